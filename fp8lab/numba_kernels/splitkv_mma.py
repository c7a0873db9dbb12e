"""Split-kv paged decode attention over an FP8 cache on tensor cores (``mma.m16n8k16``, F16 in, float32 out).

Computes ``fp8lab.reference.attention.paged_decode`` (FP8 cache, no ALiBi). Also ``decode_mma_with_input``: the same with the attention input (q/k-norm, RoPE, the new token's cache write) in
the split kernel. Launch: ``split_kernel`` grid
``(num_seqs, num_kv_heads, num_splits)`` x 128 threads (4 warps), then, with more than one split, the combine
kernel of ``fp8lab.numba_kernels.splitkv`` (grid ``(num_seqs, num_heads)`` x ``head_dim``), which reads the
same workspace layout. Checked (``tests/numba_kernels/test_splitkv_mma_kernel.py``): bit for bit against
``fp8lab.simulators.splitkv_mma`` in the CUDA simulator (whose ``mma`` twin is the model the simulator uses),
against the oracle within ``fp8lab.simulators.splitkv_mma.error_bound`` on a GPU; sm_90 PTX in
``tests/numba_kernels/test_kernels_compile.py``.

Why: the SIMT kernel (``splitkv``) spends a lane's instructions on 16-element fma chains and butterflies per
token and query head, and is bound by that chain, not by bytes (``bench/RESULTS.md``: at Qwen3-8B batch 16 its
25 us per layer read 16 x 1.1 MB). Here a warp serves all ``G`` query heads of a kv head (the rows of an mma
tile) and 16 tokens per step: ``D / 16 * 2`` mma for the scores, ``D / 8`` for ``P V``. A CTA's 4 warps take every
fourth tile of the shard each, so that 4 tiles' loads are in flight at once, and each warp keeps the loads of its
next two tiles in flight during its current tile's arithmetic (one for groups of more than 8 query heads, which
need the registers; a warp alone waits for each tile's loads: 1.3 us a tile, and one tile ahead left the kernel at
about a quarter of the copy bandwidth at 16,384 tokens); the block
table is read 32 tiles at a time, one entry per lane, and passed round by ``shfl``. At the end the warps' states
meet in shared memory (rows padded so that a warp's stores meet 32 banks: ``stash_offset``) and the CTA merges them in
warp order (``splitkv.merge_weight``, the merge of the shards).

Measured (``bench/attention_mma.py``, ``bench/RESULTS.md``, H200): against the SIMT kernel, both with their best
split counts, 1.0 times its time at batch 1 and 512 tokens, 1.2 at batches 4 to 16, 1.3 at 16,384 tokens and
at batches 8 and 16 over 2,048.

The device functions of one tile (``tile_functions``: its loads, the scores, the online softmax, ``P V``) are the
split kernel's; the flash prefill (``fp8lab.numba_kernels.prefill_mma``) shares their lane layouts through shared
memory.

The schedule is the simulator's (read ``fp8lab.simulators.splitkv_mma`` first); per lane ``L`` of a warp, ``g = L >> 2``,
``t = L & 3``, tile ``[tile0, tile0 + 16)`` (one KV block holds it: the block size is a multiple of 16):

- **Keys**: the lane loads ``D / 4`` bytes, ``[(D/4) t, (D/4)(t+1))``, of tokens ``g`` and ``8 + g`` (the two
  8-token n tiles): word ``s`` of them is k-step ``s``'s B registers, two ``cvt.rn.f16x2.e4m3x2`` away.
- **Queries**: row ``g`` (and ``g + 8`` when ``G > 8``) of the A registers, the same elements, as F16 pairs of
  ``q * scale_log2``, loaded once.
- **Scores**: the lane's accumulator holds tokens ``2t, 2t + 1, 8 + 2t, 9 + 2t`` of rows ``g`` and ``g + 8``;
  it loads those tokens' scales and V bytes ``[(D/8) g, (D/8)(g + 1))``.
- **Softmax**: the row max over the tile is the lane's 4 values and two ``shfl_xor`` (the row's 4 lanes); the
  weights ``p`` of the lane's tokens are, as F16 pairs, exactly the A registers of ``P V`` (no shuffle: the
  accumulator's layout of the scores is the A layout of the weights).
- **Values**: the B registers of ``P V`` are pairs of consecutive tokens at one head element, so the lane
  gathers byte ``s`` of two token rows into one pair (shifts and masks) before the conversion; n tile ``s``
  gives elements ``(D/8)(2t) + s`` and ``(D/8)(2t + 1) + s`` of the row: the lane ends with ``D / 4``
  elements of row ``g``'s output.

**With its input** (``decode_mma_with_input``, what the engine's decode step runs): the same split kernel also does
the attention input, bit for bit ``attention_input.qk_norm_rope_cache_write`` then the kernel above (checked
against ``fp8lab.simulators.splitkv_mma.decode_with_input`` in the CUDA simulator and against the two launches on a
GPU). Before it waits for the q/k/v GEMM (``pdl``), each CTA issues the block table's load and its first tile's,
unless that tile holds the new token: the cache tiles are earlier steps', complete before this kernel launched; and
the norm weights, the position and its cos/sin, which nothing in the step writes.
Then its warps take tasks ``w, w + 4, ...``: task ``i < G`` norms and rotates query head ``kv G + i`` into shared
memory (``attention_input``'s warp functions); task ``G``, in the CTA whose shard holds position ``seq_len - 1``,
norms, rotates and quantizes the new token's k and writes k and v into that position's slot of the block table.
After a barrier the warps read the queries from shared memory and the tiles with coherent loads
(``warp.load_u32x4_coherent``: this CTA wrote one of them). One launch fewer per layer (``bench/RESULTS.md``).

Caches: ``[num_blocks, num_kv_heads, block_size, head_dim]`` uint8 E4M3 codes with float32 scales ``[num_blocks,
num_kv_heads, block_size]``; ``head_dim`` 128; ``num_heads / num_kv_heads`` at most 16; ``block_size`` a
multiple of 16 (``fp8lab.simulators.splitkv_mma.supports``). ``q`` float32; ``out`` float32 or uint16 (BF16 bits,
rounded once as ``layers.bf16_round`` does).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, types, uint32, uint64

from fp8lab.simulators.splitkv_mma import (
    HEAD_DIMS,
    MAX_GROUP,
    TILE,
    WARPS,
    choose_num_splits,
    supports,
)

from . import mathops, pdl
from .arguments import as_kernel_array
from .attention_input import check_head_inputs, head_row_functions, host_contiguous
from .bits import e4m3x2_to_f16x2, f32_as_u32, f32_to_f16_bits, u32_as_f32
from .gemv_simt import unrolled
from .kv_cache import on_device, placeholder
from .mma import mma_f16_inline as mma_f16
from .splitkv import (
    check_decode,
    combine_and_return,
    decode_workspace,
    device_num_sms,
    merge_weight,
    normalized,
    output_store,
)
from .warp import FULL_MASK, WARP_SIZE, load_u32x4, load_u32x4_coherent

THREADS = WARPS * WARP_SIZE
EXPONENT_BITS = uint32(0x7F800000)
INVERSE_EXPONENT_BITS = uint32(254 << 23)


@cuda.jit(device=True, inline=True)
def stash_offset(warp, row, d, group, head_dim):
    """Where element ``d`` of query row ``row`` of warp ``warp``'s partial sits in the split kernel's shared ``stash``:
    rows of ``head_dim`` elements with one unused word after every 32 (``stash_size`` per CTA).

    Why the padding: a warp stores its partial with lane ``(g, t)`` writing element ``(D/8)(2t + e) + s`` of row ``g``
    (``e``, ``s`` the same in every lane), ``32 t + 16 e + s`` at ``D = 128``. Unpadded, every lane of such a store
    meets one bank (rows and ``32 t`` both a multiple of 32 words apart); padded, lane ``(g, t)`` meets bank ``4 g + t``
    plus a constant, 32 different ones. The merge reads 32 consecutive elements, consecutive words still
    (``tests/numba_kernels/test_splitkv_mma_kernel.py`` checks both through ``stash_offset.py_func``)."""
    return (warp * group + row) * (head_dim + head_dim // 32) + d + d // 32


def stash_size(group: int, head_dim: int) -> int:
    """The words of the split kernel's ``stash`` (``stash_offset``): ``WARPS * group`` padded rows."""
    return WARPS * group * (head_dim + head_dim // 32)


@cuda.jit(device=True, inline=True)
def tile_shard_range(seq_len, shard, num_splits):
    """Token range ``[start, end)`` of ``shard``: ``fp8lab.simulators.splitkv_mma.shard_bounds``, whole tiles."""
    tiles = (seq_len + TILE - 1) // TILE
    tokens_per_shard = (tiles + num_splits - 1) // num_splits * TILE
    start = min(shard * tokens_per_shard, seq_len)
    return start, min(start + tokens_per_shard, seq_len)


@cuda.jit(device=True, inline=True)
def f16_pair(low, high, scale_log2):
    """F16 bits of ``low * scale_log2`` (low half) and of ``high * scale_log2`` (high half): a query register."""
    return f32_to_f16_bits(low * scale_log2) | (f32_to_f16_bits(high * scale_log2) << uint32(16))


@cuda.jit(device=True, inline=True)
def query_pair(q_rows, row, d, scale_log2):
    """``f16_pair`` of ``q_rows[row, d]`` and ``q_rows[row, d + 1]``."""
    return f16_pair(q_rows[row, d], q_rows[row, d + 1], scale_log2)


@cuda.jit(device=True, inline=True)
def byte_pair(first, second, shift):
    """Byte ``shift / 8`` of ``first`` (low byte) and of ``second`` (high byte): two codes for one conversion."""
    return ((first >> shift) & uint32(0xFF)) | (((second >> shift) & uint32(0xFF)) << uint32(8))


@cuda.jit(device=True, inline=True)
def power_of_two_below(vmax):
    """``(pow, inv)``: ``2^floor(log2 vmax)`` and its inverse from the exponent bits (``(1, 1)`` where they are 0;
    ``inv = 0`` from ``2^127`` on): ``fp8lab.simulators.splitkv_mma.power_of_two_below``."""
    bits = f32_as_u32(vmax) & EXPONENT_BITS
    if bits == uint32(0):
        return float32(1), float32(1)
    inverse = INVERSE_EXPONENT_BITS - bits if bits < INVERSE_EXPONENT_BITS else uint32(0)
    return u32_as_f32(bits), u32_as_f32(uint32(inverse))


@cuda.jit(device=True, inline=True)
def row_max(x):
    """The NaN-propagating max over the 4 lanes of an mma row group (``shfl_xor`` 1 and 2)."""
    x = mathops.nan_max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
    return mathops.nan_max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))


def tile_functions(head_dim: int, wide: bool, load_words):
    """The device functions of one key tile of the decode split kernel: ``load_tile`` (a lane's key and value words,
    scales and which tokens are loaded), ``tile_row`` and ``table_chunk`` (the block table, 32 tiles per load), and
    ``attend_tile`` (the scores' mma chain, the online softmax, ``P V``). ``wide``: rows ``g + 8`` hold queries too;
    ``load_words``: the 128-bit load. Returned as a namespace of ``cuda.jit`` device functions."""
    D = head_dim
    STEPS = D // 16  # k-steps of the scores
    K_WORDS = D // 16  # the lane's key words per token (D / 4 codes)
    V_WORDS = D // 32  # the lane's value words per token (D / 8 codes)
    ROW_WORDS = uint64(D // 4)
    ROWS = 2 if wide else 1  # accumulator rows g (and g + 8) a lane works on

    @cuda.jit(device=True, inline=True)
    def value_word(w, args):
        """The 4 n tiles ``s = 4 w + k`` of ``P V`` whose values are in word ``w`` of the lane's tokens (n tile ``s``:
        head elements ``(D/8) n + s`` of lane group ``n``), into ``acc[4 s : 4 s + 4]``."""
        vw, pa0, pa1, pa2, pa3, corr, pow_, acc = args
        for k in range(4):
            s = 4 * w + k
            shift = uint32(8 * k)
            b0 = e4m3x2_to_f16x2(byte_pair(vw[w], vw[V_WORDS + w], shift))  # tokens 2t, 2t + 1
            b1 = e4m3x2_to_f16x2(byte_pair(vw[2 * V_WORDS + w], vw[3 * V_WORDS + w], shift))  # 8 + 2t, 9 + 2t
            o0, o1, o2, o3 = mma_f16(pa0, pa1, pa2, pa3, b0, b1, float32(0), float32(0), float32(0), float32(0))
            acc[4 * s] = cuda.fma(acc[4 * s], corr[0], o0 * pow_)
            acc[4 * s + 1] = cuda.fma(acc[4 * s + 1], corr[0], o1 * pow_)
            if wide:
                acc[4 * s + 2] = cuda.fma(acc[4 * s + 2], corr[1], o2 * pow_)
                acc[4 * s + 3] = cuda.fma(acc[4 * s + 3], corr[1], o3 * pow_)

    @cuda.jit(device=True, inline=True)
    def softmax_row(r, args):
        """One tile's online-softmax step of row ``g + 8 r``: scores times ``k_scale`` (``-inf`` past the end), the row
        max, ``corr``, ``p``, this lane's ``l``; the F16 weights ``p * (v_scale * inv)`` into ``weights[4 r ..]``."""
        scores, k_scale, v_scale, valid, inv, m, lsum, corr, p, weights = args
        tile_max = float32(-math.inf)
        for u in range(4):
            s_u = scores[4 * r + u] * k_scale[u] if valid[u] else float32(-math.inf)
            scores[4 * r + u] = s_u
            tile_max = mathops.nan_max(tile_max, s_u)
        m_new = mathops.nan_max(m[r], row_max(tile_max))
        corr[r] = float32(1) if m_new == m[r] else mathops.exp2_flush(m[r] - m_new)
        for u in range(4):
            p[u] = mathops.exp2_flush(scores[4 * r + u] - m_new) if valid[u] else float32(0)
            weights[4 * r + u] = f32_to_f16_bits(p[u] * (v_scale[u] * inv))
        lsum[r] = cuda.fma(lsum[r], corr[r], (p[0] + p[1]) + (p[2] + p[3]))
        m[r] = m_new

    value_tiles = unrolled(value_word, V_WORDS)  # straight-line code: acc stays in registers
    softmax_rows = unrolled(softmax_row, ROWS)

    @cuda.jit(device=True, inline=True)
    def load_tile(k_words, v_words, k_scales, v_scales, row0, tile0, end, g, t, kw, vw, k_scale, v_scale, valid):
        """The lane's share of the tile ``[tile0, tile0 + 16)`` whose first token is cache row ``row0``: key words of
        tokens ``g``, ``8 + g``; value words, scales and whether it is in the shard for tokens ``u = 0..3`` (token
        ``2t + (u & 1) + 8 (u >> 1)``). Tokens past ``end`` load nothing: zero codes, ``k_scale`` 1, ``v_scale`` 0."""
        for half in range(2):
            if tile0 + 8 * half + g < end:
                first = (row0 + uint64(8 * half + g)) * ROW_WORDS + uint64(K_WORDS * t)
                for i in range(K_WORDS // 4):
                    w0, w1, w2, w3 = load_words(k_words, first + uint64(4 * i))
                    kw[half * K_WORDS + 4 * i] = w0
                    kw[half * K_WORDS + 4 * i + 1] = w1
                    kw[half * K_WORDS + 4 * i + 2] = w2
                    kw[half * K_WORDS + 4 * i + 3] = w3
            else:
                for i in range(K_WORDS):
                    kw[half * K_WORDS + i] = uint32(0)
        for u in range(4):
            j = 2 * t + (u & 1) + 8 * (u >> 1)
            valid[u] = 1 if tile0 + j < end else 0
            if valid[u]:
                row = row0 + uint64(j)
                first = row * ROW_WORDS + uint64(V_WORDS * g)
                for i in range(V_WORDS // 4):
                    w0, w1, w2, w3 = load_words(v_words, first + uint64(4 * i))
                    vw[u * V_WORDS + 4 * i] = w0
                    vw[u * V_WORDS + 4 * i + 1] = w1
                    vw[u * V_WORDS + 4 * i + 2] = w2
                    vw[u * V_WORDS + 4 * i + 3] = w3
                k_scale[u] = k_scales[row]
                v_scale[u] = v_scales[row]
            else:
                for i in range(V_WORDS):
                    vw[u * V_WORDS + i] = uint32(0)
                k_scale[u] = float32(1)
                v_scale[u] = float32(0)

    @cuda.jit(device=True, inline=True)
    def tile_row(lane_block, tile, start, block_size, rows_per_block, kv_row):
        """Cache row of tile ``tile``'s first token, its block read from lane ``tile % 32``'s ``lane_block``."""
        tile0 = start + TILE * tile
        block = cuda.shfl_sync(FULL_MASK, lane_block, tile % WARP_SIZE)
        return uint64(block * rows_per_block + kv_row + tile0 % block_size)

    @cuda.jit(device=True, inline=True)
    def table_chunk(table, start, end, block_size, first_tile, lane):
        """Lane ``i`` reads the block of tile ``first_tile + i`` (0 past the shard): 32 tiles' blocks in one load."""
        tile0 = start + TILE * (first_tile + lane)
        return table[tile0 // block_size] if tile0 < end else 0

    @cuda.jit(device=True, inline=True)
    def attend_tile(qa, kw, vw, k_scale, v_scale, valid, m, lsum, corr, p, scores, weights, acc):
        """One loaded tile: the scores (two 8-token n tiles, ``D / 16`` k-steps each), the online softmax of each row
        with the V scales relative to the tile's largest, then ``P V`` into ``acc``."""
        for half in range(2):
            c0 = c1 = c2 = c3 = float32(0)
            for s in range(STEPS):
                word = kw[half * K_WORDS + s]
                b0 = e4m3x2_to_f16x2(word & uint32(0xFFFF))
                b1 = e4m3x2_to_f16x2(word >> uint32(16))
                c0, c1, c2, c3 = mma_f16(qa[4 * s], qa[4 * s + 1], qa[4 * s + 2], qa[4 * s + 3], b0, b1,
                                         c0, c1, c2, c3)
            scores[2 * half] = c0
            scores[2 * half + 1] = c1
            scores[4 + 2 * half] = c2
            scores[4 + 2 * half + 1] = c3

        vmax = mathops.nan_max(mathops.nan_max(v_scale[0], v_scale[1]), mathops.nan_max(v_scale[2], v_scale[3]))
        pow_, inv = power_of_two_below(row_max(vmax))
        softmax_rows((scores, k_scale, v_scale, valid, inv, m, lsum, corr, p, weights))

        # P V: one mma per n tile s (head elements (D/8) n + s of the lane group n)
        pa0 = weights[0] | (weights[1] << uint32(16))
        pa1 = weights[4] | (weights[5] << uint32(16))
        pa2 = weights[2] | (weights[3] << uint32(16))
        pa3 = weights[6] | (weights[7] << uint32(16))
        value_tiles((vw, pa0, pa1, pa2, pa3, corr, pow_, acc))

    return SimpleNamespace(load_tile=load_tile, tile_row=tile_row, table_chunk=table_chunk, attend_tile=attend_tile)


def split_kernel_function(head_dim: int, group: int, bf16_out: bool = False, with_input: bool = False):
    """The Python source of the split kernel for one head size, query heads per kv head and output format.

    Arguments: ``q, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, scale_log2, num_kv_heads,
    block_size, num_splits, workspace, out``: the caches flat as uint32 words and their scales flat
    (``splitkv.flat_cache``: row ``(block * num_kv_heads + kv_head) * block_size + offset``). Launch
    ``[(num_seqs, num_kv_heads, num_splits), THREADS]`` (4 warps). ``out`` is written only when ``num_splits == 1``.

    ``with_input``: the kernel of ``decode_mma_with_input``, whose arguments begin ``q_in, k_in, v_in, q_norm, k_norm,
    eps, positions, cos_sin, k_cache, v_cache, k_scale, v_scale`` (the attention input, as
    ``attention_input.qk_norm_rope_cache_write`` takes it, and the caches it writes) in place of ``q``.
    """
    D, G = head_dim, group
    STEPS = D // 16  # k-steps of the scores; the lane's key words per token
    K_WORDS = D // 16
    V_WORDS = D // 32  # the lane's value words per token
    NTILES = D // 8  # n tiles of P V
    WIDE = G > 8  # rows g + 8 hold query heads too
    ROWS = 2 if WIDE else 1  # accumulator rows g (and g + 8) a lane works on
    AHEAD = 1 if WIDE else 2  # tiles a warp has loading while it computes one (a wide group has no registers for 2)
    QUERY_WORDS, ACC_SIZE = 4 * STEPS, 4 * NTILES  # local array sizes must be plain constants
    STASH_SIZE = stash_size(G, D)  # the warps' partials in shared memory, padded (stash_offset)
    KEY_WORDS, VALUE_WORDS = 2 * K_WORDS, 4 * V_WORDS
    store = output_store(bf16_out)
    # a CTA that writes the new token reads it back: the coherent load (the non-coherent path may hold a stale line)
    load_words = load_u32x4_coherent if with_input else load_u32x4
    head_rows = head_row_functions(D, "fp8")  # the attention input's warp functions (with_input)
    HEAD_ELEMENTS, load_row, store_row, write_row = (head_rows.elements, head_rows.load_row, head_rows.store_row,
                                                     head_rows.write_row)
    load_weights, load_rotation, norm_rope = head_rows.load_weights, head_rows.load_rotation, head_rows.norm_rope
    tiles_of = tile_functions(D, WIDE, load_words)
    load_tile, tile_row, table_chunk, attend_tile = (tiles_of.load_tile, tiles_of.tile_row, tiles_of.table_chunk,
                                                     tiles_of.attend_tile)

    @cuda.jit(device=True, inline=True)
    def stash_index(warp, row, d):
        """``stash_offset`` for this kernel's group and head size."""
        return stash_offset(warp, row, d, G, D)

    @cuda.jit(device=True, inline=True)
    def stash_word(w, args):
        """Row ``r``'s elements of n tiles ``4 w .. 4 w + 3`` of this warp's ``acc`` into the CTA's shared ``stash``."""
        stash, warp, row, t, r, acc = args
        for k in range(4):
            for e in range(2):
                s = 4 * w + k
                stash[stash_index(warp, row, (D // 8) * (2 * t + e) + s)] = acc[4 * s + 2 * r + e]

    @cuda.jit(device=True, inline=True)
    def finish_row(r, args):
        """Row ``g + 8 r`` of this warp: ``l`` over its four lanes, ``(l_0 + l_1) + (l_2 + l_3)``; the warp's ``(m, l,
        acc)`` into the CTA's shared arrays, where the merge reads them."""
        stash_m, stash_l, stash, warp, g, t, m, lsum, acc = args
        l = lsum[r] + cuda.shfl_xor_sync(FULL_MASK, lsum[r], 1)
        l += cuda.shfl_xor_sync(FULL_MASK, l, 2)
        row = g + 8 * r
        if row < G:
            stash_words((stash, warp, row, t, r, acc))
            if t == 0:
                stash_m[warp, row] = m[r]
                stash_l[warp, row] = l

    stash_words = unrolled(stash_word, V_WORDS)
    finish_rows = unrolled(finish_row, ROWS)


    @cuda.jit(device=True, inline=True)
    def query_registers(q_rows, row0, g, t, scale_log2, qa):
        """The A registers of the scores, per k-step: rows ``g`` (and ``g + 8``) are query rows ``row0 + g`` (``+ 8``)
        of ``q_rows [heads, D]``, as F16 pairs of ``q * scale_log2``; rows past the group are 0."""
        for s in range(STEPS):
            d = (D // 4) * t + 4 * s
            qa[4 * s] = query_pair(q_rows, row0 + g, d, scale_log2) if g < G else uint32(0)
            qa[4 * s + 2] = query_pair(q_rows, row0 + g, d + 2, scale_log2) if g < G else uint32(0)
            if WIDE and g + 8 < G:
                qa[4 * s + 1] = query_pair(q_rows, row0 + g + 8, d, scale_log2)
                qa[4 * s + 3] = query_pair(q_rows, row0 + g + 8, d + 2, scale_log2)
            else:
                qa[4 * s + 1] = uint32(0)
                qa[4 * s + 3] = uint32(0)

    @cuda.jit(device=True, inline=True)
    def load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size, rows_per_block, kv_row,
                        tile, g, t, kw, vw, k_scale, v_scale, valid):
        """The loads of tile ``tile`` of the shard (its block from ``lane_block``, which must hold its 32-tile chunk)."""
        load_tile(k_words, v_words, k_scales, v_scales,
                  tile_row(lane_block, tile, start, block_size, rows_per_block, kv_row), start + TILE * tile, end,
                  g, t, kw, vw, k_scale, v_scale, valid)

    @cuda.jit(device=True, inline=True)
    def attend_shard(qa, k_words, v_words, k_scales, v_scales, table, lane_block, start, end, block_size, num_kv_heads,
                     kv, seq, shard, num_splits, workspace, out, warp, lane, g, t, kw, vw, k_scale, v_scale, valid):
        """This warp's tiles of the shard (``warp``, ``warp + 4``, ...; the first one's loads already issued into
        ``kw``, ``vw``, ...), then the CTA's merge of its warps and the shard's partial (or ``out``)."""
        head0 = kv * G
        m = cuda.local.array(2, float32)  # rows g, g + 8
        lsum = cuda.local.array(2, float32)  # this lane's share of l
        corr = cuda.local.array(2, float32)
        weights = cuda.local.array(8, uint32)  # F16 bits, [row r][u]
        acc = cuda.local.array(ACC_SIZE, float32)  # [n tile][c0, c1, c2, c3]
        for r in range(2):
            m[r] = float32(-math.inf)
            lsum[r] = float32(0)
            corr[r] = float32(1)
        for i in range(ACC_SIZE):
            acc[i] = float32(0)
        for i in range(8):
            weights[i] = uint32(0)  # rows g + 8 stay 0 unless G > 8

        # The warp's next AHEAD tiles load while this one computes: the next one's registers, then the one after.
        next_kw = cuda.local.array(KEY_WORDS, uint32)
        next_vw = cuda.local.array(VALUE_WORDS, uint32)
        next_k_scale = cuda.local.array(4, float32)
        next_v_scale = cuda.local.array(4, float32)
        next_valid = cuda.local.array(4, types.int32)
        after_kw = cuda.local.array(KEY_WORDS, uint32)
        after_vw = cuda.local.array(VALUE_WORDS, uint32)
        after_k_scale = cuda.local.array(4, float32)
        after_v_scale = cuda.local.array(4, float32)
        after_valid = cuda.local.array(4, types.int32)
        p = cuda.local.array(4, float32)
        scores = cuda.local.array(8, float32)  # [row r][u]

        rows_per_block = num_kv_heads * block_size
        kv_row = kv * block_size
        tiles = (end - start + TILE - 1) // TILE
        if AHEAD == 2 and warp + WARPS < tiles:  # the warp's second tile (in the first 32: lane_block has its block)
            load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size, rows_per_block,
                            kv_row, warp + WARPS, g, t, next_kw, next_vw, next_k_scale, next_v_scale, next_valid)
        for tile in range(warp, tiles, WARPS):  # this warp's tiles: warp, warp + 4, ...
            ahead = tile + AHEAD * WARPS
            if ahead < tiles:  # the loads of the tile AHEAD steps ahead go out before this tile's arithmetic
                if ahead // WARP_SIZE != (ahead - WARPS) // WARP_SIZE:
                    lane_block = table_chunk(table, start, end, block_size, ahead - ahead % WARP_SIZE, lane)
                if AHEAD == 2:
                    load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size,
                                    rows_per_block, kv_row, ahead, g, t, after_kw, after_vw, after_k_scale,
                                    after_v_scale, after_valid)
                else:
                    load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size,
                                    rows_per_block, kv_row, ahead, g, t, next_kw, next_vw, next_k_scale,
                                    next_v_scale, next_valid)

            attend_tile(qa, kw, vw, k_scale, v_scale, valid, m, lsum, corr, p, scores,
                        weights, acc)
            # The moves of the tile after the next read registers whose loads went out at this step's start. ptxas
            # would schedule them into this tile's arithmetic, where the warp then waits for those loads; OR-ing in
            # `late` (0: `end` is below 2^31) ties them to this tile's last result, after the arithmetic.
            late = f32_as_u32(acc[ACC_SIZE - 3]) & (uint32(end) >> uint32(31))
            for i in range(KEY_WORDS):  # the next tile becomes this one, the one after the next (register moves)
                kw[i] = next_kw[i]
                if AHEAD == 2:
                    next_kw[i] = after_kw[i] | late
            for i in range(VALUE_WORDS):
                vw[i] = next_vw[i]
                if AHEAD == 2:
                    next_vw[i] = after_vw[i] | late
            for u in range(4):
                k_scale[u] = next_k_scale[u]
                v_scale[u] = next_v_scale[u]
                valid[u] = next_valid[u]
                if AHEAD == 2:
                    next_k_scale[u] = u32_as_f32(f32_as_u32(after_k_scale[u]) | late)
                    next_v_scale[u] = u32_as_f32(f32_as_u32(after_v_scale[u]) | late)
                    next_valid[u] = after_valid[u] | types.int32(late)

        stash_m = cuda.shared.array((WARPS, G), float32)
        stash_l = cuda.shared.array((WARPS, G), float32)
        stash = cuda.shared.array(STASH_SIZE, float32)
        finish_rows((stash_m, stash_l, stash, warp, g, t, m, lsum, acc))
        cuda.syncthreads()

        # The CTA's partial: the warps' merged in warp order (splitkv's merge rule); thread i takes elements i, i + 128, ...
        for element in range(cuda.threadIdx.x, G * D, THREADS):
            row, d = element // D, element % D
            m_star = stash_m[0, row]
            for w in range(1, WARPS):
                m_star = mathops.nan_max(m_star, stash_m[w, row])
            l_sum = float32(0)
            acc_sum = float32(0)
            for w in range(WARPS):
                weight = merge_weight(stash_m[w, row], m_star)
                l_sum = cuda.fma(weight, stash_l[w, row], l_sum)
                acc_sum = cuda.fma(weight, stash[stash_index(w, row, d)], acc_sum)
            head = head0 + row
            if num_splits == 1:
                store(out, seq, head, d, normalized(acc_sum, l_sum))
            else:
                workspace[seq, head, shard, d] = acc_sum
                if d == 0:
                    workspace[seq, head, shard, D] = m_star
                    workspace[seq, head, shard, D + 1] = l_sum

    def split_kernel(q, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, scale_log2, num_kv_heads,
                     block_size, num_splits, workspace, out):
        pdl.prologue()  # the cache write and q come from the kernels before: wait for them
        seq, kv, shard = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        g, t = lane >> 2, lane & 3
        start, end = tile_shard_range(seq_lens[seq], shard, num_splits)
        qa = cuda.local.array(QUERY_WORDS, uint32)
        query_registers(q[seq], kv * G, g, t, scale_log2, qa)
        kw = cuda.local.array(KEY_WORDS, uint32)
        vw = cuda.local.array(VALUE_WORDS, uint32)
        k_scale = cuda.local.array(4, float32)
        v_scale = cuda.local.array(4, float32)
        valid = cuda.local.array(4, types.int32)
        table = block_tables[seq]
        lane_block = table_chunk(table, start, end, block_size, 0, lane)
        if warp < (end - start + TILE - 1) // TILE:
            load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size,
                            num_kv_heads * block_size, kv * block_size, warp, g, t, kw, vw, k_scale, v_scale, valid)
        attend_shard(qa, k_words, v_words, k_scales, v_scales, table, lane_block, start, end, block_size, num_kv_heads,
                     kv, seq, shard, num_splits, workspace, out, warp, lane, g, t, kw, vw, k_scale, v_scale, valid)

    def split_kernel_with_input(q_in, k_in, v_in, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, k_scale_out,
                                v_scale_out, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, scale_log2,
                                num_kv_heads, block_size, num_splits, workspace, out):
        seq, kv, shard = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        warp, lane = cuda.threadIdx.x // WARP_SIZE, cuda.threadIdx.x % WARP_SIZE
        g, t = lane >> 2, lane & 3
        length = seq_lens[seq]
        start, end = tile_shard_range(length, shard, num_splits)
        writer = start < end and end == length  # the shard holding the new token (position length - 1) writes it
        tiles = (end - start + TILE - 1) // TILE
        kw = cuda.local.array(KEY_WORDS, uint32)
        vw = cuda.local.array(VALUE_WORDS, uint32)
        k_scale = cuda.local.array(4, float32)
        v_scale = cuda.local.array(4, float32)
        valid = cuda.local.array(4, types.int32)
        table = block_tables[seq]
        rows_per_block, kv_row = num_kv_heads * block_size, kv * block_size
        # Before the wait: the block table (copied in before the step) and every first tile but the new token's,
        # which earlier steps wrote. Every kernel waits for its predecessor before it lets the next one launch
        # (pdl.prologue), so when this kernel runs, everything but the q/k/v GEMM before it is complete.
        lane_block = table_chunk(table, start, end, block_size, 0, lane)
        early = warp < tiles and not (writer and warp == tiles - 1)
        if early:
            load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size, rows_per_block,
                            kv_row, warp, g, t, kw, vw, k_scale, v_scale, valid)
        # and what the attention input reads besides q, k and v: the norm weights, the position and its cos/sin (the
        # position's load and then the table's were two round trips after the wait, in every task)
        q_weights = cuda.local.array(HEAD_ELEMENTS, float32)
        k_weights = cuda.local.array(HEAD_ELEMENTS, float32)
        cos = cuda.local.array(HEAD_ELEMENTS, float32)
        sin = cuda.local.array(HEAD_ELEMENTS, float32)
        load_weights(q_norm, lane, q_weights)
        if writer:
            load_weights(k_norm, lane, k_weights)
        in_table = load_rotation(positions, cos_sin, seq, lane, cos, sin)
        pdl.prologue()  # q, k and v come from the GEMM before: wait for it

        # The attention input (attention_input's warp functions, bit for bit): task i < G is query head kv G + i, normed
        # and rotated into shared memory; task G, in the writing CTA, the new token's k (normed, rotated) and v into
        # the cache at position length - 1. Warp w takes tasks w, w + 4, ...
        q_rows = cuda.shared.array((1, G, D), float32)
        stage = cuda.shared.array(D, float32)  # unused: D = 128 keeps each RoPE pair in one lane
        values = cuda.local.array(HEAD_ELEMENTS, float32)
        n = float32(k_cache.shape[3])  # D at run time: the norm divides as rms_norm does
        for task in range(warp, G + 1, WARPS):
            if task < G:
                norm_rope(q_in, q_weights, eps, n, cos, sin, in_table, seq, kv * G + task, lane, values, stage)
                store_row(q_rows, 0, task, lane, values)
            elif writer:
                v_values = cuda.local.array(HEAD_ELEMENTS, float32)
                load_row(v_in, seq, kv, lane, v_values)
                norm_rope(k_in, k_weights, eps, n, cos, sin, in_table, seq, kv, lane, values, stage)
                position = length - 1
                block, offset = table[position // block_size], position % block_size
                write_row(values, k_cache, k_scale_out, block, kv, offset, lane)
                write_row(v_values, v_cache, v_scale_out, block, kv, offset, lane)
        cuda.syncthreads()  # the queries and the new token's K/V are visible to the CTA

        if warp < tiles and not early:
            load_shard_tile(k_words, v_words, k_scales, v_scales, lane_block, start, end, block_size, rows_per_block,
                            kv_row, warp, g, t, kw, vw, k_scale, v_scale, valid)
        qa = cuda.local.array(QUERY_WORDS, uint32)
        query_registers(q_rows[0], 0, g, t, scale_log2, qa)
        attend_shard(qa, k_words, v_words, k_scales, v_scales, table, lane_block, start, end, block_size, num_kv_heads,
                     kv, seq, shard, num_splits, workspace, out, warp, lane, g, t, kw, vw, k_scale, v_scale, valid)

    return split_kernel_with_input if with_input else split_kernel




@functools.lru_cache(maxsize=None)
def _split_kernel(head_dim: int, group: int, bf16_out: bool = False, with_input: bool = False):
    """The compiled split kernel of one variant, compiled once per process."""
    return cuda.jit(split_kernel_function(head_dim, group, bf16_out, with_input))


def _checked_call(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale, v_scale, num_splits,
                  workspace, kv_format, max_seq_len):
    """``splitkv.check_decode``'s checks, then this kernel's: a cache it takes (``supports``), the split count ``"auto"``
    picks here and a workspace of the right shape; returns ``(call, workspace)`` (a placeholder for one shard)."""
    call = check_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale, v_scale, None,
                        1 if isinstance(num_splits, str) and num_splits == "auto" else num_splits, None, max_seq_len,
                        kv_format)
    num_seqs, num_heads, head_dim = call.q.shape
    group = num_heads // call.num_kv_heads
    if not supports(head_dim, group, call.block_size, call.cache_format == "fp8", False):
        raise ValueError(f"k_cache: the tensor-core decode attention takes an FP8 cache, head_dim in {HEAD_DIMS}, at "
                         f"most {MAX_GROUP} query heads per kv head and a block size that is a multiple of {TILE}; got "
                         f"a {call.cache_format} cache, head_dim {head_dim}, {group} heads per kv head, block size "
                         f"{call.block_size}")
    if isinstance(num_splits, str):
        call = dataclasses.replace(call, num_splits=choose_num_splits(num_seqs, call.num_kv_heads, call.max_seq_len,
                                                                      device_num_sms()))
    if workspace is None:
        workspace = decode_workspace(num_seqs, num_heads, head_dim, call.num_splits) if call.num_splits > 1 else None
    if workspace is not None:
        shape = tuple(workspace.shape)
        if len(shape) != 4 or shape[:2] != (num_seqs, num_heads) or shape[2] < call.num_splits or shape[3] != head_dim + 2 \
                or np.dtype(workspace.dtype) != np.float32:
            raise ValueError(f"workspace: expected float32 [{num_seqs}, {num_heads}, >= {call.num_splits}, {head_dim + 2}] "
                             f"(splitkv.decode_workspace), got {workspace.dtype} {shape}")
    else:
        workspace = placeholder(4)  # one shard: the kernel writes out itself and never reads this
    return call, workspace


def _launch(call, workspace, input_arrays, stream) -> None:
    """The split kernel, then the combine; ``input_arrays``: the attention input's arrays, which the kernel with its
    input takes first, or None (the queries ``call.q``)."""
    num_seqs, num_heads, head_dim = call.q.shape
    with_input = input_arrays is not None
    device = [on_device(x, stream) for x in (*(input_arrays if with_input else (call.q,)), call.k_words, call.v_words, call.k_scales, call.v_scales,
                                             call.block_tables, call.seq_lens)]
    out_device = on_device(call.out, stream)
    workspace_device = on_device(workspace, stream)
    kernel = _split_kernel(head_dim, num_heads // call.num_kv_heads, call.bf16_out, with_input)
    pdl.launch(kernel, (num_seqs, call.num_kv_heads, call.num_splits), THREADS, stream, *device, call.scale_log2,
               call.num_kv_heads, call.block_size, call.num_splits, workspace_device, out_device)
    combine_and_return(call, workspace_device, out_device, stream)


def paged_decode_mma(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale=None, v_scale=None,
                     num_splits="auto", workspace=None, *, kv_format=None, max_seq_len=None, stream=0):
    """Decode attention of one query token per sequence over a paged FP8 cache on tensor cores, into ``out``;
    returns ``out``.

    Arguments as ``fp8lab.numba_kernels.splitkv.paged_decode`` (and checked by it: ``check_decode``), without
    ``alibi_slopes``; the cache must be one this kernel takes (``fp8lab.simulators.splitkv_mma.supports``: FP8,
    ``head_dim`` 128, at most 16 query heads per kv head, a block size that is a multiple of 16), else a
    ``ValueError`` that says which. ``num_splits="auto"`` is ``fp8lab.simulators.splitkv_mma.choose_num_splits``
    for this GPU (4-warp CTAs, one per SM, at most 32 shards); ``workspace`` as ``splitkv.decode_workspace``.
    """
    call, workspace = _checked_call(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale, v_scale,
                                    num_splits, workspace, kv_format, max_seq_len)
    if call.q.shape[0] and call.q.shape[1]:
        _launch(call, workspace, None, stream)
    return out


def decode_mma_with_input(q, k, v, q_norm, k_norm, eps, positions, cos_sin, k_cache, v_cache, block_tables, seq_lens,
                          softmax_scale, out, k_scale=None, v_scale=None, num_splits="auto", workspace=None, *,
                          kv_format=None, max_seq_len=None, stream=0):
    """A decode step's attention with its input, in one split kernel (and the combine): bit for bit
    ``attention_input.qk_norm_rope_cache_write`` of the new tokens, then ``paged_decode_mma``; returns ``out``.

    ``q [S, Hq * D]``, ``k``, ``v [S, Hkv * D]``: the step's q/k/v GEMM output, one row per sequence, as
    ``qk_norm_rope_cache_write`` takes them (C-contiguous or column slices of the fused output), with ``q_norm``,
    ``k_norm``, ``eps``, ``positions [S]`` (RoPE's) and ``cos_sin``. The new token of sequence ``s`` is its position
    ``seq_lens[s] - 1``: its normed, rotated k and its v are written into the cache slot that ``block_tables[s]`` gives
    that position (a row of length 0 writes nothing), by the CTA whose shard holds it, which then reads it back;
    every CTA norms and rotates its kv head's queries itself. The rest as ``paged_decode_mma``; ``out``'s shape
    ``[S, Hq, D]`` is the queries'. The normed queries are not stored anywhere.

    Why: the attention input as a launch of its own costs a decode step one kernel boundary per layer (3.5 us at the
    Qwen3-0.6B shape, ``bench/RESULTS.md``); here each CTA also issues its first tile's loads before it waits for the
    GEMM (the tiles are earlier steps' and the cache is written by this kernel only at the new token).
    """
    out = as_kernel_array("out", out)
    names = ("q", "k", "v", "q_norm", "k_norm", "positions", "cos_sin")
    q, k, v, q_norm, k_norm, positions, cos_sin = (as_kernel_array(n, x) for n, x in
                                                   zip(names, (q, k, v, q_norm, k_norm, positions, cos_sin)))
    # The kernel writes the caches and reads them as flat words: one device copy of each (a NumPy cache is copied in,
    # then back, in the CUDA simulator too, which would otherwise copy the cache and its word view apart), whose word
    # views check_decode makes.
    hosts = [None if x is None else as_kernel_array(n, x) for n, x in
             (("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale), ("v_scale", v_scale))]
    k_cache, v_cache, k_scale, v_scale = devices = [cuda.to_device(x, stream=stream) if isinstance(x, np.ndarray) else x
                                                    for x in hosts]
    queries = np.broadcast_to(np.float32(0), tuple(out.shape))  # the shape check_decode wants of q: out's
    call, workspace = _checked_call(queries, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale,
                                    v_scale, num_splits, workspace, kv_format, max_seq_len)
    num_seqs, num_heads, head_dim = call.q.shape
    check_head_inputs(q, k, v, q_norm, k_norm, positions, cos_sin, num_seqs, num_heads, call.num_kv_heads, head_dim)
    if num_seqs and num_heads:
        inputs = (host_contiguous(q), host_contiguous(k), host_contiguous(v), q_norm, k_norm, np.float32(eps), positions,
                  cos_sin, k_cache, v_cache, k_scale, v_scale)
        _launch(call, workspace, inputs, stream)
        for host, device in zip(hosts, devices):
            if device is not host:
                device.copy_to_host(host, stream=stream)
    return out


def kernel_variants():
    """``(name, python function, numba signature)`` of the variants the PTX check compiles: 4 query heads per kv head
    with float32 out; 16 (rows ``g + 8`` in use) with BF16 out and the attention input (the q/k/v GEMM output as
    column slices: layout "A")."""
    f32 = types.float32
    words = types.Array(types.uint32, 1, "C")
    f32_1d, f32_2d, f32_3d = (types.Array(f32, d, "C") for d in (1, 2, 3))
    columns = types.Array(f32, 2, "A")
    cache = types.Array(types.uint8, 4, "C")
    input_arguments = (columns, columns, columns, f32_1d, f32_1d, f32, types.Array(types.int32, 1, "C"), f32_2d,
                       cache, cache, f32_3d, f32_3d)

    def signature(bf16_out: bool, with_input: bool):
        out = types.Array(types.uint16 if bf16_out else f32, 3, "C")
        return types.void(*(input_arguments if with_input else (f32_3d,)), words, words, f32_1d, f32_1d,
                          types.Array(types.int32, 2, "C"), types.Array(types.int32, 1, "C"), f32, types.int64,
                          types.int64, types.int64, types.Array(f32, 4, "C"), out)

    shapes = ((128, 4, False, False), (128, 16, True, True))
    return [(f"split_mma[head_dim={d}, group={g}{', out=bf16' if b else ''}{', with input' if w else ''}]",
             split_kernel_function(d, g, b, w), signature(b, w)) for d, g, b, w in shapes]
