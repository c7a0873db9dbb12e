"""The peers of ``docs/10_peer_results.md``: each test runs the kit on one peer function as the page reports
it and asserts what the page says (a pass passes; a difference fails with the stated output, minimal input
and bug class). Optional: a test skips when its package is missing; in CI only ml_dtypes is installed.

The wrappers are ``tools/peer_results.py``'s (loaded from its path), so there is one statement of how each
peer's API maps onto a check's signature. Every test runs the CPU rows; the GPU rows are the lead's
``python tools/peer_results.py run --device cuda`` on the device.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from fp8lab.reference import e4m3
from fp8lab.testing.checks import encode_inputs

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "peer_results.py"


@pytest.fixture(scope="module")
def peers():
    """``tools/peer_results.py`` as a module."""
    spec = importlib.util.spec_from_file_location("peer_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_results"] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def row(peers, package: str, function: str, check: str, **options) -> dict:
    """The CPU result of the one peer of ``PEERS`` named by ``function``, for ``check`` with
    ``options`` among its options (its whole function, or the start of one)."""
    found = [p for p in peers.PEERS if p.package == package and p.function.startswith(function)
             and p.check == f"check_{check}" and all(p.options.get(k) == v for k, v in options.items())]
    found = [p for p in found if p.function == function] or found  # an exact name wins over longer ones
    assert len(found) == 1, f"{package} {function} {check} {options}: {len(found)} peers match"
    return peers.run_one(found[0], "cpu")


def assert_fails(result: dict, output: str, diagnoses: list[str]) -> dict:
    """``result`` is a failure of ``output`` naming exactly ``diagnoses``; its report."""
    assert result["outcome"] == "fail", result
    report = result["report"]
    assert (report["output"], report["diagnoses"]) == (output, diagnoses), result["text"]
    return report


# ---------------------------------------------------------------------------- E4M3 casts


def test_ml_dtypes_cast_follows_the_nan_policy(peers):
    pytest.importorskip("ml_dtypes")
    assert row(peers, "ml_dtypes", "x.astype(ml_dtypes.float8_e4m3fn)", "e4m3_encode", saturate=False)["outcome"] == "pass"
    report = assert_fails(row(peers, "ml_dtypes", "x.astype(ml_dtypes.float8_e4m3fn)", "e4m3_encode", saturate=True),
                          "codes", ["overflow_policy_swapped"])
    assert (report["inputs"]["x"], report["expected"], report["actual"]) == ("float32[1] [465.]", "0x7E", "0x7F")
    assert row(peers, "ml_dtypes", "codes.view(ml_dtypes.float8_e4m3fn)", "e4m3_decode")["outcome"] == "pass"


def test_ml_dtypes_fnuz_is_the_other_format(peers):
    """Decoding and encoding with float8_e4m3fnuz are both named fnuz_max_240 (the catalog's encode side has an
    encoder of fnuz's bias-8 bit patterns besides the clip at 240), and the page says so."""
    pytest.importorskip("ml_dtypes")
    assert_fails(row(peers, "ml_dtypes", "codes.view(ml_dtypes.float8_e4m3fnuz)", "e4m3_decode"), "values",
                 ["fnuz_max_240"])
    report = assert_fails(row(peers, "ml_dtypes", "x.astype(ml_dtypes.float8_e4m3fnuz)", "e4m3_encode"), "codes",
                          ["fnuz_max_240"])
    assert (report["inputs"]["x"], report["expected"], report["actual"]) == ("float32[1] [-448.]", "0xFE", "0x80")


TORCH_CAST_SATURATES = {"2.11": False, "2.13": True}
"""torch's cast: saturates (True) or NaN (False) on overflow, per release, as docs/01_e4m3.md measured."""


def test_torch_cast_follows_one_overflow_policy(peers):
    torch = pytest.importorskip("torch")
    outcomes = {saturate: row(peers, "torch", "x.to(torch.float8_e4m3fn)", "e4m3_encode", saturate=saturate)
                for saturate in (True, False)}
    followed = [s for s, result in outcomes.items() if result["outcome"] == "pass"]
    assert len(followed) == 1, outcomes
    assert_fails(outcomes[not followed[0]], "codes", ["overflow_policy_swapped"])
    release = ".".join(torch.__version__.split(".")[:2])
    if release in TORCH_CAST_SATURATES:
        assert followed[0] == TORCH_CAST_SATURATES[release]
    assert row(peers, "torch", "codes.view(torch.float8_e4m3fn)", "e4m3_decode")["outcome"] == "pass"
    assert_fails(row(peers, "torch", "codes.view(torch.float8_e4m3fnuz)", "e4m3_decode"), "values", ["fnuz_max_240"])


def test_gfloat_differs_only_in_the_sign_of_nan(peers):
    """gfloat encodes every NaN as 0xFF; the contract keeps the input's sign (nan_sign_not_kept). Nothing else
    differs."""
    pytest.importorskip("gfloat")
    decode = row(peers, "gfloat", "decode_ndarray", "e4m3_decode")
    assert decode["outcome"] == "pass"
    x = encode_inputs()
    for sat in (True, False):
        report = assert_fails(row(peers, "gfloat", f"encode_ndarray(ocp_e4m3, round_ndarray(ocp_e4m3, x, sat={sat}))",
                                  "e4m3_encode", saturate=sat), "codes", ["nan_sign_not_kept"])
        assert report["actual"] == "0xFF"
        got = peers.gfloat_encode(sat)("cpu")(x.copy())
        expected = e4m3.encode(x, saturate=sat)
        wrong = got != expected
        assert np.all(got[wrong] == 0xFF) and np.all(expected[wrong] == 0x7F)  # +NaN only, as a -NaN code


def test_onnx_reference_casts_pass(peers):
    pytest.importorskip("onnx")
    for saturate in (1, 0):
        function = f"reference QuantizeLinear(x, 1, 0) -> FLOAT8E4M3FN, saturate={saturate}"
        assert row(peers, "onnx", function, "e4m3_encode", saturate=bool(saturate))["outcome"] == "pass"
    assert row(peers, "onnx", "reference DequantizeLinear", "e4m3_decode")["outcome"] == "pass"


# ---------------------------------------------------------------------------- blockwise weights and activations


def test_transformers_quantize(peers):
    """As-is it leaves a weight that is not whole blocks unquantized; padded, a block of amax below about 1.3e-36
    gets scale_inv 0 (448 / amax overflows) and its zeros NaN codes; beyond that, its scale_inv is up to 2
    float32 ulps from amax / 448."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    as_is = row(peers, "transformers", "Fp8Quantize(...)._quantize_one(key, w)", "blockwise_quantize")
    assert as_is["outcome"] == "raised" and "unquantized" in as_is["error"]
    report = assert_fails(row(peers, "transformers", "Fp8Quantize(...)._quantize_one(key, w), w zero-padded",
                              "blockwise_quantize"), "scale_inv", [])
    assert report["actual"] == 0.0 and report["expected"] == 2.0**-126
    quantize = peers.transformers_quantize(padded=True)("cpu")
    codes, scale_inv = quantize(np.array([[1e-37, 0.0, -1e-37]], np.float32), (128, 128))
    assert codes.tolist() == [[0x7E, 0xFF, 0xFE]] and scale_inv.tolist() == [[0.0]]  # its zero became NaN
    beyond = row(peers, "transformers", "Fp8Quantize(...)._quantize_one(key, w), padded; blocks", "blockwise_quantize")
    assert beyond["outcome"] == "pass"  # its scales are up to 2 float32 ulps off: within the kit's 4
    # the minimal case by hand: torch's `448 / t` is `t.reciprocal() * 448`, then transformers takes 1 / that
    amax = np.float32(1.3559227)
    scale_inv = (1.0 / (448.0 / torch.tensor([amax]))).item()
    assert abs(scale_inv - amax / np.float32(448)) == 2 * np.spacing(amax / np.float32(448))


def test_transformers_dequantize(peers):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    as_is = row(peers, "transformers", "Fp8Dequantize(...)._dequantize_one(codes, scale_inv)", "blockwise_dequantize")
    assert as_is["outcome"] == "raised" and "not divisible by scale grid" in as_is["error"]
    padded = row(peers, "transformers", "Fp8Dequantize(...)._dequantize_one(codes, scale_inv), codes zero-padded",
                 "blockwise_dequantize")
    assert padded["outcome"] == "pass"
    assert row(peers, "transformers", "_dequantize_fp8_weight", "blockwise_dequantize")["outcome"] == "pass"


def test_compressed_tensors(peers):
    """An all-zero block or group gets float32's epsilon as its scale, a tiny one a subnormal scale (no
    floor); nothing else differs. Its dequantize passes."""
    pytest.importorskip("compressed_tensors")
    report = assert_fails(row(peers, "compressed-tensors", "calculate_qparams + quantize, FP8_BLOCK",
                              "blockwise_quantize"), "scale_inv", [])
    assert (report["inputs"]["w"], report["expected"], report["actual"]) == ("float32[1, 1] [0.]", 1.0,
                                                                             float(np.finfo(np.float32).eps))
    assert row(peers, "compressed-tensors", "calculate_qparams + quantize, blocks", "blockwise_quantize")["outcome"] == "pass"
    assert row(peers, "compressed-tensors", "dequantize", "blockwise_dequantize")["outcome"] == "pass"
    report = assert_fails(row(peers, "compressed-tensors", "compute_dynamic_scales_and_zp + quantize, FP8_BLOCK",
                              "activation_quantize"), "scales", [])
    assert report["inputs"]["a"] == "float32[1, 1] [0.]" and report["actual"] == float(np.finfo(np.float32).eps)
    masked = row(peers, "compressed-tensors", "compute_dynamic_scales_and_zp + quantize, groups", "activation_quantize")
    assert masked["outcome"] == "pass"


def test_torchao_torch_references(peers):
    """An amax clamped at 1e-12: a block below it gets scale_inv 1e-12 / 448; nothing else differs; its
    activation quantizer passes with eps=1e-12."""
    pytest.importorskip("torch")
    pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")  # needs triton (installs on a CPU)
    report = assert_fails(row(peers, "torchao", "torch_blockwise_scale_weight_quant(w, tile_size=128)",
                              "blockwise_quantize"), "scale_inv", [])
    assert report["expected"] == 1.0 and report["actual"] == pytest.approx(1e-12 / 448, rel=1e-6)
    assert row(peers, "torchao", "torch_blockwise_scale_weight_quant(w, tile_size=128), blocks",
               "blockwise_quantize")["outcome"] == "pass"
    assert row(peers, "torchao", "torch_blockwise_scale_act_quant_lhs", "activation_quantize")["outcome"] == "pass"


def test_the_results_page_shows_every_cpu_row(peers):
    """Every CPU peer of the script has its row on the page (rendered from docs/data/peers_cpu.json)."""
    page = (SCRIPT.parents[1] / "docs" / "10_peer_results.md").read_text(encoding="utf-8")
    for peer in peers.PEERS:
        if "cpu" in peer.devices:
            assert f"`{peer.function}`" in page, peer.function
