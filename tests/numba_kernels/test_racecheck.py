"""``fp8lab.numba_kernels.racecheck``: shared-memory races found in the CUDA simulator.

Planted races (small kernels written here, each with a twin that has the missing barrier and must run
clean): a read of a neighbour's element before the barrier (read-after-write), a stage overwritten
before every thread has read it (write-after-read), a tree reduction that reads a partial one level too
early, a warp-synchronous exchange without ``syncwarp``, two threads writing one element, a
``cp.async`` copy read by another thread after its own wait but before a barrier, and a plain read
beside atomics. Each report names the kind, the array, the element, both threads and both source
lines. Then every fp8lab kernel that uses shared memory runs clean under the checker at tiny sizes,
with its result still bit for bit its simulator's (the checker changes nothing it checks).
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import pytest
from helpers.attention import filled_cache
from numba import cuda, float32, int32

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import cp_async, racecheck
from fp8lab.simulators import dense as sim_dense

pytestmark = pytest.mark.cudasim

WAIT_ALL = cp_async.wait_group_function(0)


def line_of(function, text: str) -> int:
    """The source line of ``function`` that holds ``text``."""
    lines, first = inspect.getsourcelines(function.py_func if hasattr(function, "py_func") else function)
    return first + next(i for i, line in enumerate(lines) if text in line)


# ---------------------------------------------------------------------------- planted races


@cuda.jit
def neighbour_sum(x, out, barrier):
    buf = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    buf[t] = x[t]  # the write
    if barrier:
        cuda.syncthreads()
    out[t] = buf[t] + buf[(t + 1) % 64]  # the neighbour's read


@cuda.jit
def staged_sums(x, out, barrier):
    """Two chunks through one stage buffer: the second overwrites the stage while a neighbour may still read it."""
    stage = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    acc = float32(0)
    for chunk in range(2):
        stage[t] = x[chunk * 64 + t]
        cuda.syncthreads()
        acc += stage[(t + 1) % 64]
        if barrier:
            cuda.syncthreads()  # every thread is done reading before the stage is refilled
    out[t] = acc


@cuda.jit
def tree_sum(x, out, skip_level):
    partial = cuda.shared.array(64, float32)
    t = cuda.threadIdx.x
    partial[t] = x[t]
    cuda.syncthreads()
    width = 32
    level = 0
    while width > 0:
        if t < width:
            partial[t] += partial[t + width]
        if level != skip_level:
            cuda.syncthreads()
        width //= 2
        level += 1
    if t == 0:
        out[0] = partial[0]


@cuda.jit
def warp_exchange(x, out, sync):
    buf = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x
    buf[lane] = x[lane]
    if sync:
        cuda.syncwarp()
    out[lane] = buf[lane ^ 1]


@cuda.jit
def everyone_writes_one(out, use_atomic, read_too):
    cell = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    if t == 0:
        cell[0] = 0
    cuda.syncthreads()
    if use_atomic:
        cuda.atomic.add(cell, 0, 1)
        if read_too and t == 5:
            out[1] = cell[0]  # a plain read beside the others' atomics
    else:
        cell[0] = t
    cuda.syncthreads()
    if t == 0:
        out[0] = cell[0]


@cuda.jit
def last_atomic_then_read(out, done):
    """Thread 5 adds last (it spins until the other seven have added) and then reads the cell plainly: its
    own atomic is the cell's latest write, yet the read races with the other seven's."""
    cell = cuda.shared.array(1, int32)
    t = cuda.threadIdx.x
    if t == 0:
        cell[0] = 0
    cuda.syncthreads()
    if t != 5:
        cuda.atomic.add(cell, 0, 1)
        cuda.atomic.add(done, 0, 1)
    else:
        while cuda.atomic.add(done, 0, 0) < 7:  # the simulator's threads are host threads: this waits
            pass
        cuda.atomic.add(cell, 0, 1)
        out[1] = cell[0]


@cuda.jit
def async_neighbour(x, out, barrier):
    stage = cuda.shared.array(128, float32)
    t = cuda.threadIdx.x
    cp_async.copy_16_cg(stage, 4 * t, x, 0, 4 * t, 16)  # lands at this thread's wait
    cp_async.commit_group()
    WAIT_ALL()
    if barrier:
        cuda.syncthreads()
    out[t] = stage[(4 * t + 4) % 128]  # the next thread's copy


@cuda.jit
def dynamic_neighbour(x, out, barrier):
    words = cuda.shared.array(0, float32)
    t = cuda.threadIdx.x
    words[t] = x[t]
    if barrier:
        cuda.syncthreads()
    out[t] = words[(t + 3) % 32]


def test_a_read_before_the_barrier_is_a_read_after_write_race(rng):
    x = rng.standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    with racecheck.checking():
        neighbour_sum[1, 64](x, out, True)
        np.testing.assert_array_equal(out, x + np.roll(x, -1))
        with pytest.raises(racecheck.SharedMemoryRace) as race:
            neighbour_sum[1, 64](x, out, False)
    message = str(race.value)
    assert "race on shared array allocated at" in message and __file__ in message
    write, read = line_of(neighbour_sum, "# the write"), line_of(neighbour_sum, "# the neighbour's read")
    assert f"{__file__}:{write}" in message and f"{__file__}:{read}" in message
    assert ("read-after-write" in message) or ("write-after-read" in message)  # whichever thread ran first
    assert "thread (" in message and "element " in message


def test_refilling_a_stage_before_everyone_read_it(rng):
    x = rng.standard_normal(128).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    with racecheck.checking():
        staged_sums[1, 64](x, out, True)
        np.testing.assert_allclose(out, np.roll(x[:64], -1) + np.roll(x[64:], -1), rtol=1e-6)
        with pytest.raises(racecheck.SharedMemoryRace, match="write-after-read|read-after-write"):
            staged_sums[1, 64](x, out, False)


def test_a_reduction_that_reads_a_partial_one_level_early(rng):
    x = rng.standard_normal(64).astype(np.float32)
    out = np.full(1, np.nan, np.float32)
    with racecheck.checking():
        tree_sum[1, 64](x, out, -1)
        np.testing.assert_allclose(out[0], x.astype(np.float64).sum(), rtol=1e-5)
        for level in (0, 2):
            with pytest.raises(racecheck.SharedMemoryRace):
                tree_sum[1, 64](x, out, level)


def test_a_warp_synchronous_exchange_needs_syncwarp(rng):
    x = rng.standard_normal(32).astype(np.float32)
    out = np.full(32, np.nan, np.float32)
    with racecheck.checking():
        warp_exchange[1, 32](x, out, True)
        np.testing.assert_array_equal(out, x[np.arange(32) ^ 1])
        with pytest.raises(racecheck.SharedMemoryRace, match="no syncthreads or syncwarp"):
            warp_exchange[1, 32](x, out, False)


def test_writers_of_one_element_and_atomics():
    out = np.full(2, -1, np.int32)
    with racecheck.checking():
        with pytest.raises(racecheck.SharedMemoryRace, match="write-after-write"):
            everyone_writes_one[1, 8](out, False, False)
        everyone_writes_one[1, 8](out, True, False)  # atomics are ordered among themselves
        assert out[0] == 8
        with pytest.raises(racecheck.SharedMemoryRace):
            everyone_writes_one[1, 8](out, True, True)
        with pytest.raises(racecheck.SharedMemoryRace, match="read-after-write"):
            last_atomic_then_read[1, 8](out, np.zeros(1, np.int32))


def test_a_cp_async_copy_is_a_write_when_its_wait_lands_it(rng):
    x = rng.standard_normal((1, 128)).astype(np.float32)
    out = np.full(32, np.nan, np.float32)
    with racecheck.checking():
        async_neighbour[1, 32](x, out, True)
        np.testing.assert_array_equal(out, x[0, (4 * np.arange(32) + 4) % 128])
        with pytest.raises(racecheck.SharedMemoryRace):
            async_neighbour[1, 32](x, out, False)


def test_dynamic_shared_memory_and_perturbed_schedules(rng):
    x = rng.standard_normal(32).astype(np.float32)
    out = np.full(32, np.nan, np.float32)
    with racecheck.checking(perturb=3):
        dynamic_neighbour[1, 32, 0, 128](x, out, True)
        np.testing.assert_array_equal(out, np.roll(x, -3))
        with pytest.raises(racecheck.SharedMemoryRace, match="dynamic shared memory"):
            dynamic_neighbour[1, 32, 0, 128](x, out, False)


def test_off_outside_checking_and_only_in_the_simulator(rng):
    x = rng.standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    neighbour_sum[1, 64](x, out, False)  # the race is there, but nothing checks it
    assert np.all(np.isfinite(out))


@cuda.jit
def two_arrays(x, out):
    a = cuda.shared.array(32, float32)
    b = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    a[t] = x[t]
    b[t] = 2 * x[t]
    cuda.syncthreads()
    out[t] = a[t] + b[(t + 1) % 32]


def test_shared_arrays_stay_apart_checked_and_after_checking(rng):
    """Each ``cuda.shared.array`` line is its own array, while checking and in unchecked launches after it (the
    checker replaces the simulator's allocation, which finds its caller on the stack)."""
    x = rng.standard_normal(32).astype(np.float32)
    want = x + 2 * np.roll(x, -1)
    for checked in (True, False):
        out = np.full(32, np.nan, np.float32)
        with racecheck.checking() if checked else contextlib.nullcontext():
            two_arrays[1, 32](x, out)
        np.testing.assert_array_equal(out, want)


def test_blocks_start_afresh(rng):
    """Blocks run one after another; a later block's thread never races with an earlier block's."""
    x = rng.standard_normal(64).astype(np.float32)
    out = np.full(64, np.nan, np.float32)
    with racecheck.checking():
        neighbour_sum[3, 64](x, out, True)
    np.testing.assert_array_equal(out, x + np.roll(x, -1))


# ---------------------------------------------------------------------------- fp8lab's kernels run clean


def test_split_kv_decode_and_combine(rng):
    from fp8lab.numba_kernels import splitkv
    from fp8lab.reference import strategies as fst
    from fp8lab.simulators import splitkv as sk

    lens = np.array([9], np.int32)  # 3 blocks of 4: the last one partly filled
    tables = np.array([[2, 0, 3]], np.int32)
    layout = fst.PagedKVLayout(2, 1, 32, 4, 4, tables, lens)
    data = layout.random_data(rng, fp8=True)
    for splits in (1, 2):  # the split kernel alone, then with the combine
        out = np.full(data.q.shape, np.nan, np.float32)
        with racecheck.checking() as seen:
            splitkv.paged_decode(*data.decode_args()[:6], out, data.k_scale, data.v_scale, num_splits=splits)
        assert seen.total > 0 and all(name.startswith("allocated at") and "splitkv.py" in name for name in seen.accesses)
        np.testing.assert_array_equal(out.view(np.uint32),
                                      sk.paged_decode(*data.decode_args(), num_splits=splits).view(np.uint32))


def test_prefill(rng):
    from helpers.attention import reference_prefill

    from fp8lab.numba_kernels import prefill

    context, query = np.array([5], np.int32), np.array([2], np.int32)
    ((k, k_scale), (v, v_scale)), tables = filled_cache(rng, context, 4, 1, 32, "fp8")
    q = rng.standard_normal((int(query.sum()), 2, 32)).astype(np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    with racecheck.checking() as seen:
        prefill.paged_prefill(q, k, v, tables, context, query, 32**-0.5, out, k_scale, v_scale)
    assert seen.total > 0
    want = reference_prefill(q, k, v, k_scale, v_scale, tables, context, query, 32**-0.5)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_norms_and_argmax(rng):
    from fp8lab.numba_kernels import layers

    x = rng.standard_normal((2, 300)).astype(np.float32)  # past the warp-per-row size: a CTA per row
    weight = rng.standard_normal(300).astype(np.float32)
    residual = rng.standard_normal((2, 300)).astype(np.float32)
    out = np.full_like(x, np.nan)
    with racecheck.checking() as seen:
        layers.rms_norm(x, weight, 1e-6, out)
        want = sim_dense.rms_norm(x, weight, 1e-6, layers.rms_norm_threads_per_row(300))
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
        summed = residual.copy()
        layers.add_rms_norm(x, summed, weight, 1e-6, out)
        np.testing.assert_array_equal(summed, residual + x)
        logits = rng.standard_normal((2, 150)).astype(np.float32)
        ids = np.full(2, -7, np.int32)
        layers.argmax_rows(logits, ids, logits_per_cta=40)  # 4 CTAs per row, the last one merges
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))
    assert len(seen.accesses) >= 3  # the norms' warp totals, the argmax's best values and indices

def test_the_norm_kernel_for_long_rows(rng):
    """Rows past the register kernels' reach (n > 8192): the loop kernel, 1024 threads reading 32 warp totals."""
    from fp8lab.numba_kernels import layers

    n = 8200
    x, weight = rng.standard_normal((1, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = np.full_like(x, np.nan)
    with racecheck.checking() as seen:
        layers.rms_norm(x, weight, 1e-6, out)
    assert seen.total > 0
    want = sim_dense.rms_norm(x, weight, 1e-6, layers.rms_norm_threads_per_row(n))
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_attention_input_with_a_staged_head_dim(rng):
    from fp8lab.numba_kernels.attention_input import qk_norm_rope_cache_write
    from fp8lab.numba_kernels.layers import rope_table

    tokens, heads, kv_heads, d = 2, 2, 1, 16  # D not a multiple of 64: RoPE partners through shared memory
    q = rng.standard_normal((tokens, heads * d)).astype(np.float32)
    k = rng.standard_normal((tokens, kv_heads * d)).astype(np.float32)
    v = rng.standard_normal((tokens, kv_heads * d)).astype(np.float32)
    weights = [rng.standard_normal(d).astype(np.float32) for _ in range(2)]
    cache_shape = (2, kv_heads, 4, d)
    k_cache, v_cache = np.full(cache_shape, np.nan, np.float32), np.full(cache_shape, np.nan, np.float32)
    q_out = np.full((tokens, heads, d), np.nan, np.float32)
    with racecheck.checking() as seen:
        qk_norm_rope_cache_write(q, k, v, q_out, *weights, 1e-6, np.array([0, 5], np.int32), rope_table(8, d, 1e4),
                                 k_cache, v_cache, np.array([1, 6], np.int32))
    assert np.all(np.isfinite(q_out)) and np.all(np.isfinite(k_cache.reshape(-1, d)[[1, 6]]))
    assert seen.total > 0


def test_tensor_core_gemm_pipeline(rng):
    from fp8lab.numba_kernels import gemm_mma
    from fp8lab.reference import blockwise
    from fp8lab.reference.dense import float32_to_bf16_bits
    from fp8lab.simulators import gemm_mma as model

    m, n, k, block = 17, 16, 384, (8, 128)  # three K chunks through the pipeline, a partial M tile
    a_bits = float32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    q, scale_inv = blockwise.quantize(rng.standard_normal((n, k)).astype(np.float32), block)
    out = np.full((m, n), np.nan, np.float32)
    with racecheck.checking() as seen:
        gemm_mma.gemm_mma(a_bits, q, scale_inv, out, block, stages=2)
    assert seen.total > 0 and all("dynamic shared memory" in name for name in seen.accesses)
    np.testing.assert_array_equal(out, model.gemm_mma(a_bits, q, scale_inv, block, activation="bf16"))
