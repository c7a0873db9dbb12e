"""fp8lab.numba_kernels.gemm_wgmma_ss, the warpgroup GEMM with a producer warpgroup and both operands in shared memory.

- In the CUDA simulator: bit for bit ``fp8lab.simulators.gemm_mma.gemm_mma`` with tails in M and N, fewer chunks
  than stages and more (a stage refilled after the consumers hand it back), a second CTA in N, a scale per 8 rows,
  float32 and BF16 outputs (poisoned first); a NaN scale reaches exactly its outputs.
- On a GPU (``gpu``): bit for bit ``gemm_wgmma`` at Qwen3-8B shapes (the same order, deterministic tensor cores;
  ``gemm_wgmma``'s GPU tests hold it to the tensor-core budget of ``fp8lab.reference.blockwise.gemm``).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from test_gemm_mma_kernel import (
    activations,
    expected_bits,
    fresh_rng,
    output_values,
    poisoned_output,
    random_weights,
)

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import gemm_wgmma, gemm_wgmma_ss
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.simulators import gemm_mma as model


@pytest.mark.cudasim
@pytest.mark.parametrize("m, n, k, block, output", [
    (20, 72, 256, (128, 128), "f32"),  # M and N tails inside one CTA, two chunks (fewer than the stages)
    (9, 8, 128, (128, 128), "f32"),  # one chunk: the consumers' loop skipped
    (20, 136, 512, (8, 256), "bf16"),  # two CTAs in N, four chunks through three stages, a scale per 8 rows
])
def test_bit_for_bit_the_simulator(m, n, k, block, output, rng):
    a = activations(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    q, scale_inv = random_weights(rng, n, k, block)
    out = poisoned_output(m, n, output)
    gemm_wgmma_ss.gemm_wgmma_ss(a, q, scale_inv, out, block)
    expected = expected_bits(model.gemm_mma(a, q, scale_inv, block), output)
    assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))


@pytest.mark.cudasim
def test_the_selectors_are_gemm_wgmmas():
    assert (gemm_wgmma_ss.SELECT_LOW, gemm_wgmma_ss.SELECT_HIGH) == (gemm_wgmma.pair_selector(0), gemm_wgmma.pair_selector(1))


@pytest.mark.cudasim
def test_a_nan_scale_reaches_exactly_its_outputs(rng):
    m, n, k, block = 9, 64, 384, (8, 128)
    a = activations(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    q, scale_inv = random_weights(rng, n, k, block)
    scale_inv[2, 1] = np.nan  # rows 16..23, chunk 1
    out = poisoned_output(m, n, "f32")
    gemm_wgmma_ss.gemm_wgmma_ss(a, q, scale_inv, out, block)
    nan = np.zeros((m, n), bool)
    nan[:, 16:24] = True
    np.testing.assert_array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), model.gemm_mma(a, q, scale_inv, block)[~nan].view(np.uint32))


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("m, n, k, output", [(1000, 6144, 4096, "f32"), (512, 4096, 12288, "bf16")])
def test_gpu_bit_for_bit_gemm_wgmma(m, n, k, output):
    """The same order as ``gemm_wgmma`` (held to the tensor-core budget of the oracle by its own GPU tests) and
    deterministic tensor cores: the same bits, every output written (the poison would stay)."""
    rng, seed = fresh_rng()
    a = cuda.to_device(activations(rng.standard_normal((m, k)).astype(np.float32), "bf16"))
    q, scale_inv = (cuda.to_device(x) for x in random_weights(rng, n, k, (128, 128)))
    out, reference_out = (cuda.to_device(poisoned_output(m, n, output)) for _ in range(2))
    gemm_wgmma_ss.gemm_wgmma_ss(a, q, scale_inv, out)
    gemm_wgmma.gemm_wgmma(a, q, scale_inv, reference_out)
    got, expected = out.copy_to_host(), reference_out.copy_to_host()
    assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), f"seed {seed}"
    assert not np.isnan(output_values(got, output)).any(), f"seed {seed}"
