"""Warp-level building blocks shared by the kernels, in both modes (GPU and CUDA simulator).

One definition per view: every kernel file (and ``cudasim``) takes its warp constants and 128-bit load
from here. Device functions, no kernel; checked through the kernels that use them
(``tests/numba_kernels/test_gemv_kernel.py``, ``test_splitkv_kernel.py``), ``warp_sum`` against
``fp8lab.simulators.common.butterfly_sum``.

- ``WARP_SIZE``, ``FULL_MASK``: 32 lanes, all of them taking part in a shuffle;
- ``load_u32x4(words, index)``: four uint32 words in one 128-bit global load (``ld.global.nc.v4.u32``
  on a GPU; in the simulator a plain read that refuses a misaligned index, as the GPU would fault);
  ``load_u32x4_coherent`` the same as ``ld.global.v4.u32``, for memory the kernel itself writes;
  ``load_shared_u32x4`` the same from shared memory (``ld.shared.v4.u32``), and
  ``store_shared_u32x4(words, index, w0, w1, w2, w3)`` four words into it in one ``st.shared.v4.u32``
  (``gemm_wgmma_ss``'s placed weights);
- ``load_f32x4(array, index)``: the four float32 elements ``array[index]`` and the three after it along the last
  axis, in one ``ld.global.nc.v4.f32`` (``index`` a tuple, one entry per axis); ``store_u32x4(array, index, w0, w1,
  w2, w3)``: the 16 bytes from ``array[index]`` on (float32, uint32 or uint16 elements: 4, 4 or 8 of them) <- the
  four words, in one ``st.global.v4.u32`` (``prefill_mma``'s queries and outputs). Both need a C-contiguous array
  whose device data starts on 16 bytes (``arguments.require_load_alignment``) and 16 bytes from the start of a row
  to ``index``;
- ``warp_sum(value)``: the butterfly reduction ``value += shfl_xor(value, off)`` for
  ``off = 16, 8, 4, 2, 1``, after which every lane holds the total. Its float32 order is that of
  ``fp8lab.simulators.common.butterfly_sum``.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .bits import SIMULATOR

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
BUTTERFLY_OFFSETS = (16, 8, 4, 2, 1)
WORDS_PER_LOAD = 4
LOAD_ALIGNMENT = 16
"""Bytes: a 128-bit load needs a 16-byte aligned address."""


# ---------------------------------------------------------------------------- the 128-bit load

if SIMULATOR:

    def load_u32x4(words, index):
        """``words[index : index + 4]`` of a 1-D uint32 array (one 128-bit load on a GPU; ``index % 4 == 0``)."""
        index = int(index)
        if index % WORDS_PER_LOAD:
            raise RuntimeError(f"load_u32x4: index {index} is not a multiple of 4 (the GPU load would be misaligned)")
        return words[index], words[index + 1], words[index + 2], words[index + 3]

    load_u32x4_coherent = load_u32x4
    load_shared_u32x4 = load_u32x4

    def store_shared_u32x4(words, index, w0, w1, w2, w3):
        """``words[index : index + 4] = w0 .. w3`` of a 1-D uint32 shared array (one 128-bit store on a GPU)."""
        index = int(index)
        if index % WORDS_PER_LOAD:
            raise RuntimeError(f"store_shared_u32x4: index {index} is not a multiple of 4 (the GPU store would be "
                               "misaligned)")
        words[index], words[index + 1], words[index + 2], words[index + 3] = w0, w1, w2, w3

    def _require_row_alignment(array, index, what: str):
        """Refuse ``array[index]`` unless it lies on 16 bytes from its row's start (the last axis), as on a GPU."""
        row_length = array.shape[len(array.shape) - 1]  # (the simulator's shape takes no negative index)
        offset = int(index[len(index) - 1]) * array.dtype.itemsize
        if offset % LOAD_ALIGNMENT or (row_length * array.dtype.itemsize) % LOAD_ALIGNMENT:
            raise RuntimeError(f"{what}: element {tuple(int(i) for i in index)} of an array of shape {array.shape} "
                               f"is not on a 16-byte boundary (the GPU access would be misaligned)")

    def load_f32x4(array, index):
        """``array[index]`` and the next three float32 elements of its row (one 128-bit load on a GPU)."""
        _require_row_alignment(array, index, "load_f32x4")
        *head, last = (int(i) for i in index)
        return tuple(np.float32(array[(*head, last + i)]) for i in range(WORDS_PER_LOAD))

    def store_u32x4(array, index, w0, w1, w2, w3):
        """The 16 bytes of ``array`` from ``array[index]`` on <- the words ``w0 .. w3`` (little-endian: a uint16
        array's element ``2 i`` is word ``i``'s low half); one 128-bit store on a GPU."""
        _require_row_alignment(array, index, "store_u32x4")
        *head, last = (int(i) for i in index)
        values = np.array([int(w) & 0xFFFFFFFF for w in (w0, w1, w2, w3)], np.uint32).view(array.dtype)
        for i, value in enumerate(values):
            array[(*head, last + i)] = value

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _GLOBAL_ADDRESS_SPACE = 1

    _SHARED_ADDRESS_SPACE = 3

    def _load_u32x4_intrinsic(invariant: bool, address_space: int = _GLOBAL_ADDRESS_SPACE):
        """The 128-bit load as an intrinsic: ``invariant`` marks it ``invariant.load`` (the non-coherent path);
        ``address_space``: global (1) or shared (3) memory."""

        @intrinsic
        def load(typingctx, words, index):
            if not (isinstance(words, types.Array) and words.ndim == 1 and words.dtype == types.uint32):
                return None
            return types.UniTuple(types.uint32, WORDS_PER_LOAD)(words, index), _load_codegen(invariant, address_space)

        return load

    def _load_codegen(invariant: bool, address_space: int):
        def codegen(context, builder, signature, args):
            array_type, index_type = signature.args
            array = context.make_array(array_type)(context, builder, value=args[0])
            index = [context.cast(builder, args[1], index_type, types.intp)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)
            vector = ir.VectorType(ir.IntType(32), WORDS_PER_LOAD)
            space_pointer = builder.addrspacecast(pointer, ir.PointerType(ir.IntType(32), address_space))
            loaded = builder.load(builder.bitcast(space_pointer, ir.PointerType(vector, address_space)),
                                  align=LOAD_ALIGNMENT)
            if invariant:
                loaded.set_metadata("invariant.load", builder.module.add_metadata([]))
            lanes = [builder.extract_element(loaded, ir.Constant(ir.IntType(32), i)) for i in range(WORDS_PER_LOAD)]
            return context.make_tuple(builder, signature.return_type, lanes)

        return codegen

    load_u32x4 = _load_u32x4_intrinsic(invariant=True)
    """``words[index : index + 4]`` of a 1-D uint32 array as one ``ld.global.nc.v4.u32``.

    The address must be 16-byte aligned (``index % 4 == 0`` and a 16-byte aligned array; the host checks the data
    pointer). The data is read-only for the kernel's lifetime, which the ``invariant.load`` mark tells the compiler,
    so it uses the non-coherent (read-only data cache) path. An unsigned index needs no negative-index fix-up."""

    load_u32x4_coherent = _load_u32x4_intrinsic(invariant=False)
    """The same load as a plain ``ld.global.v4.u32``: for memory that this kernel also writes (a CTA reading what
    its own threads stored before a barrier; the non-coherent path may return the stale line)."""

    @intrinsic
    def store_shared_u32x4(typingctx, words, index, w0, w1, w2, w3):
        """``words[index : index + 4] = w0 .. w3`` as one ``st.shared.v4.u32`` (``index % 4 == 0``, a shared array
        that starts on 16 bytes)."""
        if not (isinstance(words, types.Array) and words.ndim == 1 and words.dtype == types.uint32):
            return None

        def codegen(context, builder, signature, args):
            array_type, index_type, *value_types = signature.args
            array = context.make_array(array_type)(context, builder, value=args[0])
            index = [context.cast(builder, args[1], index_type, types.intp)]
            pointer = cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)
            vector = ir.VectorType(ir.IntType(32), WORDS_PER_LOAD)
            value = ir.Constant(vector, ir.Undefined)
            for i, (v, t) in enumerate(zip(args[2:], value_types)):
                value = builder.insert_element(value, context.cast(builder, v, t, types.uint32), ir.Constant(ir.IntType(32), i))
            space_pointer = builder.addrspacecast(pointer, ir.PointerType(ir.IntType(32), _SHARED_ADDRESS_SPACE))
            builder.store(value, builder.bitcast(space_pointer, ir.PointerType(vector, _SHARED_ADDRESS_SPACE)),
                          align=LOAD_ALIGNMENT)
            return context.get_dummy_value()

        return types.void(words, index, w0, w1, w2, w3), codegen

    load_shared_u32x4 = _load_u32x4_intrinsic(invariant=False, address_space=_SHARED_ADDRESS_SPACE)
    """``words[index : index + 4]`` of a 1-D uint32 *shared-memory* array as one ``ld.shared.v4.u32`` (16-byte
    aligned: ``index % 4 == 0`` in an array that starts on 16 bytes, as a dynamic shared array does)."""

    def _vector_pointer(context, builder, array_type, array_value, index_type, index_value, element, address_space):
        """The address of ``array[index]`` (``index`` a tuple, one entry per axis) as a pointer to 4 ``element``s in
        ``address_space``."""
        array = context.make_array(array_type)(context, builder, value=array_value)
        values = cgutils.unpack_tuple(builder, index_value, len(index_type))
        index = [context.cast(builder, v, t, types.intp) for v, t in zip(values, index_type.types)]
        pointer = cgutils.get_item_pointer(context, builder, array_type, array, index, wraparound=False)
        space_pointer = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, address_space))
        return builder.bitcast(space_pointer, ir.PointerType(ir.VectorType(element, WORDS_PER_LOAD), address_space))

    def _indexes(array, index) -> bool:
        """Whether ``index`` is a tuple of integers, one per axis of ``array``."""
        return (isinstance(index, types.BaseTuple) and len(index) == array.ndim
                and all(isinstance(t, types.Integer) for t in index.types))

    @intrinsic
    def load_f32x4(typingctx, array, index):
        """``array[index]`` and the next three elements of a C-contiguous float32 array as one ``ld.global.nc.v4.f32``
        (read-only for the kernel's lifetime, 16-byte aligned)."""
        if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.layout == "C"
                and _indexes(array, index)):
            return None

        def codegen(context, builder, signature, args):
            pointer = _vector_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1],
                                      ir.FloatType(), _GLOBAL_ADDRESS_SPACE)
            loaded = builder.load(pointer, align=LOAD_ALIGNMENT)
            loaded.set_metadata("invariant.load", builder.module.add_metadata([]))
            lanes = [builder.extract_element(loaded, ir.Constant(ir.IntType(32), i)) for i in range(WORDS_PER_LOAD)]
            return context.make_tuple(builder, signature.return_type, lanes)

        return types.UniTuple(types.float32, WORDS_PER_LOAD)(array, index), codegen

    @intrinsic
    def store_u32x4(typingctx, array, index, w0, w1, w2, w3):
        """The 16 bytes from ``array[index]`` on (a C-contiguous array of 4- or 2-byte elements, 16-byte aligned) <-
        ``w0 .. w3``, as one ``st.global.v4.u32``."""
        if not (isinstance(array, types.Array) and array.layout == "C" and array.dtype.bitwidth in (16, 32)
                and _indexes(array, index)):
            return None

        def codegen(context, builder, signature, args):
            array_type, index_type, *value_types = signature.args
            pointer = _vector_pointer(context, builder, array_type, args[0], index_type, args[1], ir.IntType(32),
                                      _GLOBAL_ADDRESS_SPACE)
            vector = ir.Constant(ir.VectorType(ir.IntType(32), WORDS_PER_LOAD), ir.Undefined)
            for i, (v, t) in enumerate(zip(args[2:], value_types)):
                vector = builder.insert_element(vector, context.cast(builder, v, t, types.uint32),
                                                ir.Constant(ir.IntType(32), i))
            builder.store(vector, pointer, align=LOAD_ALIGNMENT)
            return context.get_dummy_value()

        return types.void(array, index, w0, w1, w2, w3), codegen



@cuda.jit(device=True, inline=True)
def warp_sum(value):
    """Butterfly: ``value += shfl_xor(value, off)`` for off = 16, 8, 4, 2, 1; every lane gets the total."""
    for off in BUTTERFLY_OFFSETS:
        value += cuda.shfl_xor_sync(FULL_MASK, value, off)
    return value
