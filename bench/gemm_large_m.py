"""The FP8 GEMM at prefill sizes (large M) on the GPU: TFLOP/s against cuBLAS BF16, and a tiling sweep.

    python bench/gemm_large_m.py [--batches 512,1024,4096] [--paths mma,wgmma,wgmma_ss] [--sweep] [--out DIR]

For each Qwen3-8B projection shape (N, K) and each M it

1. runs each path's kernel with its default tiling (``mma``: ``gemm_mma``; ``wgmma``: ``gemm_wgmma``) on fresh
   random data (the output poisoned with NaN first) and checks 64 random rows against
   ``fp8lab.reference.blockwise.gemm`` (relative error);
2. with ``--sweep``, runs every tiling of the path's sweep (``SWEEP``, ``WGMMA_SWEEP``) too and requires its
   output to be *bit for bit* that path's default's: the tiling never changes the float32 order (the kernels'
   docstrings), and the tensor cores are deterministic, so any difference is a bug;
3. times each with CUDA-graph replay (``bench/timing.py``) and cuBLAS BF16
   (``torch.nn.functional.linear``, BF16 weights of the same shape) with CUDA events;
4. prints and writes ``gemm_large_m.md``: microseconds, TFLOP/s, and our throughput as a share
   of cuBLAS BF16's (issue 16's target: at least 60% from M = 512 on).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gemm import SHAPES, random_problem  # noqa: E402

BATCHES = (512, 1024, 4096)
CHECKED_ROWS = 64
SWEEP = [
    # (m_blocks, warps_n, n8_tiles_per_warp, stages, warps_m[, place_once]): CTA M x N, warps
    (4, 4, 4, 3, 2),  # 128 x 128, 8 warps of 64 x 32
    (4, 4, 4, 2, 2),
    (4, 4, 4, 4, 2),
    (2, 4, 4, 3, 4),  # 128 x 128, 16 warps of 32 x 32
    (2, 4, 4, 2, 4),
    (2, 4, 4, 4, 2),  # 64 x 128, 8 warps of 32 x 32
    (4, 4, 2, 3, 2),  # 128 x 64, 8 warps of 64 x 16
    (4, 4, 2, 2, 2),
    (4, 2, 4, 4, 2),  # 128 x 64, 4 warps of 64 x 32
    (2, 2, 4, 4, 2),  # 64 x 64, 4 warps of 32 x 32
    (2, 4, 2, 3, 2),  # 64 x 64, 8 warps of 32 x 16
    (4, 8, 4, 3, 1),  # 64 x 256, 8 warps of 64 x 32 side by side (each weight code placed by one warp only)
    (4, 8, 2, 3, 1),  # 64 x 128, 8 warps of 64 x 16
    # the same with the codes placed once per CTA (place_once): one more barrier per chunk, no code placed twice
    (4, 4, 4, 3, 2, True),
    (4, 4, 4, 2, 2, True),
    (2, 4, 4, 3, 4, True),
    (4, 4, 2, 3, 2, True),
]

WGMMA_SWEEP = [
    # gemm_wgmma's Tiling (tokens, warpgroups, stages, parts): CTA of 64 warpgroups weight rows x tokens
    # (H100, against (128, 2, 4, 1): (128, 2, 3), (128, 1, 4), (64, 2, 4) slower in the nineteenth session; a second
    # set of A registers, at 64 or 128 tokens, slower in the twentieth; producer warps slower in the twenty-first;
    # two accumulator chains per warpgroup slower in the twenty-second; two register sets slower, and the token-major
    # CTA order on three of the four shapes, in the twenty-fourth; the warpgroups taking turns in the twenty-fifth).
    # Parts 2 and 4, stages 3 and 4; 5 stages fit only a smaller CTA. 192 tokens (m64n192k16: 1.5x the tensor work per
    # placed A register, 255 registers with 32 bytes of spills, 3 stages fill the shared memory): 2 to 4% faster at
    # M = 2,048 on the two large shapes, up to 45% slower at M = 1,000 (twenty-fifth session).
    (128, 2, 4, 2), (128, 2, 3, 4), (128, 2, 3, 2), (128, 1, 5, 4), (64, 2, 5, 4), (192, 2, 3, 4),
]

def knobs_of(tiling) -> dict:
    """``gemm_mma``'s keyword knobs of a ``Tiling`` tuple (``place_once`` False where it is left out)."""
    m_blocks, warps_n, n8_tiles, stages, warps_m, place_once = (*tiling, False)[:6]
    return dict(m_blocks=m_blocks, warps_n=warps_n, n8_tiles_per_warp=n8_tiles, stages=stages, warps_m=warps_m,
                place_once=bool(place_once))


def problem(rng, m, n, k, torch):
    """``gemm.random_problem`` on the device, and the float64 oracle for ``CHECKED_ROWS`` random rows only (the whole
    product would take the host minutes at these sizes)."""
    from numba import cuda

    from fp8lab.reference import blockwise

    q, s, a_bf16, a_rounded = random_problem(rng, m, n, k, torch)
    rows = np.sort(rng.choice(m, size=min(CHECKED_ROWS, m), replace=False))
    ref = blockwise.gemm(a_rounded[rows], q, s)
    a_dev = cuda.as_cuda_array(a_bf16.view(torch.int16))
    return a_bf16, a_dev, cuda.to_device(q), cuda.to_device(s), cuda.device_array((m, n), np.float32), rows, ref


def run_once(gemm, a_dev, q_dev, s_dev, out, knobs) -> np.ndarray:
    from numba import cuda

    out.copy_to_device(np.full(out.shape, np.nan, np.float32))
    gemm(a_dev, q_dev, s_dev, out, **knobs)
    cuda.synchronize()
    return out.copy_to_host()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated M values")
    parser.add_argument("--sweep", action="store_true", help="also time (and check bit for bit) the sweep's tilings")
    parser.add_argument("--paths", default="mma,wgmma", help="comma-separated: mma (gemm_mma), wgmma (gemm_wgmma), "
                        "wgmma_ss (gemm_wgmma_ss)")
    args = parser.parse_args(argv)
    import torch
    from timing import graph_time_us, torch_time_us

    from fp8lab.numba_kernels import gemm_wgmma, gemm_wgmma_ss
    from fp8lab.numba_kernels.gemm_mma import gemm_mma, launch_info

    def variants(m, n, k):
        """(path, tiling, is the default, launch(a, q, s, out, stream)) of every kernel to run at this shape."""
        for path in args.paths.split(","):
            if path == "mma":
                default = tuple(launch_info(m, n, k).tiling)
                tilings = [default] + ([t for t in SWEEP if knobs_of(t) != knobs_of(default)] if args.sweep else [])
                for t in tilings:
                    yield path, t, t == default, functools.partial(gemm_mma, **knobs_of(t))
            elif path == "wgmma":
                default = tuple(gemm_wgmma.Tiling())
                tilings = [default] + ([t for t in WGMMA_SWEEP if t != default] if args.sweep else [])
                for t in tilings:
                    yield path, t, t == default, functools.partial(gemm_wgmma.gemm_wgmma,
                                                                   tiling=gemm_wgmma.Tiling(*t))
            elif path == "wgmma_ss":  # one tiling: 128 x 128, a producer warpgroup
                yield path, "producer warpgroup", True, gemm_wgmma_ss.gemm_wgmma_ss
            else:
                raise SystemExit(f"--paths: unknown path {path!r} (expected mma, wgmma, wgmma_ss)")

    rng = np.random.default_rng(2026)
    lines = [
        f"### FP8 GEMM at large M, {datetime.date.today()}, {torch.cuda.get_device_name()}",
        "",
        f"Command: `python bench/gemm_large_m.py {' '.join(argv if argv is not None else sys.argv[1:])}`. "
        "Ours: CUDA-graph replays; cuBLAS BF16 (torch `linear`): CUDA events; medians. "
        f"rel. err: {CHECKED_ROWS} random rows against the float64 oracle.",
        "",
        "| N x K | M | path and tiling (mma: m_blocks, warps_n, n8_tiles, stages, warps_m[, place_once]; wgmma: tokens, "
        "warpgroups, stages, parts) | us | TFLOP/s | rel. err | "
        "cuBLAS BF16 us | cuBLAS TFLOP/s | ours / cuBLAS throughput |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    failures = 0
    for n, k in SHAPES:
        for m in [int(b) for b in args.batches.split(",")]:
            a_bf16, a_dev, q_dev, s_dev, out, rows, ref = problem(rng, m, n, k, torch)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            cublas_us = torch_time_us(lambda i: torch.nn.functional.linear(a_bf16, w), iters=20, repeats=5)
            flops = 2.0 * m * n * k
            first = {}
            for path, tiling, is_default, gemm in variants(m, n, k):
                try:
                    result = run_once(gemm, a_dev, q_dev, s_dev, out, {})
                except ValueError as error:  # a tiling that does not fit (shared memory)
                    print(f"skipped {path} {tiling}: {error}", flush=True)
                    continue
                if path not in first:
                    first[path] = result
                    err = float(np.linalg.norm(result[rows] - ref) / np.linalg.norm(ref))
                    bad = not (np.all(np.isfinite(result)) and err < 1e-5)
                    note = f"{err:.1e}"
                else:
                    bad = not np.array_equal(result.view(np.uint32), first[path].view(np.uint32))
                    note = "= default" if not bad else "DIFFERS"
                failures += bad
                us = graph_time_us(lambda i, stream: gemm(a_dev, q_dev, s_dev, out, stream=stream), reps=8, replays=5)
                lines.append(f"| {n} x {k} | {m} | {path} {tiling}{' default' if is_default else ''} | {us:.1f} | "
                             f"{flops / us / 1e6:.0f} | {note} | {cublas_us:.1f} | {flops / cublas_us / 1e6:.0f} | "
                             f"{cublas_us / us:.2f} |")
                print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_large_m.md").write_text(table)
    if failures:
        print(f"FAILED: {failures} outputs wrong or not bit for bit the default tiling's")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
