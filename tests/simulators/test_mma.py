"""fp8lab.simulators.mma: fragment maps against an independent transcription of the PTX ISA, round trips,
register packing, and the accumulation model (exact on integers, bounded on random data)."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.simulators import bit_placement as bp
from fp8lab.simulators import figures, mma

U32 = 2.0**-24  # unit roundoff of float32


# ---------------------------------------------------------------------------- the PTX ISA table, transcribed again


def ptx_a_coords():
    """PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", fragment A:
    row = groupID for a0, a1, a4, a5, groupID + 8 for a2, a3, a6, a7;
    col = threadID_in_group * 2 + (i & 0x1) for a0..a3, the same + 8 for a4..a7."""
    coords = np.zeros((32, 8, 2), dtype=np.int64)
    for lane in range(32):
        group, tid = lane // 4, lane % 4
        for i in range(8):
            row = group if i in (0, 1, 4, 5) else group + 8
            col = tid * 2 + (i & 0x1) + (8 if i >= 4 else 0)
            coords[lane, i] = (row, col)
    return coords


def ptx_b_coords():
    """Fragment B (k x n): row = threadID_in_group * 2 + (i & 0x1) for b0, b1, + 8 for b2, b3;
    col = groupID."""
    coords = np.zeros((32, 4, 2), dtype=np.int64)
    for lane in range(32):
        group, tid = lane // 4, lane % 4
        for i in range(4):
            row = tid * 2 + (i & 0x1) + (8 if i >= 2 else 0)
            coords[lane, i] = (row, group)
    return coords


def ptx_c_coords():
    """Fragment C/D: row = groupID for c0, c1, groupID + 8 for c2, c3; col = threadID_in_group * 2 + (i & 0x1)."""
    coords = np.zeros((32, 4, 2), dtype=np.int64)
    for lane in range(32):
        group, tid = lane // 4, lane % 4
        for i in range(4):
            coords[lane, i] = (group if i < 2 else group + 8, tid * 2 + (i & 0x1))
    return coords


def test_fragment_maps_equal_the_ptx_isa_table():
    assert mma.A_COORDS.shape == (32, 8, 2) and mma.B_COORDS.shape == (32, 4, 2) and mma.C_COORDS.shape == (32, 4, 2)
    assert np.array_equal(mma.A_COORDS, ptx_a_coords())
    assert np.array_equal(mma.B_COORDS, ptx_b_coords())
    assert np.array_equal(mma.C_COORDS, ptx_c_coords())


def test_fragment_map_spot_checks_from_architecture_md():
    # lane 5: g = 1, t = 1
    assert [tuple(x) for x in mma.A_COORDS[5]] == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert [tuple(x) for x in mma.B_COORDS[5]] == [(2, 1), (3, 1), (10, 1), (11, 1)]
    assert [tuple(x) for x in mma.C_COORDS[5]] == [(1, 2), (1, 3), (9, 2), (9, 3)]
    assert tuple(mma.A_COORDS[31, 7]) == (15, 15) and tuple(mma.B_COORDS[31, 3]) == (15, 7)


@pytest.mark.parametrize(
    "coords, owners, shape",
    [(mma.A_COORDS, mma.A_OWNERS, (16, 16)), (mma.B_COORDS, mma.B_OWNERS, (16, 8)), (mma.C_COORDS, mma.C_OWNERS, (16, 8))],
)
def test_each_element_has_exactly_one_owner(coords, owners, shape):
    flat = coords[..., 0] * shape[1] + coords[..., 1]
    assert np.array_equal(np.sort(flat.ravel()), np.arange(shape[0] * shape[1]))
    lanes, index = owners[..., 0], owners[..., 1]
    assert np.array_equal(coords[lanes, index], np.stack(np.indices(shape), axis=-1))


# ---------------------------------------------------------------------------- loads and stores


@given(seed=st.integers(0, 2**32 - 1), batch=st.lists(st.integers(1, 3), max_size=2))
def test_load_store_round_trips(seed, batch):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((*batch, 16, 16)).astype(np.float32)
    b = rng.standard_normal((*batch, 16, 8)).astype(np.float32)
    c = rng.standard_normal((*batch, 16, 8)).astype(np.float32)
    assert mma.load_a(a).shape == (*batch, 32, 8) and mma.load_b(b).shape == (*batch, 32, 4)
    assert np.array_equal(mma.assemble_a(mma.load_a(a)), a)
    assert np.array_equal(mma.assemble_b(mma.load_b(b)), b)
    assert np.array_equal(mma.store_c(mma.load_c(c)), c)
    # B stored n-major (weight rows): same fragments as the k-major tile
    assert np.array_equal(mma.load_b_from_nk(np.swapaxes(b, -1, -2)), mma.load_b(b))
    # each lane really holds what the table says
    frag = mma.load_a(a)
    lane, i = 13, 6
    row, col = mma.A_COORDS[lane, i]
    assert np.array_equal(frag[..., lane, i], a[..., row, col])


def test_b_pairs_are_adjacent_bytes_of_a_weight_row():
    w = np.arange(8 * 16).reshape(8, 16)  # w[n, k]
    frag = mma.load_b_from_nk(w)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        assert list(frag[lane]) == [w[g, 2 * t], w[g, 2 * t + 1], w[g, 2 * t + 8], w[g, 2 * t + 9]]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"\[\.\.\., 16, 16\]"):
        mma.load_a(np.zeros((16, 8)))
    with pytest.raises(ValueError, match=r"\[\.\.\., 32, 4\]"):
        mma.store_c(np.zeros((32, 8)))
    with pytest.raises(ValueError, match="float32"):
        mma.mma(np.zeros((32, 8)), np.zeros((32, 4)), np.zeros((32, 4)))


# ---------------------------------------------------------------------------- registers


def test_register_packing_lower_index_in_low_half(rng):
    halves = rng.integers(0, 2**16, size=(3, 32, 8), dtype=np.uint16)
    regs = mma.pack_registers(halves)
    assert regs.dtype == np.uint32 and regs.shape == (3, 32, 4)
    assert np.array_equal(regs[..., 1], halves[..., 2].astype(np.uint32) | halves[..., 3].astype(np.uint32) << 16)
    assert np.array_equal(mma.unpack_registers(regs), halves)
    with pytest.raises(ValueError):
        mma.pack_registers(halves[..., :3])


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_mma_registers_equals_mma_on_values(fmt, rng):
    a = rng.standard_normal((2, 16, 16)).astype(np.float32)
    b = rng.standard_normal((2, 16, 8)).astype(np.float32)
    a_bits, b_bits = bp.float32_to_bits(a, fmt), bp.float32_to_bits(b, fmt)
    c = mma.load_c(rng.standard_normal((2, 16, 8)).astype(np.float32))
    via_regs = mma.mma_registers(mma.pack_registers(mma.load_a(a_bits)), mma.pack_registers(mma.load_b(b_bits)), c, fmt)
    via_values = mma.mma(mma.load_a(bp.bits_to_float32(a_bits, fmt)), mma.load_b(bp.bits_to_float32(b_bits, fmt)), c)
    assert np.array_equal(via_regs, via_values)


# ---------------------------------------------------------------------------- the accumulation model


def run_mma(a, b, c, **kwargs):
    """Tile-level convenience: D tile = mma on the fragments of A, B, C tiles."""
    return mma.store_c(mma.mma(mma.load_a(a), mma.load_b(b), mma.load_c(c), **kwargs))


@given(seed=st.integers(0, 2**32 - 1), limit=st.sampled_from([1, 4, 64, 256]))
def test_integer_inputs_give_exactly_a_at_b_plus_c(seed, limit):
    # |products| <= limit^2, |S| <= 16 limit^2 <= 2^20: every value and sum is an exact float32 integer
    rng = np.random.default_rng(seed)
    a = rng.integers(-limit, limit + 1, (4, 16, 16)).astype(np.float32)
    b = rng.integers(-limit, limit + 1, (4, 16, 8)).astype(np.float32)
    c = rng.integers(-limit, limit + 1, (4, 16, 8)).astype(np.float32)
    d = run_mma(a, b, c)
    assert d.dtype == np.float32
    expected = a.astype(np.int64) @ b.astype(np.int64) + c.astype(np.int64)
    assert np.array_equal(d, expected.astype(np.float32)) and np.array_equal(d.astype(np.int64), expected)
    assert np.any(d != 0)


def exact_model(a, b, c):
    """The documented model with exact rational arithmetic: fl32(c + fl32(exact sum))."""
    d = np.zeros((16, 8), dtype=np.float32)
    for i in range(16):
        for j in range(8):
            s = sum(Fraction(float(a[i, k])) * Fraction(float(b[k, j])) for k in range(16))
            d[i, j] = c[i, j] + np.float32(float(s))  # float(Fraction) rounds correctly to float64
    return d


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_random_inputs_follow_the_documented_model_exactly(fmt, rng):
    for _ in range(3):
        a = bp.bits_to_float32(bp.float32_to_bits(rng.standard_normal((16, 16)).astype(np.float32), fmt), fmt)
        b = bp.bits_to_float32(bp.float32_to_bits(rng.standard_normal((16, 8)).astype(np.float32), fmt), fmt)
        c = rng.standard_normal((16, 8)).astype(np.float32)
        # float(Fraction) is the correctly rounded float64; for these spans the float64 sum is exact,
        # so float32(float64) is the correctly rounded float32 of the exact sum.
        assert np.array_equal(run_mma(a, b, c), exact_model(a, b, c))
        assert np.array_equal(run_mma(a, b, c, sums_are_exact=True), run_mma(a, b, c))


@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from(bp.FORMATS), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_random_inputs_within_the_stated_bound_of_float64(seed, fmt, scale):
    # Bound: |d - (c + A @ B)| <= u |S| + u |c + S| (+ u^2 terms) <= 2.001 u (|c| + sum_k |a b|)
    rng = np.random.default_rng(seed)
    a = bp.bits_to_float32(bp.float32_to_bits((scale * rng.standard_normal((3, 16, 16))).astype(np.float32), fmt), fmt)
    b = bp.bits_to_float32(bp.float32_to_bits(rng.standard_normal((3, 16, 8)).astype(np.float32), fmt), fmt)
    c = (scale * rng.standard_normal((3, 16, 8))).astype(np.float32)
    d = run_mma(a, b, c)
    a64, b64, c64 = a.astype(np.float64), b.astype(np.float64), c.astype(np.float64)
    exact = c64 + a64 @ b64
    bound = 2.001 * U32 * (np.abs(c64) + np.abs(a64) @ np.abs(b64))
    assert np.all(np.isfinite(d))
    assert np.all(np.abs(d - exact) <= bound)


def test_batched_mma_equals_one_call_per_item(rng):
    a = rng.standard_normal((3, 1, 32, 8)).astype(np.float32)
    b = rng.standard_normal((1, 5, 32, 4)).astype(np.float32)
    c = rng.standard_normal((3, 5, 32, 4)).astype(np.float32)
    d = mma.mma(a, b, c)
    assert d.shape == (3, 5, 32, 4)
    for i in range(3):
        for j in range(5):
            assert np.array_equal(d[i, j], mma.mma(a[i, 0], b[0, j], c[i, j]))


def test_sum_is_float64_in_ascending_k_when_it_is_not_exact():
    # Exponents spanning far more than 33 binades: the float64 sum rounds, and the model fixes the
    # order: ((a0 b0 + a1 b1) + a2 b2) + ...
    a = np.zeros((16, 16), dtype=np.float32)
    b = np.zeros((16, 8), dtype=np.float32)
    b[:3, 0] = 1.0
    a[0, :3] = [2.0**60, 1.0, -(2.0**60)]
    assert mma.k16_sum(a, b)[0, 0] == 0.0  # 2^60 + 1 is not a float64: the 1 is lost
    a[0, :3] = [2.0**60, -(2.0**60), 1.0]
    assert mma.k16_sum(a, b)[0, 0] == 1.0
    assert mma.k16_sum(a, b).dtype == np.float64


# ---------------------------------------------------------------------------- the figures' tables


def test_figure_labels_follow_the_coordinate_maps():
    lanes, index, labels = figures.layout_table("a")
    assert labels[1][10] == "T5 a4" and labels[15][15] == "T31 a7"
    assert np.array_equal(np.stack([lanes, index], axis=-1), mma.A_OWNERS)
    _, _, b_labels = figures.layout_table("b")
    _, _, weight_row_labels = figures.layout_table("b", weight_rows=True)
    assert b_labels[3][1] == weight_row_labels[1][3] == "T5 b1"  # B[k=3, n=1] is w[n=1, k=3]
    assert figures.layout_table("c")[2][9][3] == "T5 c3"
    with pytest.raises(ValueError):
        figures.layout_table("a", weight_rows=True)
