"""SIMT decode GEMV for FP8 weights: ``out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]``
for ``1 <= M <= 16`` rows (the decode step of an LLM: a handful of tokens against a big weight).

What it computes: the W8A16 product of ``reference.blockwise.gemm`` in float32, in exactly the
order of ``simulators.gemv_simt`` (the schedule, below). Activations are BF16 bits (uint16/int16),
float16 or float32, widened exactly to float32 on load; the output is float32, float16 or BF16
bits (uint16/int16), rounded once from the float32 sum.

The schedule (``simulators.gemv_simt`` is its bit-exact NumPy model; read the two side by side):

- **One warp per output column** ``n`` (weight row ``n``). Lane ``L`` owns the 16-byte chunks
  ``c = L, L + 32, L + 64, ...`` of the row, i.e. ``k in [16 c, 16 c + 16)``; one warp *step*
  covers 512 contiguous bytes. Lanes past the row end sit the last step out.
- **Wide loads**: a lane's 16 codes are one 128-bit load (``ld.global.nc.v4.u32`` through a
  ``uint32`` view of ``q``); the activations too (two 128-bit loads per row for 16-bit formats,
  four for float32).
- **Register prefetch**: the codes and block scale of the lane's next chunk are loaded before the
  current chunk is computed (double-buffered registers), so the next load is in flight while
  this chunk's arithmetic runs.
- **Bit placement** (``dequantize.placed_codes``): code ``c`` becomes the F16 pattern
  ``(c & 0x80) << 8 | (c & 0x7F) << 7``, widened to float32 ``decode(c) * 2^-8`` (exact).
- **Per row of the tile**: ``part = fma(a_i, w_i, part)`` for the chunk's 16 elements in ``k``
  order, from ``part = 0``; then the promotion ``acc = fma(s, part, acc)`` with
  ``s = scale_inv[n // BN, 16 c // BK] * 2^8`` (the placement's ``2^-8`` folded in, exact).
- **Butterfly**: ``acc += shfl_xor(acc, off)`` for ``off = 16, 8, 4, 2, 1``; lane 0 stores.
- **Row tiles**: ``M_TILE`` rows (1, 2, 4, 8 or 16) share each weight load; each row has its own
  accumulator in a register. ``M_TILE`` is a compile-time constant of the kernel (one compiled
  kernel per ``(M_TILE, activation format, output format, BN, BK)``), so the row loops unroll.
  In the last tile, rows past ``M`` are skipped (their accumulators stay 0 and are not stored).

Launch shape (``gemv_simt_launch_info``): CTAs of ``WARPS_PER_CTA = 4`` warps (128 threads), each
warp a different column ``n``; grid ``(ceil(N / 4), ceil(M / M_TILE))``. Why four: the warps of a
CTA share nothing but the activations (which L1 caches), so a small CTA costs nothing and keeps the
grid fine-grained (``N / 4`` CTAs for a few thousand columns), which shortens the last, partial
wave. ``warps_per_cta`` is a knob for the benchmark; it never changes the result.
``m_tile=None`` picks the smallest tile holding all ``M`` rows, so the weights are read once.

Checked against ``simulators.gemv_simt`` bit for bit (CUDA simulator and GPU) and against
``reference.blockwise.gemm`` by relative error (``tests/test_gemv_kernel.py``).

Requirements (``ValueError`` before anything is launched): those of ``arguments.check_gemm``
(``K`` and ``BK`` multiples of 128, shapes and dtypes) plus ``1 <= M <= 16``, ``m_tile`` one of
1, 2, 4, 8, 16, and device arrays whose data start on a 16-byte boundary (for the 128-bit loads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from . import arguments
from .bits import SIMULATOR, bf16_bits_to_f32, f16_bits_to_f32, u32_as_f32
from .dequantize import F16_PLACEMENT_SCALE, STORE, output_bits_view, placed_codes

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
WARPS_PER_CTA = 4
"""Columns (warps) per CTA by default; see the module docstring for why."""
MAX_WARPS_PER_CTA = 32
BYTES_PER_LANE = 16
"""One 128-bit load per lane per step: 16 FP8 codes, 4 uint32 words."""
WORDS_PER_LOAD = 4
K_PER_STEP = WARP_SIZE * BYTES_PER_LANE
MAX_ROWS = 16
M_TILES = (1, 2, 4, 8, 16)
BUTTERFLY_OFFSETS = (16, 8, 4, 2, 1)
LOAD_ALIGNMENT = 16
"""Bytes: a 128-bit load needs a 16-byte aligned address."""


# ---------------------------------------------------------------------------- the 128-bit load

if SIMULATOR:

    def load_u32x4(words, row, col):
        """``words[row, col : col + 4]`` as 4 uint32 (one 128-bit load on a GPU; ``col % 4 == 0``)."""
        if col % WORDS_PER_LOAD:
            raise RuntimeError(f"load_u32x4: column {col} is not a multiple of 4 (the GPU load would be misaligned)")
        return words[row, col], words[row, col + 1], words[row, col + 2], words[row, col + 3]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _GLOBAL_ADDRESS_SPACE = 1

    @intrinsic
    def load_u32x4(typingctx, words, row, col):
        """``words[row, col : col + 4]`` of a 2-D uint32 array as one ``ld.global.nc.v4.u32``.

        The address must be 16-byte aligned (``col % 4 == 0`` and a 16-byte aligned row start; the
        host checks the array's data pointer). The data is read-only for the kernel's lifetime,
        which the ``invariant.load`` mark tells the compiler, so it uses the non-coherent
        (read-only data cache) path.
        """
        if not (isinstance(words, types.Array) and words.ndim == 2 and words.dtype == types.uint32):
            return None

        def codegen(context, builder, signature, args):
            array_type, row_type, col_type = signature.args
            array = context.make_array(array_type)(context, builder, value=args[0])
            index = [context.cast(builder, args[1], row_type, types.intp),
                     context.cast(builder, args[2], col_type, types.intp)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)
            vector = ir.VectorType(ir.IntType(32), WORDS_PER_LOAD)
            global_pointer = builder.addrspacecast(pointer, ir.PointerType(ir.IntType(32), _GLOBAL_ADDRESS_SPACE))
            loaded = builder.load(builder.bitcast(global_pointer, ir.PointerType(vector, _GLOBAL_ADDRESS_SPACE)),
                                  align=LOAD_ALIGNMENT)
            loaded.set_metadata("invariant.load", builder.module.add_metadata([]))
            lanes = [builder.extract_element(loaded, ir.Constant(ir.IntType(32), i)) for i in range(WORDS_PER_LOAD)]
            return context.make_tuple(builder, signature.return_type, lanes)

        return types.UniTuple(types.uint32, WORDS_PER_LOAD)(words, row, col), codegen


# ---------------------------------------------------------------------------- one chunk of 16 elements


@cuda.jit(device=True, inline=True)
def place_chunk(codes, weights):
    """The 4 words (16 codes) of one chunk -> ``weights[0:16]``, float32 ``decode(c) * 2^-8`` in k order."""
    for word in range(WORDS_PER_LOAD):
        v0, v1, v2, v3 = placed_codes(codes[word])
        weights[4 * word] = v0
        weights[4 * word + 1] = v1
        weights[4 * word + 2] = v2
        weights[4 * word + 3] = v3


@cuda.jit(device=True, inline=True)
def load_bf16_chunk(a_words, row, chunk, values):
    """``a[row, 16 chunk : +16]`` of BF16 activations (2 per uint32, low half first) -> float32, exact."""
    for half in range(2):
        words = load_u32x4(a_words, row, 8 * chunk + WORDS_PER_LOAD * half)
        for j in range(WORDS_PER_LOAD):
            values[8 * half + 2 * j] = bf16_bits_to_f32(words[j])
            values[8 * half + 2 * j + 1] = bf16_bits_to_f32(words[j] >> uint32(16))


@cuda.jit(device=True, inline=True)
def load_f16_chunk(a_words, row, chunk, values):
    """``a[row, 16 chunk : +16]`` of float16 activations (2 per uint32, low half first) -> float32, exact."""
    for half in range(2):
        words = load_u32x4(a_words, row, 8 * chunk + WORDS_PER_LOAD * half)
        for j in range(WORDS_PER_LOAD):
            values[8 * half + 2 * j] = f16_bits_to_f32(words[j])
            values[8 * half + 2 * j + 1] = f16_bits_to_f32(words[j] >> uint32(16))


@cuda.jit(device=True, inline=True)
def load_f32_chunk(a_words, row, chunk, values):
    """``a[row, 16 chunk : +16]`` of float32 activations (read as their bits) -> float32."""
    for quarter in range(4):
        words = load_u32x4(a_words, row, 16 * chunk + WORDS_PER_LOAD * quarter)
        for j in range(WORDS_PER_LOAD):
            values[4 * quarter + j] = u32_as_f32(words[j])


LOAD_ACTIVATIONS = {"bf16": load_bf16_chunk, "f16": load_f16_chunk, "f32": load_f32_chunk}


@cuda.jit(device=True, inline=True)
def chunk_partial(activations, weights):
    """The lane's 16-product partial: ``part = fma(a_i, w_i, part)`` for i = 0..15, from 0 (k order)."""
    part = float32(0.0)
    for i in range(BYTES_PER_LANE):
        part = cuda.fma(activations[i], weights[i], part)
    return part


@cuda.jit(device=True, inline=True)
def warp_sum(value):
    """Butterfly: ``value += shfl_xor(value, off)`` for off = 16, 8, 4, 2, 1; every lane gets the total."""
    for off in BUTTERFLY_OFFSETS:
        value += cuda.shfl_xor_sync(FULL_MASK, value, off)
    return value


# ---------------------------------------------------------------------------- the kernel


@functools.lru_cache(maxsize=None)
def gemv_simt_kernel(m_tile: int, activation: str, output: str, block_n: int, block_k: int,
                     warps_per_cta: int = WARPS_PER_CTA):
    """The compiled GEMV kernel for one row tile, activation format, output format, block size and
    CTA size.

    All are compile-time constants: the row and element loops unroll, the per-row accumulators
    live in registers, and the block divisions become shifts.
    """
    load_activations = LOAD_ACTIVATIONS[activation]
    store = STORE[output]
    scale_block_chunks = block_k // BYTES_PER_LANE  # 16-byte chunks per K block

    @cuda.jit
    def kernel(a_words, q_words, scale_inv, out, m, n, k):
        lane = cuda.threadIdx.x % WARP_SIZE
        col = cuda.blockIdx.x * warps_per_cta + cuda.threadIdx.x // WARP_SIZE  # output column = weight row
        if col >= n:
            return  # the whole warp leaves together: no lane is left waiting in a shuffle
        row0 = cuda.blockIdx.y * m_tile
        rows = min(m_tile, m - row0)
        scale_row = col // block_n
        chunks = k // BYTES_PER_LANE

        acc = cuda.local.array(m_tile, float32)
        for r in range(m_tile):
            acc[r] = float32(0.0)
        weights = cuda.local.array(BYTES_PER_LANE, float32)
        activations = cuda.local.array(BYTES_PER_LANE, float32)

        # Prefetch the lane's first chunk (lanes past the row end have none: K = 128 keeps 8 busy).
        chunk = lane
        next_codes = (uint32(0), uint32(0), uint32(0), uint32(0))
        next_scale = float32(0.0)
        if chunk < chunks:
            next_codes = load_u32x4(q_words, col, WORDS_PER_LOAD * chunk)
            next_scale = scale_inv[scale_row, chunk // scale_block_chunks]
        while chunk < chunks:
            codes = next_codes
            s = next_scale * F16_PLACEMENT_SCALE
            following = chunk + WARP_SIZE
            if following < chunks:  # start the next step's loads before computing this one
                next_codes = load_u32x4(q_words, col, WORDS_PER_LOAD * following)
                next_scale = scale_inv[scale_row, following // scale_block_chunks]
            place_chunk(codes, weights)
            for r in range(m_tile):
                if r < rows:
                    load_activations(a_words, row0 + r, chunk, activations)
                    acc[r] = cuda.fma(s, chunk_partial(activations, weights), acc[r])
            chunk = following

        for r in range(m_tile):
            acc[r] = warp_sum(acc[r])
        if lane == 0:
            for r in range(m_tile):
                if r < rows:
                    store(out, row0 + r, col, acc[r])

    return kernel


# ---------------------------------------------------------------------------- launch shape and entry point


@dataclass(frozen=True)
class GemvLaunch:
    """The launch shape of ``gemv_simt`` for one problem."""

    grid: tuple[int, int]  # (column tiles of warps_per_cta columns, row tiles of m_tile rows)
    block: tuple[int]  # threads per CTA: 32 * warps_per_cta
    m_tile: int
    warps_per_cta: int
    steps: int  # warp steps of 512 codes per column: ceil(K / 512)


def default_m_tile(m: int) -> int:
    """The smallest row tile holding all ``m`` rows (weights read once)."""
    return next(t for t in M_TILES if t >= m)


def gemv_simt_launch_info(m: int, n: int, k: int, m_tile: int | None = None,
                          warps_per_cta: int = WARPS_PER_CTA) -> GemvLaunch:
    """Grid, CTA shape and row tile of ``gemv_simt`` for ``a[M, K] @ q[N, K]^T``."""
    m, n, k, warps_per_cta = int(m), int(n), int(k), int(warps_per_cta)
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"a: the SIMT GEMV handles 1 <= M <= {MAX_ROWS} rows, got M = {m}")
    if m_tile is None:
        m_tile = default_m_tile(m)
    if m_tile not in M_TILES:
        raise ValueError(f"m_tile: expected one of {M_TILES} or None, got {m_tile!r}")
    if not 1 <= warps_per_cta <= MAX_WARPS_PER_CTA:
        raise ValueError(f"warps_per_cta: expected 1 to {MAX_WARPS_PER_CTA}, got {warps_per_cta}")
    grid = (-(-n // warps_per_cta), -(-m // m_tile))
    return GemvLaunch(grid=grid, block=(warps_per_cta * WARP_SIZE,), m_tile=m_tile, warps_per_cta=warps_per_cta,
                      steps=-(-k // K_PER_STEP))


def _require_load_alignment(name: str, x):
    """Device arrays must start on a 16-byte boundary (NumPy arrays are copied to fresh device memory)."""
    if isinstance(x, np.ndarray) or SIMULATOR:
        return
    address = x.__cuda_array_interface__["data"][0]
    if address % LOAD_ALIGNMENT:
        raise ValueError(f"{name}: the SIMT GEMV loads 16 bytes at a time and needs the data to start on a "
                         f"{LOAD_ALIGNMENT}-byte boundary, got address 0x{address:x}")


def gemv_simt(a, q, scale_inv, out, block=(128, 128), m_tile=None, warps_per_cta=WARPS_PER_CTA, stream=0):
    """``out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]``, float32
    accumulation in the order of ``simulators.gemv_simt``; returns ``out``.

    ``a``: ``[M, K]`` with ``1 <= M <= 16``, BF16 bits (uint16/int16), float16 or float32;
    ``q``: uint8 E4M3 codes ``[N, K]``; ``scale_inv``: float32 ``[ceil(N/BN), ceil(K/BK)]``;
    ``out``: ``[M, N]`` float32, float16 or BF16 bits (uint16/int16); ``block = (BN, BK)``;
    ``m_tile``: rows sharing each weight load (1, 2, 4, 8, 16; None: all rows in one tile);
    ``warps_per_cta``: columns per CTA (a tuning knob; the result does not depend on it);
    ``stream``: where to enqueue the launch (a Numba stream, or a ``cuda.core`` GraphBuilder
    to capture it into a CUDA graph; 0 is the default stream).
    Arrays may be NumPy, Numba device arrays or ``__cuda_array_interface__`` objects. Bad arguments
    raise ``ValueError`` and nothing is launched. NaN weight codes are read as finite (+-480 * scale).
    """
    problem = arguments.check_gemm(a, q, scale_inv, out, block, kernel="the SIMT GEMV")
    launch = gemv_simt_launch_info(problem.m, problem.n, problem.k, m_tile, warps_per_cta)
    for name in ("a", "q"):
        _require_load_alignment(name, getattr(problem, name))
    bn, bk = problem.block
    kernel = gemv_simt_kernel(launch.m_tile, problem.activation, problem.output, bn, bk, launch.warps_per_cta)
    kernel[launch.grid, launch.block, stream](problem.a.view(np.uint32), problem.q.view(np.uint32), problem.scale_inv,
                                      output_bits_view(problem.out, problem.output), problem.m, problem.n, problem.k)
    return out
