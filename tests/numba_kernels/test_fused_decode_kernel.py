"""fp8lab.numba_kernels.splitkv.paged_decode_fused_input: the decode split kernel that does the attention input itself.

The independent implementation is the pair of launches it replaces, in the engine's order:
``attention_input.qk_norm_rope_cache_write`` (q-norm, k-norm, RoPE, the paged cache write) and then
``splitkv.paged_decode``. The fused call must give the same bits for ``out``, both caches and both FP8
scales; cache slots it does not write keep their NaN poison. Its model,
``fp8lab.simulators.splitkv.paged_decode_fused_input`` (the composition of the simulators), must give the
same bits too.

- CUDA simulator (``cudasim``, tiny shapes): every cache format; head dims 32 (RoPE partners through shared
  memory), 64, 128 and 256; 1, 2 and 4 query heads per CTA (GQA groups of 2 and 4; ``max_seq_len`` chooses
  the plan's heads per CTA); 1 to 4 splits, with the new token (position ``L - 1``) in the first, a middle
  and the last shard and trailing shards empty; lengths that are and are not multiples of the block size
  and of ``SLOTS * tokens_in_flight`` (the new token in a full group of the split kernel's schedule, and in
  its guarded last group); a length of 1 (only the new token) and padding rows (length 0, slot -1); q, k
  and v as column slices of one fused q/k/v buffer; ``out`` and the split workspace NaN-poisoned before
  the launch. Random data, never zeros. A position outside the RoPE table gives the same NaN rows as the
  two launches. Bad arguments and a broken precondition raise a ``ValueError`` and launch nothing.
- GPU (``gpu``): Qwen3-8B heads (32 query, 8 kv, head dim 128), FP8 cache, batch 1 and 4, contexts about 512
  and 3,000, the ``"auto"`` split count of the engine's context bound: device arrays, bit for bit against
  the two launches on the GPU.
"""

import os

import ml_dtypes
import numpy as np
import pytest
from helpers.numerics import spread_activations
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import layers, splitkv
from fp8lab.numba_kernels.attention_input import qk_norm_rope_cache_write
from fp8lab.simulators import splitkv as sk

EPS = 1e-6
THETA = 1e6
POISON = {"fp8": 0x7F, "bf16": 0x7FC0, "fp32": np.nan}
"""NaN in each cache format (the E4M3 NaN code, BF16 and float32 NaN); FP8 scales are poisoned with NaN."""
STORAGE = {"fp8": np.uint8, "bf16": np.uint16, "fp32": np.float32}
CACHE_NAMES = ("k_cache", "v_cache", "k_scale", "v_scale")


def bits(x: np.ndarray) -> np.ndarray:
    """The bit patterns of an array (NaN payloads and -0.0 count)."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def random_rows(rng, fmt, shape):
    """Cache rows as the kernels store them: random E4M3 codes (no NaN code) with scales, BF16 patterns, float32."""
    if fmt == "fp8":
        codes = rng.integers(0, 256, shape, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 0x01  # the NaN codes become 448 or -448's neighbour
        return codes, (2.0 ** rng.uniform(-10, -4, shape[:-1])).astype(np.float32)
    values = spread_activations(rng, shape, spread=1)
    return (values.astype(ml_dtypes.bfloat16).view(np.uint16) if fmt == "bf16" else values), None


def make_problem(rng, lens, q_heads, kv_heads, head_dim, fmt, block_size, max_positions=128):
    """A decode step: the fused q/k/v GEMM output ``[S, (Hq + 2 Hkv) D]`` of one new token per sequence, and a
    paged cache over a shuffled block pool that holds each sequence's ``L - 1`` earlier tokens; every other
    slot (the new tokens' included) poisoned. Position and slot of the new token follow the precondition;
    a row of length 0 is padding (slot -1)."""
    lens = np.asarray(lens, np.int32)
    num_seqs = len(lens)
    blocks = -(-lens // block_size)
    num_blocks = int(blocks.sum()) + 2  # and blocks nobody uses
    pool = rng.permutation(num_blocks)
    tables = np.full((num_seqs, max(1, int(blocks.max(initial=0)))), -1, np.int32)
    first = np.concatenate([[0], np.cumsum(blocks)])
    for i in range(num_seqs):
        tables[i, : blocks[i]] = pool[first[i] : first[i + 1]]
    shape = (num_blocks, kv_heads, block_size, head_dim)
    caches = {}
    for name in ("k", "v"):
        cache = np.full(shape, POISON[fmt], STORAGE[fmt])
        scales = np.full(shape[:3], np.nan, np.float32) if fmt == "fp8" else None
        for i, length in enumerate(lens):
            for position in range(max(0, int(length) - 1)):  # the earlier tokens; L - 1 is the new one
                block, offset = tables[i, position // block_size], position % block_size
                row, row_scales = random_rows(rng, fmt, (kv_heads, head_dim))
                cache[block, :, offset] = row
                if scales is not None:
                    scales[block, :, offset] = row_scales
        caches[f"{name}_cache"], caches[f"{name}_scale"] = cache, scales
    last = np.maximum(lens - 1, 0)
    slots = np.where(lens > 0, tables[np.arange(num_seqs), last // block_size] * block_size + last % block_size, -1)
    heads = q_heads + 2 * kv_heads
    return dict(
        dims=(num_seqs, q_heads, kv_heads, head_dim),
        fused=spread_activations(rng, (num_seqs, heads, head_dim)).reshape(num_seqs, heads * head_dim),
        q_norm=spread_activations(rng, (head_dim,), spread=1),
        k_norm=spread_activations(rng, (head_dim,), spread=1),
        positions=last.astype(np.int32),
        cos_sin=layers.rope_table(max_positions, head_dim, THETA),
        slot_mapping=slots.astype(np.int32), block_tables=tables, seq_lens=lens,
        softmax_scale=float(head_dim) ** -0.5, **caches,
    )


def column_slices(fused, dims):
    """q, k, v as the engine takes them from the fused GEMM output: column slices (row stride N)."""
    _, q_heads, kv_heads, head_dim = dims
    qd, kd = q_heads * head_dim, kv_heads * head_dim
    return fused[:, :qd], fused[:, qd : qd + kd], fused[:, qd + kd :]


def copies(p):
    return {name: None if p[name] is None else p[name].copy() for name in CACHE_NAMES}


def poisoned_out_and_workspace(p, num_splits):
    num_seqs, q_heads, _, head_dim = p["dims"]
    out = np.full((num_seqs, q_heads, head_dim), np.nan, np.float32)
    workspace = np.full((num_seqs, q_heads, num_splits, head_dim + 2), np.nan, np.float32) if num_splits > 1 else None
    return out, workspace


def two_launches(p, fmt, num_splits, max_seq_len=None):
    """What the engine ran before: ``qk_norm_rope_cache_write``, then ``paged_decode``; out and the caches."""
    num_seqs, q_heads, _, head_dim = p["dims"]
    got = copies(p)
    q, k, v = column_slices(p["fused"], p["dims"])
    q_out = np.full((num_seqs, q_heads, head_dim), np.nan, np.float32)
    qk_norm_rope_cache_write(q, k, v, q_out, p["q_norm"], p["k_norm"], EPS, p["positions"], p["cos_sin"],
                             got["k_cache"], got["v_cache"], p["slot_mapping"], got["k_scale"], got["v_scale"],
                             kv_format=fmt)
    out, workspace = poisoned_out_and_workspace(p, num_splits)
    splitkv.paged_decode(q_out, got["k_cache"], got["v_cache"], p["block_tables"], p["seq_lens"], p["softmax_scale"],
                         out, got["k_scale"], got["v_scale"], num_splits=num_splits, workspace=workspace,
                         kv_format=fmt, max_seq_len=max_seq_len)
    got["out"] = out
    return got


def fused_launch(p, fmt, num_splits, max_seq_len=None):
    """``paged_decode_fused_input`` on copies of the caches (q, k, v column slices); out and the caches."""
    got = copies(p)
    q, k, v = column_slices(p["fused"], p["dims"])
    out, workspace = poisoned_out_and_workspace(p, num_splits)
    splitkv.paged_decode_fused_input(q, k, v, p["q_norm"], p["k_norm"], EPS, p["positions"], p["cos_sin"],
                                     got["k_cache"], got["v_cache"], p["slot_mapping"], p["block_tables"],
                                     p["seq_lens"], p["softmax_scale"], out, got["k_scale"], got["v_scale"],
                                     num_splits=num_splits, workspace=workspace, kv_format=fmt, max_seq_len=max_seq_len)
    got["out"] = out
    return got


def as_float32(cache):
    """A kernel cache as the simulators take it: BF16 patterns widened to float32 (exactly), the rest as it is."""
    return cache.view(ml_dtypes.bfloat16).astype(np.float32) if cache.dtype == np.uint16 else cache.copy()


def simulated(p, fmt, num_splits):
    """The model, ``fp8lab.simulators.splitkv.paged_decode_fused_input``, on NumPy caches (BF16 as float32)."""
    got = {name: None if p[name] is None else as_float32(p[name]) for name in CACHE_NAMES}
    q, k, v = column_slices(p["fused"], p["dims"])
    got["out"] = sk.paged_decode_fused_input(
        q, k, v, p["q_norm"], p["k_norm"], EPS, p["positions"], p["cos_sin"], got["k_cache"], got["v_cache"],
        p["slot_mapping"], p["block_tables"], p["seq_lens"], p["softmax_scale"], got["k_scale"], got["v_scale"],
        num_splits=num_splits, kv_format=fmt)
    return got


def assert_same_bits(got, expected, what):
    for name in ("out",) + CACHE_NAMES:
        if expected[name] is not None:
            np.testing.assert_array_equal(bits(got[name]), bits(expected[name]), err_msg=f"{name} ({what})")


def assert_only_new_slots_written(got, p):
    """Every cache slot but the new tokens' holds what it held before (earlier tokens, or NaN poison)."""
    num_blocks, _, block_size, _ = p["k_cache"].shape
    written = np.zeros(num_blocks * block_size, bool)
    written[p["slot_mapping"][p["slot_mapping"] >= 0]] = True
    for name in CACHE_NAMES:
        if p[name] is None:
            continue
        before, after = (np.moveaxis(x, 1, 2).reshape(num_blocks * block_size, -1) for x in (p[name], got[name]))
        np.testing.assert_array_equal(bits(after[~written]), bits(before[~written]), err_msg=name)
        assert not np.array_equal(bits(after[written]), bits(before[written])), name


def max_seq_len_for(heads, lens):
    """A ``max_seq_len`` (a bound of the lengths) for which the plan puts ``heads`` query heads in a CTA
    (``heads_per_cta``'s caps: 1 up to 2,048 tokens of ``num_seqs * max_seq_len``, 2 up to 8,192, 4 beyond)."""
    tokens = {1: 0, 2: 4096, 4: 16384}[heads]
    return max(int(max(lens)), -(-tokens // len(lens)))


CASES = [  # (cache format, head_dim, q heads, kv heads, heads per CTA, splits, block size, lengths)
    # SLOTS * tokens_in_flight = 16 * 4 = 64: the new token (63) in a full group of the split kernel's schedule
    ("fp8", 128, 4, 1, 4, 1, 16, [64, 0, 3]),
    # 3 splits: the new token in shard 2 (70: 2 blocks per shard, a guarded group), shard 1 (17: shard 2
    # empty), shard 0 (16: shards 1 and 2 empty); a padding row
    ("fp8", 128, 4, 2, 2, 3, 16, [70, 17, 0, 16]),
    # RoPE partners through shared memory (D = 32: 64 slots); lengths not multiples of the block size
    ("fp8", 32, 4, 2, 1, 2, 4, [9, 0, 13]),
    # SLOTS * tokens_in_flight = 32 * 2 = 64 for BF16 at 64; a sequence of the new token alone
    ("bf16", 64, 4, 1, 1, 2, 4, [64, 5, 0, 1]),
    ("bf16", 256, 2, 1, 2, 1, 8, [12, 0, 7]),
    # float32 at 128: SLOTS * tokens_in_flight = 16 (32: full, 47: guarded); 4 heads per CTA
    ("fp32", 128, 4, 1, 4, 2, 16, [32, 47, 0]),
    ("fp32", 64, 4, 2, 2, 4, 4, [23, 8, 0, 2]),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("fmt, head_dim, q_heads, kv_heads, heads, num_splits, block_size, lens", CASES,
                         ids=["-".join(map(str, c[:6])) for c in CASES])
def test_fused_matches_the_two_launches_and_the_simulator_bit_for_bit(rng, fmt, head_dim, q_heads, kv_heads, heads,
                                                                       num_splits, block_size, lens):
    p = make_problem(rng, lens, q_heads, kv_heads, head_dim, fmt, block_size)
    max_seq_len = max_seq_len_for(heads, lens)
    assert sk.heads_per_cta(q_heads // kv_heads, len(lens) * max_seq_len) == heads
    expected = two_launches(p, fmt, num_splits, max_seq_len)
    got = fused_launch(p, fmt, num_splits, max_seq_len)
    assert np.all(np.isfinite(got["out"])) and np.all(got["out"][np.asarray(lens) == 0] == 0)
    assert_same_bits(got, expected, "against the two launches")
    assert_only_new_slots_written(got, p)
    model = simulated(p, fmt, num_splits)
    assert_same_bits({name: None if x is None else as_float32(x) for name, x in got.items()}, model,
                     "against the simulator")


@pytest.mark.cudasim
def test_a_position_outside_the_rope_table_gives_the_same_nan_rows(rng):
    """The new token of sequence 1 lies past the table (a precondition-abiding batch whose positions the table
    does not cover): its q and k are NaN, so its output row and (FP8) K scale are, as with the two launches."""
    p = make_problem(rng, [5, 11], 2, 1, 64, "fp8", 4, max_positions=8)
    expected = two_launches(p, "fp8", 2)
    got = fused_launch(p, "fp8", 2)
    assert np.all(np.isfinite(got["out"][0])) and np.all(np.isnan(got["out"][1]))
    assert np.isnan(got["k_scale"].reshape(-1)[p["slot_mapping"][1]])
    assert_same_bits(got, expected, "against the two launches")


def _with_slot(p, row, slot):
    slots = p["slot_mapping"].copy()
    slots[row] = slot
    return slots


def _q_and_out_in_one_buffer(p):
    q = column_slices(p["fused"], p["dims"])[0].copy()
    return dict(q=q, out=q.reshape(3, 2, 32))


BAD_CALLS = [  # (change: the good call's arguments -> the changed ones, the message the ValueError must match)
    # the good call: lengths [5, 0, 3] in blocks of 4, Hq 2, Hkv 1, D 32, FP8, 2 splits
    (lambda p: dict(alibi_slopes=np.ones(2, np.float32)), "^alibi_slopes: the fused decode has no ALiBi"),
    (lambda p: dict(slot_mapping=_with_slot(p, 0, p["slot_mapping"][0] ^ 1)), "^slot_mapping: row 0 \\(length 5\\)"),
    (lambda p: dict(slot_mapping=_with_slot(p, 1, 7)), "^slot_mapping: row 1 \\(length 0\\) writes slot 7, expected -1"),
    (lambda p: dict(slot_mapping=_with_slot(p, 2, -1)), "^slot_mapping: row 2 \\(length 3\\) writes slot -1"),
    (lambda p: dict(positions=np.array([4, 0, 1], np.int32)),
     "^positions: row 2 \\(length 3\\) is at position 1, expected 2"),
    (lambda p: dict(out=np.ones((3, 2, 32), np.float64)), "^out: expected float32 \\[num_seqs, num_heads, head_dim\\]"),
    (lambda p: dict(out=np.ones((3, 2, 64), np.float32)), "^k_cache: head_dim 32 does not match out's head_dim 64"),
    (lambda p: dict(q=p["fused"][:, :48]), "^q: expected float32 \\[3, 64\\]"),
    (lambda p: dict(k=p["fused"][:, 64:80]), "^k: expected float32 \\[3, 32\\]"),
    (lambda p: dict(v=p["fused"][:, ::4]), "^v: expected contiguous rows"),
    (lambda p: dict(q_norm=np.ones(16, np.float32)), "^q_norm: expected float32 \\[32\\]"),
    (lambda p: dict(positions=p["positions"].astype(np.int64)), "^positions: expected int32 \\[3\\]"),
    (lambda p: dict(slot_mapping=p["slot_mapping"][:2]), "^slot_mapping: expected int32 \\[3\\]"),
    (lambda p: dict(k_scale=None), "^k_cache: an FP8 cache of codes"),
    (lambda p: dict(kv_format="bf16"), "^k_cache: expected .*kv_format bf16"),
    (_q_and_out_in_one_buffer, "^out: overlaps q in memory"),
    (lambda p: dict(num_splits=0), "^num_splits: expected an int from 1"),
    (lambda p: dict(max_seq_len=4), "^max_seq_len: 4 is shorter than the longest sequence \\(5\\)"),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("change, message", BAD_CALLS, ids=[m[1:40] for _, m in BAD_CALLS])
def test_bad_calls_raise_before_launching(rng, change, message):
    p = make_problem(rng, [5, 0, 3], 2, 1, 32, "fp8", 4)
    q, k, v = column_slices(p["fused"], p["dims"])
    kwargs = dict(q=q, k=k, v=v, out=np.full((3, 2, 32), np.nan, np.float32), eps=EPS, kv_format="fp8", num_splits=2,
                  **{name: p[name] for name in ("q_norm", "k_norm", "positions", "cos_sin", "slot_mapping",
                                                 "block_tables", "seq_lens", "softmax_scale") + CACHE_NAMES})
    kwargs.update(change(p))
    snapshot = {name: np.copy(a) for name, a in kwargs.items() if isinstance(a, np.ndarray)}
    with pytest.raises(ValueError, match=message):
        splitkv.paged_decode_fused_input(**kwargs)
    for name, before in snapshot.items():  # nothing was written: nothing was launched
        assert kwargs[name].tobytes() == before.tobytes(), name


# ---------------------------------------------------------------------------- on a GPU, at Qwen3-8B sizes


@pytest.mark.gpu
@pytest.mark.parametrize("batch, context", [(1, 512), (1, 3000), (4, 512), (4, 3000)])
def test_gpu_fused_matches_the_two_launches_at_qwen3_8b_sizes(batch, context):
    """Device arrays as the engine passes them (q, k, v column slices of one device buffer, ``max_seq_len`` the
    engine's context bound, ``"auto"`` splits): out, caches and scales bit for bit against the two launches."""
    from fp8lab.engine.cuda.plan import decode_context_bound

    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    lens = [context - 7 * i for i in range(batch)]  # different lengths: the new tokens in different blocks
    p = make_problem(rng, lens, 32, 8, 128, "fp8", 16, max_positions=40960)
    bound = decode_context_bound(max(lens), 40960)
    splits = sk.choose_num_splits(batch, 32, 8, bound, splitkv.device_num_sms(), 16)

    def run(fused: bool):
        d = {name: cuda.to_device(p[name]) for name in ("q_norm", "k_norm", "positions", "cos_sin", "slot_mapping",
                                                        "block_tables", "seq_lens") + CACHE_NAMES}
        qkv = cuda.to_device(p["fused"])
        q, k, v = column_slices(qkv, p["dims"])
        out = cuda.to_device(np.full((batch, 32, 128), np.nan, np.float32))
        workspace = cuda.to_device(np.full((batch, 32, max(splits, 1), 130), np.nan, np.float32))
        options = dict(num_splits="auto", workspace=workspace, kv_format="fp8", max_seq_len=bound)
        if fused:
            splitkv.paged_decode_fused_input(q, k, v, d["q_norm"], d["k_norm"], EPS, d["positions"], d["cos_sin"],
                                             d["k_cache"], d["v_cache"], d["slot_mapping"], d["block_tables"],
                                             d["seq_lens"], p["softmax_scale"], out, d["k_scale"], d["v_scale"],
                                             **options)
        else:
            q_out = cuda.to_device(np.full((batch, 32, 128), np.nan, np.float32))
            qk_norm_rope_cache_write(q, k, v, q_out, d["q_norm"], d["k_norm"], EPS, d["positions"], d["cos_sin"],
                                     d["k_cache"], d["v_cache"], d["slot_mapping"], d["k_scale"], d["v_scale"],
                                     kv_format="fp8")
            splitkv.paged_decode(q_out, d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"],
                                 p["softmax_scale"], out, d["k_scale"], d["v_scale"], **options)
        cuda.synchronize()
        return dict(out=out.copy_to_host(), **{name: d[name].copy_to_host() for name in CACHE_NAMES})

    try:
        expected, got = run(False), run(True)
        assert np.all(np.isfinite(got["out"]))
        assert_same_bits(got, expected, f"batch {batch}, context {context}, {splits} splits")
        assert_only_new_slots_written(got, p)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}") from error
