"""Exact rounding ties and softmax with huge scores in the Numba CUDA kernels (run in the CUDA simulator).

What is checked against what (tiny sizes: a simulated CTA costs about 0.1 s):

- The device rounding helpers ``mathops.f32_to_bf16_bits_rne`` (inside a kernel of
  this file, outputs poisoned) and ``mathops.e4m3_encode_saturating``: float32 BF16 ties (low 16 bits
  exactly 0x8000: both parities and signs, carries into the exponent, subnormals, the overflow tie above
  the largest finite BF16; and every finite BF16 pattern with that tail) and every E4M3 midpoint
  (subnormal and normal, both parities and signs, 464 and just above) against hand-derived codes,
  ``ml_dtypes`` and the reference helpers.
- ``layers.bf16_round`` (the BF16 cast of the tensor-core GEMM's input) on the same ties.
- ``kv_cache.paged_cache_write``: an FP8 cache written from rows whose amax is 448 or ``448 * 2^k`` (scale
  exactly 1 or ``2^k``, so ``x / scale`` are exact E4M3 ties), float32 and BF16 inputs; a BF16 cache from
  float32 and float16 ties: codes and scales against ``fp8lab.reference.kv_cache.write``, hand-derived
  even codes and ``ml_dtypes``; untouched slots keep their poison. ``attention_input.qk_norm_rope_cache_write``
  (the fused k-norm, RoPE and cache write) with k = +-1 (its RMS norm is exactly 1, RoPE at position 0
  the identity), so that the k-norm weight puts exact ties into the cache, and ties in v directly.
- BF16 stores of GEMM outputs: ``fp8_gemm`` on both paths (SIMT GEMV and tensor-core GEMM) with sums
  ``X + ulp(X)/2`` computed exactly (one-hot weights 1.0, scale a power of two), and ``dequantize``
  with tie scales: against hand-derived even patterns, ``ml_dtypes`` of the simulators' float32 results.
- Attention with scores of magnitude 100 to 10,000 (q and k scaled up, one key far above the others, all
  scores equal and huge of both signs), float32, BF16 and FP8 caches: ``splitkv.paged_decode`` with 1 and 3
  splits and ``prefill.paged_prefill``: outputs (poisoned with NaN first) finite, bit for bit
  ``fp8lab.simulators.splitkv`` (the decode's workspace partials too), and within the split-kv float32
  bound (``helpers.attention.tolerance``) of a float64 oracle written here (softmax, max subtracted).
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
    e4m3_midpoints,
    every_bf16_tie,
    kernel_caches,
    paged_batch,
    stored_values,
    tie_row,
    unit,
)
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import layers, mathops
from fp8lab.numba_kernels import prefill as prefill_kernels
from fp8lab.numba_kernels import splitkv as splitkv_kernels
from fp8lab.numba_kernels.attention_input import qk_norm_rope_cache_write
from fp8lab.numba_kernels.dequantize import dequantize
from fp8lab.numba_kernels.fp8_gemm import fp8_gemm
from fp8lab.numba_kernels.kv_cache import paged_cache_write
from fp8lab.reference import blockwise, dense, e4m3, kv_cache
from fp8lab.reference import strategies as fst
from fp8lab.simulators import gemm_mma as sim_mma
from fp8lab.simulators import gemv_simt as sim_gemv
from fp8lab.simulators import splitkv as sk

pytestmark = pytest.mark.cudasim

# ---------------------------------------------------------------------------- tie data, derived by hand

# (float32 bit pattern, BF16 pattern): a 0x8000 tail is half a BF16 ulp; the even neighbour wins.
# ---------------------------------------------------------------------------- device helpers, in a kernel


@cuda.jit
def rounding_kernel(x, bf16_rne, e4m3_codes):
    i = cuda.grid(1)
    if i < x.shape[0]:
        bf16_rne[i] = mathops.f32_to_bf16_bits_rne(x[i])
        e4m3_codes[i] = mathops.e4m3_encode_saturating(x[i])


def test_device_helpers_round_bf16_ties_to_even():
    x, want = bf16_cases()
    rne = np.full(x.size, 0xFFFF, np.uint16)  # poisoned
    codes = np.full(x.size, 0xFF, np.uint8)
    rounding_kernel[1, 32](x, rne, codes)
    np.testing.assert_array_equal(rne, want)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(x.astype(ml_dtypes.bfloat16).view(np.uint16), want)
    # the same functions over every finite BF16 tie (called directly: 65280 simulated threads would be slow)
    x, want = every_bf16_tie()
    got = np.array([mathops.f32_to_bf16_bits_rne(v) for v in x], np.uint32)
    np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(want, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_device_encoder_rounds_every_e4m3_midpoint_to_even():
    x, want = e4m3_midpoints(signed=True)
    above = np.nextafter(np.float32(464), np.float32(np.inf))
    x = np.concatenate([x, [above, -above, 480.0]]).astype(np.float32)
    want = np.concatenate([want, [0x7E, 0xFE, 0x7E]]).astype(np.uint8)  # saturating: above 464 is 448
    codes = np.full(x.size, 0x7F, np.uint8)  # poisoned with the NaN code
    rne = np.full(x.size, 0xFFFF, np.uint16)
    rounding_kernel[(x.size + 127) // 128, 128](x, rne, codes)
    np.testing.assert_array_equal(codes, want)
    np.testing.assert_array_equal(codes, e4m3.encode(x, saturate=True))
    # ml_dtypes has the non-saturating policy: it agrees up to 464 and gives NaN above
    oracle = x[:-3].astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(codes[:-3], oracle)
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.all(x[-3:].astype(ml_dtypes.float8_e4m3fn).view(np.uint8) & 0x7F == 0x7F)
    np.testing.assert_array_equal(rne, dense.float32_to_bf16_bits(x))  # E4M3 midpoints are BF16 values: exact


def test_bf16_round_kernel_on_ties(rng):
    x, want = bf16_cases()
    every, every_want = every_bf16_tie()
    pick = rng.choice(every.size, 512 - x.size, replace=False)
    x, want = np.concatenate([x, every[pick]]), np.concatenate([want, every_want[pick]])
    out = np.full(x.size, 0xFFFF, np.uint16)  # poisoned (a NaN pattern no finite tie rounds to)
    layers.bf16_round(x, out)
    np.testing.assert_array_equal(out, want)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16).view(np.uint16))


# ---------------------------------------------------------------------------- KV-cache writes of exact ties


def bf16_patterns(x):
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)  # exact here: every tie row value is a BF16 value


@pytest.mark.parametrize("input_format", ["f32", "bf16"])
def test_fp8_cache_write_of_exact_ties(rng, input_format):
    rows = [tie_row(rng, 32, k) for k in (0, 0, 3, -4, -20, 0)]
    x = np.stack([r for r, _ in rows]).reshape(3, 2, 32)  # [tokens, kv heads, head_dim]
    want = np.stack([c for _, c in rows]).reshape(3, 2, 32)
    k, v = x, -x[:, ::-1]  # V: the same ties, negated, heads swapped
    shape = (3, 2, 4, 32)
    caches = [np.full(shape, 0x7F, np.uint8) for _ in range(2)]  # poisoned: NaN codes and NaN scales
    scales = [np.full(shape[:3], np.nan, np.float32) for _ in range(2)]
    slots = np.array([9, 0, 6], np.int32)
    if input_format == "bf16":
        paged_cache_write(bf16_patterns(k), bf16_patterns(v), *caches, slots, *scales)
    else:
        paged_cache_write(k, v, *caches, slots, *scales)
    ref_caches = [np.full(shape, 0x7F, np.uint8) for _ in range(2)]
    ref_scales = [np.full(shape[:3], np.nan, np.float32) for _ in range(2)]
    kv_cache.write(ref_caches[0], ref_scales[0], k, slots)
    kv_cache.write(ref_caches[1], ref_scales[1], v, slots)
    for got, ref in zip(caches + scales, ref_caches + ref_scales):
        np.testing.assert_array_equal(got, ref)  # NaN poison in the same places too
    blocks, offsets = slots // 4, slots % 4
    np.testing.assert_array_equal(caches[0][blocks, :, offsets], want)
    np.testing.assert_array_equal(caches[1][blocks, :, offsets], (want ^ 0x80)[:, ::-1])
    np.testing.assert_array_equal(scales[0][blocks, :, offsets],
                                  np.float32(2.0) ** np.array([0, 0, 3, -4, -20, 0], np.float32).reshape(3, 2))
    scaled = x / scales[0][blocks, :, offsets][..., None]
    np.testing.assert_array_equal(want, scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.count_nonzero(np.isnan(scales[0])) == 3 * 2 * 4 - 3 * 2


# float16 ties to BF16 (11 significant bits against 8), with their hand-derived BF16 patterns
F16_TIES = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-10 * (1 + 3 * 2.0**-8)] * 16, np.float16)
F16_TIES_BF16 = np.array([0x3F80, 0x3F82, 0xBF80, 0x3A82] * 16, np.uint16)


@pytest.mark.parametrize("input_format", ["f32", "f16"])
def test_bf16_cache_write_of_exact_ties(rng, input_format):
    if input_format == "f32":  # the hand table (the overflow tie included: +-inf is its BF16) and random ties
        x, want = bf16_cases()
        every, every_want = every_bf16_tie()
        pick = rng.choice(every.size, 64 - x.size, replace=False)
        k, k_want = np.concatenate([x, every[pick]]), np.concatenate([want, every_want[pick]])
        v, v_want = F16_TIES.astype(np.float32), F16_TIES_BF16
    else:
        k, k_want = F16_TIES, F16_TIES_BF16
        v, v_want = F16_TIES[::-1].copy(), F16_TIES_BF16[::-1]
    k, v = k.reshape(1, 2, 32), v.reshape(1, 2, 32)
    caches = [np.full((2, 2, 4, 32), 0xFFFF, np.uint16) for _ in range(2)]  # poisoned
    paged_cache_write(k, v, caches[0], caches[1], np.array([5], np.int32))
    np.testing.assert_array_equal(caches[0][1, :, 1], k_want.reshape(2, 32))
    np.testing.assert_array_equal(caches[1][1, :, 1], v_want.reshape(2, 32))
    with np.errstate(over="ignore"):
        for cache, x in zip(caches, (k, v)):
            np.testing.assert_array_equal(cache[1, :, 1], x[0].astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))
    untouched = np.ones((2, 2, 4), bool)
    untouched[1, :, 1] = False
    assert np.all(caches[0][untouched] == 0xFFFF) and np.all(caches[1][untouched] == 0xFFFF)


@pytest.mark.parametrize("cache_format", ["fp8", "bf16"])
def test_fused_attention_input_writes_exact_ties(rng, cache_format):
    d, tokens = 32, 2
    if cache_format == "fp8":
        rows = [tie_row(rng, d, e) for e in (0, 2, 0, -3)]
        k_weight, k_want = rows[0][0], np.stack([rows[0][1], rows[0][1]])
        v = np.stack([rows[2][0], rows[3][0]])
        v_want = np.stack([rows[2][1], rows[3][1]])
    else:
        x, want = bf16_cases()
        every, every_want = every_bf16_tie()
        ok = np.abs(x) < 1e30  # leave out the ties near overflow (the overflow tie's inf is no weight to pass)
        pick = rng.choice(every.size, 3 * d - int(ok.sum()), replace=False)
        pool = np.concatenate([x[ok], every[pick]])
        pool_want = np.concatenate([want[ok], every_want[pick]])
        k_weight, k_want = pool[:d], np.stack([pool_want[:d], pool_want[:d]])
        v, v_want = pool[d:].reshape(2, d), pool_want[d:].reshape(2, d)
    signs = np.where(rng.integers(0, 2, (tokens, d)) == 1, 1.0, -1.0).astype(np.float32)
    k = signs  # RMS of +-1 is exactly 1 (eps 2^-26 is lost in 1 + eps), so the normed k is k_norm * sign
    if cache_format == "fp8":
        k_want = np.where(signs < 0, k_want ^ 0x80, k_want)
    else:
        k_want = np.where(signs < 0, k_want ^ 0x8000, k_want)
    q = rng.standard_normal((tokens, d)).astype(np.float32)
    q_out = np.full((tokens, 1, d), np.nan, np.float32)
    positions = np.zeros(tokens, np.int32)  # RoPE at position 0: cos 1, sin 0, the identity
    cos_sin = layers.rope_table(4, d, 1e6)
    shape = (2, 1, 4, d)
    if cache_format == "fp8":
        caches = [np.full(shape, 0x7F, np.uint8) for _ in range(2)]
        scales = [np.full(shape[:3], np.nan, np.float32) for _ in range(2)]
    else:
        caches, scales = [np.full(shape, 0xFFFF, np.uint16) for _ in range(2)], [None, None]
    slots = np.array([6, 1], np.int32)
    qk_norm_rope_cache_write(q, k, v, q_out, np.ones(d, np.float32), k_weight, 2.0**-26, positions, cos_sin,
                             caches[0], caches[1], slots, scales[0], scales[1])
    assert np.all(np.isfinite(q_out))
    blocks, offsets = slots // 4, slots % 4
    np.testing.assert_array_equal(caches[0][blocks, 0, offsets], k_want)
    np.testing.assert_array_equal(caches[1][blocks, 0, offsets], v_want)
    stored_k = k_weight * signs  # what the k-norm and RoPE give, exactly
    if cache_format == "fp8":
        np.testing.assert_array_equal(scales[0][blocks, 0, offsets], [1.0, 1.0])
        np.testing.assert_array_equal(scales[1][blocks, 0, offsets], [1.0, 2.0**-3])
        ref, ref_scales = np.full(shape, 0x7F, np.uint8), np.full(shape[:3], np.nan, np.float32)
        kv_cache.write(ref, ref_scales, stored_k[:, None], slots)
        np.testing.assert_array_equal(caches[0], ref)
        np.testing.assert_array_equal(scales[0], ref_scales)
    else:
        np.testing.assert_array_equal(caches[0][blocks, 0, offsets], stored_k.astype(ml_dtypes.bfloat16).view(np.uint16))
        np.testing.assert_array_equal(caches[1][blocks, 0, offsets], v.astype(ml_dtypes.bfloat16).view(np.uint16))


# ---------------------------------------------------------------------------- BF16 stores of GEMM outputs


def gemm_ties(rng, m, n, k):
    """BF16 activations and one-hot weights 1.0 for ``out[i, j] = X + h`` with ``X`` a random BF16 value
    (both parities and signs, moderate magnitude) and ``h`` exactly half its BF16 ulp (a power of two):
    an exact float32 sum and an exact BF16 tie. Returns ``(a_bits, q, X + h, hand-derived BF16 bits)``."""
    upper = rng.integers(0x3D80, 0x4D80, (m, n)).astype(np.uint32)  # 2^-4 .. 2^28
    upper[0, :4] = [0x3F80, 0x3F81, 0x3FFF, 0x3F7F]  # even, odd, carry into the exponent (twice)
    upper |= rng.integers(0, 2, (m, n)).astype(np.uint32) << 15
    big = (upper << 16).view(np.float32)
    half = np.copysign(np.ldexp(np.float32(1), ((upper >> 7) & 0xFF).astype(np.int32) - 127 - 8), big)
    a = np.zeros((m, k), np.float32)
    a[:, 2 * np.arange(n)] = big
    a[:, 2 * np.arange(n) + 1] = half.astype(np.float32)
    q = np.zeros((n, k), np.uint8)
    q[np.arange(n), 2 * np.arange(n)] = 0x38  # 1.0
    q[np.arange(n), 2 * np.arange(n) + 1] = 0x38
    a_bits = (a.view(np.uint32) >> 16).astype(np.uint16)  # exact: every entry is a BF16 value
    return a_bits, q, big.astype(np.float64) + half, (upper + (upper & 1)).astype(np.uint16)


@pytest.mark.parametrize("path, m", [("simt", 2), ("mma", 5)])
def test_gemm_bf16_output_ties(rng, path, m):
    n, k = 16, 128
    a_bits, q, exact, want = gemm_ties(rng, m, n, k)
    scale_inv = np.full((1, 1), 2.0, np.float32)  # a power of two keeps the ties ties
    want = want + np.uint16(0x80)  # times 2: one more in the exponent field (bit 7 up)
    out = np.full((m, n), 0xFFFF, np.uint16)  # poisoned
    fp8_gemm(a_bits, q, scale_inv, out, block=(n, k), path=path)
    np.testing.assert_array_equal(out, want)
    a = (a_bits.astype(np.uint32) << 16).view(np.float32)
    sim = sim_gemv.gemv_simt(a, q, scale_inv, (n, k)) if path == "simt" else sim_mma.gemm_mma(a_bits, q, scale_inv, (n, k))
    np.testing.assert_array_equal(sim, (2 * exact).astype(np.float32))  # the float32 result is the exact tie
    np.testing.assert_array_equal(out, sim.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_dequantize_bf16_output_ties(rng):
    n, k, block = 8, 16, (2, 4)
    upper = rng.integers(0x3D80, 0x4D80, (4, 4)).astype(np.uint32)
    upper[0, :3] = [0x3F80, 0x3F81, 0x3FFF]
    scale_inv = ((upper << 16) | 0x8000).view(np.float32)  # every scale an exact BF16 tie
    q = rng.choice(np.array([0x38, 0xB8, 0x30, 0x40, 0xC8], np.uint8), (n, k))  # +-1, 0.5, 2, -4: powers of two
    out = np.full((n, k), 0xFFFF, np.uint16)
    dequantize(q, scale_inv, out, block)
    product = blockwise.dequantize(q, scale_inv, block)  # one float32 product: exact, still a tie
    want = ((product.view(np.uint32) >> 16) + ((product.view(np.uint32) >> 16) & 1)).astype(np.uint16)
    assert np.all(product.view(np.uint32) & 0xFFFF == 0x8000)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out, product.astype(ml_dtypes.bfloat16).view(np.uint16))


# ---------------------------------------------------------------------------- attention with huge scores


def score_cases(rng):
    """Per sequence ``(name, q[2, D], k[L, 1, D], v[L, 1, D])``, float32, scores of 100 to 10,000 (few sequences:
    simulated CTAs are slow, so the scaled case has both magnitudes, one per query head)."""
    q = rng.standard_normal((2, HEAD_DIM))
    k = rng.standard_normal((13, 1, HEAD_DIM)) * 30  # k scaled up, then each head's q to its largest score
    q *= (np.array([100.0, 1e4]) / np.abs(SOFTMAX_SCALE * q @ k[:, 0].T).max(axis=1))[:, None]
    cases = [("scaled_100_and_10000", q, k, rng.standard_normal((13, 1, HEAD_DIM)))]
    u = unit(rng)  # one key far above the others: theirs ~ +-20, key 5's ~ +5000
    k = rng.standard_normal((11, 1, HEAD_DIM))
    k[5, 0] = 1000 * u
    cases.append(("one_far_key", 30 * u + rng.standard_normal((2, HEAD_DIM)), k,
                  rng.standard_normal((11, 1, HEAD_DIM))))
    u = unit(rng)  # all scores equal and huge: one key repeated, +8000 for head 0, -8000 for head 1
    cases.append(("equal_huge", np.stack([100 * u, -100 * u]), np.broadcast_to(80 * u * np.sqrt(HEAD_DIM), (10, 1, HEAD_DIM)),
                  rng.standard_normal((10, 1, HEAD_DIM))))
    return [(n, q.astype(np.float32), np.ascontiguousarray(k, np.float32), v.astype(np.float32))
            for n, q, k, v in cases]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_paged_decode_with_huge_scores(rng, fmt):
    data = paged_batch(rng, score_cases(rng), fmt)
    k_cache, v_cache = kernel_caches(data, fmt)
    largest = [np.abs(SOFTMAX_SCALE * data.q[i].astype(np.float64)
                      @ stored_values(data.k_cache, data.k_scale, data.block_tables[i], int(n)).T).max(axis=1)
               for i, n in enumerate(data.seq_lens)]
    assert largest[0][0] > 90 and largest[0][1] > 9000 and min(largest[1]) > 4000 and min(largest[2]) > 7000
    for num_splits in (1, 3):
        out = np.full(data.q.shape, np.nan, np.float32)  # poisoned: every element must be written
        workspace = np.full(data.q.shape[:2] + (num_splits, HEAD_DIM + 2), np.nan, np.float32)
        splitkv_kernels.paged_decode(data.q, k_cache, v_cache, data.block_tables, data.seq_lens, SOFTMAX_SCALE, out,
                                     data.k_scale, data.v_scale, num_splits=num_splits, workspace=workspace)
        expected = sk.paged_decode(*data.decode_args(), num_splits=num_splits)
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
        if num_splits > 1:
            partials = sk.shard_partials(*data.decode_args(), num_splits=num_splits)
            np.testing.assert_array_equal(workspace[..., :HEAD_DIM], partials.acc)
            np.testing.assert_array_equal(workspace[..., HEAD_DIM], partials.m)
            np.testing.assert_array_equal(workspace[..., HEAD_DIM + 1], partials.l)
        check_decode_bound(data, out, [num_splits])
        # the far key takes all the weight; equal scores (+8000 and -8000) give the mean of the values
        v_far = stored_values(data.v_cache, data.v_scale, data.block_tables[1], 11)[5]
        np.testing.assert_allclose(out[1], np.broadcast_to(v_far, out[1].shape), rtol=0, atol=2.0**-20 * np.abs(v_far).max())
        v_equal = stored_values(data.v_cache, data.v_scale, data.block_tables[2], 10)
        np.testing.assert_allclose(out[2], np.broadcast_to(v_equal.mean(axis=0), out[2].shape), rtol=0,
                                   atol=1e-5 * np.abs(v_equal).max())


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_paged_prefill_with_huge_scores(rng, fmt):
    """The last tokens of each case's sequence are new (2, 1, 1; the rest a cached prefix): bit for bit the
    simulator on the rows expanded by hand, within the bound of the float64 oracle. Blocks of 8 tokens keep
    the "auto" split count (at most the blocks of a row) and so the simulated CTAs few."""
    cases = score_cases(rng)
    data = paged_batch(rng, cases, fmt, block_size=8)
    k_cache, v_cache = kernel_caches(data, fmt)
    query_lens = np.array([2, 1, 1], np.int32)
    q = np.concatenate([(c[1][None] * rng.uniform(0.9, 1.1, (n, 1, 1))).astype(np.float32)
                        for c, n in zip(cases, query_lens)])
    out = np.full(q.shape, np.nan, np.float32)
    prefill_kernels.paged_prefill(q, k_cache, v_cache, data.block_tables, data.seq_lens, query_lens, SOFTMAX_SCALE,
                                  out, data.k_scale, data.v_scale)
    row_tables, row_lens = prefill_rows(data.block_tables, data.seq_lens, query_lens)
    rows = fst.PagedKVData(q, data.k_cache, data.v_cache, data.k_scale, data.v_scale, row_tables, row_lens,
                           SOFTMAX_SCALE)
    expected = sk.paged_decode(*rows.decode_args())  # "auto": the kernel's rule on these rows
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    check_decode_bound(rows, out, range(1, 9))  # whatever "auto" chose: at most 8 splits per head
