"""The Qwen3-FP8 engine on an NVIDIA GPU: ``CudaQwen3Model`` (``fp8lab.engine.cuda.model``), the forward pass
as ``numba_kernels`` launches (and, unchanged, in Numba's CUDA simulator).

It is a drop-in for ``fp8lab.engine.model.Qwen3Model`` where ``fp8lab.engine.generate.Generator`` uses it
(both implement ``fp8lab.engine.model.CausalLM``): ``config``, ``allocate_kv_cache(num_blocks, block_size,
kv_cache_dtype)``, ``forward(batch, kv_cache, all_logits=False)``, which returns float32 host logits, and
``greedy_tokens(batch, kv_cache)``, the greedy ids sampled on the device.

One concern per module, read in this order:

- ``memory``: every device allocation and copy (NumPy arrays in the simulator), out-of-memory errors that
  name the array;
- ``weights``: what the constructor uploads (FP8 codes and scales, q/k/v and gate/up fused and re-blocked
  by ``fp8lab.reference.blockwise.concatenate_rows``, BF16 embeddings) and which shapes the kernels take
  (``unsupported_reason``);
- ``kv_cache``: the paged cache on the device and the named index buffers its forwards read;
- ``plan``: the forward as a ``Plan``, a sequence of kernel launches over preallocated activations,
  whose length is the launch count; the float32 / BF16 GEMM input rule (``f32_max_rows``);
- ``graphs``: decode steps captured into CUDA graphs and replayed;
- ``stats``: what the model did (launches per decode step, replays, host time);
- ``model``: ``CudaQwen3Model``, which ties them together: checks a batch, stages its indices, runs the
  plan or replays its graph, copies the result out.

Checked against ``Qwen3Model`` on the reference backend (``tests/engine/test_cuda_model.py``, which states
and derives the bounds): in the CUDA simulator on a micro model, every non-GEMM kernel for real and
the three GEMM kernels replaced by their bit-exact NumPy twins (``fp8lab/simulators/``; the simulator spends
milliseconds per simulated thread, so one real-width GEMM takes seconds to minutes there): greedy
tokens identical over prefill and decode steps with BF16 and FP8 KV, a batch of three with a padding
row, logits within ``1e-4`` / ``1e-3`` (measured 2e-7), the BF16-input path within ``2^-6``, padding
rows writing nothing into the cache, launch counts, ``fp8lab generate --backend cudasim``. On a GPU
with the embedded tiny model and the real kernels: 32 greedy tokens identical to the reference (BF16
and FP8 KV, one sequence and a batch of two), logits within ``5e-3``, graph replays bit-identical to
eager steps, a long prompt through the tensor-core path, out-of-memory errors, and
``fp8lab generate --backend cuda``.
"""
