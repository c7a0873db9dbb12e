"""Flash prefill attention over a paged FP8 or BF16 cache on tensor cores (``mma.m16n8k16``, F16 or BF16 in,
float32 out).

Computes ``fp8lab.reference.attention.prefill`` per sequence over ``fp8lab.reference.kv_cache.gather`` (FP8 or BF16
cache, head size 128, ``G`` query heads per kv head with ``G`` dividing 16, no ALiBi), with the arguments of
``fp8lab.numba_kernels.prefill.paged_prefill``. Launch: ``prefill_kernel`` grid ``(query blocks, num_kv_heads,
num_seqs)`` x 128 threads (4 warps), ``stage_layout``'s dynamic shared memory, one launch, no workspace. Checked
(``tests/numba_kernels/test_prefill_mma_kernel.py``): bit for bit against ``fp8lab.simulators.prefill_mma`` in the
CUDA simulator (whose ``mma`` twin is the model the simulator uses), against the oracle within the tensor-core
decode's error bound per query on a GPU; sm_90 PTX in ``tests/numba_kernels/test_kernels_compile.py``.

Why: ``prefill.paged_prefill`` decodes every query token over its whole prefix with the SIMT decode kernel, so a
prompt of ``T`` tokens reads about ``T^2 / 2`` K/V rows per kv head and multiplies them on CUDA cores. Here the rows
of an mma tile are ``16 / G`` query tokens times the ``G`` query heads of a kv head, and the 4 warps of a CTA (64
rows) share each K/V tile through shared memory.

The schedule is the simulator's (read ``fp8lab.simulators.prefill_mma`` first). Per CTA: query block ``gridDim.x - 1
- x`` (the longest walks start first) of sequence ``blockIdx.z``, kv head ``blockIdx.y``; warp ``w`` owns query
tokens ``i0 = (block * 4 + w) * 16 / G ..``. The CTA walks tiles of 64 keys (``KEYS``) up to its last query's
position through ``STAGES = 3`` stages of dynamic shared memory: warp ``w`` copies chunk ``w`` of a tile, its K
and V rows (16-byte ``cp.async`` pieces, L2 only; rows padded to 144 bytes so that a quarter-warp's 128-bit reads hit
distinct banks) and scales, two tiles ahead of the one the warps compute. Each 16-key chunk's block-table entry comes
by ``cp.async`` too, into a small ring in shared memory (``TABLE_RING_WORDS``), two tiles before the copies that need
it, so that no thread waits for a global load inside the walk. Per
tile a warp computes, per 16-key chunk before its own end, the tensor-core decode's lane layouts (a lane reads its
``D / 4`` key bytes of keys ``g``, ``8 + g`` and its ``D / 8`` value bytes of keys ``2t, 2t + 1, 8 + 2t, 9 + 2t``
with ``ld.shared.v4``; ``cvt.rn.f16x2.e4m3x2``; F16 ``mma``), then one online-softmax step per tile, ``acc``
rescaled, and ``P V`` chained through ``acc`` (flash attention's order). At the end each row's ``l`` is summed over
its four lanes and the lane stores its ``D / 4`` elements of rows ``g`` and ``g + 8``, ``acc * pow / l`` (0 where
``l = 0``), in float32 or BF16 bits: ``P V``'s n tile ``s`` holds head elements ``(D / 8) n + s``, so a lane's
column ``e`` of the 16 n tiles is 16 consecutive elements, stored 16 bytes at a time (``store_row``). The queries
come 16 bytes at a time too (a lane's k-step ``s`` is elements ``(D / 4) t + 4 s ..``). A NaN value (code or BF16
element) or V scale of a key after a query's position but before its warp's end reaches that query (the simulator's
docstring says why); the reference keeps it out.

**Two versions of a tile** (``tile_functions(masked)``): every tile before the warp's first query position, where
every key counts for every row, runs without a check per key; only the walk's last one or two tiles (the causal
diagonal, the warp's end, rows past the queries) run the checks: keys past the warp's end read as zero values and
zero V scales, after a row's position as ``-inf`` scores. The instructions a tile costs are what bound this kernel
(the twenty-fourth session's SASS counts and timings, ``bench/RESULTS.md``), so the unmasked tile is kept lean:
``prmt`` pairs the value codes of two keys (one instruction for two pairs), ``cvt.rn.f16x2.f32``
(``cvt.rn.bf16x2.f32``) packs two weights, ``max.NaN.f32`` is the NaN-propagating max (``bits``), ``exp2`` is the
bare ``ex2.approx.ftz.f32`` (``mathops.exp2_flush``: the subnormal path cost three instructions a weight), the
rescale of ``acc`` is skipped where every row's factor is 1 (one vote), a warp's copies of a tile are one address
plus constant offsets (``copy_chunk``), and the walk's indices are 32-bit (the SASS counts per tile before and after:
``bench/RESULTS.md``, twenty-ninth session).

**Over a BF16 cache** (``bf16_cache``): the same walk with rows of 272 bytes (104,448 bytes of shared memory, over
the 48 KiB default: ``gemm_mma._allow_shared_memory``), the key words as the B registers as they are, a value
register one halfword of two keys' words (``half_pair``), BF16 queries, weights and ``mma``; no scales.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, types, uint32

from fp8lab.simulators.prefill_mma import (
    CHUNKS,
    KEYS,
    supports,
    tokens_per_warp,
)
from fp8lab.simulators.splitkv_mma import HEAD_DIMS, LOG2E, MAX_GROUP, TILE, WARPS

from . import mathops, pdl
from .arguments import as_kernel_array, require_c_contiguous, require_load_alignment
from .bits import (
    e4m3x2_high_to_f16x2,
    e4m3x2_to_f16x2,
    f32_as_u32,
    f32x2_to_bf16x2,
    f32x2_to_f16x2,
    max_nan,
    prmt,
)
from .cp_async import (
    commit_group,
    copy_4_ca,
    strided_copy_function,
    wait_group_function,
)
from .gemm_mma import _allow_shared_memory
from .gemv_simt import unrolled
from .kv_cache import on_device, placeholder, to_host
from .mathops import divide_by_reciprocal, divide_u32, reciprocal_u32
from .mma import mma_bf16_inline as mma_bf16
from .mma import mma_f16_inline as mma_f16
from .prefill import check_prefill
from .splitkv import _as_int32, flat_cache, normalized
from .splitkv_mma import f16_pair, power_of_two_below
from .warp import FULL_MASK, WARP_SIZE, load_f32x4, load_shared_u32x4, store_u32x4

THREADS = WARPS * WARP_SIZE
MAX_GRID_Z = 65535
"""The grid's z extent at most: the sequences of one call."""
MAX_CACHE_WORDS = 2**32
"""The kernel indexes a cache as uint32 words with 32-bit indices: fewer than this many words (16 GiB)."""
HEAD_DIM = 128
STAGES = 3
"""Shared-memory stages: the copies of the next two tiles land while the warps compute the current one."""
ROW_PADDING_WORDS = 4
"""16 bytes after each K/V row in shared memory (rows of 144 bytes for FP8 codes): the 8 lanes of a 128-bit read's
quarter-warp then read 8 distinct 16-byte bank groups, for the key reads (rows ``g``, bytes ``32 t ..``) and the value
reads (rows ``2 t``, bytes ``16 g ..``) alike."""
TABLE_RING_WORDS = STAGES * CHUNKS
"""The block-table entries of the tiles whose copies go out next, one slot of ``CHUNKS`` words per tile (slot
``tile % STAGES``): each lands by ``cp.async`` two tiles before that tile's copies read it, so no thread waits for a
global load of the table inside the walk (``bench/RESULTS.md``, twenty-seventh session: that wait was the kernel's
largest single stall)."""
LOW_BYTES_OF_TWO, HIGH_BYTES_OF_TWO = 0x5140, 0x7362
"""``prmt`` selectors: bytes 0, 1 (``LOW``) or 2, 3 (``HIGH``) of two words interleaved, ``a0 b0 a1 b1``: two pairs of
codes of two keys at two head elements, each pair one conversion's input."""


@cuda.jit(device=True, inline=True)
def half_pair(first, second, k):
    """Halfword ``k`` of ``first`` (low half) and of ``second`` (high half): two BF16 patterns for one register."""
    if k == 0:
        return (first & uint32(0xFFFF)) | (second << uint32(16))
    return (first >> uint32(16)) | (second & uint32(0xFFFF0000))


@cuda.jit(device=True, inline=True)
def bf16_pair(low, high, scale_log2):
    """``splitkv_mma.f16_pair`` in BF16 (round to nearest even): a query register over a BF16 cache."""
    return (mathops.f32_to_bf16_bits_rne(low * scale_log2)
            | (mathops.f32_to_bf16_bits_rne(high * scale_log2) << uint32(16)))


def stage_layout(bf16_cache: bool) -> tuple[int, int, int]:
    """``(row_words, stage_words, shared_bytes)`` of the kernel's shared memory: a K/V tile's row of ``D`` elements
    padded by 16 bytes (``ROW_PADDING_WORDS``), a stage = ``KEYS`` K rows, ``KEYS`` V rows and (FP8) the ``KEYS`` K and
    V scales, ``STAGES`` stages, then ``STAGES`` slots of a tile's ``CHUNKS`` block-table entries
    (``TABLE_RING_WORDS``)."""
    row_words = HEAD_DIM * (2 if bf16_cache else 1) // 4 + ROW_PADDING_WORDS
    stage_words = 2 * KEYS * row_words + (0 if bf16_cache else 2 * KEYS)
    return row_words, stage_words, (STAGES * stage_words + TABLE_RING_WORDS) * 4


def softmax_row_function(masked: bool, fp8: bool, score_index):
    """``softmax_row(r, scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights)``: one tile's online-softmax
    step of row ``g + 8 r`` of a warp, the flash prefill's (``prefill_mma`` and ``prefill_wgmma``). The scores
    (``-inf`` where the key does not count: past the warp's ``end`` or after the row's position; checked only where
    ``masked``), the row max, ``corr``, ``p``, this lane's ``l`` (chunk sums, then ``(c_0 + c_1) + (c_2 + c_3)``); the
    weights ``p * (v_scale * inv)`` (``vsi``) as F16 pairs (``fp8``; else ``p`` as BF16 pairs) into ``weights[4 c +
    r]`` (keys ``2t, 2t + 1``) and ``weights[4 c + 2 + r]`` (``8 + 2t, 9 + 2t``). ``score_index(c, r, u)``: where the
    kernel keeps the score of chunk ``c``'s key ``2t + (u & 1) + 8 (u >> 1)`` for row ``g + 8 r``."""

    @cuda.jit(device=True, inline=True)
    def softmax_row(r, scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights):
        p = cuda.local.array(4, float32)
        chunk_sums = cuda.local.array(CHUNKS, float32)
        tile_max = float32(-math.inf)
        for c in range(CHUNKS):
            for u in range(4):
                i = score_index(c, r, u)
                if masked:
                    key = tile0 + TILE * c + 2 * t + (u & 1) + 8 * (u >> 1)
                    if not (key < warp_end and key <= limit[r]):
                        scores[i] = float32(-math.inf)
                tile_max = max_nan(tile_max, scores[i])
        row_max = max_nan(tile_max, cuda.shfl_xor_sync(FULL_MASK, tile_max, 1))  # over the row's 4 lanes
        row_max = max_nan(row_max, cuda.shfl_xor_sync(FULL_MASK, row_max, 2))
        m_new = max_nan(m[r], row_max)
        corr[r] = float32(1) if m_new == m[r] else mathops.exp2_flush(m[r] - m_new)
        for c in range(CHUNKS):
            for u in range(4):
                if masked:
                    key = tile0 + TILE * c + 2 * t + (u & 1) + 8 * (u >> 1)
                    counts = key < warp_end and key <= limit[r]
                    # selects, not branches (a branch around exp2 costs registers); no -inf - -inf computed
                    difference = scores[score_index(c, r, u)] - m_new if counts else float32(0)
                    p_u = mathops.exp2_flush(difference)
                    p[u] = p_u if counts else float32(0)
                else:
                    p[u] = mathops.exp2_flush(scores[score_index(c, r, u)] - m_new)
            # the A registers of chunk c's P V: (row g, keys 2t, 2t + 1), (g + 8, ...), (g, 8 + 2t, 9 + 2t), ...
            if fp8:
                weights[4 * c + r] = f32x2_to_f16x2(p[0] * vsi[4 * c], p[1] * vsi[4 * c + 1])
                weights[4 * c + 2 + r] = f32x2_to_f16x2(p[2] * vsi[4 * c + 2], p[3] * vsi[4 * c + 3])
            else:
                weights[4 * c + r] = f32x2_to_bf16x2(p[0], p[1])
                weights[4 * c + 2 + r] = f32x2_to_bf16x2(p[2], p[3])
            chunk_sums[c] = (p[0] + p[1]) + (p[2] + p[3])
        lsum[r] = cuda.fma(lsum[r], corr[r], (chunk_sums[0] + chunk_sums[1]) + (chunk_sums[2] + chunk_sums[3]))
        m[r] = m_new

    return softmax_row


@cuda.jit(device=True, inline=True)
def first_query_row(query_lens, seq):
    """``q``'s row of sequence ``seq``'s query 0: the queries of the sequences before it."""
    first_row = 0
    for s in range(seq):
        first_row += query_lens[s]
    return first_row


@cuda.jit(device=True, inline=True)
def start_state(m, lsum, corr, v_max, pow_, acc):
    """A warp's state before its walk: no max (``-inf``), sums 0, factors 1, no V scale (power 1), ``acc`` 0."""
    for r in range(2):
        m[r] = float32(-math.inf)
        lsum[r] = float32(0)
        corr[r] = float32(1)
    v_max[0], pow_[0] = float32(0), float32(1)
    for i in range(acc.shape[0]):
        acc[i] = float32(0)


@cuda.jit(device=True, inline=True)
def warp_score_index(c, r, u):
    """``prefill_mma``'s scores: ``8 c + 4 r + u`` (chunk ``c``'s two n tiles, row ``g + 8 r``)."""
    return 8 * c + 4 * r + u


def walk_functions(group: int, bf16_cache: bool, warps: int = WARPS):
    """The device functions a flash-prefill CTA walks its keys with, for ``group`` query heads per kv head and the cache
    format (head size ``HEAD_DIM``, the shared-memory layout of ``stage_layout``): ``(query_registers, row_limits,
    start_walk, copy_next_tile)``. The queries as the scores' A registers, each row's last key, and the copies of the
    walk's tiles (a warp's ``cp.async`` copies of one 16-key chunk, its cache row from the block table, or from the
    ring of its entries in shared memory): ``prefill_kernel_function``'s walk; ``fp8lab.numba_kernels.prefill_wgmma``
    walks the same way. ``warps``: the CTA's (a multiple of ``CHUNKS``); warps ``0 .. CHUNKS - 1`` copy, each one
    chunk of a tile."""
    D, G = HEAD_DIM, group
    STEPS = D // 16  # k-steps of the scores
    FP8 = not bf16_cache
    ROW_WORDS = D * (2 if bf16_cache else 1) // 4  # a cache row in global memory
    PIECES = ROW_WORDS // 4  # 16-byte copies per row
    ROWS_PER_PASS = WARP_SIZE // PIECES  # rows a warp copies at once
    COPIES = TILE // ROWS_PER_PASS  # per thread per tile, K and V each (a warp copies one chunk)
    SROW, STAGE_WORDS, _ = stage_layout(bf16_cache)
    V_OFFSET, SCALE_OFFSET = KEYS * SROW, 2 * KEYS * SROW
    TABLE_OFFSET = STAGES * STAGE_WORDS  # the ring of block-table entries
    pair = bf16_pair if bf16_cache else f16_pair
    assert warps % CHUNKS == 0 and TILE % ROWS_PER_PASS == 0, "copy_chunk: a warp copies one 16-key chunk of a tile"
    EVERY_WARP_COPIES = warps == CHUNKS
    assert STAGES == 3, "the walk's ring slots: tile + 2 (STAGES - 1) has the slot of tile + 1 only for 3 stages"

    @cuda.jit(device=True, inline=True)
    def query_registers(q, first_row, i0, query_len, kv, g, t, scale_log2, qa):
        """The A registers of the scores: row ``g + 8 r`` is query token ``i0 + (g + 8 r) // G`` (``q``'s row
        ``first_row`` + that) and head ``kv G + (g + 8 r) % G``, as F16 (BF16) pairs of ``q * scale_log2``; 0 past
        the sequence's queries. A lane's elements of k-step ``s`` are the four ``D / 4 t + 4 s ..``: one 128-bit
        load. A row past the queries loads the sequence's last query and keeps 0, so that no branch stands between
        a row's loads (a branch per row and step serialized them: ``bench/RESULTS.md``, twenty-seventh session)."""
        for r in range(2):
            row = g + 8 * r
            token = i0 + row // G
            is_query = token < query_len
            q_row = first_row + min(token, query_len - 1)
            head = kv * G + row % G
            for s in range(STEPS):
                x = load_f32x4(q, (q_row, head, (D // 4) * t + 4 * s))
                qa[4 * s + r] = pair(x[0], x[1], scale_log2) if is_query else uint32(0)
                qa[4 * s + 2 + r] = pair(x[2], x[3], scale_log2) if is_query else uint32(0)

    @cuda.jit(device=True, inline=True)
    def chunk_block(chunk, walk):
        """``(chunk, block index)`` of 16-key chunk ``chunk`` clamped to the CTA's last chunk (``chunk_row``)."""
        last_chunk, chunks_per_block, block_divider, rows_per_block, kv_row = walk
        chunk = uint32(min(chunk, last_chunk))
        return chunk, divide_by_reciprocal(chunk, block_divider)

    @cuda.jit(device=True, inline=True)
    def row_of_entry(entry, chunk, block_index, walk):
        """The cache row of the first key of chunk ``chunk`` (clamped, and its block index: ``chunk_block``) whose
        block-table entry is ``entry``."""
        last_chunk, chunks_per_block, block_divider, rows_per_block, kv_row = walk
        slot = uint32((chunk - block_index * chunks_per_block) * uint32(TILE))
        return uint32(uint32(entry) * rows_per_block + kv_row + slot)

    @cuda.jit(device=True, inline=True)
    def chunk_row(table, chunk, walk):
        """The cache row of the first key of 16-key chunk ``chunk`` (one KV block holds a chunk), clamped to the
        CTA's last chunk: a chunk past the CTA's keys copies rows that no warp reads (``attend_tile`` masks them),
        and the block table is never read past the sequence. ``walk``: ``(last_chunk, chunks_per_block,
        block_divider, rows_per_block, kv_row)``, unsigned 32-bit (``block_divider``: ``mathops.reciprocal_u32``
        of ``chunks_per_block``, 64-bit). ``chunk // chunks_per_block`` is ``mathops.divide_by_reciprocal`` (exact
        while ``chunk * chunks_per_block < 2^32``): a division is a subroutine."""
        chunk, block_index = chunk_block(chunk, walk)
        return row_of_entry(table[block_index], chunk, block_index, walk)

    @cuda.jit(device=True, inline=True)
    def ring_word(slot, c):
        """The shared-memory word of chunk ``c``'s block-table entry in ring slot ``slot`` (a tile's is ``tile %
        STAGES``, its stage: the walk passes the stage it tracks, no remainder is computed)."""
        return uint32(uint32(TABLE_OFFSET) + slot * uint32(CHUNKS) + c)

    @cuda.jit(device=True, inline=True)
    def fetch_entries(smem, block_tables, seq, tile, slot, walk, thread):
        """Threads ``0 .. CHUNKS - 1``: ``cp.async`` the block-table entry of chunk ``thread`` of tile ``tile`` into
        ring slot ``slot`` (the tile's, ``tile % STAGES``; in the thread's current copy group)."""
        if thread < uint32(CHUNKS):
            block_index = chunk_block(uint32(tile * uint32(CHUNKS) + thread), walk)[1]
            copy_4_ca(smem, ring_word(slot, thread), block_tables, seq, block_index, uint32(4))

    @cuda.jit(device=True, inline=True)
    def ring_row(smem, tile, slot, walk, c):
        """The cache row of chunk ``c``'s first key in tile ``tile``, from the entry ``fetch_entries`` landed in ring
        slot ``slot``."""
        chunk, block_index = chunk_block(uint32(tile * uint32(CHUNKS) + c), walk)
        return row_of_entry(smem[ring_word(slot, c)], chunk, block_index, walk)

    copy_rows = strided_copy_function("cg", 16, COPIES, ROWS_PER_PASS * SROW, ROWS_PER_PASS * ROW_WORDS)
    copy_scale = strided_copy_function("ca", 4, 1, 0, 0)

    @cuda.jit(device=True, inline=True)
    def copy_chunk(smem, smemf, k_words, v_words, k_scales, v_scales, first, stage_base, warp, lane):
        """Issue this lane's ``cp.async`` copies of chunk ``warp`` of a tile (its first key is cache row ``first``)
        into the stage at word ``stage_base``: 16-byte pieces ``j 32 + lane`` of the chunk's K and V rows, and
        (FP8) lanes ``0 .. 15`` one K scale, ``16 .. 31`` one V scale. Each warp copies one chunk, so that a thread
        computes one chunk's row a tile, and its copies of K (of V) are one address plus constant offsets
        (``strided_copy_function``). The rows of keys past the CTA's end are copied too (rows of the last chunk's
        block, or of the last chunk): no warp reads them. All arguments unsigned 32-bit (Numba widens unsigned
        arithmetic to 64 bits; each result is cast back, so that the compiler keeps 32)."""
        row, piece = lane // uint32(PIECES), lane % uint32(PIECES)  # of the lane's first copy
        element = uint32((first + row) * uint32(ROW_WORDS) + uint32(4) * piece)
        index = uint32(stage_base + (uint32(TILE) * warp + row) * uint32(SROW) + uint32(4) * piece)
        copy_rows(smem, index, k_words, element)
        copy_rows(smem, uint32(index + uint32(V_OFFSET)), v_words, element)
        if FP8:
            key = lane % uint32(TILE)
            v_scale_lane = lane >= uint32(TILE)  # lanes 16 .. 31: the V scales
            index = uint32(stage_base + uint32(SCALE_OFFSET) + (uint32(KEYS) if v_scale_lane else uint32(0))
                           + uint32(TILE) * warp + key)
            copy_scale(smemf, index, v_scales if v_scale_lane else k_scales, uint32(first + key))

    @cuda.jit(device=True, inline=True)
    def row_limits(i0, g, start, query_len, limit):
        """``limit[r]``: the last key that row ``g + 8 r`` of the warp whose first query is ``i0`` counts (its
        position; -1 for a row past the queries)."""
        for r in range(2):
            token = i0 + (g + 8 * r) // G
            limit[r] = start + token if token < query_len else -1

    @cuda.jit(device=True, inline=True)
    def start_walk(smem, smemf, k_words, v_words, k_scales, v_scales, block_tables, seq, kv, cta_end, num_kv_heads,
                   block_size, thread):
        """The walk's constants for a CTA whose keys end at ``cta_end`` (``(walk, tiles)``: ``chunk_row``'s tuple, the
        number of 64-key tiles), after issuing the prologue's copies: tiles ``0 .. STAGES - 2`` and the block-table
        entries of the next ones, a copy group each (these lookups wait for the table; the walk's come from the
        ring)."""
        table = block_tables[seq]
        chunks_per_block = divide_u32(uint32(block_size), uint32(TILE))
        walk = (divide_u32(cta_end - uint32(1), uint32(TILE)), chunks_per_block,
                reciprocal_u32(chunks_per_block),
                uint32(num_kv_heads) * uint32(block_size), uint32(kv) * uint32(block_size))
        copy_thread = uint32(thread)
        copy_warp, copy_lane = copy_thread // uint32(WARP_SIZE), copy_thread % uint32(WARP_SIZE)
        tiles = divide_u32(cta_end + uint32(KEYS - 1), uint32(KEYS))
        for ahead in range(STAGES - 1):
            if uint32(ahead) < tiles and (EVERY_WARP_COPIES or copy_warp < uint32(CHUNKS)):
                first = chunk_row(table, uint32(ahead * CHUNKS) + copy_warp, walk)
                copy_chunk(smem, smemf, k_words, v_words, k_scales, v_scales, first, uint32(ahead * STAGE_WORDS),
                           copy_warp, copy_lane)
            if uint32(ahead + STAGES - 1) < tiles:
                fetch_entries(smem, block_tables, seq, uint32(ahead + STAGES - 1),
                              uint32((ahead + STAGES - 1) % STAGES), walk, copy_thread)
            commit_group()
        return walk, tiles

    @cuda.jit(device=True, inline=True)
    def copy_next_tile(smem, smemf, k_words, v_words, k_scales, v_scales, block_tables, seq, walk, tiles, tile, stage,
                       next_stage, thread):
        """A tile's copies, after its barrier: tile ``tile + STAGES - 1`` into the stage of ``tile - 1`` (done with
        by every warp), from the entries that landed with ``tile``'s group, and the entries of the tile ``STAGES -
        1`` after that into slot ``next_stage``; then the commit (an empty group past the end)."""
        copy_thread = uint32(thread)
        copy_warp, copy_lane = copy_thread // uint32(WARP_SIZE), copy_thread % uint32(WARP_SIZE)
        ahead = uint32(tile + uint32(STAGES - 1))
        if ahead < tiles and (EVERY_WARP_COPIES or copy_warp < uint32(CHUNKS)):  # before this tile's arithmetic
            ahead_stage = uint32(stage - uint32(1)) if stage > uint32(0) else uint32(STAGES - 1)  # tile - 1's
            first = ring_row(smem, ahead, ahead_stage, walk, copy_warp)  # its entries landed with tile's group
            copy_chunk(smem, smemf, k_words, v_words, k_scales, v_scales, first,
                       uint32(ahead_stage * uint32(STAGE_WORDS)), copy_warp, copy_lane)
            if uint32(ahead + uint32(STAGES - 1)) < tiles:  # read in STAGES - 1 tiles, after this group lands
                fetch_entries(smem, block_tables, seq, uint32(ahead + uint32(STAGES - 1)), next_stage, walk,
                              copy_thread)
        commit_group()

    return query_registers, row_limits, start_walk, copy_next_tile


def prefill_kernel_function(head_dim: int, group: int, bf16_out: bool = False, bf16_cache: bool = False):
    """The Python source of the prefill kernel for one head size, query heads per kv head, output format and cache
    format (E4M3 codes, or ``bf16_cache``: BF16 patterns).

    Arguments: ``q, k_words, v_words, k_scales, v_scales, block_tables, context_lens, query_lens, scale_log2,
    num_kv_heads, block_size, out``: the caches flat as uint32 words (``splitkv.flat_cache``) and their scales
    flat (placeholders for a BF16 cache, never read). Launch ``[(query_blocks, num_kv_heads, num_seqs),
    THREADS]`` with ``stage_layout(bf16_cache)[2]`` bytes of dynamic shared memory and ``query_blocks *
    tokens_per_cta(group)`` at least the longest ``query_lens`` (a CTA past its sequence's queries returns at once).
    """
    D, G = head_dim, group
    if D != HEAD_DIM:
        raise ValueError(f"head_dim: the flash prefill kernel compiles for {HEAD_DIM}, got {D}")
    TOKENS = tokens_per_warp(G)
    STEPS = D // 16  # k-steps of the scores
    NTILES = D // 8  # n tiles of P V
    QUERY_WORDS, ACC_SIZE = 4 * STEPS, 4 * NTILES
    TILE_SCORES = 8 * CHUNKS  # a lane's scores of a tile: 4 per row and chunk
    TILE_WEIGHT_WORDS = 4 * CHUNKS  # its weights, two per word: the A registers of the chunks' P V
    LANE_KEYS = 4 * CHUNKS  # the keys of a lane's scores in a tile (4 per chunk): its V scales times inv
    FP8 = not bf16_cache
    ROW_WORDS = D * (2 if bf16_cache else 1) // 4  # a cache row in global memory
    SROW, STAGE_WORDS, _ = stage_layout(bf16_cache)
    V_OFFSET, SCALE_OFFSET = KEYS * SROW, 2 * KEYS * SROW
    K_WORDS = ROW_WORDS // 4  # a lane's words of a key row: D / 4 elements
    V_WORDS = ROW_WORDS // 8  # a lane's words of a value row: D / 8 elements
    wait_for_tile = wait_group_function(STAGES - 2)

    query_registers, row_limits, start_walk, copy_next_tile = walk_functions(G, bf16_cache)

    ELEMENTS_PER_WORD = 2 if bf16_out else 1

    @cuda.jit(device=True, inline=True)
    def output_word(acc, s, r, e, power, l):
        """The word of ``out`` that holds the element of ``acc[4 s + 2 r + e]``, ``acc * power / l`` (0 where ``l =
        0``): its float32 bits, or (BF16 out) the BF16 patterns of it (low half) and of n tile ``s + 1``'s (high)."""
        if bf16_out:
            low = mathops.f32_to_bf16_bits_rne(normalized(acc[4 * s + 2 * r + e] * power, l))
            high = mathops.f32_to_bf16_bits_rne(normalized(acc[4 * (s + 1) + 2 * r + e] * power, l))
            return low | (high << uint32(16))
        return f32_as_u32(normalized(acc[4 * s + 2 * r + e] * power, l))

    @cuda.jit(device=True, inline=True)
    def store_row(out, out_row, head, t, r, acc, power, l):
        """Store this lane's ``D / 4`` outputs of row ``g + 8 r`` (``out[out_row, head]``): for each of its two
        columns ``e`` of the ``P V`` n tiles, the 16 consecutive head elements ``(D / 8)(2 t + e) + s``, ``s = 0 ..
        15``, in 128-bit stores of four words (four of float32, two of BF16) instead of 16 scalar ones."""
        for e in range(2):
            first = (D // 8) * (2 * t + e)
            for store in range(NTILES // (4 * ELEMENTS_PER_WORD)):
                s = 4 * ELEMENTS_PER_WORD * store
                w = cuda.local.array(4, uint32)
                for i in range(4):
                    w[i] = output_word(acc, s + ELEMENTS_PER_WORD * i, r, e, power, l)
                store_u32x4(out, (out_row, head, first + s), w[0], w[1], w[2], w[3])

    def tile_functions(masked: bool):
        """The device functions of one tile for the warp, ``masked``: with the per-key checks of the walk's last tiles
        (keys past the warp's end, the causal mask per row, rows past the queries), or without (every key of the tile
        counts for every row: the tiles before the warp's first query)."""

        @cuda.jit(device=True, inline=True)
        def chunk_scores(c, args):
            """Chunk ``c``'s scores (keys ``16 c ..`` of the tile; two 8-key n tiles, ``D / 16`` chained k-steps each)
            times their K scales, into ``scores[8 c ..]``: ``8 c + 4 r + u`` is row ``g + 8 r``, key ``2t + (u & 1) + 8
            (u >> 1)`` of the chunk. The lane's B registers are words of its ``D / 4`` elements of key row ``g`` (and
            ``8 + g``). A chunk wholly past the warp's end is not computed (its scores are masked)."""
            smem, smemf, kbase, qa, chunks, g, t, scores = args
            if not masked or c < chunks:
                for half in range(2):
                    first = kbase + (TILE * c + 8 * half + g) * SROW + K_WORDS * t
                    c0 = c1 = c2 = c3 = float32(0)
                    for quad in range(K_WORDS // 4):
                        w = load_shared_u32x4(smem, first + 4 * quad)
                        for i in range(4):
                            if FP8:  # one word: k-step 4 quad + i, two conversions
                                s = 4 * quad + i
                                b0 = e4m3x2_to_f16x2(w[i] & uint32(0xFFFF))
                                b1 = e4m3x2_high_to_f16x2(w[i])
                                c0, c1, c2, c3 = mma_f16(qa[4 * s], qa[4 * s + 1], qa[4 * s + 2], qa[4 * s + 3], b0,
                                                         b1, c0, c1, c2, c3)
                            elif i % 2 == 0:  # two words: k-step (4 quad + i) / 2, the B registers as they are
                                s = (4 * quad + i) // 2
                                c0, c1, c2, c3 = mma_bf16(qa[4 * s], qa[4 * s + 1], qa[4 * s + 2], qa[4 * s + 3],
                                                          w[i], w[i + 1], c0, c1, c2, c3)
                    if FP8:  # the K scales of keys 2t, 2t + 1 (this n tile's columns of the lane)
                        ks0 = smemf[kbase + SCALE_OFFSET + TILE * c + 8 * half + 2 * t]
                        ks1 = smemf[kbase + SCALE_OFFSET + TILE * c + 8 * half + 2 * t + 1]
                        c0, c1, c2, c3 = c0 * ks0, c1 * ks1, c2 * ks0, c3 * ks1
                    scores[8 * c + 2 * half] = c0
                    scores[8 * c + 2 * half + 1] = c1
                    scores[8 * c + 4 + 2 * half] = c2
                    scores[8 * c + 4 + 2 * half + 1] = c3

        softmax_step = softmax_row_function(masked, FP8, warp_score_index)

        @cuda.jit(device=True, inline=True)
        def softmax_row(r, args):
            """``softmax_row_function``'s step of row ``g + 8 r`` (``args`` as ``unrolled`` passes them)."""
            scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights = args
            softmax_step(r, scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights)

        @cuda.jit(device=True, inline=True)
        def chunk_values(c, args):
            """Chunk ``c``'s ``P V``: the weights of its 16 keys (A) times their values (B: pairs of consecutive keys
            at one head element), one mma per n tile ``s`` (head elements ``(D/8) n + s``) into ``acc[4 s ..]``. The
            lane's value words are its ``D / 8`` elements of keys ``2t, 2t + 1, 8 + 2t, 9 + 2t``, zeroed for keys past
            the warp's ``end`` (masked tiles); a chunk wholly past it is skipped."""
            smem, vbase, weights, chunks, tile0, warp_end, g, t, acc = args
            if not masked or c < chunks:
                pa0, pa1, pa2, pa3 = weights[4 * c], weights[4 * c + 1], weights[4 * c + 2], weights[4 * c + 3]
                for quad in range(V_WORDS // 4):  # 16 n tiles (FP8) or 8 (BF16) per quad of value words
                    rows = (TILE * c + 2 * t, TILE * c + 2 * t + 1, TILE * c + 8 + 2 * t, TILE * c + 9 + 2 * t)
                    w0 = load_shared_u32x4(smem, vbase + rows[0] * SROW + V_WORDS * g + 4 * quad)
                    w1 = load_shared_u32x4(smem, vbase + rows[1] * SROW + V_WORDS * g + 4 * quad)
                    w2 = load_shared_u32x4(smem, vbase + rows[2] * SROW + V_WORDS * g + 4 * quad)
                    w3 = load_shared_u32x4(smem, vbase + rows[3] * SROW + V_WORDS * g + 4 * quad)
                    if masked:  # keys past the warp's end: zero values, as the model reads them
                        if tile0 + rows[0] >= warp_end:
                            w0 = (uint32(0), uint32(0), uint32(0), uint32(0))
                        if tile0 + rows[1] >= warp_end:
                            w1 = (uint32(0), uint32(0), uint32(0), uint32(0))
                        if tile0 + rows[2] >= warp_end:
                            w2 = (uint32(0), uint32(0), uint32(0), uint32(0))
                        if tile0 + rows[3] >= warp_end:
                            w3 = (uint32(0), uint32(0), uint32(0), uint32(0))
                    for i in range(4):
                        if FP8:  # word i: head elements 4 i .. 4 i + 3 of the lane's 16, n tiles s = 4 (4 quad + i) + k
                            pairs01 = (prmt(w0[i], w1[i], LOW_BYTES_OF_TWO), prmt(w0[i], w1[i], HIGH_BYTES_OF_TWO))
                            pairs23 = (prmt(w2[i], w3[i], LOW_BYTES_OF_TWO), prmt(w2[i], w3[i], HIGH_BYTES_OF_TWO))
                            for k in range(4):
                                s = 4 * (4 * quad + i) + k
                                if k % 2 == 0:
                                    b0 = e4m3x2_to_f16x2(pairs01[k // 2])  # keys 2t, 2t + 1
                                    b1 = e4m3x2_to_f16x2(pairs23[k // 2])  # keys 8 + 2t, 9 + 2t
                                else:
                                    b0 = e4m3x2_high_to_f16x2(pairs01[k // 2])
                                    b1 = e4m3x2_high_to_f16x2(pairs23[k // 2])
                                acc[4 * s], acc[4 * s + 1], acc[4 * s + 2], acc[4 * s + 3] = mma_f16(
                                    pa0, pa1, pa2, pa3, b0, b1, acc[4 * s], acc[4 * s + 1], acc[4 * s + 2],
                                    acc[4 * s + 3])
                        else:
                            for k in range(2):
                                s = 2 * (4 * quad + i) + k
                                b0 = half_pair(w0[i], w1[i], k)
                                b1 = half_pair(w2[i], w3[i], k)
                                acc[4 * s], acc[4 * s + 1], acc[4 * s + 2], acc[4 * s + 3] = mma_bf16(
                                    pa0, pa1, pa2, pa3, b0, b1, acc[4 * s], acc[4 * s + 1], acc[4 * s + 2],
                                    acc[4 * s + 3])

        all_chunk_scores = unrolled(chunk_scores, CHUNKS)  # straight-line code: the arrays stay in registers
        both_softmax_rows = unrolled(softmax_row, 2)
        all_chunk_values = unrolled(chunk_values, CHUNKS)

        @cuda.jit(device=True, inline=True)
        def attend_tile(smem, smemf, kbase, tile0, warp_end, limit, qa, g, t, v_max, pow_, m, lsum, corr, scores,
                        vsi, weights, acc):
            """The warp's share of one tile in shared memory (stage at word ``kbase``): the scores of its chunks
            before ``warp_end``, the online softmax of both rows, ``acc`` rescaled to the running V-scale power
            (``fp8lab.simulators.prefill_mma``), then ``P V`` chained into ``acc``."""
            chunks = min(CHUNKS, (warp_end - tile0 + TILE - 1) // TILE) if masked else CHUNKS
            all_chunk_scores((smem, smemf, kbase, qa, chunks, g, t, scores))
            inv, ratio = float32(1), float32(1)
            if FP8:  # the largest V scale the warp has loaded, over the row's 4 lanes; acc's unit follows its power
                tile_vmax = float32(0)
                for c in range(CHUNKS):
                    for u in range(4):
                        j = TILE * c + 2 * t + (u & 1) + 8 * (u >> 1)
                        v_scale = smemf[kbase + SCALE_OFFSET + KEYS + j]
                        if masked and tile0 + j >= warp_end:
                            v_scale = float32(0)  # a key past the warp's end: the model's "not loaded"
                        vsi[4 * c + u] = v_scale
                        tile_vmax = max_nan(tile_vmax, v_scale)
                tile_vmax = max_nan(tile_vmax, cuda.shfl_xor_sync(FULL_MASK, tile_vmax, 1))
                tile_vmax = max_nan(tile_vmax, cuda.shfl_xor_sync(FULL_MASK, tile_vmax, 2))
                v_max[0] = max_nan(v_max[0], tile_vmax)
                new_pow, inv = power_of_two_below(v_max[0])
                ratio = pow_[0] * inv
                pow_[0] = new_pow
                for i in range(LANE_KEYS):
                    vsi[i] = vsi[i] * inv
            both_softmax_rows((scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights))
            rescale0 = corr[0] * ratio if FP8 else corr[0]  # a BF16 cache: ratio is 1
            rescale1 = corr[1] * ratio if FP8 else corr[1]
            # x * 1 is x (a NaN stays NaN): where no row of the warp changes its max or power, the 64 products are
            # skipped, bit for bit the same acc (once a row's max is found early, as an attention sink's is, the
            # usual case)
            if not cuda.all_sync(FULL_MASK, rescale0 == float32(1) and rescale1 == float32(1)):
                for s in range(NTILES):
                    acc[4 * s] *= rescale0
                    acc[4 * s + 1] *= rescale0
                    acc[4 * s + 2] *= rescale1
                    acc[4 * s + 3] *= rescale1
            all_chunk_values((smem, kbase + V_OFFSET, weights, chunks, tile0, warp_end, g, t, acc))

        return attend_tile

    attend_full_tile = tile_functions(masked=False)
    attend_masked_tile = tile_functions(masked=True)

    def prefill_kernel(q, k_words, v_words, k_scales, v_scales, block_tables, context_lens, query_lens, scale_log2,
                       num_kv_heads, block_size, out):
        pdl.prologue()  # q and the cache write come from the kernels before: wait for them
        kv, seq = cuda.blockIdx.y, cuda.blockIdx.z
        query_block = cuda.gridDim.x - 1 - cuda.blockIdx.x  # the last queries (the longest walks) first
        thread = cuda.threadIdx.x
        warp, lane = thread // WARP_SIZE, thread % WARP_SIZE
        g, t = lane >> 2, lane & 3
        query_len = query_lens[seq]
        cta_i0 = query_block * WARPS * TOKENS
        if cta_i0 >= query_len:  # no query of this sequence here (the whole CTA leaves; no barrier yet)
            return
        i0 = cta_i0 + warp * TOKENS
        first_row = first_query_row(query_lens, seq)
        start = context_lens[seq] - query_len  # position of query 0
        cta_end = uint32(start + min(cta_i0 + WARPS * TOKENS, query_len))  # keys the CTA loads
        warp_end = uint32(start + min(i0 + TOKENS, query_len) if i0 < query_len else 0)  # keys this warp reads
        limit = cuda.local.array(2, types.int32)  # rows g, g + 8: the last key each counts (-1: none)
        row_limits(i0, g, start, query_len, limit)
        # keys before this are before every row's position, and every row is a query: no check per key
        unmasked_end = uint32(start + i0 + 1 if i0 + TOKENS <= query_len else 0)

        smem = cuda.shared.array(0, uint32)  # STAGES stages of K rows, V rows, K scales, V scales
        smemf = cuda.shared.array(0, float32)  # the same memory, for the scales
        walk, tiles = start_walk(smem, smemf, k_words, v_words, k_scales, v_scales, block_tables, seq, kv, cta_end,
                                 num_kv_heads, block_size, thread)

        qa = cuda.local.array(QUERY_WORDS, uint32)
        query_registers(q, first_row, i0, query_len, kv, g, t, scale_log2, qa)
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        corr = cuda.local.array(2, float32)
        v_max = cuda.local.array(1, float32)
        pow_ = cuda.local.array(1, float32)
        scores = cuda.local.array(TILE_SCORES, float32)
        vsi = cuda.local.array(LANE_KEYS, float32)
        weights = cuda.local.array(TILE_WEIGHT_WORDS, uint32)
        acc = cuda.local.array(ACC_SIZE, float32)
        start_state(m, lsum, corr, v_max, pow_, acc)

        tile, stage = uint32(0), uint32(0)  # stage = tile % STAGES
        while tile < tiles:
            wait_for_tile()  # this thread's copies of `tile` have landed ...
            cuda.syncthreads()  # ... and everyone's; and everyone is done with tile - 1's stage
            next_stage = uint32(stage + uint32(1)) if stage + uint32(1) < uint32(STAGES) else uint32(0)
            copy_next_tile(smem, smemf, k_words, v_words, k_scales, v_scales, block_tables, seq, walk, tiles, tile,
                           stage, next_stage, thread)
            tile0 = uint32(tile * uint32(KEYS))
            kbase = uint32(stage * uint32(STAGE_WORDS))
            stage = next_stage
            if tile0 + uint32(KEYS) <= unmasked_end:
                attend_full_tile(smem, smemf, kbase, tile0, warp_end, limit, qa, g, t, v_max, pow_, m, lsum, corr,
                                 scores, vsi, weights, acc)
            elif tile0 < warp_end:
                attend_masked_tile(smem, smemf, kbase, tile0, warp_end, limit, qa, g, t, v_max, pow_, m, lsum, corr,
                                   scores, vsi, weights, acc)
            tile += uint32(1)

        if i0 >= query_len:
            return
        for r in range(2):  # rows g, g + 8: l over the row's four lanes, then this lane's D / 4 elements
            l = lsum[r] + cuda.shfl_xor_sync(FULL_MASK, lsum[r], 1)
            l += cuda.shfl_xor_sync(FULL_MASK, l, 2)
            row = g + 8 * r
            token = i0 + row // G
            if token < query_len:
                store_row(out, first_row + token, kv * G + row % G, t, r, acc, pow_[0], l)

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
    (the CTAs past a sequence's queries return at once). ``q`` and ``out`` are C-contiguous, and on a GPU their data
    starts on 16 bytes (the kernel reads and writes them 16 bytes at a time). ``q`` may end in padding rows past
    ``sum(query_lens)`` (the engine pads a prefill to a token bucket so that one CUDA graph serves every prompt
    length of the bucket): no sequence owns them, and their ``out`` rows are left as they were.
    """
    call = prepared_call(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale, out, k_scale,
                         v_scale, kv_format, max_context_len, stream, "paged_prefill_mma")
    if call is not None:
        kernel = _prefill_kernel(HEAD_DIM, call.group, call.bf16_out, not call.fp8)
        launch_prepared(kernel, call, stage_layout(not call.fp8)[2], stream)
    return out


class PreparedCall(NamedTuple):
    """A checked flash-prefill call, ready to launch: the kernel's arguments (device arrays), its grid, and what
    selects the variant."""

    args: tuple
    grid: tuple[int, int, int]
    threads: int
    group: int
    fp8: bool
    bf16_out: bool
    out: object
    out_device: object


def prepared_call(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale, out, k_scale, v_scale,
                  kv_format, max_context_len, stream, kernel_name: str, cta_warps: int = WARPS) -> PreparedCall | None:
    """``paged_prefill_mma``'s checks and arguments (shared with ``fp8lab.numba_kernels.prefill_wgmma``, named
    ``kernel_name`` in its errors) for CTAs of ``cta_warps`` warps of ``tokens_per_warp`` query tokens; None where
    there is nothing to compute (no query token or head)."""
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
    for name, x in (("q", call.q), ("out", call.out)):  # read and written 16 bytes at a time
        require_c_contiguous(name, x)
        require_load_alignment(name, x, kernel_name)
    if call.block_tables.shape[0] > MAX_GRID_Z:
        raise ValueError(f"block_tables: at most {MAX_GRID_Z} sequences per call (the grid's z), got "
                         f"{call.block_tables.shape[0]}")
    if k_cache.size * k_cache.dtype.itemsize // 4 >= MAX_CACHE_WORDS:
        raise ValueError(f"k_cache: {k_cache.shape} is {k_cache.size * k_cache.dtype.itemsize} bytes, more than the "
                         f"kernel's 32-bit word indices reach ({MAX_CACHE_WORDS * 4 / 2**30:g} GiB)")
    if num_tokens == 0 or num_heads == 0:
        return None
    longest = int(to_host(call.query_lens).max(initial=0)) if call.host_indices else num_tokens
    fp8 = call.kv_format.scaled
    k_words, k_scales = flat_cache(k_cache, as_kernel_array("k_scale", k_scale) if fp8 else None)
    v_words, v_scales = flat_cache(v_cache, as_kernel_array("v_scale", v_scale) if fp8 else None)
    if not fp8:  # a BF16 cache: the kernel never reads its scale arguments
        k_scales = v_scales = placeholder(1)
    arrays = (call.q, k_words, v_words, k_scales, v_scales, _as_int32(call.block_tables), _as_int32(call.context_lens),
              _as_int32(call.query_lens))
    device = [on_device(x, stream) for x in arrays]
    out_device = on_device(call.out, stream)
    cta_tokens = cta_warps * tokens_per_warp(group)
    grid = (max(1, -(-longest // cta_tokens)), num_kv_heads, call.block_tables.shape[0])
    args = (*device, np.float32(float(softmax_scale) * LOG2E), num_kv_heads, call.block_size, out_device)
    return PreparedCall(args, grid, cta_warps * WARP_SIZE, group, fp8, np.dtype(call.out.dtype) == np.uint16, call.out,
                        out_device)


def launch_prepared(kernel, call: PreparedCall, shared_bytes: int, stream) -> None:
    """Launch ``kernel`` on a prepared call with ``shared_bytes`` of dynamic shared memory; copy ``out`` back where it
    is a NumPy array on a GPU."""
    _allow_shared_memory(kernel, call.args, shared_bytes)
    pdl.launch(kernel, call.grid, call.threads, stream, *call.args, shared_bytes=shared_bytes)
    if call.out_device is not call.out:  # a NumPy out on a GPU
        call.out_device.copy_to_host(call.out, stream=stream)


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
