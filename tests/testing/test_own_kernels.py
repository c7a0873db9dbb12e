"""fp8lab's own CUDA kernels pass the kit (``fp8lab.testing``): the same checks a kernel author runs on
theirs, with each kernel's documented shape constraints as the checks' options (K a multiple of 128 for
the GEMMs, BF16 activations for the tensor-core path). The kernels write into NaN-poisoned outputs.
On a GPU only: in Numba's CUDA simulator a check's dozens of examples would take minutes (the
simulators of these kernels pass the same checks on the CPU: ``test_bug_zoo.py``, ``test_kv_kit.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.attention import paged_prefill_arguments

from fp8lab import testing

pytestmark = pytest.mark.gpu

K_MULTIPLE = 128
"""The GEMM kernels' K granularity (``fp8lab.numba_kernels.arguments.K_MULTIPLE``)."""


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, np.nan, dtype)


def test_the_simt_gemv_passes_the_w8a16_check():
    from fp8lab.numba_kernels.gemv_simt import gemv_simt

    def gemm(a, q, s, block):
        return gemv_simt(a, q, s, poisoned((a.shape[0], q.shape[0])), block)

    testing.check_blockwise_gemm(gemm, k_multiple=K_MULTIPLE)
    testing.check_blockwise_gemm(gemm, activation_dtype="bfloat16", k_multiple=K_MULTIPLE)


def test_the_tensor_core_gemm_passes_the_w8a16_check():
    from fp8lab.numba_kernels.fp8_gemm import fp8_gemm

    def gemm(a, q, s, block):
        return fp8_gemm(a, q, s, poisoned((a.shape[0], q.shape[0])), block, path="mma")

    testing.check_blockwise_gemm(gemm, activation_dtype="bfloat16", k_multiple=K_MULTIPLE)


def test_the_dequantize_kernel_passes_bit_for_bit():
    from fp8lab.numba_kernels.dequantize import dequantize

    testing.check_blockwise_dequantize(lambda q, s, block: dequantize(q, s, poisoned(q.shape), block), k_multiple=4)


def test_the_paged_cache_write_kernel_passes():
    from fp8lab.numba_kernels.kv_cache import paged_cache_write

    def write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        paged_cache_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    testing.check_paged_cache_write(write)


@pytest.mark.parametrize("fp8, alibi", [(True, False), (False, False), (True, True)])
def test_the_split_kv_decode_kernel_passes(fp8, alibi):
    from fp8lab.numba_kernels.splitkv import HEAD_DIMS, paged_decode

    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, alibi_slopes=None):
        return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, poisoned(q.shape), k_scale,
                            v_scale, alibi_slopes)

    testing.check_paged_decode(decode, fp8=fp8, alibi=alibi, head_dims=HEAD_DIMS)


def test_the_tensor_core_decode_kernel_passes_with_f16_operands():
    """``splitkv_mma`` (F16 query and weights): head_dim 128, blocks of 16 and 32, the split count "auto"."""
    from fp8lab.numba_kernels.splitkv_mma import paged_decode_mma

    def decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale):
        return paged_decode_mma(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, poisoned(q.shape), k_scale,
                                v_scale)

    testing.check_paged_decode(decode, head_dims=(128,), block_sizes=(16, 32), operands="f16")


def prefill_over_a_paged_cache(q, k, v, softmax_scale, k_scale, v_scale):
    """``fp8lab.numba_kernels.prefill.paged_prefill`` on ``check_prefill``'s arguments (``paged_prefill_arguments``)."""
    from fp8lab.numba_kernels.prefill import paged_prefill

    args = paged_prefill_arguments(q, k, v, softmax_scale, k_scale, v_scale)
    return paged_prefill(*args[:7], poisoned(q.shape), *args[7:])


@pytest.mark.parametrize("fp8", [True, False])
def test_the_prefill_kernel_passes(fp8):
    from fp8lab.numba_kernels.splitkv import HEAD_DIMS

    testing.check_prefill(prefill_over_a_paged_cache, fp8=fp8, head_dims=HEAD_DIMS)


def test_the_tensor_core_prefill_kernel_passes_with_f16_operands():
    """``prefill_mma`` (F16 query and weights): head_dim 128, blocks of 16, GQA groups of 1, 2 and 4."""
    from fp8lab.numba_kernels.prefill_mma import paged_prefill_mma

    def prefill(q, k, v, softmax_scale, k_scale, v_scale):
        args = paged_prefill_arguments(q, k, v, softmax_scale, k_scale, v_scale)
        return paged_prefill_mma(*args[:7], poisoned(q.shape), *args[7:])

    testing.check_prefill(prefill, head_dims=(128,), operands="f16")
