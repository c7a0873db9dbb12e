"""Blockwise FP8 weights (Qwen3-FP8 / DeepSeek-V3 checkpoints) and the GEMMs that use them.

A weight ``w[N, K]`` is stored as E4M3 codes ``q[N, K]`` plus one float32 ``scale_inv`` per
``(BN, BK)`` block (usually 128 x 128; edge blocks may be partial)::

    w[n, k] ~= decode(q[n, k]) * scale_inv[n // BN, k // BK]

Quantizing a block: ``scale_inv = amax / 448`` (1 for an all-zero block, never below float32's
smallest normal ``2^-126``: ``e4m3.scale_of_amax``) and ``q = encode(w / scale_inv, saturate=True)``,
all in float32 as the checkpoint tools do.

Two GEMM numerics are in use:

- **W8A16** (``gemm``): ``out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n//BN, k//BK]``;
  the activations stay in 16/32-bit floats. Kernels accumulate in float32 per 128-wide K chunk
  and promote each partial with its block scale; this oracle accumulates in float64.
- **W8A8** (``gemm_w8a8``, transformers / vLLM): activations are quantized per token and per
  group of ``BK`` columns (``quantize_activations``), then each K block contributes
  ``a_scale * w_scale * sum_k decode(aq) * decode(q)``.

Error bound of ``dequantize(*quantize(w))`` per element (tested in ``tests/reference/test_blockwise.py``)::

    |dequantize(q, s)[n, k] - w[n, k]| <= 2^-4 * |w[n, k]| + 2^-10 * s[n // BN, k // BK]  (+ float32 rounding)

The first term is half a unit in the last place of the 3-bit mantissa (relative 2^-4) for
normals, the second half the subnormal spacing 2^-9 scaled by the block scale. The ``2^-126``
floor of the scale keeps the bound for blocks whose ``amax / 448`` would be a float32 subnormal.

Concatenating weights along N (``concatenate_rows``: the GPU engine fuses q/k/v and gate/up into one
GEMM each) is exact: codes and scale rows are concatenated, and when a part is not whole blocks every
part is re-blocked to ``BN' = gcd(BN, part sizes)`` rows per scale (``reblock_rows``: each scale row
repeated), so the fused weight dequantizes to exactly the row-concatenation of the dequantized parts.

NaN and infinity follow the formulas, never a finite wrong number: a NaN or infinity in a
block of ``w`` (or in a group of activations) makes its scale NaN or infinite and every element
of it dequantize to NaN (``x / inf`` codes are 0 or NaN, ``0 * inf`` is NaN). NaN codes, NaN or
infinite scales and non-finite activations reach the GEMM outputs that use them, by IEEE
arithmetic. A loader rejects NaN codes in a checkpoint (``nan_code_positions``).
"""

from __future__ import annotations

import math

import numpy as np

from . import e4m3
from .checks import as_block, as_codes, as_float, ceil_div, require_ndim, require_shape

DEFAULT_BLOCK = (128, 128)
DEFAULT_ACTIVATION_EPS = 1e-10
"""vLLM's ``per_token_group_quant_fp8`` default: keeps the scale of an all-zero group positive."""
MIN_ACTIVATION_EPS = 448 * 2.0**-126
"""The smallest ``eps`` allowed: ``eps / 448`` is then a normal float32 (at least ``2^-126``). A
smaller one makes an all-zero group's scale subnormal or 0, and ``0 / 0`` NaN codes."""


def scale_shape(weight_shape: tuple[int, int], block=DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of ``scale_inv`` for a weight of ``weight_shape = (N, K)``: ``(ceil(N/BN), ceil(K/BK))``."""
    bn, bk = as_block("block", block)
    n, k = weight_shape
    return ceil_div(n, bn), ceil_div(k, bk)


def checked_scales(scale_inv, weight_shape: tuple[int, int], block=DEFAULT_BLOCK) -> np.ndarray:
    """``scale_inv`` as float32 (it may be stored F32, BF16 or F16), after checking that its
    shape is the ``(ceil(N/BN), ceil(K/BK))`` that the weight shape and block size imply."""
    s = as_float("scale_inv", scale_inv, np.float32)
    require_ndim("scale_inv", s, 2, "[ceil(N/BN), ceil(K/BK)]")
    require_shape("scale_inv", s, scale_shape(weight_shape, block))
    return s


def expand_scales(scale_inv, weight_shape: tuple[int, int], block=DEFAULT_BLOCK) -> np.ndarray:
    """Broadcast a per-block ``scale_inv`` to one float32 scale per weight element, shape ``(N, K)``."""
    bn, bk = as_block("block", block)
    s = checked_scales(scale_inv, weight_shape, (bn, bk))
    n, k = weight_shape
    return np.repeat(np.repeat(s, bn, axis=0)[:n], bk, axis=1)[:, :k]


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Max of ``|w|`` over each (BN, BK) block, partial edge blocks included."""
    bn, bk = block
    n, k = w.shape
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    padded = np.zeros((nb * bn, kb * bk), dtype=w.dtype)
    padded[:n, :k] = np.abs(w)
    return padded.reshape(nb, bn, kb, bk).max(axis=(1, 3))


def quantize(w, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a weight ``w[N, K]`` blockwise; returns ``(q, scale_inv)``.

    ``q``: uint8 E4M3 codes ``[N, K]``; ``scale_inv``: float32 ``[ceil(N/BN), ceil(K/BK)]``,
    ``e4m3.scale_of_amax(amax)`` per block. Finite weights never give NaN codes; a block holding
    NaN or infinity gets a NaN or infinite scale and dequantizes to NaN everywhere.
    """
    bn, bk = as_block("block", block)
    w32 = as_float("w", w, np.float32)
    require_ndim("w", w32, 2, "[N, K]")
    scale_inv = e4m3.scale_of_amax(_block_amax(w32, (bn, bk)))
    # float32 division as the GPU and checkpoint tools do; saturate catches the amax element
    # landing a hair above 448 after scale_inv was rounded to float32.
    with np.errstate(invalid="ignore"):  # inf / inf in a block holding inf: NaN, on purpose
        scaled = w32 / expand_scales(scale_inv, w32.shape, (bn, bk))
    return e4m3.encode(scaled, saturate=True), scale_inv


def dequantize(q, scale_inv, block=DEFAULT_BLOCK) -> np.ndarray:
    """``decode(q[n, k]) * scale_inv[n // BN, k // BK]`` as float32 ``[N, K]`` (one float32 multiply).

    NaN codes decode to NaN; use ``nan_code_positions`` to find them first. A NaN scale, or an
    infinite one times a zero code, gives NaN.
    """
    codes = as_codes("q", q)
    require_ndim("q", codes, 2, "[N, K]")
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN, on purpose
        return e4m3.decode(codes) * expand_scales(scale_inv, codes.shape, block)


def nan_code_positions(q) -> np.ndarray:
    """Indices ``[count, 2]`` of NaN codes (0x7F / 0xFF) in a weight; a loader must reject any."""
    return np.argwhere(e4m3.is_nan(q))


def reblock_rows(scale_inv, rows: int, block_n: int, new_block_n: int) -> np.ndarray:
    """The ``scale_inv`` of a weight of ``rows`` rows for blocks of ``new_block_n`` rows instead of ``block_n``.

    ``new_block_n`` must divide ``block_n``: new block ``r`` (rows ``r * new_block_n`` on) then lies inside
    old block ``r * new_block_n // block_n``, whose scale row it repeats. Returns float32
    ``[ceil(rows / new_block_n), KB]``; the weight dequantizes to exactly the same matrix with it.
    """
    rows, block_n, new_block_n = int(rows), int(block_n), int(new_block_n)
    if new_block_n <= 0 or block_n % new_block_n:
        raise ValueError(f"new_block_n: expected a positive divisor of block_n = {block_n}, got {new_block_n}")
    s = as_float("scale_inv", scale_inv, np.float32)
    require_ndim("scale_inv", s, 2, "[ceil(N/BN), ceil(K/BK)]")
    if s.shape[0] != ceil_div(rows, block_n):
        raise ValueError(f"scale_inv: expected {ceil_div(rows, block_n)} rows for {rows} weight rows in blocks of "
                         f"{block_n}, got shape {s.shape}")
    return s[np.arange(ceil_div(rows, new_block_n)) * new_block_n // block_n]


def concatenate_rows(parts, block=DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Concatenate blockwise FP8 weights ``(codes [N_i, K], scale_inv)`` along N (rows) into one weight.

    Returns ``(codes [sum N_i, K], scale_inv, (BN', BK))`` with ``BN' = gcd(BN, N_0, N_1, ...)``: when every
    part is whole blocks that is ``BN`` and the scales are concatenated as they are; otherwise each part is
    re-blocked (``reblock_rows``) so that no block straddles two parts. Contract: the fused weight
    dequantizes to exactly the row-concatenation of the dequantized parts, bit for bit. Every part must
    have the same K and a ``scale_inv`` of the shape its codes and ``block`` imply.
    """
    bn, bk = as_block("block", block)
    if len(parts) == 0:
        raise ValueError("parts: expected at least one (codes, scale_inv) pair")
    codes = [as_codes(f"parts[{i}] codes", q) for i, (q, _) in enumerate(parts)]
    for i, q in enumerate(codes):
        require_ndim(f"parts[{i}] codes", q, 2, "[N, K]")
        if q.shape[1] != codes[0].shape[1]:
            raise ValueError(f"parts[{i}] codes: expected K = {codes[0].shape[1]} (the first part's), got {q.shape}")
    scales = [checked_scales(s, q.shape, (bn, bk)) for q, (_, s) in zip(codes, parts)]
    new_bn = math.gcd(bn, *(q.shape[0] for q in codes))
    rows = [reblock_rows(s, q.shape[0], bn, new_bn) for q, s in zip(codes, scales)]
    return np.concatenate(codes), np.ascontiguousarray(np.concatenate(rows), np.float32), (new_bn, bk)


def _activations_2d(a, k: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """``a[..., K]`` as float64 ``[M, K]`` plus the leading shape to restore."""
    a64 = as_float("a", a, np.float64)
    if a64.ndim < 1 or a64.shape[-1] != k:
        raise ValueError(f"a: expected shape [..., K] with K = {k} (the weight's K), got {a64.shape}")
    return a64.reshape(-1, k), a64.shape[:-1]


def gemm(a, q, scale_inv, block=DEFAULT_BLOCK) -> np.ndarray:
    """W8A16 GEMM: ``out[..., n] = sum_k a[..., k] * decode(q[n, k]) * scale_inv[n//BN, k//BK]``.

    ``a``: float ``[..., K]``; ``q``: uint8 ``[N, K]``; ``scale_inv``: ``[ceil(N/BN), ceil(K/BK)]``.
    The weight products are exact and the sum is accumulated in float64; returns float64
    ``[..., N]``, so the oracle's own rounding is far below any float32 kernel's.
    """
    codes = as_codes("q", q)
    require_ndim("q", codes, 2, "[N, K]")
    # decode(q) * scale_inv is exact in float64 (4 + 24 significant bits), unlike dequantize's float32 product
    w = e4m3.decode(codes).astype(np.float64) * expand_scales(scale_inv, codes.shape, block).astype(np.float64)
    a2, lead = _activations_2d(a, w.shape[1])
    return (a2 @ w.T).reshape(*lead, w.shape[0])


def quantize_activations(a, group: int = 128, eps: float = DEFAULT_ACTIVATION_EPS) -> tuple[np.ndarray, np.ndarray]:
    """Per-token, per-group dynamic activation quantization as transformers and vLLM do it.

    For each row and each group of ``group`` columns (the last group may be partial):
    ``s = max(amax, eps) / 448`` and ``q = encode(a / s, saturate=True)``, in float32.
    Returns ``(q uint8 [M, K], scales float32 [M, ceil(K/group)])`` for ``a`` of shape ``[M, K]``.
    ``eps`` must be finite and at least ``MIN_ACTIVATION_EPS`` (``check_eps``). A group holding
    NaN or infinity gets a NaN or infinite scale and dequantizes to NaN everywhere.
    """
    a32 = as_float("a", a, np.float32)
    require_ndim("a", a32, 2, "[M, K]")
    if int(group) <= 0:
        raise ValueError(f"group: expected a positive group size, got {group!r}")
    eps32 = check_eps(eps)
    amax = _block_amax(a32, (1, int(group)))
    scales = (np.maximum(amax, eps32) / np.float32(e4m3.MAX)).astype(np.float32)  # np.maximum keeps a NaN
    with np.errstate(invalid="ignore"):  # inf / inf in a group holding inf: NaN, on purpose
        q = e4m3.encode(a32 / expand_scales(scales, a32.shape, (1, group)), saturate=True)
    return q, scales


def check_eps(eps) -> np.float32:
    """``eps`` as float32, after checking it is finite and ``>= MIN_ACTIVATION_EPS``; else ``ValueError``."""
    eps32 = np.float32(eps)
    if not (np.isfinite(eps32) and eps32 >= np.float32(MIN_ACTIVATION_EPS)):
        raise ValueError(
            f"eps: expected a finite eps >= {MIN_ACTIVATION_EPS:.3g} (448 * 2^-126, so that an all-zero "
            f"group's scale eps / 448 is a normal float32), got {eps!r}"
        )
    return eps32


def gemm_w8a8(a, q, scale_inv, block=DEFAULT_BLOCK, eps: float = DEFAULT_ACTIVATION_EPS) -> np.ndarray:
    """W8A8 GEMM with transformers/vLLM numerics; returns float64 ``[..., N]``.

    Activations are quantized with ``quantize_activations(a, group=BK)``; then each K block ``j``
    contributes ``a_scale[m, j] * scale_inv[n // BN, j] * sum_{k in block j} decode(aq[m, k]) * decode(q[n, k])``.
    The products of two E4M3 values are exact in float64, as are their block sums.
    """
    bn, bk = as_block("block", block)
    codes = as_codes("q", q)
    require_ndim("q", codes, 2, "[N, K]")
    n, k = codes.shape
    a2, lead = _activations_2d(a, k)
    aq, a_scales = quantize_activations(a2, group=bk, eps=eps)
    w_scales = np.repeat(checked_scales(scale_inv, codes.shape, (bn, bk)), bn, axis=0)[:n].astype(np.float64)
    a_vals = e4m3.decode(aq).astype(np.float64)
    w_vals = e4m3.decode(codes).astype(np.float64)
    out = np.zeros((a2.shape[0], n), dtype=np.float64)
    for j in range(ceil_div(k, bk)):
        cols = slice(j * bk, (j + 1) * bk)
        block_sums = a_vals[:, cols] @ w_vals[:, cols].T
        out += block_sums * a_scales[:, j : j + 1].astype(np.float64) * w_scales[:, j]
    return out.reshape(*lead, n)
