"""fp8lab.numba_kernels.gemm_wgmma, the warpgroup (``wgmma``) FP8 GEMM for prefill sizes.

- In the CUDA simulator: bit for bit ``fp8lab.simulators.gemm_mma.gemm_mma`` (the order per output is
  ``gemm_mma``'s) for every tiling, with tails in M, N and scale blocks, float32 and BF16 outputs (poisoned
  first); a NaN scale or activation reaches exactly its outputs; bad calls raise before launching.
- On a GPU (``gpu``): every output within the tensor-core budget of ``fp8lab.reference.blockwise.gemm``
  (element by element) on fresh random data, for every tiling and at Qwen3-8B shapes; the NaN check again with the
  GPU's own NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from test_gemm_mma_kernel import (
    CANONICAL_NAN,
    activation_values,
    activations,
    both_promotion_forms,
    expected_bits,
    fresh_rng,
    gpu_budget,
    output_values,
    poisoned_output,
    random_weights,
    with_output_rounding,
)

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import gemm_wgmma as kernel
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.reference import blockwise
from fp8lab.simulators import bit_placement as bp
from fp8lab.simulators import gemm_mma as model

TILINGS = [kernel.Tiling(64, 1, 3, 4), kernel.Tiling(64, 2, 5), kernel.Tiling(128, 1, 4), kernel.Tiling(),
           kernel.Tiling(128, 2, 4, 1), kernel.Tiling(128, 2, 4, 2), kernel.Tiling(192, 2, 3, 4)]


@pytest.mark.cudasim
@pytest.mark.parametrize("tiling, m, n, k, block, output", [
    (TILINGS[0], 20, 72, 256, (128, 128), "f32"),  # M and N tails inside one CTA; a chunk in 4 parts of 2 k16 steps
    (TILINGS[0], 20, 72, 768, (128, 128), "bf16"),
    (TILINGS[4], 9, 64, 384, (64, 128), "f32"),  # a chunk in one part
    (TILINGS[1], 70, 136, 384, (64, 128), "bf16"),  # two token tiles, a second CTA in N, 3 chunks over 5 stages
    (TILINGS[2], 130, 64, 512, (8, 256), "f32"),  # a scale per 8 rows, a scale block of two chunks, token tail
    (TILINGS[3], 9, 200, 640, (128, 128), "bf16"),  # the default: 5 chunks through 4 stages
    (TILINGS[5], 130, 72, 512, (8, 256), "f32"),  # two parts of 4 k16 steps, a token tile tail
    (TILINGS[6], 200, 136, 512, (128, 128), "bf16"),  # 192 tokens (m64n192k16): a token tail, 4 chunks, 3 stages
])
def test_bit_for_bit_the_simulator(tiling, m, n, k, block, output, rng):
    a = activations(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    q, scale_inv = random_weights(rng, n, k, block)
    out = poisoned_output(m, n, output)
    kernel.gemm_wgmma(a, q, scale_inv, out, block, tiling)
    expected = expected_bits(model.gemm_mma(a, q, scale_inv, block), output)
    assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))


@pytest.mark.cudasim
def test_pair_selection_and_placement_are_bit_placements(rng):
    """``place_selected(prmt(w0, w1, pair_selector(t)))``: codes ``2t`` and ``2t + 1`` of the eight in ``(w0, w1)``
    as ``fp8lab.simulators.bit_placement.place_code_pair`` places them, for every code in every position."""
    codes = np.concatenate([np.arange(256), rng.integers(0, 256, 8 * 64)]).astype(np.uint8)
    words = np.resize(codes, (len(codes) // 8 + 1) * 8).reshape(-1, 8)
    words = np.concatenate([words, np.roll(words, 3, axis=1)])  # each code in other positions too
    for eight in words:
        w0, w1 = eight.view(np.uint32)
        for t in range(4):
            got = kernel.place_selected(kernel.prmt(w0, w1, kernel.pair_selector(t)))
            pair = np.uint16(eight[2 * t]) | np.uint16(eight[2 * t + 1]) << np.uint16(8)
            assert got == bp.place_code_pair(np.array([pair]), "bf16")[0], (eight, t)


@pytest.mark.cudasim
@pytest.mark.filterwarnings("ignore:overflow encountered")  # the inf outputs the data are built for
def test_bit_for_bit_both_promotion_forms(rng):
    """A warp whose two scales fold takes the one-fma form; one with a scale too large (or NaN) the general form,
    for both of its 8-row groups (the first warp: a folding group and a too-large one)."""
    m, n, k = 3, 128, 256
    a, q, scale_inv, block = both_promotion_forms(rng, m, n, k, "bf16")
    scale_inv[8:10] = scale_inv[:2]  # warp 2 (rows 32..47): both scales fold; warp 0: 2^-20 and 2^-20 ...
    scale_inv[1] = scale_inv[2]  # ... then 2^9 in its bottom group: the general form
    modelled = model.gemm_mma(a, q, scale_inv, block)
    assert np.all(np.isfinite(modelled[0, 32:48])) and not np.any(np.isfinite(modelled[0, 8:16]))
    out = poisoned_output(m, n, "f32")
    kernel.gemm_wgmma(a, q, scale_inv, out, block, kernel.Tiling(64, 1, 3))
    assert np.array_equal(out.view(np.uint8), modelled.view(np.uint8))


def check_a_nan_scale_or_activation_reaches_exactly_its_outputs(rng, to_device=lambda x: x):
    """A NaN block scale (the GPU's NaN pattern) makes its block's columns NaN in every row; a NaN activation makes
    its row NaN in every column; every other output is finite (the poison is finite: only the kernel writes NaN)."""
    m, n, k, block = 5, 80, 256, (8, 128)
    a = activations(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    a[2, 130] = 0x7FFF  # a BF16 NaN in row 2, second chunk
    q, scale_inv = random_weights(rng, n, k, block)
    scale_inv[9, 0] = CANONICAL_NAN  # columns 72..79, first chunk
    for output in ("f32", "bf16"):
        out = np.full((m, n), 0x1234 if output == "bf16" else 7.0, poisoned_output(1, 1, output).dtype)
        result = kernel.gemm_wgmma(to_device(a), to_device(q), to_device(scale_inv), to_device(out), block)
        result = result.copy_to_host() if hasattr(result, "copy_to_host") else result
        expected_nan = np.zeros((m, n), bool)
        expected_nan[2, :] = True
        expected_nan[:, 72:] = True
        assert np.array_equal(np.isnan(output_values(result, output)), expected_nan), output


@pytest.mark.cudasim
def test_a_nan_scale_or_activation_reaches_exactly_its_outputs(rng):
    check_a_nan_scale_or_activation_reaches_exactly_its_outputs(rng)


@pytest.mark.parametrize("change, message", [
    (dict(a=np.zeros((4, 256), np.float16)), "a: "),
    (dict(out=np.zeros((4, 16), np.float16)), "out: gemm_wgmma writes float32 or BF16"),
    (dict(block=(4, 128)), "block_n to be a positive multiple of 8"),
    (dict(tiling=kernel.Tiling(96, 2, 4)), "tokens: expected one of"),
    (dict(tiling=kernel.Tiling(128, 2, 7)), "stages: expected one of"),
    (dict(tiling=kernel.Tiling(64, 2, 4, 3)), "parts: expected one of"),
])
def test_bad_calls_raise_before_launching(change, message):
    args = dict(a=np.zeros((4, 256), np.uint16), q=np.zeros((16, 256), np.uint8),
                scale_inv=np.ones((1, 2), np.float32), out=np.zeros((4, 16), np.float32), block=(128, 128),
                tiling=None)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        kernel.gemm_wgmma(**args)


def test_every_tiling_fits_a_ctas_shared_memory():
    for tiling in TILINGS:
        assert tiling.check().shared_bytes <= kernel.MAX_SHARED_PER_CTA
        assert tiling.stage_bytes % 1024 == 0 and tiling.code_offset % 1024 == 0  # swizzle atoms 1,024-aligned


def test_the_default_tiling_takes_64_tokens_only_where_that_grid_is_one_wave():
    """On 132 SMs: Qwen3-0.6B's o_proj / down_proj (1,024 rows) at 1,000 tokens take 64-token tiles (128 CTAs); the
    wider weights, a grid of 64-token tiles past one wave, and a single 64-token tile keep 128."""
    small, large = kernel.SMALL_GRID_TILING, kernel.Tiling()
    assert small in TILINGS and small.tokens == 64  # the GPU tests run it
    assert kernel.default_tiling(1000, 1024, 132) == small
    assert kernel.default_tiling(1024, 1024, 132) == small  # 16 x 8 = 128 CTAs of 64 tokens
    # 1,025 tokens: 17 x 8 = 136 CTAs of 64 tokens, past one wave
    for m, n in [(1000, 4096), (1000, 6144), (1000, 24576), (1025, 1024), (2048, 1024), (64, 1024)]:
        assert kernel.default_tiling(m, n, 132) == large, (m, n)
    assert kernel.default_tiling(1000, 1024, 114) == large  # an H100 PCIe's 114 SMs


# ---------------------------------------------------------------------------- GPU


def run_on_gpu(a, q, scale_inv, block, output, tiling):
    m, n = a.shape[0], q.shape[0]
    d_out = cuda.to_device(poisoned_output(m, n, output))
    kernel.gemm_wgmma(cuda.to_device(a), cuda.to_device(q), cuda.to_device(scale_inv), d_out, block, tiling)
    cuda.synchronize()
    return d_out.copy_to_host()


def check_gpu_against_the_oracle(m, n, k, block, output, tiling):
    rng, seed = fresh_rng()
    a = activations(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    q, scale_inv = random_weights(rng, n, k, block, scale=1e-3)
    values = output_values(run_on_gpu(a, q, scale_inv, block, output, tiling), output)
    a64 = activation_values(a, "bf16")
    ref = blockwise.gemm(a64, q, scale_inv, block)
    budget = with_output_rounding(gpu_budget(a64, q, scale_inv, block, "bf16"), ref, output)
    assert np.all(np.isfinite(values)), f"seed {seed}: unwritten (NaN) outputs at {np.argwhere(~np.isfinite(values))[:5]}"
    worst = np.unravel_index(np.argmax(np.abs(values - ref) / budget), ref.shape)
    assert np.all(np.abs(values - ref) <= budget), (
        f"seed {seed}: out{list(worst)} = {values[worst]!r}, oracle {ref[worst]!r}, budget {budget[worst]:.3g}")


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("tiling", TILINGS, ids=str)
def test_gpu_every_tiling_within_the_budget(tiling):
    check_gpu_against_the_oracle(300, 1000, 1024, (128, 128), "bf16", tiling)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
@pytest.mark.parametrize("m, n, k, output", [(1000, 6144, 4096, "f32"), (512, 4096, 12288, "bf16"),
                                             (129, 24576, 4096, "f32")])
def test_gpu_qwen3_8b_shapes_within_the_budget(m, n, k, output):
    check_gpu_against_the_oracle(m, n, k, (128, 128), output, None)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="needs a GPU")
def test_gpu_a_nan_scale_or_activation_reaches_exactly_its_outputs():
    rng, _ = fresh_rng()
    check_a_nan_scale_or_activation_reaches_exactly_its_outputs(rng, cuda.to_device)
