"""Thread-block clusters (sm_90 and later): CTAs that meet at one barrier and read each other's shared memory.

Device functions and a host launch helper, no kernel. Checked in ``tests/numba_kernels/test_cluster.py``: in the CUDA
simulator (``fp8lab.numba_kernels.cudasim``'s cluster emulation) and on a GPU (clusters of 4, 8 and 16 CTAs), a kernel
whose CTAs read each other's shared memory; its sm_90 PTX in ``tests/numba_kernels/test_kernels_compile.py``.

Why: a kernel whose CTAs must combine their results otherwise ends, and a second kernel combines them (a launch and
a round trip through the L2), or its last CTA does it serially after an atomic count and a fence. A cluster's CTAs
meet at a hardware barrier and read each other's partials from shared memory. No kernel uses it now: the split-kv
decode attention's shards merged in clusters (the combine kernel's bits) took 1.02 to 1.23 times as long as the split
kernel plus the combine, both as programmatic dependent launches in a graph (H100, 2026-12-07, ``bench/RESULTS.md``,
the index of negatives). It stays, tested on a GPU and in the simulator, for kernels where it may pay (a GEMM whose
CTAs share operand tiles, for instance).

- ``rank()``: this CTA's rank in its cluster (``%cluster_ctarank``): for a cluster of ``(1, 1, n)`` CTAs, ``blockIdx.z
  % n``.
- ``sync()``: every thread of the cluster arrives (``barrier.cluster.arrive.release``) and waits
  (``barrier.cluster.wait.acquire``): shared-memory writes of any CTA of the cluster before it are visible to every
  thread of the cluster after it. Every thread of every CTA of the cluster must call it (``.aligned``: all threads
  of a warp together).
- ``load_f32(shared, index, rank)``: element ``index`` (flat, in C order) of ``shared`` in the shared memory of CTA
  ``rank`` of this cluster (``mapa.shared::cluster`` then ``ld.shared::cluster``); ``shared``: a float32
  ``cuda.shared.array``, the same variable in every CTA. A CTA's shared memory lives as long as the CTA: a kernel whose CTAs read each other's
  calls ``sync()`` again before any CTA may exit.
- ``launch(kernel, griddim, blockdim, cluster_dims, stream, *args)``: the launch (Numba's own sets no cluster).

On a GPU the device functions are inline PTX through ``numba.cuda.extending.intrinsic``; in the CUDA simulator they
are ``cudasim``'s emulation, which runs the CTAs of a cluster at once (the simulator otherwise runs one CTA at a
time) with shared memory of their own.
"""

from __future__ import annotations

import math

from . import pdl
from .bits import SIMULATOR

PORTABLE_CLUSTER_SIZE = 8
"""The most CTAs a cluster holds on every GPU with clusters; sm_90 allows 16 once the kernel says so."""
MAX_CLUSTER_SIZE = 16


def dims3(dims) -> tuple[int, int, int]:
    """A launch dimension (an int or a tuple of 1 to 3) as a 3-tuple, missing dimensions 1."""
    dims = tuple(dims) if isinstance(dims, tuple) else (dims,)
    return dims + (1,) * (3 - len(dims))


def check_cluster_dims(griddim, cluster_dims) -> tuple[int, int, int]:
    """``cluster_dims`` as a 3-tuple, checked: at most ``MAX_CLUSTER_SIZE`` CTAs, dividing the grid in every dimension."""
    grid, cluster = dims3(griddim), dims3(cluster_dims)
    if not 1 <= math.prod(cluster) <= MAX_CLUSTER_SIZE or min(cluster) < 1:
        raise ValueError(f"cluster_dims: {cluster_dims} is not 1 to {MAX_CLUSTER_SIZE} CTAs")
    if any(g % c for g, c in zip(grid, cluster)):
        raise ValueError(f"cluster_dims: {cluster_dims} does not divide the grid {griddim}")
    return cluster


if SIMULATOR:
    from . import cudasim

    HAS_CLUSTERS = True  # emulated

    def rank():
        return cudasim.cluster_rank()

    def sync():
        cudasim.cluster_sync()

    def load_f32(shared, index, rank):
        return cudasim.remote_shared(shared, int(rank)).reshape(-1)[index]

    def launch(kernel, griddim, blockdim, cluster_dims, stream, *args, shared_bytes: int = 0) -> None:
        """``kernel[griddim, blockdim, stream, shared_bytes](*args)`` with the CTAs of each cluster run at once."""
        cluster = check_cluster_dims(griddim, cluster_dims)
        with cudasim.clusters(cluster):
            kernel[griddim, blockdim, stream, shared_bytes](*args)

else:
    from llvmlite import ir
    from numba import cuda, float32, types
    from numba.cuda.extending import intrinsic

    try:  # numba-cuda's own names (0.30), as pdl uses them
        from numba.cuda.cudadrv.driver import (
            GraphBuilder,
            _to_core_stream,
            binding,
            driver,
        )
    except ImportError:  # a numba-cuda without them: no cluster launch
        GraphBuilder = _to_core_stream = None

    HAS_CLUSTERS = pdl.HAS_PDL and _to_core_stream is not None  # sm_90 and later, as PDL

    @intrinsic
    def rank(typingctx):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), []), "mov.u32 $0, %cluster_ctarank;", "=r")
            return builder.call(asm, [])

        return types.uint32(), codegen

    @intrinsic
    def sync(typingctx):
        def codegen(context, builder, signature, args):
            # the memory clobber: LLVM moves no shared-memory access across the barrier
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                               "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;",
                               "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def load_f32(typingctx, shared, index, cta):
        def codegen(context, builder, signature, args):
            array, at, which = args
            data = context.make_array(signature.args[0])(context, builder, array).data
            # this CTA's element as a 32-bit shared-window address (LLVM folds the cast of a shared array's generic
            # pointer back to the window: no 64-bit generic address to keep), then CTA ``which``'s copy of it
            element = builder.addrspacecast(builder.gep(data, [at]), ir.PointerType(ir.FloatType(), 3))
            shared_address = builder.ptrtoint(element, ir.IntType(32))
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(32), ir.IntType(32)]),
                               "{\n .reg .u32 r;\n mapa.shared::cluster.u32 r, $1, $2;\n ld.shared::cluster.f32 $0, [r];\n}",
                               "=f,r,r,~{memory}", side_effect=True)
            return builder.call(asm, [shared_address, which])

        return float32(shared, types.intp, types.uint32), codegen  # the call casts index and rank to these

    _non_portable_allowed: set[int] = set()

    def _allow_non_portable(function) -> None:
        """Let ``function`` launch clusters of more than 8 CTAs (``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED``)."""
        key = int(function.handle)
        if key not in _non_portable_allowed:
            attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            driver.cuKernelSetAttribute(attribute, 1, function.handle, cuda.get_current_device().id)
            _non_portable_allowed.add(key)

    def _cuda_core_grid_is_clusters() -> bool:
        """cuda.core 0.4 and later read ``LaunchConfig.grid`` as clusters when a cluster is given, earlier ones as CTAs."""
        from cuda import core as cuda_core

        return tuple(int(p) for p in cuda_core.__version__.split(".")[:2]) >= (0, 4)

    def launch(kernel, griddim, blockdim, cluster_dims, stream, *args, shared_bytes: int = 0) -> None:
        """``kernel[griddim, blockdim, stream, shared_bytes](*args)`` in clusters of ``cluster_dims`` CTAs (a dividing
        tuple; more than 8 CTAs allowed), through ``cuda.core`` on any stream; inside a CUDA-graph capture also as a
        programmatic dependent launch (``pdl.launch``'s rule). ``kernel`` follows ``pdl``'s rules.

        Every launch pays cuda.core's Python path (about 18 us more than Numba's own, ``pdl.launch``): Numba's
        launch sets no cluster. Raises ``RuntimeError`` on a GPU without clusters (before sm_90)."""
        if not HAS_CLUSTERS:
            raise RuntimeError("cluster.launch: this GPU has no thread-block clusters (sm_90 and later)")
        cluster = check_cluster_dims(griddim, cluster_dims)
        grid = dims3(griddim)
        if _cuda_core_grid_is_clusters():
            grid = tuple(g // c for g, c in zip(grid, cluster))
        in_graph = GraphBuilder is not None and isinstance(stream, GraphBuilder)
        pdl.launch_through_core(kernel, stream, args,
                                prepare=_allow_non_portable if math.prod(cluster) > PORTABLE_CLUSTER_SIZE else None,
                                grid=grid, cluster=cluster, block=blockdim, shmem_size=shared_bytes,
                                programmatic_stream_serialization=in_graph)
