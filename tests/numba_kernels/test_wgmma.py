"""fp8lab.numba_kernels.wgmma: the warpgroup mma's simulator twin, layouts and late reads.

One warpgroup (128 threads) in the CUDA simulator: A in registers (each warp its 16 rows, mma.m16n8k16's A
layout), B written into shared memory in the 128-byte-swizzled K-major layout, two chained k16 steps; on
integer-valued operands every product and sum is exact, so D must equal the float64 ``A @ B`` exactly. The twin
reads shared memory at the wait, the latest moment a GPU may (a B overwritten before the wait is what it uses), and
refuses A registers written between a wgmma's issue and its wait. Two half-width chains (``mma_async_function(64,
32)`` for the second) fill the accumulators of one full-width product exactly. The same product in F16 operands
(``operand="f16"``, the flash prefill's), and a format the helper does not take refused.
"""

import numpy as np
import pytest
from numba import cuda, float32, uint32

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import wgmma
from fp8lab.simulators import bit_placement as bp
from fp8lab.simulators import mma as mma_model

N = 64
MULTIPLY = {operand: wgmma.mma_async_function(N, operand=operand) for operand in wgmma.OPERANDS}
wait_all = wgmma.wait_group_function(0, N)


def swizzled_b(b_kn: np.ndarray) -> np.ndarray:
    """``B[k, n]`` (BF16 bits, k < 64) as the bytes of one swizzled atom block: row ``n`` holds its 64 k."""
    rows, k = b_kn.shape[1], b_kn.shape[0]
    memory = np.zeros(rows * wgmma.ROW_BYTES, np.uint8)
    logical = wgmma.ROW_BYTES * np.arange(rows)[None, :] + 2 * np.arange(k)[:, None]
    physical = wgmma.physical_address(logical)
    memory[physical] = b_kn & 0xFF
    memory[physical + 1] = b_kn >> 8
    return memory


def warpgroup_kernel_function(mma_async):
    """The test kernel over one of ``MULTIPLY``'s products: two chained k16 steps, then (as asked) B overwritten or
    an A register rewritten before the wait, the accumulators stored."""

    def warpgroup_kernel(a_regs, b_bytes, later_b_bytes, out, overwrite, write_a_early):
        thread = cuda.threadIdx.x
        smem = cuda.shared.array(N * 128, np.uint8)
        for i in range(thread, N * 128, 128):
            smem[i] = b_bytes[i]
        cuda.syncthreads()
        acc = cuda.local.array(N // 2, float32)
        registers = cuda.local.array(8, uint32)
        for i in range(8):
            registers[i] = uint32(a_regs[i // 4, thread, i % 4])
        wgmma.fence()
        for step in range(2):  # k 0..15, then k 16..31 (32 bytes further into each row)
            mma_async(acc, registers, 4 * step, smem, 0, step * wgmma.STEP_BYTES, step > 0)
        wgmma.commit_group()
        if overwrite:  # a kernel bug: B rewritten before the wait
            cuda.syncthreads()
            for i in range(thread, N * 128, 128):
                smem[i] = later_b_bytes[i]
            cuda.syncthreads()
        if write_a_early:  # a kernel bug: the A registers of a wgmma in flight rewritten
            registers[5] = uint32(0)
        wait_all(acc)
        for i in range(N // 2):
            out[thread, i] = acc[i]

    return warpgroup_kernel


def check_accumulators(out, expected):
    """Thread ``32 w + lane``'s accumulators ``out`` are ``expected``'s rows and columns in D's layout (warp ``w``:
    rows ``16 w ..``)."""
    lane = np.arange(32)[:, None]
    i = np.arange(N // 2)[None, :]
    rows = (lane >> 2) + 8 * ((i >> 1) & 1)
    cols = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)
    for warp in range(4):
        np.testing.assert_array_equal(out[32 * warp: 32 * warp + 32], expected[16 * warp + rows, cols])


def run(rng, overwrite, write_a_early=False, operand="bf16"):
    a = rng.integers(-8, 9, size=(64, 32)).astype(np.float32)  # 64 rows (4 warps x 16), k 0..31
    b = rng.integers(-8, 9, size=(32, N)).astype(np.float32)
    later_b = rng.integers(-8, 9, size=(32, N)).astype(np.float32)
    a_bits, b_bits, later_bits = (bp.float32_to_bits(x, operand) for x in (a, b, later_b))
    # each warp's A registers per k16 step, in mma.m16n8k16's A layout
    a_regs = np.zeros((2, 128, 4), np.uint32)
    for step in range(2):
        for warp in range(4):
            tile = a_bits[16 * warp: 16 * warp + 16, 16 * step: 16 * step + 16]
            halves = mma_model.load_a(tile)  # [32 lanes, 8] 16-bit patterns
            a_regs[step, 32 * warp: 32 * warp + 32] = mma_model.pack_registers(halves)
    out = np.full((128, N // 2), np.nan, np.float32)
    kernel = cuda.jit(warpgroup_kernel_function(MULTIPLY[operand]))
    kernel[1, 128](a_regs, swizzled_b(b_bits), swizzled_b(later_bits), out, overwrite, write_a_early)
    used_b = later_b if overwrite else b
    expected = a.astype(np.float64) @ used_b.astype(np.float64)  # exact: integer products and sums
    check_accumulators(out, expected)


@pytest.mark.cudasim
def test_the_twin_computes_a_at_b_in_the_fragment_and_swizzle_layouts(rng):
    run(rng, overwrite=False)


@pytest.mark.cudasim
def test_the_twin_computes_a_at_b_in_f16_operands(rng):
    run(rng, overwrite=False, operand="f16")


def test_a_format_the_helper_does_not_take_is_refused():
    with pytest.raises(ValueError, match="operand: expected one of .* got 'e4m3'"):
        wgmma.mma_async_function(N, operand="e4m3")


@pytest.mark.cudasim
def test_the_twin_reads_shared_memory_at_the_wait(rng):
    run(rng, overwrite=True)


@pytest.mark.cudasim
def test_the_twin_refuses_a_registers_written_before_the_wait(rng):
    with pytest.raises(Exception, match="A registers 4..7 were written before the wait_group"):
        run(rng, overwrite=False, write_a_early=True)


def test_the_swizzle_spreads_an_atoms_rows_over_all_banks():
    # piece c of row r goes to piece c ^ (r % 8): the 8 rows' pieces 0 land in 8 distinct 16-byte bank groups
    pieces = [wgmma.physical_address(r * wgmma.ROW_BYTES) % wgmma.ROW_BYTES // 16 for r in range(8)]
    assert sorted(pieces) == list(range(8))
    assert wgmma.physical_address(9 * 128 + 2 * 16) == 9 * 128 + (2 ^ 1) * 16  # row 9 is row 1 of the next atom


def two_chains_kernel(a_regs, b_bytes, out):
    """Two m64n64k16 chains (columns 0..63 into accumulators 0..31, columns 64..127 into 32..63), two k16 steps each."""
    thread = cuda.threadIdx.x
    smem = cuda.shared.array(128 * 128, np.uint8)
    for i in range(thread, 128 * 128, 128):
        smem[i] = b_bytes[i]
    cuda.syncthreads()
    acc = cuda.local.array(64, float32)
    registers = cuda.local.array(8, uint32)
    for i in range(8):
        registers[i] = uint32(a_regs[i // 4, thread, i % 4])
    wgmma.fence()
    for step in range(2):
        low_chain(acc, registers, 4 * step, smem, 0, step * wgmma.STEP_BYTES, step > 0)
        high_chain(acc, registers, 4 * step, smem, 64 * wgmma.ROW_BYTES, step * wgmma.STEP_BYTES, step > 0)
    wgmma.commit_group()
    wait_128(acc)
    for i in range(64):
        out[thread, i] = acc[i]


low_chain = wgmma.mma_async_function(64)
high_chain = wgmma.mma_async_function(64, 32)
wait_128 = wgmma.wait_group_function(0, 128)


@pytest.mark.cudasim
def test_two_half_width_chains_fill_the_accumulators_of_one_full_width_product(rng):
    """``mma_async_function(64, 32)`` writes accumulators 32..63: with B's columns 64..127 those are exactly the
    accumulators of an m64n128 product's columns 64..127 (lane (g, t), accumulator i: column 8 (i >> 2) + 2 t +
    (i & 1)), so two chains give A @ B in the m64n128 layout."""
    a = rng.integers(-8, 9, size=(64, 32)).astype(np.float32)
    b = rng.integers(-8, 9, size=(32, 128)).astype(np.float32)
    a_bits, b_bits = bp.float32_to_bf16_bits(a), bp.float32_to_bf16_bits(b)
    a_regs = np.zeros((2, 128, 4), np.uint32)
    for step in range(2):
        for warp in range(4):
            tile = a_bits[16 * warp: 16 * warp + 16, 16 * step: 16 * step + 16]
            a_regs[step, 32 * warp: 32 * warp + 32] = mma_model.pack_registers(mma_model.load_a(tile))
    out = np.full((128, 64), np.nan, np.float32)
    cuda.jit(two_chains_kernel)[1, 128](a_regs, swizzled_b(b_bits), out)
    expected = a.astype(np.float64) @ b.astype(np.float64)  # exact: integer products and sums
    lane = np.arange(32)[:, None]
    i = np.arange(64)[None, :]
    rows = (lane >> 2) + 8 * ((i >> 1) & 1)
    cols = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)
    for warp in range(4):
        np.testing.assert_array_equal(out[32 * warp: 32 * warp + 32], expected[16 * warp + rows, cols])


mma_async_ss = wgmma.mma_async_ss_function(N)
A_BYTES = 64 * wgmma.ROW_BYTES  # A's 64 rows of 64 k, swizzled like B


def both_in_shared_kernel(ab_bytes, out):
    """A (64 rows) then B (N columns) in shared memory, two k16 steps with both operands as descriptors."""
    thread = cuda.threadIdx.x
    smem = cuda.shared.array(A_BYTES + N * 128, np.uint8)
    for i in range(thread, A_BYTES + N * 128, 128):
        smem[i] = ab_bytes[i]
    cuda.syncthreads()
    acc = cuda.local.array(N // 2, float32)
    wgmma.fence()
    for step in range(2):
        mma_async_ss(acc, smem, 0, step * wgmma.STEP_BYTES, A_BYTES, step * wgmma.STEP_BYTES, step > 0)
    wgmma.commit_group()
    wait_all(acc)
    for i in range(N // 2):
        out[thread, i] = acc[i]


@pytest.mark.cudasim
def test_the_twin_with_a_in_shared_memory_computes_a_at_b(rng):
    """``mma_async_ss``: A read from the same swizzled K-major layout as B (row ``r`` of A where B has column
    ``n``), warp ``w`` of the warpgroup getting rows ``16 w ..``: exactly the float64 ``A @ B`` on integers."""
    a = rng.integers(-8, 9, size=(64, 32)).astype(np.float32)
    b = rng.integers(-8, 9, size=(32, N)).astype(np.float32)
    a_bits, b_bits = bp.float32_to_bf16_bits(a), bp.float32_to_bf16_bits(b)
    out = np.full((128, N // 2), np.nan, np.float32)
    cuda.jit(both_in_shared_kernel)[1, 128](np.concatenate([swizzled_b(a_bits.T), swizzled_b(b_bits)]), out)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    check_accumulators(out, expected)
