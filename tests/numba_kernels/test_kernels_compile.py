"""Kernels compile to PTX for sm_90 on a CPU-only machine (numba.cuda.compile_ptx needs no GPU).

This catches typing errors that the CUDA simulator, which runs kernels as Python, cannot. A
process chooses the simulator once, so the variants compile in subprocesses with the simulator off
(``helpers.ptx.compile_sets``): every variant of this module once, in one queue shared by two
compile processes, before the first test here; each test then checks the PTX of its set in this
process. Run with ``-v`` (or ``-s``) to see a line per compiled variant. ``PTX_VARIANT_SETS`` is the
name a session hook may look for to start these compiles in the background right after collection
(``helpers.ptx.start_compiling``); the fixture then only collects them.
"""

import re

import pytest
from helpers.ptx import (
    check_pdl_rules,
    compile_sets,
    each_variant,
    progress_printer,
    run_compiled,
)

from fp8lab.numba_kernels.gemv_mma import REGISTERS, REGISTERS_TWO_TILES

# ---------------------------------------------------------------------------- the variant sets (run with the simulator off)

TOOLKIT = r'''
from numba import cuda, float32, uint32
import fp8lab.numba_kernels
from fp8lab.numba_kernels import bits, mathops
from helpers.ptx import Variant

def toolkit_kernel(x, codes, out):
    t = cuda.threadIdx.x
    v = x[t]
    v += cuda.shfl_xor_sync(0xFFFFFFFF, v, 16)
    v += cuda.shfl_down_sync(0xFFFFFFFF, v, 1) + cuda.shfl_up_sync(0xFFFFFFFF, v, 1) + cuda.shfl_sync(0xFFFFFFFF, v, 0)
    c = uint32(codes[t])
    v += bits.f16_bits_to_f32((c & 0x80) << 8 | (c & 0x7F) << 7) + bits.bf16_bits_to_f32((c & 0x80) << 8 | (c & 0x7F) << 4)
    v += bits.u32_as_f32(bits.f32_as_u32(v) ^ uint32(1))
    v += bits.f16_bits_to_f32(bits.e4m3x2_to_f16x2(c | (c << uint32(8))))
    if cuda.ballot_sync(0xFFFFFFFF, v > 0) != 0 and cuda.all_sync(cuda.activemask(), 1):
        cuda.syncwarp(0xFFFFFFFF)
    out[t] = float32(mathops.f32_to_bf16_bits_rne(v))

def variants():
    return [Variant("toolkit", toolkit_kernel, "void(float32[:], uint8[:], float32[:])")]
'''

MMA_HELPER = r'''
from numba import cuda
from fp8lab.numba_kernels.mma import mma_bf16, mma_f16
from helpers.ptx import Variant

def calls_mma(a, b, c, d):
    lane = cuda.threadIdx.x
    r = mma_bf16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    s = mma_f16(a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1], r[0], r[1], r[2], r[3])
    d[lane, 0] = s[0]

def variants():
    return [Variant("calls_mma", calls_mma, "void(uint32[:, :], uint32[:, :], float32[:, :], float32[:, :])",
                    resources=False)]  # the helper is CUDA C++ linked in later: ptxas cannot resolve the calls
'''

GEMM_MMA = r'''
from fp8lab.numba_kernels import gemm_mma as G
from helpers.ptx import Variant

def variants():
    # every small-M (m_blocks, warps_n, n8_tiles_per_warp) with stages 2, 3, 4 in turn (so every
    # (warps, stages) pair too), BF16 -> float32; the deepest pipelines; the large-M tilings; the
    # other formats once
    shapes = [(mb, w, t) for mb in (1, 2) for w in (1, 2, 4) for t in (1, 2)]
    tilings = [G.Tiling(*shape, (2, 3, 4)[i % 3]) for i, shape in enumerate(shapes)]
    tilings += [G.Tiling(1, 4, 1, 8), G.Tiling(2, 4, 2, 8)]
    tilings += [G.Tiling(4, 4, 4, 3, 2), G.Tiling(2, 4, 4, 3, 4), G.Tiling(4, 2, 4, 4, 2)]  # 128-row CTAs
    tilings += [G.Tiling(4, 8, 4, 3, 1), G.Tiling(4, 4, 4, 3, 2, True)]  # 8 warps in N; the codes placed once
    formats = [(a, o) for a in ("bf16", "f16") for o in ("f32", "f16", "bf16")]
    cases = [(t, "bf16", "f32") for t in tilings] + [(G.Tiling(1, 4, 1, 4), a, o) for a, o in formats[1:]]
    return [Variant(f"{tuple(t)} {a} -> {o}", G.kernel_function(t, a, o), G.kernel_signature(o), lto=True,
                    launch_bounds=G.launch_bounds(t),
                    info={"activation": a, "stages": t.stages, "threads": t.threads, "shared_bytes": t.shared_bytes})
            for t, a, o in cases]
'''

GEMM_WGMMA = r'''
from fp8lab.numba_kernels import gemm_wgmma as G
from helpers.ptx import Variant

def variants():
    cases = [(G.Tiling(), "f32"), (G.Tiling(), "bf16"), (G.Tiling(64, 2, 5), "f32"), (G.Tiling(64, 1, 6), "bf16"),
             (G.Tiling(128, 1, 4), "f32"), (G.Tiling(128, 2, 4, 1), "f32"), (G.Tiling(128, 2, 4, 2), "bf16")]
    return [Variant(f"{tuple(t)} -> {o}", G.kernel_function(t, o), G.kernel_signature(o), launch_bounds=(t.threads, 1),
                    arch_specific=True, info={"tokens": t.tokens, "stages": t.stages, "threads": t.threads, "parts": t.parts})
            for t, o in cases]
'''

GEMM_WGMMA_SS = r'''
from fp8lab.numba_kernels import gemm_wgmma_ss as G
from helpers.ptx import Variant

def variants():
    return [Variant(f"gemm_wgmma_ss -> {o}", G.kernel_function(o), G.kernel_signature(o), launch_bounds=(G.THREADS, 1),
                    arch_specific=True) for o in ("f32",)]  # a BF16 out changes only the stores
'''

GEMV_MMA = r'''
from fp8lab.numba_kernels import gemv_mma as G
from helpers.ptx import Variant

def variants():
    # every k slicing the engine picks (default_k_slices: 2, 4 or 8) at its depths, depth 1 once more, float32 in,
    # SwiGLU; two batch tiles (9 to 16 rows) and a BF16 output, as the engine runs them; three and four (17 to 32
    # rows) at their deepest rings. (Depth 4 and one warp per CTA, which the defaults never pick, are left to the
    # simulator tests: each variant costs the CPU suite about 36 s of ptxas beside it.)
    cases = [(2, "bf16", False, 3, 1, "f32"), (4, "bf16", False, 3, 1, "f32"),
             (8, "bf16", False, 2, 1, "f32"), (4, "bf16", False, 1, 1, "f32"),
             (4, "f32", False, 2, 1, "f32"), (2, "bf16", True, 3, 1, "f32"), (2, "bf16", True, 3, 1, "bf16"),
             (4, "bf16", False, 2, 2, "f32"), (8, "bf16", False, 2, 2, "f32"), (2, "bf16", True, 2, 2, "bf16"),
             (2, "bf16", True, 1, 1, "bf16"), (8, "bf16", False, 1, 2, "f32"),  # default_depth's 1 (8B gate/up, o, down)
             (4, "bf16", False, 3, 3, "f32"), (4, "bf16", False, 2, 4, "f32"), (2, "bf16", True, 1, 4, "bf16")]  # 17-32 rows
    cases = [case + ("e4m3",) for case in cases]
    cases += [(2, "bf16", False, 2, 1, "f32", "bf16"), (2, "bf16", False, 2, 2, "f32", "bf16"),  # the lm_head form,
              (2, "f32", False, 2, 2, "f32", "bf16")]  # and on a prefill's float32 rows (250 registers, no spill)
    cases = [case + (1,) for case in cases]
    # two column tiles where the defaults take them (8B o / down at 32 rows, gate/up at 16)
    cases += [(8, "bf16", False, 1, 4, "f32", "e4m3", 2), (2, "bf16", True, 1, 2, "bf16", "e4m3", 2)]
    return [Variant(f"gemv_mma{'_swiglu' if swiglu else ''} k_slices={ks} {activation} depth={depth}"
                    f" batch_tiles={tiles} out={output} weights={weights} column_tiles={ct}",
                    G.gemv_mma_kernel(ks, activation, swiglu, depth, tiles, output, weights, ct).py_func,
                    G.kernel_signature(output), lto=True,
                    info={"k_slices": ks, "ring": [activation, weights, swiglu, tiles, depth, ct]})
            for ks, activation, swiglu, depth, tiles, output, weights, ct in cases]
'''

GEMV_SIMT = r'''
from fp8lab.numba_kernels.gemv_simt import WORDS_PER_CHUNK, gemv_simt_kernel, tuning_candidates
from helpers.ptx import Variant

ARRAY = {"f32": "float32", "f16": "float16", "bf16": "uint16"}

def variants():
    # the sweep's candidates for M = 1, 4 and 8 (BF16 in, float32 out), the other activation and
    # output formats, tall tiles: (m_tile, activation, output, warps, group, columns)
    cases = [(c["m_tile"], "bf16", "f32", c["warps_per_cta"], c["chunks_per_iteration"], c["columns_per_warp"])
             for m in (1, 4, 8) for c in tuning_candidates(m)]
    cases = list({v[:3] + v[4:]: v for v in reversed(cases)}.values())  # CTA size changes no code
    cases += [(3, "f16", "f16", 2, 2, 2), (2, "f32", "bf16", 4, 4, 2), (1, "f32", "f32", 4, 2, 4),
              (16, "bf16", "bf16", 4, 1, 2), (16, "f16", "f32", 4, 2, 1)]
    cases = [c + (False,) for c in cases] + [(4, "bf16", "f32", 4, 2, 2, True), (1, "f32", "f32", 8, 1, 4, True)]
    return [Variant(f"gemv_simt{'_swiglu' if swiglu else ''} M_TILE={m_tile} {activation}->{output} warps={warps} "
                    f"G={group} NC={columns}",
                    gemv_simt_kernel(m_tile, activation, output, 128, 128, warps, group, columns, swiglu).py_func,
                    f"void(uint32[::1], uint32[::1], float32[::1], {ARRAY[output]}[:, ::1], int64, int64, int64, int64)",
                    info={"m_tile": m_tile, "group": group, "columns": columns, "swiglu": swiglu,
                          "words_per_chunk": WORDS_PER_CHUNK[activation]})
            for m_tile, activation, output, warps, group, columns, swiglu in cases]
'''

DEQUANTIZE = r'''
from fp8lab.numba_kernels.dequantize import dequantize_kernel
from helpers.ptx import Variant

ARRAY = {"f32": "float32", "f16": "float16", "bf16": "uint16"}

def variants():
    return [Variant(f"dequantize ->{output}", dequantize_kernel(output, 128, 128).py_func,
                    f"void(uint32[:, ::1], float32[:, ::1], {ARRAY[output]}[:, ::1])") for output in ("f32", "f16", "bf16")]
'''

KV_CACHE_AND_SPLITKV = r'''
from fp8lab.numba_kernels import kv_cache, prefill_mma, splitkv, splitkv_mma
from helpers.ptx import Variant

def variants():
    return [Variant(*v) for v in kv_cache.kernel_variants() + splitkv.kernel_variants() + splitkv_mma.kernel_variants()
            + prefill_mma.kernel_variants()]
'''

PREFILL_WGMMA = r'''
from fp8lab.numba_kernels import prefill_wgmma as P
from helpers.ptx import Variant

def variants():
    return [Variant(name, f, sig, launch_bounds=P.launch_bounds(w), arch_specific=True, info={"warpgroups": w})
            for name, f, sig, w in P.kernel_variants()]
'''

ATTENTION_INPUT = r'''
from fp8lab.numba_kernels import attention_input
from helpers.ptx import Variant

def variants():
    return [Variant(*v) for v in attention_input.kernel_variants()]
'''

PDL_RULES = r'''
from numba import cuda
from fp8lab.numba_kernels import pdl
from helpers.ptx import Variant

def follows_the_rules(x, out):
    pdl.prologue()
    out[cuda.threadIdx.x] = x[cuda.threadIdx.x]

def writes_before_the_wait(x, out):
    out[cuda.threadIdx.x] = 1.0
    pdl.prologue()
    out[cuda.threadIdx.x] += x[cuda.threadIdx.x]

def reads_before_the_wait(x, out):
    v = x[cuda.threadIdx.x]
    pdl.prologue()
    out[cuda.threadIdx.x] = v

def triggers_before_the_wait(x, out):
    pdl.launch_dependents()
    pdl.wait_for_prior_grids()
    out[cuda.threadIdx.x] = x[cuda.threadIdx.x]

def variants():
    return [Variant(f.__name__, f, "void(float32[:], float32[:])") for f in
            (follows_the_rules, writes_before_the_wait, reads_before_the_wait, triggers_before_the_wait)]
'''

CLUSTER = r'''
from numba import cuda, float32, uint32
from fp8lab.numba_kernels import cluster
from helpers.ptx import Variant

def reads_the_next_ctas_shared_memory(x, out):
    stage = cuda.shared.array(128, float32)
    t = cuda.threadIdx.x
    rank = cluster.rank()
    stage[t] = x[t] + float32(rank)
    cluster.sync()
    out[cuda.blockIdx.x, t] = cluster.load_f32(stage, t, uint32((rank + 1) % 4))
    cluster.sync()

def variants():
    return [Variant("cluster exchange", reads_the_next_ctas_shared_memory, "void(float32[:], float32[:, ::1])")]
'''

PTX_VARIANT_SETS = {"gemv_simt": GEMV_SIMT, "gemv_mma": GEMV_MMA, "kv_cache and splitkv": KV_CACHE_AND_SPLITKV, "gemm_mma": GEMM_MMA,
                    "gemm_wgmma": GEMM_WGMMA, "gemm_wgmma_ss": GEMM_WGMMA_SS, "prefill_wgmma": PREFILL_WGMMA,
                    "attention_input": ATTENTION_INPUT, "dequantize": DEQUANTIZE, "mma helper": MMA_HELPER,
                    "toolkit": TOOLKIT, "pdl rules": PDL_RULES, "cluster": CLUSTER}
"""Everything this module compiles; the slowest sets first, so that the queue ends with short compiles."""


@pytest.fixture(scope="module")
def compiled(request):
    """Every variant of ``PTX_VARIANT_SETS`` compiled once for the module (two processes sharing one queue)."""
    return compile_sets(PTX_VARIANT_SETS, progress=progress_printer(request.config))


def registers(report: str) -> list[str]:
    """ptxas's "Used N registers, ..." lines."""
    return [line.split(":", 1)[1].strip() for line in report.splitlines() if "Used" in line]


def check_no_spills(c) -> None:
    """Registers only: no local memory in the PTX, no spills where nvJitLink can run ptxas (registers printed)."""
    assert ".local" not in c.ptx, "local memory (arrays not promoted to registers)"
    if c.resources is not None:
        assert "0 bytes spill stores" in c.resources, c.resources
        print(c.name, registers(c.resources))


# ---------------------------------------------------------------------------- the checks


def test_toolkit_compiles_to_sm90_ptx(compiled):
    def check(c):
        for needle in ("shfl.sync.bfly.b32", "shfl.sync.down.b32", "shfl.sync.up.b32", "shfl.sync.idx.b32",
                       "cvt.f32.f16", "vote.sync.ballot.b32", "bar.warp.sync", "activemask", "cvt.rn.f16x2.e4m3x2"):
            assert needle in c.ptx, needle
        assert ".target sm_90" in c.ptx

    each_variant(compiled["toolkit"], check)


def test_cluster_functions_compile_to_sm90_ptx(compiled):
    """``fp8lab.numba_kernels.cluster``: the rank, both halves of the cluster barrier, and a load from another CTA's
    shared memory through its 32-bit shared-window address (no generic address: ``mapa`` takes the ``.u32`` form)."""
    def check(c):
        for needle in ("mov.u32", "%cluster_ctarank", "barrier.cluster.arrive.release.aligned",
                       "barrier.cluster.wait.acquire.aligned", "mapa.shared::cluster.u32", "ld.shared::cluster.f32"):
            assert needle in c.ptx, needle
        assert ".target sm_90" in c.ptx
        check_no_spills(c)

    each_variant(compiled["cluster"], check)


def test_the_pdl_rule_check_rejects_each_broken_rule(compiled):
    """``check_pdl_rules`` passes a kernel that follows ``pdl``'s rules and names each broken one."""
    by_name = {c.name: c.ptx for c in compiled["pdl rules"]}
    check_pdl_rules(by_name["follows_the_rules"])
    for name, message in (("writes_before_the_wait", "a store before"), ("reads_before_the_wait", "a load before"),
                          ("triggers_before_the_wait", "launch_dependents before the wait")):
        with pytest.raises(AssertionError, match=message):
            check_pdl_rules(by_name[name])


def test_mma_helper_calls_compile_to_sm90_ptx(compiled):
    def check(c):
        assert "mma_m16n8k16_bf16" in c.ptx and "mma_m16n8k16_f16" in c.ptx

    each_variant(compiled["mma helper"], check)


def test_gemm_mma_kernels_compile_to_sm90_ptx(compiled):
    """Variants of fp8lab.numba_kernels.gemm_mma (every small-M CTA shape, stages 2 to 8, every format pair, three
    large-M CTAs of 128 rows):
    typed and compiled for sm_90; after link-time optimization (as on a GPU) the mma helper inlined,
    cp.async copies of the right widths, no local memory, no float64, no spills (registers
    printed). Without cuda.core only the compile to LTO-IR is checked."""
    def check(c):
        if c.ptx is None:
            return
        info = c.info
        # the mma helper inlined (no call, no local memory); cp.async copies of 16 bytes (A through L1,
        # B through L2 only) and 4 (the scales), one commit per chunk, the wait for stages - 2 groups,
        # one barrier; float32 only; the CTA size as launch bound
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{info['activation']}.{info['activation']}.f32" in c.ptx
        assert "mma_m16n8k16" not in c.ptx and ".local" not in c.ptx
        for needle in ("cp.async.ca.shared.global [s], [g], 16,", "cp.async.cg.shared.global [s], [g], 16,",
                       "cp.async.ca.shared.global [s], [g], 4,", "cp.async.commit_group;",
                       f"cp.async.wait_group {info['stages'] - 2};", "bar.sync", "fma.rn.f32",
                       f".maxntid {info['threads']}", ".minnctapersm 1"):
            assert needle in c.ptx, needle
        assert ".f64" not in c.ptx
        check_pdl_rules(c.ptx)
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in c.resources, c.resources
        used = int(re.search(r"Used (\d+) registers", c.resources).group(1))
        print(f"{c.name}: {used} registers, {info['shared_bytes']} bytes shared")

    each_variant(compiled["gemm_mma"], check)


def test_gemm_wgmma_kernels_compile_to_sm90a_ptx(compiled):
    """Variants of fp8lab.numba_kernels.gemm_wgmma, compiled for sm_90a as on a Hopper GPU: the warpgroup mma of the
    tiling's width (8 per chunk: the first chunk's, peeled, and the loop's), its fence, commit and wait, the proxy
    fence after the copies (16-byte ones from flat sources: 32-bit shared addresses, one ``mad.wide.u32`` a source), no
    float64, no 64-bit division (a subroutine call: ptxas then serializes every wgmma), and no ptxas warning that it
    serialized the wgmma (registers and spills printed)."""
    def check(c):
        info = c.info
        assert ".target sm_90a" in c.ptx
        wgmmas = c.ptx.count(f"wgmma.mma_async.sync.aligned.m64n{info['tokens']}k16.f32.bf16.bf16")
        assert wgmmas == 16  # the peeled chunk's and the loop's
        assert c.ptx.count("wgmma.fence.sync.aligned;") == 2 * info["parts"]  # one before each part's wgmma
        for needle in ("wgmma.fence.sync.aligned;", "wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 0;",
                       "fence.proxy.async.shared::cta;",
                       "mad.wide.u32 g,", "cp.async.cg.shared.global [%r", "cp.async.ca.shared.global [s], [g], 4,",
                       f"cp.async.wait_group {info['stages'] - 3};", "prmt.b32", f".maxntid {info['threads']}"):
            assert needle in c.ptx, needle
        assert "cp.async.ca.shared.global [s], [g], 16," not in c.ptx  # activations bypass L1 (15 to 20% faster)
        # no float64, and no division instruction or call at all: div.rn's slow path and a 64-bit integer division
        # are subroutine calls, and a call makes ptxas serialize every wgmma
        assert ".f64" not in c.ptx
        assert not re.search(r"(div|rem)\.[us]64|div\.rn|\bcall", c.ptx)
        check_pdl_rules(c.ptx)
        if c.resources is not None:
            assert "wgmma.mma_async instructions are serialized" not in c.resources, c.resources
            spills = re.search(r"(\d+) bytes spill stores", c.resources)
            print(f"{c.name}: {registers(c.resources)}, {spills.group(0) if spills else ''}")

    each_variant(compiled["gemm_wgmma"], check)


def test_gemm_wgmma_ss_compiles_to_sm90a_ptx(compiled):
    """fp8lab.numba_kernels.gemm_wgmma_ss for sm_90a: 16 warpgroup mma with both operands as descriptors (the peeled
    chunk's and the loop's), the named barriers' non-aligned sync and arrive, the producer's 128-bit stores and the
    proxy fence after them, no float64, no division or call, and within the 168 registers of a 384-thread CTA without spills or
    serialized wgmma."""
    def check(c):
        assert ".target sm_90a" in c.ptx and ".maxntid 384" in c.ptx
        assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+,",
                              c.ptx)) == 16
        for needle in ("barrier.sync %r", "barrier.arrive %r", "fence.proxy.async.shared::cta;",
                       "wgmma.wait_group.sync.aligned 0;", "cp.async.wait_group 1;", "prmt.b32", "st.shared.v4.u32"):
            assert needle in c.ptx, needle
        assert ".f64" not in c.ptx and ".local" not in c.ptx
        assert not re.search(r"(div|rem)\.[us]64|div\.rn|\bcall", c.ptx)
        check_pdl_rules(c.ptx)
        if c.resources is not None:
            assert "wgmma.mma_async instructions are serialized" not in c.resources, c.resources
            assert "0 bytes spill stores" in c.resources, c.resources
            assert int(re.search(r"Used (\d+) registers", c.resources).group(1)) <= 168
            print(c.name, registers(c.resources))

    each_variant(compiled["gemm_wgmma_ss"], check)


def test_gemv_mma_kernels_compile_to_sm90_ptx(compiled):
    """Variants of fp8lab.numba_kernels.gemv_mma (every k slicing, float32 and BF16 activations, SwiGLU): the mma
    helper inlined after link-time optimization, 128-bit read-only loads of codes and activations, a barrier only
    with several warps, no local memory, no float64, the PDL rule, no spills (registers printed)."""
    def check(c):
        if c.ptx is None:
            return
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in c.ptx
        assert "mma_m16n8k16" not in c.ptx and ".local" not in c.ptx and ".f64" not in c.ptx
        assert "ld.global.nc.v4.u32" in c.ptx and "fma.rn.f32" in c.ptx
        assert ("bar.sync" in c.ptx) == (c.info["k_slices"] > 1)
        check_pdl_rules(c.ptx, weights_before_wait=True)  # the first chunk's codes load before the wait
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in c.resources, c.resources
        print(c.name, registers(c.resources))
        activation, weights, swiglu, tiles, depth, column_tiles = c.info["ring"]
        if activation == "bf16" and weights == "e4m3" and depth <= 3:  # the registers default_depth counts on
            used = int(re.search(r"Used (\d+) registers", c.resources).group(1))
            table = REGISTERS if column_tiles == 1 else REGISTERS_TWO_TILES
            # the same allocation (registers are given 8 a thread): k_slices = 1 (no CTA sum) may use 2 fewer
            assert -(-used // 8) == -(-table[bool(swiglu), tiles][depth - 1] // 8), (c.name, used)

    each_variant(compiled["gemv_mma"], check)


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


def test_fp8_weight_kernels_compile_to_sm90_ptx(compiled):
    """The SIMT GEMV's tuning candidates (every knob), each activation and output format, and the
    dequantize kernel: 128-bit loads of codes and activations, unrolled fma chains, the butterfly,
    32-bit index arithmetic, registers only (no local memory, and no spills where nvJitLink can run
    ptxas; the registers per variant are printed)."""
    def check_gemv(c):
        ptx, info = c.ptx, c.info
        group, columns, m_tile = info["group"], info["columns"], info["m_tile"]
        assert ".target sm_90" in ptx
        # 128-bit loads: the codes of every (chunk, column) of a group, in the prologue and in each of
        # the loop's two halves, and the activations of every (chunk, row) in the two halves
        codes = 3 * group * columns
        activations = 2 * group * m_tile * info["words_per_chunk"] // 4
        wide_loads = len(re.findall(r"ld\.global\.nc\.v4\.[uf]32", ptx))  # (float32 activations: .f32)
        assert wide_loads == codes + activations, wide_loads
        # unrolled: per (chunk, row, column) 16 products and a promotion, twice (the loop's two halves);
        # a 5-step butterfly per (row, column)
        # (SwiGLU: expf takes 4 more fmas per output, columns / 2 outputs per row)
        epilogue = 2 * m_tile * columns if info["swiglu"] else 0
        assert ptx.count("fma.rn.f32") == 2 * group * m_tile * columns * 17 + epilogue, ptx.count("fma.rn.f32")
        assert ptx.count("shfl.sync.bfly.b32") == 5 * m_tile * columns
        # 32-bit index arithmetic: no division or remainder instruction, nothing in float64
        assert not re.search(r"\b(div|rem)\.[su]", ptx) and ".f64" not in ptx
        check_pdl_rules(ptx, weights_before_wait=True)  # the first group's codes and scales load before the wait
        check_no_spills(c)

    def check_dequantize(c):
        assert "ld.global.u32" in c.ptx or "ld.global.nc.u32" in c.ptx, "codes not loaded 4 at a time"
        assert "cvt.f32.f16" in c.ptx and "shfl" not in c.ptx
        check_pdl_rules(c.ptx)
        check_no_spills(c)

    each_variant(compiled["gemv_simt"], check_gemv)
    each_variant(compiled["dequantize"], check_dequantize)


# ---------------------------------------------------------------------------- KV cache write and split-kv decode


def test_prefill_wgmma_compiles_to_sm90a_ptx(compiled):
    """fp8lab.numba_kernels.prefill_wgmma for sm_90a (Qwen3-8B's group of 4 with float32 out, in CTAs of one and two
    warpgroups, Qwen3-0.6B's 2 with BF16 out): per tile 8 ``m64n64k16`` F16 ``wgmma`` for the scores and 4 ``m64n128k16`` for ``P V``, every wait a
    ``wait_group 0``; the codes decoded by ``cvt.rn.f16x2.e4m3x2`` and stored 16 bytes at a time; no division
    instruction (``div.rn``'s subroutine serializes ``wgmma``: C7509) and no ptxas warning that it serialized them
    (registers printed); no float64 but the division's, no local memory, no spills; the PDL rules."""
    def check(c):
        ptx = c.ptx
        warpgroups = c.info["warpgroups"]
        assert ".target sm_90a" in ptx and f".maxntid {128 * warpgroups}" in ptx
        assert f".minnctapersm {2 // warpgroups}" in ptx
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16") == 8
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16") == 4
        assert "wgmma.wait_group.sync.aligned 0;" in ptx and "wgmma.wait_group.sync.aligned 1;" not in ptx
        for needle in ("fence.proxy.async.shared::cta;", "cvt.rn.f16x2.e4m3x2", "st.shared.v4.u32", "prmt.b32",
                       "cp.async.cg.shared.global", "ex2.approx.ftz.f32", "max.NaN.f32", "st.global.v4.u32",
                       "rcp.approx.ftz.f64"):
            assert needle in ptx, needle
        assert "div.rn" not in ptx and "div.full" not in ptx
        check_pdl_rules(ptx)
        check_no_spills(c)
        if c.resources is not None:
            assert "wgmma.mma_async instructions are serialized" not in c.resources, c.resources

    each_variant(compiled["prefill_wgmma"], check)


def test_kv_cache_and_splitkv_kernels_compile_to_sm90_ptx(compiled):
    """Every variant: 9 cache writes (input x cache format), 10 split kernels (3 cache formats at head size 128
    and FP8 at 32, 64 and 256, with 4 heads per CTA; FP8 at 128 with 1 to 3 heads; FP8 at 128 with 4 heads and BF16
    output),
    the combine for float32 and BF16 output, 2 tensor-core split kernels (``splitkv_mma``: head_dim 128 with
    4 query heads per kv head and float32 output, 16 with BF16 output and the attention input), 5 tensor-core
    prefill kernels (``prefill_mma``: over an FP8 cache groups of 4 and 16 with float32 output, 2 with BF16; over a
    BF16 cache groups of 4 and 2; their tiles by ``cp.async`` into shared memory, 128-bit shared reads,
    ``max.NaN.f32``, FP8 weights two per ``cvt.rn.f16x2.f32``): no local memory, no float64, the expected load widths (the attention with its
    input reads its cache with coherent 128-bit loads: it writes the new token there), 16-bit stores for BF16
    output, the F16 ``mma`` and the E4M3 pair conversion in the tensor-core ones over an FP8 cache, the BF16 ``mma``
    and no conversion over a BF16 cache, the norm's square root in the one with its input; no spills where nvJitLink
    can run ptxas."""
    def check(c):
        name, ptx = c.name, c.ptx
        assert ".target sm_90" in ptx
        assert ".f64" not in ptx  # float32 throughout
        if name.startswith("cache_write") and "fp8" in name:
            assert "shfl.sync.bfly.b32" in ptx and "div.rn.f32" in ptx  # amax butterfly; x / scale correctly rounded
        if name.startswith("split"):
            assert "shfl.sync.bfly.b32" in ptx and "ex2.approx.f32" in ptx and "fma.rn.f32" in ptx
            with_input = "with input" in name
            load = r"ld\.global\.v4\.u32\b" if with_input else r"ld\.global\.nc\.v4\.[uf]32\b"
            assert re.search(load, ptx)  # a lane reads its 16 elements in 128-bit loads
            assert not (with_input and "ld.global.nc.v4" in ptx)  # what a CTA writes, it reads back coherently
            assert not with_input or "sqrt.rn.f32" in ptx
        if name.startswith("prefill_mma"):
            assert "shfl.sync.bfly.b32" in ptx and "fma.rn.f32" in ptx
            assert "ex2.approx.ftz.f32" in ptx and "ex2.approx.f32" not in ptx  # exp2_flush: one MUFU.EX2 each
            assert "cp.async.cg.shared.global" in ptx  # tiles through shared memory, no cache word loaded directly
            assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\+\d+\], \[g\+\d+\]", ptx)  # strided copies
            assert "ld.global.nc.v4.u32" not in ptx
            assert "ld.global.nc.v4.f32" in ptx and "st.global.v4.u32" in ptx  # queries and outputs 16 bytes at a time
            assert re.search(r"ld\.shared\.v4\.[uf]32\b", ptx)  # a lane reads its fragments in 128-bit loads
            assert "max.NaN.f32" in ptx  # the NaN-propagating max in one instruction
            assert "cache=bf16" in name or "cvt.rn.f16x2.f32" in ptx  # two F16 weights per conversion
        if name.startswith("split_mma"):  # the weights' exp2_flush: one MUFU.EX2 each (the warps' merge keeps exp2)
            assert "ex2.approx.ftz.f32" in ptx
        if name.startswith(("split_mma", "prefill_mma")) and "cache=bf16" not in name:
            assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
            assert "cvt.rn.f16.f32" in ptx  # the query and the weights rounded to F16
        if "cache=bf16" in name:
            assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and ".f16" not in ptx
        if name.startswith("combine"):
            assert "ex2.approx.f32" in ptx and "div.rn.f32" in ptx
        if "out=bf16" in name and name.startswith("prefill_mma"):  # 8 BF16 patterns per 128-bit store
            assert "st.global.v4.u32" in ptx and not re.search(r"st\.global\.(f32|[ub]16)\b", ptx)
        elif "out=bf16" in name:
            assert re.search(r"st\.global\.[ub]16\b", ptx)  # out is stored as 16-bit BF16 patterns
        check_pdl_rules(ptx, loads_before_wait="with input" in name)
        check_no_spills(c)  # every per-lane array lives in registers

    each_variant(compiled["kv_cache and splitkv"], check)


def test_attention_input_kernels_compile_to_sm90_ptx(compiled):
    """q/k-norm, RoPE and the cache write in one kernel (the FP8 cache at head sizes 16, 64 and 128, the float caches at 128): the
    norm's butterfly, fmas, correctly rounded sqrt and division; no local memory, no float64, no spills; before the wait
    only loads (of what no kernel writes: the norm weights, the position, its cos/sin)."""
    def check(c):
        assert ".target sm_90" in c.ptx and ".local" not in c.ptx and ".f64" not in c.ptx
        for needle in ("shfl.sync.bfly.b32", "fma.rn.f32", "sqrt.rn.f32", "div.rn.f32"):
            assert needle in c.ptx, needle
        check_pdl_rules(c.ptx, loads_before_wait=True)  # the norm weights, the position and its cos/sin
        check_no_spills(c)

    each_variant(compiled["attention_input"], check)


SAME_PTX_SOONER = r'''
from numba import cuda
from fp8lab.numba_kernels.gemv_simt import gemv_simt_kernel
from fp8lab.numba_kernels.inlining import install

if PATCHED:
    assert install(), "fp8lab.numba_kernels.inlining: this numba-cuda's inliner is not the shape the patch expects"
function = gemv_simt_kernel(2, "bf16", "f32", 128, 128, 4, 2, 2, True).py_func  # SwiGLU, groups of 2 chunks
signature = "void(uint32[::1], uint32[::1], float32[::1], float32[:, ::1], int64, int64, int64, int64)"
ptx, _ = cuda.compile_ptx(function, signature, cc=(9, 0))
print(ptx)
'''


def test_the_faster_inliner_compiles_the_same_ptx():
    """``fp8lab.numba_kernels.inlining`` (one deepcopy memo per inlining, which every compile process here installs) changes
    nothing but the time: a SIMT GEMV with SwiGLU, whose unrolled groups inline chains of device functions, compiles
    to the same PTX text with and without it, each in a fresh process."""
    outputs = {}
    for mode in ("plain", "patched"):
        result = run_compiled(f"PATCHED = {mode == 'patched'}\n" + SAME_PTX_SOONER)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ".target sm_90" in result.stdout
        outputs[mode] = result.stdout
    assert outputs["plain"] == outputs["patched"]
