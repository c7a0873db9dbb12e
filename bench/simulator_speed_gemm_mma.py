"""How fast is the vectorized mma-GEMM simulator (fp8lab.simulators.gemm_mma) on one CPU core?

Usage (from the repository root)::

    python bench/simulator_speed_gemm_mma.py [--repeats N]

Validates first (a small GEMM against the float64 oracle, within the documented bound), then
times Qwen3-8B-shaped GEMMs and prints seconds (wall clock and process CPU time, best of
``--repeats``) and useful multiply-adds per CPU second (M*N*K / s). Goal: M=16, N=4096, K=4096 in
under 5 s and at least 500 M MAC/s. BLAS and OpenMP threads are pinned to 1 before NumPy loads,
so the numbers are one core's.
"""

from __future__ import annotations

import os

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
for _var in THREAD_VARIABLES:  # before NumPy is imported, or BLAS has already started its threads
    os.environ[_var] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from fp8lab.reference import blockwise, e4m3  # noqa: E402
from fp8lab.simulators import bit_placement, gemm_mma  # noqa: E402

SHAPES = [
    # (label, M, N, K, m_blocks, activation)
    ("Qwen3-8B q_proj, 16 tokens", 16, 4096, 4096, 1, "bf16"),
    ("Qwen3-8B q_proj, 16 tokens, f16", 16, 4096, 4096, 1, "f16"),
    ("Qwen3-8B q_proj, decode (1 token)", 1, 4096, 4096, 1, "bf16"),
    ("Qwen3-8B q_proj, 32 tokens, M_BLOCKS=2", 32, 4096, 4096, 2, "bf16"),
    ("Qwen3-8B down_proj, 16 tokens", 16, 4096, 12288, 1, "bf16"),
]


def make_problem(rng, m, n, k):
    """Random non-NaN codes and checkpoint-like scales (quantizing a big random weight would take
    longer than the GEMM; the simulator's speed does not depend on the values)."""
    codes = np.arange(256, dtype=np.uint8)
    q = rng.choice(codes[~e4m3.is_nan(codes)], size=(n, k))
    scale_inv = rng.uniform(2e-5, 2e-4, size=blockwise.scale_shape((n, k))).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(np.float32)
    return a, q, scale_inv


def validate(rng) -> None:
    """Small GEMM against the float64 oracle on the rounded activations: the documented bound."""
    a, q, scale_inv = make_problem(rng, 24, 200, 512)
    for activation in bit_placement.FORMATS:
        out = gemm_mma.gemm_mma(a, q, scale_inv, m_blocks=2, activation=activation)
        a16 = bit_placement.bits_to_float32(bit_placement.activation_bits(a, activation), activation).astype(np.float64)
        ref = blockwise.gemm(a16, q, scale_inv)
        w = blockwise.dequantize(q, scale_inv).astype(np.float64)
        chunks = 512 // gemm_mma.K_CHUNK
        bound = (chunks + 9) * 2.0**-24 * (np.abs(a16) @ np.abs(w).T) + 15 * chunks * 2.0 ** (
            bit_placement.EXPONENT_OFFSET[activation] - 150
        ) * float(scale_inv.max()) + chunks * 2.0**-150
        if not (np.all(np.isfinite(out)) and np.all(np.abs(out - ref) <= bound)):
            raise SystemExit(f"validation failed for {activation}: max error {np.max(np.abs(out - ref)):.3g}")
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        print(f"validate {activation}: ok (relative error {rel:.2e} against the float64 oracle)")


def time_gemm(a, q, scale_inv, m_blocks, activation, repeats) -> tuple[float, float]:
    """Best wall-clock and best process-CPU seconds over ``repeats`` runs."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = gemm_mma.gemm_mma(a, q, scale_inv, m_blocks=m_blocks, activation=activation)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    assert np.all(np.isfinite(out))
    return best_wall, best_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape; the best is reported")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    validate(rng)
    print(f"\n{'shape':42s} {'M':>4s} {'N':>6s} {'K':>6s}  {'wall s':>7s}  {'cpu s':>6s}  {'M MAC/s':>8s}")
    problems = [(label, make_problem(rng, m, n, k), m_blocks, activation) for label, m, n, k, m_blocks, activation in SHAPES]
    # The slow path: activations whose exponents span too much for the exactness proof make every
    # k16 sum run as the ascending-k float64 loop instead of BLAS.
    a, q, scale_inv = make_problem(rng, 16, 4096, 4096)
    a[:, ::16] *= np.float32(2.0**30)
    problems.append(("same, wide-span activations (loop path)", (a, q, scale_inv), 1, "bf16"))
    for label, (a, q, scale_inv), m_blocks, activation in problems:
        wall, cpu = time_gemm(a, q, scale_inv, m_blocks, activation, args.repeats)
        (m, k), n = a.shape, q.shape[0]
        print(f"{label:42s} {m:4d} {n:6d} {k:6d}  {wall:7.3f}  {cpu:6.3f}  {m * n * k / cpu / 1e6:8.0f}")
    print("\nM MAC/s = M*N*K / cpu s (process CPU time, robust on a shared machine; wall time is also shown).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
