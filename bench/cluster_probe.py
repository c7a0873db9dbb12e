"""Probe: do thread-block clusters work from Numba (the first step of a split-kv combine through a cluster)?

A kernel reads the cluster rank (``%cluster_ctarank``), writes a value per thread into its CTA's shared memory, meets
the cluster's other CTAs at a cluster barrier (``barrier.cluster.arrive.release`` then ``wait.acquire``), and rank 0
sums the ``CLUSTER`` CTAs' values for its thread through distributed shared memory (``mapa.shared::cluster`` then
``ld.shared::cluster``); a second barrier keeps every CTA's shared memory alive until rank 0 has read it. All four
are inline PTX through ``numba.cuda.extending.intrinsic``.

1. On any machine: compile the kernel to sm_90 PTX and, if a ``ptxas`` is given (``--ptxas PATH``), to SASS, and
   print the registers. (2026-12-07, CPU machine, ptxas 13: compiles, 16 registers, no spills.)
2. On a GPU of sm_90 or later: launch it through ``cuda.core`` with ``LaunchConfig(cluster=CLUSTER)`` (Numba's own
   launch sets no cluster) and check every rank-0 row is ``sum_r (r + t) = 6 + 4 t`` and every other row untouched.
   (Written on 2026-12-07 without a GPU: this part has not run yet.)

    python bench/cluster_probe.py [--ptxas PATH]
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llvmlite import ir  # noqa: E402
from numba import cuda, float32, types, uint32  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

CLUSTER = 4
THREADS = 128
CLUSTERS = 3


@intrinsic
def cluster_ctarank(typingctx):
    """This CTA's rank in its cluster."""
    def codegen(context, builder, signature, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), []), "mov.u32 $0, %cluster_ctarank;", "=r",
                           side_effect=True)
        return builder.call(asm, [])
    return types.uint32(), codegen


@intrinsic
def cluster_sync(typingctx):
    """Every thread of the cluster arrives (release) and waits (acquire): writes to shared memory before it are seen
    by every CTA of the cluster after it."""
    def codegen(context, builder, signature, args):
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                           "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;",
                           "~{memory}", side_effect=True)
        builder.call(asm, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def load_remote_f32(typingctx, shared, index, rank):
    """``shared[index]`` in the shared memory of CTA ``rank`` of this cluster (``shared``: a 1-D float32 shared
    array, the same variable in every CTA)."""
    def codegen(context, builder, signature, args):
        array, at, cta = args
        data = context.make_array(signature.args[0])(context, builder, array).data
        generic = builder.ptrtoint(builder.gep(data, [at]), ir.IntType(64))
        asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(64), ir.IntType(32)]),
                           "{\n .reg .u64 a;\n .reg .u32 s, r;\n cvta.to.shared.u64 a, $1;\n cvt.u32.u64 s, a;\n"
                           " mapa.shared::cluster.u32 r, s, $2;\n ld.shared::cluster.f32 $0, [r];\n}",
                           "=f,l,r", side_effect=True)
        return builder.call(asm, [generic, cta])
    return float32(shared, index, rank), codegen


def make_probe_kernel(cluster: int):
    """The probe kernel for clusters of ``cluster`` CTAs."""

    def probe_kernel(out):
        stage = cuda.shared.array(THREADS, float32)
        t = cuda.threadIdx.x
        rank = cluster_ctarank()
        stage[t] = float32(rank) + float32(t)
        cluster_sync()
        if rank == 0 and cuda.blockIdx.x < out.shape[0] * cluster:  # in bounds whichever unit the grid was read in
            total = float32(0)
            for r in range(cluster):
                total += load_remote_f32(stage, t, uint32(r))
            out[cuda.blockIdx.x // cluster, t] = total
        cluster_sync()  # no CTA leaves while rank 0 may still read its shared memory

    return probe_kernel


SIGNATURE = "void(float32[:, ::1])"


def compile_check(ptxas: str | None) -> None:
    ptx, _ = cuda.compile_ptx(make_probe_kernel(CLUSTER), SIGNATURE, cc=(9, 0))
    found = {k: k in ptx for k in ("%cluster_ctarank", "barrier.cluster", "mapa.shared::cluster", "ld.shared::cluster")}
    print(f"sm_90 PTX: {found}")
    if ptxas:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        result = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
        used = [line.strip() for line in result.stderr.splitlines() if "Used" in line or "spill" in line]
        print(f"ptxas exit {result.returncode}: {' | '.join(used)}")


def run_on_gpu(cluster: int) -> bool:
    """Launch the probe in clusters of ``cluster`` CTAs (above 8, with the non-portable size allowed first)."""
    # ``from cuda import core``, not ``import cuda.core``: that would make ``cuda`` (Numba's here) a local name
    from cuda import core as cuda_core
    from cuda.core import LaunchConfig
    from cuda.core import launch as core_launch
    from numba.cuda.cudadrv.driver import _to_core_stream, binding, driver

    kernel = cuda.jit(SIGNATURE)(make_probe_kernel(cluster))
    out = cuda.to_device(np.full((CLUSTERS, THREADS), np.nan, np.float32))
    compiled = kernel.overloads[kernel.signatures[0]]
    function = compiled._codelibrary.get_cufunc()
    if cluster > 8:
        attribute = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        driver.cuKernelSetAttribute(attribute, 1, function.handle, cuda.get_current_device().id)
    stream = cuda.stream()
    writebacks, kernel_args = [], []
    compiled._prepare_args(compiled.argument_types[0], out, stream, writebacks, kernel_args)
    # cuda.core before 0.4 reads ``grid`` as blocks even with a cluster, 0.4 and later as clusters
    version = tuple(int(p) for p in cuda_core.__version__.split(".")[:2])
    grid = CLUSTERS if version >= (0, 4) else CLUSTERS * cluster
    config = LaunchConfig(grid=(grid,), cluster=(cluster,), block=(THREADS,))
    try:
        core_launch(_to_core_stream(stream), config, function.kernel, *kernel_args)
        stream.synchronize()
    except Exception as error:  # report and go on to the next size
        print(f"cluster {cluster}: launch failed: {error}")
        return False
    got = out.copy_to_host()
    expected = (np.arange(cluster).sum() + cluster * np.arange(THREADS)).astype(np.float32)
    ok = bool(np.array_equal(got, np.broadcast_to(expected, got.shape)))
    print(f"cuda.core {cuda_core.__version__}, cluster {cluster} on {cuda.get_current_device().name}: "
          f"{'correct' if ok else 'WRONG'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptxas", default=None, help="a ptxas binary, to compile the PTX to SASS too")
    args = parser.parse_args(argv)
    compile_check(args.ptxas)
    if cuda.is_available() and cuda.get_current_device().compute_capability >= (9, 0):
        return 0 if all([run_on_gpu(c) for c in (4, 8, 16)]) else 1
    print("no sm_90 GPU here: the launch was not run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
