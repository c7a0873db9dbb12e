"""fp8lab.simulators.gemv_mma, the model of the tensor-core decode GEMV (weights as the mma's m16 operand).

Against ``fp8lab.reference.blockwise.gemm``: exactly where every float32 rounding is exact (small integer values,
power-of-two scales), within the float32 bound of ``fp8lab.simulators.gemm_mma`` on random data; the k order is a
permutation inside each 64-wide span; a NaN activation gives NaN in its row only; SwiGLU is ``dense.silu_mul`` of
the product; bad arguments raise ``ValueError``.
"""

from __future__ import annotations

import numpy as np
import pytest

from fp8lab.reference import blockwise, e4m3
from fp8lab.reference import strategies as fst
from fp8lab.simulators import bit_placement, dense
from fp8lab.simulators import gemv_mma as model

CODES = np.array(fst.NON_NAN_CODES, dtype=np.uint8)
INTEGER_CODES = np.array([c for c in fst.NON_NAN_CODES if float(e4m3.VALUES[c]).is_integer() and abs(e4m3.VALUES[c]) <= 8],
                         dtype=np.uint8)


def test_k_order_permutes_each_span_and_gives_each_lane_16_contiguous_k():
    order = model.k_order(256)
    assert sorted(order) == list(range(256))
    spans = order.reshape(4, 64)
    assert all(sorted(s) == list(range(64 * p, 64 * p + 64)) for p, s in enumerate(spans))
    # lane (g, t) holds fragment positions 2t, 2t+1, 2t+8, 2t+9 of each step: over a span's 4 steps, the 16 k
    # [16 t, 16 t + 16) of that span
    steps = order.reshape(-1, 16)
    for t in range(4):
        held = np.concatenate([steps[j][[2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]] for j in range(4)])
        assert list(held) == list(range(16 * t, 16 * t + 16))


@pytest.mark.parametrize("k_slices", model.K_SLICES_CHOICES)
@pytest.mark.parametrize("m", [1, 5, 8, 16, 32])
def test_exact_where_every_rounding_is_exact(rng, m, k_slices):
    n, k = 32, 640  # 5 chunks: uneven and empty slices
    q = rng.choice(INTEGER_CODES, (n, k))
    a = rng.integers(-4, 5, (m, k)).astype(np.float32)
    scales = np.exp2(rng.integers(-2, 3, (n // 16, k // 128))).astype(np.float32)
    got = model.gemv_mma(a, q, scales, (16, 128), k_slices=k_slices)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, blockwise.gemm(a, q, scales, (16, 128)).astype(np.float32))


@pytest.mark.parametrize("k_slices", [1, 4])
def test_random_data_within_the_float32_bound(rng, k_slices):
    m, n, k = 4, 48, 1024
    q = rng.choice(CODES, (n, k))
    a = rng.standard_normal((m, k)).astype(np.float32)
    scales = rng.uniform(0.5, 2, (n // 8, k // 256)).astype(np.float32)
    got = model.gemv_mma(a, q, scales, (8, 256), k_slices=k_slices).astype(np.float64)
    a16 = bit_placement.bf16_bits_to_float32(bit_placement.float32_to_bf16_bits(a)).astype(np.float64)
    w = blockwise.dequantize(q, scales, (8, 256)).astype(np.float64)
    chunks = k // 128
    bound = (chunks + 9 + k_slices) * 2.0**-24 * (np.abs(a16) @ np.abs(w).T) + 15 * chunks * 2.0**-30 * scales.max()
    assert np.all(np.abs(got - a16 @ w.T) <= bound)


def test_a_nan_activation_poisons_its_row_only(rng):
    q = rng.choice(CODES, (16, 256))
    a = rng.standard_normal((3, 256)).astype(np.float32)
    a[1, 77] = np.nan
    got = model.gemv_mma(a, q, np.ones((1, 2), np.float32), (16, 128))
    assert np.all(np.isnan(got[1])) and np.all(np.isfinite(got[[0, 2]]))


def test_each_row_is_computed_alone(rng):
    """A row's bits do not depend on the other rows: a second batch tile changes nothing in the first."""
    q = rng.choice(CODES, (16, 512))
    a = rng.standard_normal((14, 512)).astype(np.float32)
    s = rng.uniform(0.5, 2, (1, 4)).astype(np.float32)
    together = model.gemv_mma(a, q, s, (16, 128), k_slices=2)
    alone = np.concatenate([model.gemv_mma(a[i : i + 1], q, s, (16, 128), k_slices=2) for i in range(14)])
    np.testing.assert_array_equal(together.view(np.uint32), alone.view(np.uint32))


def test_swiglu_is_silu_mul_of_the_product(rng):
    q = rng.choice(CODES, (32, 256))
    a = rng.standard_normal((2, 256)).astype(np.float32)
    s = np.ones((2, 2), np.float32)
    got = model.gemv_mma_swiglu(a, q, s, (16, 128), k_slices=2)
    np.testing.assert_array_equal(got.view(np.uint32),
                                  dense.silu_mul(model.gemv_mma(a, q, s, (16, 128), k_slices=2)).view(np.uint32))


@pytest.mark.parametrize("change, message", [
    (dict(a=np.zeros((33, 128), np.float32)), "^a: expected 1 to 32 rows"),
    (dict(k_slices=3), "^k_slices: expected one of"),
    (dict(a=np.zeros((2, 256), np.float32)), "^a: expected shape \\[..., K\\] with K = 128"),
    (dict(a=np.zeros((2, 2, 128), np.float32)), "^a: expected \\[M, K\\], got shape \\(2, 2, 128\\)"),
])
def test_bad_arguments(change, message):
    args = dict(a=np.ones((2, 128), np.float32), q=np.zeros((16, 128), np.uint8),
                scale_inv=np.ones((1, 1), np.float32), block=(16, 128)) | change
    with pytest.raises(ValueError, match=message):
        model.gemv_mma(**args)


@pytest.mark.parametrize("k_slices", [1, 4])
def test_bf16_weights_exact_where_every_rounding_is_exact(rng, k_slices):
    """BF16 weights (the lm_head form): small integers everywhere make every sum exact, so the model is the
    oracle's product bit for bit; random data stays within the float32 bound."""
    m, n, k = 5, 32, 640
    a = rng.integers(-4, 5, (m, k)).astype(np.float32)
    w = rng.integers(-4, 5, (n, k)).astype(np.float32)
    got = model.gemv_mma_bf16(a, bit_placement.float32_to_bf16_bits(w), k_slices=k_slices)
    np.testing.assert_array_equal(got, (a.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32))
    a = rng.standard_normal((m, k)).astype(np.float32)
    w_bits = bit_placement.float32_to_bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
    got = model.gemv_mma_bf16(a, w_bits, k_slices=k_slices).astype(np.float64)
    a16 = bit_placement.bf16_bits_to_float32(bit_placement.float32_to_bf16_bits(a)).astype(np.float64)
    w64 = bit_placement.bf16_bits_to_float32(w_bits).astype(np.float64)
    bound = (k // 16 + k // 128 + k_slices) * 2.0**-24 * (np.abs(a16) @ np.abs(w64).T)
    assert np.all(np.abs(got - a16 @ w64.T) <= bound)
