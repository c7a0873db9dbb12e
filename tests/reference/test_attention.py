"""fp8lab.reference.attention against a plain dense softmax written here, GQA, ALiBi, length 0, causality."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import attention, kv_cache
from fp8lab.reference import strategies as fst


def dense_attention_one_query(q, k, v, softmax_scale, bias=None):
    """Textbook softmax attention for one query head: q[D], k/v[S, D]; math.exp, float64 loops."""
    scores = [softmax_scale * float(np.dot(q, k[j])) + (0.0 if bias is None else bias[j]) for j in range(len(k))]
    if not scores:
        return np.zeros_like(q, dtype=np.float64)
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    return sum(w * v[j].astype(np.float64) for j, w in enumerate(weights)) / sum(weights)


@given(layout=fst.paged_kv_layouts(), seed=st.integers(0, 2**32 - 1), fp8=st.booleans(), alibi=st.booleans())
def test_paged_decode_matches_dense_attention_over_gathered_kv(layout, seed, fp8, alibi):
    rng = np.random.default_rng(seed)
    data = layout.random_data(rng, fp8=fp8)
    slopes = rng.uniform(0.01, 0.5, layout.num_heads) if alibi else None
    out = attention.paged_decode(*data.decode_args(), alibi_slopes=slopes)
    assert out.shape == data.q.shape and out.dtype == np.float32 and np.all(np.isfinite(out))
    group = layout.num_heads // layout.num_kv_heads
    for i, (table, length) in enumerate(zip(layout.block_tables, layout.seq_lens)):
        k = kv_cache.gather(data.k_cache, data.k_scale, table, int(length))
        v = kv_cache.gather(data.v_cache, data.v_scale, table, int(length))
        for h in range(layout.num_heads):
            bias = None if slopes is None else [slopes[h] * (j - (length - 1)) for j in range(length)]
            expected = dense_attention_one_query(data.q[i, h].astype(np.float64), k[:, h // group], v[:, h // group], data.softmax_scale, bias)
            np.testing.assert_allclose(out[i, h], expected, rtol=2e-6, atol=2e-6 * np.abs(v).max(initial=0))


def test_length_zero_gives_a_zero_row(rng):
    cache = np.full((2, 1, 4, 8), 0x7F, np.uint8)  # NaN codes everywhere: nothing may be read
    scales = np.full((2, 1, 4), np.nan, np.float32)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    out = attention.paged_decode(q, cache, cache, np.array([[0]]), np.array([0]), 0.3, scales, scales)
    assert np.array_equal(out, np.zeros_like(q))


def test_single_token_returns_its_value(rng):
    cache = rng.standard_normal((3, 1, 4, 8)).astype(np.float32)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    out = attention.paged_decode(q, cache, cache, np.array([[2]]), np.array([1]), 0.5)
    np.testing.assert_allclose(out[0], np.repeat(cache[2, :, 0], 2, axis=0), rtol=1e-7)


@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 7), prefix=st.integers(0, 5), kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 2, 3]), alibi=st.booleans())
def test_prefill_is_causal_and_matches_dense(seed, t, prefix, kv_heads, group, alibi):
    rng = np.random.default_rng(seed)
    s, heads, d = t + prefix, kv_heads * group, 8
    q = rng.standard_normal((t, heads, d)).astype(np.float32)
    k = rng.standard_normal((s, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((s, kv_heads, d)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.5, heads) if alibi else None
    out = attention.prefill(q, k, v, 0.35, alibi_slopes=slopes)
    for i in range(t):
        pos = prefix + i
        for h in range(heads):
            bias = None if slopes is None else [slopes[h] * (j - pos) for j in range(pos + 1)]
            expected = dense_attention_one_query(q[i, h], k[: pos + 1, h // group], v[: pos + 1, h // group], 0.35, bias)
            np.testing.assert_allclose(out[i, h], expected, rtol=2e-6, atol=2e-6)
    # causality: changing the future (keys/values after a query) leaves that query's output alone
    k2, v2 = k.copy(), v.copy()
    k2[prefix + t // 2 + 1 :] += 5.0
    v2[prefix + t // 2 + 1 :] -= 3.0
    out2 = attention.prefill(q, k2, v2, 0.35, alibi_slopes=slopes)
    np.testing.assert_array_equal(out2[: t // 2 + 1], out[: t // 2 + 1])


def test_decode_of_last_token_equals_prefill_row(rng):
    """The last prefill row is what paged decode computes for the same sequence."""
    length, heads, kv_heads, d, bs = 11, 4, 2, 16, 4
    k = rng.standard_normal((length, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((length, kv_heads, d)).astype(np.float32)
    q = rng.standard_normal((length, heads, d)).astype(np.float32)
    k_cache, v_cache = np.zeros((5, kv_heads, bs, d), np.float32), np.zeros((5, kv_heads, bs, d), np.float32)
    table = np.array([3, 0, 4])
    slots = kv_cache.slots_for_positions(table, np.arange(length), bs)
    kv_cache.write(k_cache, None, k, slots)
    kv_cache.write(v_cache, None, v, slots)
    decode = attention.paged_decode(q[-1:], k_cache, v_cache, table[None], np.array([length]), 0.25)
    np.testing.assert_allclose(decode[0], attention.prefill(q, k, v, 0.25)[-1], rtol=1e-6, atol=1e-7)


def test_bad_input_names_the_problem(rng):
    cache = np.zeros((2, 2, 4, 8), np.float32)
    q = np.zeros((1, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        attention.paged_decode(q, cache, cache, [[0]], [1], 1.0)
    with pytest.raises(ValueError, match="k_cache: an FP8 cache of codes.*needs its scales"):
        attention.paged_decode(np.zeros((1, 2, 8)), cache.astype(np.uint8), cache, [[0]], [1], 1.0)
    with pytest.raises(ValueError, match=r"seq_lens: expected shape \(1,\), got \(2,\)"):
        attention.paged_decode(np.zeros((1, 2, 8)), cache, cache, [[0]], [1, 1], 1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(2,\)"):
        attention.paged_decode(np.zeros((1, 2, 8)), cache, cache, [[0]], [1], 1.0, alibi_slopes=[0.1])
    with pytest.raises(ValueError, match="S >= T"):
        attention.prefill(np.zeros((3, 2, 8)), np.zeros((2, 2, 8)), np.zeros((2, 2, 8)), 1.0)
