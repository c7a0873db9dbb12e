"""The KV cache and attention checks of ``fp8lab.testing`` pass correct implementations: fp8lab's
oracle, hand-written token loops without a planted bug (``tests/helpers/zoo_kv.py``), and the
bit-exact simulator of fp8lab's split-kv decode kernel; and they see NaN-poisoned slots in either layout."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.zoo_kv import my_decode, my_prefill, write_token_loop

from fp8lab import testing
from fp8lab.reference import attention, kv_cache
from fp8lab.simulators import splitkv


def test_the_oracle_and_hand_written_loops_pass():
    testing.check_kv_quantize(kv_cache.quantize_kv)
    testing.check_paged_cache_write(write_token_loop)  # the loop without a planted bug
    testing.check_paged_cache_write(lambda *a: write_token_loop(*a, vllm_layout=True), layout="vllm")
    testing.check_paged_decode(lambda *a: my_decode(*a))  # the hand-written decode without a planted bug
    testing.check_paged_decode(lambda *a: my_decode(*a), fp8=False)


def test_the_split_kv_simulator_passes():
    """The bit-exact model of fp8lab's split-kv decode kernel (auto splits, log2-domain combine)."""
    testing.check_paged_decode(lambda *a: splitkv.paged_decode(*a), max_examples=15)


def test_alibi_decode_passes():
    """ALiBi through the split-kv simulator (slopes folded into the log2 domain as float32) and by hand."""
    testing.check_paged_decode(lambda *a, **kw: splitkv.paged_decode(*a, **kw), alibi=True, max_examples=15)
    testing.check_paged_decode(lambda *a, **kw: splitkv.paged_decode(*a, **kw), fp8=False, alibi=True,
                               max_examples=10)
    testing.check_paged_decode(lambda *a, **kw: my_decode(*a, **kw), alibi=True, max_examples=15)


@pytest.mark.parametrize("fp8", [True, False])
def test_vllm_layout_decode_passes(fp8):
    """A hand-written loop over vLLM's ``[blocks, block_size, kv_heads, head_dim]`` caches, with and without ALiBi."""
    testing.check_paged_decode(lambda *a: my_decode(*a, layout="vllm"), fp8=fp8, layout="vllm", max_examples=15)
    testing.check_paged_decode(lambda *a, **kw: my_decode(*a, **kw, layout="vllm"), fp8=fp8, alibi=True,
                               layout="vllm", max_examples=10)


def _oracle_prefill(q, k, v, softmax_scale, k_scale, v_scale, **alibi):
    if k_scale is not None:
        k, v = kv_cache.dequantize_kv(k, k_scale), kv_cache.dequantize_kv(v, v_scale)
    return attention.prefill(q, k, v, softmax_scale, **alibi)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("alibi", [False, True])
def test_prefill_passes(fp8, alibi):
    """The oracle and a hand-written log2-domain prefill loop without a planted bug."""
    testing.check_prefill(_oracle_prefill, fp8=fp8, alibi=alibi)
    testing.check_prefill(lambda *a, **kw: my_prefill(*a, **kw), fp8=fp8, alibi=alibi, max_examples=20)


def test_an_alibi_origin_shifted_per_row_passes():
    """ALiBi measured from key 0 (``slope * j``) instead of from the query: a constant per row, which softmax
    ignores, so the same attention and no bug class (``fp8lab.testing.kv_bugs``)."""
    testing.check_prefill(lambda *a, **kw: my_prefill(*a, **kw, alibi_origin=lambda pos: 0), alibi=True,
                          max_examples=20)


def prefill_as_decode_rows(q, k, v, softmax_scale, k_scale, v_scale, alibi_slopes=None):
    """fp8lab's prefill algorithm (``fp8lab.numba_kernels.prefill``: decode of every query row over its causal
    prefix) through the split-kv simulator: K and V as a paged cache of one-token blocks, query ``i`` a decode
    row of length ``S - T + i + 1``."""
    t, s = q.shape[0], k.shape[0]
    tables = np.tile(np.arange(s, dtype=np.int32), (t, 1))
    lens = (s - t + np.arange(t) + 1).astype(np.int32)
    k_cache, v_cache = (np.ascontiguousarray(x[:, :, None]) for x in (k, v))  # [S, kv_heads, 1, head_dim]
    k_scale, v_scale = (None if x is None else np.ascontiguousarray(x[:, :, None]) for x in (k_scale, v_scale))
    return splitkv.paged_decode(q, k_cache, v_cache, tables, lens, softmax_scale, k_scale, v_scale, alibi_slopes)


def test_fp8labs_prefill_algorithm_passes():
    """float32 throughout, in the kernel's order: within the stated bound, with and without ALiBi."""
    testing.check_prefill(prefill_as_decode_rows, max_examples=15)
    testing.check_prefill(prefill_as_decode_rows, alibi=True, max_examples=15)
    testing.check_prefill(prefill_as_decode_rows, fp8=False, alibi=True, max_examples=5)


def test_prefill_calls_the_kernel_as_documented():
    """Positional ``(q, k, v, softmax_scale, k_scale, v_scale)``, ``alibi_slopes=`` only with ALiBi; E4M3 codes
    with one float32 scale per (token, kv head) for FP8, float32 and no scales otherwise."""
    seen = []

    def spy(q, k, v, softmax_scale, k_scale, v_scale, **kw):
        seen.append((k.dtype, None if k_scale is None else (k_scale.dtype, k_scale.shape == k.shape[:2]), set(kw)))
        return _oracle_prefill(q, k, v, softmax_scale, k_scale, v_scale, **kw)

    testing.check_prefill(spy, max_examples=3)
    testing.check_prefill(spy, fp8=False, alibi=True, max_examples=3)
    assert seen[:3] == [(np.uint8, (np.float32, True), set())] * 3
    assert seen[3:] == [(np.float32, None, {"alibi_slopes"})] * 3


@pytest.mark.parametrize("layout", ["fp8lab", "vllm"])
def test_slots_past_a_sequence_are_poisoned_in_either_layout(layout):
    """What the decode check hands the kernel: every slot that is not one of a sequence's first ``seq_len``
    tokens holds NaN (codes 0x7F with NaN scales), in the caller's layout, so a kernel reading one is caught."""
    seen = []

    def spy(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale):
        block_size = k_scale.shape[1 if layout == "vllm" else 2]
        written = np.zeros((k_scale.shape[0], block_size), bool)  # [block, offset]
        for table, length in zip(block_tables, seq_lens):
            for j in range(length):
                written[table[j // block_size], j % block_size] = True
        mask = np.broadcast_to(written[:, :, None] if layout == "vllm" else written[:, None, :], k_scale.shape)
        for cache, scales in ((k_cache, k_scale), (v_cache, v_scale)):
            seen.append((int((~mask).sum()), bool(np.all(np.isnan(scales[~mask])) and np.all(cache[~mask] == 0x7F)
                                                   and np.all(np.isfinite(scales[mask])))))
        return my_decode(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale, layout=layout)

    testing.check_paged_decode(spy, layout=layout, max_examples=10)
    assert all(ok for _, ok in seen) and sum(n for n, _ in seen) > 0


def test_head_dims_restrict_the_drawn_head_sizes():
    seen = set()

    def spy_decode(q, *args):
        seen.add(q.shape[-1])
        return attention.paged_decode(q, *args)

    def spy_prefill(q, k, v, softmax_scale, k_scale, v_scale):
        seen.add(q.shape[-1])
        return _oracle_prefill(q, k, v, softmax_scale, k_scale, v_scale)

    testing.check_paged_decode(spy_decode, head_dims=(32, 128), max_examples=10)
    testing.check_prefill(spy_prefill, head_dims=(32, 128), max_examples=10)
    assert seen and seen <= {32, 128}
    with pytest.raises(ValueError, match="^head_dims: expected positive head sizes"):
        testing.check_prefill(spy_prefill, head_dims=())


def test_the_tensor_core_decode_simulator_passes_with_f16_operands_and_fails_with_float32_ones():
    """The bit-exact model of fp8lab's tensor-core decode kernel (F16 query and weights; head_dim 128, blocks of 16
    and 32) passes the check that states its operands' format, and fails the float32 one: the F16 roundings are
    what the added tolerance is for, not slack that hides a bug."""
    from fp8lab.simulators import splitkv_mma

    def tensor_cores(*args):
        return splitkv_mma.paged_decode(*args, num_splits=2)

    testing.check_paged_decode(tensor_cores, head_dims=(128,), block_sizes=(16, 32), operands="f16", max_examples=10)
    with pytest.raises(testing.KernelCheckFailed, match="paged decode"):
        testing.check_paged_decode(tensor_cores, head_dims=(128,), block_sizes=(16, 32), max_examples=10)


def test_the_tensor_core_prefill_simulator_passes_with_f16_operands_and_fails_with_float32_ones():
    """The bit-exact model of fp8lab's tensor-core flash prefill (F16 query and weights, head_dim 128, blocks of 16)
    passes the prefill check that states its operands' format, and fails the float32 one."""
    from helpers.attention import paged_prefill_arguments

    from fp8lab.simulators import prefill_mma

    def tensor_cores(q, k, v, softmax_scale, k_scale, v_scale):
        return prefill_mma.paged_prefill(*paged_prefill_arguments(q, k, v, softmax_scale, k_scale, v_scale))

    testing.check_prefill(tensor_cores, head_dims=(128,), operands="f16", max_examples=10)
    with pytest.raises(testing.KernelCheckFailed, match="prefill"):
        testing.check_prefill(tensor_cores, head_dims=(128,), max_examples=10)


def test_an_operand_format_the_kit_does_not_know_is_refused():
    with pytest.raises(ValueError, match="operands: expected one of f32, f16, bf16"):
        testing.check_paged_decode(lambda *a: my_decode(*a), operands="fp8")
    with pytest.raises(ValueError, match="operands: expected one of f32, f16, bf16"):
        testing.check_prefill(lambda *a: my_prefill(*a), operands="fp8")
    with pytest.raises(ValueError, match="block_sizes"):
        testing.check_paged_decode(lambda *a: my_decode(*a), block_sizes=(0,))
