"""Sweep the launch knobs of the FP8 weight kernels on the GPU; the knobs never change a result bit.

    python bench/gemm_tuning.py [--out DIR]

For each Qwen3-8B shape and a few M it validates every variant against ``fp8lab.reference.blockwise.gemm``
and times it with CUDA-graph replay (``bench/timing.py``), weights rotated past the L2. It prints
and writes ``gemm_tuning.md``: the best variant per (path, shape, M), which is how the defaults in
``fp8lab/numba_kernels/gemv_simt.py`` and ``fp8lab/numba_kernels/gemm_mma.py`` and the SIMT/mma threshold of
``fp8lab/numba_kernels/fp8_gemm.py`` are chosen.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gemm import SHAPES, device_problem, relative_error  # noqa: E402

VARIANTS = {
    "mma": [dict(warps_n=4, n8_tiles_per_warp=1, stages=st) for st in (2, 4, 6, 8)]
    + [dict(warps_n=4, n8_tiles_per_warp=2, stages=st) for st in (3, 5)]
    + [dict(warps_n=2, n8_tiles_per_warp=t, stages=8) for t in (1, 2)]
    + [dict(warps_n=1, n8_tiles_per_warp=1, stages=8)],
}
BATCHES = {"simt": (1, 4, 8), "mma": (16, 32)}


def variants(kernel, path, m):
    """The sweep's knob settings that the kernel accepts (an unknown knob drops the setting); for the
    SIMT GEMV its own ``tuning_candidates(m)``."""
    if path == "simt":
        from fp8lab.numba_kernels.gemv_simt import tuning_candidates

        return tuning_candidates(m)
    accepted = inspect.signature(kernel).parameters
    return [v for v in VARIANTS[path] if all(name in accepted for name in v)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--paths", default="simt,mma", help="comma-separated: simt, mma")
    parser.add_argument("--batches", default=None, help="comma-separated M values (default: per path)")
    args = parser.parse_args(argv)
    import torch
    from numba import cuda

    from fp8lab.numba_kernels.gemm_mma import gemm_mma
    from fp8lab.numba_kernels.gemv_simt import gemv_simt
    from timing import graph_time_us, torch_time_us

    kernels = {name: k for name, k in {"simt": gemv_simt, "mma": gemm_mma}.items() if name in args.paths.split(",")}
    rng = np.random.default_rng(7)
    lines = ["| N x K | M | path | best knobs | best us | default us | worst us | cuBLAS BF16 us |", "|---|---|---|---|---|---|---|---|"]
    for (n, k), path in itertools.product(SHAPES, kernels):
        kernel = kernels[path]
        batches = [int(b) for b in args.batches.split(",")] if args.batches else BATCHES[path]
        for m in batches:
            a_bf16, a_dev, q_dev, s_dev, out, ref = device_problem(m, n, k, rng, torch)
            copies = len(q_dev)
            timings = []
            for knobs in [{}] + list(variants(kernel, path, m)):
                out.copy_to_device(np.full((m, n), np.nan, np.float32))
                kernel(a_dev, q_dev[0], s_dev, out, **knobs)
                cuda.synchronize()
                err = relative_error(out.copy_to_host(), ref)
                if not err < 1e-5:
                    print(f"INVALID {path} {n}x{k} M={m} {knobs}: rel. err {err}", flush=True)
                    continue
                us = graph_time_us(lambda i, stream: kernel(a_dev, q_dev[i % copies], s_dev, out, stream=stream, **knobs))
                timings.append((us, knobs))
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            ws = [w] + [torch.randn_like(w) for _ in range(max(1, copies // 2 - 1))]
            cublas = torch_time_us(lambda i: torch.nn.functional.linear(a_bf16, ws[i % len(ws)]))
            default_us = timings[0][0]
            best_us, best = min(timings[1:] or timings, key=lambda t: t[0])
            worst_us = max(t[0] for t in timings)
            lines.append(f"| {n} x {k} | {m} | {path} | {best} | {best_us:.1f} | {default_us:.1f} | {worst_us:.1f} | {cublas:.1f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_tuning.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
