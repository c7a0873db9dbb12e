"""Bit-exact NumPy twins of the GPU model's GEMM kernels, and the micro model, for the CUDA-model tests.

In Numba's CUDA simulator a simulated GEMM costs seconds; the GPU model's tests under the simulator
swap its GEMM kernels (the SIMT GEMV plain, split-K and with SwiGLU, ``fp8_gemm``, ``gemv_mma_swiglu``, the BF16
linear and the tensor-core lm_head) for their
simulators (``gemm_twins``), which compute the same float32 operations in the same order, so the rest
of the forward (norms, RoPE, KV writes, attention, sampling) still runs as simulated kernels.
"""

from __future__ import annotations

import numpy as np

from fp8lab.engine.cuda import plan
from fp8lab.numba_kernels import arguments
from fp8lab.numba_kernels.fp8_gemm import choose_path
from fp8lab.numba_kernels.gemv_mma import default_k_slices
from fp8lab.reference.dense import round_to_bf16
from fp8lab.simulators import bit_placement
from fp8lab.simulators import dense as sim_dense
from fp8lab.simulators import gemm_mma as sim_mma
from fp8lab.simulators import gemv_mma as sim_gemv_mma
from fp8lab.simulators import gemv_simt as sim_gemv
from helpers.engine import quantize_tensors, random_float_tensors, tiny_config


def bf16_values(bits) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def gemv_simt_twin(a, q, scale_inv, out, block=(128, 128), stream=0, **knobs):
    """``fp8lab.numba_kernels.gemv_simt`` as ``fp8lab.simulators.gemv_simt`` computes it (bit for bit)."""
    p = arguments.check_gemm(a, q, scale_inv, out, block, kernel="the SIMT GEMV")
    assert p.output == "f32" and 1 <= p.m <= 16
    a32 = bf16_values(p.a) if p.activation == "bf16" else np.asarray(p.a, np.float32)
    out[...] = sim_gemv.gemv_simt(a32, p.q, p.scale_inv, p.block)
    return out


def gemv_simt_split_k_twin(a, q, scale_inv, parts, block=(128, 128), stream=0, **knobs):
    """``fp8lab.numba_kernels.gemv_simt.gemv_simt_split_k`` as ``fp8lab.simulators.gemv_simt.gemv_simt_split_k``
    computes it (bit for bit): the float32 parts ``[S, M, N]`` of the K slices."""
    p = arguments.check_gemm(a, q, scale_inv, parts[0], block, kernel="the SIMT GEMV")
    assert p.output == "f32" and 1 <= p.m <= 16 and p.activation == "f32"
    parts[...] = sim_gemv.gemv_simt_split_k(np.asarray(p.a, np.float32), p.q, p.scale_inv, parts.shape[0], p.block)
    return parts


def gemv_simt_swiglu_twin(a, q, scale_inv, out, block=(128, 128), stream=0, **knobs):
    """``fp8lab.numba_kernels.gemv_simt_swiglu`` as ``fp8lab.simulators.gemv_simt.gemv_simt_swiglu`` computes it
    (bit for bit): the float32 ``silu(gate) * up`` of the fused gate/up codes ``q [2 I, K]``."""
    p = arguments.check_gemm(a, q, scale_inv, out, block, kernel="the SIMT GEMV", out_columns=np.shape(q)[0] // 2)
    assert p.output == "f32" and 1 <= p.m <= 16
    a32 = bf16_values(p.a) if p.activation == "bf16" else np.asarray(p.a, np.float32)
    out[...] = sim_gemv.gemv_simt_swiglu(a32, p.q, p.scale_inv, p.block)
    return out


def gemv_mma_swiglu_twin(a, q, scale_inv, out, block=(128, 128), stream=0, **knobs):
    """``fp8lab.numba_kernels.gemv_mma_swiglu`` as ``fp8lab.simulators.gemv_mma.gemv_mma_swiglu`` computes it (bit for
    bit, default k slices; a uint16 ``out`` gets the BF16 rounding)."""
    p = arguments.check_gemm(a, q, scale_inv, out, block, kernel="gemv_mma_swiglu", activations=("bf16",),
                             out_columns=np.asarray(q).shape[0] // 2)
    assert p.output in ("f32", "bf16")
    product = sim_gemv_mma.gemv_mma_swiglu(np.asarray(p.a, np.uint16), p.q, p.scale_inv, p.block,
                                           k_slices=default_k_slices(p.n // 16, p.k // 128))
    out[...] = product if p.output == "f32" else bit_placement.float32_to_bf16_bits(product)
    return out


def fp8_gemm_twin(a, q, scale_inv, out, block=(128, 128), path="auto", stream=0):
    """``fp8lab.numba_kernels.fp8_gemm`` (``auto``: ``choose_path``) by its kernels' simulators."""
    p = arguments.check_gemm(a, q, scale_inv, out, block, kernel="fp8_gemm", activations=("bf16", "f16"),
                             block_n_multiple=8)
    assert p.activation == "bf16" and p.output == "f32"
    path = choose_path(p.m, p.n, p.activation, p.output)
    if path == "gemv_mma":
        out[...] = sim_gemv_mma.gemv_mma(np.asarray(p.a, np.uint16), p.q, p.scale_inv, p.block,
                                         k_slices=default_k_slices(p.n // 16, p.k // 128))
    elif path == "simt":
        out[...] = sim_gemv.gemv_simt(bf16_values(p.a), p.q, p.scale_inv, p.block)
    else:
        out[...] = sim_mma.gemm_mma(np.asarray(p.a, np.uint16), p.q, p.scale_inv, p.block, activation="bf16")
    return out


def gemv_mma_bf16_twin(a, w_bits, out, k_slices=None, depth=None, stream=0):
    """``fp8lab.numba_kernels.gemv_mma.gemv_mma_bf16`` (the tensor-core lm_head) as
    ``fp8lab.simulators.gemv_mma.gemv_mma_bf16`` computes it (bit for bit, default k slices; float32 ``a`` is rounded
    to BF16 on load)."""
    a, w = np.asarray(a), np.asarray(w_bits)
    assert tuple(out.shape) == (a.shape[0], w.shape[0]) and np.dtype(out.dtype) == np.float32 and 1 <= a.shape[0] <= 16
    out[...] = sim_gemv_mma.gemv_mma_bf16(a, w, k_slices=default_k_slices(w.shape[0] // 16, w.shape[1] // 128))
    return out


def bf16_linear_twin(x, w_bits, out, rows_per_warp=None, stream=0):
    """``layers.bf16_linear`` as ``fp8lab.simulators.dense.bf16_linear`` computes it (bit for bit)."""
    assert tuple(out.shape) == (np.asarray(x).shape[0], np.asarray(w_bits).shape[0])
    out[...] = sim_dense.bf16_linear(x, w_bits)
    return out


def install_gemm_twins(monkeypatch) -> None:
    """Swap the GPU model's seven GEMM kernels for their twins (the ``gemm_twins`` fixture of conftest): in
    ``fp8lab.engine.cuda.plan``, whose plans name the kernels every forward launches."""
    monkeypatch.setattr(plan, "gemv_simt", gemv_simt_twin)
    monkeypatch.setattr(plan, "gemv_simt_swiglu", gemv_simt_swiglu_twin)
    monkeypatch.setattr(plan, "gemv_simt_split_k", gemv_simt_split_k_twin)
    monkeypatch.setattr(plan, "fp8_gemm", fp8_gemm_twin)
    monkeypatch.setattr(plan, "gemv_mma_swiglu", gemv_mma_swiglu_twin)
    monkeypatch.setattr(plan, "bf16_linear", bf16_linear_twin)
    monkeypatch.setattr(plan, "gemv_mma_bf16", gemv_mma_bf16_twin)


def micro_config(layers: int = 1, **overrides):
    """hidden 128 (the GEMMs' K must be a multiple of 128), 2 query heads / 1 kv head of 64, I = 256;
    FP8 blocks 48 x 128: fused q/k/v (128 + 64 + 64 rows) and gate/up re-block to 16 rows, o/down have a
    partial edge block, and down_proj (K = 256) is a split-K GEMV of 2 slices on the SIMT path (its two
    parts go through ``add_parts_rms_norm``); 8 positions, so that with blocks of 4 a sequence has 2
    blocks and a decode step 2 splits (the combine kernel runs)."""
    fields = dict(block=(48, 128), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=8)
    fields.update(overrides)
    return tiny_config(**fields)


def micro_tensors(config, seed: int = 3) -> dict[str, np.ndarray]:
    """Checkpoint tensors; float tensors rounded to BF16, as a Qwen3-FP8 checkpoint stores them (the GPU
    model keeps embeddings and lm_head as BF16 patterns)."""
    floats = {name: round_to_bf16(t) for name, t in random_float_tensors(config, np.random.default_rng(seed)).items()}
    return quantize_tensors(config, floats)
