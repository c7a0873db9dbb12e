"""Exact float32 fused multiply-add in NumPy: ``fma_f32(a, b, c) = fl32(a * b + c)``, one rounding.

Models the GPU's ``FFMA``; checked against exact rational arithmetic on random and adversarial cases
(``tests/simulators/test_gemv_simt.py``, ``test_gemm_mma.py``, ``test_splitkv.py``).

The simulators model kernels whose float32 chains are built from FFMA instructions, and the CUDA
simulator's ``cuda.fma`` (see ``fp8lab.numba_kernels.cudasim``) uses this too, so both views round alike.

NumPy has no fma, and ``float32(float64(a*b) + c)``
is *not* one: the product is exact in float64 (24 + 24 bits <= 53), but the sum is rounded to
float64 and then again to float32, and the two roundings can differ from one. Example:
``fma(641, 6700417, 2^56)`` is ``2^56 + 2^33`` (the exact value ``2^56 + 2^32 + 1`` lies just above
the float32 midpoint ``2^56 + 2^32``) but float64 drops the ``+ 1`` and the tie then rounds to even,
``2^56``. x86's 80-bit ``np.longdouble`` (64-bit mantissa) fails the same way, e.g. for
``fma(2693665, 1632737, 2^66)`` (``2693665 * 1632737 = 2^42 + 1``). So ``fma_f32`` rounds the
float64 sum once, and where that sum is a float32 tie (the only case where the second rounding
can go wrong) it recomputes with an error-free transformation (TwoSum) and round-to-odd
(Boldo & Melquiond, "Emulation of FMA and correctly rounded sums", IEEE TC 2008).
"""

from __future__ import annotations

import math
import struct

import numpy as np

_F32_TIE_MASK = np.int64(0x1FFFFFFF)  # the 29 float64 mantissa bits that float32 drops
_F32_TIE_BITS = np.int64(0x10000000)  # ... equal to exactly one half of a float32 ulp
_F32_SMALLEST_NORMAL = 2.0**-126


def fma_f32_round_to_odd(a, b, c) -> np.ndarray:
    """``fma(a, b, c)`` in float32 with one rounding, the slow and obviously correct way.

    The float64 product of two float32 numbers is exact. TwoSum gives the float64 sum ``total``
    and its exact error ``err`` (``total + err == a*b + c`` exactly). Rounding ``total`` *to odd*
    when ``err != 0`` (step one float64 ulp towards the exact value if the last bit is even) keeps
    "above / below / on a float32 midpoint" intact, so the final float64 -> float32 rounding is
    the correct single rounding (round-to-odd suffices because 53 >= 24 + 2).
    """
    a64, b64, c64 = (np.asarray(x, dtype=np.float64) for x in (a, b, c))
    product = a64 * b64  # exact
    total = product + c64
    c_part = total - product  # TwoSum (Knuth): err is exactly (product + c) - total
    err = (product - (total - c_part)) + (c64 - c_part)
    bits = np.asarray(total, dtype=np.float64).view(np.int64)
    inexact_and_even = (err != 0) & np.isfinite(err) & ((bits & 1) == 0)
    towards_larger_magnitude = (err > 0) == (total > 0)
    step = np.where(towards_larger_magnitude, 1, -1) * inexact_and_even
    with np.errstate(over="ignore"):
        return (bits + step).view(np.float64).astype(np.float32)


def fma_f32(a, b, c) -> np.ndarray:
    """Fused multiply-add of float32 arrays (broadcast together), rounded once: ``fl32(a*b + c)``.

    ``float32(float64(a*b) + c)`` double-rounds; it is wrong only where the float64 sum lands
    exactly on a float32 midpoint (or in float32's subnormal range, where midpoints sit elsewhere):
    between the float64 sum and the exact value lies no other float64 number, hence no midpoint.
    (A float64 sum of 0 is exact: the float32 product is never below 2^-298, a normal float64.)
    Those rare elements are recomputed by ``fma_f32_round_to_odd``.
    """
    a32, b32, c32 = (np.asarray(x, dtype=np.float32) for x in (a, b, c))
    if a32.ndim == b32.ndim == c32.ndim == 0:
        return fma_f32_scalar(a32[()], b32[()], c32[()])
    total = np.multiply(a32, b32, dtype=np.float64)
    total += c32
    with np.errstate(over="ignore"):
        result = total.astype(np.float32)
    bits = total.view(np.int64)
    suspect = (bits & _F32_TIE_MASK) == _F32_TIE_BITS
    suspect |= (np.abs(total) < _F32_SMALLEST_NORMAL) & (total != 0)  # a zero sum is exact
    suspect &= c32 != 0  # a*b + 0 is the exact product: one rounding (the first fma of every chain)
    flat = np.flatnonzero(suspect)
    if flat.size:
        where = np.unravel_index(flat, total.shape)
        pick = [np.broadcast_to(x, total.shape)[where] for x in (a32, b32, c32)]
        result[where] = fma_f32_round_to_odd(*pick)
    return result


def fma_f32_scalar(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """``fma_f32`` of three float32 scalars, the same bits, in Python floats (float64) instead of arrays.

    The CUDA simulator's ``cuda.fma`` runs this once per simulated instruction, where the array
    machinery would cost more than the arithmetic. The method is ``fma_f32_round_to_odd``'s, applied
    to every inexact sum: TwoSum gives the float64 sum's error; if it is not zero and the sum's last
    bit is even, the sum steps one float64 ulp towards the exact value (round to odd), and the final
    rounding to float32 is then the single correct one. NaN operands give the NaN the array form gives
    (the same float64 operations in the same order).
    """
    product = float(a) * float(b)  # exact: two float32 values
    addend = float(c)
    total = product + addend
    if addend != 0 and math.isfinite(total):
        c_part = total - product  # TwoSum (Knuth)
        err = (product - (total - c_part)) + (addend - c_part)
        if err != 0 and not struct.unpack("<q", struct.pack("<d", total))[0] & 1:
            total = math.nextafter(total, math.inf if err > 0 else -math.inf)
    if abs(total) >= _F32_ROUNDS_TO_INFINITY:  # rounds to an infinity: say so without NumPy's overflow warning
        return np.float32(math.copysign(math.inf, total))
    return np.float32(total)


_F32_ROUNDS_TO_INFINITY = float(np.finfo(np.float32).max) + 2.0**103  # the midpoint above float32's max: a tie that rounds up


# ---------------------------------------------------------------------------- the same, on large arrays in place



class FmaScratch:
    """Work arrays for ``fma_f32_into`` on arrays of one shape, allocated once and reused every step
    (fresh large temporaries would cost more than the arithmetic)."""

    def __init__(self, shape):
        self.total = np.empty(shape, np.float64)
        self.bits = np.empty(shape, np.uint32)


def fma_f32_into(a, b, c, out: np.ndarray, scratch: FmaScratch, fp8_bound: float | None = None,
                  may_be_tiny: bool = True) -> None:
    """``out[...] = fma_f32(a, b, c)``, the same bits, in fewer passes over large arrays.

    ``fma_f32``'s own method: ``a * b`` is exact in float64 (both are float32 values), the sum is
    rounded once to float64, then to float32. That second rounding is the fma's unless the float64
    sum was inexact *and* is a float32 tie or lies in float32's subnormal range. Here the ties and
    tiny sums are only suspects: TwoSum tells which of them are inexact, and ``fma_f32`` recomputes
    just those (exact sums are often ties in these chains, and round once, correctly). ``c`` and
    ``out`` are float32 arrays of the result's shape; ``out`` may be ``a`` or ``c``.

    What the caller knows saves the search for suspects:

    - ``fp8_bound``: ``b`` holds E4M3 values (at most 4 significant bits) and ``|a * b| <= fp8_bound``.
      Then ``a * b`` has at most 28 significant bits, and an inexact float64 sum can only be a
      float32 tie if ``c`` vanished in it (sum == ``a * b``, ``0 < |c| <= 2^-53 |a * b|``): any other
      inexact sum needs a gap of over 24 bits between the terms, which keeps it at least one float64
      ulp from every float32 midpoint (``tests/simulators/test_gemv_simt.py`` checks this on adversarial cases).
      So no tie needs checking when every nonzero ``|c|`` exceeds ``2^-53 fp8_bound`` (one reduction).
    - ``may_be_tiny=False``: every nonzero ``|a * b| >= 2^-125``. An inexact float64 sum has one term
      below half the other, so it is then at least ``2^-126``: not subnormal.
    """
    total = scratch.total
    np.multiply(a, b, out=total, dtype=np.float64)  # (dtype: float32 inputs would be multiplied in float32)
    total += c
    suspect = None
    if fp8_bound is None or smallest_nonzero_magnitude(c, scratch.bits) * 2.0**53 <= fp8_bound:
        suspect = (total.view(np.int64) & _F32_TIE_MASK) == _F32_TIE_BITS
    if may_be_tiny:
        tiny = np.abs(total) < _F32_SMALLEST_NORMAL
        suspect = tiny if suspect is None else suspect | tiny
    redo = None
    if suspect is not None and suspect.any():
        where = np.unravel_index(np.flatnonzero(suspect), suspect.shape)  # (np.nonzero is slow on n-d masks)
        a_, b_, c_ = (np.broadcast_to(x, total.shape)[where] for x in (a, b, c))
        product, rounded = np.multiply(a_, b_, dtype=np.float64), total[where]
        c_part = rounded - product  # TwoSum (Knuth): the float64 sum's exact error is zero iff it is exact
        inexact = (product - (rounded - c_part)) + (c_ - c_part) != 0
        if inexact.any():
            where = tuple(w[inexact] for w in where)
            redo = fma_f32(a_[inexact], b_[inexact], c_[inexact])
    np.copyto(out, total, casting="same_kind")
    if redo is not None:
        out[where] = redo


def smallest_nonzero_magnitude(x: np.ndarray, bits: np.ndarray | None = None) -> float:
    """The smallest nonzero ``|x|`` of a float32 array (``inf`` if there is none); ``bits``: uint32
    scratch of ``x``'s shape (allocated if not given).

    The bits of a float32 order as its magnitude does within each sign: as uint32 the smallest is
    the smallest ``x >= 0``, as int32 (negatives first) the negative nearest zero. Two reductions, no
    writes, unless a zero hides the answer: then ``bits(x) - 1`` with the sign bit cleared maps
    ``+-0`` to the largest value and every other ``x`` to ``bits(|x|) - 1``. (NaN bits exceed inf's.)
    """
    nonnegative = int(x.view(np.uint32).min(initial=0xFFFFFFFF))
    negative = int(x.view(np.int32).min(initial=0)) + 2**31
    if nonnegative not in (0, 0x80000000) and negative not in (0, 2**31):  # no +0, no -0
        smallest = min(nonnegative if nonnegative < 0x80000000 else 0xFFFFFFFF,
                       negative if negative < 2**31 else 0xFFFFFFFF)
    else:
        bits = np.empty(x.shape, np.uint32) if bits is None else bits
        np.subtract(x.view(np.uint32), np.uint32(1), out=bits)
        np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=bits)
        smallest = int(bits.min(initial=0x7FFFFFFF)) + 1
    return np.inf if smallest >= 0x7F800000 else float(np.uint32(smallest).view(np.float32))
