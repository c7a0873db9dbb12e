"""Flash prefill attention over a paged FP8 cache with Hopper's warpgroup ``wgmma``: each K/V code decoded once a CTA.

Computes ``fp8lab.reference.attention.prefill`` per sequence over ``fp8lab.reference.kv_cache.gather`` (FP8 cache,
head size 128, ``G`` query heads per kv head with ``G`` dividing 16, no ALiBi) in the float32 order of
``fp8lab.simulators.prefill_mma.paged_prefill(..., shared_values=4 warpgroups)``, with the arguments of
``fp8lab.numba_kernels.prefill_mma.paged_prefill_mma``. Launch: grid ``(query blocks, num_kv_heads, num_seqs)`` x
``128 warpgroups`` threads (one or two warpgroups), ``SHARED_BYTES`` of dynamic shared memory, one launch; sm_90
(Hopper) only. Checked
(``tests/numba_kernels/test_prefill_wgmma_kernel.py``): bit for bit the simulator in the CUDA simulator (whose
``wgmma`` twin is the mma model per k16 step), the oracle within the tensor-core decode's error bound on a GPU.

Why: ``prefill_mma``'s four warps each decode every K/V code of a tile for their own 16 rows, so each code is
converted four times; 272 of the 849 SASS instructions of its unmasked tile are those conversions, and the kernel is
bound by instruction issue (``bench/RESULTS.md``, twenty-ninth session). Here the CTA's 128 threads convert each
code once, into F16 in shared memory in ``wgmma``'s B layout, and the tensor cores read both products' B from there.

With one warpgroup the CTA is ``prefill_mma``'s: 64 mma rows (``16 / G`` query tokens times the ``G`` heads per
warp), the same grid, walk, ``cp.async`` copies of the codes and ring of block-table entries
(``prefill_mma.walk_functions``), the same queries in the same A registers. With two (``warpgroups=2``) a CTA owns
twice the tokens, 128 rows share each decoded tile, each warpgroup issues its own ``wgmma`` from the same buffers,
warps 0 to 3 copy, and one CTA fits an SM. Per tile of 64 keys:

1. Wait for the tile's codes, barrier; the copies of the tile two ahead go out.
2. **Decode** (every thread, ``decode_keys`` and ``decode_values``): the keys into the K buffer, 64 rows of 128 F16
   positions in two 64-wide 128-byte-swizzle atoms, where position ``16 s + k`` of a key's row holds head element
   ``fp8lab.simulators.splitkv_mma.score_dims(128)[s, k]`` (the score k-step order of the decode and the warp
   kernel, so the query registers are theirs); the values into the tile's V buffer (two, by tile parity),
   transposed: 128 rows, row ``32 (d % 4) + d // 4`` holding head element ``d`` of the tile's 64 keys in key order
   (that row order makes the 128-bit stores of a quarter-warp fall into 8 distinct swizzle pieces). Values of keys
   past the CTA's end are zero. ``fence.proxy.async`` (generic stores, async-proxy reads), barrier. The tile
   before's ``P V`` runs on the tensor cores meanwhile (it reads the other V buffer); it is waited for here.
3. **Scores**: 8 ``wgmma.m64n64k16`` (A: the queries' registers, B: the K buffer), one k16 step over 16 head
   elements each, chained from zero. While they run, the warp's V scales (zero past the *warp's* end), their
   largest and its power. Then the wait. Lane ``(g, t)`` of warp ``w`` holds rows ``g``, ``g + 8`` of the warp's 16
   and keys ``8 b + 2 t + {0, 1}``: ``mma.m16n8k16``'s layout over 8 n tiles, so the rest of the tile is the warp
   kernel's: times the K scales, the online softmax of each row (masked in the walk's last tiles only), the weights
   ``p * v_scale * inv`` as F16 pairs in the A registers.
4. ``acc`` rescaled (skipped where every row's factor is 1), then **``P V``** issued: 4 ``wgmma.m64n128k16`` (A:
   the weights, 16 keys each; B: the tile's V buffer), chained through ``acc``, waited for in the next tile's step
   2 (after the walk, at the end). ``acc``'s column ``n`` is head element ``4 (n % 32) + n // 32``, so a lane's 32
   outputs of a row are four runs of 8 consecutive elements, stored 16 bytes at a time; ``acc * pow / l`` by
   ``mathops.divide_by_at_least_one``, since ``div.rn``'s subroutine call would make ptxas serialize every
   ``wgmma`` (C7509).

One ``wgmma`` computes four warps' rows from the CTA's one copy of the values, so what the warp kernel keeps per
warp is per CTA here: the values of keys up to the CTA's end enter every warp's ``P V`` (with weight 0 past a row's
position), and every chunk of the CTA's tiles is multiplied. A NaN value code of a key before the CTA's end thus
reaches every query of the CTA before it (up to ``4 warpgroups TOKENS - 1`` keys back; the warp kernel's reach is
``TOKENS - 1``): the simulator's ``shared_values`` (the CTA's warps). The V scales stay per warp, so a NaN V scale
reaches no earlier warp.

Every wait is ``wgmma.wait_group 0``: with ``wait_group 1`` (the scores waited for while ``P V`` ran on) ptxas
could not tell which group had finished and serialized every ``wgmma`` (C7514). Two CTAs of one warpgroup fit an SM
(registers and shared memory), or one of two; they overlap each other's phases. Dated measurements are in
``bench/RESULTS.md``.
"""

from __future__ import annotations

import functools

from numba import cuda, float32, types, uint32, uint64

from fp8lab.simulators.prefill_mma import CHUNKS, KEYS, tokens_per_warp
from fp8lab.simulators.splitkv_mma import TILE, WARPS

from . import mathops, pdl, wgmma
from .bits import (
    SIMULATOR,
    e4m3x2_high_to_f16x2,
    e4m3x2_to_f16x2,
    f32_as_u32,
    max_nan,
    prmt,
)
from .cp_async import wait_group_function
from .prefill_mma import (
    HEAD_DIM,
    HIGH_BYTES_OF_TWO,
    LOW_BYTES_OF_TWO,
    STAGES,
    first_query_row,
    launch_prepared,
    prepared_call,
    softmax_row_function,
    stage_layout,
    start_state,
    walk_functions,
)
from .splitkv_mma import power_of_two_below
from .warp import FULL_MASK, WARP_SIZE, store_shared_u32x4, store_u32x4

WARPGROUP_THREADS = WARPS * WARP_SIZE
"""128: a warpgroup, 64 rows; a CTA has one or two (``warpgroups``)."""
SROW, STAGE_WORDS, RING_BYTES = stage_layout(bf16_cache=False)
"""The code stages and the ring of block-table entries: ``prefill_mma``'s FP8 layout, from word 0."""
K_BUFFER_BYTES = 2 * KEYS * wgmma.ROW_BYTES
"""The decoded keys: two swizzle atoms (head positions 0..63, 64..127) of 64 rows of 128 bytes."""
V_BUFFER_BYTES = HEAD_DIM * wgmma.ROW_BYTES
"""The decoded values of one tile, transposed: 128 rows (head elements) of the tile's 64 keys. There are two (tile
``% 2``): a tile's ``P V`` reads one while the next tile is decoded into the other."""
SHARED_BYTES = RING_BYTES + wgmma.ATOM_BYTES + K_BUFFER_BYTES + 2 * V_BUFFER_BYTES
"""The stages and ring, room to align the buffers to 1,024 bytes in the shared window, the K buffer and two V buffers:
107,056 bytes, so two CTAs of one warpgroup fit an SM (and one of two)."""


def prefill_kernel_function(group: int, bf16_out: bool = False, warpgroups: int = 1):
    """The Python source of the kernel for ``group`` query heads per kv head, float32 or (``bf16_out``) BF16 output,
    and CTAs of ``warpgroups`` warpgroups (1 or 2: 64 or 128 rows share each decoded tile; two CTAs of one fit an SM,
    one of two). Arguments: ``prefill_mma.prefill_kernel_function``'s (an FP8 cache)."""
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups: expected 1 or 2, got {warpgroups!r}")
    G, D = group, HEAD_DIM
    TOKENS = tokens_per_warp(G)
    CTA_WARPS = WARPS * warpgroups
    KEY_ITEMS = 4 // warpgroups  # a thread's (key, k-step) pairs of a tile: 512 / threads
    VALUE_BLOCKS = 2 // warpgroups  # its (8 keys, 4 elements) blocks: 256 / threads
    STEPS = D // 16  # k-steps of the scores
    QUERY_WORDS, ACC_SIZE, SCORE_SIZE = 4 * STEPS, D // 2, KEYS // 2
    WEIGHT_WORDS = 4 * CHUNKS
    LANE_KEYS = 4 * CHUNKS
    V_OFFSET, SCALE_OFFSET = KEYS * SROW, 2 * KEYS * SROW
    query_registers, row_limits, start_walk, copy_next_tile = walk_functions(G, bf16_cache=False, warps=CTA_WARPS)
    wait_for_tile = wait_group_function(STAGES - 2)
    scores_mma = wgmma.mma_async_function(KEYS, operand="f16")
    values_mma = wgmma.mma_async_function(D, operand="f16")
    wait_for_scores = wgmma.wait_group_function(0, KEYS)  # the tile's scores (the youngest group)
    wait_for_values = wgmma.wait_group_function(0, D)  # the tile before's P V

    @cuda.jit(device=True, inline=True)
    def decode_keys(smem, kbase, kbuffer, warp, lane):
        """This thread's ``KEY_ITEMS`` of the tile's 512 (key, k-step) pairs: the key's code words ``s``, ``8 + s``,
        ``16 + s``, ``24 + s`` (word ``8 t + s`` holds head elements ``32 t + 4 s ..``: k-step ``s``'s four for lanes
        ``t = 0 .. 3``) converted into the 16 positions ``16 s ..`` of its row in the K buffer (byte ``kbuffer``), two
        128-bit stores. A quarter-warp covers 8 keys of one k-step: the loads hit 32 distinct banks (rows of 36
        words), the stores 8 distinct swizzle pieces."""
        for item in range(KEY_ITEMS):
            pair = warp * uint32(KEY_ITEMS) + uint32(item)  # 0 .. 15
            key = (lane & uint32(7)) + uint32(8) * (pair & uint32(7))
            step = (lane >> uint32(3)) + uint32(4) * (pair >> uint32(3))
            row = kbase + key * uint32(SROW) + step
            w0, w1, w2 = smem[row], smem[row + uint32(8)], smem[row + uint32(16)]
            w3 = smem[row + uint32(24)]
            first = kbuffer + (step >> uint32(2)) * uint32(KEYS * wgmma.ROW_BYTES) + key * uint32(wgmma.ROW_BYTES)
            low_piece = (uint32(2) * (step & uint32(3))) ^ (key & uint32(7))
            high_piece = (uint32(2) * (step & uint32(3)) + uint32(1)) ^ (key & uint32(7))
            store_shared_u32x4(smem, (first + low_piece * uint32(16)) >> uint32(2),
                               e4m3x2_to_f16x2(w0), e4m3x2_to_f16x2(w1), e4m3x2_to_f16x2(w2), e4m3x2_to_f16x2(w3))
            store_shared_u32x4(smem, (first + high_piece * uint32(16)) >> uint32(2),
                               e4m3x2_high_to_f16x2(w0), e4m3x2_high_to_f16x2(w1), e4m3x2_high_to_f16x2(w2),
                               e4m3x2_high_to_f16x2(w3))

    @cuda.jit(device=True, inline=True)
    def store_value_row(smem, vbuffer, key0, row, w0, w1, w2, w3):
        """The 4 words (8 keys from ``key0``, F16 pairs) of V-buffer row ``row``, one 128-bit store at the row's
        swizzled piece ``key0 / 8``."""
        piece = (key0 >> uint32(3)) ^ (row & uint32(7))
        store_shared_u32x4(smem, (vbuffer + row * uint32(wgmma.ROW_BYTES) + piece * uint32(16)) >> uint32(2),
                           w0, w1, w2, w3)

    @cuda.jit(device=True, inline=True)
    def decode_value_block(smem, vbase, vbuffer, key0, lane, keys_left, check_end):
        """Code word ``lane`` (elements ``4 lane ..``) of keys ``key0 .. key0 + 7``, zero for keys at or past
        ``keys_left`` (the CTA's end, from the tile's first key; ``check_end``, a constant, is False for a tile that
        ends before it), paired two keys at a time (``prmt``: ``low[p]``
        holds keys ``2p, 2p + 1`` at elements 0 and 1 of the lane's four, ``high[p]`` at 2 and 3) and converted into
        16 bytes of 8 keys in each element's row of the V buffer (row ``32 i + lane`` holds element ``4 lane + i``).
        Straight-line code: each conversion and store is written out, so nothing is chosen at run time."""
        w = cuda.local.array(8, uint32)
        for k in range(8):
            code = smem[vbase + (key0 + uint32(k)) * uint32(SROW) + lane]
            w[k] = code if not check_end or uint32(key0 + uint32(k)) < keys_left else uint32(0)
        low = cuda.local.array(4, uint32)
        high = cuda.local.array(4, uint32)
        for p in range(4):
            low[p] = prmt(w[2 * p], w[2 * p + 1], LOW_BYTES_OF_TWO)
            high[p] = prmt(w[2 * p], w[2 * p + 1], HIGH_BYTES_OF_TWO)
        store_value_row(smem, vbuffer, key0, lane, e4m3x2_to_f16x2(low[0]), e4m3x2_to_f16x2(low[1]),
                        e4m3x2_to_f16x2(low[2]), e4m3x2_to_f16x2(low[3]))
        store_value_row(smem, vbuffer, key0, lane + uint32(32), e4m3x2_high_to_f16x2(low[0]),
                        e4m3x2_high_to_f16x2(low[1]), e4m3x2_high_to_f16x2(low[2]), e4m3x2_high_to_f16x2(low[3]))
        store_value_row(smem, vbuffer, key0, lane + uint32(64), e4m3x2_to_f16x2(high[0]), e4m3x2_to_f16x2(high[1]),
                        e4m3x2_to_f16x2(high[2]), e4m3x2_to_f16x2(high[3]))
        store_value_row(smem, vbuffer, key0, lane + uint32(96), e4m3x2_high_to_f16x2(high[0]),
                        e4m3x2_high_to_f16x2(high[1]), e4m3x2_high_to_f16x2(high[2]), e4m3x2_high_to_f16x2(high[3]))

    @cuda.jit(device=True, inline=True)
    def decode_values(smem, vbase, vbuffer, warp, lane, keys_left, check_end):
        """This thread's ``VALUE_BLOCKS`` of the tile's 256 (8 keys, 4 head elements) blocks (``decode_value_block``):
        keys ``16 warp ..`` and ``16 warp + 8 ..`` with one warpgroup, ``8 warp ..`` with two."""
        decode_value_block(smem, vbase, vbuffer, uint32(8 * VALUE_BLOCKS) * warp, lane, keys_left, check_end)
        if VALUE_BLOCKS == 2:
            decode_value_block(smem, vbase, vbuffer, uint32(16) * warp + uint32(8), lane, keys_left, check_end)

    @cuda.jit(device=True, inline=True)
    def score_index(c, r, u):
        """Where the score of chunk ``c``'s key ``2t + (u & 1) + 8 (u >> 1)`` for row ``g + 8 r`` lies in the
        ``m64n64`` accumulator: n tile ``2 c + (u >> 1)``, its element ``2 r + (u & 1)``."""
        return 8 * c + 4 * (u >> 1) + 2 * r + (u & 1)

    def tile_functions(masked: bool):
        """The warp's online softmax of one tile, ``masked``: with the per-key checks of the walk's last tiles (keys
        past the warp's end, the causal mask per row, rows past the queries), or without."""

        softmax_row = softmax_row_function(masked, True, score_index)  # the warp kernel's step, in this order

        @cuda.jit(device=True, inline=True)
        def value_scales(smemf, kbase, tile0, warp_end, t, v_max, pow_, vsi):
            """The lane's V scales of the tile (zero past the warp's end) times ``inv``, the warp's largest V scale and
            its power updated; returns the ratio of the old power to the new (what ``acc`` is rescaled by besides
            ``corr``). Needs no score: it runs while the scores' ``wgmma`` do."""
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
            return ratio

        @cuda.jit(device=True, inline=True)
        def scores_softmax(smemf, kbase, tile0, warp_end, limit, t, m, lsum, corr, scores, vsi, weights):
            """The scores times their K scales, then both rows' online-softmax step (``corr`` and the weights)."""
            for c in range(CHUNKS):
                for half in range(2):
                    ks0 = smemf[kbase + SCALE_OFFSET + TILE * c + 8 * half + 2 * t]
                    ks1 = smemf[kbase + SCALE_OFFSET + TILE * c + 8 * half + 2 * t + 1]
                    for r in range(2):
                        scores[score_index(c, r, 2 * half)] *= ks0
                        scores[score_index(c, r, 2 * half + 1)] *= ks1
            softmax_row(0, scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights)
            softmax_row(1, scores, vsi, tile0, warp_end, limit, t, m, lsum, corr, weights)

        return value_scales, scores_softmax

    full_value_scales, full_softmax = tile_functions(masked=False)
    masked_value_scales, masked_softmax = tile_functions(masked=True)

    @cuda.jit(device=True, inline=True)
    def issue_scores(smem64, qa, scores, kbuffer):
        """Issue ``S = Q K^T`` of the tile as one group: 8 k16 steps from zero (step ``s``: atom ``s // 4``, 32 bytes a
        step in it)."""
        wgmma.fence()
        for s in range(STEPS):
            scores_mma(scores, qa, 4 * s, smem64, kbuffer, (s // 4) * (KEYS * wgmma.ROW_BYTES) + (s % 4) * 32, s > 0)
        wgmma.commit_group()

    @cuda.jit(device=True, inline=True)
    def issue_values(smem64, weights, acc, vbuffer):
        """Issue ``acc += P V`` as one group: 4 k16 steps of 16 keys, chained through ``acc``."""
        wgmma.fence()
        for c in range(CHUNKS):
            values_mma(acc, weights, 4 * c, smem64, vbuffer, 32 * c, True)
        wgmma.commit_group()

    @cuda.jit(device=True, inline=True)
    def normalized(x, l):
        """``splitkv.normalized``: ``x / l``, 0 where ``l = 0``, by ``mathops.divide_by_at_least_one`` (a row's ``l``
        is 0, NaN or at least 1: it holds the row's largest weight, 1), since ``div.rn``'s subroutine would make ptxas
        serialize every ``wgmma`` of the kernel."""
        return float32(0) if l == float32(0) else mathops.divide_by_at_least_one(x, l)

    @cuda.jit(device=True, inline=True)
    def store_row(out, out_row, head, t, r, acc, power, l):
        """Store this lane's 32 outputs of row ``g + 8 r``, ``acc * power / l`` (0 where ``l = 0``): head elements
        ``32 q + 8 t + j`` (``j = 4 e + u``) are ``acc[4 (4 u + q) + 2 r + e]``, 8 consecutive elements per ``q``, in
        128-bit stores (two of float32, one of BF16 each)."""
        for q in range(4):
            first = 32 * q + 8 * t
            values = cuda.local.array(8, float32)
            for j in range(8):
                values[j] = normalized(acc[4 * (4 * (j % 4) + q) + 2 * r + j // 4] * power, l)
            if bf16_out:
                w = cuda.local.array(4, uint32)
                for i in range(4):
                    w[i] = (mathops.f32_to_bf16_bits_rne(values[2 * i])
                            | (mathops.f32_to_bf16_bits_rne(values[2 * i + 1]) << uint32(16)))
                store_u32x4(out, (out_row, head, first), w[0], w[1], w[2], w[3])
            else:
                for half in range(2):
                    w = cuda.local.array(4, uint32)
                    for i in range(4):
                        w[i] = f32_as_u32(values[4 * half + i])
                    store_u32x4(out, (out_row, head, first + 4 * half), w[0], w[1], w[2], w[3])

    @cuda.jit(device=True, inline=True)
    def finish_row(out, first_row, i0, query_len, kv, g, t, r, lsum, acc, power):
        """Row ``g + 8 r``: ``l`` over the row's four lanes, then this lane's 32 elements if the row is a query."""
        l = lsum[r] + cuda.shfl_xor_sync(FULL_MASK, lsum[r], 1)
        l += cuda.shfl_xor_sync(FULL_MASK, l, 2)
        row = g + 8 * r
        token = i0 + row // G
        if token < query_len:
            store_row(out, first_row + token, kv * G + row % G, t, r, acc, power, l)

    def prefill_kernel(q, k_words, v_words, k_scales, v_scales, block_tables, context_lens, query_lens, scale_log2,
                       num_kv_heads, block_size, out):
        pdl.prologue()  # q and the cache write come from the kernels before: wait for them
        kv, seq = cuda.blockIdx.y, cuda.blockIdx.z
        query_block = cuda.gridDim.x - 1 - cuda.blockIdx.x  # the last queries (the longest walks) first
        thread = cuda.threadIdx.x
        warp, lane = thread // WARP_SIZE, thread % WARP_SIZE
        g, t = lane >> 2, lane & 3
        query_len = query_lens[seq]
        cta_i0 = query_block * CTA_WARPS * TOKENS
        if cta_i0 >= query_len:  # no query of this sequence here (the whole CTA leaves; no barrier yet)
            return
        i0 = cta_i0 + warp * TOKENS
        first_row = first_query_row(query_lens, seq)
        start = context_lens[seq] - query_len  # position of query 0
        cta_end = uint32(start + min(cta_i0 + CTA_WARPS * TOKENS, query_len))  # keys the CTA loads
        warp_end = uint32(start + min(i0 + TOKENS, query_len) if i0 < query_len else 0)  # keys this warp counts
        limit = cuda.local.array(2, types.int32)  # rows g, g + 8: the last key each counts (-1: none)
        row_limits(i0, g, start, query_len, limit)
        # keys before this are before every row's position, and every row is a query: no check per key
        unmasked_end = uint32(start + i0 + 1 if i0 + TOKENS <= query_len else 0)

        smem = cuda.shared.array(0, uint32)  # the code stages and the ring from word 0, then the F16 buffers
        smemf = cuda.shared.array(0, float32)
        smem64 = cuda.shared.array(0, uint64)
        kbuffer = uint32(RING_BYTES) + (uint32(wgmma.ATOM_BYTES) - (wgmma.shared_address(smem64) + uint32(RING_BYTES))
                                        % uint32(wgmma.ATOM_BYTES)) % uint32(wgmma.ATOM_BYTES)
        vbuffers = kbuffer + uint32(K_BUFFER_BYTES)
        walk, tiles = start_walk(smem, smemf, k_words, v_words, k_scales, v_scales, block_tables, seq, kv, cta_end,
                                 num_kv_heads, block_size, thread)

        qa = cuda.local.array(QUERY_WORDS, uint32)
        query_registers(q, first_row, i0, query_len, kv, g, t, scale_log2, qa)
        m = cuda.local.array(2, float32)
        lsum = cuda.local.array(2, float32)
        corr = cuda.local.array(2, float32)
        v_max = cuda.local.array(1, float32)
        pow_ = cuda.local.array(1, float32)
        scores = cuda.local.array(SCORE_SIZE, float32)
        vsi = cuda.local.array(LANE_KEYS, float32)
        weights = cuda.local.array(WEIGHT_WORDS, uint32)
        acc = cuda.local.array(ACC_SIZE, float32)
        start_state(m, lsum, corr, v_max, pow_, acc)

        tile, stage = uint32(0), uint32(0)  # stage = tile % STAGES
        while tile < tiles:
            wait_for_tile()  # this thread's copies of `tile` have landed ...
            cuda.syncthreads()  # ... and everyone's; everyone is done with tile - 1's stage and buffers
            next_stage = uint32(stage + uint32(1)) if stage + uint32(1) < uint32(STAGES) else uint32(0)
            copy_next_tile(smem, smemf, k_words, v_words, k_scales, v_scales, block_tables, seq, walk, tiles, tile,
                           stage, next_stage, thread)
            tile0 = uint32(tile * uint32(KEYS))
            kbase = uint32(stage * uint32(STAGE_WORDS))
            stage = next_stage
            vbuffer = vbuffers + (tile & uint32(1)) * uint32(V_BUFFER_BYTES)
            decode_keys(smem, kbase, kbuffer, uint32(warp), uint32(lane))
            keys_left = uint32(cta_end - tile0)  # the CTA's keys from the tile's first: past them, zero values
            if keys_left >= uint32(KEYS):  # (a CTA-wide branch; only the last tile checks its keys)
                decode_values(smem, kbase + uint32(V_OFFSET), vbuffer, uint32(warp), uint32(lane), keys_left, False)
            else:
                decode_values(smem, kbase + uint32(V_OFFSET), vbuffer, uint32(warp), uint32(lane), keys_left, True)
            wgmma.proxy_fence()  # the buffers' generic-proxy stores, before wgmma's async-proxy reads ...
            cuda.syncthreads()  # ... of every thread's
            wait_for_values(acc)  # tile - 1's P V (it ran during the decode): done with acc and the weights
            issue_scores(smem64, qa, scores, kbuffer)
            full = tile0 + uint32(KEYS) <= unmasked_end
            if full:  # while the scores' wgmma run
                ratio = full_value_scales(smemf, kbase, tile0, warp_end, t, v_max, pow_, vsi)
            else:
                ratio = masked_value_scales(smemf, kbase, tile0, warp_end, t, v_max, pow_, vsi)
            wait_for_scores(scores)
            if full:
                full_softmax(smemf, kbase, tile0, warp_end, limit, t, m, lsum, corr, scores, vsi, weights)
            else:
                masked_softmax(smemf, kbase, tile0, warp_end, limit, t, m, lsum, corr, scores, vsi, weights)
            rescale0, rescale1 = corr[0] * ratio, corr[1] * ratio
            # x * 1 is x (a NaN stays NaN): where no row of the warp changes its max or power, the products are
            # skipped, bit for bit the same acc
            if not cuda.all_sync(FULL_MASK, rescale0 == float32(1) and rescale1 == float32(1)):
                for s in range(ACC_SIZE // 4):
                    acc[4 * s] *= rescale0
                    acc[4 * s + 1] *= rescale0
                    acc[4 * s + 2] *= rescale1
                    acc[4 * s + 3] *= rescale1
            issue_values(smem64, weights, acc, vbuffer)  # runs on while the next tile is decoded
            tile += uint32(1)
        wait_for_values(acc)

        if i0 >= query_len:
            return
        finish_row(out, first_row, i0, query_len, kv, g, t, 0, lsum, acc, pow_[0])  # rows g, g + 8, each with
        finish_row(out, first_row, i0, query_len, kv, g, t, 1, lsum, acc, pow_[0])  # constant accumulator indices

    return prefill_kernel


def launch_bounds(warpgroups: int) -> tuple[int, int]:
    """``(threads, CTAs per SM)`` of a variant: the shared memory holds two CTAs, the registers 256 threads."""
    return WARPGROUP_THREADS * warpgroups, 2 // warpgroups


@functools.lru_cache(maxsize=None)
def _prefill_kernel(group: int, bf16_out: bool = False, warpgroups: int = 1):
    """The compiled kernel of one variant, compiled once per process."""
    options = {} if SIMULATOR else {"launch_bounds": launch_bounds(warpgroups)}
    return cuda.jit(prefill_kernel_function(group, bf16_out, warpgroups), **options)


def paged_prefill_wgmma(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale, out, k_scale=None,
                        v_scale=None, *, kv_format=None, max_context_len=None, warpgroups=1, stream=0):
    """Causal prefill attention of ``q`` over a paged FP8 cache with ``wgmma``, into ``out``; returns ``out``.

    Arguments, checks and contract as ``fp8lab.numba_kernels.prefill_mma.paged_prefill_mma`` over an FP8 cache (a
    BF16 cache is a ``ValueError``: ``paged_prefill_mma`` takes it); ``warpgroups`` (1 or 2) per CTA. The float32
    order is ``fp8lab.simulators.prefill_mma.paged_prefill(..., shared_values=4 * warpgroups)``. Needs a
    compute-capability-9.0 GPU (or the CUDA simulator).
    """
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups: expected 1 or 2, got {warpgroups!r}")
    call = prepared_call(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale, out, k_scale,
                         v_scale, kv_format, max_context_len, stream, "paged_prefill_wgmma", WARPS * warpgroups)
    if call is not None and not call.fp8:
        raise ValueError("k_cache: paged_prefill_wgmma takes an FP8 cache (uint8 E4M3 codes); a BF16 cache runs on "
                         "prefill_mma.paged_prefill_mma")
    if call is not None:
        launch_prepared(_prefill_kernel(call.group, call.bf16_out, warpgroups), call, SHARED_BYTES, stream)
    return out


def kernel_variants():
    """``(name, python function, numba signature, warpgroups)`` of the variants the sm_90a PTX check compiles:
    Qwen3-8B's group of 4 with float32 out (one and two warpgroups), Qwen3-0.6B's group of 2 with BF16 out."""
    f32 = types.float32
    words = types.Array(types.uint32, 1, "C")
    f32_1d, f32_3d = types.Array(f32, 1, "C"), types.Array(f32, 3, "C")
    i32_1d = types.Array(types.int32, 1, "C")

    def signature(bf16_out: bool):
        out = types.Array(types.uint16 if bf16_out else f32, 3, "C")
        return types.void(f32_3d, words, words, f32_1d, f32_1d, types.Array(types.int32, 2, "C"), i32_1d, i32_1d, f32,
                          types.int64, types.int64, out)

    return [(f"prefill_wgmma[group={g}{', out=bf16' if b else ''}, warpgroups={w}]", prefill_kernel_function(g, b, w),
             signature(b), w) for g, b, w in ((4, False, 1), (4, False, 2), (2, True, 1))]

