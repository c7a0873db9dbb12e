"""Bit placement: how an FP8 GEMM kernel turns E4M3 weight codes into BF16/F16 tensor-core operands.

Models the decode of ``fp8lab.numba_kernels.dequantize.placed_codes`` (used by the dequantize, SIMT GEMV
and split-kv kernels) and ``gemm_mma``'s code pairs. Checked (``tests/simulators/test_bit_placement.py``):
every non-NaN code exactly against ``fp8lab.reference.e4m3.decode`` (NaN codes become a finite 480).

A tensor core multiplies 16-bit floats, so an FP8 weight must become a BF16 or F16 number before
``mma``. Decoding ``decode(c)`` properly (branches for subnormals, a table, or a ``cvt``) is slow;
instead a kernel *places the code's bits* inside a 16-bit pattern with one mask and one shift::

    E4M3 code  c                 S EEEE MMM                      (sign, 4 exponent bits, 3 mantissa bits)
    BF16 bits  (c & 0x80) << 8 | (c & 0x7F) << 4   S 0000EEEE MMM0000      = decode(c) * 2^-120
    F16  bits  (c & 0x80) << 8 | (c & 0x7F) << 7   S 0EEEE MMM0000000      = decode(c) * 2^-8

The sign lands on the sign bit; the 4 exponent bits land in the low bits of the wider exponent
field, so the *biased* exponent is unchanged while the bias grows from 7 to 127 (BF16) or 15
(F16): every value is multiplied by ``2^-(127-7) = 2^-120`` or ``2^-(15-7) = 2^-8``. The 3
mantissa bits become the top of the wider mantissa. An exponent field of 0 stays 0, so E4M3
subnormals become BF16/F16 subnormals with the same relative scaling. Nothing is rounded.

The leftover power of two is folded into the per-block scale (``folded_scale``), which the
kernel multiplies in once per 128-wide K chunk anyway, so no per-element multiply is needed.

The NaN codes 0x7F / 0xFF (S.1111.111) are *not* special to the placement: they become the
finite patterns 0x07F0 / 0x87F0 (BF16) or 0x3F80 / 0xBF80 (F16), i.e. ``+-480 * 2^-offset``, the
value that S.1111.111 would have if the format had no NaN. A kernel therefore never sees NaN
weights; a loader must reject NaN codes (``fp8lab.reference.blockwise.nan_code_positions``).

Also here: reading 16-bit patterns as float32 values (pure bit manipulation), rounding float32
activations to BF16/F16 with round-to-nearest-even, and the pairwise packing of two FP8 bytes
into one 32-bit register holding two 16-bit patterns, as a kernel does it with ``prmt``
(``__byte_perm``), an AND and a shift.

All functions take and return NumPy arrays of any shape; bit patterns are ``uint16`` (one
16-bit value) or ``uint32`` (a register holding two).
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference import e4m3

FORMATS = ("bf16", "f16")
"""The two 16-bit operand formats of ``mma.m16n8k16`` that bit placement targets."""

BF16_EXPONENT_BIAS = 127
F16_EXPONENT_BIAS = 15
BF16_EXPONENT_OFFSET = BF16_EXPONENT_BIAS - e4m3.EXPONENT_BIAS
"""120: a placed BF16 pattern is worth ``decode(c) * 2^-120``."""
F16_EXPONENT_OFFSET = F16_EXPONENT_BIAS - e4m3.EXPONENT_BIAS
"""8: a placed F16 pattern is worth ``decode(c) * 2^-8``."""

EXPONENT_OFFSET = {"bf16": BF16_EXPONENT_OFFSET, "f16": F16_EXPONENT_OFFSET}
MAGNITUDE_SHIFT = {"bf16": 4, "f16": 7}
"""Left shift that moves the 7 exponent+mantissa bits of a code under the 16-bit format's
exponent/mantissa boundary: BF16 has 7 mantissa bits (7 - 3 = 4), F16 has 10 (10 - 3 = 7)."""
SIGN_SHIFT = 8
"""Bit 7 of the code moves to bit 15 of the 16-bit pattern."""

NAN_CODE_VALUE = 480.0
"""What the NaN codes 0x7F / 0xFF turn into after placement and scale folding: +-480, finite."""


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it is ``'bf16'`` or ``'f16'``; raise ``ValueError`` otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {fmt!r}")
    return fmt


def _codes(codes) -> np.ndarray:
    """Codes as uint16, so the shifts below have room (a uint8 would drop the shifted-out bits)."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise ValueError(f"codes: expected E4M3 codes as uint8, got dtype {c.dtype}")
    return c.astype(np.uint16)


# ---------------------------------------------------------------------------- one code -> one 16-bit pattern


def code_to_bf16_bits(codes) -> np.ndarray:
    """E4M3 codes (uint8) -> BF16 bit patterns (uint16) worth exactly ``decode(c) * 2^-120``."""
    c = _codes(codes)
    return ((c & 0x80) << SIGN_SHIFT) | ((c & 0x7F) << MAGNITUDE_SHIFT["bf16"])


def code_to_f16_bits(codes) -> np.ndarray:
    """E4M3 codes (uint8) -> F16 bit patterns (uint16) worth exactly ``decode(c) * 2^-8``."""
    c = _codes(codes)
    return ((c & 0x80) << SIGN_SHIFT) | ((c & 0x7F) << MAGNITUDE_SHIFT["f16"])


def code_to_bits(codes, fmt: str) -> np.ndarray:
    """``code_to_bf16_bits`` or ``code_to_f16_bits``, chosen by ``fmt``."""
    return code_to_bf16_bits(codes) if check_format(fmt) == "bf16" else code_to_f16_bits(codes)


# ---------------------------------------------------------------------------- 16-bit pattern -> float32 value


def _bits16(bits) -> np.ndarray:
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise ValueError(f"bits: expected 16-bit patterns as uint16, got dtype {b.dtype}")
    return b


def bf16_bits_to_float32(bits) -> np.ndarray:
    """Read BF16 bit patterns (uint16) as float32: BF16 *is* the high half of a float32.

    Exact for every pattern (subnormals, infinities, NaN included)."""
    return (_bits16(bits).astype(np.uint32) << 16).view(np.float32)


def f16_bits_to_float32(bits) -> np.ndarray:
    """Read F16 bit patterns (uint16) as float32 via NumPy's float16; exact for every pattern."""
    return _bits16(bits).view(np.float16).astype(np.float32)


def bits_to_float32(bits, fmt: str) -> np.ndarray:
    """``bf16_bits_to_float32`` or ``f16_bits_to_float32``, chosen by ``fmt``."""
    return bf16_bits_to_float32(bits) if check_format(fmt) == "bf16" else f16_bits_to_float32(bits)


def placed_values(codes, fmt: str) -> np.ndarray:
    """The float32 value a kernel's tensor core sees for each code: ``decode(c) * 2^-offset``
    (NaN codes give ``+-480 * 2^-offset``)."""
    return bits_to_float32(code_to_bits(codes, fmt), fmt)


# ---------------------------------------------------------------------------- float32 activations -> 16-bit patterns


def float32_to_bf16_bits(x) -> np.ndarray:
    """Round float32 values to BF16 patterns (uint16), round to nearest, ties to even.

    The classic bit trick: add ``0x7FFF`` plus the lowest kept bit, then drop the low 16 bits.
    Overflow rounds to +-inf as IEEE rounding does; NaN stays a (quiet) NaN.
    """
    x32 = np.asarray(x)
    if x32.dtype not in (np.float16, np.float32):
        raise ValueError(f"x: expected float32 (or float16) values, got dtype {x32.dtype}")
    u = x32.astype(np.float32).view(np.uint32).astype(np.uint64)  # uint64: the add cannot wrap
    lowest_kept_bit = (u >> 16) & 1
    rounded = (u + 0x7FFF + lowest_kept_bit) >> 16
    quiet_nan = (u >> 16) | 0x0040
    return np.where(np.isnan(x32), quiet_nan, rounded).astype(np.uint16)


def float32_to_f16_bits(x) -> np.ndarray:
    """Round float32 values to F16 patterns (uint16), round to nearest, ties to even (NumPy's cast).

    F16 overflows above 65504 (to +-inf) and has subnormals below 2^-14."""
    x32 = np.asarray(x)
    if x32.dtype not in (np.float16, np.float32):
        raise ValueError(f"x: expected float32 (or float16) values, got dtype {x32.dtype}")
    with np.errstate(over="ignore"):  # overflow to +-inf is the IEEE result, not an accident
        return x32.astype(np.float16).view(np.uint16)


def float32_to_bits(x, fmt: str) -> np.ndarray:
    """``float32_to_bf16_bits`` or ``float32_to_f16_bits``, chosen by ``fmt``."""
    return float32_to_bf16_bits(x) if check_format(fmt) == "bf16" else float32_to_f16_bits(x)


def activation_bits(a, fmt: str) -> np.ndarray:
    """Activations as 16-bit patterns of ``fmt``, the way a GEMM kernel receives them.

    - ``uint16`` arrays are taken as bit patterns already (no conversion);
    - ml_dtypes ``bfloat16`` arrays are viewed as their bits (``'bf16'``) or widened exactly to
      float32 and rounded (``'f16'``);
    - ``float16`` / ``float32`` arrays are rounded once, to nearest, ties to even.

    float64 is refused: a model hands the kernel 16-bit activations, and rounding float64 via
    float32 would round twice. Cast explicitly (``a.astype(np.float32)``) to say where it happens.
    """
    check_format(fmt)
    arr = np.asarray(a)
    if arr.dtype == np.uint16:
        return arr
    if arr.dtype.name == "bfloat16":
        return arr.view(np.uint16) if fmt == "bf16" else float32_to_f16_bits(arr.astype(np.float32))
    if arr.dtype in (np.float16, np.float32):
        return float32_to_bits(arr, fmt)
    raise ValueError(
        f"activations: expected float32, float16, bfloat16 or uint16 bit patterns, got dtype {arr.dtype}; "
        "cast float64 with .astype(np.float32) first"
    )


# ---------------------------------------------------------------------------- the block scale absorbs 2^offset


def folded_scale(scale_inv, fmt: str) -> np.ndarray:
    """The per-block scale a kernel multiplies in: ``scale_inv * 2^offset`` as float32.

    Multiplying by a power of two is exact in float32, so
    ``placed_value * folded_scale == decode(c) * scale_inv`` up to the single float32 rounding the
    plain product would have anyway. Domain: with BF16 the result overflows to inf once
    ``scale_inv >= 2^8`` (``2^8 * 2^120 = 2^128``), which is why the tensor-core GEMM restores the
    power of two on its partial sums instead (``fp8lab.simulators.gemm_mma``). F16 overflows only for
    ``scale_inv >= 2^120``, beyond any ``amax / 448``: the dequantize kernel and the SIMT GEMV fold it.
    """
    s = np.asarray(scale_inv)
    if s.dtype.kind != "f" and s.dtype.name != "bfloat16":
        raise ValueError(f"scale_inv: expected a float array, got dtype {s.dtype}")
    return s.astype(np.float32) * np.float32(2.0 ** EXPONENT_OFFSET[check_format(fmt)])


# ---------------------------------------------------------------------------- two codes -> one 32-bit register


def prmt(a, b, selector: int) -> np.ndarray:
    """PTX ``prmt.b32`` (CUDA ``__byte_perm(a, b, selector)``), default mode: a byte permute.

    The 8 source bytes are ``a``'s bytes 0..3 followed by ``b``'s bytes 0..3 (numbered 0..7);
    nibble ``i`` of ``selector`` (low nibble first) picks the source byte for result byte ``i``.
    """
    source = (np.asarray(b, dtype=np.uint64) << 32) | np.asarray(a, dtype=np.uint64)
    result = np.zeros_like(source)
    for out_byte in range(4):
        pick = (int(selector) >> (4 * out_byte)) & 0x7
        result |= ((source >> np.uint64(8 * pick)) & np.uint64(0xFF)) << np.uint64(8 * out_byte)
    return result.astype(np.uint32)


SPREAD_TO_HIGH_BYTES = 0x1404
"""``prmt`` selector that moves byte 0 of ``a`` to byte 1 and byte 1 to byte 3, zeros elsewhere
(byte index 4 is byte 0 of ``b = 0``): each code lands in the high byte of its 16-bit half."""
SIGN_MASK_X2 = 0x80008000
MAGNITUDE_MASK_X2 = 0x7F007F00


def codes_to_pairs(codes) -> np.ndarray:
    """Adjacent code pairs ``(c[2i], c[2i+1])`` of the last axis as one uint16 each, ``c[2i]`` in
    the low byte: what a kernel gets by loading 2 bytes of a weight row as one ``uint16``
    (little-endian). The last axis must have even length."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise ValueError(f"codes: expected E4M3 codes as uint8, got dtype {c.dtype}")
    if c.ndim == 0 or c.shape[-1] % 2:
        raise ValueError(f"codes: the last axis must have even length, got shape {c.shape}")
    return c[..., 0::2].astype(np.uint16) | (c[..., 1::2].astype(np.uint16) << 8)


def place_code_pair(pairs, fmt: str) -> np.ndarray:
    """Two codes in one uint16 (lower index in the low byte) -> one uint32 register holding two
    placed 16-bit patterns, lower index in the low half. What a kernel writes::

        uint32_t y = __byte_perm(pair, 0, 0x1404);       // bytes -> high byte of each half
        uint32_t r = (y & 0x80008000)                      // both signs, already at bit 15 / 31
                   | ((y & 0x7F007F00) >> SHIFT);          // SHIFT = 4 (bf16) or 1 (f16)

    Each code sits at bits 8..15 of its half after the ``prmt``; shifting right by 4 (1) puts its
    exponent+mantissa bits where ``<< 4`` (``<< 7``) from bit 0 would. The masks keep the
    shifted bits inside their own half. (On sm_90 the AND/OR pair fuses into one ``lop3``.)
    """
    p = np.asarray(pairs)
    if p.dtype != np.uint16:
        raise ValueError(f"pairs: expected two codes per uint16, got dtype {p.dtype}")
    shift = 8 - MAGNITUDE_SHIFT[check_format(fmt)]
    y = prmt(p.astype(np.uint32), 0, SPREAD_TO_HIGH_BYTES)
    return (y & np.uint32(SIGN_MASK_X2)) | ((y & np.uint32(MAGNITUDE_MASK_X2)) >> np.uint32(shift))


def split_register(registers) -> tuple[np.ndarray, np.ndarray]:
    """A uint32 register -> its ``(low, high)`` 16-bit halves as uint16 (lower index first)."""
    r = np.asarray(registers, dtype=np.uint32)
    return (r & 0xFFFF).astype(np.uint16), (r >> 16).astype(np.uint16)
