"""The bug classes of the FP8 KV cache and attention: each mistake as a mutant of the oracle.

Mutant signatures follow the operator: ``quantize_kv(x)``, ``paged_decode(q, k_cache, v_cache,
block_tables, seq_lens, softmax_scale, k_scale, v_scale)``, ``paged_cache_write(k, v, k_cache, v_cache,
k_scale, v_scale, slot_mapping)`` (fp8lab's layout; the checks convert a caller's layout first).
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


def _decode_with_heads(kv_head_of):
    """The decode oracle with query head ``h`` reading kv head ``kv_head_of(h, num_heads, num_kv_heads)``."""
    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale):
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
        out = np.zeros(q.shape, np.float64)
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv_heads)
            pick = slice(g, g + 1)
            out[:, h : h + 1] = attention.paged_decode(
                q[:, h : h + 1], k_cache[:, pick], v_cache[:, pick], block_tables, seq_lens, softmax_scale,
                None if k_scale is None else k_scale[:, pick], None if v_scale is None else v_scale[:, pick])
        return out
    return decode


def _decode_length_zero_nan(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale):
    """The oracle, but a sequence of length 0 divides 0 by 0 (``acc / l`` unguarded): NaN rows."""
    out = attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale)
    out[np.asarray(seq_lens) == 0] = np.nan
    return out


def _decode_unguarded_combine(num_splits: int):
    """Split-kv decode over ``num_splits`` shards of whole blocks whose combine has no ``-inf`` guard:
    an empty shard's ``m = -inf`` gives ``exp(-inf - (-inf)) = NaN``, so every row of a sequence with
    an empty shard (fewer blocks than shards) is NaN; the others are exact."""
    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale):
        out = attention.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale)
        blocks = -(-np.asarray(seq_lens) // k_cache.shape[2])
        out[(blocks < num_splits) & (np.asarray(seq_lens) > 0)] = np.nan
        return out
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
]

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
