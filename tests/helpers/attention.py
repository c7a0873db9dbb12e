"""Shared by the split-kv and prefill tests: the simulator's error bound, ALiBi slopes, filled paged caches,
BF16 rounding of an output, prefill as decode rows and its reference; random paged FP8 batches and the error
bound of the tensor-core decode attention (``paged_fp8``, ``assert_within_mma_bound``); prefill batches over them and
the tensor-core prefill's bound (``prefill_batch``, ``assert_within_prefill_mma_bound``).

``tolerance`` is the bound stated (and derived) in ``tests/simulators/test_splitkv.py``'s docstring.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from fp8lab.reference import attention, e4m3, kv_cache
from fp8lab.reference import strategies as fst
from fp8lab.simulators import splitkv as sk
from fp8lab.simulators import splitkv_mma
from helpers.numerics import U, gamma

EXP2_ULPS = 4
"""ulps of error per float32 ``exp2`` (checked for NumPy's float32 ``exp2`` in test_splitkv)."""


def tolerance(data, slopes, num_splits: int) -> np.ndarray:
    """The error bound of the module docstring, per (sequence, query head): ``[num_seqs, num_heads]``."""
    q = data.q.astype(np.float64)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = data.k_cache.shape[1], data.k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale_log2 = data.softmax_scale * math.log2(math.e)
    tol = np.zeros((num_seqs, num_heads))
    for i, length in enumerate(int(x) for x in data.seq_lens):
        if length == 0:
            continue
        k = kv_cache.gather(data.k_cache, data.k_scale, data.block_tables[i], length).astype(np.float64)
        v = kv_cache.gather(data.v_cache, data.v_scale, data.block_tables[i], length).astype(np.float64)
        bounds = sk.shard_bounds(length, num_splits, block_size)
        slots = sk.num_slots(head_dim)
        tokens_per_slot = int(np.max(-(-(bounds[:, 1] - bounds[:, 0]) // slots)))
        for h in range(num_heads):
            kv = h // group
            b = np.max(np.abs(k[:, kv, :]) @ np.abs(q[i, h])) * scale_log2
            a = 0.0 if slopes is None else abs(float(slopes[h])) * (length - 1) * math.log2(math.e)
            delta = gamma(sk.ELEMENTS_PER_LANE + 9) * (b + a)
            eta = math.log(2) * delta + (tokens_per_slot + 3) * (EXP2_ULPS * U + 2 * U)
            v_max = np.max(np.abs(v[:, kv, :]))
            relative = (2 * eta / (1 - eta) + 2 * math.log(2) * 0.531 * U * length
                        + 2 * gamma(2 * tokens_per_slot + slots + num_splits + 4) + 3 * U)
            tol[i, h] = relative * v_max + length * 2.0**-140
    return tol


def random_slopes(rng, num_heads: int) -> np.ndarray:
    return (2.0 ** -rng.uniform(0, 8, num_heads)).astype(np.float32)


def bf16_cache(float_cache: np.ndarray) -> np.ndarray:
    """A float32 cache rounded to BF16, as the uint16 patterns the kernel takes."""
    return float_cache.astype(ml_dtypes.bfloat16).view(np.uint16)


def as_float32(cache: np.ndarray) -> np.ndarray:
    """What a cache holds as float32 (BF16 patterns widened exactly); FP8 codes stay codes."""
    return cache.view(ml_dtypes.bfloat16).astype(np.float32) if cache.dtype == np.uint16 else cache


def filled_cache(rng, lens, block_size, num_kv_heads, head_dim, cache):
    """A paged FP8 or BF16 cache written by the reference, plus block tables over a shuffled pool."""
    blocks = -(-np.asarray(lens) // block_size)
    num_blocks = int(blocks.sum()) + 3
    pool = rng.permutation(num_blocks)
    tables = np.full((len(lens), max(1, int(blocks.max()))), -1, np.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = pool[start : start + n]
        start += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = []
    for _ in range(2):
        if cache == "fp8":
            codes, scales = np.full(shape, 0x7F, np.uint8), np.full(shape[:3], np.nan, np.float32)
        else:
            codes, scales = np.full(shape, np.nan, np.float32), None
        for table, n in zip(tables, lens):
            x = rng.standard_normal((int(n), num_kv_heads, head_dim)).astype(np.float32)
            x *= rng.uniform(0.1, 4.0, (int(n), num_kv_heads, 1)).astype(np.float32)
            kv_cache.write(codes, scales, x, kv_cache.slots_for_positions(table, np.arange(n), block_size))
        caches.append((codes if cache == "fp8" else bf16_cache(codes), scales))
    return caches, tables


def bf16_rounded(out) -> np.ndarray:
    """``layers.bf16_round`` of a float32 attention output (its own launch): the two-step path that a
    uint16 ``out`` must equal bit for bit. The result array starts poisoned with 0x1234."""
    # A kernel module, imported here: only the kernel tests that call this need numba.
    from fp8lab.numba_kernels import layers

    return layers.bf16_round(out, np.full(out.shape, 0x1234, np.uint16))


def prefill_rows(tables, context_lens, query_lens):
    """Causal prefill as decode rows, written out by hand: one (table row, causal length) per query token
    (query ``i`` of sequence ``s`` reads ``context_lens[s] - query_lens[s] + i + 1`` tokens)."""
    row_tables, row_lens = [], []
    for s in range(len(context_lens)):
        for i in range(int(query_lens[s])):
            row_tables.append(tables[s])
            row_lens.append(int(context_lens[s]) - int(query_lens[s]) + i + 1)
    if not row_tables:
        return np.zeros((0, tables.shape[1]), np.int32), np.zeros(0, np.int32)
    return np.array(row_tables, np.int32), np.array(row_lens, np.int32)


def reference_prefill(q, k_cache, v_cache, k_scale, v_scale, tables, context_lens, query_lens, softmax_scale):
    """``fp8lab.reference.attention.prefill`` per sequence over its gathered cache (BF16 caches widened exactly)."""
    k_cache, v_cache = as_float32(k_cache), as_float32(v_cache)
    out, start = [], 0
    for table, context_len, n in zip(tables, context_lens, query_lens):
        k = kv_cache.gather(k_cache, k_scale, table, int(context_len))
        v = kv_cache.gather(v_cache, v_scale, table, int(context_len))
        out.append(attention.prefill(q[start : start + n], k, v, softmax_scale))
        start += int(n)
    return np.concatenate(out)


def paged_layout(rng, lens, num_heads, num_kv_heads, head_dim, block_size, spare_blocks=1) -> fst.PagedKVLayout:
    """A paged batch's layout: each sequence's blocks drawn from a permuted pool, block tables padded with -1."""
    lens = np.asarray(lens, np.int32)
    blocks = -(-lens // block_size)
    num_blocks = int(blocks.sum()) + spare_blocks
    pool = rng.permutation(num_blocks)
    tables = np.full((len(lens), max(1, int(blocks.max(initial=0)))), -1, np.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = pool[start : start + n]
        start += n
    return fst.PagedKVLayout(num_heads, num_kv_heads, head_dim, block_size, num_blocks, tables, lens)


def paged_fp8(rng, lens, num_heads, num_kv_heads, head_dim, block_size, spare_blocks=1):
    """A random paged FP8 batch (``paged_layout``) with NaN-poisoned unused slots."""
    return paged_layout(rng, lens, num_heads, num_kv_heads, head_dim, block_size, spare_blocks).random_data(rng, fp8=True)


def assert_within_mma_bound(data, out):
    """``out`` (the tensor-core decode attention) within ``fp8lab.simulators.splitkv_mma.error_bound`` of the float64 reference for every sequence (zeros for length 0); no NaN."""
    assert not np.isnan(out).any()
    ref = attention.paged_decode(data.q, data.k_cache, data.v_cache, data.block_tables, data.seq_lens,
                                 data.softmax_scale, data.k_scale, data.v_scale)
    for seq, length in enumerate(data.seq_lens):
        if length == 0:
            assert (out[seq] == 0).all()
            continue
        bound = splitkv_mma.error_bound(data.q[seq], *exact_tokens(data, seq, length), data.softmax_scale)
        err = np.abs(out[seq].astype(np.float64) - ref[seq])
        assert (err <= bound).all(), f"sequence {seq}: error / bound up to {np.max(err / bound):.3g}"


def prefill_batch(rng, context_lens, query_lens, group, num_kv_heads, block_size, cache="fp8"):
    """A paged batch holding ``context_lens`` tokens per sequence, and fresh queries for the last ``query_lens``: an
    FP8 cache (``cache="fp8"``) or, ``"bf16"``, the same random K/V rounded to BF16 (uint16 patterns, no scales);
    NaN-poisoned unused slots either way."""
    lens = np.asarray(context_lens)
    data = paged_layout(rng, lens, group * num_kv_heads, num_kv_heads, 128, block_size).random_data(
        rng, fp8=cache == "fp8")
    if cache == "bf16":
        data = dataclasses.replace(data, k_cache=bf16_cache(data.k_cache), v_cache=bf16_cache(data.v_cache))
    q = rng.standard_normal((int(np.sum(query_lens)), group * num_kv_heads, 128)).astype(np.float32)
    return data, q, np.asarray(query_lens, np.int64)


def exact_tokens(data, seq, length):
    """``(k_values, v_values, k_scale, v_scale)`` of a sequence's first ``length`` tokens, ``[kv, L, D]`` and ``[kv,
    L]``: FP8 codes decoded with their scales apart, BF16 patterns widened with scales of 1."""
    block_size = data.k_cache.shape[2]
    slots = [(data.block_tables[seq, j // block_size], j % block_size) for j in range(int(length))]

    def values(cache):
        entries = np.stack([cache[b, :, o] for b, o in slots], axis=1)
        return e4m3.VALUES[entries] if cache.dtype == np.uint8 else as_float32(entries)

    if data.k_cache.dtype != np.uint8:
        ones = np.ones((data.k_cache.shape[1], int(length)), np.float32)
        return values(data.k_cache), values(data.v_cache), ones, ones
    ks = np.stack([data.k_scale[b, :, o] for b, o in slots], axis=1)
    vs = np.stack([data.v_scale[b, :, o] for b, o in slots], axis=1)
    return values(data.k_cache), values(data.v_cache), ks, vs


def assert_within_prefill_mma_bound(data, q, query_lens, out, operand=None):
    """``out`` (the tensor-core flash prefill) with every query within ``fp8lab.simulators.splitkv_mma.error_bound``
    over its causal prefix of the float64 reference, for the operand format (default: F16 for an FP8 cache, BF16 for
    a BF16 one); no NaN."""
    assert out.shape == q.shape and not np.isnan(out).any()
    ref = reference_prefill(q, data.k_cache, data.v_cache, data.k_scale, data.v_scale, data.block_tables,
                            data.seq_lens, query_lens, data.softmax_scale)
    operand = operand or ("f16" if data.k_cache.dtype == np.uint8 else "bf16")
    row = 0
    for seq, (context, n) in enumerate(zip(data.seq_lens, query_lens)):
        if n == 0:
            continue
        k, v, ks, vs = exact_tokens(data, seq, context)
        for i in range(int(n)):
            keys = int(context) - int(n) + i + 1
            bound = splitkv_mma.error_bound(q[row], k[:, :keys], v[:, :keys], ks[:, :keys], vs[:, :keys],
                                            data.softmax_scale, operand)
            err = np.abs(out[row].astype(np.float64) - ref[row])
            assert (err <= bound).all(), f"sequence {seq}, query {i}: error / bound up to {np.max(err / bound):.3g}"
            row += 1


def paged_prefill_arguments(q, k, v, softmax_scale, k_scale, v_scale, block_size: int = 16):
    """``fp8lab.testing.check_prefill``'s dense K and V (one sequence) written into a paged cache whose blocks come in
    reverse order, the slots past the sequence NaN-poisoned: ``(q, k_cache, v_cache, block_tables, context_lens,
    query_lens, softmax_scale, k_scale, v_scale)`` as ``prefill.paged_prefill`` takes them (``out`` goes between
    ``softmax_scale`` and the scales) and ``fp8lab.simulators.prefill_mma.paged_prefill``."""
    s, kv_heads, head_dim = k.shape
    num_blocks = -(-s // block_size)
    table = np.arange(num_blocks, dtype=np.int32)[::-1].copy()
    slots = table[np.arange(s) // block_size] * block_size + np.arange(s) % block_size
    caches = []
    for x, scale in ((k, k_scale), (v, v_scale)):
        cache = np.full((num_blocks * block_size, kv_heads, head_dim), 0x7F if scale is not None else np.nan, x.dtype)
        cache[slots] = x
        cache = np.ascontiguousarray(cache.reshape(num_blocks, block_size, kv_heads, head_dim).transpose(0, 2, 1, 3))
        scales = None
        if scale is not None:
            flat = np.full((num_blocks * block_size, kv_heads), np.nan, np.float32)
            flat[slots] = scale
            scales = np.ascontiguousarray(flat.reshape(num_blocks, block_size, kv_heads).transpose(0, 2, 1))
        caches.append((cache, scales))
    (k_cache, k_scales), (v_cache, v_scales) = caches
    return (q, k_cache, v_cache, table[None], np.array([s], np.int32), np.array([q.shape[0]], np.int32), softmax_scale,
            k_scales, v_scales)
