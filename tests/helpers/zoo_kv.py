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


def my_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, *,
              kv_head_of=lambda h, hq, hkv: h // (hq // hkv), empty_row=0.0, splits=None):
    """A decode written out by hand: gather each token through the block table, dequantize, softmax in
    float64. The keywords plant one bug each: the head mapping, what a length-0 row gets, and a
    split-kv combine over ``splits`` shards of whole blocks with no -inf guard."""
    block_size, num_heads, num_kv = k_cache.shape[2], q.shape[1], k_cache.shape[1]

    def value(cache, scale, block, g, offset):
        row = cache[block, g, offset]
        if scale is None:
            return row.astype(np.float64)
        return row.view(FN).astype(np.float64) * float(scale[block, g, offset])

    out = np.zeros(q.shape)
    for s, length in enumerate(seq_lens):
        for h in range(num_heads):
            g = kv_head_of(h, num_heads, num_kv)
            if length == 0:
                out[s, h] = empty_row
                continue
            k = np.array([value(k_cache, k_scale, block_tables[s, j // block_size], g, j % block_size) for j in range(length)])
            v = np.array([value(v_cache, v_scale, block_tables[s, j // block_size], g, j % block_size) for j in range(length)])
            scores = k @ q[s, h].astype(np.float64) * softmax_scale
            if splits is None:
                w = np.exp(scores - scores.max())
                out[s, h] = w @ v / w.sum()
                continue
            blocks = -(-length // block_size)
            per = -(-blocks // splits)
            parts = []  # flash-decoding's normalized partials: (lse_s, o_s = acc_s / l_s) per shard
            for p in range(splits):
                lo, hi = min(p * per * block_size, length), min((p + 1) * per * block_size, length)
                m = scores[lo:hi].max() if hi > lo else -np.inf
                with np.errstate(invalid="ignore", divide="ignore"):
                    w = np.exp(scores[lo:hi] - m)
                    acc = w @ v[lo:hi] if hi > lo else np.zeros(v.shape[1])
                    parts.append((m + np.log(w.sum()), acc / w.sum()))  # an empty shard: (-inf, 0 / 0 = NaN)
            lse_max = max(p[0] for p in parts)
            with np.errstate(invalid="ignore"):
                # no guard: an empty shard's weight exp(-inf) = 0 times its NaN partial is NaN
                out[s, h] = sum(np.exp(p[0] - lse_max) * p[1] for p in parts)
                out[s, h] /= sum(np.exp(p[0] - lse_max) for p in parts)
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
]


