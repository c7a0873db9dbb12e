"""The simulator's warp intrinsics (fp8lab.numba_kernels.cudasim) and bit helpers (fp8lab.numba_kernels.bits).

Each intrinsic is checked against what CUDA specifies, computed here with NumPy; misuse that
would hang or be undefined on a GPU must raise a clear error in the simulator.
"""

import threading
import time

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.cudasim

from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the intrinsics)
from fp8lab.numba_kernels import bits, cp_async, mathops

FULL = 0xFFFFFFFF


@cuda.jit
def shuffles(x, out):
    lane = cuda.threadIdx.x % 32
    v = x[cuda.threadIdx.x]
    out[0, cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, v, 5)
    out[1, cuda.threadIdx.x] = cuda.shfl_up_sync(FULL, v, 3)
    out[2, cuda.threadIdx.x] = cuda.shfl_down_sync(FULL, v, 3)
    out[3, cuda.threadIdx.x] = cuda.shfl_sync(FULL, v, 7)
    out[4, cuda.threadIdx.x] = cuda.shfl_sync(FULL, v, lane + 33)  # src_lane wraps modulo 32
    total = v
    offset = 16
    while offset > 0:  # the butterfly reduction every kernel uses
        total += cuda.shfl_xor_sync(FULL, total, offset)
        offset //= 2
    out[5, cuda.threadIdx.x] = total


def test_shuffles_follow_cuda_semantics(rng):
    x = rng.standard_normal(64).astype(np.float32)  # two warps
    out = np.full((6, 64), np.nan, np.float32)
    shuffles[1, 64](x, out)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane
    np.testing.assert_array_equal(out[0], x[base + (lane ^ 5)])
    np.testing.assert_array_equal(out[1], np.where(lane >= 3, x[base + lane - 3], x))
    np.testing.assert_array_equal(out[2], np.where(lane + 3 < 32, x[np.minimum(base + lane + 3, 63)], x))
    np.testing.assert_array_equal(out[3], x[base + 7])
    np.testing.assert_array_equal(out[4], x[base + (lane + 1) % 32])
    # every lane ends with its warp's sum, in the butterfly's float32 order
    for w in range(2):
        assert np.all(out[5, 32 * w : 32 * w + 32] == out[5, 32 * w])
        np.testing.assert_allclose(out[5, 32 * w], x[32 * w : 32 * w + 32].sum(dtype=np.float64), rtol=1e-6)


@cuda.jit
def votes(pred, out):
    t = cuda.threadIdx.x
    p = pred[t]
    out[0, t] = cuda.ballot_sync(FULL, p)
    out[1, t] = cuda.any_sync(FULL, p)
    out[2, t] = cuda.all_sync(FULL, p)
    out[3, t] = cuda.all_sync(FULL, 1)
    cuda.syncwarp(FULL)
    out[4, t] = cuda.activemask()


def test_votes_and_activemask(rng):
    pred = (rng.random(32) < 0.4).astype(np.int32)
    out = np.zeros((5, 32), np.int64)
    votes[1, 32](pred, out)
    ballot = sum(1 << i for i in range(32) if pred[i])
    assert np.all(out[0] == ballot)
    assert np.all(out[1] == int(pred.any())) and np.all(out[2] == int(pred.all())) and np.all(out[3] == 1)
    assert np.all(out[4] == FULL)


@cuda.jit
def divergent_halves(x, out):
    """Lanes 0-15 and 16-31 reduce separately with disjoint masks, as divergent code does."""
    lane = cuda.threadIdx.x
    v = x[lane]
    if lane < 16:
        mask = 0x0000FFFF
    else:
        mask = 0xFFFF0000
    offset = 8
    while offset > 0:
        v += cuda.shfl_xor_sync(mask, v, offset)
        offset //= 2
    out[lane] = v


def test_disjoint_masks_meet_their_own_groups(rng):
    x = rng.integers(-100, 100, 32).astype(np.float32)
    out = np.zeros(32, np.float32)
    divergent_halves[1, 32](x, out)
    assert np.all(out[:16] == x[:16].sum()) and np.all(out[16:] == x[16:].sum())


@cuda.jit
def lane_exits_early(out):
    lane = cuda.threadIdx.x
    if lane == 5:
        return
    out[lane] = cuda.shfl_xor_sync(FULL, lane, 1)


@cuda.jit
def lane_waits_at_syncthreads(out):
    lane = cuda.threadIdx.x
    if lane == 3:
        cuda.syncthreads()
    else:
        out[lane] = cuda.shfl_xor_sync(FULL, lane, 1)
        cuda.syncthreads()


@cuda.jit
def caller_not_in_mask(out):
    out[cuda.threadIdx.x] = cuda.shfl_xor_sync(0x0000FFFF, 1, 1)


@cuda.jit
def reads_outside_mask(out):
    lane = cuda.threadIdx.x
    if lane < 16:
        out[lane] = cuda.shfl_xor_sync(0x0000FFFF, lane, 16)


@cuda.jit
def mask_beyond_the_warp(out):
    out[cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, 1, 1)


@pytest.mark.parametrize(
    "kernel, threads, message",
    [
        (lane_exits_early, 32, "lane 5 of warp 0 is named in mask 0xffffffff but exited without arriving"),
        (lane_waits_at_syncthreads, 32, "lane 3 of warp 0 .* waits at syncthreads"),
        (caller_not_in_mask, 32, r"calling lane \d+ of warp 0 is not in mask 0x0000ffff"),
        (reads_outside_mask, 32, "reads lane 1[0-9]|reads lane [0-9]+, which is not in mask"),
        (mask_beyond_the_warp, 20, "names lane 31, but warp 0 has only 20 lanes"),
    ],
)
def test_misuse_is_a_clear_error(kernel, threads, message):
    out = np.zeros(32, np.int64)
    with pytest.raises(RuntimeError, match=message):
        kernel[1, threads](out)


def test_f16_patterns_decode_exactly():
    patterns = np.arange(1 << 16, dtype=np.uint32)
    expected = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
    finite = np.isfinite(expected)
    sample = patterns[finite][::97]  # every exponent and many mantissas; the helper runs per value
    got = np.array([bits.f16_bits_to_f32(p) for p in sample], np.float32)
    np.testing.assert_array_equal(got, expected[sample])


def test_bf16_and_f32_bit_helpers(rng):
    u = rng.integers(0, 1 << 16, 2000, dtype=np.uint32)
    expected = (u << 16).view(np.float32)
    got = np.array([bits.bf16_bits_to_f32(h) for h in u], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    x = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-30, 30, 2000)).astype(np.float32)
    assert [int(bits.f32_as_u32(v)) for v in x[:50]] == x[:50].view(np.uint32).tolist()
    assert [bits.u32_as_f32(int(b)) for b in x[:50].view(np.uint32)] == x[:50].tolist()
    rounded = np.array([mathops.f32_to_bf16_bits_rne(v) for v in x], np.uint32)
    np.testing.assert_array_equal(rounded, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_paired_conversions_max_nan_and_the_high_code_pair(rng):
    """The flash prefill's helpers against independent oracles: two float32 values to an F16 pair (NumPy's float16
    cast) and to a BF16 pair (ml_dtypes), ``max_nan`` as ``np.maximum`` (NaN wins), and the E4M3 pair in a word's
    high half as ml_dtypes decodes it."""
    x = (rng.standard_normal(400) * 10.0 ** rng.uniform(-9, 9, 400)).astype(np.float32)
    x[:4] = [np.nan, -np.inf, 70000.0, -0.0]
    low, high = x[:200], x[200:]
    with np.errstate(over="ignore"):  # 70000 overflows F16: inf, as the conversion gives
        f16 = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    got = [int(bits.f32x2_to_f16x2(a, b)) for a, b in zip(low, high)]
    assert got[1:] == (f16[1:200] | (f16[201:] << 16)).tolist()
    assert np.isnan(np.uint16(got[0] & 0xFFFF).view(np.float16))
    bf16 = x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    got = [int(bits.f32x2_to_bf16x2(a, b)) for a, b in zip(low, high)]
    assert got[1:] == (bf16[1:200] | (bf16[201:] << 16)).tolist()
    assert np.isnan(np.uint16(got[0] & 0xFFFF).view(ml_dtypes.bfloat16))
    maxima = [bits.max_nan(a, b) for a, b in zip(low, high)]
    np.testing.assert_array_equal(np.array(maxima, np.float32), np.maximum(low, high))
    words = rng.integers(0, 1 << 32, 300, dtype=np.uint64).astype(np.uint32)
    decoded = words.view(np.uint8).reshape(-1, 4).view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
    want = decoded[:, 2].astype(np.uint32) | (decoded[:, 3].astype(np.uint32) << 16)
    assert [int(bits.e4m3x2_high_to_f16x2(w)) for w in words] == want.tolist()


@cuda.jit
def fused(a, b, c, out):
    i = cuda.threadIdx.x
    out[i] = cuda.fma(a[i], b[i], c[i])


def test_fma_rounds_once():
    """fma(641, 6700417, 2^56) = 2^56 + 2^33; two roundings would give 2^56."""
    a = np.array([641, 2665 * 2.0**-54], np.float32)
    b = np.array([6700417, 402905], np.float32)
    c = np.array([2.0**56, 1.0], np.float32)
    out = np.zeros(2, np.float32)
    fused[1, 2](a, b, c, out)
    assert out.tolist() == [2.0**56 + 2.0**33, 1 + 2.0**-23]


STRIDED_ROWS = cp_async.strided_copy_function("cg", 16, 3, 20, 8)  # 3 copies: shared step 20 words, source 8
WAIT_ALL = cp_async.wait_group_function(0)


@cuda.jit
def strided_rows(x, out):
    """Thread t copies 16 bytes from x[4 t + 8 i ..] into stage[4 t + 20 i ..], i = 0..2, then writes stage out."""
    stage = cuda.shared.array(80, np.uint32)
    t = cuda.threadIdx.x
    for i in range(20):
        stage[20 * t + i] = 0
    cuda.syncthreads()
    STRIDED_ROWS(stage, 4 * t, x, 4 * t)
    cp_async.commit_group()
    WAIT_ALL()
    cuda.syncthreads()
    for i in range(20):
        out[20 * t + i] = stage[20 * t + i]


def test_strided_copies_land_where_their_steps_say(rng):
    """``strided_copy_function``: copy ``i`` of each of 4 threads moves 16 bytes from ``source[element + 8 i]`` to
    ``shared[index + 20 i]`` (whole copies, no zero fill); the words between the copies stay as they were (0)."""
    x = rng.integers(1, 2**32, 64, dtype=np.uint32)
    out = np.full(80, 0xDEADBEEF, np.uint32)
    strided_rows[1, 4](x, out)
    expected = np.zeros(80, np.uint32)
    for t in range(4):
        for i in range(3):
            expected[4 * t + 20 * i: 4 * t + 20 * i + 4] = x[4 * t + 8 * i: 4 * t + 8 * i + 4]
    assert np.array_equal(out, expected)
    with pytest.raises(ValueError, match="cp.async.cg copies"):
        cp_async.strided_copy_function("cg", 4, 2, 1, 1)


@cuda.jit
def many_lanes_shuffle_at_once(out):
    out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, cuda.threadIdx.x, 1)


def test_lanes_still_starting_are_not_taken_for_exited():
    """Regression: a lane whose thread was created but not yet started once looked 'exited'."""
    out = np.zeros(512, np.int64)
    for _ in range(10):
        many_lanes_shuffle_at_once[2, 256](out)
    assert np.array_equal(out, np.tile(np.arange(256) ^ 1, 2))


@cuda.jit
def barrier_then_shuffle(out):
    cuda.syncthreads()
    out[cuda.threadIdx.x] = cuda.shfl_xor_sync(FULL, cuda.threadIdx.x, 1)


def test_lanes_not_yet_released_from_a_passed_barrier_are_not_a_deadlock(monkeypatch):
    """Regression: the simulator releases a barrier's threads one by one; a lane that passed it
    must wait for a neighbour still being released, not report a deadlock."""
    import threading
    import time

    original_set = threading.Event.set

    def slow_set(self):
        time.sleep(0.002)
        original_set(self)

    monkeypatch.setattr(threading.Event, "set", slow_set)
    out = np.zeros(64, np.int64)
    barrier_then_shuffle[1, 64](out)
    assert np.array_equal(out, np.arange(64) ^ 1)


@cuda.jit
def reverse_through_shared(x, out):
    buffer = cuda.shared.array(64, np.float32)
    buffer[cuda.threadIdx.x] = x[cuda.threadIdx.x]
    cuda.syncthreads()
    v = buffer[63 - cuda.threadIdx.x]
    cuda.syncthreads()
    buffer[cuda.threadIdx.x] = 2 * v
    cuda.syncthreads()
    out[cuda.blockIdx.x, cuda.threadIdx.x] = buffer[63 - cuda.threadIdx.x]


@cuda.jit
def fails_in_one_lane(out):
    cuda.syncthreads()
    if cuda.threadIdx.x == 37:
        out[1000] = 1  # out of bounds
    out[cuda.threadIdx.x] = 1


def test_the_block_manager_polls_and_keeps_the_simulators_semantics():
    """install() replaces the simulator's busy-polling block manager by fp8lab.numba_kernels.cudasim's (the
    numba-cuda it was written for is installed); threads meet at every barrier and an exception in one
    thread is raised with its thread and block."""
    from numba.cuda.simulator import kernel

    from fp8lab.numba_kernels import cudasim

    assert kernel.BlockManager.run is cudasim._run_block
    x = np.arange(64, dtype=np.float32)
    out = np.zeros((3, 64), np.float32)
    reverse_through_shared[3, 64](x, out)
    assert np.array_equal(out, np.tile(2 * x, (3, 1)))
    with pytest.raises(IndexError, match=r"tid=\[37, 0, 0\] ctaid=\[0, 0, 0\]"):
        fails_in_one_lane[1, 64](np.zeros(64, np.int64))


_SLOW_LANES = []  # the threads of slow_lane_beside_a_failing_one (the simulator runs the kernel as Python)


@cuda.jit
def slow_lane_beside_a_failing_one(out):
    if cuda.threadIdx.x == 1:
        _SLOW_LANES.append(threading.current_thread())
        time.sleep(0.3)  # still running when lane 0 fails
        _SLOW_LANES.append("finished")
    if cuda.threadIdx.x == 0:
        out[1000] = 1  # out of bounds


def test_a_failed_block_ends_its_threads_before_it_raises():
    """Regression: the block manager raised a thread's exception with the block's other threads still running
    (numba-cuda does not wait for them): they went on writing into the next launch's state (a later racecheck
    session counted their accesses)."""
    _SLOW_LANES.clear()
    out = np.zeros(64, np.int64)
    with pytest.raises(IndexError, match=r"tid=\[0, 0, 0\]"):
        slow_lane_beside_a_failing_one[1, 32](out)
    assert _SLOW_LANES[1:] == ["finished"] and not _SLOW_LANES[0].is_alive()


def test_finished_blocks_are_not_kept_alive():
    """Regression: the registry of simulated threads held every finished block (its threads, their warp
    states) for the rest of the process, thousands of objects per launch."""
    import gc

    from fp8lab.numba_kernels import cudasim

    gc.collect()
    before = (len(cudasim._threads), len(cudasim._warps), len(gc.get_objects()))
    out = np.zeros(512, np.int64)
    for _ in range(5):
        many_lanes_shuffle_at_once[2, 256](out)
    gc.collect()
    assert len(cudasim._threads) <= before[0] and len(cudasim._warps) <= before[1]
    assert len(gc.get_objects()) < before[2] + 1000  # 10 blocks of 256 threads: ~30,000 objects were kept


def test_division_by_a_reciprocal_is_exact_where_it_claims(rng):
    """``mathops.divide_by_reciprocal(n, reciprocal_u32(d))`` is ``n // d`` for every ``n * d < 2^32``: random cases,
    and the edges (``d`` 1, powers of two, ``n`` at multiples of ``d`` and just below, the largest ``n``)."""
    cases = [(n, 1) for n in (0, 1, 2**32 - 1)]
    for d in [2, 3, 7, 8, 16, 255, 256, 1000, 65535, 65536, 2**20 + 1]:
        top = (2**32 - 1) // d  # every n <= top has n * d < 2^32
        cases += [(n, d) for n in (0, 1, d - 1, d, d + 1, top - 1, top, (top // d) * d, (top // d) * d - 1) if 0 <= n <= top]
    for _ in range(2000):
        d = int(rng.integers(1, 2**20))
        cases.append((int(rng.integers(0, (2**32 - 1) // d + 1)), d))
    for n, d in cases:
        got = mathops.divide_by_reciprocal(np.uint32(n), mathops.reciprocal_u32(np.uint32(d)))
        assert int(got) == n // d, (n, d)
