"""The bug zoo of E4M3, the blockwise weights and W8A8: one deliberately wrong implementation per bug
class of ``fp8lab.testing.weight_bugs``, written independently of the catalog's mutants (ml_dtypes casts
and block loops, as a kernel author might). ``ZOO``: (bug class, a check that runs the kit on it);
``tests/testing/test_bug_zoo.py`` asserts that each fails and is named."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from fp8lab import testing
from fp8lab.reference import blockwise, e4m3

FN = ml_dtypes.float8_e4m3fn


def cast_saturating(x) -> np.ndarray:
    """E4M3 codes by ml_dtypes (round to nearest even), saturated to +-448 first: a correct encoder."""
    x = np.asarray(x, np.float32)
    clipped = np.where(np.isnan(x), x, np.clip(x, -448, 448))
    return clipped.astype(FN).view(np.uint8)


def encode_ties_away(x):
    """Rounds a tie to the neighbour of larger magnitude: where ml_dtypes' cast (ties to even) rounded a
    tie down in magnitude, step one code up (codes are ordered like magnitudes within a sign)."""
    codes = cast_saturating(x)
    x = np.abs(np.asarray(x, np.float64))
    magnitude = codes & 0x7F
    value = np.abs(e4m3.decode(codes).astype(np.float64))
    above = np.abs(e4m3.decode(np.minimum(magnitude + 1, 0x7E).astype(np.uint8)).astype(np.float64))
    rounded_down_a_tie = (value < x) & (x - value == above - x) & (magnitude < 0x7E)
    return np.where(rounded_down_a_tie, codes + 1, codes).astype(np.uint8)


def encode_nan_on_overflow(x):
    """ml_dtypes' plain cast: NaN on overflow, though the caller asked to saturate."""
    return np.asarray(x, np.float32).astype(FN).view(np.uint8)


def encode_fnuz_max(x):
    """Clamps to +-240 (the e4m3fnuz maximum) before a correct cast."""
    x = np.asarray(x, np.float32)
    return cast_saturating(np.where(np.isnan(x), x, np.clip(x, -240, 240)))


def encode_fnuz_cast(x):
    """ml_dtypes' cast to float8_e4m3fnuz, the other format (NaN on overflow)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fnuz).view(np.uint8)


def encode_nan_unsigned(x):
    """A correct saturating encoder that writes every NaN as 0xFF (as gfloat does)."""
    codes = cast_saturating(x)
    return np.where((codes & 0x7F) == 0x7F, np.uint8(0xFF), codes).astype(np.uint8)


def encode_subnormal_off(x):
    """Subnormal mantissas computed as round(|x| * 2^10) (one power of two too many), clamped to 7."""
    codes = cast_saturating(x)
    x = np.asarray(x, np.float64)
    small = np.abs(x) < 2.0**-6
    m = np.minimum(np.rint(np.where(small, np.abs(x), 0.0) * 1024), 7).astype(np.uint8)
    return np.where(small, m | (np.signbit(x).astype(np.uint8) << 7), codes).astype(np.uint8)


def decode_fnuz(codes):
    """Reads the codes as float8_e4m3fnuz (bias 8): every value halved, 0x80 the only NaN."""
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)


def decode_subnormal_off(codes):
    """Subnormal codes decoded as m * 2^-10."""
    codes = np.asarray(codes, np.uint8)
    values = codes.view(FN).astype(np.float32)
    sub = (codes & 0x78) == 0
    m = (codes & 7).astype(np.float32) * np.float32(2.0**-10)
    return np.where(sub, np.where(codes & 0x80, -m, m), values).astype(np.float32)


def blocks(shape, block):
    """(row slice, column slice, block row, block column) of every block of a weight, partial edges included."""
    n, k = shape
    for bi, r in enumerate(range(0, n, block[0])):
        for bj, c in enumerate(range(0, k, block[1])):
            yield slice(r, r + block[0]), slice(c, c + block[1]), bi, bj


def quantize_per_tensor(w, block):
    amax = np.float32(np.max(np.abs(w)))
    scale = np.float32(1) if amax == 0 else max(amax / np.float32(448), np.float32(2.0**-126))
    grid = np.full(blockwise.scale_shape(w.shape, block), scale, np.float32)
    return cast_saturating(w / scale), grid


def quantize_multiplied(w, block):
    q, s = np.zeros(w.shape, np.uint8), np.zeros(blockwise.scale_shape(w.shape, block), np.float32)
    for rows, cols, bi, bj in blocks(w.shape, block):
        amax = np.float32(np.max(np.abs(w[rows, cols])))
        s[bi, bj] = np.float32(1) if amax == 0 else max(amax / np.float32(448), np.float32(2.0**-126))
        q[rows, cols] = cast_saturating(w[rows, cols] * s[bi, bj])
    return q, s


def quantize_swapped(w, block):
    return blockwise.quantize(w, (block[1], block[0]))


def dequantize_divided(q, s, block):
    out = np.zeros(q.shape, np.float32)
    for rows, cols, bi, bj in blocks(q.shape, block):
        with np.errstate(over="ignore"):
            out[rows, cols] = q[rows, cols].view(FN).astype(np.float32) / s[bi, bj]
    return out


def dequantize_swapped(q, s, block):
    n, k = q.shape
    rows = np.minimum(np.arange(n) // block[1], s.shape[0] - 1)
    cols = np.minimum(np.arange(k) // block[0], s.shape[1] - 1)
    return q.view(FN).astype(np.float32) * s[rows][:, cols]


def dequantize_edge_clamped(q, s, block):
    out = np.zeros(q.shape, np.float32)
    full_rows, full_cols = max(q.shape[0] // block[0], 1), max(q.shape[1] // block[1], 1)
    for rows, cols, bi, bj in blocks(q.shape, block):
        out[rows, cols] = q[rows, cols].view(FN).astype(np.float32) * s[min(bi, full_rows - 1), min(bj, full_cols - 1)]
    return out


def quantize_in_128_blocks(w, block):
    """Ignores the block it is given: quantizes in 128 x 128 blocks (a kernel with the size hard-coded)."""
    q, s = np.zeros(w.shape, np.uint8), np.zeros(blockwise.scale_shape(w.shape, (128, 128)), np.float32)
    for rows, cols, bi, bj in blocks(w.shape, (128, 128)):
        amax = np.float32(np.max(np.abs(w[rows, cols])))
        s[bi, bj] = np.float32(1) if amax == 0 else max(amax / np.float32(448), np.float32(2.0**-126))
        q[rows, cols] = cast_saturating(w[rows, cols] / s[bi, bj])
    return q, s


def dequantize_in_128_blocks(q, s, block):
    """Reads scale ``s[n // 128, k // 128]`` whatever the block (past the grid's edge: its last row/column)."""
    out = np.zeros(q.shape, np.float32)
    for rows, cols, bi, bj in blocks(q.shape, (128, 128)):
        out[rows, cols] = q[rows, cols].view(FN).astype(np.float32) * s[min(bi, s.shape[0] - 1), min(bj, s.shape[1] - 1)]
    return out


def gemm_over(dequantize):
    """A float32 GEMM over a (possibly wrong) dequantizer; a wrong one may overflow, as the kernel would."""
    def gemm(a, q, s, block):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(a, np.float32) @ dequantize(q, s, block).T
    return gemm


def activations_without_eps(a, group, eps):
    q, s = np.zeros(a.shape, np.uint8), np.zeros((a.shape[0], -(-a.shape[1] // group)), np.float32)
    for j, c in enumerate(range(0, a.shape[1], group)):
        s[:, j] = np.max(np.abs(a[:, c : c + group]), axis=1) / np.float32(448)
        with np.errstate(invalid="ignore", divide="ignore"):
            q[:, c : c + group] = cast_saturating(a[:, c : c + group] / s[:, j : j + 1])
    return q, s


def w8a8_without_eps(a, q, s, block, eps):
    """W8A8 as transformers' block loop writes it, but its activation scales have no epsilon."""
    aq, a_s = activations_without_eps(a, block[1], eps)
    out = np.zeros((a.shape[0], q.shape[0]), np.float64)
    for rows, cols, bi, bj in blocks(q.shape, block):
        with np.errstate(invalid="ignore"):
            x = aq[:, cols].view(FN).astype(np.float64) * a_s[:, bj : bj + 1]
        out[:, rows] += x @ (q[rows, cols].view(FN).astype(np.float64) * s[bi, bj]).T
    return out


def w8a8_float32(a, q, s, block, eps):
    """A correct W8A8 in float32, block by block as a kernel accumulates (the contract's activation scales)."""
    aq, a_s = blockwise.quantize_activations(a, block[1], eps)
    out = np.zeros((a.shape[0], q.shape[0]), np.float32)
    for rows, cols, bi, bj in blocks(q.shape, block):
        partial = aq[:, cols].view(FN).astype(np.float32) @ q[rows, cols].view(FN).astype(np.float32).T
        out[:, rows] += partial * (a_s[:, bj : bj + 1] * s[bi, bj])
    return out


ZOO = [
    ("ties_away_from_zero", lambda: testing.check_e4m3_encode(encode_ties_away)),
    ("overflow_policy_swapped", lambda: testing.check_e4m3_encode(encode_nan_on_overflow)),
    ("fnuz_max_240", lambda: testing.check_e4m3_encode(encode_fnuz_max)),
    ("fnuz_max_240", lambda: testing.check_e4m3_encode(encode_fnuz_cast)),
    ("fnuz_max_240", lambda: testing.check_e4m3_encode(encode_fnuz_cast, saturate=False)),
    ("nan_sign_not_kept", lambda: testing.check_e4m3_encode(encode_nan_unsigned)),
    ("subnormal_wrong_power_of_two", lambda: testing.check_e4m3_encode(encode_subnormal_off)),
    ("fnuz_max_240", lambda: testing.check_e4m3_decode(decode_fnuz)),
    ("subnormal_wrong_power_of_two", lambda: testing.check_e4m3_decode(decode_subnormal_off)),
    ("per_tensor_scale", lambda: testing.check_blockwise_quantize(quantize_per_tensor)),
    ("scale_multiplied_not_divided", lambda: testing.check_blockwise_quantize(quantize_multiplied)),
    ("wrong_block_dimension", lambda: testing.check_blockwise_quantize(quantize_swapped, block=(64, 128))),
    ("scale_multiplied_not_divided", lambda: testing.check_blockwise_dequantize(dequantize_divided)),
    ("wrong_block_dimension", lambda: testing.check_blockwise_dequantize(dequantize_swapped, block=(64, 128))),
    ("partial_edge_block", lambda: testing.check_blockwise_dequantize(dequantize_edge_clamped)),
    ("scale_multiplied_not_divided", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_divided))),
    ("wrong_block_dimension", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_swapped), block=(64, 128))),
    ("partial_edge_block", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_edge_clamped))),
    ("wrong_block_size", lambda: testing.check_blockwise_quantize(quantize_in_128_blocks, block=(64, 64))),
    ("wrong_block_size", lambda: testing.check_blockwise_dequantize(dequantize_in_128_blocks, block=(64, 64))),
    ("wrong_block_size", lambda: testing.check_blockwise_gemm(gemm_over(dequantize_in_128_blocks), block=(64, 64))),
    ("group_scale_without_eps", lambda: testing.check_activation_quantize(activations_without_eps)),
    ("group_scale_without_eps", lambda: testing.check_w8a8_gemm(w8a8_without_eps)),
]
