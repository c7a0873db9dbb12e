"""fp8lab.engine.config: config.json is read strictly. A value of the wrong JSON type is an error naming
config.json and the field, never a silent cast (``bool("false")`` is true, ``int(4.9)`` is 4)."""

from __future__ import annotations

import json

import pytest

from fp8lab.engine.checkpoint import read_config
from fp8lab.engine.config import FP8QuantConfig, Qwen3Config
from fp8lab.engine.tiny import tiny_config


def good_dict() -> dict:
    return tiny_config(fp8=True).to_dict()


def with_field(key: str, value) -> dict:
    d = good_dict()
    if key.startswith("quantization_config."):
        d["quantization_config"][key.split(".", 1)[1]] = value
    else:
        d[key] = value
    return d


def test_round_trip_and_qwen_style_values():
    assert Qwen3Config.from_dict(good_dict()) == tiny_config(fp8=True)
    d = good_dict()
    d.update(rope_theta=1000000, rms_norm_eps=1, eos_token_id=[1021, 1019], head_dim=None)  # ints for floats, a list of ids
    c = Qwen3Config.from_dict(d)
    assert (c.rope_theta, c.rms_norm_eps, c.eos_token_ids, c.head_dim) == (1e6, 1.0, (1021, 1019), 64)
    del d["quantization_config"]
    assert Qwen3Config.from_dict(d).quantization is None


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
        ("tie_word_embeddings", 0, "tie_word_embeddings must be true or false"),
        ("num_hidden_layers", 4.9, "num_hidden_layers must be an integer"),
        ("num_hidden_layers", 4.0, "num_hidden_layers must be an integer"),
        ("num_hidden_layers", True, "num_hidden_layers must be an integer"),
        ("num_hidden_layers", "4", "num_hidden_layers must be an integer"),
        ("num_hidden_layers", 0, "num_hidden_layers must be an integer >= 1"),
        ("hidden_size", -256, "hidden_size must be an integer >= 1"),
        ("vocab_size", 0, "vocab_size must be an integer >= 1"),
        ("intermediate_size", None, "intermediate_size must be an integer"),
        ("num_key_value_heads", 0, "num_key_value_heads must be an integer >= 1"),
        ("num_key_value_heads", 3, "must be a multiple of num_key_value_heads (3)"),
        ("head_dim", 0, "head_dim must be an integer >= 1"),
        ("max_position_embeddings", 4096.5, "max_position_embeddings must be an integer"),
        ("rms_norm_eps", "1e-6", "rms_norm_eps must be a finite positive number"),
        ("rms_norm_eps", 0, "rms_norm_eps must be a finite positive number"),
        ("rope_theta", float("inf"), "rope_theta must be a finite positive number"),
        ("rope_theta", float("nan"), "rope_theta must be a finite positive number"),
        ("rope_theta", False, "rope_theta must be a finite positive number"),
        ("eos_token_id", "x", "eos_token_id must be a token id or a list of them"),
        ("eos_token_id", [1021, "x"], "eos_token_id must be a token id"),
        ("eos_token_id", 1024, "in [0, vocab_size=1024)"),
        ("eos_token_id", [], "eos_token_id must be a token id"),
        ("bos_token_id", [1019], "bos_token_id must be a token id"),
        ("torch_dtype", 16, "torch_dtype must be a string"),
        ("quantization_config", [128, 128], "quantization_config must be a JSON object, got list"),
        ("quantization_config", "fp8", "quantization_config must be a JSON object, got str"),
        ("quantization_config", {}, "unknown quant_method None"),
        ("quantization_config.weight_block_size", [128.7, 128], "weight_block_size must be a pair of positive integers"),
        ("quantization_config.weight_block_size", [128, True], "weight_block_size must be a pair of positive integers"),
        ("quantization_config.weight_block_size", [0, 128], "weight_block_size must be a pair of positive integers"),
        ("quantization_config.weight_block_size", "128", "weight_block_size must be a pair of positive integers"),
        ("quantization_config.activation_scheme", "static", "activation_scheme 'static' is not supported"),
        ("quantization_config.modules_to_not_convert", "lm_head", "modules_to_not_convert must be a list"),
    ],
)
def test_bad_field_is_an_error_naming_the_file_and_the_field(tmp_path, key, value, fragment):
    (tmp_path / "config.json").write_text(json.dumps(with_field(key, value)))
    with pytest.raises(ValueError) as e:
        read_config(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: "), message
    assert fragment in message, message
    assert len(message.splitlines()) == 1


def test_head_dim_must_divide_when_derived():
    d = good_dict()
    del d["head_dim"]
    assert Qwen3Config.from_dict(d).head_dim == 64
    d["num_attention_heads"], d["num_key_value_heads"] = 6, 3
    with pytest.raises(ValueError, match=r"no head_dim, and hidden_size \(256\) is not a multiple of num_attention_heads \(6\)"):
        Qwen3Config.from_dict(d)


def test_direct_construction_checks_sizes():
    fields = tiny_config(fp8=False).__dict__ | {"num_key_value_heads": 0}
    with pytest.raises(ValueError, match="num_key_value_heads must be an integer >= 1"):
        Qwen3Config(**fields)
    assert FP8QuantConfig.from_dict({"quant_method": "fp8", "weight_block_size": [64, 128]}).weight_block_size == (64, 128)
