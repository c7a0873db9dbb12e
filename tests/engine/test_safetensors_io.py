"""fp8lab.engine.safetensors_io: round trips for every dtype, BF16 rounding against ml_dtypes, the
writer and reader against the real ``safetensors`` library, and every kind of corrupt file."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from fp8lab.engine import safetensors_io as sio

# ----------------------------------------------------------------------------------------------
# helpers


def random_array(rng, dtype: str, shape) -> np.ndarray:
    """Random data of the in-memory type each stored dtype is written from (never all zeros)."""
    if dtype == "F8_E4M3":
        return rng.integers(0, 256, size=shape).astype(np.uint8)
    if dtype in ("BF16", "F16", "F32"):
        return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)
    if dtype == "F64":
        return rng.standard_normal(shape)
    if dtype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    info = np.iinfo(sio.STORAGE_DTYPES[dtype])
    return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(sio.STORAGE_DTYPES[dtype].newbyteorder("="))


def expected_after_read(dtype: str, array: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return array.astype(ml_dtypes.bfloat16).astype(np.float32)
    if dtype == "F16":
        return array.astype(np.float16).astype(np.float32)
    return array


def write_raw(path, header: dict, buffer: bytes) -> None:
    """A safetensors file with an arbitrary header (for corruption tests)."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + buffer)


def valid_two_tensor_file(path):
    tensors = {"a.weight": np.arange(1, 7, dtype=np.float32).reshape(2, 3), "b.codes": np.arange(1, 5, dtype=np.uint8)}
    sio.write_safetensors(path, tensors, {"b.codes": "F8_E4M3"})
    return tensors


# ----------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("dtype", sorted(sio.STORAGE_DTYPES))
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_round_trip_every_dtype(tmp_path_factory, dtype, shape, seed):
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("rt") / "x.safetensors"
    a = random_array(rng, dtype, tuple(shape))
    b = random_array(rng, dtype, (3, 2))
    sio.write_safetensors(path, {"first": a, "second": b}, {"first": dtype, "second": dtype}, {"format": "pt"})
    f = sio.SafetensorsFile(path)
    assert f.names() == ["first", "second"]
    assert f.metadata == {"format": "pt"}
    for name, original in (("first", a), ("second", b)):
        got = f.read(name)
        assert f.info(name).dtype == dtype
        assert got.shape == original.shape
        want = expected_after_read(dtype, original)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_read_returns_float32_and_codes(tmp_path, rng):
    path = tmp_path / "x.safetensors"
    x = rng.standard_normal((4, 5)).astype(np.float32)
    codes = rng.integers(0, 256, (3, 3)).astype(np.uint8)
    sio.write_safetensors(path, {"x": x, "q": codes, "h": x}, {"x": "BF16", "q": "F8_E4M3", "h": "F16"})
    tensors, dtypes = sio.read_safetensors(path)
    assert dtypes == {"x": "BF16", "q": "F8_E4M3", "h": "F16"}
    assert tensors["x"].dtype == np.float32 and tensors["h"].dtype == np.float32
    assert tensors["q"].dtype == np.uint8
    np.testing.assert_array_equal(tensors["q"], codes)
    only, _ = sio.read_safetensors(path, names=["q"])
    assert list(only) == ["q"]


def test_read_copies_out_of_the_file(tmp_path, rng):
    """A returned array does not change when the file is overwritten afterwards."""
    path = tmp_path / "x.safetensors"
    x = rng.standard_normal((8, 8)).astype(np.float32)
    sio.write_safetensors(path, {"x": x})
    got = sio.SafetensorsFile(path).read("x")
    sio.write_safetensors(path, {"x": -x})
    np.testing.assert_array_equal(got, x)


# ----------------------------------------------------------------------------------------------
# BF16 conversion against ml_dtypes


def test_bf16_decode_all_65536_patterns():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    ours = sio.bf16_bits_to_float32(bits)
    theirs = bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200))
def test_bf16_encode_matches_ml_dtypes_on_random_bit_patterns(patterns):
    x = np.array(patterns, dtype=np.uint32).view(np.float32)
    ours = sio.float32_to_bf16_bits(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.all(np.isnan(sio.bf16_bits_to_float32(ours[nan])))
    # the sign of a NaN is kept
    np.testing.assert_array_equal(ours[nan] >> 15, (x[nan].view(np.uint32) >> 31).astype(np.uint16))


def test_bf16_ties_round_to_even_and_overflow_to_infinity():
    one_plus_half_ulp = np.uint32(0x3F808000).view(np.float32)  # 1 + 2^-8: halfway, even neighbour 1.0
    three_halves_ulp = np.uint32(0x3F818000).view(np.float32)  # halfway between 0x3F81 and 0x3F82: to 0x3F82
    big = np.float32(np.finfo(np.float32).max)
    bits = sio.float32_to_bf16_bits(np.array([one_plus_half_ulp, three_halves_ulp, big, -big]))
    np.testing.assert_array_equal(bits, [0x3F80, 0x3F82, 0x7F80, 0xFF80])


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=100))
def test_bf16_writer_against_safetensors_deserialize(tmp_path_factory, patterns):
    x = np.array(patterns, dtype=np.uint32).view(np.float32)
    x = np.where(np.isnan(x), np.float32(1.5), x)  # NaN payloads are ours to choose; compare finite/inf only
    path = tmp_path_factory.mktemp("bf16") / "x.safetensors"
    sio.write_safetensors(path, {"x": x}, {"x": "BF16"})
    (name, entry), = safetensors.deserialize(path.read_bytes())
    assert name == "x" and entry["dtype"] == "BF16" and entry["shape"] == [len(patterns)]
    np.testing.assert_array_equal(np.frombuffer(bytes(entry["data"]), "<u2"), x.astype(ml_dtypes.bfloat16).view(np.uint16))


# ----------------------------------------------------------------------------------------------
# the real safetensors library reads what we write, and we read what it writes


def test_writer_against_safe_open(tmp_path, rng):
    path = tmp_path / "x.safetensors"
    tensors = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal((5,)).astype(np.float32),
        "u8": rng.integers(0, 256, (2, 3, 4)).astype(np.uint8),
        "i64": rng.integers(-(2**40), 2**40, (7,)),
    }
    sio.write_safetensors(path, tensors, {"f16": "F16"}, {"format": "pt"})
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "pt"}
        np.testing.assert_array_equal(f.get_tensor("f32"), tensors["f32"])
        np.testing.assert_array_equal(f.get_tensor("f16"), tensors["f16"].astype(np.float16))
        np.testing.assert_array_equal(f.get_tensor("u8"), tensors["u8"])
        np.testing.assert_array_equal(f.get_tensor("i64"), tensors["i64"])


def test_fp8_writer_against_deserialize(tmp_path, rng):
    path = tmp_path / "x.safetensors"
    codes = rng.integers(0, 256, (6, 7)).astype(np.uint8)
    sio.write_safetensors(path, {"w": codes}, {"w": "F8_E4M3"})
    (name, entry), = safetensors.deserialize(path.read_bytes())
    assert (name, entry["dtype"], entry["shape"]) == ("w", "F8_E4M3", [6, 7])
    assert bytes(entry["data"]) == codes.tobytes()


def test_reader_on_files_from_safetensors_numpy(tmp_path, rng):
    path = tmp_path / "lib.safetensors"
    tensors = {
        "a": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal((2, 2)).astype(np.float16),
        "c": rng.integers(0, 256, (9,)).astype(np.uint8),
        "d": rng.integers(-5, 5, (2, 5)).astype(np.int32),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    f = sio.SafetensorsFile(path)
    assert sorted(f.names()) == ["a", "b", "c", "d"]
    assert {n: f.info(n).dtype for n in tensors} == {"a": "F32", "b": "F16", "c": "U8", "d": "I32"}
    for name, original in tensors.items():
        np.testing.assert_array_equal(f.read(name), original.astype(np.float32) if original.dtype == np.float16 else original)


@pytest.mark.skipif(not hasattr(safetensors, "TensorSpec"), reason="safetensors.TensorSpec (raw-dtype serialize) needs safetensors >= 0.7")
def test_reader_on_bf16_and_fp8_files_from_safetensors(tmp_path, rng):
    x = rng.standard_normal((5, 3)).astype(np.float32)
    bf16_bits = np.ascontiguousarray(x.astype(ml_dtypes.bfloat16).view(np.uint16))
    codes = np.ascontiguousarray(rng.integers(0, 256, (4, 4)).astype(np.uint8))
    specs = {
        "x": safetensors.TensorSpec(dtype="bfloat16", shape=[5, 3], data_ptr=bf16_bits.ctypes.data, data_len=bf16_bits.nbytes),
        "q": safetensors.TensorSpec(dtype="float8_e4m3fn", shape=[4, 4], data_ptr=codes.ctypes.data, data_len=codes.nbytes),
    }
    path = tmp_path / "lib.safetensors"
    path.write_bytes(bytes(safetensors.serialize(specs, metadata={"format": "pt"})))
    f = sio.SafetensorsFile(path)
    assert (f.info("x").dtype, f.info("q").dtype) == ("BF16", "F8_E4M3")
    np.testing.assert_array_equal(f.read("x"), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(f.read("q"), codes)


# ----------------------------------------------------------------------------------------------
# the writer refuses lossy or ambiguous input


@pytest.mark.parametrize(
    "array, dtype, match",
    [
        (np.ones(3, np.float32), "F8_E4M3", "uint8 E4M3 codes"),
        (np.ones(3, np.float64), "BF16", "float32"),
        (np.ones(3, np.int32), "F32", "float32"),
        (np.ones(3, np.float32), "F8_E5M2", "unknown dtype"),
        (np.ones(3, np.float32), "I32", "int32"),
    ],
)
def test_writer_refuses(tmp_path, array, dtype, match):
    with pytest.raises(ValueError, match=match):
        sio.write_safetensors(tmp_path / "x.safetensors", {"t": array}, {"t": dtype})
    assert not (tmp_path / "x.safetensors").exists()


# ----------------------------------------------------------------------------------------------
# corrupt files: each is a ValueError naming the file (and the tensor where there is one)


@given(data=st.data())
def test_every_truncation_is_an_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("trunc") / "x.safetensors"
    valid_two_tensor_file(path)
    full = path.read_bytes()
    cut = data.draw(st.integers(0, len(full) - 1), label="cut")
    path.write_bytes(full[:cut])
    with pytest.raises(ValueError, match="truncated|not valid JSON|run past") as e:
        sio.SafetensorsFile(path)
    assert str(path) in str(e.value)


@given(data=st.data())
def test_every_wrong_header_length_is_an_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("hlen") / "x.safetensors"
    valid_two_tensor_file(path)
    full = path.read_bytes()
    (n,) = struct.unpack("<Q", full[:8])
    wrong = data.draw(st.one_of(st.integers(0, n - 1), st.integers(n + 1, 2**64 - 1)), label="header length")
    path.write_bytes(struct.pack("<Q", wrong) + full[8:])
    with pytest.raises(ValueError) as e:
        sio.SafetensorsFile(path)
    assert str(path) in str(e.value)


GOOD_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, buffer_size, match",
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, 12, "hold 12 bytes, but F32 \\[2\\] needs 8"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 4, "run past the end"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8, "0 <= begin <= end"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, 8, "0 <= begin <= end"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, 8, "data_offsets must be"),
        ({"t": GOOD_ENTRY, "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlap"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "belong to no tensor"),
        ({"t": GOOD_ENTRY}, 12, "after the last tensor"),
        ({"t": {"dtype": "F4", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown or unsupported dtype 'F4'"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "shape must be"),
        ({"t": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, 8, "shape must be"),
        ({"t": {"dtype": "F32", "shape": [2]}}, 8, "must have dtype, shape and data_offsets"),
        ({"t": GOOD_ENTRY, "__metadata__": {"format": 3}}, 8, "__metadata__"),
    ],
)
def test_bad_header_entries(tmp_path, header, buffer_size, match):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, bytes(range(1, buffer_size + 1)))
    with pytest.raises(ValueError, match=match) as e:
        sio.SafetensorsFile(path)
    assert str(path) in str(e.value)
    if "__metadata__" not in header:
        assert "'t'" in str(e.value) or "'u'" in str(e.value) or "after the last tensor" in str(e.value)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b'{"t": {"dtype": "F32", ', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b'{"t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}', "appears twice"),
    ],
)
def test_bad_json_headers(tmp_path, raw, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ValueError, match=match) as e:
        sio.SafetensorsFile(path)
    assert str(path) in str(e.value)


def test_missing_file_and_missing_tensor(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        sio.SafetensorsFile(tmp_path / "nope.safetensors")
    path = tmp_path / "x.safetensors"
    valid_two_tensor_file(path)
    with pytest.raises(ValueError, match="no tensor named 'c'"):
        sio.SafetensorsFile(path).read("c")


def test_header_is_padded_to_8_bytes_and_empty_file_is_valid(tmp_path):
    path = tmp_path / "empty.safetensors"
    sio.write_safetensors(path, {})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0 and len(data) == 8 + n
    assert sio.SafetensorsFile(path).names() == []
    assert safetensors.deserialize(data) == []


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    def interrupt(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(sio.os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        sio.write_safetensors(tmp_path / "w.safetensors", {"x": np.ones(4, np.float32)})
    assert list(tmp_path.iterdir()) == []
