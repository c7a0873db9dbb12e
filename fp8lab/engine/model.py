"""The Qwen3 forward pass over a paged KV cache, written against ``fp8lab.engine.backend.Backend``.

One decoder layer (``h`` is the residual stream, float32 ``[T, hidden]``)::

    x = rms_norm(h, input_layernorm)
    q, k, v = x @ Wq^T, x @ Wk^T, x @ Wv^T               split into heads
    q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)       per head, BEFORE RoPE (Qwen3)
    q, k = rope(q, positions), rope(k, positions)         NeoX style, rope_theta
    cache[slot_mapping] = k, v                            K stored after k-norm and RoPE
    a = attention(q, cache)                               causal, GQA, over the paged cache
    h = h + a @ Wo^T
    x = rms_norm(h, post_attention_layernorm)
    h = h + (silu(x @ Wgate^T) * (x @ Wup^T)) @ Wdown^T   SwiGLU

then ``logits = rms_norm(h, model.norm) @ lm_head^T`` (``lm_head`` is ``embed_tokens`` when
``tie_word_embeddings``).

A forward runs a *batch* of sequences, flattened token by token as in vLLM and nano-vllm: each
sequence contributes its new tokens (a whole prompt, a prefill chunk after an earlier prefix,
or one decode token), described by ``ForwardBatch``. Sequences with exactly one new token go
to the backend's paged decode attention, the others to its prefill attention over the cached
prefix. The forward returns float32 logits of the last new token of every sequence (or of
every new token, for tests).

``CausalLM`` is the interface the generator drives (``allocate_kv_cache``, ``forward``, ``greedy_tokens``);
``Qwen3Model`` implements it on a backend on the host, ``fp8lab.engine.cuda.model.CudaQwen3Model`` with
kernels on the device.

Non-finite values: weights or scales that load fine can still overflow float32 at run time. The
forward checks the residual stream after each block, K and V before each cache write, and the
logits, once per tensor (``np.isfinite(...).all()``), and raises ``NonFiniteError`` naming the
layer and the place. This model serves generation, where failing loudly is right; the operator
oracles in ``fp8lab/reference/`` still propagate NaN where a test asks them to.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import numpy as np

from fp8lab.reference.dense import argmax_rows

from .backend import Backend, ReferenceBackend
from .config import Qwen3Config
from .kv_manager import KVCacheManager, LayerKVCache
from .layout import PROJECTIONS, expected_tensors, is_fp8_projection


class NonFiniteError(RuntimeError):
    """A forward produced NaN or infinity; the message names the layer and where (one line)."""


def check_finite(x: np.ndarray, where: str) -> None:
    """Raise ``NonFiniteError`` if ``x`` holds a NaN or an infinity: ``"{where} is not finite ..."``."""
    if not np.isfinite(x).all():
        bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
        raise NonFiniteError(f"{where} is not finite: {bad} of its {np.size(x)} values are NaN or infinite "
                             "(weights or scales too large?)")


@dataclass(frozen=True)
class ForwardBatch:
    """What one forward computes: the new tokens of ``S`` sequences, concatenated (``T`` in all).

    ``token_ids``, ``positions``, ``slot_mapping``: ``[T]``; ``query_lens``: ``[S]`` new tokens per
    sequence (in the order of the concatenation); ``context_lens``: ``[S]`` tokens in each
    sequence's cache once the new ones are written (earlier prefix + new); ``block_tables``:
    ``[S, max_blocks]`` int32, padded with -1.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def last_token_rows(self) -> np.ndarray:
        """Row of each sequence's last new token in the flattened batch."""
        return np.cumsum(self.query_lens) - 1

    def check(self) -> None:
        """Raise ``ValueError`` if the fields disagree with each other."""
        t = len(self.token_ids)
        if len(self.positions) != t or len(self.slot_mapping) != t:
            raise ValueError(f"ForwardBatch: token_ids ({t}), positions ({len(self.positions)}) and "
                             f"slot_mapping ({len(self.slot_mapping)}) must have one entry per token")
        if int(self.query_lens.sum()) != t or (self.query_lens.size and self.query_lens.min() <= 0):
            raise ValueError(f"ForwardBatch: query_lens {self.query_lens.tolist()} must be positive and sum to {t}")
        if np.any(self.context_lens < self.query_lens):
            raise ValueError("ForwardBatch: every context_len must count the sequence's new tokens too")
        if len(self.context_lens) != self.num_seqs or len(self.block_tables) != self.num_seqs:
            raise ValueError("ForwardBatch: context_lens and block_tables need one entry per sequence")



class CausalLM(Protocol):
    """A Qwen3 causal LM over a paged KV cache, as ``fp8lab.engine.generate.Generator`` drives it.

    - ``allocate_kv_cache(num_blocks, block_size, kv_format)``: a cache of its own kind (one entry per
      layer), poisoned with NaN;
    - ``forward(batch, kv_cache, all_logits=False)``: writes the batch's K/V and returns float32 host logits
      ``[num_seqs, vocab]`` of each sequence's last new token (``[T, vocab]`` with ``all_logits``);
    - ``greedy_tokens(batch, kv_cache)``: the same forward, then int64 ``[num_seqs]`` greedy ids by the rule
      of ``fp8lab.reference.dense.argmax_rows`` (lowest index among equal maxima; a row holding NaN gives
      ``NAN_ROW``, -1), computed where the logits are (on the device for the GPU model).
    """

    config: Qwen3Config

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_format) -> Sequence: ...

    def forward(self, batch: ForwardBatch, kv_cache: Sequence, all_logits: bool = False) -> np.ndarray: ...

    def greedy_tokens(self, batch: ForwardBatch, kv_cache: Sequence) -> np.ndarray: ...

def make_batch(manager: KVCacheManager, chunks: Sequence[tuple[Hashable, Sequence[int]]]) -> ForwardBatch:
    """Reserve cache slots for each ``(sequence, new token ids)`` chunk and describe the forward.

    The new tokens of a sequence continue it: their positions start at its current length.
    All slots are reserved at once (``KVCacheManager.append_batch``), so running out of blocks
    raises ``KVCacheExhausted`` before anything changes.
    """
    seqs = [seq for seq, _ in chunks]
    if len(set(seqs)) != len(seqs):
        raise ValueError("make_batch: a sequence appears twice in one batch")
    lengths = [len(ids) for _, ids in chunks]
    starts = [manager.context_len(seq) for seq in seqs]
    slots = manager.append_batch(dict(zip(seqs, lengths)))
    total = sum(lengths)
    # one array per field, each filled in one pass: a decode step builds this for every step, on the host
    return ForwardBatch(
        token_ids=np.fromiter(itertools.chain.from_iterable(ids for _, ids in chunks), np.int64, count=total),
        positions=np.fromiter(itertools.chain.from_iterable(range(s, s + n) for s, n in zip(starts, lengths)),
                              np.int64, count=total),
        slot_mapping=np.concatenate([slots[seq] for seq in seqs]),
        query_lens=np.array(lengths, dtype=np.int64),
        context_lens=np.array([s + n for s, n in zip(starts, lengths)], dtype=np.int64),
        block_tables=manager.block_tables(seqs),
    )


@dataclass
class DecoderLayer:
    """The weights of one decoder layer, prepared by the backend."""

    input_layernorm: np.ndarray
    q_proj: object
    k_proj: object
    v_proj: object
    q_norm: np.ndarray
    k_norm: np.ndarray
    o_proj: object
    post_attention_layernorm: np.ndarray
    gate_proj: object
    up_proj: object
    down_proj: object


def check_tensors(config: Qwen3Config, tensors: dict[str, np.ndarray]) -> None:
    """Raise ``ValueError`` naming the first tensor that is missing or has the wrong shape or kind."""
    missing = [name for name in expected_tensors(config) if name not in tensors]
    if missing:
        raise ValueError(f"model tensors: {len(missing)} missing, e.g. {missing[0]!r}")
    for name, spec in expected_tensors(config).items():
        t = tensors[name]
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"tensor {name!r}: expected shape {spec.shape}, got {tuple(t.shape)}")
        if (spec.kind == "fp8") != (t.dtype == np.uint8):
            expected = "uint8 E4M3 codes" if spec.kind == "fp8" else "floats"
            raise ValueError(f"tensor {name!r}: expected {expected}, got dtype {t.dtype}")


class Qwen3Model(CausalLM):
    """A Qwen3 causal LM: weights prepared by a backend, forward over a paged KV cache.

    ``tensors`` maps Hugging Face names to arrays as ``fp8lab.engine.checkpoint`` loads them: FP8
    projections as uint8 codes ``[N, K]`` plus float32 ``weight_scale_inv``, everything else as
    floats (``layout.expected_tensors(config)`` lists them all).
    """

    def __init__(self, config: Qwen3Config, tensors: dict[str, np.ndarray], backend: Backend | None = None):
        check_tensors(config, tensors)
        self.config = config
        self.backend = backend if backend is not None else ReferenceBackend()
        self.softmax_scale = config.head_dim ** -0.5

        def f32(name: str) -> np.ndarray:
            return np.ascontiguousarray(tensors[name], dtype=np.float32)

        self.embed_tokens = f32("model.embed_tokens.weight")
        self.layers = [self._prepare_layer(tensors, f32, i) for i in range(config.num_hidden_layers)]
        self.norm = f32("model.norm.weight")
        lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self.backend.prepare_linear(f32(lm_head))

    @classmethod
    def from_checkpoint(cls, checkpoint, backend: Backend | None = None) -> "Qwen3Model":
        """Build from an ``fp8lab.engine.checkpoint.Checkpoint`` (its ``config`` and ``tensors``)."""
        return cls(checkpoint.config, checkpoint.tensors, backend)

    def _prepare_layer(self, tensors, f32, i: int) -> DecoderLayer:
        prefix = f"model.layers.{i}."
        block = self.config.quantization.weight_block_size if self.config.quantization else None
        projections = {}
        for proj in PROJECTIONS:
            name, short = prefix + proj, proj.split(".")[1]  # "self_attn.q_proj" -> "q_proj"
            if is_fp8_projection(self.config, name):
                projections[short] = self.backend.prepare_linear(
                    tensors[name + ".weight"], tensors[name + ".weight_scale_inv"], block)
            else:
                projections[short] = self.backend.prepare_linear(f32(name + ".weight"))
        return DecoderLayer(
            input_layernorm=f32(prefix + "input_layernorm.weight"),
            q_norm=f32(prefix + "self_attn.q_norm.weight"),
            k_norm=f32(prefix + "self_attn.k_norm.weight"),
            post_attention_layernorm=f32(prefix + "post_attention_layernorm.weight"),
            **projections,
        )

    # -- the forward pass

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_format) -> list[LayerKVCache]:
        c = self.config
        return self.backend.allocate_kv_cache(c.num_hidden_layers, num_blocks, c.num_key_value_heads,
                                              block_size, c.head_dim, kv_format)

    def forward(self, batch: ForwardBatch, kv_cache: list[LayerKVCache], all_logits: bool = False) -> np.ndarray:
        """Run the batch's new tokens through the model, writing their K/V into ``kv_cache``.

        Returns float32 logits ``[num_seqs, vocab]`` of each sequence's last new token, or
        ``[T, vocab]`` of every new token with ``all_logits``.
        """
        batch.check()
        if len(kv_cache) != self.config.num_hidden_layers:
            raise ValueError(f"kv_cache: expected {self.config.num_hidden_layers} layers, got {len(kv_cache)}")
        if np.any(batch.token_ids < 0) or np.any(batch.token_ids >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        b, eps = self.backend, self.config.rms_norm_eps
        h = b.embedding(self.embed_tokens, batch.token_ids)  # the residual stream, [T, hidden]
        check_finite(h, "the embedding of the new tokens")
        for i, (layer, cache) in enumerate(zip(self.layers, kv_cache)):
            h = h + self._attention_block(layer, b.rms_norm(h, layer.input_layernorm, eps), batch, cache, i)
            check_finite(h, f"layer {i}: the residual stream after the attention")
            h = h + self._mlp_block(layer, b.rms_norm(h, layer.post_attention_layernorm, eps))
            check_finite(h, f"layer {i}: the residual stream after the MLP")
        if not all_logits:
            h = h[batch.last_token_rows]
        logits = b.lm_head(b.rms_norm(h, self.norm, eps), self.lm_head)
        check_finite(logits, "the output of the final norm and lm_head (the logits)")
        return logits

    def greedy_tokens(self, batch: ForwardBatch, kv_cache: list[LayerKVCache]) -> np.ndarray:
        """``forward``, then each sequence's greedy id on the host (``fp8lab.reference.dense.argmax_rows``)."""
        return argmax_rows(self.forward(batch, kv_cache))

    def _attention_block(self, layer: DecoderLayer, x: np.ndarray, batch: ForwardBatch, cache: LayerKVCache,
                         index: int):
        c, b = self.config, self.backend
        t = x.shape[0]
        q = b.linear(x, layer.q_proj).reshape(t, c.num_attention_heads, c.head_dim)
        k = b.linear(x, layer.k_proj).reshape(t, c.num_key_value_heads, c.head_dim)
        v = b.linear(x, layer.v_proj).reshape(t, c.num_key_value_heads, c.head_dim)
        q = b.rope(b.rms_norm(q, layer.q_norm, c.rms_norm_eps), batch.positions, c.rope_theta)
        k = b.rope(b.rms_norm(k, layer.k_norm, c.rms_norm_eps), batch.positions, c.rope_theta)
        # checked before the write: the cache would quantize a NaN and report it without the layer
        check_finite(k, f"layer {index}: K before the cache write")
        check_finite(v, f"layer {index}: V before the cache write")
        b.write_kv(cache, k, v, batch.slot_mapping)
        out = self._attention(q, batch, cache)
        return b.linear(out.reshape(t, c.num_attention_heads * c.head_dim), layer.o_proj)

    def _attention(self, q: np.ndarray, batch: ForwardBatch, cache: LayerKVCache) -> np.ndarray:
        """Decode attention for sequences with one new token, prefill attention for the rest."""
        out = np.empty(q.shape, dtype=np.float32)
        rows = batch.last_token_rows
        decode = batch.query_lens == 1
        if decode.any():
            out[rows[decode]] = self.backend.decode_attention(
                q[rows[decode]], cache, batch.block_tables[decode], batch.context_lens[decode], self.softmax_scale)
        if (~decode).any():
            starts = rows - batch.query_lens + 1
            prefill_rows = np.concatenate([np.arange(s, r + 1) for s, r in zip(starts[~decode], rows[~decode])])
            out[prefill_rows] = self.backend.prefill_attention(
                q[prefill_rows], cache, batch.query_lens[~decode], batch.block_tables[~decode],
                batch.context_lens[~decode], self.softmax_scale)
        return out

    def _mlp_block(self, layer: DecoderLayer, x: np.ndarray) -> np.ndarray:
        b = self.backend
        return b.linear(b.silu_mul(b.linear(x, layer.gate_proj), b.linear(x, layer.up_proj)), layer.down_proj)
