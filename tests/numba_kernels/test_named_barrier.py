"""Named CTA barriers (``fp8lab.numba_kernels.named_barrier``) in the CUDA simulator.

Two groups of warps pass a value back and forth through shared memory, each side waiting on its own barrier for the
other's ``arrive``: every round must read the value of that round (a ``sync`` that returned early reads the last
round's, or the poison). A ``sync`` nobody arrives at is a clear error, and bad counts and ids are refused. The PTX
side is checked with the kernel that uses them (``test_kernels_compile.py``).
"""

import numpy as np
import pytest
from numba import cuda, int32, uint32

from fp8lab.numba_kernels import cudasim, named_barrier

pytestmark = pytest.mark.skipif(not named_barrier.SIMULATOR, reason="simulator twin")

ROUNDS = 12
HALF = 64  # two warps a side


def ping_pong_kernel():
    sync = named_barrier.sync_function(2 * HALF)
    arrive = named_barrier.arrive_function(2 * HALF)

    @cuda.jit
    def kernel(seen, seeds):
        box = cuda.shared.array(HALF, int32)
        t = cuda.threadIdx.x
        lane = t % HALF
        if t < HALF:  # the writer: round r's value, then signal the reader; wait for it to be read
            for r in range(ROUNDS):
                box[lane] = seeds[lane] + int32(r)
                arrive(uint32(1))
                sync(uint32(2))
        else:  # the reader: wait for round r's value, read it, hand the box back
            for r in range(ROUNDS):
                sync(uint32(1))
                seen[r, lane] = box[lane]
                arrive(uint32(2))

    return kernel


def test_each_round_reads_that_rounds_value():
    rng = np.random.default_rng(11)
    seeds = rng.integers(-1000, 1000, HALF, dtype=np.int32)
    seen = np.full((ROUNDS, HALF), np.iinfo(np.int32).min, np.int32)  # poisoned
    ping_pong_kernel()[1, 2 * HALF](seen, seeds)
    np.testing.assert_array_equal(seen, seeds[None, :] + np.arange(ROUNDS, dtype=np.int32)[:, None])


def test_a_sync_nobody_arrives_at_is_an_error(monkeypatch):
    monkeypatch.setattr(cudasim, "TIMEOUT_S", 0.5)
    sync = named_barrier.sync_function(64)

    @cuda.jit
    def waits_alone(out):
        if cuda.threadIdx.x < 32:
            sync(uint32(3))  # the other warp never arrives
        out[cuda.threadIdx.x] = 1

    with pytest.raises(RuntimeError, match="named barrier 3: 32 of 64 threads arrived"):
        waits_alone[1, 64](np.zeros(64, np.int32))


@pytest.mark.parametrize("count", [0, 48, 2048])
def test_a_count_of_no_whole_warps_is_refused(count):
    with pytest.raises(ValueError, match="count: a named barrier counts whole warps"):
        named_barrier.sync_function(count)


def test_barrier_zero_is_refused():
    arrive = named_barrier.arrive_function(32)

    @cuda.jit
    def uses_zero():
        arrive(uint32(0))

    with pytest.raises(RuntimeError, match="id 0 outside 1..15"):
        uses_zero[1, 32]()
