"""The tensor-core flash prefill model (``fp8lab.simulators.prefill_mma``) against the float64 oracle.

Each query of a causal prefill is a decode over its prefix with the tensor-core decode's roundings (F16 queries and
weights over an FP8 cache, BF16 ones over a BF16 cache; float32 chains), so ``fp8lab.simulators.splitkv_mma.error_bound``
over that prefix, in the operand format, bounds its error; the oracle is ``fp8lab.reference.attention.prefill`` over
``fp8lab.reference.kv_cache.gather``. Caches are random FP8 or BF16 with NaN-poisoned unused slots; chunked prefill (a
cached prefix before the new tokens), sequences without new tokens, every group size that divides 16. The warpgroup
kernel's order (``shared_values``) gives the same bits on finite data.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.attention import assert_within_prefill_mma_bound as assert_within_bound
from helpers.attention import prefill_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8lab.simulators import common, prefill_mma


def run_model(data, q, query_lens):
    return prefill_mma.paged_prefill(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, query_lens,
                                     data.softmax_scale, data.k_scale, data.v_scale)


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), lens=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1,
                                                     max_size=3),
       group=st.sampled_from([1, 2, 4, 8, 16]), num_kv_heads=st.sampled_from([1, 2]), block_size=st.sampled_from([16, 32]),
       cache=st.sampled_from(["fp8", "bf16"]))
def test_within_the_error_bound_of_the_reference(seed, lens, group, num_kv_heads, block_size, cache):
    rng = np.random.default_rng(seed)
    context_lens = [max(a, b) for a, b in lens]
    query_lens = [min(a, b) for a, b in lens]  # a cached prefix of the difference (chunked prefill), or none
    data, q, query_lens = prefill_batch(rng, context_lens, query_lens, group, num_kv_heads, block_size, cache)
    assert_within_bound(data, q, query_lens, run_model(data, q, query_lens))


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), lens=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1,
                                                     max_size=2),
       group=st.sampled_from([1, 2, 4, 16]), block_size=st.sampled_from([16, 32]), warps=st.sampled_from([4, 8]))
def test_shared_values_change_no_bit_of_finite_data(seed, lens, group, block_size, warps):
    """The warpgroup kernel's order (``shared_values``: values to the CTA's end, every chunk multiplied) adds only
    products by a weight of 0 to what the warp kernel's order adds: on finite data the same bits (a zero ``acc``
    element could change its sign, which random data does not reach)."""
    rng = np.random.default_rng(seed)
    context_lens = [max(a, b) for a, b in lens]
    query_lens = [min(a, b) for a, b in lens]
    data, q, query_lens = prefill_batch(rng, context_lens, query_lens, group, 1, block_size)
    warp = run_model(data, q, query_lens)
    shared = prefill_mma.paged_prefill(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, query_lens,
                                       data.softmax_scale, data.k_scale, data.v_scale, shared_values=warps)
    assert np.isfinite(warp).all() and np.array_equal(warp.view(np.uint32), shared.view(np.uint32))


@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_long_prompt_over_many_tiles(cache):
    """A 150-token prompt after a 40-token prefix, Qwen3-8B's group of 4: 12 key tiles, 38 warps of 4 tokens."""
    rng = np.random.default_rng(3)
    data, q, query_lens = prefill_batch(rng, [190, 17], [150, 17], 4, 2, 32, cache)
    assert_within_bound(data, q, query_lens, run_model(data, q, query_lens))


@pytest.mark.parametrize("cache, nan", [("fp8", 0x7F), ("bf16", 0x7FC0)])
def test_a_nan_value_reaches_the_rows_that_see_it_and_its_warps_earlier_rows(cache, nan):
    """The documented difference: a NaN value (an E4M3 NaN code, a BF16 NaN) of key ``j`` reaches every query at or
    after ``j`` (as in the reference) and the queries before ``j`` in the same warp tile (weight 0 times NaN in the
    ``P V`` mma); no other."""
    rng = np.random.default_rng(11)
    group, block_size = 4, 16  # a warp owns 4 query tokens: queries 0-3, 4-7, ...
    data, q, query_lens = prefill_batch(rng, [30], [30], group, 2, block_size, cache)
    j = 10  # in the warp of queries 8-11
    data.v_cache[data.block_tables[0, j // block_size], 1, j % block_size, 5] = nan
    out = run_model(data, q, query_lens)
    nan_rows = np.isnan(out[:, group:]).any(axis=-1).any(axis=-1)  # kv head 1's query heads
    assert nan_rows.tolist() == [i >= 8 for i in range(30)]
    assert not np.isnan(out[:, :group]).any()  # kv head 0 never reads it


def test_shared_values_is_0_4_or_8():
    rng = np.random.default_rng(2)
    data, q, query_lens = prefill_batch(rng, [9], [9], 2, 1, 16)
    with pytest.raises(ValueError, match="shared_values: expected 0 .* got True"):
        prefill_mma.paged_prefill(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, query_lens,
                                  data.softmax_scale, data.k_scale, data.v_scale, shared_values=True)


def test_a_sequence_without_new_tokens_and_an_empty_batch():
    rng = np.random.default_rng(5)
    data, q, query_lens = prefill_batch(rng, [20, 9, 33], [0, 9, 1], 2, 1, 16)
    assert_within_bound(data, q, query_lens, run_model(data, q, query_lens))
    empty = run_model(data, q[:0], np.zeros(3, np.int64))
    assert empty.shape == (0, 2, 128)


@pytest.mark.parametrize("change, message", [
    (dict(group=3), "divides"), (dict(block_size=8), "block size"), (dict(query_lens=[5, 9]), "query_lens"),
])
def test_unsupported_or_wrong_calls_are_refused(change, message):
    shape = dict(group=2, block_size=16, query_lens=[5, 8]) | change
    rng = np.random.default_rng(0)
    data, q, _ = prefill_batch(rng, [5, 8], [5, 8], shape["group"], 1, shape["block_size"])
    with pytest.raises(ValueError, match=message):
        run_model(data, q, np.asarray(shape["query_lens"]))


def test_a_float32_cache_or_scales_beside_bf16_are_refused():
    rng = np.random.default_rng(2)
    data, q, query_lens = prefill_batch(rng, [9], [9], 2, 1, 16, "bf16")
    floats = data.k_cache.view(np.float16).astype(np.float32)
    with pytest.raises(ValueError, match="k_cache: the tensor-core prefill attention takes an FP8 cache"):
        prefill_mma.paged_prefill(q, floats, floats, data.block_tables, data.seq_lens, query_lens, data.softmax_scale,
                                  None, None)
    scales = np.ones(data.k_cache.shape[:3], np.float32)
    with pytest.raises(ValueError, match="k_cache: a BF16 cache .* takes no scales"):
        prefill_mma.paged_prefill(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, query_lens,
                                  data.softmax_scale, scales, None)


def test_exp2_flush_is_numpy_exp2_with_subnormal_results_zero():
    """``common.exp2_flush``, the flash prefill's exponent: NumPy's float32 ``exp2`` wherever that is at least
    ``2^-126``, ``+0`` below (the results ``ex2.approx.ftz.f32`` flushes), ``exp2(-inf) = 0``, NaN kept; one value
    in gives one float32."""
    rng = np.random.default_rng(21)
    x = np.concatenate([rng.uniform(-140, 10, 5000), [-126, -126.0001, -149, -150, -np.inf, np.inf, np.nan, 0]])
    x = x.astype(np.float32)
    y = common.exp2_flush(x)
    with np.errstate(over="ignore"):
        plain = np.exp2(x)
    normal = plain >= np.float32(2.0**-126)
    assert np.array_equal(y[normal].view(np.uint32), plain[normal].view(np.uint32))
    assert not y[~normal & ~np.isnan(x)].any() and np.signbit(y).sum() == 0
    assert np.isnan(y[np.isnan(x)]).all() and (x[~normal & ~np.isnan(x)] < -126).all()
    one = common.exp2_flush(np.float32(-130))
    assert isinstance(one, np.float32) and one == 0 and common.exp2_flush(np.float32(-3)) == np.float32(0.125)
