"""How tensor-core flash prefill attention over an FP8 or BF16 cache computes, modelled in vectorized NumPy.

Models ``fp8lab.numba_kernels.prefill_mma`` (grid ``(query blocks, num_kv_heads, num_seqs)`` of 4-warp CTAs) bit
for bit, and with ``shared_values`` (4 or 8 warps) the warpgroup kernel ``fp8lab.numba_kernels.prefill_wgmma`` (the
same grid and order, its ``P V`` one ``wgmma`` per warpgroup over the CTA's shared values). Checked
(``tests/simulators/test_prefill_mma.py``): against ``fp8lab.reference.attention.prefill`` over
``fp8lab.reference.kv_cache.gather`` within ``fp8lab.simulators.splitkv_mma.error_bound`` per query (each query is a
decode over its causal prefix, with the same roundings), and exactly against ``fp8lab.simulators.splitkv_mma``'s tile
functions, which it reuses.

What it computes: the contract of ``fp8lab.reference.attention.prefill`` (causal softmax attention of each
sequence's new tokens over its cached prefix and themselves, GQA) for an FP8 cache (E4M3 codes, one float32 scale
per token and kv head) or a BF16 cache (BF16 patterns, no scales), head size 128, ``G = num_heads / num_kv_heads``
query heads per kv head with ``G`` dividing 16, without ALiBi. The batch is laid out as ``fp8lab.numba_kernels.prefill`` takes it: ``q [sum(query_lens),
num_heads, D]``, sequence ``s``'s ``query_lens[s]`` new tokens back to back, its query ``i`` at position
``context_lens[s] - query_lens[s] + i``, attending keys ``0 ..`` that position.

How (the kernel's schedule, operation by operation). The scores and weights are the tile math of the tensor-core
decode (``fp8lab.simulators.splitkv_mma``: F16 queries times ``scale_log2``, scores by ``D / 16`` chained mma
k-steps, scores times ``k_scale``, the log2-domain online softmax with a lane's four partial sums, the weights ``p *
v_scale`` relative to a power of two in F16), with the *query tokens* in the rows and 64 keys per step:

- **Rows**: a warp owns ``TOKENS = 16 / G`` consecutive query tokens of one sequence and one kv head; row ``r`` of its
  mma tiles is query token ``i0 + r // G`` and query head ``kv G + r % G``. So the ``G`` heads that share the kv head
  share each K/V tile, and every row of the tile is used. Rows of tokens past ``query_lens[s]`` are zero queries and
  are not stored. The 4 warps of a CTA own consecutive tokens and share each K/V tile through shared memory.
- **Keys**: the warp walks key tiles of 64 (``KEYS``, four 16-key chunks) from position 0 in ascending order, up to
  its last token's position (no split, no merge: the rows are whole when the walk ends). Its keys stop at ``end =
  start + min(i0 + TOKENS, query_lens[s])`` (the last row's position + 1): keys past it count as not loaded, codes 0,
  ``k_scale`` 1, ``v_scale`` 0 (the kernel zeroes them in its registers; its CTA loaded them for a later warp).
- **Scores**: per chunk the decode's ``tile_scores``; then ``s = S * k_scale``, ``-inf`` where the key does not count.
- **Causal mask per row**: key ``j`` counts for row ``r`` when it was loaded and ``j <= position(r)``; otherwise its
  score is ``-inf`` and its weight ``p`` 0, exactly as the decode's tokens past the end.
- **Online softmax per row and tile**: ``m_new = max(m, max_j s_j)``, ``corr = 1 if m_new == m else exp2(m -
  m_new)``, ``p_j = exp2(s_j - m_new)``, ``l_t = fma(l_t, corr, (c_0 + c_1) + (c_2 + c_3))`` with ``c_i`` chunk
  ``i``'s ``(p_2t + p_2t+1) + (p_2t+8 + p_2t+9)`` (``chunk_lane_sums``). Here ``exp2`` flushes results below
  ``2^-126`` to 0 (``common.exp2_flush``; the kernel's ``ex2.approx.ftz.f32``, one instruction where the subnormal
  path costs four). What it drops is below ``2^-126`` of a weight: an F16 weight (``p * v_scale * inv``, that factor
  below 2) rounds it to 0 anyway, and a row's ``l``, which holds the row's largest weight (1), cannot resolve it.
- **Values** (flash-attention's order: the accumulator is rescaled, then the mma chain adds to it): ``acc`` is kept
  in units of ``pow = 2^floor(log2 vmax)``, ``vmax`` the largest V scale the warp has loaded so far (one for all its
  rows; ``power_of_two_below``, ``inv = 1 / pow``). Per tile: ``acc = fl32(acc * fl32(corr * (pow_old * inv)))`` (the
  ratio of the powers is a power of two at most 1, exact), ``w_j = f16(fl32(p_j * fl32(v_scale_j * inv)))``, then
  per chunk ``acc = fl32(acc + fl32(S))`` with ``S`` the exact 16-key sum of ``w_j v_j`` (one mma per 8 head
  elements, chained through the accumulator); a chunk wholly past the warp's ``end`` is skipped (it would add only
  zeros, but not always a zero of ``acc``'s sign).
- **End**: ``l = (l_0 + l_1) + (l_2 + l_3)`` per row, ``out = fl32(acc * pow) / l`` (0 where ``l = 0``;
  ``splitkv.normalized``).
- **A BF16 cache** (``OPERANDS``): the same schedule in BF16 operands, since a BF16 key is no F16 value (F16's range
  ends at 65504): the queries ``bf16(fl32(q * scale_log2))``, the keys and values as stored (exact), the weights
  ``bf16(p)``, BF16 ``mma``. There are no scales: the model multiplies by ``k_scale = 1`` and ``v_scale = 1`` (``pow =
  inv = 1``), each multiply exact, which the kernel leaves out. BF16 keeps 8 significant bits where F16 keeps 11, so
  the error bound is the decode's at ``2^-8`` (``splitkv_mma.error_bound(..., operand="bf16")``): the rounding every
  BF16 model's attention makes, of the order of the rounding the cache already gave K and V.

One difference from the reference, stated: a key *after* a query's position but inside its warp's last tile (at most
``TOKENS - 1`` keys) enters the ``P V`` mma with weight exactly 0, so a NaN value (an E4M3 code, a BF16 element) or a
non-finite V scale of that key reaches the query's output (``0 * NaN``; a V scale through ``pow``, of every row of the
warp), where the reference says a later key is never part of a query's math.
Keys past the warp's last query are not loaded at all. Finite caches (what quantization writes) are unaffected.
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference import dense, e4m3, kv_cache
from fp8lab.reference.checks import (
    as_float,
    as_index,
    check_block_tables,
    require_ndim,
    require_shape,
)

from .common import exp2_flush
from .fma import fma_f32
from .mma import MMA_N, k16_sum
from .splitkv_mma import (
    HEAD_DIMS,
    LOG2E,
    MAX_GROUP,
    TILE,
    WARPS,
    f16,
    lane_sums,
    power_of_two_below,
    tile_scores,
)

ROWS = 16
"""Rows of an mma tile: ``TOKENS`` query tokens times ``G`` query heads."""
KEYS = 64
"""Keys per step: the K/V tile a CTA shares through shared memory, and one online-softmax step of each row."""
CHUNKS = KEYS // TILE
"""16-key chunks of a tile: the k of one ``P V`` mma each, and two 8-key n tiles of the scores each."""
OPERANDS = {"fp8": "f16", "bf16": "bf16"}
"""The 16-bit format of the mma operands (queries, keys, weights, values) per cache format: every E4M3 value is an
F16 value (11 significant bits for the query and the weights); a BF16 key is not (F16's range ends at 65504), so a
BF16 cache multiplies in BF16."""


def supports(head_dim: int, group: int, block_size: int, kv_format: str, alibi: bool) -> bool:
    """Whether the flash prefill kernel computes an attention: a cache in one of ``OPERANDS``' formats (``kv_format``,
    the name of ``fp8lab.reference.kv_cache``'s format), no ALiBi, ``head_dim`` in ``HEAD_DIMS``, ``G`` query heads
    per kv head with ``G`` dividing 16, and KV blocks of whole tiles."""
    return (kv_format in OPERANDS and not alibi and head_dim in HEAD_DIMS and 1 <= group <= MAX_GROUP
            and MAX_GROUP % group == 0 and block_size % TILE == 0)


def tokens_per_warp(group: int) -> int:
    """Query tokens a warp owns: ``16 / G``."""
    return ROWS // group


def tokens_per_cta(group: int) -> int:
    """Query tokens a CTA (``WARPS`` warps) owns: the grid's x extent is ``ceil(query_len / this)``."""
    return WARPS * tokens_per_warp(group)


def cache_format(k_cache, v_cache, k_scale, v_scale) -> str:
    """``"fp8"`` for E4M3 codes (uint8) with float32 scales, ``"bf16"`` for BF16 patterns (uint16, the kernel's BF16
    storage) without scales; a ``ValueError`` naming the cache otherwise."""
    for name, cache, scales in (("k_cache", k_cache, k_scale), ("v_cache", v_cache, v_scale)):
        if not isinstance(cache, np.ndarray) or cache.dtype not in (np.uint8, np.uint16):
            raise ValueError(f"{name}: the tensor-core prefill attention takes an FP8 cache (uint8 E4M3 codes) or a "
                             f"BF16 cache (uint16 patterns), got {getattr(cache, 'dtype', type(cache).__name__)}")
        if cache.dtype == np.uint8:
            kv_cache.check_cache(cache, scales, name)
        else:
            require_ndim(name, cache, 4, "[num_blocks, num_kv_heads, block_size, head_dim]")
            if scales is not None:
                raise ValueError(f"{name}: a BF16 cache (uint16 patterns) takes no scales, got an array")
    require_shape("v_cache", v_cache, k_cache.shape)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected {k_cache.dtype} like k_cache, got {v_cache.dtype}")
    return "fp8" if k_cache.dtype == np.uint8 else "bf16"


def _checked(q, k_cache, v_cache, block_tables, context_lens, query_lens, k_scale, v_scale):
    q32 = as_float("q", q, np.float32)
    require_ndim("q", q32, 3, "[num_query_tokens, num_heads, head_dim]")
    kv_format = cache_format(k_cache, v_cache, k_scale, v_scale)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    num_heads = q32.shape[1]
    if q32.shape[2] != head_dim:
        raise ValueError(f"k_cache: head_dim {head_dim} does not match q's head_dim {q32.shape[2]}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    group = num_heads // num_kv_heads
    if not supports(head_dim, group, block_size, kv_format, False):
        raise ValueError(f"the tensor-core prefill attention takes head_dim in {HEAD_DIMS}, a number of query heads "
                         f"per kv head that divides {MAX_GROUP} and a block size that is a multiple of {TILE}; got "
                         f"head_dim {head_dim}, {group} heads per kv head, block size {block_size}")
    tables = as_index("block_tables", block_tables)
    require_ndim("block_tables", tables, 2, "[num_seqs, max_blocks_per_seq]")
    context = as_index("context_lens", context_lens)
    queries = as_index("query_lens", query_lens)
    require_shape("context_lens", context, (tables.shape[0],))
    require_shape("query_lens", queries, (tables.shape[0],))
    if np.any(queries < 0) or np.any(queries > context):
        raise ValueError("query_lens: expected 0 <= query_lens <= context_lens for every sequence")
    if int(queries.sum()) > q32.shape[0]:
        raise ValueError(f"query_lens: sum(query_lens) = {int(queries.sum())} is more than q's {q32.shape[0]} tokens")
    check_block_tables(tables, np.where(queries > 0, context, 0), block_size, num_blocks)
    if tables.shape[1] == 0:
        tables = np.zeros((tables.shape[0], 1), np.int64)
    return q32, tables, context, queries, kv_format


def bf16(x) -> np.ndarray:
    """float32 ``x`` rounded to BF16 (nearest, ties to even; NaN stays NaN), as float64 values."""
    return dense.round_to_bf16(np.asarray(x, np.float32)).astype(np.float64)


def cache_values(entries) -> np.ndarray:
    """The values (float64, exact) of cache entries: E4M3 codes (uint8) decoded, BF16 patterns (uint16) widened;
    the per-token scales are not applied."""
    if entries.dtype == np.uint8:
        return e4m3.VALUES.astype(np.float64)[entries]
    return dense.bf16_bits_to_float32(entries).astype(np.float64)


def tile_scores_of_chunks(qh: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``S [..., 16 rows, KEYS]`` (float32) of F16 or BF16 queries ``qh [..., 16, D]`` and exact keys ``keys [...,
    KEYS, D]``: per 16-key chunk the decode's ``tile_scores`` (``D / 16`` chained k-steps from 0, two 8-key mma tiles)."""
    chunked = keys.reshape(keys.shape[:-2] + (CHUNKS, TILE, keys.shape[-1]))
    s = tile_scores(qh[..., None, :, :], chunked)  # [..., chunks, 16 rows, 16 keys]
    return np.moveaxis(s, -3, -2).reshape(s.shape[:-3] + (ROWS, KEYS))


def chunk_lane_sums(p: np.ndarray) -> np.ndarray:
    """``[..., 4]``: lane ``t``'s sum of weights ``p [..., KEYS]`` (float32): per chunk the decode's ``lane_sums``
    (``(p_2t + p_2t+1) + (p_2t+8 + p_2t+9)``), then the four chunks pairwise, ``(c_0 + c_1) + (c_2 + c_3)``."""
    c = lane_sums(p.reshape(p.shape[:-1] + (CHUNKS, TILE)))  # [..., chunks, 4]
    return (c[..., 0, :] + c[..., 1, :]) + (c[..., 2, :] + c[..., 3, :])


def chunk_values(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``fl32(S)``, ``S [..., 16 rows, D]`` the exact sum over one chunk's 16 keys of ``weights [..., 16, 16]`` (F16 or
    BF16 values) times ``values [..., 16, D]`` (exact), one mma per 8 head elements: what each mma of the chain adds
    to its accumulator (``fp8lab.simulators.mma``: ``d = fl32(c + fl32(S))``; a zero ``S`` keeps its sign)."""
    head_dim = values.shape[-1]
    b = values.reshape(values.shape[:-1] + (head_dim // MMA_N, MMA_N)).swapaxes(-2, -3)  # [..., D/8, 16 keys, 8]
    s = k16_sum(weights[..., None, :, :], b).astype(np.float32)  # [..., D/8, 16 rows, 8]
    return s.swapaxes(-2, -3).reshape(weights.shape[:-1] + (head_dim,))


def paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale: float, k_scale,
                  v_scale, shared_values: int = 0) -> np.ndarray:
    """Causal prefill attention as the tensor-core kernel computes it: float32 ``[num_query_tokens, num_heads, D]``,
    whose rows past ``sum(query_lens)`` (padding, which no sequence owns and the kernel leaves unwritten) are 0.

    Arguments as ``fp8lab.numba_kernels.prefill.paged_prefill`` with an FP8 cache (uint8 codes, float32 ``k_scale``,
    ``v_scale`` ``[num_blocks, num_kv_heads, block_size]``) or a BF16 cache (uint16 patterns, the kernel's storage;
    no scales); the new tokens' K/V already in the cache. Every warp
    advances one tile per step, all at once; a warp past its last tile sees no key (``corr = 1``, ``p = 0``: its
    state stays as it is, as if it had stopped).

    ``shared_values``: 0 for ``prefill_mma``'s order; 4 or 8 for the warpgroup kernel's
    (``fp8lab.numba_kernels.prefill_wgmma`` with one or two warpgroups), whose CTAs of that many warps multiply one
    copy of the values, a ``wgmma`` per warpgroup: a warp's values are those of its CTA, loaded up to the CTA's end
    (``cta_end``, its last warp's ``end``), and every chunk of each of the CTA's tiles is multiplied (no chunk
    skipped). The scores, the V scales (zero past the warp's own ``end``) and so ``pow`` and the weights are the
    warp's as without it. So a NaN value code of a key before ``cta_end`` reaches every row of the CTA whose walk
    multiplies it with weight 0 (up to ``shared_values TOKENS - 1`` keys after a query's position, where the warp
    kernel's reach is ``TOKENS - 1``).
    """
    q32, tables, context, queries, kv_format = _checked(q, k_cache, v_cache, block_tables, context_lens, query_lens,
                                                        k_scale, v_scale)
    operand = f16 if OPERANDS[kv_format] == "f16" else bf16
    fp8 = kv_format == "fp8"
    num_tokens, num_heads, head_dim = q32.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tokens = tokens_per_warp(group)
    out = np.zeros((num_tokens, num_heads, head_dim), np.float32)

    # the warps: (sequence, first query token); every warp runs for every kv head
    seq = np.concatenate([np.full(-(-int(n) // tokens), s) for s, n in enumerate(queries)] + [np.zeros(0, np.int64)])
    if seq.size == 0:
        return out
    first_row = np.cumsum(queries) - queries  # q's row of each sequence's query 0
    i0 = np.concatenate([np.arange(0, int(n), tokens) for n in queries] + [np.zeros(0, np.int64)])
    start = (context - queries)[seq]  # position of query 0
    row_token = i0[:, None] + np.arange(ROWS) // group  # [W, 16]
    real = row_token < queries[seq][:, None]
    position = np.where(real, start[:, None] + row_token, -1)  # -1: nothing counts for a row past the queries
    end = start + np.minimum(i0 + tokens, queries[seq])  # keys loaded: up to the last row's position
    if shared_values not in (0, 4, 8):
        raise ValueError(f"shared_values: expected 0 (the warp kernel) or the 4 or 8 warps of a warpgroup kernel's "
                         f"CTA, got {shared_values!r}")
    cta_tokens = (shared_values or WARPS) * tokens
    cta_i0 = i0 - i0 % cta_tokens
    cta_end = start + np.minimum(cta_i0 + cta_tokens, queries[seq])  # the warp's CTA's end (its last warp's)
    value_end = cta_end if shared_values else end

    # queries: [W, kv, 16, D], the operand format's q * scale_log2, rows past the queries 0
    scale_log2 = np.float32(float(softmax_scale) * LOG2E)
    q_index = np.where(real, first_row[seq][:, None] + row_token, 0)
    heads = np.arange(num_kv_heads)[:, None] * group + np.arange(ROWS) % group  # [kv, 16]
    qh = operand(q32[q_index[:, None, :], heads[None]] * scale_log2)
    qh = np.where(real[:, None, :, None], qh, 0.0)

    shape = (len(seq), num_kv_heads, ROWS)
    m = np.full(shape, -np.inf, np.float32)
    l = np.zeros(shape + (4,), np.float32)
    acc = np.zeros(shape + (head_dim,), np.float32)  # in units of `pow`, the running largest V scale's power of 2
    v_max = np.zeros(shape[:2], np.float32)  # the largest V scale the warp has loaded (NaN-propagating)
    pow_ = np.ones(shape[:2], np.float32)
    for step in range(int(np.max(-(-end // KEYS)))):
        key = KEYS * step + np.arange(KEYS)  # [64]
        loaded = key[None, :] < end[:, None]  # [W, 64]
        values_loaded = key[None, :] < value_end[:, None]
        block = np.where(values_loaded, tables[seq[:, None], np.minimum(key // block_size, tables.shape[1] - 1)], 0)
        offset = key % block_size
        k = np.where(loaded[..., None, None], cache_values(k_cache[block, :, offset]), 0.0).transpose(0, 2, 1, 3)
        v = np.where(values_loaded[..., None, None], cache_values(v_cache[block, :, offset]), 0.0).transpose(0, 2, 1, 3)
        if fp8:
            ks = np.where(loaded[..., None], k_scale[block, :, offset], np.float32(1)).transpose(0, 2, 1)  # [W, kv, 64]
            vs = np.where(loaded[..., None], v_scale[block, :, offset], np.float32(0)).transpose(0, 2, 1)
        else:  # no scales: 1 for a loaded key (each multiply below is then exact, and the kernel skips it)
            ks = np.ones(loaded.shape, np.float32)[:, None, :]
            vs = loaded.astype(np.float32)[:, None, :]
        counts = (loaded[:, None, :] & (key[None, None, :] <= position[:, :, None]))[:, None]  # [W, 1, rows, keys]
        with np.errstate(invalid="ignore", over="ignore"):
            s = np.where(counts, tile_scores_of_chunks(qh, k) * ks[..., None, :], np.float32(-np.inf))
            m_new = np.maximum(m, np.max(s, axis=-1))  # NaN-propagating, as the kernel's nan_max
            corr = np.where(m_new == m, np.float32(1), exp2_flush(m - m_new))
            p = np.where(counts, exp2_flush(s - m_new[..., None]), np.float32(0))
        l = fma_f32(l, corr[..., None], chunk_lane_sums(p))
        v_max = np.maximum(v_max, np.max(vs, axis=-1))  # NaN-propagating
        pow_new, inv = power_of_two_below(v_max)
        with np.errstate(invalid="ignore", over="ignore"):
            rescale = corr * (pow_ * inv)[..., None]  # pow / pow_new: a power of two at most 1, exact
            acc = acc * rescale[..., None]
            weights = operand(p * (vs * inv[..., None])[..., None, :])
            if shared_values:  # every chunk of the CTA's tiles
                chunk_loaded = np.broadcast_to((KEYS * step < cta_end)[:, None], (len(seq), CHUNKS))
            else:
                chunk_loaded = (KEYS * step + TILE * np.arange(CHUNKS))[None, :] < end[:, None]  # [W, chunks]
            for c in range(CHUNKS):  # P V: one mma chain through the accumulator; a chunk past the warp's end skipped
                part = slice(TILE * c, TILE * (c + 1))
                summed = acc + chunk_values(weights[..., part], v[..., part, :])
                acc = np.where(chunk_loaded[:, c, None, None, None], summed, acc)
        m, pow_ = m_new, pow_new

    l_row = (l[..., 0] + l[..., 1]) + (l[..., 2] + l[..., 3])
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        total = acc * pow_[..., None, None]
        result = np.where(l_row[..., None] == 0, np.float32(0), total / l_row[..., None])
    w_index, kv_index, row_index = np.nonzero(np.broadcast_to(real[:, None, :], shape))
    out[q_index[w_index, row_index], heads[kv_index, row_index]] = result[w_index, kv_index, row_index]
    return out
