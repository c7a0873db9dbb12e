"""How the SIMT decode GEMV computes a W8A16 product, modelled in vectorized NumPy.

Models ``fp8lab.numba_kernels.gemv_simt`` (a warp per output column, 16 bytes per lane and step) bit for
bit. Checked (``tests/simulators/test_gemv_simt.py``): against ``fp8lab.reference.blockwise.gemm`` exactly
on integer-valued data and within a float32 bound otherwise.

What it computes (the contract of ``fp8lab.reference.blockwise.gemm``, for ``M <= 16`` rows)::

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

The float32 fused multiply-adds are ``fp8lab.simulators.fma.fma_f32`` (NumPy has no fma).

Fast path of the 16-product chain: when the activations have at most 20 significant bits (every
bf16 or f16 value, widened) the product ``a * w`` (w has 4 significant bits) is exact in float32,
so ``part + a * w`` in float32 *is* ``fma(a, w, part)``; the model then uses plain float32 NumPy
arithmetic (several times faster). Other float32 activations take ``fma_f32`` for every product.

Split-K (``gemv_simt_split_k``, the model of ``numba_kernels.gemv_simt.gemv_simt_split_k``): ``S`` K slices
of whole ``BK`` blocks, each summed by ``gemv_simt`` as if it were the whole row, the parts then added in
slice order (``sum_parts``); ``choose_k_splits`` is the engine's rule for ``S``.

SwiGLU in the epilogue (``gemv_simt_swiglu``, the model of ``numba_kernels.gemv_simt.gemv_simt_swiglu``):
``dense.silu_mul(gemv_simt(a, q, scale_inv))`` for the fused gate/up codes ``q[2 I, K]``. The kernel
variant is the same composition: its warps sum the gate and up columns ``j`` and ``I + j`` as the
plain kernel's warps sum any column, and its lane 0 applies ``silu_mul``'s expression.
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference import blockwise
from fp8lab.reference.checks import as_block, as_codes, as_float

from . import dense
from .common import BUTTERFLY_OFFSETS, WARP_SIZE
from .fma import FmaScratch, fma_f32_into, smallest_nonzero_magnitude

BYTES_PER_LANE = 16
"""One 128-bit load per lane per step: 16 FP8 codes."""
K_PER_STEP = WARP_SIZE * BYTES_PER_LANE
"""512: the ``k`` range one warp step covers."""
K_MULTIPLE = 128
"""``K`` and ``BK`` must be multiples of this."""
MAX_ROWS = 16
M_TILES = (1, 2, 4, 8, 16)
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
    s = blockwise.checked_scales(scale_inv, (n, k), (bn, bk))[np.arange(n) // bn]
    chunk_k = np.arange(0, k, BYTES_PER_LANE)
    if bk % (8 * BYTES_PER_LANE):
        return s[:, chunk_k // bk] * np.float32(F16_PLACEMENT_SCALE)
    # BK a multiple of 128 (as the kernel requires): 8 neighbouring chunks share a scale, so look up
    # one per 8 and repeat it (a quarter of the time of looking up every chunk's).
    per_8_chunks = s[:, chunk_k[::8] // bk] * np.float32(F16_PLACEMENT_SCALE)
    return np.repeat(per_8_chunks, 8, axis=1)[:, : chunk_k.size]


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
    if exact_products:
        product = np.empty_like(part)
        for i in range(BYTES_PER_LANE):
            np.multiply(a_chunks[i][:, None, :], w_chunks[i][None, :, :], out=product)  # exact, so the add
            part += product  # below is the fma's one rounding
        return part
    # The placed weights are E4M3 values times 2^-8 (at most 4 significant bits, |w| in [2^-17, 1.875]
    # or 0), which lets fma_f32_into skip most of its tests.
    scratch = FmaScratch(part.shape)
    bound = float(np.max(np.abs(a_chunks), initial=0)) * _PLACED_MAX
    may_be_tiny = smallest_nonzero_magnitude(a_chunks) * _PLACED_SMALLEST < 2.0**-125
    for i in range(BYTES_PER_LANE):
        fma_f32_into(a_chunks[i][:, None, :], w_chunks[i][None, :, :], part, part, scratch, bound, may_be_tiny)
    return part


def promote_partials(part: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Each lane's running sum after the K loop: ``acc[m, n, L]`` (float32).

    Step ``t``, lane ``L`` promotes chunk ``c = 32 t + L``: ``acc = fma(s[n, c], part[m, n, c], acc)``,
    steps in order. Lanes whose chunk lies past ``K`` leave ``acc`` untouched.
    """
    rows, cols, chunks = part.shape
    acc = np.zeros((rows, cols, WARP_SIZE), dtype=np.float32)
    scratch = None
    for first in range(0, chunks, WARP_SIZE):
        active = min(WARP_SIZE, chunks - first)  # lanes 0 .. active-1 have bytes this step
        lanes = acc[..., :active]
        if scratch is None or scratch.total.shape != lanes.shape:  # the first step, and a shorter last one
            scratch = FmaScratch(lanes.shape)
        step_chunks = slice(first, first + active)
        fma_f32_into(scales[None, :, step_chunks], part[..., step_chunks], lanes, lanes, scratch)
    return acc


# ---------------------------------------------------------------------------- the entry point

_TILE_COLUMN_BYTES = 1 << 17
"""About this many weight bytes decoded at a time (a column tile): the tile's arrays stay in cache."""
_PROMOTE_LANES = 1 << 16
"""About this many (row, column, lane) running sums promoted at a time."""
_PLACED_VALUES = placed_weights(np.arange(256, dtype=np.uint8))  # code -> placed float32, a lookup table
_PLACED_MAX = float(np.max(_PLACED_VALUES))  # 1.875 (the NaN codes' 480 * 2^-8)
_PLACED_SMALLEST = float(np.min(np.abs(_PLACED_VALUES[_PLACED_VALUES != 0])))  # 2^-17


def _pair_table(values: np.ndarray) -> np.ndarray:
    """``table[x]``: the two placed float32 values of the two codes stored in the uint16 ``x``, as one
    8-byte item (uint64, so that nothing treats the bits as a number). Decoding through it moves two
    weights per lookup, half the lookups of the 256-entry table. The table is built from ``x``'s
    bytes in memory order, so it matches ``q.view(np.uint16)`` on any byte order."""
    code_pairs = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(values[code_pairs]).view(np.uint64).reshape(-1)


_PLACED_PAIRS = _pair_table(_PLACED_VALUES)  # 65536 x 8 bytes = 512 KiB


def _placed_pairs(codes: np.ndarray, index: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """The placed weights of ``codes [cols, K]`` as a view ``w[i // 2, i % 2, n, c] = placed(codes[n, 16 c + i])``.

    Codes ``i`` and ``i + 1`` of a lane are neighbours in memory: one lookup of their uint16 in
    ``_PLACED_PAIRS`` gives both values. ``index`` (intp) and ``pairs`` (uint64) are scratch arrays
    ``[8, cols, K / 16]``; the returned float32 view points into ``pairs``.
    """
    cols, k = codes.shape
    by_pair = codes.view(np.uint16).reshape(cols, k // BYTES_PER_LANE, BYTES_PER_LANE // 2).transpose(2, 0, 1)
    np.copyto(index, by_pair)  # (np.take would allocate this conversion itself, every call)
    np.take(_PLACED_PAIRS, index, out=pairs, mode="wrap")  # ("wrap": no bounds check; a uint16 is < 65536)
    return pairs.view(np.float32).reshape(pairs.shape + (2,)).transpose(0, 3, 1, 2)


def _lane_partials_one_row(a_row: np.ndarray, w_pairs: np.ndarray, out: np.ndarray, products: np.ndarray) -> None:
    """``lane_partials`` for one row with exact products, reading the decoded pairs where they are.

    ``a_row``: ``[16, 1, chunks]``; ``w_pairs``: ``_placed_pairs``'s view; ``out``: ``[1, cols, chunks]``;
    ``products``: float32 scratch ``[16, cols, chunks]``. All 16 products come from one multiply (which
    also splits the pairs, the copy the other path makes first), then the partial adds them in ``k``
    order from 0 (``0 + x`` turns ``-0`` into ``+0``, as the chain does).
    """
    chunks = a_row.shape[-1]
    np.multiply(a_row.reshape(8, 2, 1, chunks), w_pairs, out=products.reshape(w_pairs.shape))
    np.add(products[0], np.float32(0), out=out[0])
    for i in range(1, BYTES_PER_LANE):
        out[0] += products[i]


def gemv_simt(a, q, scale_inv, block=blockwise.DEFAULT_BLOCK, m_tile: int = 8) -> np.ndarray:
    """The SIMT decode GEMV: float32 ``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T``.

    ``a``: float ``[M, K]`` with ``1 <= M <= 16`` (rounded to float32); ``q``: uint8 E4M3 codes
    ``[N, K]``; ``scale_inv``: ``[ceil(N/BN), ceil(K/BK)]``; ``block = (BN, BK)``; ``m_tile``: rows
    sharing each weight load (1, 2, 4, 8 or 16). Returns what lane 0 of warp ``n`` stores, bit for bit.

    Vectorized as the kernel's lanes are independent: every weight is decoded once (a column tile
    at a time, shared by all rows), each lane's 16-product chain runs for all (row, column, chunk)
    at once, and the promotions and the butterfly run over all columns at once.
    """
    a32, codes, (bn, bk), m_tile = _check_arguments(a, q, block, m_tile)
    m, k = a32.shape
    n = codes.shape[0]
    chunks = k // BYTES_PER_LANE
    # Element i of every lane's 16, contiguous over chunks: a as [16, M, chunks], per row tile.
    a_by_element = a32.reshape(m, chunks, BYTES_PER_LANE).transpose(2, 0, 1)
    tiles = [(rows, np.ascontiguousarray(a_by_element[:, rows, :])) for rows in row_tiles(m, m_tile)]
    exact_products = [products_fit_float32(a_tile) for _, a_tile in tiles]

    part = np.empty((m, n, chunks), np.float32)  # every lane's partial of every chunk
    cols_per_tile = max(1, _TILE_COLUMN_BYTES // k)
    w_tile = np.empty(0)
    for col0 in range(0, n, cols_per_tile):  # column tiles only keep the work in cache
        cols = slice(col0, min(col0 + cols_per_tile, n))
        if w_tile.shape[1:2] != (cols.stop - cols.start,):  # the first tile, and a shorter last one
            w_tile = np.empty((BYTES_PER_LANE, cols.stop - cols.start, chunks), np.float32)
            products = np.empty_like(w_tile)
            index, pairs = (np.empty((BYTES_PER_LANE // 2,) + w_tile.shape[1:], t) for t in (np.intp, np.uint64))
        w_pairs = _placed_pairs(codes[cols], index, pairs)
        if any(rows.stop - rows.start > 1 or not exact for (rows, _), exact in zip(tiles, exact_products)):
            np.copyto(w_tile.reshape(w_pairs.shape), w_pairs)  # element i of every lane, contiguous
        for (rows, a_tile), exact in zip(tiles, exact_products):
            if rows.stop - rows.start == 1 and exact:
                _lane_partials_one_row(a_tile, w_pairs, part[rows, cols], products)
            else:
                part[rows, cols] = lane_partials(a_tile, w_tile, exact)
    scales = chunk_scales(scale_inv, n, k, (bn, bk))
    out = np.empty((m, n), np.float32)
    cols_per_block = max(1, _PROMOTE_LANES // (m * WARP_SIZE))
    for col0 in range(0, n, cols_per_block):  # column blocks only keep the promotions in cache
        cols = slice(col0, min(col0 + cols_per_block, n))
        out[:, cols] = _butterfly_lane0(promote_partials(part[:, cols], scales[cols]))
    return out


def gemv_simt_swiglu(a, q, scale_inv, block=blockwise.DEFAULT_BLOCK, m_tile: int = 8) -> np.ndarray:
    """The SIMT GEMV with SwiGLU in its epilogue: float32 ``act[M, I] = silu(gate) * up``.

    ``q``: the fused codes ``[2 I, K]`` (gate rows ``0 .. I-1``, up rows ``I .. 2I-1``); the rest as
    ``gemv_simt``. It is the composition ``dense.silu_mul(gemv_simt(...))``, and so is the kernel: each
    of a warp's columns is summed as ``gemv_simt``'s warps sum a column, only the warp's columns are
    ``{j, I + j}`` and its lane 0 applies ``silu_mul``'s expression to the two sums.
    """
    rows = np.shape(q)[0] if np.ndim(q) == 2 else 0
    if rows == 0 or rows % 2:
        raise ValueError(f"q: expected the fused gate and up codes [2 I, K] (an even, positive number of rows), "
                         f"got shape {np.shape(q)}")
    return dense.silu_mul(gemv_simt(a, q, scale_inv, block, m_tile))


K_SPLITS = (1, 2, 3, 4)
"""The split-K slice counts the engine chooses among (``choose_k_splits``). More slices made the narrow
GEMVs of Qwen3-0.6B a little faster still, but the residual norm reads every part (``bench/RESULTS.md``)."""
SPLIT_K_CTAS_PER_SM = 4
"""``choose_k_splits`` aims at this many CTAs (of ``SPLIT_K_COLUMNS_PER_CTA`` columns) per SM."""
SPLIT_K_COLUMNS_PER_CTA = 16
"""Columns per CTA of the kernel's default launch (4 warps of 4 columns)."""


def choose_k_splits(n: int, k: int, block_k: int, num_sms: int) -> int:
    """The K slices ``S`` of the engine's split-K GEMVs (o_proj and down_proj, whose parts the residual
    norm adds) for ``q[N, K]`` on a GPU of ``num_sms`` SMs: among ``K_SPLITS`` with ``K / S`` whole blocks
    of ``block_k``, the one whose grid of ``ceil(N / 16) * S`` CTAs comes nearest, as a ratio, to
    ``SPLIT_K_CTAS_PER_SM * num_sms`` (ties: fewer slices).

    It depends on the weight's shape and the GPU, never on ``M``: a row's bits do not depend on the
    batch it is in. Measured on an H200 (132 SMs, ``bench/gemv_split_k.py``, ``bench/RESULTS.md``): Qwen3-8B
    o_proj and down_proj get 2 slices, Qwen3-0.6B's 4; q/k/v and gate/up would get 1.
    """
    ctas = -(-int(n) // SPLIT_K_COLUMNS_PER_CTA)
    target = SPLIT_K_CTAS_PER_SM * int(num_sms)
    allowed = [s for s in K_SPLITS if s == 1 or int(k) % (s * int(block_k)) == 0]
    return min(allowed, key=lambda s: (abs(np.log(ctas * s / target)), s))


def gemv_simt_split_k(a, q, scale_inv, k_splits: int, block=blockwise.DEFAULT_BLOCK, m_tile: int = 8) -> np.ndarray:
    """Split-K: float32 ``parts[S, M, N]``, ``parts[s] = gemv_simt`` of K slice ``s`` (columns
    ``[s K / S, (s + 1) K / S)`` of ``a`` and ``q`` with their block scales); the product is
    ``sum_parts(parts)``. The model of ``numba_kernels.gemv_simt.gemv_simt_split_k``, whose CTA layer
    ``s`` runs the plain kernel on slice ``s`` as if it were the whole row.

    For ``S > 1``, ``K / S`` must be a multiple of ``BK`` (each slice whole K blocks, so a slice's scales
    are whole columns of ``scale_inv``); the rest as ``gemv_simt``.
    """
    a32, codes, (bn, bk), m_tile = _check_arguments(a, q, block, m_tile)
    k, splits = a32.shape[1], int(k_splits)
    if splits < 1 or (splits > 1 and k % (splits * bk)):
        raise ValueError(f"k_splits: {k_splits} K slices of K = {k} must each be whole K blocks of {bk}")
    if splits == 1:  # the plain GEMV (K need not be whole blocks)
        return gemv_simt(a32, codes, scale_inv, (bn, bk), m_tile)[None]
    width, blocks = k // splits, k // splits // bk
    scales = np.asarray(scale_inv, np.float32)
    return np.stack([gemv_simt(a32[:, s * width:(s + 1) * width], codes[:, s * width:(s + 1) * width],
                               scales[:, s * blocks:(s + 1) * blocks], (bn, bk), m_tile) for s in range(splits)])


sum_parts = dense.sum_parts
"""The split-K product from its parts (``fp8lab.simulators.dense.sum_parts``)."""


def _butterfly_lane0(acc: np.ndarray) -> np.ndarray:
    """``butterfly_sum(acc)[..., 0]``, the value lane 0 stores, with only the additions it depends on.

    After ``off = 16`` lane ``L < 16`` holds ``acc[L] + acc[L + 16]``; lane 0 then needs lanes 0..7 of
    that, and so on: five halvings of the lane axis, each two contiguous halves added.
    """
    for half in BUTTERFLY_OFFSETS:
        acc = acc[..., :half] + acc[..., half : 2 * half]
    return acc[..., 0]


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
