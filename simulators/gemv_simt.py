"""How the SIMT decode GEMV computes a W8A16 product, modelled in vectorized NumPy.

What it computes (the contract of ``reference.blockwise.gemm``, for ``M <= 16`` rows)::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

How (the schedule a CUDA kernel follows, and this model reproduces bit for bit):

- **One warp per output column** ``n`` (weight row ``n``). A warp *step* covers 512 values of
  ``k``: lane ``L`` of step ``t`` loads the 16 consecutive FP8 bytes ``k in [512 t + 16 L, +16)``
  of row ``n`` with one 128-bit load, so the 32 lanes read 512 contiguous bytes (coalesced).
  Lanes whose bytes lie past ``K`` do nothing in that step. ``lane_byte_map`` prints the map.
- **Bit placement**: each code ``c`` becomes the F16 pattern ``(c & 0x80) << 8 | (c & 0x7F) << 7``,
  whose value is exactly ``decode(c) * 2^-8``, widened to float32. No per-element multiply; the
  ``2^8`` is folded into the block scale instead. (A NaN code becomes the finite 480 * 2^-8 here,
  as in the kernel: weights must be checked for NaN codes when they are loaded, not per product.)
- **Activations** are float32 (the kernel converts bf16/f16 to float32 on load; float64 input is
  rounded to float32 first).
- **Per lane, per row** ``m`` of the tile: the 16 products go into a float32 partial in ``k`` order,
  ``part = fma(a, w, part)`` starting from ``part = 0``; then the partial is *promoted* into the
  lane's running sum ``acc[m] = fma(s, part, acc[m])`` with ``s = scale_inv[n // BN, k // BK] * 2^8``
  (float32; multiplying by a power of two is exact). ``BK`` is a multiple of 128 and 16 divides 128,
  so a lane's 16 elements share one scale.
- **Butterfly reduction** after the K loop: ``acc += shfl_xor(acc, off)`` for ``off = 16, 8, 4, 2, 1``
  (lane ``L`` adds lane ``L ^ off``'s value, float32); every lane ends with the same sum, lane 0 stores.
- **Row tiles**: rows are processed ``M_TILE`` at a time (1, 2, 4, 8 or 16; the last tile may be
  shorter), sharing each weight load. Each row's arithmetic is independent of the others, so
  ``M_TILE`` changes the memory traffic, never the result. Neither does a register prefetch of the
  next step's bytes: it changes *when* bytes arrive, not which products are summed in which order.

Requirements (``ValueError`` otherwise): ``1 <= M <= 16``, ``K`` a positive multiple of 128 (a
lane's 16-byte load is then aligned and never straddles the row end), ``BK`` a multiple of 128.

The float32 fused multiply-adds are ``simulators.fma.fma_f32`` (NumPy has no fma).

Fast path of the 16-product chain: when the activations have at most 20 significant bits (every
bf16 or f16 value, widened) the product ``a * w`` (w has 4 significant bits) is exact in float32,
so ``part + a * w`` in float32 *is* ``fma(a, w, part)``; the model then uses plain float32 NumPy
arithmetic (several times faster). Other float32 activations take ``fma_f32`` for every product.
"""

from __future__ import annotations

import numpy as np

from reference import blockwise
from reference._checks import as_block, as_codes, as_float

from .fma import fma_f32

WARP_SIZE = 32
BYTES_PER_LANE = 16
"""One 128-bit load per lane per step: 16 FP8 codes."""
K_PER_STEP = WARP_SIZE * BYTES_PER_LANE
"""512: the ``k`` range one warp step covers."""
K_MULTIPLE = 128
"""``K`` and ``BK`` must be multiples of this."""
MAX_ROWS = 16
M_TILES = (1, 2, 4, 8, 16)
BUTTERFLY_OFFSETS = (16, 8, 4, 2, 1)
F16_PLACEMENT_SCALE = 2.0**8
"""The F16 bit placement yields ``decode(c) / 2^8``; the block scale is multiplied by this instead."""


# ---------------------------------------------------------------------------- the kernel's data layout


def f16_bits_of_e4m3(codes) -> np.ndarray:
    """The F16 bit placement of E4M3 codes: ``(c & 0x80) << 8 | (c & 0x7F) << 7`` (uint16).

    Sign to the F16 sign bit, the 4 exponent and 3 mantissa bits to the top of F16's exponent and
    mantissa fields; with F16's bias 15 against E4M3's 7 the value is ``decode(c) * 2^-8`` exactly,
    subnormals included.
    """
    c = as_codes("codes", codes).astype(np.uint16)
    return ((c & 0x80) << 8) | ((c & 0x7F) << 7)


def placed_weights(q) -> np.ndarray:
    """What a lane holds after bit placement and widening: float32 ``decode(q) * 2^-8`` (NaN codes
    become the finite +-480 * 2^-8)."""
    return f16_bits_of_e4m3(q).view(np.float16).astype(np.float32)


def num_steps(k: int) -> int:
    """Warp steps per output column: ``ceil(K / 512)``."""
    return -(-int(k) // K_PER_STEP)


def lane_k_start(step, lane) -> np.ndarray:
    """First ``k`` (byte of weight row ``n``) that ``lane`` loads at ``step``: ``512 step + 16 lane``."""
    return K_PER_STEP * np.asarray(step) + BYTES_PER_LANE * np.asarray(lane)


def lane_byte_map(k: int) -> np.ndarray:
    """``map[t, L, i]``: the ``k`` of the ``i``-th byte lane ``L`` reads at step ``t`` (-1: lane idle).

    Shape ``[num_steps(K), 32, 16]``. Lane ``L``'s 16 bytes are one 128-bit load; a warp step reads
    512 contiguous bytes. Every ``k`` in ``[0, K)`` appears exactly once.
    """
    k = _check_k(k)
    steps = np.arange(num_steps(k))[:, None, None]
    lanes = np.arange(WARP_SIZE)[None, :, None]
    offsets = np.arange(BYTES_PER_LANE)[None, None, :]
    start = lane_k_start(steps, lanes)
    byte_k = start + offsets
    return np.where(start < k, byte_k, -1)


def row_tiles(m: int, m_tile: int) -> list[slice]:
    """The row ranges processed together, ``m_tile`` rows each (the last one may be shorter)."""
    return [slice(r, min(r + m_tile, m)) for r in range(0, m, m_tile)]


def chunk_scales(scale_inv, n: int, k: int, block) -> np.ndarray:
    """``s[n, c] = scale_inv[n // BN, 16 c // BK] * 2^8`` (float32): the promotion scale of every
    16-wide chunk ``c`` of row ``n``, with the bit placement's ``2^8`` folded in (exact)."""
    bn, bk = block
    s = blockwise.checked_scales(scale_inv, (n, k), (bn, bk))
    chunk_k = np.arange(0, k, BYTES_PER_LANE)
    per_chunk = s[np.arange(n) // bn][:, chunk_k // bk]
    return per_chunk * np.float32(F16_PLACEMENT_SCALE)


# ---------------------------------------------------------------------------- the arithmetic


def products_fit_float32(a32: np.ndarray) -> bool:
    """True when every ``a * w`` is exact in float32 (then ``part + a * w`` is a true fma).

    ``w`` has at most 4 significant bits and ``2^-17 <= |w| <= 1.875`` (or is 0). The product of an
    ``a`` with at most 20 significant bits (low 4 mantissa bits zero: every bf16/f16 value) fits
    float32's 24 bits, and ``2^-109 <= |a| <= 2^127`` keeps it normal and finite.
    """
    bits = a32.view(np.uint32)
    short_mantissa = (bits & 0xF) == 0
    magnitude = np.abs(a32)
    in_range = ((magnitude >= 2.0**-109) & (magnitude <= 2.0**127)) | (magnitude == 0)
    return bool(np.all(short_mantissa & in_range))


def lane_partials(a_chunks: np.ndarray, w_chunks: np.ndarray, exact_products: bool) -> np.ndarray:
    """The 16-product float32 partial of every (row, column, 16-wide chunk): ``part[m, n, c]``.

    ``a_chunks[i, m, c] = a[m, 16 c + i]``, ``w_chunks[i, n, c] = w[n, 16 c + i]`` (i = 0..15).
    ``part = fma(a, w, part)`` for ``i = 0, 1, ..., 15``, from ``part = 0``: sequential in ``k``,
    as one lane does it, for all lanes and steps at once.
    """
    rows, cols, chunks = a_chunks.shape[1], w_chunks.shape[1], a_chunks.shape[2]
    part = np.zeros((rows, cols, chunks), dtype=np.float32)
    product = np.empty_like(part)
    for i in range(BYTES_PER_LANE):
        a_i, w_i = a_chunks[i][:, None, :], w_chunks[i][None, :, :]
        if exact_products:
            np.multiply(a_i, w_i, out=product)  # exact, so the add below is the fma's one rounding
            part += product
        else:
            part = fma_f32(a_i, w_i, part)
    return part


def promote_partials(part: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Each lane's running sum after the K loop: ``acc[m, n, L]`` (float32).

    Step ``t``, lane ``L`` promotes chunk ``c = 32 t + L``: ``acc = fma(s[n, c], part[m, n, c], acc)``,
    steps in order. Lanes whose chunk lies past ``K`` leave ``acc`` untouched.
    """
    rows, cols, chunks = part.shape
    acc = np.zeros((rows, cols, WARP_SIZE), dtype=np.float32)
    for first in range(0, chunks, WARP_SIZE):
        active = min(WARP_SIZE, chunks - first)  # lanes 0 .. active-1 have bytes this step
        step_chunks = slice(first, first + active)
        acc[..., :active] = fma_f32(scales[None, :, step_chunks], part[..., step_chunks], acc[..., :active])
    return acc


def butterfly_sum(acc: np.ndarray) -> np.ndarray:
    """``acc += shfl_xor(acc, off)`` for ``off = 16, 8, 4, 2, 1`` over the last (lane) axis, float32.

    Lane ``L`` adds lane ``L ^ off``'s value; afterwards every lane holds the warp's total (float32
    addition commutes, so the partners compute the same bits).
    """
    lanes = np.arange(WARP_SIZE)
    for off in BUTTERFLY_OFFSETS:
        acc = acc + acc[..., lanes ^ off]
    return acc


# ---------------------------------------------------------------------------- the entry point

_TILE_ELEMENTS = 1 << 17  # partials per (row tile x column tile) block: keeps the work in cache
_PLACED_VALUES = placed_weights(np.arange(256, dtype=np.uint8))  # code -> placed float32, a lookup table


def gemv_simt(a, q, scale_inv, block=blockwise.DEFAULT_BLOCK, m_tile: int = 8) -> np.ndarray:
    """The SIMT decode GEMV: float32 ``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T``.

    ``a``: float ``[M, K]`` with ``1 <= M <= 16`` (rounded to float32); ``q``: uint8 E4M3 codes
    ``[N, K]``; ``scale_inv``: ``[ceil(N/BN), ceil(K/BK)]``; ``block = (BN, BK)``; ``m_tile``: rows
    sharing each weight load (1, 2, 4, 8 or 16). Returns what lane 0 of warp ``n`` stores, bit for bit.
    """
    a32, codes, (bn, bk), m_tile = _check_arguments(a, q, block, m_tile)
    m, k = a32.shape
    n = codes.shape[0]
    chunks = k // BYTES_PER_LANE
    scales = chunk_scales(scale_inv, n, k, (bn, bk))
    # Element i of every lane's 16, contiguous over chunks: a as [16, M, chunks], q as [16, N, chunks].
    a_by_element = a32.reshape(m, chunks, BYTES_PER_LANE).transpose(2, 0, 1)
    q_by_element = codes.reshape(n, chunks, BYTES_PER_LANE).transpose(2, 0, 1)
    tiles = [(rows, np.ascontiguousarray(a_by_element[:, rows, :])) for rows in row_tiles(m, m_tile)]
    exact_products = [products_fit_float32(a_tile) for _, a_tile in tiles]

    out = np.empty((m, n), dtype=np.float32)
    cols_per_tile = max(1, _TILE_ELEMENTS // (min(m, m_tile) * chunks))
    for col0 in range(0, n, cols_per_tile):  # column tiles only keep the work in cache
        cols = slice(col0, min(col0 + cols_per_tile, n))
        w_tile = np.take(_PLACED_VALUES, np.ascontiguousarray(q_by_element[:, cols, :]))
        for (rows, a_tile), exact in zip(tiles, exact_products):
            part = lane_partials(a_tile, w_tile, exact)
            acc = promote_partials(part, scales[cols])
            out[rows, cols] = butterfly_sum(acc)[..., 0]  # lane 0 stores
    return out


def _check_k(k) -> int:
    k = int(k)
    if k <= 0 or k % K_MULTIPLE:
        raise ValueError(
            f"K: the SIMT GEMV needs K to be a positive multiple of {K_MULTIPLE} (whole 16-byte lane loads), got K = {k}"
        )
    return k


def _check_arguments(a, q, block, m_tile):
    a32 = as_float("a", a, np.float32)
    codes = as_codes("q", q)
    if a32.ndim != 2:
        raise ValueError(f"a: expected 2 dimensions [M, K], got shape {a32.shape}")
    if codes.ndim != 2:
        raise ValueError(f"q: expected 2 dimensions [N, K], got shape {codes.shape}")
    m, k = a32.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"a: the SIMT decode GEMV handles 1 <= M <= {MAX_ROWS} rows, got M = {m}")
    if codes.shape[1] != k:
        raise ValueError(f"q: expected K = {k} columns (a's K), got shape {codes.shape}")
    _check_k(k)
    bn, bk = as_block("block", block)
    if bk % K_MULTIPLE:
        raise ValueError(
            f"block: block_k must be a multiple of {K_MULTIPLE} so a lane's 16 elements share one scale, got {bk}"
        )
    if m_tile not in M_TILES:
        raise ValueError(f"m_tile: expected one of {M_TILES}, got {m_tile!r}")
    return np.ascontiguousarray(a32), np.ascontiguousarray(codes), (bn, bk), int(m_tile)
