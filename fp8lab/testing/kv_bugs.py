"""The bug classes of the FP8 KV cache and attention: each mistake as a mutant of the oracle.

Mutant signatures follow the operator: ``quantize_kv(x)``, ``paged_decode(q, k_cache, v_cache,
block_tables, seq_lens, softmax_scale, k_scale, v_scale, alibi_slopes=None)``, ``prefill(q, k, v,
softmax_scale, k_scale, v_scale, alibi_slopes=None)``, ``paged_cache_write(k, v, k_cache, v_cache, k_scale,
v_scale, slot_mapping)``; caches always in fp8lab's layout (a check given a caller's layout runs the
mutants on its own copy in fp8lab's).

ALiBi adds ``slope_h * (j - p)`` to the score of key ``j`` for a query at position ``p``. A mistake that
shifts this bias by a constant per (query, head), such as measuring the distance from key 0 or from the
last key instead of from the query, is *not* a bug class: softmax is invariant under it, so no output
can tell it apart. The ALiBi classes below change the bias's slope (its sign, its domain).
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference import attention, e4m3, kv_cache

from .report import BugClass

# ---------------------------------------------------------------------------- the FP8 KV cache and decode attention


def _kv_scale_over_all_heads(x):
    """``quantize_kv`` with one scale per token, taken over all its heads, instead of one per (token, head)."""
    x32 = np.asarray(x, np.float32)
    amax = np.max(np.abs(x32), axis=(-2, -1), initial=0)
    scales = np.broadcast_to(e4m3.scale_of_amax(amax)[..., None], x32.shape[:-1]).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return e4m3.encode(x32 / scales[..., None], saturate=True), scales


def _head(array, h: int):
    """Head ``h`` of ``array`` along axis 1 (kept as a 1-wide axis); None stays None."""
    return None if array is None else np.asarray(array)[:, h : h + 1]


def _slope(alibi_slopes, h: int):
    """The ALiBi slope of query head ``h`` as a 1-element array; None stays None."""
    return None if alibi_slopes is None else np.asarray(alibi_slopes)[h : h + 1]


def _decode_with_heads(kv_head_of):
    """The decode oracle with query head ``h`` reading kv head ``kv_head_of(h, num_heads, num_kv_heads)``
    (its ALiBi slope stays the query head's)."""
    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
        out = np.zeros(q.shape, np.float64)
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv_heads)
            out[:, h : h + 1] = attention.paged_decode(
                _head(q, h), _head(k_cache, g), _head(v_cache, g), block_tables, seq_lens, softmax_scale,
                _head(k_scale, g), _head(v_scale, g), _slope(alibi_slopes, h))
        return out
    return decode


def _decode_length_zero_nan(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                            alibi_slopes=None):
    """The oracle, but a sequence of length 0 divides 0 by 0 (``acc / l`` unguarded): NaN rows."""
    out = attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                                 alibi_slopes)
    out[np.asarray(seq_lens) == 0] = np.nan
    return out


def _decode_block_tail_read(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                            alibi_slopes=None):
    """The oracle reading every slot of a sequence's last block, past ``seq_len`` (masked per block, not
    per token): the never-written slots (NaN-poisoned by the check) reach the output."""
    block_size = k_cache.shape[2]
    whole_blocks = -(-np.asarray(seq_lens) // block_size) * block_size
    # the ALiBi origin moves with the length read: a constant per row, which softmax ignores
    return attention.paged_decode(q, k_cache, v_cache, block_tables, whole_blocks, softmax_scale, k_scale, v_scale,
                                  alibi_slopes)


def _decode_unguarded_combine(num_splits: int):
    """Split-kv decode over ``num_splits`` shards of whole blocks whose combine has no ``-inf`` guard:
    an empty shard's ``m = -inf`` gives ``exp(-inf - (-inf)) = NaN``, so every row of a sequence with
    an empty shard (fewer blocks than shards) is NaN; the others are exact."""
    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        out = attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                                     alibi_slopes)
        blocks = -(-np.asarray(seq_lens) // k_cache.shape[2])
        out[(blocks < num_splits) & (np.asarray(seq_lens) > 0)] = np.nan
        return out
    return decode


def _decode_with_slopes(transform):
    """The decode oracle with the ALiBi slopes replaced by ``transform(slopes)``."""
    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        slopes = None if alibi_slopes is None else transform(np.asarray(alibi_slopes, np.float64))
        return attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale,
                                      slopes)
    return decode


KV_BUGS = [
    BugClass("kv_scale_over_all_heads", "quantize_kv", "the KV scale is taken over all heads of a token "
             "instead of one per (token, kv head)", _kv_scale_over_all_heads),
]

DECODE_ATTENTION_BUGS = [
    BugClass("wrong_head_mapping", "paged_decode", "query head h reads kv head h % num_kv_heads (round robin) "
             "instead of h // (num_heads / num_kv_heads)", _decode_with_heads(lambda h, hq, hkv: h % hkv)),
    BugClass("length_zero_rows_not_zero", "paged_decode", "a sequence of length 0 gives NaN (an unguarded "
             "acc / l) or a stale row instead of zeros", _decode_length_zero_nan),
] + [
    BugClass("missing_neg_inf_guard", "paged_decode", f"the split-kv combine has no -inf guard: an empty shard "
             f"(here with {p} shards) makes its sequence NaN", _decode_unguarded_combine(p)) for p in range(2, 17)
] + [
    BugClass("block_tail_not_masked", "paged_decode", "the last block is read whole: slots past seq_len (never "
             "written; NaN-poisoned by the check) reach the output", _decode_block_tail_read),
]

LN2 = float(np.log(2))

ALIBI_DECODE_BUGS = [
    BugClass("alibi_slope_not_log2_scaled", "paged_decode", "a log2-domain kernel adds slope * (j - p) unscaled "
             "(not times log2 e): the bias acts as slope * ln 2 * (j - p)", _decode_with_slopes(lambda s: s * LN2)),
    BugClass("alibi_wrong_sign", "paged_decode", "the ALiBi bias has the wrong sign (slope * (p - j), e.g. "
             "+slope * |p - j|): distant keys gain weight instead of losing it", _decode_with_slopes(np.negative)),
]
"""Decode's ALiBi classes (the check runs them only with ALiBi: without slopes they are the oracle)."""

# ---------------------------------------------------------------------------- causal prefill


def _dense(x, scales):
    """K or V as float32: the dequantized codes, or the float values themselves (``scales`` None)."""
    return np.asarray(x, np.float32) if scales is None else kv_cache.dequantize_kv(x, scales)


def _prefill_reading(num_keys):
    """Causal prefill whose query ``i`` (of ``T``, over ``S`` keys) reads keys ``0 .. num_keys(i, T, S) - 1``
    (at most ``S``); a query that reads none gets NaN (``0 / 0``, an unguarded softmax)."""
    def prefill(q, k, v, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        k, v = _dense(k, k_scale), _dense(v, v_scale)
        t, s = q.shape[0], k.shape[0]
        out = np.full(q.shape, np.nan, np.float32)
        for i in range(t):
            n = min(num_keys(i, t, s), s)
            if n > 0:
                # the oracle puts the query at position n - 1: the ALiBi origin moves by a constant per row
                out[i] = attention.prefill(q[i : i + 1], k[:n], v[:n], softmax_scale, alibi_slopes)[0]
        return out
    return prefill


def _prefill_with_heads(kv_head_of):
    """The prefill oracle with query head ``h`` reading kv head ``kv_head_of(h, num_heads, num_kv_heads)``."""
    def prefill(q, k, v, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        k, v = _dense(k, k_scale), _dense(v, v_scale)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        out = np.zeros(q.shape, np.float32)
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv_heads)
            out[:, h : h + 1] = attention.prefill(_head(q, h), _head(k, g), _head(v, g), softmax_scale,
                                                  _slope(alibi_slopes, h))
        return out
    return prefill


def _prefill_with_slopes(transform):
    """The prefill oracle with the ALiBi slopes replaced by ``transform(slopes)``."""
    def prefill(q, k, v, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        slopes = None if alibi_slopes is None else transform(np.asarray(alibi_slopes, np.float64))
        return attention.prefill(q, _dense(k, k_scale), _dense(v, v_scale), softmax_scale, slopes)
    return prefill


PREFILL_BUGS = [
    BugClass("causal_mask_off_by_one", "prefill", "the causal mask is off by one: query i also sees the next "
             "key (j <= p + 1)", _prefill_reading(lambda i, t, s: s - t + i + 2)),
    BugClass("causal_mask_off_by_one", "prefill", "the causal mask is off by one: query i misses its own key "
             "(j < p), a query with no key left is NaN", _prefill_reading(lambda i, t, s: s - t + i)),
    BugClass("prefix_offset_ignored", "prefill", "chunked prefill's prefix offset is ignored: query i attends "
             "keys 0 .. i instead of 0 .. S - T + i", _prefill_reading(lambda i, t, s: i + 1)),
    BugClass("wrong_head_mapping", "prefill", "query head h reads kv head h % num_kv_heads (round robin) "
             "instead of h // (num_heads / num_kv_heads)", _prefill_with_heads(lambda h, hq, hkv: h % hkv)),
]

ALIBI_PREFILL_BUGS = [
    BugClass("alibi_slope_not_log2_scaled", "prefill", "a log2-domain kernel adds slope * (j - p) unscaled "
             "(not times log2 e): the bias acts as slope * ln 2 * (j - p)", _prefill_with_slopes(lambda s: s * LN2)),
    BugClass("alibi_wrong_sign", "prefill", "the ALiBi bias has the wrong sign (slope * (p - j), e.g. "
             "+slope * |p - j|): distant keys gain weight instead of losing it", _prefill_with_slopes(np.negative)),
]
"""Prefill's ALiBi classes (run only with ALiBi)."""

# ---------------------------------------------------------------------------- the paged cache write (fp8lab's layout)


def _write(quantize, *, padding_wraps=False, layout_swapped=False):
    """The paged FP8 write (``kv_cache.write``) with a mutant's knobs: ``quantize`` per vector,
    ``padding_wraps`` lets slot -1 index the last slot (NumPy's negative indexing), and
    ``layout_swapped`` stores token-major ``[block, offset, head]`` inside the ``[block, head, offset]`` cache."""
    def write(k, v, k_cache, v_cache, k_scale, v_scale, slots):
        block_size = k_cache.shape[2]
        slots = np.asarray(slots, np.int64)
        use = np.ones(slots.shape, bool) if padding_wraps else slots >= 0
        for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            codes, s = quantize(np.asarray(x, np.float32)[use])
            blocks, offsets = slots[use] // block_size, slots[use] % block_size
            if layout_swapped:  # the flat [offset, head] index of a token-major layout, read as [head, offset]
                heads = cache.shape[1]
                flat = offsets[:, None] * heads + np.arange(heads)[None, :]
                h_idx, o_idx = flat // block_size, flat % block_size
                cache[blocks[:, None], h_idx, o_idx] = codes
                scales[blocks[:, None], h_idx, o_idx] = s
            else:
                cache[blocks, :, offsets] = codes
                scales[blocks, :, offsets] = s
    return write


def _quantize_kv_oracle(x):
    return kv_cache.quantize_kv(x)


CACHE_WRITE_BUGS = [
    BugClass("kv_scale_over_all_heads", "paged_cache_write", "the KV scale is taken over all heads of a token "
             "instead of one per (token, kv head)", _write(_kv_scale_over_all_heads)),
    BugClass("padding_slot_written", "paged_cache_write", "a padding slot (-1) is written, to the cache's last "
             "slot (negative indexing) instead of nowhere", _write(_quantize_kv_oracle, padding_wraps=True)),
    BugClass("wrong_cache_layout", "paged_cache_write", "tokens are stored token-major ([block, offset, head]) in a "
             "head-major ([block, head, offset]) cache", _write(_quantize_kv_oracle, layout_swapped=True)),
]
