"""fp8lab.numba_kernels.prefill_wgmma (flash prefill with ``wgmma``, K/V decoded once a CTA) against
fp8lab.simulators.prefill_mma (``shared_values``: the CTA's 4 or 8 warps) and fp8lab.reference.attention.

In the CUDA simulator (the ``wgmma`` twin pools a warp's registers into the mma model per k16 step, reading shared
memory at the wait): outputs bit for bit the simulator for GQA groups of 1, 2, 4 and 16, block sizes 16 and 32, pure
and chunked prefill (a cached prefix: unmasked tiles), query counts that end inside a warp and inside a CTA, a
sequence without new tokens, CTAs of one and of two warpgroups, a walk over more than 32 key tiles, NaN-poisoned
unused cache slots and ``out``; BF16 output bit for bit ``layers.bf16_round`` of the float32 output; a NaN value
code inside the CTA reaches the CTA's earlier queries (the documented ``shared_values`` reach) while a NaN V scale
stays out of the earlier warps; the simulator with ``shared_values`` differs from the warp kernel's only there; a
BF16 cache is refused.

On a GPU (``gpu``): Qwen3-8B heads (32 query, 8 kv) over a 1,000-token prompt (one and two warpgroups) and 4 x 512
tokens, Qwen3-0.6B heads (16, 8) over 2,048 tokens after a 100-token prefix, on fresh random data, ``out`` poisoned:
every query within ``fp8lab.simulators.splitkv_mma.error_bound`` of the reference over its causal prefix; BF16
output bit for bit the float32 output rounded.
"""

import os

import numpy as np
import pytest
from helpers.attention import assert_within_prefill_mma_bound as assert_within_bound
from helpers.attention import prefill_batch

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import layers, prefill_wgmma
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.simulators import prefill_mma as model


def run_kernel(data, q, query_lens, out=None, warpgroups=1):
    if out is None:
        out = np.full(q.shape, np.nan, np.float32)  # poisoned: every element must be written
    returned = prefill_wgmma.paged_prefill_wgmma(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                                 query_lens, data.softmax_scale, out, data.k_scale, data.v_scale,
                                                 warpgroups=warpgroups)
    assert returned is out
    return out


def simulated(data, q, query_lens, shared_values=4):
    return model.paged_prefill(q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, query_lens,
                               data.softmax_scale, data.k_scale, data.v_scale, shared_values=shared_values)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("context_lens, query_lens, group, num_kv_heads, block_size, warpgroups", [
    ([21], [21], 4, 2, 16, 1),  # pure prefill: CTAs of 16 tokens, the second with 5 (one warp, one query); 2 kv
    ([50, 9, 21], [19, 0, 21], 2, 1, 32, 1),  # chunked prefill after 31 cached tokens; a sequence without new tokens
    ([23], [23], 1, 1, 16, 1),  # 16 tokens per warp
    ([19, 6], [3, 2], 16, 1, 16, 1),  # one token per warp, rows g + 8 are heads 8..15
    ([90], [20], 4, 1, 16, 1),  # after a 70-token prefix: the first tile unmasked for every warp, then the diagonal's
    ([45], [45], 4, 1, 16, 2),  # two warpgroups: CTAs of 32 tokens, the second with 13 (its second warpgroup idle)
    ([120, 9], [50, 0], 2, 1, 32, 2),  # two warpgroups after a 70-token prefix; a sequence without new tokens
])
def test_bit_for_bit_the_simulator(context_lens, query_lens, group, num_kv_heads, block_size, warpgroups):
    rng = np.random.default_rng(sum(context_lens) * group + block_size)
    data, q, query_lens = prefill_batch(rng, context_lens, query_lens, group, num_kv_heads, block_size)
    out = run_kernel(data, q, query_lens, warpgroups=warpgroups)
    assert not np.isnan(out).any(), "an output was not written (still NaN)"
    assert same_bits(out, simulated(data, q, query_lens, 4 * warpgroups))


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
def test_a_walk_past_32_tiles_and_bf16_out():
    """Two queries at positions 527 and 528 after a cached prefix: 9 tiles of 64 keys, 8 of them unmasked, over 34
    KV blocks; group 8. Then BF16 out: the float32 out rounded by ``layers.bf16_round``."""
    rng = np.random.default_rng(4)
    data, q, query_lens = prefill_batch(rng, [529], [2], 8, 1, 16)
    f32 = run_kernel(data, q, query_lens)
    assert same_bits(f32, simulated(data, q, query_lens))
    bf16 = run_kernel(data, q, query_lens, out=np.full(q.shape, 0xFFFF, np.uint16))
    expected = np.empty(f32.size, np.uint16)
    layers.bf16_round(f32.reshape(-1), expected)
    assert np.array_equal(bf16.reshape(-1), expected)


@pytest.mark.skipif(not SIMULATOR, reason="bit for bit the simulator only in the CUDA simulator")
@pytest.mark.parametrize("poisoned", ["code", "scale"])
def test_a_nan_value_reaches_the_cta_a_nan_scale_only_its_warps(poisoned):
    """A NaN V code (or V scale) of key 10, in the CTA of queries 0-15 (group 4: warps of 4 queries). The code: one
    ``wgmma`` multiplies the CTA's values for all four warps, so queries 0-9 get it with weight 0, and every query
    from 10 on attends it: all 30 outputs NaN (``shared_values``; the warp kernel keeps queries 0-7 finite). The
    scale: per warp, as in the warp kernel, queries 0-7 stay finite. Bit for bit the simulator either way, and the
    simulator without ``shared_values`` differs exactly on the code case."""
    rng = np.random.default_rng(12)
    data, q, query_lens = prefill_batch(rng, [30], [30], 4, 1, 16)
    if poisoned == "code":
        data.v_cache[data.block_tables[0, 0], 0, 10, 7] = 0x7F
    else:
        data.v_scale[data.block_tables[0, 0], 0, 10] = np.nan
    out = run_kernel(data, q, query_lens)
    finite_before = 0 if poisoned == "code" else 8
    assert np.isnan(out).any(axis=(1, 2)).tolist() == [i >= finite_before for i in range(30)]
    assert same_bits(out, simulated(data, q, query_lens))
    assert same_bits(out, simulated(data, q, query_lens, shared_values=0)) == (poisoned == "scale")


@pytest.mark.skipif(not SIMULATOR, reason="the CUDA simulator's argument checks")
def test_a_bf16_cache_and_three_warpgroups_are_refused():
    rng = np.random.default_rng(1)
    data, q, query_lens = prefill_batch(rng, [9], [9], 2, 1, 16, "bf16")
    with pytest.raises(ValueError, match="paged_prefill_wgmma takes an FP8 cache"):
        run_kernel(data, q, query_lens)
    data, q, query_lens = prefill_batch(rng, [9], [9], 2, 1, 16)
    with pytest.raises(ValueError, match="warpgroups: expected 1 or 2, got 3"):
        run_kernel(data, q, query_lens, warpgroups=3)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("heads, context_lens, query_lens, warpgroups", [
    ((32, 8), [1000], [1000], 1), ((32, 8), [512] * 4, [512] * 4, 1), ((16, 8), [2148], [2048], 1),
    ((32, 8), [1000], [1000], 2),
])
def test_on_the_gpu_within_the_bound_of_the_reference(heads, context_lens, query_lens, warpgroups):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    group = heads[0] // heads[1]
    data, q, query_lens = prefill_batch(rng, context_lens, query_lens, group, heads[1], 16)
    f32 = run_kernel(data, q, query_lens, warpgroups=warpgroups)
    assert_within_bound(data, q, query_lens, f32)
    bf16 = run_kernel(data, q, query_lens, out=np.full(q.shape, 0xFFFF, np.uint16), warpgroups=warpgroups)
    rounded = ((f32.view(np.uint32) + 0x7FFF + ((f32.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(bf16, rounded)
