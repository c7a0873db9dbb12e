"""Programmatic dependent launch (``fp8lab.numba_kernels.pdl``) on a GPU, in a CUDA graph.

The PTX side of the rules (every kernel lets the next one launch and waits before it writes or reads
what others write) is checked with each kernel's PTX (``helpers.ptx.check_pdl_rules``). Here: a chain of
launches in one graph, each link reading its predecessor's result right after its wait while the
predecessor writes that result only at its very end, after streaming a buffer past the L2. Every link
must see it. And the control that makes the test able to fail: the same chain with links that read
*before* their wait must see stale values, which shows that the graph really launched them early.
"""

import numpy as np
import pytest

from fp8lab.numba_kernels import pdl

LINKS = 64
THREADS = 128
STREAM_WORDS = 4 * 1024 * 1024  # 16 MB per link: a few microseconds of reading before the write


def make_link(read_before_wait: bool):
    from numba import cuda, int32, uint32

    @cuda.jit
    def link(words, chain, i, sink):
        """``chain[i + 1] = chain[i] + 1``, written by thread 0 of CTA 0 after the CTA has read ``words``."""
        pdl.launch_dependents()
        if read_before_wait:
            previous = chain[i]  # breaks the rule: the predecessor may not have written it yet
            pdl.wait_for_prior_grids()
        else:
            pdl.wait_for_prior_grids()
            previous = chain[i]
        acc = uint32(0)
        stride = cuda.gridDim.x * cuda.blockDim.x
        for w in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, words.shape[0], stride):
            acc ^= words[w]
        if acc == uint32(0x9E3779B9):  # practically never: keeps the loads
            sink[0] = acc
        cuda.syncthreads()
        if cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
            chain[i + 1] = previous + int32(1)

    return link


def replay_chain(read_before_wait: bool) -> np.ndarray:
    """The chain after one replay of a graph of ``LINKS`` PDL launches (``chain[0] = 0``, the rest poisoned)."""
    from cuda.core import Device
    from numba import cuda

    device = Device()
    device.set_current()
    link = make_link(read_before_wait)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    rng = np.random.default_rng(20261203)
    buffers = [cuda.to_device(rng.integers(0, 2**32, STREAM_WORDS, dtype=np.uint32)) for _ in range(4)]
    poisoned = np.full(LINKS + 1, -(2**30), np.int32)
    poisoned[0] = 0
    chain, sink = cuda.to_device(poisoned), cuda.device_array(1, np.uint32)
    builder = device.create_graph_builder()
    builder.begin_building()
    for i in range(LINKS):
        pdl.launch(link, 2 * sms, THREADS, builder, buffers[i % len(buffers)], chain, i, sink)
    graph = builder.end_building().complete()
    stream = device.create_stream()
    graph.launch(stream)
    stream.sync()
    return chain.copy_to_host()


@pytest.mark.gpu
def test_gpu_every_link_sees_its_predecessors_write():
    assert pdl.HAS_PDL, "the GPU tests run on sm_90 or later"
    np.testing.assert_array_equal(replay_chain(read_before_wait=False), np.arange(LINKS + 1))


@pytest.mark.gpu
def test_gpu_a_read_before_the_wait_sees_stale_data():
    """The control: links that read their input before ``griddepcontrol.wait`` were launched while their
    predecessor still ran, so some of them read the poison (or an older value)."""
    chain = replay_chain(read_before_wait=True)
    assert not np.array_equal(chain, np.arange(LINKS + 1)), "no link started early: PDL had no effect"
