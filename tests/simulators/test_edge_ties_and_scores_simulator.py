"""Exact rounding ties and softmax with huge scores in the bit-exact NumPy models (``fp8lab.simulators``).

What is checked against what:

- ``bit_placement.float32_to_bf16_bits`` and ``activation_bits(.., 'bf16')``: float32 values whose low
  16 bits are exactly 0x8000 (a hand-derived table: even and odd mantissas, both signs, carries into
  the exponent, subnormals, the overflow tie above the largest finite BF16; and every finite BF16
  pattern with that tail) against the hand-derived codes, ``ml_dtypes.bfloat16`` and
  ``fp8lab.reference.dense.float32_to_bf16_bits``. ``float32_to_f16_bits``: exact F16 ties (normal,
  subnormal, the overflow tie 65520) against hand-derived patterns.
- The GEMM models' input rounding: ``gemm_mma`` (BF16 and F16 activations) fed float32 activations that
  are exact ties, with one-hot weights of 1.0 so each output is one rounded activation: against the
  hand-derived rounding, ``ml_dtypes`` and ``fp8lab.reference.blockwise.gemm`` on the rounded inputs;
  ``gemv_simt`` fed float64 activations halfway between float32 neighbours (rounded to float32 first).
- ``splitkv`` (the one simulator of attention; prefill is decode of expanded rows) with scores of
  magnitude 100 to 10,000 (q and k scaled up, one key far above the others, all scores equal and huge
  of both signs), float32, BF16 and FP8 caches, 1, 3 and 8 splits, decode and causal prefill rows:
  finite, within the split-kv float32 bound (``helpers.attention.tolerance``, derived in
  ``tests/simulators/test_splitkv.py``) of a float64 oracle written here (softmax with the max
  subtracted), and ``shard_partials_by_step`` (the schedule as written) bit for bit ``shard_partials``.
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.attention import prefill_rows
from helpers.edge_cases import (
    HEAD_DIM,
    SOFTMAX_SCALE,
    bf16_cases,
    check_decode_bound,
    paged_batch,
    score_cases,
    stored_values,
)

from fp8lab.reference import blockwise, dense
from fp8lab.reference import strategies as fst
from fp8lab.simulators import bit_placement, gemm_mma, gemv_simt
from fp8lab.simulators import splitkv as sk

# ---------------------------------------------------------------------------- BF16 and F16 ties

# (float32 bit pattern, BF16 pattern), by hand: a 0x8000 tail is half a BF16 ulp; the even neighbour wins.
def test_bf16_ties_hand_table():
    x, want = bf16_cases()
    for got in (bit_placement.float32_to_bf16_bits(x), bit_placement.activation_bits(x, "bf16"),
                bit_placement.float32_to_bits(x, "bf16")):
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(x.astype(ml_dtypes.bfloat16).view(np.uint16), want)


def test_every_bf16_tie_rounds_to_even():
    upper = np.arange(1 << 16, dtype=np.uint32)
    upper = upper[(upper & 0x7F80) != 0x7F80]  # exponent 0xFF with a 0x8000 tail is a NaN
    x = ((upper << 16) | 0x8000).view(np.float32)
    got = bit_placement.float32_to_bf16_bits(x)
    np.testing.assert_array_equal(got, (upper + (upper & 1)).astype(np.uint16))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(got, dense.float32_to_bf16_bits(x))  # the oracle's own helper agrees


# (value, F16 pattern), by hand: F16 has 10 mantissa bits, subnormals 2^-24 apart, largest finite 65504.
F16_TIES = [
    (1 + 2.0**-11, 0x3C00),      # between 1.0 (even) and 1 + 2^-10
    (1 + 3 * 2.0**-11, 0x3C02),  # between 1 + 2^-10 (odd) and 1 + 2^-9
    (2 - 2.0**-11, 0x4000),      # between 2 - 2^-10 (odd, 0x3BFF) and 2.0: carry into the exponent
    (2.0**-25, 0x0000),          # half the smallest subnormal: zero
    (3 * 2.0**-25, 0x0002),      # odd subnormal 0x0001: up
    (65520.0, 0x7C00),           # between 65504 (0x7BFF, odd) and 2^16: overflows to inf
    (65504.0 + 8, 0x7BFF),       # below that tie: 65504
]


def test_f16_ties_hand_table():
    x = np.array([v for v, _ in F16_TIES] + [-v for v, _ in F16_TIES], np.float32)
    want = np.array([c for _, c in F16_TIES] + [c | 0x8000 for _, c in F16_TIES], np.uint16)
    np.testing.assert_array_equal(bit_placement.float32_to_f16_bits(x), want)
    np.testing.assert_array_equal(bit_placement.activation_bits(x, "f16"), want)


# ---------------------------------------------------------------------------- the GEMMs' input rounding


def tie_activations(rng, m, k, fmt):
    """float32 ``[m, k]`` activations, every one an exact tie of ``fmt`` ('bf16' or 'f16'), both parities and
    signs, of moderate magnitude (so that the products with bit placement's ``2^-120`` stay normal), and
    the hand-derived even neighbour of each."""
    if fmt == "bf16":
        upper = rng.integers(0x3D80, 0x5D80, (m, k)).astype(np.uint32)  # BF16 exponents 2^-4 .. 2^59
        upper |= rng.integers(0, 2, (m, k)).astype(np.uint32) << 15
        even = (upper + (upper & 1)) << 16  # odd mantissa: up; even: stays
        return ((upper << 16) | 0x8000).view(np.float32), even.astype(np.uint32).view(np.float32)
    half = rng.integers(0x0400, 0x7BFF, (m, k)).astype(np.int64)  # normal F16 patterns but the largest
    half |= rng.integers(0, 2, (m, k)) << 15
    lo, hi = half.astype(np.uint16).view(np.float16), (half + 1).astype(np.uint16).view(np.float16)
    tie = ((lo.astype(np.float64) + hi.astype(np.float64)) / 2).astype(np.float32)  # exact in float32
    return tie, np.where(half & 1, hi, lo).astype(np.float32)


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_gemm_mma_rounds_tie_activations_to_even(rng, fmt):
    m, n, k = 3, 16, 128
    a, even = tie_activations(rng, m, k, fmt)
    q = np.zeros((n, k), np.uint8)
    q[np.arange(n), 7 * np.arange(n)] = 0x38  # column j reads activation 7 j with weight 1.0: out = rounded a
    scale_inv = np.ones((1, 1), np.float32)
    got = gemm_mma.gemm_mma(a, q, scale_inv, (n, k), activation=fmt)
    want = even[:, 7 * np.arange(n)]
    np.testing.assert_array_equal(got, want)
    oracle = a.astype(ml_dtypes.bfloat16).astype(np.float32) if fmt == "bf16" else a.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got, oracle[:, 7 * np.arange(n)])
    np.testing.assert_array_equal(got, blockwise.gemm(oracle, q, scale_inv, (n, k)).astype(np.float32))
    assert np.count_nonzero(got != a[:, 7 * np.arange(n)]) == got.size  # every input really was a tie


def test_gemv_simt_rounds_float64_activations_to_float32_once(rng):
    m, n, k = 2, 8, 512
    lo = (rng.standard_normal((m, k)) * 4).astype(np.float32)
    a = (lo.astype(np.float64) + np.nextafter(lo, np.float32(np.inf)).astype(np.float64)) / 2  # float32 ties
    q = np.zeros((n, k), np.uint8)
    q[np.arange(n), 60 * np.arange(n)] = 0x38
    got = gemv_simt.gemv_simt(a, q, np.ones((1, 1), np.float32), (n, k))
    want = a.astype(np.float32)[:, 60 * np.arange(n)]  # NumPy's float64 -> float32 cast is RNE
    np.testing.assert_array_equal(got, want)
    bits = want.view(np.uint32)
    assert np.all(bits & 1 == 0)  # ties round to the even float32 neighbour


# ---------------------------------------------------------------------------- split-kv with huge scores

@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_with_huge_scores(rng, fmt, num_splits):
    data = paged_batch(rng, score_cases(rng), fmt)
    got = sk.paged_decode(*data.decode_args(), num_splits=num_splits)
    check_decode_bound(data, got, [num_splits])
    # closed forms: the far key takes all the weight (the others' is exp2 of < -4000: 0); equal scores give
    # the mean of the values, at +8000 and at -8000 (a softmax without the max subtracted gives inf / inf
    # or 0 / 0 there)
    v_far = stored_values(data.v_cache, data.v_scale, data.block_tables[2], 11)[5]
    np.testing.assert_allclose(got[2], np.broadcast_to(v_far, (2, HEAD_DIM)), rtol=0, atol=2.0**-20 * np.abs(v_far).max())
    v_equal = stored_values(data.v_cache, data.v_scale, data.block_tables[3], 10)
    np.testing.assert_allclose(got[3], np.broadcast_to(v_equal.mean(axis=0), (2, HEAD_DIM)), rtol=0,
                               atol=1e-5 * np.abs(v_equal).max())
    # the vectorized model is the step-by-step schedule, bit for bit, huge scores included
    fast = sk.shard_partials(*data.decode_args(), num_splits=num_splits)
    slow = sk.shard_partials_by_step(*data.decode_args(), num_splits=num_splits)
    for name in ("m", "l", "acc"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name))
    assert np.all(np.isfinite(fast.l)) and np.all(fast.m[..., 0] > -np.inf)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_prefill_rows_with_huge_scores(rng, fmt):
    """Causal prefill is decode of one row per query token (each reading its causal prefix): the last 8
    tokens of each case's sequence as new tokens, the first ones a cached prefix."""
    cases = score_cases(rng)
    data = paged_batch(rng, cases, fmt)
    query_lens = np.full(len(cases), 8, np.int32)
    row_tables, row_lens = prefill_rows(data.block_tables, data.seq_lens, query_lens)
    q = np.concatenate([(c[1][None] * rng.uniform(0.9, 1.1, (8, 1, 1))).astype(np.float32) for c in cases])
    rows = fst.PagedKVData(q, data.k_cache, data.v_cache, data.k_scale, data.v_scale, row_tables, row_lens,
                           SOFTMAX_SCALE)
    for num_splits in (1, 2):
        check_decode_bound(rows, sk.paged_decode(*rows.decode_args(), num_splits=num_splits), [num_splits])
