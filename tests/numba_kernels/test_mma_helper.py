"""The mma.m16n8k16 device function: exact on integer-valued fragments, in the simulator (its
warp-collective twin) and on a GPU (the linked CUDA C++ with inline PTX)."""

import os
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import mma as mma_helper
from fp8lab.simulators import bit_placement, mma

pytestmark = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and not cuda.is_available(), reason="needs the simulator or a GPU"
)


def _make_kernel(device_fn):
    @cuda.jit
    def one_mma(a_regs, b_regs, c, d):
        lane = cuda.threadIdx.x
        r = device_fn(a_regs[lane, 0], a_regs[lane, 1], a_regs[lane, 2], a_regs[lane, 3],
                      b_regs[lane, 0], b_regs[lane, 1], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
        d[lane, 0] = r[0]
        d[lane, 1] = r[1]
        d[lane, 2] = r[2]
        d[lane, 3] = r[3]

    return one_mma


KERNELS = {"bf16": _make_kernel(mma_helper.mma_bf16), "f16": _make_kernel(mma_helper.mma_f16)}


def run_one_mma(a_tile, b_tile, c_tile, fmt):
    a_regs = mma.pack_registers(bit_placement.float32_to_bits(mma.load_a(a_tile), fmt))
    b_regs = mma.pack_registers(bit_placement.float32_to_bits(mma.load_b(b_tile), fmt))
    d = np.full((32, 4), np.nan, np.float32)  # poisoned
    KERNELS[fmt][1, 32](a_regs, b_regs, mma.load_c(c_tile), d)
    return mma.store_c(d)


@settings(max_examples=10)  # each example is a simulated warp of 32 Python threads
@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from(["bf16", "f16"]))
def test_integer_fragments_are_exact(seed, fmt):
    """Small integers: every product and sum is exact in float32, so D == A @ B + C exactly."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-16, 17, (16, 16)).astype(np.float32)
    b = rng.integers(-16, 17, (16, 8)).astype(np.float32)
    c = rng.integers(-1000, 1001, (16, 8)).astype(np.float32)
    d = run_one_mma(a, b, c, fmt)
    assert np.all(np.isfinite(d))
    np.testing.assert_array_equal(d, a @ b + c)


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="twin vs model: simulator only")
def test_twin_equals_the_model_bit_for_bit(rng):
    a = rng.standard_normal((16, 16)).astype(np.float32)
    b = rng.standard_normal((16, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    for fmt in ("bf16", "f16"):
        a_regs = mma.pack_registers(bit_placement.float32_to_bits(mma.load_a(a), fmt))
        b_regs = mma.pack_registers(bit_placement.float32_to_bits(mma.load_b(b), fmt))
        expected = mma.mma_registers(a_regs, b_regs, mma.load_c(c), fmt)
        np.testing.assert_array_equal(mma.load_c(run_one_mma(a, b, c, fmt)), expected)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_source_compiles_to_mma_instructions(tmp_path):
    ptx = tmp_path / "mma.ptx"
    subprocess.run(["nvcc", "-arch=sm_90", "-rdc=true", "-ptx", str(mma_helper.SOURCE), "-o", str(ptx)], check=True)
    text = ptx.read_text()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
