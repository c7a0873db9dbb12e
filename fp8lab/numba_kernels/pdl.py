"""Programmatic dependent launch (PDL, sm_90 and later): the next kernel of a stream starts before this one ends.

Device functions and a host launch helper, no kernel. Checked in ``tests/numba_kernels/test_pdl.py`` (the PTX
holds the two instructions; on a GPU, a chain of launches in a CUDA graph sees every predecessor's writes).

Why: a decode step is a few hundred kernels, each too short to hide its own start and end (the launch, the
CTAs' dispatch, the ramp until enough loads are in flight, the last wave): about 1.7 us per kernel on an H200
(``bench/RESULTS.md``, "the read ceiling"), a quarter of a small GEMV's time. With PDL the GPU launches kernel
``n + 1`` while kernel ``n`` still runs; ``n + 1`` does what needs nothing from ``n`` (a GEMV's weight loads)
and then waits for ``n``.

The rules a kernel launched by ``launch`` follows (all of this package's kernels do; most begin with
``prologue()``, both calls at once, and the SIMT GEMV loads its first weights before the two):

- ``wait_for_prior_grids()`` (``griddepcontrol.wait``) before its first read of anything an earlier
  kernel of the stream writes and before its first global write (an earlier kernel may still be reading
  that buffer): it returns once every prerequisite grid has completed and its writes are visible. Only
  reads of data no kernel of the stream writes (weights, scales) may come before it. Since every kernel
  waits before it completes, completion is transitive: when ``n`` completes, so have all before it.
- ``launch_dependents()`` (``griddepcontrol.launch_dependents``) right after the wait: once every CTA of
  this grid has run it (or exited), the GPU may launch the next kernel of the stream. It only allows an
  early launch; it says nothing about this kernel's memory. After the wait, not before: then at most one
  kernel runs ahead, doing its weight loads while this one works. Triggered before the wait, every kernel
  of a step launched as soon as its predecessor had, and CTAs that only wait took the SMs' slots from the
  kernel that does the work: the Qwen3-0.6B step took 1,135 us against 960 us this way, the Qwen3-8B
  batch-4 step 7,764 against 7,569 us (``bench/RESULTS.md``, "programmatic dependent launch").
- A thread may leave before the wait only if it writes nothing, and at least one thread of the grid
  always waits (so the grid's completion implies its predecessor's, which the transitivity needs).

A kernel launched without the attribute (Numba's ``kernel[grid, block, stream](...)``) and a kernel
whose predecessor was launched so are ordered as usual; the two instructions are then no-ops. Inside
a CUDA graph capture, a PDL launch becomes a programmatic edge of the graph.

- On a GPU of sm_90 or later: inline PTX through ``numba.cuda.extending.intrinsic``. ``launch`` into a CUDA
  graph being captured compiles the kernel for its arguments as Numba does, then launches it through
  ``cuda.core`` with ``LaunchConfig(programmatic_stream_serialization=True)`` (Numba's own launch sets no
  attributes); on a stream it is Numba's launch (see ``launch`` for why).
- On an older GPU: the device functions are no-ops and ``launch`` is Numba's launch.
- In the CUDA simulator: the device functions do nothing (the simulator runs one kernel at a time)
  and ``launch`` is Numba's launch.
"""

from __future__ import annotations

from .bits import SIMULATOR

if SIMULATOR:
    HAS_PDL = False

    def launch_dependents():
        pass

    def wait_for_prior_grids():
        pass

    def prologue():
        pass

    def launch(kernel, griddim, blockdim, stream, *args, shared_bytes: int = 0) -> None:
        """``kernel[griddim, blockdim, stream, shared_bytes](*args)``: the simulator has no PDL."""
        kernel[griddim, blockdim, stream, shared_bytes](*args)

else:
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda.extending import intrinsic

    try:  # numba-cuda's own names (0.30): what a graph capture passes as its stream, and its cuda.core stream
        from numba.cuda.cudadrv.driver import GraphBuilder, _to_core_stream
    except ImportError:  # a numba-cuda without them: every launch is Numba's (the instructions are then no-ops)
        GraphBuilder = _to_core_stream = None

    def _compiles_for_sm90() -> bool:
        """Whether kernels compile for a GPU with ``griddepcontrol`` (sm_90 and later): this machine's GPU, or,
        without one, sm_90 (what the PTX checks compile for)."""
        return not cuda.is_available() or cuda.get_current_device().compute_capability >= (9, 0)

    HAS_PDL = _compiles_for_sm90()

    def _inline_ptx(instruction: str):
        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, signature, args):
                # side_effect and the memory clobber: LLVM neither drops it nor moves loads or stores across it
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), instruction, "~{memory}", side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return emit

    if HAS_PDL:
        launch_dependents = _inline_ptx("griddepcontrol.launch_dependents;")
        wait_for_prior_grids = _inline_ptx("griddepcontrol.wait;")
    else:  # before sm_90 every launch is an ordinary one, and the two are no-ops

        @cuda.jit(device=True, inline=True)
        def launch_dependents():
            pass

        @cuda.jit(device=True, inline=True)
        def wait_for_prior_grids():
            pass

    @cuda.jit(device=True, inline=True)
    def prologue():
        """Wait for the previous kernels, then let the next one launch: what a kernel runs before it reads their
        results or writes anything (most kernels as their first statement; the SIMT GEMV after its first loads)."""
        wait_for_prior_grids()
        launch_dependents()

    def launch(kernel, griddim, blockdim, stream, *args, shared_bytes: int = 0) -> None:
        """``kernel[griddim, blockdim, stream, shared_bytes](*args)``, as a programmatic dependent launch when
        ``stream`` is a ``cuda.core`` GraphBuilder (a CUDA graph being captured) on sm_90 or later.

        ``kernel``: a ``numba.cuda.jit`` kernel that follows the rules of the module docstring. Why only in
        graphs: this Python path (typing the arguments, then ``cuda.core``'s launch) costs about 18 us more
        per launch than Numba's own dispatch (40 against 22 us on the H200's host), which an eager forward
        would pay on every launch and a graph pays once, at capture. Compiles on first use for the
        arguments' types and passes them as Numba's launch would.
        """
        if not (HAS_PDL and GraphBuilder is not None and isinstance(stream, GraphBuilder)):
            kernel[griddim, blockdim, stream, shared_bytes](*args)
            return
        launch_through_core(kernel, stream, args, grid=griddim, block=blockdim, shmem_size=shared_bytes,
                            programmatic_stream_serialization=True)

    def launch_through_core(kernel, stream, args, prepare=None, **config) -> None:
        """``kernel(*args)`` on ``stream`` through ``cuda.core``'s launch with ``LaunchConfig(**config)`` (what Numba's
        own launch cannot set: PDL here, clusters in ``cluster.launch``). Compiles on first use for the arguments'
        types, calls ``prepare(function)`` on the compiled function if given (a function attribute to set), and
        passes the arguments as Numba's launch would."""
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        function = compiled._codelibrary.get_cufunc()
        if prepare is not None:
            prepare(function)
        writebacks, kernel_args = [], []
        for argument_type, value in zip(compiled.argument_types, args):
            compiled._prepare_args(argument_type, value, stream, writebacks, kernel_args)
        core_launch(_to_core_stream(stream), LaunchConfig(**config), function.kernel, *kernel_args)
        for writeback in writebacks:
            writeback()
