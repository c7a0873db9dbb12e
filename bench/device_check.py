"""A first look at a GPU machine before benchmarking: is numba-cuda working, does graph capture
work, what are the ceilings (copy bandwidth, cuBLAS BF16 at the benchmark shapes)?

    python bench/device_check.py
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    import torch
    from numba import cuda

    from timing import copy_bandwidth_tb_s, graph_time_us, torch_time_us

    print("device:", torch.cuda.get_device_name(), "| numba-cuda sees:", cuda.get_current_device().name)

    @cuda.jit("void(float32[:], float32[:])")
    def axpy(x, y):
        i = cuda.grid(1)
        if i < x.size:
            y[i] = 2.0 * x[i] + y[i]

    x = cuda.to_device(np.ones(1 << 20, np.float32))
    y = cuda.to_device(np.zeros(1 << 20, np.float32))
    us = graph_time_us(lambda i, stream: axpy[(1 << 20) // 256, 256, stream](x, y), reps=50)
    print(f"graph-replayed 1M-element axpy: {us:.2f} us per kernel; y[0] = {y.copy_to_host()[0]} (expected {2.0 * 50 * 16}: warm-up + 15 replays of 50)")
    print(f"copy bandwidth (read + write): {copy_bandwidth_tb_s():.2f} TB/s")
    for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]:
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        cells = []
        for m in (1, 8, 16, 32, 64):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = torch_time_us(lambda i: torch.nn.functional.linear(a, ws[i % 4]))
            cells.append(f"M={m}: {t:.1f} us ({2 * n * k / (t * 1e-6) / 1e12:.2f} TB/s)")
        print(f"cuBLAS BF16 {n}x{k}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
