"""Bit-exact, vectorized NumPy models of *how* the FP8 kernels compute (lane layouts, bit
placement, float32 operation order). Filled in by the simulators issue; see ARCHITECTURE.md."""
