"""Tensor-core W8A16 GEMM for FP8 (E4M3) blockwise weights: ``mma.m16n8k16`` fed by bit placement.

What it computes (``reference.blockwise.gemm``, float32 accumulation)::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

with ``a`` BF16 (``uint16``/``int16`` bit patterns) or F16 (``float16``) ``[M, K]``, ``q`` E4M3
codes ``uint8 [N, K]``, ``scale_inv`` ``float32 [ceil(N/BN), ceil(K/BK)]`` and ``out`` float32,
float16 or BF16 bits (``uint16``/``int16``), rounded once from the float32 result.

How: exactly the schedule of ``simulators.gemm_mma`` (read that first; this file is its CUDA):

- **Launch**: grid ``(ceil(N / 32), ceil(M / M_TILE))``, block ``(128,)`` = 4 warps,
  ``M_TILE = 16 * m_blocks`` (``m_blocks`` 1 or 2); dynamic shared memory ``2 * (M_TILE * 272 +
  32 * 136)`` bytes = 17 408 (``m_blocks=1``) or 26 112 (``m_blocks=2``). ``launch_info`` returns it.
  A CTA owns ``out[M_TILE rows, 32 columns]``; warp ``w`` owns the n8 strip ``8w..8w+7`` of it and
  ``m_blocks`` m16 x n8 accumulator tiles. Rows/columns past the end of ``a``/``q`` read as zero;
  outputs past the end are not stored. Large M is simply more CTAs in ``y``.
- **K loop**: 128-wide chunks in ascending order, double-buffered in shared memory. In iteration
  ``c`` every thread first issues its global loads of chunk ``c + 1`` into registers, then the
  warps multiply chunk ``c`` from buffer ``c % 2`` (the loads are in flight meanwhile), then the
  registers are written to buffer ``(c + 1) % 2`` and one ``syncthreads`` ends the iteration. One
  barrier per chunk suffices *because* there are two buffers: the buffer written in iteration ``c``
  was last read in iteration ``c - 1``, before that iteration's barrier.
- **Per chunk**: ``c_part = 0``; 8 k16 steps, each one ``mma`` per m16 tile; A fragments are
  32-bit words of shared memory (two activations), B fragments are two codes read as one
  ``uint16`` and placed into two BF16/F16 patterns in one 32-bit register (``place_code_pair``).
  Then the promotion ``c_fin = fma(s, c_part, c_fin)`` with the warp's folded block scale
  ``s = scale_inv[n0 // BN, k0 // BK] * 2^120`` (BF16) or ``* 2^8`` (F16).

Shared memory (one dynamic allocation, read through three aliased views: ``uint64`` for the
cooperative copy, ``uint32`` for A words, ``uint16`` for B code pairs)::

    byte 0                       A buffer 0: M_TILE rows x 272 bytes (128 activations + 16 pad)
    M_TILE * 272                 A buffer 1
    2 * M_TILE * 272             B buffer 0: 32 weight rows x 136 bytes (128 codes + 8 pad)
    2 * M_TILE * 272 + 4352      B buffer 1

Why the padding (32 banks of 4 bytes; a warp's access is conflict-free when its 32 addresses fall
into distinct banks or share words): an A fragment load has lane ``(g, t)`` read word ``t`` (+ a
constant) of row ``g``. Unpadded rows are 64 words, so all 8 rows start in bank 0 and the load is
8-way conflicted; at 68 words row ``g`` starts in bank ``4g`` and the 8 x 4 words hit 32 distinct
banks. A B pair load has lane ``(g, t)`` read halfword ``t`` of weight row ``g``: 2 words per row;
at 34 words per row, row ``g`` starts in bank ``2g``: 16 distinct words in 16 distinct banks. The
copy writes whole 8-byte words, 16 lanes (128 contiguous bytes) per phase: conflict-free too.

Float32 operation order is that of ``simulators.gemm_mma`` exactly, so in Numba's CUDA simulator
(where ``mma_bf16``/``mma_f16`` are warp-collective twins built on ``simulators.mma``) this kernel
equals ``simulators.gemm_mma.gemm_mma`` bit for bit; on a GPU it is checked against
``reference.blockwise.gemm`` with the GPU error budget stated there (``tests/test_gemm_mma_kernel.py``).
On a GPU the linked ``mma`` helper is inlined by link-time optimization (numba-cuda's default
when nvJitLink is installed): the call and its local-memory return slot disappear.

Versions: v1 (this): register-staged double buffer with 8-byte global loads, padded shared rows,
32-bit A fragment loads, pairwise bit placement (CUDA 13.5, sm_90: 80 / 110 registers for
``m_blocks`` 1 / 2, no local memory; ``tests/test_kernels_compile.py`` checks the compiled code).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from . import bits
from .arguments import check_gemm
from .mma import mma_bf16, mma_f16

# ---------------------------------------------------------------------------- the schedule's constants
# (the same numbers as simulators.gemm_mma; tests check that they agree)

WARP_SIZE = 32
WARPS_PER_CTA = 4
THREADS_PER_CTA = WARP_SIZE * WARPS_PER_CTA
MMA_M, MMA_N, MMA_K = 16, 8, 16
CTA_N = WARPS_PER_CTA * MMA_N
"""32 output columns per CTA: one n8 strip per warp."""
M_BLOCKS_CHOICES = (1, 2)
K_CHUNK = 128
K_STEPS_PER_CHUNK = K_CHUNK // MMA_K
BLOCK_N_MULTIPLE = MMA_N
"""An n8 tile must lie in one scale block, so that a warp needs one scale per chunk."""
FOLDED_SCALE_EXPONENT = {"bf16": 120, "f16": 8}
"""Bit placement makes a code worth ``decode(c) * 2^-120`` (BF16) or ``2^-8`` (F16); the block
scale is multiplied by the inverse power of two instead (``simulators.bit_placement``)."""
PLACEMENT_SHIFT = {"bf16": 4, "f16": 1}
"""Right shift from a code in the high byte of a 16-bit half to its place: ``8 - 4`` for BF16's
7 mantissa bits, ``8 - 7`` for F16's 10."""

# ---------------------------------------------------------------------------- shared memory layout (bytes)

WORD64 = 8
A_ROW_BYTES = 2 * K_CHUNK + 16
"""272: 128 activations + 16 bytes of padding (68 words: row g starts in bank 4g)."""
B_ROW_BYTES = K_CHUNK + 8
"""136: 128 codes + 8 bytes of padding (34 words: row g starts in bank 2g)."""
B_BUFFER_BYTES = CTA_N * B_ROW_BYTES
A_WORDS64_PER_ROW = 2 * K_CHUNK // WORD64
"""32 eight-byte words of activations per row and chunk."""
Q_WORDS64_PER_ROW = K_CHUNK // WORD64
"""16 eight-byte words of codes per weight row and chunk."""
Q_LOADS_PER_THREAD = CTA_N * Q_WORDS64_PER_ROW // THREADS_PER_CTA
"""4: the B chunk is 512 eight-byte words, 4 per thread."""

SIGN_MASK_X2 = 0x80008000
MAGNITUDE_MASK_X2 = 0x7F007F00


def a_buffer_bytes(m_blocks: int) -> int:
    """One A buffer: M_TILE padded rows."""
    return MMA_M * m_blocks * A_ROW_BYTES


def shared_memory_bytes(m_blocks: int) -> int:
    """Two A buffers and two B buffers."""
    return 2 * (a_buffer_bytes(m_blocks) + B_BUFFER_BYTES)


# ---------------------------------------------------------------------------- launch geometry


class LaunchInfo(NamedTuple):
    grid: tuple[int, int]
    """``(ceil(N / 32), ceil(M / M_TILE))``: x over 32-column N tiles, y over M tiles."""
    block: tuple[int]
    """``(128,)``: four warps."""
    shared_bytes: int
    """Dynamic shared memory per CTA."""


MAX_GRID_Y = 65535


def choose_m_blocks(m: int) -> int:
    """One m16 tile per CTA up to M = 16 (no wasted rows); two beyond (each B fragment feeds two mma)."""
    return 1 if m <= MMA_M else 2


def launch_info(m: int, n: int, k: int, m_blocks: int) -> LaunchInfo:
    """Grid, block and dynamic shared memory bytes of the kernel for ``out[m, n]`` with reduction ``k``."""
    if m_blocks not in M_BLOCKS_CHOICES:
        raise ValueError(f"m_blocks: expected one of {M_BLOCKS_CHOICES} (M tile 16 or 32), got {m_blocks!r}")
    if m < 1 or n < 1 or k < K_CHUNK or k % K_CHUNK:
        raise ValueError(f"shape: expected M, N >= 1 and K a positive multiple of {K_CHUNK}, got {(m, n, k)}")
    m_tile = MMA_M * m_blocks
    grid = (-(-n // CTA_N), -(-m // m_tile))
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"a: M = {m} needs {grid[1]} M tiles, more than the grid's {MAX_GRID_Y}")
    return LaunchInfo(grid=grid, block=(THREADS_PER_CTA,), shared_bytes=shared_memory_bytes(m_blocks))


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
def place_code_pair(pair, shift):
    """Two E4M3 codes (one uint16, lower k in the low byte) -> one register of two BF16/F16 patterns.

    ``simulators.bit_placement.place_code_pair``: move each code to the high byte of its 16-bit
    half (what ``prmt(pair, 0, 0x1404)`` does; the compiler may emit exactly that), keep both signs
    at bits 15 and 31, shift both 7-bit magnitudes right into place; the masks keep each half's
    bits inside that half.
    """
    p = uint32(pair)
    spread = ((p & uint32(0x00FF)) << uint32(8)) | ((p & uint32(0xFF00)) << uint32(16))
    return (spread & uint32(SIGN_MASK_X2)) | ((spread & uint32(MAGNITUDE_MASK_X2)) >> uint32(shift))


@inlined_device_function
def load_rows(words, first_row, first_word, thread, staged, words_per_row, loads):
    """Global -> registers: this thread's share of a chunk, ``loads`` eight-byte words.

    The chunk is ``words[first_row.., first_word .. first_word + words_per_row]``; load ``j`` of
    thread ``i`` takes word ``j * 128 + i`` of it in row-major order, so consecutive lanes read
    consecutive words: one warp load covers one 256-byte A row or two 128-byte weight rows, every
    byte used (coalesced). Rows past the end read as zero.
    """
    for j in range(loads):
        linear = j * THREADS_PER_CTA + thread
        row = first_row + linear // words_per_row
        if row < words.shape[0]:
            staged[j] = words[row, first_word + linear % words_per_row]
        else:
            staged[j] = 0


@inlined_device_function
def store_rows(smem64, base_byte, row_bytes, thread, staged, words_per_row, loads):
    """Registers -> shared memory: the words ``load_rows`` fetched, into padded rows."""
    for j in range(loads):
        linear = j * THREADS_PER_CTA + thread
        row, word = linear // words_per_row, linear % words_per_row
        smem64[(base_byte + row * row_bytes) // WORD64 + word] = staged[j]


@inlined_device_function
def folded_scale(scale_inv, tile_n0, n, chunk, block_n, block_k, fold):
    """The warp's scale for one chunk: ``scale_inv[n0 // BN, k0 // BK] * 2^offset`` (exact in
    float32); 0 for a tile wholly past N, whose outputs are never stored (as in the simulator)."""
    if tile_n0 < n:
        return scale_inv[tile_n0 // block_n, (chunk * K_CHUNK) // block_k] * fold
    return float32(0.0)


# ---------------------------------------------------------------------------- the kernel factory


def kernel_function(m_blocks: int, activation: str, output: str):
    """The Python source of one kernel variant, before ``cuda.jit``: ``m_blocks``, the activation
    format (``'bf16'``/``'f16'``) and the output format (``'f32'``/``'f16'``/``'bf16'``) are
    compile-time constants, so every per-thread array below has constant indices after unrolling
    and lives in registers. Arguments: ``(a_words uint64 [M, K/4], q_words uint64 [N, K/8],
    scale_inv float32 [ceil(N/BN), ceil(K/BK)], out [M, N], block_n uint32, block_k uint32)``: the
    activations and codes as 8-byte words (``kernel_signature``)."""
    known = m_blocks in M_BLOCKS_CHOICES and activation in FOLDED_SCALE_EXPONENT and output in ("f32", "f16", "bf16")
    if not known:
        raise ValueError(f"no kernel variant for m_blocks={m_blocks!r}, activation={activation!r}, output={output!r}")
    m_tile = MMA_M * m_blocks
    mma = mma_bf16 if activation == "bf16" else mma_f16
    shift = PLACEMENT_SHIFT[activation]
    fold = np.float32(2.0 ** FOLDED_SCALE_EXPONENT[activation])
    accumulators = 4 * m_blocks  # float32 c registers per lane: 4 per m16 x n8 tile
    a_loads = m_tile * A_WORDS64_PER_ROW // THREADS_PER_CTA  # 4 or 8 eight-byte words per thread
    a_buffer = a_buffer_bytes(m_blocks)
    b_first = 2 * a_buffer  # byte offset of B buffer 0
    bf16_output = output == "bf16"

    @inlined_device_function
    def load_chunk(a_words, q_words, chunk, cta_row0, cta_col0, thread, staged_a, staged_q):
        """Global -> registers: the CTA's activation rows and weight rows of one K chunk."""
        load_rows(a_words, cta_row0, chunk * A_WORDS64_PER_ROW, thread, staged_a, A_WORDS64_PER_ROW, a_loads)
        load_rows(q_words, cta_col0, chunk * Q_WORDS64_PER_ROW, thread, staged_q, Q_WORDS64_PER_ROW, Q_LOADS_PER_THREAD)

    @inlined_device_function
    def store_chunk(smem64, buffer, thread, staged_a, staged_q):
        """Registers -> shared buffer ``buffer`` (0 or 1) of A and of B."""
        store_rows(smem64, buffer * a_buffer, A_ROW_BYTES, thread, staged_a, A_WORDS64_PER_ROW, a_loads)
        store_rows(smem64, b_first + buffer * B_BUFFER_BYTES, B_ROW_BYTES, thread, staged_q, Q_WORDS64_PER_ROW,
                   Q_LOADS_PER_THREAD)

    @inlined_device_function
    def a_fragment(smem32, buffer, row0, step, g, t):
        """The 4 A registers of rows ``row0..row0+15``, k16 step ``step``: words (two activations) at
        (g, 2t), (g+8, 2t), (g, 2t+8), (g+8, 2t+8) of the 16x16 tile (``simulators.mma.A_COORDS``)."""
        top = (buffer * a_buffer + (row0 + g) * A_ROW_BYTES) // 4 + step * (MMA_K // 2) + t
        bottom = top + 8 * (A_ROW_BYTES // 4)
        return at(smem32, top), at(smem32, bottom), at(smem32, top + 4), at(smem32, bottom + 4)

    @inlined_device_function
    def b_fragment(smem16, buffer, weight_row, step, t):
        """The 2 B registers of k16 step ``step``: codes (k = 2t, 2t+1) and (2t+8, 2t+9) of weight row
        ``weight_row`` (n = g of the warp's strip), each pair one uint16, placed into 16-bit patterns."""
        pair = (b_first + buffer * B_BUFFER_BYTES + weight_row * B_ROW_BYTES) // 2 + step * (MMA_K // 2) + t
        return place_code_pair(at(smem16, pair), shift), place_code_pair(at(smem16, pair + 4), shift)

    @inlined_device_function
    def multiply_chunk(smem32, smem16, buffer, c_part, warp, g, t):
        """``c_part = 0``, then 8 k16 steps of one mma per m16 tile; one B fragment feeds all tiles."""
        for i in range(accumulators):
            c_part[i] = float32(0.0)
        for step in range(K_STEPS_PER_CHUNK):
            b0, b1 = b_fragment(smem16, buffer, warp * MMA_N + g, step, t)
            for tile in range(m_blocks):
                a0, a1, a2, a3 = a_fragment(smem32, buffer, tile * MMA_M, step, g, t)
                c = 4 * tile
                d = mma(a0, a1, a2, a3, b0, b1, c_part[c], c_part[c + 1], c_part[c + 2], c_part[c + 3])
                c_part[c], c_part[c + 1], c_part[c + 2], c_part[c + 3] = d[0], d[1], d[2], d[3]

    @inlined_device_function
    def store_tile(out, c_fin, row0, col0, g, t):
        """Each lane's c0..c3 of each tile: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); only inside ``out``."""
        for tile in range(m_blocks):
            for i in range(4):
                row = row0 + tile * MMA_M + g + 8 * (i >> 1)
                col = col0 + 2 * t + (i & 1)
                if row < out.shape[0] and col < out.shape[1]:
                    value = c_fin[4 * tile + i]
                    if bf16_output:
                        out[row, col] = bits.f32_to_bf16_bits(value)
                    else:
                        out[row, col] = value  # float32, or float16 rounded once (nearest even)

    def gemm_mma_kernel(a_words, q_words, scale_inv, out, block_n, block_k):
        # Indices are uint32 from the start: the compiler then knows they are not negative and drops
        # the fix-ups that Python semantics (negative indices, floor division) would otherwise cost.
        thread = uint32(cuda.threadIdx.x)
        warp, lane = thread // WARP_SIZE, thread % WARP_SIZE
        g, t = lane >> 2, lane & 3
        cta_row0 = uint32(cuda.blockIdx.y) * m_tile
        cta_col0 = uint32(cuda.blockIdx.x) * CTA_N
        tile_n0 = cta_col0 + warp * MMA_N
        n = q_words.shape[0]
        chunks = q_words.shape[1] // Q_WORDS64_PER_ROW

        # Three views of one dynamic shared allocation (dynamic shared arrays alias each other).
        # The compiler may treat them as distinct objects; that is safe here because every phase
        # change (write a buffer -> read it -> overwrite it) passes a syncthreads, which orders all
        # memory accesses.
        smem64 = cuda.shared.array(0, uint64)
        smem32 = cuda.shared.array(0, uint32)
        smem16 = cuda.shared.array(0, uint16)
        staged_a = cuda.local.array(a_loads, uint64)
        staged_q = cuda.local.array(Q_LOADS_PER_THREAD, uint64)
        c_part = cuda.local.array(accumulators, float32)
        c_fin = cuda.local.array(accumulators, float32)
        for i in range(accumulators):
            c_fin[i] = float32(0.0)

        # Prologue: chunk 0 into buffer 0.
        load_chunk(a_words, q_words, uint32(0), cta_row0, cta_col0, thread, staged_a, staged_q)
        store_chunk(smem64, uint32(0), thread, staged_a, staged_q)
        next_scale = folded_scale(scale_inv, tile_n0, n, uint32(0), block_n, block_k, fold)
        cuda.syncthreads()

        for chunk_index in range(chunks):
            chunk = uint32(chunk_index)
            buffer = chunk & 1
            scale = next_scale
            prefetch = chunk_index + 1 < chunks
            if prefetch:  # issue chunk + 1's loads now; they land while this chunk is multiplied
                load_chunk(a_words, q_words, chunk + 1, cta_row0, cta_col0, thread, staged_a, staged_q)
                next_scale = folded_scale(scale_inv, tile_n0, n, chunk + 1, block_n, block_k, fold)

            multiply_chunk(smem32, smem16, buffer, c_part, warp, g, t)
            for i in range(accumulators):  # promotion: one rounding per chunk
                c_fin[i] = cuda.fma(scale, c_part[i], c_fin[i])

            if prefetch:  # the other buffer was last read before the previous barrier
                store_chunk(smem64, buffer ^ 1, thread, staged_a, staged_q)
            cuda.syncthreads()

        store_tile(out, c_fin, cta_row0, tile_n0, g, t)

    return gemm_mma_kernel


def kernel_signature(output: str) -> str:
    """The Numba signature the host wrapper launches with (for ``cuda.compile_ptx``)."""
    out_type = {"f32": "float32", "f16": "float16", "bf16": "uint16"}[output]
    return f"void(uint64[:, ::1], uint64[:, ::1], float32[:, ::1], {out_type}[:, ::1], uint32, uint32)"


@functools.lru_cache(maxsize=None)
def compiled_kernel(m_blocks: int, activation: str, output: str):
    """One ``cuda.jit`` dispatcher per variant, compiled on first launch and kept."""
    options = {} if bits.SIMULATOR else {"launch_bounds": THREADS_PER_CTA}
    return cuda.jit(kernel_function(m_blocks, activation, output), **options)


# ---------------------------------------------------------------------------- the host side


def _as_words(name: str, x, dtype):
    """``x`` (C-contiguous, row bytes a multiple of the word) reinterpreted as ``dtype`` words.

    A device array must be aligned to the word: the kernel's loads are that wide. (A NumPy array
    is copied into a fresh, aligned device allocation at launch.)
    """
    word = np.dtype(dtype).itemsize
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is not None and interface["data"][0] % word:
        raise ValueError(f"{name}: the kernel reads {word} bytes at a time, so the data must be {word}-byte aligned; "
                         f"got address 0x{interface['data'][0]:x}")
    return x.view(dtype)


def gemm_mma(a, q, scale_inv, out, block=(128, 128), m_blocks=None, stream=0):
    """``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T`` on tensor cores; returns ``out``.

    ``a``: BF16 bits (``uint16``/``int16``) or ``float16`` ``[M, K]``, any M >= 1; ``q``: ``uint8
    [N, K]``; ``scale_inv``: ``float32 [ceil(N/BN), ceil(K/BK)]``; ``out``: ``float32``,
    ``float16`` or BF16 bits (``uint16``/``int16``) ``[M, N]``; all C-contiguous NumPy, Numba device
    or ``__cuda_array_interface__`` arrays. ``block = (BN, BK)``: ``BN`` a multiple of 8, ``BK``
    a multiple of 128; ``K`` a multiple of 128. ``m_blocks`` (1 or 2 m16 tiles per CTA) defaults to
    ``choose_m_blocks(M)``; it does not change a single bit of the result. ``stream``: where to
    enqueue the launch (a Numba stream, or a ``cuda.core`` GraphBuilder to capture it into a CUDA
    graph; 0 is the default stream). Every problem is a ``ValueError`` raised before anything is
    launched.
    """
    problem = check_gemm(a, q, scale_inv, out, block, kernel="gemm_mma", activations=("bf16", "f16"),
                         block_n_multiple=BLOCK_N_MULTIPLE)
    m_blocks = choose_m_blocks(problem.m) if m_blocks is None else m_blocks
    launch = launch_info(problem.m, problem.n, problem.k, m_blocks)
    a_words = _as_words("a", problem.a, np.uint64)
    q_words = _as_words("q", problem.q, np.uint64)
    out_view = problem.out.view(np.uint16) if problem.output == "bf16" else problem.out  # int16 bits too
    kernel = compiled_kernel(m_blocks, problem.activation, problem.output)
    kernel[launch.grid, launch.block, stream, launch.shared_bytes](
        a_words, q_words, problem.scale_inv, out_view, np.uint32(problem.block[0]), np.uint32(problem.block[1])
    )
    return problem.out
