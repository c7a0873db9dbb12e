"""fp8lab.numba_kernels.attention_input: q/k-norm, RoPE and the paged cache write in one launch.

The independent implementation is the sequence of existing kernels the engine ran before:
``layers.rms_norm`` on q and on k, ``layers.rope`` on q and on k, ``kv_cache.paged_cache_write`` of k
and v (on copies of the same inputs). The fused kernel must give the same bits for q, k, both
caches and the FP8 scales.

- CUDA simulator (``cudasim``, tiny shapes: T 1..5, (Hq, Hkv) in (4, 2), (2, 2), (4, 1), D 8, 16,
  64, every cache format, block size 4): q, k, v views of one flat buffer (as the engine's), some
  padding slots (-1), outputs and caches poisoned with NaN; bit for bit against the sequence, and
  every slot not written still holds its poison. A position outside the table gives NaN q and k
  (and, for an FP8 cache, a NaN scale), as the sequence does. Bad arguments raise a ``ValueError``
  naming the argument and launch nothing.
- GPU (``gpu``, Qwen3-8B: Hq 32, Hkv 8, D 128, T 1 and 16, FP8 cache): device arrays, bit for bit
  against the same sequence on the GPU.
"""

import os

import numpy as np
import pytest
from helpers.numerics import spread_activations

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import attention_input, layers
from fp8lab.numba_kernels.kv_cache import paged_cache_write

BLOCK_SIZE = 4
EPS = 1e-6
THETA = 1e6
POISON = {"fp8": 0x7F, "bf16": 0x7FC0, "fp32": np.nan}
"""NaN in each cache format (the E4M3 NaN code, BF16 and float32 NaN); FP8 scales are poisoned with NaN."""
STORAGE = {"fp8": np.uint8, "bf16": np.uint16, "fp32": np.float32}


def poisoned_cache(fmt, num_blocks, kv_heads, head_dim):
    """Caches and scales (None unless FP8) full of NaN: what the kernel leaves alone stays NaN."""
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    caches = [np.full(shape, POISON[fmt], STORAGE[fmt]) for _ in range(2)]
    scales = [np.full(shape[:3], np.nan, np.float32) if fmt == "fp8" else None for _ in range(2)]
    return caches, scales


def make_problem(rng, tokens, q_heads, kv_heads, head_dim, fmt, max_positions=64):
    """Random inputs: q, k, v as disjoint views of one flat buffer (the engine's layout) and poisoned caches."""
    qd, kd = q_heads * head_dim, kv_heads * head_dim
    qkv = spread_activations(rng, (tokens, q_heads + 2 * kv_heads, head_dim)).reshape(-1)
    num_blocks = -(-tokens // BLOCK_SIZE) + 1  # room for every token, and slots nobody writes
    slots = rng.permutation(num_blocks * BLOCK_SIZE)[:tokens].astype(np.int32)
    slots[rng.random(tokens) < 0.3] = -1  # padding tokens
    caches, scales = poisoned_cache(fmt, num_blocks, kv_heads, head_dim)
    return dict(
        qkv=qkv,
        q=qkv[: tokens * qd].reshape(tokens, q_heads, head_dim),
        k=qkv[tokens * qd : tokens * (qd + kd)].reshape(tokens, kv_heads, head_dim),
        v=qkv[tokens * (qd + kd) :].reshape(tokens, kv_heads, head_dim),
        q_norm=spread_activations(rng, (head_dim,), spread=1),
        k_norm=spread_activations(rng, (head_dim,), spread=1),
        positions=rng.integers(0, max_positions, tokens).astype(np.int32),
        cos_sin=layers.rope_table(max_positions, head_dim, THETA),
        k_cache=caches[0], v_cache=caches[1], k_scale=scales[0], v_scale=scales[1], slot_mapping=slots,
    )


def copied(problem):
    """A deep copy, with q, k, v again views of one fresh flat buffer."""
    out = {name: None if x is None else np.copy(x) for name, x in problem.items()}
    qkv = out["qkv"]
    sizes = [problem[n].size for n in ("q", "k", "v")]
    starts = np.cumsum([0] + sizes)
    for name, start, size in zip(("q", "k", "v"), starts, sizes):
        out[name] = qkv[start : start + size].reshape(problem[name].shape)
    return out


def fused(p, fmt, stream=0):
    attention_input.qk_norm_rope_cache_write(
        p["q"], p["k"], p["v"], p["q_norm"], p["k_norm"], EPS, p["positions"], p["cos_sin"], p["k_cache"],
        p["v_cache"], p["slot_mapping"], p["k_scale"], p["v_scale"], kv_format=fmt, stream=stream)


def sequence(p, fmt, stream=0):
    """The four launches the fused kernel replaces, in the engine's order."""
    tokens, q_heads, head_dim = p["q"].shape
    q2 = p["q"].reshape(tokens * q_heads, head_dim)
    k2 = p["k"].reshape(-1, head_dim)
    layers.rms_norm(q2, p["q_norm"], EPS, q2, stream=stream)
    layers.rms_norm(k2, p["k_norm"], EPS, k2, stream=stream)
    layers.rope(p["q"], p["positions"], p["cos_sin"], p["q"], stream=stream)
    layers.rope(p["k"], p["positions"], p["cos_sin"], p["k"], stream=stream)
    paged_cache_write(p["k"], p["v"], p["k_cache"], p["v_cache"], p["slot_mapping"], p["k_scale"], p["v_scale"],
                      kv_format=fmt, stream=stream, check_slots=False)


def bits(x: np.ndarray) -> np.ndarray:
    """The bit patterns of an array (NaN payloads and -0.0 count)."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_same_bits(got, expected):
    for name in ("q", "k", "v", "k_cache", "v_cache", "k_scale", "v_scale"):
        if expected[name] is not None:
            np.testing.assert_array_equal(bits(got[name]), bits(expected[name]), err_msg=name)


def assert_only_used_slots_written(p, fmt):
    """Every cache slot not in ``slot_mapping`` still holds its poison; every used one holds no poison scale."""
    num_blocks = p["k_cache"].shape[0]
    written = np.zeros(num_blocks * BLOCK_SIZE, bool)
    written[p["slot_mapping"][p["slot_mapping"] >= 0]] = True
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        x = p[name]
        if x is None:
            continue
        rows = np.moveaxis(x, 1, 2).reshape(num_blocks * BLOCK_SIZE, -1)  # [slot, heads (* head_dim)]
        poison = np.isnan(rows) if rows.dtype.kind == "f" else rows == POISON[fmt]
        assert np.all(poison[~written]), name
        if name.endswith("scale"):
            assert not np.any(np.isnan(rows[written])), name


CASES = [  # (tokens, q_heads, kv_heads, head_dim, cache format): every D with every format, each head layout
    (3, 4, 2, 8, "fp8"), (5, 2, 2, 8, "bf16"), (1, 4, 1, 8, "fp32"),
    (2, 2, 2, 16, "fp8"), (4, 4, 1, 16, "bf16"), (3, 4, 2, 16, "fp32"),
    (5, 4, 1, 64, "fp8"), (1, 4, 2, 64, "bf16"), (2, 2, 2, 64, "fp32"),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, fmt", CASES)
def test_fused_matches_the_kernel_sequence_bit_for_bit(rng, tokens, q_heads, kv_heads, head_dim, fmt):
    p = make_problem(rng, tokens, q_heads, kv_heads, head_dim, fmt)
    p["slot_mapping"][0] = max(p["slot_mapping"][0], 0)  # at least one token is written
    expected = copied(p)
    sequence(expected, fmt)
    fused(p, fmt)
    assert np.all(np.isfinite(p["q"])) and np.all(np.isfinite(p["k"]))
    assert_same_bits(p, expected)
    assert_only_used_slots_written(p, fmt)


@pytest.mark.cudasim
@pytest.mark.parametrize("fmt", ["fp8", "fp32"])
def test_position_outside_the_table_gives_nan(rng, fmt):
    p = make_problem(rng, 4, 2, 1, 16, fmt, max_positions=8)
    p["positions"][:] = [3, -1, 8, 7]
    p["slot_mapping"][:] = [0, 1, 2, 3]
    expected = copied(p)
    sequence(expected, fmt)
    fused(p, fmt)
    assert np.all(np.isnan(p["q"][1:3])) and np.all(np.isnan(p["k"][1:3]))
    assert np.all(np.isfinite(p["q"][[0, 3]])) and np.all(np.isfinite(p["k"][[0, 3]]))
    if fmt == "fp8":  # the NaN reaches the cache as a NaN scale: attention over that token gives NaN
        assert np.all(np.isnan(p["k_scale"][0, 0, 1:3])) and np.all(np.isfinite(p["v_scale"][0, 0, :]))
    assert_same_bits(p, expected)


@pytest.mark.cudasim
def test_zero_tokens_launch_nothing(rng):
    p = make_problem(rng, 1, 2, 1, 16, "fp8")
    empty = {name: p[name][:0] for name in ("q", "k", "v", "positions", "slot_mapping")}
    before = p["k_cache"].copy()
    attention_input.qk_norm_rope_cache_write(
        empty["q"], empty["k"], empty["v"], p["q_norm"], p["k_norm"], EPS, empty["positions"], p["cos_sin"],
        p["k_cache"], p["v_cache"], empty["slot_mapping"], p["k_scale"], p["v_scale"])
    np.testing.assert_array_equal(p["k_cache"], before)


def _bad_calls():
    """(change to a good call's arguments, the message the ValueError must match)."""
    r = np.random.default_rng(0)
    flat = np.zeros(2 * 4 * 16, np.float32)
    return [
        (dict(q=np.ones((2, 2, 16), np.float64)), "^q: expected float32 \\[T, Hq, head_dim\\]"),
        (dict(q=np.ones((2, 2, 15), np.float32)), "^q: expected .*head_dim even"),
        (dict(q=np.ones((2, 2, 258), np.float32)), "^q: expected .*at most 256"),
        (dict(q=np.ones((2, 2, 32), np.float32)[:, :, ::2]), "^q: expected a C-contiguous"),
        (dict(k=np.ones((2, 2, 16), np.float32)), "^k: expected float32 \\[2, 1, 16\\]"),
        (dict(v=np.ones((3, 1, 16), np.float32)), "^v: expected float32 \\[2, 1, 16\\]"),
        (dict(q_norm=np.ones(8, np.float32)), "^q_norm: expected float32 \\[16\\]"),
        (dict(k_norm=np.ones(16, np.float64)), "^k_norm: expected float32 \\[16\\]"),
        (dict(positions=np.zeros(2, np.int64)), "^positions: expected int32 \\[2\\]"),
        (dict(cos_sin=layers.rope_table(8, 32, 1e4)), "^cos_sin: expected float32 \\[max_positions, 16\\]"),
        (dict(slot_mapping=np.zeros(2, np.int64)), "^slot_mapping: expected int32 \\[2\\]"),
        (dict(slot_mapping=np.zeros(3, np.int32)), "^slot_mapping: expected int32 \\[2\\]"),
        (dict(k_scale=None), "^k_cache: an FP8 cache of codes"),
        (dict(v_scale=np.ones((2, 1, 3), np.float32)), "^v_scale: expected float32 scales"),
        (dict(v_cache=np.zeros((2, 1, 4, 8), np.uint8)), "^v_cache: expected the shape"),
        (dict(k_cache=np.zeros((2, 1, 4, 8), np.uint8), v_cache=np.zeros((2, 1, 4, 8), np.uint8)),
         "^k_cache: expected .*16\\] \\(q's head_dim\\)"),
        (dict(kv_format="bf16"), "^k_cache: expected .*kv_format bf16"),
        (dict(q=flat[:64].reshape(2, 2, 16), k=flat[48:80].reshape(2, 1, 16)), "^k: overlaps q in memory"),
        (dict(q=[[[1.0] * 16] * 2] * 2), "^q: expected a NumPy array"),
        (dict(q_norm=r.standard_normal(16)), "^q_norm: expected float32"),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.cudasim
@pytest.mark.parametrize("change, message", BAD_CALLS, ids=[m[1:40] for _, m in BAD_CALLS])
def test_bad_calls_raise_before_launching(rng, change, message):
    p = make_problem(rng, 2, 2, 1, 16, "fp8")
    kwargs = {name: p[name] for name in ("q", "k", "v", "q_norm", "k_norm", "positions", "cos_sin", "k_cache",
                                         "v_cache", "slot_mapping", "k_scale", "v_scale")}
    kwargs.update(eps=EPS, kv_format="fp8")
    kwargs.update(change)
    snapshot = {name: np.copy(a) for name, a in kwargs.items() if isinstance(a, np.ndarray)}
    with pytest.raises(ValueError, match=message):
        attention_input.qk_norm_rope_cache_write(**kwargs)
    for name, before in snapshot.items():  # nothing was written: nothing was launched
        assert kwargs[name].tobytes() == before.tobytes(), name


# ---------------------------------------------------------------------------- on a GPU, at Qwen3-8B sizes


def on_device(p):
    """The problem as device arrays (q, k, v views of one device buffer, as the engine's)."""
    from numba import cuda

    d = {name: None if x is None else cuda.to_device(x) for name, x in p.items() if name not in ("q", "k", "v")}
    sizes = [p[n].size for n in ("q", "k", "v")]
    starts = np.cumsum([0] + sizes)
    for name, start, size in zip(("q", "k", "v"), starts, sizes):
        d[name] = d["qkv"][start : start + size].reshape(p[name].shape)
    return d


def to_host(d):
    return {name: None if x is None else x.copy_to_host() for name, x in d.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_fused_matches_the_kernel_sequence_at_qwen3_8b_sizes(tokens):
    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    p = make_problem(rng, tokens, 32, 8, 128, "fp8", max_positions=40960)
    p["slot_mapping"][0] = max(p["slot_mapping"][0], 0)
    got, expected = on_device(p), on_device(p)
    sequence(expected, "fp8")
    fused(got, "fp8")
    got, expected = to_host(got), to_host(expected)
    try:
        assert np.all(np.isfinite(got["q"])) and np.all(np.isfinite(got["k"]))
        assert_same_bits(got, expected)
        assert_only_used_slots_written(got, "fp8")
    except AssertionError as error:
        raise AssertionError(f"seed {seed}") from error
