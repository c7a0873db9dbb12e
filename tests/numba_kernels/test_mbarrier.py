"""fp8lab.numba_kernels.mbarrier in the CUDA simulator: phases and parities, copies that arrive, and misuse.

A producer warp and a consumer warp pass ``ITEMS`` values through a ring of ``SLOTS`` shared-memory slots with a
``full`` and an ``empty`` barrier per slot, as ``gemm_wgmma``'s producer warps do: the producer copies each item
in with ``cp.async`` and has the copies arrive, the consumer waits on the phase of the right parity, reads, and
arrives on ``empty``. Every item must come out once, in order, whatever the threads' interleaving; a wait on a
barrier never initialized, and a phase nobody completes, are errors.
"""

import numpy as np
import pytest
from numba import cuda, uint32, uint64

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import cp_async, cudasim, mbarrier

SLOTS, ITEMS, WIDTH = 2, 7, 32


def copy_item(smem, index, source, item, lane):
    """Elements ``lane`` and ``lane + 1`` of the item, copied by the even lanes (16 bytes, the size the kernels use);
    the odd lanes issue nothing, and their arrival still counts."""
    if lane % 2 == 0:
        cp_async.copy_16_cg(smem, index, source, item, lane, 16)


def ring_kernel(source, out, skip_init, consumer_waits_twice):
    thread = uint32(cuda.threadIdx.x)
    smem = cuda.shared.array(SLOTS * WIDTH + 2 * SLOTS, uint64)
    barriers = SLOTS * WIDTH  # full[s] = barriers + s, empty[s] = barriers + SLOTS + s
    if thread == 0 and not skip_init:
        for s in range(SLOTS):
            mbarrier.init(smem, barriers + s, WIDTH)  # the producer warp's 32 copy arrivals
            mbarrier.init(smem, barriers + SLOTS + s, WIDTH)  # the consumer warp's 32 arrivals
    cuda.syncthreads()
    lane = thread % WIDTH
    slot, phase = uint32(0), uint32(0)
    for item in range(ITEMS):
        if thread >= WIDTH:  # the producer warp
            if item >= SLOTS:
                mbarrier.wait(smem, barriers + SLOTS + slot, phase ^ 1)  # the consumer is done with the slot
            copy_item(smem, slot * WIDTH + lane, source, item, lane)
            cp_async.commit_group()
            mbarrier.arrive_when_copied(smem, barriers + slot)
        else:  # the consumer warp
            mbarrier.wait(smem, barriers + slot, phase)
            if consumer_waits_twice and item == ITEMS - 1:
                mbarrier.wait(smem, barriers + slot, phase ^ 1)  # a phase no one will complete
            out[item, lane] = smem[slot * WIDTH + lane]
            mbarrier.arrive(smem, barriers + SLOTS + slot)
        slot += 1
        if slot == SLOTS:
            slot, phase = uint32(0), phase ^ 1


def run(skip_init=False, consumer_waits_twice=False):
    rng = np.random.default_rng(1)
    source = rng.integers(1, 2 ** 62, size=(ITEMS, WIDTH), dtype=np.uint64)
    out = np.zeros((ITEMS, WIDTH), np.uint64)
    cuda.jit(ring_kernel)[1, 2 * WIDTH](source, out, skip_init, consumer_waits_twice)
    return source, out


@pytest.mark.cudasim
def test_items_pass_through_the_ring_once_and_in_order():
    source, out = run()
    np.testing.assert_array_equal(out, source)


@pytest.mark.cudasim
def test_a_wait_on_a_barrier_never_initialized_raises():
    with pytest.raises(Exception, match="never initialized"):
        run(skip_init=True)


@pytest.mark.cudasim
def test_a_phase_nobody_completes_is_reported_as_a_deadlock(monkeypatch):
    monkeypatch.setattr(cudasim, "TIMEOUT_S", 1.0)
    with pytest.raises(Exception, match="never completed"):
        run(consumer_waits_twice=True)
