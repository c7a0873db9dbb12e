"""fp8lab.numba_kernels.prefill (causal prefill as split-kv decode of every query token) against
fp8lab.simulators.splitkv, fp8lab.reference.attention.prefill and a by-hand expansion of the rows.

In the CUDA simulator (``cudasim``; tiny shapes, a simulated 128-thread CTA costs about 0.3 s here):
FP8 and BF16 caches with permuted block tables, chunked prefill (a cached prefix), several sequences
of different lengths including one with no new tokens, ``out`` poisoned with NaN: bit for bit equal
to ``fp8lab.simulators.splitkv.paged_decode`` on the expanded rows (built here by a plain loop), and within
the split-kv float32 bound (``helpers.attention.tolerance``) of ``fp8lab.reference.attention.prefill`` per
sequence; the device path (device index arrays, ``max_context_len``, a rows workspace) reads
nothing back; the expansion kernel equals the host expansion; a uint16 ``out`` is bit for bit
``layers.bf16_round`` of the float32 one; every bad argument is a ``ValueError`` before anything is
launched. Without the simulator: the expansion kernel compiles to sm_90 PTX. On a GPU (``gpu``): Qwen3-8B heads, prompts of 300 and 700 tokens (one after a cached
prefix), FP8 and BF16, host and device paths, against ``fp8lab.reference.attention.prefill``.
"""

import os
from dataclasses import dataclass

import numpy as np
import pytest
from helpers.attention import (
    as_float32,
    bf16_rounded,
    filled_cache,
    prefill_rows,
    tolerance,
)
from helpers.attention import reference_prefill as helpers_reference_prefill
from helpers.ptx import check_pdl_rules, compile_sets, each_variant, progress_printer
from hypothesis import given
from hypothesis import strategies as st
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import prefill as kernels
from fp8lab.numba_kernels import splitkv
from fp8lab.reference import strategies as fst
from fp8lab.simulators import splitkv as sk

# ---------------------------------------------------------------------------- test data


@dataclass(frozen=True)
class Batch:
    """A prefill batch: new tokens' queries back to back, paged caches already holding every token."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_lens: np.ndarray
    softmax_scale: float


def make_batch(rng, context_lens, query_lens, num_heads=2, num_kv_heads=1, head_dim=32, block_size=4,
               cache="fp8") -> Batch:
    """Random K/V written by ``fp8lab.reference.kv_cache.write`` over a shuffled block pool (tables padded with -1;
    ``helpers.attention.filled_cache``); unused slots hold NaN, so a read outside a sequence shows."""
    context_lens = np.asarray(context_lens, np.int32)
    query_lens = np.asarray(query_lens, np.int32)
    caches, tables = filled_cache(rng, context_lens, block_size, num_kv_heads, head_dim, cache)
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((int(query_lens.sum()), num_heads, head_dim)).astype(np.float32)
    return Batch(q, k, v, k_scale, v_scale, tables, context_lens, query_lens, float(head_dim) ** -0.5)


def reference_prefill(b: Batch) -> np.ndarray:
    """``fp8lab.reference.attention.prefill`` per sequence over its gathered cache (``helpers.attention``)."""
    return helpers_reference_prefill(b.q, b.k_cache, b.v_cache, b.k_scale, b.v_scale, b.block_tables, b.context_lens,
                                     b.query_lens, b.softmax_scale)


def run_prefill(b: Batch, out=None, **kwargs) -> np.ndarray:
    if out is None:
        out = np.full(b.q.shape, np.nan, np.float32)  # poisoned: every element must be written
    kernels.paged_prefill(b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.query_lens, b.softmax_scale,
                          out, b.k_scale, b.v_scale, **kwargs)
    return out


def check_against_simulator_and_reference(b: Batch, got: np.ndarray):
    """Bit for bit the simulator on the hand-expanded rows with its own ``"auto"`` split count (the kernel's
    rule on the longest row: the tests pass no looser ``max_context_len``); within the split-kv bound of the
    reference, for any split count up to 16 (the bound's dependence on the count is mild)."""
    row_tables, row_lens = prefill_rows(b.block_tables, b.context_lens, b.query_lens)
    k, v = as_float32(b.k_cache), as_float32(b.v_cache)
    expected = sk.paged_decode(b.q, k, v, row_tables, row_lens, b.softmax_scale, b.k_scale, b.v_scale)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    rows = fst.PagedKVData(b.q, k, v, b.k_scale, b.v_scale, row_tables, row_lens, b.softmax_scale)
    bound = np.max([tolerance(rows, None, splits) for splits in range(1, 17)], axis=0)
    error = np.max(np.abs(got.astype(np.float64) - reference_prefill(b)), axis=-1)
    assert np.all(error <= bound), (error, bound)


# ---------------------------------------------------------------------------- the expansion


@given(lens=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=5), width_extra=st.integers(0, 2),
       seed=st.integers(0, 2**32 - 1))
def test_host_expansion_is_the_loop(lens, width_extra, seed):
    """Query counts clipped to the context (0 included): the same rows as the hand-written loop."""
    rng = np.random.default_rng(seed)
    context = np.array([c for c, _ in lens], np.int32)
    queries = np.array([min(c, n) for c, n in lens], np.int32)
    width = int(-(-context.max(initial=0) // 4)) + width_extra
    tables = rng.integers(-1, 50, (len(lens), width)).astype(np.int32)
    got_tables, got_lens = kernels.expand_rows_host(tables, context, queries)
    want_tables, want_lens = prefill_rows(tables, context, queries)
    assert got_tables.dtype == np.int32 and got_lens.dtype == np.int32
    np.testing.assert_array_equal(got_tables, want_tables)
    np.testing.assert_array_equal(got_lens, want_lens)


@pytest.mark.cudasim
def test_device_expansion_kernel_equals_the_host_expansion(rng):
    """Five sequences (query counts 0 in the middle and at the ends, a chunk after a prefix), int64 lengths;
    two extra rows past sum(query_lens) get length 0. Outputs poisoned first."""
    context = np.array([0, 6, 3, 9, 4], np.int64)
    queries = np.array([0, 2, 3, 0, 4], np.int64)
    tables = rng.integers(0, 40, (5, 3)).astype(np.int32)
    num_rows = int(queries.sum())
    row_tables = np.full((num_rows + 2, 3), -7, np.int32)
    row_lens = np.full(num_rows + 2, -7, np.int32)
    kernels._expand_kernel[num_rows + 2, kernels.WARP_SIZE](tables, context, queries, row_tables, row_lens)
    host_tables, host_lens = kernels.expand_rows_host(tables, context, queries)
    np.testing.assert_array_equal(row_tables[:num_rows], host_tables)
    np.testing.assert_array_equal(row_lens[:num_rows], host_lens)
    np.testing.assert_array_equal(row_lens[num_rows:], 0)
    np.testing.assert_array_equal(row_tables[num_rows:], 0)
    np.testing.assert_array_equal(row_lens[:num_rows], [5, 6, 1, 2, 3, 1, 2, 3, 4])


# ---------------------------------------------------------------------------- attention in the simulator


@pytest.mark.cudasim
def test_fp8_host_indices_bit_exact_and_within_the_bound(rng):
    """FP8, GQA 2:1: a chunk of 2 after a prefix of 4, a whole prompt of 3, a sequence with no new tokens
    (and the longest context, never read). 5 rows x 2 heads; "auto" splits these short rows (the combine runs)."""
    b = make_batch(rng, context_lens=[6, 3, 9], query_lens=[2, 3, 0], num_heads=2, num_kv_heads=1, head_dim=32,
                   block_size=4, cache="fp8")
    got = run_prefill(b)
    assert np.all(np.isfinite(got))
    check_against_simulator_and_reference(b, got)


@pytest.mark.cudasim
def test_bf16_device_path_reads_nothing_back(rng, monkeypatch):
    """BF16, 2 kv heads, head_dim 64: device index arrays, max_context_len and a rows workspace; nothing is
    copied to the host (prefill's to_host is disabled) and the workspace holds the hand-expanded rows."""
    b = make_batch(rng, context_lens=[3, 0, 7], query_lens=[3, 0, 1], num_heads=2, num_kv_heads=2, head_dim=64,
                   block_size=4, cache="bf16")
    num_tokens, width = b.q.shape[0], b.block_tables.shape[1]
    rows = kernels.PrefillRows(cuda.to_device(np.full((num_tokens, width), -7, np.int32)),
                               cuda.to_device(np.full(num_tokens, -7, np.int32)))

    def no_read_back(x):
        raise AssertionError("the device path read an array back to the host")

    monkeypatch.setattr(kernels, "to_host", no_read_back)
    device = [cuda.to_device(x) for x in (b.block_tables, b.context_lens, b.query_lens)]
    out = np.full(b.q.shape, np.nan, np.float32)
    kernels.paged_prefill(b.q, b.k_cache, b.v_cache, *device, b.softmax_scale, out, max_context_len=7, rows=rows)
    monkeypatch.undo()
    want_tables, want_lens = prefill_rows(b.block_tables, b.context_lens, b.query_lens)
    np.testing.assert_array_equal(rows.block_tables.copy_to_host(), want_tables)
    np.testing.assert_array_equal(rows.seq_lens.copy_to_host(), want_lens)
    assert np.all(np.isfinite(out))
    check_against_simulator_and_reference(b, out)


@pytest.mark.cudasim
def test_f32_cache_and_host_rows_workspace(rng):
    """A float32 cache, one block per sequence (1 split); the rows workspace is filled on the host path too."""
    b = make_batch(rng, context_lens=[2, 3], query_lens=[1, 1], num_heads=2, num_kv_heads=1, head_dim=32,
                   block_size=4, cache="fp32")
    rows = kernels.prefill_rows_workspace(2, b.block_tables.shape[1])
    got = run_prefill(b, rows=rows)
    np.testing.assert_array_equal(rows.seq_lens, [2, 3])
    check_against_simulator_and_reference(b, got)


@pytest.mark.cudasim
def test_bf16_out_is_the_float32_out_rounded(rng, monkeypatch):
    """uint16 ``out`` (BF16 bits) is bit for bit ``layers.bf16_round`` of the float32 call's ``out``: FP8, a chunk
    of 2 after a prefix of 1 in blocks of 2 ("auto" splits the rows in 2: the combine's store), 2 query heads on 1
    kv head served by one CTA (``heads_per_cta`` forced to 2, which changes no bit; fewer simulated CTAs); ``out``
    poisoned with 0x1234."""
    monkeypatch.setattr(splitkv, "heads_per_cta", lambda group, tokens: group)
    b = make_batch(rng, context_lens=[3], query_lens=[2], num_heads=2, num_kv_heads=1, head_dim=32, block_size=2,
                   cache="fp8")
    expected = bf16_rounded(run_prefill(b))
    got = run_prefill(b, out=np.full(b.q.shape, 0x1234, np.uint16))
    np.testing.assert_array_equal(got, expected)
    assert np.all(got != 0x1234) and np.all(got != 0)


@pytest.mark.cudasim
def test_no_query_tokens_is_a_no_op(rng):
    b = make_batch(rng, context_lens=[5, 0], query_lens=[0, 0])
    assert b.q.shape[0] == 0
    assert run_prefill(b).shape == (0, 2, 32)


# ---------------------------------------------------------------------------- bad calls


def bad_calls(b: Batch):
    """(case, keyword changes, message) of calls that must fail before launching; the batch has
    context_lens [7, 2, 4], query_lens [3, 0, 4]: 7 query tokens, 2 heads of 32, 1 kv head, blocks of 4."""
    q, k, v, s = b.q, b.k_cache, b.v_cache, b.k_scale
    i32 = np.int32
    return [
        ("q float64", dict(q=q.astype(np.float64)), "q: expected float32 \\[num_query_tokens, num_heads, head_dim\\]"),
        ("q 2-D", dict(q=q[:, 0]), "q: expected float32"),
        ("token count", dict(query_lens=np.array([3, 0, 3], i32)),
         "query_lens: sum\\(query_lens\\) = 6 does not match q's 7 query tokens"),
        ("more queries than context", dict(query_lens=np.array([2, 0, 5], i32)),
         "query_lens: sequence 2 has 5 new tokens but context_lens says only 4 tokens are cached"),
        ("negative context", dict(context_lens=np.array([7, -1, 4], i32)),
         "context_lens: expected lengths >= 0, sequence 1"),
        ("negative query", dict(query_lens=np.array([4, -1, 4], i32)), "query_lens: expected lengths >= 0, sequence 1"),
        ("context_lens shape", dict(context_lens=np.array([7, 2], i32)),
         "context_lens: expected an integer array \\[3\\]"),
        ("float query_lens", dict(query_lens=np.array([3.0, 0.0, 4.0])),
         "query_lens: expected an integer array \\[3\\]"),
        ("table 1-D", dict(block_tables=b.block_tables[0]), "block_tables: expected an integer array"),
        ("table too short", dict(block_tables=b.block_tables[:, :1]),
         "block_tables: sequence 0 has 7 tokens, which need 2"),
        ("block id out of range", dict(block_tables=b.block_tables + 100), "block_tables: block ids must lie in"),
        ("out wrong shape", dict(out=np.zeros((7, 2, 16), np.float32)), "out: expected float32 or uint16 \\(BF16 bits\\) \\[7, 2, 32\\] like q"),
        ("out float64", dict(out=np.zeros(q.shape, np.float64)), "out: expected float32"),
        ("out float16", dict(out=np.zeros(q.shape, np.float16)),
         "out: expected float32 or uint16 \\(BF16 bits\\) \\[7, 2, 32\\] like q, got shape \\(7, 2, 32\\) dtype float16"),
        ("out strided", dict(out=np.zeros((7, 2, 64), np.float32)[:, :, ::2]), "out: expected a C-contiguous"),
        ("head_dim mismatch", dict(q=np.ones((7, 2, 64), np.float32), out=np.zeros((7, 2, 64), np.float32)),
         "k_cache: head_dim 32 does not match q's head_dim 64"),
        ("heads do not divide", dict(q=np.ones((7, 3, 32), np.float32), out=np.zeros((7, 3, 32), np.float32),
                                     k_cache=np.repeat(k, 2, axis=1), v_cache=np.repeat(v, 2, axis=1),
                                     k_scale=np.repeat(s, 2, axis=1), v_scale=np.repeat(b.v_scale, 2, axis=1)), "GQA"),
        ("FP8 without k_scale", dict(k_scale=None), "k_cache: an FP8 cache of codes \\(uint8\\) needs its scales"),
        ("FP8 without v_scale", dict(v_scale=None), "v_cache: an FP8 cache of codes \\(uint8\\) needs its scales"),
        ("scales wrong shape", dict(k_scale=s[:, :, :2]), "k_scale: expected float32 scales of shape"),
        ("float cache with scales", dict(k_cache=np.ones(k.shape, np.float32), v_cache=np.ones(k.shape, np.float32)),
         "a float cache \\(float32\\) takes k_scale=None"),
        ("v_cache differs", dict(v_cache=v[:1]), "v_cache: expected the shape"),
        ("max_context_len short", dict(max_context_len=5),
         "max_context_len: 5 is shorter than the longest context \\(7\\)"),
        ("rows not PrefillRows", dict(rows=(np.zeros((7, 2), i32), np.zeros(7, i32))), "rows: expected a PrefillRows"),
        ("rows wrong shape", dict(rows=kernels.PrefillRows(np.zeros((6, 2), i32), np.zeros(7, i32))),
         "rows.block_tables: expected int32 \\[7, 2\\]"),
        ("rows int64", dict(rows=kernels.PrefillRows(np.zeros((7, 2), i32), np.zeros(7, np.int64))),
         "rows.seq_lens: expected int32 \\[7\\]"),
    ]


@pytest.mark.cudasim
def test_bad_calls_raise_before_launching(rng):
    b = make_batch(rng, context_lens=[7, 2, 4], query_lens=[3, 0, 4])
    base = dict(q=b.q, k_cache=b.k_cache, v_cache=b.v_cache, block_tables=b.block_tables, context_lens=b.context_lens,
                query_lens=b.query_lens, softmax_scale=b.softmax_scale, k_scale=b.k_scale, v_scale=b.v_scale)
    for case, change, message in bad_calls(b):
        args = dict(base, out=np.full(b.q.shape, np.nan, np.float32))
        args.update(change)
        with pytest.raises(ValueError, match=message):
            kernels.paged_prefill(**args)
        if "out" not in change:
            assert np.all(np.isnan(args["out"])), case  # nothing was launched


@pytest.mark.cudasim
def test_device_index_arrays_with_a_bad_bound_raise_before_launching(rng):
    """With device index arrays and max_context_len nothing is read back: only the bound is checked."""
    b = make_batch(rng, context_lens=[7, 4], query_lens=[3, 4])
    rows = kernels.PrefillRows(np.full((7, 2), -7, np.int32), np.full(7, -7, np.int32))
    device = [cuda.to_device(x) for x in (b.block_tables, b.context_lens, b.query_lens)]
    out = np.full(b.q.shape, np.nan, np.float32)
    for bound, message in ((9, "max_context_len: 9 tokens need 3 blocks of 4, block_tables has 2 columns"),
                           (-1, "max_context_len: -1 tokens")):
        with pytest.raises(ValueError, match=message):
            kernels.paged_prefill(b.q, b.k_cache, b.v_cache, *device, b.softmax_scale, out, b.k_scale, b.v_scale,
                                  max_context_len=bound, rows=rows)
    assert np.all(np.isnan(out)) and np.all(rows.seq_lens == -7)


# ---------------------------------------------------------------------------- the expansion kernel compiles


PTX_VARIANT_SETS = {"prefill": r'''
from fp8lab.numba_kernels import prefill
from helpers.ptx import Variant

def variants():
    return [Variant(name, function, signature) for name, function, signature in prefill.kernel_variants()]
'''}
"""Compiled once per session with the simulator off, in the background from the end of collection
(``helpers.ptx``, ``conftest.py``)."""


def check_expansion_ptx(c) -> None:
    assert ".target sm_90" in c.ptx
    assert ".local" not in c.ptx and ".f64" not in c.ptx
    assert "st.global.u32" in c.ptx or "st.global.b32" in c.ptx
    check_pdl_rules(c.ptx)


def test_expansion_kernel_compiles_to_sm90_ptx(request):
    """Typed and compiled for sm_90 with the simulator off (a compile process: a process chooses its mode once)."""
    (compiled,) = compile_sets(PTX_VARIANT_SETS, progress=progress_printer(request.config)).values()
    assert [c.name for c in compiled] == [name for name, _, _ in kernels.kernel_variants()]
    each_variant(compiled, check_expansion_ptx)


# ---------------------------------------------------------------------------- on a GPU


RELATIVE_ERROR_BOUND = 1e-5
"""As tests/numba_kernels/test_splitkv_kernel.py: float32 accumulation over up to 764 tokens with a 2-ulp exp2 stays far
below this; a wrong token, row length or scale is off by order 1e-2 and more."""


def relative_error(got, expected) -> float:
    """``||got - expected|| / ||expected||``; infinite when ``got`` holds a NaN or infinity."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_gpu_qwen3_8b_heads_against_the_reference(cache):
    """32 query heads on 8 kv heads of 128, blocks of 16: a whole prompt of 300 tokens and a chunk of 700 after a
    cached prefix of 64, on fresh random data. The host path (NumPy indices) and the device path (device
    indices, max_context_len, rows and decode workspaces) on the same data, out poisoned before each; both
    against the reference, and bit-identical to each other (same rows, same split count)."""
    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    b = make_batch(rng, context_lens=[300, 764], query_lens=[300, 700], num_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, cache=cache)
    expected = reference_prefill(b)
    num_tokens, width = b.q.shape[0], b.block_tables.shape[1]

    host_out = run_prefill(b)
    assert relative_error(host_out, expected) <= RELATIVE_ERROR_BOUND, (seed, relative_error(host_out, expected))

    device = [cuda.to_device(x) for x in (b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, b.query_lens)]
    scales = [None if x is None else cuda.to_device(x) for x in (b.k_scale, b.v_scale)]
    out = cuda.to_device(np.full(b.q.shape, np.nan, np.float32))
    rows = kernels.prefill_rows_workspace(num_tokens, width)
    workspace = splitkv.decode_workspace(num_tokens, num_heads, head_dim)
    q, k, v, tables, context_lens, query_lens = device
    kernels.paged_prefill(q, k, v, tables, context_lens, query_lens, b.softmax_scale, out, *scales,
                          max_context_len=764, rows=rows, workspace=workspace)
    got = out.copy_to_host()
    assert relative_error(got, expected) <= RELATIVE_ERROR_BOUND, (seed, relative_error(got, expected))
    np.testing.assert_array_equal(got.view(np.uint32), host_out.view(np.uint32))
