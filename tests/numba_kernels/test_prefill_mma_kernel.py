"""fp8lab.numba_kernels.prefill_mma (tensor-core flash prefill attention) against fp8lab.simulators.prefill_mma and
fp8lab.reference.attention.

In the CUDA simulator (``cudasim``; a simulated warp's ``mma`` pools the 32 lanes' registers into the model of
``fp8lab.simulators.mma``): outputs bit for bit equal to ``fp8lab.simulators.prefill_mma`` for GQA groups of 1, 2, 4
and 16 (16, 8, 4 and 1 query tokens per warp), block sizes 16 and 32, pure prefill and chunked prefill (a cached
prefix before the new tokens), query counts that end inside a warp, a sequence without new tokens, a walk over more
than 32 key tiles (the block table's second chunk), NaN-poisoned unused cache slots and a NaN-poisoned ``out``; device
index arrays with ``max_context_len`` (nothing read back: the grid covers ``len(q)`` tokens per sequence); BF16 output
bit for bit ``layers.bf16_round`` of the float32 output; padding rows past the queries left unwritten; caches the kernel
does not take, and a ``q`` or ``out`` not in C order (the kernel reads and writes them 16 bytes at a time), are a
``ValueError``; a NaN that a CTA loads for a later warp stays out of the earlier warps; a weight below ``2^-126``
flushed to 0 as the simulator does. Over a
BF16 cache: group 16, group 2 over 90 and 70 queries, and group 8 over the 34-block walk. The cases with more than 64
keys before a warp's first query run the unmasked tile (``prefill_mma.tile_functions(masked=False)``).

On a GPU (``gpu``, run by hand on an H200): Qwen3-8B heads (32 query, 8 kv) over a 1,000-token prompt and 4 x 512
tokens, Qwen3-0.6B heads (16, 8) over 2,048 tokens after a 100-token prefix, against ``fp8lab.reference.attention``
on fresh random data, ``out`` poisoned: every query within ``fp8lab.simulators.splitkv_mma.error_bound`` over its
causal prefix (in BF16 operands over a BF16 cache: the 8B prompt once more); BF16 output bit for bit the float32 output
rounded.
"""

import os

import numpy as np
import pytest
from helpers.attention import assert_within_prefill_mma_bound as assert_within_bound
from helpers.attention import paged_fp8, prefill_batch
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import layers, prefill_mma
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.simulators import prefill_mma as model


def run_kernel(data, q, query_lens, out=None, **kwargs):
    if out is None:
        out = np.full(q.shape, np.nan, np.float32)  # poisoned: every element must be written
    returned = prefill_mma.paged_prefill_mma(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                             query_lens, data.softmax_scale, out, data.k_scale, data.v_scale, **kwargs)
    assert returned is out
    return out


def simulated(data, q, query_lens):
    return model.paged_prefill(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, query_lens,
                               data.softmax_scale, data.k_scale, data.v_scale)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("context_lens, query_lens, group, num_kv_heads, block_size, cache", [
    ([21], [21], 4, 2, 16, "fp8"),  # pure prefill, 6 warps of 4 tokens, the last one with one query; 2 kv heads
    ([50, 9, 21], [19, 0, 21], 2, 1, 32, "fp8"),  # chunked prefill after 31 cached tokens; a sequence without new tokens
    ([23], [23], 1, 1, 16, "fp8"),  # 16 tokens per warp
    ([19, 6], [3, 2], 16, 1, 16, "fp8"),  # one token per warp, rows g + 8 are heads 8..15
    ([19, 6], [3, 2], 16, 1, 16, "bf16"),  # the BF16 cache (its chunked prefill: the engine's test)
    ([90], [20], 4, 1, 16, "fp8"),  # after a 70-token prefix: every warp's tile 0 unmasked, then the diagonal's
    ([84, 75], [12, 3], 2, 1, 32, "bf16"),  # the same over a BF16 cache, two sequences
])
def test_bit_for_bit_the_simulator(context_lens, query_lens, group, num_kv_heads, block_size, cache):
    rng = np.random.default_rng(sum(context_lens) * group + block_size)
    data, q, query_lens = prefill_batch(rng, context_lens, query_lens, group, num_kv_heads, block_size, cache)
    out = run_kernel(data, q, query_lens)
    assert not np.isnan(out).any(), "an output was not written (still NaN)"
    assert same_bits(out, simulated(data, q, query_lens))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_a_walk_past_32_tiles_bit_for_bit_the_simulator(cache):
    """Two queries at positions 527 and 528 after a cached prefix: 9 tiles of 64 keys, 8 of them unmasked, over 34
    KV blocks; group 8 (2 tokens per warp)."""
    rng = np.random.default_rng(4)
    data, q, query_lens = prefill_batch(rng, [529], [2], 8, 1, 16, cache)
    out = run_kernel(data, q, query_lens)
    assert same_bits(out, simulated(data, q, query_lens))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("poisoned", ["code", "scale"])
def test_a_nan_the_cta_loads_for_a_later_warp_stays_out_of_the_earlier_warps(poisoned):
    """A NaN V code (or V scale) of key 10, in the CTA of queries 0-15 (group 4: warps of 4 queries): the CTA loads it
    into shared memory for the warp of queries 8-11, but warps 0-3 and 4-7 end before it and must read it as a zero
    code with scale 0 (zeroed in their registers): their queries stay finite. Queries 8 and 9, before key 10 in its
    warp, see it (the documented weight-0 case), and so does every query from 10 on; bit for bit the simulator."""
    rng = np.random.default_rng(12)
    data, q, query_lens = prefill_batch(rng, [30], [30], 4, 1, 16)
    if poisoned == "code":
        data.v_cache[data.block_tables[0, 0], 0, 10, 7] = 0x7F
    else:
        data.v_scale[data.block_tables[0, 0], 0, 10] = np.nan
    out = run_kernel(data, q, query_lens)
    assert np.isnan(out).any(axis=(1, 2)).tolist() == [i >= 8 for i in range(30)]
    assert same_bits(out, simulated(data, q, query_lens))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
def test_device_indices_without_a_read_back_and_bf16_out():
    """Device index arrays with ``max_context_len``: the grid covers ``len(q)`` tokens per sequence (most CTAs
    return at once), bit for bit the simulator; then (host indices) BF16 out is that float32 out rounded by
    ``layers.bf16_round``."""
    rng = np.random.default_rng(8)
    data, q, query_lens = prefill_batch(rng, [20, 9], [5, 9], 4, 1, 16)
    on_device = [cuda.to_device(np.asarray(x, np.int32)) for x in (data.block_tables, data.seq_lens, query_lens)]
    f32 = np.full(q.shape, np.nan, np.float32)
    prefill_mma.paged_prefill_mma(q, data.k_cache, data.v_cache, on_device[0], on_device[1], on_device[2],
                                  data.softmax_scale, f32, data.k_scale, data.v_scale, max_context_len=20)
    assert same_bits(f32, simulated(data, q, query_lens))
    bf16 = run_kernel(data, q, query_lens, out=np.full(q.shape, 0xFFFF, np.uint16))
    expected = np.empty(f32.size, np.uint16)
    layers.bf16_round(f32.reshape(-1), expected)
    assert np.array_equal(bf16.reshape(-1), expected)


def a_weight_below_the_smallest_normal():
    """Over a BF16 cache (whose weights keep float32's range), group 16, 2 queries: key 0 scores about 130 (log2
    units) above key 1, with value 0 where key 1's value is 1, so query 1's output is key 1's weight, ``2^-130``,
    unless ``exp2`` flushes it (``mathops.exp2_flush``, the simulator's order). Returns ``(data, q, query_lens)``."""
    rng = np.random.default_rng(13)
    data, q, query_lens = prefill_batch(rng, [2], [2], 16, 1, 16, "bf16")
    block = data.block_tables[0, 0]
    data.k_cache[block, 0, 0] = 0x4100  # 8.0 at every head element
    data.k_cache[block, 0, 1] = 0
    data.v_cache[block, 0, 0] = 0
    data.v_cache[block, 0, 1] = 0x3F80  # 1.0
    q[:] = 1  # score of key 0: 128 * 8 / sqrt(128) * log2(e) = 130.6 above key 1's
    return data, q, query_lens


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
def test_a_weight_below_the_smallest_normal_is_flushed_to_zero():
    """``a_weight_below_the_smallest_normal``: both queries' outputs exactly 0, bit for bit the simulator."""
    data, q, query_lens = a_weight_below_the_smallest_normal()
    out = run_kernel(data, q, query_lens)
    assert same_bits(out, simulated(data, q, query_lens))
    assert not out.any()


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
def test_padding_rows_past_the_queries_are_left_as_they_were():
    """``q`` with 5 rows past ``sum(query_lens)`` (the engine's padded prefill): those rows of a NaN-poisoned ``out``
    stay NaN, the simulator gives them 0, and the real rows are bit for bit the unpadded call's."""
    rng = np.random.default_rng(9)
    data, q, query_lens = prefill_batch(rng, [20, 9], [5, 9], 4, 1, 16)
    padded = np.concatenate([q, rng.standard_normal((5, *q.shape[1:])).astype(np.float32)])
    out = run_kernel(data, padded, query_lens)
    assert np.isnan(out[14:]).all() and not np.isnan(out[:14]).any()
    assert same_bits(out[:14], run_kernel(data, q, query_lens))
    simulated_padded = simulated(data, padded, query_lens)
    assert same_bits(simulated_padded[:14], simulated(data, q, query_lens)) and not simulated_padded[14:].any()


@pytest.mark.skipif(not SIMULATOR, reason="the CUDA simulator's argument checks")
@pytest.mark.parametrize("change, message", [
    (dict(block_size=8), "block size"), (dict(group=3), "divides"), (dict(head_dim=64), "head_dim"),
])
def test_unsupported_caches_are_refused(change, message):
    shape = dict(block_size=16, head_dim=128, group=2) | change
    rng = np.random.default_rng(0)
    data = paged_fp8(rng, [5], shape["group"], 1, shape["head_dim"], shape["block_size"])
    q = rng.standard_normal((5, shape["group"], shape["head_dim"])).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        run_kernel(data, q, np.array([5]))


@pytest.mark.skipif(not SIMULATOR, reason="the CUDA simulator's argument checks")
def test_a_float_cache_and_wrong_lengths_are_refused_a_nan_scale_propagates(monkeypatch):
    rng = np.random.default_rng(1)
    data, q, query_lens = prefill_batch(rng, [9], [9], 2, 1, 16)
    floats = np.zeros(data.k_cache.shape, np.float32)
    with pytest.raises(ValueError, match="an FP8 or a BF16 cache"):
        prefill_mma.paged_prefill_mma(q, floats, floats, data.block_tables, data.seq_lens, query_lens,
                                      data.softmax_scale, np.zeros_like(q))
    with pytest.raises(ValueError, match="query_lens: sum.* is more than q's 8 query tokens"):
        run_kernel(data, q[:8], np.array([9]))
    strided = np.zeros((9, 2, 256), np.float32)[:, :, ::2]  # read and written 16 bytes at a time: C order only
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous \(row-major\) array"):
        run_kernel(data, q, query_lens, out=strided)
    with pytest.raises(ValueError, match=r"q: expected a C-contiguous \(row-major\) array"):
        run_kernel(data, np.ascontiguousarray(np.concatenate([q, q], axis=2))[:, :, ::2], query_lens)
    many = prefill_mma.MAX_GRID_Z + 1  # sequences, each without new tokens: refused before the launch
    with pytest.raises(ValueError, match="block_tables: at most 65535 sequences"):
        prefill_mma.paged_prefill_mma(q[:0], data.k_cache, data.v_cache, np.zeros((many, 1), np.int32),
                                      np.zeros(many, np.int32), np.zeros(many, np.int32), data.softmax_scale,
                                      np.zeros_like(q[:0]), data.k_scale, data.v_scale)
    monkeypatch.setattr(prefill_mma, "MAX_CACHE_WORDS", data.k_cache.nbytes // 4)  # a 16 GiB cache, scaled down
    with pytest.raises(ValueError, match="k_cache: .* bytes, more than the kernel's 32-bit word indices reach"):
        run_kernel(data, q, np.array([9]))
    monkeypatch.undo()
    nan_scale = prefill_mma.paged_prefill_mma(q[:1], data.k_cache, data.v_cache, data.block_tables, np.array([1]),
                                              np.array([1]), float("nan"), np.zeros_like(q[:1]), data.k_scale,
                                              data.v_scale)
    assert np.isnan(nan_scale).all()  # a NaN softmax_scale reaches every row it scales, as in the reference


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("heads, context_lens, query_lens, cache", [
    ((32, 8), [1000], [1000], "fp8"), ((32, 8), [512] * 4, [512] * 4, "fp8"), ((16, 8), [2148], [2048], "fp8"),
    ((32, 8), [1000], [1000], "bf16"),
])
def test_on_the_gpu_within_the_bound_of_the_reference(heads, context_lens, query_lens, cache):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    group = heads[0] // heads[1]
    data, q, query_lens = prefill_batch(rng, context_lens, query_lens, group, heads[1], 16, cache)
    f32 = run_kernel(data, q, query_lens)
    assert_within_bound(data, q, query_lens, f32)
    bf16 = run_kernel(data, q, query_lens, out=np.full(q.shape, 0xFFFF, np.uint16))
    rounded = ((f32.view(np.uint32) + 0x7FFF + ((f32.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(bf16, rounded)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
def test_on_the_gpu_a_weight_below_the_smallest_normal_is_flushed_to_zero():
    """``a_weight_below_the_smallest_normal`` on the GPU (``ex2.approx.ftz.f32``): both outputs exactly +0, as the
    simulator's."""
    data, q, query_lens = a_weight_below_the_smallest_normal()
    out = run_kernel(data, q, query_lens)
    assert same_bits(out, simulated(data, q, query_lens)) and not out.any()
