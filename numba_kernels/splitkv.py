"""Split-kv (flash-decoding) paged decode attention over an FP8 or float KV cache, as Numba CUDA kernels.

What it computes (the contract of ``reference.attention.paged_decode``): for each sequence and query
head ``h``, softmax attention of the new token's query ``q[seq, h]`` over the sequence's
``seq_lens[seq]`` cached tokens, reading kv head ``h // (num_heads // num_kv_heads)`` (GQA), with an
optional ALiBi bias ``slope_h * (j - (L - 1))``; float32 ``out[num_seqs, num_heads, head_dim]``, and a
zero row for a sequence of length 0.

How: exactly the schedule of ``simulators.splitkv`` (read its docstring first), in the same float32
operations in the same order, so that in the CUDA simulator the kernels match
``simulators.splitkv.shard_partials`` and ``paged_decode`` bit for bit, and on a GPU they differ from
it only through ``exp2`` (``numba_kernels.mathops``); GPU results are checked against
``reference.attention`` with an error bound. Both checks are in ``tests/test_splitkv_kernel.py``.

Kernels and launch shapes:

1. ``split_kernel``, grid ``(num_seqs, num_heads, num_splits)``, 128 threads = 4 warps per CTA. The
   CTA takes shard ``blockIdx.z`` of the sequence (``shard_range``: whole KV blocks); warp ``w``
   takes the shard's tokens ``start + w, start + w + 4, ...`` in order; lane ``L`` owns the head
   elements ``[L E, (L + 1) E)``, ``E = head_dim / 32``. Per token: dequantize on load (an E4M3 code
   becomes its exact float32 value by bit placement, a BF16 pattern by a shift), the lane's fma
   chain with the query (pre-scaled by ``softmax_scale * log2(e)``), a ``shfl_xor`` butterfly, the
   per-token ``k_scale``, the ALiBi fma, then one step of the log2-domain online softmax. The 4
   warps' states merge through shared memory in warp order. The CTA writes its shard's partial
   ``(m, l, acc)`` to the workspace; with ``num_splits == 1`` it writes ``out = acc / l`` directly
   (bit-identical to a combine of one shard) and no combine kernel runs.
2. ``combine_kernel``, grid ``(num_seqs, num_heads)``, ``head_dim`` threads (thread ``d`` owns
   element ``d``): merge the ``num_splits`` partials in shard order and write ``acc / l``; ``l = 0``
   (nothing attended) gives a zero row, never NaN.

Every shard always writes its partial, an empty shard (and every shard of a length-0 sequence) the
neutral element ``(-inf, 0, 0)``: nothing stale from an earlier call survives in the workspace or in
``out``.

Memory-level parallelism without changing the arithmetic (``attend_to_group``): a warp loads its
next ``U`` tokens (block ids, K and V words, scales) before it computes any of them, computes their
``U`` scores (independent butterflies, which the scheduler interleaves), and only then runs the
softmax updates one token at a time in token order. Full groups run without any per-token test; the
shard's last group (fewer than ``U`` tokens) runs the same code with guards. ``U``
(``LaneLayout.tokens_in_flight``) keeps the K and V words in flight at about 32 registers per lane:
16 tokens for FP8 at head_dim 128, 8 for BF16, 4 for float32. Each lane reads its ``E`` elements of a
row as whole words (for FP8 at head_dim 128 one 32-bit load of 4 codes: one 128-byte load per warp),
and the caches are passed flat, so a token costs one index computation.

Caches: ``[num_blocks, num_kv_heads, block_size, head_dim]`` of uint8 E4M3 codes with float32 scales
``[num_blocks, num_kv_heads, block_size]`` (``reference.kv_cache``; no scales is an error, never a
fallback), float32, or uint16 BF16 patterns. ``head_dim``: a multiple of 32 up to 256. ``q``, ``out``:
float32. Variants: one split kernel per (cache format, head_dim), compiled on first use;
``kernel_variants()`` lists them all with the combine (``tests/test_kernels_compile.py`` compiles each
to sm_90 PTX).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, types, uint32, uint64
from numba.np import numpy_support

from . import mathops
from .arguments import as_kernel_array
from .bits import SIMULATOR, bf16_bits_to_f32, u32_as_f32
from .kv_cache import CACHE_FORMATS, check_cache, on_device, placeholder, reject, require_c_contiguous, to_host

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
BUTTERFLY_OFFSETS = (16, 8, 4, 2, 1)
NUM_WARPS = 4
"""Warps per split-kernel CTA; a shard's tokens are dealt to them round-robin (as ``simulators.splitkv``)."""
THREADS_PER_CTA = NUM_WARPS * WARP_SIZE
HEAD_DIMS = tuple(range(WARP_SIZE, 257, WARP_SIZE))
"""Supported head sizes: every lane owns ``head_dim / 32`` elements, 1 to 8."""
MAX_AUTO_SPLITS = 8
DEFAULT_NUM_SMS = 132
"""SMs of an H100 SXM / H200; used in the CUDA simulator (which has no SM count), as ``simulators.splitkv``."""
LOG2E = math.log2(math.e)
LOG2E_F32 = float32(LOG2E)
"""``log2(e)`` rounded once to float32: ALiBi slopes are scaled by it (``slope2 = slope * LOG2E_F32``)."""
KV_REGISTER_BUDGET = 32
"""Registers of K and V words a lane may hold in flight (one word per register): sets ``tokens_in_flight``."""
MAX_TOKENS_IN_FLIGHT = 16

CACHE_ELEMENT_BITS = {"fp8": 8, "bf16": 16, "f32": 32}
WORD_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


# ---------------------------------------------------------------------------- the "auto" split count


def choose_num_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS,
                      block_size: int = 16) -> int:
    """The ``"auto"`` split count, ``simulators.splitkv.choose_num_splits``'s rule (a test keeps them equal).

    The largest ``s`` with ``num_seqs * num_heads * s <= num_sms`` (one wave of CTAs), at most
    ``MAX_AUTO_SPLITS``, at most the KV blocks of the longest sequence, at least 1. (``numba_kernels``
    may import ``simulators`` only in simulator mode, so the rule is written out here.)
    """
    grid = int(num_seqs) * int(num_heads)
    if grid <= 0:
        return 1
    blocks_of_work = -(-int(max_seq_len) // int(block_size))
    return int(max(1, min(MAX_AUTO_SPLITS, int(num_sms) // grid, blocks_of_work)))


@functools.lru_cache(maxsize=None)
def device_num_sms() -> int:
    """The current GPU's SM count (``DEFAULT_NUM_SMS`` in the simulator)."""
    if SIMULATOR:
        return DEFAULT_NUM_SMS
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


# ---------------------------------------------------------------------------- how a lane reads a row


@dataclass(frozen=True)
class LaneLayout:
    """How lane ``L`` reads its ``elements`` values ``[L E, (L + 1) E)`` of one cache row.

    The row is viewed as words of ``word_bytes`` (the widest of 4, 2, 1 bytes that divides the lane's
    share of the row); the lane loads ``words`` of them, each holding ``per_word`` elements, lowest
    element in the lowest bits (little endian). ``tokens_in_flight`` is ``U``, the tokens a warp
    loads before computing (see the module docstring).
    """

    cache_format: str
    head_dim: int
    elements: int
    element_bits: int
    word_bytes: int
    words: int
    per_word: int
    tokens_in_flight: int


def lane_layout(cache_format: str, head_dim: int) -> LaneLayout:
    """The ``LaneLayout`` of a cache format (``fp8``, ``bf16``, ``f32``) and a head size in ``HEAD_DIMS``."""
    elements = head_dim // WARP_SIZE
    bits = CACHE_ELEMENT_BITS[cache_format]
    lane_bytes = elements * bits // 8
    word_bytes = next(w for w in (4, 2, 1) if lane_bytes % w == 0)
    words = lane_bytes // word_bytes
    in_flight = max(1, min(MAX_TOKENS_IN_FLIGHT, KV_REGISTER_BUDGET // (2 * words)))  # K and V words
    return LaneLayout(cache_format, head_dim, elements, bits, word_bytes, words, word_bytes * 8 // bits, in_flight)


@cuda.jit(device=True, inline=True)
def fp8_element(word, position):
    """Element ``position`` (0..3) of a word of E4M3 codes, as its exact float32 value (unscaled)."""
    return mathops.e4m3_decode(word >> (8 * position))


@cuda.jit(device=True, inline=True)
def bf16_element(word, position):
    """Element ``position`` (0..1) of a word of BF16 patterns, as float32 (exact)."""
    return bf16_bits_to_f32(word >> (16 * position))


@cuda.jit(device=True, inline=True)
def f32_element(word, position):
    """A float32 word is its own element."""
    return u32_as_f32(word)


ELEMENT_DECODERS = {"fp8": fp8_element, "bf16": bf16_element, "f32": f32_element}


# ---------------------------------------------------------------------------- device functions of the schedule


@cuda.jit(device=True, inline=True)
def shard_range(seq_len, shard, num_splits, block_size):
    """Token range ``[start, end)`` of ``shard``: ``simulators.splitkv.shard_bounds``, one shard at a time.

    Every shard takes ``ceil(num_blocks / num_splits)`` whole blocks; trailing shards may be empty.
    """
    num_blocks = (seq_len + block_size - 1) // block_size
    tokens_per_shard = (num_blocks + num_splits - 1) // num_splits * block_size
    start = min(shard * tokens_per_shard, seq_len)
    end = min(start + tokens_per_shard, seq_len)
    return start, end


@cuda.jit(device=True, inline=True)
def warp_sum(x):
    """The butterfly: after ``x += shfl_xor(x, off)`` for ``off = 16, 8, 4, 2, 1`` every lane holds the sum."""
    for offset in BUTTERFLY_OFFSETS:
        x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
    return x


@cuda.jit(device=True, inline=True)
def merge_weight(m_i, m_star):
    """``exp2(m_i - m*)``, and 0 for the neutral element (``m_i = -inf``, where ``-inf - -inf`` is NaN)."""
    if m_i == -math.inf:
        return float32(0)
    return mathops.exp2(m_i - m_star)


@cuda.jit(device=True, inline=True)
def normalized(acc, l):
    """``acc / l``, and 0 where ``l == 0`` (nothing attended: a zero row, never NaN).

    A NaN ``l`` (non-finite cache data) gives NaN here, where the simulator's ``l > 0`` gives 0: a
    NaN in the data must reach the output.
    """
    if l == 0:
        return float32(0)
    return acc / l


# ---------------------------------------------------------------------------- the split kernel


def split_kernel_function(cache_format: str, head_dim: int):
    """The Python source of the split kernel for one cache format and head size.

    Arguments: ``q, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, alibi_slopes,
    use_alibi, scale_log2, num_kv_heads, block_size, num_splits, workspace, out``. The caches come
    flat, as 1-D arrays of words (``flat_cache``): the token at ``(block, kv_head, offset)`` is *row*
    ``(block * num_kv_heads + kv_head) * block_size + offset``, its words are ``row * ROW_WORDS ...``
    and its scale is ``k_scales[row]``: one index computation per token instead of three 4-D ones. A
    float cache gets placeholder scale arrays (never read), a call without ALiBi a placeholder
    ``alibi_slopes`` and ``use_alibi = 0``. Launch ``[(num_seqs, num_heads, num_splits), 128]``.
    """
    layout = lane_layout(cache_format, head_dim)
    E, WORDS, PER_WORD, U = layout.elements, layout.words, layout.per_word, layout.tokens_in_flight
    GROUP_WORDS = U * WORDS  # local array sizes must be plain constants
    ROW_WORDS = np.uint64(WARP_SIZE * WORDS)  # unsigned, so that word indices stay unsigned
    HEAD_DIM = head_dim
    WARPS_TIMES_HEAD_DIM = NUM_WARPS * head_dim
    IS_FP8 = cache_format == "fp8"
    element = ELEMENT_DECODERS[cache_format]

    @cuda.jit(device=True, inline=True)
    def attend_to_group(count, first, seq_len, m, l, q2, acc, slope2, use_alibi, table, rows_per_block, head_row,
                        lane_words, block_size, k_words, v_words, k_scales, v_scales):
        """The warp's tokens ``first, first + 4, ...`` (``count <= U`` of them): load, score, softmax.

        Updates ``acc`` in place and returns the new ``(m, l)``. Called with ``count = U`` (a
        constant) for full groups, so that every ``u < count`` test folds away and the U butterflies
        of step 2 have no branch between them (they interleave); with the rest for the last group.
        """
        k_group = cuda.local.array(GROUP_WORDS, uint32)
        v_group = cuda.local.array(GROUP_WORDS, uint32)
        k_group_scales = cuda.local.array(U, float32)
        v_group_scales = cuda.local.array(U, float32)
        scores = cuda.local.array(U, float32)

        # 1. Load every token before computing any. A token's row is table[column] * rows_per_block +
        #    head_row + offset, its words start at row * ROW_WORDS and its scale is element row (uint64
        #    indices: Numba then skips its negative-index wraparound). One division per group; the
        #    next token is NUM_WARPS positions further.
        column = first // block_size
        offset = first % block_size
        for u in range(U):
            if u < count:
                row = uint64(table[uint64(column)] * rows_per_block + head_row + offset)
                for i in range(WORDS):
                    word = row * ROW_WORDS + uint64(lane_words + i)
                    k_group[u * WORDS + i] = k_words[word]
                    v_group[u * WORDS + i] = v_words[word]
                if IS_FP8:
                    k_group_scales[u] = k_scales[row]
                    v_group_scales[u] = v_scales[row]
            offset += NUM_WARPS
            while offset >= block_size:
                offset -= block_size
                column += 1

        # 2. Scores in the log2 domain: the lane's fma chain, the butterfly, the token's scale, ALiBi.
        for u in range(U):
            if u < count:
                dot = float32(0)
                for e in range(E):
                    dot = cuda.fma(q2[e], element(k_group[u * WORDS + e // PER_WORD], e % PER_WORD), dot)
                s = warp_sum(dot)
                if IS_FP8:
                    s = s * k_group_scales[u]
                if use_alibi:
                    s = cuda.fma(slope2, float32(first + NUM_WARPS * u - (seq_len - 1)), s)
                scores[u] = s

        # 3. The online softmax, one token at a time in token order (the simulator's order).
        for u in range(U):
            if u < count:
                s = scores[u]
                m_new = mathops.nan_max(m, s)
                corr = mathops.exp2(m - m_new)  # 0 on the warp's first token (m = -inf)
                p = mathops.exp2(s - m_new)
                l = cuda.fma(l, corr, p)
                pv = p * v_group_scales[u] if IS_FP8 else p
                for e in range(E):
                    acc[e] = cuda.fma(pv, element(v_group[u * WORDS + e // PER_WORD], e % PER_WORD), acc[e] * corr)
                m = m_new
        return m, l

    def split_kernel(q, k_words, v_words, k_scales, v_scales, block_tables, seq_lens, alibi_slopes,
                     use_alibi, scale_log2, num_kv_heads, block_size, num_splits, workspace, out):
        seq = cuda.blockIdx.x
        head = cuda.blockIdx.y
        shard = cuda.blockIdx.z
        warp = cuda.threadIdx.x // WARP_SIZE
        lane = cuda.threadIdx.x % WARP_SIZE
        num_heads = q.shape[1]
        kv_head = head // (num_heads // num_kv_heads)
        seq_len = seq_lens[seq]
        start, end = shard_range(seq_len, shard, num_splits, block_size)

        # The query, in the log2 domain, as this lane's E elements; the ALiBi slope likewise.
        q2 = cuda.local.array(E, float32)
        for e in range(E):
            q2[e] = q[seq, head, lane * E + e] * scale_log2
        slope2 = float32(0)
        if use_alibi:
            slope2 = alibi_slopes[head] * LOG2E_F32

        # This warp's online-softmax state (m, l, acc); acc holds the lane's E elements.
        m = float32(-math.inf)
        l = float32(0)
        acc = cuda.local.array(E, float32)
        for e in range(E):
            acc[e] = float32(0)

        # The warp's tokens start + warp, start + warp + 4, ... in groups of U (see attend_to_group).
        table = block_tables[seq]
        rows_per_block = num_kv_heads * block_size
        head_row = kv_head * block_size
        lane_words = lane * WORDS
        first = start + warp
        while first + NUM_WARPS * (U - 1) < end:  # full groups
            m, l = attend_to_group(U, first, seq_len, m, l, q2, acc, slope2, use_alibi, table, rows_per_block,
                                   head_row, lane_words, block_size, k_words, v_words, k_scales, v_scales)
            first += NUM_WARPS * U
        if first < end:  # the last group, 1 to U - 1 tokens
            m, l = attend_to_group((end - first + NUM_WARPS - 1) // NUM_WARPS, first, seq_len, m, l, q2, acc, slope2,
                                   use_alibi, table, rows_per_block, head_row, lane_words, block_size, k_words,
                                   v_words, k_scales, v_scales)

        # Merge the 4 warps in warp order through shared memory (a warp without tokens is neutral).
        warp_m = cuda.shared.array(NUM_WARPS, float32)
        warp_l = cuda.shared.array(NUM_WARPS, float32)
        warp_acc = cuda.shared.array(WARPS_TIMES_HEAD_DIM, float32)
        if lane == 0:
            warp_m[warp] = m
            warp_l[warp] = l
        for e in range(E):
            warp_acc[warp * HEAD_DIM + lane * E + e] = acc[e]
        cuda.syncthreads()
        m_star = warp_m[0]
        for w in range(1, NUM_WARPS):
            m_star = mathops.nan_max(m_star, warp_m[w])
        for d in range(cuda.threadIdx.x, HEAD_DIM, THREADS_PER_CTA):
            l_sum = float32(0)
            acc_sum = float32(0)
            for w in range(NUM_WARPS):
                weight = merge_weight(warp_m[w], m_star)
                l_sum = cuda.fma(weight, warp_l[w], l_sum)
                acc_sum = cuda.fma(weight, warp_acc[w * HEAD_DIM + d], acc_sum)
            if num_splits == 1:
                out[seq, head, d] = normalized(acc_sum, l_sum)
            else:
                workspace[seq, head, shard, d] = acc_sum
                if d == 0:
                    workspace[seq, head, shard, HEAD_DIM] = m_star
                    workspace[seq, head, shard, HEAD_DIM + 1] = l_sum

    return split_kernel


def combine_kernel(workspace, num_splits, out):
    """Merge the shards' partials in shard order and normalize; thread ``d`` owns element ``d``.

    Launch ``[(num_seqs, num_heads), head_dim]``. Workspace row ``[..., shard, :]`` holds
    ``acc[0:head_dim], m, l``.
    """
    seq = cuda.blockIdx.x
    head = cuda.blockIdx.y
    d = cuda.threadIdx.x
    head_dim = out.shape[2]
    m_star = workspace[seq, head, 0, head_dim]
    for s in range(1, num_splits):
        m_star = mathops.nan_max(m_star, workspace[seq, head, s, head_dim])
    l_sum = float32(0)
    acc_sum = float32(0)
    for s in range(num_splits):
        weight = merge_weight(workspace[seq, head, s, head_dim], m_star)
        l_sum = cuda.fma(weight, workspace[seq, head, s, head_dim + 1], l_sum)
        acc_sum = cuda.fma(weight, workspace[seq, head, s, d], acc_sum)
    out[seq, head, d] = normalized(acc_sum, l_sum)


@functools.lru_cache(maxsize=None)
def _split_kernel(cache_format: str, head_dim: int):
    return cuda.jit(split_kernel_function(cache_format, head_dim))


_combine_kernel = cuda.jit(combine_kernel)


# ---------------------------------------------------------------------------- host side


def decode_workspace(num_seqs: int, num_heads: int, head_dim: int, max_splits: int = MAX_AUTO_SPLITS):
    """A workspace for ``paged_decode``: float32 ``[num_seqs, num_heads, max_splits, head_dim + 2]``.

    Row ``[seq, head, shard]`` receives the shard's ``acc`` (``head_dim`` values), then ``m`` and
    ``l``. Allocate it once and pass it to every call (no allocation per call; CUDA-graph capture
    needs that). A device array on a GPU, a NumPy array in the simulator.
    """
    shape = (int(num_seqs), int(num_heads), int(max_splits), int(head_dim) + 2)
    return np.empty(shape, np.float32) if SIMULATOR else cuda.device_array(shape, np.float32)


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


def _check_index_values(tables, lens, block_size: int, num_blocks: int) -> None:
    """Every sequence's length is >= 0 and its used block-table entries are block ids in range."""
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens: expected lengths >= 0, got {lens.min()}")
    needed = -(-lens // block_size)
    if needed.size and needed.max() > tables.shape[1]:
        i = int(np.argmax(needed))
        raise ValueError(f"block_tables: sequence {i} has {lens[i]} tokens, which need {needed[i]} blocks of "
                         f"{block_size}, but the table has {tables.shape[1]} columns")
    for i, n_used in enumerate(needed):
        used = tables[i, :n_used]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            raise ValueError(f"block_tables: block ids must lie in [0, {num_blocks}), sequence {i} uses "
                             f"{used.min()}..{used.max()}")


def check_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale=None, v_scale=None,
                 alibi_slopes=None, num_splits="auto", workspace=None, max_seq_len=None) -> DecodeCall:
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
    cache_format = check_cache("k_cache", k_cache, k_scale, "k_scale")
    if np.dtype(v_cache.dtype) != np.dtype(k_cache.dtype) or tuple(v_cache.shape) != tuple(k_cache.shape):
        reject("v_cache", f"the shape {tuple(k_cache.shape)} and dtype {k_cache.dtype} of k_cache", v_cache)
    check_cache("v_cache", v_cache, v_scale, "v_scale")
    num_blocks, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_head_dim} does not match q's head_dim {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be a multiple of 32 from 32 to 256, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or np.dtype(block_tables.dtype).kind not in "iu":
        reject("block_tables", f"an integer array [{num_seqs}, max_blocks_per_seq]", block_tables)
    if tuple(seq_lens.shape) != (num_seqs,) or np.dtype(seq_lens.dtype).kind not in "iu":
        reject("seq_lens", f"an integer array [{num_seqs}]", seq_lens)
    if alibi_slopes is not None and (tuple(alibi_slopes.shape) != (num_heads,) or np.dtype(alibi_slopes.dtype) != np.float32):
        reject("alibi_slopes", f"float32 [{num_heads}] or None", alibi_slopes)
    if tuple(out.shape) != (num_seqs, num_heads, head_dim) or np.dtype(out.dtype) != np.float32:
        reject("out", f"float32 [{num_seqs}, {num_heads}, {head_dim}]", out)
    require_c_contiguous("out", out)

    # The index arrays' values: read on the host unless the caller vouches for them with max_seq_len.
    host_indices = isinstance(seq_lens, np.ndarray) and isinstance(block_tables, np.ndarray)
    if max_seq_len is None or host_indices:
        lens = to_host(seq_lens).astype(np.int64)
        _check_index_values(to_host(block_tables).astype(np.int64), lens, block_size, num_blocks)
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
        splits = choose_num_splits(num_seqs, num_heads, max_seq_len, device_num_sms(), block_size)
    elif isinstance(num_splits, (int, np.integer)) and not isinstance(num_splits, bool) and num_splits >= 1:
        splits = int(num_splits)
    else:
        raise ValueError(f"num_splits: expected a positive int or 'auto', got {num_splits!r}")
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
                      block_size)


def flat_cache(cache, scales):
    """The cache as one flat array of words (``lane_layout``'s word size) and its scales flattened
    (None for a float cache); views, no copies."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    fmt = CACHE_FORMATS[np.dtype(cache.dtype)]
    word = WORD_DTYPES[lane_layout(fmt, head_dim).word_bytes]
    num_rows = num_blocks * num_kv_heads * block_size
    words = cache.reshape(num_rows * head_dim).view(word)
    return words, None if scales is None else scales.reshape(num_rows)


def _as_int32(x):
    """Host index arrays become C-contiguous int32 (one kernel specialization); device arrays stay as they are."""
    return np.ascontiguousarray(x, dtype=np.int32) if isinstance(x, np.ndarray) else x


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale=None, v_scale=None,
                 alibi_slopes=None, num_splits="auto", workspace=None, *, max_seq_len=None, stream=0):
    """Decode attention of one query token per sequence over a paged cache, into ``out``; returns ``out``.

    ``q``: float32 ``[num_seqs, num_heads, head_dim]``; ``k_cache``, ``v_cache``: ``[num_blocks,
    num_kv_heads, block_size, head_dim]`` of uint8 E4M3 codes (then float32 ``k_scale``, ``v_scale``
    ``[num_blocks, num_kv_heads, block_size]`` are required), float32, or uint16 BF16 patterns;
    ``block_tables``: integer ``[num_seqs, max_blocks_per_seq]`` (entries past a sequence's blocks are
    never read); ``seq_lens``: integer ``[num_seqs]``, 0 allowed; ``softmax_scale``: a float;
    ``out``: float32 ``[num_seqs, num_heads, head_dim]``, written entirely; ``alibi_slopes``: float32
    ``[num_heads]`` or None.

    ``num_splits``: a positive int (any; the workspace must have room), or ``"auto"``
    (``choose_num_splits`` with this GPU's SM count; at most 8). ``workspace``: see
    ``decode_workspace``; allocated per call when None and ``num_splits > 1``.

    ``max_seq_len`` (keyword): an upper bound of ``seq_lens``. Without it the values of
    ``seq_lens`` and ``block_tables`` are checked on the host (device arrays are copied, a
    synchronizing copy). With it and device index arrays nothing is read back: only the block
    table's width is checked against ``max_seq_len`` and ``"auto"`` uses it (the way to run inside
    CUDA-graph capture); the caller vouches for the values.

    Arrays: NumPy (copied to the device once, ``out`` copied back, on a GPU), Numba device arrays or
    ``__cuda_array_interface__`` objects. Every bad argument is a ``ValueError`` before any launch.
    """
    call = check_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, out, k_scale, v_scale,
                        alibi_slopes, num_splits, workspace, max_seq_len)
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
    kernel = _split_kernel(call.cache_format, head_dim)
    kernel[(num_seqs, num_heads, call.num_splits), THREADS_PER_CTA, stream](
        *device, int(call.alibi_slopes is not None), call.scale_log2, call.num_kv_heads, call.block_size,
        call.num_splits, workspace_device, out_device)
    if call.num_splits > 1:
        _combine_kernel[(num_seqs, num_heads), head_dim, stream](workspace_device, call.num_splits, out_device)
    if out_device is not call.out:  # a NumPy out on a GPU
        out_device.copy_to_host(call.out, stream=stream)
    return out


# ---------------------------------------------------------------------------- every variant, for the PTX check


def kernel_variants():
    """``(name, python function, numba signature)`` of every decode kernel variant (C-contiguous, int32 indices)."""
    f32 = types.float32
    variants = []
    for cache_format in ("fp8", "bf16", "f32"):
        for head_dim in HEAD_DIMS:
            word = numpy_support.from_dtype(np.dtype(WORD_DTYPES[lane_layout(cache_format, head_dim).word_bytes]))
            signature = types.void(
                types.Array(f32, 3, "C"), types.Array(word, 1, "C"), types.Array(word, 1, "C"),
                types.Array(f32, 1, "C"), types.Array(f32, 1, "C"), types.Array(types.int32, 2, "C"),
                types.Array(types.int32, 1, "C"), types.Array(f32, 1, "C"), types.int64, f32, types.int64,
                types.int64, types.int64, types.Array(f32, 4, "C"), types.Array(f32, 3, "C"))
            variants.append((f"split[{cache_format}, head_dim={head_dim}]", split_kernel_function(cache_format, head_dim),
                             signature))
    variants.append(("combine", combine_kernel,
                     types.void(types.Array(f32, 4, "C"), types.int64, types.Array(f32, 3, "C"))))
    return variants
