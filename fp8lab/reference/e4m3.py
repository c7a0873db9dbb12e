"""The OCP FP8 E4M3 format (``float8_e4m3fn``): exact decode and round-to-nearest-even encode.

An 8-bit code ``S.EEEE.MMM`` has 1 sign bit, 4 exponent bits (bias 7) and 3 mantissa bits:

- exponent field 0: subnormal, value ``(-1)^S * 2^-6 * M/8`` (so ``MIN_SUBNORMAL = 2^-9``);
- exponent field 1..15: normal, value ``(-1)^S * 2^(E-7) * (1 + M/8)``;
- ``S.1111.111`` (0x7F, 0xFF) is NaN. There are no infinities, so ``S.1111.110`` = 448 is the
  largest finite value (``MAX``). 240 is the maximum of the *fnuz* variant, not of this format.

Encoding rounds to nearest, ties to even. Overflow is a policy: ``saturate=True`` clamps to
+-448 (CUDA's ``__NV_SATFINITE``), ``saturate=False`` gives NaN (what ``torch`` and ``ml_dtypes``
casts do). With round-to-nearest-even, everything up to 464 (the midpoint between 448 and the
would-be 480) rounds to 448; above 464 is overflow.
"""

from __future__ import annotations

import numpy as np

from .checks import as_codes, as_float

EXPONENT_BITS = 4
MANTISSA_BITS = 3
EXPONENT_BIAS = 7
MAX = 448.0
"""Largest finite value, code 0x7E (S.1111.110)."""
MIN_NORMAL = 2.0**-6
"""Smallest positive normal value, code 0x08."""
MIN_SUBNORMAL = 2.0**-9
"""Smallest positive subnormal value, code 0x01."""
NAN_CODES = (0x7F, 0xFF)
"""The two NaN codes, S.1111.111."""
MAX_CODE = 0x7E
"""Code of ``MAX``: magnitudes above it are NaN."""


def fields(codes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split codes into their ``(sign, exponent, mantissa)`` bit fields, each a uint8 array."""
    c = as_codes("codes", codes)
    return c >> 7, (c >> MANTISSA_BITS) & 0xF, c & 0x7


def is_nan(codes) -> np.ndarray:
    """True where a code is one of the NaN codes (0x7F, 0xFF)."""
    return (as_codes("codes", codes) & 0x7F) == 0x7F


def decode(codes) -> np.ndarray:
    """Decode E4M3 codes (uint8, any shape) to float32, exactly; NaN codes give NaN.

    Every E4M3 value is exactly representable in float32, so no rounding happens here.
    """
    sign, exponent, mantissa = fields(codes)
    e = exponent.astype(np.int32)
    m = mantissa.astype(np.float64)
    normal = np.ldexp(1.0 + m / 8.0, e - EXPONENT_BIAS)
    subnormal = np.ldexp(m / 8.0, 1 - EXPONENT_BIAS)
    magnitude = np.where(e == 0, subnormal, normal)
    magnitude = np.where((e == 15) & (mantissa == 7), np.nan, magnitude)
    return np.where(sign == 1, -magnitude, magnitude).astype(np.float32)


def _working_dtype(dtype: np.dtype) -> type:
    """The float type ``encode`` computes in: long double for long double, else float64 (which
    holds every float16, bfloat16, float32 and float64 exactly)."""
    return np.longdouble if dtype == np.longdouble else np.float64


def encode(x, saturate: bool = True) -> np.ndarray:
    """Encode numbers (any float or integer dtype, any shape) to E4M3 codes (uint8), round to nearest, ties to even.

    ``saturate=True`` maps magnitudes that round above 448 (and +-inf) to +-448;
    ``saturate=False`` maps them to the NaN code of their sign, as ``torch`` and ``ml_dtypes`` do.
    NaN gives the NaN code with the input's sign bit. -0.0 gives 0x80.

    The input is rounded exactly once: float16/bfloat16/float32 (and integers, exact up to
    2^53, far beyond the range) are widened to float64, and ``np.longdouble`` stays long double,
    since narrowing it to float64 first would round twice (a value a hair above a tie would
    become the tie, then round to even).
    """
    v = np.asarray(x)
    v = as_float("x", v.astype(np.float64) if v.dtype.kind in "iu" else v, _working_dtype(v.dtype))
    sign = np.signbit(v)
    a = np.abs(v)
    finite = np.isfinite(a)
    a_finite = np.where(finite, a, 0.0)

    # Binade of |x|: |x| = f * 2^e with f in [0.5, 1), so floor(log2|x|) = e - 1. Below the
    # normal range (and for zero) the grid spacing stays that of the smallest binade, 2^-6 .. 2^-5.
    _, e = np.frexp(a_finite)
    smallest_binade = 1 - EXPONENT_BIAS
    binade = np.where(a_finite > 0, np.maximum(e.astype(np.int64) - 1, smallest_binade), smallest_binade)
    # In binade b the grid spacing is 2^(b - 3): |x| / spacing is exact (a power-of-two scale),
    # and np.rint rounds half to even, which is exactly round-to-nearest-even on the E4M3 grid.
    steps = np.rint(np.ldexp(a_finite, MANTISSA_BITS - binade)).astype(np.int64)
    # Codes are ordered like magnitudes: code = (binade + 6) * 8 + steps, where steps is in
    # [8, 16] for normals (16 carries into the next binade) and [0, 8] in the subnormal binade.
    magnitude_code = (binade + EXPONENT_BIAS - 1) * 8 + steps

    overflow = ~finite | (magnitude_code > MAX_CODE)
    overflow_code = MAX_CODE if saturate else 0x7F
    magnitude_code = np.where(overflow, overflow_code, magnitude_code)
    magnitude_code = np.where(np.isnan(v), 0x7F, magnitude_code)
    return (magnitude_code | (sign.astype(np.int64) << 7)).astype(np.uint8)


FLOAT32_MIN_NORMAL = 2.0**-126
"""float32's smallest normal number: the smallest scale ``scale_of_amax`` gives."""


def scale_of_amax(amax) -> np.ndarray:
    """The float32 scale that maps ``amax`` to ``MAX``: ``amax / 448`` in float32, 1 where
    ``amax == 0``, and never below ``2^-126``. Used per KV vector and per weight block.

    Why the floor: for ``amax < 448 * 2^-126`` the float32 quotient is subnormal (or 0) and
    rounded to few bits, possibly down, so ``amax / scale`` would overflow 448 (or divide by
    zero). With the power of two ``2^-126``, ``x / scale`` and ``decode(code) * scale`` are exact
    and ``|x| / scale < 448``, so the bound ``|error| <= 2^-4 |x| + 2^-10 scale`` still holds.
    A NaN or infinite ``amax`` gives a NaN or infinite scale (``NaN == 0`` is false, and
    ``np.maximum`` keeps a NaN).
    """
    amax = np.asarray(amax, np.float32)
    scale = np.maximum(amax / np.float32(MAX), np.float32(FLOAT32_MIN_NORMAL))
    return np.where(amax == 0, np.float32(1), scale).astype(np.float32)


def round_trip(x, saturate: bool = True) -> np.ndarray:
    """``decode(encode(x, saturate))``: the nearest E4M3 value of each input, as float32."""
    return decode(encode(x, saturate=saturate))


def code_class(code: int) -> str:
    """Name the kind of one code: ``'zero'``, ``'subnormal'``, ``'normal'`` or ``'nan'``."""
    c = int(as_codes("code", code))
    exponent, mantissa = (c >> 3) & 0xF, c & 0x7
    if exponent == 15 and mantissa == 7:
        return "nan"
    if exponent == 0:
        return "zero" if mantissa == 0 else "subnormal"
    return "normal"


CODES = np.arange(256, dtype=np.uint8)
"""All 256 codes, 0x00..0xFF."""
VALUES = decode(CODES)
"""The 256-code table: ``VALUES[c]`` is the float32 value of code ``c`` (NaN for 0x7F, 0xFF)."""
VALUES.setflags(write=False)
CODES.setflags(write=False)


def bits_string(code: int) -> str:
    """The bit fields of one code as ``'S.EEEE.MMM'``, e.g. ``bits_string(0x7E) == '0.1111.110'``."""
    c = int(as_codes("code", code))
    return f"{c >> 7:01b}.{(c >> 3) & 0xF:04b}.{c & 7:03b}"


def table() -> list[dict]:
    """The 256-code table as rows ``{code, bits, sign, exponent, mantissa, value, kind}``."""
    rows = []
    for c in range(256):
        rows.append(
            {
                "code": c,
                "bits": bits_string(c),
                "sign": c >> 7,
                "exponent": (c >> 3) & 0xF,
                "mantissa": c & 7,
                "value": float(VALUES[c]),
                "kind": code_class(c),
            }
        )
    return rows
