"""Single-threaded speed of the NumPy simulators ``gemv_simt`` and ``splitkv``.

Runs on any CPU, one thread (the BLAS/OpenMP thread counts are pinned to 1 before NumPy loads).
Each case is validated against its ``reference`` oracle before it is timed, then run ``--repeat``
times; the table shows the best wall time, the CPU time of that run (a better guide on a shared
machine), and useful multiply-adds per second (M MAC/s, from the wall time) against the target of
issue 4: 100x a plain Python loop simulation (about 5 M MAC/s), so 500 M MAC/s.

- ``gemv_simt`` at M = 1, 2 and 8, N = K = 4096, 128 x 128 blocks: ``M * N * K`` MACs. Activations
  are bf16 values (what the kernel gets), which lets the model use exact float32 products; the
  ``f32 act`` row feeds full float32 activations, where every product goes through an exact fma.
- ``splitkv.paged_decode`` at a decode shape of Llama-3-8B (32 query heads, 8 kv heads, head_dim
  128), FP8 cache in blocks of 16, ``num_splits="auto"``: ``2 * num_seqs * num_heads * L * head_dim``
  MACs (QK and PV). ``--by-step`` adds the same cases through ``splitkv.shard_partials_by_step``,
  the plain step-by-step statement of the schedule that the vectorized model reproduces bit for bit.

Usage::

    python bench/simulator_speed_gemv_splitkv.py [--repeat 3] [--quick] [--by-step]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp8lab.reference import attention, blockwise  # noqa: E402
from fp8lab.reference import strategies as fst  # noqa: E402
from fp8lab.simulators import gemv_simt, splitkv  # noqa: E402


TARGET_MAC_PER_S = 500e6  # issue 4: 100x a pure-Python loop simulation (~5 M MAC/s)


def best_seconds(fn, repeat: int) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of the fastest of ``repeat`` runs."""
    runs = []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(runs)


def to_bf16_values(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 value (ties to even), kept as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def gemv_case(rng, m: int, n: int, k: int, bf16: bool):
    w = rng.standard_normal((n, k)).astype(np.float32)
    q, scale_inv = blockwise.quantize(w)
    a = rng.standard_normal((m, k)).astype(np.float32)
    if bf16:
        a = to_bf16_values(a)
    out = gemv_simt.gemv_simt(a, q, scale_inv)
    ref = blockwise.gemm(a, q, scale_inv)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert np.all(np.isfinite(out)) and rel < 1e-6, f"gemv_simt does not validate: relative error {rel:.2e}"
    return (lambda: gemv_simt.gemv_simt(a, q, scale_inv)), m * n * k, rel


def splitkv_case(rng, num_seqs: int, seq_len: int, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16):
    blocks = -(-seq_len // block_size)
    tables = rng.permutation(num_seqs * blocks).reshape(num_seqs, blocks).astype(np.int32)
    layout = fst.PagedKVLayout(num_heads, num_kv_heads, head_dim, block_size, num_seqs * blocks, tables,
                               np.full(num_seqs, seq_len, np.int32))
    data = layout.random_data(rng, fp8=True)
    out = splitkv.paged_decode(*data.decode_args())
    ref = attention.paged_decode(*data.decode_args())
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert np.all(np.isfinite(out)) and rel < 1e-5, f"splitkv does not validate: relative error {rel:.2e}"
    splits = splitkv.choose_num_splits(num_seqs, num_heads, seq_len, block_size=block_size)
    macs = 2 * num_seqs * num_heads * seq_len * head_dim

    def by_step():  # the plain step-by-step model, then the same combine
        partials = splitkv.shard_partials_by_step(*data.decode_args())
        return splitkv.combine_partials(partials.m, partials.l, partials.acc)

    return (lambda: splitkv.paged_decode(*data.decode_args())), by_step, macs, rel, splits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller shapes, for a smoke test")
    parser.add_argument("--by-step", action="store_true", help="also time splitkv's step-by-step model")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    size = 1024 if args.quick else 4096
    seq_len = 512 if args.quick else 4096

    rows = []
    for m, bf16 in ((1, True), (2, True), (8, True), (1, False)):
        fn, macs, rel = gemv_case(rng, m, size, size, bf16)
        label = f"gemv_simt M={m} N=K={size}" + ("" if bf16 else " (f32 act)")
        rows.append((label, macs, best_seconds(fn, args.repeat), f"rel err {rel:.1e}"))
    for num_seqs in (1, 4):
        fn, by_step, macs, rel, splits = splitkv_case(rng, num_seqs, seq_len)
        label = f"splitkv {num_seqs}x{seq_len} tok, 32/8 heads, D=128"
        rows.append((label, macs, best_seconds(fn, args.repeat), f"rel err {rel:.1e}, {splits} splits"))
        if args.by_step:
            rows.append(("  the same, step by step", macs, best_seconds(by_step, 1), "best of 1"))

    print(f"simulator speed, 1 thread, numpy {np.__version__}, {platform.processor() or platform.machine()}, "
          f"best of {args.repeat}; target {TARGET_MAC_PER_S / 1e6:.0f} M MAC/s")
    print(f"{'case':<44} {'M MAC':>8} {'wall s':>8} {'cpu s':>8} {'M MAC/s':>8}  check")
    for label, macs, (wall, cpu), note in rows:
        rate = macs / wall
        mark = "" if label.startswith(" ") else (" ok" if rate >= TARGET_MAC_PER_S else " below target")
        print(f"{label:<44} {macs / 1e6:>8.1f} {wall:>8.3f} {cpu:>8.3f} {rate / 1e6:>8.0f}  {note}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
