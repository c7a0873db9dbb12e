"""Numba CUDA kernels of the FP8 algorithms; the same source runs on an NVIDIA GPU and in Numba's
CUDA simulator. Filled in by the kernel issues; see ARCHITECTURE.md."""
