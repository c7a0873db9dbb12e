"""The bug classes of E4M3 and the blockwise weights: each mistake as a mutant of the oracle.

Mutant signatures follow the operator: ``encode(x, saturate)``, ``decode(codes)``,
``quantize(w, block)``, ``dequantize(q, scale_inv, block)``, ``gemm(a, q, scale_inv, block)``,
``quantize_activations(a, group, eps)``, ``gemm_w8a8(a, q, scale_inv, block, eps)``.
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference import blockwise, e4m3

from .report import BugClass

# ---------------------------------------------------------------------------- E4M3 encode and decode


def _encode(x, saturate: bool, *, ties_away: bool = False, max_code: int = e4m3.MAX_CODE,
            subnormal_step_exponent: int = -9) -> np.ndarray:
    """E4M3 encode written out with the knobs the mutants turn (the defaults are the contract).

    As ``fp8lab.reference.e4m3.encode``: in binade ``b`` (at least -6, which also holds the
    subnormals) the grid spacing is ``2^(b - 3)`` and ``code = (b + 6) * 8 + steps``. The mutant
    knob ``subnormal_step_exponent`` gives values below ``2^-6`` the code ``rint(|x| / 2^e)``
    (clamped to the 7 subnormal codes), the mistake of scaling subnormals by the wrong power of two.
    """
    v = np.asarray(x, np.float64)
    sign, a = np.signbit(v), np.abs(v)
    finite = np.isfinite(a)
    a = np.where(finite, a, 0.0)
    _, e = np.frexp(a)
    binade = np.where(a > 0, np.maximum(e.astype(np.int64) - 1, -6), -6)
    ratio = np.ldexp(a, 3 - binade)
    steps = np.floor(ratio + 0.5) if ties_away else np.rint(ratio)
    code = ((binade + 6) * 8 + steps).astype(np.int64)
    if subnormal_step_exponent != -9:
        subnormal = a < 2.0**-6
        wrong = np.minimum(np.rint(np.ldexp(a, -subnormal_step_exponent)), 7).astype(np.int64)
        code = np.where(subnormal, wrong, code)
    overflow = ~finite | (code > max_code)
    code = np.where(overflow, max_code if saturate else 0x7F, code)
    code = np.where(np.isnan(v), 0x7F, code)
    return (code | (sign.astype(np.int64) << 7)).astype(np.uint8)


def _decode(codes, *, bias: int = 7, subnormal_step_exponent: int | None = None) -> np.ndarray:
    """E4M3 decode with the exponent bias and the subnormal step as knobs (defaults: the contract; the
    subnormal step follows the bias, ``2^(1 - bias - 3)``, unless given)."""
    if subnormal_step_exponent is None:
        subnormal_step_exponent = 1 - bias - 3
    c = np.asarray(codes, np.uint8).astype(np.int64)
    sign, exponent, mantissa = c >> 7, (c >> 3) & 0xF, c & 7
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - bias)
    sub = mantissa * 2.0**subnormal_step_exponent
    value = np.where(exponent == 0, sub, normal)
    value = np.where(sign == 1, -value, value)
    nan = (c == 0x80) if bias == 8 else ((c & 0x7F) == 0x7F)
    return np.where(nan, np.nan, value).astype(np.float32)


def _encode_fnuz(x, saturate: bool) -> np.ndarray:
    """Encode to float8_e4m3fnuz bit patterns: its values are float8_e4m3fn's halved (exponent bias 8) and its
    0x7F is finite (240), so ``2x`` is rounded on fn's grid up to code 0x7F; no negative zero (0x80 is its
    only NaN); overflow beyond 240 (``|x| >= 248``, the tie rounding to even 256) saturates or gives NaN."""
    v = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        code = _encode(2 * v, True, max_code=0x7F).astype(np.int64)
    code = np.where((code & 0x7F) == 0, 0, code)  # -0 and negatives that round to zero: +0
    overflow = ~np.isfinite(v) | (np.abs(np.where(np.isnan(v), 0, v)) >= 248)
    return np.where(np.isnan(v) | (overflow & (not saturate)), 0x80, code).astype(np.uint8)


def _encode_nan_as(x, saturate: bool, nan_code: int) -> np.ndarray:
    """The contract's encode, but every NaN code replaced by ``nan_code`` (the input's sign lost)."""
    codes = e4m3.encode(x, saturate=saturate)
    return np.where(e4m3.is_nan(codes), np.uint8(nan_code), codes).astype(np.uint8)


ENCODE_BUGS = [
    BugClass("ties_away_from_zero", "encode", "a value half-way between two E4M3 values rounds away from zero "
             "instead of to the even code", lambda x, saturate: _encode(x, saturate, ties_away=True)),
    BugClass("overflow_policy_swapped", "encode", "overflow gives NaN where the caller asked to saturate to "
             "+-448, or saturates where the caller asked for NaN", lambda x, saturate: e4m3.encode(x, not saturate)),
    BugClass("fnuz_max_240", "encode", "the largest value is taken as 240, the maximum of float8_e4m3fnuz, "
             "not 448", lambda x, saturate: _encode(x, saturate, max_code=0x77)),
    BugClass("fnuz_max_240", "encode", "the codes are float8_e4m3fnuz bit patterns (exponent bias 8, maximum 240, "
             "0x80 the only NaN)", _encode_fnuz),
    BugClass("fnuz_max_240", "encode", "the codes are float8_e4m3fnuz bit patterns, overflowing to NaN (a plain "
             "cast to float8_e4m3fnuz)", lambda x, saturate: _encode_fnuz(x, False)),
    BugClass("nan_sign_not_kept", "encode", "a NaN is encoded as 0xFF whatever its sign (the contract keeps the "
             "input's sign: 0x7F or 0xFF)", lambda x, saturate: _encode_nan_as(x, saturate, 0xFF)),
    BugClass("nan_sign_not_kept", "encode", "a NaN is encoded as 0x7F whatever its sign (the contract keeps the "
             "input's sign: 0x7F or 0xFF)", lambda x, saturate: _encode_nan_as(x, saturate, 0x7F)),
    BugClass("subnormal_wrong_power_of_two", "encode", "subnormals are scaled by the wrong power of two "
             "(steps of 2^-10 instead of 2^-9)", lambda x, saturate: _encode(x, saturate, subnormal_step_exponent=-10)),
]

DECODE_BUGS = [
    BugClass("fnuz_max_240", "decode", "codes are decoded as float8_e4m3fnuz (exponent bias 8, maximum 240)",
             lambda codes: _decode(codes, bias=8)),
    BugClass("subnormal_wrong_power_of_two", "decode", "subnormal codes are scaled by the wrong power of two "
             "(m * 2^-10 instead of m * 2^-9)", lambda codes: _decode(codes, subnormal_step_exponent=-10)),
]


# ---------------------------------------------------------------------------- blockwise weights


def _expand(scale_inv, shape, block, *, swap=False, clamp_edges=False, assumed_block=None) -> np.ndarray:
    """``scale_inv[n // BN, k // BK]`` over a weight of ``shape``, with the mutants' knobs: ``swap``
    reads the block as ``(BK, BN)``; ``clamp_edges`` gives a partial edge block its full neighbour's scale;
    ``assumed_block`` indexes with another block size than the weight's (past the grid's edge: its last scale)."""
    bn, bk = (block[1], block[0]) if swap else (assumed_block or block)
    n, k = shape
    s = np.asarray(scale_inv, np.float32)
    rows, cols = np.arange(n) // bn, np.arange(k) // bk
    if clamp_edges:
        rows = np.minimum(rows, max(n // bn - 1, 0))
        cols = np.minimum(cols, max(k // bk - 1, 0))
    rows, cols = np.minimum(rows, s.shape[0] - 1), np.minimum(cols, s.shape[1] - 1)  # stay in the grid
    return s[rows][:, cols]


def _dequantize(q, scale_inv, block, **knobs) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return e4m3.decode(q) * _expand(scale_inv, np.shape(q), block, **knobs)


def _dequantize_divided(q, scale_inv, block) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return (e4m3.decode(q) / _expand(scale_inv, np.shape(q), block)).astype(np.float32)


def _quantize_per_tensor(w, block):
    w32 = np.asarray(w, np.float32)
    scale = e4m3.scale_of_amax(np.max(np.abs(w32), initial=0))
    grid = np.full(blockwise.scale_shape(w32.shape, block), scale, np.float32)
    return e4m3.encode(w32 / scale, saturate=True), grid


def _quantize_multiplied(w, block):
    q, s = blockwise.quantize(w, block)
    w32 = np.asarray(w, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return e4m3.encode(w32 * blockwise.expand_scales(s, w32.shape, block), saturate=True), s


def _quantize_swapped(w, block):
    return blockwise.quantize(w, (block[1], block[0]))


def _gemm_with(dequantize):
    """A GEMM mutant: the oracle's float64 product over a mutant's dequantized weight."""
    def gemm(a, q, scale_inv, block):
        w = dequantize(q, scale_inv, block).astype(np.float64)
        return np.asarray(a, np.float64) @ w.T

    gemm.dequantize = dequantize  # the weight it multiplies by, for the diagnosis's error bound
    return gemm


DEQUANTIZE_BUGS = [
    BugClass("scale_multiplied_not_divided", "dequantize", "the scale is applied the wrong way round "
             "(divided by scale_inv instead of multiplied)", _dequantize_divided),
    BugClass("wrong_block_dimension", "dequantize", "the scale is indexed with the block dimensions swapped "
             "(n // BK, k // BN)", lambda q, s, block: _dequantize(q, s, block, swap=True)),
    BugClass("partial_edge_block", "dequantize", "a partial edge block uses its full neighbour's scale "
             "(the scale grid computed with floor instead of ceiling division)",
             lambda q, s, block: _dequantize(q, s, block, clamp_edges=True)),
]

WRONG_BLOCK_SIZES = {
    "a hard-coded 128 x 128 block": lambda block: (128, 128),
    "a block of half the size": lambda block: (max(block[0] // 2, 1), max(block[1] // 2, 1)),
    "a block of twice the size": lambda block: (2 * block[0], 2 * block[1]),
}
"""The block sizes a kernel wrongly assumes (from the true block ``(BN, BK)``), by what they are."""

DEQUANTIZE_BUGS += [
    BugClass("wrong_block_size", "dequantize", f"the scale is indexed with {words} instead of the weight's",
             lambda q, s, block, size=size: _dequantize(q, s, block, assumed_block=size(block)))
    for words, size in WRONG_BLOCK_SIZES.items()
]

QUANTIZE_BUGS = [
    BugClass("per_tensor_scale", "quantize", "one scale for the whole tensor where one per block is meant",
             _quantize_per_tensor),
    BugClass("scale_multiplied_not_divided", "quantize", "the weight is multiplied by scale_inv instead of "
             "divided by it before encoding", _quantize_multiplied),
    BugClass("wrong_block_dimension", "quantize", "the blocks are taken with their dimensions swapped "
             "(BK rows by BN columns)", _quantize_swapped),
] + [
    BugClass("wrong_block_size", "quantize", f"the weight is quantized with {words} instead of the given block",
             lambda w, block, size=size: blockwise.quantize(w, size(block)))
    for words, size in WRONG_BLOCK_SIZES.items()
]

GEMM_BUGS = [BugClass(b.name, "gemm", b.summary, _gemm_with(b.mutant)) for b in DEQUANTIZE_BUGS]


# ---------------------------------------------------------------------------- activation quantization


def _activations_without_eps(a, group, eps):
    a32 = np.asarray(a, np.float32)
    amax = blockwise._block_amax(a32, (1, int(group)))
    scales = (amax / np.float32(e4m3.MAX)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = e4m3.encode(a32 / blockwise.expand_scales(scales, a32.shape, (1, group)), saturate=True)
    return q, scales


ACTIVATION_BUGS = [
    BugClass("group_scale_without_eps", "quantize_activations", "the group scale is amax / 448 with no epsilon, "
             "so an all-zero group divides 0 by 0 and gives NaN codes", _activations_without_eps),
]

def _w8a8_with_activations(quantize_activations):
    """The W8A8 oracle with the activations quantized by ``quantize_activations`` (a mutant of it)."""
    def gemm(a, q, scale_inv, block, eps):
        a32 = np.asarray(a, np.float32)
        aq, a_scales = quantize_activations(a32, block[1], eps)
        w = e4m3.decode(q).astype(np.float64) * np.repeat(np.repeat(np.asarray(scale_inv, np.float64), block[0], 0),
                                                          block[1], 1)[: q.shape[0], : q.shape[1]]
        with np.errstate(invalid="ignore"):
            x = e4m3.decode(aq).astype(np.float64) * np.repeat(a_scales.astype(np.float64), block[1], 1)[:, : a32.shape[1]]
        return x @ w.T
    return gemm


W8A8_BUGS = [
    BugClass("group_scale_without_eps", "gemm_w8a8", "the activation group scale is amax / 448 with no epsilon, "
             "so an all-zero group gives NaN", _w8a8_with_activations(_activations_without_eps)),
]

