"""``cp.async`` (sm_80 and later): global -> shared memory copies that bypass registers.

Device functions, no kernel; in the simulator they land copies as late as the hardware may. Checked
in ``tests/numba_kernels/test_gemm_mma_kernel.py`` (stale reads shown, the GEMM bit for bit against
``fp8lab.simulators.gemm_mma``).

A thread issues copies (``copy_16_cg``, ``copy_16_ca``, ``copy_4_ca``), closes the ones issued so
far into a *group* (``commit_group``), and later waits until at most ``n`` of its most recent
groups are still in flight (``wait_group(n)``, ``n`` a compile-time constant: one function per
``n`` from ``wait_group_function``). A wait covers only the calling thread's own copies: for other
threads' copies to be visible, follow it with ``cuda.syncthreads()``. Meanwhile the thread keeps
computing, so a kernel can keep several chunks of memory in flight without holding them in
registers (the multi-stage pipeline of ``fp8lab.numba_kernels.gemm_mma``).

Copy arguments: ``(shared, index, source, row, col, source_bytes)``: the destination is
``shared[index]`` of a 1-D shared-memory array (address aligned to the copy size), the source is
``source[row, col]`` of a 2-D global array, ``source_bytes`` is the copy size or 0: with 0 nothing
is read and the destination is filled with zeros (``source[row, col]`` must still be a valid
element). A 16-byte copy moves ``16 / itemsize`` consecutive elements. ``cg`` caches in L2 only
(data read once), ``ca`` in L1 too (data that other CTAs on the same SM read as well).

``copy_16_cg_flat(shared, index, source, element)`` is the same copy from ``source[element]`` of a 1-D global array,
always whole (no zero fill), with 32-bit shared addresses: the form for a kernel whose copies are a hot loop (a
2-D source costs a 64-bit multiply per copy, unless the compiler has the registers to keep it hoisted).

``strided_copy_function(cache, size, count, shared_step, source_step)`` gives ``copy(shared, index, source, element)``:
``count`` flat copies, copy ``i`` from ``source[element + i source_step]`` into ``shared[index + i shared_step]``
(steps in elements of each array, compile-time constants). On a GPU one address pair is computed and the other copies
use immediate offsets from it: a lane's copies into the rows of a tile at the cost of one.

- On a GPU: inline PTX, ``cp.async.{ca,cg}.shared.global [dst], [src], size, src_size``; the
  shared address is the 32-bit shared-window offset of the generic pointer (``cvta.to.shared``).
- In the CUDA simulator: each thread queues its copies and performs a group only when a
  ``wait_group`` requires it, the latest moment the hardware may land them. A kernel that reads a
  buffer before waiting for it therefore reads stale data here, as it could on a GPU.
"""

from __future__ import annotations

import numpy as np

from .bits import SIMULATOR

SIZES = {"cg": (16,), "ca": (4, 8, 16)}
"""Copy sizes in bytes PTX allows per cache operator."""


def require_size(cache: str, size: int) -> None:
    """A ``ValueError`` unless PTX's ``cp.async.{cache}`` copies ``size`` bytes (``SIZES``)."""
    if size not in SIZES[cache]:
        raise ValueError(f"cp.async.{cache} copies {SIZES[cache]} bytes, not {size}")

if SIMULATOR:
    from .cudasim import CommitGroups

    _groups = CommitGroups()

    def _copy_function(size: int):
        def copy(shared, index, source, row, col, source_bytes):
            words, source_words = size // shared.dtype.itemsize, size // source.dtype.itemsize
            if (index * shared.dtype.itemsize) % size or (col * source.dtype.itemsize) % size:
                raise RuntimeError(f"cp.async: a {size}-byte copy needs {size}-byte aligned addresses "
                                   f"(shared element {index}, source column {col})")
            if not (0 <= row < source.shape[0] and 0 <= col and col + source_words <= source.shape[1]):
                raise RuntimeError(f"cp.async: source element [{row}, {col}] lies outside {source.shape}")
            if int(source_bytes) not in (0, size):
                raise RuntimeError(f"cp.async: source_bytes must be 0 or {size}, got {source_bytes}")
            index, row, col, fill = int(index), int(row), int(col), int(source_bytes) == 0

            def land():
                values = np.zeros(source_words, source.dtype) if fill else source[row, col : col + source_words]
                shared[index : index + words] = values.view(shared.dtype)

            _groups.issue(land)

        return copy

    def _flat_copy_function(size: int):
        def copy(shared, index, source, element):
            words, source_words = size // shared.dtype.itemsize, size // source.dtype.itemsize
            if (index * shared.dtype.itemsize) % size or (element * source.dtype.itemsize) % size:
                raise RuntimeError(f"cp.async: a {size}-byte copy needs {size}-byte aligned addresses "
                                   f"(shared element {index}, source element {element})")
            if not (0 <= element and element + source_words <= source.size):
                raise RuntimeError(f"cp.async: source elements {element}..{element + source_words - 1} lie outside "
                                   f"{source.shape}")
            index, element = int(index), int(element)

            def land():
                shared[index : index + words] = source[element : element + source_words].view(shared.dtype)

            _groups.issue(land)

        return copy

    copy_16_cg = copy_16_ca = _copy_function(16)
    copy_4_ca = _copy_function(4)
    copy_16_cg_flat = _flat_copy_function(16)

    def strided_copy_function(cache: str, size: int, count: int, shared_step: int, source_step: int):
        require_size(cache, size)
        flat = _flat_copy_function(size)

        def copy(shared, index, source, element):
            for i in range(count):
                flat(shared, int(index) + i * shared_step, source, int(element) + i * source_step)

        return copy

    def commit_group():
        _groups.commit()

    def wait_group_function(n: int):
        def wait_group():
            for land in _groups.take_all_but(n):
                land()

        return wait_group

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _pointer(context, builder, array_type, array, indices, index_types):
        """The generic address of ``array[indices]`` as a 64-bit integer."""
        array = context.make_array(array_type)(context, builder, value=array)
        index = [context.cast(builder, i, t, types.intp) for i, t in zip(indices, index_types)]
        pointer = cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)
        return builder.ptrtoint(pointer, ir.IntType(64))

    def _copy_intrinsic(cache: str, size: int):
        require_size(cache, size)
        asm = ("{ .reg .u64 s64, g; .reg .u32 s; cvta.to.shared.u64 s64, $0; cvt.u32.u64 s, s64; "
               f"cvta.to.global.u64 g, $1; cp.async.{cache}.shared.global [s], [g], {size}, $2; }}")

        @intrinsic
        def copy(typingctx, shared, index, source, row, col, source_bytes):
            arrays_ok = (isinstance(shared, types.Array) and shared.ndim == 1 and isinstance(source, types.Array)
                         and source.ndim == 2)
            if not arrays_ok or not all(isinstance(x, types.Integer) for x in (index, row, col, source_bytes)):
                return None

            def codegen(context, builder, signature, args):
                shared_type, index_type, source_type, row_type, col_type, bytes_type = signature.args
                destination = _pointer(context, builder, shared_type, args[0], [args[1]], [index_type])
                origin = _pointer(context, builder, source_type, args[2], args[3:5], [row_type, col_type])
                count = context.cast(builder, args[5], bytes_type, types.uint32)
                function = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(64), ir.IntType(32)])
                builder.call(ir.InlineAsm(function, asm, "l,l,r,~{memory}", side_effect=True),
                             [destination, origin, count])
                return context.get_dummy_value()

            return types.void(shared, index, source, row, col, source_bytes), codegen

        return copy

    def shared_start(context, builder, array_type, array):
        """The 32-bit shared-window address of a shared array's first element (``cvta.to.shared`` of its generic
        address: a value the compiler computes once). Also used by ``fp8lab.numba_kernels.wgmma``."""
        data = context.make_array(array_type)(context, builder, value=array).data
        generic = builder.ptrtoint(data, ir.IntType(64))
        start = builder.call(ir.InlineAsm(ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                                          "cvta.to.shared.u64 $0, $1;", "=l,l"), [generic])
        return builder.trunc(start, ir.IntType(32))

    def _shared_window_address(context, builder, array_type, array, index, index_type):
        """The 32-bit shared-window address of ``array[index]``: ``shared_start`` plus the index in 32 bits."""
        itemsize = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
        offset = builder.mul(context.cast(builder, index, index_type, types.uint32), ir.Constant(ir.IntType(32), itemsize))
        return builder.add(shared_start(context, builder, array_type, array), offset)

    def _offset(byte_offset: int) -> str:
        """A PTX address's immediate offset (``+n``; nothing for 0)."""
        return f"+{byte_offset}" if byte_offset else ""

    def strided_copy_function(cache: str, size: int, count: int, shared_step: int, source_step: int):
        """The strided copies (module docstring) as one PTX block: ``mad.wide.u32`` forms the first source address
        (in the PTX, so that LLVM cannot merge a 32-bit element into a 64-bit sum with the array's start: that costs
        four instructions a copy), the others are ``[g+offset]``, and the shared ones ``[s+offset]``."""
        require_size(cache, size)

        @intrinsic
        def copy(typingctx, shared, index, source, element):
            arrays_ok = (isinstance(shared, types.Array) and shared.ndim == 1 and isinstance(source, types.Array)
                         and source.ndim == 1)
            if not arrays_ok or not all(isinstance(x, types.Integer) for x in (index, element)):
                return None

            def codegen(context, builder, signature, args):
                shared_type, index_type, source_type, element_type = signature.args
                destination = _shared_window_address(context, builder, shared_type, args[0], args[1], index_type)
                start = builder.ptrtoint(context.make_array(source_type)(context, builder, value=args[2]).data,
                                         ir.IntType(64))
                element = context.cast(builder, args[3], element_type, types.uint32)
                item, shared_item = source_type.dtype.bitwidth // 8, shared_type.dtype.bitwidth // 8
                copies = " ".join(f"cp.async.{cache}.shared.global [$0{_offset(i * shared_step * shared_item)}], "
                                  f"[g{_offset(i * source_step * item)}], {size};" for i in range(count))
                text = f"{{ .reg .u64 g; mad.wide.u32 g, $1, {item}, $2; cvta.to.global.u64 g, g; {copies} }}"
                function = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(32), ir.IntType(64)])
                builder.call(ir.InlineAsm(function, text, "r,r,l,~{memory}", side_effect=True),
                             [destination, element, start])
                return context.get_dummy_value()

            return types.void(shared, index, source, element), codegen

        return copy

    copy_16_cg = _copy_intrinsic("cg", 16)
    copy_16_ca = _copy_intrinsic("ca", 16)
    copy_4_ca = _copy_intrinsic("ca", 4)
    copy_16_cg_flat = strided_copy_function("cg", 16, 1, 0, 0)

    def statement_intrinsic(text: str):
        """A device function that runs the PTX statement ``text`` (no operands; a memory clobber, never moved or
        dropped). Also used by ``fp8lab.numba_kernels.wgmma``."""

        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, signature, args):
                function = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(function, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        return statement

    commit_group = statement_intrinsic("cp.async.commit_group;")
    _waits = {}

    def wait_group_function(n: int):
        if n not in _waits:
            _waits[n] = statement_intrinsic(f"cp.async.wait_group {int(n)};")
        return _waits[n]
