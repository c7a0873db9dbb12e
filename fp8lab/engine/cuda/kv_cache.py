"""The GPU model's paged KV cache and the index buffers of its forwards.

The cache is ``fp8lab.engine.kv_manager``'s layout on the device, one ``DeviceLayerKVCache`` per layer,
poisoned with 0xFF bytes (NaN in every format) so that a slot read before it was written shows.

Beside the pages, a cache owns the persistent int32 index buffers that its forwards read (they hold no
per-model state, and CUDA graphs captured with a cache read exactly these addresses):

- ``decode_index`` (``DecodeIndex``): a decode step's token ids, positions, slots and context lengths
  (``max_num_seqs`` each) and its block tables ``[max_num_seqs, width]``; a step of bucket ``b`` uses the
  first ``b`` rows; the step's argmax writes its ids over the token ids, for the next step
  (``fp8lab.engine.cuda.pipeline``);
- ``eager_index`` (``EagerIndex``): any other forward's token ids, positions, slots (``max_num_tokens``
  each), context and query lengths (``max_num_seqs`` each) and block tables (``[S, W]`` packed at the front: the
  forward's sequences and table width, padded or not: ``CudaQwen3Model.prefill_shape``);
- ``prefill_row_tables`` / ``prefill_row_lens``: ``paged_prefill``'s expanded rows.

Each index is a dataclass of named arrays that lie end to end in one device buffer, with a page-locked
host twin of the same layout (``StagedIndex``): a forward fills the host side by name and moves it in
with one copy. Graphs (``graphs``, by bucket and context bound) belong to the cache they were captured with and are
dropped with it; so do a padded prefill's (by token and sequence bucket).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np

from fp8lab.reference.kv_cache import KVCacheFormat

from ..config import Qwen3Config
from . import pipeline
from .memory import DeviceMemory, to_device


@dataclass(frozen=True)
class DecodeIndex:
    """The index arrays of a decode step: ``token_ids``, ``positions``, ``slots``, ``context_lens``
    ``[max_num_seqs]`` and ``block_tables [max_num_seqs, width]`` (int32)."""

    token_ids: object
    positions: object
    slots: object
    context_lens: object
    block_tables: object


@dataclass(frozen=True)
class EagerIndex:
    """The index arrays of any other forward: ``token_ids``, ``positions``, ``slots`` ``[max_num_tokens]``,
    ``context_lens``, ``query_lens`` ``[max_num_seqs]`` and ``block_tables [max_num_seqs * width]``, flat:
    a batch's ``[S, its width]`` table packed at the front (int32)."""

    token_ids: object
    positions: object
    slots: object
    context_lens: object
    query_lens: object
    block_tables: object


Index = TypeVar("Index", DecodeIndex, EagerIndex)


class StagedIndex(Generic[Index]):
    """Named int32 arrays (the fields of ``layout``, of ``shapes``) laid end to end in field order in one
    device buffer (``device``) and in ``host_copies`` page-locked host buffers of the same layout
    (``hosts``; ``host`` is the first), so that one copy moves them in. ``block_tables``, the last field,
    is the one whose used part varies; ``token_ids`` is the first.

    A pipelined decode step (``fp8lab.engine.cuda.pipeline``) fills one host copy while the copy-in from
    the other may still be pending, and leaves the device's token ids as the previous step's argmax wrote
    them (``copy_in(..., token_ids=False)``)."""

    def __init__(self, memory: DeviceMemory, what: str, layout: type[Index], shapes: dict[str, tuple[int, ...]],
                 host_copies: int = 1):
        names = [f.name for f in fields(layout)]
        assert names == list(shapes) and names[0] == "token_ids" and names[-1] == "block_tables", (names, list(shapes))
        sizes = [math.prod(shapes[n]) for n in names]
        self._tables_at, self._ids = sum(sizes[:-1]), sizes[0]
        self._device = memory.empty(what, (sum(sizes),), np.int32)
        self._hosts = [memory.pinned((sum(sizes),), np.int32) for _ in range(host_copies)]
        # the views past the token ids, made once (slicing a device array costs host time)
        self._device_tail = self._device[self._ids:]
        self._host_tails = [h[self._ids:] for h in self._hosts]
        self.device: Index = layout(**self._views(self._device, shapes, sizes))
        self.hosts: list[Index] = [layout(**self._views(h, shapes, sizes)) for h in self._hosts]
        self.host: Index = self.hosts[0]

    @staticmethod
    def _views(flat, shapes, sizes) -> dict:
        views, at = {}, 0
        for (name, shape), size in zip(shapes.items(), sizes):
            views[name] = flat[at : at + size].reshape(shape)
            at += size
        return views

    def copy_in(self, table_entries: int, stream, host: int = 0, token_ids: bool = True) -> None:
        """Copy host copy ``host`` to the device: every field whole but ``block_tables``, of which only the first
        ``table_entries`` entries (in row-major order); with ``token_ids=False`` every field but the token ids."""
        used = self._tables_at + int(table_entries)
        if token_ids:
            to_device(self._device, self._hosts[host], stream, count=used)
        else:
            to_device(self._device_tail, self._host_tails[host], stream, count=used - self._ids)


@dataclass
class DeviceLayerKVCache:
    """One layer's paged caches on the device: ``k``, ``v`` ``[num_blocks, num_kv_heads, block_size,
    head_dim]`` (uint8 E4M3 codes, uint16 BF16 patterns or float32) and, for FP8, float32 scales
    ``k_scale``, ``v_scale`` ``[num_blocks, num_kv_heads, block_size]`` (None otherwise)."""

    k: object
    v: object
    k_scale: object
    v_scale: object
    kv_format: KVCacheFormat

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


class DeviceKVCache:
    """A model's paged KV cache on the device: one ``DeviceLayerKVCache`` per layer (``len``, indexing and
    iteration as a list) plus the index buffers of the module docstring and the decode step's CUDA graphs.

    ``width``: block-table columns per sequence (``min(num_blocks, ceil(max_position_embeddings /
    block_size))``); ``capacity``: ``width * block_size`` tokens, the ``max_seq_len`` of every decode step.
    ``model_id`` names the model whose forwards may use it.
    """

    def __init__(self, config: Qwen3Config, memory: DeviceMemory, model_id: int, max_num_tokens: int,
                 max_num_seqs: int, num_blocks: int, block_size: int, kv_format: KVCacheFormat):
        c, mem = config, memory
        self.model_id = model_id
        self.num_blocks, self.block_size, self.kv_format = int(num_blocks), int(block_size), kv_format
        shape = (self.num_blocks, c.num_key_value_heads, self.block_size, c.head_dim)
        dtype = kv_format.kernel_storage
        self.layers = []
        for i in range(c.num_hidden_layers):
            k = mem.poisoned(f"KV cache layer {i} K {list(shape)} {kv_format.name}", shape, dtype)
            v = mem.poisoned(f"KV cache layer {i} V {list(shape)} {kv_format.name}", shape, dtype)
            ks = vs = None
            if kv_format.scaled:
                ks = mem.poisoned(f"KV cache layer {i} K scales {list(shape[:3])}", shape[:3], np.float32)
                vs = mem.poisoned(f"KV cache layer {i} V scales {list(shape[:3])}", shape[:3], np.float32)
            self.layers.append(DeviceLayerKVCache(k, v, ks, vs, kv_format))
        self.width = max(1, min(self.num_blocks, -(-c.max_position_embeddings // self.block_size)))
        self.capacity = self.width * self.block_size
        smax, tmax, width = int(max_num_seqs), int(max_num_tokens), self.width
        self.decode_index = StagedIndex(mem, "decode-step index buffer", DecodeIndex, dict(
            token_ids=(smax,), positions=(smax,), slots=(smax,), context_lens=(smax,), block_tables=(smax, width)),
            host_copies=pipeline.STAGING_SLOTS)
        self.decode_staging = pipeline.DecodeStaging(mem, smax)
        self.eager_index = StagedIndex(mem, "forward index buffer", EagerIndex, dict(
            token_ids=(tmax,), positions=(tmax,), slots=(tmax,), context_lens=(smax,), query_lens=(smax,),
            block_tables=(smax * width,)))
        self.prefill_row_tables = mem.empty("prefill expanded block tables", (tmax * width,), np.int32)
        self.prefill_row_lens = mem.empty("prefill expanded lengths", (tmax,), np.int32)
        self.graphs: dict[tuple, object] = {}
        """CUDA graphs of this cache's forwards: decode steps by (bucket, context bound), prefills by ("prefill",
        tokens, seqs)."""

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)
