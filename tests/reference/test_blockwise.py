"""fp8lab.reference.blockwise: the quantization error bound, GEMMs against independent formulations, bad input."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import blockwise, e4m3
from fp8lab.reference import strategies as fst

BLOCKS = st.tuples(st.integers(1, 40), st.integers(1, 40))


def dequantize_by_loops(q, scale_inv, block):
    """An independent dequantization: decode through ml_dtypes, scale block by block."""
    import ml_dtypes

    w = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    bn, bk = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= float(scale_inv[i, j])
    return w


@st.composite
def weights(draw, max_side=90):
    n, k = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # varied magnitudes per row, a few exact zeros, sometimes an all-zero region
    w = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-3, 2, size=(n, 1))
    w[rng.random((n, k)) < 0.05] = 0.0
    if draw(st.booleans()):
        w[: n // 2, : k // 2] = 0.0
    return w.astype(np.float32)


@given(w=weights(), block=BLOCKS)
def test_quantize_error_bound_per_element(w, block):
    """|dequantize(quantize(w)) - w| <= 2^-4 |w| + 2^-10 s (+ float32 rounding), per element."""
    q, s = blockwise.quantize(w, block)
    assert q.dtype == np.uint8 and s.dtype == np.float32
    assert s.shape == (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    assert not e4m3.is_nan(q).any()
    w_hat = blockwise.dequantize(q, s, block).astype(np.float64)
    s_full = dequantize_by_loops(np.full(q.shape, 0x38, np.uint8), s, block)  # code 0x38 is 1.0
    bound = 2.0**-4 * np.abs(w) + 2.0**-10 * s_full
    bound = bound * (1 + 2.0**-22)  # the float32 division and multiply
    assert np.all(np.abs(w_hat - w) <= bound)


@given(w=weights(), block=BLOCKS)
def test_quantize_scale_formula(w, block):
    """scale_inv = amax / 448 per block (1 for an all-zero block); the amax element maps to +-448."""
    q, s = blockwise.quantize(w, block)
    bn, bk = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            amax = np.max(np.abs(tile))
            assert s[i, j] == (np.float32(amax) / np.float32(448) if amax > 0 else 1.0)
            if amax > 0:
                codes = q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                assert np.max(np.abs(e4m3.decode(codes))) == 448.0


@given(w=fst.blockwise_weights())
def test_dequantize_matches_blockwise_loops(w):
    got = blockwise.dequantize(w.q, w.scale_inv, w.block)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, dequantize_by_loops(w.q, w.scale_inv, w.block).astype(np.float32))


@given(w=fst.blockwise_weights(), m=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_gemm_equals_dequantize_then_matmul(w, m, seed):
    a = np.random.default_rng(seed).standard_normal((m, w.k)).astype(np.float32)
    got = blockwise.gemm(a, w.q, w.scale_inv, w.block)
    expected = a.astype(np.float64) @ dequantize_by_loops(w.q, w.scale_inv, w.block).T
    assert got.shape == (m, w.n) and np.all(np.isfinite(got))
    # both are float64 sums of the same products in different orders
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12 * np.abs(a).sum() * np.abs(expected).max())


@given(w=fst.blockwise_weights(power_of_two_scales=True), seed=st.integers(0, 2**32 - 1))
def test_gemm_is_exact_on_integer_activations_and_power_of_two_scales(w, seed):
    a = np.random.default_rng(seed).integers(-8, 9, size=(3, w.k)).astype(np.float32)
    expected = np.zeros((3, w.n))
    w_exact = dequantize_by_loops(w.q, w.scale_inv, w.block)
    for kk in range(w.k):  # a plain sum, every term and partial sum exact in float64
        expected += np.outer(a[:, kk], w_exact[:, kk])
    np.testing.assert_array_equal(blockwise.gemm(a, w.q, w.scale_inv, w.block), expected)


def test_gemm_accepts_leading_dimensions(rng):
    q, s = blockwise.quantize(rng.standard_normal((40, 130)).astype(np.float32))
    a = rng.standard_normal((2, 3, 130)).astype(np.float32)
    out = blockwise.gemm(a, q, s)
    assert out.shape == (2, 3, 40)
    np.testing.assert_allclose(out[1, 2], blockwise.gemm(a[1, 2:3], q, s)[0], rtol=1e-13)


@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 6), k=st.integers(1, 300), group=st.sampled_from([1, 7, 64, 128]))
def test_quantize_activations_per_token_group(seed, m, k, group):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3, size=(m, 1))).astype(np.float32)
    a[0, :group] = 0.0  # an all-zero group takes the eps scale
    q, scales = blockwise.quantize_activations(a, group=group)
    assert scales.shape == (m, -(-k // group)) and q.shape == a.shape
    for r in range(m):
        for j in range(scales.shape[1]):
            seg = a[r, j * group : (j + 1) * group]
            expected = np.maximum(np.max(np.abs(seg)), np.float32(1e-10)) / np.float32(448)
            assert scales[r, j] == np.float32(expected)
            expected_codes = e4m3.encode(np.clip(seg / scales[r, j], -448, 448))
            np.testing.assert_array_equal(q[r, j * group : (j + 1) * group], expected_codes)


@given(w=fst.blockwise_weights(max_k=300), m=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_gemm_w8a8_against_dequantized_activations(w, m, seed):
    """W8A8 = W8A16 applied to the activations' own quantize-dequantize round trip."""
    a = np.random.default_rng(seed).standard_normal((m, w.k)).astype(np.float32)
    bk = w.block[1]
    aq, a_s = blockwise.quantize_activations(a, group=bk)
    a_dq = dequantize_by_loops(aq, a_s, (1, bk))
    expected = a_dq @ dequantize_by_loops(w.q, w.scale_inv, w.block).T
    got = blockwise.gemm_w8a8(a, w.q, w.scale_inv, w.block)
    scale = np.abs(a_dq) @ np.abs(dequantize_by_loops(w.q, w.scale_inv, w.block)).T
    assert np.all(np.abs(got - expected) <= 1e-13 * scale + 1e-300)
    # and W8A8 differs from W8A16 by no more than the activation rounding allows (2^-4 relative)
    w8a16 = blockwise.gemm(a, w.q, w.scale_inv, w.block)
    w_abs = np.abs(dequantize_by_loops(w.q, w.scale_inv, w.block))
    act_err = 2.0**-4 * np.abs(a) + 2.0**-10 * np.repeat(a_s, bk, axis=1)[:, : w.k]
    assert np.all(np.abs(got - w8a16) <= act_err @ w_abs.T * (1 + 1e-6) + 1e-300)


def test_bad_input_names_the_problem(rng):
    q, s = blockwise.quantize(rng.standard_normal((200, 260)).astype(np.float32))
    assert s.shape == (2, 3)
    with pytest.raises(ValueError, match=r"scale_inv: expected shape \(2, 3\), got \(2, 2\)"):
        blockwise.dequantize(q, s[:, :2])
    with pytest.raises(ValueError, match="scale_inv: expected a float array.*int"):
        blockwise.dequantize(q, s.astype(np.int32))
    with pytest.raises(ValueError, match="q: expected E4M3 codes.*float32"):
        blockwise.dequantize(q.astype(np.float32), s)
    with pytest.raises(ValueError, match=r"a: expected shape \[..., K\] with K = 260"):
        blockwise.gemm(np.ones((2, 128), np.float32), q, s)
    with pytest.raises(ValueError, match="eps: expected a finite eps >= 5.27e-36"):
        blockwise.quantize_activations(np.ones((1, 4), np.float32), eps=0.0)
    with pytest.raises(ValueError, match=r"w: expected 2 dimensions \[N, K\]"):
        blockwise.quantize(np.ones(5, np.float32))
    with pytest.raises(ValueError, match="block"):
        blockwise.quantize(np.ones((4, 4), np.float32), block=(0, 128))


def test_nan_codes_are_found():
    q = np.full((3, 4), 0x38, np.uint8)
    q[1, 2], q[2, 0] = 0x7F, 0xFF
    assert blockwise.nan_code_positions(q).tolist() == [[1, 2], [2, 0]]
    assert np.isnan(blockwise.dequantize(q, np.ones((1, 1), np.float32))[1, 2])


def test_bf16_and_f16_scales_are_accepted(rng):
    import ml_dtypes

    q, s = blockwise.quantize(rng.standard_normal((130, 130)).astype(np.float32))
    for dtype in (np.float16, ml_dtypes.bfloat16):
        stored = s.astype(dtype)
        np.testing.assert_array_equal(
            blockwise.dequantize(q, stored), e4m3.decode(q) * np.repeat(np.repeat(stored.astype(np.float32), 128, 0), 128, 1)[:130, :130]
        )


# ---------------------------------------------------------------------------- concatenating weights along N


@given(st.lists(st.integers(1, 70), min_size=1, max_size=4), st.sampled_from([(8, 32), (16, 16), (48, 128)]),
       st.integers(1, 100), st.integers(0, 2**32 - 1))
def test_concatenate_rows_dequantizes_to_the_concatenated_parts(sizes, block, k, seed):
    """Random parts with partial edge blocks (in N and K): the fused weight dequantizes bit for bit to the
    row-concatenation of the dequantized parts, with block_n = gcd(block_n, sizes)."""
    rng = np.random.default_rng(seed)
    parts = [blockwise.quantize((rng.standard_normal((n, k)) * rng.uniform(0.01, 100)).astype(np.float32), block)
             for n in sizes]
    codes, scale_inv, new_block = blockwise.concatenate_rows(parts, block)
    assert new_block == (math.gcd(block[0], *sizes), block[1])
    assert codes.dtype == np.uint8 and scale_inv.dtype == np.float32
    assert scale_inv.shape == blockwise.scale_shape(codes.shape, new_block)
    want = np.concatenate([blockwise.dequantize(q, s, block) for q, s in parts])
    np.testing.assert_array_equal(blockwise.dequantize(codes, scale_inv, new_block), want)


def test_concatenate_rows_of_whole_blocks_keeps_the_scales(rng):
    block = (64, 128)
    parts = [blockwise.quantize(rng.standard_normal((n, 200)).astype(np.float32), block) for n in (128, 64, 64)]
    codes, scale_inv, new_block = blockwise.concatenate_rows(parts, block)
    assert new_block == block
    np.testing.assert_array_equal(scale_inv, np.concatenate([s for _, s in parts]))
    np.testing.assert_array_equal(codes, np.concatenate([q for q, _ in parts]))


def test_concatenate_rows_reblocks_parts_that_are_not_whole_blocks(rng):
    """Rows 128 + 64 + 64 in blocks of 48 (the GPU tests' micro model): re-blocked to 16 rows per scale."""
    block = (48, 128)
    parts = [blockwise.quantize(rng.standard_normal((n, 256)).astype(np.float32), block) for n in (128, 64, 64)]
    codes, scale_inv, new_block = blockwise.concatenate_rows(parts, block)
    assert new_block == (16, 128) and scale_inv.shape == (16, 2)
    want = np.concatenate([blockwise.dequantize(q, s, block) for q, s in parts])
    np.testing.assert_array_equal(blockwise.dequantize(codes, scale_inv, new_block), want)

def test_reblock_rows_repeats_each_scale_row(rng):
    scale_inv = rng.uniform(0.5, 2, (3, 2)).astype(np.float32)  # 40 rows in blocks of 16: the last is partial
    got = blockwise.reblock_rows(scale_inv, 40, 16, 8)
    np.testing.assert_array_equal(got, scale_inv[[0, 0, 1, 1, 2]])
    np.testing.assert_array_equal(blockwise.reblock_rows(scale_inv, 40, 16, 16), scale_inv)


def test_concatenate_rows_bad_input_names_the_problem(rng):
    block = (16, 32)
    a = blockwise.quantize(rng.standard_normal((16, 64)).astype(np.float32), block)
    b = blockwise.quantize(rng.standard_normal((8, 32)).astype(np.float32), block)
    with pytest.raises(ValueError, match="at least one"):
        blockwise.concatenate_rows([], block)
    with pytest.raises(ValueError, match=r"parts\[1\] codes: expected K = 64"):
        blockwise.concatenate_rows([a, b], block)
    with pytest.raises(ValueError, match=r"scale_inv: expected shape \(1, 2\)"):
        blockwise.concatenate_rows([a, (a[0], a[1][:, :1])], block)
    with pytest.raises(ValueError, match="parts.* codes: expected E4M3 codes"):
        blockwise.concatenate_rows([(a[0].astype(np.float32), a[1])], block)
    with pytest.raises(ValueError, match="new_block_n: expected a positive divisor of block_n = 16"):
        blockwise.reblock_rows(a[1], 16, 16, 6)
    with pytest.raises(ValueError, match="scale_inv: expected 1 rows"):
        blockwise.reblock_rows(np.ones((2, 2), np.float32), 16, 16, 8)
