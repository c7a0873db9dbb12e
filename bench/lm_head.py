"""The lm_head (a BF16 weight, 151,936 rows) at decode batches: the SIMT ``bf16_linear`` against ``gemv_mma_bf16``.

For the Qwen3-8B and Qwen3-0.6B lm_heads and M = 1, 2, 4, 8, 16: ``layers.bf16_linear`` on float32 activations (what
the engine runs) and ``gemv_mma.gemv_mma_bf16`` on their BF16 rounding (tensor cores, the weights as the A operand).
Each is validated first on a slice of the weight's rows against the float64 product (``bf16_linear``: the float32
bound of its order; ``gemv_mma_bf16``: the tensor-core budget, on the BF16-rounded inputs), outputs NaN-poisoned.
Times: CUDA-graph replays (the weight, 311 MB or 1.2 GB, is far larger than the L2). Prints a markdown table with
the weight bytes per microsecond against the copy bandwidth measured in the same run.

    python bench/lm_head.py [--out results.md]      # on a GPU; results in bench/RESULTS.md
"""

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from numba import cuda
from timing import copy_bandwidth_tb_s, graph_time_us

from fp8lab.numba_kernels.gemv_mma import gemv_mma_bf16
from fp8lab.numba_kernels.layers import bf16_linear
from fp8lab.simulators import bit_placement

SHAPES = {"qwen3-8b": 4096, "qwen3-0.6b": 1024}  # hidden size; the vocabulary is 151,936 for both
VOCAB = 151936
ROWS = (1, 2, 4, 8, 16)
CHECKED_ROWS = 4096
"""Weight rows validated against float64 (all of them would take minutes on the host)."""
U = 2.0 ** -24


def validate(name, got, a, w_bits, tensor_cores):
    """``got`` (the first ``CHECKED_ROWS`` columns) against the float64 product, within the kernel's bound."""
    a64 = a.astype(np.float64)
    if tensor_cores:
        a64 = bit_placement.bf16_bits_to_float32(bit_placement.float32_to_bf16_bits(a)).astype(np.float64)
    w64 = bit_placement.bf16_bits_to_float32(w_bits[:CHECKED_ROWS]).astype(np.float64)
    exact, magnitude = a64 @ w64.T, np.abs(a64) @ np.abs(w64).T
    k = a.shape[1]
    bound = ((48 + k // 128 + 9) if tensor_cores else (k // 8 + 40)) * U * magnitude
    got = got[:, :CHECKED_ROWS].astype(np.float64)
    if not np.all(np.isfinite(got)) or np.any(np.abs(got - exact) > bound):
        raise SystemExit(f"{name}: wrong result, max error {np.nanmax(np.abs(got - exact)):.3g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(2026_12_04)
    copy = copy_bandwidth_tb_s()
    lines = [f"Copy bandwidth {copy:.2f} TB/s (read + write).", "",
             "| shape | M | bf16_linear us | gemv_mma_bf16 us | gemv_mma_bf16 / bf16_linear | gemv_mma_bf16 weight TB/s |",
             "|---|---|---|---|---|---|"]
    for shape, k in SHAPES.items():
        w_bits = bit_placement.float32_to_bf16_bits((rng.standard_normal((VOCAB, k)) * 0.02).astype(np.float32))
        w_d = cuda.to_device(w_bits)
        for m in ROWS:
            a = rng.standard_normal((m, k)).astype(np.float32)
            x32, x16 = cuda.to_device(a), cuda.to_device(bit_placement.float32_to_bf16_bits(a))
            out = cuda.to_device(np.full((m, VOCAB), np.nan, np.float32))
            bf16_linear(x32, w_d, out)
            validate(f"{shape} M={m} bf16_linear", out.copy_to_host(), a, w_bits, False)
            out = cuda.to_device(np.full((m, VOCAB), np.nan, np.float32))
            gemv_mma_bf16(x16, w_d, out)
            validate(f"{shape} M={m} gemv_mma_bf16", out.copy_to_host(), a, w_bits, True)
            t_simt = graph_time_us(lambda i, s: bf16_linear(x32, w_d, out, stream=s))
            t_mma = graph_time_us(lambda i, s: gemv_mma_bf16(x16, w_d, out, stream=s))
            lines.append(f"| {shape} | {m} | {t_simt:.1f} | {t_mma:.1f} | {t_mma / t_simt:.2f} | "
                         f"{w_bits.nbytes / t_mma / 1e6:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
