"""The attention input of a Qwen3 layer in one launch: q/k-norm, RoPE and the paged KV-cache write.

What it computes: for every token ``t``, bit for bit the sequence the engine ran as four launches,

1. ``layers.rms_norm(q, q_norm, eps, q)`` and ``layers.rms_norm(k, k_norm, eps, k)`` (warp per row);
2. ``layers.rope(q, positions, cos_sin, q)`` and the same for ``k`` (NeoX, two fmas per pair; a
   position outside the table makes the token's q and k vectors NaN);
3. ``kv_cache.paged_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
   check_slots=False)`` of the normed and rotated ``k`` and of ``v`` (FP8 codes and per-token
   scales, BF16 patterns or float32; a slot of -1 is padding and writes nothing).

``q``, ``k`` and ``v`` are only read, and may be column slices of the fused q/k/v GEMM output
``[T, (Hq + 2 Hkv) D]`` (a token's q, k and v are not contiguous there), so the engine runs one GEMM
for q, k and v. The normed, rotated q goes to its own C-contiguous ``q_out [T, Hq, D]`` (attention
reads it; it may be ``q`` itself, in place), the normed, rotated k to the cache only. The float32
operations are those of the kernels above, in their order, so the results are theirs bit for bit on
a GPU and in the CUDA simulator: the norm is ``fp8lab.simulators.dense.rms_norm`` with 32 threads
(lane ``L`` sums ``x[L], x[L + 32], ...`` with fmas, a butterfly, ``sqrt(ss / D + eps)``,
``w * (x / denom)``), RoPE ``fp8lab.simulators.dense.rope``, the cache write
``fp8lab.reference.kv_cache.write``.

Launch: grid ``(T, ceil((Hq + Hkv) / 4))`` x 128 threads, one warp per (token, head): warp ``w`` of CTA
``(t, b)`` takes head ``y = 4 b + w`` of token ``t``. (A CTA of one warp per head, as before, ran at most 32 warps
per SM, the SM's limit of resident CTAs.) Head ``y < Hq`` is query
head ``y``: load ``q[t, y D : (y + 1) D]``, norm, rope, store ``q_out[t, y]``. Head ``y >= Hq`` is kv
head ``j = y - Hq`` of a token with a slot: load k's and v's row ``j``, norm and rope k, write k's
cache row, then v's. Lane ``L`` holds elements ``L + 32 i`` (``i < ceil(D / 32)``) in registers, and
reads all of them before it writes any (so ``q_out`` may be ``q``); ``D`` (even, at most 256) is a
compile-time constant of the kernel variant (one per head dim and cache format), so each lane's
loads are issued together, unrolled: the norm weights, the position and its cos/sin before the kernel waits for the
q/k/v GEMM (``pdl``: nothing in the forward writes them), then x (and v). ``q``, ``k``, ``v`` are compiled with
layout "A" (any row stride; elements of a row adjacent). When ``D`` is a multiple of 64 the RoPE
pair ``(i, i + D/2)`` lies in one lane; otherwise the normed row is staged in shared memory (D
floats per warp, ``syncwarp``) and each lane reads its elements' partners.

A warp's work on one head row is a set of device functions (``head_row_functions``): the tensor-core decode
attention with its input (``splitkv_mma.decode_mma_with_input``) runs the same ones, so its queries and cache
writes are this kernel's bits.

Checked (``tests/numba_kernels/test_attention_input_kernel.py``): in the CUDA simulator, bit for bit
against ``layers.rms_norm``, ``layers.rope`` and ``kv_cache.paged_cache_write`` run in sequence (q_out,
both caches and scales; untouched slots keep their poison; q, k, v unchanged), every cache format,
several head dims, q/k/v both as column slices of one fused buffer and as separate arrays with
``q_out`` in place of ``q``; on a GPU (``gpu``) the same at Qwen3-8B sizes (fused slices); the sm_90
PTX of ``kernel_variants()``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import cuda, float32, types
from numba.np.numpy_support import from_dtype as numba_dtype

from fp8lab.reference.kv_cache import KV_CACHE_FORMATS

from . import mathops, pdl
from .arguments import (
    as_kernel_array,
    memory_extent,
    overlaps,
    reject,
    require_c_contiguous,
)
from .kv_cache import E4M3_MAX, MIN_SCALE, check_cache, placeholder, warp_max
from .layers import MAX_GRID_Y, WARP_PER_ROW_MAX_N, _run, sqrt_f32
from .warp import WARP_SIZE, warp_sum

MAX_HEAD_DIM = WARP_PER_ROW_MAX_N
"""256: up to here ``layers.rms_norm`` uses a warp per row, the order this kernel reproduces."""
NAN = float32(np.nan)
HEADS_PER_CTA = 4
"""Warps (heads) per CTA."""
COMPILED_HEAD_DIMS = (16, 64, 128)
"""Head dims of ``kernel_variants`` (the PTX check): a staged one (16) and in-lane ones (64: tiny model, 128: Qwen3);
the FP8 cache at each, the float caches at 128."""


@dataclass(frozen=True)
class HeadRowFunctions:
    """The device functions of one warp's work on one head row (``head_row_functions``)."""

    elements: int
    """``E``: elements per lane (lane ``L`` holds elements ``L + 32 i``)."""
    load_row: Callable
    """``load_row(x, token, head, lane, values)``: head ``head``'s D columns of row ``token`` of a 2-D ``[T, heads * D]``
    array (any row stride) into the lane's ``values[E]``."""
    store_row: Callable
    """``store_row(x, token, head, lane, values)``: the lane's elements into ``x[token, head, :]`` of a 3-D array."""
    write_row: Callable
    """``write_row(values, cache, scales, block, head, offset, lane)``: the lane's elements into the cache slot
    (``kv_cache``'s write for the cache format: FP8 codes and the row's scale, BF16 bits or float32)."""
    load_weights: Callable
    """``load_weights(weight, lane, w)``: the lane's elements of a norm weight ``[D]`` into ``w[E]``."""
    load_rotation: Callable
    """``load_rotation(positions, cos_sin, token, lane, c, s)``: the lane's cos/sin of the token's position into ``c``,
    ``s`` (``E`` each); whether the position is in the table."""
    norm_rope: Callable
    """``norm_rope(x, w, eps, n, c, s, in_table, token, head, lane, values, stage)``: load head ``head`` of row ``token``
    of ``x``, q/k-norm it with the weights ``w`` and rotate it by ``c``, ``s`` (``load_weights``, ``load_rotation``:
    a kernel issues those loads before it waits for the q/k/v GEMM) into ``values`` (``n``: D as a run-time float32;
    ``stage``: D shared floats, used only when the RoPE pair is not in one lane)."""


@functools.cache
def head_row_functions(head_dim: int, cache_format: str) -> HeadRowFunctions:
    """The device functions of this kernel for one head dim and cache format: what a warp does to one head row.
    ``splitkv_mma``'s decode attention with its input runs the same ones, so their results are the same bits."""
    D = head_dim
    HALF = D // 2
    E = -(-D // WARP_SIZE)  # elements per lane
    IN_LANE = HALF % WARP_SIZE == 0  # the pair (i, i + D/2) is (register r, register r + E/2) of one lane
    WHOLE = D % WARP_SIZE == 0  # every lane owns E elements: no bound check

    # Both are compile-time facts for in-lane D (the compiler does not know that lane < 32 by itself)
    @cuda.jit(device=True, inline=True)
    def owns(lane, r):
        """Does the lane hold element ``lane + 32 r``?"""
        return WHOLE or lane + WARP_SIZE * r < D

    @cuda.jit(device=True, inline=True)
    def first_half(lane, r):
        """Is element ``lane + 32 r`` the first of its pair (``< D/2``)?"""
        return r < E // 2 if IN_LANE else lane + WARP_SIZE * r < HALF

    @cuda.jit(device=True, inline=True)
    def load_row(x, token, head, lane, values):
        """Head ``head``'s D columns of row ``token`` of a 2-D ``[T, heads * D]`` array (any row stride)."""
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                values[r] = x[token, head * D + d]

    @cuda.jit(device=True, inline=True)
    def load_weights(weight, lane, w):
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                w[r] = weight[d]

    @cuda.jit(device=True, inline=True)
    def load_cos_sin(cos_sin, p, lane, c, s):
        """Element ``d`` of a pair ``(i, i + D/2)`` rotates by ``cos_sin[p, i]`` and ``cos_sin[p, D/2 + i]``."""
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                i = d if first_half(lane, r) else d - HALF
                c[r] = cos_sin[p, i]
                s[r] = cos_sin[p, HALF + i]

    @cuda.jit(device=True, inline=True)
    def normalize(values, w, eps, lane, n):
        """``layers.rms_norm``'s warp-per-row arithmetic on the registers, in place; ``n`` is D read at run time."""
        acc = float32(0)
        for r in range(E):
            if owns(lane, r):
                acc = cuda.fma(values[r], values[r], acc)
        # divide by the run-time n, as rms_norm does: by a constant power of two the compiler would multiply
        # instead and contract the product with `+ eps` into an fma (one rounding fewer: other bits)
        denom = sqrt_f32(warp_sum(acc) / n + eps)
        for r in range(E):
            if owns(lane, r):
                values[r] = w[r] * (values[r] / denom)

    @cuda.jit(device=True, inline=True)
    def partners(values, stage, lane, other):
        """``other[r]``: the value paired with register ``r`` (element ``(d + D/2) mod D``)."""
        if IN_LANE:
            for r in range(E):
                other[r] = values[(r + E // 2) % E]
        else:
            for r in range(E):
                d = lane + WARP_SIZE * r
                if owns(lane, r):
                    stage[d] = values[r]
            cuda.syncwarp()
            for r in range(E):
                d = lane + WARP_SIZE * r
                if owns(lane, r):
                    other[r] = stage[(d + HALF) % D]

    @cuda.jit(device=True, inline=True)
    def rotate(values, other, c, s, in_table, lane):
        """``layers.rope_kernel``: ``x_i c - x_{i+h} s`` and ``x_{i+h} c + x_i s`` as its two fmas."""
        for r in range(E):
            if owns(lane, r):
                if not in_table:
                    values[r] = NAN
                elif first_half(lane, r):
                    values[r] = cuda.fma(values[r], c[r], -(other[r] * s[r]))
                else:
                    values[r] = cuda.fma(values[r], c[r], other[r] * s[r])

    @cuda.jit(device=True, inline=True)
    def write_fp8(values, cache, scales, block, head, offset, lane):
        """``kv_cache``'s FP8 write: amax (lane order, then the butterfly), the scale by lane 0, the codes."""
        amax = float32(0)
        for r in range(E):
            if owns(lane, r):
                amax = mathops.nan_max(amax, abs(values[r]))
        amax = warp_max(amax)
        scale = float32(1) if amax == 0 else amax / E4M3_MAX  # a NaN amax stays NaN (NaN == 0 is false)
        if scale < MIN_SCALE:  # a NaN scale is not < anything: kept
            scale = MIN_SCALE
        if lane == 0:
            scales[block, head, offset] = scale
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                cache[block, head, offset, d] = mathops.e4m3_encode_saturating(values[r] / scale)

    @cuda.jit(device=True, inline=True)
    def write_f32(values, cache, scales, block, head, offset, lane):
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                cache[block, head, offset, d] = values[r]

    @cuda.jit(device=True, inline=True)
    def write_bf16(values, cache, scales, block, head, offset, lane):
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                cache[block, head, offset, d] = mathops.f32_to_bf16_bits_rne(values[r])

    @cuda.jit(device=True, inline=True)
    def load_rotation(positions, cos_sin, token, lane, c, s):
        """The lane's cos/sin of token ``token``'s position into ``c``, ``s``; whether the position is in the table
        (outside it nothing is read, and the rotated row becomes NaN)."""
        p = positions[token]
        in_table = p >= 0 and p < cos_sin.shape[0]
        if in_table:
            load_cos_sin(cos_sin, p, lane, c, s)
        return in_table

    @cuda.jit(device=True, inline=True)
    def norm_rope(x, w, eps, n, c, s, in_table, token, head, lane, values, stage):
        """Load head ``head`` of row ``token`` of ``x``, norm it with ``w`` and rotate it by ``c``, ``s`` into ``values``
        (``n``: D at run time)."""
        other = cuda.local.array(E, float32)
        load_row(x, token, head, lane, values)
        normalize(values, w, eps, lane, n)
        partners(values, stage, lane, other)
        rotate(values, other, c, s, in_table, lane)

    @cuda.jit(device=True, inline=True)
    def store_row(x, token, head, lane, values):
        for r in range(E):
            d = lane + WARP_SIZE * r
            if owns(lane, r):
                x[token, head, d] = values[r]

    write_row = {"fp8": write_fp8, "fp32": write_f32, "bf16": write_bf16}[cache_format]
    return HeadRowFunctions(E, load_row, store_row, write_row, load_weights, load_rotation, norm_rope)


def attention_input_function(head_dim: int, cache_format: str):
    """The Python source of the kernel for one head dim and cache format.

    Arguments ``(q, k, v, q_out, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, k_scale,
    v_scale, slot_mapping)``: ``q [T, Hq D]``, ``k``, ``v [T, Hkv D]`` (any row stride), ``q_out [T, Hq,
    D]`` (a float cache gets placeholder scale arrays, never touched). Launch ``[(T, Hq + Hkv), 32]``.
    """
    D = head_dim
    rows = head_row_functions(head_dim, cache_format)
    E, load_row, store_row, write_row = rows.elements, rows.load_row, rows.store_row, rows.write_row
    load_weights, load_rotation, norm_rope = rows.load_weights, rows.load_rotation, rows.norm_rope

    def attention_input_kernel(q, k, v, q_out, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, k_scale,
                               v_scale, slot_mapping):
        token = cuda.blockIdx.x
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        y = cuda.blockIdx.y * HEADS_PER_CTA + warp
        q_heads = q_out.shape[1]
        if y >= q_heads + k_cache.shape[1]:
            return  # past the last head: the whole warp leaves, having written nothing (warp 0 of CTA 0 always waits)
        # Before the wait, what no kernel writes: the norm weights, the position (copied in before the forward) and
        # its cos/sin; after it, only q, k and v (the q/k/v GEMM's output) are left to load
        w = cuda.local.array(E, float32)
        c = cuda.local.array(E, float32)
        s = cuda.local.array(E, float32)
        if y < q_heads:  # two calls, not one on a chosen array: a chosen pointer would load through the generic space
            load_weights(q_norm, lane, w)
        else:
            load_weights(k_norm, lane, w)
        in_table = load_rotation(positions, cos_sin, token, lane, c, s)
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        values = cuda.local.array(E, float32)
        stages = cuda.shared.array((HEADS_PER_CTA, D), float32)
        stage = stages[warp]
        # D read at run time: the norm divides by it as rms_norm does (see normalize)
        n = float32(q_out.shape[2])
        if y < q_heads:
            # every lane loads its elements before it stores any, and only its own: q_out may be q
            norm_rope(q, w, eps, n, c, s, in_table, token, y, lane, values, stage)
            store_row(q_out, token, y, lane, values)
            return
        head = y - q_heads
        block_size = k_cache.shape[2]
        slot = slot_mapping[token]
        if slot < 0 or slot >= k_cache.shape[0] * block_size:  # -1: padding; never outside the cache
            return  # k goes to the cache only: a token without a slot has nothing to do here
        v_values = cuda.local.array(E, float32)
        load_row(v, token, head, lane, v_values)  # issued with k's loads: v's latency overlaps k's work
        norm_rope(k, w, eps, n, c, s, in_table, token, head, lane, values, stage)
        block = slot // block_size
        offset = slot % block_size
        write_row(values, k_cache, k_scale, block, head, offset, lane)
        write_row(v_values, v_cache, v_scale, block, head, offset, lane)

    return attention_input_kernel


@functools.cache
def _attention_input_kernel(head_dim: int, cache_format: str):
    return cuda.jit(attention_input_function(head_dim, cache_format))


# ---------------------------------------------------------------------------- host side


def _is_c_contiguous(x) -> bool:
    return x.flags["C_CONTIGUOUS"] if isinstance(x, np.ndarray) else x.is_c_contiguous()


def _check_columns(name: str, x, tokens: int, width: int):
    """``x``: float32 ``[tokens, width]`` whose rows are contiguous (element stride 4 bytes, rows at least
    ``width`` apart): C-contiguous, or a column slice of a wider row-major float32 buffer."""
    if x.ndim != 2 or tuple(x.shape) != (tokens, width) or np.dtype(x.dtype) != np.float32:
        reject(name, f"float32 [{tokens}, {width}] (C-contiguous or a column slice of a row-major buffer)", x)
    row, column = x.strides
    if tokens and (column != 4 or (tokens > 1 and (row < 4 * width or row % 4))):
        raise ValueError(f"{name}: expected contiguous rows (element stride 4 bytes, row stride a multiple of 4 "
                         f"and at least {4 * width} bytes), got strides {x.strides}")


def check_head_inputs(q, k, v, q_norm, k_norm, positions, cos_sin, tokens: int, q_heads: int, kv_heads: int,
                      head_dim: int) -> None:
    """The checks of the inputs a warp's head rows read (``ValueError`` naming the argument): ``q``, ``k``, ``v`` float32
    columns (``_check_columns``), the norm weights, int32 positions and the RoPE table."""
    _check_columns("q", q, tokens, q_heads * head_dim)
    _check_columns("k", k, tokens, kv_heads * head_dim)
    _check_columns("v", v, tokens, kv_heads * head_dim)
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if tuple(weight.shape) != (head_dim,) or np.dtype(weight.dtype) != np.float32:
            reject(name, f"float32 [{head_dim}]", weight)
        require_c_contiguous(name, weight)
    if positions.ndim != 1 or positions.shape[0] != tokens or np.dtype(positions.dtype) != np.int32:
        reject("positions", f"int32 [{tokens}]", positions)
    if cos_sin.ndim != 2 or cos_sin.shape[1] != head_dim or np.dtype(cos_sin.dtype) != np.float32:
        reject("cos_sin", f"float32 [max_positions, {head_dim}] (rope_table)", cos_sin)
    require_c_contiguous("cos_sin", cos_sin)


def _check_q_out_memory(q_out, q, k, v):
    """``q_out`` overlaps neither ``k`` nor ``v``, and ``q`` only as ``q`` itself (in place: same start, contiguous)."""
    if q_out.size == 0:
        return
    for name, x in (("k", k), ("v", v)):
        if overlaps(q_out, x):
            raise ValueError(f"q_out: overlaps {name} in memory (q_out may share memory with q only)")
    if overlaps(q_out, q) and not (_is_c_contiguous(q) and memory_extent(q) == memory_extent(q_out)):
        raise ValueError("q_out: partially overlaps q in memory (allowed: q_out is q's memory exactly, "
                         "q C-contiguous, in place)")


def host_contiguous(x):
    """A NumPy column slice as a C-contiguous copy (the simulator and ``on_device`` copy only contiguous arrays);
    device arrays, read in place with their row stride, pass through."""
    return np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x


def qk_norm_rope_cache_write(q, k, v, q_out, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache,
                             slot_mapping, k_scale=None, v_scale=None, *, kv_format=None, stream=0) -> None:
    """q/k-norm and RoPE of q (to ``q_out``) and k, and the paged cache write of k and v, in one launch.

    ``q_out``: float32 ``[T, Hq, D]``, C-contiguous, ``D`` even, at most 256; receives the normed,
    rotated q. ``q``: float32 ``[T, Hq * D]``; ``k``, ``v``: float32 ``[T, Hkv * D]``; each
    C-contiguous or a column slice of a wider row-major float32 buffer (element stride 1, any row
    stride >= its width: the fused q/k/v GEMM output ``[T, (Hq + 2 Hkv) D]`` sliced by columns), only
    read. ``q_out`` must not overlap ``k`` or ``v``; it may be ``q`` itself (same memory, ``q``
    C-contiguous: in place) and must not overlap ``q`` otherwise. ``q_norm``, ``k_norm``: float32
    ``[D]``; ``eps``: a float (used as float32). ``positions``: int32 ``[T]``; ``cos_sin``: float32
    ``[max_positions, D]`` (``layers.rope_table``); a position outside it gives a NaN q_out vector
    (and a NaN k in the cache). ``k_cache``, ``v_cache``, ``k_scale``, ``v_scale``, ``kv_format``: as
    ``kv_cache.paged_cache_write`` takes them; ``Hkv`` is ``k_cache.shape[1]``. ``slot_mapping``:
    int32 ``[T]``, -1 for a padding token (written nowhere). The slot values are never read on the
    host (the caller vouches for them, as ``check_slots=False``), so the call can be captured in a
    CUDA graph; shapes, dtypes, strides and overlaps are checked (``ValueError`` naming the
    argument). ``stream``: a Numba stream or a ``cuda.core`` GraphBuilder. Bit for bit ``rms_norm``
    (q, k), ``rope`` (q, k) and ``paged_cache_write``. ``T == 0`` launches nothing.
    """
    names = ("q", "k", "v", "q_out", "q_norm", "k_norm", "positions", "cos_sin", "k_cache", "v_cache",
             "slot_mapping")
    arrays = (q, k, v, q_out, q_norm, k_norm, positions, cos_sin, k_cache, v_cache, slot_mapping)
    q, k, v, q_out, q_norm, k_norm, positions, cos_sin, k_cache, v_cache, slot_mapping = (
        as_kernel_array(n, x) for n, x in zip(names, arrays))
    k_scale = None if k_scale is None else as_kernel_array("k_scale", k_scale)
    v_scale = None if v_scale is None else as_kernel_array("v_scale", v_scale)
    if (q_out.ndim != 3 or np.dtype(q_out.dtype) != np.float32 or not 0 < q_out.shape[2] <= MAX_HEAD_DIM
            or q_out.shape[2] % 2):
        reject("q_out", f"float32 [T, Hq, head_dim] with head_dim even and at most {MAX_HEAD_DIM}", q_out)
    require_c_contiguous("q_out", q_out)
    tokens, q_heads, head_dim = q_out.shape
    cache_format = check_cache("k_cache", k_cache, k_scale, "k_scale", kv_format).name
    if np.dtype(v_cache.dtype) != np.dtype(k_cache.dtype) or tuple(v_cache.shape) != tuple(k_cache.shape):
        reject("v_cache", f"the shape {tuple(k_cache.shape)} and dtype {k_cache.dtype} of k_cache", v_cache)
    check_cache("v_cache", v_cache, v_scale, "v_scale", cache_format)
    kv_heads = k_cache.shape[1]
    if k_cache.shape[3] != head_dim:
        reject("k_cache", f"[num_blocks, num_kv_heads, block_size, {head_dim}] (q_out's head_dim)", k_cache)
    check_head_inputs(q, k, v, q_norm, k_norm, positions, cos_sin, tokens, q_heads, kv_heads, head_dim)
    if slot_mapping.ndim != 1 or slot_mapping.shape[0] != tokens or np.dtype(slot_mapping.dtype) != np.int32:
        reject("slot_mapping", f"int32 [{tokens}] (-1: padding)", slot_mapping)
    _check_q_out_memory(q_out, q, k, v)
    if q_heads + kv_heads > MAX_GRID_Y:
        raise ValueError(f"q_out: at most {MAX_GRID_Y} heads in all (q and kv), got {q_heads} + {kv_heads}")
    if tokens == 0:
        return
    fp8 = cache_format == "fp8"
    # q before q_out: the simulator copies every NumPy argument back after the launch, in order, so an
    # in-place q_out (another NumPy view of q's memory) gets the result last
    args = [host_contiguous(q), host_contiguous(k), host_contiguous(v), q_out, q_norm, k_norm, np.float32(eps),
            positions, cos_sin, k_cache, v_cache, k_scale if fp8 else placeholder(3),
            v_scale if fp8 else placeholder(3), slot_mapping]
    written = (3, 9, 10, 11, 12) if fp8 else (3, 9, 10)
    grid = (tokens, -(-(q_heads + kv_heads) // HEADS_PER_CTA))
    _run(_attention_input_kernel(head_dim, cache_format), grid, WARP_SIZE * HEADS_PER_CTA, stream, args, written)


# ---------------------------------------------------------------------------- every variant, for the PTX check


def kernel_variants():
    """``(name, python function, numba signature)`` of the variants the PTX check compiles (q, k, v with layout
    "A": column slices of the fused q/k/v output; everything else C-contiguous; int32)."""
    f32_1d, f32_2d, f32_3d = (types.Array(types.float32, d, "C") for d in (1, 2, 3))
    columns = types.Array(types.float32, 2, "A")
    i32_1d = types.Array(types.int32, 1, "C")
    variants = []
    for head_dim in COMPILED_HEAD_DIMS:
        for fmt in KV_CACHE_FORMATS.values():
            if fmt.name != "fp8" and head_dim != 128:
                continue  # the float caches' writes at one head size: the same code paths, fewer compiles
            cache = types.Array(numba_dtype(fmt.kernel_storage), 4, "C")
            signature = types.void(columns, columns, columns, f32_3d, f32_1d, f32_1d, types.float32, i32_1d, f32_2d,
                                   cache, cache, f32_3d, f32_3d, i32_1d)
            variants.append((f"qk_norm_rope_cache_write[D={head_dim}, {fmt.name}]",
                             attention_input_function(head_dim, fmt.name), signature))
    return variants
