"""Run ``fp8lab.testing`` on the FP8 functions of other packages (the peers) and render the results page.

Each peer function is wrapped as a NumPy callable with the signature of one ``check_*`` (``PEERS``): that
wrapper is the statement of how the peer's API maps onto the contract, and its docstring says so. Where the
peer documents a different contract (an epsilon, dimensions that must be whole blocks, no epsilon at all),
the check's options are chosen to match it and the wrapper says why; what differs after that is a finding.

    PYTHONPATH=. python tools/peer_results.py run --out docs/data/peers_cpu.json            # every peer importable here
    PYTHONPATH=. python tools/peer_results.py run --device cuda --label h200 --out docs/data/peers_h200.json
    PYTHONPATH=. python tools/peer_results.py render docs/data/peers_cpu.json --page docs/10_peer_results.md

``run`` needs NumPy, Hypothesis and fp8lab (``PYTHONPATH=.`` from the repository root); every peer whose
package is missing, or whose function this version lacks, or that needs CUDA where there is none, is
recorded as skipped, with the reason, and so is one that raises ``ImportError`` while it runs (a kernel it
would load from elsewhere). Nothing is downloaded (``HF_HUB_OFFLINE=1`` unless set). ``render`` replaces the part of the page
between ``<!-- peer-results LABEL -->`` and ``<!-- /peer-results LABEL -->`` with the tables of the
results labelled ``LABEL``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from fp8lab import testing
from fp8lab.reference import blockwise

MIN_EPS = 448 * 2.0**-126
"""The smallest activation epsilon the contract allows: the check option for peers that have none, so that
only an all-zero group (where no epsilon gives 0 / 0) can tell them apart from the contract."""

FLOORED_AMAX = 448 * 2.0**-126
"""Below this amax the contract's scale is its floor ``2^-126`` (1 for an all-zero block)."""


class Unavailable(Exception):
    """The peer cannot run here: its package, this version's function, or a CUDA device is missing."""


@dataclass(frozen=True)
class Peer:
    """One peer function checked one way: ``package`` (its distribution, for the version), ``function``
    (what the wrapper calls, as a user would write it), the ``check`` of ``fp8lab.testing`` and its
    ``options``, ``make(device)`` returning the NumPy callable, and the devices it runs on."""

    package: str
    function: str
    check: str
    options: dict
    make: Callable[[str], Callable]
    devices: tuple = ("cpu",)
    why: str = ""
    """Why these check options: the peer's documented contract, in a line."""


def _require(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise Unavailable(f"{module} is not installed ({error})") from None


def _attr(module: str, name: str):
    value = getattr(_require(module), name, None)
    if value is None:
        raise Unavailable(f"{module}.{name} is not in this version")
    return value


# ---------------------------------------------------------------------------- torch tensors <-> NumPy


def _torch():
    return _require("torch")


def _tensor(x: np.ndarray, device: str):
    """A torch tensor on ``device`` holding a copy of ``x``."""
    return _torch().from_numpy(np.ascontiguousarray(x)).to(device)


def _fp8(codes: np.ndarray, device: str):
    """uint8 E4M3 codes as a ``torch.float8_e4m3fn`` tensor (the same bytes)."""
    return _tensor(codes.astype(np.uint8), device).view(_torch().float8_e4m3fn)


def _codes(t) -> np.ndarray:
    """A float8 tensor's bytes as uint8 codes."""
    return t.contiguous().view(_torch().uint8).cpu().numpy()


def _numpy(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _pad_to_blocks(x: np.ndarray, block) -> np.ndarray:
    """``x`` padded with zeros at the end of each axis to whole blocks. Zeros leave every block's amax as it
    is, so a peer that requires whole blocks, run on the padded array and cropped, computes the contract's
    partial edge blocks; this is how a caller of such a peer has to use it."""
    return np.pad(x, [(0, -n % b) for n, b in zip(x.shape, block)])


def _block_amax(x: np.ndarray, block) -> np.ndarray:
    """The amax of every (partial) block of ``x``."""
    a = np.abs(_pad_to_blocks(x, block))
    return a.reshape(a.shape[0] // block[0], block[0], a.shape[1] // block[1], block[1]).max(axis=(1, 3))


def below_amax_as_contract(quantize, floor: float, groups: bool = False):
    """``quantize`` with one finding taken out, to look for differences beyond it: blocks (activation groups
    when ``groups``) whose amax is below ``floor`` get the oracle's codes and scale. The page states the
    finding first (the plain peer's row), then this row."""
    def masked(x, block, *eps):
        shape = (1, block) if groups else block
        q, s = quantize(x, block, *eps)
        q_ref, s_ref = blockwise.quantize_activations(x, block, *eps) if groups else blockwise.quantize(x, block)
        low = _block_amax(x, shape) < floor
        low_elements = np.repeat(np.repeat(low, shape[0], 0), shape[1], 1)[: x.shape[0], : x.shape[1]]
        return np.where(low_elements, q_ref, q), np.where(low, s_ref, s)
    return masked


# ---------------------------------------------------------------------------- E4M3 casts


def torch_encode(dtype_name: str = "float8_e4m3fn"):
    """``torch.from_numpy(x).to(device).to(torch.<dtype>)``, its bytes as codes: torch's cast has no
    overflow switch, so both policies are checked and the one it follows passes."""
    def make(device):
        dtype = getattr(_torch(), dtype_name)
        return lambda x: _codes(_tensor(x, device).to(dtype))
    return make


def torch_decode(dtype_name: str = "float8_e4m3fn"):
    """``codes.view(torch.<dtype>).to(torch.float32)``."""
    def make(device):
        dtype = getattr(_torch(), dtype_name)
        return lambda codes: _numpy(_tensor(codes, device).view(dtype).to(_torch().float32))
    return make


def ml_dtypes_encode(dtype_name: str = "float8_e4m3fn"):
    """``x.astype(ml_dtypes.<dtype>).view(np.uint8)``: a plain cast, no overflow switch."""
    def make(device):
        dtype = _attr("ml_dtypes", dtype_name)
        return lambda x: np.asarray(x, np.float32).astype(dtype).view(np.uint8)
    return make


def ml_dtypes_decode(dtype_name: str = "float8_e4m3fn"):
    """``codes.view(ml_dtypes.<dtype>).astype(np.float32)``."""
    def make(device):
        dtype = _attr("ml_dtypes", dtype_name)
        return lambda codes: codes.view(dtype).astype(np.float32)
    return make


def gfloat_encode(sat: bool):
    """``gfloat.encode_ndarray(ocp_e4m3, gfloat.round_ndarray(ocp_e4m3, x, sat=sat))``: gfloat rounds (ties to
    even; ``sat`` clips to +-448, else overflow gives NaN) and encodes as two steps; ``sat`` is the
    check's ``saturate``."""
    def make(device):
        gfloat = _require("gfloat")
        fmt = _require("gfloat.formats").format_info_ocp_e4m3

        def encode(x):
            rounded = gfloat.round_ndarray(fmt, np.asarray(x, np.float64), sat=sat)
            return gfloat.encode_ndarray(fmt, rounded).astype(np.uint8)
        return encode
    return make


def gfloat_decode(device):
    """``gfloat.decode_ndarray(ocp_e4m3, codes)`` (codes as integers)."""
    gfloat = _require("gfloat")
    fmt = _require("gfloat.formats").format_info_ocp_e4m3
    return lambda codes: gfloat.decode_ndarray(fmt, codes.astype(np.int64)).astype(np.float32)


def _onnx_model(op: str, saturate: int | None):
    """A one-node ONNX model ``y = op(x, scale=1, zero_point=0)`` between float32 and FLOAT8E4M3FN, opset 21
    (the first with ``saturate`` on QuantizeLinear's float8 outputs), for ``onnx.reference``."""
    onnx = _require("onnx")
    helper, tp = onnx.helper, onnx.TensorProto
    attrs = {} if saturate is None else {"saturate": saturate}
    node = helper.make_node(op, ["x", "scale", "zero_point"], ["y"], **attrs)
    x_type, y_type = (tp.FLOAT, tp.FLOAT8E4M3FN) if op == "QuantizeLinear" else (tp.FLOAT8E4M3FN, tp.FLOAT)
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", x_type, None)],
                              [helper.make_tensor_value_info("y", y_type, None)],
                              initializer=[helper.make_tensor("scale", tp.FLOAT, [], [1.0]),
                                           helper.make_tensor("zero_point", tp.FLOAT8E4M3FN, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return _require("onnx.reference").ReferenceEvaluator(model)


def onnx_encode(saturate: int):
    """``onnx.reference`` QuantizeLinear to FLOAT8E4M3FN with scale 1 and zero point 0 (so ``x / 1``, exact),
    attribute ``saturate`` (1: clip to +-448, 0: NaN on overflow) as the check's ``saturate``."""
    def make(device):
        model = _onnx_model("QuantizeLinear", saturate)
        return lambda x: np.asarray(model.run(None, {"x": x})[0]).view(np.uint8)
    return make


def onnx_decode(device):
    """``onnx.reference`` DequantizeLinear from FLOAT8E4M3FN with scale 1 and zero point 0."""
    model = _onnx_model("DequantizeLinear", None)
    dtype = _attr("ml_dtypes", "float8_e4m3fn")  # onnx.reference holds float8 arrays as ml_dtypes arrays
    return lambda codes: np.asarray(model.run(None, {"x": codes.view(dtype)})[0], np.float32)


# ---------------------------------------------------------------------------- transformers' fine-grained FP8


def _transformers_fp8():
    return _require("transformers.integrations.finegrained_fp8")


def _hf_quantizer(block):
    """The stand-in for transformers' FP8 quantizer that ``Fp8Quantize`` / ``Fp8Dequantize`` read:
    ``quantization_config`` is a real ``FineGrainedFP8Config`` with ``weight_block_size = block``."""
    config = _attr("transformers", "FineGrainedFP8Config")(weight_block_size=list(block))
    return types.SimpleNamespace(quantization_config=config)


def transformers_quantize(padded: bool):
    """``Fp8Quantize(hf_quantizer)._quantize_one("w.weight", w)`` -> ``{"w.weight": codes, "w.weight_scale_inv":
    scale_inv}``: the conversion op transformers runs to save a model as fine-grained FP8 (scale_inv =
    ``1 / (448 / amax)``, codes ``clamp(w * (448 / amax), -448, 448)`` cast). It leaves a weight whose shape is
    not whole blocks unquantized (no scale key): as-is that raises here; ``padded`` pads to whole blocks."""
    def make(device):
        op = _attr("transformers.integrations.finegrained_fp8", "Fp8Quantize")

        def quantize(w, block):
            x = _pad_to_blocks(w, block) if padded else w
            out = op(_hf_quantizer(block))._quantize_one("w.weight", _tensor(x, device))
            if "w.weight_scale_inv" not in out:
                raise ValueError(f"Fp8Quantize left a {list(w.shape)} weight unquantized (not whole {block} blocks)")
            return _codes(out["w.weight"])[: w.shape[0], : w.shape[1]], _numpy(out["w.weight_scale_inv"])
        return quantize
    return make


def transformers_dequantize(padded: bool):
    """``Fp8Dequantize(hf_quantizer)._dequantize_one(codes, scale_inv, output_dtype=torch.float32)``: the load-time
    op of ``dequantize=True``; it takes the block from the scale grid, so it refuses a weight that is not whole
    blocks; ``padded`` pads the codes to whole blocks (zeros) and crops the result."""
    def make(device):
        op = _attr("transformers.integrations.finegrained_fp8", "Fp8Dequantize")

        def dequantize(q, s, block):
            codes = _pad_to_blocks(q, block) if padded else q
            out = op(_hf_quantizer(block))._dequantize_one(_fp8(codes, device), _tensor(s, device),
                                                         output_dtype=_torch().float32)
            return _numpy(out)[: q.shape[0], : q.shape[1]]
        return dequantize
    return make


def transformers_dequantize_weight(device):
    """``_dequantize_fp8_weight(codes, scale_inv, list(block), torch.float32)``: the dequantize of ``FP8Linear``'s
    backward (partial edge blocks handled)."""
    fn = _attr("transformers.integrations.finegrained_fp8", "_dequantize_fp8_weight")
    return lambda q, s, block: _numpy(fn(_fp8(q, device), _tensor(s, device), list(block), _torch().float32))


def _cuda_only(device):
    if device != "cuda":
        raise Unavailable("Triton: CUDA only")


def transformers_act_quant(device):
    """``act_quant(a, group)`` (transformers 4.x, Triton, copied from DeepSeek-V3): per token and group
    ``s = amax / 448`` with no epsilon; it requires ``K % group == 0``, so the activations are padded with
    zeros to whole groups (amax unchanged) and the codes cropped."""
    _cuda_only(device)
    act_quant = _attr("transformers.integrations.finegrained_fp8", "act_quant")

    def quantize(a, group, eps):
        q, s = act_quant(_tensor(_pad_to_blocks(a, (1, group)), device), group)
        return _codes(q)[:, : a.shape[1]], _numpy(s)
    return quantize


def transformers_w8a8(device):
    """``w8a8_block_fp8_matmul_triton(*act_quant(a, BK), codes, scale_inv, block, torch.float32)``: what 4.x's
    ``FP8Linear.forward`` computes, without its final ``nan_to_num``."""
    _cuda_only(device)
    act_quant = _attr("transformers.integrations.finegrained_fp8", "act_quant")
    matmul = _attr("transformers.integrations.finegrained_fp8", "w8a8_block_fp8_matmul_triton")

    def gemm(a, q, s, block, eps):
        aq, a_s = act_quant(_tensor(a, device), block[1])
        return _numpy(matmul(aq, _fp8(q, device), a_s, _tensor(s, device), list(block), _torch().float32))
    return gemm


def transformers_fp8_linear(device):
    """``FP8Linear(K, N, block_size=block)`` with ``weight = codes``, ``weight_scale_inv = scale_inv``, called on
    float32 activations: the layer a fine-grained FP8 checkpoint loads into (4.x: act_quant + the Triton W8A8
    matmul + ``nan_to_num``; 5.x: the hub kernel, which needs a download, or DeepGEMM)."""
    _cuda_only(device)
    torch = _torch()
    layer_class = _attr("transformers.integrations.finegrained_fp8", "FP8Linear")

    def gemm(a, q, s, block, eps):
        layer = layer_class(q.shape[1], q.shape[0], block_size=tuple(block)).to(device)
        with torch.no_grad():
            layer.weight = torch.nn.Parameter(_fp8(q, device), requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(_tensor(s, device), requires_grad=False)
            return _numpy(layer(_tensor(a, device)))
    return gemm


# ---------------------------------------------------------------------------- compressed-tensors


def _ct_args(**kwargs):
    """``QuantizationArgs`` of compressed-tensors' ``FP8_BLOCK`` preset (8-bit float, symmetric), with ``kwargs``."""
    args = _attr("compressed_tensors.quantization", "QuantizationArgs")
    return args(num_bits=8, type="float", symmetric=True, **kwargs)


def compressed_tensors_quantize(device):
    """``calculate_qparams(block min, block max, args)`` then ``quantize(w, scale, zero_point, args,
    dtype=torch.float8_e4m3fn)`` with the ``FP8_BLOCK`` weight args (``strategy="block"``,
    ``block_structure=block``). The per-block min and max are an observer's job (llm-compressor's), done here
    over the zero-padded weight, which is what compressed-tensors' own block padding does."""
    torch = _torch()
    helpers = _require("compressed_tensors.quantization.utils")
    forward = _require("compressed_tensors.quantization.lifecycle.forward")

    def quantize(w, block):
        args = _ct_args(strategy="block", block_structure=list(block))
        x = _tensor(_pad_to_blocks(w, block), device)
        tiles = x.reshape(x.shape[0] // block[0], block[0], x.shape[1] // block[1], block[1])
        scale, zero_point = helpers.calculate_qparams(tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3)), args)
        q = forward.quantize(_tensor(w, device), scale, zero_point, args, dtype=torch.float8_e4m3fn)
        return _codes(q), _numpy(scale)
    return quantize


def compressed_tensors_dequantize(device):
    """``dequantize(codes, scale_inv, None, args, dtype=torch.float32)`` with the ``FP8_BLOCK`` weight args."""
    forward = _require("compressed_tensors.quantization.lifecycle.forward")

    def dequantize(q, s, block):
        args = _ct_args(strategy="block", block_structure=list(block))
        return _numpy(forward.dequantize(_fp8(q, device), _tensor(s, device), None, args, dtype=_torch().float32))
    return dequantize


def compressed_tensors_act_quantize(device):
    """``compute_dynamic_scales_and_zp(a, args, module)`` then ``quantize(...)`` with the ``FP8_BLOCK`` input
    args (``strategy="group"``, ``group_size=group``, dynamic): scale ``amax / 448``, a zero scale replaced by
    float32's epsilon, no other epsilon; group quantization requires ``K % group == 0``, so the activations
    are zero-padded to whole groups and the codes cropped."""
    torch = _torch()
    helpers = _require("compressed_tensors.quantization.utils")
    forward = _require("compressed_tensors.quantization.lifecycle.forward")

    def quantize(a, group, eps):
        args = _ct_args(strategy="group", group_size=group, dynamic=True)
        x = _tensor(_pad_to_blocks(a, (1, group)), device)
        scale, zero_point = helpers.compute_dynamic_scales_and_zp(x, args, torch.nn.Module())
        q = forward.quantize(x, scale, zero_point, args, dtype=torch.float8_e4m3fn)
        return _codes(q)[:, : a.shape[1]], _numpy(scale)
    return quantize


# ---------------------------------------------------------------------------- torchao


def _torchao_training():
    """torchao's blockwise FP8 training kernels (imports triton, which installs on a CPU too)."""
    return _require("torchao.prototype.blockwise_fp8_training.kernels")


def torchao_weight_quant(device):
    """``torch_blockwise_scale_weight_quant(w, tile_size=BN)`` (the torch reference of torchao's blockwise FP8
    training): square tiles; ``s = float32(448 / max(amax, 1e-12))`` in float64, codes
    ``clamp(w * s, -448, 448)``, returns ``1 / s``; it requires whole tiles, so the weight is zero-padded."""
    fn = _torchao_training().torch_blockwise_scale_weight_quant

    def quantize(w, block):
        q, s = fn(_tensor(_pad_to_blocks(w, block), device), tile_size=block[0])
        return _codes(q)[: w.shape[0], : w.shape[1]], _numpy(s)
    return quantize


def torchao_act_quant_reference(device):
    """``torch_blockwise_scale_act_quant_lhs(a, tile_size=group)`` (torch reference): per token and group
    ``s = float32(448 / max(amax, 1e-12))``, returns ``1 / s``; so the check's ``eps`` is torchao's 1e-12.
    Whole groups required: zero-padded."""
    fn = _torchao_training().torch_blockwise_scale_act_quant_lhs

    def quantize(a, group, eps):
        q, s = fn(_tensor(_pad_to_blocks(a, (1, group)), device), tile_size=group)
        return _codes(q)[:, : a.shape[1]], _numpy(s)
    return quantize


def _torchao_inference(name):
    return _attr("torchao.kernel.blockwise_quantization", name)


def torchao_triton_act_quant(device):
    """``fp8_blockwise_act_quant(a, group)`` (Triton): ``s = amax / 448`` with no epsilon; whole groups required:
    zero-padded."""
    _cuda_only(device)
    fn = _torchao_inference("fp8_blockwise_act_quant")

    def quantize(a, group, eps):
        q, s = fn(_tensor(_pad_to_blocks(a, (1, group)), device), group)
        return _codes(q)[:, : a.shape[1]], _numpy(s)
    return quantize


def torchao_triton_weight_quant(device):
    """``fp8_blockwise_weight_quant(w, BN)`` (Triton): square blocks, ``s = amax / 448``; whole blocks
    required: zero-padded."""
    _cuda_only(device)
    fn = _torchao_inference("fp8_blockwise_weight_quant")

    def quantize(w, block):
        q, s = fn(_tensor(_pad_to_blocks(w, block), device), block[0])
        return _codes(q)[: w.shape[0], : w.shape[1]], _numpy(s)
    return quantize


def torchao_triton_weight_dequant(device):
    """``fp8_blockwise_weight_dequant(codes, scale_inv, BN)`` (Triton, square blocks, partial edge blocks masked)."""
    _cuda_only(device)
    fn = _torchao_inference("fp8_blockwise_weight_dequant")
    return lambda q, s, block: _numpy(fn(_fp8(q, device), _tensor(s, device), block[0]))


# ---------------------------------------------------------------------------- the peers

ENCODE, DECODE = "check_e4m3_encode", "check_e4m3_decode"
QUANTIZE, DEQUANTIZE = "check_blockwise_quantize", "check_blockwise_dequantize"
ACT, W8A8 = "check_activation_quantize", "check_w8a8_gemm"
BLOCK = {"block": (128, 128)}
TORCH_DEVICES = ("cpu", "cuda")

PEERS = [
    Peer("torch", "x.to(torch.float8_e4m3fn)", ENCODE, {"saturate": True}, torch_encode(), TORCH_DEVICES,
         "no overflow switch: both policies checked"),
    Peer("torch", "x.to(torch.float8_e4m3fn)", ENCODE, {"saturate": False}, torch_encode(), TORCH_DEVICES,
         "no overflow switch: both policies checked"),
    Peer("torch", "codes.view(torch.float8_e4m3fn).float()", DECODE, {}, torch_decode(), TORCH_DEVICES),
    Peer("torch", "codes.view(torch.float8_e4m3fnuz).float()", DECODE, {}, torch_decode("float8_e4m3fnuz"),
         TORCH_DEVICES, "the other format, on purpose: the kit should name it"),
    Peer("ml_dtypes", "x.astype(ml_dtypes.float8_e4m3fn)", ENCODE, {"saturate": True}, ml_dtypes_encode(),
         why="no overflow switch: both policies checked"),
    Peer("ml_dtypes", "x.astype(ml_dtypes.float8_e4m3fn)", ENCODE, {"saturate": False}, ml_dtypes_encode(),
         why="no overflow switch: both policies checked"),
    Peer("ml_dtypes", "codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)", DECODE, {}, ml_dtypes_decode()),
    Peer("ml_dtypes", "x.astype(ml_dtypes.float8_e4m3fnuz)", ENCODE, {"saturate": True},
         ml_dtypes_encode("float8_e4m3fnuz"), why="the other format, on purpose: the kit should name it"),
    Peer("ml_dtypes", "codes.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)", DECODE, {},
         ml_dtypes_decode("float8_e4m3fnuz"), why="the other format, on purpose: the kit should name it"),
    Peer("gfloat", "encode_ndarray(ocp_e4m3, round_ndarray(ocp_e4m3, x, sat=True))", ENCODE, {"saturate": True},
         gfloat_encode(True), why="sat=True is the saturating policy"),
    Peer("gfloat", "encode_ndarray(ocp_e4m3, round_ndarray(ocp_e4m3, x, sat=False))", ENCODE, {"saturate": False},
         gfloat_encode(False), why="sat=False is the NaN policy"),
    Peer("gfloat", "decode_ndarray(ocp_e4m3, codes)", DECODE, {}, gfloat_decode),
    Peer("onnx", "reference QuantizeLinear(x, 1, 0) -> FLOAT8E4M3FN, saturate=1", ENCODE, {"saturate": True},
         onnx_encode(1), why="saturate=1 is the saturating policy"),
    Peer("onnx", "reference QuantizeLinear(x, 1, 0) -> FLOAT8E4M3FN, saturate=0", ENCODE, {"saturate": False},
         onnx_encode(0), why="saturate=0 is the NaN policy"),
    Peer("onnx", "reference DequantizeLinear(codes, 1, 0)", DECODE, {}, onnx_decode),
    Peer("transformers", "Fp8Quantize(...)._quantize_one(key, w)", QUANTIZE, BLOCK, transformers_quantize(False),
         TORCH_DEVICES, "as-is: it quantizes only whole-block weights"),
    Peer("transformers", "Fp8Quantize(...)._quantize_one(key, w), w zero-padded to whole blocks", QUANTIZE, BLOCK,
         transformers_quantize(True), TORCH_DEVICES, "padded: zeros leave each block's amax as it is"),
    Peer("transformers", "Fp8Quantize(...)._quantize_one(key, w), padded; blocks of amax < 448 * 2^-126 as the "
         "contract's", QUANTIZE, {**BLOCK, "max_examples": 200},
         lambda d: below_amax_as_contract(transformers_quantize(True)(d), FLOORED_AMAX), TORCH_DEVICES,
         "the tiny-block finding taken out, to look beyond it (200 examples: what is left is rare)"),
    Peer("transformers", "Fp8Dequantize(...)._dequantize_one(codes, scale_inv)", DEQUANTIZE, BLOCK,
         transformers_dequantize(False), TORCH_DEVICES, "as-is: the block is read off the scale grid"),
    Peer("transformers", "Fp8Dequantize(...)._dequantize_one(codes, scale_inv), codes zero-padded", DEQUANTIZE,
         BLOCK, transformers_dequantize(True), TORCH_DEVICES, "padded to whole blocks, then cropped"),
    Peer("transformers", "_dequantize_fp8_weight(codes, scale_inv, block, torch.float32)", DEQUANTIZE, BLOCK,
         transformers_dequantize_weight, TORCH_DEVICES),
    Peer("transformers", "act_quant(a, 128) (4.x, Triton)", ACT, {"group": 128, "eps": MIN_EPS},
         transformers_act_quant, ("cuda",), "no epsilon: the smallest eps the contract allows"),
    Peer("transformers", "w8a8_block_fp8_matmul_triton(*act_quant(a, 128), codes, scale_inv, block) (4.x)", W8A8,
         {**BLOCK, "eps": MIN_EPS, "k_multiple": 128, "max_examples": 15}, transformers_w8a8, ("cuda",),
         "no epsilon; act_quant needs K % 128 == 0"),
    Peer("transformers", "FP8Linear(K, N, block_size=block)(a)", W8A8,
         {**BLOCK, "eps": MIN_EPS, "k_multiple": 128, "max_examples": 15}, transformers_fp8_linear, ("cuda",),
         "no epsilon; K % 128 == 0"),
    Peer("compressed-tensors", "calculate_qparams + quantize, FP8_BLOCK weight args", QUANTIZE, BLOCK,
         compressed_tensors_quantize, TORCH_DEVICES),
    Peer("compressed-tensors", "calculate_qparams + quantize, blocks of amax < 448 * 2^-126 as the contract's",
         QUANTIZE, BLOCK, lambda d: below_amax_as_contract(compressed_tensors_quantize(d), FLOORED_AMAX),
         TORCH_DEVICES, "the zero- and tiny-block finding taken out, to look beyond it"),
    Peer("compressed-tensors", "dequantize(codes, scale, None, FP8_BLOCK weight args)", DEQUANTIZE, BLOCK,
         compressed_tensors_dequantize, TORCH_DEVICES),
    Peer("compressed-tensors", "compute_dynamic_scales_and_zp + quantize, FP8_BLOCK input args", ACT,
         {"group": 128, "eps": MIN_EPS}, compressed_tensors_act_quantize, TORCH_DEVICES,
         "no epsilon (a zero scale becomes float32 eps): the smallest eps the contract allows"),
    Peer("compressed-tensors", "compute_dynamic_scales_and_zp + quantize, groups of amax < 448 * 2^-126 as the "
         "contract's", ACT, {"group": 128, "eps": MIN_EPS},
         lambda d: below_amax_as_contract(compressed_tensors_act_quantize(d), FLOORED_AMAX, groups=True),
         TORCH_DEVICES, "the zero-group finding taken out, to look beyond it"),
    Peer("torchao", "torch_blockwise_scale_weight_quant(w, tile_size=128)", QUANTIZE, BLOCK, torchao_weight_quant,
         TORCH_DEVICES, "whole tiles required: zero-padded"),
    Peer("torchao", "torch_blockwise_scale_weight_quant(w, tile_size=128), blocks of amax < 1e-12 as the contract's",
         QUANTIZE, BLOCK, lambda d: below_amax_as_contract(torchao_weight_quant(d), 1e-12), TORCH_DEVICES,
         "its 1e-12 amax clamp taken out, to look beyond it"),
    Peer("torchao", "torch_blockwise_scale_act_quant_lhs(a, tile_size=128)", ACT, {"group": 128, "eps": 1e-12},
         torchao_act_quant_reference, TORCH_DEVICES, "its amax is clamped at 1e-12: eps=1e-12"),
    Peer("torchao", "fp8_blockwise_act_quant(a, 128) (Triton)", ACT, {"group": 128, "eps": MIN_EPS},
         torchao_triton_act_quant, ("cuda",), "no epsilon: the smallest eps the contract allows"),
    Peer("torchao", "fp8_blockwise_weight_quant(w, 128) (Triton)", QUANTIZE, BLOCK, torchao_triton_weight_quant,
         ("cuda",), "whole blocks required: zero-padded"),
    Peer("torchao", "fp8_blockwise_weight_dequant(codes, scale_inv, 128) (Triton)", DEQUANTIZE, BLOCK,
         torchao_triton_weight_dequant, ("cuda",)),
]


# ---------------------------------------------------------------------------- running


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe(value) -> str:
    """A short text for one input of a report: small arrays in full, larger ones by dtype, shape and range."""
    if not isinstance(value, np.ndarray):
        return repr(value)
    head = f"{value.dtype}{list(value.shape)}"
    if value.size <= 8:
        return f"{head} {np.array2string(value.ravel(), separator=', ', precision=9)}"
    finite = np.abs(value[np.isfinite(value)]) if value.dtype.kind == "f" else np.abs(value.astype(np.int64))
    zero_rows = int(np.sum(~value.reshape(value.shape[0], -1).any(axis=1))) if value.ndim > 1 else 0
    extra = f", {zero_rows} all-zero row(s)" if zero_rows else ""
    return f"{head}, |x| in [{finite.min():.3g}, {finite.max():.3g}]{extra}" if finite.size else head


def _plain(value):
    """A report's expected / actual value as JSON (floats as floats, NaN as the string 'nan')."""
    if isinstance(value, (float, np.floating)):
        return "nan" if np.isnan(value) else float(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    return value if isinstance(value, (str, type(None))) else repr(value)


def run_one(peer: Peer, device: str) -> dict:
    """Run ``peer`` on ``device``: its row of the results (outcome ``pass``, ``fail`` with the report,
    ``raised`` with the exception and Hypothesis' failing case, or ``skipped`` with the reason)."""
    row = {"package": peer.package, "version": _version(peer.package), "function": peer.function,
           "check": peer.check, "options": {k: list(v) if isinstance(v, tuple) else v for k, v in peer.options.items()},
           "why": peer.why, "device": device}
    start = time.perf_counter()
    try:
        if row["version"] is None:
            raise Unavailable(f"{peer.package} is not installed")
        if device == "cuda" and not cuda_available():
            raise Unavailable("no CUDA device here")
        fn = peer.make(device)
        getattr(testing, peer.check)(fn, **peer.options)
        row["outcome"] = "pass"
    except Unavailable as reason:
        row.update(outcome="skipped", reason=str(reason))
    except ImportError as error:  # raised while running: the peer loads a kernel this machine lacks
        row.update(outcome="skipped", reason=f"{type(error).__name__}: {str(error).splitlines()[0]}")
    except testing.KernelCheckFailed as failure:
        r = failure.report
        row.update(outcome="fail", text=str(r), report={
            "operator": r.operator, "inputs": {name: _describe(v) for name, v in r.inputs.items()},
            "output": r.output, "index": list(r.index), "expected": _plain(r.expected), "actual": _plain(r.actual),
            "tolerance": r.tolerance, "wrong": r.wrong, "total": r.total, "diagnoses": [b.name for b in r.diagnoses]})
    except Exception as error:  # the peer refused an input of the contract: that is a result too
        notes = [n for n in getattr(error, "__notes__", []) if n.strip()]
        case = next((n.strip() for n in notes if "Falsifying example" in n or "Failing test case" in n), "")
        row.update(outcome="raised", error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                   case=" ".join(case.split()))
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def environment(label: str) -> dict:
    """Where the results were measured: date, python, platform, NumPy, torch and its CUDA device, fp8lab's commit."""
    env = {"label": label, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
           "numpy": np.__version__, "hypothesis": _version("hypothesis")}
    try:
        env["fp8lab_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["fp8lab_commit"] = None
    torch = sys.modules.get("torch") or _optional("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["device"] = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    return env


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def cuda_available() -> bool:
    torch = _optional("torch")
    return bool(torch is not None and torch.cuda.is_available())


def run(devices: list[str], label: str, only: str | None = None) -> dict:
    rows = []
    for peer in PEERS:
        if only and only not in f"{peer.package} {peer.function}":
            continue
        for device in peer.devices:
            if device not in devices:
                continue
            rows.append(run_one(peer, device))
            print(f"{rows[-1]['outcome']:8} {rows[-1]['seconds']:6.2f}s  {device:4} {peer.package}: {peer.function} "
                  f"[{peer.check} {peer.options}]", file=sys.stderr)
    return {"environment": environment(label), "results": rows}


# ---------------------------------------------------------------------------- rendering


def _options_text(options: dict) -> str:
    def show(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    return ", ".join(f"{k}={show(v)}" for k, v in options.items() if k != "max_examples")


def _result_text(row: dict) -> str:
    if row["outcome"] == "pass":
        return "pass"
    if row["outcome"] == "skipped":
        return f"skipped: {row['reason']}"
    if row["outcome"] == "raised":
        case = row.get("case", "").split("run(", 1)[-1].rstrip(") ").split(" #")[0].strip(" ,")
        return f"**raises** `{row['error']}`" + (f" on `{case}`" if case else "")
    r = row["report"]
    named = ", ".join(f"`{d}`" for d in r["diagnoses"]) or "no known class"
    inputs = "; ".join(f"{k} = {v}" for k, v in r["inputs"].items()
                       if k not in row["options"] and k != "format")  # the options are in their own column
    return (f"**fails** ({named}): `{r['output']}`{r['index']} expected {r['expected']}, got {r['actual']} "
            f"({r['wrong']} of {r['total']} wrong); minimal input: {inputs}")


def render(data: dict) -> str:
    """The markdown of one results file: the environment, then one row per (function, check, device)."""
    env = data["environment"]
    versions = sorted({(r["package"], r["version"]) for r in data["results"] if r["version"]})
    lines = [f"Measured {env['date']} on {env['platform']} ({env.get('device', 'no GPU')}), Python {env['python']}, "
             f"NumPy {env['numpy']}, Hypothesis {env['hypothesis']}, fp8lab {env['fp8lab_commit']}. Packages: "
             + ", ".join(f"{p} {v}" for p, v in versions) + ".", "",
             "| package | function | check (options) | device | result |", "|---|---|---|---|---|"]
    for row in data["results"]:
        check = row["check"].removeprefix("check_")
        options = _options_text(row["options"])
        why = f"<br>*{row['why']}*" if row.get("why") else ""
        lines.append(f"| {row['package']} {row['version'] or ''} | `{row['function']}`{why} | {check}"
                     f"{f' ({options})' if options else ''} | {row['device']} | {_result_text(row)} |")
    return "\n".join(line.replace("\n", " ") for line in lines)


def render_into(page: Path, files: list[Path]) -> None:
    """Replace each results block of ``page`` (by the label in its file) with the rendered tables."""
    text = page.read_text(encoding="utf-8")
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        label = data["environment"]["label"]
        block = re.compile(rf"(<!-- peer-results {re.escape(label)} -->\n).*?(<!-- /peer-results {re.escape(label)} -->)",
                           re.S)
        if not block.search(text):
            raise SystemExit(f"{page}: no '<!-- peer-results {label} -->' ... '<!-- /peer-results {label} -->' block")
        text = block.sub(lambda m: m.group(1) + f"<!-- rendered from {path.as_posix()} by tools/peer_results.py -->\n"
                         + render(data) + "\n" + m.group(2), text)
    page.write_text(text, encoding="utf-8")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run the kit on every peer importable here and write the results JSON")
    p_run.add_argument("--out", type=Path, required=True)
    p_run.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    p_run.add_argument("--label", default=None, help="the page block the results go to (default: cpu, or gpu "
                                                      "with CUDA)")
    p_run.add_argument("--only", default=None, help="only peers whose package or function contains this")
    p_render = sub.add_parser("render", help="render results JSONs into the page")
    p_render.add_argument("files", type=Path, nargs="+")
    p_render.add_argument("--page", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a peer that fetches a kernel from the Hub fails at once
        devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
        label = args.label or ("gpu" if cuda_available() and "cuda" in devices else "cpu")
        data = run(devices, label, args.only)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        counts = {o: sum(r["outcome"] == o for r in data["results"]) for o in ("pass", "fail", "raised", "skipped")}
        print(f"{args.out}: {counts}", file=sys.stderr)
    else:
        render_into(args.page, args.files)


if __name__ == "__main__":
    main()
