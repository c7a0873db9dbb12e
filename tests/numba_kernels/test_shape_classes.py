"""The GPU tests' shape classes, at tiny sizes in the CUDA simulator (``cudasim``): the kernel paths that
the other simulator tests leave out.

Gaps closed here (the other modules in ``tests/numba_kernels`` already cover the rest):

- **GQA with several KV heads.** Every simulator-run decode elsewhere has one KV head, or as many query
  heads as KV heads, and every prefill one KV head with GQA 2 or 2 KV heads without GQA: a wrong query
  head -> KV head mapping passes there. Here split-kv decode (4 over 2, 6 over 3, 8 over 2 and 12 over 2
  heads, the last with 3 heads per CTA so that a CTA starts inside a GQA group; FP8 and BF16; 1 and more
  splits) and causal prefill (4 over 2 FP8, 6 over 3 BF16) are bit for bit the simulator and within the
  split-kv bound of the reference, with KV heads that the data tells apart: the reference with a wrong
  head mapping is outside the bound for every head it maps wrongly.
- **Cache blocks longer than a CTA's token slots.** Elsewhere ``block_size`` divides ``num_slots``, so a
  slot's next token is always ``SLOTS // block_size`` blocks on at offset 0 and the split kernel's
  page-crossing branch (``offset >= block_size`` in ``load_group``) never runs. Here it does.
- **Partial edge blocks through ``fp8_gemm``.** ``gemv_simt`` (N = 5 in blocks of 2, K = 1152 in
  blocks of 256), ``gemm_mma`` (N = 61 in blocks of 16, K = 384 in blocks of 256) and ``dequantize``
  (random blocks) already meet partial N and K blocks in their own tests; the router ``fp8_gemm`` only
  met N = 12 in one block of 128 and K = 128. Here both of its paths get N = 20 in blocks of 8 and
  K = 384 in blocks of 256 (K must be a multiple of 128, so the partial block is in the scales).

Simulated CTAs are slow (about 0.1 to 0.3 s each): lengths of a few blocks, two sequences.
"""

import numpy as np
import pytest
from helpers.attention import (
    as_float32,
    filled_cache,
    prefill_rows,
    random_slopes,
    reference_prefill,
    tolerance,
)

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import fp8_gemm as router
from fp8lab.numba_kernels import prefill as prefill_kernels
from fp8lab.numba_kernels import splitkv as kernels
from fp8lab.reference import attention, blockwise
from fp8lab.reference import strategies as fst
from fp8lab.simulators import gemm_mma as sim_mma
from fp8lab.simulators import gemv_simt as sim_gemv
from fp8lab.simulators import splitkv as sk

pytestmark = pytest.mark.cudasim


# ---------------------------------------------------------------------------- data


def decode_data(rng, lens, num_heads, num_kv_heads, head_dim, block_size, cache):
    """A decode batch over a filled paged cache (``helpers.attention.filled_cache``: shuffled blocks,
    unused slots NaN), as the kernel takes it; each KV head's tokens drawn independently."""
    caches, tables = filled_cache(rng, lens, block_size, num_kv_heads, head_dim, cache)
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((len(lens), num_heads, head_dim)).astype(np.float32)
    return fst.PagedKVData(q, k, v, k_scale, v_scale, tables, np.asarray(lens, np.int32), float(head_dim) ** -0.5)


def widened(data):
    """The batch as the simulator and the reference read it (BF16 patterns widened to float32, exactly)."""
    return fst.PagedKVData(data.q, as_float32(data.k_cache), as_float32(data.v_cache), data.k_scale, data.v_scale,
                           data.block_tables, data.seq_lens, data.softmax_scale)


def run_decode(data, num_splits, slopes=None):
    out = np.full(data.q.shape, np.nan, np.float32)  # poisoned: every element must be written
    kernels.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens, data.softmax_scale,
                         out, data.k_scale, data.v_scale, alibi_slopes=slopes, num_splits=num_splits)
    return out


def reference_with_head_map(data, head_map, slopes=None):
    """``fp8lab.reference.attention.paged_decode`` where query head ``h`` reads KV head ``head_map[h]``: the
    caches re-laid out with one KV head per query head (``head_map = h // group`` is the reference itself)."""
    def per_query_head(x):
        return None if x is None else np.ascontiguousarray(np.take(x, head_map, axis=1))

    return attention.paged_decode(data.q, per_query_head(data.k_cache), per_query_head(data.v_cache),
                                  data.block_tables, data.seq_lens, data.softmax_scale,
                                  per_query_head(data.k_scale), per_query_head(data.v_scale), alibi_slopes=slopes)


def wrong_head_maps(num_heads, num_kv_heads):
    """Plausible mapping bugs: heads dealt round-robin (``h % num_kv_heads``) and each group shifted by one."""
    group = num_heads // num_kv_heads
    right = np.arange(num_heads) // group
    return {"round-robin": np.arange(num_heads) % num_kv_heads, "shifted": (right + 1) % num_kv_heads}


def max_error(got, expected):
    """Per (row, head): ``max |got - expected|``, float64."""
    return np.max(np.abs(got.astype(np.float64) - expected), axis=-1)


# ---------------------------------------------------------------------------- decode: several KV heads, GQA > 1


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, cache, num_splits, alibi", [
    (4, 2, 32, "fp8", 1, False),
    (6, 3, 32, "bf16", 3, True),
    (8, 2, 64, "fp8", 2, False),
    (12, 2, 32, "bf16", 1, False),  # group 6: 3 heads per CTA, two CTAs per group (the second starts at head 3)
])
def test_decode_gqa_with_several_kv_heads(rng, num_heads, num_kv_heads, head_dim, cache, num_splits, alibi):
    """Bit for bit the simulator, within the split-kv bound of the reference; the reference with a wrong
    head mapping lies outside that bound for every head it maps wrongly (the KV heads differ)."""
    group = num_heads // num_kv_heads
    assert num_kv_heads > 1 and group > 1
    data = decode_data(rng, [11, 5], num_heads, num_kv_heads, head_dim, block_size=4, cache=cache)
    slopes = random_slopes(rng, num_heads) if alibi else None
    got = run_decode(data, num_splits, slopes)
    assert np.all(np.isfinite(got))

    wide = widened(data)
    expected = sk.paged_decode(*wide.decode_args(), alibi_slopes=slopes, num_splits=num_splits)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))

    bound = tolerance(wide, slopes, num_splits)
    reference = attention.paged_decode(*wide.decode_args(), alibi_slopes=slopes)
    assert np.all(max_error(got, reference) <= bound)

    right = np.arange(num_heads) // group
    np.testing.assert_array_equal(reference_with_head_map(wide, right, slopes), reference)  # the re-layout is exact
    for name, head_map in wrong_head_maps(num_heads, num_kv_heads).items():
        wrong = head_map != right
        assert np.any(wrong), name
        error = max_error(got, reference_with_head_map(wide, head_map, slopes))
        assert np.all(error[:, wrong] > bound[:, wrong]), f"{name}: the data cannot tell the KV heads apart"


# ---------------------------------------------------------------------------- decode: blocks longer than the slots


def page_crossings(seq_len, num_splits, block_size, head_dim):
    """Tokens the split kernel reaches through its page-crossing branch, walking as ``load_group`` does.

    A slot reads the shard's tokens ``start + slot, start + slot + SLOTS, ...``; from one token to the
    next the kernel adds ``SLOTS // block_size`` to the block column and ``SLOTS % block_size`` to the
    offset, and when the offset reaches ``block_size`` it takes the branch ``offset -= block_size;
    column += 1``. Counted from the plan functions, so that a change of the plan shows here.
    """
    slots = kernels.num_slots(head_dim)
    crossings = 0
    for start, end in sk.shard_bounds(seq_len, num_splits, block_size):
        for slot in range(slots):
            tokens = np.arange(start + slot, end, slots)
            crossings += int(np.sum(tokens[:-1] % block_size + slots % block_size >= block_size))
    return crossings


@pytest.mark.parametrize("cache, head_dim, block_size, length, num_splits", [
    ("fp8", 256, 16, 37, 2),  # 8 slots, blocks of 16: a slot crosses a page every second token; shards of 2 blocks, 1
    ("bf16", 128, 32, 70, 1),  # 16 slots, blocks of 32: every fourth token
])
def test_decode_blocks_longer_than_the_token_slots(rng, cache, head_dim, block_size, length, num_splits):
    """The split kernel's page-crossing branch: with ``block_size > num_slots(head_dim)`` a slot's next
    token is in the same block (column step 0, offset step ``SLOTS``) until the offset passes the block's
    end, then in the next block; asserted reached (``page_crossings > 0``) before comparing bit for bit with
    the simulator (which locates every token directly, ``token // block_size``) and with the reference.
    2 KV heads, GQA 2."""
    assert kernels.num_slots(head_dim) == sk.num_slots(head_dim)
    assert block_size > kernels.num_slots(head_dim)
    assert page_crossings(length, num_splits, block_size, head_dim) > 0
    data = decode_data(rng, [length], 4, 2, head_dim, block_size, cache)
    got = run_decode(data, num_splits)
    wide = widened(data)
    expected = sk.paged_decode(*wide.decode_args(), num_splits=num_splits)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    reference = attention.paged_decode(*wide.decode_args())
    assert np.all(max_error(got, reference) <= tolerance(wide, None, num_splits))


# ---------------------------------------------------------------------------- prefill: several KV heads, GQA > 1


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, cache, block_size", [
    (4, 2, 32, "fp8", 4),  # "auto" splits the rows of 5 and 6 tokens in 2 (the combine runs)
    (6, 3, 32, "bf16", 8),  # one block per row: 1 split
])
def test_prefill_gqa_with_several_kv_heads(rng, num_heads, num_kv_heads, head_dim, cache, block_size):
    """A whole prompt of 3 and a chunk of 2 after a cached prefix of 4: bit for bit the simulator on the
    hand-expanded rows (its own ``"auto"`` split count, as the kernel's), within the split-kv bound (any
    split count up to 16) of the reference; a reference reading the wrong KV heads is outside it."""
    context_lens, query_lens = np.array([3, 6], np.int32), np.array([3, 2], np.int32)
    caches, tables = filled_cache(rng, context_lens, block_size, num_kv_heads, head_dim, cache)
    (k, k_scale), (v, v_scale) = caches
    q = rng.standard_normal((int(query_lens.sum()), num_heads, head_dim)).astype(np.float32)
    softmax_scale = float(head_dim) ** -0.5
    out = np.full(q.shape, np.nan, np.float32)
    prefill_kernels.paged_prefill(q, k, v, tables, context_lens, query_lens, softmax_scale, out, k_scale, v_scale)
    assert np.all(np.isfinite(out))

    row_tables, row_lens = prefill_rows(tables, context_lens, query_lens)
    rows = fst.PagedKVData(q, as_float32(k), as_float32(v), k_scale, v_scale, row_tables, row_lens, softmax_scale)
    expected = sk.paged_decode(*rows.decode_args())
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    bound = np.max([tolerance(rows, None, splits) for splits in range(1, 17)], axis=0)
    reference = reference_prefill(q, k, v, k_scale, v_scale, tables, context_lens, query_lens, softmax_scale)
    assert np.all(max_error(out, reference) <= bound)

    right = np.arange(num_heads) // (num_heads // num_kv_heads)
    for name, head_map in wrong_head_maps(num_heads, num_kv_heads).items():
        wrong = head_map != right
        error = max_error(out, reference_with_head_map(rows, head_map))
        assert np.all(error[:, wrong] > bound[:, wrong]), f"{name}: the data cannot tell the KV heads apart"


# ---------------------------------------------------------------------------- fp8_gemm: partial edge blocks


@pytest.mark.parametrize("m, path", [(2, "auto"), (5, "auto"), (3, "simt"), (3, "mma")])
def test_fp8_gemm_partial_edge_blocks(rng, m, path):
    """N = 12 in blocks of 8 (the last block 4 wide) and K = 384 in blocks of 256 (the last 128 wide):
    bit for bit the simulator of the kernel the path picks, within 1e-5 relative of the reference."""
    n, k, block = 12, 384, (8, 256)
    assert n % block[0] and k % block[1] and k % 128 == 0
    w = (rng.standard_normal((n, k)) * rng.uniform(0.05, 2.0, (n, 1))).astype(np.float32)
    q, scale_inv = blockwise.quantize(w, block)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a_bits = (a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1) >> 16).astype(np.uint16)  # RNE to BF16
    out = np.full((m, n), np.nan, np.float32)
    router.fp8_gemm(a_bits, q, scale_inv, out, block, path=path)

    chosen = router.choose_path(m, n) if path == "auto" else path
    assert chosen != "gemv_mma"  # N = 12 is not a multiple of 16: the SIMT GEMV or the mma GEMM
    a32 = (a_bits.astype(np.uint32) << 16).view(np.float32)
    if chosen == "simt":
        expected = sim_gemv.gemv_simt(a32, q, scale_inv, block)
    else:
        expected = sim_mma.gemm_mma(a_bits, q, scale_inv, block)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    reference = blockwise.gemm(a32, q, scale_inv, block)
    assert np.linalg.norm(out - reference) / np.linalg.norm(reference) <= 1e-5
