"""Bit reinterpretation inside kernels, the same calls on a GPU and in the CUDA simulator.

Device functions, no kernel. Checked in ``tests/numba_kernels/test_cudasim.py`` (the F16/BF16/F32
helpers, exactly) and through the kernels that use them.

Kernels that place E4M3 bits into BF16/F16/F32 patterns need to read an integer as a float
without conversion. On a GPU these are LLVM ``bitcast`` intrinsics (free: no instruction) and
``cvt`` for F16; in the simulator, where kernels are plain Python, they are NumPy views.

- ``u32_as_f32(u)``, ``f32_as_u32(x)``: uint32 <-> float32 bit patterns;
- ``bf16_bits_to_f32(h)``: a BF16 pattern (low 16 bits of ``h``) as float32 (exact);
- ``f16_bits_to_f32(h)``: an F16 pattern (low 16 bits of ``h``) as float32 (exact);
- ``f32_to_f16_bits(x)``: float32 to F16 bits, round to nearest even, overflow to inf, NaN to NaN
  (``cvt.rn.f16.f32`` through libdevice; in the simulator NumPy's float16 cast, which rounds the same way);
- ``e4m3x2_to_f16x2(pair)``: the two E4M3 codes in the low 16 bits of ``pair`` (code 0 in the low
  byte) as two F16 patterns (code 0 in the low half), exact, NaN codes to NaN: the hardware
  conversion ``cvt.rn.f16x2.e4m3x2`` (sm_89 and later: one instruction for two codes) as inline
  PTX; in the simulator, ``fp8lab.reference.e4m3.decode`` cast to float16 (every E4M3 value is an F16
  value, so the cast is exact);
- ``e4m3x2_high_to_f16x2(word)``: the same for the two codes in the high 16 bits of ``word`` (the PTX names the
  word's high half, so that no shift is spent on it);
- ``prmt(a, b, selector)``: PTX's byte permute ``prmt.b32`` (default mode): byte ``i`` of the result is byte
  ``selector >> 4 i & 7`` of the eight bytes ``b:a`` (``a`` bytes 0-3, ``b`` bytes 4-7), or, where bit 3 of that
  nibble is set, that byte's sign bit copied to all 8 bits; one instruction on a GPU;
- ``f32x2_to_f16x2(low, high)``: two float32 values as two F16 patterns (``low`` in the low half), each
  ``f32_to_f16_bits``: ``cvt.rn.f16x2.f32``, one instruction for two;
- ``f32_to_bf16_bits_rne(x)``: float32 to a BF16 pattern, nearest even, a NaN a quiet NaN of its sign (the rule the
  kernels' BF16 outputs follow; ``mathops`` re-exports it);
- ``f32x2_to_bf16x2(low, high)``: the same in BF16 (nearest, ties to even): ``cvt.rn.bf16x2.f32``; in the simulator
  ``f32_to_bf16_bits_rne``'s rule (a NaN becomes a quiet NaN of its sign; the hardware's NaN is canonical:
  NaN either way);
- ``max_nan(a, b)``: the larger of ``a`` and ``b``, NaN if either is NaN (``mathops.nan_max``'s rule): ``max.NaN.f32``,
  one instruction (a NaN result is then the canonical NaN, and ``max(-0, +0)`` may be either zero: neither changes a
  softmax that uses it).
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda, uint32

SIMULATOR = bool(config.ENABLE_CUDASIM)

if SIMULATOR:

    def u32_as_f32(u):
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)

    def f32_as_u32(x):
        return np.float32(x).view(np.uint32)

    def f16_bits_to_f32(h):
        return np.float32(np.uint16(int(h) & 0xFFFF).view(np.float16))

    def f32_to_f16_bits(x):
        with np.errstate(over="ignore"):
            return np.uint32(np.float32(x).astype(np.float16).view(np.uint16))

    def e4m3x2_to_f16x2(pair):
        from fp8lab.reference.e4m3 import decode

        codes = np.array([int(pair) & 0xFF, (int(pair) >> 8) & 0xFF], np.uint8)
        halves = decode(codes).astype(np.float16).view(np.uint16).astype(np.uint32)
        return np.uint32(halves[0] | (halves[1] << np.uint32(16)))

    def e4m3x2_high_to_f16x2(word):
        return e4m3x2_to_f16x2(int(word) >> 16)

    def f32x2_to_f16x2(low, high):
        return f32_to_f16_bits(low) | (f32_to_f16_bits(high) << np.uint32(16))

    def f32x2_to_bf16x2(low, high):
        return np.uint32(int(f32_to_bf16_bits_rne(low)) | (int(f32_to_bf16_bits_rne(high)) << 16))

    def max_nan(a, b):
        if a != a:
            return a
        return a if b <= a else b  # b > a, or b is NaN

    def prmt(a, b, selector):
        source = (int(a) & 0xFFFFFFFF) | ((int(b) & 0xFFFFFFFF) << 32)
        result = 0
        for i in range(4):
            nibble = (int(selector) >> (4 * i)) & 0xF
            byte = (source >> (8 * (nibble & 7))) & 0xFF
            if nibble & 8:
                byte = 0xFF if byte & 0x80 else 0
            result |= byte << (8 * i)
        return np.uint32(result)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _bitcast_u32_to_f32(typingctx, u):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(types.uint32), codegen

    @intrinsic
    def _bitcast_f32_to_u32(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @cuda.jit(device=True, inline=True)
    def u32_as_f32(u):
        return _bitcast_u32_to_f32(types.uint32(u))

    @cuda.jit(device=True, inline=True)
    def f32_as_u32(x):
        return _bitcast_f32_to_u32(types.float32(x))

    @cuda.jit(device=True, inline=True)
    def f16_bits_to_f32(h):
        # libdevice's __nv_half2float: one cvt.f32.f16, exact for every F16 value
        return libdevice.half2float(types.int16(h & 0xFFFF))

    @cuda.jit(device=True, inline=True)
    def f32_to_f16_bits(x):
        return types.uint32(libdevice.float2half_rn(x)) & types.uint32(0xFFFF)

    @intrinsic
    def _cvt_e4m3x2_f16x2(typingctx, pair):
        def codegen(context, builder, signature, args):
            i16 = builder.trunc(args[0], ir.IntType(16))
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(16)]), "cvt.rn.f16x2.e4m3x2 $0, $1;",
                               "=r,h")
            return builder.call(asm, [i16])

        return types.uint32(types.uint32), codegen

    @cuda.jit(device=True, inline=True)
    def e4m3x2_to_f16x2(pair):
        return _cvt_e4m3x2_f16x2(types.uint32(pair))

    @intrinsic
    def _cvt_high_e4m3x2_f16x2(typingctx, word):
        def codegen(context, builder, signature, args):
            text = "{ .reg .b16 low, high; mov.b32 {low, high}, $1; cvt.rn.f16x2.e4m3x2 $0, high; }"
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(32)]), text, "=r,r")
            return builder.call(asm, [args[0]])

        return types.uint32(types.uint32), codegen

    @cuda.jit(device=True, inline=True)
    def e4m3x2_high_to_f16x2(word):
        return _cvt_high_e4m3x2_f16x2(types.uint32(word))

    @intrinsic
    def prmt(typingctx, a, b, selector):
        if not all(isinstance(x, types.Integer) for x in (a, b, selector)):
            return None

        def codegen(context, builder, signature, args):
            words = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, signature.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 3), "prmt.b32 $0, $1, $2, $3;",
                               "=r,r,r,r")
            return builder.call(asm, words)

        return types.uint32(a, b, selector), codegen

    def _two_floats_intrinsic(text: str, result, swap: bool):
        """An intrinsic ``f(a, b)`` of two float32 values running the PTX ``text`` (``$0`` the result, ``$1``, ``$2``
        the sources: ``b, a`` where ``swap``: a two-half conversion puts its first source in the high half)."""
        result_ir = ir.FloatType() if result == types.float32 else ir.IntType(32)
        constraint = "=f,f,f" if result == types.float32 else "=r,f,f"

        @intrinsic
        def two_floats(typingctx, a, b):
            if not all(isinstance(x, types.Float) for x in (a, b)):
                return None

            def codegen(context, builder, signature, args):
                values = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
                asm = ir.InlineAsm(ir.FunctionType(result_ir, [ir.FloatType()] * 2), text, constraint)
                return builder.call(asm, values[::-1] if swap else values)

            return result(a, b), codegen

        return two_floats

    f32x2_to_f16x2 = _two_floats_intrinsic("cvt.rn.f16x2.f32 $0, $1, $2;", types.uint32, swap=True)
    f32x2_to_bf16x2 = _two_floats_intrinsic("cvt.rn.bf16x2.f32 $0, $1, $2;", types.uint32, swap=True)
    max_nan = _two_floats_intrinsic("max.NaN.f32 $0, $1, $2;", types.float32, swap=False)


@cuda.jit(device=True, inline=True)
def bf16_bits_to_f32(h):
    """A BF16 pattern is the high half of a float32 pattern."""
    return u32_as_f32((h & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def f32_to_bf16_bits_rne(x):
    """float32 to a BF16 bit pattern, round to nearest even; NaN stays a (quiet) NaN.

    The add-and-shift rounding (``(u + 0x7FFF + lsb) >> 16``) alone would carry a NaN into the sign bit or into
    infinity (the GPU's own NaN, ``0x7FFFFFFF``, becomes ``0x8000``, -0.0); so a NaN is handled first and keeps
    its sign: 0x7FC0 or 0xFFC0. The only BF16 rounding rule in the kernels (the simulator's ``f32x2_to_bf16x2``
    uses it too).
    """
    if x != x:
        return ((uint32(f32_as_u32(x)) >> 16) & 0x8000) | 0x7FC0
    u = uint32(f32_as_u32(x))
    rounding = 0x7FFF + ((u >> 16) & 1)
    return ((u + rounding) >> 16) & 0xFFFF
