"""Flash prefill attention over a paged FP8 or BF16 cache on tensor cores (``mma.m16n8k16``, F16 or BF16 in,
float32 out).

Computes ``fp8lab.reference.attention.prefill`` per sequence over ``fp8lab.reference.kv_cache.gather`` (FP8 or BF16
cache, head size 128, ``G`` query heads per kv head with ``G`` dividing 16, no ALiBi), with the arguments of
``fp8lab.numba_kernels.prefill.paged_prefill``. Launch: ``prefill_kernel`` grid ``(query blocks, num_kv_heads,
num_seqs)`` x 128 threads (4 warps), one launch, no workspace. Checked (``tests/numba_kernels/test_prefill_mma_kernel.py``):
bit for bit against ``fp8lab.simulators.prefill_mma`` in the CUDA simulator (whose ``mma`` twin is the model the
simulator uses), against the oracle within the tensor-core decode's error bound per query on a GPU; sm_90 PTX in
``tests/numba_kernels/test_kernels_compile.py``.

Why: ``prefill.paged_prefill`` decodes every query token over its whole prefix with the SIMT decode kernel, so a
prompt of ``T`` tokens reads about ``T^2 / 2`` K/V rows per kv head and multiplies them on CUDA cores. Here the rows
of an mma tile are ``16 / G`` query tokens times the ``G`` query heads of a kv head: each K/V tile a warp loads serves
16 query rows (the GQA group shares it), and the 4 warps of a CTA, which own consecutive query tokens, read the same
tiles (from L1 after the first).

The schedule is the simulator's (read ``fp8lab.simulators.prefill_mma`` first). Per warp: query tokens ``i0 ..
i0 + 16/G - 1`` of sequence ``blockIdx.z`` (CTA ``x`` of the grid takes query block ``gridDim.x - 1 - x``, so the
longest walks start first; ``i0 = (block * 4 + warp) * 16 / G``), kv head ``blockIdx.y``. The warp walks key tiles
``0, 1, ...`` up to its last token's position with the tile functions of the tensor-core decode
(``splitkv_mma.tile_functions``: the same lane layouts, conversions and mma chains; the loads of the next tile go out
before the current tile's arithmetic), with ``causal=True``: row ``r``'s key ``j`` counts when ``j <=`` its position
(``limit[r]``; -1 for rows past the sequence's queries). At the end each row's ``l`` is summed over its four lanes
and the lane stores its ``D / 4`` elements of rows ``g`` and ``g + 8``, ``acc / l`` (0 where ``l = 0``), in float32
or BF16 bits. A NaN value (code or BF16 element) or V scale of a key after a query's position but inside its warp's
last tile reaches that query (the simulator's docstring says why); the reference keeps it out.

**Over a BF16 cache** (``bf16_cache``): the same walk with ``tile_functions(..., bf16_cache=True)``: a lane's key and
value words are twice as many (``D / 4`` and ``D / 8`` elements of 2 bytes), the key words are the B registers as
they are, a value register is one halfword of two tokens' words (``splitkv_mma.half_pair``), the queries and weights
are BF16 patterns and the ``mma`` is the BF16 one; no scales are read. Those 64 words do not fit twice in the
registers, so a warp issues a tile's loads, then computes it (the other warps of the SM hide the wait) where the FP8
kernel has the next tile's loads in flight.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, types, uint32

from fp8lab.simulators.prefill_mma import supports, tokens_per_cta, tokens_per_warp
from fp8lab.simulators.splitkv_mma import HEAD_DIMS, LOG2E, MAX_GROUP, TILE, WARPS

from . import pdl
from .arguments import as_kernel_array
from .kv_cache import on_device, placeholder, to_host
from .prefill import check_prefill
from .splitkv import _as_int32, flat_cache, normalized, output_store
from .splitkv_mma import query_pair, query_pair_bf16, tile_functions
from .warp import FULL_MASK, WARP_SIZE, load_u32x4

THREADS = WARPS * WARP_SIZE
MAX_GRID_Z = 65535
"""The grid's z extent at most: the sequences of one call."""


def prefill_kernel_function(head_dim: int, group: int, bf16_out: bool = False, bf16_cache: bool = False):
    """The Python source of the prefill kernel for one head size, query heads per kv head, output format and cache
    format (E4M3 codes, or ``bf16_cache``: BF16 patterns).

    Arguments: ``q, k_words, v_words, k_scales, v_scales, block_tables, context_lens, query_lens, scale_log2,
    num_kv_heads, block_size, out``: the caches flat as uint32 words and their scales flat (``splitkv.flat_cache``;
    placeholders for a BF16 cache, never read). Launch ``[(query_blocks, num_kv_heads, num_seqs), THREADS]`` with
    ``query_blocks * tokens_per_cta(group)`` at least the longest ``query_lens`` (a CTA past its sequence's queries
    returns at once).
    """
    D, G = head_dim, group
    TOKENS = tokens_per_warp(G)
    STEPS = D // 16
    NTILES = D // 8  # n tiles of P V
    QUERY_WORDS, ACC_SIZE = 4 * STEPS, 4 * NTILES
    ELEMENT_BYTES = 2 if bf16_cache else 1
    KEY_WORDS, VALUE_WORDS = 2 * (D * ELEMENT_BYTES // 16), 4 * (D * ELEMENT_BYTES // 32)
    # One tile's loads in flight during the arithmetic of the one before: the FP8 tile's 32 words fit twice in the
    # registers, the BF16 tile's 64 do not (ptxas, sm_90: 255 registers and 72 to 80 bytes of spills; 176 registers
    # without), so a BF16 warp loads, then computes.
    LOAD_AHEAD = not bf16_cache
    store = output_store(bf16_out)
    pair = query_pair_bf16 if bf16_cache else query_pair
    tiles_of = tile_functions(D, True, load_u32x4, causal=True, bf16_cache=bf16_cache)  # rows g, g + 8: queries
    load_tile, tile_row, table_chunk, attend_tile = (tiles_of.load_tile, tiles_of.tile_row, tiles_of.table_chunk,
                                                     tiles_of.attend_tile)

    @cuda.jit(device=True, inline=True)
    def query_registers(q, first_row, i0, query_len, kv, g, t, scale_log2, qa):
        """The A registers of the scores: row ``g + 8 r`` is query token ``i0 + (g + 8 r) // G`` (``q``'s row
        ``first_row`` + that) and head ``kv G + (g + 8 r) % G``, as F16 pairs of ``q * scale_log2``; 0 past the
        sequence's queries."""
        for s in range(STEPS):
            d = (D // 4) * t + 4 * s
            for r in range(2):
                row = g + 8 * r
                token = i0 + row // G
                if token < query_len:
                    head = kv * G + row % G
                    qa[4 * s + r] = pair(q[first_row + token], head, d, scale_log2)
                    qa[4 * s + 2 + r] = pair(q[first_row + token], head, d + 2, scale_log2)
                else:
                    qa[4 * s + r] = uint32(0)
                    qa[4 * s + 2 + r] = uint32(0)

    def prefill_kernel(q, k_words, v_words, k_scales, v_scales, block_tables, context_lens, query_lens, scale_log2,
                       num_kv_heads, block_size, out):
        pdl.prologue()  # q and the cache write come from the kernels before: wait for them
        kv, seq = cuda.blockIdx.y, cuda.blockIdx.z
        query_block = cuda.gridDim.x - 1 - cuda.blockIdx.x  # the last queries (the longest walks) first
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        g, t = lane >> 2, lane & 3
        query_len = query_lens[seq]
        i0 = (query_block * WARPS + warp) * TOKENS
        if i0 >= query_len:  # no query of this sequence here (the whole warp leaves; no barrier follows)
            return
        first_row = 0  # q's row of the sequence's query 0
        for s in range(seq):
            first_row += query_lens[s]
        start = context_lens[seq] - query_len  # position of query 0
        end = start + min(i0 + TOKENS, query_len)  # keys loaded: up to the warp's last query's position
        limit = cuda.local.array(2, types.int64)  # rows g, g + 8: the last key each counts (-1: none)
        for r in range(2):
            token = i0 + (g + 8 * r) // G
            limit[r] = start + token if token < query_len else -1

        qa = cuda.local.array(QUERY_WORDS, uint32)
        query_registers(q, first_row, i0, query_len, kv, g, t, scale_log2, qa)
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        corr = cuda.local.array(2, float32)
        weights = cuda.local.array(8, uint32)
        acc = cuda.local.array(ACC_SIZE, float32)
        p = cuda.local.array(4, float32)
        scores = cuda.local.array(8, float32)
        for r in range(2):
            m[r] = float32(-np.inf)
            lsum[r] = float32(0)
            corr[r] = float32(1)
        for i in range(ACC_SIZE):
            acc[i] = float32(0)
        for i in range(8):
            weights[i] = uint32(0)
        kw = cuda.local.array(KEY_WORDS, uint32)
        vw = cuda.local.array(VALUE_WORDS, uint32)
        k_scale = cuda.local.array(4, float32)
        v_scale = cuda.local.array(4, float32)
        valid = cuda.local.array(4, types.int32)
        next_kw = cuda.local.array(KEY_WORDS, uint32)
        next_vw = cuda.local.array(VALUE_WORDS, uint32)
        next_k_scale = cuda.local.array(4, float32)
        next_v_scale = cuda.local.array(4, float32)
        next_valid = cuda.local.array(4, types.int32)

        table = block_tables[seq]
        rows_per_block, kv_row = num_kv_heads * block_size, kv * block_size
        tiles = (end + TILE - 1) // TILE
        lane_block = table_chunk(table, 0, end, block_size, 0, lane)
        if LOAD_AHEAD:
            load_tile(k_words, v_words, k_scales, v_scales,
                      tile_row(lane_block, 0, 0, block_size, rows_per_block, kv_row), 0, end, g, t, kw, vw, k_scale,
                      v_scale, valid)
        for tile in range(tiles):
            if LOAD_AHEAD:
                ahead = tile + 1
                if ahead < tiles:  # the next tile's loads go out before this tile's arithmetic
                    if ahead % WARP_SIZE == 0:
                        lane_block = table_chunk(table, 0, end, block_size, ahead, lane)
                    load_tile(k_words, v_words, k_scales, v_scales,
                              tile_row(lane_block, ahead, 0, block_size, rows_per_block, kv_row), TILE * ahead, end,
                              g, t, next_kw, next_vw, next_k_scale, next_v_scale, next_valid)
            else:  # this tile's loads, then its arithmetic
                if tile > 0 and tile % WARP_SIZE == 0:
                    lane_block = table_chunk(table, 0, end, block_size, tile, lane)
                load_tile(k_words, v_words, k_scales, v_scales,
                          tile_row(lane_block, tile, 0, block_size, rows_per_block, kv_row), TILE * tile, end, g, t,
                          kw, vw, k_scale, v_scale, valid)
            attend_tile(qa, kw, vw, k_scale, v_scale, valid, limit, TILE * tile, t, m, lsum, corr, p, scores, weights,
                        acc)
            if LOAD_AHEAD:
                for i in range(KEY_WORDS):
                    kw[i] = next_kw[i]
                for i in range(VALUE_WORDS):
                    vw[i] = next_vw[i]
                for u in range(4):
                    k_scale[u] = next_k_scale[u]
                    v_scale[u] = next_v_scale[u]
                    valid[u] = next_valid[u]

        for r in range(2):  # rows g, g + 8: l over the row's four lanes, then this lane's D / 4 elements
            l = lsum[r] + cuda.shfl_xor_sync(FULL_MASK, lsum[r], 1)
            l += cuda.shfl_xor_sync(FULL_MASK, l, 2)
            row = g + 8 * r
            token = i0 + row // G
            if token < query_len:
                head = kv * G + row % G
                for s in range(NTILES):
                    for e in range(2):
                        store(out, first_row + token, head, (D // 8) * (2 * t + e) + s,
                              normalized(acc[4 * s + 2 * r + e], l))

    return prefill_kernel


@functools.lru_cache(maxsize=None)
def _prefill_kernel(head_dim: int, group: int, bf16_out: bool = False, bf16_cache: bool = False):
    """The compiled prefill kernel of one variant, compiled once per process."""
    return cuda.jit(prefill_kernel_function(head_dim, group, bf16_out, bf16_cache))


def paged_prefill_mma(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale, out, k_scale=None,
                      v_scale=None, *, kv_format=None, max_context_len=None, stream=0):
    """Causal prefill attention of ``q`` over a paged FP8 or BF16 cache on tensor cores, into ``out``; returns ``out``.

    Arguments as ``fp8lab.numba_kernels.prefill.paged_prefill`` (and checked by its ``check_prefill``), without
    ``rows`` and ``workspace`` (this kernel needs neither); the cache must be one this kernel takes
    (``fp8lab.simulators.prefill_mma.supports``: FP8 or BF16, ``head_dim`` 128, a number of query heads per kv head
    that divides 16, a block size that is a multiple of 16), else a ``ValueError`` that says which. With device index
    arrays and ``max_context_len`` nothing is read back: the grid then covers ``len(q)`` query tokens per sequence
    (the CTAs past a sequence's queries return at once). ``q`` may end in padding rows past ``sum(query_lens)`` (the
    engine pads a prefill to a token bucket so that one CUDA graph serves every prompt length of the bucket): no
    sequence owns them, and their ``out`` rows are left as they were.
    """
    call = check_prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, out, k_scale, v_scale,
                         max_context_len, None, kv_format, padding_rows=True)
    k_cache, v_cache = as_kernel_array("k_cache", k_cache), as_kernel_array("v_cache", v_cache)
    num_tokens, num_heads, head_dim = call.q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if not supports(head_dim, group, call.block_size, call.kv_format.name, False):
        raise ValueError(f"k_cache: the tensor-core prefill attention takes an FP8 or a BF16 cache, head_dim in "
                         f"{HEAD_DIMS}, a number of query heads per kv head that divides {MAX_GROUP} and a block size "
                         f"that is a multiple of {TILE}; got {call.kv_format.name} ({k_cache.dtype}), head_dim "
                         f"{head_dim}, {group} heads per kv head, block size {call.block_size}")
    if call.block_tables.shape[0] > MAX_GRID_Z:
        raise ValueError(f"block_tables: at most {MAX_GRID_Z} sequences per call (the grid's z), got "
                         f"{call.block_tables.shape[0]}")
    if num_tokens == 0 or num_heads == 0:
        return out
    longest = int(to_host(call.query_lens).max(initial=0)) if call.host_indices else num_tokens
    fp8 = call.kv_format.scaled
    k_words, k_scales = flat_cache(k_cache, as_kernel_array("k_scale", k_scale) if fp8 else None)
    v_words, v_scales = flat_cache(v_cache, as_kernel_array("v_scale", v_scale) if fp8 else None)
    if not fp8:  # a BF16 cache: the kernel never reads its scale arguments
        k_scales, v_scales = placeholder(1), placeholder(1)
    arrays = (call.q, k_words, v_words, k_scales, v_scales, _as_int32(call.block_tables), _as_int32(call.context_lens),
              _as_int32(call.query_lens))
    device = [on_device(x, stream) for x in arrays]
    out_device = on_device(call.out, stream)
    grid = (max(1, -(-longest // tokens_per_cta(group))), num_kv_heads, call.block_tables.shape[0])
    kernel = _prefill_kernel(head_dim, group, np.dtype(call.out.dtype) == np.uint16, not fp8)
    pdl.launch(kernel, grid, THREADS, stream, *device, np.float32(float(softmax_scale) * LOG2E), num_kv_heads,
               call.block_size, out_device)
    if out_device is not call.out:  # a NumPy out on a GPU
        out_device.copy_to_host(call.out, stream=stream)
    return out


def kernel_variants():
    """``(name, python function, numba signature)`` of the variants the PTX check compiles: over an FP8 cache,
    Qwen3-8B's group of 4 with float32 out, Qwen3-0.6B's group of 2 with BF16 out and a group of 16 (one query token
    per warp); over a BF16 cache, groups of 4 and 2 (BF16 out)."""
    f32 = types.float32
    words = types.Array(types.uint32, 1, "C")
    f32_1d, f32_3d = types.Array(f32, 1, "C"), types.Array(f32, 3, "C")
    i32_1d = types.Array(types.int32, 1, "C")

    def signature(bf16_out: bool):
        out = types.Array(types.uint16 if bf16_out else f32, 3, "C")
        return types.void(f32_3d, words, words, f32_1d, f32_1d, types.Array(types.int32, 2, "C"), i32_1d, i32_1d, f32,
                          types.int64, types.int64, out)

    shapes = ((128, 4, False, False), (128, 2, True, False), (128, 16, False, False), (128, 4, False, True),
              (128, 2, True, True))
    return [(f"prefill_mma[head_dim={d}, group={g}{', out=bf16' if b else ''}{', cache=bf16' if c else ''}]",
             prefill_kernel_function(d, g, b, c), signature(b)) for d, g, b, c in shapes]
