"""fp8lab.reference.e4m3 against the independent oracle ml_dtypes.float8_e4m3fn, exhaustively and by property."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

from fp8lab.reference import e4m3
from fp8lab.reference import strategies as fst

ORACLE = ml_dtypes.float8_e4m3fn
ALL_CODES = np.arange(256, dtype=np.uint8)


def oracle_encode(x) -> np.ndarray:
    """ml_dtypes' cast (round to nearest even, overflow to NaN), as codes.

    ml_dtypes 0.6 casts float64 through float32, rounding twice, so float64 inputs must be
    float32-representable here; ``test_float64_is_rounded_once`` covers the rest.
    """
    x = np.asarray(x)
    if x.dtype == np.float64:
        assert np.array_equal(x.astype(np.float32).astype(np.float64), x, equal_nan=True)
    return x.astype(ORACLE).view(np.uint8)


def nearest_code_brute_force(x: float) -> int:
    """The E4M3 code nearest to a finite |x| <= 448 by search over all finite codes; ties to the
    even mantissa (even code). Independent of both encoders."""
    finite = np.array(fst.NON_NAN_CODES)
    values = e4m3.VALUES[finite].astype(np.float64)
    distance = np.abs(values - x)
    best = finite[distance == distance.min()]
    best = best[np.signbit(e4m3.VALUES[best]) == np.signbit(x)]  # +0 and -0 are both at distance |x|
    return int(best[best % 2 == 0][0]) if best.size > 1 else int(best[0])


def oracle_encode_saturating(x) -> np.ndarray:
    """Clip to +-448, then cast: the definition of saturate=True."""
    return oracle_encode(np.clip(x, -e4m3.MAX, e4m3.MAX))


def same_codes(a, b) -> bool:
    return np.array_equal(np.asarray(a, np.uint8), np.asarray(b, np.uint8))


def test_all_256_codes_decode_like_ml_dtypes():
    got = e4m3.decode(ALL_CODES)
    expected = ALL_CODES.view(ORACLE).astype(np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(got, expected, equal_nan=True)
    # -0.0 keeps its sign
    assert np.array_equal(np.signbit(got), np.signbit(expected))


def test_table_constants_and_landmarks():
    assert e4m3.MAX == 448.0 and e4m3.MIN_SUBNORMAL == 2.0**-9 and e4m3.MIN_NORMAL == 2.0**-6
    assert float(ORACLE(448.0)) == e4m3.MAX == float(ml_dtypes.finfo(ORACLE).max)
    assert e4m3.VALUES[0x7E] == 448.0 and e4m3.VALUES[0x01] == 2.0**-9 and e4m3.VALUES[0x08] == 2.0**-6
    assert [c for c in range(256) if np.isnan(e4m3.VALUES[c])] == list(e4m3.NAN_CODES)
    assert e4m3.VALUES[0x77] == 240.0  # the fnuz format's maximum is an ordinary value here
    rows = e4m3.table()
    assert len(rows) == 256 and rows[0x7E]["bits"] == "0.1111.110" and rows[0xFF]["kind"] == "nan"
    assert sum(r["kind"] == "subnormal" for r in rows) == 14 and sum(r["kind"] == "zero" for r in rows) == 2


def test_every_code_round_trips():
    finite = np.array(fst.NON_NAN_CODES, dtype=np.uint8)
    assert same_codes(e4m3.encode(e4m3.decode(finite)), finite)


def test_fields_rebuild_the_value():
    sign, exponent, mantissa = e4m3.fields(ALL_CODES)
    finite = ~e4m3.is_nan(ALL_CODES)
    # an independent formula: subnormals have an implicit 0 and exponent 1 - bias
    significand = np.where(exponent == 0, mantissa / 8.0, 1 + mantissa / 8.0)
    value = (-1.0) ** sign * significand * 2.0 ** (np.maximum(exponent.astype(int), 1) - 7)
    assert np.array_equal(value[finite], e4m3.VALUES[finite].astype(np.float64))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_encode_matches_ml_dtypes_on_dense_random_floats(rng, dtype):
    midpoints = fst._midpoints()
    with np.errstate(over="ignore"):  # 1e30 becomes inf in float16, which is part of the test
        x = _dense_samples(rng, midpoints, dtype)
    assert same_codes(e4m3.encode(x, saturate=False), oracle_encode(x))
    assert same_codes(e4m3.encode(x, saturate=True), oracle_encode_saturating(x))


def test_float64_is_rounded_once(rng):
    """float64 inputs a hair above or below a tie round to the nearer side, not to the tie's even side."""
    midpoints = fst._midpoints()
    midpoints = midpoints[midpoints <= e4m3.MAX]
    for sign in (1.0, -1.0):
        for nudge in (1 + 2.0**-40, 1 - 2.0**-40, 1.0):
            x = sign * midpoints * nudge
            got = e4m3.encode(x, saturate=True)
            expected = [nearest_code_brute_force(v) for v in x]
            assert got.tolist() == expected
    assert e4m3.encode(464 * (1 + 2.0**-40), saturate=False) == 0x7F
    assert e4m3.encode(2.0**-10 + 1e-12) == 0x01


def _dense_samples(rng, midpoints, dtype):
    if dtype == np.float64:  # float32-representable, see oracle_encode; then widened
        return _dense_samples(rng, midpoints, np.float32).astype(np.float64)
    return np.concatenate([
        rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 3.5, 20000),
        rng.uniform(-2 * e4m3.MIN_NORMAL, 2 * e4m3.MIN_NORMAL, 5000),  # subnormals
        rng.uniform(440, 490, 5000),  # around 448 / 464 / 480
        midpoints, -midpoints,  # exact ties
        [0.0, -0.0, 448, 464, 480, -464, 2.0**-10, 3 * 2.0**-11, 1e30, -1e30],
    ]).astype(dtype)


def test_ties_round_to_even():
    # 464 lies halfway between 448 (mantissa 110, even) and 480 (111, odd): it stays at 448
    assert e4m3.encode(464.0, saturate=False) == 0x7E
    assert e4m3.encode(np.nextafter(464.0, np.inf), saturate=False) == 0x7F
    # 2^-10 is halfway between 0 and the smallest subnormal: even is 0
    assert e4m3.encode(2.0**-10) == 0x00 and e4m3.encode(-(2.0**-10)) == 0x80
    # 1.0625 lies between 1.0 (0x38) and 1.125 (0x39): even is 1.0
    assert e4m3.encode(1.0625) == 0x38 and e4m3.encode(1.1875) == 0x3A


def test_overflow_policies_and_special_values():
    x = np.array([465.0, -1e9, np.inf, -np.inf, np.nan, -np.nan, -0.0])
    assert list(e4m3.encode(x, saturate=True)) == [0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0xFF, 0x80]
    assert list(e4m3.encode(x, saturate=False)) == [0x7F, 0xFF, 0x7F, 0xFF, 0x7F, 0xFF, 0x80]


@given(fst.e4m3_float_arrays())
def test_encode_matches_ml_dtypes_on_edge_floats(x):
    assert same_codes(e4m3.encode(x, saturate=False), oracle_encode(x))
    with np.errstate(invalid="ignore"):
        assert same_codes(e4m3.encode(x, saturate=True), oracle_encode_saturating(x))


@given(fst.e4m3_edge_floats(include_nonfinite=False))
def test_encode_is_nearest(x):
    """No representable value is closer to x than the one encode picks (saturating policy)."""
    code = int(e4m3.encode(x, saturate=True))
    target = min(max(x, -e4m3.MAX), e4m3.MAX)
    finite_values = e4m3.VALUES[list(fst.NON_NAN_CODES)].astype(np.float64)
    assert abs(float(e4m3.VALUES[code]) - target) == np.min(np.abs(finite_values - target))


@given(fst.e4m3_codes(allow_nan=True))
def test_decode_of_arbitrary_code_arrays_keeps_shape(codes):
    out = e4m3.decode(codes)
    assert out.shape == codes.shape and out.dtype == np.float32
    assert np.array_equal(np.isnan(out), e4m3.is_nan(codes))


def test_bad_input_is_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="codes.*integer.*float32"):
        e4m3.decode(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="0..255"):
        e4m3.decode(np.array([1, 256]))
    with pytest.raises(ValueError, match="x: expected a float array"):
        e4m3.encode(np.array(["1"]))
    assert e4m3.encode(464) == 0x7E  # integers are numbers too
    with pytest.raises(ValueError, match="0..255"):
        e4m3.code_class(300)
