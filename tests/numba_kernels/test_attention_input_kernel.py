"""fp8lab.numba_kernels.attention_input: q/k-norm, RoPE and the paged cache write in one launch.

The independent implementation is the sequence of existing kernels the engine ran before:
``layers.rms_norm`` on q and on k, ``layers.rope`` on q and on k, ``kv_cache.paged_cache_write`` of k
and v (on C-contiguous copies of the same inputs). The fused kernel must give the same bits for q_out,
both caches and the FP8 scales, and leave q, k and v as they were (unless q_out is q).

- CUDA simulator (``cudasim``, tiny shapes: T 1..3, (Hq, Hkv) in (4, 2), (2, 2), (4, 1), D 8, 16,
  64, every cache format, block size 4), every case in both layouts: q, k, v column slices of one
  fused ``[T, (Hq + 2 Hkv) D]`` device buffer (the fused GEMM output) with q_out its own buffer; and
  separate C-contiguous device arrays with q_out the memory of q (in place). Some padding slots (-1),
  q_out and caches poisoned with NaN; bit for bit against the sequence, and every slot not written
  still holds its poison. A position outside the table gives a NaN q_out (and, for an FP8 cache, a
  NaN k scale), as the sequence does (NumPy inputs: the wrapper's host path). Bad arguments raise a
  ``ValueError`` naming the argument and launch nothing.
- GPU (``gpu``, Qwen3-8B: Hq 32, Hkv 8, D 128, T 1 and 16, FP8 cache): fused-slice device arrays, bit
  for bit against the same sequence on the GPU.
"""

import os

import numpy as np
import pytest
from helpers.numerics import spread_activations
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import attention_input, layers
from fp8lab.numba_kernels.kv_cache import paged_cache_write

BLOCK_SIZE = 4
EPS = 1e-6
THETA = 1e6
POISON = {"fp8": 0x7F, "bf16": 0x7FC0, "fp32": np.nan}
"""NaN in each cache format (the E4M3 NaN code, BF16 and float32 NaN); FP8 scales are poisoned with NaN."""
STORAGE = {"fp8": np.uint8, "bf16": np.uint16, "fp32": np.float32}
CACHE_NAMES = ("k_cache", "v_cache", "k_scale", "v_scale")
LAYOUTS = ("fused slices", "in place")


def poisoned_cache(fmt, num_blocks, kv_heads, head_dim):
    """Caches and scales (None unless FP8) full of NaN: what the kernel leaves alone stays NaN."""
    shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
    caches = [np.full(shape, POISON[fmt], STORAGE[fmt]) for _ in range(2)]
    scales = [np.full(shape[:3], np.nan, np.float32) if fmt == "fp8" else None for _ in range(2)]
    return caches, scales


def make_problem(rng, tokens, q_heads, kv_heads, head_dim, fmt, max_positions=64):
    """Random inputs: the fused q/k/v GEMM output ``[T, (Hq + 2 Hkv) D]`` and poisoned caches."""
    heads = q_heads + 2 * kv_heads
    num_blocks = -(-tokens // BLOCK_SIZE) + 1  # room for every token, and slots nobody writes
    slots = rng.permutation(num_blocks * BLOCK_SIZE)[:tokens].astype(np.int32)
    slots[rng.random(tokens) < 0.3] = -1  # padding tokens
    caches, scales = poisoned_cache(fmt, num_blocks, kv_heads, head_dim)
    return dict(
        dims=(tokens, q_heads, kv_heads, head_dim),
        fused=spread_activations(rng, (tokens, heads, head_dim)).reshape(tokens, heads * head_dim),
        q_norm=spread_activations(rng, (head_dim,), spread=1),
        k_norm=spread_activations(rng, (head_dim,), spread=1),
        positions=rng.integers(0, max_positions, tokens).astype(np.int32),
        cos_sin=layers.rope_table(max_positions, head_dim, THETA),
        k_cache=caches[0], v_cache=caches[1], k_scale=scales[0], v_scale=scales[1], slot_mapping=slots,
    )


def write_token_zero(p):
    """At least one token is written: token 0, if it is padding, gets a slot no other token has (two tokens on one
    slot are an error, which ``sequence``'s cache write would raise: which write wins is not defined)."""
    slots = p["slot_mapping"]
    if slots[0] < 0:
        slots[0] = np.setdiff1d(np.arange(p["k_cache"].shape[0] * BLOCK_SIZE), slots)[0]


def column_slices(fused, dims):
    """q, k, v as the engine takes them from the fused GEMM output: column slices (row stride N)."""
    _, q_heads, kv_heads, head_dim = dims
    qd, kd = q_heads * head_dim, kv_heads * head_dim
    return fused[:, :qd], fused[:, qd : qd + kd], fused[:, qd + kd :]


def sequence(p, fmt):
    """The four launches the fused kernel replaces, in the engine's order, on contiguous copies; the results."""
    tokens, q_heads, kv_heads, head_dim = p["dims"]
    q, k, v = (x.copy() for x in column_slices(p["fused"], p["dims"]))  # C-contiguous copies
    q3, k3, v3 = q.reshape(tokens, q_heads, head_dim), k.reshape(tokens, kv_heads, head_dim), v.reshape(
        tokens, kv_heads, head_dim)
    out = {name: None if p[name] is None else np.copy(p[name]) for name in CACHE_NAMES}
    q2, k2 = q.reshape(-1, head_dim), k.reshape(-1, head_dim)
    layers.rms_norm(q2, p["q_norm"], EPS, q2)
    layers.rms_norm(k2, p["k_norm"], EPS, k2)
    layers.rope(q3, p["positions"], p["cos_sin"], q3)
    layers.rope(k3, p["positions"], p["cos_sin"], k3)
    paged_cache_write(k3, v3, out["k_cache"], out["v_cache"], p["slot_mapping"], out["k_scale"], out["v_scale"],
                      kv_format=fmt)  # checks the slots: each used once, as the engine gives them
    out["q_out"] = q3
    return out


def host(x):
    return x if x is None or isinstance(x, np.ndarray) else x.copy_to_host()


def fused_call(p, fmt, layout, device=True, stream=0):
    """The fused kernel on ``p`` in ``layout``; the results (q_out, caches, scales) and q, k, v after the call.

    "fused slices": q, k, v column slices of one fused buffer, q_out its own NaN-poisoned buffer; "in
    place": q, k, v separate C-contiguous arrays, q_out the memory of q. ``device``: Numba device arrays
    (the engine's case, read in place with their strides), else NumPy arrays.
    """
    tokens, q_heads, _, head_dim = p["dims"]
    put = cuda.to_device if device else np.copy
    a = {name: None if p[name] is None else put(p[name]) for name in
         ("q_norm", "k_norm", "positions", "cos_sin", "slot_mapping") + CACHE_NAMES}
    if layout == "fused slices":
        fused = put(p["fused"])
        q, k, v = column_slices(fused, p["dims"])
        q_out = put(np.full((tokens, q_heads, head_dim), np.nan, np.float32))
    else:
        q, k, v = (put(x.copy()) for x in column_slices(p["fused"], p["dims"]))
        q_out = q.reshape(tokens, q_heads, head_dim)
    attention_input.qk_norm_rope_cache_write(
        q, k, v, q_out, a["q_norm"], a["k_norm"], EPS, a["positions"], a["cos_sin"], a["k_cache"], a["v_cache"],
        a["slot_mapping"], a["k_scale"], a["v_scale"], kv_format=fmt, stream=stream)
    got = {name: host(a[name]) for name in CACHE_NAMES}
    # q, k, v read back through their contiguous buffers (a strided device array's copy is not portable)
    after = column_slices(host(fused), p["dims"]) if layout == "fused slices" else (host(q), host(k), host(v))
    got.update(q_out=host(q_out), q=after[0], k=after[1], v=after[2])
    return got


def bits(x: np.ndarray) -> np.ndarray:
    """The bit patterns of an array (NaN payloads and -0.0 count)."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_same_bits(got, expected, p, layout):
    for name in ("q_out",) + CACHE_NAMES:
        if expected[name] is not None:
            np.testing.assert_array_equal(bits(got[name]), bits(expected[name]), err_msg=f"{name} ({layout})")
    # only read: k and v keep their values, and q too unless q_out is q
    for name, before in zip(("q", "k", "v"), column_slices(p["fused"], p["dims"])):
        if not (name == "q" and layout == "in place"):
            np.testing.assert_array_equal(bits(got[name]), bits(before), err_msg=f"{name} ({layout})")


def assert_only_used_slots_written(got, slot_mapping, fmt):
    """Every cache slot not in ``slot_mapping`` still holds its poison; every used one holds no poison scale."""
    num_blocks = got["k_cache"].shape[0]
    written = np.zeros(num_blocks * BLOCK_SIZE, bool)
    written[slot_mapping[slot_mapping >= 0]] = True
    for name in CACHE_NAMES:
        x = got[name]
        if x is None:
            continue
        rows = np.moveaxis(x, 1, 2).reshape(num_blocks * BLOCK_SIZE, -1)  # [slot, heads (* head_dim)]
        poison = np.isnan(rows) if rows.dtype.kind == "f" else rows == POISON[fmt]
        assert np.all(poison[~written]), name
        if name.endswith("scale"):
            assert not np.any(np.isnan(rows[written])), name


CASES = [  # (tokens, q_heads, kv_heads, head_dim, cache format): every D with every format, each head layout
    (2, 4, 2, 8, "fp8"), (3, 2, 2, 8, "bf16"), (1, 4, 1, 8, "fp32"),
    (2, 2, 2, 16, "fp8"), (3, 4, 1, 16, "bf16"), (2, 4, 2, 16, "fp32"),
    (3, 4, 1, 64, "fp8"), (1, 4, 2, 64, "bf16"), (2, 2, 2, 64, "fp32"),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, fmt", CASES)
def test_fused_matches_the_kernel_sequence_bit_for_bit(rng, tokens, q_heads, kv_heads, head_dim, fmt):
    p = make_problem(rng, tokens, q_heads, kv_heads, head_dim, fmt)
    write_token_zero(p)
    expected = sequence(p, fmt)
    for layout in LAYOUTS:  # one sequence, both layouts
        got = fused_call(p, fmt, layout)
        assert np.all(np.isfinite(got["q_out"])), layout
        assert_same_bits(got, expected, p, layout)
        assert_only_used_slots_written(got, p["slot_mapping"], fmt)


@pytest.mark.cudasim
@pytest.mark.parametrize("fmt, layout", [("fp8", "fused slices"), ("fp32", "in place")])
def test_position_outside_the_table_gives_nan(rng, fmt, layout):
    p = make_problem(rng, 4, 2, 1, 16, fmt, max_positions=8)
    p["positions"][:] = [3, -1, 8, 7]
    p["slot_mapping"][:] = [0, 1, 2, 3]
    expected = sequence(p, fmt)
    got = fused_call(p, fmt, layout, device=False)  # NumPy arrays: the wrapper's host path
    assert np.all(np.isnan(got["q_out"][1:3])) and np.all(np.isfinite(got["q_out"][[0, 3]]))
    if fmt == "fp8":  # the NaN reaches the cache as a NaN scale: attention over that token gives NaN
        assert np.all(np.isnan(got["k_scale"][0, 0, 1:3])) and np.all(np.isfinite(got["k_scale"][0, 0, [0, 3]]))
        assert np.all(np.isfinite(got["v_scale"][0, 0, :]))
    else:
        assert np.all(np.isnan(got["k_cache"][0, 0, 1:3])) and np.all(np.isfinite(got["k_cache"][0, 0, [0, 3]]))
    assert_same_bits(got, expected, p, layout)


@pytest.mark.cudasim
def test_zero_tokens_launch_nothing(rng):
    p = make_problem(rng, 1, 2, 1, 16, "fp8")
    q, k, v = (x[:0] for x in column_slices(p["fused"], p["dims"]))
    before = p["k_cache"].copy()
    attention_input.qk_norm_rope_cache_write(
        q, k, v, np.empty((0, 2, 16), np.float32), p["q_norm"], p["k_norm"], EPS, p["positions"][:0], p["cos_sin"],
        p["k_cache"], p["v_cache"], p["slot_mapping"][:0], p["k_scale"], p["v_scale"])
    np.testing.assert_array_equal(p["k_cache"], before)


def _bad_calls():
    """(change to a good call's arguments, the message the ValueError must match); the good call has T 2, Hq 2,
    Hkv 1, D 16: q [2, 32], k and v [2, 16] column slices of a fused [2, 64] buffer, q_out [2, 2, 16]."""
    r = np.random.default_rng(0)
    flat = np.zeros(256, np.float32)
    fused = np.zeros((2, 64), np.float32)
    return [
        (dict(q_out=np.ones((2, 2, 16), np.float64)), "^q_out: expected float32 \\[T, Hq, head_dim\\]"),
        (dict(q_out=np.ones((2, 2, 15), np.float32)), "^q_out: expected .*head_dim even"),
        (dict(q_out=np.ones((2, 2, 258), np.float32)), "^q_out: expected .*at most 256"),
        (dict(q_out=np.ones((2, 2, 32), np.float32)[:, :, ::2]), "^q_out: expected a C-contiguous"),
        (dict(q=np.ones((2, 32), np.float64)), "^q: expected float32 \\[2, 32\\]"),
        (dict(q=np.ones((3, 32), np.float32)), "^q: expected float32 \\[2, 32\\]"),
        (dict(q=np.ones((2, 2, 16), np.float32)), "^q: expected float32 \\[2, 32\\]"),
        (dict(q=np.ones((2, 64), np.float32)[:, ::2]), "^q: expected contiguous rows .* got strides \\(256, 8\\)"),
        (dict(k=np.ones((2, 32), np.float32)), "^k: expected float32 \\[2, 16\\]"),
        (dict(v=np.ones((2, 1, 16), np.float32)), "^v: expected float32 \\[2, 16\\]"),
        (dict(v=np.ones((2, 32), np.float32)[:, 1::2]), "^v: expected contiguous rows"),
        (dict(k=np.lib.stride_tricks.as_strided(flat, (2, 16), (32, 4))), "^k: expected contiguous rows"),
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
         "^k_cache: expected .*16\\] \\(q_out's head_dim\\)"),
        (dict(kv_format="bf16"), "^k_cache: expected .*kv_format bf16"),
        (dict(v=flat[:32].reshape(2, 16), q_out=flat[16:80].reshape(2, 2, 16)), "^q_out: overlaps v in memory"),
        (dict(k=fused[:, 32:48], v=fused[:, 48:], q_out=fused.reshape(-1)[64:].reshape(2, 2, 16)),
         "^q_out: overlaps k in memory"),
        (dict(q=flat[:64].reshape(2, 32), q_out=flat[16:80].reshape(2, 2, 16)), "^q_out: partially overlaps q"),
        (dict(q=fused[:, :32], q_out=fused.reshape(-1)[:64].reshape(2, 2, 16)),  # same start, q not contiguous
         "^q_out: partially overlaps q"),
        (dict(q=[[1.0] * 32] * 2), "^q: expected a NumPy array"),
        (dict(q_norm=r.standard_normal(16)), "^q_norm: expected float32"),
    ]


BAD_CALLS = _bad_calls()


@pytest.mark.cudasim
@pytest.mark.parametrize("change, message", BAD_CALLS, ids=[m[1:40] for _, m in BAD_CALLS])
def test_bad_calls_raise_before_launching(rng, change, message):
    p = make_problem(rng, 2, 2, 1, 16, "fp8")
    q, k, v = column_slices(p["fused"], p["dims"])
    kwargs = {name: p[name] for name in ("q_norm", "k_norm", "positions", "cos_sin", "k_cache", "v_cache",
                                         "slot_mapping", "k_scale", "v_scale")}
    kwargs.update(q=q, k=k, v=v, q_out=np.full((2, 2, 16), np.nan, np.float32), eps=EPS, kv_format="fp8")
    kwargs.update(change)
    snapshot = {name: np.copy(a) for name, a in kwargs.items() if isinstance(a, np.ndarray)}
    with pytest.raises(ValueError, match=message):
        attention_input.qk_norm_rope_cache_write(**kwargs)
    for name, before in snapshot.items():  # nothing was written: nothing was launched
        assert kwargs[name].tobytes() == before.tobytes(), name


# ---------------------------------------------------------------------------- on a GPU, at Qwen3-8B sizes


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 1001])
def test_gpu_fused_matches_the_kernel_sequence_at_qwen3_8b_sizes(tokens):
    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    p = make_problem(rng, tokens, 32, 8, 128, "fp8", max_positions=40960)
    write_token_zero(p)
    expected = sequence(p, "fp8")  # the same kernels on the GPU (NumPy arguments copied to it and back)
    got = fused_call(p, "fp8", "fused slices")  # device arrays: q, k, v column slices of one device buffer
    try:
        assert np.all(np.isfinite(got["q_out"]))
        assert_same_bits(got, expected, p, "fused slices")
        assert_only_used_slots_written(got, p["slot_mapping"], "fp8")
    except AssertionError as error:
        raise AssertionError(f"seed {seed}") from error
