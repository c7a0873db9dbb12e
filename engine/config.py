"""Qwen3 model configuration, read from and written to a Hugging Face ``config.json``.

Only the fields the engine uses are kept; ``to_dict`` writes a config that transformers'
``Qwen3ForCausalLM`` accepts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class FP8QuantConfig:
    """``quantization_config`` of an FP8 blockwise checkpoint (Qwen3-FP8 / DeepSeek-V3 style)."""

    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    quant_method: str = "fp8"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: dict) -> "FP8QuantConfig":
        method = d.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config: unknown quant_method {method!r}; fp8lab reads 'fp8' (blockwise E4M3)")
        fmt = d.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config: unsupported fmt {fmt!r}; expected 'e4m3'")
        block = d.get("weight_block_size")
        if block is None or len(block) != 2 or min(int(b) for b in block) <= 0:
            raise ValueError(f"quantization_config: weight_block_size must be a pair of positive ints, got {block!r}")
        return cls(
            weight_block_size=(int(block[0]), int(block[1])),
            activation_scheme=d.get("activation_scheme", "dynamic"),
            fmt=fmt,
            modules_to_not_convert=tuple(d.get("modules_to_not_convert") or ()),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["weight_block_size"] = list(self.weight_block_size)
        d["modules_to_not_convert"] = list(self.modules_to_not_convert) or None
        if d["modules_to_not_convert"] is None:
            del d["modules_to_not_convert"]
        return d


@dataclass(frozen=True)
class Qwen3Config:
    """The architecture hyper-parameters of a Qwen3 causal LM."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    quantization: FP8QuantConfig | None = field(default=None)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        """Parse a ``config.json`` dict; missing required fields raise ``ValueError`` naming them."""
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json: missing required fields {missing}")
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"config.json: model_type {model_type!r} is not supported; fp8lab runs 'qwen3'")
        if d.get("rope_scaling"):
            raise ValueError(f"config.json: rope_scaling {d['rope_scaling']!r} is not supported")
        heads = int(d["num_attention_heads"])
        quant = d.get("quantization_config")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=d.get("torch_dtype", "bfloat16"),
            quantization=FP8QuantConfig.from_dict(quant) if quant else None,
        )

    def to_dict(self) -> dict:
        """A ``config.json`` dict in the format of Qwen's own checkpoints."""
        d = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
        }
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        return d

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple (it may be one id or a list)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
