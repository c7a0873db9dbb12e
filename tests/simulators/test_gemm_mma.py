"""fp8lab.simulators.gemm_mma against the float64 oracle fp8lab.reference.blockwise.gemm (exact on integer data,
within the documented float32 bound on random data) and against a slow, per-warp walk of the
schedule built from the per-lane registers (bit for bit)."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import blockwise, e4m3
from fp8lab.reference import strategies as fst
from fp8lab.simulators import bit_placement as bp
from fp8lab.simulators import gemm_mma as G
from fp8lab.simulators import mma
from fp8lab.simulators.fma import fma_f32

U32 = 2.0**-24
FORMATS = st.sampled_from(bp.FORMATS)
M_BLOCKS = st.sampled_from(G.M_BLOCKS_CHOICES)
BLOCKS = st.tuples(st.sampled_from([8, 16, 24, 32, 128]), st.sampled_from([128, 256]))


def rounded_activations(a32: np.ndarray, fmt: str) -> np.ndarray:
    """The activations the kernel actually multiplies: ``a`` rounded to BF16/F16, as float64."""
    return bp.bits_to_float32(bp.activation_bits(a32, fmt), fmt).astype(np.float64)


def stated_bound(a64, q, scale_inv, block, fmt):
    """The error bound from the gemm_mma docstring, per output element."""
    chunks = q.shape[1] // G.K_CHUNK
    w = blockwise.dequantize(q, scale_inv, block).astype(np.float64)
    relative = (chunks + 9) * U32 * (np.abs(a64) @ np.abs(w).T)
    underflow = 15 * chunks * 2.0 ** (bp.EXPONENT_OFFSET[fmt] - 150) * float(np.max(scale_inv)) + chunks * 2.0**-150
    return relative + underflow


# ---------------------------------------------------------------------------- exact on integer data

SMALL_CODES = np.array([c for c in fst.NON_NAN_CODES if abs(float(e4m3.VALUES[c])) <= 4.0], dtype=np.uint8)


@given(
    m=st.integers(1, 40),
    n=st.integers(1, 100),
    chunks=st.integers(1, 4),
    block=BLOCKS,
    fmt=FORMATS,
    m_blocks=M_BLOCKS,
    seed=st.integers(0, 2**32 - 1),
)
def test_exactly_the_oracle_on_integer_activations_and_power_of_two_scales(m, n, chunks, block, fmt, m_blocks, seed):
    # Ranges chosen so that every intermediate is exact in float32: |a| <= 4, |decode(q)| <= 4
    # (a multiple of 2^-9, subnormals included), scales in {1/2, 1, 2}. A chunk's partial sum is
    # below 128 * 16 = 2^11 in units of 2^-9 (20 bits); c_fin below 4 * 2^11 * 2 = 2^14 in units
    # of 2^-10 (24 bits).
    rng = np.random.default_rng(seed)
    k = chunks * G.K_CHUNK
    a = rng.integers(-4, 5, size=(m, k)).astype(np.float32)
    q = rng.choice(SMALL_CODES, size=(n, k))
    scale_inv = np.ldexp(1.0, rng.integers(-1, 2, size=blockwise.scale_shape((n, k), block))).astype(np.float32)
    out = G.gemm_mma(a, q, scale_inv, block, m_blocks=m_blocks, activation=fmt)
    expected = blockwise.gemm(a, q, scale_inv, block)
    assert out.dtype == np.float32 and out.shape == (m, n)
    assert np.all(np.isfinite(out)) and np.any(out != 0)
    assert np.array_equal(out.astype(np.float64), expected)


@given(n=st.integers(1, 70), fmt=FORMATS, seed=st.integers(0, 2**32 - 1))
def test_exact_with_wide_power_of_two_scales_in_one_chunk(n, fmt, seed):
    # One chunk: c_fin = fma(s, c_part, 0) = s * c_part, exact for any power-of-two s in range.
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 9, size=(5, 128)).astype(np.float32)
    q = rng.choice(SMALL_CODES, size=(n, 128))
    scale_inv = np.ldexp(1.0, rng.integers(-40, 8, size=(-(-n // 8), 1))).astype(np.float32)
    out = G.gemm_mma(a, q, scale_inv, (8, 128), activation=fmt)
    assert np.all(np.isfinite(out)) and np.any(out != 0)
    assert np.array_equal(out.astype(np.float64), blockwise.gemm(a, q, scale_inv, (8, 128)))


# ---------------------------------------------------------------------------- within the bound on random data


@given(
    w=BLOCKS.flatmap(lambda block: fst.blockwise_weights(max_n=100, max_k=512, block=block, k_multiple=128)),
    m=st.integers(1, 40),
    fmt=FORMATS,
    m_blocks=M_BLOCKS,
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_data_within_the_stated_bound(w, m, fmt, m_blocks, magnitude, seed):
    rng = np.random.default_rng(seed)
    a = (magnitude * rng.standard_normal((m, w.k))).astype(np.float32)
    out = G.gemm_mma(a, w.q, w.scale_inv, w.block, m_blocks=m_blocks, activation=fmt)
    assert np.all(np.isfinite(out))
    a16 = rounded_activations(a, fmt)
    expected = blockwise.gemm(a16, w.q, w.scale_inv, w.block)
    assert np.any(expected != 0)
    assert np.all(np.abs(out - expected) <= stated_bound(a16, w.q, w.scale_inv, w.block, fmt))
    # Against the unrounded float32 activations, the 16-bit rounding dominates: per element the
    # unit roundoff 2^-p (BF16 p = 8, F16 p = 11) relative, or half the subnormal spacing absolute
    # (F16 is subnormal below 2^-14, where its spacing is 2^-24; BF16 below 2^-126).
    relative, absolute = {"bf16": (2.0**-8, 2.0**-134), "f16": (2.0**-11, 2.0**-25)}[fmt]
    a64 = np.abs(a.astype(np.float64))
    w64 = np.abs(blockwise.dequantize(w.q, w.scale_inv, w.block).astype(np.float64))
    loose = stated_bound(a64, w.q, w.scale_inv, w.block, fmt) * (1 + relative) + (relative * a64 + absolute) @ w64.T
    assert np.all(np.abs(out - blockwise.gemm(a, w.q, w.scale_inv, w.block)) <= loose)


@given(w=fst.blockwise_weights(max_n=64, max_k=384, block=(32, 128), k_multiple=128), m=st.integers(1, 40), fmt=FORMATS)
def test_m_blocks_do_not_change_a_single_bit(w, m, fmt):
    a = np.random.default_rng(m).standard_normal((m, w.k)).astype(np.float32)
    one = G.gemm_mma(a, w.q, w.scale_inv, w.block, m_blocks=1, activation=fmt)
    two = G.gemm_mma(a, w.q, w.scale_inv, w.block, m_blocks=2, activation=fmt)
    assert np.array_equal(one, two) and np.all(np.isfinite(one)) and np.any(one != 0)


# ---------------------------------------------------------------------------- bit for bit against a per-warp walk


def walk_the_schedule(a_bits, q, scale_inv, block, m_blocks, fmt):
    """The kernel's loops written out: grid, warps, m blocks, chunks, k16 steps; registers from
    ``warp_registers`` (pairwise bit placement), one ``mma_registers`` per warp and step, one
    ``fma`` per chunk. Slow, obviously sequential, and independent of gemm_mma's vectorization."""
    m, k = a_bits.shape
    n = q.shape[0]
    bn, bk = block
    out = np.full((m, n), np.nan, dtype=np.float32)  # poisoned: every stored element must be written
    grid_x, grid_y = -(-n // 32), -(-m // (16 * m_blocks))
    for cta_y in range(grid_y):
        for cta_x in range(grid_x):
            for warp in range(4):
                n_tile = cta_x * 4 + warp
                for m_block in range(m_blocks):
                    m_tile = cta_y * m_blocks + m_block
                    c_fin = np.zeros((32, 4), dtype=np.float32)
                    for chunk in range(k // 128):
                        c_part = np.zeros((32, 4), dtype=np.float32)
                        for step in range(8):
                            a_regs, b_regs = G.warp_registers(
                                a_bits, q, m_tile=m_tile, n_tile=n_tile, k_step=chunk * 8 + step, activation=fmt
                            )
                            c_part = mma.mma_registers(a_regs, b_regs, c_part, fmt)
                        n0 = 8 * n_tile
                        if n0 < n:
                            s = np.float32(scale_inv[n0 // bn, chunk * 128 // bk]) * np.float32(2.0 ** bp.EXPONENT_OFFSET[fmt])
                        else:
                            s = np.float32(0)
                        c_fin = fma_f32(s, c_part, c_fin)
                    tile = mma.store_c(c_fin)
                    row_count = min(16, m - 16 * m_tile)  # outputs past the end are not stored
                    col_count = min(8, n - 8 * n_tile)
                    if row_count > 0 and col_count > 0:
                        rows = slice(16 * m_tile, 16 * m_tile + row_count)
                        cols = slice(8 * n_tile, 8 * n_tile + col_count)
                        out[rows, cols] = tile[:row_count, :col_count]
    return out


@given(
    m=st.integers(1, 20),
    n=st.integers(1, 40),
    chunks=st.integers(1, 2),
    block=BLOCKS,
    fmt=FORMATS,
    m_blocks=M_BLOCKS,
    wide_span=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_bit_for_bit_the_per_warp_walk(m, n, chunks, block, fmt, m_blocks, wide_span, seed):
    rng = np.random.default_rng(seed)
    k = chunks * 128
    a = rng.standard_normal((m, k)).astype(np.float32)
    a = np.copysign(np.maximum(np.abs(a), np.float32(2.0**-6)), a)  # spans well inside the exactness proof
    if wide_span:  # defeat the exactness proof: gemm_mma must fall back to the ascending-k sum
        a *= np.ldexp(1.0, rng.integers(-12, 13, size=(m, k))).astype(np.float32)
        a[:, 3] = 2.0**12
        a[:, 5] = 2.0**-13
    a_bits = bp.activation_bits(a, fmt)
    assert G.every_k16_sum_is_exact(bp.bits_to_float32(a_bits, fmt), fmt) != wide_span
    q = rng.choice(np.array(fst.NON_NAN_CODES, dtype=np.uint8), size=(n, k))
    scale_inv = (rng.uniform(0.5, 2, size=blockwise.scale_shape((n, k), block)) * 1e-2).astype(np.float32)
    out = G.gemm_mma(a_bits, q, scale_inv, block, m_blocks=m_blocks, activation=fmt)
    walked = walk_the_schedule(a_bits, q, scale_inv, block, m_blocks, fmt)
    assert np.all(np.isfinite(out)) and np.any(out != 0)
    assert np.array_equal(out, walked)


# ---------------------------------------------------------------------------- pieces of the schedule


def test_fma_float32_rounds_once():
    a, b, c = np.float32(2665 * 2.0**-54), np.float32(402905), np.float32(1)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == 1.0  # double rounding lands on the tie and goes to even
    assert fma_f32(a, b, c) == np.float32(1 + 2.0**-23)
    assert fma_f32(a, -b, -c) == np.float32(-(1 + 2.0**-23))


def round_to_float32(x: Fraction) -> float:
    """Correct rounding of an exact rational to float32, ties to even (normal and subnormal)."""
    if x == 0:
        return 0.0
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    units, rest = divmod(x, ulp)
    if rest > ulp / 2 or (rest == ulp / 2 and units % 2 == 1):
        units += 1
    return sign * float(units * ulp)


def test_fma_float32_against_exact_rationals(rng):
    size = 400
    a = (rng.standard_normal(size) * np.ldexp(1.0, rng.integers(-70, 70, size))).astype(np.float32)
    b = (rng.standard_normal(size) * np.ldexp(1.0, rng.integers(-70, 70, size))).astype(np.float32)
    c = (rng.standard_normal(size) * np.ldexp(1.0, rng.integers(-140, 100, size))).astype(np.float32)
    c[::3] = -(a[::3] * b[::3])  # near-cancellation
    got = fma_f32(a, b, c)
    expected = [round_to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert np.array_equal(got, np.array(expected, dtype=np.float32))


@pytest.mark.parametrize("offset", [120, 8])
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_promotion_rounds_the_exact_product_once_where_the_scale_folds(offset, rng):
    """``promote``: for ``|s| < 2^(128 - offset)`` one rounding of the exact ``s 2^offset c_part + c_fin`` (finite
    even where ``c_part 2^offset`` alone is beyond float32); for larger scales ``c_part 2^offset`` rounded first;
    a NaN scale gives NaN. Against exact rationals."""
    size, limit = 300, 128 - offset
    s = np.ldexp(rng.uniform(1, 2, size), rng.integers(limit - 20, limit + 4, size)).astype(np.float32)
    exponents = np.minimum(rng.integers(-140, 40, size) - offset + 100, 126)  # some c_part * 2^offset overflow
    c_part = (rng.standard_normal(size) * np.ldexp(1.0, exponents)).astype(np.float32)
    c_fin = (rng.standard_normal(size) * np.ldexp(1.0, rng.integers(-40, 100, size))).astype(np.float32)
    s[:3] = np.float32(2.0 ** -20)
    c_part[:3] = np.float32(2.0 ** (130 - offset))  # c_part * 2^offset = 2^130: beyond float32; the product is not
    s[3] = np.nan
    got = G.promote(s, c_part, c_fin, offset)
    folds = np.abs(s) < 2.0 ** limit
    unplace = Fraction(2) ** offset
    for i in range(size):
        if folds[i]:
            exact = Fraction(float(s[i])) * unplace * Fraction(float(c_part[i])) + Fraction(float(c_fin[i]))
        elif np.isnan(s[i]):
            assert np.isnan(got[i])
            continue
        else:
            restored = np.float32(float(c_part[i]) * 2.0 ** offset)  # rounded: may overflow
            if not np.isfinite(restored):
                assert not np.isfinite(got[i])
                continue
            exact = Fraction(float(s[i])) * Fraction(float(restored)) + Fraction(float(c_fin[i]))
        expected = round_to_float32(exact)
        assert got[i] == expected or (np.isinf(got[i]) and abs(exact) >= 2 ** 128 - 2 ** 103), (i, got[i], expected)
    assert np.all(np.isfinite(got[:3])) and folds.mean() > 0.5 and (~folds).sum() > 20


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_exactness_proof_holds_at_its_limit(fmt):
    # Activations at the two ends of the allowed exponent span, with all significand bits set,
    # times the largest and the smallest E4M3 magnitudes: the float64 sum is still exact.
    p = G.ACTIVATION_PRECISION[fmt]
    limit = 31 - p
    e_max = 3
    full = 1 - 2.0**-p  # frexp fraction with all p bits set
    a = np.zeros((1, 16), dtype=np.float32)
    a[0, :8] = full * 2.0**e_max
    a[0, 8:] = full * 2.0 ** (e_max - limit)
    assert G.every_k16_sum_is_exact(a, fmt)
    a[0, 15] = full * 2.0 ** (e_max - limit - 1)
    assert not G.every_k16_sum_is_exact(a, fmt)
    a[0, 15] = a[0, 14]
    b = np.zeros((16, 1))
    b[:8, 0] = 448.0
    b[8:, 0] = 2.0**-9
    exact = sum(Fraction(float(a[0, i])) * Fraction(float(b[i, 0])) for i in range(16))
    # every prefix (any order would do; check ascending and descending)
    for order in (range(16), range(15, -1, -1)):
        total = 0.0
        for i in order:
            total += float(a[0, i]) * float(b[i, 0])
        assert Fraction(total) == exact


def test_nan_codes_compute_as_480():
    k = 128
    a = np.zeros((2, k), dtype=np.float32)
    a[0, 7], a[1, 7] = 1.0, -2.0
    q = np.zeros((3, k), dtype=np.uint8)
    q[:, 7] = [0x7F, 0xFF, 0x7E]
    scale_inv = np.full((1, 1), 0.5, dtype=np.float32)
    for fmt in bp.FORMATS:
        out = G.gemm_mma(a, q, scale_inv, (128, 128), activation=fmt)
        assert np.all(np.isfinite(out))
        assert np.array_equal(out, np.array([[240.0, -240.0, 224.0], [-480.0, 480.0, -448.0]], dtype=np.float32))


def test_schedule_geometry():
    s = G.Schedule(m=33, n=100, k=384, m_blocks=2)
    assert s.m_tile == 32 and s.grid == (4, 2) and (s.m_padded, s.n_padded) == (64, 128)
    assert (s.m16_tiles, s.n8_tiles, s.num_chunks) == (4, 16, 3)
    assert G.chunk_order(3) == [(0, 0), (1, 1), (2, 0)]


def test_leading_axes_and_bit_pattern_activations(rng):
    w = rng.standard_normal((40, 256)).astype(np.float32)
    q, scale_inv = blockwise.quantize(w)
    a = rng.standard_normal((2, 3, 256)).astype(np.float32)
    out = G.gemm_mma(a, q, scale_inv)
    assert out.shape == (2, 3, 40)
    assert np.array_equal(out.reshape(6, 40), G.gemm_mma(a.reshape(6, 256), q, scale_inv))
    assert np.array_equal(out, G.gemm_mma(bp.activation_bits(a, "bf16"), q, scale_inv))


def test_warp_registers_hold_the_placed_codes(rng):
    q = rng.choice(np.array(fst.NON_NAN_CODES, dtype=np.uint8), size=(20, 256))
    a = rng.standard_normal((36, 256)).astype(np.float32)
    a_regs, b_regs = G.warp_registers(a, q, m_tile=1, n_tile=2, k_step=9, activation="f16")
    assert a_regs.shape == (32, 4) and b_regs.shape == (32, 2)
    lane = 6  # g = 1, t = 2: b0, b1 = q[16 + 1, 144 + 4], q[16 + 1, 144 + 5]
    low, high = bp.split_register(b_regs[lane, 0])
    assert low == bp.code_to_f16_bits(q[17, 148]) and high == bp.code_to_f16_bits(q[17, 149])
    low, high = bp.split_register(a_regs[lane, 3])  # a6, a7 at (g + 8, 2t + 8), (g + 8, 2t + 9) of tile rows 16..
    assert low == bp.float32_to_f16_bits(a[16 + 9, 144 + 12]) and high == bp.float32_to_f16_bits(a[16 + 9, 144 + 13])
    # rows past the end read as zero
    a_regs, _ = G.warp_registers(a, q, m_tile=2, n_tile=0, k_step=0)
    assert np.all(mma.unpack_registers(a_regs)[mma.A_COORDS[:, :, 0] >= 4] == 0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=100), "multiple of 128"),
        (dict(block=(16, 64)), "block_k"),
        (dict(block=(12, 128)), "block_n"),
        (dict(m_blocks=3), "m_blocks"),
        (dict(activation="fp32"), "format"),
        (dict(a_k=256), "K = 128"),
        (dict(scale_rows=5), "scale_inv"),
        (dict(a_dtype=np.float64), "float64"),
        (dict(q_dtype=np.float32), "uint8"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_the_problem(change, message, rng):
    k = change.get("k", 128)
    block = change.get("block", (16, 128))
    q = rng.integers(0, 0x7E, size=(32, k)).astype(change.get("q_dtype", np.uint8))
    a = rng.standard_normal((4, change.get("a_k", k))).astype(change.get("a_dtype", np.float32))
    scale_shape = (change.get("scale_rows", -(-32 // block[0])), max(1, -(-k // block[1])))
    scale_inv = np.ones(scale_shape, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        G.gemm_mma(a, q, scale_inv, block, m_blocks=change.get("m_blocks", 1), activation=change.get("activation", "bf16"))
