"""Weight formats of the kit (``fp8lab.testing.weight_format``): a transposed ``[K, N]`` layout and BF16
scales are check parameters. Correct implementations in each format pass; wrong ones fail with their
class named; a quantizer that returns the wrong scale dtype is told so."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.zoo_weights import FN, blocks, cast_saturating

from fp8lab import testing
from fp8lab.reference import blockwise, dense
from fp8lab.testing.weight_format import WeightFormat


def bf16_bits_truncated(x) -> np.ndarray:
    """float32 -> BF16 bits by dropping the low 16 bits (round toward zero), as some kernels store scales."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def quantize_kn(w_kn, block_kn, *, to_bf16=dense.float32_to_bf16_bits, swap_block=False):
    """A block loop over a transposed weight ``[K, N]`` with ``block_kn = (BK, BN)``, BF16 scales: each
    scale rounded by ``to_bf16`` first, then the block divided by the stored scale. ``swap_block`` plants
    a bug: the blocks taken as ``(BN, BK)`` over the ``[K, N]`` array."""
    block = (block_kn[1], block_kn[0]) if swap_block else block_kn
    q = np.zeros(w_kn.shape, np.uint8)
    s = np.zeros(blockwise.scale_shape(w_kn.shape, block), np.uint16)
    for rows, cols, bi, bj in blocks(w_kn.shape, block):
        amax = np.float32(np.max(np.abs(w_kn[rows, cols])))
        scale = np.float32(1) if amax == 0 else max(amax / np.float32(448), np.float32(2.0**-126))
        s[bi, bj] = to_bf16(np.array([scale], np.float32))[0]
        q[rows, cols] = cast_saturating(w_kn[rows, cols] / dense.bf16_bits_to_float32(s[bi, bj]))
    return q, s


def dequantize_kn(q_kn, s_bits, block_kn):
    """``decode(q) * scale`` over a transposed weight with BF16 scale bits."""
    out = np.zeros(q_kn.shape, np.float32)
    scales = dense.bf16_bits_to_float32(s_bits)
    for rows, cols, bi, bj in blocks(q_kn.shape, block_kn):
        out[rows, cols] = q_kn[rows, cols].view(FN).astype(np.float32) * scales[bi, bj]
    return out


def test_correct_transposed_bf16_implementations_pass():
    testing.check_blockwise_quantize(quantize_kn, block=(64, 128), layout="kn", scale_dtype="bfloat16")
    testing.check_blockwise_quantize(lambda w, b: quantize_kn(w, b, to_bf16=bf16_bits_truncated), block=(64, 128),
                                     layout="kn", scale_dtype="bfloat16")  # truncation stays within 1 BF16 ulp
    testing.check_blockwise_dequantize(dequantize_kn, block=(64, 128), layout="kn", scale_dtype="bfloat16")
    testing.check_blockwise_gemm(lambda a, q, s, b: a @ dequantize_kn(q, s, b), block=(64, 128), layout="kn",
                                 scale_dtype="bfloat16")


def test_a_transposed_layout_keeps_the_contract_for_float32_scales():
    def gemm_kn(a, q_kn, s_kn, block_kn):
        return blockwise.gemm(a, q_kn.T, s_kn.T, (block_kn[1], block_kn[0]))

    testing.check_blockwise_gemm(gemm_kn, block=(64, 128), layout="kn")
    testing.check_w8a8_gemm(lambda a, q, s, b, eps: blockwise.gemm_w8a8(a, q.T, dense.bf16_bits_to_float32(s).T,
                                                                         (b[1], b[0]), eps),
                            block=(64, 128), layout="kn", scale_dtype="bfloat16")


def test_blocks_taken_the_wrong_way_in_a_transposed_layout_are_named():
    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_blockwise_quantize(lambda w, b: quantize_kn(w, b, swap_block=True), block=(64, 128), layout="kn",
                                         scale_dtype="bfloat16")
    assert "wrong_block_dimension" in [b.name for b in failure.value.report.diagnoses], str(failure.value)


def test_float32_scales_where_bf16_ones_are_due_are_reported():
    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_blockwise_quantize(blockwise.quantize, scale_dtype="bfloat16")
    report = failure.value.report
    assert report.output == "scale_inv" and "uint16" in str(report.actual) and "float32" in str(report.actual)


def test_a_bf16_scale_off_by_more_than_one_ulp_fails():
    def quantize_coarse(w, block):  # scales with 4 significant bits instead of 8: up to 2^-4 off
        q, s = quantize_kn(w, block)
        return q, (s & 0xFFF8).astype(np.uint16)

    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_blockwise_quantize(quantize_coarse, layout="kn", scale_dtype="bfloat16")
    report = failure.value.report
    assert report.output == "scale_inv" and report.tolerance.startswith("within 1 bfloat16 ulp")


def test_a_bad_format_is_one_line_naming_the_option():
    with pytest.raises(ValueError, match="^layout: expected one of nk, kn, got 'mk'$"):
        WeightFormat("mk")
    with pytest.raises(ValueError, match="^scale_dtype: expected one of float32, bfloat16, got 'float16'$"):
        testing.check_blockwise_gemm(lambda *a: None, scale_dtype="float16")
    with pytest.raises(ValueError, match="^activation_dtype: expected one of float32, bfloat16, got 'f16'$"):
        testing.check_blockwise_gemm(lambda *a: None, activation_dtype="f16")


def test_the_format_converts_both_ways(rng):
    fmt = WeightFormat("kn", "bfloat16")
    s = (rng.standard_normal((3, 5)) * 1e-3).astype(np.float32)
    stored = fmt.stored_scales(s)
    assert np.array_equal(fmt.scales_from_caller(fmt.scales_to_caller(s)), stored)
    assert fmt.scales_to_caller(s).shape == (5, 3) and fmt.scales_to_caller(s).dtype == np.uint16
    assert np.all(np.abs(stored - s) <= 2.0**-8 * np.abs(s))  # round to nearest: half a BF16 ulp
    q = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    assert np.array_equal(fmt.codes_from_caller(fmt.codes_to_caller(q)), q) and fmt.block((64, 128)) == (128, 64)


def test_bf16_activations_travel_as_bits():
    def gemm_bf16(a_bits, q, s, block):
        return dense.bf16_bits_to_float32(a_bits) @ blockwise.dequantize(q, s, block).T

    testing.check_blockwise_gemm(gemm_bf16, activation_dtype="bfloat16")
    with pytest.raises(testing.KernelCheckFailed):  # the bit patterns taken for numbers
        testing.check_blockwise_gemm(lambda a, q, s, b: a.astype(np.float32) @ blockwise.dequantize(q, s, b).T,
                                     activation_dtype="bfloat16")
