"""The streaming-read ceiling at each decode GEMV's size: how long one kernel takes just to read that many bytes.

    python bench/read_ceiling.py [--out DIR]

A decode GEMV at M = 1 must read its weight codes once, so no GEMV of that size can beat one kernel that only
reads them. This benchmark times such a kernel (``read_kernel``: each thread sums 128-bit loads of a uint32
buffer, ``LOADS`` in flight per thread, grid-stride over the buffer; a store guarded by a test the sum
practically never passes keeps the loads from being removed) for the weight bytes of every Qwen3-8B and Qwen3-0.6B GEMV and the lm_head, by CUDA-graph
replay with buffers rotated past the L2 (``bench/timing.py``). It reports the best over a few grid sizes, as
TB/s (bytes read / time) against the device-to-device copy bandwidth (bytes read + written) of the same run.
The gap between the small sizes and the large ones is the cost of a kernel's start and end (launch, the ramp
until enough loads are in flight, the last wave), which no GEMV tuning removes; writes ``read_ceiling.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gemm import L2_BYTES  # noqa: E402
from gemv_split_k import SHAPES  # noqa: E402

from fp8lab.engine import shapes  # noqa: E402


def read_sizes() -> dict[str, int]:
    """Bytes each kernel reads: the FP8 codes of each decode GEMV's weight (``gemv_split_k.SHAPES``; the scales
    are 1/16384 of that), then the BF16 lm_head of the shape."""
    sizes = {}
    for shape, gemvs in SHAPES.items():
        sizes.update({f"{shape} {name}": n * k for name, (n, k) in gemvs.items()})
        config = shapes.shape_config(shape)
        sizes[f"{shape} lm_head (BF16)"] = config.vocab_size * config.hidden_size * 2
    return sizes


LOADS = 4
THREADS = 128
CTAS_PER_SM = (2, 4, 8, 16)


def make_read_kernel():
    from numba import cuda, uint32

    from fp8lab.numba_kernels.warp import load_u32x4

    @cuda.jit
    def read_kernel(words, out):
        """Sum (xor) every 128-bit piece of ``words``, LOADS pieces in flight per thread; one word per CTA."""
        pieces = words.shape[0] // 4
        stride = cuda.gridDim.x * cuda.blockDim.x
        acc = uint32(0)
        first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        for base in range(first, pieces, stride * LOADS):
            for j in range(LOADS):
                p = base + j * stride
                if p < pieces:
                    a, b, c, d = load_u32x4(words, uint32(4 * p))
                    acc ^= a ^ b ^ c ^ d
        if acc == uint32(0x9E3779B9):  # practically never: keeps the loads without a store per thread
            out[cuda.blockIdx.x] = acc

    return read_kernel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    args = parser.parse_args(argv)
    from numba import cuda
    from timing import copy_bandwidth_tb_s, graph_time_us

    read_kernel = make_read_kernel()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    bandwidth = copy_bandwidth_tb_s()
    out = cuda.device_array(sms * max(CTAS_PER_SM), np.uint32)
    lines = [f"Copy bandwidth {bandwidth:.2f} TB/s (read + write). One read-only kernel per size, {THREADS} threads "
             f"per CTA, {LOADS} 128-bit loads in flight per thread, best grid of {CTAS_PER_SM} CTAs per SM.", "",
             "| what | MB | read us | read TB/s | of copy bandwidth | best CTAs per SM |", "|---|---|---|---|---|---|"]
    for name, nbytes in read_sizes().items():
        copies = max(2, int(np.ceil(3 * L2_BYTES / nbytes)))
        buffers = [cuda.device_array(nbytes // 4, np.uint32) for _ in range(copies)]  # contents do not matter
        best = None
        for per_sm in CTAS_PER_SM:
            grid = min(sms * per_sm, -(-nbytes // (16 * THREADS)))

            def launch(i, stream, grid=grid, buffers=buffers):
                read_kernel[grid, THREADS, stream](buffers[i % copies], out)

            us = graph_time_us(launch)
            if best is None or us < best[0]:
                best = (us, per_sm)
        tb_s = nbytes / best[0] / 1e6
        lines.append(f"| {name} | {nbytes / 1e6:.1f} | {best[0]:.2f} | {tb_s:.2f} | {tb_s / bandwidth:.0%} | {best[1]} |")
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_ceiling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
