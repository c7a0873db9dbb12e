"""Kernels compile to PTX for sm_90 on a CPU-only machine (numba.cuda.compile_ptx needs no GPU).

This catches typing errors that the CUDA simulator, which runs kernels as Python, cannot. The
compile runs in a subprocess with the simulator off, because a process chooses once.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOOLKIT_KERNEL = r'''
from numba import cuda, float32, uint32
import numba_kernels
from numba_kernels import bits

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


def run_compiled(source: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_toolkit_compiles_to_sm90_ptx():
    result = run_compiled(TOOLKIT_KERNEL)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


MMA_KERNEL = r'''
from numba import cuda
from numba_kernels.mma import mma_bf16, mma_f16

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
