"""fp8lab: the educational reference and test oracle for FP8 (E4M3) LLM inference.

Each algorithm comes in three views, side by side, plus an engine that runs them:

- ``fp8lab.reference``: NumPy oracles of *what* each operator computes (needs only NumPy;
  ``fp8lab.reference.strategies`` adds Hypothesis strategies: ``pip install "fp8lab[strategies]"``);
- ``fp8lab.simulators``: bit-exact NumPy models of *how* the kernels compute it (lane layouts,
  bit placement, float32 operation order);
- ``fp8lab.numba_kernels``: Numba CUDA kernels of the same algorithms, on a GPU or in Numba's CUDA
  simulator (``pip install "fp8lab[kernels]"``);
- ``fp8lab.engine``: a Qwen3-FP8 engine and the ``fp8lab`` command line (``pip install "fp8lab[engine]"``);
- ``fp8lab.testing``: the kit that checks *your* FP8 kernel against the contract and names the bug
  class of a failure (``pip install "fp8lab[testing]"``).

Nothing is imported eagerly: ``import fp8lab`` loads no subpackage, and each subpackage imports
its own dependencies when it is imported. The numerics contract is the repository's ARCHITECTURE.md.
"""

__version__ = "0.1.0"
__all__ = ["reference", "simulators", "numba_kernels", "engine", "testing"]
