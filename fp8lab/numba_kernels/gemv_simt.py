"""SIMT decode GEMV for FP8 weights: ``out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]``
for ``1 <= M <= 16`` rows (the decode step of an LLM: a handful of tokens against a big weight).

Computes ``fp8lab.reference.blockwise.gemm``. Launch: a warp per ``columns_per_warp`` output columns,
``warps_per_cta`` warps per CTA, grid ``(ceil(N / (warps_per_cta * columns_per_warp)), ceil(M / m_tile))``.
Checked (``tests/numba_kernels/test_gemv_kernel.py``): bit for bit against ``fp8lab.simulators.gemv_simt``
(CUDA simulator and GPU), against the oracle by relative error.

The SwiGLU variant ``gemv_simt_swiglu`` (``gemv_simt_kernel(..., swiglu=True)``): ``act[m, j] = silu(g) * u``
with ``g``, ``u`` columns ``j`` and ``I + j`` of the product with the fused gate/up weight ``q[2 I, K]``
(``fp8lab.reference.dense.silu_mul`` of ``blockwise.gemm``), float32 ``act[M, I]``. A warp computes
``columns_per_warp`` (2 or 4) columns as above, but they are the gate and up rows of
``columns_per_warp / 2`` neighbouring outputs (``{j, I + j}`` or ``{j, j + 1, I + j, I + j + 1}``)
instead of neighbouring columns; lane 0 applies ``layers.silu_mul``'s expression with the same
``exp_f32``, so it is bit for bit ``gemv_simt`` then ``layers.silu_mul``, one launch and no
``[M, 2 I]`` round trip. Launch: grid ``(ceil(I / (warps_per_cta * columns_per_warp / 2)), ceil(M / m_tile))``.
Checked against ``fp8lab.simulators.gemv_simt.gemv_simt_swiglu`` and the two launches it replaces
bit for bit (CUDA simulator; the GPU against the two launches) and against the oracle by a float32 bound.

What it computes: the W8A16 product of ``fp8lab.reference.blockwise.gemm`` in float32, in exactly the
order of ``fp8lab.simulators.gemv_simt`` (the schedule, below). Activations are BF16 bits (uint16/int16),
float16 or float32, widened exactly to float32 on load; the output is float32, float16 or BF16
bits (uint16/int16), rounded once from the float32 sum.

The schedule (``fp8lab.simulators.gemv_simt`` is its bit-exact NumPy model; read the two side by side):

- **A warp per output column** ``n`` (weight row ``n``). Lane ``L`` owns the 16-byte chunks
  ``c = L, L + 32, L + 64, ...`` of the row, i.e. ``k in [16 c, 16 c + 16)``; one warp *step*
  covers 512 contiguous bytes. Lanes past the row end sit the last step out.
- **Wide loads**: a lane's 16 codes are one 128-bit load (``ld.global.nc.v4.u32`` through a
  ``uint32`` view of ``q``); the activations too (two 128-bit loads per row for 16-bit formats,
  four for float32).
- **Bit placement** (``dequantize.placed_codes``): code ``c`` becomes the F16 pattern
  ``(c & 0x80) << 8 | (c & 0x7F) << 7``, widened to float32 ``decode(c) * 2^-8`` (exact).
- **Per row of the tile**: ``part = fma(a_i, w_i, part)`` for the chunk's 16 elements in ``k``
  order, from ``part = 0``; then the promotion ``acc = fma(s, part, acc)`` with
  ``s = scale_inv[n // BN, 16 c // BK] * 2^8`` (the placement's ``2^-8`` folded in, exact), the
  lane's chunks in their order ``c = L, L + 32, ...``.
- **Butterfly**: ``acc += shfl_xor(acc, off)`` for ``off = 16, 8, 4, 2, 1``; lane 0 stores.

How the lanes get there fast (none of it changes which products are summed in which order, so
none of it changes a bit; each is a compile-time constant of the kernel and a keyword of
``gemv_simt``):

- **Groups of chunks** (``chunks_per_iteration`` G = 1, 2 or 4): a lane issues the 128-bit loads of
  G of its chunks (``c``, ``c + 32``, ...: G warp steps) at once, and the loads of the *next* group
  before computing this one (two register buffers used in turn, so up to 2 G chunks per lane are
  in flight). More bytes in flight per warp is what a memory-bound kernel needs; the loop
  overhead is paid once per group.
- **Columns per warp** (``columns_per_warp`` NC = 1, 2 or 4): a warp computes NC neighbouring
  columns, each exactly as a warp of its own would (same lanes, chunks, chains, butterfly). The
  activations of a chunk are loaded and widened once and used NC times, which divides the
  per-row load and conversion work, and the L1 traffic of the activations, by NC.
- **Row tiles** (``m_tile`` 1 to 16; default: all ``M`` rows): the rows of a tile share each weight
  load and decode; each row has its own accumulators. Rows of the last tile past ``M`` compute on
  a copy of row ``M - 1`` and are not stored: no per-row branch in the loop (a branch per row
  would make each row's activation loads wait for the previous row's arithmetic).
- **32-bit index arithmetic** on flat views of ``a``, ``q`` and ``scale_inv`` (the host checks that
  the arrays fit): no 64-bit compares or divisions in the loop.

Launch shape (``gemv_simt_launch_info``): CTAs of ``warps_per_cta`` warps (default 4), each warp
``columns_per_warp`` columns; grid ``(ceil(N / (warps_per_cta * columns_per_warp)), ceil(M / m_tile))``.
The warps of a CTA share nothing but the activations (which L1 caches), so a small CTA costs
nothing and keeps the grid fine-grained, which shortens the last, partial wave. The defaults
(``default_knobs``) come from an H200 sweep (``bench/gemm_tuning.py``, ``bench/RESULTS.md``);
``tuning_candidates`` lists the knob sets worth timing per M.

Where the instructions of the loop go (per column and 16-byte chunk): decoding the 16 codes (integer
operations and ``HADD2.F32``; byte spreading with ``prmt`` needs as many), one ``FFMA`` per element and
row, widening a row's BF16 activations (``/ NC``), and a few load, address and loop instructions; the
SASS counts are in ``bench/RESULTS.md``. Considered and left out: activations widened once per CTA into shared
memory as float32 (saves the widening too, but doubles the bytes read per activation, needs a
barrier, and fits 48 KB only for M <= 2; columns per warp save as much for every M), and the
hardware ``cvt.rn.f16x2.e4m3x2`` decode (two codes per instruction, but NaN codes would become NaN
instead of the finite values the simulator defines).

Checked against ``fp8lab.simulators.gemv_simt`` bit for bit (CUDA simulator and GPU) and against
``fp8lab.reference.blockwise.gemm`` by relative error (``tests/numba_kernels/test_gemv_kernel.py``).

Split-K (``gemv_simt_split_k``): the grid's third dimension is ``S`` K slices of whole ``BK`` blocks; CTA
layer ``z`` runs the schedule above on slice ``z`` as if it were the whole row and writes part ``z`` of
float32 ``parts[S, M, N]``; the product is the parts' sum in slice order (``fp8lab.simulators.dense.sum_parts``,
added by ``layers.add_parts_rms_norm``). Checked bit for bit against ``fp8lab.simulators.gemv_simt.gemv_simt_split_k``.

Requirements (``ValueError`` before anything is launched): those of ``arguments.check_gemm``
(``K`` and ``BK`` multiples of 128, shapes and dtypes) plus ``1 <= M <= 16``, the knobs in range
and within the register budget (``chunks_per_iteration * columns_per_warp <= 8``,
``columns_per_warp * m_tile <= 32``: more would spill), device arrays whose data start on a
16-byte boundary (for the 128-bit loads) and fewer than 2^32 words of codes (32-bit indices).
SwiGLU also: ``q``'s ``N`` even, ``out`` float32 ``[M, N / 2]``, ``columns_per_warp`` 2 or 4.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from . import arguments, pdl
from .bits import bf16_bits_to_f32, f16_bits_to_f32, u32_as_f32
from .dequantize import F16_PLACEMENT_SCALE, STORE, output_bits_view, placed_codes
from .layers import silu_times
from .warp import (
    WARP_SIZE,
    WORDS_PER_LOAD,
    load_u32x4,
    warp_sum,
)

WARPS_PER_CTA = 4
"""Warps per CTA when nothing else is known; see the module docstring for why small CTAs."""
MAX_WARPS_PER_CTA = 32
BYTES_PER_LANE = 16
"""One 128-bit load per lane per chunk: 16 FP8 codes, 4 uint32 words."""
K_PER_STEP = WARP_SIZE * BYTES_PER_LANE
MAX_ROWS = 16
M_TILES = tuple(range(1, MAX_ROWS + 1))
"""Row tiles the kernel accepts (the result never depends on it)."""
CHUNKS_PER_ITERATION = (1, 2, 4)
COLUMNS_PER_WARP = (1, 2, 4)
MAX_GROUP_SLOTS = 8
"""``chunks_per_iteration * columns_per_warp`` at most: two buffers of that many 16-byte chunks per lane
(more spills registers)."""
MAX_ACCUMULATORS = 32
"""``columns_per_warp * m_tile`` at most: one float32 accumulator each per lane (more spills)."""
MAX_WORDS = 2**32
"""Arrays are indexed with 32-bit words: fewer than this many uint32 words (16 GiB of codes)."""
WORDS_PER_CHUNK = {"bf16": 8, "f16": 8, "f32": 16}
"""uint32 words of one row's 16 activations, by activation format."""


# ---------------------------------------------------------------------------- one chunk of 16 elements


@cuda.jit(device=True, inline=True)
def place_chunk(codes, first_word, weights, first):
    """The 4 words (16 codes) ``codes[first_word : +4]`` of one chunk -> ``weights[first : first + 16]``,
    float32 ``decode(c) * 2^-8`` in k order."""
    for word in range(WORDS_PER_LOAD):
        v0, v1, v2, v3 = placed_codes(codes[first_word + word])
        weights[first + 4 * word] = v0
        weights[first + 4 * word + 1] = v1
        weights[first + 4 * word + 2] = v2
        weights[first + 4 * word + 3] = v3


# The activation loaders: the 16 values of one row's chunk, starting at word ``index`` of the flat
# uint32 view of ``a`` (``index`` = row start + WORDS_PER_CHUNK * chunk), widened to float32.


@cuda.jit(device=True, inline=True)
def load_bf16_chunk(a_words, index, values):
    """16 BF16 activations (2 per uint32, low half first) -> float32, exact."""
    for half in range(2):
        words = load_u32x4(a_words, index + WORDS_PER_LOAD * half)
        for j in range(WORDS_PER_LOAD):
            values[8 * half + 2 * j] = bf16_bits_to_f32(words[j])
            values[8 * half + 2 * j + 1] = bf16_bits_to_f32(words[j] >> uint32(16))


@cuda.jit(device=True, inline=True)
def load_f16_chunk(a_words, index, values):
    """16 float16 activations (2 per uint32, low half first) -> float32, exact."""
    for half in range(2):
        words = load_u32x4(a_words, index + WORDS_PER_LOAD * half)
        for j in range(WORDS_PER_LOAD):
            values[8 * half + 2 * j] = f16_bits_to_f32(words[j])
            values[8 * half + 2 * j + 1] = f16_bits_to_f32(words[j] >> uint32(16))


@cuda.jit(device=True, inline=True)
def load_f32_chunk(a_words, index, values):
    """16 float32 activations (read as their bits)."""
    for quarter in range(4):
        words = load_u32x4(a_words, index + WORDS_PER_LOAD * quarter)
        for j in range(WORDS_PER_LOAD):
            values[4 * quarter + j] = u32_as_f32(words[j])


LOAD_ACTIVATIONS = {"bf16": load_bf16_chunk, "f16": load_f16_chunk, "f32": load_f32_chunk}


@cuda.jit(device=True, inline=True)
def chunk_partial(activations, weights, first):
    """The lane's 16-product partial: ``part = fma(a_i, w_i, part)`` for i = 0..15, from 0 (k order),
    with ``w_i = weights[first + i]``."""
    part = float32(0.0)
    for i in range(BYTES_PER_LANE):
        part = cuda.fma(activations[i], weights[first + i], part)
    return part


# ---------------------------------------------------------------------------- the kernel


def unrolled(body, count: int):
    """A device function ``run(args)`` that calls ``body(i, args)`` for ``i = 0, 1, ..., count - 1``
    as straight-line code, each ``i`` a compile-time constant (``args``: a tuple).

    LLVM does not unroll a loop whose body is large (a group of chunks with several rows and
    columns), and a register array indexed by a run-time ``i`` would be demoted to local memory.
    """

    @cuda.jit(device=True, inline=True)
    def nothing(args):
        pass

    run = nothing
    for i in reversed(range(count)):
        run = _call_then(body, i, run)
    return run


def _call_then(body, i: int, rest):
    @cuda.jit(device=True, inline=True)
    def run(args):
        body(i, args)
        rest(args)

    return run



# ---------------------------------------------------------------------------- the two epilogues


def plain_columns(columns: int, m_tile: int, store):
    """The plain GEMV's column mapping and epilogue: a warp's ``columns`` weight rows are the
    neighbouring output columns ``first .. first + columns - 1`` of ``out[M, N]``."""

    @cuda.jit(device=True, inline=True)
    def weight_row(first, j, width):
        """Weight row of the warp's column ``j``; past ``N``: row ``N - 1`` (computed, never stored)."""
        return uint32(min(first + uint32(j), width - uint32(1)))

    @cuda.jit(device=True, inline=True)
    def write(out, acc, row0, part_row0, first, m, width):
        """Lane 0 stores every column of every row of the tile that lies inside ``out`` (row ``r`` of the
        tile at ``out`` row ``part_row0 + row0 + r``: ``part_row0`` is where the K slice's part starts)."""
        for j in range(columns):
            if first + uint32(j) < width:
                for r in range(m_tile):
                    if row0 + uint32(r) < m:
                        store(out, part_row0 + row0 + uint32(r), first + uint32(j), acc[j * m_tile + r])

    return columns, weight_row, write


def swiglu_columns(columns: int, m_tile: int):
    """The SwiGLU GEMV's column mapping and epilogue, ``P = columns / 2`` outputs per warp: for the
    outputs ``first .. first + P - 1`` of ``act[M, I]`` the warp's columns are the gate rows
    ``first + p`` (slots ``p < P``) and the up rows ``I + first + p`` (slots ``P + p``)."""
    pairs = columns // 2

    @cuda.jit(device=True, inline=True)
    def weight_row(first, j, width):
        """Weight row of the warp's column ``j`` (``width = I``); an output past ``I`` computes output
        ``I - 1``'s rows (never stored)."""
        return uint32(min(first + uint32(j % pairs), width - uint32(1)) + uint32(j // pairs) * width)

    @cuda.jit(device=True, inline=True)
    def write(out, acc, row0, part_row0, first, m, width):
        """Lane 0 stores ``act = silu(gate) * up`` with ``layers.silu_mul``'s device function (one K
        slice only: ``part_row0`` is 0)."""
        for p in range(pairs):
            if first + uint32(p) < width:
                for r in range(m_tile):
                    if row0 + uint32(r) < m:
                        gate = acc[p * m_tile + r]
                        up = acc[(pairs + p) * m_tile + r]
                        out[row0 + uint32(r), first + uint32(p)] = silu_times(gate, up)

    return pairs, weight_row, write


@functools.lru_cache(maxsize=None)
def gemv_simt_kernel(m_tile: int, activation: str, output: str, block_n: int, block_k: int,
                     warps_per_cta: int = WARPS_PER_CTA, chunks_per_iteration: int = 1, columns_per_warp: int = 1,
                     swiglu: bool = False):
    """The compiled GEMV kernel for one row tile, activation format, output format, block size,
    CTA size, group size and columns per warp; ``swiglu``: the SwiGLU variant (``output`` "f32",
    ``columns_per_warp`` 2 or 4), which differs from the plain kernel only in which weight rows a
    warp's columns are and in the epilogue (``plain_columns``, ``swiglu_columns``).

    All are compile-time constants: the row, column, chunk and element loops unroll, the
    accumulators and the loaded codes live in registers, and the block divisions become shifts.

    Arguments of the kernel: flat uint32 views of ``a`` and ``q``, the flat ``scale_inv``, the 2-D
    ``out`` (its bits view for BF16; for split-K the parts as ``[S * M, N]``), ``M, N, K`` (``N``: rows
    of ``q``, ``2 I`` for SwiGLU) and the K slice's width ``K / S`` (``K`` unless split-K; the grid's
    third dimension is ``S``).
    """
    if swiglu and (output != "f32" or columns_per_warp % 2):
        raise ValueError(f"swiglu: needs a float32 output and an even columns_per_warp, got {output}, "
                         f"{columns_per_warp}")
    load_activations = LOAD_ACTIVATIONS[activation]
    words_per_chunk = uint32(WORDS_PER_CHUNK[activation])
    group = chunks_per_iteration  # a lane's chunks per group: G consecutive warp steps
    columns = columns_per_warp
    mapping = swiglu_columns(columns, m_tile) if swiglu else plain_columns(columns, m_tile, STORE[output])
    outputs_per_warp, weight_row, write = mapping
    rows_per_output = columns // outputs_per_warp  # weight rows per output column: 1, or 2 (gate, up)
    # Numba wants plain constants for the sizes of local arrays.
    accumulators = columns * m_tile  # acc[j * m_tile + r]: column j, row r
    weight_count = columns * BYTES_PER_LANE  # the decoded chunk of every column
    slots = group * columns  # (chunk i, column j) pairs of a group: slot i * columns + j
    code_words = slots * WORDS_PER_LOAD
    chunks_per_scale = uint32(block_k // BYTES_PER_LANE)  # 16-byte chunks per K block
    u_block_n, u_block_k = uint32(block_n), uint32(block_k)
    u_warp, u_words = uint32(WARP_SIZE), uint32(WORDS_PER_LOAD)

    @cuda.jit(device=True, inline=True)
    def lane_chunk(lane, first_step, i):
        """The lane's chunk in warp step ``first_step + i``."""
        return uint32(lane + u_warp * (first_step + uint32(i)))

    @cuda.jit(device=True, inline=True)
    def load_chunk(i, args):
        """Issue the code load (and block-scale load) of the lane's chunk in warp step
        ``first_step + i``, every column: ``codes[4 s : 4 s + 4]`` and ``scales[s]`` for slot
        ``s = i * columns + j``. A chunk past the row end is skipped."""
        q_words, scales_flat, q_start, scale_start, lane, first_step, chunks, codes, scales = args
        chunk = lane_chunk(lane, first_step, i)
        if chunk < chunks:
            for j in range(columns):
                slot = i * columns + j
                words = load_u32x4(q_words, q_start[j] + u_words * chunk)
                for w in range(WORDS_PER_LOAD):
                    codes[WORDS_PER_LOAD * slot + w] = words[w]
                scales[slot] = scales_flat[scale_start[j] + chunk // chunks_per_scale]

    @cuda.jit(device=True, inline=True)
    def compute_chunk(i, args):
        """The lane's chunk in warp step ``first_step + i``, as ``load_chunk`` fetched it: decode
        every column's 16 codes; then per row load (and widen) the 16 activations once and run
        every column's chain and promotion ``acc[j, r] = fma(s_j, part, acc[j, r])``."""
        a_words, row_start, lane, first_step, chunks, codes, scales, acc, weights, folded, activations = args
        chunk = lane_chunk(lane, first_step, i)
        if chunk < chunks:
            for j in range(columns):
                place_chunk(codes, WORDS_PER_LOAD * (i * columns + j), weights, BYTES_PER_LANE * j)
                folded[j] = scales[i * columns + j] * F16_PLACEMENT_SCALE
            for r in range(m_tile):
                load_activations(a_words, row_start[r] + words_per_chunk * chunk, activations)
                for j in range(columns):
                    part = chunk_partial(activations, weights, BYTES_PER_LANE * j)
                    acc[j * m_tile + r] = cuda.fma(folded[j], part, acc[j * m_tile + r])

    # A group: its G chunks in the lane's chunk order (i = 0 .. G - 1), written out.
    load_group = unrolled(load_chunk, group)
    compute_group = unrolled(compute_chunk, group)

    @cuda.jit
    def kernel(a_words, q_words, scales_flat, out, m, n, k, slice_k):
        lane = uint32(cuda.threadIdx.x) % u_warp
        warp = uint32(cuda.blockIdx.x) * uint32(warps_per_cta) + uint32(cuda.threadIdx.x) // u_warp
        width = uint32(n) // uint32(rows_per_output)  # output columns: N, or I = N / 2 for SwiGLU
        first = warp * uint32(outputs_per_warp)  # the warp's first output column
        if first >= width:
            return  # the whole warp leaves together: no lane is left waiting in a shuffle
        m, k = uint32(m), uint32(k)
        row0 = uint32(cuda.blockIdx.y) * uint32(m_tile)
        # Split-K: CTA layer z computes the plain kernel's sum over K slice z (``slice_k`` wide, whole K
        # blocks; the host divides, so the kernel has no integer division), as if the slice were the
        # whole row; it writes rows z * M .. z * M + M - 1 of ``out`` (the parts [S, M, N]). One slice
        # (slice_k = K): the plain GEMV.
        split, row_chunks = uint32(cuda.blockIdx.z), uint32(k // uint32(BYTES_PER_LANE))
        chunks = uint32(uint32(slice_k) // uint32(BYTES_PER_LANE))  # the slice's chunks: the lane loop's range
        skipped = uint32(split * chunks)  # chunks of the row before the slice
        groups = uint32((chunks + u_warp * uint32(group) - uint32(1)) // (u_warp * uint32(group)))  # every lane's

        # Where each row, column and scale row of the slice starts in the flat arrays. Rows past M read
        # row M - 1 and columns past the output's read its last one's weight rows: computed like the
        # others, never stored.
        row_start = cuda.local.array(m_tile, uint32)
        for r in range(m_tile):
            row_start[r] = uint32(min(row0 + uint32(r), m - uint32(1)) * (row_chunks * words_per_chunk)
                                  + skipped * words_per_chunk)
        q_start = cuda.local.array(columns, uint32)
        scale_start = cuda.local.array(columns, uint32)
        for j in range(columns):
            col = weight_row(first, j, width)
            q_start[j] = uint32(col * (k // u_words) + skipped * u_words)
            scale_start[j] = uint32((col // u_block_n) * ((k + u_block_k - uint32(1)) // u_block_k)
                                    + skipped // chunks_per_scale)

        acc = cuda.local.array(accumulators, float32)
        for x in range(accumulators):
            acc[x] = float32(0.0)
        weights = cuda.local.array(weight_count, float32)
        folded = cuda.local.array(columns, float32)  # each column's promotion scale, 2^8 folded in
        activations = cuda.local.array(BYTES_PER_LANE, float32)
        # Two register buffers of codes and scales, used in turn (the loop body is written twice, so
        # no buffer is ever copied): group g + 1 is loaded before group g is computed.
        codes_a = cuda.local.array(code_words, uint32)
        codes_b = cuda.local.array(code_words, uint32)
        scales_a = cuda.local.array(slots, float32)
        scales_b = cuda.local.array(slots, float32)

        load_group((q_words, scales_flat, q_start, scale_start, lane, uint32(0), chunks, codes_a, scales_a))
        # The first group's weight loads are in flight; the activations (and ``out``, which an earlier
        # kernel may still read) are the previous kernels' business: wait for them to complete.
        pdl.prologue()  # then the next kernel may launch; it waits for this one before it reads our output
        g = uint32(0)
        while g < groups:
            load_group((q_words, scales_flat, q_start, scale_start, lane, uint32(group) * (g + uint32(1)), chunks,
                        codes_b, scales_b))
            compute_group((a_words, row_start, lane, uint32(group) * g, chunks, codes_a, scales_a, acc, weights,
                           folded, activations))
            g = uint32(g + uint32(1))
            if g >= groups:
                break
            load_group((q_words, scales_flat, q_start, scale_start, lane, uint32(group) * (g + uint32(1)), chunks,
                        codes_a, scales_a))
            compute_group((a_words, row_start, lane, uint32(group) * g, chunks, codes_b, scales_b, acc, weights,
                           folded, activations))
            g = uint32(g + uint32(1))

        for x in range(accumulators):
            acc[x] = warp_sum(acc[x])
        if lane == 0:
            write(out, acc, row0, split * m, first, m, width)

    return kernel


# ---------------------------------------------------------------------------- launch shape and entry point


@dataclass(frozen=True)
class GemvLaunch:
    """The launch shape of ``gemv_simt`` for one problem."""

    grid: tuple[int, int, int]  # (column tiles of warps_per_cta * columns_per_warp columns, row tiles, K slices)
    block: tuple[int]  # threads per CTA: 32 * warps_per_cta
    m_tile: int
    warps_per_cta: int
    chunks_per_iteration: int
    columns_per_warp: int
    steps: int  # warp steps of 512 codes per column and K slice: ceil(K / k_splits / 512)
    k_splits: int = 1  # K slices, one layer of CTAs each (gemv_simt_split_k)


def default_knobs(m: int, n: int, k: int) -> dict:
    """The knobs ``gemv_simt`` uses when none are given, for ``a[M, K] @ q[N, K]^T``.

    All ``M`` rows in one tile (every weight byte read once); 4-warp CTAs; four columns per warp up to
    M = 8 (the activations loaded and widened once for all four: with float32 activations, 64 bytes per
    row and chunk, the activation loads are what each extra row costs), two beyond (the accumulators'
    register budget); one chunk per group. Measured on an H200 with float32 activations (the engine's
    decode input; ``bench/RESULTS.md``): four columns per warp beat two on the Qwen3-8B shapes at every
    M from 1 to 8 (2026-12-01), more chunks per group were slower everywhere, and 4-warp CTAs beat 8-warp
    ones on all eight Qwen3-8B and Qwen3-0.6B shapes at M = 1 (by 1 to 7%) and M = 2 (by up to 33%:
    q/k/v 18.9 -> 12.7 us; 2026-12-02, ``bench/gemv_split_k.py``).
    """
    return {"m_tile": int(m), "warps_per_cta": WARPS_PER_CTA, "chunks_per_iteration": 1,
            "columns_per_warp": 4 if m <= 8 else 2}


def tuning_candidates(m: int, swiglu: bool = False) -> list[dict]:
    """The knob sets worth timing for ``M = m`` rows (one tile of all rows): (warps_per_cta,
    chunks_per_iteration, columns_per_warp) chosen from the SASS of each variant, none spilling.

    Registers bound the warps an SM holds (65536 / 32 / registers per thread), and with them the
    bytes in flight; more chunks per group and more columns per warp cost registers but put more
    bytes in flight per warp and cut instructions per chunk (``tests/numba_kernels/test_kernels_compile.py``
    prints registers per variant). ``swiglu``: those ``gemv_simt_swiglu`` takes (an even ``columns_per_warp``).
    """
    if m <= 2:
        shapes = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (2, 4, 1), (4, 1, 2), (4, 2, 2), (2, 2, 2), (4, 1, 4)]
    elif m <= 4:
        shapes = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 1, 2), (2, 1, 2), (4, 2, 2), (2, 1, 4)]
    else:
        shapes = [(4, 1, 1), (2, 1, 1), (4, 1, 2), (2, 1, 2), (4, 2, 2), (2, 1, 4)]
    return [{"m_tile": int(m), "warps_per_cta": w, "chunks_per_iteration": g, "columns_per_warp": c}
            for w, g, c in shapes if c * m <= MAX_ACCUMULATORS and not (swiglu and c % 2)]


def gemv_simt_launch_info(m: int, n: int, k: int, m_tile: int | None = None, warps_per_cta: int | None = None,
                          chunks_per_iteration: int | None = None, columns_per_warp: int | None = None,
                          swiglu: bool = False, k_splits: int = 1) -> GemvLaunch:
    """Grid, CTA shape, row tile and loop shape of ``gemv_simt`` for ``a[M, K] @ q[N, K]^T`` (None:
    the ``default_knobs`` value); ``swiglu``: of ``gemv_simt_swiglu`` (``N = 2 I`` weight rows, a warp
    per ``columns_per_warp / 2`` outputs, so the grid covers ``I`` outputs); ``k_splits``: of
    ``gemv_simt_split_k`` with that many K slices (the grid's third dimension)."""
    m, n, k = int(m), int(n), int(k)
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"a: the SIMT GEMV handles 1 <= M <= {MAX_ROWS} rows, got M = {m}")
    given = {"m_tile": m_tile, "warps_per_cta": warps_per_cta, "chunks_per_iteration": chunks_per_iteration,
             "columns_per_warp": columns_per_warp}
    knobs = {name: (default if given[name] is None else given[name])
             for name, default in default_knobs(m, n, k).items()}
    if knobs["m_tile"] not in M_TILES:
        raise ValueError(f"m_tile: expected 1 to {MAX_ROWS} or None, got {m_tile!r}")
    if knobs["warps_per_cta"] not in range(1, MAX_WARPS_PER_CTA + 1):
        raise ValueError(f"warps_per_cta: expected 1 to {MAX_WARPS_PER_CTA} or None, got {warps_per_cta!r}")
    if knobs["chunks_per_iteration"] not in CHUNKS_PER_ITERATION:
        raise ValueError(f"chunks_per_iteration: expected one of {CHUNKS_PER_ITERATION} or None, "
                         f"got {chunks_per_iteration!r}")
    if knobs["columns_per_warp"] not in COLUMNS_PER_WARP:
        raise ValueError(f"columns_per_warp: expected one of {COLUMNS_PER_WARP} or None, got {columns_per_warp!r}")
    if knobs["chunks_per_iteration"] * knobs["columns_per_warp"] > MAX_GROUP_SLOTS:
        raise ValueError(f"chunks_per_iteration x columns_per_warp: at most {MAX_GROUP_SLOTS} (registers), got "
                         f"{knobs['chunks_per_iteration']} x {knobs['columns_per_warp']}")
    if knobs["columns_per_warp"] * knobs["m_tile"] > MAX_ACCUMULATORS:
        raise ValueError(f"columns_per_warp x m_tile: at most {MAX_ACCUMULATORS} accumulators per lane (registers), "
                         f"got {knobs['columns_per_warp']} x {knobs['m_tile']}")
    if swiglu and knobs["columns_per_warp"] % 2:
        raise ValueError(f"columns_per_warp: the SwiGLU GEMV computes gate and up columns in pairs, so it needs "
                         f"2 or 4, got {columns_per_warp!r}")
    knobs = {name: int(value) for name, value in knobs.items()}  # (compile-time constants of the kernel)
    rows_per_output = 2 if swiglu else 1  # weight rows behind one output column
    outputs_per_cta = knobs["warps_per_cta"] * knobs["columns_per_warp"] // rows_per_output
    grid = (-(-(n // rows_per_output) // outputs_per_cta), -(-m // knobs["m_tile"]), int(k_splits))
    return GemvLaunch(grid=grid, block=(knobs["warps_per_cta"] * WARP_SIZE,), steps=-(-(k // k_splits) // K_PER_STEP),
                      k_splits=int(k_splits), **knobs)


def gemv_simt(a, q, scale_inv, out, block=(128, 128), m_tile=None, warps_per_cta=None, chunks_per_iteration=None,
              columns_per_warp=None, stream=0):
    """``out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]``, float32
    accumulation in the order of ``fp8lab.simulators.gemv_simt``; returns ``out``.

    ``a``: ``[M, K]`` with ``1 <= M <= 16``, BF16 bits (uint16/int16), float16 or float32;
    ``q``: uint8 E4M3 codes ``[N, K]``; ``scale_inv``: float32 ``[ceil(N/BN), ceil(K/BK)]``;
    ``out``: ``[M, N]`` float32, float16 or BF16 bits (uint16/int16); ``block = (BN, BK)``;
    ``stream``: where to enqueue the launch (a Numba stream, or a ``cuda.core`` GraphBuilder
    to capture it into a CUDA graph; 0 is the default stream).

    Tuning knobs (None: ``default_knobs``; the result does not depend on any of them):
    ``m_tile``: rows sharing each weight load (1 to 16); ``warps_per_cta``: warps per CTA (1 to 32);
    ``chunks_per_iteration``: a lane's chunks loaded together (1, 2, 4); ``columns_per_warp``:
    columns a warp computes (1, 2, 4).

    Arrays may be NumPy, Numba device arrays or ``__cuda_array_interface__`` objects. Bad arguments
    raise ``ValueError`` and nothing is launched. NaN weight codes are read as finite (+-480 * scale).
    """
    problem = arguments.check_gemm(a, q, scale_inv, out, block, kernel="the SIMT GEMV")
    launch = gemv_simt_launch_info(problem.m, problem.n, problem.k, m_tile, warps_per_cta, chunks_per_iteration,
                                   columns_per_warp)
    _launch(problem, launch, stream)
    return out


def gemv_simt_split_k(a, q, scale_inv, parts, block=(128, 128), m_tile=None, warps_per_cta=None,
                      chunks_per_iteration=None, columns_per_warp=None, stream=0):
    """Split-K: ``parts[s] = gemv_simt`` of K slice ``s`` (``K / S`` wide, ``S = parts.shape[0]``), so
    that the product is ``fp8lab.simulators.gemv_simt.sum_parts(parts)``: ``parts[0] + parts[1] + ...``
    in float32, in that order, which the consumer computes (``layers.add_parts_rms_norm`` adds them to
    the residual); returns ``parts``.

    The narrow shapes (``N`` = hidden size, e.g. o_proj and down_proj) have too few columns to keep
    the memory busy with one warp per column; S slices give S times the warps, each with an S times
    shorter chain of dependent steps. Each slice is summed exactly as ``gemv_simt`` sums a whole row
    (``fp8lab.simulators.gemv_simt.gemv_simt_split_k`` is the bit-exact model).

    ``parts``: float32 ``[S, M, N]``, ``1 <= S``, and for ``S > 1`` ``K / S`` a multiple of ``BK`` (each
    slice whole K blocks); ``a``, ``q``, ``scale_inv``, ``block``, the knobs and ``stream`` as in ``gemv_simt``.
    """
    a, q, parts = (arguments.as_kernel_array(name, x) for name, x in (("a", a), ("q", q), ("parts", parts)))
    m, n = (a.shape[0] if a.ndim == 2 else 0), (q.shape[0] if q.ndim == 2 else 0)
    arguments.require("parts", parts, f"float32 [S, {m}, {n}] (the K slices' partial products)",
                      parts.ndim == 3 and tuple(parts.shape[1:]) == (m, n) and parts.shape[0] >= 1
                      and np.dtype(parts.dtype) == np.float32)
    arguments.require_c_contiguous("parts", parts)
    splits = parts.shape[0]
    problem = arguments.check_gemm(a, q, scale_inv, parts[0], block, kernel="the SIMT GEMV")
    if splits > 1 and problem.k % (splits * problem.block[1]):
        raise ValueError(f"parts: {splits} K slices of K = {problem.k} must each be whole K blocks of "
                         f"{problem.block[1]}, but K / {splits} is not a multiple of {problem.block[1]}")
    launch = gemv_simt_launch_info(problem.m, problem.n, problem.k, m_tile, warps_per_cta, chunks_per_iteration,
                                   columns_per_warp, k_splits=splits)
    _launch(dataclasses.replace(problem, out=parts.reshape(splits * problem.m, problem.n)), launch, stream)
    return parts


def _launch(problem: arguments.GemmProblem, launch: GemvLaunch, stream, swiglu: bool = False):
    """The checks that need the knobs and the device pointers, then the launch (``gemv_simt_kernel``'s
    arguments: flat uint32 views of ``a`` and ``q``, the flat ``scale_inv``, ``out``'s bits view; with
    K slices, ``out`` is the parts viewed as ``[S * M, N]``)."""
    for name in ("a", "q"):
        arguments.require_load_alignment(name, getattr(problem, name), "the SIMT GEMV")
    if problem.n * problem.k // 4 >= MAX_WORDS:
        raise ValueError(f"q: the SIMT GEMV indexes the codes with 32-bit words and needs N * K < 2^34, "
                         f"got {problem.n} x {problem.k}")
    bn, bk = problem.block
    kernel = gemv_simt_kernel(launch.m_tile, problem.activation, problem.output, bn, bk, launch.warps_per_cta,
                              launch.chunks_per_iteration, launch.columns_per_warp, swiglu)
    pdl.launch(
        kernel, launch.grid, launch.block, stream,
        problem.a.view(np.uint32).reshape(-1), problem.q.view(np.uint32).reshape(-1), problem.scale_inv.reshape(-1),
        output_bits_view(problem.out, problem.output), problem.m, problem.n, problem.k, problem.k // launch.k_splits)


def gemv_simt_swiglu(a, q, scale_inv, out, block=(128, 128), m_tile=None, warps_per_cta=None,
                     chunks_per_iteration=None, columns_per_warp=None, stream=0):
    """SwiGLU fused into the GEMV: ``out[m, j] = silu(g) * u = g / (1 + exp(-g)) * u`` with ``g``, ``u``
    columns ``j`` and ``I + j`` of ``gemv_simt(a, q, scale_inv)``; returns ``out``.

    Bit for bit ``gemv_simt`` into a float32 ``gate_up[M, 2 I]`` then ``layers.silu_mul`` (same
    ``exp_f32``), without the second launch and the ``[M, 2 I]`` round trip: a warp computes the gate
    and up columns of ``columns_per_warp / 2`` outputs, each as ``gemv_simt``'s warps do, and lane 0
    applies ``silu_mul``'s expression. ``q``: uint8 E4M3 codes ``[2 I, K]`` (gate_proj's rows, then
    up_proj's); ``out``: float32 ``[M, I]``; ``a``, ``scale_inv``, ``block``, ``stream`` and the knobs
    as in ``gemv_simt``, except ``columns_per_warp``: 2 or 4 (None: ``default_knobs``, 2).
    """
    problem = _check_swiglu(a, q, scale_inv, out, block)
    launch = gemv_simt_launch_info(problem.m, problem.n, problem.k, m_tile, warps_per_cta, chunks_per_iteration,
                                   columns_per_warp, swiglu=True)
    _launch(problem, launch, stream, swiglu=True)
    return out


def _check_swiglu(a, q, scale_inv, out, block) -> arguments.GemmProblem:
    """``arguments.check_gemm``'s checks of ``a``, ``q``, ``scale_inv`` and ``block``, plus: ``q``'s ``N``
    even and ``out`` float32 ``[M, N / 2]``, C-contiguous."""
    q, a, out = (arguments.as_kernel_array(name, x) for name, x in (("q", q), ("a", a), ("out", out)))
    arguments.require("q", q, "uint8 E4M3 codes [2 I, K] (gate rows, then up rows)",
                      q.ndim == 2 and q.dtype == np.uint8 and q.shape[0] % 2 == 0 and q.shape[0] > 0)
    m, n = (a.shape[0] if a.ndim == 2 else 1), q.shape[0]
    arguments.require("out", out, f"float32 [{m}, {n // 2}] (silu(gate) * up)",
                      tuple(out.shape) == (m, n // 2) and np.dtype(out.dtype) == np.float32)
    return arguments.check_gemm(a, q, scale_inv, out, block, kernel="the SIMT GEMV", out_columns=n // 2)
