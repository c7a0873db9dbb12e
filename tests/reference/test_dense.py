"""fp8lab.reference.dense against independent oracles: ml_dtypes for BF16 (every upper half with the
low halves that decide a rounding), Python's ``math`` in float64 and closed forms for the norms, RoPE,
SwiGLU and the linear, a plain loop for argmax; NaN and infinity rules; bad arguments.

``u = 2^-24`` is float32's unit roundoff, ``gamma(n) = n u / (1 - n u)``.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from helpers.numerics import U, gamma, spread_activations
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import dense

TINY = 1e-30


# ---------------------------------------------------------------------------- BF16

LOW_HALVES = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000], np.uint32)
"""Low 16 bits that decide the rounding: exact, just above exact, below / at / above the midpoint, the top."""


def interesting_float32() -> np.ndarray:
    """Every BF16 upper half (zeros, subnormals, normals, the largest finite, infinities, NaNs of
    both signs) combined with every ``LOW_HALVES``: 524288 float32 values."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    return (upper[:, None] | LOW_HALVES[None, :]).reshape(-1).view(np.float32)


def test_bf16_rounding_matches_ml_dtypes_on_every_upper_half():
    x = interesting_float32()
    bits = dense.float32_to_bf16_bits(x)
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    nan = np.isnan(x)
    np.testing.assert_array_equal(bits[~nan], x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))
    # NaN stays a quiet NaN with its sign (never an infinity, never a number)
    assert np.all(np.isnan(bits[nan].view(ml_dtypes.bfloat16).astype(np.float32)))
    np.testing.assert_array_equal(bits[nan] >> 15, (x[nan].view(np.uint32) >> 31).astype(np.uint16))
    assert np.all(bits[nan] & 0x0040)
    np.testing.assert_array_equal(dense.round_to_bf16(x)[~nan], x[~nan].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.all(np.isnan(dense.round_to_bf16(x)[nan]))


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_bf16_rounding_matches_ml_dtypes_on_random_patterns(patterns):
    x = np.array(patterns, np.uint32).view(np.float32)
    nan = np.isnan(x)
    np.testing.assert_array_equal(dense.float32_to_bf16_bits(x)[~nan], x[~nan].astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bf16_ties_go_to_even_and_overflow_gives_infinity():
    ties = np.array([0x3F808000, 0x3F818000, 0x80008000, 0x00018000], np.uint32).view(np.float32)
    assert dense.float32_to_bf16_bits(ties).tolist() == [0x3F80, 0x3F82, 0x8000, 0x0002]
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 3.3e38], np.float32)
    assert dense.float32_to_bf16_bits(big).tolist() == [0x7F80, 0xFF80, 0x7F78]
    assert dense.float32_to_bf16_bits(np.float16([1.5, -65504])).tolist() == [0x3FC0, 0xC780]  # float16 is exact in float32


def test_bf16_widening_is_exact_for_every_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    theirs = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    for view in (bits, bits.view(np.int16)):  # int16: torch's bfloat16 export
        ours = dense.bf16_bits_to_float32(view)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # NaN payloads included
    finite = np.isfinite(theirs)
    np.testing.assert_array_equal(dense.float32_to_bf16_bits(theirs)[finite], bits[finite])


@pytest.mark.parametrize("x, message", [
    (np.ones(3, np.float64), "x: expected float32 \\(or float16\\) values, got dtype float64"),
    (np.ones(3, np.int32), "x: expected float32 \\(or float16\\) values, got dtype int32"),
])
def test_bf16_rounding_refuses_what_would_round_twice_or_is_not_a_float(x, message):
    with pytest.raises(ValueError, match=message):
        dense.float32_to_bf16_bits(x)


def test_bf16_widening_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bits: expected BF16 bit patterns \\(uint16 or int16\\), got dtype uint32"):
        dense.bf16_bits_to_float32(np.ones(3, np.uint32))


# ---------------------------------------------------------------------------- RMSNorm


def rms_norm_math(x, weight, eps) -> np.ndarray:
    """Row by row with ``math.fsum`` (the exact sum of squares, rounded once): an independent float64 oracle."""
    rows = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.empty(rows.shape)
    for r, row in enumerate(rows):
        denom = math.sqrt(math.fsum(float(v) * float(v) for v in row) / len(row) + float(np.float32(eps)))
        out[r] = [float(w) * (float(v) / denom) for v, w in zip(row, weight)]
    return out.reshape(x.shape)


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), n=st.sampled_from([1, 7, 64, 128, 300]),
       eps=st.sampled_from([1e-6, 1e-5, 0.5]))
def test_rms_norm_within_float32_rounding_of_the_exact_norm(seed, rows, n, eps):
    """float32 with a pairwise sum: the sum of squares within ``gamma(n)``, so the result within
    ``(gamma(n) / 2 + 4 u) |exact|`` (sqrt halves the relative error; eps, sqrt, division, weight: 4 u)."""
    rng = np.random.default_rng(seed)
    x = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    got = dense.rms_norm(x, weight, eps)
    assert got.dtype == np.float32 and got.shape == x.shape
    exact = rms_norm_math(x, weight, eps)
    np.testing.assert_allclose(dense.rms_norm_float64(x, weight, eps), exact, rtol=1e-14, atol=0)
    assert np.all(np.abs(got - exact) <= 1.01 * (gamma(n) / 2 + 4 * U) * np.abs(exact) + TINY)


def test_rms_norm_closed_forms(rng):
    """A constant row of a power of two normalizes to its sign exactly (eps = 0); scaling a row by a
    power of two changes nothing, bit for bit; rows are independent of each other."""
    n = 64
    constant = np.array([[2.0**-20] * n, [-8.0] * n], np.float32)
    np.testing.assert_array_equal(dense.rms_norm(constant, np.ones(n, np.float32), 0.0), np.sign(constant))
    x = spread_activations(rng, (3, n), spread=1)
    weight = spread_activations(rng, (n,), spread=1)
    once = dense.rms_norm(x, weight, 0.0)
    np.testing.assert_array_equal(dense.rms_norm(x * np.float32(2.0**40), weight, 0.0), once)
    np.testing.assert_array_equal(dense.rms_norm(x[1:2], weight, 0.0), once[1:2])


def test_rms_norm_over_the_last_axis_only(rng):
    x = spread_activations(rng, (2, 3, 16))
    weight = spread_activations(rng, (16,), spread=1)
    np.testing.assert_array_equal(dense.rms_norm(x, weight, 1e-6).reshape(6, 16), dense.rms_norm(x.reshape(6, 16), weight, 1e-6))


def test_add_rms_norm_is_the_float32_sum_then_the_norm(rng):
    x, residual = spread_activations(rng, (3, 40)), spread_activations(rng, (3, 40))
    weight = spread_activations(rng, (40,), spread=1)
    normed, h = dense.add_rms_norm(x, residual, weight, 1e-6)
    np.testing.assert_array_equal(h.view(np.uint32), (residual + x).view(np.uint32))
    np.testing.assert_array_equal(normed.view(np.uint32), dense.rms_norm(residual + x, weight, 1e-6).view(np.uint32))


def test_rms_norm_nan_and_inf_propagate(rng):
    """A NaN makes its whole row NaN; an infinity makes its own element NaN (inf / inf) and the row's
    others 0 (x / inf), as IEEE arithmetic does; other rows are untouched; a NaN eps or weight is NaN."""
    x = spread_activations(rng, (3, 8))
    weight = spread_activations(rng, (8,), spread=1)
    clean = dense.rms_norm(x, weight, 1e-6)
    x[0, 3], x[1, 5] = np.nan, np.inf
    got = dense.rms_norm(x, weight, 1e-6)
    assert np.all(np.isnan(got[0]))
    assert np.isnan(got[1, 5]) and np.all(got[1, np.arange(8) != 5] == 0)
    np.testing.assert_array_equal(got[2], clean[2])
    assert np.all(np.isnan(dense.rms_norm(x[2:], weight, np.nan)))
    weight[2] = np.nan
    assert np.all(np.isnan(dense.rms_norm(x[2:], weight, 1e-6)[:, 2]))
    assert np.all(np.isnan(dense.rms_norm_float64(x[:1], weight, 1e-6)))


# ---------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("head_dim, theta", [(2, 10000.0), (64, 10000.0), (128, 1e6), (256, 5e5)])
def test_rope_cos_sin_is_the_float64_angle_rounded_once(head_dim, theta):
    positions = np.array([0, 1, 2, 17, 4095, 40959, 131071])
    cos, sin = dense.rope_cos_sin(positions, head_dim, theta)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (positions.size, head_dim // 2)
    for p_index, p in enumerate(positions):
        for i in range(head_dim // 2):
            angle = float(p) * float(theta) ** (-(2 * i) / head_dim)
            assert cos[p_index, i] == np.float32(math.cos(angle)) and sin[p_index, i] == np.float32(math.sin(angle))
    assert np.all(cos[0] == 1) and np.all(sin[0] == 0)


def rope_math(x, positions, theta) -> np.ndarray:
    """The NeoX rotation in float64 with exact (float64) angles, pair by pair."""
    t, heads, head_dim = x.shape
    half = head_dim // 2
    out = np.empty(x.shape)
    for a in range(t):
        for i in range(half):
            angle = float(positions[a]) * float(theta) ** (-(2 * i) / head_dim)
            c, s = math.cos(angle), math.sin(angle)
            x1, x2 = x[a, :, i].astype(np.float64), x[a, :, half + i].astype(np.float64)
            out[a, :, i], out[a, :, half + i] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def test_rope_is_the_rotation_within_float32_rounding(rng):
    """The table's cos and sin are within ``u`` of the exact ones, each product and the sum add ``u``:
    within ``3 u (|x1| + |x2|)`` of the exact rotation (plus the float64 angles' own error)."""
    x = spread_activations(rng, (4, 3, 64))
    positions = np.array([0, 5, 4095, 40000])
    got = dense.rope(x, positions, 1e6)
    assert got.dtype == np.float32 and got.shape == x.shape
    half = 32
    pair = np.abs(x[..., :half].astype(np.float64)) + np.abs(x[..., half:])
    magnitude = np.concatenate([pair, pair], axis=-1)
    assert np.all(np.abs(got - rope_math(x, positions, 1e6)) <= 3.01 * U * magnitude + TINY)
    np.testing.assert_array_equal(got[0], x[0])  # position 0: cos 1, sin 0, exactly


def test_rope_rotates_dimension_i_with_i_plus_half(rng):
    """NeoX ``rotate_half``: a vector with only dimension i (or i + h) set stays in the plane (i, i + h)."""
    x = np.zeros((1, 1, 16), np.float32)
    x[0, 0, 3] = 1.0
    got = dense.rope(x, [7], 1e4)[0, 0]
    assert set(np.flatnonzero(got)) <= {3, 11}
    c, s = dense.rope_cos_sin([7], 16, 1e4)
    assert got[3] == c[0, 3] and got[11] == s[0, 3]


def test_rope_nan_propagates_within_its_pairs(rng):
    x = spread_activations(rng, (2, 2, 8))
    x[0, 1, 2] = np.nan
    got = dense.rope(x, [3, 4], 1e4)
    nan = np.isnan(got)
    assert nan[0, 1, 2] and nan[0, 1, 6] and nan.sum() == 2
    assert np.all(np.isnan(dense.rope(x[1:], [4], np.nan)[..., 1:4]))  # theta^(-2i/d) is NaN for i >= 1


# ---------------------------------------------------------------------------- SwiGLU


def test_silu_mul_within_float32_rounding(rng):
    """NumPy's float32 exp is within 4 u; ``1 + e``, the division and the product add ``u`` each."""
    gate = (rng.standard_normal((3, 50)) * 6).astype(np.float32)
    gate[0, :6] = [-100, -88.8, -20, 30, 88, 100]
    up = spread_activations(rng, (3, 50), spread=1)
    got = dense.silu_mul(gate, up)
    assert got.dtype == np.float32
    exact = np.array([[float(g) / (1 + math.exp(-float(g))) * float(u) if g > -700 else -0.0 * float(u)
                       for g, u in zip(gr, ur)] for gr, ur in zip(gate, up)])
    np.testing.assert_allclose(dense.silu_mul_float64(gate, up), exact, rtol=1e-14, atol=0)
    assert np.all(np.abs(got - exact) <= 8 * U * np.abs(exact) + TINY * np.maximum(1, np.abs(up)))
    # closed forms: silu(0) = 0; exp(-gate) overflows to inf below -88.7: -0 * up; silu(100) = 100
    edge = dense.silu_mul(np.float32([0, -100, 100]), np.float32([3, 2, 0.5]))
    assert edge.tolist() == [0.0, -0.0, 50.0] and np.signbit(edge[1])


def test_silu_mul_nan_propagates():
    got = dense.silu_mul(np.float32([np.nan, 1, -np.inf, np.inf]), np.float32([1, np.nan, 1, 1]))
    assert np.isnan(got[0]) and np.isnan(got[1]) and np.isnan(got[2]) and got[3] == np.inf


# ---------------------------------------------------------------------------- embedding and linear


def test_embedding_gathers_rows_exactly(rng):
    table = spread_activations(rng, (10, 6))
    ids = np.array([9, 0, 3, 3], np.int32)
    got = dense.embedding(table, ids)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.stack([table[i] for i in ids]))
    bf16 = table.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(dense.embedding(bf16, ids), bf16.astype(np.float32)[ids])


@pytest.mark.parametrize("ids", [[0, -1], [10], [2**31 - 1]])
def test_embedding_refuses_ids_outside_the_vocabulary(ids):
    with pytest.raises(ValueError, match="ids: expected token ids in \\[0, 10\\)"):
        dense.embedding(np.ones((10, 4), np.float32), np.array(ids))


@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 5), n=st.integers(1, 6), k=st.integers(1, 300))
def test_linear_within_float32_gemm_rounding(seed, m, n, k):
    rng = np.random.default_rng(seed)
    x, w = spread_activations(rng, (m, k), spread=1), spread_activations(rng, (n, k), spread=1)
    got = dense.linear(x, w)
    assert got.dtype == np.float32 and got.shape == (m, n)
    exact = np.array([[math.fsum(float(a) * float(b) for a, b in zip(row, col)) for col in w] for row in x])
    np.testing.assert_allclose(dense.linear_float64(x, w), exact, rtol=1e-12, atol=1e-300)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    assert np.all(np.abs(got - exact) <= gamma(k) * scale + TINY)


def test_linear_is_exact_on_small_integers(rng):
    """Integers below 2^6 in K = 96 terms: every partial sum is an integer below 2^24, so any order is exact."""
    x = rng.integers(-60, 60, (3, 2, 96)).astype(np.float32)
    w = rng.integers(-60, 60, (5, 96)).astype(np.float32)
    got = dense.linear(x, w)
    assert got.shape == (3, 2, 5)
    np.testing.assert_array_equal(got, (x.astype(np.int64) @ w.T.astype(np.int64)).astype(np.float32))


def test_linear_nan_poisons_its_row_and_column(rng):
    x, w = spread_activations(rng, (3, 8), spread=1), spread_activations(rng, (4, 8), spread=1)
    x[1, 2], w[3, 5] = np.nan, np.nan
    nan = np.isnan(dense.linear(x, w))
    assert np.all(nan[1]) and np.all(nan[:, 3]) and nan.sum() == 4 + 3 - 1


# ---------------------------------------------------------------------------- argmax


def greedy_loop(row) -> int:
    """The greedy rule one element at a time: -1 if any NaN, else the first index of the largest value."""
    if any(math.isnan(v) for v in row):
        return dense.NAN_ROW
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), vocab=st.integers(1, 60), levels=st.integers(1, 6))
def test_argmax_rows_lowest_index_and_nan_rows(seed, rows, vocab, levels):
    """Few distinct values (many ties, +-0, infinities), sometimes a NaN."""
    rng = np.random.default_rng(seed)
    values = np.array([-np.inf, -2.5, 0.0, -0.0, 3.0, np.inf, np.nan], np.float32)[: levels + 1]
    logits = rng.choice(values, (rows, vocab)).astype(np.float32)
    got = dense.argmax_rows(logits)
    assert got.shape == (rows,)
    assert got.tolist() == [greedy_loop(row.tolist()) for row in logits]


def test_argmax_rows_closed_cases():
    logits = np.array([[1, 5, 5, 2], [0.0, -0.0, -1, -1], [-0.0, 0.0, -1, -1], [np.nan, 9, 9, 9],
                       [-np.inf] * 4, [3, 3, 3, np.nan]], np.float32)
    assert dense.argmax_rows(logits).tolist() == [1, 0, 0, dense.NAN_ROW, 0, dense.NAN_ROW]
    assert dense.argmax_rows(logits.reshape(2, 3, 4)).tolist() == [[1, 0, 0], [-1, 0, -1]]
    assert dense.argmax_rows(np.float32([[2.0]])).tolist() == [0]


# ---------------------------------------------------------------------------- bad arguments

BAD_CALLS = [
    (lambda: dense.rms_norm(np.ones((2, 0), np.float32), np.ones(0), 1e-6), "x: expected a float array \\[..., n\\] with n >= 1"),
    (lambda: dense.rms_norm(np.ones((2, 4), np.int32), np.ones(4), 1e-6), "x: expected a float array"),
    (lambda: dense.rms_norm(np.ones((2, 4), np.float32), np.ones(5), 1e-6), "weight: expected shape \\(4,\\), got \\(5,\\)"),
    (lambda: dense.add_rms_norm(np.ones((2, 4)), np.ones((1, 4)), np.ones(4), 1e-6), "residual: expected shape \\(2, 4\\)"),
    (lambda: dense.rope_cos_sin([0, 1], 7, 1e4), "head_dim: expected a positive even number, got 7"),
    (lambda: dense.rope_cos_sin([0.5], 8, 1e4), "positions: expected an integer array"),
    (lambda: dense.rope(np.ones((2, 8), np.float32), [0, 1], 1e4), "x: expected 3 dimensions \\[T, heads, head_dim\\]"),
    (lambda: dense.rope(np.ones((2, 1, 8), np.float32), [0], 1e4), "positions: expected shape \\(2,\\), got \\(1,\\)"),
    (lambda: dense.silu_mul(np.ones(3), np.ones(4)), "up: expected shape \\(3,\\), got \\(4,\\)"),
    (lambda: dense.embedding(np.ones(4), [0]), "table: expected 2 dimensions \\[vocab, hidden\\]"),
    (lambda: dense.embedding(np.ones((4, 2)), [0.0]), "ids: expected an integer array"),
    (lambda: dense.linear(np.ones((2, 3)), np.ones((4, 5))), "x: expected shape \\[..., 5\\] \\(w is \\(4, 5\\)\\), got \\(2, 3\\)"),
    (lambda: dense.linear(np.ones((2, 3)), np.ones(3)), "w: expected 2 dimensions \\[N, K\\]"),
    (lambda: dense.argmax_rows(np.ones((2, 0), np.float32)), "logits: expected a float array \\[..., n\\] with n >= 1"),
    (lambda: dense.argmax_rows(np.ones(3, np.int64)), "logits: expected a float array"),
]


@pytest.mark.parametrize("call, message", BAD_CALLS, ids=[m[:40] for _, m in BAD_CALLS])
def test_bad_arguments_raise_one_line_errors_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message) as error:
        call()
    assert "\n" not in str(error.value)
