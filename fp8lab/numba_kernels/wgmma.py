"""Hopper's warpgroup matrix multiply ``wgmma.mma_async`` (BF16 or F16 in, float32 accumulate) as device functions.

Device functions, no kernel (sm_90a: numba-cuda compiles for it on a compute-capability-9.0 GPU). Checked: the
twin in ``tests/numba_kernels/test_wgmma.py`` (one warpgroup, integer operands: exactly the float64 ``A @ B`` in
these fragment and swizzle layouts; shared memory read at the wait); the instructions in the sm_90a PTX in
``tests/numba_kernels/test_kernels_compile.py``; on a GPU through ``fp8lab.numba_kernels.gemm_wgmma``'s tests.

One ``wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16`` is issued by a *warpgroup* (4 consecutive warps,
the first a multiple of 4) and computes ``D[64, N] = A[64, 16] @ B[16, N] (+ D)``:

- **A in registers**: warp ``w`` of the warpgroup holds rows ``16 w .. 16 w + 15`` in exactly the layout of
  ``mma.m16n8k16``'s A (``fp8lab.simulators.mma.A_COORDS``): four 32-bit registers, two BF16 each;
- **B in shared memory**, K-major (each of the N columns is 16 consecutive k, 32 bytes), described by a 64-bit
  *matrix descriptor*; the layout used here is the 128-byte swizzle: a column's k run lies in a 128-byte row
  of 64 k, 8 such rows form a 1,024-byte atom (aligned to 1,024 in the shared window), and the 16-byte piece
  ``c`` of row ``r`` is stored at piece ``c ^ (r % 8)`` of its row (``swizzled_piece``), so that the 8 rows
  of an atom spread over all 32 banks. The descriptor: start address, rows' stride of 8 (1,024 bytes between
  atoms of consecutive columns), swizzle mode 128 B; the k16 step ``j`` of a 64-wide atom starts ``32 j``
  bytes into its first row (the hardware applies the swizzle to the address it forms);
- **D in registers**: warp ``w`` holds rows ``16 w ..``; lane ``(g, t)``'s accumulator ``i`` (``N / 2`` of
  them) is row ``g + 8 ((i >> 1) & 1)``, column ``8 (i >> 2) + 2 t + (i & 1)``: ``mma.m16n8k16``'s C layout
  repeated over the ``N / 8`` column blocks.

So the rows of ``D`` that warp ``w`` holds depend only on its own A registers: the twin below computes each
warp alone, with ``fp8lab.simulators.mma``'s model per m16 x n8 block (``d = fl32(c + fl32(S))``, ``S`` the
exact sum of the 16 products; ``accumulate=False`` starts from ``c = +0``). A real GPU rounds as its tensor
cores do (tutorial 03), so GPU results are held to the tensor-core error budget.

The instruction is asynchronous: ``fence()`` before the first ``mma_async`` of a batch (registers written by
ordinary instructions become visible to it), ``commit_group()`` after the batch, and ``wait_group(n)(acc)``
before the accumulators are read (at most ``n`` younger groups left in flight). The shared memory it reads
must stay unchanged until that wait, and shared memory written by ``cp.async`` (the generic proxy) must pass
``proxy_fence()`` in each writing thread, then a barrier, before ``wgmma`` (the async proxy) reads it.

``mma_async(acc, a_regs, first, smem, stage_offset, byte_offset, accumulate)`` (from ``mma_async_function(N,
acc_offset, operand)``): ``acc[acc_offset .. acc_offset + N / 2 - 1]`` the float32 accumulators, ``a_regs[first ..
first + 3]`` the A registers (both per-thread ``cuda.local.array``), B at ``smem``'s byte ``stage_offset +
byte_offset``, both multiples of 16 (``smem`` is dynamic shared memory, which starts 16-byte aligned); ``operand``
the format of A and B, ``"bf16"`` (the default) or ``"f16"`` (``.f32.f16.f16``: ``prefill_wgmma``). Two offsets, so
that the descriptor is one addition: the stage's part the compiler computes once per stage, the step's part is a constant
after unrolling (one offset, a run-time sum, costs a shift and a mask per instruction). (An offset lets two
instructions of half the width keep two independent accumulator chains in one array.)

``mma_async_ss(acc, smem, a_offset, a_step, b_offset, b_step, accumulate)`` (from ``mma_async_ss_function(N)``):
the same product with A in shared memory too, in B's layout (the warpgroup's 64 rows as 128-byte K-major rows,
swizzled, 8-row atoms 1,024 bytes apart), at ``smem``'s byte ``a_offset + a_step``, B at ``b_offset + b_step``
(each a multiple of 16): two descriptors, no A registers (``fp8lab.numba_kernels.gemm_wgmma_ss``). The twin reads
warp ``w``'s rows ``16 w .. 16 w + 15`` from shared memory at the wait, as it reads B.

- On a GPU: LLVM inline assembly in the calling kernel (the arrays indexed with constants only after unrolling,
  so they live in registers; the wait passes every accumulator through the instruction so the compiler reads
  none of them earlier).
- In the CUDA simulator: ``mma_async`` queues the operation; ``wait_group`` performs the queued groups, warp by
  warp, reading shared memory *then*, the latest moment the hardware may read it: a kernel that overwrites a
  stage before waiting computes with the new data here, as it could on a GPU. And it refuses (``RuntimeError``)
  a wait whose operations' A registers were written after their issue: on a GPU those are the same PTX
  registers, and their async read may see the new values (an H100 did: ``bench/RESULTS.md``, nineteenth
  session).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .bits import SIMULATOR
from .warp import FULL_MASK

N_CHOICES = (64, 128, 192)
"""Columns of D per instruction that kernels here use: ``N / 2`` float32 accumulators per lane (PTX allows any
multiple of 8 up to 256 for BF16)."""
OPERANDS = ("bf16", "f16")
"""The 16-bit formats of A and B that ``mma_async_function`` takes (both operands the same)."""

M_ROWS, K_STEP = 64, 16
ROW_BYTES = 128
"""A swizzle row: 64 BF16 k of one column."""
ATOM_ROWS = 8
ATOM_BYTES = ROW_BYTES * ATOM_ROWS
"""1,024: a swizzle atom, also the stride between atoms of consecutive columns (the descriptor's SBO)."""
PIECE_BYTES = 16
STEP_BYTES = 2 * K_STEP
"""32: how far a k16 step moves the start address inside a row."""
DESCRIPTOR_TAIL = (1 << 16) | ((ATOM_BYTES >> 4) << 32) | (1 << 62)
"""The descriptor's fields but the start address: LBO 16 bytes (unused by swizzled K-major layouts), SBO
1,024 bytes, swizzle mode 1 (128 B) in bits 62-63."""


def _check_choices(n: int, operand: str):
    """A ``ValueError`` for a width or an operand format the helpers do not take."""
    if n not in N_CHOICES:
        raise ValueError(f"n: expected one of {N_CHOICES}, got {n!r}")
    if operand not in OPERANDS:
        raise ValueError(f"operand: expected one of {OPERANDS}, got {operand!r}")


@cuda.jit(device=True, inline="always")
def swizzled_piece(row, piece):
    """Where the 16-byte piece ``piece`` (0..7) of swizzle row ``row`` lies in its row: ``piece ^ (row % 8)``."""
    return piece ^ (row & 7)


def physical_address(logical):
    """The 128-byte swizzle on a shared-memory byte address (``logical`` relative to a 1,024-aligned base):
    bits 4-6 (the piece) XOR bits 7-9 (the row within the atom). Works on NumPy arrays."""
    return logical ^ (((logical >> 7) & 7) << 4)


if SIMULATOR:
    from fp8lab.simulators import bit_placement
    from fp8lab.simulators import mma as mma_model

    from . import cudasim

    _groups = cudasim.CommitGroups()

    def shared_address(smem):
        """The shared-window address of ``smem[0]``: 0 here (every simulated allocation counts as aligned)."""
        return np.uint32(0)

    def fence():
        pass

    def proxy_fence():
        pass

    def commit_group():
        _groups.commit()

    def _accumulator_coordinates(n: int):
        """Row and column of D, per (lane, accumulator), within the warp's 16 rows."""
        lane = np.arange(cudasim.WARP_SIZE)[:, None]
        i = np.arange(n // 2)[None, :]
        return (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)

    def _b_operand(smem, byte_offset: int, n: int, operand: str = "bf16") -> np.ndarray:
        """B ``[16 k, n]`` as float64 values (BF16 or F16 patterns, ``operand``) read from the swizzled K-major layout
        at ``byte_offset``."""
        memory = np.asarray(smem).reshape(-1).view(np.uint8)
        logical = byte_offset + ROW_BYTES * np.arange(n)[None, :] + 2 * np.arange(K_STEP)[:, None]
        physical = physical_address(logical)
        if physical.max() + 1 >= memory.size:
            raise RuntimeError(f"wgmma: B at byte {byte_offset} (n = {n}) runs past the {memory.size}-byte shared array")
        bits = memory[physical].astype(np.uint16) | (memory[physical + 1].astype(np.uint16) << 8)
        return bit_placement.bits_to_float32(bits, operand).astype(np.float64)

    def _perform(pooled):
        """The warp's queued operations (``pooled``: each lane's list, by lane) in order: every lane's accumulators
        updated in place. The operations' shared-memory operands are the same on every lane; lane 0's are used."""
        for index, (_, _, smem, byte_offset, accumulate, n, a_regs, first, operand) in enumerate(pooled[0]):
            rows, cols = _accumulator_coordinates(n)
            if a_regs is None:  # A in shared memory (``mma_async_ss``): ``first`` is the warp's rows' byte offset
                a = _b_operand(smem, first, 16, operand).T  # the warp's 16 rows, K-major like B's columns
            else:
                registers = np.array([pooled[lane][index][1] for lane in range(cudasim.WARP_SIZE)], dtype=np.uint32)
                a_bits = mma_model.unpack_registers(registers)  # [32, 8] 16-bit patterns
                a = mma_model.assemble_a(bit_placement.bits_to_float32(a_bits, operand)).astype(np.float64)
            b = _b_operand(smem, byte_offset, n, operand)
            b_tiles = np.stack([b[:, 8 * j: 8 * j + 8] for j in range(n // 8)])  # [n/8, 16, 8]
            sums = mma_model.k16_sum(a[None], b_tiles).astype(np.float32)  # fl32(S) per block
            d = np.transpose(sums, (1, 0, 2)).reshape(16, n)  # [16 rows, n]
            c = np.zeros((16, n), np.float32)
            if accumulate:
                for lane in range(cudasim.WARP_SIZE):
                    c[rows[lane], cols[lane]] = pooled[lane][index][0][: n // 2]
            d = c + d  # float32: one rounding
            for lane in range(cudasim.WARP_SIZE):
                pooled[lane][index][0][: n // 2] = d[rows[lane], cols[lane]]
        return None

    def _wait(n_younger: int):
        if _groups.uncommitted():
            raise RuntimeError("wgmma.wait_group: mma_async issued since the last commit_group")
        ready = _groups.take_all_but(n_younger)
        for _, registers, _, _, _, _, a_regs, first, _ in ready:
            if a_regs is not None and tuple(int(x) & 0xFFFFFFFF for x in a_regs[first: first + 4]) != registers:
                raise RuntimeError(f"wgmma: A registers {first}..{first + 3} were written before the wait_group of the "
                                   "wgmma that reads them (undefined: a GPU may read them late)")
        cudasim.exchange("wgmma.wait_group", FULL_MASK, ready, combine=_perform)

    def wait_group_function(n: int, columns: int):
        def wait_group(acc):
            _wait(n)

        return wait_group

    def mma_async_function(n: int, acc_offset: int = 0, operand: str = "bf16"):
        _check_choices(n, operand)

        def mma_async(acc, a_regs, first, smem, stage_offset, byte_offset, accumulate):
            if int(stage_offset) % PIECE_BYTES or int(byte_offset) % PIECE_BYTES:
                raise RuntimeError(f"wgmma: B's offsets {stage_offset} + {byte_offset} are not multiples of 16")
            byte_offset = int(stage_offset) + int(byte_offset)
            first = int(first)
            registers = tuple(int(x) & 0xFFFFFFFF for x in a_regs[first: first + 4])
            accumulators = acc[acc_offset: acc_offset + n // 2]  # a view: the wait updates acc in place
            _groups.issue((accumulators, registers, smem, int(byte_offset), bool(accumulate), n, a_regs, first,
                           operand))

        return mma_async

    def mma_async_ss_function(n: int):
        if n not in N_CHOICES:
            raise ValueError(f"n: expected one of {N_CHOICES}, got {n!r}")

        def mma_async_ss(acc, smem, a_offset, a_step, b_offset, b_step, accumulate):
            offsets = [int(x) for x in (a_offset, a_step, b_offset, b_step)]
            if any(x % PIECE_BYTES for x in offsets):
                raise RuntimeError(f"wgmma: the operands' offsets {offsets} are not all multiples of 16")
            warp = cudasim._current_thread().thread_id // cudasim.WARP_SIZE % 4  # rows 16 warp .. of the 64
            a_rows = offsets[0] + offsets[1] + warp * 2 * ATOM_BYTES  # 16 rows: two 8-row atoms on
            accumulators = acc[: n // 2]
            _groups.issue((accumulators, None, smem, offsets[2] + offsets[3], bool(accumulate), n, None, a_rows,
                           "bf16"))

        return mma_async_ss

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    from .cp_async import shared_start, statement_intrinsic

    fence = statement_intrinsic("wgmma.fence.sync.aligned;")
    commit_group = statement_intrinsic("wgmma.commit_group.sync.aligned;")
    proxy_fence = statement_intrinsic("fence.proxy.async.shared::cta;")

    @intrinsic
    def shared_address(typingctx, smem):
        """The shared-window address of ``smem[0]`` (uint32)."""
        if not isinstance(smem, types.Array):
            return None

        def codegen(context, builder, signature, args):
            return shared_start(context, builder, signature.args[0], args[0])

        return types.uint32(smem), codegen

    def _accumulators(context, builder, array_type, array, count, first=0):
        data = context.make_array(array_type)(context, builder, value=array).data
        pointers = [builder.gep(data, [ir.Constant(_I64, first + i)]) for i in range(count)]
        return pointers, [builder.load(p) for p in pointers]

    def _through_asm(builder, text, values, extra, extra_constraints, count):
        """Call ``text`` with the ``count`` accumulators as read-write operands (outputs ``$0..``, tied inputs),
        then ``extra`` inputs; the accumulators' new values."""
        function = ir.FunctionType(ir.LiteralStructType([_F32] * count), [_F32] * count + [v.type for v in extra])
        constraints = ",".join(["=f"] * count + [str(i) for i in range(count)] + extra_constraints + ["~{memory}"])
        result = builder.call(ir.InlineAsm(function, text, constraints, side_effect=True), values + extra)
        return [builder.extract_value(result, i) for i in range(count)]

    def _a_registers(context, builder, regs_type, regs, first_type, first, count):
        """The values of ``regs[first .. first + count - 1]`` (a uint32 array of A registers)."""
        data = context.make_array(regs_type)(context, builder, value=regs).data
        first_index = context.cast(builder, first, first_type, types.int64)
        return [builder.load(builder.gep(data, [builder.add(first_index, ir.Constant(_I64, i))])) for i in range(count)]

    def _wait(context, builder, n, count, acc_type, acc):
        """``wgmma.wait_group n`` with the ``count`` accumulators passed through it, so that the compiler reads none
        of them before it."""
        pointers, values = _accumulators(context, builder, acc_type, acc, count)
        for p, v in zip(pointers, _through_asm(builder, f"wgmma.wait_group.sync.aligned {int(n)};", values, [], [],
                                               count)):
            builder.store(v, p)
        return context.get_dummy_value()

    def wait_group_function(n: int, columns: int):
        count = columns // 2

        @intrinsic
        def wait_group(typingctx, acc):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32):
                return None

            def codegen(context, builder, signature, args):
                return _wait(context, builder, n, count, signature.args[0], args[0])

            return types.void(acc), codegen

        return wait_group

    def mma_async_function(n: int, acc_offset: int = 0, operand: str = "bf16"):
        _check_choices(n, operand)
        count = n // 2
        d = ", ".join(f"${i}" for i in range(count))
        a = ", ".join(f"${2 * count + i}" for i in range(4))
        text = ("{ .reg .pred p; "
                f"setp.ne.b32 p, ${2 * count + 5}, 0; "
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{operand}.{operand} {{{d}}}, {{{a}}}, "
                f"${2 * count + 4}, p, 1, 1, 0; }}")

        @intrinsic
        def mma_async(typingctx, acc, a_regs, first, smem, stage_offset, byte_offset, accumulate):
            arrays_ok = all(isinstance(x, types.Array) for x in (acc, a_regs, smem))
            if not (arrays_ok and acc.dtype == types.float32 and a_regs.dtype == types.uint32):
                return None

            def codegen(context, builder, signature, args):
                acc_type, regs_type, first_type, smem_type, stage_type, offset_type, accumulate_type = signature.args
                registers = _a_registers(context, builder, regs_type, args[1], first_type, args[2], 4)
                # The descriptor's start field is address >> 4 (14 bits: every shared window, <= 228 KB, fits). All
                # three terms are multiples of 16, so it is the sum of their shifts: the first two the compiler
                # computes once per stage, the third is a constant after unrolling.
                four = ir.Constant(_I32, 4)
                stage = builder.add(builder.lshr(shared_start(context, builder, smem_type, args[3]), four),
                                    builder.lshr(context.cast(builder, args[4], stage_type, types.uint32), four))
                address = builder.add(stage, builder.lshr(context.cast(builder, args[5], offset_type, types.uint32),
                                                          four))
                descriptor = builder.or_(builder.zext(address, _I64), ir.Constant(_I64, DESCRIPTOR_TAIL))
                scale_d = context.cast(builder, args[6], accumulate_type, types.uint32)
                pointers, values = _accumulators(context, builder, acc_type, args[0], count, acc_offset)
                results = _through_asm(builder, text, values, registers + [descriptor, scale_d],
                                       ["r", "r", "r", "r", "l", "r"], count)
                for p, v in zip(pointers, results):
                    builder.store(v, p)
                return context.get_dummy_value()

            return types.void(acc, a_regs, first, smem, stage_offset, byte_offset, accumulate), codegen

        return mma_async

    def _descriptor(context, builder, smem_type, smem, offsets):
        """The matrix descriptor of the operand at ``smem``'s byte ``sum(offsets)`` (each ``(type, value)``, a
        multiple of 16): the start field is the sum of the shifted terms, the rest ``DESCRIPTOR_TAIL``."""
        four = ir.Constant(_I32, 4)
        address = builder.lshr(shared_start(context, builder, smem_type, smem), four)
        for offset_type, offset in offsets:
            address = builder.add(address, builder.lshr(context.cast(builder, offset, offset_type, types.uint32), four))
        return builder.or_(builder.zext(address, _I64), ir.Constant(_I64, DESCRIPTOR_TAIL))

    def mma_async_ss_function(n: int):
        if n not in N_CHOICES:
            raise ValueError(f"n: expected one of {N_CHOICES}, got {n!r}")
        count = n // 2
        d = ", ".join(f"${i}" for i in range(count))
        text = ("{ .reg .pred p; "
                f"setp.ne.b32 p, ${2 * count + 2}, 0; "
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, ${2 * count}, ${2 * count + 1}, p, 1, 1, "
                "0, 0; }")

        @intrinsic
        def mma_async_ss(typingctx, acc, smem, a_offset, a_step, b_offset, b_step, accumulate):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and isinstance(smem, types.Array)):
                return None

            def codegen(context, builder, signature, args):
                acc_type, smem_type, *offset_types, accumulate_type = signature.args
                a = _descriptor(context, builder, smem_type, args[1], list(zip(offset_types[:2], args[2:4])))
                b = _descriptor(context, builder, smem_type, args[1], list(zip(offset_types[2:], args[4:6])))
                scale_d = context.cast(builder, args[6], accumulate_type, types.uint32)
                pointers, values = _accumulators(context, builder, acc_type, args[0], count)
                for p, v in zip(pointers, _through_asm(builder, text, values, [a, b, scale_d], ["l", "l", "r"], count)):
                    builder.store(v, p)
                return context.get_dummy_value()

            return types.void(acc, smem, a_offset, a_step, b_offset, b_step, accumulate), codegen

        return mma_async_ss


@cuda.jit(device=True, inline="always")
def atom_aligned_offset(smem):
    """The first byte offset into the dynamic shared array ``smem`` that is 1,024-aligned in the shared window (where
    a kernel's swizzled stages start: the swizzle is a function of the address)."""
    return (np.uint32(ATOM_BYTES) - (shared_address(smem) % np.uint32(ATOM_BYTES))) % np.uint32(ATOM_BYTES)
