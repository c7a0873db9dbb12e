"""How split-kv flash decoding computes paged decode attention, modelled in vectorized NumPy.

Models ``fp8lab.numba_kernels.splitkv`` (grid ``(num_seqs, num_heads / H, num_splits)`` of 4-warp CTAs,
then the combine) bit for bit, and writes its launch plan once: ``heads_per_cta``, ``choose_num_splits``,
``shard_bounds``, ``lanes_per_token``, ``num_slots`` are what the kernel's host side launches with.
Checked (``tests/simulators/test_splitkv.py``): against ``fp8lab.reference.attention.paged_decode`` within
a float32 error bound.

What it computes (the contract of ``fp8lab.reference.attention.paged_decode``): for each sequence and
query head ``h``, softmax attention of the new token's query over the sequence's ``L`` cached
tokens, reading kv head ``h // (num_heads // num_kv_heads)`` (GQA), with an optional ALiBi bias
``slope_h * (j - (L - 1))``. A sequence of length 0 gives a zero row.

How (the schedule a CUDA kernel follows, and this model reproduces in float32, operation by
operation):

- **Grid** ``(num_seqs, num_heads / H, num_splits)``: one CTA of 4 warps per sequence, *shard* and
  group of ``H = heads_per_cta(num_heads / num_kv_heads, num_seqs * max_seq_len)`` query heads that share one kv head (GQA:
  the CTA loads and decodes each K and V row once for its ``H`` heads). ``shard_bounds`` cuts
  ``[0, L)`` into ``num_splits`` ranges of whole KV blocks (the last ones may be empty).
  ``choose_num_splits`` is the ``"auto"`` heuristic.
- **Lanes and slots**: a token is read by ``lanes_per_token(D)`` lanes (``D / 16`` for the kernel's
  head sizes 32 to 256), lane ``r`` of them owning the 16 consecutive elements ``[16 r, 16 r + 16)``
  of the head (``lane_elements``; for an FP8 cache one 128-bit load). A warp thus reads
  ``32 / lanes_per_token`` tokens at once and the CTA ``num_slots(D)`` (16 at D = 128): each group
  of lanes is a *slot* with its own online-softmax state. A shard's tokens are dealt to the slots
  round-robin (``slot_tokens``): slot ``p`` takes ``start + p, start + p + num_slots, ...``, in
  increasing order, so the slots of one warp read neighbouring tokens.
- **Log2 domain**: ``scale_log2 = softmax_scale * log2(e)`` (float64 on the host, rounded once to
  float32) is folded into the query once, ``q2 = q * scale_log2`` (float32), so a score is already a
  base-2 exponent and ``exp2`` (one GPU instruction) replaces ``exp``. ALiBi slopes are folded the
  same way: ``slope2 = slope * float32(log2(e))``.
- **Score of token j** (the slot's lanes work on it): each lane forms ``part = fma(q2[d], k[d], part)``
  over its 16 elements in order from 0, a butterfly ``part += shfl_xor(part, off)`` for ``off =
  lanes_per_token / 2, ..., 2, 1`` gives each of the slot's lanes the dot product, then ``s = dot *
  k_scale[j]`` (the per-token FP8 scale is applied once to the dot, not per element; a float cache
  has no scale) and, with ALiBi, ``s = fma(slope2, float32(j - (L - 1)), s)``. ``k[d]`` is the exact
  float32 value of the code (or of the float cache entry).
- **Online softmax per slot and head** (state ``m = -inf, l = 0, acc = 0``), per token::

      m_new = max(m, s);  corr = 1 if m_new == m else exp2(m - m_new);  p = exp2(s - m_new)
      l   = fma(l, corr, p)
      acc = fma(p * v_scale[j], v[d], acc[d] * corr)     for each element d (the lane's own)
      m   = m_new

  ``corr = 1`` when the max did not move is what ``exp2(0)`` gives anyway; stating it lets the
  kernel skip the ``exp2`` and the ``acc * corr`` multiplications on most tokens (``x * 1`` is
  ``x``), and keeps a state whose max is still ``-inf`` finite.
- **Merge** (``merge_partials``; the same rule joins the slots of a CTA, in slot order, and the
  shards of a sequence, in shard order): ``m* = max m_i``, ``w_i = exp2(m_i - m*)`` (0 where
  ``m_i = -inf``), ``l = sum w_i l_i``, ``acc = sum w_i acc_i`` as float32 fma chains from 0. A shard
  writes its partial ``(m, l, acc)``, *not* normalized. An empty slot or shard is the neutral
  element ``(-inf, 0, 0)``: it contributes weight 0 and leaves ``m*`` alone.
- **Combine** (``combine_partials``, one more small kernel): merge the shards, then
  ``out = acc / l`` (float32 division); ``l = 0`` (length 0) gives a zero row, never NaN.

``np.exp2`` on float32 is not correctly rounded (here within 2 ulp), and neither is CUDA's
``exp2f``/``ex2.approx``: the two differ in the last bits, so GPU results are checked against this
model (or the reference) with an error bound, not bit for bit. NumPy's float32 ``exp2`` may also
differ between CPUs (SIMD paths). Every other operation above is a correctly rounded float32
operation (``fma`` via ``fp8lab.simulators.fma.fma_f32``), reproducible anywhere.

Two formulations give the same bits: ``shard_partials_by_step`` runs the schedule as written, one
token per slot per step; ``shard_partials`` (what ``paged_decode`` uses) computes every token's
score at once, the running max as a cumulative maximum, and steps only through the ``l`` and
``acc`` fma chains, which are truly sequential (see its docstring).

Model parameters, not kernel limits: any ``head_dim`` up to 512 (lanes own 16 elements each, the
last lane's run padded with zeros; ``lanes_per_token`` is the next power of two). The kernel
compiles ``head_dim`` 32, 64, 128 and 256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fp8lab.reference import e4m3, kv_cache
from fp8lab.reference.checks import (
    as_float,
    as_index,
    check_block_tables,
    require_ndim,
    require_shape,
)

from .common import WARP_SIZE
from .fma import (
    FmaScratch,
    fma_f32,
    fma_f32_into,
    fma_f32_round_to_odd,
    smallest_nonzero_magnitude,
)

NUM_WARPS = 4
"""Warps per CTA."""
ELEMENTS_PER_LANE = 16
"""Head elements a lane owns: 16 FP8 codes are one 128-bit load."""
MAX_HEAD_DIM = WARP_SIZE * ELEMENTS_PER_LANE
MAX_HEADS_PER_CTA = 4
"""Query heads one CTA serves at most (each costs a lane 32 registers: its query and accumulator)."""
HEADS_PER_CTA_BY_TOKENS = ((2048, 1), (8192, 2))
"""``(tokens, cap)``: at most ``cap`` query heads per CTA while a call's ``num_seqs * max_seq_len`` is at most
``tokens``; ``MAX_HEADS_PER_CTA`` beyond. Why: ``heads_per_cta``; the measurements: ``bench/attention_plan.py``
(``bench/RESULTS.md``, 2026-12-03): on an H200, Qwen3-8B and Qwen3-0.6B heads, batches 1 to 16, contexts 512
to 16,384, this rule (with 2 CTAs per SM) is within 4.4% of the fastest of 1, 2 and 4 heads per CTA and 1 or
2 CTAs per SM in every case measured, and never slower than the plan it replaced."""
MAX_SPLITS_PER_HEAD = 8
"""``"auto"`` splits a (sequence, query head) over at most 8 CTAs: ``8 * heads_per_cta`` shards."""
CTAS_PER_SM = 2
"""``"auto"`` aims at this many CTAs per SM. Two, measured on an H200 (``bench/RESULTS.md``, 2026-12-03) with
``heads_per_cta`` as above: as fast as one or faster in every case measured (at the Qwen3-8B shape, batch 4,
8,192 tokens: 56.7 against 72.1 us). (One per SM, the rule of 2026-12-02, was faster with 4 heads per CTA at
batch 1 up to 8,192 tokens, where ``heads_per_cta`` now takes 1 or 2.)"""
NUM_SMS = 132
"""Streaming multiprocessors of an H100 SXM / H200: the default GPU of the ``auto`` heuristic."""
LOG2E = math.log2(math.e)


# ---------------------------------------------------------------------------- the work decomposition


def shard_bounds(seq_len: int, num_splits: int, block_size: int) -> np.ndarray:
    """Token ranges ``[start, end)`` of the ``num_splits`` shards of a sequence, shape ``[num_splits, 2]``.

    Shards are made of whole KV blocks: each takes ``ceil(num_blocks / num_splits)`` blocks, so
    only the last non-empty shard may end inside a block (at ``seq_len``), and trailing shards may
    be empty (``start == end == seq_len``). Together they partition ``[0, seq_len)`` in order.
    """
    seq_len, num_splits, block_size = int(seq_len), int(num_splits), int(block_size)
    if seq_len < 0 or num_splits < 1 or block_size < 1:
        raise ValueError(
            f"shard_bounds: need seq_len >= 0, num_splits >= 1, block_size >= 1, got {seq_len}, {num_splits}, {block_size}"
        )
    num_blocks = -(-seq_len // block_size)
    tokens_per_shard = -(-num_blocks // num_splits) * block_size
    edges = np.minimum(np.arange(num_splits + 1) * tokens_per_shard, seq_len)
    return np.stack([edges[:-1], edges[1:]], axis=1)


def lanes_per_token(head_dim: int) -> int:
    """Lanes that read one token: ``ceil(head_dim / 16)`` rounded up to a power of two (``D / 16`` for
    the kernel's head sizes), so that the butterfly over them is a few ``shfl_xor`` steps."""
    head_dim = int(head_dim)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must lie in [1, {MAX_HEAD_DIM}], got {head_dim}")
    return 1 << (-(-head_dim // ELEMENTS_PER_LANE) - 1).bit_length()


def num_slots(head_dim: int) -> int:
    """Tokens a CTA reads at once, each by its own group of lanes (16 at ``head_dim`` 128)."""
    return NUM_WARPS * (WARP_SIZE // lanes_per_token(head_dim))


def butterfly_offsets(head_dim: int) -> tuple[int, ...]:
    """The ``shfl_xor`` offsets that sum a slot's lanes: ``lanes_per_token / 2, ..., 2, 1``."""
    lanes = lanes_per_token(head_dim)
    return tuple(1 << i for i in reversed(range(lanes.bit_length() - 1)))


def slot_tokens(start: int, end: int, slot: int, slots: int) -> np.ndarray:
    """The tokens of shard ``[start, end)`` that ``slot`` processes, in its order: round-robin by token.

    Dealing single tokens keeps the slots within one token of each other even in short shards, and
    the slots of a warp read neighbouring tokens (neighbouring rows of a KV block).
    """
    return np.arange(start + slot, end, slots)


def lane_elements(head_dim: int) -> np.ndarray:
    """``idx[r, e]``: the head element the slot's lane ``r`` owns as its ``e``-th, or -1
    (``[lanes_per_token, 16]``).

    Lane ``r`` owns ``[16 r, 16 r + 16)``; past ``head_dim`` (only for head sizes that are not 16
    times a power of two) it owns nothing. Each element is owned by exactly one lane.
    """
    lanes = lanes_per_token(head_dim)
    idx = np.arange(lanes * ELEMENTS_PER_LANE).reshape(lanes, ELEMENTS_PER_LANE)
    return np.where(idx < head_dim, idx, -1)


def heads_per_cta(group: int, tokens: int) -> int:
    """Query heads per CTA: the largest divisor of the GQA group size within the cap ``HEADS_PER_CTA_BY_TOKENS``
    sets for ``tokens`` (``num_seqs * max_seq_len`` of the call): 1 up to 2,048 tokens, 2 up to 8,192, 4 beyond.

    A CTA of ``H`` heads loads and decodes each K and V row once for its ``H`` heads, so a head-token
    costs fewer instructions, which is what long contexts need (at 16,384 tokens, 4 heads per CTA take
    40 us, 1 head 55 us). But it runs the ``H`` heads' work one after another and merges ``H`` heads'
    slots, and a short context is bound by that chain, not by the instructions per token: at 512
    tokens, 1 head per CTA takes 9.6 us, 4 heads 13.2. Which heads share a CTA never changes a bit of
    the result: only the split count does.
    """
    cap = next((c for most, c in HEADS_PER_CTA_BY_TOKENS if int(tokens) <= most), MAX_HEADS_PER_CTA)
    return max(h for h in range(1, cap + 1) if int(group) % h == 0)


def choose_num_splits(num_seqs: int, num_heads: int, num_kv_heads: int, max_seq_len: int, num_sms: int = NUM_SMS,
                      block_size: int = 16) -> int:
    """The ``"auto"`` split count: split the KV only when the grid alone would leave SMs idle.

    The goal is a full GPU: ``CTAS_PER_SM`` = 2 CTAs per SM. The grid without splitting has
    ``num_seqs * num_heads / H`` CTAs (``H = heads_per_cta(group, num_seqs * max_seq_len)``). The
    answer is the largest ``s`` with ``grid * s <= 2 * num_sms``, at most ``8 * H`` (8 CTAs per query
    head; more shards cost more combine traffic than they gain), at most the number of KV blocks of
    the longest sequence (a shard with no work is waste), and at least 1. It is 1 whenever
    ``grid * 2 > 2 * num_sms``.
    """
    per_cta = heads_per_cta(int(num_heads) // max(1, int(num_kv_heads)), int(num_seqs) * int(max_seq_len))
    grid = int(num_seqs) * int(num_heads) // per_cta
    if grid <= 0:
        return 1
    blocks_of_work = -(-int(max_seq_len) // int(block_size))
    most = MAX_SPLITS_PER_HEAD * per_cta
    return int(max(1, min(most, CTAS_PER_SM * int(num_sms) // grid, blocks_of_work)))


# ---------------------------------------------------------------------------- partials and their merge


@dataclass(frozen=True)
class Partials:
    """What the split-kv kernel writes before the combine: one ``(m, l, acc)`` per shard.

    ``m``, ``l``: float32 ``[num_seqs, num_heads, num_splits]`` (running max in the log2 domain, sum
    of ``exp2(s - m)``); ``acc``: float32 ``[num_seqs, num_heads, num_splits, head_dim]``, not
    normalized; ``bounds``: int ``[num_seqs, num_splits, 2]``, each shard's token range.
    Empty shards hold the neutral element ``(-inf, 0, 0)``.
    """

    m: np.ndarray
    l: np.ndarray
    acc: np.ndarray
    bounds: np.ndarray

    def shard_outputs(self) -> np.ndarray:
        """Each shard's own normalized output ``acc / l`` (zeros for empty shards)."""
        return _normalize(self.l, self.acc)


def neutral_partial(head_dim: int) -> tuple[np.float32, np.float32, np.ndarray]:
    """The neutral element ``(-inf, 0, zeros(head_dim))``: merging it in changes nothing."""
    return np.float32(-np.inf), np.float32(0), np.zeros(head_dim, dtype=np.float32)


def merge_weights(m: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """``(m*, w)``: ``m* = max m_i`` along ``axis`` and ``w_i = exp2(m_i - m*)``, 0 where ``m_i = -inf``.

    The guard matters when every ``m_i`` is ``-inf`` (nothing to attend to): ``-inf - -inf`` is NaN.
    """
    m_star = np.max(m, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore"):
        w = np.where(m == -np.inf, np.float32(0), np.exp2(m - m_star))
    return np.squeeze(m_star, axis=axis), w.astype(np.float32)


def merge_partials(m, l, acc, axis: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge partials along ``axis`` of ``m`` and ``l`` (``acc`` has one more, last, axis).

    ``l = sum w_i l_i`` and ``acc = sum w_i acc_i`` as float32 fma chains from 0, in index order.
    """
    m, l, acc = (np.asarray(x, dtype=np.float32) for x in (m, l, acc))
    axis = axis % m.ndim
    m_star, w = merge_weights(m, axis)
    l_sum = np.zeros(m_star.shape, dtype=np.float32)
    acc_sum = np.zeros(m_star.shape + acc.shape[-1:], dtype=np.float32)
    for i in range(m.shape[axis]):
        w_i = np.take(w, i, axis=axis)
        l_sum = fma_f32(w_i, np.take(l, i, axis=axis), l_sum)
        acc_sum = fma_f32(w_i[..., None], np.take(acc, i, axis=axis), acc_sum)
    return m_star, l_sum, acc_sum


def _normalize(l: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc / l`` (float32 division), and zeros where ``l == 0`` (nothing attended). A NaN ``l`` or
    ``acc`` (non-finite cache data) stays NaN, as in the kernel: only an empty row is a defined zero."""
    empty = (l == 0)[..., None]
    safe_l = np.where(l == 0, np.float32(1), l)[..., None]
    with np.errstate(invalid="ignore"):
        return np.where(empty, np.float32(0), acc / safe_l).astype(np.float32)


def combine_partials(m, l, acc) -> np.ndarray:
    """The combine step: merge the shards (last axis of ``m``, ``l``) and normalize: ``acc / l``.

    ``m``, ``l``: ``[..., num_splits]``; ``acc``: ``[..., num_splits, head_dim]``; returns float32
    ``[..., head_dim]``. All shards empty (``l = 0``): a zero row.
    """
    _, l_sum, acc_sum = merge_partials(m, l, acc, axis=-1)
    return _normalize(l_sum, acc_sum)


# ---------------------------------------------------------------------------- inside one CTA


def slot_scores(q2_lanes: np.ndarray, k_lanes: np.ndarray, k_scale: np.ndarray) -> np.ndarray:
    """Scores in the log2 domain: per-lane fma chains, the butterfly over the slot's lanes, ``* k_scale``.

    ``q2_lanes``, ``k_lanes``: ``[..., lanes_per_token, 16]`` (broadcastable; lanes' elements, 0 where
    a lane owns none); ``k_scale``: ``[...]``. Returns float32 ``[...]``.
    """
    shape = np.broadcast_shapes(q2_lanes.shape, k_lanes.shape)[:-1]
    part = np.zeros(shape, dtype=np.float32)
    for e in range(q2_lanes.shape[-1]):
        part = fma_f32(q2_lanes[..., e], k_lanes[..., e], part)
    lanes = np.arange(shape[-1])
    off = shape[-1] // 2
    while off:
        part = part + part[..., lanes ^ off]
        off //= 2
    return part[..., 0] * k_scale  # every lane has the same dot; a float cache passes k_scale = 1


def online_softmax_step(state, s, v, v_scale, active):
    """One token of every slot's online softmax; ``state = (m, l, acc)`` float32, returns the new one.

    ``s``, ``v_scale``, ``m``, ``l``: ``[...]``; ``v``, ``acc``: ``[..., D]``. Where ``active`` is False
    (the slot has no token this step) the state is left as it is.
    """
    m, l, acc = state
    with np.errstate(invalid="ignore"):  # inactive slots may hold -inf - -inf; they are masked below
        m_new = np.maximum(m, s)
        corr = np.where(m_new == m, np.float32(1), np.exp2(m - m_new))  # 0 on a slot's first token (m = -inf)
        p = np.exp2(s - m_new)
        l_new = fma_f32(l, corr, p)
        acc_new = fma_f32((p * v_scale)[..., None], v, acc * corr[..., None])
    return (np.where(active, m_new, m), np.where(active, l_new, l), np.where(active[..., None], acc_new, acc))


# ---------------------------------------------------------------------------- the entry points


def shard_partials(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale: float, k_scale=None, v_scale=None,
                   alibi_slopes=None, num_splits="auto") -> Partials:
    """Run the split-kv kernel and return its per-shard partials (before the combine).

    Arguments as ``paged_decode``. The same float32 operations as the step-by-step model
    (``shard_partials_by_step``: all slots advance one token per step), bit for bit, in fewer and
    larger NumPy operations:

    1. **Scores** (``_scores``): a token's score depends on no other token, so all of them are
       computed at once, one 128-token tile at a time.
    2. **Softmax weights** (``_softmax_weights``): the running max ``m`` of each slot is a cumulative
       maximum over its tokens (``np.maximum.accumulate``, exact), so every ``corr`` and ``p`` is
       known before any sum is formed.
    3. **Running sums** (``_running_sums``): only the ``l`` and ``acc`` fma chains are sequential; they
       advance one step for every (sequence, head, shard, slot, element) at once.
    """
    q32, tables, lens, slopes = _checked_arguments(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale,
                                                   alibi_slopes)
    num_seqs, num_heads, head_dim = q32.shape
    block_size = k_cache.shape[2]
    splits = _resolve_num_splits(num_splits, num_seqs, num_heads, k_cache.shape[1], lens, block_size)
    bounds = np.array([shard_bounds(length, splits, block_size) for length in lens], np.int64).reshape(num_seqs, splits, 2)
    slots = _Slots(bounds, tables, block_size, num_slots(head_dim))

    scale_log2 = np.float32(float(softmax_scale) * LOG2E)  # float64 product, rounded once
    scores = _scores(q32 * scale_log2, k_cache, k_scale, slots)  # [seq, kv, g, shard, step, slot]
    if slopes is not None:
        num_kv_heads = k_cache.shape[1]
        slope2 = (slopes * np.float32(LOG2E)).reshape(1, num_kv_heads, -1, 1, 1, 1)
        distance = (slots.token - (lens[:, None, None, None] - 1)).astype(np.float32)[:, None, None]
        scores = fma_f32(slope2, distance, scores)
    m, corr, p = _softmax_weights(scores, slots.active)
    l, acc = _running_sums(corr, p, v_cache, v_scale, slots)

    m, l, acc = merge_partials(m, l, acc, axis=4)  # the slots of each CTA, in slot order
    heads = (num_seqs, num_heads, splits)
    return Partials(m.reshape(heads), l.reshape(heads), acc.reshape(heads + (head_dim,)), bounds)


def shard_partials_by_step(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale: float, k_scale=None,
                           v_scale=None, alibi_slopes=None, num_splits="auto") -> Partials:
    """``shard_partials`` as the kernel runs it: one token per slot per step, all slots at once.

    The plain statement of the schedule (``slot_scores`` and ``online_softmax_step`` every step; the
    loop runs over the longest slot's token count), kept to read and to test ``shard_partials``
    against: both give the same bits. It is several times slower.
    """
    q32, tables, lens, slopes = _checked_arguments(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale,
                                                   alibi_slopes)
    num_seqs, num_heads, head_dim = q32.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    splits = _resolve_num_splits(num_splits, num_seqs, num_heads, num_kv_heads, lens, block_size)
    bounds = np.array([shard_bounds(length, splits, block_size) for length in lens], np.int64).reshape(num_seqs, splits, 2)
    slots = num_slots(head_dim)

    # Axes of the work: [seq, kv_head, group, shard, slot (, lane, element)]; query head = kv_head * group + g.
    scale_log2 = np.float32(float(softmax_scale) * LOG2E)  # float64 product, rounded once
    q2 = (q32 * scale_log2).reshape(num_seqs, num_kv_heads, group, 1, 1, head_dim)
    lanes = lane_elements(head_dim)
    q2_lanes = _to_lanes(q2, lanes)
    slope2 = None if slopes is None else (slopes * np.float32(LOG2E)).reshape(1, num_kv_heads, group, 1, 1)

    state_shape = (num_seqs, num_kv_heads, group, splits, slots)
    state = (np.full(state_shape, -np.inf, np.float32), np.zeros(state_shape, np.float32),
             np.zeros(state_shape + (head_dim,), np.float32))
    starts, ends = bounds[..., 0], bounds[..., 1]
    slot = np.arange(slots)
    steps = int(np.max(-(-(ends - starts) // slots), initial=0))
    for step in range(steps):
        token = starts[..., None] + slot + slots * step  # [seq, shard, slot]
        active = token < ends[..., None]
        k, ks = _gather_tokens(k_cache, k_scale, tables, token, active)  # [seq, kv, shard, slot(, D)]
        v, vs = _gather_tokens(v_cache, v_scale, tables, token, active)
        s = slot_scores(q2_lanes, _to_lanes(k[:, :, None], lanes), ks[:, :, None])
        if slope2 is not None:
            distance = (token - (lens[:, None, None] - 1)).astype(np.float32)[:, None, None]
            s = fma_f32(slope2, distance, s)
        state = online_softmax_step(state, s, v[:, :, None], vs[:, :, None], active[:, None, None])

    m, l, acc = merge_partials(*state, axis=4)  # the slots of each CTA, in slot order
    heads = (num_seqs, num_heads, splits)
    return Partials(m.reshape(heads), l.reshape(heads), acc.reshape(heads + (head_dim,)), bounds)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale: float, k_scale=None, v_scale=None,
                 alibi_slopes=None, num_splits="auto") -> np.ndarray:
    """Split-kv decode attention, as the kernel computes it: float32 ``[num_seqs, num_heads, head_dim]``.

    Arguments as ``fp8lab.reference.attention.paged_decode`` (FP8 caches of uint8 codes need float32
    ``k_scale``, ``v_scale`` ``[num_blocks, num_kv_heads, block_size]``), plus ``num_splits``: a
    positive int, or ``"auto"`` for ``choose_num_splits`` on this batch (``num_sms = 132``).
    """
    partials = shard_partials(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                              alibi_slopes, num_splits)
    return combine_partials(partials.m, partials.l, partials.acc)


# ---------------------------------------------------------------------------- the vectorized model

_SCORE_TILE = 1 << 16
"""About this many (lane, query head, token) products per score tile: its float64 arrays stay in cache."""
_VALUE_STEPS = 8
"""Steps of V gathered and decoded at a time by ``_running_sums``."""
_FP8_VALUES64 = e4m3.VALUES.astype(np.float64)  # code -> exact value (NaN codes -> NaN), a lookup table
_FP8_SMALLEST = float(np.min(np.abs(e4m3.VALUES[(e4m3.VALUES != 0) & np.isfinite(e4m3.VALUES)])))  # 2^-9
_FP8_MAX = float(np.nanmax(e4m3.VALUES))  # 448


class _Slots:
    """Which token every slot reads at every step: arrays ``[seq, shard, step, slot]``.

    ``token = start + slot + slots * step`` (round-robin); ``active`` where ``token < end``; ``block``
    and ``offset`` locate the token in the paged cache (block 0, offset 0 where inactive, never read
    as data).
    """

    def __init__(self, bounds, tables, block_size: int, slots: int):
        starts, ends = bounds[..., 0, None, None], bounds[..., 1, None, None]  # [seq, shard, 1, 1]
        self.steps = int(np.max(-(-(ends - starts) // slots), initial=0))
        self.token = starts + slots * np.arange(self.steps)[:, None] + np.arange(slots)
        self.active = self.token < ends
        position = np.where(self.active, self.token, 0)
        column = np.minimum(position // block_size, tables.shape[1] - 1).reshape(len(tables), -1)
        self.block = np.where(self.active, np.take_along_axis(tables, column, axis=1).reshape(self.token.shape), 0)
        self.offset = position % block_size


def _gather_codes(cache, block, offset, active) -> np.ndarray:
    """The cache entries (codes or floats) ``[..., kv_head, head_dim]`` of the tokens at ``(block, offset)``,
    0 for inactive tokens (an unused slot may hold NaN; code 0 is +0)."""
    raw = cache[block, :, offset, :]
    raw[~active] = 0
    return raw


def _decode(raw, out: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[...] =`` the exact float64 values of gathered cache entries, laid out as ``raw`` is indexed
    (``raw`` may be a transposed view). FP8 codes go through a 256-entry table, floats are rounded to
    float32 first (as the step-by-step model does). ``index``: an intp array of ``out``'s shape.

    (The codes are copied into ``index`` first because ``np.take`` would otherwise allocate that
    conversion anew each call; ``mode="wrap"`` skips the bounds check, codes are < 256 anyway.)
    """
    if raw.dtype == np.uint8:
        np.copyto(index, raw)
        return np.take(_FP8_VALUES64, index, out=out, mode="wrap")
    np.copyto(out, raw.astype(np.float32))
    return out


def _gather_scales(cache, scales, block, offset, active) -> np.ndarray:
    """The float32 per-token scales ``[..., kv_head]``: 1 for a float cache and for inactive tokens."""
    if not kv_cache.is_fp8(cache):
        return np.ones(block.shape + cache.shape[1:2], np.float32)
    return np.where(active[..., None], scales[block, :, offset], np.float32(1))


def _scores(q2, k_cache, k_scale, slots: _Slots) -> np.ndarray:
    """The log2-domain score of every slot step: float32 ``[seq, kv_head, g, shard, step, slot]``.

    ``slot_scores`` for all of them at once, per sequence, kv head and tile of tokens: lane ``r``'s
    chain over its 16 elements ``part = fma(q2[d], k[d], part)`` from ``part = 0``, the butterfly,
    then ``* k_scale``. The arrays are laid out ``[lane, g, token]``: the products broadcast ``q2``
    over the tokens (long inner loops) and ``k`` over the query heads of a GQA group (each key is
    decoded once), and each butterfly step adds two contiguous halves of the lane axis.
    """
    num_seqs, num_heads, head_dim = q2.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    lanes, per_lane = lane_elements(head_dim).shape
    width = lanes * per_lane  # head_dim padded with elements no lane owns (value 0)
    grid = slots.token.shape  # [seq, shard, step, slot]
    num_slots = int(np.prod(grid[1:]))
    scores = np.empty((num_seqs, num_kv_heads, group, num_slots), np.float32)

    # q2 by element and lane: [seq, kv, E, lane, g, 1], float64 (exact)
    q_lanes = np.zeros((num_seqs, num_heads, width))
    q_lanes[..., :head_dim] = q2
    q_lanes = q_lanes.reshape(num_seqs, num_kv_heads, group, lanes, per_lane).transpose(0, 1, 4, 3, 2)[..., None]
    fp8 = kv_cache.is_fp8(k_cache)
    fp8_bound = float(np.max(np.abs(q2), initial=0)) * _FP8_MAX if fp8 else None
    may_be_tiny = not fp8 or smallest_nonzero_magnitude(q2) * _FP8_SMALLEST < 2.0**-125  # see fma_f32_into

    tile = max(1, _SCORE_TILE // (lanes * group))
    for seq in range(num_seqs):
        block, offset, active = (x[seq].reshape(-1) for x in (slots.block, slots.offset, slots.active))
        for first in range(0, num_slots, tile):
            tokens = slice(first, min(first + tile, num_slots))
            raw = _gather_codes(k_cache, block[tokens], offset[tokens], active[tokens])  # [T, kv, D]
            if width > head_dim:
                raw = np.concatenate([raw, np.zeros(raw.shape[:2] + (width - head_dim,), raw.dtype)], axis=2)
            k_scales = _gather_scales(k_cache, k_scale, block[tokens], offset[tokens], active[tokens])
            count = raw.shape[0]
            shape = (lanes, group, count)
            k_lanes, k_index = np.empty((per_lane, lanes, count)), np.empty((per_lane, lanes, count), np.intp)
            part, scratch = np.empty(shape, np.float32), FmaScratch(shape)
            for kv in range(num_kv_heads):
                _decode(raw[:, kv].reshape(count, lanes, per_lane).transpose(2, 1, 0), k_lanes, k_index)
                for e in range(per_lane):
                    q_e, k_e = q_lanes[seq, kv, e], k_lanes[e][:, None, :]
                    if e == 0:  # fma(q, k, +0): the exact product + 0 (turns -0 into +0), rounded once to float32
                        np.multiply(q_e, k_e, out=scratch.total)
                        np.add(scratch.total, 0.0, out=part, casting="same_kind")
                    else:
                        fma_f32_into(q_e, k_e, part, part, scratch, fp8_bound, may_be_tiny)
                for half in butterfly_offsets(head_dim):  # the butterfly as lane 0 sees it: lanes r and r + half
                    part[:half] += part[half : 2 * half]
                np.multiply(part[0], k_scales[:, kv], out=scores[seq, kv, :, tokens])
    return scores.reshape((num_seqs, num_kv_heads, group) + grid[1:])


def _softmax_weights(scores, active):
    """``(m, corr, p)`` of every slot step, from the scores ``[seq, kv, g, shard, step, slot]``.

    ``m`` (after the last step, ``[seq, kv, g, shard, slot]``) is the running max; ``corr[step] =
    exp2(m_before - m_after)`` (1 where the max did not move) and ``p[step] = exp2(s - m_after)`` are
    laid out step first, ``[step, seq, kv, g, shard, slot]``. Where a slot has no token, ``corr = 1``
    and ``p = -0``: the
    fmas of ``_running_sums`` then leave ``l`` and ``acc`` as they are (``x * 1 + -0`` is ``x``, even
    for ``x = +0``), as the step-by-step model's ``np.where(active, ...)`` does.
    """
    active = active[:, None, None]
    scores = np.where(active, scores, np.float32(-np.inf))  # an idle step never raises the max
    m_after = np.maximum.accumulate(scores, axis=4)
    m_before = np.concatenate([np.full_like(m_after[..., :1, :], -np.inf), m_after[..., :-1, :]], axis=4)
    with np.errstate(invalid="ignore"):  # idle steps of an empty slot: -inf - -inf; replaced below
        corr = np.where(active & (m_before != m_after), np.exp2(m_before - m_after), np.float32(1))
        p = np.where(active, np.exp2(scores - m_after), np.float32(-0.0))
    m = m_after[..., -1, :] if scores.shape[4] else np.full(scores.shape[:4] + scores.shape[5:], -np.inf, np.float32)
    return m, np.moveaxis(corr, 4, 0).copy(), np.moveaxis(p, 4, 0).copy()


def _running_sums(corr, p, v_cache, v_scale, slots: _Slots):
    """Each slot's ``l`` and ``acc`` after its last token, from the weights of ``_softmax_weights``.

    Per step, for every (sequence, head, shard, slot) at once: ``l = fma(l, corr, p)`` and
    ``acc = fma(p * v_scale, v, acc * corr)`` (the float32 ``acc * corr`` first, as in the kernel).
    Returns ``l [seq, kv, g, shard, slot]`` and ``acc [..., head_dim]``.
    """
    steps, num_seqs, num_kv_heads, group, splits, slots_per_cta = p.shape
    head_dim = v_cache.shape[-1]
    state = (num_seqs, num_kv_heads, group, splits, slots_per_cta)
    l = np.zeros(state, np.float32)
    acc = np.zeros(state + (head_dim,), np.float32)
    l_rows, acc_rows = l.reshape(-1), acc.reshape(-1, head_dim)  # views: one row per (sequence, head, shard, slot)
    scratch = FmaScratch(acc.shape)

    # p * v_scale of every step, [step, seq, kv, g, shard, slot]: -0 on idle steps (p = -0, scale 1)
    v_scales = _gather_scales(v_cache, v_scale, slots.block, slots.offset, slots.active)  # [seq, shard, step, slot, kv]
    pv = p * v_scales.transpose(2, 0, 4, 1, 3)[:, :, :, None]
    fp8 = kv_cache.is_fp8(v_cache)
    fp8_bounds = np.max(np.abs(pv), axis=(1, 2, 3, 4, 5), initial=0) * _FP8_MAX if fp8 else [None] * steps
    may_be_tiny = not fp8 or smallest_nonzero_magnitude(pv) * _FP8_SMALLEST < 2.0**-125  # see fma_f32_into
    pv = pv.astype(np.float64)[..., None]

    v_values = v_index = np.empty(0)
    for first in range(0, steps, _VALUE_STEPS):
        chunk = slice(first, min(first + _VALUE_STEPS, steps))
        raw = _gather_codes(v_cache, slots.block[:, :, chunk], slots.offset[:, :, chunk], slots.active[:, :, chunk])
        raw = raw.transpose(2, 0, 4, 1, 3, 5)  # [step, seq, kv, shard, slot, D]
        if v_values.shape != raw.shape:  # (the last chunk may be shorter)
            v_values, v_index = np.empty(raw.shape), np.empty(raw.shape, np.intp)
        v = _decode(raw, v_values, v_index)[:, :, :, None]  # [step, seq, kv, 1 (g), shard, slot, D]
        for step in range(chunk.start, chunk.stop):
            # Only the rows whose max moved have corr != 1; elsewhere x * 1 = x exactly, so there
            # l = fma(l, 1, p) is the float32 sum l + p and acc * corr is acc.
            corr_rows, p_rows = corr[step].reshape(-1), p[step].reshape(-1)
            rows = np.flatnonzero(corr_rows != 1)
            if rows.size:  # (a few rows: fma_f32's always-exact path is the cheapest call)
                l_moved = fma_f32_round_to_odd(l_rows[rows], corr_rows[rows], p_rows[rows])
            np.add(l, p[step], out=l)
            if rows.size:
                l_rows[rows] = l_moved
                acc_rows[rows] *= corr_rows[rows, None]
            fma_f32_into(pv[step], v[step - chunk.start], acc, acc, scratch, fp8_bounds[step], may_be_tiny)
    return l, acc


# ---------------------------------------------------------------------------- helpers


def _to_lanes(x: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    """``x[..., D]`` as ``[..., 32, E]`` in the lanes' ownership (0 where a lane owns nothing)."""
    return np.where(lanes >= 0, np.take(x, np.maximum(lanes, 0), axis=-1), np.float32(0)).astype(np.float32)


def _gather_tokens(cache, scales, tables, token, active):
    """Values ``[seq, kv_head, shard, slot, D]`` and scales ``[seq, kv_head, shard, slot]`` of ``token``.

    FP8 codes become their exact float32 values; a float cache gets scale 1 (multiplying by 1 is
    exact, so this is the kernel variant without a scale). Inactive slots read as 0 with scale 1:
    they are masked out of the state anyway, and this keeps padded table entries (-1) out of it.
    """
    block_size = cache.shape[2]
    position = np.where(active, token, 0)
    table_column = np.minimum(position // block_size, tables.shape[1] - 1)
    block = np.where(active, np.take_along_axis(tables, table_column.reshape(len(tables), -1), axis=1)
                     .reshape(token.shape), 0)
    offset = position % block_size
    raw = cache[block, :, offset, :]  # [seq, shard, slot, kv_head, D]
    if kv_cache.is_fp8(cache):
        values = np.take(e4m3.VALUES, raw)
        token_scales = scales[block, :, offset]
    else:
        values = raw.astype(np.float32)
        token_scales = np.ones(raw.shape[:-1], dtype=np.float32)
    values = np.where(active[..., None, None], values, np.float32(0))
    token_scales = np.where(active[..., None], token_scales, np.float32(1))
    return values.transpose(0, 3, 1, 2, 4), token_scales.transpose(0, 3, 1, 2)


def _resolve_num_splits(num_splits, num_seqs, num_heads, num_kv_heads, lens, block_size) -> int:
    if isinstance(num_splits, str):
        if num_splits != "auto":
            raise ValueError(f"num_splits: expected a positive int or 'auto', got {num_splits!r}")
        return choose_num_splits(num_seqs, num_heads, num_kv_heads, int(np.max(lens, initial=0)), block_size=block_size)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 1:
        raise ValueError(f"num_splits: expected a positive int or 'auto', got {num_splits!r}")
    return int(num_splits)


def _checked_arguments(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, alibi_slopes):
    q32 = as_float("q", q, np.float32)
    require_ndim("q", q32, 3, "[num_seqs, num_heads, head_dim]")
    num_seqs, num_heads, head_dim = q32.shape
    kv_cache.check_cache(k_cache, k_scale, "k_cache")
    kv_cache.check_cache(v_cache, v_scale, "v_cache")
    require_shape("v_cache", v_cache, k_cache.shape)
    num_blocks, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_head_dim} does not match q's head_dim {head_dim}")
    lanes_per_token(head_dim)  # checks the range
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    tables = as_index("block_tables", block_tables)
    require_ndim("block_tables", tables, 2, "[num_seqs, max_blocks_per_seq]")
    require_shape("block_tables", tables, (num_seqs, tables.shape[1]))
    lens = as_index("seq_lens", seq_lens)
    require_shape("seq_lens", lens, (num_seqs,))
    check_block_tables(tables, lens, block_size, num_blocks)
    slopes = None
    if alibi_slopes is not None:
        slopes = as_float("alibi_slopes", alibi_slopes, np.float32)
        require_shape("alibi_slopes", slopes, (num_heads,))
    if tables.shape[1] == 0:  # no columns at all (every length 0): give the gather something to read
        tables = np.zeros((num_seqs, 1), dtype=np.int64)
    return q32, tables, lens, slopes
