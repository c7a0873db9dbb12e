"""Warpgroup W8A16 GEMM with a producer warpgroup: the FP8 weights placed into BF16 in shared memory once per CTA,
both ``wgmma`` operands read from shared memory.

Computes ``fp8lab.reference.blockwise.gemm`` in the float32 order of ``fp8lab.simulators.gemm_mma`` (as
``gemm_wgmma``: the order per output is the same). Launch: grid ``(ceil(N / 128), ceil(M / 128))`` x 384 threads
(three warpgroups), ``SHARED_BYTES`` of dynamic shared memory; sm_90 (Hopper) only. Checked
(``tests/numba_kernels/test_gemm_wgmma_ss_kernel.py``): bit for bit ``fp8lab.simulators.gemm_mma.gemm_mma`` in the
CUDA simulator; on a GPU bit for bit ``gemm_wgmma``. Measured 8 to 10% slower than ``gemm_wgmma`` on an H100
(``bench/RESULTS.md``, twenty-sixth session: the producer's copies and placement bound it), so the engine does not
use it; it stays as the worked example of a warp-specialized kernel.

Why a second warpgroup GEMM. ``gemm_wgmma`` places each chunk's codes into A registers in the two warpgroups that
multiply, so every chunk those warps issue about 380 instructions per warp (placement, copies, promotion) for 8
``wgmma``; its variants (two register sets, producer warps with the A operand still in registers, warpgroups taking
turns) all measured slower, and it stays at about 0.6 of cuBLAS BF16 (``bench/RESULTS.md``). Here the multiplying
warpgroups do nothing but wait, issue 8 ``wgmma`` and promote: the placement and the copies move to a third
warpgroup, and the placed BF16 weights go to shared memory, where ``wgmma`` reads them as its A operand. Without A
registers and placement temporaries the consumers fit the 168 registers a 384-thread CTA allows, which the earlier
producer-warp variant (A in registers) did not. The price is shared-memory traffic: per chunk the placed weights are
written and read once more (about 1.5x ``gemm_wgmma``'s bytes per chunk).

- **Tiles**: a CTA owns 128 weight rows x 128 tokens. Consumer warpgroup ``w`` (0, 1) multiplies weight rows ``64 w
  ..`` by all 128 tokens, one ``wgmma.m64n128k16`` per k16 step, A (weights) and B (activations) both in the
  128-byte-swizzled K-major layout (``fp8lab.numba_kernels.wgmma``). Warpgroup 2 is the producer.
- **Stages** (3, of ``STAGE_BYTES``): activations (two 64-k halves, 128 token rows of 128 bytes each), the placed
  weights (two 64-k halves, 128 weight rows of 128 bytes), and 16 block scales. A chunk's codes are copied into
  the weights' second half (row ``r``'s 128 codes in its 128-byte row, pieces swizzled); the producer thread of row
  ``r`` loads its row's codes into registers, then writes the row's BF16 patterns over both halves (only it reads or
  writes that row, so no barrier is needed between its loads and its stores).
- **Hand-over** through named barriers of 384 threads (``fp8lab.numba_kernels.named_barrier``): ``FULL + s``, the
  producer arrives when stage ``s`` holds a placed chunk (after ``fence.proxy.async``: its stores and copies are
  generic-proxy writes that ``wgmma`` reads through the async proxy), the consumers sync; ``EMPTY + s``, the
  consumers arrive once their ``wgmma`` of the stage's chunk are done and its scales read, the producer syncs before
  it copies into the stage again. The producer's own threads meet at ``PRODUCERS`` (128) after their copies land.
- **Producer**, iteration ``c``: wait for stage ``c % 3`` to be empty (``c >= 3``); copy chunk ``c`` (activations,
  codes, scales) and commit; then finish chunk ``c - 1``: wait for its copies (one group may stay in flight),
  meet the other producers, place row ``p``'s codes, fence, arrive at its ``FULL``.
- **Consumer**, iteration ``c``: sync on ``FULL`` of chunk ``c``'s stage; wait for chunk ``c - 1``'s ``wgmma``, read
  its two scales, arrive at its ``EMPTY`` (unless no later chunk uses the stage), promote it (``c_fin = fma(s *
  2^120, c_part, c_fin)``, ``gemm_wgmma.promote``'s); issue chunk ``c``'s 8 ``wgmma`` into ``c_part`` (the first
  with ``accumulate`` off) and commit. So per output: chunks ascending, per chunk 8 k16 steps from ``c_part = 0``,
  then one promotion fma: ``gemm_mma``'s order.
- **Epilogue**: ``gemm_wgmma``'s (lane ``(g, t)`` of consumer warp ``v`` holds weight rows ``16 v + g, + 8``).
"""

from __future__ import annotations

import functools

from numba import cuda, float32, uint8, uint32, uint64

from . import bits, named_barrier, pdl, wgmma
from .bits import prmt
from .cp_async import commit_group, copy_4_ca, copy_16_cg_flat, wait_group_function
from .gemm_mma import _allow_shared_memory, at, inlined_device_function
from .gemm_wgmma import (
    K_CHUNK,
    check_launch,
    checked_problem,
    clamp32,
    kernel_arguments,
    kernel_signature,  # noqa: F401  (the same arguments: this kernel's signature too)
    place_selected,
    promotion_function,
    store_function,
)
from .mathops import divide_by_reciprocal, divide_u32, reciprocal_u32
from .warp import WARP_SIZE, load_shared_u32x4, store_shared_u32x4

TOKENS = 128
CTA_N = 128
CONSUMERS = 2
WARPGROUP_THREADS = 4 * WARP_SIZE
PRODUCER_THREADS = WARPGROUP_THREADS
THREADS = (CONSUMERS + 1) * WARPGROUP_THREADS
STAGES = 3
K_STEPS = K_CHUNK // wgmma.K_STEP
HALF_BYTES = 128 * wgmma.ROW_BYTES
"""16 KB: one 64-k half of 128 rows (tokens or weight rows alike)."""
WEIGHTS_OFFSET = 2 * HALF_BYTES
SCALES_OFFSET = 4 * HALF_BYTES
STAGE_BYTES = SCALES_OFFSET + wgmma.ATOM_BYTES
SHARED_BYTES = STAGES * STAGE_BYTES + wgmma.ATOM_BYTES
"""200,704 bytes: the stages and 1,024 of room to align them."""
FULL, EMPTY, PRODUCERS = 1, 1 + STAGES, 1 + 2 * STAGES
"""Named barrier ids: ``FULL + s`` and ``EMPTY + s`` per stage, ``PRODUCERS`` for the producer warpgroup alone."""
ACCUMULATORS = TOKENS // 2
PIECES_PER_ROW = 2 * 8
"""16-byte pieces of a row's 128 BF16 k (8 per half); a row's 128 codes are 8 pieces."""
A_COPIES = TOKENS * PIECES_PER_ROW // PRODUCER_THREADS
Q_COPIES = CTA_N * 8 // PRODUCER_THREADS
SELECT_LOW, SELECT_HIGH = 0x9180, 0xB3A2
"""``prmt`` selectors: codes 0, 1 (2, 3) of a word, each sign-extended to 16 bits, for ``place_selected``
(``gemm_wgmma.pair_selector(0)`` and ``(1)``; ``tests/numba_kernels/test_gemm_wgmma_ss_kernel.py`` checks)."""

sync_all = named_barrier.sync_function(THREADS)
arrive_all = named_barrier.arrive_function(THREADS)
sync_producers = named_barrier.sync_function(PRODUCER_THREADS)
mma_async_ss = wgmma.mma_async_ss_function(TOKENS)
wait_for_wgmma = wgmma.wait_group_function(0, TOKENS)
wait_for_all_copies = wait_group_function(0)
wait_for_older_copies = wait_group_function(1)


@inlined_device_function
def swizzled(row, piece):
    """The byte offset of 16-byte piece ``piece`` (0..7) of 128-byte row ``row`` in the 128-byte swizzle."""
    return row * uint32(wgmma.ROW_BYTES) + wgmma.swizzled_piece(row, piece) * uint32(wgmma.PIECE_BYTES)


@inlined_device_function
def stage_of(base, chunk):
    return base + (chunk % uint32(STAGES)) * uint32(STAGE_BYTES)


@inlined_device_function
def copy_chunk(smem8, a_words, q_words, scale_inv, chunk, stage, p, token0, row0, m, n, k, scale_row, block_divider):
    """Producer thread ``p``'s copies of chunk ``chunk`` into the stage at byte ``stage``: activation piece ``p % 16``
    of tokens ``p / 16 + 8 j``, code piece ``p % 8`` of weight rows ``p / 8 + 16 j`` (into the weights' second
    half), and for ``p < 16`` the scale of 8-row group ``p``. Rows past the end copy the last row."""
    piece = p % uint32(16)
    a_destination = (piece // uint32(8)) * uint32(HALF_BYTES) + swizzled(p // uint32(16), piece % uint32(8))
    for j in range(A_COPIES):
        token = p // uint32(16) + uint32(8 * j)  # steps of 8 rows: the same swizzle as row p / 16
        element = clamp32(token0 + token, m) * (k // uint32(4)) + chunk * uint32(K_CHUNK // 4) + uint32(2) * piece
        copy_16_cg_flat(smem8, stage + a_destination + uint32(8 * j * wgmma.ROW_BYTES), a_words, element)
    code_piece = p % uint32(8)
    q_destination = uint32(WEIGHTS_OFFSET + HALF_BYTES) + swizzled(p // uint32(8), code_piece)
    for j in range(Q_COPIES):
        row = p // uint32(8) + uint32(16 * j)
        element = clamp32(row0 + row, n) * (k // uint32(8)) + chunk * uint32(K_CHUNK // 8) + uint32(2) * code_piece
        copy_16_cg_flat(smem8, stage + q_destination + uint32(16 * j * wgmma.ROW_BYTES), q_words, element)
    if p < uint32(CTA_N // 8):
        column = divide_by_reciprocal(chunk, block_divider)  # chunk // chunks_per_block
        copy_4_ca(smem8, stage + uint32(SCALES_OFFSET) + uint32(4) * p, scale_inv, scale_row, column, 4)


@inlined_device_function
def place_row(smem32, stage, row):
    """Weight row ``row``'s 128 codes (in the weights' second half) -> its 128 BF16 patterns (``place_selected``:
    ``decode(q) * 2^-120``) over both halves, k ``16 i .. 16 i + 15`` of code piece ``i`` to BF16 pieces ``2 i, 2 i +
    1``, each one 128-bit store at a 32-bit address from the row's start. All loads first: the stores overwrite the
    codes."""
    codes_row = (stage + uint32(WEIGHTS_OFFSET + HALF_BYTES)) // uint32(4)
    words = cuda.local.array(32, uint32)
    for i in range(8):
        w0, w1, w2, w3 = load_shared_u32x4(smem32, codes_row + swizzled(row, uint32(i)) // uint32(4))
        words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3] = w0, w1, w2, w3
    row_start = (stage + uint32(WEIGHTS_OFFSET) + row * uint32(wgmma.ROW_BYTES)) // uint32(4)  # in words
    for i in range(8):
        for half_piece in range(2):  # BF16 piece 2 i + half_piece: k 16 i + 8 half_piece .., one 128-bit store
            bf16_piece = 2 * i + half_piece
            first, second = words[4 * i + 2 * half_piece], words[4 * i + 2 * half_piece + 1]
            destination = uint32(row_start + uint32((bf16_piece // 8) * HALF_BYTES // 4)
                                 + wgmma.swizzled_piece(row, uint32(bf16_piece % 8)) * uint32(wgmma.PIECE_BYTES // 4))
            store_shared_u32x4(smem32, destination,
                               place_selected(prmt(first, first, SELECT_LOW)),
                               place_selected(prmt(first, first, SELECT_HIGH)),
                               place_selected(prmt(second, second, SELECT_LOW)),
                               place_selected(prmt(second, second, SELECT_HIGH)))


@inlined_device_function
def finish_chunk(smem32, stage, chunk, p):
    """Producer: chunk ``chunk``'s copies are in (the caller waited for its own), every producer's too (the
    barrier); place row ``p``, make the writes visible to ``wgmma`` and hand the stage to the consumers."""
    sync_producers(uint32(PRODUCERS))
    place_row(smem32, stage, p)
    wgmma.proxy_fence()
    arrive_all(uint32(FULL) + chunk % uint32(STAGES))


@inlined_device_function
def multiply_chunk(smem64, stage, c_part, warpgroup):
    """Consumer: chunk ``chunk``'s 8 ``wgmma`` of the warpgroup's 64 weight rows by the 128 tokens into ``c_part``,
    the first overwriting it."""
    weights = stage + uint32(WEIGHTS_OFFSET) + warpgroup * uint32(64 * wgmma.ROW_BYTES)
    wgmma.fence()
    for j in range(K_STEPS):
        step = (j // 4) * HALF_BYTES + (j % 4) * wgmma.STEP_BYTES
        mma_async_ss(c_part, smem64, weights, step, stage, step, j > 0)
    wgmma.commit_group()


promote = promotion_function(ACCUMULATORS)


def kernel_function(output: str):
    """The Python source of the kernel before ``cuda.jit``; arguments as ``gemm_wgmma.kernel_function``'s."""
    if output not in ("f32", "bf16"):
        raise ValueError(f"no gemm_wgmma_ss variant for output={output!r}")
    store = store_function(TOKENS, output == "bf16")

    @inlined_device_function
    def scales(smemf, stage, warp_row):
        """The two scales of the warp's rows ``g`` and ``g + 8`` (8-row groups ``warp_row / 8`` and the next)."""
        first = (stage + uint32(SCALES_OFFSET)) // uint32(4) + warp_row // uint32(8)
        return at(smemf, first), at(smemf, first + uint32(1))

    def gemm_wgmma_ss_kernel(a_words, q_words, scale_inv, out, k, block_n, block_k):
        pdl.prologue()
        thread = uint32(cuda.threadIdx.x)
        warpgroup = thread // uint32(WARPGROUP_THREADS)
        m, n = uint32(out.shape[0]), uint32(out.shape[1])
        row0 = uint32(cuda.blockIdx.x) * uint32(CTA_N)
        token0 = uint32(cuda.blockIdx.y) * uint32(TOKENS)
        chunks = uint32(k // uint32(K_CHUNK))
        smem8 = cuda.shared.array(0, uint8)
        smem32 = cuda.shared.array(0, uint32)
        smem64 = cuda.shared.array(0, uint64)
        smemf = cuda.shared.array(0, float32)
        base = wgmma.atom_aligned_offset(smem64)  # the first stage's offset

        if warpgroup == uint32(CONSUMERS):  # the producer
            p = thread - uint32(CONSUMERS * WARPGROUP_THREADS)
            scale_row = divide_u32(clamp32(row0 + p * uint32(8), n), block_n)
            block_divider = reciprocal_u32(divide_u32(block_k, K_CHUNK))
            for chunk_index in range(chunks):
                chunk = uint32(chunk_index)
                if chunk >= uint32(STAGES):
                    sync_all(uint32(EMPTY) + chunk % uint32(STAGES))  # the consumers are done with chunk - 3
                copy_chunk(smem8, a_words, q_words, scale_inv, chunk, stage_of(base, chunk), p, token0, row0, m, n, k,
                           scale_row, block_divider)
                commit_group()
                if chunk >= uint32(1):
                    wait_for_older_copies()  # chunk - 1's copies are in; chunk's may still fly
                    finish_chunk(smem32, stage_of(base, chunk - uint32(1)), chunk - uint32(1), p)
            wait_for_all_copies()
            finish_chunk(smem32, stage_of(base, chunks - uint32(1)), chunks - uint32(1), p)
            return

        warp, lane = thread // uint32(WARP_SIZE), thread % uint32(WARP_SIZE)
        g, t = lane >> uint32(2), lane & uint32(3)
        warp_row = warp * uint32(16)  # the warp's first weight row in the CTA
        c_part = cuda.local.array(ACCUMULATORS, float32)
        c_fin = cuda.local.array(ACCUMULATORS, float32)
        for i in range(ACCUMULATORS):
            c_fin[i] = float32(0.0)
            c_part[i] = float32(0.0)
        # Chunk 0 outside the loop, so that the loop's wgmma waits sit on no branch of their own.
        sync_all(uint32(FULL))
        multiply_chunk(smem64, base, c_part, warpgroup)
        for chunk_index in range(1, chunks):
            chunk = uint32(chunk_index)
            sync_all(uint32(FULL) + chunk % uint32(STAGES))
            wait_for_wgmma(c_part)  # chunk - 1's wgmma are done with c_part and with their stage
            previous = chunk - uint32(1)
            s_top, s_bottom = scales(smemf, stage_of(base, previous), warp_row)
            if previous + uint32(STAGES) < chunks:  # the producer waits for this stage again
                arrive_all(uint32(EMPTY) + previous % uint32(STAGES))
            promote(c_part, c_fin, s_top, s_bottom)
            multiply_chunk(smem64, stage_of(base, chunk), c_part, warpgroup)
        wait_for_wgmma(c_part)
        s_top, s_bottom = scales(smemf, stage_of(base, chunks - uint32(1)), warp_row)
        promote(c_part, c_fin, s_top, s_bottom)
        store(out, c_fin, token0, row0 + warp_row, g, t)

    return gemm_wgmma_ss_kernel


@functools.lru_cache(maxsize=None)
def compiled_kernel(output: str):
    options = {} if bits.SIMULATOR else {"launch_bounds": (THREADS, 1)}
    return cuda.jit(kernel_function(output), **options)


def gemm_wgmma_ss(a, q, scale_inv, out, block=(128, 128), stream=0):
    """``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T``, the weights placed by a producer warpgroup; returns
    ``out``. Arguments and checks as ``gemm_wgmma.gemm_wgmma``'s (no tiling: one shape)."""
    problem = checked_problem(a, q, scale_inv, out, block, "gemm_wgmma_ss")
    grid = check_launch(problem.m, problem.n, problem.k, TOKENS, CTA_N)
    kernel = compiled_kernel(problem.output)
    args = kernel_arguments(problem)
    _allow_shared_memory(kernel, args, SHARED_BYTES)
    pdl.launch(kernel, grid, (THREADS,), stream, *args, shared_bytes=SHARED_BYTES)
    return problem.out
