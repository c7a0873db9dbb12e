"""The tensor-core decode GEMV (``gemv_mma``) against the SIMT GEMV, at the Qwen3 decode shapes, by rows.

For each engine GEMV of Qwen3-8B and Qwen3-0.6B (q/k/v, o, gate/up with SwiGLU, down) and M = 1, 2, 4, 8, 16 (and up
to 32 with ``--rows``; float32 inputs only up to 16):
the kernel the engine ran at that M before ``gemv_mma`` (the SIMT GEMV up to 4 rows: float32 activations,
split-K for o/down, SwiGLU fused; BF16 at M > 1 for the 8B shape, as ``plan.default_f32_max_rows`` says; the
tensor-core ``gemm_mma`` on BF16 beyond 4 rows) and ``gemv_mma`` at its default knobs on BF16 inputs (what
the engine's norms, attention and SwiGLU write for it); at ``--sweep-rows`` (16; the ninth session swept 4), ``gemv_mma`` at every
(k_slices, depth) of ``KNOBS`` in a second table. Each result is validated first against ``fp8lab.reference.blockwise.gemm`` (float64) within
the tensor-core error budget of ``fp8lab.simulators.gemm_mma`` (outputs NaN-poisoned before the launch), and the
float32 and BF16 input forms of ``gemv_mma`` must agree bit for bit. Times: CUDA-graph replays of 40 launches
(PDL edges, as the engine's graph), rotating among weight copies of at least 256 MB in all so the weights come
from HBM. Prints a markdown table; ``--out`` writes it to a file too.

    python bench/gemv_mma.py [--out results.md] [--rows 1,2,4,8,16] [--sweep-rows 16] [--gemvs gate/up,down]  # on a GPU
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from numba import cuda
from timing import graph_time_us

from fp8lab.numba_kernels.gemm_mma import gemm_mma
from fp8lab.numba_kernels.gemv_mma import F32_MAX_ROWS, gemv_mma, gemv_mma_swiglu
from fp8lab.numba_kernels.gemv_simt import (
    gemv_simt,
    gemv_simt_split_k,
    gemv_simt_swiglu,
)
from fp8lab.reference import blockwise
from fp8lab.simulators import bit_placement
from fp8lab.simulators.gemv_simt import choose_k_splits

SHAPES = {  # name: [(gemv, N, K)]
    "qwen3-8b": [("q/k/v", 6144, 4096), ("o", 4096, 4096), ("gate/up", 24576, 4096), ("down", 4096, 12288)],
    "qwen3-0.6b": [("q/k/v", 4096, 1024), ("o", 1024, 2048), ("gate/up", 6144, 1024), ("down", 1024, 3072)],
}
SIMT_ROWS = 4
"""Up to this M the engine ran the SIMT GEMV before ``gemv_mma`` (``fp8_gemm.SIMT_MAX_M``); beyond it ``gemm_mma``."""
KNOBS = [(ks, d) for ks in (2, 4, 8) for d in (1, 2, 3, 4)]
BLOCK = (128, 128)
U = 2.0 ** -24


def random_weight(rng, n, k):
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes (loaders reject them)
    scales = rng.uniform(2.0 ** -9, 2.0 ** -7, (n // BLOCK[0], k // BLOCK[1])).astype(np.float32)
    return codes, scales


def check(name, got, a_bf16, w, scales, swiglu):
    """Within the GPU budget of fp8lab.simulators.gemm_mma against the float64 oracle on the BF16 inputs
    (``w``: the dequantized weight, float64)."""
    a = bit_placement.bf16_bits_to_float32(a_bf16).astype(np.float64)
    exact = a @ w.T
    magnitude = np.abs(a) @ np.abs(w).T
    chunks = w.shape[1] // 128
    bound = (48 + chunks + 1) * U * magnitude + 15 * chunks * 2.0 ** (120 - 150) * scales.max()
    if swiglu:
        half = exact.shape[1] // 2
        g, u = exact[:, :half], exact[:, half:]
        exact = g / (1 + np.exp(-g)) * u
        # silu(g) * u moves by at most |u| |dg| * 1.1 + |silu(g)| |du| plus float32 roundings of the epilogue
        bg, bu = bound[:, :half], bound[:, half:]
        bound = 1.1 * np.abs(u) * bg + np.abs(g) * bu + 8 * U * np.abs(exact) + 1e-30
    if not np.all(np.isfinite(got)) or np.any(np.abs(got - exact) > bound):
        raise SystemExit(f"{name}: wrong result, max error {np.nanmax(np.abs(got - exact)):.3g} "
                         f"(bound there {bound.flat[np.nanargmax(np.abs(got - exact))]:.3g})")


def time_rotating(kernel, x, copies, scales, out, **knobs):
    """Graph-replay time of ``kernel(x, copies[i], scales, out, BLOCK, **knobs)``, rotating the weight copies."""
    return graph_time_us(lambda i, s: kernel(x, copies[i % len(copies)], scales, out, BLOCK, stream=s, **knobs))


def simt_launch(gemv, m, n, x32, x16, copies, scales_d, out, parts, big):
    """The launch the engine used for this GEMV and M before ``gemv_mma``: returns launch(i, stream) and its label.
    Where the engine ran ``silu_mul`` after the GEMV, the label says so; that second launch is not timed."""
    if m > SIMT_ROWS:
        full = out if gemv != "gate/up" else cuda.device_array((m, n), np.float32)
        return (lambda i, s: gemm_mma(x16, copies[i % len(copies)], scales_d, full, BLOCK, stream=s)), \
            "gemm_mma bf16" + (" (+ silu_mul)" if gemv == "gate/up" else "")
    f32 = m == 1 or not big
    x = x32 if f32 else x16
    if gemv == "gate/up" and f32:
        return (lambda i, s: gemv_simt_swiglu(x, copies[i % len(copies)], scales_d, out, BLOCK, stream=s)), \
            "simt swiglu f32"
    if gemv in ("o", "down") and f32:
        return (lambda i, s: gemv_simt_split_k(x, copies[i % len(copies)], scales_d, parts, BLOCK, stream=s)), \
            f"simt split-K {parts.shape[0]} f32"
    full = out if gemv != "gate/up" else cuda.device_array((m, n), np.float32)
    return (lambda i, s: gemv_simt(x, copies[i % len(copies)], scales_d, full, BLOCK, stream=s)), \
        f"simt {'f32' if f32 else 'bf16'}" + (" (+ silu_mul)" if gemv == "gate/up" else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-0.6b")
    parser.add_argument("--rows", default="1,2,4,8,16", help="the M of the first table")
    parser.add_argument("--sweep-rows", default="16", help="the M at which every (k_slices, depth) is timed")
    parser.add_argument("--gemvs", default="q/k/v,o,gate/up,down", help="which of each shape's GEMVs to run")
    args = parser.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    sweep_rows = {int(m) for m in args.sweep_rows.split(",")}
    rng = np.random.default_rng(2026_12_04)
    header = ("| shape | GEMV | M | kernel before (SIMT; gemm_mma past 8 rows) | us before | gemv_mma us, defaults (k_slices, depth) "
              "| gemv_mma / before | weight TB/s, gemv_mma |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    sweep = ["| shape | GEMV | M | " + " | ".join(f"k_slices {ks}, depth {d}" for ks, d in KNOBS) + " |",
             "|---|---|---|" + "---|" * len(KNOBS)]
    for shape in args.shapes.split(","):
        big = shape == "qwen3-8b"
        for gemv, n, k in SHAPES[shape]:
            if gemv not in args.gemvs.split(","):
                continue
            codes, scales = random_weight(rng, n, k)
            count = max(2, -(-256 * 2**20 // (n * k)))
            copies = [cuda.to_device(codes)] + [cuda.to_device(rng.permutation(codes, axis=0)) for _ in range(count - 1)]
            scales_d = cuda.to_device(scales)
            w = blockwise.dequantize(codes, scales, BLOCK).astype(np.float64)
            swiglu = gemv == "gate/up"
            mma_fn = gemv_mma_swiglu if swiglu else gemv_mma
            width = n // 2 if swiglu else n
            for m in rows:
                a = rng.standard_normal((m, k)).astype(np.float32)
                a16 = bit_placement.float32_to_bf16_bits(a)
                x32, x16 = cuda.to_device(a), cuda.to_device(a16)
                results = {}
                forms = ((x32, "f32"), (x16, "bf16")) if m <= F32_MAX_ROWS else ((x16, "bf16"),)
                for x, form in forms:
                    out = cuda.to_device(np.full((m, width), np.nan, np.float32))
                    mma_fn(x, copies[0], scales_d, out, BLOCK)
                    results[form] = out.copy_to_host()
                if "f32" in results and not np.array_equal(results["f32"].view(np.uint32),
                                                           results["bf16"].view(np.uint32)):
                    raise SystemExit(f"{shape} {gemv} M={m}: float32 and BF16 inputs differ")
                check(f"{shape} {gemv} M={m}", results["bf16"], a16, w, scales, swiglu)
                out = cuda.device_array((m, width), np.float32)
                if m in sweep_rows:
                    times = [time_rotating(mma_fn, x16, copies, scales_d, out, k_slices=ks, depth=d) for ks, d in KNOBS]
                    sweep.append(f"| {shape} | {gemv} | {m} (BF16 in) | " + " | ".join(f"{t:.2f}" for t in times) + " |")
                    print(sweep[-1], flush=True)
                t_default = time_rotating(mma_fn, x16, copies, scales_d, out)
                splits = choose_k_splits(n, k, BLOCK[1], 132)
                parts = cuda.device_array((splits, m, n), np.float32)
                simt, label = simt_launch(gemv, m, n, x32, x16, copies, scales_d,
                                          cuda.device_array((m, width), np.float32), parts, big)
                t_simt = graph_time_us(simt)
                lines.append(f"| {shape} | {gemv} | {m} | {label} | {t_simt:.2f} | {t_default:.2f} "
                             f"(bf16 in) | {t_default / t_simt:.2f} | {n * k / t_default / 1e6:.2f} |")
                print(lines[-1], flush=True)
    lines += [""] + sweep
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
