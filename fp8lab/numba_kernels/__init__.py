"""Numba CUDA kernels of the FP8 algorithms; the same source runs on an NVIDIA GPU and in Numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is imported).

Toolkit:

- ``fp8lab.numba_kernels.cudasim``: warp intrinsics (shuffles, votes, ``syncwarp``) for the simulator,
  installed on import when the simulator is on;
- ``fp8lab.numba_kernels.bits``: bit reinterpretation (uint32 <-> float32, BF16/F16 patterns) in both modes;
- ``fp8lab.numba_kernels.racecheck``: a shared-memory race checker for kernels run in the simulator
  (``with racecheck.checking(): kernel[grid, block](...)``).
- ``fp8lab.numba_kernels.inlining``: faster Numba inlining (``install()``: the same PTX in about half the compile
  time; the engine's GPU model, the tests and ``bench/engine.py`` install it).
"""

from . import cudasim

SIMULATOR = cudasim.install()
