"""Argument checks of every kernel host wrapper, done on the host before anything is launched.

One copy of each check the kernels share: ``reject``/``require`` (the error of a bad array), ``require_c_contiguous``,
``require_load_alignment`` (device data for 128-bit loads), ``overlaps`` (two arrays' memory) and ``check_gemm`` (the FP8 weight GEMMs' whole
call); the values of a paged cache's block tables are checked by the oracle's own rule
(``fp8lab.reference.checks.check_block_tables``). No kernel here; each
kernel's test file checks its bad calls (``tests/numba_kernels/test_*_kernel.py``, ``test_fp8_gemm.py``).

The kernels accept NumPy arrays (copied to the device by Numba; in the CUDA simulator that is the
normal case), Numba device arrays, and any object with ``__cuda_array_interface__`` (torch, CuPy).
Every problem is a ``ValueError`` naming the argument, what was expected and what was given, and
nothing is launched on a bad call.

Formats (by dtype):

- activations ``a[M, K]``: ``uint16``/``int16`` = BF16 bit patterns (view a torch bfloat16 tensor
  as ``torch.int16``: torch does not export bfloat16 through the array interface), ``float16`` =
  F16, ``float32`` (SIMT GEMV only; the tensor-core path needs 16-bit operands);
- weights ``q[N, K]``: ``uint8`` E4M3 codes, C-contiguous; ``scale_inv``: ``float32``
  ``[ceil(N/BN), ceil(K/BK)]``;
- output ``out[M, N]``: ``float32``, ``float16`` or ``uint16`` (BF16 patterns, round to nearest even).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from .warp import LOAD_ALIGNMENT

K_MULTIPLE = 128
"""Every kernel walks K in 128-wide chunks (one block scale per chunk)."""

ACTIVATION_FORMATS = {np.dtype(np.uint16): "bf16", np.dtype(np.int16): "bf16", np.dtype(np.float16): "f16",
                      np.dtype(np.float32): "f32"}
OUTPUT_FORMATS = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16",
                  np.dtype(np.int16): "bf16"}


def as_kernel_array(name: str, x):
    """NumPy and device arrays pass through; ``__cuda_array_interface__`` objects become device arrays."""
    if isinstance(x, np.ndarray) or hasattr(x, "copy_to_host"):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cuda.as_cuda_array(x)
    raise ValueError(f"{name}: expected a NumPy array, a Numba device array or a __cuda_array_interface__ object, "
                     f"got {type(x).__name__}")


def reject(name: str, expected: str, x):
    """Raise the ``ValueError`` of a bad array argument: its name, what was expected, its shape and dtype."""
    raise ValueError(f"{name}: expected {expected}, got shape {tuple(x.shape)} dtype {x.dtype}")


def require(name: str, x, expected: str, ok: bool):
    """``reject(name, expected, x)`` unless ``ok``."""
    if not ok:
        reject(name, expected, x)


def require_c_contiguous(name: str, x):
    """Raise unless ``x`` (NumPy or device array) is C-contiguous."""
    contiguous = x.flags["C_CONTIGUOUS"] if isinstance(x, np.ndarray) else x.is_c_contiguous()
    if not contiguous:
        raise ValueError(f"{name}: expected a C-contiguous (row-major) array, got strides {x.strides}")


def require_load_alignment(name: str, x, kernel: str):
    """Raise unless the device data of ``x`` starts on a 16-byte boundary (``kernel`` reads it 16 bytes at a time).

    A NumPy array passes: it is copied into a fresh, aligned device allocation at launch (Numba's and
    torch's allocations are aligned; a view into one may not be).
    """
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is None:
        return
    address = interface["data"][0]
    if address % LOAD_ALIGNMENT:
        raise ValueError(f"{name}: {kernel} reads {LOAD_ALIGNMENT} bytes at a time, so its device data must be "
                         f"{LOAD_ALIGNMENT}-byte aligned (start on a {LOAD_ALIGNMENT}-byte boundary); "
                         f"got address 0x{address:x}")


def memory_extent(x) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of an array's data (host or device address; strides >= 0)."""
    interface = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    start = interface["data"][0]
    if x.size == 0:
        return start, start
    itemsize = np.dtype(x.dtype).itemsize
    return start, start + sum((n - 1) * s for n, s in zip(x.shape, x.strides)) + itemsize


def overlaps(a, b) -> bool:
    """Whether the data of ``a`` and ``b`` share a byte (NumPy arrays or device arrays, strides >= 0)."""
    (a0, a1), (b0, b1) = memory_extent(a), memory_extent(b)
    return a0 < b1 and b0 < a1


@dataclass(frozen=True)
class GemmProblem:
    """A checked ``out[M, N] = a[M, K] @ dequantize(q, scale_inv)^T`` call."""

    a: object
    q: object
    scale_inv: object
    out: object
    m: int
    n: int
    k: int
    block: tuple[int, int]
    activation: str  # "bf16", "f16" or "f32"
    output: str  # "f32", "f16" or "bf16"


def check_gemm(a, q, scale_inv, out, block, *, kernel: str, activations=("bf16", "f16", "f32"),
               block_n_multiple: int = 1, out_columns: int | None = None) -> GemmProblem:
    """Check a W8A16 GEMM call for the kernel named ``kernel``; return the problem, arrays converted.
    ``out_columns``: the columns of ``out`` when they are not ``N`` (the SwiGLU GEMV writes ``N / 2``)."""
    a, q, scale_inv, out = (as_kernel_array(n, x) for n, x in (("a", a), ("q", q), ("scale_inv", scale_inv), ("out", out)))
    try:
        bn, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"block: expected a pair (block_n, block_k), got {block!r}") from None
    require("q", q, "uint8 E4M3 codes [N, K]", q.ndim == 2 and q.dtype == np.uint8)
    require_c_contiguous("q", q)
    n, k = q.shape
    if k == 0 or k % K_MULTIPLE:
        raise ValueError(f"q: {kernel} needs K to be a positive multiple of {K_MULTIPLE}, got K = {k}")
    if bk <= 0 or bk % K_MULTIPLE:
        raise ValueError(f"block: {kernel} needs block_k to be a multiple of {K_MULTIPLE}, got {bk}")
    if bn <= 0 or bn % block_n_multiple:
        raise ValueError(f"block: {kernel} needs block_n to be a positive multiple of {block_n_multiple}, got {bn}")
    expected_scales = (-(-n // bn), -(-k // bk))
    require("scale_inv", scale_inv, f"float32 [{expected_scales[0]}, {expected_scales[1]}] for block {(bn, bk)}",
             tuple(scale_inv.shape) == expected_scales and scale_inv.dtype == np.float32)
    require_c_contiguous("scale_inv", scale_inv)
    activation = ACTIVATION_FORMATS.get(np.dtype(a.dtype))
    allowed = " / ".join(f for f in ("bf16 (uint16)", "f16 (float16)", "f32 (float32)") if f.split()[0] in activations)
    require("a", a, f"activations [M, {k}] of {allowed}", a.ndim == 2 and a.shape[1] == k and activation in activations)
    require_c_contiguous("a", a)
    m = a.shape[0]
    if m == 0:
        raise ValueError("a: expected at least one row (M >= 1), got M = 0")
    output = OUTPUT_FORMATS.get(np.dtype(out.dtype))
    width = n if out_columns is None else int(out_columns)
    require("out", out, f"[{m}, {width}] of float32, float16 or uint16 (BF16)", tuple(out.shape) == (m, width) and output is not None)
    require_c_contiguous("out", out)
    # no GEMM runs in place: some CTAs would still read activations that others have overwritten
    require("out", out, "memory apart from a's", not overlaps(a, out))
    return GemmProblem(a, q, scale_inv, out, m, n, k, (bn, bk), activation, output)
