"""What one phase boundary of a decode step costs: a kernel boundary against a barrier inside one persistent kernel.

    python bench/grid_sync_probe.py [--phases 1000]

A decode step at batch 1 is a chain of small dependent kernels (8 per layer); at Qwen3-0.6B each adds 2 to 7 us to
the step, far more than its bytes take (``bench/RESULTS.md``, thirty-fifth session). A persistent kernel would
replace each boundary by a grid-wide barrier. This probe times one boundary of each kind on the same chain of
phases, over one CTA of 128 threads per SM: in phase ``p``, CTA ``b`` reads what CTA ``b + 1`` wrote in phase
``p - 1`` and writes that plus one, so every phase depends on the one before across SMs, as a decode step's
kernels do. The variants:

- **kernel boundary**: one kernel per phase, programmatic dependent launches (``pdl.launch``) replayed in a CUDA graph,
  as the engine's decode step runs; ``timing.graph_time_us`` over the chain, per kernel.
- **grid sync**: one cooperative kernel running every phase, ``cuda.cg.this_grid().sync()`` between them.
- **counter barrier**: one kernel running every phase, a barrier of one global counter (each CTA's thread 0 fences,
  adds 1, and spins until the count reaches the phase's target); the CTAs must all be resident (one per SM).

The two persistent variants are timed by wall clock around a synchronized launch of ``--phases`` phases and of one
phase, per phase ``(T(N) - T(1)) / (N - 1)``, median of 7. In the persistent kernels every read of the chain is an
atomic (``atomic.add`` of 0: through the L2, never a stale L1 line). Before timing, each variant's chain is
checked: after ``N`` phases every CTA holds ``N``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

THREADS = 128


def kernels():
    """The three kernels (compiled on first launch)."""
    from numba import cuda, int32

    from fp8lab.numba_kernels import pdl

    @cuda.jit
    def phase_kernel(source, target):
        pdl.prologue()
        b = cuda.blockIdx.x
        if cuda.threadIdx.x == 0:
            target[b] = source[(b + 1) % cuda.gridDim.x] + 1

    @cuda.jit
    def grid_sync_kernel(chain, phases):
        grid = cuda.cg.this_grid()
        b, n = cuda.blockIdx.x, cuda.gridDim.x
        for p in range(phases):
            if cuda.threadIdx.x == 0:
                chain[(p + 1) % 2, b] = cuda.atomic.add(chain, ((p % 2), (b + 1) % n), 0) + 1
            grid.sync()

    @cuda.jit
    def counter_kernel(chain, counter, phases):
        b, n = cuda.blockIdx.x, cuda.gridDim.x
        for p in range(phases):
            if cuda.threadIdx.x == 0:
                chain[(p + 1) % 2, b] = cuda.atomic.add(chain, ((p % 2), (b + 1) % n), 0) + 1
                cuda.threadfence()
                cuda.atomic.add(counter, 0, 1)
                target = int32((p + 1) * n)
                while cuda.atomic.add(counter, 0, 0) < target:
                    pass
            cuda.syncthreads()

    return phase_kernel, grid_sync_kernel, counter_kernel


def kernel_boundary_us(phase_kernel, ctas: int, phases: int) -> float:
    """Microseconds per kernel of the PDL chain replayed in a CUDA graph, after checking one replay's result."""
    from numba import cuda
    from timing import graph_time_us

    from fp8lab.numba_kernels import pdl

    buffers = [cuda.to_device(np.zeros(ctas, np.int32)), cuda.to_device(np.zeros(ctas, np.int32))]

    def launch(i, stream):
        pdl.launch(phase_kernel, ctas, THREADS, stream, buffers[i % 2], buffers[(i + 1) % 2])

    graph_time_us(launch, reps=phases, replays=1)  # a warm-up replay and one more: 2 * phases kernels, in order
    got = buffers[0].copy_to_host()  # (an even chain ends in the buffer it starts from)
    if not np.all(got == 2 * phases):
        raise RuntimeError(f"kernel boundary: the chain holds {np.unique(got)}, not {2 * phases}")
    return graph_time_us(launch, reps=phases, replays=7)


def persistent_us(run, phases: int) -> float:
    """Microseconds per phase of a persistent kernel: ``run(n)`` launches it for ``n`` phases and synchronizes."""
    def seconds(n):
        start = time.perf_counter()
        run(n)
        return time.perf_counter() - start

    samples = [(seconds(phases) - seconds(1)) / (phases - 1) * 1e6 for _ in range(7)]
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", type=int, default=1000, help="phases per timed chain (default 1000)")
    args = parser.parse_args()
    if args.phases < 2 or args.phases % 2:
        parser.error(f"--phases: an even number of at least 2 (the chain alternates two buffers), got {args.phases}")
    from numba import cuda

    device = cuda.get_current_device()
    ctas = device.MULTIPROCESSOR_COUNT
    phase_kernel, grid_sync_kernel, counter_kernel = kernels()
    print(f"{device.name.decode() if isinstance(device.name, bytes) else device.name}: {ctas} CTAs of {THREADS} threads")

    rows = [("kernel boundary (PDL, CUDA graph)", kernel_boundary_us(phase_kernel, ctas, args.phases))]

    chain = cuda.device_array((2, ctas), np.int32)

    def run_grid_sync(n):
        chain.copy_to_device(np.zeros((2, ctas), np.int32))
        grid_sync_kernel[ctas, THREADS](chain, n)
        cuda.synchronize()
        got = chain.copy_to_host()[n % 2]
        if not np.all(got == n):
            raise RuntimeError(f"grid sync: the chain holds {np.unique(got)} after {n} phases")

    counter = cuda.device_array(1, np.int32)

    def run_counter(n):
        chain.copy_to_device(np.zeros((2, ctas), np.int32))
        counter.copy_to_device(np.zeros(1, np.int32))
        counter_kernel[ctas, THREADS](chain, counter, n)
        cuda.synchronize()
        got = chain.copy_to_host()[n % 2]
        if not np.all(got == n):
            raise RuntimeError(f"counter barrier: the chain holds {np.unique(got)} after {n} phases")

    for name, run in (("grid sync (cooperative groups)", run_grid_sync), ("counter barrier", run_counter)):
        run(args.phases)  # compile and check
        rows.append((name, persistent_us(run, args.phases)))

    print("| phase boundary | us per phase |")
    print("|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
