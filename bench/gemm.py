"""FP8 weight GEMM benchmark on the GPU: our kernels against cuBLAS BF16 and the copy bandwidth.

Run on an NVIDIA GPU with torch installed (the peer); writes a Markdown table and a roofline
plot into the output folder (default ``bench/``) and prints the table::

    python bench/gemm.py [--out DIR] [--batches 1,2,4,8] [--paths auto,simt,mma]

For each Qwen3-8B projection shape (N, K) and batch M it

1. validates each path on fresh random data against ``fp8lab.reference.blockwise.gemm`` (relative
   error ||out - ref|| / ||ref||; the output is poisoned with NaN first);
2. times each path with CUDA-graph replay (``bench/timing.py``), rotating among weight copies
   that together exceed the L2, and cuBLAS BF16 (``torch.nn.functional.linear`` on BF16 weights
   of the same shape) with CUDA events;
3. reports microseconds, FP8 weight bytes read per second against the measured device-to-device
   copy bandwidth, and the ratio to cuBLAS BF16.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # Qwen3-8B: qkv, o, gate+up, down
BATCHES = [1, 2, 4, 8, 16, 32, 64]
L2_BYTES = 60e6


def random_problem(rng, m, n, k, torch):
    """FP8 weights quantized from random floats, BF16 activations; numpy and torch copies."""
    from fp8lab.reference import blockwise

    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    q, s = blockwise.quantize(w)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a_bf16 = torch.from_numpy(a).to("cuda", torch.bfloat16)
    a_rounded = a_bf16.float().cpu().numpy()
    return q, s, a_bf16, a_rounded


def relative_error(out, ref) -> float:
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def device_problem(m, n, k, rng, torch):
    """A random problem on the GPU: ``(a_bf16, a_dev, q_devs, s_dev, out_dev, ref)``.

    ``q_devs`` holds enough copies of the weights to exceed the L2 three times over, for timing
    loops to rotate through; ``ref`` is the float64 oracle on the BF16-rounded activations.
    """
    from numba import cuda

    from fp8lab.reference import blockwise

    q, s, a_bf16, a_rounded = random_problem(rng, m, n, k, torch)
    ref = blockwise.gemm(a_rounded, q, s)
    copies = max(2, int(np.ceil(3 * L2_BYTES / (n * k))))
    q_devs = [cuda.to_device(q) for _ in range(copies)]
    a_dev = cuda.as_cuda_array(a_bf16.view(torch.int16))
    return a_bf16, a_dev, q_devs, cuda.to_device(s), cuda.device_array((m, n), np.float32), ref


def bench_shape(m, n, k, rng, torch, paths):
    from numba import cuda

    a_bf16, a_dev, q_dev, s_dev, out_dev, ref = device_problem(m, n, k, rng, torch)
    copies = len(q_dev)
    rows = []
    for name, fn in paths.items():
        if not fn.accepts(m):
            continue
        out_dev.copy_to_device(np.full((m, n), np.nan, np.float32))
        fn(a_dev, q_dev[0], s_dev, out_dev, stream=0)
        cuda.synchronize()
        err = relative_error(out_dev.copy_to_host(), ref)
        from timing import graph_time_us

        us = graph_time_us(lambda i, stream: fn(a_dev, q_dev[i % copies], s_dev, out_dev, stream=stream))
        rows.append((name, us, err))
    w_bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
    from timing import torch_time_us

    cublas_us = torch_time_us(lambda i: torch.nn.functional.linear(a_bf16, w_bf16[i % len(w_bf16)]))
    return rows, cublas_us


class KernelPath:
    """A kernel path of the benchmark: how to call it (``call(a, q, s, out, stream)``) and for which M."""

    def __init__(self, call, accepts):
        self.call, self.accepts = call, accepts

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def kernel_paths(names):
    """The requested paths (``auto``: ``fp8_gemm``'s choice, what the engine runs; ``simt``, ``mma``: one kernel)."""
    paths = {}
    if "auto" in names:
        from fp8lab.numba_kernels.fp8_gemm import fp8_gemm

        paths["auto"] = KernelPath(lambda a, q, s, o, stream: fp8_gemm(a, q, s, o, stream=stream), lambda m: True)
    if "simt" in names:
        from fp8lab.numba_kernels.gemv_simt import gemv_simt

        paths["simt"] = KernelPath(lambda a, q, s, o, stream: gemv_simt(a, q, s, o, stream=stream), lambda m: m <= 16)
    if "mma" in names:
        from fp8lab.numba_kernels.gemm_mma import gemm_mma

        paths["mma"] = KernelPath(lambda a, q, s, o, stream: gemm_mma(a, q, s, o, stream=stream), lambda m: True)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated M values")
    parser.add_argument("--paths", default="auto,simt,mma", help="comma-separated kernel paths: auto, simt, mma")
    args = parser.parse_args(argv)
    import torch

    from timing import copy_bandwidth_tb_s

    rng = np.random.default_rng(2026)
    copy_tb_s = copy_bandwidth_tb_s()
    paths = kernel_paths(args.paths.split(","))
    batches = [int(m) for m in args.batches.split(",")]
    lines = [
        f"### FP8 GEMM, {datetime.date.today()}, {torch.cuda.get_device_name()}",
        "",
        f"Command: `python bench/gemm.py {' '.join(argv if argv is not None else sys.argv[1:])}`. Copy bandwidth (read + write): {copy_tb_s:.2f} TB/s. "
        "Times are CUDA-graph replays (ours) and CUDA events (cuBLAS BF16 via torch), medians, weights rotated past the L2.",
        "",
        "| N x K | M | path | us | rel. err | FP8 weight TB/s | % of copy BW | cuBLAS BF16 us | ratio to cuBLAS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    points = []
    for n, k in SHAPES:
        for m in batches:
            rows, cublas_us = bench_shape(m, n, k, rng, torch, paths)
            for name, us, err in rows:
                tb_s = n * k / (us * 1e-6) / 1e12
                lines.append(
                    f"| {n} x {k} | {m} | {name} | {us:.1f} | {err:.1e} | {tb_s:.2f} | {100 * tb_s / copy_tb_s:.0f}% "
                    f"| {cublas_us:.1f} | {us / cublas_us:.2f} |"
                )
                points.append((n, k, m, name, us, cublas_us))
                print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_results.md").write_text(table)
    plot_roofline(points, copy_tb_s, args.out / "gemm_roofline.png")
    print(table)
    return 0


def plot_roofline(points, copy_tb_s, path):
    """Achieved TFLOP/s against arithmetic intensity (FLOP per byte moved), with the bandwidth roof."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = {"simt": "o", "mma": "s", "auto": "^", "cuBLAS BF16": "x"}
    colors = {"simt": "C0", "mma": "C1", "auto": "C1", "cuBLAS BF16": "C2"}
    for n, k, m, name, us, cublas_us in points:
        flops = 2.0 * m * n * k
        fp8_bytes = n * k + 2 * m * k + 4 * m * n
        bf16_bytes = 2 * n * k + 2 * m * k + 2 * m * n
        ax.scatter(flops / fp8_bytes, flops / (us * 1e-6) / 1e12, marker=markers[name], color=colors[name])
        ax.scatter(flops / bf16_bytes, flops / (cublas_us * 1e-6) / 1e12, marker="x", color=colors["cuBLAS BF16"])
    ai = np.logspace(-0.5, 2, 50)
    ax.plot(ai, ai * copy_tb_s, "k--", label=f"measured copy bandwidth {copy_tb_s:.1f} TB/s x intensity")
    for name, marker in markers.items():
        ax.scatter([], [], marker=marker, color=colors[name], label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of weights + activations + output)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("FP8 blockwise GEMM (Qwen3-8B shapes) vs cuBLAS BF16")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
