"""Scalar device functions shared by the KV-cache and decode-attention kernels, in both modes.

Device functions, no kernel. Checked: ``e4m3_encode_saturating`` against ``fp8lab.reference.e4m3.encode``
in ``tests/numba_kernels/test_kv_cache_kernel.py``; ``divide_by_at_least_one`` against IEEE division in
``tests/numba_kernels/test_mathops.py`` (and on a GPU inside ``prefill_wgmma``); ``exp2`` is the simulators'
``exp2_f32`` in simulator mode, so the split-kv kernel tests check it bit for bit there.

- ``exp2(x)``: float32 ``2^x``, the one transcendental of the log2-domain softmax.

  - On a GPU: libdevice's ``__nv_exp2f`` (what CUDA C++'s ``exp2f`` is), which lowers to the
    hardware ``ex2.approx.f32`` (one ``MUFU.EX2`` plus a few instructions that keep subnormal
    results, since fp8lab compiles without flush-to-zero). The CUDA Math API documents a maximum
    error of 2 ulp. ``exp2(-inf) = +0`` (the PTX ISA specifies it for ``ex2``), ``exp2(+inf) = +inf``,
    ``exp2(NaN) = NaN``.
  - In the CUDA simulator: ``fp8lab.simulators.common.exp2_f32``, NumPy's float32 ``exp2``, the very
    function the simulators use, so a kernel in the simulator matches
    ``fp8lab.simulators.splitkv`` bit for bit. (NumPy's float32 ``exp2`` is not correctly rounded either;
    ``tests/simulators/test_splitkv.py`` checks it within 4 ulp.) The GPU and the simulator differ in the last
    bits of ``exp2``, which is why GPU results are checked against ``fp8lab.reference.attention`` by an
    error bound, not bit for bit.

- ``exp2_flush(x)``: ``exp2`` with results below ``2^-126`` (float32 subnormals) flushed to ``+0``: on a GPU the bare
  ``ex2.approx.ftz.f32`` (one ``MUFU.EX2``; ``exp2``'s subnormal path costs three more instructions a call, a tenth
  of the flash prefill's loop), in the CUDA simulator ``fp8lab.simulators.common.exp2_flush``. For a softmax weight
  ``2^(s - max)`` what it drops is below ``2^-126``: an F16 weight rounds it to 0 anyway, and a row's sum, which
  holds the row's largest weight (1), cannot resolve it.

- ``divide_u32(a, b)``: ``a // b`` of two unsigned 32-bit values as a 32-bit division (Numba widens integer
  arithmetic to 64 bits, and a 64-bit division is a subroutine call on the GPU, which, among other costs, makes
  ptxas serialize every ``wgmma`` of the kernel).

- ``reciprocal_u32(d)`` and ``divide_by_reciprocal(n, reciprocal)``: ``n // d`` in a kernel's loop as a multiply
  by ``ceil(2^32 / d)`` (computed once, with one division) taking the high word: exact while ``n * d < 2^32``.

- ``divide_by_at_least_one(x, d)``: float32 ``x / d`` rounded to nearest even, exactly what ``div.rn.f32`` gives,
  for ``d >= 1``, ``+inf`` or NaN (an attention row's sum of weights, which holds its largest weight, 1), without a
  division instruction: ptxas expands ``div.rn`` into a fast path and a *subroutine call* for the rare operands, and a
  kernel with a call gets every ``wgmma`` serialized (C7509). In float64: a reciprocal approximation
  (``rcp.approx.ftz.f64``; in the simulator ``1 / d`` with its low 32 bits cleared) refined by Newton's method, the
  quotient refined once, rounded to float32, then the one rounding decision that the approximation could get wrong
  settled exactly: the sign of ``x - m d`` (one fma, exact) for the midpoint ``m`` between the result and its
  neighbour towards the quotient. In the simulator the float64 fma is exact rational arithmetic.

- ``nan_max(a, b)``: ``max`` that keeps a NaN (like ``np.maximum``), so a NaN in the data reaches
  the output instead of being dropped by a comparison.

- ``e4m3_decode(code)``: the exact float32 value of an E4M3 code, by bit placement (no table).
- ``e4m3_encode_saturating(x)``: float32 to an E4M3 code, round to nearest even, saturating to
  +-448, by integer arithmetic on the float32 bit pattern; equal to
  ``fp8lab.reference.e4m3.encode(x, saturate=True)`` for every float32 (``tests/numba_kernels/test_kv_cache_kernel.py``).

Every function here is a plain Python function in the simulator (numpy scalars in, numpy scalars
out) and an inlined ``cuda.jit`` device function on a GPU; the integer ones are the same source in
both modes. NumPy scalars overflow silently at their width (``uint8 << 24`` is 0), so the integer
code widens to uint32 before it shifts.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from .bits import SIMULATOR, f32_as_u32, f32_to_bf16_bits_rne, u32_as_f32  # noqa: F401  (re-exported)

if SIMULATOR:
    from fp8lab.simulators.common import exp2_f32
    from fp8lab.simulators.common import exp2_flush as exp2_flush_f32

    def exp2(x):
        """float32 ``2^x``: the simulator's NumPy float32 exp2 (see the module docstring)."""
        return exp2_f32(x)

    def exp2_flush(x):
        """``exp2`` flushed to ``+0`` below ``2^-126``: the simulators' ``exp2_flush``."""
        return exp2_flush_f32(x)

    def divide_u32(a, b):
        return uint32(int(a) // int(b))

    def fma_f64(a, b, c):
        """float64 ``a * b + c`` with one rounding (exact rationals, then Python's correctly rounded float())."""
        from fractions import Fraction

        a, b, c = float(a), float(b), float(c)
        if not all(math.isfinite(v) for v in (a, b, c)):
            return float64(a * b + c)
        return float64(float(Fraction(a) * Fraction(b) + Fraction(c)))

    def reciprocal_approx_f64(d):
        """A model of ``rcp.approx.ftz.f64``: ``1 / d`` with the low 32 of its 52 fraction bits cleared (about 2^-20
        relative error), so that the refinement steps are exercised here too."""
        bits = np.float64(1.0 / float(d)).view(np.uint64) & np.uint64(0xFFFFFFFF00000000)
        return bits.view(np.float64)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    @cuda.jit(device=True, inline=True)
    def exp2(x):
        """float32 ``2^x``: libdevice ``__nv_exp2f`` = ``ex2.approx.f32`` (2 ulp); ``exp2(-inf) = 0``."""
        return libdevice.exp2f(x)

    @intrinsic
    def _ex2_approx_ftz(typingctx, x):
        if not isinstance(x, types.Float):
            return None

        def codegen(context, builder, signature, args):
            value = context.cast(builder, args[0], signature.args[0], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType()]), "ex2.approx.ftz.f32 $0, $1;",
                               "=f,f")
            return builder.call(asm, [value])

        return types.float32(x), codegen

    @cuda.jit(device=True, inline=True)
    def exp2_flush(x):
        """float32 ``2^x`` by ``ex2.approx.ftz.f32`` (one ``MUFU.EX2``): ``exp2``'s value, ``+0`` below ``2^-126``."""
        return _ex2_approx_ftz(x)

    @intrinsic
    def divide_u32(typingctx, a, b):
        """``a // b`` in 32 bits (both taken modulo 2^32): LLVM ``udiv i32``."""
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            a32, b32 = (context.cast(builder, v, t, types.uint32) for v, t in zip(args, signature.args))
            return builder.udiv(a32, b32)

        return types.uint32(a, b), codegen

    @cuda.jit(device=True, inline=True)
    def fma_f64(a, b, c):
        return cuda.fma(float64(a), float64(b), float64(c))

    @intrinsic
    def reciprocal_approx_f64(typingctx, d):
        """``rcp.approx.ftz.f64``: a fast approximate float64 reciprocal (no subroutine, unlike ``rcp.rn``)."""
        if not isinstance(d, types.Float):
            return None

        def codegen(context, builder, signature, args):
            value = context.cast(builder, args[0], signature.args[0], types.float64)
            function = ir.FunctionType(ir.DoubleType(), [ir.DoubleType()])
            return builder.call(ir.InlineAsm(function, "rcp.approx.ftz.f64 $0, $1;", "=d,d"), [value])

        return types.float64(d), codegen


@cuda.jit(device=True, inline=True)
def divide_by_at_least_one(x, d):
    """float32 ``x / d``, correctly rounded (ties to even), for ``d >= 1``, ``+inf`` or NaN, without a division
    instruction (see the module docstring: ``div.rn``'s slow path is a call, which serializes ``wgmma``)."""
    return finish_division(quotient_estimate(x, d), x, d)


@cuda.jit(device=True, inline=True)
def quotient_estimate(x, d):
    """float64 ``x / d`` within about an ulp of float64, for finite ``x != 0`` and finite ``d >= 1`` (any other
    operands give some float64 that ``finish_division`` ignores)."""
    big_x, big_d = float64(x), float64(d)
    r = reciprocal_approx_f64(big_d)
    r = fma_f64(r, fma_f64(-big_d, r, float64(1.0)), r)  # Newton: about 2^-40 relative
    r = fma_f64(r, fma_f64(-big_d, r, float64(1.0)), r)  # to float64's precision
    q = big_x * r
    return fma_f64(fma_f64(-q, big_d, big_x), r, q)  # within about an ulp of float64 of x / d


@cuda.jit(device=True, inline=True)
def finish_division(q, x, d):
    """``divide_by_at_least_one(x, d)`` from ``q = quotient_estimate(x, d)``: the special operands first, then
    ``round_quotient``."""
    if d != d or x != x:
        return d + x  # NaN
    if d == float32(math.inf):
        return x * float32(0.0)  # +-0 for finite x, NaN for +-inf
    if x == float32(0.0) or abs(x) == float32(math.inf):
        return x  # +-0 / d, +-inf / d (d finite >= 1)
    return round_quotient(q, float64(x), float64(d))


@cuda.jit(device=True, inline=True)
def round_quotient(q, big_x, big_d):
    """``x / d`` rounded to the nearest float32 (ties to even), from ``q``, any float64 within ``2^-30`` relative
    of it (``x``, ``d`` float32 values as float64, ``x / d`` a finite float32 quotient, ``d > 0``). ``q`` rounded to
    float32 is that, or its neighbour on ``q``'s side: which one the sign of ``x - m d`` says, ``m`` the midpoint
    between them (exact: ``m`` has 25 bits, ``d`` 24, ``x`` is within a float32 ulp of ``m d``); zero is a tie."""
    y = float32(q)
    t = float64(y)
    if q == t:
        return y  # x / d within about 2^-30 of a float32: not near a midpoint
    toward = f32_as_u32(y) + uint32(1) if abs(q) > abs(t) else f32_as_u32(y) - uint32(1)
    n = u32_as_f32(toward)  # y's neighbour on q's side
    middle = (t + float64(n)) * float64(0.5)
    above = fma_f64(-middle, big_d, big_x)  # exact: x - middle * d, the sign of x / d - middle
    if above == float64(0.0):
        return y if f32_as_u32(y) & uint32(1) == uint32(0) else n  # a tie: the even one
    if (above > float64(0.0)) == (float64(n) > t):
        return n
    return y


@cuda.jit(device=True, inline=True)
def reciprocal_u32(d):
    """``ceil(2^32 / d)`` as a uint64 for a uint32 ``d >= 1`` (``floor((2^32 - 1) / d) + 1``: one 32-bit division;
    at most ``2^32``), for ``divide_by_reciprocal``."""
    return uint64(divide_u32(uint32(0xFFFFFFFF), d)) + uint64(1)


@cuda.jit(device=True, inline=True)
def divide_by_reciprocal(n, reciprocal):
    """``n // d`` for a uint32 ``n`` with ``reciprocal = reciprocal_u32(d)``: the high word of ``n * ceil(2^32 / d)``,
    exact while ``n * d < 2^32`` (the product's excess over ``n / d`` is ``n e / (d 2^32)`` with ``e < d``, below
    ``1 / d``). A multiply and a shift where a division in a loop would be a subroutine call."""
    return uint32((uint64(n) * reciprocal) >> uint64(32))


@cuda.jit(device=True, inline=True)
def nan_max(a, b):
    """The larger of ``a`` and ``b``; NaN if either is NaN (``np.maximum``'s rule, not ``fmaxf``'s)."""
    if a != a:
        return a
    if b <= a:
        return a
    return b  # b > a, or b is NaN


# ---------------------------------------------------------------------------- E4M3 <-> float32

TWO_POW_120 = float32(2.0**120)
"""The power of two that E4M3's bit placement into float32 leaves out (see ``e4m3_decode``)."""


FLOAT32_BITS_OF_E4M3 = 0x87F00000
"""Where bit placement puts an E4M3 code in a float32 pattern: the sign at bit 31, the other 7 bits at 20..26."""


@cuda.jit(device=True, inline=True)
def e4m3_decode(code):
    """The exact float32 value of E4M3 ``code`` (the low 8 bits of an unsigned integer; higher bits ignored).

    Bit placement: the float32 pattern with the code's sign at bit 31 and its 7 exponent-and-mantissa
    bits at bits 20..26 is exactly ``decode(code) * 2^-120``, subnormal codes included (they land on
    float32 subnormals with the same mantissa), so one multiplication by ``2^120`` (exact) gives the
    value. To place the bits in few instructions, the code's byte goes to the top of a 32-bit
    integer and an arithmetic shift right by 4 moves it to bits 20..27 while copying the sign into
    bits 27..31; the mask keeps bit 31 and bits 20..26.

    The NaN codes (0x7F, 0xFF) come out as +-480, a finite number: ``paged_cache_write`` writes them
    only for a non-finite input, together with a NaN scale, which carries the NaN into the result.
    """
    top = int32(uint32(code) << 24)
    return u32_as_f32(uint32(top >> 4) & FLOAT32_BITS_OF_E4M3) * TWO_POW_120


F32_EXPONENT_OF_E4M3_ZERO = 120
"""float32 biased exponent minus E4M3 biased exponent (127 - 7): normals keep their bits, shifted."""
F32_BITS_OF_448 = 0x43E00000
"""448 = 1.75 * 2^8, E4M3's largest finite value: at and above it (and for +-inf) saturate."""
F32_BITS_OF_MIN_NORMAL = 0x3C800000
"""2^-6, E4M3's smallest normal value: below it the E4M3 grid is uniform in steps of 2^-9."""


@cuda.jit(device=True, inline=True)
def e4m3_encode_saturating(x):
    """The E4M3 code (0..255) nearest to float32 ``x``: ties to even, ``|x| >= 448`` and +-inf to +-448.

    NaN gives the NaN code with ``x``'s sign (0x7F or 0xFF); -0.0 gives 0x80. Three ranges of ``|x|``:

    - ``[448, inf]``: saturate to 0x7E. (448 < |x| <= 464 would round to 448 anyway; above 464
      is overflow, which ``saturate=True`` clamps.)
    - ``[2^-6, 448)``, E4M3 normals: keep the float32 exponent (rebased by 120) and the top 3 of the
      23 mantissa bits, rounding the other 20 to nearest even by adding ``0x7FFFF + lsb`` before the
      shift. A carry out of the mantissa increments the exponent field, which is the right result
      (the largest input here rounds to 448, never further).
    - ``[0, 2^-6)``: E4M3 subnormals, ``k * 2^-9`` for ``k = 0..8`` (8 is the smallest normal, code
      0x08, where the codes continue seamlessly). ``|x| = mant * 2^(e - 150)`` (``mant`` with its
      implicit bit; float32 subnormals use ``e = 1`` and no implicit bit), so ``|x| / 2^-9 =
      mant >> (141 - e)``, rounded to nearest even.
    """
    bits = int64(f32_as_u32(x))  # int64 throughout: Numba would widen mixed uint32/int64 to float64
    sign = (bits >> 31) << 7
    magnitude = bits & 0x7FFFFFFF
    if magnitude > 0x7F800000:  # NaN
        return sign | 0x7F
    if magnitude >= F32_BITS_OF_448:
        return sign | 0x7E
    if magnitude >= F32_BITS_OF_MIN_NORMAL:
        lsb = (magnitude >> 20) & 1
        rounded = magnitude + 0x7FFFF + lsb - (F32_EXPONENT_OF_E4M3_ZERO << 23)
        return sign | (rounded >> 20)
    exponent = magnitude >> 23
    mantissa = magnitude & 0x7FFFFF
    if exponent > 0:
        mantissa = mantissa | 0x800000
    else:
        exponent = int64(1)
    shift = 141 - exponent  # >= 21 here, since exponent <= 120
    if shift > 25:  # |x| < 2^-11: below half of 2^-9, rounds to zero
        return sign
    kept = mantissa >> shift
    halfway = int64(1) << (shift - 1)
    steps = (mantissa + halfway - 1 + (kept & 1)) >> shift
    return sign | steps

