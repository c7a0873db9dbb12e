"""fp8lab.simulators.splitkv against fp8lab.reference.attention.paged_decode, its work split, its combine, and a
by-hand loop over shards, slots and tokens.

Error bound (``helpers.attention.tolerance``), per sequence and query head, with ``u = 2^-24``,
``gamma(n) = n u / (1 - n u)``, ``E = 16`` elements per lane, ``T`` tokens per slot at most, ``P``
shards, ``W`` slots per CTA and ``V = max |v_jd|`` over the sequence's values:

- A score (log2 domain) is off by at most ``delta = gamma(E + 9) * (B + A)``: ``B = max_j sum_d
  |q_d k_jd| * scale_log2`` covers the query scaling, the lane's E fmas, up to 5 butterfly additions, the
  ``k_scale`` product and the reference's own float32 dequantization; ``A = max_j |slope (j - L + 1)|
  log2(e)`` the ALiBi fma and the slope's float32 rounding.
- A weight ``2^(s_j - m)`` then carries a relative error of at most ``eta = ln2 * delta +
  (T + 3)(e2 + 2u)``: ``e2 = 4u`` per ``exp2`` (checked below for NumPy's float32 ``exp2``) for the
  token's own ``p`` and each later rescaling (at most ``T - 1`` in its slot, one slot merge, one
  combine), plus the products with those factors. The rounding of the ``exp2`` arguments adds
  ``u |s_j - m|`` to the exponent; since ``2^-x x <= 0.531`` it moves the output by at most
  ``2 ln2 * 0.531 u L V``.
- Perturbing the weights by ``eta`` moves ``sum w v / sum w`` by at most ``2 eta V / (1 - eta)``; the
  float32 sums of ``l`` and ``acc`` (two roundings per token, then W slots and P shards) add
  ``2 gamma(2T + W + P + 4) V``; the final division and the reference's float32 output ``3u V``.
"""

import numpy as np
import pytest
from helpers.attention import EXP2_ULPS, U, random_slopes, tolerance
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import attention, kv_cache
from fp8lab.reference import strategies as fst
from fp8lab.simulators import fma as fma_module
from fp8lab.simulators import splitkv as sk

# ---------------------------------------------------------------------------- against the reference


@given(
    layout=fst.paged_kv_layouts(max_seqs=3, max_seq_len=48),
    num_splits=st.integers(1, 8),
    fp8=st.booleans(),
    alibi=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_the_reference_within_the_float32_bound(layout, num_splits, fp8, alibi, seed):
    rng = np.random.default_rng(seed)
    data = layout.random_data(rng, fp8=fp8)
    slopes = random_slopes(rng, layout.num_heads) if alibi else None
    expected = attention.paged_decode(*data.decode_args(), alibi_slopes=slopes)
    got = sk.paged_decode(*data.decode_args(), alibi_slopes=slopes, num_splits=num_splits)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.all(np.isfinite(got))
    error = np.max(np.abs(got.astype(np.float64) - expected), axis=-1, initial=0.0)
    assert np.all(error <= tolerance(data, slopes, num_splits))
    assert np.all(got[data.seq_lens == 0] == 0)  # length 0: a zero row


@given(layout=fst.paged_kv_layouts(max_seqs=3, max_seq_len=48), seed=st.integers(0, 2**32 - 1))
def test_auto_splits_match_the_reference(layout, seed):
    data = layout.random_data(np.random.default_rng(seed), fp8=True)
    expected = attention.paged_decode(*data.decode_args())
    got = sk.paged_decode(*data.decode_args())  # num_splits="auto"
    splits = sk.choose_num_splits(layout.num_seqs, layout.num_heads, layout.num_kv_heads, int(layout.seq_lens.max()),
                                  block_size=layout.block_size)
    assert np.all(np.isfinite(got))
    assert np.all(np.max(np.abs(got - expected), axis=-1, initial=0.0) <= tolerance(data, None, splits))


def test_long_sequences_many_splits_gqa_alibi(rng):
    """Fixed larger case: 2 sequences of a few hundred tokens, GQA 4, head_dim 128, 8 splits."""
    lens = np.array([300, 77], dtype=np.int32)
    block_size = 16
    tables = rng.permutation(40).reshape(2, 20).astype(np.int32)
    layout = fst.PagedKVLayout(8, 2, 128, block_size, 40, tables, lens)
    data = layout.random_data(rng, fp8=True)
    slopes = random_slopes(rng, 8)
    expected = attention.paged_decode(*data.decode_args(), alibi_slopes=slopes)
    got = sk.paged_decode(*data.decode_args(), alibi_slopes=slopes, num_splits=8)
    assert np.all(np.isfinite(got))
    assert np.all(np.max(np.abs(got - expected), axis=-1) <= tolerance(data, slopes, 8))
    assert np.max(np.abs(got - expected)) < 1e-4  # in practice far inside the bound


def test_numpy_exp2_float32_is_within_the_assumed_ulps():
    x = np.linspace(-126, 0, 400_001).astype(np.float32)
    exact = np.exp2(x.astype(np.float64))
    relative = np.abs(np.exp2(x).astype(np.float64) - exact) / exact
    assert np.max(relative) <= EXP2_ULPS * U


# ---------------------------------------------------------------------------- the work split


@given(seq_len=st.integers(0, 600), num_splits=st.integers(1, 8), block_size=st.sampled_from([1, 2, 3, 8, 16, 32]))
def test_shards_partition_the_tokens(seq_len, num_splits, block_size):
    bounds = sk.shard_bounds(seq_len, num_splits, block_size)
    assert bounds.shape == (num_splits, 2)
    starts, ends = bounds[:, 0], bounds[:, 1]
    assert starts[0] == 0 and ends[-1] == seq_len and np.array_equal(starts[1:], ends[:-1])
    assert np.all(starts <= ends)
    covered = np.concatenate([np.arange(s, e) for s, e in bounds])
    assert np.array_equal(covered, np.arange(seq_len))  # every token exactly once, in order
    assert np.all((starts % block_size == 0) | (starts == seq_len))  # shards start on a block
    sizes = ends - starts
    nonempty = np.flatnonzero(sizes)
    if nonempty.size:
        assert np.all(sizes[nonempty[:-1]] % block_size == 0)  # only the last one ends mid-block
        assert nonempty[-1] == nonempty.size - 1  # empty shards only at the end
        assert np.all(sizes[nonempty[:-1]] == sizes[0])  # equal shards of whole blocks, then the rest


@given(start=st.integers(0, 100), size=st.integers(0, 80), head_dim=st.sampled_from([16, 32, 64, 128, 256]))
def test_slots_take_tokens_round_robin(start, size, head_dim):
    end, slots = start + size, sk.num_slots(head_dim)
    per_slot = [sk.slot_tokens(start, end, p, slots) for p in range(slots)]
    assert np.array_equal(np.sort(np.concatenate(per_slot)), np.arange(start, end))
    for p, tokens in enumerate(per_slot):
        assert np.all((tokens - start) % slots == p) and np.all(np.diff(tokens) == slots)
    counts = [len(t) for t in per_slot]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("head_dim, lanes, slots", [(4, 1, 128), (16, 1, 128), (32, 2, 64), (40, 4, 32), (64, 4, 32),
                                                    (128, 8, 16), (256, 16, 8), (512, 32, 4)])
def test_lanes_own_every_element_once(head_dim, lanes, slots):
    assert sk.lanes_per_token(head_dim) == lanes and sk.num_slots(head_dim) == slots
    assert sk.butterfly_offsets(head_dim) == tuple(lanes >> i for i in range(1, lanes.bit_length()))
    idx = sk.lane_elements(head_dim)
    assert idx.shape == (lanes, 16)
    owned = idx[idx >= 0]
    assert np.array_equal(owned, np.arange(head_dim))  # lane r owns a contiguous run, in lane order


def test_head_dim_beyond_the_warp_is_an_error():
    with pytest.raises(ValueError, match="head_dim"):
        sk.lanes_per_token(513)


@pytest.mark.parametrize("group, per_cta", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 1), (6, 3), (8, 4), (12, 4), (7, 1)])
def test_heads_per_cta_at_long_contexts(group, per_cta):
    """Beyond 8,192 tokens: the largest divisor of the group size up to 4."""
    assert sk.heads_per_cta(group, 8193) == per_cta


@pytest.mark.parametrize("group, tokens, per_cta", [(4, 0, 1), (4, 2048, 1), (4, 2049, 2), (4, 8192, 2), (8, 8192, 2),
                                                    (3, 8192, 1), (6, 4096, 2), (2, 512, 1), (1, 100_000, 1)])
def test_heads_per_cta_by_tokens(group, tokens, per_cta):
    """Short calls take fewer heads per CTA: 1 up to 2,048 tokens (num_seqs * max_seq_len), at most 2 up to 8,192."""
    assert sk.heads_per_cta(group, tokens) == per_cta


@given(num_seqs=st.integers(0, 300), num_kv_heads=st.integers(1, 16), group=st.integers(1, 8),
       max_seq_len=st.integers(0, 100_000), num_sms=st.sampled_from([1, 16, 78, 108, 132, 148]),
       block_size=st.sampled_from([1, 16, 32]))
def test_split_heuristic(num_seqs, num_kv_heads, group, max_seq_len, num_sms, block_size):
    num_heads = num_kv_heads * group
    splits = sk.choose_num_splits(num_seqs, num_heads, num_kv_heads, max_seq_len, num_sms=num_sms, block_size=block_size)
    per_cta = sk.heads_per_cta(group, num_seqs * max_seq_len)
    grid = num_seqs * num_heads // per_cta
    assert 1 <= splits <= sk.MAX_SPLITS_PER_HEAD * per_cta
    if grid >= sk.CTAS_PER_SM * num_sms:
        assert splits == 1  # the grid fills the GPU: no split
    if splits > 1:
        assert grid * splits <= sk.CTAS_PER_SM * num_sms  # splitting stays within the target
        assert splits <= -(-max_seq_len // block_size)  # never more shards than blocks of work
        assert grid * (splits + 1) > sk.CTAS_PER_SM * num_sms or splits in (sk.MAX_SPLITS_PER_HEAD * per_cta,
                                                                           -(-max_seq_len // block_size))


def test_split_heuristic_examples():
    # Qwen3-8B (32 query heads, 8 kv heads), 132 SMs, 2 CTAs per SM
    assert sk.choose_num_splits(1, 32, 8, 16384) == 32  # 4 heads per CTA: 8 CTAs x 32 shards = 256 <= 264
    assert sk.choose_num_splits(1, 32, 8, 8192) == 16  # 2 heads per CTA: 16 CTAs, at most 8 x 2 shards
    assert sk.choose_num_splits(1, 32, 8, 1024) == 8  # 1 head per CTA: 32 CTAs, at most 8 shards
    assert sk.choose_num_splits(8, 32, 8, 4096) == 4  # 32,768 tokens: 4 heads per CTA, 64 CTAs x 4 = 256
    assert sk.choose_num_splits(16, 32, 8, 4096) == 2  # 128 CTAs x 2
    assert sk.choose_num_splits(64, 32, 8, 4096) == 1  # 512 CTAs fill the GPU
    assert sk.choose_num_splits(1, 16, 8, 4096) == 16  # Qwen3-0.6B: GQA 2, 2 heads per CTA, at most 8 x 2 shards
    assert sk.choose_num_splits(1, 8, 8, 4096) == 8  # no GQA: one head per CTA, at most 8
    assert sk.choose_num_splits(1, 32, 8, 40, block_size=16) == 3  # only 3 blocks of work
    assert sk.choose_num_splits(1, 32, 8, 0) == 1


# ---------------------------------------------------------------------------- partials and combine


def some_partials(rng, num_splits=5, fp8=True, lens=(0, 1, 13, 70)):
    lens = np.array(lens, dtype=np.int32)
    block_size = 8
    blocks = -(-lens // block_size)
    tables = np.full((len(lens), max(1, blocks.max())), -1, np.int32)
    pool = rng.permutation(int(blocks.sum()) + 2)
    start = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = pool[start : start + b]
        start += b
    layout = fst.PagedKVLayout(4, 2, 16, block_size, int(blocks.sum()) + 2, tables, lens)
    data = layout.random_data(rng, fp8=fp8)
    return data, sk.shard_partials(*data.decode_args(), num_splits=num_splits)


def test_partials_follow_the_shards(rng):
    data, p = some_partials(rng)
    num_seqs, num_heads, num_splits = p.m.shape
    assert p.acc.shape == (num_seqs, num_heads, num_splits, 16) and p.bounds.shape == (num_seqs, num_splits, 2)
    for i, length in enumerate(data.seq_lens):
        assert np.array_equal(p.bounds[i], sk.shard_bounds(int(length), num_splits, 8))
    empty = (p.bounds[..., 1] == p.bounds[..., 0])[:, None, :].repeat(num_heads, axis=1)
    assert empty.any() and (~empty).any()
    assert np.all(p.m[empty] == -np.inf) and np.all(p.l[empty] == 0) and np.all(p.acc[empty] == 0)
    assert np.all(np.isfinite(p.m[~empty])) and np.all(p.l[~empty] >= 1)  # the max token has weight 1
    assert np.all(np.isfinite(p.acc))


def test_combine_of_one_shard_is_its_normalized_output(rng):
    _, p = some_partials(rng)
    own = p.shard_outputs()
    for s in range(p.m.shape[-1]):
        single = sk.combine_partials(p.m[..., s : s + 1], p.l[..., s : s + 1], p.acc[..., s : s + 1, :])
        assert np.all(np.isfinite(single)) and np.array_equal(single, own[..., s, :])
        nonempty = p.l[..., s] > 0
        assert np.array_equal(single[nonempty], p.acc[..., s, :][nonempty] / p.l[..., s][nonempty][:, None])


def test_num_splits_1_is_one_shard_normalized(rng):
    data, p = some_partials(rng, num_splits=1)
    out = sk.paged_decode(*data.decode_args(), num_splits=1)
    assert np.array_equal(out, p.shard_outputs()[..., 0, :])


def test_neutral_element_leaves_the_combine_unchanged(rng):
    _, p = some_partials(rng)
    before = sk.combine_partials(p.m, p.l, p.acc)
    m0, l0, acc0 = sk.neutral_partial(p.acc.shape[-1])
    for position in (0, 2, p.m.shape[-1]):
        m = np.insert(p.m, position, m0, axis=-1)
        l = np.insert(p.l, position, l0, axis=-1)
        acc = np.insert(p.acc, position, acc0, axis=-2)
        assert np.array_equal(sk.combine_partials(m, l, acc), before)
    only_neutral = sk.combine_partials(np.full((3, 2), m0), np.zeros((3, 2), np.float32), np.zeros((3, 2, 16), np.float32))
    assert np.array_equal(only_neutral, np.zeros((3, 16)))  # nothing to attend to: zeros, not NaN


def test_length_zero_gives_zero_rows_never_nan(rng):
    for num_splits in (1, 3, 8):
        data, p = some_partials(rng, num_splits=num_splits, lens=(0, 0, 5))
        out = sk.paged_decode(*data.decode_args(), num_splits=num_splits)
        assert np.all(np.isfinite(out))
        assert np.all(out[:2] == 0) and np.any(out[2] != 0)


def test_fp8_and_float_caches_agree_on_the_same_values(rng):
    """A float cache holding exactly the dequantized FP8 values gives nearly the same output (the
    FP8 path scales the dot and the weight once per token instead of every element)."""
    data, _ = some_partials(rng, fp8=True)
    as_float = [kv_cache.dequantize_kv(c, s) for c, s in ((data.k_cache, data.k_scale), (data.v_cache, data.v_scale))]
    fp8_out = sk.paged_decode(*data.decode_args(), num_splits=3)
    float_out = sk.paged_decode(data.q, as_float[0], as_float[1], data.block_tables, data.seq_lens,
                                data.softmax_scale, num_splits=3)
    assert np.all(np.isfinite(float_out)) and np.max(np.abs(fp8_out - float_out)) < 1e-5


# ---------------------------------------------------------------------------- the schedule, by hand


def merge_by_hand(partials, head_dim: int):
    """The merge rule on a list of scalar partials ``(m, l, acc)``, in list order."""
    fma = fma_module.fma_f32
    m_star = max(m for m, _, _ in partials)
    l, acc = np.float32(0), np.zeros(head_dim, np.float32)
    for m, l_i, acc_i in partials:
        w = np.float32(0) if m == -np.inf else np.exp2(np.float32(m - m_star))
        l, acc = fma(w, l_i, l), fma(w, acc_i, acc)
    return m_star, l, acc


def decode_by_hand(data, slopes, num_splits: int) -> np.ndarray:
    """The kernel's loops written out for one (sequence, head) at a time, scalar fmas and all."""
    fma = fma_module.fma_f32
    num_seqs, num_heads, head_dim = data.q.shape
    num_kv_heads, block_size = data.k_cache.shape[1], data.k_cache.shape[2]
    scale_log2 = np.float32(data.softmax_scale * sk.LOG2E)
    lanes = sk.lane_elements(head_dim)
    out = np.zeros(data.q.shape, np.float32)
    for i in range(num_seqs):
        length = int(data.seq_lens[i])
        k = kv_cache.gather(data.k_cache, None if data.k_scale is None else np.ones_like(data.k_scale),
                            data.block_tables[i], length)  # the codes' values, unscaled
        v = kv_cache.gather(data.v_cache, None if data.v_scale is None else np.ones_like(data.v_scale),
                            data.block_tables[i], length)
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            q2 = data.q[i, h] * scale_log2
            shards = []
            for start, end in sk.shard_bounds(length, num_splits, block_size):
                slots = []
                for slot in range(sk.num_slots(head_dim)):
                    m, l, acc = np.float32(-np.inf), np.float32(0), np.zeros(head_dim, np.float32)
                    for j in sk.slot_tokens(start, end, slot, sk.num_slots(head_dim)):
                        block, offset = data.block_tables[i, j // block_size], j % block_size
                        ks = np.float32(1) if data.k_scale is None else data.k_scale[block, kv, offset]
                        vs = np.float32(1) if data.v_scale is None else data.v_scale[block, kv, offset]
                        n = len(lanes)
                        part = np.zeros(n, np.float32)
                        for lane in range(n):
                            for d in lanes[lane][lanes[lane] >= 0]:
                                part[lane] = fma(q2[d], k[j, kv, d], part[lane])
                        off = n // 2
                        while off:
                            part = np.array([part[x] + part[x ^ off] for x in range(n)], np.float32)
                            off //= 2
                        s = part[0] * ks
                        if slopes is not None:
                            s = fma(slopes[h] * np.float32(sk.LOG2E), np.float32(j - (length - 1)), s)
                        m_new = max(m, s)
                        corr = np.float32(1) if m_new == m else np.exp2(np.float32(m - m_new))
                        p = np.exp2(np.float32(s - m_new))
                        l = fma(l, corr, p)
                        acc = fma(p * vs, v[j, kv], acc * corr)
                        m = m_new
                    slots.append((m, l, acc))
                shards.append(merge_by_hand(slots, head_dim))
            _, l, acc = merge_by_hand(shards, head_dim)
            out[i, h] = acc / l if l > 0 else 0
    return out


@pytest.mark.parametrize("fp8, alibi, num_splits", [(True, True, 3), (False, False, 2), (True, False, 1)])
def test_matches_the_loop_nest_bit_for_bit(rng, fp8, alibi, num_splits):
    tables = rng.permutation(60)[:54].reshape(3, 18).astype(np.int32)
    layout = fst.PagedKVLayout(4, 2, 40, 4, 60, tables, np.array([13, 70, 6], np.int32))  # D = 40: 3 lanes + 1 idle
    data = layout.random_data(rng, fp8=fp8)
    slopes = random_slopes(rng, 4) if alibi else None
    expected = decode_by_hand(data, slopes, num_splits)
    got = sk.paged_decode(*data.decode_args(), alibi_slopes=slopes, num_splits=num_splits)
    assert np.all(np.isfinite(got)) and np.array_equal(got, expected)


# ---------------------------------------------------------------------------- bad input


def test_bad_arguments_raise(rng):
    data, _ = some_partials(rng)
    args = list(data.decode_args())
    with pytest.raises(ValueError, match="num_splits"):
        sk.paged_decode(*args, num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        sk.paged_decode(*args, num_splits="many")
    with pytest.raises(ValueError, match="scales"):
        sk.paged_decode(*args[:6], None, data.v_scale)  # FP8 codes without their scales
    with pytest.raises(ValueError, match="GQA"):
        sk.paged_decode(data.q[:, :3], *args[1:])
    with pytest.raises(ValueError, match="alibi_slopes"):
        sk.paged_decode(*args, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="block_tables"):
        sk.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables[:, :1], *args[4:])
    with pytest.raises(ValueError, match="shard_bounds"):
        sk.shard_bounds(10, 0, 16)


# ---------------------------------------------------------------------------- the vectorized model


def assert_same_partials(got, expected):
    for name in ("m", "l", "acc"):
        x, y = getattr(got, name), getattr(expected, name)
        assert x.dtype == y.dtype == np.float32 and np.array_equal(x.view(np.uint32), y.view(np.uint32)), name
    assert np.array_equal(got.bounds, expected.bounds)


@given(
    layout=fst.paged_kv_layouts(max_seqs=3, max_seq_len=48),
    num_splits=st.one_of(st.just("auto"), st.integers(1, 8)),
    fp8=st.booleans(),
    alibi=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    q_scale=st.sampled_from([1.0, 2.0**-40, 2.0**-100, 2.0**20]),  # tiny and huge scores too
)
def test_equals_the_step_by_step_model_bit_for_bit(layout, num_splits, fp8, alibi, seed, q_scale):
    rng = np.random.default_rng(seed)
    data = layout.random_data(rng, fp8=fp8)
    q = (data.q * np.float32(q_scale)).astype(np.float32)
    slopes = random_slopes(rng, layout.num_heads) if alibi else None
    args = (q,) + data.decode_args()[1:]
    assert_same_partials(sk.shard_partials(*args, alibi_slopes=slopes, num_splits=num_splits),
                         sk.shard_partials_by_step(*args, alibi_slopes=slopes, num_splits=num_splits))


def test_equals_the_step_by_step_model_on_long_sequences(rng):
    """Hundreds of steps, several score tiles and value chunks, GQA 4, head_dim 128 (8 lanes) and 40 (4 lanes)."""
    for head_dim, fp8 in ((128, True), (40, False)):
        lens = np.array([700, 0, 333], np.int32)
        tables = rng.permutation(3 * 44).reshape(3, 44).astype(np.int32)
        data = fst.PagedKVLayout(8, 2, head_dim, 16, 3 * 44, tables, lens).random_data(rng, fp8=fp8)
        for num_splits in (1, 3):
            assert_same_partials(sk.shard_partials(*data.decode_args(), num_splits=num_splits),
                                 sk.shard_partials_by_step(*data.decode_args(), num_splits=num_splits))
