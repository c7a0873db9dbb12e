"""``CudaQwen3Model``: the Qwen3-FP8 forward pass as ``numba_kernels`` on an NVIDIA GPU (and, unchanged, in
Numba's CUDA simulator).

It implements ``fp8lab.engine.model.CausalLM`` as ``Qwen3Model`` does and computes what ``Qwen3Model``
computes, in the same order (see ``fp8lab/engine/model.py``); every operator is a kernel and every
activation stays on the device. A forward copies in the small index arrays (token ids, positions,
slots, block tables, lengths: int32, one copy), runs its plan (``fp8lab.engine.cuda.plan``), and copies
the logits (or, for ``greedy_tokens``, the greedy ids) out; nothing is allocated and nothing else is
read back.

Prefill and decode: a batch whose sequences all have one new token is a *decode step*: padded to its
bucket, planned for its context bound (``plan.decode_context_bound``), run eagerly once per (bucket, bound)
and then replayed as a CUDA graph on a GPU (``fp8lab.engine.cuda.graphs``); any
other batch is a *prefill* over all its rows (a one-token chunk is a prefill chunk whose attention is exactly a
decode; ``fp8lab.engine.generate`` never mixes the two). Over the tensor-core prefill attention (an FP8 or BF16 cache
of head size 128) a prefill is padded too, to a token bucket (``prefill_buckets``) and a sequence bucket, and
replayed as a graph from its second run on: an eager prefill costs 100 to 400 us of host time per launch (Numba's
argument handling and the wrappers' checks), which at 9 launches per layer is more than its GPU time. Padding rows
are rows of their own (every kernel keeps rows apart), so they change no real row's bits. Logits are
computed only for each sequence's last token (``all_logits``: every token, in chunks of
``max_num_seqs``). ``stats`` reports launches per decode step, graph replays and host time per step.

A batch larger than the preallocated buffers raises ``ValueError`` naming the limit; running out of KV
blocks is ``fp8lab.engine.kv_manager``'s ``KVCacheExhausted``, raised before any work, as with the
reference model; running out of device memory is a ``RuntimeError`` naming the array
(``fp8lab.engine.cuda.memory``).
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.numba_kernels.gemv_simt import MAX_ROWS as SIMT_MAX_ROWS
from fp8lab.numba_kernels.inlining import install as install_faster_inlining
from fp8lab.reference.dense import argmax_rows
from fp8lab.reference.kv_cache import kv_cache_format

from ..config import Qwen3Config
from ..model import CausalLM, ForwardBatch, check_tensors
from . import graphs
from .kv_cache import DeviceKVCache
from .memory import DeviceMemory, device_copy, new_stream, record, synchronize, to_host
from .pipeline import PendingGreedy
from .plan import (
    DEFAULT_F32_MAX_ROWS,
    Plan,
    Planner,
    allocate_activations,
    decode_context_bound,
)
from .stats import CudaModelStats
from .weights import unsupported_reason, upload_weights


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a decode step is padded to: powers of two below ``max_num_seqs``, and ``max_num_seqs``."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [int(max_num_seqs)])


PREFILL_BUCKET_STEP = 128
"""Beyond this many tokens a prefill is padded to a multiple of it (the height of the large-M GEMM tiles, so the
GEMMs do little more work); below, to a power of two (``prefill_buckets``)."""


def prefill_buckets(max_num_tokens: int) -> tuple[int, ...]:
    """Token counts a prefill over the tensor-core attention is padded to, so that one CUDA graph serves every prompt
    length of a bucket: powers of two up to ``PREFILL_BUCKET_STEP``, then its multiples, then ``max_num_tokens``."""
    buckets, b = [], 1
    while b < min(PREFILL_BUCKET_STEP, max_num_tokens):
        buckets.append(b)
        b *= 2
    b = PREFILL_BUCKET_STEP
    while b < max_num_tokens:
        buckets.append(b)
        b += PREFILL_BUCKET_STEP
    return tuple(buckets + [int(max_num_tokens)])


def _within(values: np.ndarray, low: int, high: int) -> bool:
    """Whether every value lies in ``[low, high)`` (two reductions: the checks run before every decode step,
    and the GPU waits for them)."""
    return values.size == 0 or (low <= values.min() and values.max() < high)


def _last_token_slots(batch: ForwardBatch, block_size: int) -> np.ndarray | None:
    """The cache slot of each sequence's position ``context_len - 1`` in its block table (None, equal to no slots,
    where a table has no block for it)."""
    last = np.asarray(batch.context_lens, np.int64) - 1
    tables = np.asarray(batch.block_tables)
    if np.any(last // block_size >= tables.shape[1]):
        return None
    return tables[np.arange(batch.num_seqs), last // block_size] * block_size + last % block_size


def _is_decode_step(batch: ForwardBatch) -> bool:
    """One new token per sequence (``batch.check()`` has made every query length positive)."""
    return len(batch.token_ids) == batch.num_seqs


class CudaQwen3Model(CausalLM):
    """A Qwen3 (FP8) causal LM whose forward runs as ``numba_kernels`` on the device; see the module docstring.

    ``tensors``: checkpoint tensors as ``fp8lab.engine.checkpoint`` loads them (``Qwen3Model``'s input).
    ``max_num_tokens``: most tokens in one forward (a prefill's prompt tokens); ``max_num_seqs``: most
    sequences in one forward (the decode batch); ``f32_max_rows``: GEMMs of at most this many rows take
    float32 activations (SIMT GEMV), larger ones BF16 (tensor cores); None: ``plan.DEFAULT_F32_MAX_ROWS`` (1); ``cuda_graphs``: capture and replay decode steps (GPU only).
    """

    def __init__(self, config: Qwen3Config, tensors: dict[str, np.ndarray], *, max_num_tokens: int = 2048,
                 max_num_seqs: int = 16, f32_max_rows: int | None = None, cuda_graphs: bool = True):
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"CudaQwen3Model: unsupported model: {reason}")
        check_tensors(config, tensors)
        if int(max_num_seqs) < 1 or int(max_num_tokens) < int(max_num_seqs):
            raise ValueError(f"max_num_seqs ({max_num_seqs}) must be >= 1 and max_num_tokens ({max_num_tokens}) "
                             f">= max_num_seqs")
        if f32_max_rows is None:
            f32_max_rows = DEFAULT_F32_MAX_ROWS
        if not 0 <= int(f32_max_rows) <= SIMT_MAX_ROWS:
            raise ValueError(f"f32_max_rows: expected 0 to {SIMT_MAX_ROWS} (the SIMT GEMV's row limit), got {f32_max_rows}")
        # the faster Numba inliner (the same PTX): the engine's first forwards compile about a third faster
        # (55 against 84 s at Qwen3-0.6B on an H100, bench/RESULTS.md, thirty-second session)
        install_faster_inlining()
        self.config = config
        self.max_num_tokens, self.max_num_seqs = int(max_num_tokens), int(max_num_seqs)
        self.f32_max_rows = int(f32_max_rows)
        self.cuda_graphs = bool(cuda_graphs) and not SIMULATOR
        self.buckets = decode_buckets(self.max_num_seqs)
        self.prefill_buckets = prefill_buckets(self.max_num_tokens)
        self.memory = DeviceMemory()
        self.stats = CudaModelStats()
        self._stream = new_stream()
        self._core_stream = None
        self.weights = upload_weights(config, tensors, self.memory)
        self.activations = allocate_activations(config, self.memory, self.max_num_tokens, self.max_num_seqs,
                                                self.f32_max_rows)
        self.planner = Planner(config, self.weights, self.activations, self.f32_max_rows)

    @classmethod
    def from_checkpoint(cls, checkpoint, **options) -> "CudaQwen3Model":
        """Build from an ``fp8lab.engine.checkpoint.Checkpoint`` (its ``config`` and ``tensors``); ``options``
        are the constructor's keywords."""
        return cls(checkpoint.config, checkpoint.tensors, **options)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_format) -> DeviceKVCache:
        """A paged KV cache on the device, poisoned with NaN (``memory.POISON_BYTE``), in ``kv_format``
        (a ``fp8lab.reference.kv_cache.KVCacheFormat`` or its name: ``"fp8"``, ``"bf16"``, ``"fp32"``)."""
        kv_format = kv_cache_format(kv_format)
        if int(num_blocks) <= 0 or int(block_size) <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        return DeviceKVCache(self.config, self.memory, id(self), self.max_num_tokens, self.max_num_seqs,
                             num_blocks, block_size, kv_format)

    # -- the forward pass

    def forward(self, batch: ForwardBatch, kv_cache: DeviceKVCache, all_logits: bool = False) -> np.ndarray:
        """Run the batch's new tokens through the model, writing their K/V into ``kv_cache``.

        Returns float32 host logits ``[num_seqs, vocab]`` of each sequence's last new token, or
        ``[T, vocab]`` of every new token with ``all_logits``.
        """
        start = time.perf_counter()
        self._check(batch, kv_cache)
        if _is_decode_step(batch):
            return self._decode_logits(batch, kv_cache, start)
        self.stats.prefill_forwards += 1
        return self._prefill(batch, kv_cache, all_logits)

    def greedy_tokens(self, batch: ForwardBatch, kv_cache: DeviceKVCache) -> np.ndarray:
        """``forward`` then greedy sampling: int ``[num_seqs]``, the argmax of each sequence's last logits
        row (``np.argmax``'s rule: the first maximum; a row holding NaN gives -1, no token, which
        ``fp8lab.engine.generate`` turns into that sequence's error). A decode step samples on the device
        (``layers.argmax_rows``, part of the captured graph) and copies 4 bytes per sequence back instead
        of the logits (``submit_greedy(...).tokens()``); a prefill samples the host logits with the same
        rule (``fp8lab.reference.dense.argmax_rows``)."""
        start = time.perf_counter()
        self._check(batch, kv_cache)
        if _is_decode_step(batch):
            return self._submit_greedy(batch, kv_cache, start, fed=False).tokens()
        self.stats.prefill_forwards += 1
        return argmax_rows(self._prefill(batch, kv_cache, False))

    def submit_greedy(self, batch: ForwardBatch, kv_cache: DeviceKVCache,
                      feed: PendingGreedy | None = None) -> PendingGreedy:
        """Enqueue a decode step with greedy sampling on the device and return without waiting for it;
        ``tokens()`` of the result gives what ``greedy_tokens`` returns (``fp8lab.engine.cuda.pipeline``).

        ``feed``: the last step submitted on ``kv_cache``, of the same sequences in the same order, whose
        ids are this step's token ids: they stay on the device (its argmax wrote them where this step's
        embedding reads), so this step can be enqueued before ``feed``'s ids reach the host, and
        ``batch.token_ids`` are not used (they must still lie in the vocabulary). A feed id of -1 (a NaN
        row) gives that row a NaN embedding, hence NaN logits and -1 again: the row's sequence, which
        ``feed`` ended with an error, is dropped by its caller; other rows are unaffected."""
        start = time.perf_counter()
        self._check(batch, kv_cache)
        if not _is_decode_step(batch):
            raise ValueError(f"submit_greedy: expected a decode step (one new token per sequence), got "
                             f"{len(batch.token_ids)} tokens of {batch.num_seqs} sequences")
        if feed is not None and (feed is not kv_cache.decode_staging.last or feed.num_seqs != batch.num_seqs):
            raise ValueError("feed: expected the last decode step submitted on this cache, of as many sequences as "
                             "the batch (its argmax wrote the token ids this step reads)")
        return self._submit_greedy(batch, kv_cache, start, fed=feed is not None)

    def _check(self, batch: ForwardBatch, cache) -> None:
        batch.check()
        c = self.config
        if not isinstance(cache, DeviceKVCache) or cache.model_id != id(self):
            raise ValueError("kv_cache: expected a cache from this model's allocate_kv_cache")
        t, s = len(batch.token_ids), batch.num_seqs
        if t > self.max_num_tokens:
            raise ValueError(f"batch of {t} tokens: more than max_num_tokens={self.max_num_tokens}, the size of the "
                             "preallocated activation buffers (build the model with a larger max_num_tokens, or prefill "
                             "in smaller chunks)")
        if s > self.max_num_seqs:
            raise ValueError(f"batch of {s} sequences: more than max_num_seqs={self.max_num_seqs}, the size of the "
                             "preallocated per-sequence buffers (build the model with a larger max_num_seqs)")
        if not _within(batch.token_ids, 0, c.vocab_size):
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        if not _within(batch.positions, 0, c.max_position_embeddings):
            raise ValueError(f"positions must lie in [0, {c.max_position_embeddings}) (max_position_embeddings)")
        slots = np.asarray(batch.slot_mapping)
        num_slots = cache.num_blocks * cache.block_size
        if not _within(slots, 0, num_slots) or len(set(slots.tolist())) != slots.size:
            raise ValueError(f"slot_mapping: slots must be distinct and lie in [0, {num_slots})")
        if batch.block_tables.shape[1] > cache.width or not _within(batch.context_lens, 0, cache.capacity + 1):
            raise ValueError(f"block_tables: at most {cache.width} blocks ({cache.capacity} tokens) per sequence in "
                             "this cache")
        if _is_decode_step(batch) and not np.array_equal(slots, _last_token_slots(batch, cache.block_size)):
            raise ValueError("slot_mapping: a decode step's new token must go to the slot of position context_len - 1 "
                             "in its block table (where its attention reads it, and the tensor-core attention writes it)")

    # -- decode steps

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    @staticmethod
    def _stage_decode_index(batch: ForwardBatch, host, bucket: int) -> None:
        """Fill ``host``, a host copy of the cache's decode index, for ``batch`` padded to ``bucket`` rows:
        padding rows have slot -1 (no cache write) and length 0 (a zero attention row)."""
        s = batch.num_seqs
        for array in (host.token_ids, host.positions, host.slots, host.context_lens):
            array[...] = 0
        host.token_ids[:s] = batch.token_ids
        host.positions[:s] = batch.positions
        host.slots[:bucket] = -1  # padding rows write no slot
        host.slots[:s] = batch.slot_mapping
        host.context_lens[:s] = batch.context_lens  # padding rows: length 0, a zero attention row
        tables = host.block_tables[:bucket]
        tables[...] = 0
        tables[:s, : batch.block_tables.shape[1]] = batch.block_tables

    def _enqueue_decode_step(self, batch: ForwardBatch, cache: DeviceKVCache, fed: bool) -> tuple[int, bool]:
        """Stage the decode index in a free host slot, copy it in (without the token ids when ``fed``: the
        previous step's argmax wrote them) and enqueue the step: a graph replay of its (bucket, context
        bound), or an eager run that is then captured. Returns the staging slot and whether it was a replay."""
        s, stream = batch.num_seqs, self._stream
        bucket = self._bucket(s)
        bound = decode_context_bound(int(np.max(batch.context_lens)), cache.capacity)
        slot = cache.decode_staging.take()
        self._stage_decode_index(batch, cache.decode_index.hosts[slot], bucket)
        cache.decode_index.copy_in(bucket * cache.width, stream, host=slot, token_ids=not fed)
        graph = cache.graphs.get((bucket, bound))
        if graph is not None:
            graph.launch(self._graph_stream())
            self.stats.graph_replays += 1
        else:
            plan = self.planner.decode(bucket, cache, bound)
            plan.run(stream)
            self.stats.launches_by_bucket[bucket] = plan.kernel_launches
            if self.cuda_graphs:
                synchronize(stream)  # the eager run compiled and warmed every kernel: capture it
                self._capture((bucket, bound), cache, plan)
        self.stats.decode_steps += 1
        self.stats.last_decode_bucket = bucket
        return slot, graph is not None

    def _enqueued(self, start: float, replay: bool) -> None:
        """Count the host time of a decode step from ``start`` until all of its work is enqueued."""
        host = time.perf_counter() - start
        self.stats.decode_host_seconds += host
        if replay:
            self.stats.replay_host_seconds += host

    def _submit_greedy(self, batch: ForwardBatch, cache: DeviceKVCache, start: float, fed: bool) -> PendingGreedy:
        """Enqueue the decode step and the copy of its greedy ids to the host; the step's ``PendingGreedy``."""
        staging, s = cache.decode_staging, batch.num_seqs
        slot, replay = self._enqueue_decode_step(batch, cache, fed)
        to_host(staging.ids[slot], cache.decode_index.device.token_ids, self._stream, count=s)
        record(staging.events[slot], self._stream)
        self._enqueued(start, replay)
        pending = PendingGreedy(staging, slot, s, start, self._decode_done)
        staging.owners[slot] = staging.last = pending
        return pending

    def _decode_done(self, wall_seconds: float) -> None:
        """A greedy decode step's ids are on the host, ``wall_seconds`` after it was submitted (overlapping
        with the next step's when steps are pipelined)."""
        self.stats.decode_wall_seconds += wall_seconds

    def _decode_logits(self, batch: ForwardBatch, cache: DeviceKVCache, start: float) -> np.ndarray:
        """A decode step whose logits come to the host (``forward``): enqueued as a greedy one, then waited for."""
        a, stream, s = self.activations, self._stream, batch.num_seqs
        _, replay = self._enqueue_decode_step(batch, cache, fed=False)
        cache.decode_staging.last = None  # its argmax overwrote the token ids that a pending step's successor needs
        to_host(a.logits_host, a.logits, stream, count=s * self.config.vocab_size)
        self._enqueued(start, replay)
        synchronize(stream)
        self.stats.decode_wall_seconds += time.perf_counter() - start
        return np.array(a.logits_host[:s], dtype=np.float32)

    def _graph_stream(self):
        """The model's Numba stream as a ``cuda.core`` stream (what ``Graph.launch`` takes)."""
        if self._core_stream is None:
            self._core_stream = graphs.core_stream(self._stream)
        return self._core_stream

    def _capture(self, key: tuple, cache: DeviceKVCache, plan: Plan) -> None:
        """Capture ``plan``, which just ran eagerly, into a graph of ``cache`` under ``key``: (bucket, context bound) for
        a decode step, ("prefill", tokens, seqs) for a prefill. A failure turns graphs off for this model, with a
        warning."""
        begin = time.perf_counter()
        try:
            cache.graphs[key] = graphs.capture(plan, self._graph_stream())
        except Exception as e:
            self.cuda_graphs = False
            self.stats.graph_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"CudaQwen3Model: CUDA graph capture of a forward failed, running eagerly: {e}")
            return
        self.stats.graphs_captured += 1
        self.stats.capture_seconds += time.perf_counter() - begin

    # -- prefill (and any batch that is not a pure decode step)

    def prefill_shape(self, batch: ForwardBatch, cache: DeviceKVCache) -> tuple[int, int, int, int]:
        """``(tokens, seqs, width, max_context)`` of the plan that runs ``batch``: with the tensor-core prefill
        attention, the batch padded to a token bucket (``prefill_buckets``) and a sequence bucket (``decode_buckets``),
        its block tables to the cache's width and its contexts bounded by the cache's capacity, so that the plan, and
        its CUDA graph, depend on the two buckets only; else the batch as it is (the SIMT attention's expanded rows
        follow the batch)."""
        t, s = len(batch.token_ids), batch.num_seqs
        if self.planner.prefill_attention_on_tensor_cores(cache):
            return next(b for b in self.prefill_buckets if b >= t), self._bucket(s), cache.width, cache.capacity
        return t, s, batch.block_tables.shape[1], int(np.max(batch.context_lens))

    def _stage_eager_index(self, batch: ForwardBatch, cache: DeviceKVCache, tokens: int, seqs: int, width: int) -> None:
        """Fill the host side of the cache's eager index with ``batch`` padded to ``tokens`` tokens, ``seqs`` sequences
        and ``width`` table columns, and copy it in. Padding tokens have token id 0, position 0 and slot -1 (no cache
        write); padding sequences no query and no context (no attention rows), so padding changes no real row."""
        host, t, s = cache.eager_index.host, len(batch.token_ids), batch.num_seqs
        for array, values, pad in ((host.token_ids, batch.token_ids, 0), (host.positions, batch.positions, 0),
                                   (host.slots, batch.slot_mapping, -1)):
            array[t:tokens] = pad
            array[:t] = values
        for array, values in ((host.context_lens, batch.context_lens), (host.query_lens, batch.query_lens)):
            array[s:seqs] = 0
            array[:s] = values
        tables = host.block_tables[: seqs * width].reshape(seqs, width)
        tables[...] = 0
        tables[:s, : batch.block_tables.shape[1]] = batch.block_tables
        cache.eager_index.copy_in(seqs * width, self._stream)

    def _run_prefill(self, batch: ForwardBatch, cache: DeviceKVCache) -> None:
        """Enqueue the layers of a prefill (``prefill_shape``'s plan). A padded shape's plan runs eagerly the first time
        (which compiles and warms every kernel) and is then captured into a CUDA graph, as a decode step's is; later
        prefills of that shape replay it."""
        shape = tokens, seqs, width, _ = self.prefill_shape(batch, cache)
        self._stage_eager_index(batch, cache, tokens, seqs, width)
        padded = self.planner.prefill_attention_on_tensor_cores(cache)
        key = ("prefill", tokens, seqs)
        graph = cache.graphs.get(key) if padded else None
        if graph is not None:
            graph.launch(self._graph_stream())
            self.stats.prefill_graph_replays += 1
            return
        plan = self.planner.prefill(*shape, cache)
        plan.run(self._stream)
        if self.cuda_graphs and padded:
            synchronize(self._stream)
            self._capture(key, cache, plan)

    def _prefill(self, batch: ForwardBatch, cache: DeviceKVCache, all_logits: bool) -> np.ndarray:
        t, s, smax = len(batch.token_ids), batch.num_seqs, self.max_num_seqs
        a, stream = self.activations, self._stream
        self._run_prefill(batch, cache)
        if all_logits:
            logits = np.empty((t, self.config.vocab_size), np.float32)
            for first in range(0, t, smax):
                n = min(smax, t - first)
                self.planner.lm_head(a.x[first : first + n], n)(stream)
                to_host(a.logits_host, a.logits, stream, count=n * self.config.vocab_size)
                synchronize(stream)
                logits[first : first + n] = a.logits_host[:n]
            return logits
        for i, row in enumerate(batch.last_token_rows):
            device_copy(a.selected[i : i + 1], a.x[int(row) : int(row) + 1], stream)
        self.planner.lm_head(a.selected[:s], s)(stream)
        to_host(a.logits_host, a.logits, stream, count=s * self.config.vocab_size)
        synchronize(stream)
        return np.array(a.logits_host[:s], dtype=np.float32)
