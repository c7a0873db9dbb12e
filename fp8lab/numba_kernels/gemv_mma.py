"""Tensor-core decode GEMV for FP8 (E4M3) blockwise weights: ``mma.m16n8k16`` with the weights as the m16 operand.

Computes ``fp8lab.reference.blockwise.gemm`` for ``1 <= M <= 32`` rows (a decode batch, a short prefill; float32
activations: 16)::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

Launch: grid ``(N / 16 c,)`` (``gemv_mma``) or ``(I / 8 c,)`` (``gemv_mma_swiglu``) x ``32 k_slices`` threads, ``c`` the
column tiles per CTA (1 or 2).
Checked (``tests/numba_kernels/test_gemv_mma_kernel.py``): bit for bit against ``fp8lab.simulators.gemv_mma`` in
the CUDA simulator, against the oracle within the tensor-core error budget of ``fp8lab.simulators.gemm_mma`` on a
GPU. Read the simulator's docstring first: it fixes which k each mma step sums and the order of everything.

Why a second tensor-core GEMM: ``gemm_mma`` puts the activations in the mma's 16 rows, so a decode batch of 4
uses a quarter of each mma and a CTA covers only 32 columns through shared memory; the SIMT GEMV
(``gemv_simt``) does one FFMA per code and row, so its time grows with every row (at the Qwen3-8B gate/up
shape, 30 us at M = 1 and 51 us at M = 4 on an H200). Here the **weights are the A operand** (a warp's 16
output columns) and the **activations the B operand** (8 rows per mma, one per lane group; each further 8 rows,
up to 32, take one more mma on the same A registers), so one mma does the work of 16 x 8 x 16 FFMAs whatever M
is, and the weights go from global memory straight into registers, once for all the rows.

How, per warp (lane ``(g, t)`` = ``(lane >> 2, lane & 3)``):

- **Columns**: the CTA's 16 weight rows are ``16 x .. 16 x + 15`` (SwiGLU: gate rows ``8 x + g`` and the
  matching up rows ``I + 8 x + g``, so a lane's two accumulator rows are the gate and up of one output).
  Lane ``(g, t)`` loads rows ``g`` and ``g + 8`` of the tile.
- **Column tiles**: with ``column_tiles=2`` the CTA takes two such tiles (32 weight rows; SwiGLU: 16 outputs) and
  each warp multiplies both by the same activation registers (one more mma per batch tile and k16 step), so the
  activations cross the L2 once per 32 weight rows instead of 16: at 32 rows of K = 4,096 a warp's activations are
  16 times its codes' bytes. Half the CTAs and more registers each, so ``default_column_tiles`` takes two only where
  one tile's grid needs a second wave and two tiles' fits one. No output's order changes.
- **K slices**: the CTA's ``k_slices`` warps each take a contiguous slice of the 128-wide chunks
  (``fp8lab.simulators.gemv_mma.slice_chunks``); more warps per column where the grid is narrow.
- **Spans of 64 k**: per span a lane loads 16 codes of each of its two rows (one 128-bit load each) and
  16 activations of batch row ``g`` (and ``g + 8``, ``g + 16``, ``g + 24`` for further batch tiles) at the same k
  (two 128-bit loads
  of BF16, four of float32, per row); rows ``>= M`` are zeros, never loaded. The 4 k16 steps of a span take word ``j`` of each code load
  (codes ``4 j .. 4 j + 3``: A registers ``a0a1 = place(codes 0, 1)`` of row ``g``, ``a2a3`` the same of row
  ``g + 8``, ``a4a5``, ``a6a7`` codes 2, 3) and activations ``4 j .. 4 j + 3`` (B registers
  ``b0b1``, ``b2b3``): the mma sums the 16 k ``16 t' + 4 j + r`` of the span, the simulator's ``k_order``.
  A code becomes a BF16 pattern by bit placement (``gemm_mma.place_code_pair``, worth ``decode(c) * 2^-120``).
- **Per chunk**: ``c_part = 0``; 8 mma steps, one mma per batch tile each (``mma.mma_bf16_inline``: the
  instruction as inline assembly in this kernel); ``c_fin = fma(s, c_part * 2^120, c_fin)`` with each row's
  block scale.
- **A ring of ``depth`` chunks** (1 to 4; ``default_depth``): each warp keeps the codes, activations and block
  scales of its next ``depth`` chunks in registers and refills a slot right after that chunk's mma. A round of
  the loop is written out ``depth`` times (``gemv_simt.unrolled``) so every slot index is a constant. The ring
  is what keeps bytes in flight; registers bound it (78, 108 and 144 at depths 1 to 3 with one batch tile; 143 and
  226 at depths 1 and 2 with four, which spill at 3): the default is the deepest ring at which the whole grid is
  resident at once (``default_depth``).
- **The CTA's sum**: each warp puts its ``c_fin`` in shared memory; warp 0 adds them in warp order and stores
  ``out[8 b + 2 t, n]``, ``out[8 b + 2 t + 1, n]`` of batch tile ``b`` (the accumulator columns are the batch
  rows), or SwiGLU's ``silu(gate) * up`` with ``layers.silu_times``; a uint16 ``out`` gets them rounded to BF16
  bits (``mathops.f32_to_bf16_bits_rne``, as ``layers.bf16_round``), the input format of the next GEMM.
- **Float32 activations** are rounded to BF16 on load (``mathops.f32_to_bf16_bits_rne``, what
  ``layers.bf16_round`` does), so a float32 call is ``bf16_round`` + a BF16 call, bit for bit, one launch less.
- **PDL**: the ring's first codes and scales are loaded before ``griddepcontrol.wait`` (nothing in the stream
  writes them), the activations after it.
- **BF16 weights** (``gemv_mma_bf16``, for the lm_head): the same kernel with ``weights='bf16'``: a lane loads
  its 16 k of each row as two 128-bit loads of BF16 patterns, which are the A registers as they are (no bit
  placement), and there are no block scales (``c_fin += c_part``). Model: ``fp8lab.simulators.gemv_mma.gemv_mma_bf16``.
  The engine's lm_head for more than ``f32_max_rows`` rows; at the copy bandwidth at every M on an H200
  (``bench/lm_head.py``: 299 us at 16 rows of Qwen3-8B's, against 1,488 for ``layers.bf16_linear``).

Measured (``bench/gemv_mma.py`` and ``bench/engine.py``; numbers in ``bench/RESULTS.md``): at 2 to 8 rows with BF16
inputs faster than the SIMT GEMV, at one row slower (the SIMT GEMV streams more bytes per register); at 8 rows of
Qwen3-8B's q/k/v, 0.47 times ``gemm_mma``'s time; in the engine, faster than ``gemm_mma`` at 8 and 16 rows.
So ``fp8_gemm`` sends it 2 to 32 rows (17 to 32 went to ``gemm_mma`` before; not yet timed there).

Requirements (``ValueError`` before launching): ``arguments.check_gemm``'s (K and BK multiples of 128), BN a
multiple of 8, ``1 <= M <= 32`` (``F32_MAX_ROWS`` for float32), activations BF16 bits (uint16/int16) or float32, ``out``
float32 or uint16 (BF16 bits), ``N`` a multiple of 16 (SwiGLU: ``I`` a multiple of 8), 16-byte aligned device data.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, uint32

from fp8lab.simulators.gemv_mma import (
    BATCH_TILE,
    K_CHUNK,
    K_SLICES_CHOICES,
    MAX_ROWS,
    ROWS_PER_WARP,
)

from . import arguments, pdl
from .bits import SIMULATOR, u32_as_f32
from .dequantize import STORE
from .gemm_mma import (
    PLACEMENT_EXPONENT,
    PLACEMENT_SHIFT,
    inlined_device_function,
    place_code_pair,
)
from .gemv_simt import unrolled
from .layers import silu_times
from .mathops import f32_to_bf16_bits_rne
from .mma import mma_bf16_inline as mma_bf16
from .splitkv import device_num_sms
from .warp import WARP_SIZE, load_u32x4

SPANS_PER_CHUNK = 2
"""Two 64-wide spans per 128-wide chunk."""
WEIGHT_WORDS = {"e4m3": 4, "bf16": 8}
"""uint32 words a lane loads per weight row and span: its 16 k as E4M3 codes (one 128-bit load) or as BF16
patterns (two)."""
SHIFT = PLACEMENT_SHIFT["bf16"]
UNPLACE = np.float32(2.0 ** PLACEMENT_EXPONENT["bf16"])
ACTIVATION_WORDS = {"bf16": SPANS_PER_CHUNK * 8, "f32": SPANS_PER_CHUNK * 16}
"""uint32 words of activations a lane holds per chunk: 16 per span as BF16 pairs (8) or float32 (16)."""
F32_MAX_ROWS = 2 * BATCH_TILE
"""Rows of float32 activations at most: two batch tiles. With three or four, their 32 words per tile and chunk put
the ring in local memory (ptxas, sm_90: a 576-byte stack frame at four tiles and depth 1)."""


DEPTH_CHOICES = (1, 2, 3, 4)
"""Chunks a warp keeps in flight (its register ring)."""
COLUMN_TILES_CHOICES = (1, 2)
"""Tiles of 16 weight rows per CTA (``gemv_mma_kernel``'s ``column_tiles``)."""


def default_k_slices(n_tiles: int, num_chunks: int) -> int:
    """Warps per CTA: the fewest of 2, 4 and 8 that give the grid at least 1,536 warps, at most one per chunk
    (``bench/gemv_mma.py`` on an H200: within 10% of the best (k_slices, depth) at the Qwen3 shapes but for
    Qwen3-0.6B's down_proj, 26%)."""
    for s in K_SLICES_CHOICES[1:]:
        if n_tiles * s >= 1536 or s >= num_chunks:
            return s
    return K_SLICES_CHOICES[-1]


REGISTERS = {(False, 1): (77, 110, 144), (False, 2): (102, 142, 198), (False, 3): (116, 184, 250), (False, 4): (145, 230),
             (True, 1): (77, 106, 140), (True, 2): (102, 142, 196), (True, 3): (114, 184, 248), (True, 4): (143, 226)}
"""Registers per thread of the BF16-activation kernels at ring depths 1, 2 and 3, by (SwiGLU, batch tiles): ptxas
for sm_90 (``tests/numba_kernels/test_kernels_compile.py`` checks the variants it compiles against this table).
Four batch tiles spill at depth 3 (255 registers and 892 bytes), so their entry stops at depth 2."""
REGISTERS_TWO_TILES = {(False, 1): (95, 162, 237), (False, 2): (156, 232), (False, 3): (162, 248), (False, 4): (209,),
                       (True, 1): (95, 162, 237), (True, 2): (156, 232), (True, 3): (162, 248), (True, 4): (209,)}
"""The same with two column tiles per CTA (``column_tiles=2``), up to the deepest ring without spills (ptxas, sm_90;
depth 3 spills from two batch tiles on, depth 2 at four)."""
SM_REGISTERS, SM_MAX_WARPS, SM_MAX_CTAS, REGISTER_UNIT = 65536, 64, 32, 256
"""An sm_90 SM's register file, its most resident warps and CTAs, and the registers a warp is given at a time."""


def resident_ctas(k_slices: int, registers: int) -> int:
    """CTAs of ``k_slices`` warps that one SM holds at once when each thread uses ``registers`` registers (shared
    memory never binds: at most 32 KB a CTA, at eight warps of four batch tiles and two column tiles, where the
    registers allow one CTA)."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return min(SM_MAX_CTAS, SM_MAX_WARPS // k_slices, SM_REGISTERS // (per_warp * k_slices))


def _resident_depths(registers: tuple, k_slices: int, grid: int, sms: int) -> list[int]:
    """The ring depths (deepest first) at which all ``grid`` CTAs are resident at once on ``sms`` SMs."""
    return [depth for depth in range(len(registers), 0, -1)
            if resident_ctas(k_slices, registers[depth - 1]) * sms >= grid]


def default_column_tiles(activation: str, k_slices: int, batch_tiles: int, swiglu: bool, n_tiles: int,
                         sms: int) -> int:
    """Tiles of 16 weight rows per CTA: 1, unless no ring of one tile keeps the whole grid (``n_tiles`` CTAs)
    resident at once and a ring of two tiles does (half the CTAs, more registers each). Two tiles read each
    activation once per 32 weight rows, but give half the warps; on an H100 (``bench/RESULTS.md``, twenty-sixth and
    twenty-seventh sessions) they were faster exactly where one tile needed a second wave: the Qwen3-8B o_proj and
    down_proj at 32 rows (14.8 against 17.3 us; 33.1 against 39.1), gate/up with SwiGLU at 16 and 24 rows (40.9
    against 49.7; 44.6 against 56.4), and slower wherever one tile fitted (q/k/v at 32 rows: 19.0 against 17.0)."""
    if activation != "bf16" or n_tiles % 2:
        return 1
    if _resident_depths(REGISTERS[swiglu, batch_tiles], k_slices, n_tiles, sms):
        return 1
    return 2 if _resident_depths(REGISTERS_TWO_TILES[swiglu, batch_tiles], k_slices, n_tiles // 2, sms) else 1


def default_depth(activation: str, k_slices: int, batch_tiles: int, swiglu: bool, grid: int, sms: int,
                  column_tiles: int = 1) -> int:
    """Chunks in flight per warp: the deepest ring (up to 3) at which all ``grid`` CTAs are resident at once on
    ``sms`` SMs (one wave), else 1, the most warps at once. A deeper ring keeps more bytes in flight per warp but
    costs registers, and once the grid needs a second wave the SMs idle through its tail. On an H200 (the sweeps
    of ``bench/RESULTS.md``, ninth and eleventh sessions) this picks, at every Qwen3 shape and row count measured,
    the fastest of the depths measured at the default ``k_slices`` or one within 5% of it: e.g. Qwen3-8B gate/up at
    4 and 8 rows, depth 1, 33.7 us, against 43.9 at depth 3, the rule before. Float32 activations: 2 (twice the
    activation words per chunk: 168 registers at depth 2)."""
    if activation != "bf16":
        return 2
    registers = (REGISTERS if column_tiles == 1 else REGISTERS_TWO_TILES)[swiglu, batch_tiles]
    return max([1] + _resident_depths(registers, k_slices, grid, sms))


def batch_tiles_for(m: int) -> int:
    """n8 tiles of activations a warp multiplies: 1 for up to 8 rows, 2 for 9 to 16, ..., 4 for 25 to 32."""
    return -(-m // BATCH_TILE)


@functools.cache
def gemv_mma_kernel(k_slices: int, activation: str, swiglu: bool, depth: int = 3, batch_tiles: int = 1,
                    output: str = "f32", weights: str = "e4m3", column_tiles: int = 1):
    """One kernel variant: ``depth`` chunks in flight per warp (a register ring), ``k_slices`` warps per CTA,
    ``activation`` ``'bf16'`` (uint16 pairs as uint32 words) or ``'f32'`` (float32 bits as uint32 words), plain or
    SwiGLU, ``batch_tiles`` n8 tiles of batch rows (1: rows 0..7; 2: rows 0..15, two mma per k16 step on the same
    A registers; up to 4: rows 0..31), ``output`` ``'f32'`` or ``'bf16'`` (uint16 bits, rounded as ``layers.bf16_round``). Arguments:
    ``(a_words uint32 [M * K / 2 or M * K], q_words uint32 [N * K / 4], scale_inv float32 [ceil(N/BN),
    ceil(K/BK)], out float32 or uint16 [M, N or I], m, k, block_n, block_k)``, all flat words row-major.
    ``weights='bf16'``: ``q_words`` holds BF16 weight patterns (``N * K / 2`` words), the A registers take them as
    they are, and there are no block scales (``scale_inv`` is not read; the promotion is ``c_fin += c_part``).
    ``column_tiles`` (1 or 2): tiles of 16 weight rows (SwiGLU: 8 outputs) per CTA, each warp multiplying every
    tile by the same activation registers, so the activations are read from L2 once per ``16 column_tiles`` rows;
    every output's order is unchanged."""
    if column_tiles not in COLUMN_TILES_CHOICES:
        raise ValueError(f"column_tiles: expected one of {COLUMN_TILES_CHOICES}, got {column_tiles!r}")
    scaled = weights == "e4m3"
    row_words = WEIGHT_WORDS[weights]  # per weight row and span
    code_words = 2 * SPANS_PER_CHUNK * row_words  # per chunk: 2 rows x 2 spans
    weight_k_per_word = 16 // row_words  # k per uint32 word: 4 codes or 2 BF16
    unplace = UNPLACE if scaled else np.float32(1)
    activation_words = ACTIVATION_WORDS[activation]
    slot_words = batch_tiles * activation_words  # a ring slot holds every batch tile's activations
    code_ring, activation_ring = depth * column_tiles * code_words, depth * slot_words  # constants
    scale_ring = 2 * depth * column_tiles
    accumulators = 4 * batch_tiles  # C registers: 4 per n8 tile, per column tile
    all_accumulators = column_tiles * accumulators
    rows_per_tile = 8 if swiglu else ROWS_PER_WARP
    words_per_k = 2 if activation == "bf16" else 1  # k per activation word

    @inlined_device_function
    def load_codes(q_words, row0, row1, k_words, chunk, t, codes, slot):
        """This lane's 16 weights (codes, or BF16 patterns) of rows ``row0`` and ``row1`` in both spans of
        ``chunk``, into ring slot ``slot``: ``codes[code_words slot + 2 row_words s + row_words r + i]`` is word
        ``i`` of span ``s``, row ``r``."""
        for s in range(SPANS_PER_CHUNK):
            column = (chunk * uint32(K_CHUNK) + uint32(s * 64) + uint32(16) * t) // uint32(weight_k_per_word)
            for r in range(2):
                row = row0 if r == 0 else row1
                for piece in range(row_words // 4):
                    base = code_words * slot + 2 * row_words * s + row_words * r + 4 * piece
                    w = load_u32x4(q_words, row * k_words + column + uint32(4 * piece))
                    codes[base], codes[base + 1], codes[base + 2], codes[base + 3] = w

    @inlined_device_function
    def load_batch_tile(a_words, row, present, k, chunk, t, values, base0):
        """Batch row ``row``'s 16 activations per span at this lane's k, into ``values[base0:]`` (``present``
        False: zeros, nothing loaded)."""
        if present:
            row_words = k // uint32(words_per_k)
            for s in range(SPANS_PER_CHUNK):
                first = row * row_words + (chunk * uint32(K_CHUNK) + uint32(s * 64) + uint32(16) * t) // uint32(words_per_k)
                for piece in range(activation_words // (4 * SPANS_PER_CHUNK)):
                    w = load_u32x4(a_words, first + uint32(4 * piece))
                    base = base0 + s * (activation_words // SPANS_PER_CHUNK) + 4 * piece
                    values[base], values[base + 1], values[base + 2], values[base + 3] = w
        else:
            for i in range(activation_words):
                values[base0 + i] = uint32(0)

    @inlined_device_function
    def load_activations(a_words, g, m, k, chunk, t, values, slot):
        """Ring slot ``slot`` <- the activations of batch rows ``g`` (and ``g + 8``) for ``chunk``; rows ``>= m``
        are zeros."""
        for tile in range(batch_tiles):
            row = g + uint32(BATCH_TILE * tile)
            load_batch_tile(a_words, row, row < m, k, chunk, t, values, slot_words * slot + activation_words * tile)

    @inlined_device_function
    def load_scales(scale_inv, scale_row0, scale_row1, chunk, block_k, scales, slot):
        """The block scales of the lane's two rows for ``chunk``, into ring slot ``slot`` (BF16 weights: 1)."""
        if scaled:
            column = (chunk * uint32(K_CHUNK)) // block_k
            scales[2 * slot] = scale_inv[scale_row0, column]
            scales[2 * slot + 1] = scale_inv[scale_row1, column]
        else:
            scales[2 * slot] = float32(1)
            scales[2 * slot + 1] = float32(1)

    if scaled:
        @inlined_device_function
        def a_registers(codes, base, j):
            """A registers of step ``j`` from the span's words at ``codes[base:]``: word ``j`` of each row holds codes
            ``4 j .. 4 j + 3``, placed pairwise into BF16 patterns (row ``g``: a0a1, a4a5; row ``g + 8``: a2a3, a6a7)."""
            top, bottom = codes[base + j], codes[base + 4 + j]
            return (place_code_pair(top & uint32(0xFFFF), SHIFT), place_code_pair(bottom & uint32(0xFFFF), SHIFT),
                    place_code_pair(top >> uint32(16), SHIFT), place_code_pair(bottom >> uint32(16), SHIFT))
    else:
        @inlined_device_function
        def a_registers(codes, base, j):
            """The same from BF16 weights: words ``2 j`` and ``2 j + 1`` of each row hold k ``4 j .. 4 j + 3`` as pairs,
            already the A registers."""
            return codes[base + 2 * j], codes[base + 8 + 2 * j], codes[base + 2 * j + 1], codes[base + 8 + 2 * j + 1]

    if activation == "bf16":
        @inlined_device_function
        def b_register(values, v, span, pair):
            """B register ``pair`` (0..7) of span ``span`` of the batch tile whose words start at ``v``:
            activations ``2 pair``, ``2 pair + 1`` (a BF16 pair)."""
            return values[v + 8 * span + pair]
    else:
        @inlined_device_function
        def b_register(values, v, span, pair):
            """The same from float32 words: each rounded to BF16 (nearest even, ``layers.bf16_round``)."""
            low = f32_to_bf16_bits_rne(u32_as_f32(values[v + 16 * span + 2 * pair]))
            high = f32_to_bf16_bits_rne(u32_as_f32(values[v + 16 * span + 2 * pair + 1]))
            return uint32(low) | (uint32(high) << uint32(16))

    store = STORE[output]  # float32, or BF16 bits rounded as ``layers.bf16_round``

    @inlined_device_function
    def multiply_chunk(codes, values, slot, c_part):
        """``c_part = 0``, then the 8 mma steps of the chunk in ring slot ``slot`` (one mma per batch tile and
        column tile, the batch tiles on the same A registers, the column tiles on the same B registers): span
        ``s``, step ``j`` take word ``j`` of the span's codes."""
        for i in range(all_accumulators):
            c_part[i] = float32(0)
        for span in range(SPANS_PER_CHUNK):
            for j in range(4):
                for column in range(column_tiles):
                    base = code_words * (column_tiles * slot + column) + 2 * row_words * span  # the span's words
                    a0, a1, a2, a3 = a_registers(codes, base, j)
                    for tile in range(batch_tiles):
                        v = slot_words * slot + activation_words * tile  # the tile's words, from span 0
                        c = accumulators * column + 4 * tile
                        d = mma_bf16(a0, a1, a2, a3, b_register(values, v, span, 2 * j),
                                     b_register(values, v, span, 2 * j + 1), c_part[c], c_part[c + 1], c_part[c + 2],
                                     c_part[c + 3])
                        c_part[c], c_part[c + 1], c_part[c + 2], c_part[c + 3] = d[0], d[1], d[2], d[3]

    @inlined_device_function
    def lane_rows(tile, g, width):
        """The lane's two weight rows in column tile ``tile`` (``width``: the output's columns)."""
        row0 = tile * uint32(rows_per_tile) + g
        # SwiGLU: the up row of the same output; else the lane's second row of the tile
        return row0, (width + row0 if swiglu else row0 + uint32(8))

    @inlined_device_function
    def of_column(column, pairs):
        """Column tile ``column``'s pair of ``pairs`` (the first tile's two values, then the second's)."""
        return (pairs[0], pairs[1]) if column == 0 else (pairs[2], pairs[3])

    @inlined_device_function
    def load_weights(q_words, scale_inv, rows, scale_rows, k_words, block_k, chunk, t, codes, scales, slot):
        """Ring slot ``slot`` <- every column tile's codes and scales of ``chunk`` (sub-slot ``column_tiles slot +
        column``)."""
        for column in range(column_tiles):
            sub_slot = column_tiles * slot + column
            row0, row1 = of_column(column, rows)
            scale_row0, scale_row1 = of_column(column, scale_rows)
            load_codes(q_words, row0, row1, k_words, chunk, t, codes, sub_slot)
            load_scales(scale_inv, scale_row0, scale_row1, chunk, block_k, scales, sub_slot)

    @inlined_device_function
    def prefetch_weights(slot, args):
        """Ring slot ``slot`` <- chunk ``first + slot``'s codes and scales (if the slice has it)."""
        q_words, scale_inv, rows, scale_rows, k_words, block_k, first, last, t, codes, scales = args
        chunk = first + uint32(slot)
        if chunk < last:
            load_weights(q_words, scale_inv, rows, scale_rows, k_words, block_k, chunk, t, codes, scales, slot)

    @inlined_device_function
    def prefetch_activations(slot, args):
        a_words, g, m, k, first, last, t, values = args
        chunk = first + uint32(slot)
        if chunk < last:
            load_activations(a_words, g, m, k, chunk, t, values, slot)

    @inlined_device_function
    def ring_step(slot, args):
        """Chunk ``round_start + slot`` from ring slot ``slot``: its 8 mma and promotion, then the slot refilled
        with the chunk ``depth`` ahead."""
        (q_words, a_words, scale_inv, rows, scale_rows, k_words, k, block_k, g, m, t,
         round_start, last, codes, values, scales, c_part, c_fin) = args
        chunk = round_start + uint32(slot)
        if chunk < last:
            multiply_chunk(codes, values, slot, c_part)
            for column in range(column_tiles):
                sub_slot = column_tiles * slot + column
                s0, s1 = scales[2 * sub_slot], scales[2 * sub_slot + 1]
                for c in range(accumulators * column, accumulators * (column + 1), 4):
                    # C registers c, c + 1: weight row g; c + 2, c + 3: row g + 8
                    c_fin[c] = cuda.fma(s0, c_part[c] * unplace, c_fin[c])  # * 2^120: exact (BF16 weights: 1, 1)
                    c_fin[c + 1] = cuda.fma(s0, c_part[c + 1] * unplace, c_fin[c + 1])
                    c_fin[c + 2] = cuda.fma(s1, c_part[c + 2] * unplace, c_fin[c + 2])
                    c_fin[c + 3] = cuda.fma(s1, c_part[c + 3] * unplace, c_fin[c + 3])
            ahead = uint32(chunk + uint32(depth))
            if ahead < last:
                load_weights(q_words, scale_inv, rows, scale_rows, k_words, block_k, ahead, t, codes, scales, slot)
                load_activations(a_words, g, m, k, ahead, t, values, slot)

    prefetch_all_weights = unrolled(prefetch_weights, depth)
    prefetch_all_activations = unrolled(prefetch_activations, depth)
    ring_round = unrolled(ring_step, depth)

    def kernel(a_words, q_words, scale_inv, out, m, k, block_n, block_k):
        thread = uint32(cuda.threadIdx.x)
        warp, lane = thread // uint32(WARP_SIZE), thread % uint32(WARP_SIZE)
        g, t = lane >> uint32(2), lane & uint32(3)
        first_tile = uint32(cuda.blockIdx.x) * uint32(column_tiles)
        width = uint32(out.shape[1])
        # the lane's rows and their scale rows, once: (tile 0's two, tile 1's two); one tile repeats its own
        row0, row1 = lane_rows(first_tile, g, width)
        row2, row3 = lane_rows(first_tile + uint32(column_tiles - 1), g, width)
        rows = (row0, row1, row2, row3)
        scale_rows = (row0 // block_n, row1 // block_n, row2 // block_n, row3 // block_n)
        k_words = k // uint32(weight_k_per_word)
        num_chunks = k // uint32(K_CHUNK)
        per_slice = (num_chunks + uint32(k_slices - 1)) // uint32(k_slices)
        first = uint32(min(warp * per_slice, num_chunks))
        last = uint32(min(first + per_slice, num_chunks))

        # A ring of `depth` chunks in registers: chunk c lives in slot (c - first) % depth. A round of the loop
        # is `depth` steps written out (``unrolled``), so that every slot index is a constant (registers, not
        # local memory) and no register is copied: a slot is refilled with chunk c + depth right after chunk
        # c's mma used it.
        codes = cuda.local.array(code_ring, uint32)
        values = cuda.local.array(activation_ring, uint32)
        scales = cuda.local.array(scale_ring, float32)
        c_part = cuda.local.array(all_accumulators, float32)
        c_fin = cuda.local.array(all_accumulators, float32)
        for i in range(all_accumulators):
            c_fin[i] = float32(0)

        # weights and scales: before the wait (PDL; nothing in the stream writes them)
        prefetch_all_weights((q_words, scale_inv, rows, scale_rows, k_words, block_k, first, last, t, codes, scales))
        pdl.prologue()
        prefetch_all_activations((a_words, g, m, k, first, last, t, values))
        round_start = uint32(first)
        while round_start < last:  # uint32 throughout: a signed/unsigned comparison would be done in float64
            ring_round((q_words, a_words, scale_inv, rows, scale_rows, k_words, k, block_k, g, m, t, round_start, last,
                        codes, values, scales, c_part, c_fin))
            round_start = uint32(round_start + uint32(depth))

        if k_slices > 1:  # the warps' results, added in warp order by warp 0
            partial = cuda.shared.array((k_slices, WARP_SIZE, all_accumulators), float32)
            for i in range(all_accumulators):
                partial[warp, lane, i] = c_fin[i]
            cuda.syncthreads()
            if warp == uint32(0):
                for w in range(1, k_slices):
                    for i in range(all_accumulators):
                        c_fin[i] = c_fin[i] + partial[w, lane, i]
        if warp == uint32(0):
            for column in range(column_tiles):
                row0, row1 = of_column(column, rows)
                for tile in range(batch_tiles):  # the accumulator columns are the batch rows 8 tile + 2 t, + 1
                    c = accumulators * column + 4 * tile
                    batch0 = uint32(BATCH_TILE * tile) + uint32(2) * t
                    batch1 = batch0 + uint32(1)
                    if swiglu:
                        if batch0 < m:
                            store(out, batch0, row0, silu_times(c_fin[c], c_fin[c + 2]))
                        if batch1 < m:
                            store(out, batch1, row0, silu_times(c_fin[c + 1], c_fin[c + 3]))
                    else:
                        if batch0 < m:
                            store(out, batch0, row0, c_fin[c])
                            store(out, batch0, row1, c_fin[c + 2])
                        if batch1 < m:
                            store(out, batch1, row0, c_fin[c + 1])
                            store(out, batch1, row1, c_fin[c + 3])

    return cuda.jit(kernel)


# ---------------------------------------------------------------------------- the host side


def kernel_signature(output: str = "f32") -> str:
    """The Numba signature the host wrapper launches with (for ``cuda.compile_ptx``): activations of either format
    travel as uint32 words; ``out`` is float32 or, for ``output='bf16'``, uint16."""
    out = "uint16[:, ::1]" if output == "bf16" else "float32[:, ::1]"
    return f"void(uint32[::1], uint32[::1], float32[:, ::1], {out}, uint32, uint32, uint32, uint32)"


def _check(a, q, scale_inv, out, block, swiglu: bool) -> arguments.GemmProblem:
    kernel = "gemv_mma_swiglu" if swiglu else "gemv_mma"
    q = arguments.as_kernel_array("q", q)
    arguments.require("q", q, "uint8 E4M3 codes [N, K]", q.ndim == 2 and q.dtype == np.uint8)
    n = q.shape[0]
    tile = 16
    if n == 0 or n % tile:
        raise ValueError(f"q: {kernel} needs N to be a positive multiple of {tile}"
                         f"{' (I a multiple of 8)' if swiglu else ''}, got N = {n}")
    problem = arguments.check_gemm(a, q, scale_inv, out, block, kernel=kernel, activations=("bf16", "f32"),
                                   block_n_multiple=8, out_columns=n // 2 if swiglu else None)
    check_row_count(kernel, problem.m, problem.activation)
    if problem.output not in ("f32", "bf16"):
        raise ValueError(f"out: {kernel} writes float32 or uint16 (BF16 bits), got dtype {np.dtype(problem.out.dtype)}")
    for name in ("a", "q"):
        arguments.require_load_alignment(name, getattr(problem, name), kernel)
    return problem


def check_row_count(kernel: str, m: int, activation: str) -> None:
    """``ValueError`` unless ``1 <= m <= MAX_ROWS`` (BF16 activations) or ``F32_MAX_ROWS`` (float32)."""
    limit = MAX_ROWS if activation == "bf16" else F32_MAX_ROWS
    if not 1 <= m <= limit:
        raise ValueError(f"a: {kernel} takes 1 to {limit} rows of {activation} activations (n8 tiles of the mma), "
                         f"got M = {m}")


def _knob(name: str, value, choices: tuple, default):
    """A launch knob: ``value``, or ``default()`` when it is None; ``ValueError`` naming it when not in ``choices``."""
    value = default() if value is None else value
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


def _launch(problem: arguments.GemmProblem, k_slices, depth, column_tiles, stream, swiglu: bool) -> None:
    n_tiles = problem.n // ROWS_PER_WARP
    k_slices = _knob("k_slices", k_slices, K_SLICES_CHOICES, lambda: default_k_slices(n_tiles, problem.k // K_CHUNK))
    batch_tiles = batch_tiles_for(problem.m)
    column_tiles = _knob("column_tiles", column_tiles, COLUMN_TILES_CHOICES, lambda: default_column_tiles(
        problem.activation, k_slices, batch_tiles, swiglu, n_tiles, device_num_sms()))
    if n_tiles % column_tiles:
        raise ValueError(f"column_tiles: {column_tiles} tiles per CTA need N to be a multiple of "
                         f"{ROWS_PER_WARP * column_tiles}, got N = {problem.n}")
    grid = n_tiles // column_tiles
    depth = _knob("depth", depth, DEPTH_CHOICES, lambda: default_depth(problem.activation, k_slices, batch_tiles,
                                                                        swiglu, grid, device_num_sms(), column_tiles))
    kernel = gemv_mma_kernel(k_slices, problem.activation, swiglu, depth, batch_tiles, problem.output,
                             column_tiles=column_tiles)
    bn, bk = problem.block
    pdl.launch(kernel, (grid,), (WARP_SIZE * k_slices,), stream,
               problem.a.view(np.uint32).reshape(-1), problem.q.view(np.uint32).reshape(-1), problem.scale_inv,
               problem.out, np.uint32(problem.m), np.uint32(problem.k), np.uint32(bn), np.uint32(bk))


def gemv_mma(a, q, scale_inv, out, block=(128, 128), k_slices=None, depth=None, column_tiles=None, stream=0):
    """``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T`` on tensor cores for ``1 <= M <= 32``; returns ``out``.

    ``a``: BF16 bits (uint16/int16) or float32 (rounded to BF16 on load, at most 16 rows) ``[M, K]``; ``q``: uint8
    ``[N, K]``,
    ``N`` a multiple of 16; ``scale_inv``: float32 ``[ceil(N/BN), ceil(K/BK)]``; ``out``: float32 ``[M, N]``, or
    uint16 (the float32 result rounded to BF16 bits as ``layers.bf16_round``: the next GEMM's input format);
    all C-contiguous NumPy or device arrays (device data 16-byte aligned). ``block = (BN, BK)``: BN a multiple
    of 8, BK of 128; K a multiple of 128. ``k_slices`` (1, 2, 4, 8; None: ``default_k_slices``): warps per CTA,
    each a slice of K (it changes the order of the slices' sum: ``fp8lab.simulators.gemv_mma``); ``depth`` (1 to 4;
    None: ``default_depth``): chunks in flight per warp, which changes no bit. ``stream``: a
    Numba stream or a ``cuda.core`` GraphBuilder. Bad calls raise ``ValueError`` before any launch.
    """
    problem = _check(a, q, scale_inv, out, block, swiglu=False)
    _launch(problem, k_slices, depth, column_tiles, stream, swiglu=False)
    return out


def gemv_mma_swiglu(a, q, scale_inv, out, block=(128, 128), k_slices=None, depth=None, column_tiles=None, stream=0):
    """``out[M, I] = silu(a @ gate^T) * (a @ up^T)`` from the fused gate/up weight ``q[2 I, K]`` (gate rows, then
    up rows), on tensor cores for ``1 <= M <= 32`` (float32: 16): bit for bit ``gemv_mma`` into ``[M, 2 I]`` then
    ``layers.silu_mul`` (with a uint16 ``out``: then ``layers.bf16_round``), in one launch. ``I`` a multiple of 8;
    the rest as ``gemv_mma``."""
    problem = _check(a, q, scale_inv, out, block, swiglu=True)
    _launch(problem, k_slices, depth, column_tiles, stream, swiglu=True)
    return out


# ---------------------------------------------------------------------------- BF16 weights (the lm_head)


@functools.cache
def _no_scales():
    """The ``scale_inv`` a BF16-weight launch passes and never reads (one allocation, so graphs can capture it)."""
    array = np.ones((1, 1), np.float32)
    return array if SIMULATOR else cuda.to_device(array)


def gemv_mma_bf16(a, w_bits, out, k_slices=None, depth=None, stream=0):
    """``out[M, N] = a[M, K] @ W^T`` for BF16 weights ``W`` (the lm_head), on tensor cores for ``1 <= M <= 32``
    (float32 activations: 16); returns ``out``.

    The kernel of ``gemv_mma`` with the weights' BF16 patterns as the A registers (no bit placement, no block
    scales): the order of ``fp8lab.simulators.gemv_mma.gemv_mma_bf16`` (per 128-wide chunk ``c_part = 0``, 8 mma
    steps over K permuted by ``k_order``, ``c_fin += c_part``; the K slices added in warp order).
    ``a``: BF16 bits (uint16/int16) or float32 (rounded to BF16 on load) ``[M, K]``; ``w_bits``: BF16 patterns
    ``[N, K]`` (uint16/int16), ``N`` a multiple of 16, ``K`` of 128; ``out``: float32 or uint16 (BF16 bits)
    ``[M, N]``, sharing no memory with ``a``; C-contiguous, device data 16-byte aligned. ``k_slices``, ``depth``:
    as ``gemv_mma``'s. Bad calls raise ``ValueError`` before any launch.
    """
    kernel_name = "gemv_mma_bf16"
    a, w_bits, out = (arguments.as_kernel_array(n, x) for n, x in (("a", a), ("w_bits", w_bits), ("out", out)))
    arguments.require("w_bits", w_bits, "BF16 patterns [N, K] (uint16 or int16)",
                      w_bits.ndim == 2 and np.dtype(w_bits.dtype) in (np.dtype(np.uint16), np.dtype(np.int16)))
    arguments.require_c_contiguous("w_bits", w_bits)
    n, k = w_bits.shape
    if n == 0 or n % ROWS_PER_WARP or k == 0 or k % K_CHUNK:
        raise ValueError(f"w_bits: {kernel_name} needs N a positive multiple of {ROWS_PER_WARP} and K of {K_CHUNK}, "
                         f"got [{n}, {k}]")
    activation = arguments.ACTIVATION_FORMATS.get(np.dtype(a.dtype))
    arguments.require("a", a, f"activations [M, {k}] of bf16 (uint16) / f32 (float32)",
                      a.ndim == 2 and a.shape[1] == k and activation in ("bf16", "f32"))
    arguments.require_c_contiguous("a", a)
    m = a.shape[0]
    check_row_count(kernel_name, m, activation)
    output = arguments.OUTPUT_FORMATS.get(np.dtype(out.dtype))
    arguments.require("out", out, f"[{m}, {n}] of float32 or uint16 (BF16 bits)",
                      tuple(out.shape) == (m, n) and output in ("f32", "bf16"))
    arguments.require_c_contiguous("out", out)
    arguments.require("out", out, "memory apart from a's", not arguments.overlaps(a, out))
    for name, x in (("a", a), ("w_bits", w_bits)):
        arguments.require_load_alignment(name, x, kernel_name)
    n_tiles = n // ROWS_PER_WARP
    k_slices = _knob("k_slices", k_slices, K_SLICES_CHOICES, lambda: default_k_slices(n_tiles, k // K_CHUNK))
    # depth 2: twice the weight words of a code chunk, the ring of a depth-3 FP8 one (at the copy bandwidth already);
    # 1 for three or four batch tiles (148 registers at four; 246 at depth 2)
    depth = _knob("depth", depth, DEPTH_CHOICES, lambda: 2 if batch_tiles_for(m) <= 2 else 1)
    kernel = gemv_mma_kernel(k_slices, activation, False, depth, batch_tiles_for(m), output, "bf16")
    pdl.launch(kernel, (n_tiles,), (WARP_SIZE * k_slices,), stream,
               a.view(np.uint32).reshape(-1), w_bits.view(np.uint32).reshape(-1), _no_scales(), out,
               np.uint32(m), np.uint32(k), np.uint32(ROWS_PER_WARP), np.uint32(K_CHUNK))
    return out
