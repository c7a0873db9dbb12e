"""Exact rounding ties and softmax with huge scores in the NumPy oracles (``fp8lab.reference``).

Random data almost never lands on an exact tie, so a round-half-up (or half-away) bug passes
where round-to-nearest-even is required; softmax without the max subtraction only overflows at
large scores. What is checked against what:

- BF16 (``dense.float32_to_bf16_bits``, ``dense.round_to_bf16``): float32 inputs whose low 16 bits
  are exactly 0x8000, against a hand-derived table (even and odd BF16 mantissa above, both signs,
  ties that carry into the exponent, subnormal ties, the tie above the largest finite BF16, which
  overflows to infinity) and, for every finite BF16 pattern with a 0x8000 tail, against
  ``upper + (upper & 1)`` and ``ml_dtypes.bfloat16``; the neighbours one ulp above and below each
  tie round away from it.
- E4M3 (``e4m3.encode``, ``e4m3.round_trip``): every exact midpoint between adjacent E4M3 values
  (subnormal, normal, the subnormal/normal seam, both parities, both signs) against the even code
  of the pair and ``ml_dtypes.float8_e4m3fn``, in every input dtype that holds the midpoint exactly;
  464 (the midpoint of 448 and the would-be 480) and the value just above it under both overflow
  policies; a hand-derived table.
- The quantizers that divide by a scale first (``kv_cache.quantize_kv`` / ``kv_cache.write``,
  ``blockwise.quantize``, ``blockwise.quantize_activations``): rows whose amax is 448 (scale exactly 1)
  or ``448 * 2^k`` (scale ``2^k``), so the scaled values are exact ties; codes against the hand-derived
  even codes and ``ml_dtypes``.
- Attention (``attention.paged_decode`` and ``attention.prefill``) with scores of magnitude 100 to
  10,000 (q and k scaled up, one key far above the others, all scores equal and huge, of both signs),
  float32, BF16 and FP8 caches: finite, and within float32 rounding of a float64 oracle written here
  (softmax with the max subtracted, over the values the cache stores, decoded with ``ml_dtypes``).
"""

import ml_dtypes
import numpy as np
import pytest
from helpers.edge_cases import (
    BF16_OVERFLOWING_TIE,
    BF16_TIES,
    HEAD_DIM,
    SOFTMAX_SCALE,
    bf16_cases,
    e4m3_midpoints,
    every_bf16_tie,
    score_cases,
    tie_row,
)

from fp8lab.reference import attention, blockwise, dense, e4m3, kv_cache

# ---------------------------------------------------------------------------- BF16 ties

def test_bf16_ties_match_the_hand_table_and_ml_dtypes():
    x, want = bf16_cases()
    got = dense.float32_to_bf16_bits(x)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(x.astype(ml_dtypes.bfloat16).view(np.uint16), want)
    np.testing.assert_array_equal(dense.round_to_bf16(x).view(np.uint32), want.astype(np.uint32) << 16)
    overflow = BF16_OVERFLOWING_TIE
    assert np.isposinf(dense.round_to_bf16(x)[overflow]) and np.isneginf(dense.round_to_bf16(x)[len(BF16_TIES) + overflow])


def test_every_bf16_tie_rounds_to_even():
    x, want = every_bf16_tie()  # odd mantissa: up; even: stays
    assert x.size == 2 * (65536 // 2 - 128)  # 65280 ties, none a NaN
    upper = (x.view(np.uint32) >> 16).astype(np.uint16)
    got = dense.float32_to_bf16_bits(x)
    np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    # half the results are odd inputs that moved: a round-half-down helper would fail on those
    assert np.count_nonzero(got != upper) == np.count_nonzero(upper & 1)


def test_float16_ties_to_bf16():
    # float16 has 11 significant bits, BF16 8: 1 + 2^-8 and 1 + 3 * 2^-8 are exact float16 ties
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-14 * (1 + 2.0**-8)], np.float16)
    want = np.array([0x3F80, 0x3F82, 0xBF80, 0x3880], np.uint16)
    np.testing.assert_array_equal(dense.float32_to_bf16_bits(x), want)
    np.testing.assert_array_equal(x.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16), want)


# ---------------------------------------------------------------------------- E4M3 ties

# (value, code), derived by hand from the format: the two neighbours and the even one among them.
E4M3_TIES = [
    (2.0**-10, 0x00),      # half the smallest subnormal 2^-9: zero
    (3 * 2.0**-10, 0x02),  # between 1 and 2 * 2^-9: the even 0x02
    (5 * 2.0**-10, 0x02),  # between 2 and 3 * 2^-9: 0x02 again (0x03 is odd)
    (7 * 2.0**-10, 0x04),
    (15 * 2.0**-10, 0x08),  # between the largest subnormal 7 * 2^-9 (0x07) and 2^-6 (0x08)
    (17 * 2.0**-10, 0x08),  # between 2^-6 (0x08) and 9 * 2^-9 (0x09)
    (1.0625, 0x38),        # between 1.0 (0x38) and 1.125 (0x39)
    (1.1875, 0x3A),        # between 1.125 (0x39) and 1.25 (0x3A)
    (1.9375, 0x40),        # between 1.875 (0x3F) and 2.0 (0x40): carries into the exponent
    (17.0, 0x58),          # between 16 (0x58) and 18 (0x59)
    (400.0, 0x7C),         # between 384 (0x7C) and 416 (0x7D)
    (432.0, 0x7E),         # between 416 (0x7D) and 448 (0x7E)
    (464.0, 0x7E),         # between 448 and the would-be 480 (0x7F is NaN): 448 even, no overflow
]


TIE_DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.longdouble]


def test_e4m3_hand_table():
    x = np.array([v for v, _ in E4M3_TIES])
    want = np.array([c for _, c in E4M3_TIES], np.uint8)
    for saturate in (True, False):  # no tie is above 464, so the overflow policy never applies
        np.testing.assert_array_equal(e4m3.encode(x, saturate=saturate), want)
        np.testing.assert_array_equal(e4m3.encode(-x, saturate=saturate), want | 0x80)
    np.testing.assert_array_equal(x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8), want)


@pytest.mark.parametrize("dtype", TIE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_e4m3_midpoint_rounds_to_even_in_every_dtype(dtype):
    mid, want = e4m3_midpoints()
    x = np.concatenate([mid, -mid]).astype(dtype)
    assert np.all(x.astype(np.float64) == np.concatenate([mid, -mid]))  # the midpoints are exact in dtype
    want = np.concatenate([want, want | 0x80])
    got = e4m3.encode(x, saturate=True)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(e4m3.encode(x, saturate=False), want)
    np.testing.assert_array_equal(got, x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    # the round trip lands on the even neighbour, never on the midpoint itself
    np.testing.assert_array_equal(e4m3.round_trip(x), e4m3.VALUES[want])


def test_464_and_above_under_both_overflow_policies():
    above = float(np.nextafter(np.float32(464), np.float32(np.inf)))
    x = np.array([464.0, above, 480.0, -464.0, -above], np.float32)
    np.testing.assert_array_equal(e4m3.encode(x, saturate=True), [0x7E, 0x7E, 0x7E, 0xFE, 0xFE])
    np.testing.assert_array_equal(e4m3.encode(x, saturate=False), [0x7E, 0x7F, 0x7F, 0xFE, 0xFF])
    with np.errstate(invalid="ignore", over="ignore"):
        oracle = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    # ml_dtypes gives NaN on overflow (saturate=False's policy); its NaN sign bit need not match
    np.testing.assert_array_equal(oracle[[0, 3]], [0x7E, 0xFE])
    assert np.all(oracle[[1, 2, 4]] & 0x7F == 0x7F)
    # a hair above 464 in long double, below float32's resolution: rounded once, it overflows
    hair = np.longdouble(464) + np.longdouble(2.0) ** -40
    if hair != np.longdouble(464):
        assert e4m3.encode(np.array([hair]), saturate=False)[0] == 0x7F
        assert e4m3.encode(np.array([hair]), saturate=True)[0] == 0x7E


# ---------------------------------------------------------------------------- quantizers that divide by a scale


@pytest.mark.parametrize("scale_exponent", [0, 3, -5, -20])
def test_kv_quantize_and_write_of_exact_ties(rng, scale_exponent):
    rows = [tie_row(rng, 32, scale_exponent) for _ in range(6)]
    x = np.stack([r for r, _ in rows]).reshape(3, 2, 32)  # [tokens, kv heads, head_dim]
    want = np.stack([c for _, c in rows]).reshape(3, 2, 32)
    codes, scales = kv_cache.quantize_kv(x)
    np.testing.assert_array_equal(scales, np.float32(2.0**scale_exponent))
    np.testing.assert_array_equal(codes, want)
    oracle = (x.astype(np.float64) / 2.0**scale_exponent).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(codes, oracle.view(np.uint8))
    # the paged write stores the same codes and scales; untouched slots keep their poison
    cache = np.full((2, 2, 4, 32), 0x7F, np.uint8)
    cache_scales = np.full((2, 2, 4), np.nan, np.float32)
    slots = np.array([5, 0, 3])
    kv_cache.write(cache, cache_scales, x, slots)
    for t, slot in enumerate(slots):
        np.testing.assert_array_equal(cache[slot // 4, :, slot % 4], want[t])
        np.testing.assert_array_equal(cache_scales[slot // 4, :, slot % 4], np.float32(2.0**scale_exponent))
    assert np.count_nonzero(np.isnan(cache_scales)) == 2 * 2 * 4 - 3 * 2


def test_blockwise_weight_and_activation_quantizers_round_ties_to_even(rng):
    rows = [tie_row(rng, 16, k) for k in (0, 0, 2, 2)]  # two blocks of [2, 16]: scales 1 and 4
    w = np.stack([r for r, _ in rows])
    want = np.stack([c for _, c in rows])
    q, scale_inv = blockwise.quantize(w, (2, 16))
    np.testing.assert_array_equal(scale_inv, [[1.0], [4.0]])
    np.testing.assert_array_equal(q, want)
    a_q, a_scales = blockwise.quantize_activations(w, group=16)  # per row: scales 1, 1, 4, 4
    np.testing.assert_array_equal(a_scales[:, 0], [1.0, 1.0, 4.0, 4.0])
    np.testing.assert_array_equal(a_q, want)
    scaled = (w / np.array([[1.0], [1.0], [4.0], [4.0]], np.float32)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q, scaled.view(np.uint8))


# ---------------------------------------------------------------------------- attention with huge scores

def oracle(q, k, v):
    """float64 softmax attention with the max subtracted: ``q[H, D]`` over ``k, v[L, D]`` (one kv head)."""
    s = SOFTMAX_SCALE * (q.astype(np.float64) @ k.astype(np.float64).T)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return (w @ v.astype(np.float64)) / w.sum(axis=1, keepdims=True)


def stored(x, fmt):
    """What a NumPy cache of ``fmt`` holds for ``x`` (the float cache's entries), and its values in float64
    decoded independently of fp8lab (``ml_dtypes``)."""
    if fmt == "fp32":
        return x, None, x.astype(np.float64)
    if fmt == "bf16":
        b = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        return b, None, b.astype(np.float64)
    codes, scales = kv_cache.quantize_kv(x)
    # the contract's dequantized value: the float32 product decode(code) * scale
    return codes, scales, (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * scales[..., None]).astype(np.float64)


def paged_batch(rng, cases, fmt, block_size=4):
    """The cases' K/V in one paged cache of ``fmt`` over shuffled blocks (unused slots NaN-poisoned)."""
    lens = np.array([k.shape[0] for _, _, k, _ in cases])
    blocks = -(-lens // block_size)
    num_blocks = int(blocks.sum()) + 2
    pool = rng.permutation(num_blocks)
    tables = np.full((len(cases), int(blocks.max())), -1, np.int32)
    fp8 = fmt == "fp8"
    shape = (num_blocks, 1, block_size, HEAD_DIM)
    caches = [np.full(shape, 0x7F, np.uint8) if fp8 else np.full(shape, np.nan, np.float32) for _ in range(2)]
    scales = [np.full(shape[:3], np.nan, np.float32) if fp8 else None for _ in range(2)]
    values, start = [], 0
    for i, (_, _, k, v) in enumerate(cases):
        tables[i, : blocks[i]] = pool[start : start + blocks[i]]
        start += blocks[i]
        slots = kv_cache.slots_for_positions(tables[i], np.arange(lens[i]), block_size)
        kv = []
        for c, s, x in zip(caches, scales, (k, v)):
            entries, _, decoded = stored(x, fmt)
            kv_cache.write(c, s, entries if not fp8 else x, slots)
            kv.append(decoded[:, 0])
        values.append(kv)
    return caches, scales, tables, lens, values


def float32_bound(expected, v):
    """The reference computes in float64 and rounds once: half a float32 ulp of the result, plus far less
    than a float32 ulp for its float64 work (relative error of the weights ~ |s| D 2^-53 ~ 1e-10)."""
    return 2.0**-24 * np.abs(expected) + 1e-9 * np.max(np.abs(v))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_paged_decode_with_huge_scores(rng, fmt):
    cases = score_cases(rng)
    (k_cache, v_cache), (k_scale, v_scale), tables, lens, values = paged_batch(rng, cases, fmt)
    q = np.stack([c[1] for c in cases])
    got = attention.paged_decode(q, k_cache, v_cache, tables, lens, SOFTMAX_SCALE, k_scale, v_scale)
    assert np.all(np.isfinite(got))
    for i, (name, qi, _, _) in enumerate(cases):
        k, v = values[i]
        scores = SOFTMAX_SCALE * qi.astype(np.float64) @ k.T
        assert np.abs(scores).max() > 90, (name, np.abs(scores).max())  # the scores really are huge
        expected = oracle(qi, k, v)
        assert np.all(np.abs(got[i] - expected) <= float32_bound(expected, v)), name
        if name == "equal_huge":  # uniform weights: the mean of the values, for +8000 and -8000 alike
            assert np.abs(scores).min() > 7000 and np.all(np.ptp(scores, axis=1) <= 1e-9 * 8000)  # (BLAS: last bits)
            np.testing.assert_allclose(got[i], np.broadcast_to(v.mean(axis=0), got[i].shape), rtol=1e-6, atol=1e-6)
        if name == "one_far_key":  # the far key takes all the weight (the others' is below exp(-4000))
            assert np.all(scores[:, 5] - np.delete(scores, 5, axis=1).max(axis=1) > 3000)
            np.testing.assert_array_equal(got[i], np.broadcast_to(v[5].astype(np.float32), got[i].shape))


def causal_oracle(q, k, v):
    """float64 causal prefill: ``q[T, H, D]`` over ``k, v[S, D]``, query ``t`` reads keys ``0 .. S - T + t``."""
    t, s = q.shape[0], k.shape[0]
    return np.stack([oracle(q[i], k[: s - t + i + 1], v[: s - t + i + 1]) for i in range(t)])


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_prefill_with_huge_scores(rng, fmt):
    for name, q1, k, v in score_cases(rng):
        length = k.shape[0]
        t = length - 3  # chunked: the first 3 keys are an earlier prefix
        # every query is its case's query, perturbed per row (the equal case stays equal: keys are identical)
        q = (q1[None] * rng.uniform(0.9, 1.1, (t, 1, 1))).astype(np.float32)
        _, _, k_values = stored(k, fmt)
        _, _, v_values = stored(v, fmt)
        got = attention.prefill(q, k_values.astype(np.float32), v_values.astype(np.float32), SOFTMAX_SCALE)
        assert np.all(np.isfinite(got)), name
        expected = causal_oracle(q, k_values[:, 0], v_values[:, 0])
        assert np.all(np.abs(got - expected) <= float32_bound(expected, v_values)), name
