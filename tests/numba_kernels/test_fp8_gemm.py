"""fp8_gemm routes by M to the SIMT GEMV, the tensor-core GEMV or the tensor-core GEMM, and checks arguments first."""

import os

import numpy as np
import pytest
from numba import cuda

from fp8lab.numba_kernels import fp8_gemm as router
from fp8lab.numba_kernels.gemv_mma import default_k_slices
from fp8lab.reference import blockwise
from fp8lab.simulators import gemm_mma as sim_mma
from fp8lab.simulators import gemv_mma as sim_gemv_mma
from fp8lab.simulators import gemv_simt as sim_gemv

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def problem(rng, m, n, k, block=(128, 128)):
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    q, s = blockwise.quantize(w, block)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a_bits = (a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1) >> 16).astype(np.uint16)  # RNE to BF16
    return a_bits, q, s


def test_auto_picks_simt_for_one_row_gemv_mma_for_2_to_32_then_mma_then_wgmma_on_hopper():
    assert router.choose_path(1, 4096) == "simt"
    assert [router.choose_path(m, 4096) for m in (2, 4, 8, 9, 16, 17, 32)] == ["gemv_mma"] * 7
    assert router.choose_path(2, 4096, "bf16", "bf16") == "gemv_mma"
    assert router.choose_path(33, 4096) == "mma" and router.choose_path(router.WGMMA_MIN_M - 1, 4096) == "mma"
    assert router.choose_path(384, 4096, wgmma=True) == "wgmma"  # 3 token tiles x 32 row tiles: 96 CTAs
    assert router.choose_path(256, 4096, wgmma=True) == "wgmma"  # 64 CTAs
    assert router.choose_path(128, 4096, wgmma=True) == "mma"  # 32 CTAs: too few (measured slower on an H100)
    assert router.choose_path(128, 24576, wgmma=True) == "wgmma"  # 192 CTAs
    assert router.choose_path(300, 4096, wgmma=False) == "mma"  # a GPU without wgmma
    assert router.choose_path(300, 4096, "f16", wgmma=True) == "mma"  # gemm_wgmma takes BF16 only
    # where gemv_mma does not apply (N not a multiple of 16, F16 in, F16 out): the SIMT GEMV up to SIMT_MAX_M
    assert router.choose_path(2, 24) == router.choose_path(2, 16, "f16") == router.choose_path(2, 16, "bf16", "f16")
    assert router.choose_path(2, 24) == "simt" and router.choose_path(router.SIMT_MAX_M + 1, 24) == "mma"


@pytest.mark.cudasim
@pytest.mark.parametrize("m, n", [(1, 16), (3, 16), (3, 12), (router.SIMT_MAX_M + 1, 12), (9, 16), (17, 16), (33, 16),
                                  (router.WGMMA_MIN_M + 2, 24)])  # mma: wgmma's grid would be 2 CTAs
def test_auto_equals_the_chosen_kernels_simulator(rng, m, n):
    a_bits, q, s = problem(rng, m, n, 128)
    out = np.full((m, n), np.nan, np.float32)
    router.fp8_gemm(a_bits, q, s, out)
    a = (a_bits.astype(np.uint32) << 16).view(np.float32)
    path = router.choose_path(m, n)
    if path == "gemv_mma":
        expected = sim_gemv_mma.gemv_mma(a_bits, q, s, k_slices=default_k_slices(n // 16, 1))
    else:
        expected = sim_gemv.gemv_simt(a, q, s) if path == "simt" else sim_mma.gemm_mma(a_bits, q, s)  # mma, wgmma
    np.testing.assert_array_equal(out, expected)


def test_bad_calls_raise_before_any_launch(rng, monkeypatch):
    monkeypatch.setattr(router, "gemv_simt", None)  # a launch would fail with TypeError, not ValueError
    monkeypatch.setattr(router, "gemm_mma", None)
    monkeypatch.setattr(router, "gemv_mma", None)
    monkeypatch.setattr(router, "gemm_wgmma", None)
    a_bits, q, s = problem(rng, 2, 16, 256)
    out = np.zeros((2, 16), np.float32)
    with pytest.raises(ValueError, match="path: expected one of"):
        router.fp8_gemm(a_bits, q, s, out, path="cublas")
    with pytest.raises(ValueError, match="block_n to be a positive multiple of 8"):
        router.fp8_gemm(a_bits, q, np.ones((4, 2), np.float32), out, block=(4, 128))
    with pytest.raises(ValueError, match=r"a: expected activations \[M, 256\] of bf16 \(uint16\) / f16 \(float16\)"):
        router.fp8_gemm(a_bits.view(np.int16).astype(np.float32), q, s, out)
    with pytest.raises(ValueError, match="K to be a positive multiple of 128"):
        router.fp8_gemm(np.ascontiguousarray(a_bits[:, :200]), np.ascontiguousarray(q[:, :200]), s, out)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 32, 40])
def test_gpu_every_m_against_the_reference(m):
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    rng = np.random.default_rng(seed)
    a_bits, q, s = problem(rng, m, 4096 + 24, 4096)
    out = cuda.to_device(np.full((m, 4096 + 24), np.nan, np.float32))
    router.fp8_gemm(cuda.to_device(a_bits), cuda.to_device(q), cuda.to_device(s), out)
    got = out.copy_to_host()
    ref = blockwise.gemm((a_bits.astype(np.uint32) << 16).view(np.float32), q, s)
    assert np.all(np.isfinite(got)), f"seed {seed}"
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5, f"seed {seed}"


def test_a_gemm_never_runs_in_place(monkeypatch):
    """``out`` sharing memory with ``a`` is refused before any launch: some CTAs would read activations that others
    have already overwritten (what the engine's SwiGLU output once did to its own input)."""
    for kernel in ("gemv_simt", "gemm_mma", "gemv_mma"):
        monkeypatch.setattr(router, kernel, None)
    memory = np.ones(2 * 128, np.uint16)
    a, out = memory.reshape(2, 128), memory.view(np.float32)[:32].reshape(2, 16)
    with pytest.raises(ValueError, match="^out: expected memory apart from a's"):
        router.fp8_gemm(a, np.zeros((16, 128), np.uint8), np.ones((1, 1), np.float32), out)
