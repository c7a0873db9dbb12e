"""Tensor-core W8A16 GEMM for FP8 (E4M3) blockwise weights: ``mma.m16n8k16`` fed by bit placement.

Computes ``fp8lab.reference.blockwise.gemm``. Launch: grid ``(ceil(N / CTA_N), ceil(M / M_TILE))`` x
``32 warps_m warps_n`` threads, ``stages`` stages of dynamic shared memory (``launch_info``). Checked
(``tests/numba_kernels/test_gemm_mma_kernel.py``): bit for bit against ``fp8lab.simulators.gemm_mma.gemm_mma``
in the CUDA simulator for every tiling, against the oracle within its GPU error budget on a GPU.

What it computes (``fp8lab.reference.blockwise.gemm``, float32 accumulation)::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

with ``a`` BF16 (``uint16``/``int16`` bit patterns) or F16 (``float16``) ``[M, K]``, ``q`` E4M3
codes ``uint8 [N, K]``, ``scale_inv`` ``float32 [ceil(N/BN), ceil(K/BK)]`` and ``out`` float32,
float16 or BF16 bits (``uint16``/``int16``), rounded once from the float32 result (a NaN stays a NaN).

How: the float32 operations of ``fp8lab.simulators.gemm_mma`` (read that first), tile by tile. What is
fixed is the order *per output tile* (m16 x n8): every chunk of 128 in ascending K, per chunk
``c_part = 0``, 8 k16 ``mma`` steps in order, then one promotion fma. What may vary without
changing a bit is how tiles are grouped into warps and CTAs and how many chunks are in flight:
those are the tuning knobs (``Tiling``; ``choose_tiling`` picks defaults).

- **Tiles**: a warp owns ``m_blocks`` (1, 2 or 4) m16 tiles times ``n8_tiles_per_warp`` (1, 2 or
  4) n8 tiles; a CTA has ``warps_m x warps_n`` warps (``warps_m`` 1, 2 or 4, ``warps_n`` 1, 2, 4 or 8), ``warps_n`` side by side in
  N, ``warps_m`` stacked in M (warp ``w`` sits at ``(w // warps_n, w % warps_n)``). So a CTA owns
  ``out[M_TILE rows, CTA_N columns]``, ``M_TILE = 16 m_blocks warps_m``, ``CTA_N = 8 warps_n
  n8_tiles_per_warp``; grid ``(ceil(N / CTA_N), ceil(M / M_TILE))``, block ``32 warps_m warps_n``.
  More m16 tiles per warp reuse each B fragment, more n8 tiles reuse each A fragment (fewer shared
  reads, and independent mma chains the warp interleaves); narrower CTAs make more of them (better
  for small N); taller and wider CTAs read each weight and each activation from global memory
  fewer times (large M: prefill). Rows/columns past the end of ``a``/``q`` read as zero; outputs past the end are not
  stored.
- **K loop, ``stages``-deep**: chunk ``c`` lives in shared-memory stage ``c % stages`` (its A rows,
  its weight rows and the CTA's block scales), copied there by ``cp.async`` (global -> shared
  without registers, ``fp8lab.numba_kernels.cp_async``). The prologue issues chunks ``0 .. stages - 2``,
  one commit group each. Iteration ``c``:

  1. ``cp.async.wait_group(stages - 2)``: this thread's copies of chunk ``c`` have landed (one
     group is committed per chunk, so at most the ``stages - 2`` younger ones stay in flight);
  2. ``syncthreads``: so have everyone's, and every warp has finished chunk ``c - 1``;
  3. issue the copies of chunk ``c + stages - 1`` into stage ``(c - 1) % stages`` (free: step 2
     says its last readers are done), and commit (an empty group past the last chunk, so that the
     count in step 1 stays right);
  4. with ``place_once``: every thread places a share of the stage's weight codes into the CTA's placed buffer
     (``place_chunk``), then a second ``syncthreads`` (the buffer's last readers, chunk ``c - 1``'s warps, passed
     the first one);
  5. multiply chunk ``c`` from stage ``c % stages`` (the B fragments from the placed buffer with ``place_once``),
     then promote with its scales.

  One barrier per chunk suffices: a stage is written only after the barrier that follows its
  last read, and read only after the wait + barrier that follow its write. ``stages - 1`` chunks
  are in flight while one is multiplied (``stages = 2`` is classic double buffering).
- **Per chunk** (per warp): ``c_part = 0``; 8 k16 steps: B fragments of each n8 tile (two codes
  read as one ``uint16``, placed into two BF16/F16 patterns in one register, ``place_code_pair``; with
  ``place_once`` the two patterns read as one word of the placed buffer, placed there once for the CTA where
  ``warps_m`` warps would each place them),
  then per m16 tile its A fragment (32-bit words of shared memory) and one ``mma`` per n8 tile.
  Then per tile ``c_fin = fma(s * 2^120, c_part, c_fin)`` (BF16; ``2^8`` for F16: the power of two
  bit placement took away, folded into the tile's block scale ``s = scale_inv[n0 // BN, k0 // BK]``, 0 for a
  tile past N), or, for a scale too large for that to be exact (``|s| >= 2^8`` with BF16),
  ``fma(s, c_part * 2^120, c_fin)``: ``fold_scale``, ``fp8lab.simulators.gemm_mma.promote``.

Shared memory: ``stages`` stages of ``stage_bytes`` each (``Tiling.stage_bytes``), with ``place_once`` then the
placed buffer (``CTA_N`` rows of 128 placed 16-bit patterns padded to 272 bytes, A's row layout), one dynamic
allocation read through aliased views (``uint64`` for the copies, ``uint32`` A words, ``uint16`` B
code pairs, ``float32`` scales). One stage::

    byte 0                          A: M_TILE rows x 272 bytes (128 activations + 16 pad)
    M_TILE * 272                    B: CTA_N weight rows x 144 bytes (128 codes + 16 pad)
    M_TILE * 272 + CTA_N * 144      scales: one float32 per n8 tile of the CTA, padded to 16 bytes

Rows are multiples of 16 bytes (``cp.async`` copies 16). Padding, bank by bank (32 banks of 4
bytes; a warp's access is conflict-free when its addresses fall into distinct banks or share
words): an A fragment load has lane ``(g, t)`` read word ``t`` (+ a constant) of row ``g``; at 68
words per row, row ``g`` starts in bank ``4g``: 32 distinct banks (unpadded, 64 words: all rows in
bank 0, 8-way conflicts). A B pair load has lane ``(g, t)`` read halfword ``t`` of weight row
``g``, i.e. word ``t // 2``; at 36 words per row, row ``g`` starts in bank ``4g``: 16 distinct words
in 16 distinct banks. The copies write 16 bytes per lane, 8 lanes (128 contiguous bytes) per
phase: conflict-free.

Global reads: thread ``i``'s copy ``j`` takes the 16-byte piece ``j * THREADS + i`` of the chunk in
row-major order, so a warp reads 512 contiguous bytes of A (two rows of 256) or four weight rows
of 128: every byte of every sector used. A goes through L1 (``cp.async.ca``: every CTA of the M
tile reads the same activations, those sharing an SM can hit), B only through L2 (``.cg``: read
once). More than 48 KiB of shared memory per CTA needs an opt-in, done on the compiled kernel
before launch (``_allow_shared_memory``).

Float32 operation order is that of ``fp8lab.simulators.gemm_mma`` exactly, so in Numba's CUDA simulator
(where ``mma_bf16``/``mma_f16`` are warp-collective twins built on ``fp8lab.simulators.mma``, and
``cp.async`` lands as late as allowed) this kernel equals ``fp8lab.simulators.gemm_mma.gemm_mma`` bit for
bit, for every tiling; on a GPU it is checked against ``fp8lab.reference.blockwise.gemm`` with the GPU
error budget stated there (``tests/numba_kernels/test_gemm_mma_kernel.py``). On a GPU the linked ``mma`` helper
is inlined by link-time optimization (numba-cuda's default when nvJitLink is installed).

Register counts of the variants: ``tests/numba_kernels/test_kernels_compile.py`` prints them; dated
measurements are in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from . import bits, pdl
from .arguments import check_gemm, require_load_alignment
from .cp_async import (
    commit_group,
    copy_4_ca,
    copy_16_ca,
    copy_16_cg,
    wait_group_function,
)
from .mathops import f32_to_bf16_bits_rne
from .mma import mma_bf16, mma_f16
from .warp import WARP_SIZE

# ---------------------------------------------------------------------------- the schedule's constants
# (the same numbers as fp8lab.simulators.gemm_mma; tests check that they agree)

MMA_M, MMA_N, MMA_K = 16, 8, 16
M_BLOCKS_CHOICES = (1, 2, 4)
"""m16 tiles per warp: 16, 32 or 64 rows."""
WARPS_N_CHOICES = (1, 2, 4, 8)
"""Warps side by side in N."""
WARPS_M_CHOICES = (1, 2, 4)
"""Warps stacked in M."""
N8_TILES_PER_WARP_CHOICES = (1, 2, 4)
STAGES_CHOICES = tuple(range(2, 9))
"""Shared-memory stages (chunks resident at once): 2 (double buffering) to 8."""
K_CHUNK = 128
K_STEPS_PER_CHUNK = K_CHUNK // MMA_K
BLOCK_N_MULTIPLE = MMA_N
"""An n8 tile must lie in one scale block, so that a tile needs one scale per chunk."""
PLACEMENT_EXPONENT = {"bf16": 120, "f16": 8}
"""Bit placement makes a code worth ``decode(c) * 2^-120`` (BF16) or ``2^-8`` (F16)
(``fp8lab.simulators.bit_placement``); the promotion folds the inverse power of two into the block scale where
that is exact, else restores it on the partial sum (``fold_scale``)."""
PLACEMENT_SHIFT = {"bf16": 4, "f16": 1}
"""Right shift from a code in the high byte of a 16-bit half to its place: ``8 - 4`` for BF16's
7 mantissa bits, ``8 - 7`` for F16's 10."""
SIGN_MASK_X2 = 0x80008000
MAGNITUDE_MASK_X2 = 0x7F007F00

# ---------------------------------------------------------------------------- shared memory layout (bytes)

COPY_BYTES = 16
"""One ``cp.async`` moves 16 bytes: 8 activations or 16 codes."""
WORD64 = 8
A_ROW_BYTES = 2 * K_CHUNK + 16
"""272: 128 activations + 16 bytes of padding (68 words: row g starts in bank 4g)."""
B_ROW_BYTES = K_CHUNK + 16
"""144: 128 codes + 16 bytes of padding (36 words: row g starts in bank 4g)."""
A_COPIES_PER_ROW = 2 * K_CHUNK // COPY_BYTES
"""16 pieces of 16 bytes per activation row and chunk."""
B_COPIES_PER_ROW = K_CHUNK // COPY_BYTES
"""8 pieces of 16 bytes per weight row and chunk."""
PLACED_ROW_BYTES = 2 * K_CHUNK + 16
"""272: a weight row's 128 placed 16-bit patterns + 16 bytes of padding (``place_once``; the A rows' layout, so the
B fragment loads are as conflict-free as A's)."""
CODE_WORDS_PER_ROW = K_CHUNK // 4
"""32 words of 4 codes per weight row and chunk: what ``place_once``'s threads each take one of at a time."""
A_WORDS64_PER_CHUNK = 2 * K_CHUNK // WORD64
B_WORDS64_PER_CHUNK = K_CHUNK // WORD64

DEFAULT_SHARED_LIMIT = 48 * 1024
"""Dynamic shared memory a CTA may use without opting in."""
MAX_SHARED_PER_CTA = 227 * 1024
"""sm_90's opt-in limit per CTA."""

# ---------------------------------------------------------------------------- the tuning target (H100 / H200 SXM)

SM_COUNT = 132
SHARED_PER_SM = 228 * 1024
"""Shared memory per SM, of which the driver reserves 1 KiB per resident CTA."""
MIN_CTAS = 120
"""``choose_tiling`` takes the widest CTA whose grid still has this many CTAs (~90% of the SMs)."""
IN_FLIGHT_WEIGHT_BYTES = 32 * 1024
"""Weight bytes per SM that ``choose_tiling`` keeps in flight: Little's law, about 4.8 TB/s x
~0.9 us of loaded DRAM latency / 132 SMs."""
MAX_CTAS_PER_SM_COUNTED = 4
"""Past this many CTAs per SM (a multi-wave grid), deeper stages would only cost occupancy."""


# ---------------------------------------------------------------------------- tiling and launch geometry


class Tiling(NamedTuple):
    """The kernel's compile-time shape knobs; none of them changes a bit of the result."""

    m_blocks: int
    """m16 tiles per warp: 1, 2 or 4."""
    warps_n: int
    """Warps side by side in N: 1, 2, 4 or 8."""
    n8_tiles_per_warp: int
    """n8 tiles per warp: 1, 2 or 4."""
    stages: int
    """Shared-memory stages: chunks resident at once (``stages - 1`` in flight while one is used)."""
    warps_m: int = 1
    """Warps stacked in M: 1, 2 or 4."""
    place_once: bool = False
    """Place each chunk's weight codes into BF16/F16 patterns once per CTA, into a shared buffer the warps read
    their B fragments from (one more barrier per chunk), instead of once per warp that reads them (``warps_m``
    times per CTA)."""

    @property
    def warp_rows(self) -> int:
        """Rows of ``out`` one warp owns: ``16 m_blocks``."""
        return MMA_M * self.m_blocks

    @property
    def m_tile(self) -> int:
        return self.warp_rows * self.warps_m

    @property
    def n8_tiles(self) -> int:
        """n8 tiles per CTA."""
        return self.warps_n * self.n8_tiles_per_warp

    @property
    def cta_n(self) -> int:
        return MMA_N * self.n8_tiles

    @property
    def threads(self) -> int:
        return WARP_SIZE * self.warps_m * self.warps_n

    @property
    def a_bytes(self) -> int:
        return self.m_tile * A_ROW_BYTES

    @property
    def b_bytes(self) -> int:
        return self.cta_n * B_ROW_BYTES

    @property
    def stage_bytes(self) -> int:
        """A rows, B rows and the n8 tiles' scales (4 bytes each, padded to 16)."""
        return self.a_bytes + self.b_bytes + COPY_BYTES * -(-4 * self.n8_tiles // COPY_BYTES)

    @property
    def placed_bytes(self) -> int:
        """The placed-weights buffer of ``place_once``: CTA_N rows of ``PLACED_ROW_BYTES`` (0 without it)."""
        return self.cta_n * PLACED_ROW_BYTES if self.place_once else 0

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.stage_bytes + self.placed_bytes

    def check(self) -> Tiling:
        for name, value, choices in (("m_blocks", self.m_blocks, M_BLOCKS_CHOICES),
                                     ("warps_n", self.warps_n, WARPS_N_CHOICES),
                                     ("n8_tiles_per_warp", self.n8_tiles_per_warp, N8_TILES_PER_WARP_CHOICES),
                                     ("stages", self.stages, STAGES_CHOICES),
                                     ("warps_m", self.warps_m, WARPS_M_CHOICES)):
            if value not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
        if self.place_once not in (False, True):
            raise ValueError(f"place_once: expected True or False, got {self.place_once!r}")
        for name, pieces in (("a", self.m_tile * A_COPIES_PER_ROW), ("q", self.cta_n * B_COPIES_PER_ROW),
                             ("q (placed)", self.cta_n * CODE_WORDS_PER_ROW if self.place_once else 0)):
            if pieces % self.threads:
                raise ValueError(f"warps_m, warps_n: {self} splits the {pieces} 16-byte copies of {name}'s chunk "
                                 f"unevenly over {self.threads} threads")
        if self.shared_bytes > MAX_SHARED_PER_CTA:
            raise ValueError(f"stages: {self} needs {self.shared_bytes} bytes of shared memory, more than the "
                             f"{MAX_SHARED_PER_CTA} a CTA may have")
        return self


CTA_SHAPES = ((4, 2), (4, 1), (2, 2), (2, 1), (1, 2), (1, 1))
"""``(warps_n, n8_tiles_per_warp)``, widest CTA first; at equal width, more warps first
(spread over more of the SM's four schedulers)."""


def choose_m_blocks(m: int) -> int:
    """One m16 tile per warp up to M = 16 (no wasted rows); two beyond (each B fragment feeds two mma)."""
    return 1 if m <= MMA_M else 2


def grid_size(m: int, n: int, tiling: Tiling) -> tuple[int, int]:
    """``(ceil(N / CTA_N), ceil(M / M_TILE))``."""
    return -(-n // tiling.cta_n), -(-m // tiling.m_tile)


def choose_tiling(m: int, n: int, k: int, m_blocks: int | None = None, warps_n: int | None = None,
                  n8_tiles_per_warp: int | None = None, stages: int | None = None, warps_m: int = 1,
                  place_once: bool = False) -> Tiling:
    """The given knobs, and defaults for those left ``None``, tuned for a 132-SM H100/H200:

    - ``m_blocks``: ``choose_m_blocks(M)``;
    - CTA shape: the first of ``CTA_SHAPES`` (consistent with the given knobs) whose grid has at
      least ``MIN_CTAS`` CTAs, else the narrowest. Wide CTAs load each activation chunk for more
      columns (A traffic per weight byte is ``2 M_TILE / CTA_N``) and share it among more warps;
      but every SM should get work, and K cannot be split without changing the float32 order;
    - ``stages``: the fewest (2 to 8) that keep ``IN_FLIGHT_WEIGHT_BYTES`` of weights in flight per
      SM, counting the CTAs that share an SM, as long as those CTAs fit the SM's shared memory;
      never more than the chunks need.
    """
    m_blocks = choose_m_blocks(m) if m_blocks is None else m_blocks
    shapes = [(w, t) for w, t in CTA_SHAPES if warps_n in (None, w) and n8_tiles_per_warp in (None, t)]
    if not shapes:  # a value outside the choices: let check() name it
        shapes = [(warps_n or 4, n8_tiles_per_warp or 1)]
    for w, t in shapes:
        tiling = Tiling(m_blocks, w, t, 2 if stages is None else stages, warps_m, place_once)
        x, y = grid_size(m, n, tiling)
        if x * y >= MIN_CTAS:
            break
    if stages is None and m_blocks in M_BLOCKS_CHOICES:
        x, y = grid_size(m, n, tiling)
        ctas_per_sm = min(-(-x * y // SM_COUNT), MAX_CTAS_PER_SM_COUNTED)
        weight_bytes = tiling.cta_n * K_CHUNK * ctas_per_sm  # per chunk, per SM
        needed = 1 + math.ceil(IN_FLIGHT_WEIGHT_BYTES / weight_bytes)
        chunks = max(1, k // K_CHUNK)
        for s in range(min(needed, STAGES_CHOICES[-1], chunks + 1), 2, -1):
            bytes_per_cta = s * tiling.stage_bytes + tiling.placed_bytes
            if bytes_per_cta <= MAX_SHARED_PER_CTA and ctas_per_sm * (bytes_per_cta + 1024) <= SHARED_PER_SM:
                break
        else:
            s = 2
        tiling = tiling._replace(stages=s)
    return tiling.check()


class LaunchInfo(NamedTuple):
    grid: tuple[int, int]
    """``(ceil(N / CTA_N), ceil(M / M_TILE))``: x over N tiles, y over M tiles."""
    block: tuple[int]
    """``(32 * warps_m * warps_n,)``."""
    shared_bytes: int
    """Dynamic shared memory per CTA: ``stages * stage_bytes`` (+ ``placed_bytes``)."""
    tiling: Tiling


MAX_GRID_Y = 65535


def launch_info(m: int, n: int, k: int, m_blocks: int | None = None, *, warps_n: int | None = None,
                n8_tiles_per_warp: int | None = None, stages: int | None = None, warps_m: int = 1,
                place_once: bool = False) -> LaunchInfo:
    """Grid, block, dynamic shared memory bytes and tiling of the kernel for ``out[m, n]`` with
    reduction ``k``; knobs left ``None`` take ``choose_tiling``'s defaults."""
    if m < 1 or n < 1 or k < K_CHUNK or k % K_CHUNK:
        raise ValueError(f"shape: expected M, N >= 1 and K a positive multiple of {K_CHUNK}, got {(m, n, k)}")
    tiling = choose_tiling(m, n, k, m_blocks, warps_n, n8_tiles_per_warp, stages, warps_m, place_once)
    grid = grid_size(m, n, tiling)
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"a: M = {m} needs {grid[1]} M tiles, more than the grid's {MAX_GRID_Y}")
    return LaunchInfo(grid=grid, block=(tiling.threads,), shared_bytes=tiling.shared_bytes, tiling=tiling)


# ---------------------------------------------------------------------------- device helpers shared by every variant


def inlined_device_function(fn):
    """``cuda.jit(device=True, inline="always")``: inlined into the caller at Numba IR level, so the
    per-thread arrays passed in get constant indices in one function and live in registers (and the
    kernel compiles to PTX without a GPU: no separately compiled device function to ask one for).
    """
    return cuda.jit(fn, device=True, inline="always")


@inlined_device_function
def at(array, index):
    """``array[index]`` for an index known not to be negative: an unsigned index spares the
    compiler the negative-index fix-up (compare and select) that it cannot always prove away."""
    return array[uint64(index)]


@inlined_device_function
def clamp(row, rows):
    """``min(row, rows - 1)`` in unsigned arithmetic (``rows >= 1``): a valid row for a zero-fill copy
    to point at (and no mixed signed/unsigned comparison, which Numba would do in float64)."""
    r, n = uint64(row), uint64(rows)
    return r if r < n else n - uint64(1)


@inlined_device_function
def fold_scale(s, unplace, fold_limit):
    """``(scale, restore)`` for the promotion ``fma(scale, c_part * restore, c_fin)``: ``(s * unplace, 1)`` where
    ``|s| < fold_limit = 2^128 / unplace`` (the product is then finite and exact; a multiply by 1 is exact too),
    ``(s, unplace)`` for larger or NaN scales: ``fp8lab.simulators.gemm_mma.promote``'s two forms."""
    if abs(s) < fold_limit:
        return s * unplace, float32(1.0)
    return s, unplace


@inlined_device_function
def place_code_pair(pair, shift):
    """Two E4M3 codes (one uint16, lower k in the low byte) -> one register of two BF16/F16 patterns.

    ``fp8lab.simulators.bit_placement.place_code_pair``: move each code to the high byte of its 16-bit
    half (what ``prmt(pair, 0, 0x1404)`` does; the compiler may emit exactly that), keep both signs
    at bits 15 and 31, shift both 7-bit magnitudes right into place; the masks keep each half's
    bits inside that half.
    """
    p = uint32(pair)
    spread = ((p & uint32(0x00FF)) << uint32(8)) | ((p & uint32(0xFF00)) << uint32(16))
    return (spread & uint32(SIGN_MASK_X2)) | ((spread & uint32(MAGNITUDE_MASK_X2)) >> uint32(shift))


# ---------------------------------------------------------------------------- the kernel factory


def kernel_function(tiling: Tiling, activation: str, output: str):
    """The Python source of one kernel variant, before ``cuda.jit``: the tiling, the activation
    format (``'bf16'``/``'f16'``) and the output format (``'f32'``/``'f16'``/``'bf16'``) are
    compile-time constants, so every per-thread array below has constant indices after unrolling
    and lives in registers. Arguments: ``(a_words uint64 [M, K/4], q_words uint64 [N, K/8],
    scale_inv float32 [ceil(N/BN), ceil(K/BK)], out [M, N], block_n uint32, block_k uint32)``: the
    activations and codes as 8-byte words (``kernel_signature``)."""
    if activation not in PLACEMENT_EXPONENT or output not in ("f32", "f16", "bf16"):
        raise ValueError(f"no kernel variant for activation={activation!r}, output={output!r}")
    tiling = Tiling(*tiling).check()
    m_blocks, n8_per_warp, stages, warps_n = tiling.m_blocks, tiling.n8_tiles_per_warp, tiling.stages, tiling.warps_n
    warp_rows, place_once = tiling.warp_rows, tiling.place_once
    placed_offset = stages * tiling.stage_bytes  # the placed-weights buffer, after the stages
    placed_words = tiling.cta_n * CODE_WORDS_PER_ROW // tiling.threads  # code words each thread places per chunk
    threads, m_tile, n8_tiles = tiling.threads, tiling.m_tile, tiling.n8_tiles
    stage_bytes, b_offset, scale_offset = tiling.stage_bytes, tiling.a_bytes, tiling.a_bytes + tiling.b_bytes
    a_copies = m_tile * A_COPIES_PER_ROW // threads  # 16-byte copies per thread and chunk
    b_copies = tiling.cta_n * B_COPIES_PER_ROW // threads
    accumulators = 4 * m_blocks * n8_per_warp  # float32 c registers per lane: 4 per m16 x n8 tile
    b_registers = 2 * n8_per_warp
    mma = mma_bf16 if activation == "bf16" else mma_f16
    shift = PLACEMENT_SHIFT[activation]
    unplace = np.float32(2.0 ** PLACEMENT_EXPONENT[activation])
    fold_limit = np.float32(2.0 ** (128 - PLACEMENT_EXPONENT[activation]))
    wait_for_chunk = wait_group_function(stages - 2)
    bf16_output = output == "bf16"

    @inlined_device_function
    def copy_chunk(smem64, smemf, a_words, q_words, scale_inv, chunk, stage, cta_row0, cta_col0, thread, scale_row,
                   scale_bytes, block_k):
        """Issue this thread's ``cp.async`` copies of chunk ``chunk`` into stage ``stage``: A rows
        (through L1), weight rows (L2 only), and threads ``0 .. n8_tiles - 1`` one scale each (row
        ``scale_row``). Rows past the end are zero-filled (source clamped to a valid row, not read)."""
        base = stage * stage_bytes
        m, n = uint32(a_words.shape[0]), uint32(q_words.shape[0])
        for j in range(a_copies):
            piece = uint32(j * threads) + thread
            row, col = piece // A_COPIES_PER_ROW, 2 * (piece % A_COPIES_PER_ROW)  # col in 8-byte words
            source = cta_row0 + row
            copy_16_ca(smem64, (base + row * A_ROW_BYTES) // WORD64 + col, a_words, clamp(source, m),
                       chunk * A_WORDS64_PER_CHUNK + col, COPY_BYTES if source < m else 0)
        for j in range(b_copies):
            piece = uint32(j * threads) + thread
            row, col = piece // B_COPIES_PER_ROW, 2 * (piece % B_COPIES_PER_ROW)
            source = cta_col0 + row
            copy_16_cg(smem64, (base + b_offset + row * B_ROW_BYTES) // WORD64 + col, q_words, clamp(source, n),
                       chunk * B_WORDS64_PER_CHUNK + col, COPY_BYTES if source < n else 0)
        if thread < n8_tiles:
            copy_4_ca(smemf, (base + scale_offset) // 4 + thread, scale_inv, scale_row,
                      uint32(chunk * K_CHUNK) // block_k, scale_bytes)

    @inlined_device_function
    def a_fragment(smem32, top):
        """The 4 A registers of one m16 tile and k16 step: words (two activations) at (g, 2t),
        (g+8, 2t), (g, 2t+8), (g+8, 2t+8) of the 16x16 tile (``fp8lab.simulators.mma.A_COORDS``); ``top``
        is the word index of (g, 2t)."""
        bottom = top + 8 * (A_ROW_BYTES // 4)
        return at(smem32, top), at(smem32, bottom), at(smem32, top + 4), at(smem32, bottom + 4)

    @inlined_device_function
    def b_fragment(smem16, pair):
        """The 2 B registers of one n8 tile and k16 step: codes (k = 2t, 2t+1) and (2t+8, 2t+9) of
        weight row n = g, each pair one uint16 (``pair`` the halfword index of the first), placed
        into 16-bit patterns."""
        return place_code_pair(at(smem16, pair), shift), place_code_pair(at(smem16, pair + 4), shift)

    @inlined_device_function
    def place_chunk(smem32, smem64, stage, thread):
        """``place_once``: every code of the stage's weight rows into the placed buffer, 4 codes (one word in, two
        ``place_code_pair`` out as one 8-byte store) at a time; thread ``i`` takes words ``j * THREADS + i`` (a warp:
        one row's 32 words, conflict-free)."""
        for j in range(placed_words):
            piece = uint32(j * threads) + thread
            row, word = piece // CODE_WORDS_PER_ROW, piece % CODE_WORDS_PER_ROW
            codes = at(smem32, (stage * stage_bytes + b_offset + row * B_ROW_BYTES) // 4 + word)
            low = uint64(place_code_pair(codes & uint32(0xFFFF), shift))
            high = uint64(place_code_pair(codes >> uint32(16), shift))
            smem64[uint64((placed_offset + row * PLACED_ROW_BYTES) // WORD64 + word)] = low | (high << uint64(32))

    @inlined_device_function
    def b_fragment_placed(smem32, word):
        """The 2 B registers of one n8 tile and k16 step from the placed buffer: the patterns of (k = 2t, 2t+1) and
        (2t+8, 2t+9) of weight row n = g, ``word`` the index of the first."""
        return at(smem32, word), at(smem32, word + 4)

    @inlined_device_function
    def multiply_chunk(smem32, smem16, stage, c_part, b_regs, warp_m, warp_n, g, t):
        """``c_part = 0``, then 8 k16 steps of one mma per (m16, n8) tile of the warp: each B fragment
        feeds ``m_blocks`` mma, each A fragment ``n8_tiles_per_warp``. Accumulator tile
        ``mt * n8_tiles_per_warp + nt`` is ``c_part[4 * tile .. 4 * tile + 3]``."""
        for i in range(accumulators):
            c_part[i] = float32(0.0)
        # lane (g, t)'s first A word (row g, k = 2t) and first B code pair (weight row g of the
        # warp's first n8 tile, k = 2t) in this stage; each k16 step moves 16 activations / codes on
        a_first = (stage * stage_bytes + (warp_m * warp_rows + g) * A_ROW_BYTES) // 4 + t
        b_first = (stage * stage_bytes + b_offset + (warp_n * n8_per_warp * MMA_N + g) * B_ROW_BYTES) // 2 + t
        placed_first = (placed_offset + (warp_n * n8_per_warp * MMA_N + g) * PLACED_ROW_BYTES) // 4 + t
        for step in range(K_STEPS_PER_CHUNK):
            for nt in range(n8_per_warp):
                if place_once:
                    word = placed_first + nt * (MMA_N * PLACED_ROW_BYTES // 4) + step * (MMA_K // 2)
                    b_regs[2 * nt], b_regs[2 * nt + 1] = b_fragment_placed(smem32, word)
                else:
                    pair = b_first + nt * (MMA_N * B_ROW_BYTES // 2) + step * (MMA_K // 2)
                    b_regs[2 * nt], b_regs[2 * nt + 1] = b_fragment(smem16, pair)
            for mt in range(m_blocks):
                a0, a1, a2, a3 = a_fragment(smem32, a_first + mt * (MMA_M * A_ROW_BYTES // 4) + step * (MMA_K // 2))
                for nt in range(n8_per_warp):
                    c = 4 * (mt * n8_per_warp + nt)
                    d = mma(a0, a1, a2, a3, b_regs[2 * nt], b_regs[2 * nt + 1],
                            c_part[c], c_part[c + 1], c_part[c + 2], c_part[c + 3])
                    c_part[c], c_part[c + 1], c_part[c + 2], c_part[c + 3] = d[0], d[1], d[2], d[3]

    @inlined_device_function
    def promote(smemf, stage, c_part, c_fin, warp_n):
        """``c_fin = fma(s * 2^offset, c_part, c_fin)`` per accumulator, ``s`` the n8 tile's block scale (for
        ``|s| >= 2^(128 - offset)``: ``fma(s, c_part * 2^offset, c_fin)``; ``fold_scale``)."""
        for nt in range(n8_per_warp):
            s, restore = fold_scale(at(smemf, (stage * stage_bytes + scale_offset) // 4 + warp_n * n8_per_warp + nt),
                                    unplace, fold_limit)
            for mt in range(m_blocks):
                for i in range(4):
                    c = 4 * (mt * n8_per_warp + nt) + i
                    c_fin[c] = cuda.fma(s, c_part[c] * restore, c_fin[c])  # * 1 or * 2^offset: exact

    @inlined_device_function
    def store_tiles(out, c_fin, row0, col0, warp_m, warp_n, g, t):
        """Each lane's c0..c3 of each tile: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); only inside ``out``."""
        for mt in range(m_blocks):
            for nt in range(n8_per_warp):
                for i in range(4):
                    row = row0 + warp_m * warp_rows + mt * MMA_M + g + 8 * (i >> 1)
                    col = col0 + (warp_n * n8_per_warp + nt) * MMA_N + 2 * t + (i & 1)
                    if row < out.shape[0] and col < out.shape[1]:
                        value = c_fin[4 * (mt * n8_per_warp + nt) + i]
                        if bf16_output:
                            out[row, col] = f32_to_bf16_bits_rne(value)  # a NaN stays NaN
                        else:
                            out[row, col] = value  # float32, or float16 rounded once (nearest even)

    def gemm_mma_kernel(a_words, q_words, scale_inv, out, block_n, block_k):
        # Indices are uint32 from the start: the compiler then knows they are not negative and drops
        # the fix-ups that Python semantics (negative indices, floor division) would otherwise cost.
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        thread = uint32(cuda.threadIdx.x)
        warp, lane = thread // WARP_SIZE, thread % WARP_SIZE
        warp_m, warp_n = warp // uint32(warps_n), warp % uint32(warps_n)
        g, t = lane >> 2, lane & 3
        cta_row0 = uint32(cuda.blockIdx.y) * m_tile
        cta_col0 = uint32(cuda.blockIdx.x) * (n8_tiles * MMA_N)
        chunks = uint32(q_words.shape[1] // B_WORDS64_PER_CHUNK)
        # Threads 0 .. n8_tiles - 1 copy the scales: n8 tile `thread`'s scale row, and 4 bytes to
        # copy, or 0 (zero fill) for a tile wholly past N, whose outputs are never stored.
        n0, n = cta_col0 + thread * MMA_N, uint32(q_words.shape[0])
        scale_row = clamp(n0, n) // block_n
        scale_bytes = 4 if n0 < n else 0

        # Four views of one dynamic shared allocation (dynamic shared arrays alias each other). Every
        # phase change of a stage (copied -> read -> copied again) passes a wait and a syncthreads.
        smem64 = cuda.shared.array(0, uint64)
        smem32 = cuda.shared.array(0, uint32)
        smem16 = cuda.shared.array(0, uint16)
        smemf = cuda.shared.array(0, float32)
        b_regs = cuda.local.array(b_registers, uint32)
        c_part = cuda.local.array(accumulators, float32)
        c_fin = cuda.local.array(accumulators, float32)
        for i in range(accumulators):
            c_fin[i] = float32(0.0)

        # Prologue: chunks 0 .. stages - 2 into stages 0 .. stages - 2, one commit group each.
        for first in range(stages - 1):
            if first < chunks:
                copy_chunk(smem64, smemf, a_words, q_words, scale_inv, uint32(first), uint32(first), cta_row0,
                           cta_col0, thread, scale_row, scale_bytes, block_k)
            commit_group()

        for chunk_index in range(chunks):
            chunk = uint32(chunk_index)
            stage = chunk % uint32(stages)
            wait_for_chunk()  # my copies of `chunk` have landed ...
            cuda.syncthreads()  # ... and everyone's; and everyone is done with chunk - 1's stage
            ahead = chunk + uint32(stages - 1)
            if ahead < chunks:
                freed = (stage + uint32(stages - 1)) % uint32(stages)  # the stage chunk - 1 used
                copy_chunk(smem64, smemf, a_words, q_words, scale_inv, ahead, freed, cta_row0, cta_col0, thread,
                           scale_row, scale_bytes, block_k)
            commit_group()  # one group per iteration, empty or not: the wait above counts on it

            if place_once:  # the placed buffer's last readers passed the barrier above; its writers pass this one
                place_chunk(smem32, smem64, stage, thread)
                cuda.syncthreads()
            multiply_chunk(smem32, smem16, stage, c_part, b_regs, warp_m, warp_n, g, t)
            promote(smemf, stage, c_part, c_fin, warp_n)  # one rounding per chunk

        store_tiles(out, c_fin, cta_row0, cta_col0, warp_m, warp_n, g, t)

    return gemm_mma_kernel


def kernel_signature(output: str) -> str:
    """The Numba signature the host wrapper launches with (for ``cuda.compile_ptx``)."""
    out_type = {"f32": "float32", "f16": "float16", "bf16": "uint16"}[output]
    return f"void(uint64[:, ::1], uint64[:, ::1], float32[:, ::1], {out_type}[:, ::1], uint32, uint32)"


def launch_bounds(tiling: Tiling) -> tuple[int, int]:
    """``(threads per CTA, at least 1 CTA per SM)``. The second bound is no constraint, but without
    it ptxas capped some 1- and 2-warp variants at 80 to 128 registers and spilled (they hoist a
    64-bit address per copy out of the K loop: up to 255 registers, no spills)."""
    return tiling.threads, 1


@functools.lru_cache(maxsize=None)
def compiled_kernel(tiling: Tiling, activation: str, output: str):
    """One ``cuda.jit`` dispatcher per variant, compiled on first launch and kept."""
    options = {} if bits.SIMULATOR else {"launch_bounds": launch_bounds(tiling)}
    return cuda.jit(kernel_function(tiling, activation, output), **options)


# ---------------------------------------------------------------------------- the host side

def _as_words(name: str, x, dtype):
    """``x`` (C-contiguous, row bytes a multiple of 16) reinterpreted as ``dtype`` words; device data must be
    16-byte aligned, as the kernel copies 16 bytes at a time (``cp.async``)."""
    require_load_alignment(name, x, "gemm_mma")
    return x.view(dtype)


_shared_opt_ins: dict[int, tuple[object, int]] = {}


def _allow_shared_memory(kernel, args, shared_bytes: int) -> None:
    """Opt the compiled kernel for ``args`` in to ``shared_bytes`` of dynamic shared memory where
    that is over the 48 KiB default (CUDA's ``cudaFuncAttributeMaxDynamicSharedMemorySize``).
    Compiles the kernel for these argument types first (the launch then finds it compiled)."""
    if bits.SIMULATOR or shared_bytes <= DEFAULT_SHARED_LIMIT:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    function = kernel.compile(tuple(kernel.typeof_pyval(arg) for arg in args)).library.get_cufunc()
    known = _shared_opt_ins.get(id(function))
    if known is not None and known[0] is function and known[1] >= shared_bytes:
        return
    attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attribute, shared_bytes, function.handle, function.device.id)
    _shared_opt_ins[id(function)] = (function, shared_bytes)


def gemm_mma(a, q, scale_inv, out, block=(128, 128), m_blocks=None, stream=0, *, warps_n=None,
             n8_tiles_per_warp=None, stages=None, warps_m=1, place_once=False):
    """``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T`` on tensor cores; returns ``out``.

    ``a``: BF16 bits (``uint16``/``int16``) or ``float16`` ``[M, K]``, any M >= 1; ``q``: ``uint8
    [N, K]``; ``scale_inv``: ``float32 [ceil(N/BN), ceil(K/BK)]``; ``out``: ``float32``,
    ``float16`` or BF16 bits (``uint16``/``int16``) ``[M, N]``; all C-contiguous NumPy, Numba device
    or ``__cuda_array_interface__`` arrays (device data 16-byte aligned). ``block = (BN, BK)``:
    ``BN`` a multiple of 8, ``BK`` a multiple of 128; ``K`` a multiple of 128. Tiling knobs
    (``Tiling``; ``None`` takes ``choose_tiling``'s default), none of which changes a bit of the
    result: ``m_blocks`` (1, 2, 4), ``warps_n`` (1, 2, 4, 8), ``n8_tiles_per_warp`` (1, 2, 4), ``warps_m`` (1, 2, 4),
    ``place_once`` (bool),
    ``stages`` (2 to 8). ``stream``: where to enqueue the launch (a Numba stream, or a ``cuda.core``
    GraphBuilder to capture it into a CUDA graph; 0 is the default stream). Every problem is a
    ``ValueError`` raised before anything is launched.
    """
    problem = check_gemm(a, q, scale_inv, out, block, kernel="gemm_mma", activations=("bf16", "f16"),
                         block_n_multiple=BLOCK_N_MULTIPLE)
    launch = launch_info(problem.m, problem.n, problem.k, m_blocks, warps_n=warps_n, warps_m=warps_m, place_once=place_once,
                         n8_tiles_per_warp=n8_tiles_per_warp, stages=stages)
    a_words = _as_words("a", problem.a, np.uint64)
    q_words = _as_words("q", problem.q, np.uint64)
    out_view = problem.out.view(np.uint16) if problem.output == "bf16" else problem.out  # int16 bits too
    kernel = compiled_kernel(launch.tiling, problem.activation, problem.output)
    args = (a_words, q_words, problem.scale_inv, out_view, np.uint32(problem.block[0]), np.uint32(problem.block[1]))
    _allow_shared_memory(kernel, args, launch.shared_bytes)
    pdl.launch(kernel, launch.grid, launch.block, stream, *args, shared_bytes=launch.shared_bytes)
    return problem.out
