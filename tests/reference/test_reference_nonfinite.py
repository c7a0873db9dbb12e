"""Issue 12, "An oracle never hides a NaN": every reference operator on NaN, +-inf, huge finite,
tiny subnormal and -0.0 inputs.

The rule (ARCHITECTURE.md, "NaN and infinity"): a NaN or infinity in an input reaches exactly the
outputs whose math depends on it, never a finite wrong number; only a sequence of length 0 is a
defined zero. Keys a query does not read (causally masked, or cache slots past ``seq_len``) are
not part of its math. The explicit tests are named after the bug they pin down; the property
tests feed the extremes of ``fp8lab.reference.strategies.FLOAT32_EXTREMES`` to every operator.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import attention, blockwise, e4m3, kv_cache
from fp8lab.reference import strategies as fst

# NaN and inf inputs make NumPy warn ("invalid value encountered"): that is the arithmetic, not a failure
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def nan_rows_of_prefill(q, k, v, group):
    """Where ``prefill``'s output must be NaN for NaN-only (no inf) inputs, by the rule, elementwise:
    ``out[i, h, d]`` is NaN iff ``q[i, h]`` holds a NaN, or a key ``j <= pos_i`` of kv head ``h // group``
    has a NaN anywhere in ``k_j`` (its score is NaN, so the row's max and every weight are) or a NaN
    in ``v_j[d]``."""
    t, heads, d = q.shape
    s = k.shape[0]
    expected = np.zeros((t, heads, d), bool)
    for i in range(t):
        pos = s - t + i
        for h in range(heads):
            g = h // group
            row = np.isnan(q[i, h]).any() or np.isnan(k[: pos + 1, g]).any()
            expected[i, h] = row | np.isnan(v[: pos + 1, g]).any(axis=0)
    return expected


def ordinary(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- attention: regressions


def test_attention_nan_in_query_was_turned_into_a_zero_row(rng):
    cache = ordinary(rng, 2, 1, 4, 8)
    q = ordinary(rng, 1, 2, 8)
    q[0, 1, 3] = np.nan
    out = attention.paged_decode(q, cache, cache, np.array([[1, 0]]), np.array([6]), 0.3)
    assert np.all(np.isnan(out[0, 1])) and np.all(np.isfinite(out[0, 0]))


def test_attention_nan_in_key_or_value_was_turned_into_zeros(rng):
    """A NaN in kv head 1 reaches query heads 2 and 3 (GQA 4/2) only; a NaN key poisons the whole
    row, a NaN value element only that element."""
    length, heads, kv_heads, d, bs = 6, 4, 2, 8, 4
    for which in ("k", "v"):
        k, v = ordinary(rng, length, kv_heads, d), ordinary(rng, length, kv_heads, d)
        (k if which == "k" else v)[2, 1, 5] = np.nan
        caches = [np.full((3, kv_heads, bs, d), np.nan, np.float32) for _ in range(2)]
        table = np.array([2, 0])
        slots = kv_cache.slots_for_positions(table, np.arange(length), bs)
        kv_cache.write(caches[0], None, k, slots)
        kv_cache.write(caches[1], None, v, slots)
        out = attention.paged_decode(ordinary(rng, 1, heads, d), caches[0], caches[1], table[None], [length], 0.4)
        assert np.all(np.isfinite(out[0, :2])), which
        if which == "k":
            assert np.all(np.isnan(out[0, 2:]))
        else:
            assert np.all(np.isnan(out[0, 2:, 5])) and np.all(np.isfinite(np.delete(out[0, 2:], 5, axis=1)))


def test_attention_nan_softmax_scale_was_turned_into_zeros(rng):
    cache = ordinary(rng, 2, 1, 4, 8)
    q = ordinary(rng, 2, 2, 8)
    out = attention.paged_decode(q, cache, cache, np.array([[0, 1], [1, 0]]), np.array([5, 0]), np.nan)
    assert np.all(np.isnan(out[0]))
    assert np.array_equal(out[1], np.zeros((2, 8)))  # length 0 reads nothing: still the defined zero row
    assert np.all(np.isnan(attention.prefill(q, cache[0].transpose(1, 0, 2)[:2], cache[1].transpose(1, 0, 2)[:2], np.nan)))


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_read_of_a_never_written_slot_gives_nan(rng, fp8):
    """The engine poisons unwritten slots with NaN (NaN codes and NaN scales for FP8): a seq_len
    that covers one must show, not average it away."""
    shape = (2, 1, 4, 8)
    cache = np.full(shape, 0x7F, np.uint8) if fp8 else np.full(shape, np.nan, np.float32)
    scales = np.full(shape[:3], np.nan, np.float32) if fp8 else None
    kv_cache.write(cache, scales, ordinary(rng, 3, 1, 8), np.array([0, 1, 2]))  # slot 3 never written
    q = ordinary(rng, 1, 2, 8)
    table = np.array([[0, 1]])
    assert np.all(np.isfinite(attention.paged_decode(q, cache, cache, table, [3], 0.3, scales, scales)))
    assert np.all(np.isnan(attention.paged_decode(q, cache, cache, table, [4], 0.3, scales, scales)))


@pytest.mark.parametrize("which", ["k", "v"])
def test_attention_nan_in_a_future_key_does_not_reach_earlier_queries(rng, which):
    """Causal prefill never reads key j for a query before j (the kernels never load it), so a NaN
    there must not reach it. T = 150 spans three row blocks of 64, and the NaN sits mid-block."""
    t, heads, kv_heads, d = 150, 2, 1, 4
    q, k, v = ordinary(rng, t, heads, d), ordinary(rng, t, kv_heads, d), ordinary(rng, t, kv_heads, d)
    clean = attention.prefill(q, k, v, 0.5)
    (k if which == "k" else v)[100, 0, 1] = np.nan
    out = attention.prefill(q, k, v, 0.5, alibi_slopes=None)
    np.testing.assert_array_equal(out[:100], clean[:100])
    expected_nan = nan_rows_of_prefill(q, k, v, group=2)
    assert np.array_equal(np.isnan(out), expected_nan) and expected_nan[100:].any()


def test_attention_inf_score_gives_nan_not_a_one_hot_softmax(rng):
    """An infinite score makes ``s - max(s)`` NaN (``inf - inf``): IEEE, no special case."""
    k, v = ordinary(rng, 3, 1, 4), ordinary(rng, 3, 1, 4)
    k[1, 0] = [np.inf, 0, 0, 0]
    q = np.ones((3, 1, 4), np.float32)
    out = attention.prefill(q, k, v, 1.0)
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1:]))
    q_inf = ordinary(rng, 1, 1, 4)
    q_inf[0, 0, 0] = -np.inf  # every score of the row non-finite: NaN
    assert np.all(np.isnan(attention.prefill(q_inf, k[:1], v[:1], 1.0)))


def test_attention_minus_inf_score_is_weight_zero(rng):
    """A -inf score is ``exp(-inf) = 0`` weight when another score is finite: the row stays finite
    and equals attention over the other keys; with no other key, ``-inf - -inf`` is NaN."""
    k, v = ordinary(rng, 3, 1, 4), ordinary(rng, 3, 1, 4)
    q = np.abs(ordinary(rng, 1, 1, 4)) + 0.1
    k[1, 0, 2] = -np.inf
    out = attention.prefill(q, k, v, 0.5)
    expected = attention.prefill(q, k[[0, 2]], v[[0, 2]], 0.5)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert np.all(np.isnan(attention.prefill(q, k[1:2], v[1:2], 0.5)))


def test_attention_length_zero_is_a_zero_row_whatever_the_query(rng):
    cache = np.full((1, 1, 4, 8), np.nan, np.float32)
    q = np.full((1, 2, 8), np.nan, np.float32)
    assert np.array_equal(attention.paged_decode(q, cache, cache, [[0]], [0], 0.3), np.zeros((1, 2, 8), np.float32))


def test_attention_inf_value_propagates_as_inf(rng):
    """A finite row with one +inf value element: that element is +inf (positive weight times inf)."""
    k, v = ordinary(rng, 4, 1, 4), ordinary(rng, 4, 1, 4)
    v[2, 0, 3] = np.inf
    out = attention.prefill(ordinary(rng, 4, 1, 4), k, v, 0.5)
    assert np.all(np.isfinite(out[:2])) and np.all(out[2:, 0, 3] == np.inf) and np.all(np.isfinite(out[2:, 0, :3]))


# ---------------------------------------------------------------------------- attention: properties


@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 6), prefix=st.integers(0, 4), group=st.sampled_from([1, 2]),
       poison=st.lists(st.tuples(st.sampled_from("qkv"), st.integers(0, 99), st.integers(0, 1), st.integers(0, 3)), max_size=3),
       alibi=st.booleans())
def test_prefill_nan_reaches_exactly_the_outputs_that_read_it(seed, t, prefix, group, poison, alibi):
    rng = np.random.default_rng(seed)
    s, kv_heads, d = t + prefix, 2, 4
    heads = kv_heads * group
    arrays = {"q": ordinary(rng, t, heads, d), "k": ordinary(rng, s, kv_heads, d), "v": ordinary(rng, s, kv_heads, d)}
    for name, row, head, elem in poison:
        a = arrays[name]
        a[row % a.shape[0], head % a.shape[1], elem] = np.nan
    slopes = rng.uniform(0.01, 0.5, heads) if alibi else None
    out = attention.prefill(arrays["q"], arrays["k"], arrays["v"], 0.5, alibi_slopes=slopes)
    assert np.array_equal(np.isnan(out), nan_rows_of_prefill(arrays["q"], arrays["k"], arrays["v"], group))
    assert np.all(np.isfinite(out[~np.isnan(out)]))


@given(layout=fst.paged_kv_layouts(max_seqs=3, max_seq_len=12, head_dims=(4, 8)), seed=st.integers(0, 2**32 - 1),
       fp8=st.booleans(), extreme=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_decode_with_a_non_finite_token_is_non_finite_exactly_where_it_is_read(layout, seed, fp8, extreme):
    """One written token of one sequence gets an extreme K element: the query heads reading that kv
    head become non-finite, every other output stays finite (poisoned slots past seq_len unread).

    In an FP8 cache NaN and +-inf alike make the token's scale non-finite and its K row NaN. In a
    float cache only NaN is certain to: an infinite K element gives a score of +inf (NaN weights)
    or -inf (weight 0, a finite row), depending on the sign of the query element
    (``test_attention_minus_inf_score_is_weight_zero``)."""
    if not fp8:
        extreme = np.nan
    rng = np.random.default_rng(seed)
    data = layout.random_data(rng, fp8=fp8)
    written = [i for i, n in enumerate(layout.seq_lens) if n > 0]
    out_clean = attention.paged_decode(*data.decode_args())
    assert np.all(np.isfinite(out_clean))
    if not written:
        assert np.array_equal(out_clean, np.zeros_like(out_clean))
        return
    seq = written[int(rng.integers(len(written)))]
    pos, g = int(rng.integers(layout.seq_lens[seq])), int(rng.integers(layout.num_kv_heads))
    slot = kv_cache.slots_for_positions(layout.block_tables[seq], [pos], layout.block_size)
    x = kv_cache.gather(data.k_cache, data.k_scale, layout.block_tables[seq], pos + 1)[pos : pos + 1].copy()
    x[0, g, 0] = extreme
    kv_cache.write(data.k_cache, data.k_scale, x, slot)
    out = attention.paged_decode(*data.decode_args())
    reads = np.zeros(out.shape, bool)
    reads[seq, np.arange(layout.num_heads) // (layout.num_heads // layout.num_kv_heads) == g] = True
    assert np.all(~np.isfinite(out[reads])) and np.all(np.isfinite(out[~reads]))


# ---------------------------------------------------------------------------- KV cache


def test_fp8_kv_write_of_a_nan_vector_gathers_nan_not_zeros():
    """``scale = amax / 448`` with a NaN amax is NaN (``amax == 0`` is false): the whole vector
    gathers as NaN, the other head and token are untouched."""
    cache, scales = np.zeros((1, 2, 4, 4), np.uint8), np.zeros((1, 2, 4), np.float32)
    x = np.array([[[1, np.nan, 2, 3], [1, 2, 3, 4]], [[0.5, 0, 0, 0], [-1, 0, 0, 0]]], np.float32)
    kv_cache.write(cache, scales, x, [0, 1])
    assert np.isnan(scales[0, 0, 0]) and e4m3.is_nan(cache[0, 0, 0]).all()
    got = kv_cache.gather(cache, scales, [0], 2)
    assert np.all(np.isnan(got[0, 0])) and np.all(np.isfinite(got[0, 1])) and np.all(np.isfinite(got[1]))


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_fp8_kv_write_of_an_inf_vector_gathers_nan(bad):
    codes, scales = kv_cache.quantize_kv(np.array([[bad, 1.0, 0.0, -2.0]], np.float32))
    assert scales[0] == np.inf
    assert np.all(np.isnan(kv_cache.dequantize_kv(codes, scales)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_float_kv_cache_stores_non_finite_values_as_they_are(dtype):
    import ml_dtypes

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    cache = np.zeros((1, 1, 4, 3), dtype)
    x = np.array([[[np.nan, np.inf, -np.inf]], [[-0.0, 1.0, 2.0**-149]]], np.float32)
    kv_cache.write(cache, None, x, [2, 0])
    got = kv_cache.gather(cache, None, [0], 4)
    np.testing.assert_array_equal(got[2, 0], x[0, 0])
    assert np.signbit(got[0, 0, 0]) and got[0, 0, 1] == 1.0


def test_kv_scale_of_a_tiny_vector_no_longer_underflows():
    """amax = 1e-40: ``amax / 448`` in float32 is a subnormal rounded to a few bits (and 0 below
    about 6e-43), which broke the error bound; the scale is now floored at 2^-126."""
    for amax in (1e-40, 1e-44, 2.0**-149, 5e-36):
        x = np.array([[amax, -amax / 3, 0.0, amax / 7]], np.float32)
        codes, scales = kv_cache.quantize_kv(x)
        assert scales[0] >= np.float32(2.0**-126)
        dq = kv_cache.dequantize_kv(codes, scales).astype(np.float64)
        x64 = x.astype(np.float64)
        assert np.all(np.abs(dq - x64) <= 2.0**-4 * np.abs(x64) + 2.0**-10 * float(scales[0]))
    assert kv_cache.quantize_kv(np.zeros((1, 4), np.float32))[1][0] == 1.0  # amax == 0 still gives 1


@given(x=fst.float32_arrays_with_extremes(st.tuples(st.integers(1, 3), st.integers(1, 6))))
def test_quantize_kv_is_nan_exactly_for_vectors_holding_nan_or_inf(x):
    codes, scales = kv_cache.quantize_kv(x)
    dq = kv_cache.dequantize_kv(codes, scales).astype(np.float64)
    bad = ~np.all(np.isfinite(x), axis=-1)
    assert np.all(np.isnan(dq[bad]))
    x64, s = x[~bad].astype(np.float64), scales[~bad].astype(np.float64)[:, None]
    assert np.all(np.isfinite(dq[~bad]))
    assert np.all(np.abs(dq[~bad] - x64) <= 2.0**-4 * np.abs(x64) * (1 + 2.0**-20) + 2.0**-10 * s)
    assert np.array_equal(np.signbit(dq[~bad][x64 == 0]), np.signbit(x64[x64 == 0]))  # -0.0 stays -0.0


# ---------------------------------------------------------------------------- blockwise


def test_blockwise_quantize_of_a_nan_block_dequantizes_to_nan():
    w = np.ones((4, 6), np.float32)
    w[1, 4] = np.nan
    q, s = blockwise.quantize(w, (2, 3))
    clean_q, clean_s = blockwise.quantize(np.ones((4, 6), np.float32), (2, 3))
    assert np.isnan(s[0, 1]) and np.array_equal(np.isnan(s), [[False, True], [False, False]])
    w_hat = blockwise.dequantize(q, s, (2, 3))
    assert np.all(np.isnan(w_hat[:2, 3:])) and np.array_equal(w_hat[2:], blockwise.dequantize(clean_q, clean_s, (2, 3))[2:])
    assert len(blockwise.nan_code_positions(q)) == 6  # a loader would refuse this weight


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_blockwise_quantize_of_an_inf_block_dequantizes_to_nan(bad):
    w = np.ones((2, 4), np.float32)
    w[0, 0] = bad
    q, s = blockwise.quantize(w, (2, 2))
    assert s[0, 0] == np.inf and np.isfinite(s[0, 1])
    w_hat = blockwise.dequantize(q, s, (2, 2))
    assert np.all(np.isnan(w_hat[:, :2])) and np.array_equal(w_hat[:, 2:], np.ones((2, 2), np.float32))


def test_blockwise_quantize_of_a_tiny_block_no_longer_gives_a_zero_scale():
    """amax = 1e-44: float32 ``amax / 448`` was 0, the codes saturated (x / 0 = inf) or NaN (0 / 0)
    and dequantized to 0 or NaN; the floored scale 2^-126 keeps the documented bound."""
    w = np.array([[1e-44, -3e-45, 0.0, 1e-40]], np.float32)
    for block in ((1, 3), (1, 4)):
        q, s = blockwise.quantize(w, block)
        assert np.all(s >= np.float32(2.0**-126)) and not e4m3.is_nan(q).any()
        w_hat = blockwise.dequantize(q, s, block).astype(np.float64)
        s_full = blockwise.expand_scales(s, w.shape, block).astype(np.float64)
        assert np.all(np.abs(w_hat - w) <= 2.0**-4 * np.abs(w.astype(np.float64)) + 2.0**-10 * s_full)


def test_blockwise_dequantize_nan_or_inf_scale():
    q = np.array([[0x38, 0x00], [0x38, 0x00]], np.uint8)  # 1.0 and 0.0
    got = blockwise.dequantize(q, np.array([[np.nan], [np.inf]], np.float32), (1, 2))
    assert np.all(np.isnan(got[0])) and got[1, 0] == np.inf and np.isnan(got[1, 1])  # 0 * inf


def test_blockwise_gemm_nan_reaches_its_row_and_column(rng):
    q, s = blockwise.quantize(ordinary(rng, 5, 8), (2, 4))
    a = ordinary(rng, 3, 8)
    a[1, 6] = np.nan
    q[3, 2] = 0x7F  # a NaN code: column 3
    out = blockwise.gemm(a, q, s, (2, 4))
    expected = np.zeros(out.shape, bool)
    expected[1, :], expected[:, 3] = True, True
    assert np.array_equal(np.isnan(out), expected)
    s[2, 0] = np.nan  # scale block row 2 (weight rows 4): column 4
    assert np.all(np.isnan(blockwise.gemm(a, q, s, (2, 4))[:, 4]))


def test_blockwise_gemm_inf_activation_gives_inf_or_nan_never_finite(rng):
    q, s = blockwise.quantize(ordinary(rng, 4, 6), (2, 3))
    q[0, 2] = 0x00  # a zero weight under the inf: 0 * inf = NaN
    a = ordinary(rng, 2, 6)
    a[0, 2] = np.inf
    out = blockwise.gemm(a, q, s, (2, 3))
    assert np.isnan(out[0, 0]) and np.all(np.isinf(out[0, 1:])) and np.all(np.isfinite(out[1]))


def test_quantize_activations_nan_group_gives_nan_codes_and_scale():
    a = np.ones((2, 4), np.float32)
    a[0, 3] = np.nan
    q, scales = blockwise.quantize_activations(a, group=2)
    assert np.array_equal(np.isnan(scales), [[False, True], [False, False]])
    assert np.all(np.isnan(blockwise.dequantize(q, scales, (1, 2))[0, 2:]))
    assert np.all(np.isnan(blockwise.gemm_w8a8(a, *blockwise.quantize(np.ones((3, 4), np.float32), (1, 2)), (1, 2))[0]))


@pytest.mark.parametrize("eps", [0.0, -1e-10, np.nan, np.inf, 1e-40, 1e-45])
def test_activation_eps_that_gives_nan_codes_is_refused(eps):
    """eps <= 0 (or so small that eps / 448 is a float32 subnormal or 0) made an all-zero row's
    scale 0 and its codes 0 / 0 = NaN; a non-finite eps is meaningless. Both now raise."""
    a = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="eps: expected a finite eps >= 5.27e-36"):
        blockwise.quantize_activations(a, group=2, eps=eps)
    q, s = blockwise.quantize(np.ones((2, 4), np.float32), (2, 2))
    with pytest.raises(ValueError, match="eps: expected a finite eps"):
        blockwise.gemm_w8a8(a, q, s, (2, 2), eps=eps)


def test_smallest_activation_eps_is_accepted():
    q, scales = blockwise.quantize_activations(np.zeros((1, 4), np.float32), eps=blockwise.MIN_ACTIVATION_EPS)
    assert scales[0, 0] == np.float32(2.0**-126) and np.all(q == 0)


@given(w=fst.float32_arrays_with_extremes(st.tuples(st.integers(1, 5), st.integers(1, 5))),
       block=st.tuples(st.integers(1, 3), st.integers(1, 3)))
def test_blockwise_quantize_is_nan_exactly_for_blocks_holding_nan_or_inf(w, block):
    q, s = blockwise.quantize(w, block)
    w_hat = blockwise.dequantize(q, s, block).astype(np.float64)
    s_full = blockwise.expand_scales(s, w.shape, block).astype(np.float64)
    bad_block = ~np.isfinite(s_full)
    bn, bk = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            assert np.isfinite(s[i, j]) == np.all(np.isfinite(tile))
    assert np.all(np.isnan(w_hat[bad_block]))
    good, w64 = ~bad_block, w.astype(np.float64)
    assert np.all(np.abs(w_hat[good] - w64[good]) <= (2.0**-4 * np.abs(w64[good]) + 2.0**-10 * s_full[good]) * (1 + 2.0**-22))


@given(a=fst.float32_arrays_with_extremes(st.tuples(st.integers(1, 3), st.integers(1, 6))), seed=st.integers(0, 2**32 - 1))
def test_gemms_are_non_finite_exactly_for_rows_holding_nan_or_inf(a, seed):
    """W8A16: a NaN in row m makes every output of row m NaN, an inf makes them inf or NaN (the
    weights here are positive, so no 0 * inf). W8A8: a NaN or inf in row m makes its group's scale
    non-finite, so all of row m is NaN. Finite rows (huge, tiny, -0.0 included) stay finite."""
    rng = np.random.default_rng(seed)
    k = a.shape[1]
    q, s = blockwise.quantize(rng.uniform(0.5, 2, (3, k)).astype(np.float32), (2, 2))  # no zero weights
    w16, w8 = blockwise.gemm(a, q, s, (2, 2)), blockwise.gemm_w8a8(a, q, s, (2, 2))
    bad_row = ~np.all(np.isfinite(a), axis=1)
    nan_row = np.isnan(a).any(axis=1)
    assert np.all(np.isnan(w16[nan_row])) and np.all(~np.isfinite(w16[bad_row]))
    assert np.all(np.isnan(w8[bad_row]))
    assert np.all(np.isfinite(w16[~bad_row])) and np.all(np.isfinite(w8[~bad_row]))


# ---------------------------------------------------------------------------- e4m3


@pytest.mark.skipif(np.finfo(np.longdouble).nmant <= 52, reason="long double is float64 on this platform")
def test_encode_of_long_double_was_rounded_twice():
    """1.0625 + 2^-60 lies above the tie between 1.0 (0x38) and 1.125 (0x39): nearest is 0x39.
    Through float64 it became the tie 1.0625, which rounds to even 0x38."""
    above, below = np.longdouble(1.0625) + np.longdouble(2.0) ** -60, np.longdouble(1.0625) - np.longdouble(2.0) ** -60
    assert e4m3.encode(np.float64(above)) == 0x38  # the double rounding this avoids
    assert e4m3.encode(above) == 0x39 and e4m3.encode(-above) == 0xB9 and e4m3.encode(below) == 0x38
    # 464 + tiny is past the last value that rounds to 448: overflow
    assert e4m3.encode(np.longdouble(464) + np.longdouble(2.0) ** -50, saturate=False) == 0x7F
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e300], np.longdouble)
    specials = np.append(specials, np.longdouble("1e400"))  # beyond float64's range
    assert e4m3.encode(specials, saturate=True).tolist() == [0x7F, 0x7E, 0xFE, 0x80, 0x7E, 0x7E]


@given(x=fst.float32_arrays_with_extremes(st.integers(1, 8), extreme_fraction=0.5))
def test_encode_decode_never_turn_nan_into_a_number(x):
    for saturate in (True, False):
        codes = e4m3.encode(x, saturate=saturate)
        back = e4m3.decode(codes)
        assert np.array_equal(np.isnan(back[np.isnan(x)]), np.ones(int(np.isnan(x).sum()), bool))
        inf = np.isinf(x)
        if saturate:  # the documented saturating policy: +-inf -> +-448, everything finite else
            assert np.array_equal(back[inf], np.copysign(448, x[inf]).astype(np.float32))
            assert np.all(np.isfinite(back[~np.isnan(x)]))
        else:
            assert np.all(np.isnan(back[inf | (np.abs(x) > 464)]))
        assert np.array_equal(np.signbit(back[x == 0]), np.signbit(x[x == 0]))  # -0.0 -> 0x80 -> -0.0


def test_the_bf16_kv_write_keeps_a_nan_nan():
    """The reference backend's BF16 cache rounds with the one BF16 rounding (``fp8lab.reference.dense.round_to_bf16``):
    a NaN whose mantissa would carry into the sign under a plain add-and-truncate (0x7FFFFFFF) stays NaN,
    and infinity stays infinity."""
    from fp8lab.engine.backend import ReferenceBackend

    backend = ReferenceBackend()
    (cache,) = backend.allocate_kv_cache(1, 1, 1, 4, 4, "bf16")
    k = np.array([[[1.0, 1.015625, 2.0, 3.0]]], np.float32)
    k[0, 0, 2:] = np.array([0x7FFFFFFF, 0x7F800000], np.uint32).view(np.float32)
    backend.write_kv(cache, k, k.copy(), np.array([0]))
    got = cache.k[0, 0, 0]
    assert np.isnan(got[2]) and got[3] == np.inf and got[0] == 1.0
