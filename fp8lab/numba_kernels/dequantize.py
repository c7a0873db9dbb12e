"""Blockwise FP8 dequantize: ``out[n, k] = decode(q[n, k]) * scale_inv[n // BN, k // BK]``.

Computes ``fp8lab.reference.blockwise.dequantize``. Launch: 1-D, ``THREADS_PER_CTA`` threads per CTA, a
thread per 4 codes in a grid-stride loop (``dequantize_launch_info``). Checked
(``tests/numba_kernels/test_dequantize_kernel.py``): bit for bit against the oracle (simulator and GPU), the
placement against ``fp8lab.simulators.bit_placement``.

What it computes: ``fp8lab.reference.blockwise.dequantize`` (one float32 product per element), stored as
float32, or that float32 value rounded once more to float16 or BF16 (round to nearest, ties to
even), which is what ``fp8lab.reference.blockwise.dequantize(q, s).astype(float16 / bfloat16)`` gives.

How: each thread takes 4 consecutive codes of a row with one 32-bit load (``q`` is read through a
``uint32`` view of its bytes) and decodes them by **F16 bit placement** (``fp8lab.simulators.bit_placement``):
a code ``c`` becomes the F16 pattern ``(c & 0x80) << 8 | (c & 0x7F) << 7``, worth exactly
``decode(c) * 2^-8``, widened to float32 (one ``cvt``). The ``2^8`` is folded into the scale:

    placed = decode(c) * 2^-8          exact (F16 holds every E4M3 value times 2^-8)
    folded = scale_inv * 2^8           exact in float32 unless it overflows (scale_inv >= 2^120)
    out    = fl32(placed * folded)     one rounding of the real number decode(c) * scale_inv

so the result equals the reference's single float32 rounding ``fl32(decode(c) * scale_inv)`` bit for
bit. ``placed_codes`` (4 codes of one 32-bit word at once) is shared with the SIMT GEMV.

NaN codes (0x7F / 0xFF) are not special to the placement: they become the finite ``+-480 * scale``
(the reference gives NaN). Weights must be checked for NaN codes when they are loaded
(``fp8lab.reference.blockwise.nan_code_positions``), not on every decode.

Launch shape (``dequantize_launch_info``): 1-D, ``THREADS_PER_CTA`` threads per CTA, at most
``MAX_CTAS`` CTAs, each thread walking a grid-stride loop over the ``N * K / 4`` words of ``q``.

Checked (``tests/numba_kernels/test_dequantize_kernel.py``) against ``fp8lab.reference.blockwise.dequantize`` bit for bit,
in the CUDA simulator and on a GPU; ``placed_codes`` against ``fp8lab.simulators.bit_placement``.

Requirements (``ValueError`` before anything is launched): ``q`` uint8 ``[N, K]`` C-contiguous with
``K`` a positive multiple of 4 (whole 32-bit words per row); ``scale_inv`` float32
``[ceil(N/BN), ceil(K/BK)]``; ``out`` ``[N, K]`` float32, float16 or uint16/int16 (BF16 bits).
Any positive block ``(BN, BK)``; edge blocks may be partial.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from . import arguments, pdl
from .bits import e4m3x2_to_f16x2, f16_bits_to_f32
from .mathops import f32_to_bf16_bits_rne

CODES_PER_WORD = 4
THREADS_PER_CTA = 256
MAX_CTAS = 4096
"""Grid cap: enough CTAs to fill any current GPU many times over; the grid-stride loop does the rest."""
F16_PLACEMENT_SCALE = float32(2.0**8)
"""An F16-placed code is worth ``decode(c) * 2^-8``; the block scale is multiplied by ``2^8`` instead."""

# The F16 placement of two codes at once. A 32-bit word holds codes c0 (bits 0-7), c1 (8-15),
# c2 (16-23), c3 (24-31). The result registers hold two F16 patterns each (low half, high half):
#
#   even = (c0, c2):  sign: bit 7 -> 15, bit 23 -> 31      (w << 8) & 0x80008000
#                     magnitude: bits 0-6 -> 7-13,
#                                bits 16-22 -> 23-29      (w << 7) & 0x3F803F80
#   odd  = (c1, c3):  sign: bit 15 -> 15, bit 31 -> 31     w & 0x80008000
#                     magnitude: bits 8-14 -> 7-13,
#                                bits 24-30 -> 23-29      (w >> 1) & 0x3F803F80
#
# The masks keep each shifted field inside its own 16-bit half. (Same idea as
# fp8lab.simulators.bit_placement.place_code_pair, which spreads the bytes with prmt first.)
SIGN_BITS_X2 = uint32(0x80008000)
MAGNITUDE_BITS_X2 = uint32(0x3F803F80)


@cuda.jit(device=True, inline=True)
def f16_patterns_of_even_codes(word):
    """Codes 0 and 2 of a 32-bit word of E4M3 codes as two F16 patterns (low half: code 0)."""
    # uint32(...) after each left shift: Numba widens shifts to 64 bits; the cast keeps them 32-bit
    return (uint32(word << uint32(8)) & SIGN_BITS_X2) | (uint32(word << uint32(7)) & MAGNITUDE_BITS_X2)


@cuda.jit(device=True, inline=True)
def f16_patterns_of_odd_codes(word):
    """Codes 1 and 3 of a 32-bit word of E4M3 codes as two F16 patterns (low half: code 1)."""
    return (word & SIGN_BITS_X2) | ((word >> uint32(1)) & MAGNITUDE_BITS_X2)


@cuda.jit(device=True, inline=True)
def placed_codes(word):
    """The 4 codes of a uint32 word (code 0 in the low byte) as float32 ``decode(c) * 2^-8``, exact.

    Returns ``(v0, v1, v2, v3)`` in code order. NaN codes give the finite ``+-480 * 2^-8``.
    """
    word = uint32(word)
    even = f16_patterns_of_even_codes(word)
    odd = f16_patterns_of_odd_codes(word)
    return (f16_bits_to_f32(even), f16_bits_to_f32(odd),
            f16_bits_to_f32(even >> uint32(16)), f16_bits_to_f32(odd >> uint32(16)))


@cuda.jit(device=True, inline=True)
def decoded_codes(word):
    """The 4 codes of a uint32 word (code 0 in the low byte) as float32 ``decode(c)``, exact, NaN codes NaN.

    Returns ``(v0, v1, v2, v3)`` in code order. The hardware conversion (``bits.e4m3x2_to_f16x2``: two
    codes per instruction), then F16 to float32 (exact): 6 instructions for 4 codes, where the
    placement of ``placed_codes`` takes about 13; unlike the placement it keeps a NaN code a NaN.
    """
    word = uint32(word)
    low = e4m3x2_to_f16x2(word)  # codes 0 and 1
    high = e4m3x2_to_f16x2(word >> uint32(16))  # codes 2 and 3
    return (f16_bits_to_f32(low), f16_bits_to_f32(low >> uint32(16)),
            f16_bits_to_f32(high), f16_bits_to_f32(high >> uint32(16)))


# ---------------------------------------------------------------------------- output formats


@cuda.jit(device=True, inline=True)
def store_f32(out, i, j, value):
    out[i, j] = value


@cuda.jit(device=True, inline=True)
def store_f16(out, i, j, value):
    out[i, j] = value  # the array's float16 element type: one cvt.rn.f16.f32


@cuda.jit(device=True, inline=True)
def store_bf16(out, i, j, value):
    # out: uint16 view of the BF16 bits; ``layers.bf16_round``'s rounding, so a NaN stays a NaN
    out[i, j] = f32_to_bf16_bits_rne(value)


STORE = {"f32": store_f32, "f16": store_f16, "bf16": store_bf16}
"""How a float32 result is written to each output format (rounded once, to nearest even): the store of every
kernel with a choice of output format (the GEMVs, ``dequantize``, the norms and ``silu_mul``)."""


def output_bits_view(out, output: str):
    """``out`` as the kernel writes it: BF16 given as int16 is viewed as uint16 (same bits)."""
    return out.view(np.uint16) if output == "bf16" and np.dtype(out.dtype) == np.int16 else out


# ---------------------------------------------------------------------------- the kernel


@functools.lru_cache(maxsize=None)
def dequantize_kernel(output: str, block_n: int, block_k: int):
    """The compiled dequantize kernel for one output format and block size (compile-time constants,
    so the block divisions become multiplies and shifts)."""
    store = STORE[output]

    @cuda.jit
    def kernel(q_words, scale_inv, out):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        words_per_row = q_words.shape[1]
        total = q_words.shape[0] * words_per_row
        word = cuda.grid(1)
        stride = cuda.gridsize(1)
        while word < total:
            n = word // words_per_row
            k0 = (word - n * words_per_row) * CODES_PER_WORD
            values = placed_codes(q_words[n, k0 // CODES_PER_WORD])
            scale_row = n // block_n
            folded = scale_inv[scale_row, k0 // block_k] * F16_PLACEMENT_SCALE
            for i in range(CODES_PER_WORD):
                if block_k % CODES_PER_WORD != 0:  # compile-time: a word may straddle two K blocks
                    folded = scale_inv[scale_row, (k0 + i) // block_k] * F16_PLACEMENT_SCALE
                store(out, n, k0 + i, values[i] * folded)
            word += stride

    return kernel


@dataclass(frozen=True)
class DequantizeLaunch:
    """The launch shape of ``dequantize`` for an ``[N, K]`` weight."""

    grid: tuple[int]
    block: tuple[int]
    words: int  # 32-bit words of codes, 4 codes each: the loop's trip count over all threads


def dequantize_launch_info(n: int, k: int) -> DequantizeLaunch:
    """Grid and CTA shape for an ``[N, K]`` weight: one thread per word, grid capped at ``MAX_CTAS``."""
    words = int(n) * (int(k) // CODES_PER_WORD)
    ctas = max(1, min(MAX_CTAS, -(-words // THREADS_PER_CTA)))
    return DequantizeLaunch(grid=(ctas,), block=(THREADS_PER_CTA,), words=words)


# ---------------------------------------------------------------------------- the entry point


def check_dequantize(q, scale_inv, out, block):
    """Check a ``dequantize`` call; return ``(q, scale_inv, out, (BN, BK), output format)``.

    Every problem is a ``ValueError`` naming the argument, in the style of ``arguments.check_gemm``.
    """
    q, scale_inv, out = (arguments.as_kernel_array(name, x)
                         for name, x in (("q", q), ("scale_inv", scale_inv), ("out", out)))
    try:
        bn, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"block: expected a pair (block_n, block_k), got {block!r}") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block: block sizes must be positive, got {(bn, bk)}")
    arguments.require("q", q, "uint8 E4M3 codes [N, K]", q.ndim == 2 and q.dtype == np.uint8)
    arguments.require_c_contiguous("q", q)
    n, k = q.shape
    if n == 0:
        raise ValueError("q: expected at least one row (N >= 1), got N = 0")
    if k == 0 or k % CODES_PER_WORD:
        raise ValueError(f"q: dequantize reads 4 codes per 32-bit load and needs K to be a positive multiple "
                         f"of {CODES_PER_WORD}, got K = {k}")
    expected_scales = (-(-n // bn), -(-k // bk))
    arguments.require("scale_inv", scale_inv,
                       f"float32 [{expected_scales[0]}, {expected_scales[1]}] for block {(bn, bk)}",
                       tuple(scale_inv.shape) == expected_scales and scale_inv.dtype == np.float32)
    arguments.require_c_contiguous("scale_inv", scale_inv)
    output = arguments.OUTPUT_FORMATS.get(np.dtype(out.dtype))
    arguments.require("out", out, f"[{n}, {k}] of float32, float16 or uint16 (BF16)",
                       tuple(out.shape) == (n, k) and output is not None)
    arguments.require_c_contiguous("out", out)
    return q, scale_inv, out, (bn, bk), output


def dequantize(q, scale_inv, out, block=(128, 128), stream=0):
    """Write ``decode(q[n, k]) * scale_inv[n // BN, k // BK]`` into ``out`` (float32, float16 or
    uint16/int16 BF16 bits), rounded once from the float32 product; returns ``out``.

    ``q``: uint8 E4M3 codes ``[N, K]`` (``K`` a multiple of 4); ``scale_inv``: float32
    ``[ceil(N/BN), ceil(K/BK)]``; arrays may be NumPy, Numba device arrays or any
    ``__cuda_array_interface__`` object; ``stream``: where to enqueue the launch (0: the default
    stream). Bad arguments raise ``ValueError``; nothing is launched. NaN codes give finite values
    (see the module docstring).
    """
    q, scale_inv, out, (bn, bk), output = check_dequantize(q, scale_inv, out, block)
    launch = dequantize_launch_info(*q.shape)
    kernel = dequantize_kernel(output, bn, bk)
    pdl.launch(kernel, launch.grid, launch.block, stream, q.view(np.uint32), scale_inv, output_bits_view(out, output))
    return out
