"""Qwen3 model configuration, read from and written to a Hugging Face ``config.json``.

Only the fields the engine uses are kept; ``to_dict`` writes a config that transformers'
``Qwen3ForCausalLM`` accepts.

Reading is strict about JSON types, because Python's casts silently turn mistakes into other
values (``bool("false")`` is ``True``, ``int(4.9)`` is ``4``): booleans must be JSON booleans,
integers JSON integers (``true`` is not one), floats JSON numbers that are finite; sizes must be
positive. Every problem is a ``ValueError`` that starts ``config.json:`` and names the field.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field

ACTIVATION_SCHEMES = ("dynamic",)
"""What fp8lab runs: activations stay BF16/float32 and are never scaled by a stored factor.
``static`` (stored activation scales) would need tensors fp8lab neither expects nor applies."""

_REQUIRED = object()
"""Default of the field readers: the field must be present."""


# ----------------------------------------------------------------------------------------------
# Field readers: each returns the value of one JSON field, or raises naming it


def _field(d: dict, key: str, default, where: str):
    if key in d:
        return d[key]
    if default is _REQUIRED:
        raise ValueError(f"{where}: missing required field {key!r}")
    return default


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is a subclass of int


def read_int(d: dict, key: str, default=_REQUIRED, minimum: int = 1, where: str = "config.json") -> int:
    """A JSON integer ``>= minimum`` (4.9, "4" and true are refused, not rounded or cast)."""
    value = _field(d, key, default, where)
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def read_bool(d: dict, key: str, default: bool, where: str = "config.json") -> bool:
    """A JSON boolean (the string "false" is refused: ``bool("false")`` would be true)."""
    value = _field(d, key, default, where)
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def read_positive_float(d: dict, key: str, default: float, where: str = "config.json") -> float:
    """A finite, positive JSON number (integer or float)."""
    value = _field(d, key, default, where)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {key} must be a finite positive number, got {value!r}")
    return float(value)


def read_str(d: dict, key: str, default: str, where: str = "config.json") -> str:
    value = _field(d, key, default, where)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string, got {value!r}")
    return value


def read_token_ids(d: dict, key: str, vocab_size: int, many: bool, where: str = "config.json"):
    """``None``, one token id, or (``many``) a list of ids; each an integer in ``[0, vocab_size)``."""
    value = d.get(key)
    if value is None:
        return None
    ids = value if many and isinstance(value, list) else [value]
    if not ids or not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
        shape = "a token id or a list of them" if many else "a token id"
        raise ValueError(f"{where}: {key} must be {shape} in [0, vocab_size={vocab_size}), got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# The configuration


@dataclass(frozen=True)
class FP8QuantConfig:
    """``quantization_config`` of an FP8 blockwise checkpoint (Qwen3-FP8 / DeepSeek-V3 style)."""

    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    quant_method: str = "fp8"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d) -> "FP8QuantConfig":
        """Parse ``quantization_config``; anything fp8lab cannot run is a ``ValueError`` naming the field."""
        where = "config.json: quantization_config"
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(d).__name__} {d!r}")
        method = d.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{where}: unknown quant_method {method!r}; fp8lab reads 'fp8' (blockwise E4M3)")
        fmt = d.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{where}: unsupported fmt {fmt!r}; expected 'e4m3'")
        block = d.get("weight_block_size")
        if not isinstance(block, list) or len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
            raise ValueError(f"{where}: weight_block_size must be a pair of positive integers, got {block!r}")
        scheme = d.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"{where}: activation_scheme {scheme!r} is not supported; fp8lab runs 'dynamic' "
                "(no stored activation scales)"
            )
        skip = d.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise ValueError(f"{where}: modules_to_not_convert must be a list of module names, got {skip!r}")
        return cls(weight_block_size=(block[0], block[1]), activation_scheme=scheme, fmt=fmt, modules_to_not_convert=tuple(skip))

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
        # Checked here too (not only in from_dict) because code builds configs directly.
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip
        for name in sizes:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {name} must be an integer >= 1, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        """Parse a ``config.json`` dict; a missing or mistyped field raises ``ValueError`` naming it."""
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json: missing required fields {missing}")
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"config.json: model_type {model_type!r} is not supported; fp8lab runs 'qwen3'")
        if d.get("rope_scaling"):
            raise ValueError(f"config.json: rope_scaling {d['rope_scaling']!r} is not supported")
        vocab, hidden, heads = read_int(d, "vocab_size"), read_int(d, "hidden_size"), read_int(d, "num_attention_heads")
        quant = d.get("quantization_config")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=read_int(d, "intermediate_size"),
            num_hidden_layers=read_int(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=read_int(d, "num_key_value_heads", heads),
            head_dim=_head_dim(d, hidden, heads),
            rms_norm_eps=read_positive_float(d, "rms_norm_eps", 1e-6),
            rope_theta=read_positive_float(d, "rope_theta", 1_000_000.0),
            max_position_embeddings=read_int(d, "max_position_embeddings", 40960),
            tie_word_embeddings=read_bool(d, "tie_word_embeddings", False),
            bos_token_id=read_token_ids(d, "bos_token_id", vocab, many=False),
            eos_token_id=read_token_ids(d, "eos_token_id", vocab, many=True),
            torch_dtype=read_str(d, "torch_dtype", "bfloat16"),
            quantization=None if quant is None else FP8QuantConfig.from_dict(quant),
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


def _head_dim(d: dict, hidden: int, heads: int) -> int:
    """``head_dim`` as given (Qwen3 sets it, and it need not be hidden / heads: Qwen3-0.6B has
    16 heads of 128 on a hidden size of 1024), else hidden / heads, which must then divide."""
    if d.get("head_dim") is not None:
        return read_int(d, "head_dim")
    if hidden % heads:
        raise ValueError(
            f"config.json: no head_dim, and hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
            "to derive it from"
        )
    return hidden // heads
