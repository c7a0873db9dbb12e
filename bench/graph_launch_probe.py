"""What a cuda.core Graph.launch of a 300-kernel graph costs the host, and when (a GPU diagnostic, issue 15).

The decode step's graph launch took 6 us in one experiment and 110 to 170 us in others (bench/RESULTS.md, 2026-12-02).
Graphs of N tiny Numba kernels; median host time of launch() (synchronized after each), in these states:
the first graph of the process, a second graph, the first again, after the second is deleted, without upload,
and cuGraphLaunch called directly through cuda.bindings; then after torch's CUDA initialization, inside a
torch.profiler session and after it (the profiler leaves CUPTI attached). Prints one line per state.

    python bench/graph_launch_probe.py
"""
import gc
import statistics
import time

import numpy as np
from numba import cuda

N = 300


@cuda.jit
def tiny(x, i):
    if cuda.grid(1) == 0:
        x[0] += i


def build(x, upload_stream=None):
    from cuda.core import Device

    device = Device()
    device.set_current()
    b = device.create_graph_builder()
    b.begin_building()
    for i in range(N):
        tiny[1, 32, b](x, i)
    g = b.end_building().complete()
    if upload_stream is not None:
        g.upload(upload_stream)
    return g


def time_launch(g, stream, reps=60):
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        g.launch(stream)
        samples.append((time.perf_counter() - t) * 1e6)
        stream.sync()
    return round(statistics.median(samples), 1), round(min(samples), 1)


def main():
    from cuda.core import Device

    device = Device()
    device.set_current()
    stream = device.create_stream()
    x = cuda.to_device(np.zeros(4, np.float32))
    tiny[1, 32](x, 0)
    cuda.synchronize()
    g1 = build(x, stream)
    print("first graph", time_launch(g1, stream))
    g2 = build(x, stream)
    print("second graph", time_launch(g2, stream))
    print("first graph again", time_launch(g1, stream))
    del g1
    gc.collect()
    print("second, first deleted", time_launch(g2, stream))
    g3 = build(x, None)
    print("third, not uploaded", time_launch(g3, stream))
    other = device.create_stream()
    print("second on another stream", time_launch(g2, other))
    print("second on its stream again", time_launch(g2, stream))
    try:
        from cuda.bindings import driver

        handle = int(g2.handle) if hasattr(g2, "handle") else None
        s_handle = int(stream.handle)
        if handle is not None:
            samples = []
            for _ in range(60):
                t = time.perf_counter()
                driver.cuGraphLaunch(handle, s_handle)
                samples.append((time.perf_counter() - t) * 1e6)
                stream.sync()
            print("cuGraphLaunch direct", round(statistics.median(samples), 1))
    except Exception as e:  # noqa: BLE001
        print("direct launch failed", repr(e))
    x2 = cuda.to_device(np.zeros(1 << 28, np.float32))  # 1 GiB of device memory in use
    g4 = build(x, stream)
    print("fourth, after a 1 GiB allocation", time_launch(g4, stream))
    del x2
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    print("after torch's CUDA init", time_launch(g4, stream))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]):
        print("inside torch.profiler", time_launch(g4, stream, 10))
    print("after a torch.profiler session", time_launch(g4, stream))
    g5 = build(x, stream)
    print("a new graph after the profiler", time_launch(g5, stream))


if __name__ == "__main__":
    main()
