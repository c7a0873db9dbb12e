"""Time the decode GEMVs as the engine launches them, by how many column tiles each warp streams through.

    python bench/gemv_streaming.py [--out DIR] [--tiles 1,2,3,4,6,8]

``tiles_per_warp`` (``fp8lab.numba_kernels.gemv_simt``): with 1, a warp computes one tile of columns and
ends, and the GPU starts CTA after CTA, each ramping its loads up from nothing; with t, the grid is t times
smaller and each warp walks t tiles, loading the next tile's first chunk before it reduces the last one, so
its loads stay in flight from its first tile to its last. No knob changes a bit: every variant is checked
bit for bit against ``tiles_per_warp = 1`` (and that one against ``fp8lab.reference.blockwise.gemm`` by
relative error) before it is timed.

For each Qwen3-8B and Qwen3-0.6B decode GEMV the kernel the engine's plan uses (``fp8lab.engine.cuda.plan``):
q/k/v ``gemv_simt``, o and down ``gemv_simt_split_k`` with ``choose_k_splits`` slices, gate/up
``gemv_simt_swiglu``; at M = 1 on float32 activations (both shapes' batch 1), and at M = 4 on float32
(Qwen3-0.6B, ``f32_max_rows`` 4) or BF16 activations through the plain ``gemv_simt`` (Qwen3-8B,
``f32_max_rows`` 1: ``fp8_gemm`` takes the SIMT GEMV up to M = 4, without split-K or SwiGLU).
Times: CUDA-graph replays of 40 launches, weights rotated past the L2 (``bench/timing.py``), medians.
Writes ``gemv_streaming.md``.
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
ENGINE_ROWS = {"qwen3-8b": ((1, "f32"), (4, "bf16")), "qwen3-0.6b": ((1, "f32"), (4, "f32"))}
"""(M, activation format) of the decode batches 1 and 4 at each shape's default ``f32_max_rows``."""


def engine_call(name: str, m: int, act: str, n: int, k: int, sms: int):
    """``(kernel, output shape, split count)`` of the engine's launch for GEMV ``name`` at ``M = m``."""
    from fp8lab.numba_kernels import gemv_simt as kernels
    from fp8lab.simulators.gemv_simt import choose_k_splits

    if act == "bf16":  # fp8_gemm's SIMT path: the plain GEMV, one part
        return kernels.gemv_simt, (m, n), 0
    if name == "gate/up":
        return kernels.gemv_simt_swiglu, (m, n // 2), 0
    if name in ("o", "down"):
        splits = choose_k_splits(n, k, 128, sms)
        return kernels.gemv_simt_split_k, (splits, m, n), splits
    return kernels.gemv_simt, (m, n), 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    parser.add_argument("--tiles", default="1,2,3,4,6,8")
    args = parser.parse_args(argv)
    from numba import cuda
    from timing import copy_bandwidth_tb_s, graph_time_us

    from fp8lab.reference import blockwise
    from fp8lab.reference.dense import silu_mul
    from fp8lab.simulators.dense import sum_parts

    tiles = [int(t) for t in args.tiles.split(",")]
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    bandwidth = copy_bandwidth_tb_s()
    rng = np.random.default_rng(5)
    head = " | ".join(f"t = {t} us" for t in tiles)
    lines = [f"Copy bandwidth {bandwidth:.2f} TB/s; {sms} SMs. Times in us per launch (weight bytes / time in TB/s "
             "for the best).", "", f"| shape | GEMV | M, input | kernel | {head} | best t | best TB/s | best / t = 1 |",
             "|---|---|---|---|" + "---|" * len(tiles) + "---|---|---|"]
    for shape, gemvs in SHAPES.items():
        for name, (n, k) in gemvs.items():
            w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
            q, s = blockwise.quantize(w)
            copies = max(2, int(np.ceil(3 * L2_BYTES / (n * k))))
            q_devs, s_dev = [cuda.to_device(q) for _ in range(copies)], cuda.to_device(s)
            for m, act in ENGINE_ROWS[shape]:
                kernel, out_shape, splits = engine_call(name, m, act, n, k, sms)
                a = rng.standard_normal((m, k)).astype(np.float32)
                if act == "bf16":
                    from fp8lab.simulators.bit_placement import float32_to_bf16_bits

                    a_in = float32_to_bf16_bits(a)
                    a = (a_in.astype(np.uint32) << 16).view(np.float32)
                else:
                    a_in = a
                a_dev, out = cuda.to_device(a_in), cuda.device_array(out_shape, np.float32)
                ref = blockwise.gemm(a, q, s)
                if kernel.__name__ == "gemv_simt_swiglu":
                    ref = silu_mul(ref[:, : n // 2], ref[:, n // 2 :])
                first, times = None, {}
                for t in tiles:
                    out.copy_to_device(np.full(out_shape, np.nan, np.float32))
                    kernel(a_dev, q_devs[0], s_dev, out, tiles_per_warp=t)
                    got = out.copy_to_host()
                    total = sum_parts(got) if splits else got
                    if first is None:
                        first = got
                        err = relative_error(total, ref)
                        if not err < 1e-5:
                            print(f"INVALID {shape} {name} M={m}: rel. err {err}", flush=True)
                            return 1
                    elif not np.array_equal(got.view(np.uint32), first.view(np.uint32)):
                        print(f"NOT BIT-EXACT {shape} {name} M={m} tiles_per_warp={t}", flush=True)
                        return 1
                    times[t] = graph_time_us(lambda i, stream: kernel(a_dev, q_devs[i % copies], s_dev, out,
                                                                      stream=stream, tiles_per_warp=t))
                best = min(times, key=times.get)
                cells = " | ".join(f"{times[t]:.2f}" for t in tiles)
                label = kernel.__name__ + (f" (S = {splits})" if splits else "")
                lines.append(f"| {shape} | {name} | {m}, {act} | {label} | {cells} | {best} | "
                             f"{n * k / times[best] / 1e6:.2f} | {times[best] / times[1]:.2f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_streaming.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
