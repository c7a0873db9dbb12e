"""The GPU model's weights: what the constructor uploads, fused and re-blocked, and which shapes the kernels take.

Everything is uploaded once, in the form its kernel reads; there is never a BF16 or float32 copy of an
FP8 weight on the device:

=============================  ==================================================================
weights                        layout
=============================  ==================================================================
q/k/v projections              one fused FP8 weight ``[(Hq + 2 Hkv) D, hidden]`` (uint8 E4M3 codes,
                               rows q, then k, then v) with its float32 ``scale_inv``
gate/up projections            one fused FP8 weight ``[2 I, hidden]`` (gate rows, then up rows):
                               its GEMM writes the ``[T, 2 I]`` that ``layers.silu_mul`` reads
o_proj, down_proj              FP8 codes ``[N, K]`` + float32 ``scale_inv``, as in the checkpoint
norms (incl. q/k-norm)         float32
embed_tokens, lm_head          BF16 bit patterns (uint16) ``[vocab, hidden]``; one array when tied
RoPE                           ``layers.rope_table``: float32 ``[max_position_embeddings, head_dim]``
=============================  ==================================================================

Fusing is ``fp8lab.reference.blockwise.concatenate_rows``: codes and ``scale_inv`` rows are concatenated;
when a part's row count is not a multiple of the checkpoint's ``block_n`` the fused weight is re-blocked
to ``block_n' = gcd(block_n, part sizes)`` rows per scale (each scale row repeated), which describes
exactly the same dequantized matrix. ``fp8_gemm`` needs ``block_n'`` to be a multiple of 8; where it is
not, the parts stay separate weights. A part of a fused weight is a row slice of it (a view: codes,
scale rows), so q, k and v can also run as three GEMMs (where the weights do not fuse: see
``fp8lab.engine.cuda.plan``). Projections a checkpoint keeps in BF16 (``modules_to_not_convert``, or a
BF16 checkpoint) are BF16 bit patterns run by ``layers.bf16_linear``; float32 weights that are not BF16
values are rounded to BF16 at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8lab.numba_kernels import layers, splitkv
from fp8lab.numba_kernels.arguments import K_MULTIPLE
from fp8lab.numba_kernels.gemm_mma import BLOCK_N_MULTIPLE
from fp8lab.reference import blockwise
from fp8lab.reference.dense import float32_to_bf16_bits

from ..config import Qwen3Config
from ..layout import is_fp8_projection
from .memory import DeviceMemory


@dataclass
class DeviceLinear:
    """One projection on the device: ``kind`` ``"fp8"`` (uint8 codes ``weight [N, K]``, float32
    ``scale_inv``, ``block = (BN, BK)``) or ``"bf16"`` (uint16 BF16 patterns ``weight [N, K]``)."""

    kind: str
    weight: object
    scale_inv: object = None
    block: tuple[int, int] | None = None

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    def rows(self, start: int, stop: int) -> "DeviceLinear":
        """Rows ``[start, stop)`` as a view (FP8: ``start`` a multiple of block_n, ``stop`` one or ``N``)."""
        if self.kind == "bf16":
            return DeviceLinear("bf16", self.weight[start:stop])
        bn = self.block[0]
        assert start % bn == 0 and (stop % bn == 0 or stop == self.n), (start, stop, bn)
        return DeviceLinear("fp8", self.weight[start:stop], self.scale_inv[start // bn : -(-stop // bn)], self.block)


@dataclass
class LinearGroup:
    """Projections that read the same input: ``fused`` runs them as one GEMM (None when their formats
    differ or their blocks do not fuse), ``parts`` one at a time (row views of ``fused`` when there is one)."""

    fused: DeviceLinear | None
    parts: list[DeviceLinear]
    sizes: tuple[int, ...]


@dataclass
class DeviceLayer:
    """One decoder layer's weights on the device (norms float32)."""

    input_layernorm: object
    q_norm: object
    k_norm: object
    post_attention_layernorm: object
    qkv: LinearGroup
    o_proj: DeviceLinear
    gate_up: DeviceLinear
    down_proj: DeviceLinear


@dataclass
class DeviceWeights:
    """All of a model's weights on the device: ``embed_tokens`` and ``lm_head`` (BF16 patterns, the same
    array when tied), the final ``norm``, the RoPE table ``rope_cos_sin`` and the ``layers``."""

    embed_tokens: object
    lm_head: object
    norm: object
    rope_cos_sin: object
    layers: list[DeviceLayer]


def fuse_fp8_for_gemm(parts: list[tuple[np.ndarray, np.ndarray]], block: tuple[int, int]):
    """``blockwise.concatenate_rows(parts, block)`` when ``fp8_gemm`` can run the result (its block_n a
    multiple of ``BLOCK_N_MULTIPLE``), else None: the parts then stay separate weights."""
    codes, scale_inv, new_block = blockwise.concatenate_rows(parts, block)
    return None if new_block[0] % BLOCK_N_MULTIPLE else (codes, scale_inv, new_block)


def unsupported_reason(config: Qwen3Config) -> str | None:
    """Why ``CudaQwen3Model`` cannot run ``config`` with these kernels (None: it can)."""
    c = config
    if c.head_dim not in splitkv.HEAD_DIMS:
        return f"head_dim {c.head_dim} (the attention kernels take {', '.join(map(str, splitkv.HEAD_DIMS))})"
    ks = {"hidden_size": c.hidden_size, "num_attention_heads * head_dim": c.num_attention_heads * c.head_dim,
          "intermediate_size": c.intermediate_size}
    for name, k in ks.items():
        if c.quantization is not None and k % K_MULTIPLE:
            return f"{name} = {k} (the FP8 GEMM kernels need K to be a multiple of {K_MULTIPLE})"
        if k % 8:
            return f"{name} = {k} (the BF16 linear kernel needs K to be a multiple of 8)"
    if c.quantization is not None:
        bn, bk = c.quantization.weight_block_size
        if bk % K_MULTIPLE or bn % BLOCK_N_MULTIPLE:
            return (f"weight_block_size {[bn, bk]} (the FP8 GEMM kernels need block_k a multiple of {K_MULTIPLE} "
                    f"and block_n a multiple of {BLOCK_N_MULTIPLE})")
    return None


class _Uploader:
    """Uploads one checkpoint's weights into ``memory``, in the layout of the module docstring."""

    def __init__(self, config: Qwen3Config, tensors: dict[str, np.ndarray], memory: DeviceMemory):
        self.config, self.tensors, self.memory = config, tensors, memory

    def weights(self) -> DeviceWeights:
        c, mem, tensors = self.config, self.memory, self.tensors
        embed = mem.upload("model.embed_tokens.weight (BF16)", float32_to_bf16_bits(tensors["model.embed_tokens.weight"]))
        lm_head = embed if c.tie_word_embeddings else mem.upload("lm_head.weight (BF16)",
                                                                 float32_to_bf16_bits(tensors["lm_head.weight"]))
        rope = mem.upload("RoPE table", layers.rope_table(c.max_position_embeddings, c.head_dim, c.rope_theta))
        return DeviceWeights(embed, lm_head, self.f32("model.norm.weight"), rope,
                             [self.layer(i) for i in range(c.num_hidden_layers)])

    def f32(self, name: str):
        return self.memory.upload(name, np.ascontiguousarray(self.tensors[name], np.float32))

    def layer(self, i: int) -> DeviceLayer:
        p = f"model.layers.{i}."
        qkv = self.group([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"])
        gate_up = self.group([p + "mlp.gate_proj", p + "mlp.up_proj"])
        if gate_up.fused is None:
            raise ValueError(f"layer {i}: gate_proj and up_proj must share a format (both FP8 or both BF16) "
                             "to run as one GEMM")
        return DeviceLayer(
            input_layernorm=self.f32(p + "input_layernorm.weight"), q_norm=self.f32(p + "self_attn.q_norm.weight"),
            k_norm=self.f32(p + "self_attn.k_norm.weight"),
            post_attention_layernorm=self.f32(p + "post_attention_layernorm.weight"),
            qkv=qkv, o_proj=self.group([p + "self_attn.o_proj"]).fused, gate_up=gate_up.fused,
            down_proj=self.group([p + "mlp.down_proj"]).fused)

    def host_fp8(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An FP8 projection's codes and float32 scales, checked (shape, no NaN codes)."""
        codes = np.ascontiguousarray(self.tensors[name + ".weight"])
        block = self.config.quantization.weight_block_size
        scales = blockwise.checked_scales(self.tensors[name + ".weight_scale_inv"], codes.shape, block)
        nan_codes = blockwise.nan_code_positions(codes)
        if len(nan_codes):
            raise ValueError(f"{name}.weight: {len(nan_codes)} NaN codes, e.g. at {tuple(int(i) for i in nan_codes[0])}")
        return codes, np.ascontiguousarray(scales, np.float32)

    def one(self, name: str) -> DeviceLinear:
        """One projection as it is in the checkpoint: FP8 codes + scales, or BF16 patterns."""
        if is_fp8_projection(self.config, name):
            codes, scales = self.host_fp8(name)
            return DeviceLinear("fp8", self.memory.upload(f"{name} (FP8 codes)", codes),
                                self.memory.upload(f"{name}.weight_scale_inv", scales),
                                self.config.quantization.weight_block_size)
        return DeviceLinear("bf16", self.memory.upload(f"{name} (BF16)", float32_to_bf16_bits(self.tensors[name + ".weight"])))

    def group(self, names: list[str]) -> LinearGroup:
        """Projections that read the same input, fused into one weight when their formats agree."""
        if len(names) == 1:
            linear = self.one(names[0])
            return LinearGroup(linear, [linear], (linear.n,))
        fp8 = [is_fp8_projection(self.config, n) for n in names]
        what = f"{names[0].rsplit('.', 1)[0]}.{'+'.join(n.rsplit('.', 1)[-1] for n in names)}"
        fused = None
        if all(fp8):
            joined = fuse_fp8_for_gemm([self.host_fp8(n) for n in names], self.config.quantization.weight_block_size)
            if joined is not None:
                codes, scales, block = joined
                fused = DeviceLinear("fp8", self.memory.upload(f"{what} (FP8 codes)", codes),
                                     self.memory.upload(f"{what} scale_inv", scales), block)
        elif not any(fp8):
            bits = np.concatenate([float32_to_bf16_bits(self.tensors[n + ".weight"]) for n in names])
            fused = DeviceLinear("bf16", self.memory.upload(f"{what} (BF16)", bits))
        if fused is None:  # mixed formats, or blocks that do not fuse: one weight each
            parts = [self.one(n) for n in names]
            return LinearGroup(None, parts, tuple(p.n for p in parts))
        sizes = tuple(int(self.tensors[n + ".weight"].shape[0]) for n in names)
        offsets = np.cumsum((0,) + sizes)
        parts = [fused.rows(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]
        return LinearGroup(fused, parts, sizes)


def upload_weights(config: Qwen3Config, tensors: dict[str, np.ndarray], memory: DeviceMemory) -> DeviceWeights:
    """Upload checkpoint ``tensors`` (as ``fp8lab.engine.checkpoint`` loads them) in the layout of the module
    docstring; NaN codes and scale shapes are checked here, naming the tensor."""
    return _Uploader(config, tensors, memory).weights()
