"""Softmax attention over a paged (optionally FP8) KV cache: single-token decode and causal prefill.

For a query head ``h`` of a sequence with ``L`` cached tokens::

    s_j   = softmax_scale * <q_h, k_j> + slope_h * (j - (L - 1))     (ALiBi term only if slopes given)
    out_h = sum_j softmax(s)_j * v_j

GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. A sequence of length
0 has nothing to attend to and gives a zero row (whatever ``q`` and ``softmax_scale`` are).
Everything is computed in float64 from the dequantized cache (scores as
``<softmax_scale * q_h, k_j>``, as the kernels do) and returned as float32.

NaN and infinity follow IEEE arithmetic over exactly the keys a query reads, with no guard:
a NaN in ``q[.., h]`` makes row ``h`` NaN; a NaN in key or value ``j`` of kv head ``g`` makes NaN
every query head that reads ``g`` and attends ``j``; a NaN ``softmax_scale`` or ALiBi slope makes
NaN the rows it scales. An infinite score gives NaN weights (``inf - inf``), so NaN too. Keys a
query does not read cannot reach it, even when NaN: in prefill the keys after a query's position
(causal mask), in decode the cache slots past ``seq_len`` (which an engine poisons with NaN).
"""

from __future__ import annotations

import numpy as np

from . import kv_cache
from .checks import as_float, as_index, check_block_tables, require_ndim, require_shape


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


def _per_head_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``out[r, h] = a[r, h] @ b[h]`` for ``a[R, H, X]`` and ``b[H, X, Y]``: batched BLAS products
    (einsum would not use BLAS here)."""
    return np.matmul(a.transpose(1, 0, 2), b).transpose(1, 0, 2)


def _attend_all(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Softmax attention of query rows ``q[R, H, D]`` (already scaled) over *every* key of
    ``k, v[S, H, D]`` (expanded per query head), ``S >= 1``, plus ``bias`` (broadcast to ``[R, H, S]``).

    Plain IEEE float64 arithmetic with no guard: a NaN reaches every output it touches, and
    an infinite score gives NaN weights through ``inf - inf``. Callers pass only the keys a query reads.
    """
    scores = _per_head_matmul(q, k.transpose(1, 2, 0)) + bias
    weights = np.exp(scores - scores.max(axis=2, keepdims=True))
    return _per_head_matmul(weights, v.transpose(1, 0, 2)) / weights.sum(axis=2, keepdims=True)


def _attend_causal(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray, num_keys: np.ndarray) -> np.ndarray:
    """Row ``r`` of ``q[R, H, D]`` attends keys ``0 .. num_keys[r] - 1`` of ``k, v[S, H, D]``, where
    ``S = max(num_keys) >= 1``: ``_attend_all`` of each row over its own keys, computed for all rows at once.

    A key a row does not read must not reach it, even when its K or V is NaN (the kernels never
    load it). So the mask *selects* (``np.where``) instead of adding ``-inf`` (``NaN - inf`` is
    NaN), and the ``weights @ v`` product, where a masked key's weight 0 times a NaN value would
    still be NaN, sees the values with non-finite entries zeroed. That is exact for every row
    whose own values are finite; the rows that read a non-finite value are recomputed one by one.
    """
    attended = np.arange(k.shape[0])[None, None, :] < num_keys[:, None, None]  # [R, 1, S]
    scores = np.where(attended, _per_head_matmul(q, k.transpose(1, 2, 0)) + bias, -np.inf)
    # every row reads key 0, so its max is over at least one real score
    weights = np.where(attended, np.exp(scores - scores.max(axis=2, keepdims=True)), 0.0)
    finite_v = np.where(np.isfinite(v), v, 0.0)
    out = _per_head_matmul(weights, finite_v.transpose(1, 0, 2)) / weights.sum(axis=2, keepdims=True)
    reads_non_finite = np.cumsum(~np.all(np.isfinite(v), axis=(1, 2)))[num_keys - 1] > 0  # [R]
    for r in np.flatnonzero(reads_non_finite):
        n = num_keys[r]
        out[r] = _attend_all(q[r : r + 1], k[:n], v[:n], np.broadcast_to(bias, scores.shape)[r : r + 1, :, :n])[0]
    return out


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
    check_block_tables(tables, lens, k_cache.shape[2], k_cache.shape[0])
    slopes = _checked_slopes(alibi_slopes, num_heads)

    out = np.zeros((num_seqs, num_heads, head_dim), dtype=np.float64)  # length 0 keeps its zero row
    for i in range(num_seqs):
        length = int(lens[i])
        if length == 0:
            continue
        # gather reads the sequence's first `length` slots only: slots past it (NaN-poisoned) are never touched
        k = kv_cache.gather(k_cache, k_scale, tables[i], length).astype(np.float64)[:, kv_head, :]
        v = kv_cache.gather(v_cache, v_scale, tables[i], length).astype(np.float64)[:, kv_head, :]
        bias = np.zeros((num_heads, length))
        if slopes is not None:
            bias = slopes[:, None] * (np.arange(length) - (length - 1))[None, :]
        out[i] = _attend_all(q64[i][None] * softmax_scale, k, v, bias[None])[0]
    return out.astype(np.float32)


def prefill(q, k, v, softmax_scale: float, alibi_slopes=None) -> np.ndarray:
    """Causal attention of ``T`` new tokens over ``S >= T`` keys (the last ``T`` of which are theirs).

    ``q``: ``[T, num_heads, head_dim]``; ``k``, ``v``: ``[S, num_kv_heads, head_dim]`` (dense,
    dequantized). Query ``i`` sits at position ``S - T + i`` and attends keys ``0 .. S - T + i``;
    with ``S > T`` the first ``S - T`` keys are an earlier prefix (chunked prefill). A key after
    a query's position is never part of its math, even when NaN.
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
        num_keys = s - t + rows + 1  # query at position p reads keys 0 .. p
        keys = slice(0, int(num_keys[-1]))  # the block's last row reads the most; later keys are not touched
        bias = np.zeros((1, 1, 1))
        if slopes is not None:
            bias = slopes[None, :, None] * (key_pos[None, None, keys] - (num_keys - 1)[:, None, None])
        out[rows] = _attend_causal(q64[rows] * softmax_scale, k_heads[keys], v_heads[keys], bias, num_keys)
    return out.astype(np.float32)
