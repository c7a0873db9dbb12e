"""Kernels compile to PTX for sm_90 on a CPU-only machine (numba.cuda.compile_ptx needs no GPU).

This catches typing errors that the CUDA simulator, which runs kernels as Python, cannot. The
compile runs in a subprocess with the simulator off, because a process chooses once.
"""

from helpers.ptx import run_compiled, run_compiled_in_parts

TOOLKIT_KERNEL = r'''
from numba import cuda, float32, uint32
import fp8lab.numba_kernels
from fp8lab.numba_kernels import bits

def toolkit_kernel(x, codes, out):
    t = cuda.threadIdx.x
    v = x[t]
    v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
    v += cuda.shfl_down_sync(0xFFFFFFFF, v, 1) + cuda.shfl_up_sync(0xFFFFFFFF, v, 1) + cuda.shfl_sync(0xFFFFFFFF, v, 0)
    c = uint32(codes[t])
    v += bits.f16_bits_to_f32((c & 0x80) << 8 | (c & 0x7F) << 7) + bits.bf16_bits_to_f32((c & 0x80) << 8 | (c & 0x7F) << 4)
    v += bits.u32_as_f32(bits.f32_as_u32(v) ^ uint32(1))
    if cuda.ballot_sync(0xFFFFFFFF, v > 0) != 0 and cuda.all_sync(cuda.activemask(), 1):
        cuda.syncwarp(0xFFFFFFFF)
    out[t] = float32(bits.f32_to_bf16_bits(v))

ptx, _ = cuda.compile_ptx(toolkit_kernel, "void(float32[:], uint8[:], float32[:])", cc=(9, 0))
for needle in ("shfl.sync.bfly.b32", "shfl.sync.down.b32", "shfl.sync.up.b32", "shfl.sync.idx.b32",
               "cvt.f32.f16", "vote.sync.ballot.b32", "bar.warp.sync", "activemask"):
    assert needle in ptx, needle
assert ".target sm_90" in ptx
print("ok")
'''


def test_toolkit_compiles_to_sm90_ptx():
    result = run_compiled(TOOLKIT_KERNEL)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


MMA_KERNEL = r'''
from numba import cuda
from fp8lab.numba_kernels.mma import mma_bf16, mma_f16

def calls_mma(a, b, c, d):
    lane = cuda.threadIdx.x
    r = mma_bf16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    s = mma_f16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1], r[0], r[1], r[2], r[3])
    d[lane, 0] = s[0]

ptx, _ = cuda.compile_ptx(calls_mma, "void(uint32[:, :], uint32[:, :], float32[:, :], float32[:, :])", cc=(9, 0))
assert "mma_m16n8k16_bf16" in ptx and "mma_m16n8k16_f16" in ptx
print("ok")
'''


def test_mma_helper_calls_compile_to_sm90_ptx():
    result = run_compiled(MMA_KERNEL)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


GEMM_MMA_KERNELS = r'''
import re, sys
from numba.cuda import compiler
from fp8lab.numba_kernels import gemm_mma as G

try:  # link-time optimization as numba-cuda does it on a GPU (nvJitLink through cuda.core)
    from cuda.core import Linker, LinkerOptions, ObjectCode
except ImportError:
    Linker = None


def variants():
    # every (m_blocks, warps_per_cta, n8_tiles_per_warp) with stages 2, 3, 4 in turn (so every
    # (warps, stages) pair too), BF16 -> float32; the deepest pipelines; the other formats once
    shapes = [(mb, w, t) for mb in G.M_BLOCKS_CHOICES for w in G.WARPS_PER_CTA_CHOICES
              for t in G.N8_TILES_PER_WARP_CHOICES]
    tilings = [G.Tiling(*shape, (2, 3, 4)[i % 3]) for i, shape in enumerate(shapes)]
    tilings += [G.Tiling(1, 4, 1, 8), G.Tiling(2, 4, 2, 8)]
    formats = [(a, o) for a in ("bf16", "f16") for o in ("f32", "f16", "bf16")]
    return [(t, "bf16", "f32") for t in tilings] + [(G.Tiling(1, 4, 1, 4), a, o) for a, o in formats[1:]]


def lto_link(objects, output):
    linker = Linker(*objects, options=LinkerOptions(arch="sm_90", link_time_optimization=True, ptx=output == "ptx",
                                                    verbose=output == "cubin"))
    code = linker.link(output).code
    return (code.decode().replace("\0", "") if output == "ptx" else code), linker.get_info_log()


part, parts = int(sys.argv[1]), int(sys.argv[2])
for tiling, activation, output in variants()[part::parts]:
    name = f"{tuple(tiling)} {activation} -> {output}"
    fn, sig = G.kernel_function(tiling, activation, output), G.kernel_signature(output)
    codes, _ = compiler.compile_all(fn, sig, device=False, abi="numba", cc=(9, 0), output="ltoir",
                                    launch_bounds=G.launch_bounds(tiling))
    if Linker is None:  # typed and compiled to LTO-IR is all that can be checked here
        continue
    ptx, _ = lto_link([ObjectCode.from_ltoir(c) if isinstance(c, bytes) else c for c in codes], "ptx")
    # the mma helper inlined (no call, no local memory); cp.async copies of 16 bytes (A through L1,
    # B through L2 only) and 4 (the scales), one commit per chunk, the wait for stages - 2 groups,
    # one barrier; float32 only; the CTA size as launch bound
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{activation}.{activation}.f32" in ptx, name
    assert "mma_m16n8k16" not in ptx and ".local" not in ptx, name
    for needle in ("cp.async.ca.shared.global [s], [g], 16,", "cp.async.cg.shared.global [s], [g], 16,",
                   "cp.async.ca.shared.global [s], [g], 4,", "cp.async.commit_group;",
                   f"cp.async.wait_group {tiling.stages - 2};", "bar.sync", "fma.rn.f32", f".maxntid {tiling.threads}",
                   ".minnctapersm 1"):
        assert needle in ptx, (name, needle)
    assert ".f64" not in ptx, name
    _, log = lto_link([ObjectCode.from_ltoir(c) if isinstance(c, bytes) else c for c in codes], "cubin")
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, (name, log)
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    print(f"{name}: {registers} registers, {tiling.shared_bytes} bytes shared")
print("ok")
'''


def test_gemm_mma_kernels_compile_to_sm90_ptx():
    """Variants of fp8lab.numba_kernels.gemm_mma (every CTA shape, stages 2 to 8, every format pair):
    typed and compiled for sm_90; after link-time optimization (as on a GPU) the mma helper inlined,
    cp.async copies of the right widths, no local memory, no float64, no spills (registers
    printed). Two compiler processes at a time."""
    for output in run_compiled_in_parts(GEMM_MMA_KERNELS):
        print(output)


SHARED_OPT_IN = r'''
import numpy as np
from numba.cuda.cudadrv import driver as cuda_driver
from fp8lab.numba_kernels import gemm_mma as G

calls, compiled = [], []
cuda_driver.driver.cuKernelSetAttribute = lambda *args: calls.append(args)  # no GPU here: record the calls


class Device:
    id = 3


class Function:
    handle, device = "kernel handle", Device()


function = Function()


class Compiled:
    class library:
        get_cufunc = staticmethod(lambda: function)


class Dispatcher:
    typeof_pyval = staticmethod(lambda value: type(value).__name__)

    def compile(self, argtypes):
        compiled.append(argtypes)
        return Compiled()


args = (np.zeros(2), np.uint32(3))
G._allow_shared_memory(Dispatcher(), args, 48 * 1024)  # the default: nothing to do
assert calls == [] and compiled == []
G._allow_shared_memory(Dispatcher(), args, 72 * 1024)
attribute = cuda_driver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
assert calls == [(attribute, 72 * 1024, "kernel handle", 3)] and compiled == [("ndarray", "uint32")], (calls, compiled)
G._allow_shared_memory(Dispatcher(), args, 60 * 1024)  # already allowed
G._allow_shared_memory(Dispatcher(), args, 100 * 1024)
assert [c[1] for c in calls] == [72 * 1024, 100 * 1024], calls
print("ok")
'''


def test_gemm_mma_opts_in_to_large_shared_memory():
    """More than 48 KiB of dynamic shared memory: the kernel compiled for the call's argument types
    gets CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES once per size increase (driver call recorded:
    no GPU here; the GPU tests launch such tilings)."""
    result = run_compiled(SHARED_OPT_IN)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


FP8_WEIGHT_KERNELS = r'''
import re, sys
from numba import cuda
from fp8lab.numba_kernels.dequantize import dequantize_kernel
from fp8lab.numba_kernels.gemv_simt import WORDS_PER_CHUNK, gemv_simt_kernel, tuning_candidates

ARRAY = {"f32": "float32", "f16": "float16", "bf16": "uint16"}


from helpers.ptx import ptxas_report


def check_resources(name, ptx):
    assert ".local" not in ptx, f"{name}: local memory (arrays not promoted to registers)"
    report = ptxas_report(ptx)
    if report is not None:
        assert "0 bytes spill stores" in report, f"{name}: {report}"
        print(name, [line.split(":", 1)[1].strip() for line in report.splitlines() if "Used" in line])


# The SIMT GEMV: the sweep's candidates for M = 1, 4 and 8 (BF16 in, float32 out), the other
# activation and output formats, tall tiles. (m_tile, activation, output, warps, group, columns)
gemv_variants = [(c["m_tile"], "bf16", "f32", c["warps_per_cta"], c["chunks_per_iteration"], c["columns_per_warp"])
                 for m in (1, 4, 8) for c in tuning_candidates(m)]
gemv_variants = list({v[:3] + v[4:]: v for v in reversed(gemv_variants)}.values())  # CTA size changes no code
gemv_variants += [(3, "f16", "f16", 2, 2, 2), (2, "f32", "bf16", 4, 4, 2), (1, "f32", "f32", 4, 2, 4),
                  (16, "bf16", "bf16", 4, 1, 2), (16, "f16", "f32", 4, 2, 1)]
part, parts = int(sys.argv[1]), int(sys.argv[2])
for m_tile, activation, output, warps, group, columns in gemv_variants[part::parts]:
    kernel = gemv_simt_kernel(m_tile, activation, output, 128, 128, warps, group, columns)
    signature = f"void(uint32[::1], uint32[::1], float32[::1], {ARRAY[output]}[:, ::1], int64, int64, int64)"
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    name = f"gemv_simt M_TILE={m_tile} {activation}->{output} warps={warps} G={group} NC={columns}"
    assert ".target sm_90" in ptx, name
    # 128-bit loads: the codes of every (chunk, column) of a group, in the prologue and in each of
    # the loop's two halves, and the activations of every (chunk, row) in the two halves
    codes = 3 * group * columns
    activations = 2 * group * m_tile * WORDS_PER_CHUNK[activation] // 4
    wide_loads = len(re.findall(r"ld\.global\.nc\.v4\.[uf]32", ptx))  # (float32 activations: .f32)
    assert wide_loads == codes + activations, (name, wide_loads)
    # unrolled: per (chunk, row, column) 16 products and a promotion, twice (the loop's two halves);
    # a 5-step butterfly per (row, column)
    assert ptx.count("fma.rn.f32") == 2 * group * m_tile * columns * 17, (name, ptx.count("fma.rn.f32"))
    assert ptx.count("shfl.sync.bfly.b32") == 5 * m_tile * columns, name
    # 32-bit index arithmetic: no division or remainder instruction, nothing in float64
    assert not re.search(r"\b(div|rem)\.[su]", ptx) and ".f64" not in ptx, name
    check_resources(name, ptx)

if part == 0:
    for output in ("f32", "f16", "bf16"):
        kernel = dequantize_kernel(output, 128, 128)
        signature = f"void(uint32[:, ::1], float32[:, ::1], {ARRAY[output]}[:, ::1])"
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
        name = f"dequantize ->{output}"
        assert "ld.global.u32" in ptx or "ld.global.nc.u32" in ptx, f"{name}: codes not loaded 4 at a time"
        assert "cvt.f32.f16" in ptx and "shfl" not in ptx, name
        check_resources(name, ptx)
print("ok")
'''


def test_fp8_weight_kernels_compile_to_sm90_ptx():
    """The SIMT GEMV's tuning candidates (every knob), each activation and output format, and the
    dequantize kernel: 128-bit loads of codes and activations, unrolled fma chains, the butterfly,
    32-bit index arithmetic, registers only (no local memory, and no spills where nvJitLink can run
    ptxas; the registers per variant are printed). Two compiler processes at a time."""
    for output in run_compiled_in_parts(FP8_WEIGHT_KERNELS):
        print(output)


# ---------------------------------------------------------------------------- KV cache write and split-kv decode

KV_KERNELS = r'''
import re, sys
from numba import cuda
from fp8lab.numba_kernels import kv_cache, splitkv


from helpers.ptx import ptxas_report


part, parts = int(sys.argv[1]), int(sys.argv[2])
variants = kv_cache.kernel_variants() + splitkv.kernel_variants()
for name, function, signature in variants[part::parts]:
    ptx, _ = cuda.compile_ptx(function, signature, cc=(9, 0))
    assert ".target sm_90" in ptx, name
    assert ".local" not in ptx, name  # every per-lane array lives in registers
    assert ".f64" not in ptx, name  # float32 throughout
    if name.startswith("cache_write") and "fp8" in name:
        assert "shfl.sync.bfly.b32" in ptx and "div.rn.f32" in ptx, name  # amax butterfly; x / scale correctly rounded
    if name.startswith("split"):
        assert "shfl.sync.bfly.b32" in ptx and "ex2.approx.f32" in ptx and "fma.rn.f32" in ptx, name
        assert re.search(r"ld\.global\.nc\.v4\.[uf]32\b", ptx), name  # a lane reads its 16 elements in 128-bit loads
    if name == "combine":
        assert "ex2.approx.f32" in ptx and "div.rn.f32" in ptx, name
    if name.startswith("split") and not any(f"head_dim={d}," in name for d in (64, 128, 256)):
        continue  # ptxas takes seconds per split kernel: its report for the common head sizes only
    report = ptxas_report(ptx)
    if report is not None:
        assert "0 bytes spill stores" in report, f"{name}: {report}"
        print(name, [line.split(":", 1)[1].strip() for line in report.splitlines() if "Used" in line])
print("ok")
'''


def test_kv_cache_and_splitkv_kernels_compile_to_sm90_ptx():
    """Every variant: 9 cache writes (input x cache format), 15 split kernels (3 cache formats x 4 head sizes
    with 4 heads per CTA, FP8 at 128 with 1 to 3 heads), the combine: no local memory, no float64, the expected load widths; no spills where nvJitLink can run
    ptxas. Two compiler processes at a time (each split variant takes 1-2 s)."""
    for output in run_compiled_in_parts(KV_KERNELS):
        print(output)
