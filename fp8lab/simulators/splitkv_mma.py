"""How tensor-core split-kv decode attention over an FP8 cache computes, modelled in vectorized NumPy.

Models ``fp8lab.numba_kernels.splitkv_mma`` (grid ``(num_seqs, num_kv_heads, num_splits)`` of 4-warp CTAs,
then the combine kernel of ``fp8lab.numba_kernels.splitkv``) bit for bit, and writes its launch plan once:
``choose_num_splits``, ``shard_bounds``, ``supports`` are what the kernel's host side launches with.
Checked (``tests/simulators/test_splitkv_mma.py``): against ``fp8lab.reference.attention.paged_decode`` within
the error bound of its F16 roundings (``error_bound``), and against ``fp8lab.simulators.mma`` fragment by fragment.

What it computes: the contract of ``fp8lab.reference.attention.paged_decode`` (softmax attention of each
sequence's new query over its cached tokens, GQA) for an FP8 cache (E4M3 codes, one float32 scale per token and kv
head), without ALiBi; a sequence of length 0 gives a zero row.

How (the schedule the kernel follows, and this model reproduces operation by operation). One CTA of ``WARPS`` = 4
warps serves one sequence, one kv head and one *shard* of its tokens; the ``G = num_heads / num_kv_heads`` query
heads of the kv head (at most 16) are the 16 rows of ``mma.m16n8k16`` tiles (rows ``G..15`` are zeros). The shard is
cut into *tiles* of 16 tokens (``TILE``), which never straddle a KV block (the block size is a multiple of 16);
warp ``w`` walks tiles ``w, w + 4, w + 8, ...`` with a state of its own, and the CTA merges the 4 warps' states in
warp order by the merge rule of ``fp8lab.simulators.splitkv`` (``merge_partials``), as that kernel merges its slots.

- **Queries**: ``qh = f16(fl32(q * scale_log2))`` (``scale_log2 = softmax_scale * log2(e)``, float64 on the
  host, rounded once to float32): F16 keeps 11 significant bits, where BF16 keeps 8, and every E4M3 value is
  an F16 value, so the scores' products are those of the F16 query with the exact keys.
- **Scores of a tile** ``S [16 rows, 16 tokens]``: ``D / 16`` k-steps, each one ``mma`` per 8 tokens, chained
  through the accumulator from 0 (the model of ``fp8lab.simulators.mma``: per step ``c = fl32(c + fl32(sum of
  16 exact products))``). Step ``s`` takes the 16 head elements ``(D/4) t + 4 s + i`` (``t = 0..3``, ``i =
  0..3``) in the mma's k order ``k = 2t + (i & 1) + 8 (i >> 1)`` (``score_dims``): that is the order in which
  lane ``4 g + t`` finds them in the 32-bit word ``s`` of its ``D / 4`` contiguous bytes of key row ``g``,
  so a key word becomes the B registers by two ``cvt.rn.f16x2.e4m3x2`` conversions and nothing else. Then
  ``s = S * k_scale[token]`` (float32); tokens past the shard's end are ``-inf``.
- **Online softmax per row**, per tile of the warp (state ``m = -inf``, ``l = 0`` per lane, ``acc = 0``)::

      m_new = max(m, max_j s_j)           (NaN-propagating)
      corr  = 1 if m_new == m else exp2(m - m_new)
      p_j   = exp2(s_j - m_new)           (0 for tokens past the end)
      l_t   = fma(l_t, corr, (p_2t + p_2t+1) + (p_2t+8 + p_2t+9))      for the row's four lanes t = 0..3

  ``exp2`` flushes results below ``2^-126`` to 0 (``common.exp2_flush``: the kernel's bare ``ex2.approx.ftz.f32``,
  where keeping float32 subnormals costs three more instructions a weight). What it drops is below F16's smallest
  weight and below what ``l``, which holds the row's largest weight 1, resolves.

  Each lane keeps its own ``l`` of the four tokens it holds (the mma accumulator's columns ``2t, 2t + 1`` of
  both 8-token halves); the four are summed once at the end, ``(l_0 + l_1) + (l_2 + l_3)``.
- **Values of a tile**, ``acc [16 rows, D]``: the per-token V scale goes into the weights, relative to the
  tile's largest: ``pow = 2^floor(log2(vmax))`` from the exponent bits of ``vmax = max_j v_scale_j`` (1 when
  those bits are 0), ``inv = 2^-floor(...)`` likewise, ``w_j = f16(fl32(p_j * fl32(v_scale_j * inv)))`` (so
  F16's range holds the weights whatever the scales' magnitude); ``O = fl32(sum_j w_j v_j)`` by one ``mma``
  per 8 head elements (k = the 16 tokens in order, from a zero accumulator); ``acc = fma(acc, corr, fl32(O *
  pow))`` (``O * pow`` is exact: a power of two).
- **Shard partial**: the warps' ``(m, l, acc)`` merged in warp order, per query head, not normalized, in the workspace layout of
  ``fp8lab.numba_kernels.splitkv`` (an empty shard: ``(-inf, 0, 0)``); the combine is that module's (and
  ``fp8lab.simulators.splitkv.combine_partials``). With one shard the kernel writes ``acc / l`` itself (0 where
  ``l = 0``).

What the tensor-core order costs against the float32 SIMT kernel (``fp8lab.simulators.splitkv``): the query
and the weights ``p * v_scale`` are rounded to F16 (relative ``2^-11`` each, plus F16's subnormal spacing
``2^-24`` relative to the tile's largest V scale for the weights); ``error_bound`` states the resulting bound.
A NaN code, scale or query reaches the output as NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fp8lab.reference import e4m3, kv_cache

from .common import WARP_SIZE, exp2_flush
from .dense import rms_norm, rope
from .fma import fma_f32
from .mma import MMA_K, MMA_N, k16_sum
from .splitkv import (
    NUM_SMS,
    Partials,
    _checked_arguments,
    combine_partials,
    merge_partials,
)

TILE = 16
"""Tokens per tile: the k of the ``P V`` mma, and the two 8-token n tiles of the scores."""
MAX_GROUP = 16
"""Query heads per kv head at most: the 16 rows of an mma tile."""
HEAD_DIMS = (128,)
"""Head sizes the kernel compiles (every Qwen3's): a lane's 4 value words per token are one 128-bit load, and its
state (the queries' 16 words, ``acc``'s 32 or 64 floats, a tile's 40 words) fits in registers. (The model takes any
multiple of 32.)"""
WARPS = 4
"""Warps per CTA: warp ``w`` takes the shard's tiles ``w, w + 4, ...``; the CTA merges their partials in warp order."""
LONG_SHARD_TILES = 4 * WARPS
"""``"auto"`` doubles its split count (to 2 CTAs per SM) where a shard would hold more tiles than this (4 per warp)."""
MAX_SPLITS = 32
"""``"auto"`` cuts a sequence into at most this many shards."""
LOG2E = math.log2(math.e)
F32_EXPONENT_BITS = np.uint32(0x7F800000)
INVERSE_EXPONENT_BITS = np.uint32(254 << 23)
"""``2^e`` has exponent bits ``(e + 127) << 23``; its inverse ``2^-e`` has ``(254 << 23)`` minus those."""


# ---------------------------------------------------------------------------- the launch plan


def supports(head_dim: int, group: int, block_size: int, fp8: bool, alibi: bool) -> bool:
    """Whether this kernel computes a decode attention: an FP8 cache, no ALiBi, ``head_dim`` in ``HEAD_DIMS``,
    at most ``MAX_GROUP`` query heads per kv head and KV blocks of whole tiles."""
    return fp8 and not alibi and head_dim in HEAD_DIMS and 1 <= group <= MAX_GROUP and block_size % TILE == 0


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = NUM_SMS) -> int:
    """The ``"auto"`` split count: the largest power of two whose CTAs fit one per SM (whole waves: a 17th shard that
    puts 136 CTAs on 132 SMs cost 12 to 20%), doubled (2 CTAs per SM, which the registers allow) where a shard would
    hold more than ``LONG_SHARD_TILES`` tiles of the longest sequence; then at most one shard per ``WARPS`` tiles (a
    tile for every warp) and at most ``MAX_SPLITS``; at least 1.

    From the split-count sweep of ``bench/attention_mma.py`` on an H200 (``bench/RESULTS.md``, 2026-12-04, Qwen3-8B and
    Qwen3-0.6B heads, batches 1 to 16, 512 to 16,384 tokens): this rule picks the fastest timed count, or one within 5%
    of it, in every cell but one (0.6B heads, batch 8 over 512 tokens: 2 shards, 10% over the 4 that were fastest)."""
    tiles = -(-int(max_seq_len) // TILE)
    grid = int(num_seqs) * int(num_kv_heads)
    if grid == 0:
        return 1
    splits = 1
    while 2 * splits * grid <= int(num_sms):
        splits *= 2
    if tiles > LONG_SHARD_TILES * splits and 2 * splits * grid <= 2 * int(num_sms):
        splits *= 2
    return max(1, min(splits, -(-tiles // WARPS), MAX_SPLITS))


def shard_bounds(seq_len: int, num_splits: int) -> np.ndarray:
    """Token ranges ``[start, end)`` of the shards of a sequence, ``[num_splits, 2]``: each takes
    ``ceil(tiles / num_splits)`` whole tiles, in order; trailing shards may be empty (``start == end == seq_len``)."""
    seq_len, num_splits = int(seq_len), int(num_splits)
    tiles_per_shard = -(-(-(-seq_len // TILE)) // num_splits)
    edges = np.minimum(np.arange(num_splits + 1) * tiles_per_shard * TILE, seq_len)
    return np.stack([edges[:-1], edges[1:]], axis=1)


def score_dims(head_dim: int) -> np.ndarray:
    """``[D / 16, 16]``: the head element at k-step ``s`` and mma k index ``k`` of the score mma
    (``(D/4) t + 4 s + i`` with ``t = (k % 8) // 2``, ``i = k % 2 + 2 (k // 8)``)."""
    k = np.arange(MMA_K)
    t, i = (k % 8) // 2, k % 2 + 2 * (k // 8)
    return (head_dim // 4) * t[None, :] + 4 * np.arange(head_dim // 16)[:, None] + i[None, :]


# ---------------------------------------------------------------------------- roundings


def f16(x) -> np.ndarray:
    """float32 ``x`` rounded to F16 (nearest, ties to even; overflow to inf), as float64 values."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def power_of_two_below(vmax) -> tuple[np.ndarray, np.ndarray]:
    """``(pow, inv)``: ``2^floor(log2 vmax)`` and its inverse from ``vmax``'s exponent bits, float32; ``(1, 1)``
    where those bits are 0 (a zero or subnormal ``vmax``), ``inv = 0`` where they are 254 or 255 (``vmax >= 2^127``,
    whose inverse is not a normal float32: V scales that large are outside the contract)."""
    bits = np.asarray(vmax, np.float32).view(np.uint32) & F32_EXPONENT_BITS
    one = np.float32(1).view(np.uint32)
    pow_bits = np.where(bits == 0, one, bits).astype(np.uint32)
    inverse = np.where(bits < INVERSE_EXPONENT_BITS, INVERSE_EXPONENT_BITS - np.minimum(bits, INVERSE_EXPONENT_BITS), 0)
    inv_bits = np.where(bits == 0, one, inverse).astype(np.uint32)
    return pow_bits.view(np.float32), inv_bits.view(np.float32)


# ---------------------------------------------------------------------------- the model


@dataclass
class _Tile:
    """One tile of every CTA: exact key/value values ``[seq, kv, shard, 16, D]`` (0 past the end), scales
    ``[seq, kv, shard, 16]`` (``v_scale`` 0 past the end) and which tokens are in the shard."""

    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray
    v_scale: np.ndarray
    valid: np.ndarray


def _gather_tile(k_cache, v_cache, k_scale, v_scale, tables, bounds, step: int) -> _Tile:
    """Step ``step`` of every (sequence, shard, warp): the warp's tile ``w + WARPS * step`` of the shard, for every
    kv head (the shard-and-warp axis flattened)."""
    block_size = k_cache.shape[2]
    first = bounds[:, :, 0, None] + TILE * np.arange(WARPS)  # [seq, shard, warp]
    token = (first + TILE * WARPS * step).reshape(len(bounds), -1)[..., None] + np.arange(TILE)  # [seq, shard*warp, 16]
    valid = token < np.repeat(bounds[:, :, 1], WARPS, axis=1)[..., None]
    position = np.where(valid, token, 0)
    column = np.minimum(position // block_size, tables.shape[1] - 1)
    block = np.where(valid, np.take_along_axis(tables, column.reshape(len(tables), -1), axis=1).reshape(token.shape), 0)
    offset = position % block_size

    def values(cache):
        codes = np.where(valid[..., None, None], cache[block, :, offset, :], 0)  # [seq, shard, 16, kv, D]
        return e4m3.VALUES.astype(np.float64)[codes].transpose(0, 3, 1, 2, 4)

    def scales(s, past_end):
        return np.where(valid[..., None], s[block, :, offset], np.float32(past_end)).transpose(0, 3, 1, 2)

    valid_kv = np.broadcast_to(valid[:, None], (len(tables), k_cache.shape[1]) + valid.shape[1:])
    return _Tile(values(k_cache), values(v_cache), scales(k_scale, 1), scales(v_scale, 0), valid_kv)


def tile_scores(qh: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``S [..., 16 rows, 16 tokens]`` (float32) of F16 queries ``qh [..., 16, D]`` and exact keys ``keys [..., 16, D]``:
    the chain of ``D / 16`` k-steps, two 8-token mma tiles each, from a zero accumulator."""
    head_dim = qh.shape[-1]
    c = np.zeros(keys.shape[:-2] + (16, TILE), np.float32)
    for dims in score_dims(head_dim):
        a = qh[..., dims]  # [..., 16 rows, 16 k]
        b = keys[..., dims].reshape(keys.shape[:-2] + (2, MMA_N, MMA_K)).swapaxes(-1, -2)  # [..., 2 tiles, 16 k, 8]
        s = k16_sum(a[..., None, :, :], b)  # [..., 2, 16, 8]
        c = c + np.concatenate([s[..., 0, :, :], s[..., 1, :, :]], axis=-1).astype(np.float32)
    return c


def tile_values(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``O [..., 16 rows, D]`` (float32) = ``fl32(sum over the 16 tokens of weights * values)``: one mma per 8 head
    elements from a zero accumulator (``weights [..., 16, 16]`` F16 values, ``values [..., 16, D]`` exact)."""
    head_dim = values.shape[-1]
    b = values.reshape(values.shape[:-1] + (head_dim // MMA_N, MMA_N)).swapaxes(-2, -3)  # [..., D/8, 16 tok, 8]
    o = k16_sum(weights[..., None, :, :], b).astype(np.float32) + np.float32(0)  # fl32(0 + fl32(S))
    return o.swapaxes(-2, -3).reshape(weights.shape[:-1] + (head_dim,))


def lane_sums(p: np.ndarray) -> np.ndarray:
    """``[..., 4]``: lane ``t``'s ``(p_2t + p_2t+1) + (p_2t+8 + p_2t+9)`` of weights ``p [..., 16]`` (float32)."""
    t = np.arange(4)
    return (p[..., 2 * t] + p[..., 2 * t + 1]) + (p[..., 8 + 2 * t] + p[..., 9 + 2 * t])


def shard_partials(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale: float, k_scale, v_scale,
                   num_splits="auto") -> Partials:
    """Run the tensor-core split kernel and return its per-shard partials (before the combine).

    Arguments as ``fp8lab.reference.attention.paged_decode`` with an FP8 cache (uint8 codes, float32 ``k_scale``,
    ``v_scale`` ``[num_blocks, num_kv_heads, block_size]``), no ALiBi; ``num_splits`` a positive int or
    ``"auto"`` (``choose_num_splits`` for this batch's longest sequence, 132 SMs). Every CTA advances one tile
    per step, all of them at once.
    """
    q32, tables, lens, _ = _checked_arguments(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, None)
    num_seqs, num_heads, head_dim = q32.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if not supports(head_dim, group, block_size, kv_cache.is_fp8(k_cache), False):
        raise ValueError(f"the tensor-core decode attention takes an FP8 cache, head_dim in {HEAD_DIMS}, at most "
                         f"{MAX_GROUP} query heads per kv head and a block size that is a multiple of {TILE}; got "
                         f"{k_cache.dtype}, head_dim {head_dim}, {group} heads per kv head, block size {block_size}")
    splits = _resolve(num_splits, num_seqs, num_kv_heads, lens)
    bounds = np.array([shard_bounds(n, splits) for n in lens], np.int64).reshape(num_seqs, splits, 2)

    scale_log2 = np.float32(float(softmax_scale) * LOG2E)
    qh = np.zeros((num_seqs, num_kv_heads, 1, 16, head_dim))
    qh[:, :, 0, :group] = f16(q32 * scale_log2).reshape(num_seqs, num_kv_heads, group, head_dim)

    cta = (num_seqs, num_kv_heads, splits * WARPS, 16)  # per warp and row
    m = np.full(cta, -np.inf, np.float32)
    l = np.zeros(cta + (4,), np.float32)
    acc = np.zeros(cta + (head_dim,), np.float32)
    steps = int(np.max(-(-(bounds[..., 1] - bounds[..., 0]) // (TILE * WARPS)), initial=0))
    for step in range(steps):
        tile = _gather_tile(k_cache, v_cache, k_scale, v_scale, tables, bounds, step)
        valid = tile.valid[..., None, :]  # [seq, kv, shard, 1, 16]: the same tokens for every row
        with np.errstate(invalid="ignore", over="ignore"):
            s = np.where(valid, tile_scores(qh, tile.k) * tile.k_scale[..., None, :], np.float32(-np.inf))
            m_new = np.maximum(m, np.max(s, axis=-1))  # NaN-propagating, as the kernel's nan_max
            corr = np.where(m_new == m, np.float32(1), exp2_flush(m - m_new))
            p = np.where(valid, exp2_flush(s - m_new[..., None]), np.float32(0))
        l = fma_f32(l, corr[..., None], lane_sums(p))
        pow_, inv = power_of_two_below(np.max(tile.v_scale, axis=-1))
        with np.errstate(invalid="ignore", over="ignore"):
            relative = tile.v_scale * inv[..., None]  # [seq, kv, shard, 16]
            weights = f16(p * relative[..., None, :])
            o = tile_values(weights, tile.v)  # [seq, kv, shard, 16, D]
            acc = fma_f32(acc, corr[..., None], o * pow_[..., None, None])
        m = m_new
        # (a CTA past its last tile sees no token: corr = 1 and p = 0 leave its state as it is, as if it had stopped)

    l_row = (l[..., 0] + l[..., 1]) + (l[..., 2] + l[..., 3])
    by_warp = (num_seqs, num_kv_heads, splits, WARPS, 16)
    m, l_row, acc = merge_partials(m.reshape(by_warp), l_row.reshape(by_warp), acc.reshape(by_warp + (head_dim,)), axis=3)
    heads = (num_seqs, num_heads, splits)
    pick = (slice(None), slice(None), slice(None), slice(0, group))
    return Partials(m[pick].transpose(0, 1, 3, 2).reshape(heads), l_row[pick].transpose(0, 1, 3, 2).reshape(heads),
                    acc[pick].transpose(0, 1, 3, 2, 4).reshape(heads + (head_dim,)), bounds)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale: float, k_scale, v_scale,
                 num_splits="auto") -> np.ndarray:
    """Tensor-core split-kv decode attention, as the kernels compute it: float32 ``[num_seqs, num_heads, head_dim]``
    (``shard_partials``, then the combine of ``fp8lab.simulators.splitkv``)."""
    partials = shard_partials(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, num_splits)
    return combine_partials(partials.m, partials.l, partials.acc)


def new_token_slots(block_tables, seq_lens, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, slots)``: the sequences with a new token (length > 0) and the cache slot of position ``length - 1``
    in each one's block table: where a decode step's new K/V go (``decode_with_input``)."""
    lens = np.asarray(seq_lens, np.int64)
    rows = np.flatnonzero(lens > 0)
    slots = [kv_cache.slots_for_positions(block_tables[i], [lens[i] - 1], block_size)[0] for i in rows]
    return rows, np.asarray(slots, np.int64)


def decode_with_input(q, k, v, q_norm, k_norm, eps: float, positions, cos_sin, k_cache, v_cache, block_tables,
                      seq_lens, softmax_scale: float, k_scale, v_scale, num_splits="auto") -> np.ndarray:
    """``fp8lab.numba_kernels.splitkv_mma.decode_mma_with_input``: the attention input of the new tokens (q/k-norm with
    a warp per head row, ``fp8lab.simulators.dense.rms_norm``; RoPE, ``dense.rope``; the FP8 cache write of k and v,
    ``fp8lab.reference.kv_cache.write``, at position ``length - 1`` of each sequence with one), then ``paged_decode``.
    ``q [S, Hq D]``, ``k``, ``v [S, Hkv D]``; the caches and scales are updated in place; returns the attention."""
    num_kv_heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_seqs = len(seq_lens)
    def normed_rotated(x, weight):
        heads = np.asarray(x, np.float32).reshape(num_seqs, -1, head_dim)
        return rope(rms_norm(heads, weight, eps, WARP_SIZE), positions, cos_sin)  # a warp per head row

    rows, slots = new_token_slots(block_tables, seq_lens, block_size)
    new_v = np.asarray(v, np.float32).reshape(num_seqs, num_kv_heads, head_dim)
    kv_cache.write(k_cache, k_scale, normed_rotated(k, k_norm)[rows], slots)
    kv_cache.write(v_cache, v_scale, new_v[rows], slots)
    return paged_decode(normed_rotated(q, q_norm), k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale,
                        v_scale, num_splits)


def _resolve(num_splits, num_seqs: int, num_kv_heads: int, lens) -> int:
    if isinstance(num_splits, str):
        if num_splits != "auto":
            raise ValueError(f"num_splits: expected a positive int or 'auto', got {num_splits!r}")
        return choose_num_splits(num_seqs, num_kv_heads, int(np.max(lens, initial=0)))
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int or 'auto', got {num_splits!r}")
    return int(num_splits)


# ---------------------------------------------------------------------------- the error bound


ROUNDING = {"f16": (2.0**-11, 2.0**-25), "bf16": (2.0**-8, 2.0**-134)}
"""``(relative, absolute)`` error of rounding a float32 to the mma's operand format: half an ulp of 11 (F16) or 8
(BF16) significant bits, and half the subnormal spacing (``2^-24``, ``2^-133``)."""


def error_bound(q, k_values, v_values, k_scale, v_scale, softmax_scale: float, operand: str = "f16") -> np.ndarray:
    """A bound ``[num_heads, D]`` on ``|this kernel's output - exact attention|`` for one sequence: ``q [num_heads, D]``,
    the exact decoded codes ``k_values``, ``v_values`` ``[num_kv_heads, L, D]`` of its ``L >= 1`` tokens and their
    scales ``k_scale``, ``v_scale`` ``[num_kv_heads, L]`` (ones for a BF16 cache). Valid while ``|q * scale_log2|``
    stays inside the operand format's range. ``operand``: the format of the mma's operands, ``"f16"`` (an FP8 cache)
    or ``"bf16"`` (the flash prefill over a BF16 cache, ``fp8lab.simulators.prefill_mma``), whose rounding ``(u,
    a)`` is ``ROUNDING[operand]``: ``(2^-11, 2^-25)`` for F16.

    With ``w_j`` the exact softmax weights and ``v_j = v_scale_j * v_values_j``, twice the sum of:

    - the scores' error ``ds_j`` (log2 units): the query's rounding, ``u |q_d|`` or ``a`` in the subnormal range,
      times ``|k_d| k_scale_j`` summed over ``d``, plus ``2^-20`` of ``sum_d |q_d k_d| k_scale_j``
      for the float32 chain and ``scale_log2``, plus ``2^-20`` for ``exp2``; it moves the output by at most
      ``ln 2 * sum_j w_j ds_j |v_j - out|`` to first order (the factor 2 covers the higher orders while ``ln 2 ds_j``
      stays below about 1/4, as it does for the tests' data: ``ds_j`` at most about 0.2 with BF16 operands);
    - the weights' rounding: ``u sum_j w_j |v_j|`` and ``a * max_j v_scale_j * sum_j |v_values_j|``
      (the subnormal spacing, relative to the tile's largest scale; ``l >= 1``);
    - the float32 sums (tiles, shards, the ``acc`` chain): ``2^-18 sum_j w_j |v_j|``.
    """
    unit, floor = ROUNDING[operand]
    q64 = np.asarray(q, np.float64) * float(np.float32(float(softmax_scale) * LOG2E))
    k64, v64 = np.asarray(k_values, np.float64), np.asarray(v_values, np.float64)
    ks, vs = np.asarray(k_scale, np.float64), np.asarray(v_scale, np.float64)
    num_heads, head_dim = q64.shape
    num_kv_heads = k64.shape[0]
    qg = q64.reshape(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [kv, g, D]
    scores = np.einsum("kgd,kld->kgl", qg, k64) * ks[:, None]
    magnitude = np.einsum("kgd,kld->kgl", np.abs(qg), np.abs(k64)) * ks[:, None]
    q_rounding = np.maximum(unit * np.abs(qg), floor)
    ds = np.einsum("kgd,kld->kgl", q_rounding, np.abs(k64)) * ks[:, None] + 2.0**-20 * (magnitude + 1)
    w = np.exp2(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    v = v64 * vs[..., None]  # [kv, L, D]
    out = np.einsum("kgl,kld->kgd", w, v)
    spread = np.abs(v[:, None] - out[:, :, None])  # [kv, g, L, D]
    from_scores = math.log(2) * np.einsum("kgl,kgld->kgd", w * ds, spread)
    weighted = np.einsum("kgl,kld->kgd", w, np.abs(v))
    subnormal = floor * vs.max(-1)[:, None, None] * np.abs(v64).sum(1)[:, None]
    return (2 * (from_scores + (unit + 2.0**-18) * weighted + subnormal)).reshape(num_heads, head_dim)
