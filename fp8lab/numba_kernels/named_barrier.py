"""Named CTA barriers (``barrier.sync`` / ``barrier.arrive`` with an id and a thread count): a barrier between some
warps of a CTA, and a signal one group of warps gives another without waiting itself.

Device functions, no kernel. Checked in ``tests/numba_kernels/test_named_barrier.py`` (in the simulator: a sync
returns only after ``count`` threads have arrived, an arrive never waits, phases follow each other) and used by
``fp8lab.numba_kernels.gemm_wgmma_ss`` to hand shared-memory stages from a producer warpgroup to the consumers and
back (its sm_90a PTX holds the two instructions: ``tests/numba_kernels/test_kernels_compile.py``).

``sync_function(count)`` and ``arrive_function(count)`` return ``sync(barrier_id)`` and ``arrive(barrier_id)``
for barriers of ``count`` threads (a multiple of 32, a compile-time constant); ``barrier_id`` is a uint32 from 1 to
15 (0 is ``cuda.syncthreads``'s). A barrier completes a phase when ``count`` threads have arrived, by either call;
``sync`` then returns; ``arrive`` returns at once. So with ``count`` = 384, 128 producer threads that ``arrive``
let 256 consumer threads that ``sync`` go on. Whole warps only, converged (the hardware counts a warp's threads
when the warp executes the instruction), and a phase must complete before the same threads arrive again.

- On a GPU: inline PTX ``barrier.sync`` / ``barrier.arrive`` (the non-``.aligned`` forms: the warps of a barrier
  reach it at different instructions, one warpgroup's ``sync`` and another's ``arrive``).
- In the CUDA simulator: a per-block counter and condition variable per barrier id; a ``sync`` that waits longer
  than ``cudasim.TIMEOUT_S`` (a deadlock on the hardware) raises a ``RuntimeError`` naming the barrier.
"""

from __future__ import annotations

from .bits import SIMULATOR
from .warp import WARP_SIZE

MAX_ID = 15


def _check_count(count: int) -> int:
    if count < WARP_SIZE or count % WARP_SIZE or count > 1024:
        raise ValueError(f"count: a named barrier counts whole warps, 32 to 1024 threads, got {count}")
    return int(count)


if SIMULATOR:
    import threading
    import weakref

    from . import cudasim

    class _Phase:
        """One barrier id of one block: threads arrived in the current phase, and the phases completed."""

        def __init__(self):
            self.arrived = 0
            self.completed = 0
            self.condition = threading.Condition()

    _blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # block manager -> {barrier id: _Phase}
    _blocks_lock = threading.Lock()

    def _phase_of(barrier_id) -> _Phase:
        barrier_id = int(barrier_id)
        if not 1 <= barrier_id <= MAX_ID:
            raise RuntimeError(f"named barrier: id {barrier_id} outside 1..{MAX_ID} (0 is syncthreads')")
        manager = cudasim._current_thread()._manager
        with _blocks_lock:
            return _blocks.setdefault(manager, {}).setdefault(barrier_id, _Phase())

    def _arrive(barrier_id, count: int, wait: bool) -> None:
        phase = _phase_of(barrier_id)
        with phase.condition:
            mine = phase.completed
            phase.arrived += 1
            if phase.arrived == count:
                phase.arrived, phase.completed = 0, phase.completed + 1
                phase.condition.notify_all()
            elif wait and not phase.condition.wait_for(lambda: phase.completed != mine, timeout=cudasim.TIMEOUT_S):
                raise RuntimeError(f"named barrier {int(barrier_id)}: {phase.arrived} of {count} threads arrived "
                                   f"within {cudasim.TIMEOUT_S} s (a deadlock on the GPU)")

    def sync_function(count: int):
        count = _check_count(count)

        def sync(barrier_id):
            _arrive(barrier_id, count, wait=True)

        return sync

    def arrive_function(count: int):
        count = _check_count(count)

        def arrive(barrier_id):
            _arrive(barrier_id, count, wait=False)

        return arrive

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _statement_with_id(text: str):
        """A device function ``(barrier_id)`` (an integer, taken as 32 bits) running the PTX statement ``text`` with the id as ``$0`` (a
        memory clobber: loads and stores are not moved across it)."""

        @intrinsic
        def statement(typingctx, barrier_id):
            if not isinstance(barrier_id, types.Integer):
                return None

            def codegen(context, builder, signature, args):
                function = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
                value = context.cast(builder, args[0], signature.args[0], types.uint32)
                builder.call(ir.InlineAsm(function, text, "r,~{memory}", side_effect=True), [value])
                return context.get_dummy_value()

            return types.void(barrier_id), codegen

        return statement

    def sync_function(count: int):
        return _statement_with_id(f"barrier.sync $0, {_check_count(count)};")

    def arrive_function(count: int):
        return _statement_with_id(f"barrier.arrive $0, {_check_count(count)};")
