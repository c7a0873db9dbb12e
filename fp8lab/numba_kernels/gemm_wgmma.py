"""Warpgroup tensor-core W8A16 GEMM for prefill sizes: ``wgmma`` with the FP8 weights placed into registers.

Computes ``fp8lab.reference.blockwise.gemm`` in the float32 order of ``fp8lab.simulators.gemm_mma`` (the same
simulator as ``gemm_mma``: the order per output is unchanged). Launch: grid ``(ceil(N / CTA_N), ceil(M /
TOKENS))`` x ``128 warpgroups`` threads, ``launch_info``'s dynamic shared memory; sm_90 (Hopper) only. Checked
(``tests/numba_kernels/test_gemm_wgmma_kernel.py``): bit for bit ``fp8lab.simulators.gemm_mma.gemm_mma`` in the
CUDA simulator, the oracle within the tensor-core budget on a GPU.

What it computes::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

``a`` BF16 bits ``[M, K]``, ``q`` E4M3 codes ``[N, K]``, ``out`` float32 or BF16 bits (rounded once).

How (the kernel computes ``out^T``, weights as the 64-row operand, as vLLM's Machete does for its W4A16):

- **Tiles**: a CTA owns ``CTA_N = 64 warpgroups`` weight rows times ``TOKENS`` (64, 128 or 192) activation rows
  (by default 128, or 64 where 128-token tiles would leave SMs idle: ``default_tiling``).
  Warpgroup ``w`` multiplies weight rows ``64 w .. 64 w + 63`` by all ``TOKENS`` tokens with one
  ``wgmma.m64n{TOKENS}k16`` per k16 step (``fp8lab.numba_kernels.wgmma``; two independent ``m64n64k16`` chains
  instead were 1 to 10% slower on an H100, ``bench/RESULTS.md``, twenty-second session): A = the weights, in
  registers, B = the activations, from shared memory. Warp ``v`` of a warpgroup holds the A fragments of its 16
  weight rows, which it alone needs: it reads a row's 16 codes of a k16 step in one 128-bit shared load, picks its
  two pairs with ``prmt`` and places them into BF16 patterns (``place_selected``: ``decode(q) * 2^-120`` exactly, as
  ``gemm_mma.place_code_pair``), 32 registers per 128-wide chunk.
- **K loop**, ``stages`` deep (3 to 6): chunk ``c`` (128 k) lives in stage ``c % stages``: the activations in two
  128-byte-swizzled atoms of 64 k (``wgmma``'s B layout; ``cp.async`` writes each 16-byte piece where the swizzle
  puts it), the weight codes in rows of 144 bytes, and one block scale per 8 weight rows. Iteration ``c``:

  1. ``cp.async.wait_group(stages - 3)``, ``fence.proxy.async`` (the copies are generic-proxy writes that
     ``wgmma`` reads through the async proxy), ``syncthreads``: chunk ``c`` is in, and every warpgroup has
     waited for its chunk ``c - 2`` ``wgmma``;
  2. copy chunk ``c + stages - 2`` into stage ``(c - 2) % stages`` (free by step 1) and commit;
  3. wait for chunk ``c - 1``'s ``wgmma``, promote it: ``c_fin = fma(s * 2^120, c_part, c_fin)`` with its weight
     row's scale (stage ``(c - 1) % stages`` is intact until iteration ``c + 1``);
  4. place chunk ``c``'s codes into the A registers. Not earlier: the A registers of chunk ``c - 1``'s ``wgmma``
     are the same PTX registers (one loop body), and writing them before the wait is undefined; on an H100 it
     gave wrong results (``bench/RESULTS.md``, nineteenth session);
  5. issue chunk ``c``'s 8 ``wgmma`` into ``c_part`` (the first with ``accumulate`` off: ``c_part = 0``) and commit.

  With ``parts`` > 1, steps 4 and 5 go part by part (``8 / parts`` k16 steps each): part ``p + 1``'s registers
  are placed while part ``p``'s ``wgmma`` run, which read other registers. (A second set of A registers for chunk
  ``c + 1``, two chunks per loop pass, was slower: 130 to 200 TFLOP/s against 300 on an H100, from its spills and
  the 64-token tiles it needed to fit; ``bench/RESULTS.md``, twentieth session.)

  So per output: chunks in ascending K, per chunk 8 k16 steps from ``c_part = 0``, then one promotion fma:
  ``gemm_mma``'s order exactly (the model's k16 step is one exact sum of 16 products, the same whichever operand
  holds the weights).
- **Epilogue**: lane ``(g, t)`` of warp ``v`` holds ``out^T`` rows (weight rows) ``g`` and ``g + 8`` of its 16
  and tokens ``8 b + 2 t + {0, 1}``; stores only inside ``out``. Weight rows and tokens past the end are copies of
  the last one (each output reads only its own row and token, and those outputs are never stored).
- **Copies without arithmetic**: which pieces a thread copies is the same in every chunk (``thread_copies``), so
  the loop forms a copy's addresses with one multiply-add from a precomputed 32-bit element index (flat sources,
  ``cp_async.copy_16_cg_flat``), and each ``wgmma`` descriptor with one addition (``wgmma``'s two offsets). With
  the promotion's single fma and the three-instruction placement that took the loop from 627 to 354 SASS
  instructions per warp and chunk (``bench/RESULTS.md``, twenty-second session): with 16 ``wgmma`` per chunk and
  SM, instruction issue, not the tensor cores, had been the bound.

Shared memory, one stage (bytes; stages are multiples of 1,024, after a pad that aligns the first to 1,024 in
the shared window)::

    0                         activations: atom 0 (k 0..63), TOKENS rows x 128 bytes, swizzled
    TOKENS * 128              activations: atom 1 (k 64..127)
    TOKENS * 256              codes: CTA_N rows x 144 bytes (128 codes + 16 pad: a warp's 128-bit loads of 8 rows,
                              each row read by its 4 lanes, fall into 8 distinct 16-byte bank groups)
    TOKENS * 256 + CTA_N*144  scales: CTA_N / 8 float32

Three variants were measured on an H100 and removed (``bench/RESULTS.md``, twenty-fourth session): two sets of A
registers, the next chunk placed while this one's ``wgmma`` run (5 to 9% slower at M = 2,048 on the four Qwen3-8B
shapes); a token-major CTA order, the token tiles of one weight tile on consecutive CTAs (2 to 5% slower on three
shapes, 6% faster on 4096 x 12288 only); and SwiGLU fused into the gate/up GEMM's epilogue (equal to this GEMM then
``layers.silu_mul`` within 1% at M = 1,000 and 2,048, so the engine keeps the two launches). A fourth, the two
warpgroups taking turns to issue their ``wgmma`` (named barriers, FlashAttention-3's ping-pong), was 3 to 15% slower
(twenty-fifth session): the warpgroups overlap on their own, and the placement is on the critical path. Dated
measurements are in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, uint8, uint32, uint64

from . import bits, pdl, wgmma
from .arguments import check_gemm, require_load_alignment
from .bits import prmt
from .cp_async import (
    commit_group,
    copy_4_ca,
    copy_16_cg_flat,
    wait_group_function,
)
from .gemm_mma import (
    _allow_shared_memory,
    at,
    fold_scale,
    inlined_device_function,
)
from .mathops import (
    divide_by_reciprocal,
    divide_u32,
    f32_to_bf16_bits_rne,
    reciprocal_u32,
)
from .splitkv import device_num_sms
from .warp import WARP_SIZE, load_shared_u32x4

K_CHUNK = 128
K_STEPS_PER_CHUNK = K_CHUNK // wgmma.K_STEP
WARPGROUP_THREADS = 4 * WARP_SIZE
ROWS_PER_WARP = 16
CODE_ROW_BYTES = K_CHUNK + 16
"""144: a weight row's 128 codes + 16 bytes of padding."""
PIECES_PER_TOKEN = 2 * K_CHUNK // wgmma.PIECE_BYTES
"""16 pieces of 16 bytes per activation row and chunk (8 per swizzle atom)."""
PIECES_PER_CODE_ROW = K_CHUNK // wgmma.PIECE_BYTES
BF16_UNPLACE = np.float32(2.0 ** 120)
"""Bit placement makes a BF16 pattern worth ``decode(q) * 2^-120``; the promotion gives the ``2^120`` back."""
FOLD_LIMIT = np.float32(2.0 ** 8)
"""Scales below this in magnitude take the ``2^120`` exactly (``2^8 * 2^120`` is float32's overflow)."""
BLOCK_N_MULTIPLE = 8
"""Eight weight rows share one scale (a scale per 8 rows is what the stage holds)."""
MAX_SHARED_PER_CTA = 227 * 1024
MAX_GRID_Y = 65535


class Tiling(NamedTuple):
    """Compile-time shape knobs; none changes a bit of the result."""

    tokens: int = 128
    """Activation rows per CTA: the ``N`` of ``wgmma.m64nNk16`` (64, 128 or 192; 192 with two warpgroups needs 3
    stages, all the shared memory there is, and spills 32 bytes: on an H100 2 to 4% faster than 128 on the two
    large Qwen3-8B shapes at M = 2,048, up to 45% slower at M = 1,000, ``bench/RESULTS.md``, twenty-fifth session)."""
    warpgroups: int = 2
    """Warpgroups per CTA (1 or 2), stacked in weight rows: ``CTA_N = 64 warpgroups``."""
    stages: int = 4
    """Shared-memory stages, 3 to 6 (``stages - 2`` chunks copied ahead of the one placed)."""
    parts: int = 4
    """A chunk's A registers are placed and its ``wgmma`` issued in ``parts`` parts (1, 2 or 4) of ``8 / parts`` k16
    steps: part ``p + 1`` is placed while part ``p``'s ``wgmma`` run (other registers than theirs). Two parts were 1
    to 6% faster than one on an H100 at M = 2,048, four slower (``bench/RESULTS.md``, twentieth session); with the
    twenty-second session's cheaper loop, four are the fastest: 2 to 11% faster than two at M = 2,048, up to 13% at
    512, on the four Qwen3-8B shapes."""

    @property
    def cta_n(self) -> int:
        return wgmma.M_ROWS * self.warpgroups

    @property
    def threads(self) -> int:
        return WARPGROUP_THREADS * self.warpgroups

    @property
    def code_offset(self) -> int:
        return 2 * wgmma.ROW_BYTES * self.tokens

    @property
    def scale_offset(self) -> int:
        return self.code_offset + self.cta_n * CODE_ROW_BYTES

    @property
    def stage_bytes(self) -> int:
        used = self.scale_offset + 4 * (self.cta_n // 8)
        return -(-used // wgmma.ATOM_BYTES) * wgmma.ATOM_BYTES

    @property
    def shared_bytes(self) -> int:
        """The stages plus 1,024 bytes of room to align them."""
        return self.stages * self.stage_bytes + wgmma.ATOM_BYTES

    def check(self) -> Tiling:
        for name, value, choices in (("tokens", self.tokens, wgmma.N_CHOICES), ("warpgroups", self.warpgroups, (1, 2)),
                                     ("stages", self.stages, (3, 4, 5, 6)), ("parts", self.parts, (1, 2, 4))):
            if value not in choices:
                raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
        if self.shared_bytes > MAX_SHARED_PER_CTA:
            raise ValueError(f"stages: {self} needs {self.shared_bytes} bytes of shared memory, more than the "
                             f"{MAX_SHARED_PER_CTA} a CTA may have")
        return self


SMALL_GRID_TILING = Tiling(64, 2, 5)
"""The tiling ``default_tiling`` gives a grid of 128-token tiles that leaves SMs idle: half the tokens per CTA, so
twice the CTAs (five stages: the shared memory the smaller activation tiles leave room for)."""


def default_tiling(m: int, n: int, sms: int) -> Tiling:
    """The tiling ``gemm_wgmma`` uses when none is given, for ``M`` tokens, ``N`` weight rows and ``sms`` SMs:
    ``Tiling()`` (128-token tiles), or ``SMALL_GRID_TILING`` (64) where its grid of 64-token tiles, twice the CTAs,
    still fits one wave (at most one CTA per SM: either tiling's shared memory holds one) and ``M`` is more than one
    64-token tile. A CTA of 64 tokens runs at about three quarters of a 128-token CTA's rate (``bench/RESULTS.md``,
    twenty-first session), so halving each CTA's work pays only while no second wave comes of it: Qwen3-0.6B's
    o_proj and down_proj (1,024 rows, 8 weight tiles) at a 1,000-token prefill are 64 CTAs of 128 tokens on 132
    SMs, or 128 of 64. No tiling changes a bit of the result."""
    small = SMALL_GRID_TILING
    ctas = -(-m // small.tokens) * -(-n // small.cta_n)
    if m > small.tokens and ctas <= sms:
        return small
    return Tiling()


class LaunchInfo(NamedTuple):
    grid: tuple[int, int]
    block: tuple[int]
    shared_bytes: int
    tiling: Tiling


PLACED_MASK_X2 = 0x87F087F0
"""The bits of two BF16 patterns that bit placement can set: sign (15) and magnitude (10..4), per half."""


@inlined_device_function
def place_selected(spread):
    """Two E4M3 codes sign-extended to 16 bits (``spread``'s halves: a code in the low byte, its sign replicated
    through the high byte) -> two BF16 patterns, ``gemm_mma.place_code_pair``'s: shifted left by 4, a code's
    magnitude lies at bits 10..4 and a copy of its sign at bit 15; the mask drops the other copies (bits 14..11) and
    what the shift brings in. A shift and a mask (three instructions with the ``prmt``, where sign and magnitude
    masked apart took four)."""
    return (spread << uint32(4)) & uint32(PLACED_MASK_X2)


@inlined_device_function
def clamp32(row, rows):
    """``min(row, rows - 1)`` in 32-bit unsigned arithmetic (``rows >= 1``): the row a copy past the end reads."""
    return row if row < rows else rows - uint32(1)


@inlined_device_function
def pair_selector(t):
    """``prmt``'s selector that moves codes ``2t`` and ``2t + 1`` of eight (two words) into bytes 0 and 2 and their
    signs through bytes 1 and 3 (a selector nibble's bit 3 replicates the selected byte's sign bit)."""
    return (2 * t) | (8 | 2 * t) << 4 | (2 * t + 1) << 8 | (8 | (2 * t + 1)) << 12


def promotion_function(accumulators: int):
    """``promote(c_part, c_fin, s_top, s_bottom)``: ``c_fin = fma(s * 2^120, c_part, c_fin)``
    (``fp8lab.simulators.gemm_mma.promote``) over ``accumulators`` per lane, ``s_top`` for the lane's row ``g``,
    ``s_bottom`` for ``g + 8``. One fma per accumulator where both scales fold exactly (``|s| < 2^8``: every real
    checkpoint); else the general form, with a multiply per accumulator (``gemm_mma.fold_scale``)."""

    @inlined_device_function
    def promote(c_part, c_fin, s_top, s_bottom):
        if abs(s_top) < FOLD_LIMIT and abs(s_bottom) < FOLD_LIMIT:
            top, bottom = s_top * BF16_UNPLACE, s_bottom * BF16_UNPLACE  # exact
            for i in range(accumulators):
                c_fin[i] = cuda.fma(bottom if (i >> 1) & 1 else top, c_part[i], c_fin[i])
        else:
            top, top_restore = fold_scale(s_top, BF16_UNPLACE, FOLD_LIMIT)
            bottom, bottom_restore = fold_scale(s_bottom, BF16_UNPLACE, FOLD_LIMIT)
            for i in range(accumulators):
                if (i >> 1) & 1:
                    c_fin[i] = cuda.fma(bottom, c_part[i] * bottom_restore, c_fin[i])  # * 1 or * 2^120: exact
                else:
                    c_fin[i] = cuda.fma(top, c_part[i] * top_restore, c_fin[i])

    return promote


def store_function(tokens: int, bf16_output: bool):
    """``store(out, c_fin, token0, row0, g, t)``: lane ``(g, t)``'s accumulator ``4 b + i`` is ``out^T[row0 + g + 8 (i
    >> 1), token0 + 8 b + 2 t + (i & 1)]``; only inside ``out``, float32 or rounded once to BF16 bits. (Two nested
    loops, not one of ``tokens / 2``: the compiler unrolls them fully, so ``c_fin`` keeps constant indices and stays
    in registers.)"""

    @inlined_device_function
    def store(out, c_fin, token0, row0, g, t):
        for b in range(tokens // 8):
            for i in range(4):
                row = row0 + g + 8 * (i >> 1)
                token = token0 + 8 * b + 2 * t + (i & 1)
                if token < out.shape[0] and row < out.shape[1]:
                    if bf16_output:
                        out[token, row] = f32_to_bf16_bits_rne(c_fin[4 * b + i])  # a NaN stays NaN
                    else:
                        out[token, row] = c_fin[4 * b + i]

    return store


def check_launch(m: int, n: int, k: int, tokens: int, cta_n: int) -> tuple[int, int]:
    """The grid ``(ceil(N / cta_n), ceil(M / tokens))`` of a warpgroup GEMM launch; a ``ValueError`` for a shape it
    cannot take (``K`` not a positive multiple of 128, too many token tiles, element indices past 32 bits)."""
    if m < 1 or n < 1 or k < K_CHUNK or k % K_CHUNK:
        raise ValueError(f"shape: expected M, N >= 1 and K a positive multiple of {K_CHUNK}, got {(m, n, k)}")
    grid = (-(-n // cta_n), -(-m // tokens))
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"a: M = {m} needs {grid[1]} token tiles, more than the grid's {MAX_GRID_Y}")
    for name, rows, row_words in (("a", m, k // 4), ("q", n, k // 8)):
        if rows * row_words >= 2**32:
            raise ValueError(f"{name}: {rows} x {k} is {rows * row_words} 8-byte words, more than the kernel's 32-bit "
                             "element indices reach (2^32)")
    return grid


def launch_info(m: int, n: int, k: int, tiling: Tiling | None = None) -> LaunchInfo:
    """Grid ``(ceil(N / CTA_N), ceil(M / tokens))``, block, dynamic shared memory and the tiling (None:
    ``default_tiling`` for this GPU's SMs)."""
    if m < 1 or n < 1 or k < K_CHUNK or k % K_CHUNK:  # before the tiling, so a bad shape is named first
        raise ValueError(f"shape: expected M, N >= 1 and K a positive multiple of {K_CHUNK}, got {(m, n, k)}")
    tiling = Tiling(*(tiling or default_tiling(m, n, device_num_sms()))).check()
    grid = check_launch(m, n, k, tiling.tokens, tiling.cta_n)
    return LaunchInfo(grid, (tiling.threads,), tiling.shared_bytes, tiling)


def kernel_function(tiling: Tiling, output: str):
    """The Python source of one variant before ``cuda.jit``. Arguments: ``(a_words uint64 [M * K/4], q_words uint64
    [N * K/8]`` (the flat arrays), ``scale_inv float32 [ceil(N/BN), ceil(K/BK)], out [M, N], k uint32, block_n
    uint32, block_k uint32)``."""
    if output not in ("f32", "bf16"):
        raise ValueError(f"no gemm_wgmma variant for output={output!r}")
    tiling = Tiling(*tiling).check()
    tokens, stages, threads, cta_n = tiling.tokens, tiling.stages, tiling.threads, tiling.cta_n
    stage_bytes, code_offset, scale_offset = tiling.stage_bytes, tiling.code_offset, tiling.scale_offset
    accumulators = tokens // 2
    a_registers = 4 * K_STEPS_PER_CHUNK  # 32: 4 per k16 step
    parts = tiling.parts
    steps_per_part = K_STEPS_PER_CHUNK // parts
    a_copies = tokens * PIECES_PER_TOKEN // threads  # 16-byte copies per thread and chunk
    q_copies = cta_n * PIECES_PER_CODE_ROW // threads
    a_token_step, q_row_step = threads // PIECES_PER_TOKEN, threads // PIECES_PER_CODE_ROW
    a_copy_stride, q_copy_stride = a_token_step * wgmma.ROW_BYTES, q_row_step * CODE_ROW_BYTES  # in a stage
    scale_groups = cta_n // 8
    atom_bytes = tokens * wgmma.ROW_BYTES  # one 64-k atom of every token row
    mma_async = wgmma.mma_async_function(tokens)
    wait_for_wgmma = wgmma.wait_group_function(0, tokens)
    wait_for_chunk = wait_group_function(stages - 3)
    bf16_output = output == "bf16"

    @inlined_device_function
    def stage_of(base, chunk):
        """The byte offset of chunk ``chunk``'s stage (``chunk % stages``)."""
        return base + (chunk % uint32(stages)) * stage_bytes

    @inlined_device_function
    def copy_chunk(smem8, a_words, q_words, scale_inv, chunk, stage_base, copies, thread, scale_row,
                   block_divider):
        """This thread's ``cp.async`` copies of chunk ``chunk`` into the stage at byte ``stage_base``: activation and
        code pieces, cached in L2 only (``cg``: a CTA reads each piece once, and the CTAs that share an activation
        tile do not share an SM; caching the activations in L1 too made the kernel 13 to 16% slower on an H100,
        ``bench/RESULTS.md``, twenty-first session), and threads ``0 .. CTA_N / 8 - 1`` one scale each. Where each
        piece comes from and goes is fixed per thread (``thread_copies``): a chunk only moves the sources by its
        128 k. Rows past the end copy the last row again: their outputs are never stored, and no other output
        reads them."""
        a_first, q_first, a_destination, q_destination = copies
        a_chunk = a_words[chunk * uint32(K_CHUNK // 4):]  # the chunk's column in the first row, and on
        q_chunk = q_words[chunk * uint32(K_CHUNK // 8):]
        for j in range(a_copies):
            copy_16_cg_flat(smem8, stage_base + a_destination + j * a_copy_stride, a_chunk, a_first[j])
        for j in range(q_copies):
            copy_16_cg_flat(smem8, stage_base + q_destination + j * q_copy_stride, q_chunk, q_first[j])
        if thread < scale_groups:
            # chunk // chunks_per_block without a division in the loop: exact while chunk * chunks_per_block < 2^32
            # (K < 2^23)
            column = divide_by_reciprocal(chunk, block_divider)
            copy_4_ca(smem8, stage_base + scale_offset + 4 * thread, scale_inv, scale_row, column, 4)

    @inlined_device_function
    def thread_copies(thread, token0, row0, m, n, k, a_first, q_first):
        """Where this thread's copies of every chunk go in a stage and come from in chunk 0. The ``threads``
        threads copy a chunk's pieces in order (activation piece ``p`` of token ``t`` is number ``16 t + p``, code
        piece ``p`` of row ``r`` number ``8 r + p``), ``threads`` at a time: so a thread's piece within a row is
        the same in all its copies, and its rows step by ``threads / 16`` tokens (a multiple of 8: the swizzle of
        the piece is the same too) and ``threads / 8`` weight rows. Fills ``a_first`` and ``q_first`` (the source
        elements, uint64 words of the flat arrays, rows clamped to the last) and returns the stage offsets."""
        a_token, a_piece = thread // uint32(PIECES_PER_TOKEN), thread % uint32(PIECES_PER_TOKEN)
        a_destination = ((a_piece // uint32(8)) * uint32(atom_bytes) + a_token * uint32(wgmma.ROW_BYTES)
                         + wgmma.swizzled_piece(a_token, a_piece % uint32(8)) * uint32(wgmma.PIECE_BYTES))
        for j in range(a_copies):
            a_first[j] = clamp32(token0 + a_token + uint32(j * a_token_step), m) * (k // uint32(4)) + uint32(2) * a_piece
        q_row, q_piece = thread // uint32(PIECES_PER_CODE_ROW), thread % uint32(PIECES_PER_CODE_ROW)
        q_destination = uint32(code_offset) + q_row * uint32(CODE_ROW_BYTES) + q_piece * uint32(wgmma.PIECE_BYTES)
        for j in range(q_copies):
            row = row0 + q_row + uint32(j * q_row_step)
            q_first[j] = clamp32(row, n) * (k // uint32(8)) + uint32(2) * q_piece
        return a_first, q_first, a_destination, q_destination

    @inlined_device_function
    def receive_chunk(smem8, a_words, q_words, scale_inv, chunk, base, copies, thread, scale_row, block_divider,
                      chunks):
        """Steps 1 and 2 of iteration ``chunk``: wait until the chunk is in shared memory and visible to ``wgmma``
        (every warpgroup has then also waited for its chunk ``chunk - 2`` ``wgmma``), then copy chunk
        ``chunk + stages - 2`` into the stage that one used, and commit (an empty group past the end, so that the
        wait's count stays right)."""
        wait_for_chunk()  # my copies of `chunk` have landed ...
        wgmma.proxy_fence()  # ... are visible to wgmma's reads ...
        cuda.syncthreads()  # ... and so are everyone's
        ahead = chunk + uint32(stages - 2)
        if ahead < chunks:
            copy_chunk(smem8, a_words, q_words, scale_inv, ahead, stage_of(base, ahead),
                       copies, thread, scale_row, block_divider)
        commit_group()

    @inlined_device_function
    def place_part(smem32, stage_base, a_regs, warp_row, g, selector, part):
        """The A registers of the warp's 16 weight rows for the k16 steps ``j`` of part ``part`` of the chunk: step
        ``j``'s registers hold codes (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..) of the step as BF16
        patterns. A lane reads each row's 16 codes of a step in one 128-bit load (the row's four lanes read the same
        bytes: a broadcast) and picks its pairs with ``prmt`` (``selector``: codes ``2t`` and ``2t+1``, each
        sign-extended to 16 bits, ``place_selected``)."""
        top = (stage_base + code_offset + (warp_row + g) * CODE_ROW_BYTES) // 4
        bottom = top + 8 * CODE_ROW_BYTES // 4
        for i in range(steps_per_part):
            j = part * steps_per_part + i
            w0, w1, w2, w3 = load_shared_u32x4(smem32, top + 4 * j)
            v0, v1, v2, v3 = load_shared_u32x4(smem32, bottom + 4 * j)
            a_regs[4 * j] = place_selected(prmt(w0, w1, selector))
            a_regs[4 * j + 1] = place_selected(prmt(v0, v1, selector))
            a_regs[4 * j + 2] = place_selected(prmt(w2, w3, selector))
            a_regs[4 * j + 3] = place_selected(prmt(v2, v3, selector))

    @inlined_device_function
    def multiply_part(smem64, stage_base, a_regs, c_part, part):
        """The ``wgmma`` k16 steps of part ``part`` into ``c_part``, the chunk's first overwriting it (``c_part = 0 +
        ...``); the fence orders the part's register writes before them."""
        wgmma.fence()
        for i in range(steps_per_part):
            j = part * steps_per_part + i
            start = (j // 4) * atom_bytes + (j % 4) * wgmma.STEP_BYTES
            mma_async(c_part, a_regs, 4 * j, smem64, stage_base, start, j > 0)

    @inlined_device_function
    def place_and_multiply(smem32, smem64, stage_base, a_regs, c_part, warp_row, g, selector):
        """Steps 4 and 5 of an iteration: part by part, place the chunk's codes and issue their ``wgmma`` (part ``p +
        1``'s placement runs while part ``p``'s ``wgmma`` do), then commit the chunk's ``wgmma`` as one group."""
        for part in range(parts):
            place_part(smem32, stage_base, a_regs, warp_row, g, selector, part)
            multiply_part(smem64, stage_base, a_regs, c_part, part)
        wgmma.commit_group()

    promote_scaled = promotion_function(accumulators)
    store = store_function(tokens, bf16_output)

    @inlined_device_function
    def promote(smemf, stage_base, c_part, c_fin, warp_row):
        """``promote_scaled`` with the stage's scales of the warp's rows g and g + 8: 8-row groups ``warp_row / 8``
        and ``warp_row / 8 + 1``."""
        s_top = at(smemf, (stage_base + scale_offset) // 4 + warp_row // 8)
        s_bottom = at(smemf, (stage_base + scale_offset) // 4 + warp_row // 8 + 1)
        promote_scaled(c_part, c_fin, s_top, s_bottom)

    def gemm_wgmma_kernel(a_words, q_words, scale_inv, out, k, block_n, block_k):
        pdl.prologue()
        thread = uint32(cuda.threadIdx.x)
        warp, lane = thread // WARP_SIZE, thread % WARP_SIZE
        g, t = lane >> 2, lane & 3
        selector = pair_selector(t)
        warp_row = warp * ROWS_PER_WARP  # the warp's first weight row in the CTA (warpgroup w: rows 64 w ..)
        m, n = uint32(out.shape[0]), uint32(out.shape[1])
        row0 = uint32(cuda.blockIdx.x) * uint32(cta_n)
        token0 = uint32(cuda.blockIdx.y) * uint32(tokens)
        chunks = uint32(k // uint32(K_CHUNK))
        # Threads 0 .. CTA_N / 8 - 1 copy the scales of 8-row group `thread` (clamped like the rows). All divisions
        # in 32 bits: a 64-bit one is a subroutine call, which makes ptxas serialize every wgmma.
        scale_row = divide_u32(clamp32(row0 + thread * uint32(8), n), block_n)
        block_divider = reciprocal_u32(divide_u32(block_k, K_CHUNK))
        copies = thread_copies(thread, token0, row0, m, n, k, cuda.local.array(a_copies, uint32),
                               cuda.local.array(q_copies, uint32))

        smem8 = cuda.shared.array(0, uint8)
        smem64 = cuda.shared.array(0, uint64)
        smem32 = cuda.shared.array(0, uint32)
        smemf = cuda.shared.array(0, float32)
        base = wgmma.atom_aligned_offset(smem64)  # the first stage's offset
        a_regs = cuda.local.array(a_registers, uint32)
        c_part = cuda.local.array(accumulators, float32)
        c_fin = cuda.local.array(accumulators, float32)
        for i in range(accumulators):
            c_fin[i] = float32(0.0)
            c_part[i] = float32(0.0)

        for first in range(stages - 2):  # prologue: chunks 0 .. stages - 3, one group each
            if uint32(first) < chunks:
                copy_chunk(smem8, a_words, q_words, scale_inv, uint32(first), base + first * stage_bytes, copies,
                           thread, scale_row, block_divider)
            commit_group()

        # Chunk 0 outside the loop, so that the loop's wgmma waits sit on no branch (ptxas serializes wgmma
        # that depend on a wait in a divergent-looking path).
        receive_chunk(smem8, a_words, q_words, scale_inv, uint32(0), base, copies, thread, scale_row,
                      block_divider, chunks)
        place_and_multiply(smem32, smem64, base, a_regs, c_part, warp_row, g, selector)
        for chunk_index in range(1, chunks):
            chunk = uint32(chunk_index)
            stage_base = stage_of(base, chunk)
            receive_chunk(smem8, a_words, q_words, scale_inv, chunk, base, copies, thread, scale_row,
                          block_divider, chunks)
            wait_for_wgmma(c_part)  # chunk - 1's wgmma are done with c_part and with the A registers
            promote(smemf, stage_of(base, chunk - uint32(1)), c_part, c_fin, warp_row)
            place_and_multiply(smem32, smem64, stage_base, a_regs, c_part, warp_row, g, selector)

        wait_for_wgmma(c_part)
        promote(smemf, stage_of(base, chunks - uint32(1)), c_part, c_fin, warp_row)
        store(out, c_fin, token0, row0 + warp_row, g, t)

    return gemm_wgmma_kernel


def kernel_signature(output: str) -> str:
    """The Numba signature the host wrapper launches with (for ``cuda.compile_ptx``)."""
    out_type = {"f32": "float32", "bf16": "uint16"}[output]
    return f"void(uint64[::1], uint64[::1], float32[:, ::1], {out_type}[:, ::1], uint32, uint32, uint32)"


def checked_problem(a, q, scale_inv, out, block, kernel: str):
    """``check_gemm`` for a warpgroup GEMM named ``kernel``: BF16 activations, a float32 or BF16 ``out``, a scale per
    8 weight rows or more, ``a`` and ``q`` 16-byte aligned on the device."""
    problem = check_gemm(a, q, scale_inv, out, block, kernel=kernel, activations=("bf16",),
                         block_n_multiple=BLOCK_N_MULTIPLE)
    if problem.output not in ("f32", "bf16"):
        raise ValueError(f"out: {kernel} writes float32 or BF16 bits, got {problem.output}")
    require_load_alignment("a", problem.a, kernel)
    require_load_alignment("q", problem.q, kernel)
    return problem


def kernel_arguments(problem) -> tuple:
    """The arguments of ``kernel_signature``: the flat uint64 words of ``a`` and ``q``, the scales, ``out`` (BF16 as
    uint16 bits), ``K`` and the scale block."""
    out_view = problem.out.view(np.uint16) if problem.output == "bf16" else problem.out
    return (problem.a.view(np.uint64).reshape(-1), problem.q.view(np.uint64).reshape(-1), problem.scale_inv, out_view,
            np.uint32(problem.k), np.uint32(problem.block[0]), np.uint32(problem.block[1]))


@functools.lru_cache(maxsize=None)
def compiled_kernel(tiling: Tiling, output: str):
    options = {} if bits.SIMULATOR else {"launch_bounds": (tiling.threads, 1)}
    return cuda.jit(kernel_function(tiling, output), **options)


def gemm_wgmma(a, q, scale_inv, out, block=(128, 128), tiling: Tiling | None = None, stream=0):
    """``out[M, N] = a[M, K] @ (decode(q) * scale_inv)^T`` with ``wgmma``; returns ``out``.

    ``a``: BF16 bits (``uint16``/``int16``) ``[M, K]``; ``q``: ``uint8 [N, K]``; ``scale_inv``: ``float32
    [ceil(N/BN), ceil(K/BK)]``; ``out``: ``float32`` or BF16 bits ``[M, N]``; C-contiguous NumPy, Numba device or
    ``__cuda_array_interface__`` arrays (device data 16-byte aligned). ``block = (BN, BK)``: ``BN`` a multiple of
    8, ``BK`` of 128; ``K`` a multiple of 128. ``tiling``: ``Tiling`` (default: ``default_tiling`` for this
    GPU's SMs). Needs a
    compute-capability-9.0 GPU (or the CUDA simulator). Every problem is a ``ValueError`` raised before launch.
    """
    problem = checked_problem(a, q, scale_inv, out, block, "gemm_wgmma")
    launch = launch_info(problem.m, problem.n, problem.k, tiling)
    kernel = compiled_kernel(launch.tiling, problem.output)
    args = kernel_arguments(problem)
    _allow_shared_memory(kernel, args, launch.shared_bytes)
    pdl.launch(kernel, launch.grid, launch.block, stream, *args, shared_bytes=launch.shared_bytes)
    return problem.out
