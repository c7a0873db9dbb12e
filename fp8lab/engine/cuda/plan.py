"""The GPU model's forward as a plan: the sequence of kernel launches over its activation buffers.

A forward over ``T`` tokens is a ``Plan``, a tuple of ``Launch`` values (a kernel wrapper with its
arguments, the stream left open), built by ``Planner`` and then run on a stream, or on a CUDA graph
builder (``fp8lab.engine.cuda.graphs``): every wrapper takes ``stream=``. The sequence of a decode step
is fixed by its bucket and its cache, so its launch count is a property of the plan
(``Plan.kernel_launches``), not something counted while it runs.

Launches per layer: ``add_parts_rms_norm`` (the previous residual add fused with this norm; ``rms_norm`` in
layer 0), the q/k/v GEMM (one launch on the fused weight, whose output row ``t`` is ``[q | k | v]``),
``attention_input.qk_norm_rope_cache_write`` (q-norm, k-norm, RoPE and the paged cache write in one
launch; it reads q, k and v as column slices of that output and writes q, contiguous, for attention),
attention (decode: over an FP8 cache of head size 128 and blocks of whole 16-token tiles,
``splitkv_mma.decode_mma_with_input`` on tensor cores (``Planner.decode_attention_on_tensor_cores``), whose split
kernel also does the attention input, so that launch goes; else ``paged_decode``: the split kernel and, with more
than one split, the combine kernel; prefill: over an FP8 or BF16 cache of head size 128, blocks of whole tiles and a
GQA group that divides 16, ``prefill_mma.paged_prefill_mma``, one flash-attention launch on tensor cores
(``Planner.prefill_attention_on_tensor_cores``); else ``paged_prefill``, the row expansion, the split kernel and
maybe the combine), o_proj,
``add_parts_rms_norm``, the gate/up GEMM with SwiGLU (on the SIMT path one ``gemv_simt_swiglu`` launch, on
``gemv_mma``'s one ``gemv_mma_swiglu``; beyond, the GEMM then ``silu_mul``), down_proj. An FP8 GEMM of more than
``f32_max_rows`` rows reads BF16 activations, which the kernel before it (the norm, attention, SwiGLU) writes
as BF16 bits itself (``Planner.gemm_input``): no rounding launch between them.
Around the layers: the embedding, the final ``add_parts_rms_norm`` and the lm_head (``bf16_linear`` on float32
rows, at most ``f32_max_rows`` of them; beyond, ``gemv_mma_bf16`` on tensor cores, which a decode step's final
norm feeds BF16 bits and a prefill's float32 rows it rounds on load: ``Planner.lm_head``); a decode step ends with the greedy argmax (``layers.argmax_rows``, one multi-CTA
launch, for ``greedy_tokens``), which writes the ids where the next step's embedding reads its tokens.
A decode step of batch 1 is 7 or 8 launches per layer plus 4 over an FP8 cache of head size 128 (e.g. 8 * 36 + 4 = 292
for Qwen3-8B at the benchmark's context), 8 or 9 otherwise. Every launch has a ``label`` (what it is in the forward), which
``bench/decode_profile.py`` uses to attribute kernel times.

The GEMM input format (``f32_max_rows``): a GEMM of at most ``f32_max_rows`` rows (at most 16) runs
``gemv_simt`` directly on the float32 activations, so the product is the reference's float32 linear up to the
summation order; a larger one (long prompts, decode batches) reads the activations rounded to BF16 (written so by
the kernel that produces them, rounded as ``layers.bf16_round`` rounds) and runs ``fp8_gemm`` on tensor cores
(``gemv_mma`` for 2 to 32 rows, with SwiGLU fused into the gate/up launch; ``gemm_mma`` beyond, and on a Hopper
GPU ``gemm_wgmma`` at prefill sizes: ``fp8_gemm.choose_path``), W8A16 as the
kernels are designed. The accuracy table of the trained demo model (``docs/08_accuracy.md``, ``bench/RESULTS.md``) says BF16 inputs into FP8 weights
cost far less than the FP8 weights themselves, so the default (``DEFAULT_F32_MAX_ROWS``) is whatever is faster:
float32 for one row only (the SIMT GEMV beats the tensor cores at one row; from 2 rows on ``gemv_mma`` on BF16
inputs wins at both measured shapes, Qwen3-8B and Qwen3-0.6B, once the producers write BF16 themselves: at
Qwen3-0.6B batch 4, 3,564 against 2,856 tok/s with float32 up to 4 rows; ``bench/RESULTS.md``). (The random tiny
model is much more sensitive: its flat logits let BF16 inputs change greedy tokens within a few steps, which is why
its GPU tests ask for ``f32_max_rows=16``.)

The residual stream's GEMMs (o_proj, down_proj) on the SIMT path are split-K (``gemv_simt_split_k``, ``S =
fp8lab.simulators.gemv_simt.choose_k_splits`` K slices: 2 for Qwen3-8B, 4 for Qwen3-0.6B on an H200): their
narrow weights (``N`` = hidden size) give too few warps to keep the memory busy otherwise. They leave
``S`` float32 parts, and the next norm (``layers.add_parts_rms_norm``) adds them in slice order to the
residual; every other path leaves one part, and one part is ``add_rms_norm`` bit for bit.

Activations live in buffers preallocated for ``max_num_tokens`` tokens and ``max_num_seqs`` sequences
(``Activations``): the residual ``h``, the normed ``x`` (float32 ``[T, hidden]``), a block output ``y``
(float32 split-K parts ``[S, T, hidden]``, flat), the q/k/v GEMM output (one flat float32 buffer: ``[T, (Hq + 2 Hkv) D]``, or three
blocks when the weights do not fuse), the normed and rotated ``q [T, Hq, D]``, the attention output,
``gate_up [T, 2 I]``, the SwiGLU output ``[T, I]``, the BF16 GEMM inputs (a norm's or attention's; SwiGLU's), the split-kv workspace, the
greedy argmax's workspace and the logits of ``max_num_seqs`` rows. Nothing in a plan allocates or reads
back: the cache write never reads its slots back, a decode step passes attention ``max_seq_len`` = its
context bound (``decode_context_bound``: a power of two that holds the batch's longest context, at most the
cache's capacity), and its split count is chosen from the bucket and that bound, so an eager step and the
graph replays of its (bucket, bound) run the same kernels on the same arguments and give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fp8lab.numba_kernels import layers, prefill_mma, splitkv, splitkv_mma
from fp8lab.numba_kernels.attention_input import qk_norm_rope_cache_write
from fp8lab.numba_kernels.fp8_gemm import choose_path, fp8_gemm
from fp8lab.numba_kernels.gemv_mma import F32_MAX_ROWS, gemv_mma_bf16, gemv_mma_swiglu
from fp8lab.numba_kernels.gemv_simt import (
    gemv_simt,
    gemv_simt_split_k,
    gemv_simt_swiglu,
)
from fp8lab.numba_kernels.layers import bf16_linear
from fp8lab.numba_kernels.prefill import PrefillRows, paged_prefill
from fp8lab.simulators import prefill_mma as tensor_core_prefill
from fp8lab.simulators import splitkv_mma as tensor_core_attention
from fp8lab.simulators.gemv_mma import K_CHUNK, MAX_ROWS, ROWS_PER_WARP
from fp8lab.simulators.gemv_simt import K_SPLITS, choose_k_splits

from ..config import Qwen3Config
from .kv_cache import DeviceKVCache, DeviceLayerKVCache
from .memory import DeviceMemory, column_slice
from .weights import DeviceLinear, DeviceWeights

DEFAULT_F32_MAX_ROWS = 1
"""GEMMs of at most this many rows take float32 activations by default (see the module docstring): a decode step of
one sequence runs the SIMT GEMV on float32, every larger GEMM the tensor cores on BF16 inputs."""


MIN_DECODE_CONTEXT = 512
"""The smallest context a decode step's attention is planned for (``decode_context_bound``)."""


def decode_context_bound(longest: int, capacity: int) -> int:
    """The ``max_seq_len`` a decode step's attention is planned for: the smallest power of two from
    ``MIN_DECODE_CONTEXT`` on that holds the batch's longest context, at most the cache's ``capacity``.

    The split count and the heads per CTA follow from it (``splitkv.choose_num_splits``), and a decode
    step gets one CUDA graph per (bucket, bound). So a short conversation in a large cache runs the
    attention planned for short contexts (at 512 tokens of Qwen3-8B, 9.6 us per layer against 20.1 for
    the plan of a 40,960-token cache), at the price of a capture each time a batch's longest context
    crosses a power of two.
    """
    bound = MIN_DECODE_CONTEXT
    while bound < int(longest):
        bound *= 2
    return max(1, min(bound, int(capacity)))


@dataclass(frozen=True)
class Launch:
    """One kernel wrapper call: ``kernel(*args, stream=stream, **options)``, which makes ``kernels``
    kernel launches (the split-kv attention adds its combine kernel)."""

    kernel: Callable
    args: tuple
    options: dict = field(default_factory=dict)
    kernels: int = 1
    label: str = ""
    """What the launch is in the forward ("q/k/v gemv", "input norm", ...): a benchmark's per-kernel breakdown
    groups by it (``bench/decode_profile.py``)."""

    def __call__(self, stream) -> None:
        self.kernel(*self.args, stream=stream, **self.options)


@dataclass(frozen=True)
class Plan:
    """A forward's launches, in order."""

    launches: tuple[Launch, ...]

    @property
    def kernel_launches(self) -> int:
        """How many kernels running the plan launches (what one graph replay of it runs)."""
        return sum(launch.kernels for launch in self.launches)

    def run(self, stream) -> None:
        """Enqueue every launch on ``stream`` (a Numba stream, or a ``cuda.core`` graph builder)."""
        for launch in self.launches:
            launch(stream)


@dataclass
class Activations:
    """The preallocated activation buffers (see the module docstring); ``*_host`` are page-locked twins."""

    h: object
    x: object
    y: object
    qkv: object
    q: object
    attn: object
    gate_up: object
    act: object
    bf16: object
    act_bf16: object
    selected: object
    logits: object
    logits_host: np.ndarray
    argmax_workspace: object
    workspace: object


def allocate_activations(config: Qwen3Config, memory: DeviceMemory, max_num_tokens: int, max_num_seqs: int,
                         f32_max_rows: int) -> Activations:
    """The buffers of every forward of at most ``max_num_tokens`` tokens and ``max_num_seqs`` sequences."""
    c, mem, tmax, smax = config, memory, max_num_tokens, max_num_seqs
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    needs_bf16 = f32_max_rows < tmax
    # the split-kv workspace: enough for the split count "auto" picks for any number of rows (the longest
    # contexts split the most: 4 heads per CTA allow 8 x 4 shards)
    sms, most = splitkv.device_num_sms(), 0
    for rows in range(1, tmax + 1):
        for s in (splitkv.choose_num_splits(rows, hq, hkv, 2**62, sms, 1),
                  tensor_core_attention.choose_num_splits(rows, hkv, 2**62, sms)):
            if s > 1:
                most = max(most, rows * hq * s * (d + 2))
    return Activations(
        h=mem.empty("activations h", (tmax, c.hidden_size), np.float32),
        x=mem.empty("activations x", (tmax, c.hidden_size), np.float32),
        y=mem.empty("activations y (a residual block's output, as split-K parts)",
                    (max(tmax, max(K_SPLITS) * min(tmax, f32_max_rows)) * c.hidden_size,), np.float32),
        qkv=mem.empty("activations q/k/v", (tmax * (hq + 2 * hkv) * d,), np.float32),
        q=mem.empty("activations q (normed, rotated)", (tmax, hq, d), np.float32),
        attn=mem.empty("activations attention output", (tmax, hq, d), np.float32),
        gate_up=mem.empty("activations gate_up", (tmax, 2 * c.intermediate_size), np.float32),
        act=mem.empty("activations SwiGLU", (tmax, c.intermediate_size), np.float32),
        bf16=mem.empty("activations BF16 GEMM input (normed or attention output)",
                       (tmax * max(c.hidden_size, hq * d) if needs_bf16 else 1,), np.uint16),
        act_bf16=mem.empty("activations BF16 SwiGLU output", (tmax * c.intermediate_size if needs_bf16 else 1,),
                           np.uint16),
        selected=mem.empty("last-token rows", (smax, c.hidden_size), np.float32),
        logits=mem.empty(f"logits [{smax}, {c.vocab_size}]", (smax, c.vocab_size), np.float32),
        logits_host=mem.pinned((smax, c.vocab_size), np.float32),
        argmax_workspace=layers.argmax_workspace(smax, c.vocab_size),  # small: a few KB
        workspace=mem.empty("attention split-kv workspace", (max(most, 1),), np.float32),
    )


def lm_head_rows_per_launch(x) -> int:
    """Rows of ``x`` one ``gemv_mma_bf16`` launch takes: ``MAX_ROWS`` (32) of BF16 bits, ``F32_MAX_ROWS`` (16) of
    float32."""
    return MAX_ROWS if is_bf16(x) else F32_MAX_ROWS


def tensor_core_lm_head(x, w_bits, out, stream=0):
    """``out [M, N] = x [M, K] @ W^T`` for the BF16 lm_head ``w_bits``: ``gemv_mma_bf16`` on blocks of at most
    ``lm_head_rows_per_launch`` rows, one launch each (a row's bits do not depend on the other rows of its launch).
    ``x``: BF16 bits, or float32 that the kernel rounds to BF16 on load."""
    rows = lm_head_rows_per_launch(x)
    for first in range(0, x.shape[0], rows):
        gemv_mma_bf16(x[first : first + rows], w_bits, out[first : first + rows], stream=stream)


def is_bf16(x) -> bool:
    """Whether activations ``x`` are BF16 bit patterns (uint16) rather than float32."""
    return np.dtype(x.dtype) == np.uint16


Attend = Callable[[object, DeviceLayerKVCache, tuple, object], list[Launch]]
"""``attend(layer, layer_cache, (q, k, v), out)``: the launches from the q/k/v GEMM's output ``(q, k, v)`` to the
attention output ``out`` of one layer (the attention input, then the attention; or both in one kernel)."""


class Planner:
    """Builds the plans of one model's forwards over its ``weights`` and ``activations``."""

    def __init__(self, config: Qwen3Config, weights: DeviceWeights, activations: Activations, f32_max_rows: int):
        self.config, self.weights, self.activations = config, weights, activations
        self.f32_max_rows = f32_max_rows
        self.softmax_scale = config.head_dim ** -0.5

    def decode(self, bucket: int, cache: DeviceKVCache, max_context: int) -> Plan:
        """A decode step of ``bucket`` rows whose contexts are at most ``max_context`` tokens (``decode_context_bound``),
        reading only the cache's decode index buffers (what a CUDA graph captures); leaves the logits in
        ``activations.logits[:bucket]`` and their argmax in the index's ``token_ids``, where the next step's
        embedding reads them (``fp8lab.engine.cuda.pipeline``: the host copies them out, and a pipelined next
        step leaves them in place)."""
        w, a, index = self.weights, self.activations, cache.decode_index.device
        lens, tables = index.context_lens[:bucket], index.block_tables[:bucket]
        tensor_cores = self.decode_attention_on_tensor_cores(cache)
        if tensor_cores:
            splits = tensor_core_attention.choose_num_splits(bucket, self.config.num_key_value_heads, max_context,
                                                             splitkv.device_num_sms())
        else:
            splits = self.num_splits(bucket, max_context, cache.block_size)
        workspace = self.workspace(bucket, splits)
        positions, slots = index.positions[:bucket], index.slots[:bucket]
        options = dict(num_splits=splits, workspace=workspace, max_seq_len=max_context)

        def attend(layer, layer_cache, qkv, out):
            if tensor_cores:  # the attention input inside the split kernel: one launch fewer per layer
                return [Launch(splitkv_mma.decode_mma_with_input,
                               (*qkv, layer.q_norm, layer.k_norm, self.config.rms_norm_eps, positions,
                                self.weights.rope_cos_sin, layer_cache.k, layer_cache.v, tables, lens,
                                self.softmax_scale, out, layer_cache.k_scale, layer_cache.v_scale),
                               dict(options, kv_format=layer_cache.kv_format), kernels=1 + (splits > 1),
                               label="attention (with q/k norm, rope, cache write)")]
            q = self.activations.q[:bucket]
            return [self.attention_input(layer, layer_cache, qkv, q, positions, slots),
                    Launch(splitkv.paged_decode, (q, layer_cache.k, layer_cache.v, tables, lens, self.softmax_scale,
                                                  out, layer_cache.k_scale, layer_cache.v_scale),
                           dict(options, kv_format=layer_cache.kv_format), kernels=1 + (splits > 1), label="attention")]

        final = self.lm_head_input(a.x[:bucket])  # the final norm writes what the lm_head reads
        return Plan((Launch(layers.embedding, (w.embed_tokens, index.token_ids[:bucket], a.h[:bucket]), label="embedding"),
                     *self.decoder_layers(bucket, cache, attend, final),
                     self.lm_head(final, bucket),
                     Launch(layers.argmax_rows, (a.logits[:bucket], index.token_ids[:bucket]),
                            dict(workspace=a.argmax_workspace), label="argmax")))

    def decode_attention_on_tensor_cores(self, cache: DeviceKVCache) -> bool:
        """Whether a decode step's attention runs on tensor cores (``splitkv_mma``): an FP8 cache of a shape that
        kernel takes (``fp8lab.simulators.splitkv_mma.supports``). Its F16 query and weights round far less than
        the FP8 cache itself (ARCHITECTURE.md, "decode attention"); a BF16 or float32 cache keeps the float32
        SIMT kernel (``splitkv``)."""
        c = self.config
        return tensor_core_attention.supports(c.head_dim, c.num_attention_heads // c.num_key_value_heads,
                                              cache.block_size, cache.kv_format.name == "fp8", False)

    def prefill_attention_on_tensor_cores(self, cache: DeviceKVCache) -> bool:
        """Whether a prefill's attention runs as one flash-attention launch on tensor cores (``prefill_mma``): an FP8
        or BF16 cache of a shape that kernel takes (``fp8lab.simulators.prefill_mma.supports``), with the tensor-core
        decode's roundings (F16 queries and weights over FP8; BF16 over BF16, the rounding the cache already gave K
        and V); else (a float32 cache) every query is a decode row of the float32 SIMT kernel."""
        c = self.config
        return tensor_core_prefill.supports(c.head_dim, c.num_attention_heads // c.num_key_value_heads,
                                            cache.block_size, cache.kv_format.name, False)

    def prefill(self, num_tokens: int, num_seqs: int, width: int, max_context: int, cache: DeviceKVCache) -> Plan:
        """Any forward that is not a decode step, over ``num_tokens`` tokens of ``num_seqs`` sequences whose
        block tables (``width`` columns) are in the cache's eager index; leaves the final norm of every
        token in ``activations.x`` (``lm_head`` makes the logits)."""
        t, s = num_tokens, num_seqs
        index = cache.eager_index.device
        tables = index.block_tables[: s * width].reshape(s, width)
        context_lens, query_lens = index.context_lens[:s], index.query_lens[:s]
        rows = PrefillRows(cache.prefill_row_tables[: t * width].reshape(t, width), cache.prefill_row_lens[:t])
        tensor_cores = self.prefill_attention_on_tensor_cores(cache)
        workspace = None if tensor_cores else self.workspace(t, self.num_splits(t, max_context, cache.block_size))

        positions, slots, q = index.positions[:t], index.slots[:t], self.activations.q[:t]

        def attend(layer, layer_cache, qkv, out):
            args = (q, layer_cache.k, layer_cache.v, tables, context_lens, query_lens, self.softmax_scale, out,
                    layer_cache.k_scale, layer_cache.v_scale)  # both prefill attentions take these
            options = dict(max_context_len=max_context, kv_format=layer_cache.kv_format)
            if tensor_cores:
                attention = Launch(prefill_mma.paged_prefill_mma, args, options, label="attention")
            else:
                attention = Launch(paged_prefill, args, dict(options, rows=rows, workspace=workspace),
                                   kernels=2 + (workspace is not None), label="attention")
            return [self.attention_input(layer, layer_cache, qkv, q, positions, slots), attention]

        return Plan((Launch(layers.embedding, (self.weights.embed_tokens, index.token_ids[:t], self.activations.h[:t])),
                     *self.decoder_layers(t, cache, attend)))

    def attention_input(self, layer, layer_cache: DeviceLayerKVCache, qkv, q, positions, slots) -> Launch:
        """q/k-norm, RoPE and the paged cache write of the new tokens' ``qkv = (q, k, v)`` (the q/k/v GEMM's output), the
        normed, rotated q into ``q``: one ``qk_norm_rope_cache_write`` launch."""
        return Launch(qk_norm_rope_cache_write, (*qkv, q, layer.q_norm, layer.k_norm, self.config.rms_norm_eps,
                                                 positions, self.weights.rope_cos_sin, layer_cache.k, layer_cache.v,
                                                 slots, layer_cache.k_scale, layer_cache.v_scale),
                      dict(kv_format=layer_cache.kv_format), label="q/k norm, rope, cache write")

    def lm_head(self, x, rows: int) -> Launch:
        """``logits[:rows] = x @ lm_head^T`` (``x``: ``rows`` final-norm rows on the device, float32, or BF16 bits from
        ``lm_head_input``): ``bf16_linear`` on float32 ``x`` of at most ``f32_max_rows`` rows, else the tensor cores
        (``tensor_core_lm_head``) on ``x`` rounded to BF16, the rule of the FP8 GEMMs."""
        logits = self.activations.logits[:rows]
        if self.lm_head_on_tensor_cores(rows):
            return Launch(tensor_core_lm_head, (x, self.weights.lm_head, logits),
                          kernels=-(-rows // lm_head_rows_per_launch(x)), label="lm_head")
        return Launch(bf16_linear, (x, self.weights.lm_head, logits), label="lm_head")

    def lm_head_on_tensor_cores(self, rows: int) -> bool:
        """Whether the lm_head of ``rows`` rows runs on tensor cores: more than ``f32_max_rows`` rows and a weight
        ``gemv_mma_bf16`` takes (``N`` a multiple of 16, ``K`` of 128: every Qwen3's)."""
        n, k = self.weights.lm_head.shape
        return rows > self.f32_max_rows and n % ROWS_PER_WARP == 0 and k % K_CHUNK == 0

    def lm_head_input(self, x):
        """Where a decode step's final norm writes ``x [rows, hidden]``: ``x`` itself, or a BF16 view of the same shape
        in ``activations.bf16`` when the lm_head reads BF16 (``lm_head_on_tensor_cores``), so that it reads half the
        bytes and no rounding launch runs between them."""
        m, k = x.shape
        return self.activations.bf16[: m * k].reshape(m, k) if self.lm_head_on_tensor_cores(m) else x

    def decoder_layers(self, t: int, cache: DeviceKVCache, attend: Attend, final=None) -> list[Launch]:
        """The decoder layers over ``t`` tokens whose embeddings are in ``h[:t]``, then the final norm of
        the residual stream into ``final`` (default ``x[:t]``, float32; a decode step's ``lm_head_input``)."""
        c, a, plan = self.config, self.activations, []
        eps = c.rms_norm_eps
        h, x, y = a.h[:t], a.x[:t], None  # y: the parts of the last residual block's output
        qd = c.num_attention_heads * c.head_dim
        attn, gate_up, act = a.attn[:t], a.gate_up[:t], a.act[:t]
        for i, (layer, layer_cache) in enumerate(zip(self.weights.layers, cache)):
            x_in = self.gemm_input(x, layer.qkv.parts)  # the input norm writes what the q/k/v GEMM reads
            if i == 0:
                plan.append(Launch(layers.rms_norm, (h, layer.input_layernorm, eps, x_in), label="input norm"))
            else:  # the previous layer's MLP residual add, fused with this layer's input norm
                plan.append(Launch(layers.add_parts_rms_norm, (y, h, layer.input_layernorm, eps, x_in),
                                   label="input norm"))
            qkv = self.qkv_projections(layer.qkv, x_in, t, plan)
            attn_in = self.gemm_input(attn.reshape(t, qd), [layer.o_proj])  # attention writes o_proj's input
            plan.extend(attend(layer, layer_cache, qkv, attn_in.reshape(attn.shape)))
            y = self.residual_linear(layer.o_proj, attn_in, "o_proj", plan)
            x_in = self.gemm_input(x, [layer.gate_up])
            plan.append(Launch(layers.add_parts_rms_norm, (y, h, layer.post_attention_layernorm, eps, x_in),
                               label="post-attention norm"))
            act_in = self.gemm_input(act, [layer.down_proj], a.act_bf16)  # SwiGLU writes down_proj's input
            self.gate_up_swiglu(layer.gate_up, x_in, gate_up, act_in, plan)
            y = self.residual_linear(layer.down_proj, act_in, "down_proj", plan)
        final = x if final is None else final
        plan.append(Launch(layers.add_parts_rms_norm, (y, h, self.weights.norm, eps, final), label="final norm"))
        return plan

    def gemm_input(self, x, consumers: list[DeviceLinear], bf16_buffer=None):
        """Where the producer of a GEMM input ``x [M, K]`` (float32) writes it: ``x`` itself, or a BF16 view of the
        same shape in ``bf16_buffer`` (default ``activations.bf16``) when every GEMM reading it is an FP8 GEMM of
        more than ``f32_max_rows`` rows. The producer (a norm, attention, SwiGLU) then writes BF16 bits, rounded as
        ``layers.bf16_round`` rounds, so no rounding launch runs between it and the GEMM. The norms and attention
        share ``activations.bf16``: each BF16 input is read by its GEMMs before the next producer, which waits for
        them, writes the next. SwiGLU writes ``activations.act_bf16``: its fused launch reads the gate/up GEMM's
        BF16 input while it writes (a GEMM never runs in place: ``arguments.check_gemm``)."""
        m, k = x.shape
        if m <= self.f32_max_rows or any(c.kind != "fp8" for c in consumers):
            return x
        buffer = self.activations.bf16 if bf16_buffer is None else bf16_buffer
        return buffer[: m * k].reshape(m, k)

    def residual_linear(self, linear: DeviceLinear, x, label: str, plan: list[Launch]):
        """``x [t, K] @ W^T`` for the residual stream (o_proj, down_proj), its launches appended to ``plan``;
        returns it as the parts ``[S, t, N]`` in ``activations.y`` that the next norm adds
        (``layers.add_parts_rms_norm``). On the SIMT path (float32 ``x`` into FP8 weights) a split-K GEMV of ``S =
        choose_k_splits`` slices (a narrow weight keeps the memory busy only with more warps than columns); any
        other path writes one part."""
        t, n = x.shape[0], linear.n
        if linear.kind == "fp8" and self.simt_path(x):
            splits = choose_k_splits(n, linear.k, linear.block[1], splitkv.device_num_sms())
            parts = self.activations.y[: splits * t * n].reshape(splits, t, n)
            plan.append(Launch(gemv_simt_split_k, (x, linear.weight, linear.scale_inv, parts, linear.block),
                               label=f"{label} gemv"))
            return parts
        parts = self.activations.y[: t * n].reshape(1, t, n)
        self.linear(linear, x, parts.reshape(t, n), label, plan)
        return parts

    def qkv_projections(self, group, x, t: int, plan: list[Launch]):
        """The q, k and v projections of ``x [t, hidden]`` (float32, or BF16 bits from ``gemm_input``), their
        launches appended to ``plan``; returns ``(q, k, v)``, 2-D ``[t, heads * head_dim]`` views. With a fused
        weight one GEMM writes row ``t`` as ``[q | k | v]`` and the views are its column slices
        (``qk_norm_rope_cache_write`` reads them so); otherwise one GEMM each, into three contiguous blocks of the
        buffer."""
        c, a = self.config, self.activations
        qd, kd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        if group.fused is not None:
            fused = a.qkv[: t * (qd + 2 * kd)].reshape(t, qd + 2 * kd)
            self.linear(group.fused, x, fused, "q/k/v", plan)
            return column_slice(fused, 0, qd), column_slice(fused, qd, qd + kd), column_slice(fused, qd + kd, qd + 2 * kd)
        outs = (a.qkv[: t * qd].reshape(t, qd), a.qkv[t * qd : t * (qd + kd)].reshape(t, kd),
                a.qkv[t * (qd + kd) : t * (qd + 2 * kd)].reshape(t, kd))
        for part, out in zip(group.parts, outs):
            self.linear(part, x, out, "q/k/v", plan)
        return outs

    def gate_up_swiglu(self, gate_up: DeviceLinear, x, gate_up_out, act, plan: list[Launch]) -> None:
        """``act = silu(x @ gate^T) * (x @ up^T)`` from the fused gate/up weight (``act`` float32, or BF16 bits for
        a down_proj that reads them), its launches appended to ``plan``: one ``gemv_simt_swiglu`` on the SIMT path
        (the epilogue applies SwiGLU, no ``[T, 2 I]`` round trip), ``gemv_mma_swiglu`` on BF16 inputs of 2 to 32
        rows (the same, on tensor cores), else the GEMM into ``gate_up_out`` and ``layers.silu_mul`` (bit for bit
        the same as that GEMM's kernel then SwiGLU; the warpgroup GEMM with SwiGLU in its epilogue measured equal to
        the two within 1% and was removed: ``bench/RESULTS.md``, twenty-fourth session)."""
        if gate_up.kind == "fp8" and self.simt_path(x):
            plan.append(Launch(gemv_simt_swiglu, (x, gate_up.weight, gate_up.scale_inv, act, gate_up.block),
                               label="gate/up gemv + swiglu"))
            return
        if gate_up.kind == "fp8" and is_bf16(x) and choose_path(x.shape[0], gate_up.n) == "gemv_mma":
            plan.append(Launch(gemv_mma_swiglu, (x, gate_up.weight, gate_up.scale_inv, act, gate_up.block),
                               label="gate/up gemv_mma + swiglu"))
            return
        self.linear(gate_up, x, gate_up_out, "gate/up", plan)
        plan.append(Launch(layers.silu_mul, (gate_up_out, act), label="swiglu"))

    def simt_path(self, x) -> bool:
        """Whether an FP8 GEMM on ``x`` runs the SIMT GEMV on float32 activations (at most ``f32_max_rows``)."""
        return not is_bf16(x) and x.shape[0] <= self.f32_max_rows

    def linear(self, linear: DeviceLinear, x, out, label: str, plan: list[Launch]) -> None:
        """``out [M, N] = x [M, K] @ W^T``, its launch appended to ``plan``: BF16 weights take float32 ``x`` in
        ``bf16_linear``; FP8 weights the SIMT GEMV on float32 ``x`` of at most ``f32_max_rows`` rows, else
        ``fp8_gemm`` on BF16 bits (``x`` itself, or its ``bf16_round`` where ``x`` is also read as float32: a
        q/k/v group of FP8 and BF16 weights)."""
        if linear.kind == "bf16":
            plan.append(Launch(bf16_linear, (x, linear.weight, out), label=f"{label} bf16_linear"))
        elif self.simt_path(x):
            plan.append(Launch(gemv_simt, (x, linear.weight, linear.scale_inv, out, linear.block), label=f"{label} gemv"))
        else:
            x_bf16 = x if is_bf16(x) else self.bf16_round(x, plan)
            plan.append(Launch(fp8_gemm, (x_bf16, linear.weight, linear.scale_inv, out, linear.block),
                               label=f"{label} fp8_gemm"))

    def bf16_round(self, x, plan: list[Launch]):
        """The BF16 rounding of float32 ``x [M, K]`` into ``activations.bf16`` (a ``bf16_round`` launch appended to
        ``plan``): only where a float32 input also feeds an FP8 GEMM of more than ``f32_max_rows`` rows."""
        m, k = x.shape
        out = self.activations.bf16[: m * k].reshape(m, k)
        plan.append(Launch(layers.bf16_round, (x.reshape(m * k), out.reshape(m * k)), label="bf16 round"))
        return out

    def num_splits(self, rows: int, max_len: int, block_size: int) -> int:
        """The split-kv shard count ``auto`` picks for ``rows`` query rows over at most ``max_len`` tokens."""
        c = self.config
        return splitkv.choose_num_splits(rows, c.num_attention_heads, c.num_key_value_heads, max_len,
                                         splitkv.device_num_sms(), block_size)

    def workspace(self, rows: int, splits: int):
        """A view of the split-kv workspace for ``rows`` rows and ``splits`` shards (None for one shard)."""
        if splits <= 1:
            return None
        c = self.config
        shape = (rows, c.num_attention_heads, splits, c.head_dim + 2)
        return self.activations.workspace[: int(np.prod(shape))].reshape(shape)
