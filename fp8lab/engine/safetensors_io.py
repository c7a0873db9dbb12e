"""A small, strict reader and writer of the safetensors format, in NumPy.

The format (https://github.com/huggingface/safetensors) is::

    [8 bytes]  N, the header length, unsigned little-endian
    [N bytes]  a JSON object: {"__metadata__": {str: str}?,
                               name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
               (writers pad it with spaces to a multiple of 8 bytes)
    [rest]     the byte buffer: each tensor's raw little-endian, row-major bytes at
               [begin, end) relative to the start of the buffer

NumPy has no bfloat16 or float8 dtype, so tensors come back as:

=========  =========================  ======================================================
stored     returned                   how
=========  =========================  ======================================================
F8_E4M3    uint8 E4M3 codes           as stored (decode with ``fp8lab.reference.e4m3.decode``)
BF16       float32, exactly           the 16 bits become the upper half of a float32
F16        float32, exactly           widening cast
F32        float32                    as stored
F64, U8, I8, I16, I32, I64, BOOL       their NumPy dtype
=========  =========================  ======================================================

and the stored dtype name is always available beside the array (``TensorInfo.dtype``).
Writing goes the other way: BF16 from float32 with round-to-nearest-even, F8_E4M3 from uint8
codes, F16 from float16/float32 (NumPy's round-to-nearest-even cast), F32 from float32.

Reading is strict and lazy: ``SafetensorsFile`` checks the whole header when it opens a file
(truncation, header length, JSON, dtypes, shapes, offsets that are out of range, overlap, leave
holes or do not match ``prod(shape) * itemsize``) and then memory-maps the file, so reading one
tensor touches only that tensor's bytes. Every problem is a ``ValueError`` that names the file
and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the one BF16 rounding and widening (fp8lab.reference.dense)
from fp8lab.reference.dense import bf16_bits_to_float32, float32_to_bf16_bits

HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The safetensors library refuses headers above 100 MB; so do we (a corrupt length is usually huge)."""

STORAGE_DTYPES: dict[str, np.dtype] = {
    "F8_E4M3": np.dtype("u1"),
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "BOOL": np.dtype("?"),
}
"""How each supported dtype is laid out in the file (BF16 is read as its raw 16-bit patterns)."""

FLOAT_DTYPES = ("BF16", "F16", "F32")
"""The stored floats that are returned as float32."""


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: the stored dtype name, the shape and the byte range in the buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


# ----------------------------------------------------------------------------------------------
# Reading


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads`` hook: plain ``json`` would silently keep the last of two equal keys."""
    d = {}
    for key, value in pairs:
        if key in d:
            raise _DuplicateKey(key)
        d[key] = value
    return d


def _parse_header(path: Path, file_size: int, head: bytes) -> tuple[dict, int]:
    """Return the parsed JSON header and the file offset where the byte buffer starts."""
    if file_size < HEADER_LENGTH_BYTES:
        raise ValueError(f"{path}: truncated safetensors file ({file_size} bytes; the 8-byte header length is missing)")
    (header_len,) = struct.unpack("<Q", head[:HEADER_LENGTH_BYTES])
    if header_len > file_size - HEADER_LENGTH_BYTES:
        raise ValueError(
            f"{path}: header length {header_len} runs past the end of the file "
            f"({file_size} bytes): truncated or corrupt safetensors file"
        )
    if header_len > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    raw = head[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + header_len]
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    except _DuplicateKey as e:
        raise ValueError(f"{path}: tensor {e.args[0]!r} appears twice in the safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}")
    return header, HEADER_LENGTH_BYTES + header_len


def _parse_entry(path: Path, name: str, entry) -> TensorInfo:
    """Check one header entry's fields and turn it into a ``TensorInfo``."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"{where}: header entry must have dtype, shape and data_offsets, got {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"{where}: unknown or unsupported dtype {dtype!r}; fp8lab reads {sorted(STORAGE_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    expected = math.prod(info.shape) * STORAGE_DTYPES[dtype].itemsize
    if info.nbytes != expected:
        raise ValueError(
            f"{where}: data_offsets {offsets} hold {info.nbytes} bytes, but {dtype} {list(shape)} needs {expected}"
        )
    return info


def _check_buffer_layout(path: Path, infos: list[TensorInfo], buffer_size: int) -> None:
    """The tensors must tile the byte buffer exactly: in range, no overlap, no holes."""
    position = 0
    for info in sorted(infos, key=lambda i: (i.begin, i.end)):
        if info.begin < position:
            raise ValueError(f"{path}: tensor {info.name!r}: data_offsets [{info.begin}, {info.end}] overlap another tensor")
        if info.begin > position:
            raise ValueError(f"{path}: tensor {info.name!r}: bytes [{position}, {info.begin}) of the buffer belong to no tensor")
        if info.end > buffer_size:
            raise ValueError(
                f"{path}: tensor {info.name!r}: data_offsets [{info.begin}, {info.end}] run past the end of the "
                f"{buffer_size}-byte buffer: truncated or corrupt safetensors file"
            )
        position = info.end
    if position != buffer_size:
        raise ValueError(f"{path}: {buffer_size - position} bytes after the last tensor belong to no tensor")


class SafetensorsFile:
    """An opened, fully validated safetensors file; tensors are read on demand.

    >>> f = SafetensorsFile("model.safetensors")      # doctest: +SKIP
    >>> f.names(), f.info("lm_head.weight").dtype     # doctest: +SKIP
    >>> w = f.read("lm_head.weight")                  # float32 for BF16/F16/F32, uint8 codes for F8_E4M3
    """

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such safetensors file")
        file_size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(HEADER_LENGTH_BYTES)
            if len(head) == HEADER_LENGTH_BYTES:
                (n,) = struct.unpack("<Q", head)
                if n <= min(file_size - HEADER_LENGTH_BYTES, MAX_HEADER_BYTES):
                    head += f.read(n)
        header, self._data_start = _parse_header(self.path, file_size, head)
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError(f"{self.path}: __metadata__ must map strings to strings, got {metadata!r}")
        self.metadata: dict[str, str] = metadata
        infos = [_parse_entry(self.path, name, entry) for name, entry in header.items()]
        _check_buffer_layout(self.path, infos, file_size - self._data_start)
        self._infos = {info.name: info for info in infos}

    def names(self) -> list[str]:
        """Tensor names in header order."""
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor named {name!r}") from None

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def read_raw(self, name: str) -> np.ndarray:
        """The stored elements as their storage dtype (BF16 as uint16 bit patterns), copied into memory."""
        info = self.info(name)
        dtype = STORAGE_DTYPES[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype=dtype)
        # A read-only map of just this tensor's bytes; np.array copies them so the file can close.
        mapped = np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + info.begin, shape=info.shape)
        array = np.array(mapped)
        del mapped
        return array

    def read(self, name: str) -> np.ndarray:
        """One tensor: F8_E4M3 as uint8 codes, BF16/F16/F32 as float32, other dtypes as NumPy has them."""
        info = self.info(name)
        raw = self.read_raw(name)
        if info.dtype == "BF16":
            return bf16_bits_to_float32(raw)
        if info.dtype in FLOAT_DTYPES:
            return raw.astype(np.float32)
        return raw.astype(raw.dtype.newbyteorder("="))


def read_safetensors(path, names=None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read ``names`` (default: all) from a file; returns ``(tensors, stored_dtypes)``."""
    f = SafetensorsFile(path)
    wanted = f.names() if names is None else list(names)
    return {n: f.read(n) for n in wanted}, {n: f.info(n).dtype for n in wanted}


# ----------------------------------------------------------------------------------------------
# Writing


def default_dtype(array: np.ndarray) -> str:
    """The stored dtype an array gets when the caller names none (uint8 stays U8: say F8_E4M3 for codes)."""
    by_numpy = {"float32": "F32", "float16": "F16", "float64": "F64", "uint8": "U8", "int8": "I8",
                "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}  # fmt: skip
    try:
        return by_numpy[array.dtype.name]
    except KeyError:
        raise ValueError(f"no safetensors dtype for NumPy dtype {array.dtype}") from None


def to_storage(name: str, array, dtype: str) -> np.ndarray:
    """Convert ``array`` to the little-endian storage elements of ``dtype``; refuse lossy surprises.

    BF16 and F16 accept float32 (or float16) input and round to nearest even; float64 input is
    refused for them because going through float32 would round twice. F8_E4M3 takes uint8 codes
    only (encode floats with ``fp8lab.reference.e4m3.encode`` or ``fp8lab.reference.blockwise.quantize``).
    """
    a = np.asarray(array)
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}; fp8lab writes {sorted(STORAGE_DTYPES)}")
    if dtype == "F8_E4M3":
        if a.dtype != np.uint8:
            raise ValueError(f"tensor {name!r}: F8_E4M3 is written from uint8 E4M3 codes, got dtype {a.dtype}")
        return a
    if dtype in ("BF16", "F16"):
        if a.dtype not in (np.float32, np.float16):
            raise ValueError(f"tensor {name!r}: {dtype} is written from float32 (or float16), got dtype {a.dtype}")
        return float32_to_bf16_bits(a).astype("<u2") if dtype == "BF16" else a.astype("<f2")
    target = STORAGE_DTYPES[dtype]
    if dtype == "F32" and a.dtype not in (np.float32, np.float16):
        raise ValueError(f"tensor {name!r}: F32 is written from float32 (or float16), got dtype {a.dtype}")
    if dtype not in ("F32",) and a.dtype.newbyteorder("=") != target.newbyteorder("="):
        raise ValueError(f"tensor {name!r}: {dtype} is written from {target.newbyteorder('=')}, got dtype {a.dtype}")
    return a.astype(target)


def header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length plus the JSON header (padded with spaces to a multiple of 8) for
    ``entries`` of ``(name, dtype, shape, nbytes)`` laid out back to back in that order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path, tensors: dict, dtypes: dict[str, str] | None = None, metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (name -> array) to ``path`` in their given order; returns the file size.

    ``dtypes`` names the stored dtype per tensor (``"BF16"``, ``"F8_E4M3"``, ...); tensors it does
    not name keep their NumPy dtype (``default_dtype``). The file is written to a temporary name
    next to ``path`` and renamed into place, so a crash never leaves a half-written file (and an
error or Ctrl-C while writing removes the temporary one).
    """
    path = Path(path)
    dtypes = dtypes or {}
    stored = []
    for name, array in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"{path}: invalid tensor name {name!r}")
        dtype = dtypes.get(name) or default_dtype(np.asarray(array))
        stored.append((name, dtype, to_storage(name, array, dtype)))
    head = header_bytes([(n, d, a.shape, a.nbytes) for n, d, a in stored], metadata)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for _, _, a in stored:
                f.write(a.tobytes(order="C"))  # row-major; the storage dtypes are little-endian
        os.replace(tmp, path)
    except BaseException:  # an error, a full disk or Ctrl-C: leave no half-written .tmp behind
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size
