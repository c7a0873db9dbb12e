"""Shared GPU timing for the benchmarks: CUDA graphs for our kernels, CUDA events for torch.

Why graphs: a Numba launch costs 25 to 29 us of Python on the host, longer than many of the
kernels measured here, so timing back-to-back launches would measure Python. Each measurement
captures ``reps`` launches into one CUDA graph (numba-cuda launches into a ``cuda.core``
GraphBuilder), replays it, and divides: what is left per kernel is its device time plus about
1 us of replay gap.

Every benchmark validates before it times, rotates among several weight copies so that the
weights come from HBM and not from the 60 MB L2, and reports the median of several replays.
"""

from __future__ import annotations

import statistics
import time


def graph_time_us(launch, reps: int = 40, replays: int = 15) -> float:
    """Median device time in microseconds of one ``launch(i, stream)`` call, measured by graph replay.

    ``launch(i, stream)`` must enqueue exactly one kernel on ``stream`` (a cuda.core GraphBuilder
    during capture); ``i`` counts the launches so the caller can rotate buffers.
    """
    from cuda.core import Device

    device = Device()
    device.set_current()
    builder = device.create_graph_builder()
    builder.begin_building()
    for i in range(reps):
        launch(i, builder)
    graph = builder.end_building().complete()
    stream = device.create_stream()
    graph.launch(stream)  # warm-up
    stream.sync()
    samples = []
    for _ in range(replays):
        start = time.perf_counter()
        graph.launch(stream)
        stream.sync()
        samples.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(samples)


def torch_time_us(fn, iters: int = 100, repeats: int = 7) -> float:
    """Median device time in microseconds of ``fn(i)`` (torch work on the current stream), by CUDA events."""
    import torch

    for i in range(5):
        fn(i)
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def torch_graph_time_us(fn, reps: int = 20, replays: int = 9) -> float:
    """Median device time in microseconds of ``fn(i)`` (torch work), by replaying a torch CUDA graph of ``fn(0)`` to
    ``fn(reps - 1)``: no host time per call, for work shorter than a Python call (``torch_time_us`` times those)."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (torch picks its kernels) outside the capture
        for i in range(reps):
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def copy_bandwidth_tb_s(gigabytes: float = 2.0) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    import torch

    n = int(gigabytes * 1e9)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = torch_time_us(lambda i: dst.copy_(src), iters=10, repeats=5)
    return 2 * n / (us * 1e-6) / 1e12
