"""Time the SIMT GEMV against its split-K form on the decode shapes, float32 activations (what the engine runs).

    python bench/gemv_split_k.py [--out DIR] [--batches 1,2,4] [--splits 1,2,3,4,6,8]

For every Qwen3-8B and Qwen3-0.6B GEMV shape, M and number of K slices S (``K / S`` whole 128-wide
blocks) it validates ``gemv_simt_split_k`` (the parts summed in order, ``fp8lab.simulators.dense.sum_parts``)
against ``fp8lab.reference.blockwise.gemm``, checks the parts bit for bit against
``fp8lab.simulators.gemv_simt.gemv_simt_split_k`` at M = 1, and times it by CUDA-graph replay with the
weights rotated past the L2 (``bench/timing.py``), for a few knob sets; S = 1 is the plain GEMV. The
consumer's extra reads (``layers.add_parts_rms_norm`` reads S parts instead of one row) are not in
these times. Writes ``gemv_split_k.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gemm import L2_BYTES, relative_error  # noqa: E402

SHAPES = {
    "qwen3-8b": {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (24576, 4096), "down": (4096, 12288)},
    "qwen3-0.6b": {"q/k/v": (4096, 1024), "o": (1024, 2048), "gate/up": (6144, 1024), "down": (1024, 3072)},
}
KNOBS = [None, (8, 1, 2), (4, 1, 4), (4, 2, 2), (8, 2, 1)]
"""(warps_per_cta, chunks_per_iteration, columns_per_warp); None: the defaults."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--batches", default="1,2,4")
    parser.add_argument("--splits", default="1,2,3,4,6,8")
    args = parser.parse_args(argv)
    from numba import cuda
    from timing import copy_bandwidth_tb_s, graph_time_us

    from fp8lab.numba_kernels.gemv_simt import MAX_ACCUMULATORS, gemv_simt_split_k
    from fp8lab.reference import blockwise
    from fp8lab.simulators import gemv_simt as simulator

    bandwidth = copy_bandwidth_tb_s()
    rng = np.random.default_rng(11)
    lines = [f"Copy bandwidth {bandwidth:.2f} TB/s. Times in us per GEMV; TB/s = weight bytes / time.", "",
             "| shape | GEMV | N x K | M | S = 1 us | best S | best knobs | best us | best TB/s | best / S = 1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    detail = ["| shape | N x K | M | S | knobs | us |", "|---|---|---|---|---|---|"]
    for shape, gemvs in SHAPES.items():
        for name, (n, k) in gemvs.items():
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            q, s = blockwise.quantize(w)
            copies = max(2, int(np.ceil(3 * L2_BYTES / (n * k))))
            q_devs, s_dev = [cuda.to_device(q) for _ in range(copies)], cuda.to_device(s)
            for m in (int(b) for b in args.batches.split(",")):
                a = rng.standard_normal((m, k)).astype(np.float32)
                a_dev, ref = cuda.to_device(a), blockwise.gemm(a, q, s)
                timings = {}
                for splits in (int(x) for x in args.splits.split(",")):
                    if k % (splits * 128):
                        continue
                    parts = cuda.device_array((splits, m, n), np.float32)
                    for knobs in KNOBS:
                        kw = {} if knobs is None else dict(zip(("warps_per_cta", "chunks_per_iteration",
                                                                 "columns_per_warp"), knobs))
                        if knobs is not None and knobs[2] * m > MAX_ACCUMULATORS:
                            continue
                        parts.copy_to_device(np.full((splits, m, n), np.nan, np.float32))
                        gemv_simt_split_k(a_dev, q_devs[0], s_dev, parts, **kw)
                        got = parts.copy_to_host()
                        err = relative_error(simulator.sum_parts(got), ref)
                        if not err < 1e-5:
                            print(f"INVALID {shape} {name} M={m} S={splits} {knobs}: rel. err {err}", flush=True)
                            return 1
                        if m == 1 and knobs is None:
                            expected = simulator.gemv_simt_split_k(a, q, s, splits)
                            if not np.array_equal(got.view(np.uint32), expected.view(np.uint32)):
                                print(f"NOT BIT-EXACT {shape} {name} M={m} S={splits}", flush=True)
                                return 1
                        us = graph_time_us(lambda i, stream: gemv_simt_split_k(
                            a_dev, q_devs[i % copies], s_dev, parts, stream=stream, **kw))
                        timings[(splits, knobs)] = us
                        detail.append(f"| {shape} {name} | {n} x {k} | {m} | {splits} | {knobs or 'default'} | {us:.2f} |")
                plain = timings[(1, None)]
                (best_s, best_knobs), best = min(timings.items(), key=lambda t: t[1])
                lines.append(f"| {shape} | {name} | {n} x {k} | {m} | {plain:.2f} | {best_s} | {best_knobs or 'default'} "
                             f"| {best:.2f} | {n * k / best / 1e6:.2f} | {best / plain:.2f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n\n" + "\n".join(detail) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_split_k.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
