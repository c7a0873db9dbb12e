"""fp8lab.simulators.splitkv_mma (tensor-core split-kv decode attention) against fp8lab.reference.attention and
fp8lab.simulators.mma.

- Within ``error_bound`` of the float64 reference on random paged FP8 batches (GQA groups 1 to 16, head_dim 128,
  any split count, lengths 0 and 1, V scales spanning many binades); a length-0 row is zeros.
- The score and value tiles are the ``mma`` model on the fragments the kernel builds: the query and key
  registers of ``score_dims`` (two codes per conversion, word ``s`` of the lane's bytes) and the weight and
  value registers, assembled with ``fp8lab.simulators.mma``'s coordinate maps, give ``tile_scores`` and
  ``tile_values`` bit for bit.
- The plan: shards of whole tiles partition each sequence; ``choose_num_splits``; ``power_of_two_below``.
- NaN: a NaN code of an attended token makes its kv head's rows NaN; unused (NaN-poisoned) slots never reach
  the output; a bad argument is a ``ValueError`` that names it.
"""

import numpy as np
import pytest
from helpers.attention import assert_within_mma_bound as assert_within_bound
from helpers.attention import paged_fp8
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8lab.reference import e4m3
from fp8lab.simulators import mma, splitkv_mma
from fp8lab.simulators.bit_placement import bits_to_float32


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lens=st.lists(st.integers(0, 70), min_size=1, max_size=3),
       group=st.sampled_from([1, 2, 4, 8, 16]), num_kv_heads=st.sampled_from([1, 2]),
       block_size=st.sampled_from([16, 32]), num_splits=st.one_of(st.just("auto"), st.integers(1, 6)))
def test_within_the_error_bound_of_the_reference(seed, lens, group, num_kv_heads, block_size, num_splits):
    rng = np.random.default_rng(seed)
    data = paged_fp8(rng, lens, group * num_kv_heads, num_kv_heads, 128, block_size)
    out = splitkv_mma.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                   data.softmax_scale, data.k_scale, data.v_scale, num_splits=num_splits)
    assert_within_bound(data, out)


def test_v_scales_over_many_binades():
    """V scales from 2^-30 to 2^10 in one tile: the weights' power-of-two rescaling keeps them inside F16."""
    rng = np.random.default_rng(7)
    data = paged_fp8(rng, [45, 16], 8, 2, 128, 16)
    data.v_scale[...] = np.float32(2.0) ** rng.integers(-30, 11, data.v_scale.shape).astype(np.float32)
    out = splitkv_mma.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                   data.softmax_scale, data.k_scale, data.v_scale, num_splits=2)
    assert_within_bound(data, out)


def test_tiles_are_the_mma_model_on_the_kernels_registers():
    """Build the registers as the kernel does (lane by lane) and run ``fp8lab.simulators.mma.mma_registers``."""
    rng = np.random.default_rng(3)
    head_dim = 128
    codes = rng.integers(0, 256, (16, head_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN here
    keys = e4m3.VALUES[codes].astype(np.float64)
    q = rng.standard_normal((16, head_dim)).astype(np.float32)
    qh = splitkv_mma.f16(q)
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    f16_bits = q.astype(np.float16).view(np.uint16).astype(np.uint32)
    c = np.zeros((32, 4), np.float32)
    for half in range(2):
        c = np.zeros((32, 4), np.float32)
        for s in range(head_dim // 16):
            d = (head_dim // 4) * t + 4 * s
            a = np.stack([f16_bits[g, d] | f16_bits[g, d + 1] << 16, f16_bits[g + 8, d] | f16_bits[g + 8, d + 1] << 16,
                          f16_bits[g, d + 2] | f16_bits[g, d + 3] << 16,
                          f16_bits[g + 8, d + 2] | f16_bits[g + 8, d + 3] << 16], axis=-1).astype(np.uint32)
            key_codes = codes[8 * half + g]  # [32, D]: each lane's key row
            k16 = e4m3.VALUES[key_codes[lanes[:, None], d[:, None] + np.arange(4)]].astype(np.float16)
            kb = k16.view(np.uint16).astype(np.uint32)
            b = np.stack([kb[:, 0] | kb[:, 1] << 16, kb[:, 2] | kb[:, 3] << 16], axis=-1).astype(np.uint32)
            c = mma.mma_registers(a, b, c, "f16")
        expected = splitkv_mma.tile_scores(qh, keys)[:, 8 * half : 8 * half + 8]
        assert np.array_equal(mma.store_c(c), expected)

    weights = splitkv_mma.f16(rng.uniform(0, 1, (16, 16)).astype(np.float32))
    w_bits = weights.astype(np.float16).view(np.uint16).astype(np.uint32)
    tok = 2 * t
    a = np.stack([w_bits[g, tok] | w_bits[g, tok + 1] << 16, w_bits[g + 8, tok] | w_bits[g + 8, tok + 1] << 16,
                  w_bits[g, tok + 8] | w_bits[g, tok + 9] << 16, w_bits[g + 8, tok + 8] | w_bits[g + 8, tok + 9] << 16],
                 axis=-1).astype(np.uint32)
    values = keys  # any exact values
    v16 = values.astype(np.float16).view(np.uint16).astype(np.uint32)
    expected = splitkv_mma.tile_values(weights, values)
    for s in range(head_dim // 8):
        d = (head_dim // 8) * g + s  # lane group g's element of n tile s
        b = np.stack([v16[tok, d] | v16[tok + 1, d] << 16, v16[tok + 8, d] | v16[tok + 9, d] << 16], axis=-1).astype(np.uint32)
        o = mma.store_c(mma.mma_registers(a, b, np.zeros((32, 4), np.float32), "f16"))  # [16 rows, 8 n]
        columns = (head_dim // 8) * np.arange(8) + s
        assert np.array_equal(o, expected[:, columns])
    assert np.array_equal(bits_to_float32(w_bits.astype(np.uint16), "f16"), weights.astype(np.float32))


def test_shards_partition_each_sequence_in_whole_tiles():
    for length in (0, 1, 15, 16, 17, 100, 531):
        for splits in (1, 2, 3, 7, 32):
            bounds = splitkv_mma.shard_bounds(length, splits)
            assert bounds.shape == (splits, 2) and bounds[0, 0] == 0 and bounds[-1, 1] == length
            assert (bounds[1:, 0] == bounds[:-1, 1]).all() and (bounds[:, 0] <= bounds[:, 1]).all()
            starts = bounds[bounds[:, 0] < length, 0]  # (empty shards start at the end)
            assert (starts % splitkv_mma.TILE == 0).all()


def test_split_rule():
    assert splitkv_mma.choose_num_splits(1, 8, 4096, 132) == 16  # batch 1, Qwen3-8B: 128 CTAs, one per SM
    assert splitkv_mma.choose_num_splits(1, 8, 16384, 132) == 32  # 64 tiles a shard at 16: doubled, 2 per SM
    assert splitkv_mma.choose_num_splits(1, 8, 512, 132) == 8  # a tile for each of a CTA's 4 warps: 32 tiles / 4
    assert splitkv_mma.choose_num_splits(8, 8, 512, 132) == 2  # 128 CTAs; 16 tiles a shard: not doubled
    assert splitkv_mma.choose_num_splits(16, 8, 1024, 132) == 2  # 128 CTAs at 1; 64 tiles a shard: doubled
    assert splitkv_mma.choose_num_splits(1, 8, 40, 132) == 1
    assert splitkv_mma.choose_num_splits(64, 8, 4096, 132) == 1
    assert splitkv_mma.choose_num_splits(1, 1, 2**20, 132) == splitkv_mma.MAX_SPLITS


def test_power_of_two_below():
    pow_, inv = splitkv_mma.power_of_two_below(np.array([1.0, 1.5, 0.75, 3e-30, 0.0, 1e-45], np.float32))
    assert pow_.tolist() == [1.0, 1.0, 0.5, float(np.float32(2.0**-99)), 1.0, 1.0]
    assert (pow_ * inv == 1).all()


def test_a_nan_code_reaches_its_kv_heads_rows_only():
    rng = np.random.default_rng(11)
    data = paged_fp8(rng, [20, 33], 4, 2, 128, 16)
    block = data.block_tables[1, 1]
    data.v_cache[block, 1, 3, 17] = 0x7F  # token 19 of sequence 1, kv head 1: a NaN code
    out = splitkv_mma.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                   data.softmax_scale, data.k_scale, data.v_scale, num_splits=3)
    assert np.isnan(out[1, 2:]).any() and not np.isnan(out[1, :2]).any() and not np.isnan(out[0]).any()


@pytest.mark.parametrize("change, message", [
    (dict(block_size=8), "block size"), (dict(head_dim=64), "head_dim"), (dict(group=32), "heads per kv head"),
])
def test_unsupported_shapes_are_refused(change, message):
    shape = dict(block_size=16, head_dim=128, group=2) | change
    rng = np.random.default_rng(0)
    data = paged_fp8(rng, [5], shape["group"], 1, shape["head_dim"], shape["block_size"])
    with pytest.raises(ValueError, match=message):
        splitkv_mma.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                 data.softmax_scale, data.k_scale, data.v_scale)


def test_power_of_two_below_at_the_top_of_the_range():
    """``vmax >= 2^127`` gives ``inv = 0`` (as the kernel's integer code does), never a wrapped exponent."""
    pow_, inv = splitkv_mma.power_of_two_below(np.array([2.0**127, 3e38, np.inf, 2.0**126], np.float32))
    assert inv.tolist()[:3] == [0.0, 0.0, 0.0] and inv[3] == np.float32(2.0**-126)
    assert pow_[0] == np.float32(2.0**127) and np.isinf(pow_[2])
