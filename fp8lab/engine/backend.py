"""The operators the Qwen3 model is written against, and the reference backend that implements them.

The model (``fp8lab.engine.model``) never does FP8 math itself: every linear, norm, rotary embedding,
KV cache write and attention goes through a ``Backend``. ``ReferenceBackend`` runs them with
``fp8lab/reference/`` on the CPU; a GPU kernel backend implements the same methods and plugs in
without touching the model.

Contract (all activations are float32 NumPy arrays on the host; ``T`` = tokens in the batch):

===================================  =========================================================
``prepare_linear(weight, scale_inv,  once at load: turn a checkpoint weight (FP8 codes ``[N, K]``
block)``                             + ``scale_inv`` + ``(BN, BK)``, or a float ``[N, K]``) into
                                     whatever ``linear`` consumes
``linear(x, prepared)``              ``x[..., K] -> [..., N]``: ``x @ W^T`` with W8A16 numerics,
                                     ``W = decode(q) * scale_inv[n // BN, k // BK]``
``lm_head(x, prepared)``             the logits ``x @ lm_head^T`` (a ``linear`` unless the backend
                                     rounds the lm_head's input as its tensor cores do)
``embedding(table, ids)``            rows of the embedding table
``rms_norm(x, weight, eps)``         over the last axis: ``weight * x / sqrt(mean(x^2) + eps)``
``rope(x, positions, theta)``        NeoX-style rotary embedding of ``x[T, heads, head_dim]``
``silu_mul(gate, up)``               ``silu(gate) * up`` (SwiGLU)
``allocate_kv_cache(...)``           per-layer paged caches (``fp8lab.engine.kv_manager.LayerKVCache``)
``write_kv(cache, k, v, slots)``     ``k, v[T, kv_heads, head_dim]`` into their slots (FP8: with
                                     the per (token, kv head) scales of ``fp8lab.reference.kv_cache``)
``decode_attention(q, cache,         one query token per sequence (``q[S, heads, head_dim]``),
block_tables, context_lens, scale)`` the last of its ``context_len`` cached tokens; GQA
``prefill_attention(q, cache,        causal attention of each sequence's new tokens over all its
query_lens, block_tables,            cached tokens (a prefix from earlier chunks + the new ones,
context_lens, scale)``               already written): ``q[sum(query_lens), heads, head_dim]``
===================================  =========================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from fp8lab.reference import attention as ref_attention
from fp8lab.reference import blockwise, dense
from fp8lab.reference import kv_cache as ref_kv

from .kv_manager import LayerKVCache, allocate_kv_cache

GEMM_INPUTS = ("float32", "bf16")
"""The format of the activations entering the FP8 weight GEMMs (``ReferenceBackend(gemm_input=...)``,
``load_model(..., gemm_input=...)``): float32 as they are, or rounded to BF16 first (W8A16 as the
tensor-core kernels run it)."""


class Backend(ABC):
    """The operators of a Qwen3 forward pass (see the module docstring for shapes and meaning)."""

    name: str = "abstract"

    @abstractmethod
    def prepare_linear(self, weight: np.ndarray, scale_inv: np.ndarray | None = None, block=None): ...

    @abstractmethod
    def linear(self, x: np.ndarray, prepared) -> np.ndarray: ...

    def lm_head(self, x: np.ndarray, prepared) -> np.ndarray:
        """The logits ``x @ lm_head^T`` of the final norm's rows ``x``: ``linear`` by default."""
        return self.linear(x, prepared)

    @abstractmethod
    def embedding(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray: ...

    @abstractmethod
    def rope(self, x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray: ...

    @abstractmethod
    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def allocate_kv_cache(self, num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_format): ...

    @abstractmethod
    def write_kv(self, cache: LayerKVCache, k: np.ndarray, v: np.ndarray, slot_mapping: np.ndarray) -> None: ...

    @abstractmethod
    def decode_attention(self, q, cache: LayerKVCache, block_tables, context_lens, scale: float) -> np.ndarray: ...

    @abstractmethod
    def prefill_attention(self, q, cache: LayerKVCache, query_lens, block_tables, context_lens, scale: float): ...


@dataclass(frozen=True)
class PreparedLinear:
    """A weight ready for ``ReferenceBackend.linear``.

    ``weight`` is the float32 ``[N, K]`` matrix the GEMM multiplies by: for an FP8 weight it is
    ``fp8lab.reference.blockwise.dequantize(codes, scale_inv, block)``, computed once at load (the
    per-layer dequantized cache), or ``None`` when the backend dequantizes on every call to save
    memory. ``codes``, ``scale_inv`` and ``block`` keep the FP8 form (``None`` for float weights).
    """

    weight: np.ndarray | None
    codes: np.ndarray | None = None
    scale_inv: np.ndarray | None = None
    block: tuple[int, int] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.codes is not None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes if self.is_fp8 else self.weight).shape


class ReferenceBackend(Backend):
    """CPU backend: every operator is an oracle of ``fp8lab.reference`` (dense operators: ``reference.dense``, float32).

    - ``linear``: W8A16; the FP8 weight is dequantized with ``fp8lab.reference.blockwise.dequantize``
      (``decode(q) * scale_inv`` rounded to float32, once per weight unless
      ``dequantize_once=False``), then one float32 BLAS GEMM. Against the float64 oracle
      ``blockwise.gemm`` the error is within float32 GEMM rounding (tested in
      ``tests/engine/test_model.py``). Results are not batch-invariant in the last bit: BLAS uses a
      different kernel for one row than for many.
    - ``gemm_input``: ``"float32"`` (default) multiplies the FP8 weights by the float32
      activations as they are; ``"bf16"`` first rounds the activations of every FP8 linear to BF16
      (round to nearest even, NaN kept NaN), as ``fp8lab.engine.cuda`` does before its tensor-core
      GEMM, and so does ``lm_head`` (the GPU model's tensor-core lm_head, ``gemv_mma_bf16``, reads
      BF16 too). A BF16 checkpoint's projections always take float32 activations, as the GPU
      model's ``bf16_linear`` does.
    - KV cache writes and attention: ``fp8lab.reference.kv_cache.write`` (FP8 quantization per token and
      kv head), ``fp8lab.reference.attention.paged_decode`` and ``fp8lab.reference.attention.prefill`` over the
      gathered, dequantized cache (both in float64).
    """

    name = "reference"

    def __init__(self, dequantize_once: bool = True, gemm_input: str = "float32"):
        if gemm_input not in GEMM_INPUTS:
            raise ValueError(f"gemm_input: expected one of {', '.join(GEMM_INPUTS)}, got {gemm_input!r}")
        self.dequantize_once = dequantize_once
        self.gemm_input = gemm_input

    # -- dense operators

    def prepare_linear(self, weight, scale_inv=None, block=None) -> PreparedLinear:
        weight = np.asarray(weight)
        if scale_inv is None:
            if weight.dtype == np.uint8:
                raise ValueError("prepare_linear: FP8 codes (uint8) need their scale_inv")
            return PreparedLinear(weight=np.ascontiguousarray(weight, dtype=np.float32))
        if block is None:
            raise ValueError("prepare_linear: an FP8 weight needs its (block_n, block_k)")
        block = (int(block[0]), int(block[1]))
        scale_inv = blockwise.checked_scales(scale_inv, weight.shape, block)
        nan_codes = blockwise.nan_code_positions(weight)
        if len(nan_codes):
            raise ValueError(f"prepare_linear: the FP8 weight holds {len(nan_codes)} NaN codes, "
                             f"e.g. at {tuple(int(i) for i in nan_codes[0])}")
        dense = blockwise.dequantize(weight, scale_inv, block) if self.dequantize_once else None
        return PreparedLinear(weight=dense, codes=weight, scale_inv=scale_inv, block=block)

    def linear(self, x, prepared: PreparedLinear) -> np.ndarray:
        w = prepared.weight
        if w is None:
            w = blockwise.dequantize(prepared.codes, prepared.scale_inv, prepared.block)
        x = np.asarray(x, dtype=np.float32)
        if prepared.is_fp8 and self.gemm_input == "bf16":
            x = dense.round_to_bf16(x)
        return dense.linear(x, w)

    def lm_head(self, x, prepared: PreparedLinear) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        return self.linear(dense.round_to_bf16(x) if self.gemm_input == "bf16" else x, prepared)

    def embedding(self, table, ids) -> np.ndarray:
        return dense.embedding(table, ids)

    def rms_norm(self, x, weight, eps) -> np.ndarray:
        return dense.rms_norm(x, weight, eps)

    def rope(self, x, positions, theta) -> np.ndarray:
        return dense.rope(x, positions, theta)

    def silu_mul(self, gate, up) -> np.ndarray:
        return dense.silu_mul(gate, up)

    # -- paged KV cache and attention

    def allocate_kv_cache(self, num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_format):
        return allocate_kv_cache(num_layers, num_blocks, num_kv_heads, block_size, head_dim, kv_format)

    def write_kv(self, cache: LayerKVCache, k, v, slot_mapping) -> None:
        if cache.kv_format is ref_kv.BF16:  # a NumPy BF16 cache holds BF16 values in float32
            k, v = dense.round_to_bf16(k), dense.round_to_bf16(v)
        ref_kv.write(cache.k, cache.k_scale, k, slot_mapping)
        ref_kv.write(cache.v, cache.v_scale, v, slot_mapping)

    def decode_attention(self, q, cache: LayerKVCache, block_tables, context_lens, scale) -> np.ndarray:
        return ref_attention.paged_decode(q, cache.k, cache.v, block_tables, context_lens, scale,
                                          k_scale=cache.k_scale, v_scale=cache.v_scale)

    def prefill_attention(self, q, cache: LayerKVCache, query_lens, block_tables, context_lens, scale) -> np.ndarray:
        out = np.empty(q.shape, dtype=np.float32)
        start = 0
        for n, table, context_len in zip(query_lens, block_tables, context_lens):
            n, context_len = int(n), int(context_len)
            # gather-dequantize the sequence's pages, then causal attention of its n new tokens
            k = ref_kv.gather(cache.k, cache.k_scale, table, context_len)
            v = ref_kv.gather(cache.v, cache.v_scale, table, context_len)
            out[start : start + n] = ref_attention.prefill(q[start : start + n], k, v, scale)
            start += n
        return out


BACKENDS = {"reference": ReferenceBackend}
"""Per-operator backends for ``fp8lab.engine.model.Qwen3Model`` (``fp8lab.engine.loading.get_backend``)."""
