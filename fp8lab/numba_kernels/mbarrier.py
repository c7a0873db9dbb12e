"""Shared-memory barriers (``mbarrier``, sm_80 and later): a producer hands buffers to consumers without a CTA barrier.

Device functions, no kernel. Checked: the simulator's semantics in ``tests/numba_kernels/test_mbarrier.py``; the
instructions in the sm_90a PTX in ``tests/numba_kernels/test_kernels_compile.py``; on a GPU through
``fp8lab.numba_kernels.gemm_wgmma``'s warp-specialized tiling.

An mbarrier is a 64-bit word of shared memory that counts arrivals. ``init(smem64, index, count)`` (one thread,
then a ``syncthreads`` before anyone uses it) sets it up for ``count`` arrivals per *phase*; when the phase's
``count``-th arrival comes, the phase completes and the next begins. ``arrive(smem64, index)`` is one arrival;
``arrive_when_copied(smem64, index)`` is one arrival that happens only once every ``cp.async`` the calling thread has
issued so far has landed (``cp.async.mbarrier.arrive.noinc``: the ``count`` must include these arrivals).
``wait(smem64, index, parity)`` returns once the phase of parity ``parity`` (0 for the first phase, 1 for the
second, 0 for the third, ...) has completed; it gives the waiting thread every write the arriving threads made
before they arrived (for ``arrive_when_copied``, the copies). That is how a producer and its consumers hand a
buffer back and forth without a barrier of the whole CTA: the consumers wait on a "full" barrier that the
producer's copies arrive on, and the producer waits on an "empty" barrier the consumers arrive on when done.

(No ``setmaxnreg`` here, the register hand-over between warpgroups that CUTLASS pairs with this: numba-cuda links
PTX through nvJitLink, whose ptxas drops it, "(C7504) 'setmaxnreg' ignored to maintain compatibility across
compilation units". ``gemm_wgmma`` uses producer *warps* and a register cap instead.)

- On a GPU: inline PTX; ``wait`` loops on ``mbarrier.try_wait.parity`` (which itself suspends the thread for a
  while before it reports the phase incomplete).
- In the CUDA simulator: the barrier's state lives beside the block's shared memory (keyed by address), under a lock;
  ``wait`` sleeps until the phase completes and raises ``RuntimeError`` after ``cudasim.TIMEOUT_S`` (a deadlock on
  a GPU), as does an arrival on a barrier never initialized. ``arrive_when_copied`` lands the thread's copies (the
  latest moment the hardware may) and then arrives.
"""

from __future__ import annotations

from .bits import SIMULATOR

if SIMULATOR:
    import threading
    import time
    import weakref

    import numpy as np

    from . import cudasim

    _condition = threading.Condition()
    # Per block (its simulator manager, held weakly): byte address in shared memory -> [count, pending, phase]. Per
    # block, so that a launch never sees the barriers an earlier block left at the same address.
    _barriers: "weakref.WeakKeyDictionary[object, dict[int, list[int]]]" = weakref.WeakKeyDictionary()

    def _block_barriers() -> dict[int, list[int]]:
        return _barriers.setdefault(cudasim._current_thread()._manager, {})

    def _address(smem, index) -> int:
        array = np.asarray(smem)
        return array.__array_interface__["data"][0] + int(index) * array.dtype.itemsize

    def init(smem, index, count):
        if int(count) < 1:
            raise RuntimeError(f"mbarrier.init: count must be at least 1, got {count}")
        with _condition:
            _block_barriers()[_address(smem, index)] = [int(count), int(count), 0]

    def _state(smem, index, op: str) -> list[int]:
        state = _block_barriers().get(_address(smem, index))
        if state is None:
            raise RuntimeError(f"{op}: the mbarrier at shared element {index} was never initialized")
        return state

    def arrive(smem, index):
        with _condition:
            state = _state(smem, index, "mbarrier.arrive")
            state[1] -= 1
            if state[1] == 0:  # the phase completes; the next one expects `count` arrivals again
                state[1], state[2] = state[0], state[2] + 1
                _condition.notify_all()

    def arrive_when_copied(smem, index):
        from .cp_async import land_all

        land_all()
        arrive(smem, index)

    def wait(smem, index, parity):
        deadline = time.monotonic() + cudasim.TIMEOUT_S
        with _condition:
            while _state(smem, index, "mbarrier.wait")[2] % 2 == int(parity) % 2:  # that phase is still the current one
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mbarrier.wait: the phase of parity {parity} of the mbarrier at shared element "
                                       f"{index} never completed (a deadlock on a GPU)")
                _condition.wait(0.01)

else:
    from llvmlite import ir
    from numba import types, uint32
    from numba.cuda.extending import intrinsic

    from .gemm_mma import inlined_device_function
    from .wgmma import _shared_address_of

    def _barrier_address(context, builder, signature, args):
        """The shared-window address of ``smem[index]`` (8-byte elements)."""
        base = _shared_address_of(context, builder, signature.args[0], args[0])
        index = context.cast(builder, args[1], signature.args[1], types.uint32)
        return builder.add(base, builder.shl(index, ir.Constant(ir.IntType(32), 3)))

    def _barrier_statement(text: str, with_value: bool):
        """An intrinsic ``f(smem64, index[, value])`` running ``text`` with ``$0`` the barrier's address and ``$1``
        the value."""
        if with_value:
            @intrinsic
            def statement(typingctx, smem, index, value):
                if not (isinstance(smem, types.Array) and smem.dtype.bitwidth == 64):
                    return None

                def codegen(context, builder, signature, args):
                    address = _barrier_address(context, builder, signature, args)
                    value_ = context.cast(builder, args[2], signature.args[2], types.uint32)
                    function = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(32)])
                    builder.call(ir.InlineAsm(function, text, "r,r,~{memory}", side_effect=True), [address, value_])
                    return context.get_dummy_value()

                return types.void(smem, index, value), codegen
        else:
            @intrinsic
            def statement(typingctx, smem, index):
                if not (isinstance(smem, types.Array) and smem.dtype.bitwidth == 64):
                    return None

                def codegen(context, builder, signature, args):
                    address = _barrier_address(context, builder, signature, args)
                    function = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
                    builder.call(ir.InlineAsm(function, text, "r,~{memory}", side_effect=True), [address])
                    return context.get_dummy_value()

                return types.void(smem, index), codegen
        return statement

    init = _barrier_statement("mbarrier.init.shared::cta.b64 [$0], $1;", with_value=True)
    arrive = _barrier_statement("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [$0]; }", with_value=False)
    arrive_when_copied = _barrier_statement("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", with_value=False)

    @intrinsic
    def _try_wait(typingctx, smem, index, parity):
        """1 if the phase of parity ``parity`` has completed (after the instruction's own suspended wait), else 0."""
        if not (isinstance(smem, types.Array) and smem.dtype.bitwidth == 64):
            return None

        def codegen(context, builder, signature, args):
            address = _barrier_address(context, builder, signature, args)
            parity_ = context.cast(builder, args[2], signature.args[2], types.uint32)
            function = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ir.IntType(32)])
            text = ("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }")
            return builder.call(ir.InlineAsm(function, text, "=r,r,r,~{memory}", side_effect=True), [address, parity_])

        return types.uint32(smem, index, parity), codegen

    @inlined_device_function
    def wait(smem, index, parity):
        while _try_wait(smem, index, parity) == uint32(0):
            pass
