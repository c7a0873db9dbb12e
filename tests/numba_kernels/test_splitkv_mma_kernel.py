"""fp8lab.numba_kernels.splitkv_mma (tensor-core split-kv decode attention) against fp8lab.simulators.splitkv_mma and
fp8lab.reference.attention.

In the CUDA simulator (``cudasim``; a simulated warp's ``mma`` pools the 32 lanes' registers into the model of
``fp8lab.simulators.mma``): outputs bit for bit equal to ``fp8lab.simulators.splitkv_mma`` for split counts 1 to
4 and ``"auto"`` (empty shards included), GQA groups of 2, 4 and 16 (rows ``g + 8`` in use), block sizes 16 and
32, lengths 0, 1 and tails of a tile, NaN-poisoned unused slots, one shard of 13 tiles (each warp's loads two tiles
ahead) and of 6 tiles for a group of 16 (one tile ahead); BF16 output bit for bit ``layers.bf16_round``
of the float32 output; a length-0 row after a call with data comes back zero; unsupported caches and bad
workspaces are a ``ValueError`` before anything is launched. With its input (``decode_mma_with_input``): out, both
caches and scales bit for bit ``fp8lab.simulators.splitkv_mma.decode_with_input`` (a length-0 row, a new token
opening a tile, 2 kv heads, 16 query heads per kv head; the new tokens' slots poisoned before); inputs of the wrong
shape are a ``ValueError``.

On a GPU (``gpu``, run by hand on an H200): Qwen3-8B heads (32 query, 8 kv, head_dim 128) and Qwen3-0.6B heads (16,
8), batches 1 and 8, contexts up to 16k, split on and off, against ``fp8lab.reference.attention`` on fresh random
data with ``out`` poisoned: elementwise within ``fp8lab.simulators.splitkv_mma.error_bound``; BF16 output bit for
bit the float32 output rounded. With its input: bit for bit ``qk_norm_rope_cache_write`` then ``paged_decode_mma`` on
the GPU (out, caches, scales), batches 1 to 16 with lengths 0 to 4,096.
"""

import os

import numpy as np
import pytest
from helpers.attention import assert_within_mma_bound as assert_within_bound
from helpers.attention import paged_fp8
from helpers.numerics import spread_activations
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import layers, splitkv, splitkv_mma
from fp8lab.numba_kernels.attention_input import qk_norm_rope_cache_write
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.simulators import splitkv_mma as model
from fp8lab.simulators.splitkv import combine_partials

SIMULATOR_EXAMPLES = max(3, settings().max_examples // 10)
"""Simulated kernels are slow (a warp's mma is a NumPy call per lane): few Hypothesis examples."""


def run_kernel(data, num_splits="auto", out=None, **kwargs):
    if out is None:
        out = np.full(data.q.shape, np.nan, np.float32)  # poisoned: every element must be written
    splitkv_mma.paged_decode_mma(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                 data.softmax_scale, out, data.k_scale, data.v_scale, num_splits=num_splits, **kwargs)
    return out


def simulated(data, num_splits="auto"):
    return model.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                              data.softmax_scale, data.k_scale, data.v_scale, num_splits=num_splits)


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@settings(max_examples=SIMULATOR_EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), lens=st.lists(st.integers(0, 40), min_size=1, max_size=2),
       group=st.sampled_from([2, 4, 16]), block_size=st.sampled_from([16, 32]),
       num_splits=st.one_of(st.just("auto"), st.integers(1, 4)))
def test_bit_for_bit_the_simulator(seed, lens, group, block_size, num_splits):
    rng = np.random.default_rng(seed)
    data = paged_fp8(rng, lens, group, 1, 128, block_size)
    out = run_kernel(data, num_splits)
    expected = simulated(data, num_splits if num_splits != "auto" else
                         model.choose_num_splits(len(lens), 1, int(max(lens)), splitkv.device_num_sms()))
    assert np.array_equal(out, expected), np.argwhere(out != expected)[:5]


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("length, group", [
    (200, 2),  # 13 tiles in one shard: each warp's second tile, then each tile's loads two ahead, a tail
    (90, 16),  # 6 tiles: a wide group keeps one tile ahead
])
def test_long_shards_bit_for_bit_the_simulator(length, group):
    """A shard of several tiles per warp: the loads issued ahead of the arithmetic (two tiles, or one for a group over
    8) change no bit. (The block table's later 32-tile chunks need shards of over 512 tokens, half a minute here: the
    GPU test against the reference runs one shard of 16,384.)"""
    data = paged_fp8(np.random.default_rng(length), [length], group, 1, 128, 16)
    assert np.array_equal(run_kernel(data, 1), simulated(data, 1))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
def test_two_kv_heads_shards_and_a_length_0_row_after_data():
    rng = np.random.default_rng(5)
    data = paged_fp8(rng, [20, 0], 8, 2, 128, 16)
    workspace = splitkv.decode_workspace(2, 8, 128, 2)
    first = run_kernel(data, 2, workspace=workspace)
    assert np.array_equal(first, simulated(data, 2)) and (first[1] == 0).all()
    partials = model.shard_partials(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                    data.softmax_scale, data.k_scale, data.v_scale, 2)
    assert np.array_equal(workspace[..., :128], partials.acc)  # the workspace holds the shards' partials
    assert np.array_equal(workspace[..., 128], partials.m) and np.array_equal(workspace[..., 129], partials.l)
    assert np.array_equal(first, combine_partials(partials.m, partials.l, partials.acc))
    data.seq_lens[0] = 0  # the same workspace again: nothing stale survives
    assert (run_kernel(data, 2, workspace=workspace)[0] == 0).all()


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
def test_bf16_out_is_the_float32_out_rounded():
    """The split kernel's own BF16 store (one shard; with shards the combine of ``splitkv`` stores, tested there)."""
    num_splits = 1
    rng = np.random.default_rng(9)
    data = paged_fp8(rng, [21, 0], 4, 1, 128, 16)
    f32 = run_kernel(data, num_splits)
    bf16 = np.full(data.q.shape, 0xFFFF, np.uint16)
    run_kernel(data, num_splits, out=bf16)
    expected = np.empty(f32.size, np.uint16)
    layers.bf16_round(f32.reshape(-1), expected)
    assert np.array_equal(bf16.reshape(-1), expected)


@pytest.mark.skipif(not SIMULATOR, reason="the CUDA simulator's argument checks")
@pytest.mark.parametrize("change, message", [
    (dict(block_size=8), "block size"), (dict(head_dim=64), "head_dim"), (dict(group=32), "heads per kv head"),
])
def test_unsupported_caches_are_refused(change, message):
    shape = dict(block_size=16, head_dim=128, group=2) | change
    data = paged_fp8(np.random.default_rng(0), [5], shape["group"], 1, shape["head_dim"], shape["block_size"])
    with pytest.raises(ValueError, match=message):
        run_kernel(data)


@pytest.mark.skipif(not SIMULATOR, reason="the CUDA simulator's argument checks")
def test_a_bf16_cache_and_a_small_workspace_are_refused():
    data = paged_fp8(np.random.default_rng(0), [40], 2, 1, 128, 16)
    with pytest.raises(ValueError, match="workspace"):
        run_kernel(data, 4, workspace=splitkv.decode_workspace(1, 2, 128, 2))
    bf16 = np.zeros(data.k_cache.shape, np.uint16)
    with pytest.raises(ValueError, match="FP8 cache"):
        splitkv_mma.paged_decode_mma(data.q, bf16, bf16, data.block_tables, data.seq_lens, data.softmax_scale,
                                     np.zeros(data.q.shape, np.float32))


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_the_warps_partials_meet_32_banks_and_fit_48_kb(group):
    """``stash_offset``: each slot once, inside ``stash_size``; a warp's store of its partial (lane ``(g, t)``,
    element ``(D/8)(2t + e) + s`` of row ``g + 8 r``) in 32 different banks when 32 lanes store, and the merge's 32
    consecutive elements in consecutive words; with the largest group's queries, within 48 KB of static shared
    memory (the with-input kernel's ``q_rows`` and ``stage`` beside it)."""
    offset, d_model = splitkv_mma.stash_offset.py_func, model.HEAD_DIMS[0]
    slots = [offset(w, row, d, group, d_model) for w in range(splitkv_mma.WARPS) for row in range(group)
             for d in range(d_model)]
    assert len(set(slots)) == len(slots) and max(slots) < splitkv_mma.stash_size(group, d_model)
    for w in range(splitkv_mma.WARPS):
        for r in range(2):
            for e in range(2):
                for s in range(d_model // 8):
                    banks = [offset(w, g + 8 * r, (d_model // 8) * (2 * t + e) + s, group, d_model) % 32
                             for g in range(8) for t in range(4) if g + 8 * r < group]
                    assert len(set(banks)) == len(banks)
        for row in range(group):
            for first in range(0, d_model, 32):
                words = [offset(w, row, first + i, group, d_model) for i in range(32)]
                assert words == list(range(words[0], words[0] + 32))
    shared_bytes = 4 * (splitkv_mma.stash_size(group, d_model) + 2 * splitkv_mma.WARPS * group + group * d_model + d_model)
    assert shared_bytes <= 48 * 1024


# ---------------------------------------------------------------------------- with the attention input


def with_input_problem(rng, lens, group, num_kv_heads, block_size):
    """A paged FP8 batch whose new tokens (position ``length - 1``) are still to be written (their slots poisoned:
    NaN codes and scales), and the step's q/k/v GEMM output as column slices of one fused buffer."""
    data = paged_fp8(rng, lens, group * num_kv_heads, num_kv_heads, 128, block_size)
    rows, slots = model.new_token_slots(data.block_tables, data.seq_lens, block_size)
    blocks, offsets = slots // block_size, slots % block_size
    for cache, scales in ((data.k_cache, data.k_scale), (data.v_cache, data.v_scale)):
        cache[blocks, :, offsets] = 0x7F
        scales[blocks, :, offsets] = np.nan
    heads = group * num_kv_heads + 2 * num_kv_heads
    fused = spread_activations(rng, (len(lens), heads, 128)).reshape(len(lens), heads * 128)
    qd, kd = group * num_kv_heads * 128, num_kv_heads * 128
    inputs = dict(q=fused[:, :qd], k=fused[:, qd : qd + kd], v=fused[:, qd + kd :],
                  q_norm=spread_activations(rng, (128,), spread=1), k_norm=spread_activations(rng, (128,), spread=1),
                  eps=1e-6, positions=rng.integers(0, 64, len(lens)).astype(np.int32),
                  cos_sin=layers.rope_table(64, 128, 1e6))
    slot_mapping = np.full(len(lens), -1, np.int32)
    slot_mapping[rows] = slots
    return data, inputs, slot_mapping


def caches_of(data):
    return [x.copy() for x in (data.k_cache, data.v_cache, data.k_scale, data.v_scale)]


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def two_launches(data, inputs, slot_mapping, num_splits):
    """What ``decode_mma_with_input`` replaces: ``qk_norm_rope_cache_write`` then ``paged_decode_mma``, on copies of the
    caches; returns ``(out, [k_cache, v_cache, k_scale, v_scale])``."""
    caches = caches_of(data)
    q_out = np.full((len(data.seq_lens),) + data.q.shape[1:], np.nan, np.float32)
    qk_norm_rope_cache_write(inputs["q"], inputs["k"], inputs["v"], q_out, inputs["q_norm"], inputs["k_norm"],
                             inputs["eps"], inputs["positions"], inputs["cos_sin"], caches[0], caches[1], slot_mapping,
                             caches[2], caches[3])
    out = np.full(q_out.shape, np.nan, np.float32)
    splitkv_mma.paged_decode_mma(q_out, caches[0], caches[1], data.block_tables, data.seq_lens, data.softmax_scale,
                                 out, caches[2], caches[3], num_splits=num_splits)
    return out, caches


def with_input(data, inputs, num_splits):
    """``decode_mma_with_input`` on copies of the caches, ``out`` poisoned; returns ``(out, caches)``."""
    caches = caches_of(data)
    out = np.full(data.q.shape, np.nan, np.float32)
    splitkv_mma.decode_mma_with_input(**inputs, k_cache=caches[0], v_cache=caches[1], block_tables=data.block_tables,
                                      seq_lens=data.seq_lens, softmax_scale=data.softmax_scale, out=out,
                                      k_scale=caches[2], v_scale=caches[3], num_splits=num_splits)
    return out, caches


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("lens, group, num_kv_heads, block_size, num_splits", [
    ([0, 17], 4, 2, 16, 2),  # a length-0 row; the new token opens a tile (17); task G (the write) on warp 0
    ([1, 30], 16, 1, 32, "auto"),  # a length-1 row; 16 query heads per kv head: the write is warp 0's fifth task
])
def test_with_input_bit_for_bit_the_simulator(lens, group, num_kv_heads, block_size, num_splits):
    """``decode_mma_with_input`` against ``fp8lab.simulators.splitkv_mma.decode_with_input``: out, both caches and
    scales bit for bit (the new tokens' slots, poisoned before, written; every other slot untouched). The simulator
    composes the simulators of the two launches the kernel replaces (each checked bit for bit against its kernel
    elsewhere); on a GPU the kernel is checked against those launches themselves."""
    rng = np.random.default_rng(len(lens) * 100 + group)
    data, inputs, _ = with_input_problem(rng, lens, group, num_kv_heads, block_size)
    got, caches = with_input(data, inputs, num_splits)
    expected_caches = caches_of(data)
    splits = num_splits if num_splits != "auto" else model.choose_num_splits(len(lens), num_kv_heads, int(max(lens)),
                                                                              splitkv.device_num_sms())
    expected = model.decode_with_input(**inputs, k_cache=expected_caches[0], v_cache=expected_caches[1],
                                       block_tables=data.block_tables, seq_lens=data.seq_lens,
                                       softmax_scale=data.softmax_scale, k_scale=expected_caches[2],
                                       v_scale=expected_caches[3], num_splits=splits)
    assert same_bits(got, expected) and not np.isnan(got).any()
    assert all(same_bits(a, b) for a, b in zip(caches, expected_caches))


@pytest.mark.skipif(not SIMULATOR, reason="the CUDA simulator's argument checks")
def test_with_input_refuses_inputs_of_the_wrong_shape():
    data, inputs, _ = with_input_problem(np.random.default_rng(1), [5], 2, 1, 16)
    out = np.zeros((1, 2, 128), np.float32)
    for name, bad, message in (("k", inputs["q"], "k: expected"), ("positions", inputs["positions"][:0], "positions"),
                               ("q_norm", np.zeros(64, np.float32), "q_norm")):
        with pytest.raises(ValueError, match=message):
            splitkv_mma.decode_mma_with_input(**(inputs | {name: bad}), k_cache=data.k_cache, v_cache=data.v_cache,
                                              block_tables=data.block_tables, seq_lens=data.seq_lens,
                                              softmax_scale=data.softmax_scale, out=out, k_scale=data.k_scale,
                                              v_scale=data.v_scale)


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("heads, batch, context", [((32, 8), 1, 512), ((32, 8), 1, 16384), ((32, 8), 8, 2048),
                                                   ((16, 8), 1, 531), ((16, 8), 16, 1000)])
def test_on_the_gpu_within_the_bound_of_the_reference(heads, batch, context):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    lens = rng.integers(context // 2, context + 1, batch)
    lens[0] = context
    data = paged_fp8(rng, lens, heads[0], heads[1], 128, 16)
    for num_splits in ("auto", 1):
        out = run_kernel(data, num_splits)
        assert_within_bound(data, out)
    bf16 = np.full(data.q.shape, 0xFFFF, np.uint16)
    run_kernel(data, "auto", out=bf16)
    f32 = run_kernel(data, "auto")
    rounded = ((f32.view(np.uint32) + 0x7FFF + ((f32.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(bf16, rounded)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("heads, lens", [((32, 8), [512]), ((32, 8), [4096, 17, 0, 2049, 1, 700, 33, 1000]),
                                         ((16, 8), [531]), ((16, 8), [1000] * 16)])
def test_with_input_on_the_gpu_is_the_two_launches_bit_for_bit(heads, lens):
    """Qwen3-8B and Qwen3-0.6B heads: ``decode_mma_with_input`` bit for bit ``qk_norm_rope_cache_write`` then
    ``paged_decode_mma`` on the GPU (out, caches, scales), at the split count "auto" and one shard; fresh random data."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    data, inputs, slot_mapping = with_input_problem(rng, lens, heads[0] // heads[1], heads[1], 16)
    for num_splits in ("auto", 1):
        got, caches = with_input(data, inputs, num_splits)
        want, want_caches = two_launches(data, inputs, slot_mapping, num_splits)
        assert same_bits(got, want) and not np.isnan(got).any()
        assert all(same_bits(a, b) for a, b in zip(caches, want_caches))
