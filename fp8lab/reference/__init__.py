"""NumPy oracles of *what* each FP8 operator computes.

Modules (import them directly; nothing here is loaded eagerly):

- ``fp8lab.reference.e4m3``: the OCP ``float8_e4m3fn`` format, exact decode, round-to-nearest-even encode.
- ``fp8lab.reference.blockwise``: 128x128 blockwise weight quantization, W8A16 and W8A8 GEMMs.
- ``fp8lab.reference.kv_cache``: FP8 KV cache with one scale per (token, kv head), paged layout.
- ``fp8lab.reference.attention``: paged decode attention (GQA, ALiBi, FP8 KV) and causal prefill.
- ``fp8lab.reference.dense``: the dense Qwen3 operators (RMSNorm and the fused residual add, NeoX RoPE,
  SwiGLU, embedding, the float linear, BF16 rounding, greedy argmax), as the engine's reference runs them.
- ``fp8lab.reference.strategies``: Hypothesis strategies for property tests of foreign kernels
  (needs ``hypothesis``, which is in the ``strategies`` extra: ``pip install "fp8lab[strategies]"``).

Only NumPy is used. Math that the contract leaves open is done in float64 so that the oracle's
own rounding is negligible next to the kernels' float32 rounding.
"""
