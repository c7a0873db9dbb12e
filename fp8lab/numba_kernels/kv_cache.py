"""Paged KV-cache write: new K/V tokens into an FP8 (E4M3 + per-token scales) or float paged cache.

Computes ``fp8lab.reference.kv_cache.write``. Launch: grid ``(num_tokens, num_kv_heads)`` x 64 threads
(warp 0 writes K, warp 1 V). Checked (``tests/numba_kernels/test_kv_cache_kernel.py``): bit for bit against
the oracle, in the CUDA simulator and on a GPU (the write is exact float32 arithmetic, so it needs no
simulator of its own).

What it computes (the contract of ``fp8lab.reference.kv_cache.write``, checked bit for bit in
``tests/numba_kernels/test_kv_cache_kernel.py``): for every new token ``t`` and kv head ``h``, the vectors
``k[t, h, :]`` and ``v[t, h, :]`` go to slot ``slot_mapping[t] = block * block_size + offset`` of
the caches ``[num_blocks, num_kv_heads, block_size, head_dim]``:

- FP8 cache (uint8 codes, float32 scales ``[num_blocks, num_kv_heads, block_size]``), the
  quantization of ``fp8lab.reference.kv_cache.quantize_kv``: ``scale = max(amax(|x|) / 448, 2^-126)`` (1 when
  ``amax == 0``), ``codes = encode(x / scale)``, round to nearest even, saturating; every
  operation a correctly rounded float32 one, as in the reference;
- float32 cache: ``x`` as float32 (exact for every input format);
- BF16 cache (uint16 bit patterns): ``x`` rounded to BF16, to nearest even.

Inputs ``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]`` of float32, float16, or BF16 bit
patterns (uint16, or int16 as torch exports a bfloat16 tensor viewed as ``torch.int16``). Many
tokens at once (a prefill) and one token per sequence (a decode step) are the same call.

Launch: grid ``(num_tokens, num_kv_heads)``, one CTA of 2 warps per (token, kv head): warp 0
writes K, warp 1 writes V. Lane ``L`` handles elements ``L, L + 32, ...`` (coalesced loads and
stores, any ``head_dim``). For an FP8 cache each lane takes the max of its ``|x|``, a butterfly of
``shfl_xor`` gives every lane the amax, lane 0 stores the scale, and the lanes read their elements
a second time (from L1) to encode them. One warp per vector needs no shared memory and no
``syncthreads``; the write is a small part of a decode step either way.

Argument checks happen on the host before anything is launched (a ``ValueError`` naming the
argument, expected against got): an FP8 cache without scales (never a silent fallback), scales of
the wrong shape or dtype, a float cache with scales, shape or dtype mismatches, slots out of range
or repeated. ``slot_mapping`` is read on the host for that check: a device array is copied (one
small synchronizing copy).

Non-finite inputs are not rejected, here as in the reference: a NaN or infinity in a vector makes
its FP8 scale NaN or infinite, so attention over that token gives NaN rather than a silently finite
result; a float cache stores the value itself. The scale never goes below ``2^-126``
(``fp8lab.reference.e4m3.scale_of_amax``), so that a vector of tiny values still round-trips within the
E4M3 error bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, types, uint32
from numba.np.numpy_support import from_dtype as numba_dtype

from fp8lab.reference.kv_cache import (
    KV_CACHE_FORMATS,
    KVCacheFormat,
    kernel_cache_format,
    kv_cache_format,
)

from . import mathops, pdl
from .arguments import as_kernel_array, reject, require_c_contiguous
from .bits import SIMULATOR, bf16_bits_to_f32, f16_bits_to_f32
from .warp import BUTTERFLY_OFFSETS, FULL_MASK, WARP_SIZE

E4M3_MAX = float32(448.0)
MIN_SCALE = float32(2.0**-126)
"""The smallest scale (the float32 minimum normal): below it ``amax / 448`` would be subnormal and inexact."""
THREADS_PER_CTA = 2 * WARP_SIZE
"""Warp 0 writes K, warp 1 writes V."""

INPUT_FORMATS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16",
                 np.dtype(np.int16): "bf16"}
"""k/v dtype -> format; 16-bit inputs reach the kernel as uint16 bit patterns (``as_16bit_patterns``)."""


# ---------------------------------------------------------------------------- device functions


@cuda.jit(device=True, inline=True)
def load_f32(x, token, head, d):
    return x[token, head, d]


@cuda.jit(device=True, inline=True)
def load_f16_bits(x, token, head, d):
    return f16_bits_to_f32(uint32(x[token, head, d]))  # widen first: a NumPy uint16 would overflow the shifts


@cuda.jit(device=True, inline=True)
def load_bf16_bits(x, token, head, d):
    return bf16_bits_to_f32(uint32(x[token, head, d]))


INPUT_LOADERS = {"f32": load_f32, "f16": load_f16_bits, "bf16": load_bf16_bits}
"""One device function per input format: element ``[token, head, d]`` as its exact float32 value."""


@cuda.jit(device=True, inline=True)
def warp_max(x):
    """The max of ``x`` over the 32 lanes (NaN if any lane has NaN), in every lane: a butterfly."""
    for offset in BUTTERFLY_OFFSETS:
        x = mathops.nan_max(x, cuda.shfl_xor_sync(FULL_MASK, x, offset))
    return x


def _make_vector_writers(load):
    """The three ways to store one (token, head) vector, for inputs read by ``load``."""

    @cuda.jit(device=True, inline=True)
    def write_fp8(x, cache, scales, token, head, block, offset, lane):
        """quantize_kv for one vector: amax over the warp, scale by lane 0, then encode each element."""
        head_dim = cache.shape[3]
        amax = float32(0)
        for d in range(lane, head_dim, WARP_SIZE):
            amax = mathops.nan_max(amax, abs(load(x, token, head, d)))
        amax = warp_max(amax)
        scale = float32(1) if amax == 0 else amax / E4M3_MAX  # NaN amax stays NaN: NaN == 0 is false
        if scale < MIN_SCALE:  # fp8lab.reference.e4m3.scale_of_amax's floor (a NaN scale is not < anything: kept)
            scale = MIN_SCALE
        if lane == 0:
            scales[block, head, offset] = scale
        for d in range(lane, head_dim, WARP_SIZE):
            cache[block, head, offset, d] = mathops.e4m3_encode_saturating(load(x, token, head, d) / scale)

    @cuda.jit(device=True, inline=True)
    def write_f32(x, cache, scales, token, head, block, offset, lane):
        """A float32 cache stores the exact float32 value of each element."""
        for d in range(lane, cache.shape[3], WARP_SIZE):
            cache[block, head, offset, d] = load(x, token, head, d)

    @cuda.jit(device=True, inline=True)
    def write_bf16(x, cache, scales, token, head, block, offset, lane):
        """A BF16 cache stores each element rounded to nearest even."""
        for d in range(lane, cache.shape[3], WARP_SIZE):
            cache[block, head, offset, d] = mathops.f32_to_bf16_bits_rne(load(x, token, head, d))

    return {"fp8": write_fp8, "fp32": write_f32, "bf16": write_bf16}


def cache_write_function(input_format: str, cache_format: str):
    """The Python source of the cache-write kernel for one (input format, cache format) pair.

    Arguments: ``k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping`` (a float cache gets
    placeholder scale arrays, never touched). Launch ``[(num_tokens, num_kv_heads), 64]``.

    A slot of -1 is padding (a batch padded to a captured CUDA graph's size) and writes nothing; so
    does any slot outside the cache, which the host check rejects unless the caller turned it off.
    """
    write_vector = _make_vector_writers(INPUT_LOADERS[input_format])[cache_format]

    def cache_write_kernel(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        token = cuda.blockIdx.x
        head = cuda.blockIdx.y
        warp = cuda.threadIdx.x // WARP_SIZE
        lane = cuda.threadIdx.x % WARP_SIZE
        block_size = k_cache.shape[2]
        slot = slot_mapping[token]
        if slot < 0 or slot >= k_cache.shape[0] * block_size:
            return
        block = slot // block_size
        offset = slot % block_size
        if warp == 0:
            write_vector(k, k_cache, k_scale, token, head, block, offset, lane)
        else:
            write_vector(v, v_cache, v_scale, token, head, block, offset, lane)

    return cache_write_kernel


@functools.lru_cache(maxsize=None)
def _cache_write_kernel(input_format: str, cache_format: str):
    return cuda.jit(cache_write_function(input_format, cache_format))



# ---------------------------------------------------------------------------- host side


def on_device(x, stream=0):
    """``x`` where a kernel can read it without a copy per launch.

    In the simulator NumPy arrays are what kernels take. On a GPU a NumPy array is copied to the
    device once here (the caller copies results back); Numba device arrays pass through and
    ``__cuda_array_interface__`` objects (torch, CuPy) are wrapped without a copy.
    """
    if SIMULATOR or not isinstance(x, np.ndarray):
        return x
    return cuda.to_device(np.ascontiguousarray(x), stream=stream)


def to_host(x) -> np.ndarray:
    """A host copy of a small array (index arrays, for checking their values)."""
    return np.asarray(x) if isinstance(x, np.ndarray) else x.copy_to_host()


@functools.lru_cache(maxsize=None)
def placeholder(ndim: int):
    """A 1-element float32 array of ``ndim`` dimensions, passed where a kernel variant takes no array.

    Cached, so a call never allocates or copies it again (CUDA-graph capture needs that).
    """
    array = np.zeros((1,) * ndim, np.float32)
    return array if SIMULATOR else cuda.to_device(array)


def as_16bit_patterns(x):
    """float16 values and int16 BF16 patterns (torch's export) viewed as uint16: kernels decode bit patterns."""
    return x.view(np.uint16) if np.dtype(x.dtype) in (np.dtype(np.int16), np.dtype(np.float16)) else x


def check_cache(name: str, cache, scales, scales_name: str, kv_format=None) -> KVCacheFormat:
    """Check a paged cache and its scales against ``kv_format``; return the format.

    ``cache``: C-contiguous ``[num_blocks, num_kv_heads, block_size, head_dim]`` of the format's
    kernel storage (``fp8lab.reference.kv_cache.KV_CACHE_FORMATS``: uint8 E4M3 codes, uint16 BF16
    patterns, float32); a scaled format (FP8) needs float32 ``scales`` of shape ``cache.shape[:3]``,
    the others take ``scales=None``. ``kv_format`` (a format or its name) is what the caller says
    the cache holds; without it the cache's dtype names the format.
    """
    fmt = kernel_cache_format(cache.dtype) if kv_format is None else kv_cache_format(kv_format)
    if cache.ndim != 4 or fmt is None or np.dtype(cache.dtype) != fmt.kernel_storage:
        formats = ", ".join(f"{f.kernel_storage} ({f.name})" for f in KV_CACHE_FORMATS.values())
        wanted = formats if kv_format is None else f"{fmt.kernel_storage} (kv_format {fmt.name})"
        reject(name, f"[num_blocks, num_kv_heads, block_size, head_dim] of {wanted}", cache)
    require_c_contiguous(name, cache)
    if fmt.scaled:
        if scales is None:
            raise ValueError(f"{name}: an FP8 cache of codes ({fmt.kernel_storage}) needs its scales, got {scales_name}=None")
        if tuple(scales.shape) != tuple(cache.shape[:3]) or np.dtype(scales.dtype) != np.float32:
            reject(scales_name, f"float32 scales of shape {tuple(cache.shape[:3])}", scales)
        require_c_contiguous(scales_name, scales)
    elif scales is not None:
        raise ValueError(f"{name}: a float cache ({np.dtype(cache.dtype)}) takes {scales_name}=None, got an array")
    return fmt


@dataclass(frozen=True)
class CacheWrite:
    """A checked ``paged_cache_write`` call: kernel-ready arrays and the kernel variant."""

    k: object
    v: object
    k_cache: object
    v_cache: object
    k_scale: object
    v_scale: object
    slot_mapping: object
    input_format: str
    cache_format: str


def check_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, check_slots=True,
                      kv_format=None) -> CacheWrite:
    """Every argument check of ``paged_cache_write``; nothing is launched or modified here.

    ``check_slots=False`` skips the check of the slot values, which reads ``slot_mapping`` on the host.
    """
    names = ("k", "v", "k_cache", "v_cache", "slot_mapping")
    k, v, k_cache, v_cache, slot_mapping = (as_kernel_array(n, x) for n, x in zip(names, (k, v, k_cache, v_cache, slot_mapping)))
    k_scale = None if k_scale is None else as_kernel_array("k_scale", k_scale)
    v_scale = None if v_scale is None else as_kernel_array("v_scale", v_scale)
    cache_format = check_cache("k_cache", k_cache, k_scale, "k_scale", kv_format).name
    if np.dtype(v_cache.dtype) != np.dtype(k_cache.dtype) or tuple(v_cache.shape) != tuple(k_cache.shape):
        reject("v_cache", f"the shape {tuple(k_cache.shape)} and dtype {k_cache.dtype} of k_cache", v_cache)
    check_cache("v_cache", v_cache, v_scale, "v_scale", cache_format)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    if slot_mapping.ndim != 1 or np.dtype(slot_mapping.dtype).kind not in "iu":
        reject("slot_mapping", "a 1-D integer array [num_tokens]", slot_mapping)
    num_tokens = slot_mapping.shape[0]
    input_format = INPUT_FORMATS.get(np.dtype(k.dtype))
    expected = (num_tokens, num_kv_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != expected or np.dtype(x.dtype) != np.dtype(k.dtype) or input_format is None:
            reject(name, f"{list(expected)} = [num_tokens, num_kv_heads, head_dim] of float32, float16 or "
                        f"uint16/int16 (BF16 patterns), k and v alike", x)
    if check_slots:
        _check_slot_values(to_host(slot_mapping).astype(np.int64), num_blocks * block_size)
    return CacheWrite(as_16bit_patterns(k), as_16bit_patterns(v), k_cache, v_cache, k_scale, v_scale, slot_mapping,
                      input_format, cache_format)


def _check_slot_values(slots: np.ndarray, num_slots: int) -> None:
    """Every slot lies in ``[0, num_slots)`` or is -1 (padding), and no slot appears twice."""
    used = slots[slots != -1]
    if used.size and (used.min() < 0 or used.max() >= num_slots):
        raise ValueError(f"slot_mapping: slots must lie in [0, {num_slots}) (or be -1 for padding), "
                         f"got {used.min()}..{used.max()}")
    if np.unique(used).size != used.size:
        raise ValueError("slot_mapping: a slot appears more than once in one write (a token would be lost)")


def paged_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *, kv_format=None,
                      stream=0, check_slots=True) -> None:
    """Write ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches at ``slot_mapping``, in place.

    ``k_cache``, ``v_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]`` of uint8 (E4M3;
    then ``k_scale``, ``v_scale`` float32 ``[num_blocks, num_kv_heads, block_size]`` are required and
    written too), float32 or uint16 (BF16). Every slot must lie in ``[0, num_blocks * block_size)``
    and appear once, or be -1: a padding token, written nowhere. Arrays: NumPy (copied to the device
    and back on a GPU), Numba device arrays or ``__cuda_array_interface__`` objects. Raises
    ``ValueError`` before launching on a bad call.

    ``kv_format`` (keyword; a ``fp8lab.reference.kv_cache.KVCacheFormat`` or its name): the format
    the caches hold, checked against their dtype (the engine passes it; without it the dtype names it).
    ``check_slots=False`` (keyword) skips reading ``slot_mapping`` back to check its values (a
    synchronizing copy for a device array; the way to run inside CUDA-graph capture): the caller
    vouches for them. The kernel still never writes outside the cache, but a repeated slot is then
    a race.
    """
    w = check_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, check_slots, kv_format)
    if w.slot_mapping.shape[0] == 0:
        return
    fp8 = w.cache_format == "fp8"
    arrays = [w.k, w.v, w.k_cache, w.v_cache, w.k_scale if fp8 else placeholder(3), w.v_scale if fp8 else placeholder(3),
              w.slot_mapping]
    device = [on_device(x, stream) for x in arrays]
    kernel = _cache_write_kernel(w.input_format, w.cache_format)
    pdl.launch(kernel, (w.slot_mapping.shape[0], w.k_cache.shape[1]), THREADS_PER_CTA, stream, *device)
    for host, dev in zip(arrays[2:6], device[2:6]):
        if dev is not host:  # a NumPy array that on_device copied to the GPU: bring the result back
            dev.copy_to_host(host, stream=stream)


# ---------------------------------------------------------------------------- every variant, for the PTX check


def kernel_variants():
    """``(name, python function, numba signature)`` of every cache-write kernel variant (C-contiguous, int32 slots)."""
    element = {"f32": types.float32, "f16": types.uint16, "bf16": types.uint16}
    cache_element = {f.name: numba_dtype(f.kernel_storage) for f in KV_CACHE_FORMATS.values()}
    variants = []
    for input_format in ("f32", "f16", "bf16"):
        for cache_format in KV_CACHE_FORMATS:
            x = types.Array(element[input_format], 3, "C", readonly=False)
            cache = types.Array(cache_element[cache_format], 4, "C")
            scales = types.Array(types.float32, 3, "C")
            slots = types.Array(types.int32, 1, "C")
            signature = types.void(x, x, cache, cache, scales, scales, slots)
            variants.append((f"cache_write[{input_format}->{cache_format}]",
                             cache_write_function(input_format, cache_format), signature))
    return variants
