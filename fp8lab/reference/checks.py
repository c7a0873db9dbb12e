"""Argument checks shared by the oracles (``fp8lab.reference``) and the simulators (``fp8lab.simulators``).

One copy of each check, so that the two views refuse the same calls with the same messages. Every failure is a ``ValueError`` that names the argument and says what was expected and what
was given, so that a wrong call fails loudly at the boundary instead of computing garbage.
"""

from __future__ import annotations

import numpy as np


def as_codes(name: str, codes) -> np.ndarray:
    """Return ``codes`` as a uint8 array of E4M3 codes; reject float dtypes and values outside 0..255."""
    arr = np.asarray(codes)
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"{name}: expected E4M3 codes as an integer array (uint8), got dtype {arr.dtype}; "
            "to encode floats use fp8lab.reference.e4m3.encode"
        )
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise ValueError(f"{name}: E4M3 codes must lie in 0..255, got values in {arr.min()}..{arr.max()}")
    return arr.astype(np.uint8)


def as_float(name: str, x, dtype=np.float64) -> np.ndarray:
    """Return ``x`` as a float array of ``dtype``; accepts any real float dtype, including
    ml_dtypes' bfloat16 (which NumPy reports as kind 'V')."""
    arr = np.asarray(x)
    if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
        return arr.astype(dtype, copy=False)
    raise ValueError(f"{name}: expected a float array (float16/bfloat16/float32/float64), got dtype {arr.dtype}")


def as_index(name: str, x) -> np.ndarray:
    """Return ``x`` as an int64 array; reject non-integer dtypes."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def require_ndim(name: str, arr: np.ndarray, ndim: int, layout: str) -> None:
    """Raise unless ``arr`` has ``ndim`` dimensions; ``layout`` names them, e.g. ``"[N, K]"``."""
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {layout}, got shape {arr.shape}")


def require_shape(name: str, arr: np.ndarray, expected: tuple) -> None:
    """Raise unless ``arr.shape == expected``."""
    if tuple(arr.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(arr.shape)}")


def require_finite(name: str, arr: np.ndarray) -> None:
    """Raise if ``arr`` holds NaN or infinity."""
    if not np.all(np.isfinite(arr)):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise ValueError(f"{name}: expected finite values, found {bad} NaN or infinite entries")


def as_block(name: str, block) -> tuple[int, int]:
    """Return a ``(block_n, block_k)`` pair of positive ints."""
    try:
        bn, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair (block_n, block_k), got {block!r}") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"{name}: block sizes must be positive, got {(bn, bk)}")
    return bn, bk


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


def check_block_tables(tables: np.ndarray, lens: np.ndarray, block_size: int, num_blocks: int,
                       name: str = "block_tables") -> None:
    """Raise unless every sequence's blocks are in its table row and are block ids of the cache.

    ``tables``: integer ``[num_seqs, max_blocks_per_seq]``; ``lens``: integer ``[num_seqs]``, the
    tokens read per sequence (>= 0); a cache of ``num_blocks`` blocks of ``block_size`` tokens.
    Sequence ``i`` reads the first ``ceil(lens[i] / block_size)`` entries of row ``i``; they must
    exist and lie in ``[0, num_blocks)``. Entries past them are never read (``-1`` padding is fine).
    """
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens: expected lengths >= 0, got {lens.min()}")
    needed = -(-lens // block_size)
    if needed.size and needed.max() > tables.shape[1]:
        i = int(np.argmax(needed))
        raise ValueError(f"{name}: sequence {i} has {lens[i]} tokens, which need {needed[i]} blocks of "
                         f"{block_size}, the table has {tables.shape[1]} columns")
    for i, n_used in enumerate(needed):
        used = tables[i, :n_used]
        if used.size and (used.min() < 0 or used.max() >= num_blocks):
            raise ValueError(f"{name}: block ids must lie in [0, {num_blocks}), sequence {i} uses "
                             f"{used.min()}..{used.max()}")
