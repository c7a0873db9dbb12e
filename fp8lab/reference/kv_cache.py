"""Paged KV cache, in BF16/F16/F32 or in FP8 E4M3 with one float32 scale per (token, kv head).

Layout (as vLLM's paged attention, with the scales beside the codes)::

    cache  [num_blocks, num_kv_heads, block_size, head_dim]   codes (uint8) or floats
    scales [num_blocks, num_kv_heads, block_size]              float32, FP8 caches only

Token position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its *slot* is ``block * block_size + offset`` (what ``slot_mapping`` holds).

FP8 quantization of one (token, head) vector ``x[0:head_dim]``: ``scale = amax(|x|) / 448``
(1 when ``amax == 0``, never below float32's smallest normal ``2^-126``: ``e4m3.scale_of_amax``),
``codes = encode(x / scale, saturate=True)`` in float32. K is stored after k-norm and RoPE. A
cache of codes without scales is an error, never a silent fallback.

NaN and infinity are stored, not refused (a kernel cannot refuse either): a NaN or infinity in
a vector makes its ``amax`` and so its scale NaN or infinite, and every element of the vector
then gathers as NaN (``x / inf`` codes are 0 or NaN, and ``0 * inf`` is NaN). A float cache
stores the values themselves (cast to its dtype, so a float16 cache turns a huge finite value into
infinity, as any cast does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import e4m3
from .checks import (
    as_codes,
    as_float,
    as_index,
    ceil_div,
    check_block_tables,
    require_ndim,
    require_shape,
)


@dataclass(frozen=True)
class KVCacheFormat:
    """How a KV cache stores one element of K and V.

    ``name``: the command line's spelling (``--kv-cache-dtype``); ``kernel_storage``: the dtype of
    an element in a kernel's cache; ``numpy_storage``: the dtype of an element in a NumPy cache;
    ``scaled``: a float32 scale per (token, kv head) beside the elements, whose product with the
    decoded elements is the value; ``summary``: one line for messages and tables.
    """

    name: str
    kernel_storage: np.dtype
    numpy_storage: np.dtype
    scaled: bool
    summary: str

    def vector_bytes(self, head_dim: int, numpy: bool = False) -> int:
        """Bytes one (token, kv head) vector of ``head_dim`` elements takes, its scale included."""
        storage = self.numpy_storage if numpy else self.kernel_storage
        return int(head_dim) * storage.itemsize + (np.dtype(np.float32).itemsize if self.scaled else 0)


FP8_E4M3 = KVCacheFormat("fp8", np.dtype(np.uint8), np.dtype(np.uint8), True,
                         "E4M3 codes, one float32 scale per (token, kv head)")
BF16 = KVCacheFormat("bf16", np.dtype(np.uint16), np.dtype(np.float32), False,
                     "BF16, rounded to nearest even (NumPy caches: BF16 values in float32)")
FP32 = KVCacheFormat("fp32", np.dtype(np.float32), np.dtype(np.float32), False, "float32")
KV_CACHE_FORMATS = {f.name: f for f in (FP8_E4M3, BF16, FP32)}
"""Every format by name, in the command line's order of preference."""


def kv_cache_format(name) -> KVCacheFormat:
    """The format named ``name`` (a ``KVCacheFormat`` is returned as it is); ``ValueError`` otherwise."""
    if isinstance(name, KVCacheFormat):
        return name
    if name not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_FORMATS)}, got {name!r}")
    return KV_CACHE_FORMATS[name]


def kernel_cache_format(dtype) -> KVCacheFormat | None:
    """The format whose kernel cache stores elements of ``dtype`` (None: no format does).

    Each format has its own kernel storage dtype, so the dtype of a kernel's cache identifies it;
    a format that shared one with another would have to be passed explicitly (``kv_format=``).
    """
    matches = [f for f in KV_CACHE_FORMATS.values() if f.kernel_storage == np.dtype(dtype)]
    assert len(matches) <= 1, f"formats {[f.name for f in matches]} share the kernel storage {np.dtype(dtype)}"
    return matches[0] if matches else None


def quantize_kv(x) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``x[..., head_dim]`` with one scale per leading index (per token and head).

    Returns ``(codes uint8, same shape as x; scales float32, shape x.shape[:-1])``. A vector
    holding NaN or infinity gets a NaN or infinite scale, so it dequantizes to NaN.
    """
    x32 = as_float("x", x, np.float32)
    if x32.ndim < 1:
        raise ValueError("x: expected shape [..., head_dim], got a scalar")
    amax = np.max(np.abs(x32), axis=-1, initial=0)  # np.max propagates NaN
    scales = e4m3.scale_of_amax(amax)
    with np.errstate(invalid="ignore"):  # inf / inf in a vector holding inf: NaN, on purpose
        return e4m3.encode(x32 / scales[..., None], saturate=True), scales


def dequantize_kv(codes, scales) -> np.ndarray:
    """``decode(codes) * scales[..., None]`` as float32; ``scales`` has the shape ``codes.shape[:-1]``."""
    c = as_codes("codes", codes)
    s = as_float("scales", scales, np.float32)
    require_shape("scales", s, c.shape[:-1])
    with np.errstate(invalid="ignore"):  # 0 * inf (a vector that held inf): NaN, on purpose
        return e4m3.decode(c) * s[..., None]


def is_fp8(cache) -> bool:
    """True for a cache of E4M3 codes (``FP8_E4M3``'s storage, uint8), False for a float cache."""
    return np.asarray(cache).dtype == FP8_E4M3.numpy_storage


def check_cache(cache, scales, name: str = "cache") -> None:
    """Check a cache and its scales against the layout above; raise ``ValueError`` naming the problem.

    An FP8 (uint8) cache needs float32 ``scales`` of shape ``cache.shape[:3]``; a float cache
    must come with ``scales=None``.
    """
    if not isinstance(cache, np.ndarray):
        raise ValueError(f"{name}: expected a NumPy array, got {type(cache).__name__}")
    require_ndim(name, cache, 4, "[num_blocks, num_kv_heads, block_size, head_dim]")
    if is_fp8(cache):
        if scales is None:
            raise ValueError(f"{name}: an FP8 cache of codes (uint8) needs its scales, got scales=None")
        if not isinstance(scales, np.ndarray) or scales.dtype != np.float32:
            raise ValueError(f"{name} scales: expected a float32 array, got {getattr(scales, 'dtype', type(scales))}")
        require_shape(f"{name} scales", scales, cache.shape[:3])
    else:
        as_float(name, cache[:0])  # rejects integer caches other than uint8 codes
        if scales is not None:
            raise ValueError(f"{name}: a float cache ({cache.dtype}) takes scales=None, got an array")


def slots_for_positions(block_table, positions, block_size: int) -> np.ndarray:
    """Slots (``block * block_size + offset``) of token ``positions`` of a sequence with ``block_table``."""
    table = as_index("block_table", block_table)
    pos = as_index("positions", positions)
    if pos.size and (pos.min() < 0 or pos.max() >= table.shape[0] * block_size):
        raise ValueError(
            f"positions: must lie in [0, {table.shape[0] * block_size}) for a block table of "
            f"{table.shape[0]} blocks of {block_size}, got {pos.min()}..{pos.max()}"
        )
    return table[pos // block_size] * block_size + pos % block_size


def write(cache, scales, x, slot_mapping) -> None:
    """Write ``x[num_tokens, num_kv_heads, head_dim]`` into ``cache`` at ``slot_mapping[num_tokens]``, in place.

    For an FP8 cache, each (token, head) vector is quantized with ``quantize_kv`` and its scale
    written to ``scales``; a float cache stores ``x`` cast to its dtype. NaN and infinity are
    written like any value (see the module docstring). Every slot must be in range and appear
    at most once (a repeated slot would silently drop a token).
    """
    check_cache(cache, scales)
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    x32 = as_float("x", x, np.float32)
    require_ndim("x", x32, 3, "[num_tokens, num_kv_heads, head_dim]")
    slots = as_index("slot_mapping", slot_mapping)
    require_shape("x", x32, (slots.shape[0], num_kv_heads, head_dim))
    require_ndim("slot_mapping", slots, 1, "[num_tokens]")
    num_slots = num_blocks * block_size
    if slots.size and (slots.min() < 0 or slots.max() >= num_slots):
        raise ValueError(f"slot_mapping: slots must lie in [0, {num_slots}), got {slots.min()}..{slots.max()}")
    if np.unique(slots).size != slots.size:
        raise ValueError("slot_mapping: a slot appears more than once in one write")
    blocks, offsets = slots // block_size, slots % block_size
    if is_fp8(cache):
        codes, token_scales = quantize_kv(x32)
        cache[blocks, :, offsets, :] = codes
        scales[blocks, :, offsets] = token_scales
    else:
        cache[blocks, :, offsets, :] = x32.astype(cache.dtype)


def gather(cache, scales, block_table, seq_len: int) -> np.ndarray:
    """The first ``seq_len`` tokens of a sequence, dequantized: float32 ``[seq_len, num_kv_heads, head_dim]``."""
    check_cache(cache, scales)
    num_blocks, _, block_size, _ = cache.shape
    table = as_index("block_table", block_table)
    require_ndim("block_table", table, 1, "[max_blocks_per_seq]")
    seq_len = int(seq_len)
    if seq_len < 0:
        raise ValueError(f"seq_len: expected a length >= 0, got {seq_len}")
    check_block_tables(table[None], np.array([seq_len]), block_size, num_blocks, "block_table")
    used = table[:ceil_div(seq_len, block_size)]
    positions = np.arange(seq_len)
    blocks, offsets = used[positions // block_size], positions % block_size
    values = cache[blocks, :, offsets, :]
    if is_fp8(cache):
        return dequantize_kv(values, scales[blocks, :, offsets])
    return values.astype(np.float32)
