"""fp8lab.simulators.gemv_simt against fp8lab.reference.blockwise.gemm, exact rounding and a by-hand lane loop.

Error bound on random data (``test_random_data_within_the_float32_bound``). Every elementary
product ``a_k * w_k * s_k`` enters the output through at most ``16 + T + 5`` float32 roundings:
the 16 fmas of its lane's partial, the ``T = ceil(K / 512)`` promotions of that lane, and the 5
butterfly additions (the fma's own products are exact). Recursive-summation analysis then gives
``|out - exact| <= gamma(21 + T) * sum_k |a_k w_k s_k|`` with ``gamma(n) = n u / (1 - n u)``,
``u = 2^-24``. The reference rounds each dequantized weight to float32 (``u`` relative) and
sums in float64 (``K * 2^-53``), so the test allows ``gamma(22 + T) + K * 2^-52``.
"""

from fractions import Fraction

import numpy as np
import pytest
from helpers.numerics import gamma
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import blockwise, e4m3
from fp8lab.simulators import common, fma
from fp8lab.simulators import gemv_simt as gs

# ---------------------------------------------------------------------------- exact fma


def exact_fma_f32(a, b, c) -> np.float32:
    """fl32(a*b + c) with one rounding, from exact rational arithmetic (no overflow in the tests)."""
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(x))  # within one float32 ulp of the answer
    candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return min(candidates, key=lambda y: (abs(Fraction(float(y)) - x), int(np.float32(y).view(np.uint32)) & 1))


def test_fma_f32_where_double_rounding_fails():
    # 641 * 6700417 = 2^32 + 1: the exact sum lies just above the float32 midpoint 2^56 + 2^32
    a, b, c = np.float32(641), np.float32(6700417), np.float32(2.0**56)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == 2.0**56  # float64 drops the +1, then the tie rounds to even
    assert fma.fma_f32(a, b, c) == fma.fma_f32_round_to_odd(a, b, c) == 2.0**56 + 2.0**33
    # 2693665 * 1632737 = 2^42 + 1: too far down even for an 80-bit long double
    a, b, c = np.float32(2693665), np.float32(1632737), np.float32(2.0**66)
    assert 2693665 * 1632737 == 2**42 + 1
    assert fma.fma_f32(a, b, c) == 2.0**66 + 2.0**43 == exact_fma_f32(a, b, c)
    # the same below a midpoint, and with signs flipped
    assert fma.fma_f32(np.float32(-641), b := np.float32(6700417), np.float32(-(2.0**56))) == -(2.0**56 + 2.0**33)
    assert fma.fma_f32(np.float32(641), np.float32(-6700417), np.float32(2.0**56)) == 2.0**56 - 2.0**32
    assert np.float32(2.0**56 - 2.0**32) == exact_fma_f32(641, -6700417, 2.0**56)
    assert b == 6700417


# Integer pairs f1 * f2 = 2^j +- 1 with both factors below 2^24 (float32 integers): with c whose
# float32 ulp is 2^(j+1), c + f1 f2 lies 1 away from a float32 midpoint, too little for float64.
NEAR_POWER_PRODUCTS = [
    (13325, 80581, 30, 1), (32767, 32769, 30, -1), (641, 6700417, 32, 1), (65535, 65537, 32, -1),
    (1048575, 1048577, 40, -1), (2693665, 1632737, 42, 1), (8388607, 8388609, 46, -1),
]


def double_rounding_traps(rng, n: int):
    """float32 (a, b, c) with a*b + c = (float32 midpoint) +- (far below float64's precision)."""
    f1, f2, j, _ = (np.array(col) for col in zip(*NEAR_POWER_PRODUCTS))
    pick = rng.integers(0, len(NEAR_POWER_PRODUCTS), n)
    e = rng.integers(-40, 20, n)
    a = np.ldexp(f1[pick].astype(np.float64), e) * rng.choice([-1, 1], n)
    b = f2[pick].astype(np.float64)
    mantissa = rng.integers(2**23 + 1, 2**24, n).astype(np.float64)  # not a power of two
    c = np.ldexp(mantissa, j[pick] + e + 1) * rng.choice([-1, 1], n)
    assert all(f1_ * f2_ == 2**j_ + d for f1_, f2_, j_, d in NEAR_POWER_PRODUCTS)
    return a.astype(np.float32), b.astype(np.float32), c.astype(np.float32)


def adversarial_fma_inputs(rng, n: int):
    """float32 (a, b, c) whose exact a*b + c falls on, or a hair off, float32 midpoints (double
    rounding traps among them), plus plain random ones, subnormal results and zeros."""
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    product = a.astype(np.float64) * b
    kind = rng.integers(0, 5, n)
    # a float32 value T near the product, and its upper midpoint
    target = product.astype(np.float32).astype(np.float64)
    midpoint = target + np.abs(target) * 2.0**-24
    c = np.where(kind == 0, (midpoint - product), 0.0)  # a*b + c near a midpoint (c rounded to float32)
    far = (rng.standard_normal(n) * 2.0 ** rng.integers(-80, 80, n))
    c = np.where(kind == 1, far, c)  # magnitudes far apart: sums inexact in float64
    c = np.where(kind == 2, -target, c)  # cancellation
    c = np.where(kind == 3, product * 2.0 ** rng.integers(20, 40, n), c)  # tiny product on a big c
    c = c.astype(np.float32)
    b = np.where(kind == 4, np.float32(2.0**-100), b).astype(np.float32)  # subnormal results
    c = np.where(kind == 4, (rng.standard_normal(n) * 2.0**-140), c).astype(np.float32)
    a[:8] = 0  # exact zeros
    traps = double_rounding_traps(rng, n // 4)
    return tuple(np.concatenate([x, t]) for x, t in zip((a, b, c), traps))


def test_fma_f32_rounds_once(rng):
    a, b, c = adversarial_fma_inputs(rng, 6000)
    got = fma.fma_f32(a, b, c)
    expected = np.array([exact_fma_f32(*abc) for abc in zip(a, b, c)], dtype=np.float32)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    assert np.array_equal(got, expected)
    assert np.array_equal(fma.fma_f32_round_to_odd(a, b, c), expected)
    naive = (a.astype(np.float64) * b + c).astype(np.float32)
    assert np.count_nonzero(naive != expected) > 100  # the traps do catch double rounding


def test_fma_f32_scalar_rounds_once_and_equals_the_array_form(rng):
    """The scalar form (the CUDA simulator's ``cuda.fma``) against exact rationals on the adversarial cases,
    and bit for bit the array form on those and on NaNs (NumPy's and the GPU's payloads), infinities,
    overflow past float32's largest value (and the tie just above it), signed zeros and subnormals."""
    a, b, c = adversarial_fma_inputs(rng, 1500)
    got = np.array([fma.fma_f32_scalar(*abc) for abc in zip(a, b, c)], np.float32)
    expected = np.array([exact_fma_f32(*abc) for abc in zip(a, b, c)], np.float32)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    biggest = float(np.finfo(np.float32).max)
    gpu_nan, numpy_nan = (np.uint32(bits).view(np.float32) for bits in (0x7FFFFFFF, 0x7FC00000))
    specials = [(gpu_nan, 1, 1), (1, 1, gpu_nan), (numpy_nan, 2, -1), (1, numpy_nan, gpu_nan),
                (np.inf, 0, 1), (np.inf, 1, -np.inf), (-np.inf, 2, 3), (biggest, 2, 0), (biggest, 1, biggest),
                (-biggest, 1, -2.0**103), (biggest, 1, 2.0**103), (biggest, 1, 2.0**102), (-0.0, 1, 0.0),
                (0.0, -1, -0.0), (-0.0, 1, -0.0), (2.0**-75, 2.0**-75, 0), (2.0**-70, 2.0**-70, -(2.0**-149))]
    a, b, c = (np.array(column, np.float32) for column in zip(*specials))
    scalar = np.array([fma.fma_f32_scalar(*abc) for abc in zip(a, b, c)], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        array = fma.fma_f32(a, b, c)
    assert np.array_equal(scalar.view(np.uint32), array.view(np.uint32))
    assert np.isnan(scalar[:6]).all() and (scalar[6:9] == [-np.inf, np.inf, np.inf]).all()
    assert (scalar[9:12] == [-np.inf, np.inf, biggest]).all()  # the tie above the largest rounds away; below it, not


def test_fma_f32_broadcasts(rng):
    a = rng.standard_normal((3, 1, 5)).astype(np.float32)
    b = rng.standard_normal((4, 1)).astype(np.float32)
    c = rng.standard_normal(5).astype(np.float32)
    got = fma.fma_f32(a, b, c)
    assert got.shape == (3, 4, 5)
    expected = fma.fma_f32_round_to_odd(*np.broadcast_arrays(a, b, c))
    assert np.array_equal(got, expected)


# ---------------------------------------------------------------------------- data layout


def test_bit_placement_is_decode_times_2_to_minus_8():
    codes = np.arange(256, dtype=np.uint8)
    placed = gs.placed_weights(codes).astype(np.float64)
    finite = ~e4m3.is_nan(codes)
    assert np.array_equal(placed[finite], e4m3.VALUES[finite].astype(np.float64) * 2.0**-8)
    assert list(placed[list(e4m3.NAN_CODES)]) == [1.875, -1.875]  # finite: the kernel does not see NaN
    assert gs.f16_bits_of_e4m3(0x7E) == 0x3F00 and gs.f16_bits_of_e4m3(0x80) == 0x8000


@given(k=st.integers(1, 24).map(lambda i: 128 * i))
def test_lane_byte_map_covers_every_k_once(k):
    byte_map = gs.lane_byte_map(k)
    steps = -(-k // 512)
    assert byte_map.shape == (steps, 32, 16)
    read = byte_map[byte_map >= 0]
    assert np.array_equal(np.sort(read), np.arange(k))  # every k exactly once
    for t, lane in [(0, 0), (steps - 1, 31), (steps - 1, 0), (0, 5)]:
        start = 512 * t + 16 * lane
        expected = np.arange(start, start + 16) if start < k else np.full(16, -1)
        assert np.array_equal(byte_map[t, lane], expected)
    idle = (byte_map < 0).all(axis=2)
    assert idle.sum() == steps * 32 - k // 16  # whole lanes idle, only in the last step
    assert not idle[:-1].any()


def test_row_tiles_cover_the_rows():
    for m in range(1, 17):
        for m_tile in gs.M_TILES:
            rows = np.concatenate([np.arange(16)[s] for s in gs.row_tiles(m, m_tile)])
            assert np.array_equal(rows, np.arange(m))


def test_products_fit_float32_for_bf16_and_f16_values(rng):
    a = rng.standard_normal((4, 256)).astype(np.float32)
    assert not gs.products_fit_float32(a)
    assert gs.products_fit_float32(a.astype(np.float16).astype(np.float32))
    bf16 = (a.view(np.uint32) & 0xFFFF0000).view(np.float32)
    assert gs.products_fit_float32(bf16)
    assert not gs.products_fit_float32(bf16 * np.float32(2.0**-120))  # products would underflow


# ---------------------------------------------------------------------------- against the reference


@st.composite
def gemv_problems(draw, exact: bool):
    """Shapes (M 1..16, N, K a multiple of 128 often not of 512, BN any, BK multiple of 128),
    m_tile, and seeded data; ``exact`` draws data whose every float32 sum is exact."""
    m = draw(st.integers(1, 16))
    n = draw(st.integers(1, 24))
    k = 128 * draw(st.integers(1, 8))
    block = (draw(st.integers(1, n + 3)), 128 * draw(st.integers(1, 3)))
    m_tile = draw(st.sampled_from(gs.M_TILES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    nb, kb = blockwise.scale_shape((n, k), block)
    if exact:
        # |a| <= 8 integers, |w| <= 4 multiples of 1/8, scales 2^-2..2^2: every partial sum is a
        # multiple of 2^-5 below 8 * 4 * 1024 * 4 = 2^17, so it needs at most 22 bits: exact.
        small = np.array([c for c in range(256) if not e4m3.is_nan(c) and abs(e4m3.VALUES[c]) <= 4
                          and float(e4m3.VALUES[c] * 8).is_integer()], dtype=np.uint8)
        a = rng.integers(-8, 9, size=(m, k)).astype(np.float32)
        q = rng.choice(small, size=(n, k))
        scale_inv = np.ldexp(1.0, rng.integers(-2, 3, size=(nb, kb))).astype(np.float32)
    else:
        a = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
        q = rng.choice(np.array([c for c in range(256) if c not in e4m3.NAN_CODES], np.uint8), size=(n, k))
        scale_inv = (rng.uniform(0.5, 2.0, size=(nb, kb)) * 10.0 ** rng.uniform(-4, 0, size=(nb, kb))).astype(np.float32)
    assert np.any(a != 0) and np.any(e4m3.VALUES[q] != 0)
    return a, q, scale_inv, block, m_tile


@given(gemv_problems(exact=True))
def test_exact_on_integer_activations_and_power_of_two_scales(problem):
    a, q, scale_inv, block, m_tile = problem
    got = gs.gemv_simt(a, q, scale_inv, block, m_tile=m_tile)
    expected = blockwise.gemm(a, q, scale_inv, block)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.all(np.isfinite(got))
    assert np.array_equal(got, expected)


@given(gemv_problems(exact=False))
def test_random_data_within_the_float32_bound(problem):
    a, q, scale_inv, block, m_tile = problem
    k = a.shape[1]
    got = gs.gemv_simt(a, q, scale_inv, block, m_tile=m_tile)
    expected = blockwise.gemm(a, q, scale_inv, block)
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64)).T
    bound = (gamma(22 + gs.num_steps(k)) + k * 2.0**-52) * magnitude
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - expected) <= bound)


def whole_block_splits(k: int, bk: int) -> list[int]:
    return [s for s in gs.K_SPLITS if s == 1 or k % (s * bk) == 0]


@given(gemv_problems(exact=True), st.data())
def test_split_k_is_exact_on_exact_data(problem, data):
    """Split-K: the parts' sum in slice order, on data whose every float32 sum is exact, is the oracle."""
    a, q, scale_inv, block, m_tile = problem
    splits = data.draw(st.sampled_from(whole_block_splits(a.shape[1], block[1])))
    parts = gs.gemv_simt_split_k(a, q, scale_inv, splits, block, m_tile=m_tile)
    assert parts.shape == (splits,) + (a.shape[0], q.shape[0]) and parts.dtype == np.float32
    assert np.array_equal(gs.sum_parts(parts), blockwise.gemm(a, q, scale_inv, block))


@given(gemv_problems(exact=False), st.data())
def test_split_k_within_the_float32_bound(problem, data):
    """Each product passes the ``16 + T_slice + 5`` roundings of its slice and at most ``S - 1``
    additions of the parts."""
    a, q, scale_inv, block, m_tile = problem
    k = a.shape[1]
    splits = data.draw(st.sampled_from(whole_block_splits(k, block[1])))
    total = gs.sum_parts(gs.gemv_simt_split_k(a, q, scale_inv, splits, block, m_tile=m_tile))
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64)).T
    bound = (gamma(22 + gs.num_steps(k // splits) + splits) + k * 2.0**-52) * magnitude
    assert np.all(np.isfinite(total))
    assert np.all(np.abs(total - blockwise.gemm(a, q, scale_inv, block)) <= bound)


def test_split_k_of_one_slice_is_the_plain_model_and_bad_splits_are_refused():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((2, 384)).astype(np.float32)
    q = rng.integers(0, 0x7E, (3, 384)).astype(np.uint8)
    scale_inv = np.ones((1, 3), np.float32)
    assert np.array_equal(gs.gemv_simt_split_k(a, q, scale_inv, 1, (128, 128))[0], gs.gemv_simt(a, q, scale_inv))
    for bad in (0, 2, 4):
        with pytest.raises(ValueError, match="k_splits"):
            gs.gemv_simt_split_k(a, q, scale_inv, bad, (128, 128))


@given(gemv_problems(exact=False))
def test_m_tile_never_changes_the_bits(problem):
    a, q, scale_inv, block, _ = problem
    outputs = [gs.gemv_simt(a, q, scale_inv, block, m_tile=t) for t in gs.M_TILES]
    assert all(np.array_equal(outputs[0], o) for o in outputs[1:])


def test_float32_fast_path_equals_the_fma_path(rng):
    """bf16-valued activations take plain float32 arithmetic; it must give the fma chain's bits."""
    a = rng.standard_normal((3, 1024)).astype(np.float32)
    a = (a.view(np.uint32) & 0xFFFF0000).view(np.float32)
    q = rng.integers(0, 0x7E, size=(5, 1024)).astype(np.uint8)
    a_chunks = a.reshape(3, 64, 16).transpose(2, 0, 1)
    w_chunks = gs.placed_weights(q).reshape(5, 64, 16).transpose(2, 0, 1)
    fast = gs.lane_partials(a_chunks, w_chunks, exact_products=True)
    slow = gs.lane_partials(a_chunks, w_chunks, exact_products=False)
    assert np.all(np.isfinite(fast)) and np.array_equal(fast, slow)


# ---------------------------------------------------------------------------- the schedule, by hand


def gemv_by_hand(a, q, scale_inv, block) -> np.ndarray:
    """The kernel's loop nest, written with scalar loops: warp n, step t, lane L, element i."""
    (m, k), n = a.shape, q.shape[0]
    bn, bk = block
    out = np.zeros((m, n), dtype=np.float32)
    for col in range(n):
        for row in range(m):
            acc = np.zeros(32, dtype=np.float32)
            for t in range(-(-k // 512)):
                for lane in range(32):
                    k0 = 512 * t + 16 * lane
                    if k0 >= k:
                        continue  # idle lane
                    w = gs.placed_weights(q[col, k0 : k0 + 16])
                    part = np.float32(0)
                    for i in range(16):
                        part = fma.fma_f32(a[row, k0 + i], w[i], part)
                    s = np.float32(scale_inv[col // bn, k0 // bk]) * np.float32(256)
                    acc[lane] = fma.fma_f32(s, part, acc[lane])
            for off in (16, 8, 4, 2, 1):
                acc = np.array([acc[lane] + acc[lane ^ off] for lane in range(32)], dtype=np.float32)
            out[row, col] = acc[0]
    return out


def test_matches_the_loop_nest_bit_for_bit(rng):
    m, n, k, block = 2, 3, 640, (2, 256)  # K = 640: the second step has 8 busy lanes
    a = rng.standard_normal((m, k)).astype(np.float32)
    q = rng.integers(0, 0x7E, size=(n, k)).astype(np.uint8)
    scale_inv = rng.uniform(1e-3, 1e-1, size=blockwise.scale_shape((n, k), block)).astype(np.float32)
    expected = gemv_by_hand(a, q, scale_inv, block)
    for m_tile in (1, 2):
        got = gs.gemv_simt(a, q, scale_inv, block, m_tile=m_tile)
        assert np.all(np.isfinite(got)) and np.array_equal(got, expected)


def test_butterfly_leaves_the_total_in_every_lane(rng):
    acc = rng.integers(-1000, 1000, size=(2, 32)).astype(np.float32)
    total = common.butterfly_sum(acc)
    assert np.array_equal(total, np.repeat(acc.sum(axis=1, keepdims=True), 32, axis=1))


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "m, k, block, m_tile, message",
    [
        (1, 192, (128, 128), 8, "positive multiple of 128"),
        (1, 64, (128, 128), 8, "positive multiple of 128"),
        (1, 256, (128, 192), 8, "block_k must be a multiple of 128"),
        (1, 256, (0, 128), 8, "positive"),
        (17, 256, (128, 128), 8, "M <= 16"),
        (2, 256, (128, 128), 3, "m_tile"),
    ],
)
def test_bad_shapes_raise(rng, m, k, block, m_tile, message):
    a = rng.standard_normal((m, k)).astype(np.float32)
    q = rng.integers(0, 0x7E, size=(4, k)).astype(np.uint8)
    bn, bk = max(block[0], 1), block[1]
    scale_inv = np.ones((-(-4 // bn), -(-k // bk)), np.float32)
    with pytest.raises(ValueError, match=message):
        gs.gemv_simt(a, q, scale_inv, block, m_tile=m_tile)


def test_mismatched_arguments_raise(rng):
    a = rng.standard_normal((2, 256)).astype(np.float32)
    q = rng.integers(0, 0x7E, size=(4, 256)).astype(np.uint8)
    ones = np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="K = 256"):
        gs.gemv_simt(a, q[:, :128], ones)
    with pytest.raises(ValueError, match="scale_inv"):
        gs.gemv_simt(a, q, np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        gs.gemv_simt(a[0], q, ones)
    with pytest.raises(ValueError, match="codes"):
        gs.gemv_simt(a, q.astype(np.float32), ones)
    with pytest.raises(ValueError, match="K"):
        gs.lane_byte_map(100)


# ---------------------------------------------------------------------------- the vectorized model's shortcuts


def gemv_from_the_public_steps(a, q, scale_inv, block, m_tile) -> np.ndarray:
    """The model composed plainly from its public steps: decode every weight, ``lane_partials``,
    ``promote_partials``, ``butterfly_sum``, row tile by row tile (what ``gemv_simt`` computes in tiles,
    with a pair table and one multiply per single-row tile)."""
    m, k = a.shape
    n, chunks = q.shape[0], k // 16
    w_chunks = gs.placed_weights(q).reshape(n, chunks, 16).transpose(2, 0, 1)
    scales = gs.chunk_scales(scale_inv, n, k, block)
    out = np.empty((m, n), np.float32)
    for rows in gs.row_tiles(m, m_tile):
        a_chunks = np.ascontiguousarray(a.astype(np.float32).reshape(m, chunks, 16).transpose(2, 0, 1)[:, rows])
        part = gs.lane_partials(a_chunks, w_chunks, gs.products_fit_float32(a_chunks))
        out[rows] = common.butterfly_sum(gs.promote_partials(part, scales))[..., 0]
    return out


@given(gemv_problems(exact=False), st.sampled_from(["f32", "bf16", "mixed", "zeros"]), st.integers(1, 40))
def test_equals_the_public_steps_bit_for_bit(problem, activations, n):
    a, _, _, block, m_tile = problem
    rng = np.random.default_rng(n)
    m, k = a.shape
    q = rng.integers(0, 256, size=(n, k), dtype=np.uint8)  # every code, NaN codes included (placed as finite)
    scale_inv = rng.uniform(1e-3, 1.0, size=blockwise.scale_shape((n, k), block)).astype(np.float32)
    if activations == "bf16":  # the exact-product path
        a = (a.view(np.uint32) & 0xFFFF0000).view(np.float32)
    if activations == "mixed":  # even rows bf16, odd rows float32: row tiles take different paths
        a = np.where(np.arange(m)[:, None] % 2 == 0, (a.view(np.uint32) & 0xFFFF0000).view(np.float32), a)
    if activations == "zeros":  # signed zeros: the chain's 0 + (-0) = +0
        a = np.where(rng.random(a.shape) < 0.5, np.float32(-0.0), a)
    for tile in (1, m_tile):
        got = gs.gemv_simt(a, q, scale_inv, block, m_tile=tile)
        expected = gemv_from_the_public_steps(a, q, scale_inv, block, tile)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_pair_table_decodes_every_pair_of_codes():
    codes = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)  # every pair, as stored in memory
    pairs = gs._PLACED_PAIRS.view(np.float32).reshape(-1, 2)
    assert np.array_equal(pairs.view(np.uint32), gs.placed_weights(codes).view(np.uint32))


@pytest.mark.parametrize("may_be_tiny", [True, False])
def test_fma_f32_into_rounds_once(rng, may_be_tiny):
    a, b, c = adversarial_fma_inputs(rng, 6000)
    if not may_be_tiny:  # the caller's promise: every nonzero |a * b| >= 2^-125
        product = np.abs(a.astype(np.float64) * b)
        keep = (product == 0) | (product >= 2.0**-125)
        a, b, c = a[keep], b[keep], c[keep]
    expected = fma.fma_f32(a, b, c)
    for out_is in ("new", "a", "c"):
        out = {"new": np.empty_like(c), "a": a.copy(), "c": c.copy()}[out_is]
        args = (out if out_is == "a" else a, b, out if out_is == "c" else c)
        fma.fma_f32_into(*args, out, fma.FmaScratch(c.shape), may_be_tiny=may_be_tiny)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def fp8_fma_traps(rng, n: int):
    """float32 a, E4M3 values b and float32 c whose float64 sums often round onto float32 midpoints:
    short mantissas, c at and around half an ulp of the product, and tiny c below a float64 ulp."""
    values = e4m3.VALUES[np.isfinite(e4m3.VALUES)].astype(np.float32)
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    short = rng.random(n) < 0.5  # fewer significant bits: more exact products on a midpoint
    a_bits = a.view(np.uint32)
    a_bits[short] &= (np.uint32(0xFFFFFFFF) << rng.integers(0, 23, short.sum()).astype(np.uint32))
    b = rng.choice(values, n)
    product = a.astype(np.float64) * b
    half_ulp = np.abs(product.astype(np.float32)).astype(np.float64) * 2.0**-24
    kind = rng.integers(0, 4, n)
    c = product * 2.0 ** rng.integers(-70, 70, n) * rng.choice([-1, 1], n)
    near_half = half_ulp * rng.choice([0.5, 0.25, -0.5, -0.25, 1, -1], n) * (1 + rng.integers(-3, 4, n) * 2.0**-20)
    c = np.where(kind == 1, near_half, c)
    c = np.where(kind == 2, np.abs(product) * 2.0 ** rng.integers(-80, -50, n) * rng.choice([-1, 1], n), c)
    c = np.where(kind == 3, rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n), c)
    return a, b, c.astype(np.float32)


def test_fp8_factor_double_roundings_need_a_vanishing_addend(rng):
    """The fact behind ``fma_f32_into``'s ``fp8_bound``: with one factor an E4M3 value, every float64
    sum whose float32 rounding is wrong equals the product itself (the addend vanished in it)."""
    wrong = 0
    for _ in range(4):
        a, b, c = fp8_fma_traps(rng, 1 << 18)
        product = a.astype(np.float64) * b
        total = product + c
        with np.errstate(over="ignore"):
            bad = (total.astype(np.float32) != fma.fma_f32_round_to_odd(a, b, c)) & (np.abs(total) >= 2.0**-126)
        assert np.all(total[bad] == product[bad])
        assert np.all(np.abs(c[bad]) <= np.abs(product[bad]) * 2.0**-53)
        wrong += np.count_nonzero(bad)
    assert wrong > 1000  # the traps do make double rounding go wrong


def test_fma_f32_into_with_an_fp8_factor(rng):
    a, b, c = fp8_fma_traps(rng, 1 << 16)
    keep = np.isfinite(a.astype(np.float64) * b + c)
    a, b, c = a[keep], b[keep], c[keep]
    expected = fma.fma_f32(a, b, c)
    bound = float(np.max(np.abs(a.astype(np.float64) * b)))
    out = np.empty_like(c)
    fma.fma_f32_into(a, b, c, out, fma.FmaScratch(c.shape), fp8_bound=bound)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    # the same data, with the addends held back from vanishing: the bound check lets it skip the test
    big_c = np.where(np.abs(c) < bound * 2.0**-40, np.float32(bound), c).astype(np.float32)
    fma.fma_f32_into(a, b, big_c, out, fma.FmaScratch(c.shape), fp8_bound=bound)
    assert np.array_equal(out.view(np.uint32), fma.fma_f32(a, b, big_c).view(np.uint32))


def test_smallest_nonzero_magnitude(rng):
    for _ in range(300):
        x = (rng.standard_normal(40) * 2.0 ** rng.integers(-149, 127, 40)).astype(np.float32)
        x[rng.random(40) < 0.1] = rng.choice([0.0, -0.0])
        if rng.random() < 0.3:
            x = np.abs(x) * np.float32(rng.choice([-1, 1]))
        nonzero = np.abs(x[x != 0])
        expected = float(nonzero.min()) if nonzero.size else np.inf
        assert fma.smallest_nonzero_magnitude(x, np.empty(x.shape, np.uint32)) == expected
