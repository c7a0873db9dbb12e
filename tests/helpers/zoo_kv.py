"""The bug zoo of the FP8 KV cache and attention: one deliberately wrong implementation per bug class of
``fp8lab.testing.kv_bugs``, written by hand (token loops, ml_dtypes casts), independently of the
catalog's mutants. ``ZOO``: (bug class, a check that runs the kit on it); ``tests/testing/test_bug_zoo.py``
asserts that each fails and is named, and ``tests/testing/test_kv_kit.py`` that the correct versions pass."""

from __future__ import annotations

import numpy as np

from fp8lab import testing
from helpers.zoo_weights import FN, cast_saturating


def kv_quantize_per_token(x):
    """One scale per token over all its heads (the whole ``[kv_heads, head_dim]`` slice)."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).reshape(x.shape[0], -1).max(axis=1)
    scale = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
    scales = np.repeat(scale[:, None], x.shape[1], axis=1).astype(np.float32)
    return cast_saturating(x / scales[..., None]), scales


LOG2E = float(np.log2(np.e))


def _alibi_log2(alibi_slopes, h, *, log2_slopes=True, slope_sign=1):
    """Head ``h``'s ALiBi slope in the log2 domain of an exp2 kernel (0 without ALiBi); ``log2_slopes=False``
    forgets the log2(e) factor and ``slope_sign=-1`` flips the bias: one planted bug each."""
    if alibi_slopes is None:
        return 0.0
    return slope_sign * float(alibi_slopes[h]) * (LOG2E if log2_slopes else 1.0)


def my_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, alibi_slopes=None, *,
              layout="fp8lab", kv_head_of=lambda h, hq, hkv: h // (hq // hkv), empty_row=0.0, splits=None,
              read_block_tail=False, **alibi_bugs):
    """A decode written out by hand: gather each token through the block table (``layout``: fp8lab's
    ``[blocks, heads, block_size, dim]`` cache or vLLM's ``[blocks, block_size, heads, dim]``), dequantize,
    softmax in float64 in the log2 domain (``exp2``, scores times ``log2 e``, as kernels do), ALiBi bias
    ``slope * (j - (L - 1))``. The keywords plant one bug each: the head mapping, what a length-0 row gets,
    a split-kv combine over ``splits`` shards of whole blocks with no -inf guard, reading the last block
    whole, and the ALiBi slope's domain or sign (``_alibi_log2``)."""
    block_size = k_cache.shape[1] if layout == "vllm" else k_cache.shape[2]
    num_heads, num_kv = q.shape[1], k_cache.shape[2 if layout == "vllm" else 1]

    def value(cache, scale, block, g, offset):
        index = (block, offset, g) if layout == "vllm" else (block, g, offset)
        row = cache[index]
        if scale is None:
            return row.astype(np.float64)
        return row.view(FN).astype(np.float64) * float(scale[index])

    out = np.zeros(q.shape)
    for s, length in enumerate(seq_lens):
        read = -(-length // block_size) * block_size if read_block_tail else length
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv)
            if length == 0:
                out[s, h] = empty_row
                continue
            tokens = [(block_tables[s, j // block_size], j % block_size) for j in range(read)]
            k = np.array([value(k_cache, k_scale, block, g, offset) for block, offset in tokens])
            v = np.array([value(v_cache, v_scale, block, g, offset) for block, offset in tokens])
            bias2 = _alibi_log2(alibi_slopes, h, **alibi_bugs) * (np.arange(read) - (length - 1))
            with np.errstate(invalid="ignore"):  # NaN read from a poisoned slot stays NaN
                scores = k @ q[s, h].astype(np.float64) * (softmax_scale * LOG2E) + bias2
            if splits is None:
                with np.errstate(invalid="ignore"):
                    w = np.exp2(scores - scores.max())
                    out[s, h] = w @ v / w.sum()
                continue
            blocks = -(-length // block_size)
            per = -(-blocks // splits)
            parts = []  # flash-decoding's normalized partials: (lse_s, o_s = acc_s / l_s) per shard, base 2
            for p in range(splits):
                lo, hi = min(p * per * block_size, length), min((p + 1) * per * block_size, length)
                m = scores[lo:hi].max() if hi > lo else -np.inf
                with np.errstate(invalid="ignore", divide="ignore"):
                    w = np.exp2(scores[lo:hi] - m)
                    acc = w @ v[lo:hi] if hi > lo else np.zeros(v.shape[1])
                    parts.append((m + np.log2(w.sum()), acc / w.sum()))  # an empty shard: (-inf, 0 / 0 = NaN)
            lse_max = max(p[0] for p in parts)
            with np.errstate(invalid="ignore"):
                # no guard: an empty shard's weight exp2(-inf) = 0 times its NaN partial is NaN
                out[s, h] = sum(np.exp2(p[0] - lse_max) * p[1] for p in parts)
                out[s, h] /= sum(np.exp2(p[0] - lse_max) for p in parts)
    return out


def my_prefill(q, k, v, softmax_scale, k_scale, v_scale, alibi_slopes=None, *,
               kv_head_of=lambda h, hq, hkv: h // (hq // hkv), keys_read=lambda i, pos: pos + 1,
               alibi_origin=lambda pos: pos, **alibi_bugs):
    """Causal prefill written out by hand, one query row and head at a time, in the log2 domain: query ``i``
    of ``T`` sits at position ``pos = S - T + i`` and reads its first ``keys_read(i, pos)`` keys (at most
    ``S``), ALiBi bias ``slope * (j - alibi_origin(pos))``; an unguarded softmax (a row with no key is
    ``0 / 0``). The keywords plant one bug each: the head mapping, the mask (``keys_read``), the ALiBi
    slope's domain or sign; ``alibi_origin`` shifts a row's bias by a constant, which is *not* a bug."""
    t, num_heads, _ = q.shape
    s, num_kv, _ = k.shape

    def dense(x, scale):
        return x.astype(np.float64) if scale is None else x.view(FN).astype(np.float64) * scale[..., None]

    keys, values = dense(k, k_scale), dense(v, v_scale)
    out = np.zeros(q.shape)
    for i in range(t):
        pos = s - t + i
        n = min(keys_read(i, pos), s)
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv)
            slope2 = _alibi_log2(alibi_slopes, h, **alibi_bugs)
            bias2 = slope2 * (np.arange(n) - alibi_origin(pos))
            scores = keys[:n, g] @ q[i, h].astype(np.float64) * (softmax_scale * LOG2E) + bias2
            w = np.exp2(scores - np.max(scores, initial=-np.inf))
            with np.errstate(invalid="ignore"):
                out[i, h] = w @ values[:n, g] / w.sum()
    return out


def write_token_loop(k, v, k_cache, v_cache, k_scale, v_scale, slots, *, per_token_scale=False, wrap_padding=False,
                     token_major=False, vllm_layout=False):
    """A paged FP8 write one token at a time, with ml_dtypes casts; the keywords plant one bug each (or,
    ``vllm_layout``, write a correct ``[blocks, block_size, heads, dim]`` cache)."""
    block_size = k_cache.shape[1] if vllm_layout else k_cache.shape[2]
    heads = k.shape[1]
    for t, slot in enumerate(slots):
        if slot < 0 and not wrap_padding:
            continue
        block, offset = divmod(int(slot) % (k_cache.shape[0] * block_size), block_size)
        for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            amax = np.abs(x[t]).max(axis=-1)
            if per_token_scale:
                amax = np.full(heads, np.abs(x[t]).max())
            s = np.where(amax == 0, np.float32(1), np.maximum(amax / np.float32(448), np.float32(2.0**-126)))
            codes = cast_saturating(x[t] / s[:, None].astype(np.float32))
            for h in range(heads):
                if vllm_layout:
                    cache[block, offset, h], scales[block, offset, h] = codes[h], s[h]
                elif token_major:  # [offset, head] flattened into a [head, offset] cache
                    flat = offset * heads + h
                    cache[block, flat // block_size, flat % block_size], scales[block, flat // block_size, flat % block_size] = codes[h], s[h]
                else:
                    cache[block, h, offset], scales[block, h, offset] = codes[h], s[h]


ZOO = [
    ("kv_scale_over_all_heads", lambda: testing.check_kv_quantize(kv_quantize_per_token)),
    ("kv_scale_over_all_heads", lambda: testing.check_paged_cache_write(
        lambda *a: write_token_loop(*a, per_token_scale=True))),
    ("padding_slot_written", lambda: testing.check_paged_cache_write(lambda *a: write_token_loop(*a, wrap_padding=True))),
    ("wrong_cache_layout", lambda: testing.check_paged_cache_write(lambda *a: write_token_loop(*a, token_major=True))),
    ("wrong_head_mapping", lambda: testing.check_paged_decode(
        lambda *a: my_decode(*a, kv_head_of=lambda h, hq, hkv: h % hkv))),
    ("length_zero_rows_not_zero", lambda: testing.check_paged_decode(lambda *a: my_decode(*a, empty_row=np.nan))),
    ("missing_neg_inf_guard", lambda: testing.check_paged_decode(lambda *a: my_decode(*a, splits=4))),
    ("missing_neg_inf_guard", lambda: testing.check_paged_decode(  # the looser bound of F16 operands still sees it
        lambda *a: my_decode(*a, splits=4), head_dims=(128,), block_sizes=(16,), operands="f16")),
    ("block_tail_not_masked", lambda: testing.check_paged_decode(lambda *a: my_decode(*a, read_block_tail=True))),
    ("block_tail_not_masked", lambda: testing.check_paged_decode(
        lambda *a: my_decode(*a, layout="vllm", read_block_tail=True), fp8=False, layout="vllm")),
    ("alibi_slope_not_log2_scaled", lambda: testing.check_paged_decode(
        lambda *a, **kw: my_decode(*a, **kw, log2_slopes=False), alibi=True)),
    ("alibi_wrong_sign", lambda: testing.check_paged_decode(
        lambda *a, **kw: my_decode(*a, **kw, layout="vllm", slope_sign=-1), alibi=True, layout="vllm")),
    ("causal_mask_off_by_one", lambda: testing.check_prefill(
        lambda *a: my_prefill(*a, keys_read=lambda i, pos: pos + 2))),
    ("causal_mask_off_by_one", lambda: testing.check_prefill(
        lambda *a: my_prefill(*a, keys_read=lambda i, pos: pos), fp8=False)),
    ("prefix_offset_ignored", lambda: testing.check_prefill(lambda *a: my_prefill(*a, keys_read=lambda i, pos: i + 1))),
    ("wrong_head_mapping", lambda: testing.check_prefill(
        lambda *a: my_prefill(*a, kv_head_of=lambda h, hq, hkv: h % hkv), fp8=False)),
    ("alibi_slope_not_log2_scaled", lambda: testing.check_prefill(
        lambda *a, **kw: my_prefill(*a, **kw, log2_slopes=False), alibi=True)),
    ("alibi_wrong_sign", lambda: testing.check_prefill(
        lambda *a, **kw: my_prefill(*a, **kw, slope_sign=-1), fp8=False, alibi=True)),
]


