"""Thread-block clusters (``fp8lab.numba_kernels.cluster``): in the CUDA simulator's emulation and on a GPU.

The kernel: every CTA writes ``value[rank, t]`` (fresh random data) into a shared array, the cluster meets at its
barrier, and every CTA then reads the arrays of two other CTAs of its cluster, writes what it read and meets the
cluster again before it leaves. Expected output computed here with NumPy from the same values. Misuse that hangs or
is undefined on a GPU (a thread that leaves before a cluster barrier; a remote read of an array that is not shared)
must be an error in the simulator.
"""

import threading

import numpy as np
import pytest
from numba import cuda, float32, uint32

from fp8lab.numba_kernels import cluster
from fp8lab.numba_kernels.bits import SIMULATOR

THREADS = 64


@cuda.jit
def exchange(values, out):
    """``out[block, 0, t]`` = CTA ``rank + 1``'s value, ``out[block, 1, t]`` = CTA ``rank - 1``'s (ranks modulo the
    cluster's size ``values.shape[0]``), ``out[block, 2, t]`` = this CTA's rank."""
    stage = cuda.shared.array(THREADS, float32)
    t = cuda.threadIdx.x
    size = values.shape[0]
    rank = cluster.rank()
    block = (cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x
    stage[t] = values[rank, t]
    cluster.sync()
    out[block, 0, t] = cluster.load_f32(stage, t, uint32((rank + 1) % size))
    out[block, 1, t] = cluster.load_f32(stage, t, uint32((rank + size - 1) % size))
    out[block, 2, t] = float32(rank)
    cluster.sync()  # no CTA leaves while another may read its shared memory


def run_exchange(rng, grid, cluster_dims):
    size = int(np.prod(cluster_dims))
    values = rng.standard_normal((size, THREADS)).astype(np.float32)
    blocks = int(np.prod(grid))
    out = np.full((blocks, 3, THREADS), np.nan, np.float32)  # poisoned
    if SIMULATOR:
        cluster.launch(exchange, grid, THREADS, cluster_dims, 0, values, out)
        return values, out
    d_out = cuda.to_device(out)
    cluster.launch(exchange, grid, THREADS, cluster_dims, 0, cuda.to_device(values), d_out)
    cuda.synchronize()
    return values, d_out.copy_to_host()


def expected_ranks(grid, cluster_dims):
    """The rank of every CTA (in the kernel's linear block order): x fastest, as ``%cluster_ctarank``."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    dims = tuple(cluster_dims) + (1,) * (3 - len(cluster_dims))
    z, y, x = np.meshgrid(*(np.arange(g) for g in grid[::-1]), indexing="ij")
    return (x % dims[0] + dims[0] * (y % dims[1] + dims[1] * (z % dims[2]))).reshape(-1)


def check_exchange(values, out, grid, cluster_dims):
    size = values.shape[0]
    ranks = expected_ranks(grid, cluster_dims)
    np.testing.assert_array_equal(out[:, 2, 0], ranks.astype(np.float32))
    np.testing.assert_array_equal(out[:, 0], values[(ranks + 1) % size])
    np.testing.assert_array_equal(out[:, 1], values[(ranks - 1) % size])


@pytest.mark.cudasim
@pytest.mark.parametrize("grid, cluster_dims", [((1, 2, 4), (1, 1, 4)), ((4, 1, 1), (2, 1, 1)), ((2, 2, 2), (1, 2, 2))])
def test_the_simulator_runs_a_clusters_ctas_together(rng, grid, cluster_dims):
    if not SIMULATOR:
        pytest.skip("the simulator's emulation (NUMBA_ENABLE_CUDASIM=1)")
    values, out = run_exchange(rng, grid, cluster_dims)
    check_exchange(values, out, grid, cluster_dims)


@pytest.mark.cudasim
def test_clusters_and_racecheck_share_the_simulators_shared_memory(rng):
    """``racecheck`` patches the simulator's shared arrays too (once, for the rest of the process): its allocation
    keeps each CTA's own inside a cluster launch, and a cluster launch is refused while it checks."""
    if not SIMULATOR:
        pytest.skip("the simulator's emulation (NUMBA_ENABLE_CUDASIM=1)")
    from fp8lab.numba_kernels import racecheck

    with racecheck.checking():
        pass  # installs racecheck's allocation
    values, out = run_exchange(rng, (1, 1, 2), (1, 1, 2))
    check_exchange(values, out, (1, 1, 2), (1, 1, 2))
    with racecheck.checking(), pytest.raises(RuntimeError, match="cluster launches are not checked"):
        run_exchange(rng, (1, 1, 2), (1, 1, 2))


@cuda.jit
def exchange_dynamic(values, out):
    """``out[block, t]`` = CTA ``rank + 1``'s value, staged in dynamic shared memory."""
    stage = cuda.shared.array(0, float32)
    t = cuda.threadIdx.x
    rank = cluster.rank()
    stage[t] = values[rank, t]
    cluster.sync()
    out[cuda.blockIdx.x, t] = cluster.load_f32(stage, t, uint32((rank + 1) % values.shape[0]))
    cluster.sync()


@pytest.mark.cudasim
def test_the_simulator_gives_each_cta_of_a_cluster_its_dynamic_shared_memory(rng):
    if not SIMULATOR:
        pytest.skip("the simulator's emulation (NUMBA_ENABLE_CUDASIM=1)")
    values = rng.standard_normal((4, THREADS)).astype(np.float32)
    out = np.full((8, THREADS), np.nan, np.float32)
    cluster.launch(exchange_dynamic, 8, THREADS, 4, 0, values, out, shared_bytes=4 * THREADS)
    np.testing.assert_array_equal(out, values[(np.arange(8) % 4 + 1) % 4])


@cuda.jit
def leaves_early(out):
    stage = cuda.shared.array(THREADS, float32)
    stage[cuda.threadIdx.x] = float32(1)
    if cluster.rank() == 1 and cuda.threadIdx.x == 0:
        return  # skips the barrier the others wait at (undefined on a GPU: a lane skips an .aligned barrier)
    cluster.sync()
    out[cuda.blockIdx.x, cuda.threadIdx.x] = cluster.load_f32(stage, cuda.threadIdx.x, uint32(0))


@cuda.jit
def reads_a_local_array(out):
    stage = cuda.shared.array(THREADS, float32)
    local = cuda.local.array(1, float32)
    stage[cuda.threadIdx.x] = float32(1)
    local[0] = float32(2)
    cluster.sync()
    out[cuda.blockIdx.x, cuda.threadIdx.x] = cluster.load_f32(local, 0, uint32(0))
    cluster.sync()


@pytest.mark.cudasim
@pytest.mark.parametrize("kernel, message", [(leaves_early, "exited without arriving"),
                                             (reads_a_local_array, "not a shared array")])
def test_the_simulator_reports_cluster_misuse(kernel, message):
    if not SIMULATOR:
        pytest.skip("the simulator's emulation (NUMBA_ENABLE_CUDASIM=1)")
    out = np.zeros((2, THREADS), np.float32)
    with pytest.raises(RuntimeError, match=message):
        cluster.launch(kernel, 2, THREADS, 2, 0, out)


# A thread that a failed launch leaves running (a failed CTA waits ABORT_JOIN_S at most for its aborted threads) and
# that reaches a cluster barrier only while the next launch runs. Simulator-only: the kernels call Python here.
_PARKED = threading.Event()
_PARKED_THREAD = {}


@cuda.jit
def leaves_early_with_a_parked_thread(out):
    if cluster.rank() == 1 and cuda.threadIdx.x == 0:
        return  # skips the cluster barrier: the error that fails this launch
    if cluster.rank() == 0 and cuda.threadIdx.x == 0:
        _PARKED_THREAD["thread"] = threading.current_thread()
        _PARKED.wait(60)  # outlives the launch
    cluster.sync()
    out[cuda.blockIdx.x, cuda.threadIdx.x] = float32(1)


@cuda.jit
def exchange_after_releasing_the_parked_thread(values, out):
    """``exchange_dynamic``, except that thread 0 of rank 0 first lets the parked thread reach its cluster barrier."""
    stage = cuda.shared.array(0, float32)
    t = cuda.threadIdx.x
    rank = cluster.rank()
    stage[t] = values[rank, t]
    if rank == 0 and t == 0:
        _PARKED.set()
        _PARKED_THREAD["thread"].join(60)
    cluster.sync()
    out[cuda.blockIdx.x, t] = cluster.load_f32(stage, t, uint32((rank + 1) % values.shape[0]))
    cluster.sync()


@pytest.mark.cudasim
def test_a_thread_left_by_a_failed_launch_never_arrives_at_the_next_launchs_barrier(rng, monkeypatch):
    if not SIMULATOR:
        pytest.skip("the simulator's emulation (NUMBA_ENABLE_CUDASIM=1)")
    from fp8lab.numba_kernels import cudasim

    monkeypatch.setattr(cudasim, "ABORT_JOIN_S", 0.1)  # the parked thread outlives its launch
    _PARKED.clear()
    with pytest.raises(RuntimeError, match="exited without arriving"):
        cluster.launch(leaves_early_with_a_parked_thread, 2, THREADS, 2, 0, np.zeros((2, THREADS), np.float32))
    assert _PARKED_THREAD["thread"].is_alive()
    values = rng.standard_normal((2, THREADS)).astype(np.float32)
    out = np.full((2, THREADS), np.nan, np.float32)
    cluster.launch(exchange_after_releasing_the_parked_thread, 2, THREADS, 2, 0, values, out,
                   shared_bytes=4 * THREADS)
    np.testing.assert_array_equal(out, values[[1, 0]])
    assert not _PARKED_THREAD["thread"].is_alive()


@pytest.mark.parametrize("grid, cluster_dims, message", [(6, 4, "does not divide"), (32, 32, "not 1 to 16"),
                                                          ((4, 4), (1, 0), "not 1 to 16")])
def test_bad_cluster_dims_are_one_line_errors(grid, cluster_dims, message):
    with pytest.raises(ValueError, match=f"cluster_dims: .*{message}"):
        cluster.check_cluster_dims(grid, cluster_dims)


@pytest.mark.gpu
@pytest.mark.parametrize("grid, cluster_dims", [((2, 8, 4), (1, 1, 4)), ((2, 8, 16), (1, 1, 16)), ((16, 1, 1), (8, 1, 1))])
def test_gpu_a_clusters_ctas_read_each_others_shared_memory(rng, grid, cluster_dims):
    assert cluster.HAS_CLUSTERS, "the GPU tests run on sm_90 or later"
    values, out = run_exchange(rng, grid, cluster_dims)
    check_exchange(values, out, grid, cluster_dims)
