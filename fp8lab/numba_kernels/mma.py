"""The tensor-core ``mma.m16n8k16`` (BF16 or F16 in, float32 accumulate) as a device function.

A warp-collective device function, no kernel. Checked (``tests/numba_kernels/test_mma_helper.py``): its
simulator twin bit for bit against ``fp8lab.simulators.mma``, integer-valued fragments exactly, the
CUDA source compiled to the ``mma.sync`` instructions.

``mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)`` and ``mma_f16(...)`` return this lane's four
float32 results ``(d0, d1, d2, d3)`` of the warp-wide ``D = A @ B + C``. Every lane of the warp must
call it together (it is ``mma.sync``). Registers hold two 16-bit values each, lower index in the
low half, laid out as the PTX ISA's fragments (``fp8lab.simulators.mma.A_COORDS`` etc.).

- On a GPU: CUDA C++ with inline PTX (``mma_m16n8k16.cu``), linked through ``cuda.declare_device``; and
  ``mma_bf16_inline`` and ``mma_f16_inline``, the same instructions as LLVM inline assembly in the calling kernel (``gemv_mma``'s many
  call sites: link-time optimization stopped inlining the linked helper there). Its operands must be uint32
  and float32 already (the intrinsic does not convert).
- In the CUDA simulator: a warp-collective twin; the 32 lanes pool their registers and each takes
  its row of ``fp8lab.simulators.mma.mma_registers``, the model that the GEMM simulator uses too, so a
  kernel in the simulator matches ``fp8lab.simulators.gemm_mma`` bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numba import cuda, types

from .bits import SIMULATOR

SOURCE = Path(__file__).with_name("mma_m16n8k16.cu")
_SIGNATURE = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

if SIMULATOR:
    from fp8lab.simulators import mma as mma_model

    from . import cudasim

    def _warp_mma(fmt: str, pooled: dict) -> list:
        """The warp's ``mma`` on every lane's registers (``pooled``, by lane): each lane's four D values."""
        lanes = np.array([pooled[lane] for lane in range(cudasim.WARP_SIZE)], dtype=object)
        a = lanes[:, 0:4].astype(np.uint32)
        b = lanes[:, 4:6].astype(np.uint32)
        c = lanes[:, 6:10].astype(np.float32)
        d = mma_model.mma_registers(a, b, c, fmt)
        return [tuple(np.float32(x) for x in row) for row in d]

    def _mma_twin(fmt: str, registers: tuple):
        d = cudasim.exchange(f"mma_{fmt}", cudasim.FULL_MASK, tuple(registers),
                             combine=lambda pooled: _warp_mma(fmt, pooled))  # computed once for the warp
        return d[cudasim._current_thread().thread_id % cudasim.WARP_SIZE]

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_twin("bf16", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_twin("f16", (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    mma_bf16_inline = mma_bf16
    mma_f16_inline = mma_f16

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    mma_bf16 = cuda.declare_device("mma_m16n8k16_bf16", _SIGNATURE, link=str(SOURCE))
    mma_f16 = cuda.declare_device("mma_m16n8k16_f16", _SIGNATURE, link=str(SOURCE))

    def _inline_mma(fmt: str):
        """The ``mma`` of ``fmt`` ("bf16" or "f16") as inline PTX in the calling kernel (LLVM inline assembly)."""
        @intrinsic
        def mma_inline(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            def codegen(context, builder, signature, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                function = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(function, f"mma.sync.aligned.m16n8k16.row.col.f32.{fmt}.{fmt}.f32 "
                                   "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                result = builder.call(asm, list(args))
                values = [builder.extract_value(result, i) for i in range(4)]
                return context.make_tuple(builder, signature.return_type, values)

            return types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4)), codegen

        return mma_inline

    mma_bf16_inline = _inline_mma("bf16")
    """``mma_bf16`` as inline PTX in the calling kernel: no linked helper, so nothing depends on link-time
    optimization inlining it, which it stops doing in kernels with many call sites."""
    mma_f16_inline = _inline_mma("f16")
    """``mma_f16`` likewise."""
