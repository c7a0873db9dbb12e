"""fp8lab.numba_kernels.splitkv (split-kv paged decode attention) against fp8lab.simulators.splitkv and fp8lab.reference.attention.

In the CUDA simulator (``cudasim``; tiny shapes, since a simulated CTA costs about 0.1 s and each
token a few ms): outputs and per-shard partials bit for bit equal to ``fp8lab.simulators.splitkv`` for every
split count 1 to 8 (empty shards included), GQA, ALiBi, FP8, BF16 and float32 caches, lengths 0 and
1, random layouts; within the simulator's float32 bound of ``fp8lab.reference.attention``; the regression
tests (a length-0 row after a call with data comes back zero, not stale; an FP8 cache without scales
fails loudly); every bad argument a ``ValueError`` before anything is launched. BF16 output (uint16 ``out``):
bit for bit ``layers.bf16_round`` of the float32 output, through the split kernel's store and the combine's,
with a zero row and a NaN row.

On a GPU (``gpu``, run by hand on an H200): Qwen3-8B heads (32 query, 8 kv, head_dim 128), batch 1 and
8, contexts up to 16k, FP8 and BF16 caches, split on and off, against ``fp8lab.reference.attention`` on fresh
random data with ``out`` poisoned before every launch: elementwise within the bound of
``tests/simulators/test_splitkv.py`` (it assumes an ``exp2`` within 4 ulp; the GPU's ``ex2.approx.f32`` is within
2) and ``||out - ref|| / ||ref|| <= 1e-5``. A NaN anywhere fails both checks. BF16 output at the same heads,
batch 2, 1, 2 and 4 heads per CTA: bit for bit ``layers.bf16_round`` of the float32 output.
"""

import os

import numpy as np
import pytest
from helpers.attention import (
    as_float32,
    bf16_cache,
    bf16_rounded,
    filled_cache,
    paged_layout,
    random_slopes,
    tolerance,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import splitkv as kernels
from fp8lab.numba_kernels.kv_cache import paged_cache_write
from fp8lab.reference import attention, kv_cache
from fp8lab.reference import strategies as fst
from fp8lab.simulators import splitkv as sk

SIMULATOR_EXAMPLES = max(3, settings().max_examples // 10)
"""Simulated kernels are slow: few Hypothesis examples (ci: 4)."""


def make_data(rng, lens, num_heads=2, num_kv_heads=1, head_dim=32, block_size=4, cache="fp8", spare_blocks=2):
    """A paged batch with permuted block tables (padded with -1) and NaN-poisoned unused slots.

    ``cache``: ``"fp8"`` (codes + scales), ``"fp32"``, or ``"bf16"`` (the float32 data rounded to BF16 patterns).
    """
    layout = paged_layout(rng, lens, num_heads, num_kv_heads, head_dim, block_size, spare_blocks)
    data = layout.random_data(rng, fp8=cache == "fp8")
    if cache == "bf16":
        data = fst.PagedKVData(data.q, bf16_cache(data.k_cache), bf16_cache(data.v_cache), None, None,
                               data.block_tables, data.seq_lens, data.softmax_scale)
    return data


def simulator_args(data):
    """``decode_args()`` with BF16 caches widened to float32 (exact): the simulator's view of them."""
    return (data.q, as_float32(data.k_cache), as_float32(data.v_cache), data.block_tables, data.seq_lens,
            data.softmax_scale, data.k_scale, data.v_scale)


def run_kernel(data, num_splits, slopes=None, out=None, workspace=None, **kwargs):
    if out is None:
        out = np.full(data.q.shape, np.nan, np.float32)  # poisoned: every element must be written
    kernels.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, data.softmax_scale,
                         out, data.k_scale, data.v_scale, alibi_slopes=slopes, num_splits=num_splits,
                         workspace=workspace, **kwargs)
    return out


def assert_bit_exact(data, num_splits, slopes=None):
    """The kernel's output, and with splits its workspace, equal the simulator's bit for bit."""
    num_seqs, num_heads, head_dim = data.q.shape
    workspace = np.full((num_seqs, num_heads, max(num_splits, 1), head_dim + 2), np.nan, np.float32)
    got = run_kernel(data, num_splits, slopes, workspace=workspace)
    expected = sk.paged_decode(*simulator_args(data), alibi_slopes=slopes, num_splits=num_splits)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    if num_splits > 1:
        partials = sk.shard_partials(*simulator_args(data), alibi_slopes=slopes, num_splits=num_splits)
        np.testing.assert_array_equal(workspace[..., :head_dim], partials.acc)
        np.testing.assert_array_equal(workspace[..., head_dim], partials.m)
        np.testing.assert_array_equal(workspace[..., head_dim + 1], partials.l)
    return got


# ---------------------------------------------------------------------------- the plan, as the device code reads it


@pytest.mark.cudasim
@given(seq_len=st.integers(0, 2000), num_splits=st.integers(1, 40), block_size=st.sampled_from([1, 4, 16, 32]))
def test_shard_range_is_the_plans_shard_bounds(seq_len, num_splits, block_size):
    """The device function a CTA calls for its own shard gives the plan's ``shard_bounds`` row."""
    bounds = sk.shard_bounds(seq_len, num_splits, block_size)
    for shard in range(num_splits):
        assert kernels.shard_range(seq_len, shard, num_splits, block_size) == tuple(bounds[shard])


# ---------------------------------------------------------------------------- how a lane reads a row


def test_lane_layouts():
    for head_dim in kernels.HEAD_DIMS:
        for cache, bits in (("fp8", 8), ("bf16", 16), ("fp32", 32)):
            layout = kernels.lane_layout(cache, head_dim)
            assert layout.words * 32 == sk.ELEMENTS_PER_LANE * bits  # 16 elements per lane
            assert layout.loads * kernels.WORDS_PER_LOAD == layout.words
            assert layout.row_words * 32 == head_dim * bits
    assert kernels.lane_layout("fp8", 128).loads == 1  # one 128-bit load of 16 codes per lane
    assert kernels.lane_layout("fp8", 128).tokens_in_flight == 4


# ---------------------------------------------------------------------------- bit for bit against the simulator


@pytest.mark.cudasim
@pytest.mark.parametrize("num_splits", range(1, 9))
def test_every_split_count_is_bit_exact(rng, num_splits):
    """21 tokens in blocks of 4 are 6 blocks: 7 and 8 splits leave shards empty; a 1-token sequence too."""
    data = make_data(rng, [21, 1], num_heads=1)
    assert_bit_exact(data, num_splits)


@pytest.mark.cudasim
@pytest.mark.parametrize("cache, alibi, head_dim, num_splits", [
    ("fp8", True, 64, 3), ("fp8", False, 32, 2), ("bf16", True, 32, 2), ("bf16", False, 64, 1),
    ("fp32", True, 32, 1), ("fp32", False, 64, 3)])
def test_caches_gqa_and_alibi_are_bit_exact(rng, cache, alibi, head_dim, num_splits):
    data = make_data(rng, [0, 1, 11], num_heads=2, num_kv_heads=1, head_dim=head_dim, cache=cache)
    slopes = random_slopes(rng, 2) if alibi else None
    out = assert_bit_exact(data, num_splits, slopes)
    assert np.all(out[0] == 0) and np.all(np.isfinite(out))


@pytest.mark.cudasim
@pytest.mark.parametrize("cache, head_dim, block_size, length", [("fp8", 32, 2, 340), ("bf16", 64, 16, 150),
                                                                ("fp32", 128, 16, 45)])
def test_full_groups_of_tokens_in_flight_are_bit_exact(rng, cache, head_dim, block_size, length):
    """Shards long enough for several groups of U tokens per slot and a partial last one: FP8 at head_dim
    32 has 64 slots and U = 4 (340 tokens: 5 or 6 per slot), BF16 at 64 has 32 slots and U = 2, float32
    at 128 has 16 slots and U = 1."""
    tokens_in_flight = kernels.lane_layout(cache, head_dim).tokens_in_flight
    assert length // sk.num_slots(head_dim) > tokens_in_flight
    data = make_data(rng, [length], num_heads=1, head_dim=head_dim, block_size=block_size, cache=cache)
    assert_bit_exact(data, 1, random_slopes(rng, 1))


@pytest.mark.cudasim
@settings(max_examples=SIMULATOR_EXAMPLES)
@given(layout=fst.paged_kv_layouts(max_seqs=2, max_seq_len=20, block_sizes=(1, 4, 16), head_dims=(32, 64),
                                   max_kv_heads=1, gqa_ratios=(1, 2), spare_blocks=2),
       num_splits=st.integers(1, 8), fp8=st.booleans(), alibi=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_random_layouts_are_bit_exact_and_within_the_bound(layout, num_splits, fp8, alibi, seed):
    rng = np.random.default_rng(seed)
    data = layout.random_data(rng, fp8=fp8)
    slopes = random_slopes(rng, layout.num_heads) if alibi else None
    got = assert_bit_exact(data, num_splits, slopes)
    expected = attention.paged_decode(*data.decode_args(), alibi_slopes=slopes)
    error = np.max(np.abs(got.astype(np.float64) - expected), axis=-1, initial=0.0)
    assert np.all(error <= tolerance(data, slopes, num_splits))


@pytest.mark.cudasim
def test_auto_splits_are_bit_exact(rng):
    data = make_data(rng, [9, 3], num_heads=2)
    assert sk.choose_num_splits(2, 2, 1, 9, block_size=4) == 3  # 2 CTAs would not fill 132 SMs; 3 blocks of work
    got = run_kernel(data, "auto")
    np.testing.assert_array_equal(got.view(np.uint32), sk.paged_decode(*simulator_args(data)).view(np.uint32))


@pytest.mark.cudasim
@pytest.mark.parametrize("num_splits", [2, 5, 16, 17, 32, 33, 70])
def test_combine_kernel_is_the_simulators_combine(rng, num_splits):
    """The combine kernel alone on random partials, bit for bit ``fp8lab.simulators.splitkv.combine_partials``:
    up to 70 shards (more than twice the 32 a thread holds at once), empty shards (the neutral element) among them,
    a sequence whose shards are all empty (a zero row), in a workspace with more shard rows than the call uses
    (NaN-poisoned: a combine that read them would fail)."""
    num_seqs, num_heads, head_dim, max_splits = 3, 2, 32, num_splits + 3
    m = (rng.standard_normal((num_seqs, num_heads, num_splits)) * 8).astype(np.float32)
    l = rng.uniform(0.5, 30, m.shape).astype(np.float32)
    acc = (rng.standard_normal(m.shape + (head_dim,)) * l[..., None]).astype(np.float32)
    empty = rng.random(m.shape) < 0.3
    empty[2] = True  # sequence 2: nothing attended
    m[empty], l[empty], acc[empty] = -np.inf, 0, 0
    workspace = np.full((num_seqs, num_heads, max_splits, head_dim + 2), np.nan, np.float32)
    workspace[:, :, :num_splits, :head_dim] = acc
    workspace[:, :, :num_splits, head_dim] = m
    workspace[:, :, :num_splits, head_dim + 1] = l
    out = np.full((num_seqs, num_heads, head_dim), np.nan, np.float32)
    kernels._combine_kernel[(num_seqs, num_heads), head_dim](workspace.reshape(-1), max_splits, num_splits, out)
    expected = sk.combine_partials(m, l, acc)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert np.all(out[2] == 0)


@pytest.mark.cudasim
def test_combine_kernel_passes_a_nan_through(rng):
    """A NaN in one shard's partial (non-finite cache data) reaches that head's output; the other heads stay finite."""
    num_splits, head_dim = 20, 32
    m = rng.standard_normal((1, 2, num_splits)).astype(np.float32)
    l = rng.uniform(1, 5, m.shape).astype(np.float32)
    acc = rng.standard_normal(m.shape + (head_dim,)).astype(np.float32)
    for field, shard in (("m", 18), ("acc", 3)):
        workspace = np.concatenate([acc, m[..., None], l[..., None]], axis=-1).astype(np.float32)
        if field == "m":
            workspace[0, 0, shard, head_dim] = np.nan
        else:
            workspace[0, 0, shard, 5] = np.nan
        out = np.zeros((1, 2, head_dim), np.float32)
        kernels._combine_kernel[(1, 2), head_dim](workspace.reshape(-1), num_splits, num_splits, out)
        assert np.isnan(out[0, 0, 5]) and np.all(np.isfinite(out[0, 1])), field


# ---------------------------------------------------------------------------- regressions


@pytest.mark.cudasim
@pytest.mark.parametrize("num_splits", [1, 3])
def test_length_zero_after_a_call_with_data_comes_back_zero(rng, num_splits):
    """Regression: the same out (and workspace) reused; a sequence now of length 0 must give zeros, not stale values."""
    data = make_data(rng, [9, 5], num_heads=1)
    out = np.full(data.q.shape, np.nan, np.float32)
    workspace = np.full((2, 1, num_splits, 34), np.nan, np.float32)
    run_kernel(data, num_splits, out=out, workspace=workspace)
    assert np.all(np.isfinite(out)) and np.all(out[0] != 0)
    first = out.copy()
    emptied = fst.PagedKVData(data.q, data.k_cache, data.v_cache, data.k_scale, data.v_scale, data.block_tables,
                              np.array([0, 5], np.int32), data.softmax_scale)
    run_kernel(emptied, num_splits, out=out, workspace=workspace)
    assert np.all(out[0] == 0)
    np.testing.assert_array_equal(out[1], first[1])
    if num_splits > 1:  # every shard of the empty sequence published the neutral element
        assert np.all(workspace[0, :, :, 32] == -np.inf) and np.all(workspace[0, :, :, 33] == 0)
        assert np.all(workspace[0, :, :, :32] == 0)


@pytest.mark.cudasim
def test_all_sequences_empty_give_zero_rows(rng):
    data = make_data(rng, [0, 0], num_heads=1, spare_blocks=1)
    for num_splits in (1, 3):
        out = run_kernel(data, num_splits)
        assert np.all(out == 0)


def nan_code_batch(rng):
    """A batch of two sequences with a NaN code (0x7F in a key of sequence 0, 0xFF in a value of sequence 1) under a
    finite scale, and where the reference makes NaN: sequence 0's rows, sequence 1's element 3."""
    data = make_data(rng, [13, 9], num_heads=2)
    for seq, cache, token, code in ((0, data.k_cache, 7, 0x7F), (1, data.v_cache, 5, 0xFF)):
        block, offset = data.block_tables[seq, token // 4], token % 4
        cache[block, 0, offset, 3] = code
    reference = attention.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                       data.softmax_scale, data.k_scale, data.v_scale)
    expected_nan = np.zeros(data.q.shape, bool)
    expected_nan[0] = True
    expected_nan[1, :, 3] = True
    assert np.array_equal(np.isnan(reference), expected_nan)
    return data, expected_nan


@pytest.mark.cudasim
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_codes_with_finite_scales_give_the_references_nan(rng, num_splits):
    """Regression: the kernel makes NaN exactly what the reference makes NaN (``nan_code_batch``; with 3 splits the
    combine too), bit for bit the simulator elsewhere. Bit placement, which this kernel once decoded with, read those
    codes as finite numbers."""
    data, expected_nan = nan_code_batch(rng)
    got = run_kernel(data, num_splits)
    assert np.array_equal(np.isnan(got), expected_nan)
    simulated = sk.paged_decode(*simulator_args(data), num_splits=num_splits)
    assert np.array_equal(got[~expected_nan].view(np.uint32), simulated[~expected_nan].view(np.uint32))


@pytest.mark.cudasim
def test_nan_scales_give_the_references_nan(rng):
    """A NaN ``k_scale`` of a key of sequence 0 makes its rows NaN; a NaN ``v_scale`` of a value of sequence 1 makes
    every element of its rows NaN (the scale multiplies the whole value row), as in the reference."""
    data = make_data(rng, [7, 6], num_heads=2)
    data.k_scale[data.block_tables[0, 1], 0, 2] = np.nan  # sequence 0, token 6 (blocks of 4)
    data.v_scale[data.block_tables[1, 1], 0, 1] = np.nan  # sequence 1, token 5
    reference = attention.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                       data.softmax_scale, data.k_scale, data.v_scale)
    assert np.isnan(reference).all()
    assert np.isnan(run_kernel(data, 2)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_nan_codes_with_finite_scales_give_the_references_nan(num_splits):
    """The same NaN pattern on a GPU, where the decode is the hardware's ``cvt.rn.f16x2.e4m3x2``."""
    data, expected_nan = nan_code_batch(fresh_rng()[1])
    assert np.array_equal(np.isnan(run_kernel(data, num_splits)), expected_nan)


@pytest.mark.cudasim
def test_fp8_cache_without_scales_fails_loudly(rng):
    """Regression: codes without their scales must never be read as if the scales were 1."""
    data = make_data(rng, [5], num_heads=1)
    out = np.full(data.q.shape, np.nan, np.float32)
    for k_scale, v_scale, name in ((None, data.v_scale, "k"), (data.k_scale, None, "v")):
        with pytest.raises(ValueError, match=f"{name}_cache: an FP8 cache of codes \\(uint8\\) needs its scales"):
            kernels.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                 data.softmax_scale, out, k_scale, v_scale)
    assert np.all(np.isnan(out))  # nothing was launched


# ---------------------------------------------------------------------------- BF16 output (uint16 out)


def bf16_nan(bits: np.ndarray) -> np.ndarray:
    """Where BF16 patterns are NaN (exponent all ones, mantissa not zero)."""
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


@pytest.mark.cudasim
@pytest.mark.parametrize("num_splits, block_size", [(1, 4), (2, 2)])
def test_bf16_out_is_the_float32_out_rounded(rng, monkeypatch, num_splits, block_size):
    """uint16 ``out`` is bit for bit ``layers.bf16_round`` of the float32 call's ``out``, through the split kernel's
    store (1 split) and the combine's (2). FP8 cache, 4 query heads on 2 kv heads, each CTA serving both heads of
    its group (``heads_per_cta`` forced to 2: it changes no bit, exercises the store's head index and halves the
    simulated CTAs); a length-0 sequence (BF16 zeros, every shard empty) and a NaN in query head 2 of the other
    (NaN patterns in that row only, not in head 3 of the same CTA). ``out`` poisoned with 0x1234."""
    monkeypatch.setattr(kernels, "heads_per_cta", lambda group, tokens: group)
    data = make_data(rng, [0, 5], num_heads=4, num_kv_heads=2, head_dim=32, block_size=block_size)
    data.q[1, 2, 5] = np.nan
    expected = bf16_rounded(run_kernel(data, num_splits))
    got = run_kernel(data, num_splits, out=np.full(data.q.shape, 0x1234, np.uint16))
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, expected)
    assert np.all(got[0] == 0)  # the length-0 sequence: +0.0 in BF16
    nan = bf16_nan(got)
    assert np.all(nan[1, 2]) and np.sum(nan) == got.shape[2]  # the NaN query's row, and nothing else


# ---------------------------------------------------------------------------- bad calls


def bad_calls(data):
    """(case, keyword changes, message) of calls that must fail before launching."""
    q, k, v, s = data.q, data.k_cache, data.v_cache, data.k_scale
    return [
        ("scales wrong shape", dict(k_scale=s[:, :, :2]), "k_scale: expected float32 scales of shape"),
        ("scales wrong dtype", dict(v_scale=s.astype(np.float64)), "v_scale: expected float32 scales"),
        ("float cache with scales", dict(k_cache=np.zeros(k.shape, np.float32), v_cache=np.zeros(k.shape, np.float32)),
         "a float cache \\(float32\\) takes k_scale=None"),
        ("float16 cache", dict(k_cache=k.astype(np.float16), v_cache=v.astype(np.float16), k_scale=None, v_scale=None),
         "k_cache: expected"),
        ("v_cache differs", dict(v_cache=v[:1]), "v_cache: expected the shape"),
        ("heads do not divide", dict(q=np.zeros((2, 3, 32), np.float32), out=np.zeros((2, 3, 32), np.float32),
                                     k_cache=np.zeros((k.shape[0], 2) + k.shape[2:], np.uint8),
                                     v_cache=np.zeros((k.shape[0], 2) + k.shape[2:], np.uint8),
                                     k_scale=np.zeros((k.shape[0], 2, k.shape[2]), np.float32),
                                     v_scale=np.zeros((k.shape[0], 2, k.shape[2]), np.float32)), "GQA"),
        ("head_dim 48", dict(q=np.zeros((2, 2, 48), np.float32), out=np.zeros((2, 2, 48), np.float32),
                             k_cache=np.zeros(k.shape[:3] + (48,), np.uint8), v_cache=np.zeros(k.shape[:3] + (48,), np.uint8)),
         "head_dim must be one of"),
        ("head_dim mismatch", dict(q=np.zeros((2, 2, 64), np.float32)), "head_dim 32 does not match"),
        ("q float64", dict(q=q.astype(np.float64)), "q: expected float32"),
        ("out wrong shape", dict(out=np.zeros((2, 2, 16), np.float32)), "out: expected float32 or uint16 \\(BF16 bits\\) \\[2, 2, 32\\]"),
        ("out wrong dtype", dict(out=np.zeros(q.shape, np.float64)), "out: expected float32"),
        ("out BF16 as int16", dict(out=np.zeros(q.shape, np.int16)),
         "out: expected float32 or uint16 \\(BF16 bits\\) \\[2, 2, 32\\], got shape \\(2, 2, 32\\) dtype int16"),
        ("BF16 out over q", dict(out=q.reshape(-1).view(np.uint16)[: q.size].reshape(q.shape)),
         "out: expected memory apart from q's"),
        ("table too short", dict(block_tables=data.block_tables[:, :1]), "block_tables: sequence 0 has 9 tokens"),
        ("block id out of range", dict(block_tables=data.block_tables + 100), "block_tables: block ids must lie in"),
        ("negative length", dict(seq_lens=np.array([-1, 2], np.int32)), "seq_lens: expected lengths >= 0"),
        ("seq_lens shape", dict(seq_lens=np.array([1], np.int32)), "seq_lens: expected an integer array \\[2\\]"),
        ("float seq_lens", dict(seq_lens=np.array([1.0, 2.0])), "seq_lens: expected an integer array"),
        ("alibi shape", dict(alibi_slopes=np.ones(3, np.float32)), "alibi_slopes: expected float32 \\[2\\]"),
        ("num_splits 0", dict(num_splits=0), "num_splits: expected an int from 1 to 256 or 'auto'"),
        ("num_splits word", dict(num_splits="many"), "num_splits"),
        ("workspace small", dict(num_splits=3, workspace=np.zeros((2, 2, 2, 34), np.float32)), "workspace: expected"),
        ("max_seq_len short", dict(max_seq_len=3), "max_seq_len: 3 is shorter than the longest sequence"),
    ]


@pytest.mark.cudasim
def test_bad_calls_raise_before_launching(rng):
    data = make_data(rng, [9, 2], num_heads=2)
    base = dict(q=data.q, k_cache=data.k_cache, v_cache=data.v_cache, block_tables=data.block_tables,
                seq_lens=data.seq_lens, softmax_scale=data.softmax_scale, k_scale=data.k_scale, v_scale=data.v_scale)
    for case, change, message in bad_calls(data):
        args = dict(base, out=np.full(data.q.shape, np.nan, np.float32))
        args.update(change)
        with pytest.raises(ValueError, match=message):
            kernels.paged_decode(**args)
        if "out" not in change:
            assert np.all(np.isnan(args["out"])), case  # nothing was launched


# ---------------------------------------------------------------------------- on a GPU


def fresh_rng():
    seed = int.from_bytes(os.urandom(8), "little")
    return seed, np.random.default_rng(seed)


def relative_error(got, expected) -> float:
    """``||got - expected|| / ||expected||``; infinite when ``got`` holds a NaN or infinity."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


RELATIVE_ERROR_BOUND = 1e-5
"""For float32 accumulation over up to 16k tokens with a 2-ulp exp2: the elementwise bound of
tests/simulators/test_splitkv.py, summed over a row, stays below this for the data below; a wrong token, a wrong
scale or a missing shard is off by far more (order 1e-2 and up)."""


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("lens", [[16384], [1000], [16384, 1, 0, 4097, 9000, 15, 2048, 12000]], ids=["16k", "1k", "batch8"])
def test_gpu_qwen3_8b_heads_against_the_reference(cache, lens):
    """32 query heads on 8 kv heads of 128, blocks of 16; each split setting on the same fresh data, out poisoned
    before every launch; ALiBi in the batch of 8 (which also holds lengths 0 and 1)."""
    seed, rng = fresh_rng()
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    caches, tables = filled_cache(rng, lens, block_size, num_kv_heads, head_dim, cache)
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((len(lens), num_heads, head_dim)).astype(np.float32)
    slopes = random_slopes(rng, num_heads) if len(lens) > 1 else None
    seq_lens = np.asarray(lens, np.int32)
    reference_view = fst.PagedKVData(q, as_float32(k), as_float32(v), k_scale, v_scale, tables, seq_lens, head_dim**-0.5)
    expected = attention.paged_decode(*reference_view.decode_args(), alibi_slopes=slopes)
    device = [cuda.to_device(x) for x in (q, k, v, tables, seq_lens)]
    scales = [None if s is None else cuda.to_device(s) for s in (k_scale, v_scale)]
    auto = sk.choose_num_splits(len(lens), num_heads, num_kv_heads, max(lens), kernels.device_num_sms(), block_size)
    for num_splits in ("auto", 1, 4, 8, 32):
        out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
        kernels.paged_decode(*device, head_dim**-0.5, out, *scales, alibi_slopes=slopes, num_splits=num_splits)
        got = out.copy_to_host()
        error = relative_error(got, expected)
        assert error <= RELATIVE_ERROR_BOUND, (seed, num_splits, error)
        splits = auto if num_splits == "auto" else num_splits
        elementwise = np.max(np.abs(got.astype(np.float64) - expected), axis=-1)
        assert np.all(elementwise <= tolerance(reference_view, slopes, splits)), (seed, num_splits)
        assert np.all(got[seq_lens == 0] == 0), (seed, num_splits)


@pytest.mark.gpu
def test_gpu_write_then_decode_and_reuse_with_length_zero():
    """The kernels end to end: paged_cache_write fills an FP8 cache on the GPU, paged_decode reads it; then the
    same out with one sequence emptied comes back zero there (the stale-row regression at real size)."""
    seed, rng = fresh_rng()
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    lens = np.array([3000, 777, 1], np.int32)
    blocks = -(-lens // block_size)
    tables = np.full((3, int(blocks.max())), -1, np.int32)
    pool = rng.permutation(int(blocks.sum()))
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = pool[start : start + n]
        start += n
    shape = (int(blocks.sum()), num_kv_heads, block_size, head_dim)
    k_cache, v_cache = (cuda.to_device(np.full(shape, 0x7F, np.uint8)) for _ in range(2))
    k_scale, v_scale = (cuda.to_device(np.full(shape[:3], np.nan, np.float32)) for _ in range(2))
    slots = np.concatenate([kv_cache.slots_for_positions(tables[i], np.arange(n), block_size) for i, n in enumerate(lens)])
    k = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((len(slots), num_kv_heads, head_dim)).astype(np.float32)
    paged_cache_write(cuda.to_device(k), cuda.to_device(v), k_cache, v_cache, cuda.to_device(slots), k_scale, v_scale)
    codes = [c.copy_to_host() for c in (k_cache, v_cache)]
    scales = [s.copy_to_host() for s in (k_scale, v_scale)]
    q = rng.standard_normal((3, num_heads, head_dim)).astype(np.float32)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
    workspace = kernels.decode_workspace(3, num_heads, head_dim)
    for lengths in (lens, np.array([0, 777, 1], np.int32)):
        expected = attention.paged_decode(q, codes[0], codes[1], tables, lengths, head_dim**-0.5, scales[0], scales[1])
        kernels.paged_decode(cuda.to_device(q), k_cache, v_cache, cuda.to_device(tables), cuda.to_device(lengths),
                             head_dim**-0.5, out, k_scale, v_scale, num_splits=8, workspace=workspace,
                             max_seq_len=int(lens.max()))
        got = out.copy_to_host()
        assert relative_error(got, expected) <= RELATIVE_ERROR_BOUND, seed
        assert np.all(got[lengths == 0] == 0), seed


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[300, 257], [1500, 800], [6000, 4500]], ids=["1 head per CTA", "2", "4"])
def test_gpu_bf16_out_is_the_float32_out_rounded(lens):
    """Qwen3-8B heads (32 query, 8 kv of 128), FP8 cache in blocks of 16, batch 2, fresh random data: uint16 ``out``
    bit for bit ``layers.bf16_round`` of the float32 ``out``, all on the GPU, for 1 split (the split kernel's store)
    and 4 and "auto" (the combine's); the contexts make ``heads_per_cta`` choose 1, 2 and 4 heads per CTA. Both
    outs poisoned before every launch (NaN, 0x1234)."""
    seed, rng = fresh_rng()
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    caches, tables = filled_cache(rng, lens, block_size, num_kv_heads, head_dim, "fp8")
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((len(lens), num_heads, head_dim)).astype(np.float32)
    device = [cuda.to_device(x) for x in (q, k, v, tables, np.asarray(lens, np.int32))]
    scales = [cuda.to_device(s) for s in (k_scale, v_scale)]
    for num_splits in (1, 4, "auto"):
        out = cuda.to_device(np.full(q.shape, np.nan, np.float32))
        kernels.paged_decode(*device, head_dim**-0.5, out, *scales, num_splits=num_splits)
        bits = cuda.to_device(np.full(q.shape, 0x1234, np.uint16))
        kernels.paged_decode(*device, head_dim**-0.5, bits, *scales, num_splits=num_splits)
        got = bits.copy_to_host()
        np.testing.assert_array_equal(got, bf16_rounded(out), err_msg=f"seed {seed}, num_splits {num_splits}")
        assert not np.any(bf16_nan(got)), (seed, num_splits)
