"""Workspace reuse across calls with different parameters, long K / token loops and partial last tiles
(issue 18), in the CUDA simulator (``cudasim``, tiny shapes).

Reuse (each workspace NaN-poisoned once, before the first call, then shared):

- split-kv decode: a call with 6 splits, then 2, then 1 on the same workspace and ``out``: each bit for
  bit ``fp8lab.simulators.splitkv`` (outputs and, with splits, the shards' partials) and the later calls
  bit for bit the kernel on a fresh NaN workspace. The earlier call's partials of shards 2 to 5 are
  valid numbers: a combine that read them would count the tokens twice.
- the multi-CTA argmax: a call of 3 rows x 5 CTAs whose winners (50.0) sit in every partial, then one
  of 2 rows x 2 CTAs of smaller logits, then one row of 5 CTAs: each equals ``reference.dense.argmax_rows``,
  ``np.argmax`` and the simulator, the counters back at 0 after each.
- paged prefill (its decode ``workspace`` and its ``rows`` workspace): a query token after a long prefix
  (``"auto"``: 6 splits), then after a short one (2 splits): bit for bit the simulator on the
  hand-expanded rows and the kernel with fresh workspaces, within the split-kv bound of the reference.
- the GPU model's decode buckets (``CudaQwen3Model``, GEMMs by their bit-exact twins): decode steps of
  4 sequences (bucket 4), then 3 (bucket 4, the old fourth row now padding), then 1 (bucket 1), each
  against ``Qwen3Model`` (reference backend) run through the same steps: the same greedy tokens, logits
  within the micro model's FP8-KV bound of ``tests/engine/test_cuda_model.py``.

Long loops and partial tiles (bit for bit the kernel's simulator, within the reference's bound):

- ``gemm_mma`` (the ``fp8_gemm`` tensor-core path): 4 K chunks through 2 stages (the ring wraps twice),
  M = 17 (a full m16 tile and a 1-row one), N = 13 (a full n8 tile and a 5-column one), K blocks of 384
  (the last one 128 wide) and N blocks of 8 (the last 5 tall).
- split-kv decode: FP8, head_dim 256 (8 slots, 4 tokens in flight: 32 tokens per group), 90 tokens in
  blocks of 8 over 2 shards: each shard one full group then a guarded partial one, the last block
  holding 2 tokens.
- paged prefill: a query token after 109 cached, head_dim 256, blocks of 64 ("auto": 2 splits): shard 0
  two full groups (and the page-crossing path: blocks longer than the 8 slots), shard 1 a full group
  and a guarded partial one ending in a block of 46 tokens.

Already covered elsewhere, so not repeated here: ``gemv_simt`` with more chunks than groups and a row end
inside a warp step (``tests/numba_kernels/test_gemv_kernel.py::test_simulated_kernel_long_rows_and_many_rows``,
K = 2688 in 6 steps, the last with 8 busy lanes, G = 2 walking 3 groups; and ``KNOB_MATRIX`` for M and N
tails); ``gemm_mma`` with ``stages + 1`` chunks and M/N tails
(``test_gemm_mma_kernel.py::test_bit_for_bit_the_simulator_for_every_tiling``); argmax with fewer rows
after more at the same vocab (``test_layer_kernels.py::test_argmax_rows_reuses_one_workspace``).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.attention import (
    as_float32,
    filled_cache,
    prefill_rows,
    reference_prefill,
    tolerance,
)
from helpers.cuda_twins import micro_config, micro_tensors
from helpers.engine import rel_err

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.engine.cuda.model import CudaQwen3Model
from fp8lab.engine.kv_manager import KVCacheManager
from fp8lab.engine.model import Qwen3Model, make_batch
from fp8lab.numba_kernels import gemm_mma as mma_kernel
from fp8lab.numba_kernels import layers
from fp8lab.numba_kernels import prefill as prefill_kernels
from fp8lab.numba_kernels import splitkv as kernels
from fp8lab.reference import attention, blockwise, dense
from fp8lab.reference import strategies as fst
from fp8lab.simulators import bit_placement as bp
from fp8lab.simulators import dense as sim_dense
from fp8lab.simulators import gemm_mma as sim_mma
from fp8lab.simulators import splitkv as sk

pytestmark = pytest.mark.cudasim

U32 = 2.0**-24


# ---------------------------------------------------------------------------- data and checks


def decode_data(rng, lens, num_heads, head_dim, block_size, num_kv_heads=1) -> fst.PagedKVData:
    """An FP8 decode batch over a cache written by the reference (shuffled blocks, unused slots NaN)."""
    caches, tables = filled_cache(rng, lens, block_size, num_kv_heads, head_dim, "fp8")
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((len(lens), num_heads, head_dim)).astype(np.float32)
    return fst.PagedKVData(q, k, v, k_scale, v_scale, tables, np.asarray(lens, np.int32), float(head_dim) ** -0.5)


def poisoned_workspace(num_seqs, num_heads, head_dim, max_splits):
    workspace = kernels.decode_workspace(num_seqs, num_heads, head_dim, max_splits)
    workspace[...] = np.nan
    return workspace


def run_decode(data, num_splits, workspace, out=None):
    out = np.full(data.q.shape, np.nan, np.float32) if out is None else out
    out[...] = np.nan  # poisoned before every launch
    kernels.paged_decode(*data.decode_args()[:6], out, data.k_scale, data.v_scale, num_splits=num_splits,
                         workspace=workspace)
    return out


def assert_decode_is_the_simulators(data, num_splits, got, workspace):
    """``got`` and (with splits) the workspace's first ``num_splits`` partials equal the simulator's bit for bit."""
    want = sk.paged_decode(*data.decode_args(), num_splits=num_splits)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if num_splits > 1:
        d = data.q.shape[2]
        partials = sk.shard_partials(*data.decode_args(), num_splits=num_splits)
        np.testing.assert_array_equal(workspace[:, :, :num_splits, :d], partials.acc)
        np.testing.assert_array_equal(workspace[:, :, :num_splits, d], partials.m)
        np.testing.assert_array_equal(workspace[:, :, :num_splits, d + 1], partials.l)


def max_error(got, want) -> np.ndarray:
    return np.max(np.abs(got.astype(np.float64) - want), axis=-1)


# ---------------------------------------------------------------------------- workspace reuse


def test_splitkv_fewer_splits_after_more_on_one_workspace(rng):
    """6 splits, then 2, then 1 (no combine, ``out`` written directly) on one workspace and one ``out``."""
    data = decode_data(rng, [21], num_heads=2, head_dim=32, block_size=4)  # 6 blocks, the last of 1 token
    workspace = poisoned_workspace(1, 2, 32, 6)
    out = np.empty(data.q.shape, np.float32)
    first = run_decode(data, 6, workspace, out).copy()
    assert_decode_is_the_simulators(data, 6, first, workspace)
    assert np.all(np.isfinite(workspace))  # every shard of 6 wrote its partial: valid numbers, now stale
    for num_splits in (2, 1):
        got = run_decode(data, num_splits, workspace, out)
        assert np.all(np.isfinite(got))
        assert_decode_is_the_simulators(data, num_splits, got, workspace)
        fresh = run_decode(data, num_splits, poisoned_workspace(1, 2, 32, max(num_splits, 1)))
        np.testing.assert_array_equal(got.view(np.uint32), fresh.view(np.uint32))
    # the orders differ (so the comparisons above could tell them apart), the reference bound holds for all
    reference = attention.paged_decode(*data.decode_args())
    assert np.all(max_error(first, reference) <= tolerance(data, None, 6))
    assert np.all(max_error(got, reference) <= tolerance(data, None, 1))
    assert np.any(first != got)


def test_argmax_fewer_rows_and_ctas_after_more_on_one_workspace(rng):
    workspace = layers.argmax_workspace(3, 150, logits_per_cta=32)  # 5 CTAs per row
    workspace.values[...] = np.nan
    workspace.indices[...] = 2**31 - 1
    big = rng.standard_normal((3, 150)).astype(np.float32)
    big[:, 32 * np.arange(5) + 3] = 50.0  # every CTA's partial is 50.0: a winner over anything below
    big[1, 149] = 60.0
    small = rng.standard_normal((2, 50)).astype(np.float32)  # 2 CTAs per row, the second of 18 logits
    small[1, 49] = 4.5
    again = rng.standard_normal((1, 150)).astype(np.float32)
    again[0, 140] = 5.0
    for logits in (big, small, again):
        out = np.full(logits.shape[0], -7, np.int32)
        layers.argmax_rows(logits, out, workspace=workspace, logits_per_cta=32)
        np.testing.assert_array_equal(out, dense.argmax_rows(logits))
        np.testing.assert_array_equal(out, np.argmax(logits, axis=1))
        np.testing.assert_array_equal(out, sim_dense.argmax_rows(logits, layers.ARGMAX_THREADS))
        np.testing.assert_array_equal(workspace.counters, 0)
        if logits is small:  # stale winners the small call left beyond its 3 CTAs (and had to ignore)
            assert np.all(workspace.values[:3, 2:] >= 50.0)


def test_prefill_workspaces_reused_with_fewer_splits(rng):
    """The same query token after a prefix of 23 (6 blocks: 6 splits), then after one of 5 (2 blocks: 2
    splits), on one decode workspace and one rows workspace."""
    caches, tables = filled_cache(rng, [24], 4, 1, 32, "fp8")
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    scale = 32**-0.5
    query_lens = np.array([1], np.int32)
    workspace = poisoned_workspace(1, 2, 32, kernels.MAX_SPLITS_PER_HEAD * kernels.MAX_HEADS_PER_CTA)
    rows = prefill_kernels.PrefillRows(np.full((1, tables.shape[1]), -7, np.int32), np.full(1, -7, np.int32))
    for context, splits in ((24, 6), (6, 2)):
        context_lens = np.array([context], np.int32)
        row_tables, row_lens = prefill_rows(tables, context_lens, query_lens)
        assert sk.choose_num_splits(1, 2, 1, int(row_lens.max()), block_size=4) == splits
        out = np.full(q.shape, np.nan, np.float32)
        prefill_kernels.paged_prefill(q, k, v, tables, context_lens, query_lens, scale, out, k_scale, v_scale,
                                      rows=rows, workspace=workspace)
        np.testing.assert_array_equal(rows.seq_lens, row_lens)
        expanded = fst.PagedKVData(q, k, v, k_scale, v_scale, row_tables, row_lens, scale)
        want = sk.paged_decode(*expanded.decode_args())
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
        if splits == 2:  # the later call: as on fresh workspaces
            fresh = np.full(q.shape, np.nan, np.float32)
            prefill_kernels.paged_prefill(q, k, v, tables, context_lens, query_lens, scale, fresh, k_scale, v_scale)
            np.testing.assert_array_equal(out.view(np.uint32), fresh.view(np.uint32))
        reference = reference_prefill(q, k, v, k_scale, v_scale, tables, context_lens, query_lens, scale)
        assert np.all(max_error(out, reference) <= tolerance(expanded, None, splits))


def run_steps(model, kv, prompts, schedule, num_blocks=8, block_size=4):
    """Prefill ``prompts`` in one forward, then one greedy decode step per entry of ``schedule`` (the
    sequences that take part, in order; the others have been freed). Logits of every step and tokens."""
    manager = KVCacheManager(num_blocks, block_size)
    cache = model.allocate_kv_cache(num_blocks, block_size, kv)
    for i in range(len(prompts)):
        manager.add_sequence(i)
    logits = [model.forward(make_batch(manager, list(enumerate(prompts))), cache)]
    tokens = {i: [int(t)] for i, t in enumerate(logits[0].argmax(axis=1))}
    buckets = []
    for seqs in schedule:
        for gone in [s for s in manager.sequences if s not in seqs]:
            manager.free(gone)
        logits.append(model.forward(make_batch(manager, [(s, tokens[s][-1:]) for s in seqs]), cache))
        for s, t in zip(seqs, logits[-1].argmax(axis=1)):
            tokens[s].append(int(t))
        buckets.append(getattr(getattr(model, "stats", None), "last_decode_bucket", None))
    return tokens, logits, buckets


def test_gpu_model_decode_buckets_after_a_larger_batch(gemm_twins):
    """4 sequences (bucket 4), then 3 of them (bucket 4: the fourth row, real a step ago, is padding now;
    sequence 3 moves up a row), then 1 (bucket 1): each step the reference's tokens and logits."""
    config = micro_config()
    tensors = micro_tensors(config, seed=7)
    prompts = [[5, 17], [7], [200, 3], [250]]
    schedule = [[0, 1, 2, 3], [0, 2, 3], [3]]
    want_tokens, want, _ = run_steps(Qwen3Model(config, tensors), "fp8", prompts, schedule)
    model = CudaQwen3Model(config, tensors, max_num_tokens=8, max_num_seqs=4, f32_max_rows=16)
    assert model.buckets == (1, 2, 4)
    got_tokens, got, buckets = run_steps(model, "fp8", prompts, schedule)
    assert buckets == [4, 4, 1]
    assert got_tokens == want_tokens
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and rel_err(g, w) <= 1e-3, (step, rel_err(g, w))  # MICRO_F32_BOUND["fp8"]
    assert model.stats.decode_steps == 3


# ---------------------------------------------------------------------------- long loops, partial last tiles


def test_gemm_mma_more_chunks_than_stages_and_partial_tiles(rng):
    m, n, k, block = 17, 13, 512, (8, 384)
    tiling = mma_kernel.choose_tiling(m, n, k, m_blocks=1, warps_n=1, n8_tiles_per_warp=1, stages=2)
    chunks = k // sim_mma.K_CHUNK
    assert chunks >= 2 * tiling.stages and m % 16 and n % 8 and k % block[1] and n % block[0]
    assert mma_kernel.launch_info(m, n, k, 1, warps_n=1, n8_tiles_per_warp=1, stages=2).grid == (2, 2)  # 2 N tiles x 2 M tiles, both last ones partial
    a = bp.activation_bits(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    q = rng.choice(np.array(fst.NON_NAN_CODES, np.uint8), size=(n, k))
    scale_inv = (rng.uniform(0.5, 2.0, blockwise.scale_shape((n, k), block)) * 1e-2).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    mma_kernel.gemm_mma(a, q, scale_inv, out, block, m_blocks=1, warps_n=1, n8_tiles_per_warp=1, stages=2)
    want = sim_mma.gemm_mma(a, q, scale_inv, block, m_blocks=1, activation="bf16")
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    # the simulator's stated float32 bound against the oracle on the same (BF16) activations
    a64 = bp.bits_to_float32(a, "bf16").astype(np.float64)
    ref = blockwise.gemm(a64, q, scale_inv, block)
    w = np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64))
    bound = (chunks + 9) * U32 * (np.abs(a64) @ w.T)
    bound += 15 * chunks * 2.0 ** (bp.EXPONENT_OFFSET["bf16"] - 150) * float(np.max(scale_inv)) + chunks * 2.0**-150
    assert np.all(np.isfinite(out)) and np.all(np.abs(out - ref) <= bound)


def groups_per_shard(length, num_splits, block_size, head_dim, tokens_in_flight):
    """Per shard: (full groups, whether a guarded last group runs), by the split kernel's loop condition."""
    slots, per_warp = sk.num_slots(head_dim), 32 // sk.lanes_per_token(head_dim)
    result = []
    for start, end in sk.shard_bounds(length, num_splits, block_size):
        full, first = 0, start + (slots // per_warp - 1) * per_warp  # the last warp's first token
        while first + slots * (tokens_in_flight - 1) + per_warp - 1 < end:
            full, first = full + 1, first + slots * tokens_in_flight
        result.append((full, bool(start + full * slots * tokens_in_flight < end)))
    return result


def test_splitkv_long_shards_with_a_partial_last_block(rng):
    length, block_size, head_dim, num_splits = 90, 8, 256, 2
    u = kernels.lane_layout("fp8", head_dim).tokens_in_flight
    assert (u, sk.num_slots(head_dim)) == (4, 8) and length % block_size == 2
    assert groups_per_shard(length, num_splits, block_size, head_dim, u) == [(1, True), (1, True)]
    data = decode_data(rng, [length], num_heads=1, head_dim=head_dim, block_size=block_size)
    workspace = poisoned_workspace(1, 1, head_dim, num_splits)
    got = run_decode(data, num_splits, workspace)
    assert np.all(np.isfinite(got))
    assert_decode_is_the_simulators(data, num_splits, got, workspace)
    reference = attention.paged_decode(*data.decode_args())
    assert np.all(max_error(got, reference) <= tolerance(data, None, num_splits))


def test_prefill_long_rows_with_a_partial_last_block(rng):
    head_dim, block_size = 256, 64
    context_lens, query_lens = np.array([110], np.int32), np.array([1], np.int32)
    caches, tables = filled_cache(rng, context_lens, block_size, 1, head_dim, "fp8")
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((1, 1, head_dim)).astype(np.float32)
    scale = head_dim**-0.5
    row_tables, row_lens = prefill_rows(tables, context_lens, query_lens)
    assert row_lens.tolist() == [110] and sk.choose_num_splits(1, 1, 1, 110, block_size=block_size) == 2
    u = kernels.lane_layout("fp8", head_dim).tokens_in_flight
    # shard 0: 2 full groups; shard 1: a full group, then a guarded one
    assert groups_per_shard(110, 2, block_size, head_dim, u) == [(2, False), (1, True)]
    out = np.full(q.shape, np.nan, np.float32)
    prefill_kernels.paged_prefill(q, k, v, tables, context_lens, query_lens, scale, out, k_scale, v_scale)
    expanded = fst.PagedKVData(q, k, v, k_scale, v_scale, row_tables, row_lens, scale)
    want = sk.paged_decode(*expanded.decode_args())
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    reference = reference_prefill(q, as_float32(k), as_float32(v), k_scale, v_scale, tables, context_lens, query_lens,
                                  scale)
    assert np.all(np.isfinite(out)) and np.all(max_error(out, reference) <= tolerance(expanded, None, 2))
