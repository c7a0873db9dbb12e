"""The paged KV cache: block bookkeeping (who owns which block) and the per-layer cache storage.

Two halves, kept apart so that a kernel backend can put the storage on a GPU while the
bookkeeping stays plain Python:

- ``BlockAllocator`` and ``KVCacheManager``: a pool of ``num_blocks`` blocks of ``block_size``
  token slots. Every sequence owns a list of blocks (its *block table*); token position ``p`` of
  a sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``, i.e. in slot
  ``table[p // block_size] * block_size + p % block_size`` (``slot_mapping``). ``append`` reserves
  slots for new tokens, taking fresh blocks from the free list when the last one is full;
  ``free`` gives a finished sequence's blocks back. There is no block sharing (no prefix
  caching), so a block has at most one owner and no reference count is needed.
- ``LayerKVCache``: the arrays of one layer, in the layout of ``fp8lab.reference.kv_cache``::

      k, v            [num_blocks, num_kv_heads, block_size, head_dim]
      k_scale, v_scale [num_blocks, num_kv_heads, block_size]          (fp8 only)

Cache formats (``kv_format``: a ``fp8lab.reference.kv_cache.KVCacheFormat`` or its name, the
command line's ``--kv-cache-dtype``):

- ``"fp8"``: uint8 E4M3 codes with one float32 scale per (token, kv head), the numerics
  contract's FP8 KV cache. A cache of codes without scales is an error.
- ``"bf16"``: BF16 values. NumPy has no bfloat16 and ml_dtypes is not a runtime dependency, so
  the CPU cache stores float32 arrays whose values are rounded to BF16 (round to nearest, ties
  to even, ``fp8lab.reference.dense.round_to_bf16``, NaN kept NaN): the numbers are exactly those of a BF16
  cache, at twice the memory.
- ``"fp32"``: plain float32, no rounding; for tests that compare against an exact cache.

Memory (``kv_block_bytes``, ``blocks_in_budget``, ``host_available_bytes``): ``fp8lab generate`` sizes
its cache as the smaller of the batch's worst case and what fits in a fraction of the free memory.

Running out of blocks raises ``KVCacheExhausted`` (a ``RuntimeError``) naming how many blocks
were needed and how many were free, *before* any state changes: a failed ``append`` leaves every
block table, length and the free list as they were.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

import numpy as np

from fp8lab.reference import kv_cache as ref_kv


class KVCacheExhausted(RuntimeError):
    """Not enough free KV cache blocks; raised before any state changes."""

    def __init__(self, needed: int, free: int, detail: str = ""):
        self.needed, self.free = needed, free
        message = f"KV cache exhausted: {needed} blocks needed, {free} free"
        super().__init__(f"{message} ({detail})" if detail else message)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens occupy: ``ceil(num_tokens / block_size)``."""
    return -(-int(num_tokens) // int(block_size))


# ---------------------------------------------------------------------------- memory

def kv_block_bytes(config, block_size: int, kv_format, *, numpy: bool = False) -> int:
    """Bytes of one KV cache block over all layers of ``config``: K and V, plus their scales for FP8.

    ``numpy``: the size in the NumPy cache (``allocate_kv_cache``), which keeps BF16 values in
    float32 arrays (4 bytes an element); a kernel's cache stores 2-byte BF16 patterns.
    """
    fmt = ref_kv.kv_cache_format(kv_format)
    per_token_and_head = 2 * fmt.vector_bytes(config.head_dim, numpy=numpy)  # 2: K and V
    return config.num_hidden_layers * config.num_key_value_heads * int(block_size) * per_token_and_head


def blocks_in_budget(available_bytes: int, fraction: float, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` fit in ``fraction`` of ``available_bytes`` (rounded down)."""
    return int(available_bytes * fraction) // int(block_bytes)


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """Linux's ``MemAvailable`` (free memory plus what the kernel can reclaim), in bytes; None without it."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_available_bytes() -> int | None:
    """Host memory a new allocation can use now, in bytes, or None where the system does not say.

    ``MemAvailable`` on Linux; elsewhere psutil when it is installed, then the free physical pages
    (``sysconf``, which undercounts: reclaimable caches are not free pages).
    """
    available = _meminfo_available()
    if available is not None:
        return available
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # not installed, or no answer on this system
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # e.g. macOS has no SC_AVPHYS_PAGES
        return None


# ---------------------------------------------------------------------------- bookkeeping


class BlockAllocator:
    """A pool of block ids ``0 .. num_blocks - 1`` with a free list.

    Blocks are handed out in FIFO order of their freeing (a freed block goes to the back), so a
    just-freed block is reused last: stale data in it is overwritten late, which makes
    read-after-free bugs in a kernel show up as wrong numbers instead of hiding.
    """

    def __init__(self, num_blocks: int):
        if int(num_blocks) <= 0:
            raise ValueError(f"num_blocks: expected a positive number of blocks, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def is_used(self, block: int) -> bool:
        return block in self._used

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks; ``KVCacheExhausted`` (nothing taken) if fewer are free."""
        if count < 0:
            raise ValueError(f"count: expected >= 0 blocks, got {count}")
        if count > len(self._free):
            raise KVCacheExhausted(count, len(self._free))
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Give ``blocks`` back; freeing a block that is not in use (a double free) is a ``ValueError``."""
        blocks = list(blocks)
        not_used = [b for b in blocks if b not in self._used]
        if not_used or len(set(blocks)) != len(blocks):
            raise ValueError(f"free: blocks {not_used or blocks} are not all in use (double free?)")
        for b in blocks:
            self._used.remove(b)
            self._free.append(b)


class KVCacheManager:
    """Block tables and lengths of the sequences that live in one paged KV cache.

    A sequence is any hashable id. ``append(seq, n)`` reserves the slots of its next ``n``
    tokens and returns them (the slot mapping of those tokens); ``context_len(seq)`` is the
    number of token slots reserved so far, i.e. the tokens the cache will hold once they are
    written.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if int(block_size) <= 0:
            raise ValueError(f"block_size: expected a positive number of tokens per block, got {block_size}")
        self.block_size = int(block_size)
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._tables)

    def add_sequence(self, seq: Hashable) -> None:
        """Register an empty sequence (no blocks yet)."""
        if seq in self._tables:
            raise ValueError(f"sequence {seq!r} is already in the KV cache")
        self._tables[seq] = []
        self._lens[seq] = 0

    def block_table(self, seq: Hashable) -> list[int]:
        return list(self._tables[seq])

    def context_len(self, seq: Hashable) -> int:
        return self._lens[seq]

    def new_blocks_needed(self, seq: Hashable, num_tokens: int) -> int:
        """Blocks that appending ``num_tokens`` to ``seq`` would take from the free list."""
        return blocks_for(self._lens[seq] + num_tokens, self.block_size) - len(self._tables[seq])

    def append(self, seq: Hashable, num_tokens: int) -> np.ndarray:
        """Reserve slots for the next ``num_tokens`` tokens of ``seq``; returns their slots (int64)."""
        return self.append_batch({seq: num_tokens})[seq]

    def append_batch(self, requests: Mapping[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """``append`` for several sequences at once, all or nothing.

        The blocks needed by all of them are counted first; if they are more than the free
        ones, ``KVCacheExhausted`` is raised and nothing changes.
        """
        for seq, n in requests.items():
            if seq not in self._tables:
                raise KeyError(f"sequence {seq!r} is not in the KV cache (add_sequence first)")
            if int(n) < 0:
                raise ValueError(f"append: expected >= 0 new tokens for sequence {seq!r}, got {n}")
        needed = {seq: self.new_blocks_needed(seq, int(n)) for seq, n in requests.items()}
        total = sum(needed.values())
        if total > self.allocator.num_free:
            raise KVCacheExhausted(total, self.allocator.num_free,
                                   f"appending {sum(int(n) for n in requests.values())} tokens "
                                   f"to {len(requests)} sequence(s), {self.block_size} tokens per block")
        slots = {}
        for seq, n in requests.items():
            table = self._tables[seq]
            table.extend(self.allocator.allocate(needed[seq]))
            start = self._lens[seq]
            self._lens[seq] = start + int(n)
            slots[seq] = self._new_slots(table, start, int(n))
        return slots

    def _new_slots(self, table: list[int], start: int, n: int) -> np.ndarray:
        """Slots of positions ``start .. start + n - 1`` of a sequence with block ``table`` (int64), the rule of
        ``fp8lab.reference.kv_cache.slots_for_positions`` for positions just reserved, so without its checks:
        a decode step reserves one slot per sequence, and the host time of a step is time the GPU waits."""
        bs = self.block_size
        return np.fromiter((table[p // bs] * bs + p % bs for p in range(start, start + n)), np.int64, count=n)

    def slots(self, seq: Hashable, positions) -> np.ndarray:
        """Slots of token ``positions`` of ``seq`` (positions must already be reserved)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and positions.max() >= self._lens[seq]:
            raise ValueError(f"positions up to {positions.max()} of sequence {seq!r}, which has {self._lens[seq]} slots")
        table = np.asarray(self._tables[seq], dtype=np.int64)
        return ref_kv.slots_for_positions(table, positions, self.block_size)

    def block_tables(self, seqs: list[Hashable]) -> np.ndarray:
        """Block tables of ``seqs`` as one int32 array ``[len(seqs), max_blocks]``, padded with -1."""
        width = max([len(self._tables[s]) for s in seqs] + [1])
        out = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            out[i, : len(self._tables[s])] = self._tables[s]
        return out

    def free(self, seq: Hashable) -> None:
        """Forget ``seq`` and give its blocks back."""
        blocks = self._tables.pop(seq)
        del self._lens[seq]
        self.allocator.free(blocks)


# ---------------------------------------------------------------------------- storage


@dataclass
class LayerKVCache:
    """The K and V caches of one layer (see the module docstring for the layout)."""

    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None
    kv_format: ref_kv.KVCacheFormat

    def __post_init__(self):
        self.kv_format = ref_kv.kv_cache_format(self.kv_format)
        storage = self.kv_format.numpy_storage
        for name, cache, scales in (("k", self.k, self.k_scale), ("v", self.v, self.v_scale)):
            # check_cache rejects codes without scales and scales beside a float cache
            ref_kv.check_cache(cache, scales, f"{name} cache")
            if cache.dtype != storage:
                raise ValueError(f"{name} cache: holds {cache.dtype}, but kv_format {self.kv_format.name} is stored "
                                 f"as {storage} in NumPy")
        if self.k.shape != self.v.shape:
            raise ValueError(f"k and v caches differ in shape: {self.k.shape} vs {self.v.shape}")

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


def allocate_kv_cache(
    num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, kv_format
) -> list[LayerKVCache]:
    """One ``LayerKVCache`` per layer on the CPU, poisoned (NaN values, NaN codes and NaN scales)
    so that reading a slot that was never written gives NaN instead of a plausible stale number.
    ``kv_format``: a ``KVCacheFormat`` or its name."""
    fmt = ref_kv.kv_cache_format(kv_format)
    shape = (int(num_blocks), int(num_kv_heads), int(block_size), int(head_dim))
    layers = []
    for _ in range(num_layers):
        if fmt.scaled:  # E4M3 codes: 0x7F is the NaN code
            k, v = np.full(shape, 0x7F, fmt.numpy_storage), np.full(shape, 0x7F, fmt.numpy_storage)
            ks, vs = np.full(shape[:3], np.nan, np.float32), np.full(shape[:3], np.nan, np.float32)
        else:
            k, v = np.full(shape, np.nan, fmt.numpy_storage), np.full(shape, np.nan, fmt.numpy_storage)
            ks = vs = None
        layers.append(LayerKVCache(k, v, ks, vs, fmt))
    return layers
