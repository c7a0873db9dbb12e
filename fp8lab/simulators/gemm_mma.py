"""The schedule of fp8lab's tensor-core W8A16 GEMM kernel, as a vectorized NumPy model.

Models ``fp8lab.numba_kernels.gemm_mma`` (grid of m16 x n8 output tiles, 128-wide K chunks) bit for bit.
Checked (``tests/simulators/test_gemm_mma.py``): against ``fp8lab.reference.blockwise.gemm`` exactly on
integer-valued data and within the float32 bound below otherwise.

It computes what ``fp8lab.reference.blockwise.gemm`` computes::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

but *the way the kernel does*, float32 operation for float32 operation, so that a Numba CUDA
kernel (in the CUDA simulator) can be checked against it bit for bit:

1. **Activations** are 16-bit (``activation='bf16'`` or ``'f16'``): float32 inputs are rounded
   once to that format (round to nearest, ties to even), ``uint16`` inputs are taken as bit
   patterns (``bit_placement.activation_bits``).
2. **Grid**: a CTA owns an ``M_TILE x 32`` block of ``out``, ``M_TILE = 16 * m_blocks``
   (``m_blocks`` in {1, 2, 4}); its 4 warps own one n8 column strip each, and each warp owns
   ``m_blocks`` m16 x n8 accumulator tiles. Rows and columns past the end of ``a`` / ``q`` read
   as zero; outputs past the end are not stored. Tile ``(mt, nt)`` below is m16 tile
   ``mt = cta_y * m_blocks + m_block`` and n8 tile ``nt = cta_x * 4 + warp``.
3. **K loop**: K is walked in 128-wide chunks in ascending order. The kernel double-buffers them
   through shared memory (chunk ``c + 1`` is loaded into buffer ``(c + 1) % 2`` while chunk ``c``
   is multiplied from buffer ``c % 2``, ``chunk_order``); that overlaps memory with math but does
   not change the numerics.
4. **Per chunk**: ``c_part = 0``; 8 k16 steps, each one ``mma.m16n8k16`` per tile,
   ``c_part = mma(a_frag, b_frag, c_part)`` (``fp8lab.simulators.mma``: exact products, float64 sum of
   16, rounded to float32, added to ``c_part`` in float32). The B fragments are the weight codes
   after bit placement (``fp8lab.simulators.bit_placement``): worth ``decode(q) * 2^-120`` (BF16) or
   ``* 2^-8`` (F16).
5. **Promotion** (``promote``): ``c_fin = fma(s * 2^120, c_part, c_fin)`` (or ``2^8`` for F16: the power of
   two bit placement took away, folded into the block scale ``s = scale_inv[n // BN, k // BK]``, exactly, as
   ``|s| < 2^8``, ``2^120`` for F16, makes the product finite: every real checkpoint's scales), one float32
   rounding of the exact ``s * 2^120 * c_part + c_fin`` (``fp8lab.simulators.fma.fma_f32``); for a larger or NaN
   scale, ``fma(s, c_part * 2^120, c_fin)``: the power of two restored on the partial sum, which can overflow only
   where that partial sum's true value is beyond float32. One fma per accumulator and chunk in the common case
   (the multiply on ``c_part`` was a quarter of the warpgroup kernel's instructions). Requires ``BN % 8 == 0`` (an n8 tile lies in one scale block, so a warp
   uses one scale per chunk), ``BK % 128 == 0`` (a chunk lies in one scale block) and
   ``K % 128 == 0``.

Float32 error against the float64 oracle evaluated on the *rounded* activations, per output
(``C = K / 128`` chunks, ``u = 2^-24``, ``offset`` = 120 or 8, ``w`` the dequantized weight)::

    |out - ref| <= (C + 9) * u * sum_k |a[m, k] * w[n, k]|
                   + 15 * C * 2^(offset - 150) * max(scale_inv) + C * 2^-150

The first term counts relative float32 roundings: within a chunk ``c_part`` is a float32 sum of
8 rounded k16 sums (``8 u``), each chunk's fma adds one more (``C u``), and one ``u`` covers the
second-order terms. The second is the **BF16 underflow hazard**: values scaled by ``2^-120`` sit
near float32's subnormal range (below ``2^-126``), where float32 rounds to an absolute
``2^-150`` instead of a relative ``2^-24``; each of the 15 roundings per chunk in ``c_part``
(8 ``fl32(S)``, 7 adds) can lose that much, worth ``2^-30 * scale_inv`` after promotion. The F16
path (``2^-8``) makes it ``2^-142 * scale_inv``, negligible. Rounding the activations to 16 bits
is a far larger effect (up to ``2^-8`` relative for BF16, ``2^-11`` for F16, per element).

A real GPU's HMMA rounds less carefully than the model's idealized mma (``fp8lab.simulators.mma``: up to
about ``3 * 2^-23 * (|c| + sum |a b|)`` per instruction, measured on an H200), so a bound for a
GPU kernel against the oracle should budget about ``6 u`` per k16 step instead of ``u``:
roughly ``(48 + C + 1) * u * sum_k |a w|`` plus the same underflow term.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8lab.reference import blockwise
from fp8lab.reference.checks import as_block, ceil_div

from . import bit_placement, mma
from .fma import fma_f32

WARPS_PER_CTA = 4
CTA_N = WARPS_PER_CTA * mma.MMA_N
"""32: each CTA covers 32 output columns, one n8 strip per warp."""
M_BLOCKS_CHOICES = (1, 2, 4)
"""m16 tiles per warp (and per CTA): M tile 16, 32 or 64 (the kernel may also stack warps in M)."""
K_CHUNK = 128
"""Width of the K chunks staged through shared memory and promoted with one block scale."""
K_STEPS_PER_CHUNK = K_CHUNK // mma.MMA_K
"""8 mma k16 steps per chunk."""
BLOCK_N_MULTIPLE = mma.MMA_N
"""block_n must be a multiple of 8, so that an n8 tile never straddles two scale blocks."""
BLOCK_K_MULTIPLE = K_CHUNK
"""block_k must be a multiple of 128, so that a chunk never straddles two scale blocks."""
ACTIVATION_PRECISION = {"bf16": 8, "f16": 11}
"""Significant bits of a 16-bit activation (stored mantissa bits + the implicit one)."""


# ---------------------------------------------------------------------------- the launch geometry


@dataclass(frozen=True)
class Schedule:
    """How a GEMM of ``out[m, n]`` with reduction length ``k`` is cut into CTAs, warps and chunks."""

    m: int
    n: int
    k: int
    m_blocks: int

    @property
    def m_tile(self) -> int:
        """Rows per CTA: 16 * m_blocks."""
        return mma.MMA_M * self.m_blocks

    @property
    def grid(self) -> tuple[int, int]:
        """CUDA grid ``(x, y)``: ``x`` over 32-column N tiles, ``y`` over M tiles."""
        return ceil_div(self.n, CTA_N), ceil_div(self.m, self.m_tile)

    @property
    def m_padded(self) -> int:
        return self.grid[1] * self.m_tile

    @property
    def n_padded(self) -> int:
        return self.grid[0] * CTA_N

    @property
    def m16_tiles(self) -> int:
        return self.m_padded // mma.MMA_M

    @property
    def n8_tiles(self) -> int:
        return self.n_padded // mma.MMA_N

    @property
    def num_chunks(self) -> int:
        return self.k // K_CHUNK


def chunk_order(num_chunks: int) -> list[tuple[int, int]]:
    """``(chunk, shared-memory buffer)`` in the order the kernel multiplies them.

    Double buffering: before multiplying chunk ``c`` from buffer ``c % 2`` the kernel has issued
    the loads of chunk ``c + 1`` into buffer ``(c + 1) % 2``; it waits for them before the next
    iteration. The chunks are still consumed in ascending order, which is all the numerics see.
    """
    return [(chunk, chunk % 2) for chunk in range(num_chunks)]


def _check_arguments(a, q, scale_inv, block, m_blocks: int, activation: str):
    """Validate and normalise the arguments; returns ``(a_bits [M, K], lead shape, q, scales, (BN, BK))``."""
    bit_placement.check_format(activation)
    if m_blocks not in M_BLOCKS_CHOICES:
        raise ValueError(f"m_blocks: expected one of {M_BLOCKS_CHOICES} (M tile 16, 32 or 64), got {m_blocks!r}")
    codes = np.asarray(q)
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError(f"q: expected E4M3 codes uint8 [N, K], got dtype {codes.dtype}, shape {codes.shape}")
    n, k = codes.shape
    if k == 0 or k % K_CHUNK:
        raise ValueError(
            f"K: the kernel walks K in {K_CHUNK}-wide chunks, so K must be a positive multiple of {K_CHUNK}, got K = {k}"
        )
    bn, bk = as_block("block", block)
    if bn % BLOCK_N_MULTIPLE:
        raise ValueError(
            f"block_n: must be a multiple of {BLOCK_N_MULTIPLE} (an n8 tile may not straddle scale blocks), got {bn}"
        )
    if bk % BLOCK_K_MULTIPLE:
        raise ValueError(
            f"block_k: must be a multiple of {BLOCK_K_MULTIPLE} (a K chunk may not straddle scale blocks), got {bk}"
        )
    scales = blockwise.checked_scales(scale_inv, (n, k), (bn, bk))
    a_bits = bit_placement.activation_bits(a, activation)
    if a_bits.ndim < 1 or a_bits.shape[-1] != k:
        raise ValueError(f"a: expected shape [..., K] with K = {k} (the weight's K), got {a_bits.shape}")
    return a_bits.reshape(-1, k), a_bits.shape[:-1], codes, scales, (bn, bk)


# ---------------------------------------------------------------------------- tiling helpers


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """``x`` with zero rows appended up to ``rows``: out-of-range rows read as zero."""
    padded = np.zeros((rows, x.shape[1]), dtype=x.dtype)
    padded[: x.shape[0]] = x
    return padded


def _tiles(x: np.ndarray, tile_rows: int, tile_cols: int) -> np.ndarray:
    """``x[R, C]`` -> ``[R / tile_rows, C / tile_cols, tile_rows, tile_cols]``."""
    r, c = x.shape
    return x.reshape(r // tile_rows, tile_rows, c // tile_cols, tile_cols).swapaxes(1, 2)


def tile_scales(scale_inv: np.ndarray, block: tuple[int, int], schedule: Schedule) -> np.ndarray:
    """The block scale each warp uses per chunk: ``[n8 tiles, chunks]`` float32,
    ``scale_inv[n0 // BN, k0 // BK]`` at the tile's first column ``n0`` and the chunk's first ``k0``;
    0 for tiles entirely past N (never stored)."""
    bn, bk = block
    n0 = np.arange(schedule.n8_tiles) * mma.MMA_N
    k0 = np.arange(schedule.num_chunks) * K_CHUNK
    in_range = n0 < schedule.n
    s = np.asarray(scale_inv, np.float32)
    scales = s[np.minimum(n0 // bn, s.shape[0] - 1)[:, None], (k0 // bk)[None, :]]
    return np.where(in_range[:, None], scales, np.float32(0))


def promote(s, c_part, c_fin, offset: int):
    """Step 5 with ``u = 2^offset`` (120 for BF16 placement, 8 for F16): ``fma(s * u, c_part, c_fin)`` where
    ``|s| < 2^(128 - offset)`` (``s * u`` is then finite, so exact), ``fma(s, c_part * u, c_fin)`` for the other
    scales (larger, or NaN); float32, broadcasting."""
    s, c_part, c_fin = (np.asarray(x, np.float32) for x in (s, c_part, c_fin))
    unplace = np.float32(2.0 ** offset)
    folds = np.abs(s) < np.float32(2.0 ** (128 - offset))  # False for NaN
    with np.errstate(over="ignore", invalid="ignore"):  # the branch not taken may overflow
        folded = fma_f32(np.where(folds, s * unplace, s), c_part, c_fin)
        restored = fma_f32(s, c_part * unplace, c_fin)
    return np.where(folds, folded, restored).astype(np.float32)


def every_k16_sum_is_exact(a_values: np.ndarray, activation: str) -> bool:
    """True when, for these activations, every float64 partial sum inside every mma is exact,
    whatever the weight codes are; then the summation order cannot matter.

    Why: every E4M3 value (NaN codes' 480 included) is a multiple of ``2^-9`` below ``2^9``. An
    activation with ``p`` significant bits and ``frexp`` exponent ``e`` is a multiple of
    ``2^(e - p)`` below ``2^e``. In a 16-wide window whose nonzero activations have exponents in
    ``[e_min, e_max]``, every product is a multiple of ``2^(e_min - p - 9)``, and any partial sum
    of 16 products is below ``16 * 2^(e_max + 9) = 2^(e_max + 13)``. float64 (53 bits) holds all
    those exactly if ``e_max - e_min <= 31 - p``: 23 binades for BF16, 20 for F16. The common
    factor ``2^-offset`` of bit placement changes nothing (no float64 underflow that far up).
    """
    if not np.all(np.isfinite(a_values)):
        return False
    windows = a_values.reshape(a_values.shape[0], a_values.shape[1] // mma.MMA_K, mma.MMA_K)
    _, exponents = np.frexp(windows)
    nonzero = windows != 0
    e_max = np.where(nonzero, exponents, np.iinfo(np.int32).min).max(axis=-1)
    e_min = np.where(nonzero, exponents, np.iinfo(np.int32).max).min(axis=-1)
    span = np.where(nonzero.any(axis=-1), e_max.astype(np.int64) - e_min, 0)
    return bool(np.all(span <= 31 - ACTIVATION_PRECISION[activation]))


# ---------------------------------------------------------------------------- the GEMM


def gemm_mma(a, q, scale_inv, block=blockwise.DEFAULT_BLOCK, *, m_blocks: int = 1, activation: str = "bf16") -> np.ndarray:
    """W8A16 GEMM computed as the tensor-core kernel computes it; returns float32 ``[..., N]``.

    ``a``: activations ``[..., K]``: float32/float16/bfloat16 values (rounded once to
    ``activation``) or uint16 bit patterns of ``activation``; ``q``: E4M3 codes uint8 ``[N, K]``;
    ``scale_inv``: ``[ceil(N/BN), ceil(K/BK)]``; ``block = (BN, BK)`` with ``BN % 8 == 0`` and
    ``BK % 128 == 0``; ``K % 128 == 0``. ``m_blocks`` (1 or 2) and ``activation`` ('bf16' or
    'f16') are the kernel's compile-time knobs. NaN codes are *not* rejected: like the kernel,
    the model turns them into +-480 (see ``bit_placement``); loaders must reject them.
    """
    a_bits, lead, codes, scales, block = _check_arguments(a, q, scale_inv, block, m_blocks, activation)
    schedule = Schedule(m=a_bits.shape[0], n=codes.shape[0], k=codes.shape[1], m_blocks=m_blocks)

    a_values = bit_placement.bits_to_float32(_pad_rows(a_bits, schedule.m_padded), activation)
    weight_codes = _pad_rows(codes, schedule.n_padded)  # code 0 is +0.0
    scale_per_tile = tile_scales(scales, block, schedule)
    offset = bit_placement.EXPONENT_OFFSET[activation]
    sums_are_exact = every_k16_sum_is_exact(a_values, activation)

    c_fin = np.zeros((schedule.m16_tiles, schedule.n8_tiles, mma.WARP_SIZE, mma.C_PER_LANE), dtype=np.float32)
    for chunk, _buffer in chunk_order(schedule.num_chunks):
        columns = slice(chunk * K_CHUNK, (chunk + 1) * K_CHUNK)
        # Every lane's operands for the 8 k16 steps of this chunk, for every tile of the grid:
        # a_frags [m16 tiles, 8 steps, 32 lanes, 8], b_frags [n8 tiles, 8 steps, 32 lanes, 4].
        a_frags = mma.load_a(_tiles(a_values[:, columns], mma.MMA_M, mma.MMA_K))
        b_code_frags = mma.load_b_from_nk(_tiles(weight_codes[:, columns], mma.MMA_N, mma.MMA_K))
        b_frags = bit_placement.placed_values(b_code_frags, activation)

        c_part = np.zeros_like(c_fin)
        for step in range(K_STEPS_PER_CHUNK):
            # One mma per (m16 tile, n8 tile): every warp of every CTA at once.
            c_part = mma.mma(a_frags[:, None, step], b_frags[None, :, step], c_part, sums_are_exact=sums_are_exact)

        # Promotion: one fma per accumulator element with the warp's block scale.
        c_fin = promote(scale_per_tile[None, :, chunk, None, None], c_part, c_fin, offset)

    out_tiles = mma.store_c(c_fin)  # [m16 tiles, n8 tiles, 16, 8]
    out = out_tiles.swapaxes(1, 2).reshape(schedule.m_padded, schedule.n_padded)
    return out[: schedule.m, : schedule.n].reshape(*lead, schedule.n)


# ---------------------------------------------------------------------------- debugging aid


def warp_registers(a, q, *, m_tile: int, n_tile: int, k_step: int, activation: str = "bf16") -> tuple[np.ndarray, np.ndarray]:
    """The A and B registers every lane of one warp feeds to one mma, built as the kernel builds them.

    ``m_tile``: which m16 tile (rows ``16 * m_tile ..``), ``n_tile``: which n8 tile (columns
    ``8 * n_tile ..``), ``k_step``: which k16 step of the whole K (columns ``16 * k_step ..``).
    Returns ``(a_regs uint32 [32, 4], b_regs uint32 [32, 2])``: A as two 16-bit activations per
    register; B as two codes read as one uint16 from weight row ``n`` (adjacent k), placed with
    ``bit_placement.place_code_pair``. Compare a kernel's registers with these when it goes wrong.
    Out-of-range rows and columns read as zero, as in ``gemm_mma``.
    """
    codes = np.asarray(q)
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError(f"q: expected E4M3 codes uint8 [N, K], got dtype {codes.dtype}, shape {codes.shape}")
    a_bits = bit_placement.activation_bits(a, activation)
    a_bits = a_bits.reshape(-1, a_bits.shape[-1])
    rows, cols = mma.MMA_M * m_tile, mma.MMA_K * k_step
    n0 = mma.MMA_N * n_tile
    if not (0 <= cols and cols + mma.MMA_K <= codes.shape[1] and m_tile >= 0 and n_tile >= 0):
        raise ValueError(f"tile (m_tile={m_tile}, n_tile={n_tile}, k_step={k_step}) lies outside K = {codes.shape[1]}")
    a_tile = _pad_rows(a_bits[rows : rows + mma.MMA_M, cols : cols + mma.MMA_K], mma.MMA_M)
    w_tile = _pad_rows(codes[n0 : n0 + mma.MMA_N, cols : cols + mma.MMA_K], mma.MMA_N)
    a_regs = mma.pack_registers(mma.load_a(a_tile))
    code_pairs = bit_placement.codes_to_pairs(mma.load_b_from_nk(w_tile))  # (b0, b1), (b2, b3)
    b_regs = bit_placement.place_code_pair(code_pairs, activation)
    return a_regs, b_regs
