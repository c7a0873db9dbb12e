"""fp8lab.numba_kernels.gemv_mma, the tensor-core decode GEMV (weights as the mma's m16 operand).

- In the CUDA simulator: bit for bit ``fp8lab.simulators.gemv_mma`` (every k slicing, uneven and empty slices,
  1 to 32 rows, so one to four batch tiles, BF16 and float32 activations (float32 up to 16 rows), per-8-row
  scale blocks, SwiGLU),
  outputs NaN-poisoned first; a float32 call is ``bf16_round`` + a BF16 call bit for bit; a BF16 output is the
  float32 output then ``bf16_round``; a NaN activation gives NaN in its row only; bad calls raise ``ValueError``
  before any launch.
- On a GPU (``gpu``): Qwen3-8B sizes against ``fp8lab.reference.blockwise.gemm`` within the GPU error budget of
  ``fp8lab.simulators.gemm_mma``, and bit for bit the simulator where every sum is exact (integer values,
  power-of-two scales), so the HMMA's own rounding cannot differ.
"""

from __future__ import annotations

import numpy as np
import pytest

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels.gemv_mma import (
    default_column_tiles,
    default_depth,
    default_k_slices,
    gemv_mma,
    gemv_mma_bf16,
    gemv_mma_swiglu,
    resident_ctas,
)
from fp8lab.reference import blockwise, e4m3
from fp8lab.reference import strategies as fst
from fp8lab.simulators import bit_placement
from fp8lab.simulators import gemv_mma as model

CODES = np.array(fst.NON_NAN_CODES, dtype=np.uint8)
INTEGER_CODES = np.array([c for c in fst.NON_NAN_CODES if float(e4m3.VALUES[c]).is_integer() and abs(e4m3.VALUES[c]) <= 8],
                         dtype=np.uint8)


def bits(x):
    return np.asarray(x).view(np.uint32)


def problem(rng, m, n, k, block):
    q = rng.choice(CODES, (n, k))
    a = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-3, 4, (m, 1)))).astype(np.float32)
    scales = rng.uniform(2.0**-9, 2.0**-6, (-(-n // block[0]), k // block[1])).astype(np.float32)
    return a, q, scales


@pytest.mark.parametrize("m, n, k, block, k_slices, activation", [
    (1, 16, 128, (128, 128), 1, "f32"),
    (3, 32, 640, (16, 128), 4, "f32"),   # 5 chunks over 4 warps: slices of 2, 2, 1, 0
    (8, 32, 384, (8, 128), 2, "bf16"),   # a scale block per 8 rows: a lane's two rows differ
    (5, 48, 512, (16, 256), 8, "bf16"),  # more warps than chunks
    (2, 16, 1152, (16, 128), 2, "f32"),  # 9 chunks: 5 and 4 per warp, rings of 1 to 4 (below)
    (16, 32, 384, (8, 128), 2, "bf16"),  # two batch tiles, both full
    (11, 16, 640, (16, 128), 4, "f32"),  # a second batch tile of 3 rows
    (21, 16, 384, (16, 128), 2, "bf16"),  # three batch tiles, the last of 5 rows
    (32, 32, 256, (8, 128), 1, "bf16"),  # four full batch tiles
])
def test_matches_the_simulator_bit_for_bit(rng, m, n, k, block, k_slices, activation):
    a, q, scales = problem(rng, m, n, k, block)
    x = a if activation == "f32" else bit_placement.float32_to_bf16_bits(a)
    out = np.full((m, n), np.nan, np.float32)
    gemv_mma(x, q, scales, out, block, k_slices=k_slices)
    np.testing.assert_array_equal(bits(out), bits(model.gemv_mma(a, q, scales, block, k_slices=k_slices)))


@pytest.mark.parametrize("m, n, k, block, k_slices, depth, activation", [
    (3, 64, 640, (8, 128), 4, 2, "f32"),  # two CTAs of two column tiles, a scale per 8 rows, uneven slices
    (27, 32, 384, (16, 128), 2, 1, "bf16"),  # four batch tiles, the last of 3 rows, on both column tiles
])
def test_two_column_tiles_give_the_simulators_bits(rng, m, n, k, block, k_slices, depth, activation):
    """Two tiles of 16 weight rows per CTA on the same activation registers: every output's order is that of one
    tile per CTA, so the simulator's bits."""
    a, q, scales = problem(rng, m, n, k, block)
    x = a if activation == "f32" else bit_placement.float32_to_bf16_bits(a)
    out = np.full((m, n), np.nan, np.float32)
    gemv_mma(x, q, scales, out, block, k_slices=k_slices, depth=depth, column_tiles=2)
    np.testing.assert_array_equal(bits(out), bits(model.gemv_mma(a, q, scales, block, k_slices=k_slices)))


def test_two_column_tiles_with_swiglu_give_the_simulators_bits(rng):
    a, q, scales = problem(rng, 12, 64, 256, (8, 128))  # I = 32: two CTAs of two 8-output tiles
    x = bit_placement.float32_to_bf16_bits(a)
    out = np.full((12, 32), np.nan, np.float32)
    gemv_mma_swiglu(x, q, scales, out, (8, 128), k_slices=2, column_tiles=2)
    np.testing.assert_array_equal(bits(out), bits(model.gemv_mma_swiglu(a, q, scales, (8, 128), k_slices=2)))


@pytest.mark.parametrize("depth, m", [(1, 3), (2, 3), (3, 3), (4, 3), (3, 13), (2, 27)])
def test_every_ring_depth_gives_the_simulators_bits(rng, depth, m):
    a, q, scales = problem(rng, m, 16, 1152, (16, 128))  # 9 chunks: 5 and 4 per warp, partial rounds of the ring
    out = np.full((m, 16), np.nan, np.float32)
    x = a if m <= 16 else bit_placement.float32_to_bf16_bits(a)  # float32 in: at most 16 rows
    gemv_mma(x, q, scales, out, (16, 128), k_slices=2, depth=depth)
    np.testing.assert_array_equal(bits(out), bits(model.gemv_mma(a, q, scales, (16, 128), k_slices=2)))


@pytest.mark.parametrize("swiglu, m", [(False, 4), (True, 10)])
def test_a_bf16_output_is_the_float32_output_rounded(rng, swiglu, m):
    """A uint16 ``out`` holds ``bf16_round`` of what a float32 ``out`` holds (the input format of the next GEMM,
    without a launch of its own); NaN stays NaN."""
    a, q, scales = problem(rng, m, 32, 256, (16, 128))
    a[1, 7] = np.nan
    kernel, width = (gemv_mma_swiglu, 16) if swiglu else (gemv_mma, 32)
    as_f32 = np.full((m, width), np.nan, np.float32)
    as_bf16 = np.full((m, width), 0x1234, np.uint16)  # poison: a finite pattern, so a missed store shows
    kernel(a, q, scales, as_f32, (16, 128), k_slices=2)
    kernel(a, q, scales, as_bf16, (16, 128), k_slices=2)
    np.testing.assert_array_equal(as_bf16, bit_placement.float32_to_bf16_bits(as_f32))
    assert np.all(np.isnan(bit_placement.bf16_bits_to_float32(as_bf16[1])))


def test_float32_activations_are_bf16_rounded_on_load(rng):
    a, q, scales = problem(rng, 2, 16, 256, (16, 128))
    a[0, :5] = [3.0e38, -3.4e38, 1e-40, -0.0, 1.0 + 2.0**-8]  # overflow to inf, subnormal, -0, a tie
    from_f32 = np.full((2, 16), np.nan, np.float32)
    from_bf16 = np.full((2, 16), np.nan, np.float32)
    gemv_mma(a, q, scales, from_f32, (16, 128), k_slices=2)
    gemv_mma(bit_placement.float32_to_bf16_bits(a), q, scales, from_bf16, (16, 128), k_slices=2)
    np.testing.assert_array_equal(bits(from_f32), bits(from_bf16))


@pytest.mark.parametrize("m", [3, 30])
def test_swiglu_matches_the_simulator_and_a_nan_stays_in_its_row(rng, m):
    a, q, scales = problem(rng, m, 32, 256, (16, 128))
    a[1, 100] = np.nan
    x = a if m <= 16 else bit_placement.float32_to_bf16_bits(a)  # float32 in: at most 16 rows
    out = np.full((m, 16), np.nan, np.float32)
    gemv_mma_swiglu(x, q, scales, out, (16, 128), k_slices=2)
    np.testing.assert_array_equal(bits(out), bits(model.gemv_mma_swiglu(a, q, scales, (16, 128), k_slices=2)))
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(np.delete(out, 1, axis=0)))


@pytest.mark.parametrize("change, message", [
    (dict(a=np.ones((17, 128), np.float32), out=np.zeros((17, 16), np.float32)),
     "^a: gemv_mma takes 1 to 16 rows of f32 activations"),
    (dict(a=np.ones((33, 128), np.uint16), out=np.zeros((33, 16), np.float32)),
     "^a: gemv_mma takes 1 to 32 rows of bf16 activations"),
    (dict(q=np.zeros((24, 128), np.uint8), out=np.zeros((2, 24), np.float32), scale_inv=np.ones((1, 1), np.float32)),
     "^q: gemv_mma needs N to be a positive multiple of 16"),
    (dict(out=np.zeros((2, 16), np.float16)), "^out: gemv_mma writes float32 or uint16"),
    (dict(k_slices=3), "^k_slices: expected one of"),
    (dict(depth=5), "^depth: expected one of"),
    (dict(column_tiles=3), "^column_tiles: expected one of"),
    (dict(column_tiles=2), "^column_tiles: 2 tiles per CTA need N to be a multiple of 32, got N = 16"),
    (dict(a=np.ones((2, 128), np.float16)), "^a: expected activations"),
])
def test_bad_calls_raise_before_launching(change, message):
    args = dict(a=np.ones((2, 128), np.float32), q=np.zeros((16, 128), np.uint8), scale_inv=np.ones((1, 1), np.float32),
                out=np.zeros((2, 16), np.float32), block=(128, 128)) | change
    with pytest.raises(ValueError, match=message):
        gemv_mma(**args)



@pytest.mark.parametrize("n, k, swiglu, depths", [
    # (depth at up to 8 rows, at 9 to 16 rows) on 132 SMs, the fastest measured on an H200 (bench/RESULTS.md)
    (6144, 4096, False, (3, 2)),   # Qwen3-8B q/k/v: 384 CTAs of 4 warps, 3 per SM at 144 registers
    (4096, 4096, False, (2, 1)),   # 8B o: 256 CTAs of 8 warps; two batch tiles need 102 registers to fit 2 per SM
    (24576, 4096, True, (1, 1)),   # 8B gate/up: 1,536 CTAs of 2 warps fit once at depth 1 (12 per SM), never at 16 rows
    (1024, 3072, False, (3, 3)),   # Qwen3-0.6B down: 64 CTAs, one wave at any depth
])
def test_the_default_depth_is_the_deepest_ring_whose_grid_fits_one_wave(n, k, swiglu, depths):
    n_tiles = n // 16
    k_slices = default_k_slices(n_tiles, k // 128)
    assert tuple(default_depth("bf16", k_slices, tiles, swiglu, n_tiles, 132) for tiles in (1, 2)) == depths
    assert default_depth("f32", k_slices, 1, swiglu, n_tiles, 132) == 2
    assert default_depth("bf16", k_slices, 4, swiglu, n_tiles, 132) <= 2  # four batch tiles spill at depth 3
    assert resident_ctas(2, 78) == 12 and resident_ctas(8, 144) == 1 and resident_ctas(1, 32) == 32  # the CTA cap


@pytest.mark.parametrize("n, k, swiglu, tiles, expected", [
    # (N, K, SwiGLU, batch tiles) -> (column tiles, depth) on 132 SMs; the faster of the two measured on an H100
    (4096, 4096, False, 4, (2, 1)),    # 8B o at 32 rows: one tile needs two waves (256 CTAs of 8 warps, 1 per SM)
    (4096, 12288, False, 4, (2, 1)),   # 8B down at 32 rows: the same grid
    (24576, 4096, True, 2, (2, 1)),    # 8B gate/up at 16 rows: 1,536 CTAs need two waves, 768 of two tiles fit
    (24576, 4096, True, 4, (1, 1)),    # at 32 rows neither fits: one tile, more warps
    (6144, 4096, False, 4, (1, 1)),    # 8B q/k/v at 32 rows: one tile fits (384 CTAs, 3 per SM)
    (4096, 4096, False, 2, (1, 1)),    # 8B o at 16 rows: one tile fits
])
def test_two_column_tiles_only_where_one_needs_a_second_wave(n, k, swiglu, tiles, expected):
    n_tiles = n // 16
    k_slices = default_k_slices(n_tiles, k // 128)
    column_tiles = default_column_tiles("bf16", k_slices, tiles, swiglu, n_tiles, 132)
    depth = default_depth("bf16", k_slices, tiles, swiglu, n_tiles // column_tiles, 132, column_tiles)
    assert (column_tiles, depth) == expected
    assert default_column_tiles("f32", k_slices, tiles, swiglu, n_tiles, 132) == 1  # two tiles measured on BF16 only
    assert default_column_tiles("bf16", k_slices, tiles, swiglu, n_tiles + 1, 132) == 1  # an odd tile count


# ---------------------------------------------------------------------------- BF16 weights (the lm_head)


def bf16_weights(rng, n, k):
    return bit_placement.float32_to_bf16_bits((rng.standard_normal((n, k)) * 0.05).astype(np.float32))


@pytest.mark.parametrize("m, n, k, k_slices, depth", [(3, 16, 640, 4, 2), (11, 32, 384, 2, 1), (16, 16, 256, 1, 3),
                                                      (26, 16, 256, 2, None)])
def test_bf16_weights_match_the_simulator_bit_for_bit(rng, m, n, k, k_slices, depth):
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = bf16_weights(rng, n, k)
    out = np.full((m, n), np.nan, np.float32)
    x = a if m <= 16 else bit_placement.float32_to_bf16_bits(a)  # float32 in: at most 16 rows
    gemv_mma_bf16(x, w, out, k_slices=k_slices, depth=depth)
    np.testing.assert_array_equal(bits(out), bits(model.gemv_mma_bf16(a, w, k_slices=k_slices)))
    as_bf16 = np.full((m, n), 0x1234, np.uint16)
    gemv_mma_bf16(bit_placement.float32_to_bf16_bits(a), w, as_bf16, k_slices=k_slices, depth=depth)
    np.testing.assert_array_equal(as_bf16, bit_placement.float32_to_bf16_bits(out))


@pytest.mark.parametrize("change, message", [
    (dict(w_bits=np.zeros((16, 128), np.uint8)), "^w_bits: expected BF16 patterns"),
    (dict(w_bits=np.zeros((24, 128), np.uint16), out=np.zeros((2, 24), np.float32)), "^w_bits: gemv_mma_bf16 needs N"),
    (dict(a=np.ones((17, 128), np.float32), out=np.zeros((17, 16), np.float32)), "^a: gemv_mma_bf16 takes 1 to 16"),
    (dict(a=np.ones((2, 128), np.float16)), "^a: expected activations"),
    (dict(out=np.zeros((2, 16), np.float16)), "^out: expected \\[2, 16\\] of float32 or uint16"),
    (dict(depth=5), "^depth: expected one of"),
])
def test_bf16_weights_bad_calls_raise_before_launching(change, message):
    args = dict(a=np.ones((2, 128), np.float32), w_bits=np.zeros((16, 128), np.uint16),
                out=np.zeros((2, 16), np.float32)) | change
    with pytest.raises(ValueError, match=message):
        gemv_mma_bf16(**args)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, swiglu", [(1, 6144, 4096, False), (4, 4096, 12288, False), (8, 2048, 4096, True),
                                            (16, 4096, 4096, False), (12, 2048, 4096, True), (32, 6144, 4096, False),
                                            (25, 2048, 4096, True)])
def test_gpu_within_the_tensor_core_budget(rng, m, n, k, swiglu):
    from numba import cuda

    a, q, scales = problem(rng, m, n, k, (128, 128))
    width = n // 2 if swiglu else n
    out = cuda.to_device(np.full((m, width), np.nan, np.float32))
    x = a if m <= 16 else bit_placement.float32_to_bf16_bits(a)  # float32 in: at most 16 rows
    (gemv_mma_swiglu if swiglu else gemv_mma)(cuda.to_device(x), cuda.to_device(q), cuda.to_device(scales), out)
    got = out.copy_to_host().astype(np.float64)
    a16 = bit_placement.bf16_bits_to_float32(bit_placement.float32_to_bf16_bits(a)).astype(np.float64)
    w = blockwise.dequantize(q, scales, (128, 128)).astype(np.float64)
    exact, magnitude = a16 @ w.T, np.abs(a16) @ np.abs(w).T
    chunks = k // 128
    bound = (48 + chunks + 9) * 2.0**-24 * magnitude + 15 * chunks * 2.0**-30 * scales.max()
    if swiglu:
        g, u = exact[:, :width], exact[:, width:]
        exact = g / (1 + np.exp(-g)) * u
        bound = 1.1 * np.abs(u) * bound[:, :width] + np.abs(g) * bound[:, width:] + 2.0**-20 * np.abs(exact)
    assert np.all(np.isfinite(got)) and np.all(np.abs(got - exact) <= bound)


@pytest.mark.gpu
@pytest.mark.parametrize("k_slices", [1, 4, 8])
def test_gpu_bit_for_bit_the_simulator_where_sums_are_exact(rng, k_slices):
    from numba import cuda

    m, n, k = 6 + 4 * (k_slices == 4), 256, 2048  # one batch tile, and two for k_slices = 4
    q = rng.choice(INTEGER_CODES, (n, k))
    a = rng.integers(-4, 5, (m, k)).astype(np.float32)
    scales = np.exp2(rng.integers(-2, 3, (n // 128, k // 128))).astype(np.float32)
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    gemv_mma(cuda.to_device(a), cuda.to_device(q), cuda.to_device(scales), out, k_slices=k_slices)
    np.testing.assert_array_equal(bits(out.copy_to_host()), bits(model.gemv_mma(a, q, scales, k_slices=k_slices)))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, swiglu", [(32, 4096, 4096, False), (16, 24576, 4096, True), (27, 4096, 12288, False)])
def test_gpu_two_column_tiles_are_one_tiles_bits(rng, m, n, k, swiglu):
    """Two column tiles per CTA change no output's order: the same bits as one tile, at the shapes where the
    default takes two (and at a partial last batch tile)."""
    from numba import cuda

    a, q, scales = problem(rng, m, n, k, (128, 128))
    kernel, width = (gemv_mma_swiglu, n // 2) if swiglu else (gemv_mma, n)
    x, q_d, s_d = (cuda.to_device(v) for v in (bit_placement.float32_to_bf16_bits(a), q, scales))
    outs = []
    for column_tiles in (1, 2):
        out = cuda.to_device(np.full((m, width), np.nan, np.float32))
        kernel(x, q_d, s_d, out, column_tiles=column_tiles, depth=1)
        outs.append(out.copy_to_host())
    assert np.all(np.isfinite(outs[0]))
    np.testing.assert_array_equal(bits(outs[1]), bits(outs[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32])
def test_gpu_bf16_weights_at_the_lm_head_shape(rng, m):
    """Qwen3-8B's lm_head rows (a slice of 8,192 of its 151,936) against the float64 product of the BF16 inputs,
    within the tensor-core budget (the HMMA's own rounding of each 16-product sum, float32 partial sums)."""
    from numba import cuda

    n, k = 8192, 4096
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = bf16_weights(rng, n, k)
    out = cuda.to_device(np.full((m, n), np.nan, np.float32))
    x = a if m <= 16 else bit_placement.float32_to_bf16_bits(a)  # float32 in: at most 16 rows
    gemv_mma_bf16(cuda.to_device(x), cuda.to_device(w), out)
    got = out.copy_to_host().astype(np.float64)
    a16 = bit_placement.bf16_bits_to_float32(bit_placement.float32_to_bf16_bits(a)).astype(np.float64)
    w64 = bit_placement.bf16_bits_to_float32(w).astype(np.float64)
    exact, magnitude = a16 @ w64.T, np.abs(a16) @ np.abs(w64).T
    bound = (48 + k // 128 + 9) * 2.0**-24 * magnitude
    assert np.all(np.isfinite(got)) and np.all(np.abs(got - exact) <= bound)
