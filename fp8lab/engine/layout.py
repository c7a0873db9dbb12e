"""The tensors a Qwen3 checkpoint holds, by Hugging Face name: the one source of truth for the
loader (what to expect), the writers (what to write) and the model (what to read).

In an FP8 checkpoint (Qwen3-FP8 / DeepSeek-V3 style) the seven projections of every layer are
stored as E4M3 ``<name>.weight`` ``[N, K]`` plus ``<name>.weight_scale_inv``
``[ceil(N/BN), ceil(K/BK)]``; embeddings, norms (incl. ``q_norm``/``k_norm``) and ``lm_head``
stay BF16. A projection listed in ``modules_to_not_convert`` stays BF16 too.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8lab.reference.blockwise import scale_shape

from .config import Qwen3Config

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
NORMS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


@dataclass(frozen=True)
class TensorSpec:
    """Expected shape and kind of one checkpoint tensor.

    ``kind``: ``"float"`` (BF16 in Qwen's checkpoints; F16/F32 accepted), ``"fp8"`` (E4M3 codes)
    or ``"scale"`` (``weight_scale_inv``: F32, BF16 or F16).
    """

    shape: tuple[int, ...]
    kind: str


def projection_shapes(config: Qwen3Config) -> dict[str, tuple[int, int]]:
    """``{"model.layers.{i}.self_attn.q_proj": (N, K), ...}`` for every layer's seven projections."""
    c = config
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = {
        "self_attn.q_proj": (q_out, c.hidden_size),
        "self_attn.k_proj": (kv_out, c.hidden_size),
        "self_attn.v_proj": (kv_out, c.hidden_size),
        "self_attn.o_proj": (c.hidden_size, q_out),
        "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj": (c.hidden_size, c.intermediate_size),
    }
    return {f"model.layers.{i}.{p}": per_layer[p] for i in range(c.num_hidden_layers) for p in PROJECTIONS}


def is_fp8_projection(config: Qwen3Config, name: str) -> bool:
    """True when the projection ``name`` (without ``.weight``) is stored as FP8 in this checkpoint."""
    q = config.quantization
    if q is None:
        return False
    return not any(name == m or name.endswith("." + m) or m in name.split(".") for m in q.modules_to_not_convert)


def expected_tensors(config: Qwen3Config) -> dict[str, TensorSpec]:
    """Every tensor name a checkpoint for ``config`` must hold, with its shape and kind."""
    c = config
    specs = {"model.embed_tokens.weight": TensorSpec((c.vocab_size, c.hidden_size), "float")}
    for i in range(c.num_hidden_layers):
        for norm in NORMS:
            size = c.head_dim if norm.endswith(("q_norm", "k_norm")) else c.hidden_size
            specs[f"model.layers.{i}.{norm}.weight"] = TensorSpec((size,), "float")
    for name, shape in projection_shapes(c).items():
        if is_fp8_projection(c, name):
            specs[f"{name}.weight"] = TensorSpec(shape, "fp8")
            specs[f"{name}.weight_scale_inv"] = TensorSpec(scale_shape(shape, c.quantization.weight_block_size), "scale")
        else:
            specs[f"{name}.weight"] = TensorSpec(shape, "float")
    specs["model.norm.weight"] = TensorSpec((c.hidden_size,), "float")
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = TensorSpec((c.vocab_size, c.hidden_size), "float")
    return specs
