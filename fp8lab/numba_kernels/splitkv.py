"""Split-kv (flash-decoding) paged decode attention over an FP8 or float KV cache, as Numba CUDA kernels.

Computes ``fp8lab.reference.attention.paged_decode``. Launch: ``split_kernel`` grid ``(num_seqs,
num_heads / H, num_splits)`` x 128 threads, then (``num_splits > 1``) ``combine_kernel`` grid
``(num_seqs, num_heads)`` x ``head_dim``. Checked (``tests/numba_kernels/test_splitkv_kernel.py``): bit for bit
against ``fp8lab.simulators.splitkv`` in the CUDA simulator, against the oracle by an error bound on a GPU.
The launch plan (heads per CTA, the ``"auto"`` split count, shards, lanes and slots) is the simulator's,
imported from it: the contract fixes it. The arithmetic a CTA does per token is written out here.

What it computes (the contract of ``fp8lab.reference.attention.paged_decode``): for each sequence and query
head ``h``, softmax attention of the new token's query ``q[seq, h]`` over the sequence's
``seq_lens[seq]`` cached tokens, reading kv head ``h // (num_heads // num_kv_heads)`` (GQA), with an
optional ALiBi bias ``slope_h * (j - (L - 1))``; ``out[num_seqs, num_heads, head_dim]``, and a zero
row for a sequence of length 0. ``out`` is float32, or uint16: BF16 bit patterns, each element the
float32 result rounded to nearest even by ``mathops.f32_to_bf16_bits_rne`` as it is stored (bit for bit
the float32 call followed by ``layers.bf16_round``, without that launch: the o_proj FP8 tensor-core
GEMM reads BF16 input). A zero row is BF16 zeros, a NaN stays a NaN.

How: exactly the schedule of ``fp8lab.simulators.splitkv`` (read its docstring first), in the same float32
operations in the same order, so that in the CUDA simulator the kernels match
``fp8lab.simulators.splitkv.shard_partials`` and ``paged_decode`` bit for bit, and on a GPU they differ from
it only through ``exp2`` (``fp8lab.numba_kernels.mathops``); GPU results are checked against
``fp8lab.reference.attention`` with an error bound. Both checks are in ``tests/numba_kernels/test_splitkv_kernel.py``.

Kernels and launch shapes:

1. ``split_kernel``, grid ``(num_seqs, num_heads / H, num_splits)``, 128 threads = 4 warps per CTA,
   ``H = heads_per_cta(num_heads / num_kv_heads, num_seqs * max_seq_len)`` query heads sharing one kv
   head (for Qwen3-8B's 32/8: 1 at short contexts, 4 at long ones). The CTA takes shard ``blockIdx.z``
   of the sequence (``shard_range``: whole KV blocks). A token is read by ``lanes_per_token =
   head_dim / 16`` lanes, lane ``r`` of them owning elements ``[16 r, 16 r + 16)``: for an FP8 cache
   one 128-bit load of 16 codes (two for BF16, four for float32). The CTA's ``num_slots`` groups of
   lanes (16 at head_dim 128: 4 tokens per warp) each take the shard's tokens ``start + slot, start + slot + num_slots, ...``. Per token: dequantize on
   load (E4M3 by the hardware conversion ``cvt.rn.f16x2.e4m3x2``, two codes per instruction, NaN codes
   NaN; BF16 by a shift), for each of the ``H``
   heads the lane's 16-fma chain with the query (pre-scaled by ``softmax_scale * log2(e)``), a ``shfl_xor`` butterfly over the slot's lanes, the per-token ``k_scale``, the ALiBi fma;
   then one step of the log2-domain online softmax per head (``corr = 1`` when the max holds). Each
   K and V row is loaded and decoded once for the ``H`` heads. The slots' states merge through
   shared memory in slot order. The CTA writes its shard's partial ``(m, l, acc)`` per head to the
   workspace; with ``num_splits == 1`` it writes ``out = acc / l`` directly (bit-identical to a
   combine of one shard) and no combine kernel runs.
   Whichever kernel writes ``out`` writes it in ``out``'s format (float32, or BF16 bits rounded once
   from the float32 value: ``store_float32``, ``store_bf16``).
2. ``combine_kernel``, grid ``(num_seqs, num_heads)``, ``head_dim`` threads (thread ``d`` owns
   element ``d``): merge the ``num_splits`` partials in shard order and write ``acc / l``; ``l = 0``
   (nothing attended) gives a zero row, never NaN.

Every shard always writes its partial, an empty shard (and every shard of a length-0 sequence) the
neutral element ``(-inf, 0, 0)``: nothing stale from an earlier call survives in the workspace or in
``out``.

Memory-level parallelism without changing the arithmetic: a slot loads its next ``U`` tokens
(``LaneLayout.tokens_in_flight``: 4 for FP8, 2 for BF16, 1 for float32, about 32 registers of K and
V words) before it computes any of them, computes their ``U * H`` scores (independent chains and
butterflies, no branch between them), then runs the softmax updates one token at a time in token
order, all heads without a branch. Full groups run without per-token tests; the shard's last group
runs the same code with guards.

Where the time goes (measurements: ``bench/RESULTS.md``, ``bench/attention_parts.py``): the split kernel
is bound by instruction issue and latency rather than memory. The next step is tensor cores for the
scores and ``P V`` (``mma`` with K and V decoded by bit placement), which changes the summation order
the simulator fixes.

Caches: ``[num_blocks, num_kv_heads, block_size, head_dim]`` of uint8 E4M3 codes with float32 scales
``[num_blocks, num_kv_heads, block_size]`` (``fp8lab.reference.kv_cache``; no scales is an error, never a
fallback), float32, or uint16 BF16 patterns, 16-byte aligned on the device. ``head_dim``: 32, 64,
128 or 256. ``q``: float32; ``out``: float32 or uint16 (BF16 bits), its dtype choosing the output
format. Variants: one split kernel per (cache format, head_dim, heads per CTA, output format) and one
combine kernel per output format, compiled on first use; ``kernel_variants()`` lists the ones
``tests/numba_kernels/test_kernels_compile.py`` compiles to sm_90 PTX.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, types, uint32, uint64

from fp8lab.reference.checks import check_block_tables
from fp8lab.reference.kv_cache import KV_CACHE_FORMATS, kv_cache_format
from fp8lab.simulators.splitkv import (
    ELEMENTS_PER_LANE,
    MAX_HEADS_PER_CTA,
    MAX_SPLITS_PER_HEAD,
    NUM_SMS,
    NUM_WARPS,
    choose_num_splits,
    heads_per_cta,
    lanes_per_token,
    num_slots,
)

from . import mathops, pdl
from .arguments import (
    as_kernel_array,
    overlaps,
    reject,
    require_c_contiguous,
    require_load_alignment,
)
from .bits import SIMULATOR, u32_as_f32
from .dequantize import decoded_codes
from .kv_cache import check_cache, on_device, placeholder, to_host
from .warp import FULL_MASK, WARP_SIZE, WORDS_PER_LOAD, load_u32x4

THREADS_PER_CTA = NUM_WARPS * WARP_SIZE
HEAD_DIMS = (32, 64, 128, 256)
"""Supported head sizes: ``head_dim / 16`` lanes read a token, a power of two from 2 to 16."""
LOG2E = math.log2(math.e)
LOG2E_F32 = float32(LOG2E)
"""``log2(e)`` rounded once to float32: ALiBi slopes are scaled by it (``slope2 = slope * LOG2E_F32``)."""
KV_REGISTER_BUDGET = 32
"""Registers of K and V words a lane may hold in flight (one word per register): sets ``tokens_in_flight``."""


# ---------------------------------------------------------------------------- the launch plan
#
# The contract fixes the plan (which query heads a CTA serves, how many shards, which tokens each
# shard and slot reads), so the host side takes it from ``fp8lab.simulators.splitkv``:
# ``heads_per_cta``, ``choose_num_splits``, ``lanes_per_token``, ``num_slots``, ``ELEMENTS_PER_LANE``.
# What a CTA computes per token is written out below, independently of the simulator.


@functools.lru_cache(maxsize=None)
def device_num_sms() -> int:
    """The current GPU's SM count (``fp8lab.simulators.splitkv.NUM_SMS``, an H100/H200's, in the simulator)."""
    if SIMULATOR:
        return NUM_SMS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


# ---------------------------------------------------------------------------- how a lane reads a row


@dataclass(frozen=True)
class LaneLayout:
    """How the slot's lane ``r`` reads its 16 elements ``[16 r, 16 r + 16)`` of one cache row.

    The lane's share of the row is ``words`` uint32 words (4 for FP8, 8 for BF16, 16 for float32),
    read as ``words / 4`` 128-bit loads. ``tokens_in_flight`` is ``U``: a slot loads its next ``U``
    tokens (K and V) before it computes any of them (see the module docstring).
    """

    cache_format: str
    head_dim: int
    words: int
    tokens_in_flight: int

    @property
    def loads(self) -> int:
        return self.words // WORDS_PER_LOAD

    @property
    def row_words(self) -> int:
        return self.words * lanes_per_token(self.head_dim)


def lane_layout(cache_format: str, head_dim: int, tokens_in_flight: int | None = None) -> LaneLayout:
    """The ``LaneLayout`` of a cache format (``fp8``, ``bf16``, ``f32``) and a head size in ``HEAD_DIMS``."""
    words = ELEMENTS_PER_LANE * kv_cache_format(cache_format).kernel_storage.itemsize // 4
    if tokens_in_flight is None:
        tokens_in_flight = max(1, KV_REGISTER_BUDGET // (2 * words))
    return LaneLayout(cache_format, head_dim, words, int(tokens_in_flight))


@cuda.jit(device=True, inline=True)
def fp8_values(words, first, values):
    """16 E4M3 codes (4 words from ``words[first]``) -> ``values[0:16]``, float32 ``decode(c)``, exact, NaN codes NaN
    (the hardware conversion: bit placement, a few instructions more, would make a NaN code a finite number, and a
    cache that holds one, written from a vector with an infinity, must give NaN as the reference does)."""
    for w in range(4):
        v0, v1, v2, v3 = decoded_codes(words[first + w])
        values[4 * w] = v0
        values[4 * w + 1] = v1
        values[4 * w + 2] = v2
        values[4 * w + 3] = v3


@cuda.jit(device=True, inline=True)
def bf16_values(words, first, values):
    """16 BF16 patterns (8 words) -> ``values[0:16]`` as float32 (exact: a BF16 pattern is the top half of one)."""
    for w in range(8):
        word = uint32(words[first + w])
        values[2 * w] = u32_as_f32(word << uint32(16))
        values[2 * w + 1] = u32_as_f32(word & uint32(0xFFFF0000))


@cuda.jit(device=True, inline=True)
def f32_values(words, first, values):
    """16 float32 words -> ``values[0:16]``."""
    for w in range(16):
        values[w] = u32_as_f32(words[first + w])


VALUE_DECODERS = {"fp8": fp8_values, "bf16": bf16_values, "fp32": f32_values}


# ---------------------------------------------------------------------------- device functions of the schedule


@cuda.jit(device=True, inline=True)
def shard_range(seq_len, shard, num_splits, block_size):
    """Token range ``[start, end)`` of ``shard``: ``fp8lab.simulators.splitkv.shard_bounds``, one shard at a time.

    Every shard takes ``ceil(num_blocks / num_splits)`` whole blocks; trailing shards may be empty.
    """
    num_blocks = (seq_len + block_size - 1) // block_size
    tokens_per_shard = (num_blocks + num_splits - 1) // num_splits * block_size
    start = min(shard * tokens_per_shard, seq_len)
    end = min(start + tokens_per_shard, seq_len)
    return start, end


@cuda.jit(device=True, inline=True)
def merge_weight(m_i, m_star):
    """``exp2(m_i - m*)``, and 0 for the neutral element (``m_i = -inf``, where ``-inf - -inf`` is NaN)."""
    if m_i == -math.inf:
        return float32(0)
    return mathops.exp2(m_i - m_star)


@cuda.jit(device=True, inline=True)
def normalized(acc, l):
    """``acc / l``, and 0 where ``l == 0`` (nothing attended: a zero row, never NaN).

    A NaN ``l`` (non-finite cache data) gives NaN, here and in the simulator: a NaN in the data must
    reach the output.
    """
    if l == 0:
        return float32(0)
    return acc / l


# How a kernel writes one element of ``out``: a factory-time choice (``bf16_out``), so each output format
# is its own compiled kernel and the float32 one is unchanged. The value stored is the float32 result in
# both; the BF16 store rounds it once, exactly as ``layers.bf16_round`` would have in a launch of its own.


@cuda.jit(device=True, inline=True)
def store_float32(out, seq, head, d, value):
    """``out[seq, head, d] = value``: float32 ``out``."""
    out[seq, head, d] = value


@cuda.jit(device=True, inline=True)
def store_bf16(out, seq, head, d, value):
    """``out[seq, head, d]`` = the BF16 bits of ``value`` (uint16 ``out``): round to nearest even, a zero to
    a zero, NaN to a NaN (``mathops.f32_to_bf16_bits_rne``, the rounding of ``layers.bf16_round``)."""
    out[seq, head, d] = mathops.f32_to_bf16_bits_rne(value)


def output_store(bf16_out: bool):
    """The store device function of an output format: ``store_bf16`` for uint16 ``out``, else ``store_float32``."""
    return store_bf16 if bf16_out else store_float32


# ---------------------------------------------------------------------------- the split kernel


def split_kernel_function(cache_format: str, head_dim: int, heads: int, tokens_in_flight: int | None = None,
                          bf16_out: bool = False):
    """The Python source of the split kernel for one cache format, head size, ``heads`` per CTA and output format.

    Arguments: ``q, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, alibi_slopes,
    use_alibi, scale_log2, num_kv_heads, block_size, num_splits, workspace, out``. The caches come
    flat, as 1-D arrays of uint32 words (``flat_cache``): the token at ``(block, kv_head, offset)`` is
    *row* ``(block * num_kv_heads + kv_head) * block_size + offset``, its words are ``row *
    ROW_WORDS ...`` and its scale is ``k_scales[row]``. A float cache gets placeholder scale arrays
    (never read), a call without ALiBi a placeholder ``alibi_slopes`` and ``use_alibi = 0``. Launch
    ``[(num_seqs, num_heads // heads, num_splits), 128]``. ``out`` (written only when ``num_splits ==
    1``) is float32, or with ``bf16_out`` uint16 BF16 bits (``store_bf16``).
    """
    layout = lane_layout(cache_format, head_dim, tokens_in_flight)
    WORDS, LOADS, U, H = layout.words, layout.loads, layout.tokens_in_flight, heads
    LPT = lanes_per_token(head_dim)
    TOKENS_PER_WARP = WARP_SIZE // LPT
    SLOTS = num_slots(head_dim)
    E = ELEMENTS_PER_LANE
    HE = H * E
    GROUP_WORDS = U * WORDS  # local array sizes must be plain constants
    UH = U * H
    ROW_WORDS = np.uint64(layout.row_words)  # unsigned, so that word indices stay unsigned
    HEAD_DIM = head_dim
    MERGE_SIZE = H * SLOTS * head_dim
    MERGE_STATES = H * SLOTS
    IS_FP8 = cache_format == "fp8"
    values_of = VALUE_DECODERS[cache_format]
    store = output_store(bf16_out)

    def make_load_group(guarded: bool):
        @cuda.jit(device=True, inline=True)
        def load_group(token0, end, column, offset, column_step, offset_step, table, rows_per_block, head_row,
                       lane_words, block_size, k_words, v_words, k_scales, v_scales, k_group, v_group,
                       k_group_scales, v_group_scales):
            """Load the slot's next ``U`` tokens (K and V words, scales) before computing any of them.

            The slot's token ``u`` is ``token0 + SLOTS u``. ``guarded`` (the last group of a shard):
            tokens past ``end`` load nothing and read as zeros. Returns the block column and offset
            after the group.
            """
            for u in range(U):
                if not guarded or token0 + u * SLOTS < end:
                    row = uint64(table[column] * rows_per_block + head_row + offset)
                    for i in range(LOADS):
                        word = row * ROW_WORDS + uint64(lane_words + WORDS_PER_LOAD * i)
                        k0, k1, k2, k3 = load_u32x4(k_words, word)
                        v0, v1, v2, v3 = load_u32x4(v_words, word)
                        k_group[u * WORDS + 4 * i] = k0
                        k_group[u * WORDS + 4 * i + 1] = k1
                        k_group[u * WORDS + 4 * i + 2] = k2
                        k_group[u * WORDS + 4 * i + 3] = k3
                        v_group[u * WORDS + 4 * i] = v0
                        v_group[u * WORDS + 4 * i + 1] = v1
                        v_group[u * WORDS + 4 * i + 2] = v2
                        v_group[u * WORDS + 4 * i + 3] = v3
                    if IS_FP8:
                        k_group_scales[u] = k_scales[row]
                        v_group_scales[u] = v_scales[row]
                else:
                    for i in range(WORDS):
                        k_group[u * WORDS + i] = uint32(0)
                        v_group[u * WORDS + i] = uint32(0)
                    k_group_scales[u] = float32(1)
                    v_group_scales[u] = float32(1)
                column += column_step
                offset += offset_step
                if offset >= block_size:
                    offset -= block_size
                    column += 1
            return column, offset

        return load_group

    @cuda.jit(device=True, inline=True)
    def group_scores(token0, seq_len, q2, slope2, use_alibi, k_group, k_group_scales, scores):
        """``scores[u * H + h]``: the log2-domain score of the slot's token ``u`` for head ``h``.

        Every lane of the warp runs this, active slot or not, so that the ``shfl_xor`` butterflies
        see all 32 lanes (an idle slot's score is never used). No branch between the ``U * H`` dot
        products, so their fma chains and butterflies interleave; ALiBi (a uniform branch) after.
        """
        keys = cuda.local.array(E, float32)
        for u in range(U):
            values_of(k_group, u * WORDS, keys)
            for h in range(H):
                dot = float32(0)
                for e in range(E):
                    dot = cuda.fma(q2[h * E + e], keys[e], dot)
                offset = LPT // 2
                while offset > 0:  # the butterfly over the slot's lanes
                    dot += cuda.shfl_xor_sync(FULL_MASK, dot, offset)
                    offset //= 2
                scores[u * H + h] = dot * k_group_scales[u] if IS_FP8 else dot
        if use_alibi:
            for u in range(U):
                for h in range(H):
                    scores[u * H + h] = cuda.fma(slope2[h], float32(token0 + SLOTS * u - (seq_len - 1)),
                                                 scores[u * H + h])

    def make_group_softmax(guarded: bool):
        @cuda.jit(device=True, inline=True)
        def group_softmax(token0, end, scores, v_group, v_group_scales, m, l, acc):
            """The online softmax of the slot's tokens, one at a time in token order, all heads at once.

            Per token and head: ``m_new``, ``p``, ``corr`` (1 when the max did not move: the
            contract) and ``l`` without a branch, so the heads interleave; the ``acc * corr``
            multiplications only when some head's max moved (rare after the first tokens; ``x * 1``
            is exact for the others); then the 16 fmas per head. ``guarded``: skip tokens past ``end``.
            """
            values = cuda.local.array(E, float32)
            corr = cuda.local.array(H, float32)
            pv = cuda.local.array(H, float32)
            for u in range(U):
                if not guarded or token0 + SLOTS * u < end:
                    values_of(v_group, u * WORDS, values)
                    moved = False
                    for h in range(H):
                        s = scores[u * H + h]
                        m_new = mathops.nan_max(m[h], s)
                        p = mathops.exp2(s - m_new)
                        c = mathops.exp2(m[h] - m_new)  # 0 on the slot's first token (m = -inf)
                        head_moved = m_new != m[h]
                        corr[h] = c if head_moved else float32(1)
                        moved = moved or head_moved
                        l[h] = cuda.fma(l[h], corr[h], p)  # fma(l, 1, p) = l + p
                        pv[h] = p * v_group_scales[u] if IS_FP8 else p
                        m[h] = m_new
                    if moved:
                        for h in range(H):
                            for e in range(E):
                                acc[h * E + e] = acc[h * E + e] * corr[h]
                    for h in range(H):
                        for e in range(E):
                            acc[h * E + e] = cuda.fma(pv[h], values[e], acc[h * E + e])

        return group_softmax

    load_full_group, load_last_group = make_load_group(False), make_load_group(True)
    full_group_softmax, last_group_softmax = make_group_softmax(False), make_group_softmax(True)

    def split_kernel(q, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, alibi_slopes,
                     use_alibi, scale_log2, num_kv_heads, block_size, num_splits, workspace, out):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        seq = cuda.blockIdx.x
        head0 = cuda.blockIdx.y * H
        shard = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid // WARP_SIZE
        lane = tid % WARP_SIZE
        slot = warp * TOKENS_PER_WARP + lane // LPT
        r = lane % LPT  # the lane's place in its slot: it owns elements [16 r, 16 r + 16)
        num_heads = q.shape[1]
        kv_head = head0 // (num_heads // num_kv_heads)
        seq_len = seq_lens[seq]
        start, end = shard_range(seq_len, shard, num_splits, block_size)

        # The H queries in the log2 domain, as this lane's 16 elements each.
        q2 = cuda.local.array(HE, float32)
        slope2 = cuda.local.array(H, float32)
        m = cuda.local.array(H, float32)
        l = cuda.local.array(H, float32)
        acc = cuda.local.array(HE, float32)
        for h in range(H):
            for e in range(E):
                q2[h * E + e] = q[seq, head0 + h, r * E + e] * scale_log2
                acc[h * E + e] = float32(0)
            slope2[h] = alibi_slopes[head0 + h] * LOG2E_F32 if use_alibi else float32(0)
            m[h] = float32(-math.inf)
            l[h] = float32(0)

        k_group = cuda.local.array(GROUP_WORDS, uint32)
        v_group = cuda.local.array(GROUP_WORDS, uint32)
        k_group_scales = cuda.local.array(U, float32)
        v_group_scales = cuda.local.array(U, float32)
        scores = cuda.local.array(UH, float32)

        # The slot's tokens start + slot, start + slot + SLOTS, ... in groups of U. A group is full
        # when the warp's last slot has all U of its tokens (then so do the warp's other slots):
        # no guards. The last group is guarded; the warp runs it while its first slot, which has the
        # most tokens, has any, so all 32 lanes reach every shuffle.
        table = block_tables[seq]
        rows_per_block = num_kv_heads * block_size
        head_row = kv_head * block_size
        lane_words = r * WORDS
        column_step = SLOTS // block_size
        offset_step = SLOTS % block_size
        token0 = start + slot
        warp_first = start + warp * TOKENS_PER_WARP
        column = token0 // block_size
        offset = token0 % block_size
        while warp_first + SLOTS * (U - 1) + TOKENS_PER_WARP - 1 < end:
            column, offset = load_full_group(token0, end, column, offset, column_step, offset_step, table,
                                             rows_per_block, head_row, lane_words, block_size, k_words, v_words,
                                             k_scales, v_scales, k_group, v_group, k_group_scales, v_group_scales)
            group_scores(token0, seq_len, q2, slope2, use_alibi, k_group, k_group_scales, scores)
            full_group_softmax(token0, end, scores, v_group, v_group_scales, m, l, acc)
            token0 += SLOTS * U
            warp_first += SLOTS * U
        if warp_first < end:
            load_last_group(token0, end, column, offset, column_step, offset_step, table, rows_per_block, head_row,
                            lane_words, block_size, k_words, v_words, k_scales, v_scales, k_group, v_group,
                            k_group_scales, v_group_scales)
            group_scores(token0, seq_len, q2, slope2, use_alibi, k_group, k_group_scales, scores)
            last_group_softmax(token0, end, scores, v_group, v_group_scales, m, l, acc)

        # Merge the slots in slot order through shared memory (a slot without tokens is neutral): each
        # head's m* and each slot's weight exp2(m_p - m*) once, then the fma chains over the slots.
        slot_m = cuda.shared.array(MERGE_STATES, float32)
        slot_l = cuda.shared.array(MERGE_STATES, float32)
        slot_w = cuda.shared.array(MERGE_STATES, float32)
        head_m = cuda.shared.array(H, float32)
        slot_acc = cuda.shared.array(MERGE_SIZE, float32)
        for h in range(H):
            if r == 0:
                slot_m[h * SLOTS + slot] = m[h]
                slot_l[h * SLOTS + slot] = l[h]
            for e in range(E):
                slot_acc[(h * SLOTS + slot) * HEAD_DIM + r * E + e] = acc[h * E + e]
        cuda.syncthreads()
        if tid < H:
            m_star = slot_m[tid * SLOTS]
            for p in range(1, SLOTS):
                m_star = mathops.nan_max(m_star, slot_m[tid * SLOTS + p])
            head_m[tid] = m_star
        cuda.syncthreads()
        for i in range(tid, MERGE_STATES, THREADS_PER_CTA):
            slot_w[i] = merge_weight(slot_m[i], head_m[i // SLOTS])
        cuda.syncthreads()
        for i in range(tid, H * HEAD_DIM, THREADS_PER_CTA):
            h = i // HEAD_DIM
            d = i % HEAD_DIM
            l_sum = float32(0)
            acc_sum = float32(0)
            for p in range(SLOTS):
                weight = slot_w[h * SLOTS + p]
                l_sum = cuda.fma(weight, slot_l[h * SLOTS + p], l_sum)
                acc_sum = cuda.fma(weight, slot_acc[(h * SLOTS + p) * HEAD_DIM + d], acc_sum)
            if num_splits == 1:
                store(out, seq, head0 + h, d, normalized(acc_sum, l_sum))
            else:
                workspace[seq, head0 + h, shard, d] = acc_sum
                if d == 0:
                    workspace[seq, head0 + h, shard, HEAD_DIM] = head_m[h]
                    workspace[seq, head0 + h, shard, HEAD_DIM + 1] = l_sum

    return split_kernel


MAX_SPLITS = 256
"""The most shards a call may ask for (it bounds the workspace; the combine itself has no limit)."""
COMBINE_SHARDS_PER_PASS = 32
"""Shards whose partials a combine thread holds in registers at once: one round trip to the L2 for up to 32 (the
tensor-core decode's split rule picks at most 32)."""


@cuda.jit(device=True, inline=True)
def load_partials(parts, first_row, row_words, d, head_dim, first, num_splits, m, l, acc):
    """Shards ``first ... first + 32`` (those below ``num_splits``) of one (sequence, head): their ``m``, ``l``
    and element ``d`` of their ``acc`` into ``m``, ``l``, ``acc`` (registers), all loads issued together.
    ``first_row``, ``row_words``, ``d`` and ``head_dim`` are uint64: unsigned indices need no negative-index
    wraparound, which took about 40 instructions a shard in signed 64-bit."""
    for i in range(COMBINE_SHARDS_PER_PASS):
        if first + i < num_splits:
            at = (first_row + uint64(first + i)) * row_words
            acc[i] = parts[at + d]
            m[i] = parts[at + head_dim]
            l[i] = parts[at + head_dim + uint64(1)]


def combine_kernel_function(bf16_out: bool = False):
    """The Python source of the combine kernel for one output format (``bf16_out``: uint16 BF16 bits)."""
    store = output_store(bf16_out)

    def combine_kernel(parts, max_splits, num_splits, out):
        """Merge the shards' partials in shard order and normalize; thread ``d`` owns element ``d``.

        Launch ``[(num_seqs, num_heads), head_dim]``. ``parts``: the workspace ``[num_seqs, num_heads,
        max_splits, head_dim + 2]``, flat; its row ``[seq, head, shard, :]`` holds ``acc[0:head_dim], m, l``.
        ``out``: float32, or with ``bf16_out`` uint16 BF16 bits (``store_bf16``).

        The work is a few hundred instructions per thread, so the time is latency: every thread loads
        the ``m``, ``l`` and its ``acc`` element of 32 shards at once (one round trip to the L2 for the
        usual split counts), takes ``m* = max m`` over all shards in registers, computes every weight
        ``exp2(m_s - m*)`` itself (no shared memory and no barrier: the same few exponentials in each
        thread cost less than a barrier's wait), then runs the ``l`` and ``acc`` fma chains in shard
        order. More than 32 shards take further passes of 32 (their ``m`` first, for ``m*``).
        """
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        seq = cuda.blockIdx.x
        head = cuda.blockIdx.y
        d = uint64(cuda.threadIdx.x)
        num_heads = out.shape[1]
        head_dim = uint64(out.shape[2])
        row_words = head_dim + uint64(2)
        first_row = (uint64(seq) * uint64(num_heads) + uint64(head)) * uint64(max_splits)
        m = cuda.local.array(COMBINE_SHARDS_PER_PASS, float32)
        l = cuda.local.array(COMBINE_SHARDS_PER_PASS, float32)
        acc = cuda.local.array(COMBINE_SHARDS_PER_PASS, float32)
        load_partials(parts, first_row, row_words, d, head_dim, 0, num_splits, m, l, acc)
        m_star = m[0]
        for i in range(1, COMBINE_SHARDS_PER_PASS):
            if i < num_splits:
                m_star = mathops.nan_max(m_star, m[i])
        for s in range(COMBINE_SHARDS_PER_PASS, num_splits):  # more than 32 shards: the rest of the max
            m_star = mathops.nan_max(m_star, parts[(first_row + uint64(s)) * row_words + head_dim])
        l_sum = float32(0)
        acc_sum = float32(0)
        for first in range(0, num_splits, COMBINE_SHARDS_PER_PASS):
            if first > 0:
                load_partials(parts, first_row, row_words, d, head_dim, first, num_splits, m, l, acc)
            for i in range(COMBINE_SHARDS_PER_PASS):
                if first + i < num_splits:
                    weight = merge_weight(m[i], m_star)
                    l_sum = cuda.fma(weight, l[i], l_sum)
                    acc_sum = cuda.fma(weight, acc[i], acc_sum)
        store(out, seq, head, d, normalized(acc_sum, l_sum))

    return combine_kernel


@functools.lru_cache(maxsize=None)
def _split_kernel(cache_format: str, head_dim: int, heads: int, tokens_in_flight: int | None = None,
                  bf16_out: bool = False):
    """The compiled split kernel of one variant (``split_kernel_function``), compiled once per process."""
    return cuda.jit(split_kernel_function(cache_format, head_dim, heads, tokens_in_flight, bf16_out))


@functools.lru_cache(maxsize=None)
def _combine(bf16_out: bool = False):
    """The compiled combine kernel of one output format (``combine_kernel_function``), compiled once per process."""
    return cuda.jit(combine_kernel_function(bf16_out))


_combine_kernel = _combine(False)  # the float32-output combine, by the name the benches and tests launch it


# ---------------------------------------------------------------------------- host side


def decode_workspace(num_seqs: int, num_heads: int, head_dim: int, max_splits: int = MAX_SPLITS_PER_HEAD * MAX_HEADS_PER_CTA):
    """A workspace for ``paged_decode``: float32 ``[num_seqs, num_heads, max_splits, head_dim + 2]``.

    Row ``[seq, head, shard]`` receives the shard's ``acc`` (``head_dim`` values), then ``m`` and
    ``l``. Allocate it once and pass it to every call (no allocation per call; CUDA-graph capture
    needs that). A device array on a GPU, a NumPy array in the simulator.
    """
    shape = (int(num_seqs), int(num_heads), int(max_splits), int(head_dim) + 2)
    return np.empty(shape, np.float32) if SIMULATOR else cuda.device_array(shape, np.float32)


OUT_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16))
"""``out``'s dtypes: float32, or uint16 holding BF16 bit patterns (rounded once, to nearest even, in the kernel)."""


@dataclass(frozen=True)
class DecodeCall:
    """A checked ``paged_decode`` call: kernel-ready arrays, the variant and the split count."""

    q: object
    k_words: object
    v_words: object
    k_scales: object
    v_scales: object
    block_tables: object
    seq_lens: object
    alibi_slopes: object
    scale_log2: np.float32
    num_splits: int
    workspace: object
    out: object
    cache_format: str
    head_dim: int
    num_kv_heads: int
    block_size: int
    max_seq_len: int
    bf16_out: bool  # out is uint16: the kernels store BF16 bits


def check_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale=None, v_scale=None,
                 alibi_slopes=None, num_splits="auto", workspace=None, max_seq_len=None, kv_format=None) -> DecodeCall:
    """Every argument check of ``paged_decode``; nothing is launched here."""
    names = ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "out")
    q, k_cache, v_cache, block_tables, seq_lens, out = (
        as_kernel_array(n, x) for n, x in zip(names, (q, k_cache, v_cache, block_tables, seq_lens, out)))
    k_scale, v_scale, alibi_slopes, workspace = (
        None if x is None else as_kernel_array(n, x)
        for n, x in (("k_scale", k_scale), ("v_scale", v_scale), ("alibi_slopes", alibi_slopes), ("workspace", workspace)))

    if q.ndim != 3 or np.dtype(q.dtype) != np.float32:
        reject("q", "float32 [num_seqs, num_heads, head_dim]", q)
    num_seqs, num_heads, head_dim = q.shape
    cache_format = check_cache("k_cache", k_cache, k_scale, "k_scale", kv_format).name
    if np.dtype(v_cache.dtype) != np.dtype(k_cache.dtype) or tuple(v_cache.shape) != tuple(k_cache.shape):
        reject("v_cache", f"the shape {tuple(k_cache.shape)} and dtype {k_cache.dtype} of k_cache", v_cache)
    check_cache("v_cache", v_cache, v_scale, "v_scale", cache_format)
    num_blocks, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_head_dim} does not match q's head_dim {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or np.dtype(block_tables.dtype).kind not in "iu":
        reject("block_tables", f"an integer array [{num_seqs}, max_blocks_per_seq]", block_tables)
    if tuple(seq_lens.shape) != (num_seqs,) or np.dtype(seq_lens.dtype).kind not in "iu":
        reject("seq_lens", f"an integer array [{num_seqs}]", seq_lens)
    if alibi_slopes is not None and (tuple(alibi_slopes.shape) != (num_heads,) or np.dtype(alibi_slopes.dtype) != np.float32):
        reject("alibi_slopes", f"float32 [{num_heads}] or None", alibi_slopes)
    if tuple(out.shape) != (num_seqs, num_heads, head_dim) or np.dtype(out.dtype) not in OUT_DTYPES:
        reject("out", f"float32 or uint16 (BF16 bits) [{num_seqs}, {num_heads}, {head_dim}]", out)
    require_c_contiguous("out", out)
    if np.dtype(out.dtype) == np.uint16 and overlaps(out, q):  # a CTA's BF16 rows would land in other CTAs' queries
        reject("out", "memory apart from q's (a uint16 out cannot share q's memory)", out)

    # The index arrays' values: read on the host unless the caller vouches for them with max_seq_len.
    host_indices = isinstance(seq_lens, np.ndarray) and isinstance(block_tables, np.ndarray)
    if max_seq_len is None or host_indices:
        lens = to_host(seq_lens).astype(np.int64)
        check_block_tables(to_host(block_tables).astype(np.int64), lens, block_size, num_blocks)
        longest = int(lens.max(initial=0))
        if max_seq_len is not None and int(max_seq_len) < longest:
            raise ValueError(f"max_seq_len: {max_seq_len} is shorter than the longest sequence ({longest})")
    else:
        longest = int(max_seq_len)
        if longest < 0 or -(-longest // block_size) > block_tables.shape[1]:
            raise ValueError(f"max_seq_len: {longest} tokens need {-(-longest // block_size)} blocks of {block_size}, "
                             f"block_tables has {block_tables.shape[1]} columns")
    max_seq_len = longest if max_seq_len is None else int(max_seq_len)

    if isinstance(num_splits, str) and num_splits == "auto":
        splits = choose_num_splits(num_seqs, num_heads, num_kv_heads, max_seq_len, device_num_sms(), block_size)
    elif isinstance(num_splits, (int, np.integer)) and not isinstance(num_splits, bool) and 1 <= num_splits <= MAX_SPLITS:
        splits = int(num_splits)
    else:
        raise ValueError(f"num_splits: expected an int from 1 to {MAX_SPLITS} or 'auto', got {num_splits!r}")
    if workspace is not None:
        ok = (workspace.ndim == 4 and tuple(workspace.shape[:2]) == (num_seqs, num_heads) and workspace.shape[2] >= splits
              and workspace.shape[3] == head_dim + 2 and np.dtype(workspace.dtype) == np.float32)
        if not ok:
            reject("workspace", f"float32 [{num_seqs}, {num_heads}, >= {splits}, {head_dim + 2}] (decode_workspace)", workspace)
        require_c_contiguous("workspace", workspace)

    scale_log2 = np.float32(float(softmax_scale) * LOG2E)  # float64 product, rounded once (as the simulator)
    k_words, k_scales = flat_cache(k_cache, k_scale)
    v_words, v_scales = flat_cache(v_cache, v_scale)
    return DecodeCall(q, k_words, v_words, k_scales, v_scales, _as_int32(block_tables), _as_int32(seq_lens),
                      alibi_slopes, scale_log2, splits, workspace, out, cache_format, head_dim, num_kv_heads,
                      block_size, max_seq_len, np.dtype(out.dtype) == np.uint16)


def flat_cache(cache, scales):
    """The cache as one flat array of uint32 words and its scales flattened (None for a float cache);
    views, no copies. The kernel reads it with 128-bit loads: on a GPU its address must be 16-byte
    aligned (a ``ValueError`` otherwise; Numba's and torch's allocations are)."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    num_rows = num_blocks * num_kv_heads * block_size
    words = cache.reshape(num_rows * head_dim).view(np.uint32)
    require_load_alignment("cache", words, "the split-kv kernel")
    return words, None if scales is None else scales.reshape(num_rows)


def _as_int32(x):
    """Host index arrays become C-contiguous int32 (one kernel specialization); device arrays stay as they are."""
    return np.ascontiguousarray(x, dtype=np.int32) if isinstance(x, np.ndarray) else x


def combine_and_return(call: DecodeCall, workspace_device, out_device, stream) -> None:
    """After a split kernel: the combine kernel where there are shards (it writes ``out``), then ``out`` back to the
    caller's NumPy array on a GPU. Shared by ``paged_decode`` and ``splitkv_mma.paged_decode_mma``."""
    num_seqs, num_heads, head_dim = call.q.shape
    if call.num_splits > 1:
        pdl.launch(_combine(call.bf16_out), (num_seqs, num_heads), head_dim, stream,
                   workspace_device.reshape(workspace_device.size), workspace_device.shape[2], call.num_splits,
                   out_device)
    if out_device is not call.out:  # a NumPy out on a GPU
        out_device.copy_to_host(call.out, stream=stream)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale=None, v_scale=None,
                 alibi_slopes=None, num_splits="auto", workspace=None, *, kv_format=None, max_seq_len=None, stream=0,
                 tokens_in_flight=None):
    """Decode attention of one query token per sequence over a paged cache, into ``out``; returns ``out``.

    ``q``: float32 ``[num_seqs, num_heads, head_dim]``; ``k_cache``, ``v_cache``: ``[num_blocks,
    num_kv_heads, block_size, head_dim]`` of uint8 E4M3 codes (then float32 ``k_scale``, ``v_scale``
    ``[num_blocks, num_kv_heads, block_size]`` are required), float32, or uint16 BF16 patterns;
    ``block_tables``: integer ``[num_seqs, max_blocks_per_seq]`` (entries past a sequence's blocks are
    never read); ``seq_lens``: integer ``[num_seqs]``, 0 allowed; ``softmax_scale``: a float;
    ``out``: ``[num_seqs, num_heads, head_dim]``, written entirely, float32 or uint16: with uint16 every
    element is the BF16 bit pattern of the float32 result (round to nearest even,
    ``mathops.f32_to_bf16_bits_rne``), bit for bit what ``layers.bf16_round`` makes of a float32 call's
    ``out``, in the same launches; ``alibi_slopes``: float32 ``[num_heads]`` or None.

    ``num_splits``: a positive int (any; the workspace must have room), or ``"auto"``
    (``choose_num_splits`` with this GPU's SM count; at most 8 per query head). ``workspace``: see
    ``decode_workspace``; allocated per call when None and ``num_splits > 1``.

    ``kv_format`` (keyword; a ``fp8lab.reference.kv_cache.KVCacheFormat`` or its name): the format
    the caches hold, checked against their dtype (without it the dtype names it).

    ``max_seq_len`` (keyword): an upper bound of ``seq_lens``. Without it the values of
    ``seq_lens`` and ``block_tables`` are checked on the host (device arrays are copied, a
    synchronizing copy). With it and device index arrays nothing is read back: only the block
    table's width is checked against ``max_seq_len`` and ``"auto"`` uses it (the way to run inside
    CUDA-graph capture); the caller vouches for the values.

    Arrays: NumPy (copied to the device once, ``out`` copied back, on a GPU), Numba device arrays or
    ``__cuda_array_interface__`` objects. Every bad argument is a ``ValueError`` before any launch.
    """
    call = check_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale, v_scale,
                        alibi_slopes, num_splits, workspace, max_seq_len, kv_format)
    num_seqs, num_heads, head_dim = call.q.shape
    if num_seqs == 0 or num_heads == 0:
        return out
    fp8 = call.cache_format == "fp8"
    workspace = call.workspace
    if workspace is None:
        workspace = decode_workspace(num_seqs, num_heads, head_dim, call.num_splits) if call.num_splits > 1 else placeholder(4)
    args = [call.q, call.k_words, call.v_words, call.k_scales if fp8 else placeholder(1),
            call.v_scales if fp8 else placeholder(1), call.block_tables, call.seq_lens,
            placeholder(1) if call.alibi_slopes is None else call.alibi_slopes]
    device = [on_device(x, stream) for x in args]
    out_device = on_device(call.out, stream)
    workspace_device = on_device(workspace, stream)
    heads = heads_per_cta(num_heads // call.num_kv_heads, num_seqs * call.max_seq_len)
    kernel = _split_kernel(call.cache_format, head_dim, heads, tokens_in_flight, call.bf16_out)
    pdl.launch(
        kernel, (num_seqs, num_heads // heads, call.num_splits), THREADS_PER_CTA, stream,
        *device, int(call.alibi_slopes is not None), call.scale_log2, call.num_kv_heads, call.block_size,
        call.num_splits, workspace_device, out_device)
    combine_and_return(call, workspace_device, out_device, stream)
    return out


# ---------------------------------------------------------------------------- every variant, for the PTX check


def kernel_variants():
    """``(name, python function, numba signature)`` of the decode kernel variants the PTX check compiles:
    every cache format at head size 128 and the FP8 cache at every other head size, with 4 heads per CTA; the FP8
    cache at 128 with 1, 2 and 3; all with float32 ``out``; the BF16-output split kernel (FP8 cache, head_dim 128,
    4 heads per CTA); the combine for each output format (C-contiguous, int32 indices). (Every format at every head
    size and head count was 12 more compiles of the same code paths: the CPU suite's time.)"""
    f32 = types.float32
    words = types.Array(types.uint32, 1, "C")
    out_arrays = {False: types.Array(f32, 3, "C"), True: types.Array(types.uint16, 3, "C")}

    def split_signature(bf16_out: bool):
        return types.void(
            types.Array(f32, 3, "C"), words, words, types.Array(f32, 1, "C"), types.Array(f32, 1, "C"),
            types.Array(types.int32, 2, "C"), types.Array(types.int32, 1, "C"), types.Array(f32, 1, "C"), types.int64,
            f32, types.int64, types.int64, types.int64, types.Array(f32, 4, "C"), out_arrays[bf16_out])

    shapes = [(fmt, 128, MAX_HEADS_PER_CTA, False) for fmt in KV_CACHE_FORMATS]
    shapes += [("fp8", head_dim, MAX_HEADS_PER_CTA, False) for head_dim in HEAD_DIMS if head_dim != 128]
    shapes += [("fp8", 128, heads, False) for heads in range(1, MAX_HEADS_PER_CTA)]
    shapes += [("fp8", 128, MAX_HEADS_PER_CTA, True)]
    variants = [(f"split[{fmt}, head_dim={head_dim}, heads={heads}{', out=bf16' if bf16_out else ''}]",
                 split_kernel_function(fmt, head_dim, heads, bf16_out=bf16_out), split_signature(bf16_out))
                for fmt, head_dim, heads, bf16_out in shapes]
    for bf16_out in (False, True):
        variants.append(("combine[out=bf16]" if bf16_out else "combine", combine_kernel_function(bf16_out),
                         types.void(types.Array(f32, 1, "C"), types.int64, types.int64, out_arrays[bf16_out])))
    return variants
