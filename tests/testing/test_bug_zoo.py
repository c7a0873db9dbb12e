"""The bug zoo: every bug class of ``fp8lab.testing.bugs`` has a deliberately wrong implementation
(``tests/helpers/zoo_weights.py``, ``tests/helpers/zoo_kv.py``, written independently of the catalog's
mutants), and the kit must fail every one and name its class; fp8lab's own oracle, correct peers and the
simulators of its GEMM kernels must pass (the KV and attention ones: ``test_kv_kit.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import zoo_kv, zoo_weights
from helpers.zoo_weights import (
    FN,
    cast_saturating,
    encode_nan_on_overflow,
    w8a8_float32,
)

from fp8lab import testing
from fp8lab.reference import blockwise, e4m3
from fp8lab.simulators import gemv_simt

ZOO = zoo_weights.ZOO + zoo_kv.ZOO


@pytest.mark.parametrize("bug, check", ZOO, ids=[f"{i}-{bug}" for i, (bug, _) in enumerate(ZOO)])
def test_the_kit_fails_every_bug_and_names_its_class(bug, check):
    with pytest.raises(testing.KernelCheckFailed) as failure:
        check()
    names = [b.name for b in failure.value.report.diagnoses]
    assert bug in names, str(failure.value)
    assert bug in str(failure.value)


def test_every_bug_class_has_a_zoo_entry():
    assert {b.name for b in testing.CATALOG} == {bug for bug, _ in ZOO}


# ---------------------------------------------------------------------------- what must pass


def test_the_oracle_and_correct_peers_pass():
    testing.check_e4m3_encode(e4m3.encode)
    testing.check_e4m3_encode(lambda x: e4m3.encode(x, saturate=False), saturate=False)
    testing.check_e4m3_encode(cast_saturating)  # ml_dtypes behind a saturating clip: correct
    testing.check_e4m3_encode(encode_nan_on_overflow, saturate=False)  # ml_dtypes' cast IS the NaN policy
    testing.check_e4m3_decode(e4m3.decode)
    testing.check_e4m3_decode(lambda c: np.asarray(c, np.uint8).view(FN).astype(np.float32))
    testing.check_blockwise_quantize(blockwise.quantize, block=(64, 128))
    testing.check_blockwise_dequantize(blockwise.dequantize)
    testing.check_activation_quantize(blockwise.quantize_activations)
    testing.check_w8a8_gemm(lambda a, q, s, block, eps: blockwise.gemm_w8a8(a, q, s, block, eps))
    testing.check_w8a8_gemm(w8a8_float32)  # float32 accumulation in blocks: within the stated bound


def test_the_simulators_of_fp8labs_gemm_kernels_pass():
    """The bit-exact model of the SIMT GEMV kernel on float32 activations (it needs K % 128 == 0)."""
    testing.check_blockwise_gemm(lambda a, q, s, block: gemv_simt.gemv_simt(a, q, s, block), k_multiple=128,
                                 max_examples=15)


def test_a_report_says_what_is_wrong():
    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_e4m3_encode(encode_nan_on_overflow)
    report = failure.value.report
    assert report.operator == "e4m3 encode (saturate=True)" and report.inputs["x"].size == 1
    assert (report.expected, report.actual) == ("0x7E", "0x7F") and report.tolerance == "exact"
    text = str(failure.value)
    assert "smallest failing input" in text and "overflow_policy_swapped" in text
