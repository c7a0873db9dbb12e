"""Softmax attention over a paged (optionally FP8) KV cache: single-token decode and causal prefill.

For a query head ``h`` of a sequence with ``L`` cached tokens::

    s_j   = softmax_scale * <q_h, k_j> + slope_h * (j - (L - 1))     (ALiBi term only if slopes given)
    out_h = sum_j softmax(s)_j * v_j

GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. A sequence of length
0 has nothing to attend to and gives a zero row (never NaN). Everything is computed in float64
from the dequantized cache and returned as float32.
"""

from __future__ import annotations

import numpy as np

from . import kv_cache
from ._checks import as_float, as_index, require_ndim, require_shape


def _kv_head_of_query_heads(num_heads: int, num_kv_heads: int) -> np.ndarray:
    """For each query head, the kv head it reads (GQA); heads must divide."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    return np.arange(num_heads) // (num_heads // num_kv_heads)


def _checked_slopes(alibi_slopes, num_heads: int) -> np.ndarray | None:
    if alibi_slopes is None:
        return None
    slopes = as_float("alibi_slopes", alibi_slopes, np.float64)
    require_shape("alibi_slopes", slopes, (num_heads,))
    return slopes


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scores_bias: np.ndarray) -> np.ndarray:
    """Softmax attention of query rows ``q[R, H, D]`` over ``k, v[S, H, D]`` (already expanded per query head).

    ``scores_bias`` (broadcast to ``[R, H, S]``) is added to the scaled scores; ``-inf`` masks a key.
    Rows whose keys are all masked (or ``S == 0``) give zeros. float64 throughout.
    """
    # per head: [R, D] @ [D, S], as batched matrix products (einsum would not use BLAS here)
    scores = np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)).transpose(1, 0, 2) + scores_bias
    row_max = np.max(scores, axis=2, keepdims=True, initial=-np.inf)
    safe_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - safe_max)
    denom = weights.sum(axis=2, keepdims=True)
    out = np.matmul(weights.transpose(1, 0, 2), v.transpose(1, 0, 2)).transpose(1, 0, 2)
    return np.divide(out, denom, out=np.zeros_like(out), where=denom > 0)


PREFILL_ROWS = 64
"""Query rows attended at once by ``prefill`` (bounds its ``[rows, heads, S]`` score array)."""


def paged_decode(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    softmax_scale: float,
    k_scale=None,
    v_scale=None,
    alibi_slopes=None,
) -> np.ndarray:
    """Decode attention for one new query token per sequence over a paged KV cache.

    ``q``: ``[num_seqs, num_heads, head_dim]``; ``k_cache``, ``v_cache``: ``[num_blocks,
    num_kv_heads, block_size, head_dim]`` of floats, or of E4M3 codes with float32 ``k_scale``,
    ``v_scale`` ``[num_blocks, num_kv_heads, block_size]``; ``block_tables``: ``[num_seqs,
    max_blocks_per_seq]``; ``seq_lens``: ``[num_seqs]``; ``alibi_slopes``: ``[num_heads]`` or None.
    The query is the token at position ``seq_len - 1`` (it is already in the cache).
    Returns float32 ``[num_seqs, num_heads, head_dim]``; a sequence of length 0 gives zeros.
    """
    q64 = as_float("q", q, np.float64)
    require_ndim("q", q64, 3, "[num_seqs, num_heads, head_dim]")
    num_seqs, num_heads, head_dim = q64.shape
    kv_cache.check_cache(k_cache, k_scale, "k_cache")
    kv_cache.check_cache(v_cache, v_scale, "v_cache")
    require_shape("v_cache", v_cache, k_cache.shape)
    _, num_kv_heads, _, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_head_dim} does not match q's head_dim {head_dim}")
    kv_head = _kv_head_of_query_heads(num_heads, num_kv_heads)
    tables = as_index("block_tables", block_tables)
    require_ndim("block_tables", tables, 2, "[num_seqs, max_blocks_per_seq]")
    lens = as_index("seq_lens", seq_lens)
    require_shape("seq_lens", lens, (num_seqs,))
    require_shape("block_tables", tables, (num_seqs, tables.shape[1]))
    slopes = _checked_slopes(alibi_slopes, num_heads)

    out = np.zeros((num_seqs, num_heads, head_dim), dtype=np.float64)
    for i in range(num_seqs):
        length = int(lens[i])
        k = kv_cache.gather(k_cache, k_scale, tables[i], length).astype(np.float64)[:, kv_head, :]
        v = kv_cache.gather(v_cache, v_scale, tables[i], length).astype(np.float64)[:, kv_head, :]
        bias = np.zeros((num_heads, length))
        if slopes is not None:
            bias = slopes[:, None] * (np.arange(length) - (length - 1))[None, :]
        out[i] = _attend(q64[i][None] * softmax_scale, k, v, bias[None])[0]
    return out.astype(np.float32)


def prefill(q, k, v, softmax_scale: float, alibi_slopes=None) -> np.ndarray:
    """Causal attention of ``T`` new tokens over ``S >= T`` keys (the last ``T`` of which are theirs).

    ``q``: ``[T, num_heads, head_dim]``; ``k``, ``v``: ``[S, num_kv_heads, head_dim]`` (dense,
    dequantized). Query ``i`` sits at position ``S - T + i`` and attends keys ``0 .. S - T + i``;
    with ``S > T`` the first ``S - T`` keys are an earlier prefix (chunked prefill).
    Returns float32 ``[T, num_heads, head_dim]``.
    """
    q64 = as_float("q", q, np.float64)
    k64 = as_float("k", k, np.float64)
    v64 = as_float("v", v, np.float64)
    require_ndim("q", q64, 3, "[T, num_heads, head_dim]")
    require_ndim("k", k64, 3, "[S, num_kv_heads, head_dim]")
    require_shape("v", v64, k64.shape)
    t, num_heads, head_dim = q64.shape
    s, num_kv_heads, k_head_dim = k64.shape
    if k_head_dim != head_dim:
        raise ValueError(f"k: head_dim {k_head_dim} does not match q's head_dim {head_dim}")
    if s < t:
        raise ValueError(f"k: expected at least as many keys as queries (S >= T), got S = {s}, T = {t}")
    kv_head = _kv_head_of_query_heads(num_heads, num_kv_heads)
    slopes = _checked_slopes(alibi_slopes, num_heads)

    key_pos = np.arange(s)
    k_heads, v_heads = k64[:, kv_head, :], v64[:, kv_head, :]
    out = np.zeros((t, num_heads, head_dim), dtype=np.float64)
    for first in range(0, t, PREFILL_ROWS):
        rows = np.arange(first, min(t, first + PREFILL_ROWS))
        query_pos = (s - t + rows)[:, None, None]  # [R, 1, 1]
        bias = np.where(key_pos[None, None, :] <= query_pos, 0.0, -np.inf)  # causal mask, [R, 1, S]
        if slopes is not None:
            bias = bias + slopes[None, :, None] * (key_pos[None, None, :] - query_pos)
        out[rows] = _attend(q64[rows] * softmax_scale, k_heads, v_heads, bias)
    return out.astype(np.float32)
