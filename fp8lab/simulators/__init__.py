"""Bit-exact, vectorized NumPy models of *how* the FP8 kernels compute (lane layouts, bit
placement, float32 operation order); each kernel file names the simulator it matches. Each simulator opens with the kernel it models, the
oracle it is checked against and the test file (``tests/simulators/``)."""
