"""fp8lab.simulators.dense against fp8lab.reference.dense, and its orders against by-hand lane loops.

- Orders: ``sum_of_squares`` and ``bf16_linear`` against scalar loops over threads (lanes), chunks
  and the butterfly written out one element at a time (with the scalar ``fma_f32``).
- Against the reference: bit for bit where the math is exact or the operations are the same
  (``silu_mul``, ``argmax_rows``, RoPE at position 0, integer-valued linears, power-of-two norms,
  the fused add's sum); otherwise within the float32 bounds derived next to each test.

``u = 2^-24`` is float32's unit roundoff, ``gamma(n) = n u / (1 - n u)``.
"""

import numpy as np
import pytest
from helpers.numerics import U, gamma, spread_activations
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import dense
from fp8lab.simulators import dense as sim
from fp8lab.simulators.fma import fma_f32

TINY = 1e-30


def random_bf16_bits(rng, shape) -> np.ndarray:
    """BF16 patterns of random finite values: random sign, 7 mantissa bits, exponents 2^-8 .. 2^1."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    exponent = np.uint16(121) + (bits >> np.uint16(7) & np.uint16(7))
    return (bits & np.uint16(0x807F)) | exponent << np.uint16(7)


def butterfly_by_hand(values: list) -> np.float32:
    """Lane 0's total after ``v[L] += v[L ^ off]`` for off = 16, 8, 4, 2, 1, one lane at a time."""
    for off in (16, 8, 4, 2, 1):
        values = [np.float32(values[lane] + values[lane ^ off]) for lane in range(32)]
    return values[0]


# ---------------------------------------------------------------------------- RMSNorm


def test_sum_of_squares_is_the_threads_chains_then_the_butterflies_in_warp_order(rng):
    n, threads = 150, 64
    x = spread_activations(rng, (2, n))
    got = sim.sum_of_squares(x, threads)
    for r in range(2):
        partial = [np.float32(0)] * threads
        for t in range(threads):
            for k in range(t, n, threads):
                partial[t] = fma_f32(x[r, k], x[r, k], partial[t])
        total = np.float32(0)
        for w in range(threads // 32):
            total = np.float32(total + butterfly_by_hand(partial[32 * w : 32 * w + 32]))
        assert got[r].view(np.uint32) == total.view(np.uint32)


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), n=st.sampled_from([1, 32, 40, 128, 300, 520]),
       threads=st.sampled_from([32, 64, 96]), eps=st.sampled_from([1e-6, 0.5]))
def test_rms_norm_within_the_bound_of_the_reference(seed, rows, n, threads, eps):
    """The sum of squares takes at most ``L = ceil(n / threads) + 5 + warps`` roundings per term
    (``gamma(L)`` relative); the mean, ``+ eps`` and the sqrt halve it and add ``1.5 u``; the division
    and the weight add ``2 u``: within ``(gamma(L) / 2 + 4 u) |exact|`` of the float64 norm. The float32
    reference's pairwise sum adds ``gamma(n) / 2`` more between the two."""
    rng = np.random.default_rng(seed)
    x = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    got = sim.rms_norm(x, weight, eps, threads)
    assert got.dtype == np.float32 and got.shape == x.shape
    exact = dense.rms_norm_float64(x, weight, eps)
    bound = 1.01 * (gamma(-(-n // threads) + 5 + threads // 32) / 2 + 4 * U) * np.abs(exact) + TINY
    assert np.all(np.abs(got - exact) <= bound)
    assert np.all(np.abs(got - dense.rms_norm(x, weight, eps)) <= 2 * bound + gamma(n) / 2 * np.abs(exact))


def test_rms_norm_exact_on_a_power_of_two_row():
    x = np.array([[0.25] * 40, [-2.0**-30] * 40], np.float32)
    weight = np.linspace(-2, 2, 40, dtype=np.float32)
    np.testing.assert_array_equal(sim.rms_norm(x, weight, 0.0, 32), dense.rms_norm(x, weight, 0.0))
    np.testing.assert_array_equal(sim.rms_norm(x, weight, 0.0, 32), np.sign(x) * weight)


def test_add_rms_norm_is_the_reference_sum_then_the_simulated_norm(rng):
    x, residual = spread_activations(rng, (3, 300)), spread_activations(rng, (3, 300))
    weight = spread_activations(rng, (300,), spread=1)
    normed, h = sim.add_rms_norm(x, residual, weight, 1e-6, 64)
    np.testing.assert_array_equal(h.view(np.uint32), dense.add_rms_norm(x, residual, weight, 1e-6)[1].view(np.uint32))
    np.testing.assert_array_equal(normed.view(np.uint32), sim.rms_norm(h, weight, 1e-6, 64).view(np.uint32))


def test_rms_norm_nan_row_stays_nan(rng):
    x = spread_activations(rng, (2, 64))
    x[1, 7] = np.nan
    got = sim.rms_norm(x, np.ones(64, np.float32), 1e-6, 32)
    assert np.all(np.isnan(got[1])) and not np.any(np.isnan(got[0]))


# ---------------------------------------------------------------------------- RoPE


def test_rope_within_the_bound_of_the_reference(rng):
    """The simulator fuses one product, the reference rounds both: each within ``2 u (|x1 c| + |x2 s|)``
    of the exact ``x1 c - x2 s`` for the table's c, s, so within ``4 u`` of that of each other."""
    head_dim, theta = 64, 1e6
    cos_sin = np.concatenate(dense.rope_cos_sin(np.arange(300), head_dim, theta), axis=1)
    positions = rng.integers(0, 300, 5)
    x = spread_activations(rng, (5, 3, head_dim))
    got = sim.rope(x, positions, cos_sin)
    c, s = cos_sin[positions, None, :32].astype(np.float64), cos_sin[positions, None, 32:].astype(np.float64)
    x1, x2 = x[..., :32].astype(np.float64), x[..., 32:].astype(np.float64)
    magnitude = np.concatenate([np.abs(x1 * c) + np.abs(x2 * s), np.abs(x2 * c) + np.abs(x1 * s)], axis=-1)
    assert np.all(np.abs(got - dense.rope(x, positions, theta)) <= 4 * U * magnitude + TINY)


def test_rope_at_position_zero_is_the_identity_and_outside_the_table_nan(rng):
    cos_sin = np.concatenate(dense.rope_cos_sin(np.arange(8), 16, 1e4), axis=1)
    x = spread_activations(rng, (4, 2, 16))
    got = sim.rope(x, np.array([0, -1, 8, 0]), cos_sin)
    np.testing.assert_array_equal(got[[0, 3]], dense.rope(x[[0, 3]], [0, 0], 1e4))
    np.testing.assert_array_equal(got[[0, 3]], x[[0, 3]])
    assert np.all(np.isnan(got[1:3]))


# ---------------------------------------------------------------------------- SwiGLU


def test_silu_mul_is_the_reference_bit_for_bit(rng):
    """The kernel's operations are the reference's, in float32 (NumPy's exp in both)."""
    gate_up = (rng.standard_normal((3, 2 * 70)) * 30).astype(np.float32)
    gate_up[0, :5] = [-100, -88.8, 0, 88, np.nan]
    got = sim.silu_mul(gate_up)
    want = dense.silu_mul(gate_up[:, :70], gate_up[:, 70:])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    scalar = np.array([sim.exp_f32(v) for v in -gate_up[1]], np.float32)
    np.testing.assert_array_equal(scalar.view(np.uint32), np.exp(-gate_up[1]).view(np.uint32))


# ---------------------------------------------------------------------------- BF16 linear


def test_bf16_linear_is_the_lanes_chunk_chains_then_the_butterfly(rng):
    """K = 264: 33 chunks, so lane 0 chains two (its chunks 0 and 32), every other lane one."""
    k = 264
    x = spread_activations(rng, (2, k), spread=1)
    bits = random_bf16_bits(rng, (3, k))
    w = dense.bf16_bits_to_float32(bits)
    got = sim.bf16_linear(x, bits)
    for m in range(2):
        for n in range(3):
            lanes = [np.float32(0)] * 32
            for lane in range(32):
                for chunk in range(lane, k // 8, 32):
                    for e in range(8):
                        lanes[lane] = fma_f32(x[m, 8 * chunk + e], w[n, 8 * chunk + e], lanes[lane])
            assert got[m, n].view(np.uint32) == butterfly_by_hand(lanes).view(np.uint32)


@pytest.mark.parametrize("m, n, k", [(1, 5, 8), (3, 4, 264), (2, 2, 1024)])
def test_bf16_linear_within_the_bound_of_the_reference(rng, m, n, k):
    """Each product passes at most ``8 ceil(K / 256)`` chain roundings and 5 butterfly roundings."""
    x = spread_activations(rng, (m, k), spread=1)
    bits = random_bf16_bits(rng, (n, k))
    w = dense.bf16_bits_to_float32(bits)
    got = sim.bf16_linear(x, bits)
    assert got.dtype == np.float32 and got.shape == (m, n)
    bound = gamma(8 * -(-k // 256) + 5) * dense.linear_float64(np.abs(x), np.abs(w)) + TINY
    assert np.all(np.abs(got - dense.linear_float64(x, w)) <= bound)
    np.testing.assert_array_equal(sim.bf16_linear(x, bits.view(np.int16)), got)  # torch's bfloat16 export


def test_bf16_linear_exact_on_integers_and_batch_invariant(rng):
    """Integers below 2^5 over K = 512: every partial sum is an integer below 2^24, so exact in any order."""
    x = rng.integers(-30, 30, (5, 512)).astype(np.float32)
    w = rng.integers(-30, 30, (3, 512)).astype(np.float32)
    bits = dense.float32_to_bf16_bits(w)  # small integers are BF16 numbers
    got = sim.bf16_linear(x, bits)
    np.testing.assert_array_equal(got, dense.linear(x, w))
    np.testing.assert_array_equal(sim.bf16_linear(x[3:4], bits), got[3:4])


# ---------------------------------------------------------------------------- argmax


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 3), vocab=st.integers(1, 400), levels=st.integers(1, 6),
       threads=st.sampled_from([32, 64, 128]))
def test_argmax_rows_is_the_reference(seed, rows, vocab, levels, threads):
    """Few distinct values (many ties, +-0, infinities), sometimes a NaN: the threads' scans and merges
    find the reference's token (lowest index of the maximum; NAN_ROW for a row holding NaN)."""
    rng = np.random.default_rng(seed)
    values = np.array([-np.inf, -2.5, 0.0, -0.0, 3.0, np.inf, np.nan], np.float32)[: levels + 1]
    logits = rng.choice(values, (rows, vocab)).astype(np.float32)
    got = sim.argmax_rows(logits, threads)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, dense.argmax_rows(logits))


def test_argmax_rows_random_logits_with_a_late_maximum(rng):
    logits = rng.standard_normal((3, 5000)).astype(np.float32)
    logits[1, 4999] = 50
    logits[2, [17, 4000]] = 50
    np.testing.assert_array_equal(sim.argmax_rows(logits, 160), dense.argmax_rows(logits))
    assert sim.argmax_rows(logits, 160)[1:].tolist() == [4999, 17]


def test_threads_must_be_whole_warps():
    with pytest.raises(ValueError, match="threads: expected a positive multiple of 32, got 48"):
        sim.argmax_rows(np.ones((1, 4), np.float32), 48)
