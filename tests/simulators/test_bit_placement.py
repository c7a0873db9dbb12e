"""fp8lab.simulators.bit_placement: exhaustive over codes and code pairs, against fp8lab.reference.e4m3 and ml_dtypes."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fp8lab.reference import e4m3
from fp8lab.simulators import bit_placement as bp

ALL_CODES = np.arange(256, dtype=np.uint8)
NOT_NAN = ~e4m3.is_nan(ALL_CODES)
OFFSETS = {"bf16": 120, "f16": 8}


def oracle_value_bf16(bits: np.ndarray) -> np.ndarray:
    """BF16 patterns read by ml_dtypes, independent of the module's own reader."""
    return bits.view(ml_dtypes.bfloat16).astype(np.float64)


def oracle_value_f16(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(np.float64)


ORACLE_READ = {"bf16": oracle_value_bf16, "f16": oracle_value_f16}


def test_exponent_offsets():
    assert bp.BF16_EXPONENT_OFFSET == 127 - 7 == 120
    assert bp.F16_EXPONENT_OFFSET == 15 - 7 == 8
    assert bp.EXPONENT_OFFSET == OFFSETS


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_every_non_nan_code_places_exactly(fmt):
    bits = bp.code_to_bits(ALL_CODES, fmt)
    assert bits.dtype == np.uint16
    expected = e4m3.decode(ALL_CODES).astype(np.float64) * 2.0 ** -OFFSETS[fmt]
    for read in (ORACLE_READ[fmt], lambda b: bp.bits_to_float32(b, fmt).astype(np.float64)):
        got = read(bits)
        assert np.array_equal(got[NOT_NAN], expected[NOT_NAN])
        assert np.array_equal(np.signbit(got[NOT_NAN]), np.signbit(expected[NOT_NAN]))  # -0 stays -0
    assert np.array_equal(bp.placed_values(ALL_CODES, fmt)[NOT_NAN], expected[NOT_NAN].astype(np.float32))


def test_bit_patterns_are_the_contract_formulas():
    c = ALL_CODES.astype(np.uint32)
    assert np.array_equal(bp.code_to_bf16_bits(ALL_CODES), ((c & 0x80) << 8 | (c & 0x7F) << 4).astype(np.uint16))
    assert np.array_equal(bp.code_to_f16_bits(ALL_CODES), ((c & 0x80) << 8 | (c & 0x7F) << 7).astype(np.uint16))
    assert bp.code_to_bf16_bits(np.uint8(0x7E)) == 0x07E0 and bp.code_to_f16_bits(np.uint8(0xFE)) == 0xBF00


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_subnormals_map_to_subnormals(fmt):
    subnormal = np.array([c for c in range(256) if e4m3.code_class(c) == "subnormal"], dtype=np.uint8)
    assert len(subnormal) == 14
    values = np.abs(bp.placed_values(subnormal, fmt).astype(np.float64))
    smallest_normal = 2.0**-126 if fmt == "bf16" else 2.0**-14
    assert np.all((values > 0) & (values < smallest_normal))
    exponent_field = (bp.code_to_bits(subnormal, fmt) >> (7 if fmt == "bf16" else 10)) & (0xFF if fmt == "bf16" else 0x1F)
    assert np.all(exponent_field == 0)


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_nan_codes_become_finite_480(fmt):
    values = bp.placed_values(np.array(e4m3.NAN_CODES, dtype=np.uint8), fmt).astype(np.float64)
    assert np.all(np.isfinite(values))
    assert list(values * 2.0 ** OFFSETS[fmt]) == [bp.NAN_CODE_VALUE, -bp.NAN_CODE_VALUE] == [480.0, -480.0]
    expected_bits = {"bf16": [0x07F0, 0x87F0], "f16": [0x3F80, 0xBF80]}[fmt]
    assert list(bp.code_to_bits(np.array(e4m3.NAN_CODES, dtype=np.uint8), fmt)) == expected_bits


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_packed_register_both_halves_for_every_code_pair(fmt):
    low_code, high_code = (x.ravel().astype(np.uint8) for x in np.meshgrid(ALL_CODES, ALL_CODES, indexing="ij"))
    codes = np.stack([low_code, high_code], axis=-1)  # [65536, 2]: element 0 has the lower index
    pairs = bp.codes_to_pairs(codes)[:, 0]
    assert np.array_equal(pairs, low_code.astype(np.uint16) | high_code.astype(np.uint16) << 8)
    registers = bp.place_code_pair(pairs, fmt)
    assert registers.dtype == np.uint32
    low, high = bp.split_register(registers)
    assert np.array_equal(low, bp.code_to_bits(low_code, fmt))
    assert np.array_equal(high, bp.code_to_bits(high_code, fmt))
    # and the values, via the independent reader, for every non-NaN pair
    ok = ~e4m3.is_nan(low_code) & ~e4m3.is_nan(high_code)
    scale = 2.0 ** -OFFSETS[fmt]
    assert np.array_equal(ORACLE_READ[fmt](low)[ok], e4m3.decode(low_code[ok]).astype(np.float64) * scale)
    assert np.array_equal(ORACLE_READ[fmt](high)[ok], e4m3.decode(high_code[ok]).astype(np.float64) * scale)


def test_prmt_selects_bytes():
    a, b = np.uint32(0x33221100), np.uint32(0x77665544)
    assert bp.prmt(a, b, 0x3210) == 0x33221100  # identity
    assert bp.prmt(a, b, 0x7654) == 0x77665544  # all of b
    assert bp.prmt(a, b, 0x0123) == 0x00112233  # byte reverse of a
    assert bp.prmt(a, b, 0x4140) == 0x44114400  # interleave with b's byte 0
    assert bp.prmt(np.uint32(0xBEEF), 0, bp.SPREAD_TO_HIGH_BYTES) == 0xBE00EF00


def test_codes_to_pairs_is_little_endian_like_a_uint16_load():
    row = np.array([0x01, 0x02, 0x03, 0x04], dtype=np.uint8)
    assert np.array_equal(bp.codes_to_pairs(row), row.view("<u2"))
    with pytest.raises(ValueError, match="even"):
        bp.codes_to_pairs(row[:3])


@given(x=hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=32), elements=st.floats(width=32)))
def test_float32_to_bf16_rounds_like_ml_dtypes(x):
    got = bp.float32_to_bf16_bits(x)
    expected = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.all(np.isnan(bp.bf16_bits_to_float32(got[nan])))


def test_float32_to_bf16_ties_to_even_and_overflow(rng):
    # exact midpoints between neighbouring BF16 values: low 16 bits == 0x8000
    upper = rng.integers(0, 0x7F7F, size=1000, dtype=np.uint32)
    ties = ((upper << 16) | 0x8000).view(np.float32)
    got = bp.float32_to_bf16_bits(ties).astype(np.uint32)
    assert np.array_equal(got, np.where(upper % 2 == 0, upper, upper + 1))
    big = np.array([3.4e38, -3.4e38], dtype=np.float32)
    assert list(bp.bf16_bits_to_float32(bp.float32_to_bf16_bits(big))) == [np.inf, -np.inf]


@given(x=hnp.arrays(np.float32, hnp.array_shapes(max_dims=2, max_side=32), elements=st.floats(width=32, allow_nan=False)))
def test_float32_to_f16_and_back(x):
    bits = bp.float32_to_f16_bits(x)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(bp.f16_bits_to_float32(bits), expected)


def test_every_16_bit_pattern_reads_exactly():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(bp.bf16_bits_to_float32(bits), bits.view(ml_dtypes.bfloat16).astype(np.float32), equal_nan=True)
    assert np.array_equal(bp.f16_bits_to_float32(bits), bits.view(np.float16).astype(np.float32), equal_nan=True)
    finite = np.isfinite(bp.bf16_bits_to_float32(bits))
    assert np.array_equal(bp.float32_to_bf16_bits(bp.bf16_bits_to_float32(bits))[finite], bits[finite])


def test_activation_bits_accepts_bits_float32_bfloat16_and_refuses_float64(rng):
    x = rng.standard_normal(64).astype(np.float32)
    bits = bp.activation_bits(x, "bf16")
    assert bp.activation_bits(bits, "bf16") is bits
    assert np.array_equal(bp.activation_bits(x.astype(ml_dtypes.bfloat16), "bf16"), bits)
    assert np.array_equal(bp.activation_bits(x, "f16"), x.astype(np.float16).view(np.uint16))
    with pytest.raises(ValueError, match="float64"):
        bp.activation_bits(x.astype(np.float64), "bf16")
    with pytest.raises(ValueError, match="format"):
        bp.activation_bits(x, "fp8")


@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_folded_scale_restores_the_dequantized_value(fmt, rng):
    scale_inv = (rng.uniform(0.5, 2.0, 500) * 10.0 ** rng.uniform(-6, 1, 500)).astype(np.float32)
    codes = rng.choice(ALL_CODES[NOT_NAN], 500).astype(np.uint8)
    folded = bp.folded_scale(scale_inv, fmt)
    assert np.array_equal(folded.astype(np.float64), scale_inv.astype(np.float64) * 2.0 ** OFFSETS[fmt])  # exact
    via_placement = bp.placed_values(codes, fmt) * folded  # one float32 multiply, as the kernel does
    direct = e4m3.decode(codes) * scale_inv
    assert np.array_equal(via_placement, direct)
    assert np.any(direct != 0)


def test_folded_scale_overflow_domain():
    # documented: BF16 folding overflows once scale_inv >= 2^8
    s = np.array([2.0**8 * 0.99, 2.0**8], dtype=np.float32)
    with np.errstate(over="ignore"):
        assert list(np.isfinite(bp.folded_scale(s, "bf16"))) == [True, False]
    assert np.all(np.isfinite(bp.folded_scale(s, "f16")))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="uint8"):
        bp.code_to_bf16_bits(np.array([1.0]))
    with pytest.raises(ValueError, match="uint16"):
        bp.bf16_bits_to_float32(np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="format"):
        bp.code_to_bits(ALL_CODES, "e5m2")
