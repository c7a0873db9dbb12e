"""Shared helpers for the engine tests: tiny seeded random Qwen3 models built in memory, runs of
the model over a paged cache, and a byte-level fake tokenizer.

The random weights are scaled so that activations stay O(1) (projections ``N(0, 1/K)``, norms
near 1, embeddings ``N(0, 1)``): logits then spread over a few units, so greedy tokens mean
something when two runs are compared.
"""

from __future__ import annotations

import codecs
import dataclasses
import math

import numpy as np

from fp8lab.engine.config import FP8QuantConfig, Qwen3Config
from fp8lab.engine.kv_manager import KVCacheManager
from fp8lab.engine.layout import expected_tensors, is_fp8_projection, projection_shapes
from fp8lab.engine.model import Qwen3Model, make_batch
from fp8lab.reference import blockwise

BYTE_VOCAB = 256
EOS_ID = 256
VOCAB = 272  # 256 bytes + specials, a multiple of 16


def tiny_config(fp8: bool = True, tie: bool = False, block=(32, 32), **overrides) -> Qwen3Config:
    """A 2-layer Qwen3 with GQA (4 query heads, 2 kv heads). With ``block = (32, 32)`` the
    intermediate size 80 leaves partial edge blocks in the FP8 weights."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=10_000.0, max_position_embeddings=512, tie_word_embeddings=tie,
                  eos_token_id=EOS_ID, torch_dtype="float32")
    fields.update(overrides)
    quant = FP8QuantConfig(weight_block_size=tuple(block)) if fp8 else None
    return Qwen3Config(**fields, quantization=quant)


def float_config(config: Qwen3Config) -> Qwen3Config:
    """The same architecture with every projection stored as floats."""
    return dataclasses.replace(config, quantization=None)


def random_float_tensors(config: Qwen3Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor of ``config`` as float32 (projections unquantized), seeded random."""
    tensors = {}
    for name, spec in expected_tensors(float_config(config)).items():
        if name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.2 * rng.standard_normal(spec.shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight":
            tensors[name] = rng.standard_normal(spec.shape).astype(np.float32)
        else:  # projections and lm_head: N(0, 1/K)
            tensors[name] = (rng.standard_normal(spec.shape) / np.sqrt(spec.shape[1])).astype(np.float32)
    return tensors


def quantize_tensors(config: Qwen3Config, float_tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint-style tensors: each FP8 projection as uint8 codes + float32 ``weight_scale_inv``."""
    tensors = dict(float_tensors)
    for name in projection_shapes(config):
        if is_fp8_projection(config, name):
            q, s = blockwise.quantize(float_tensors[name + ".weight"], config.quantization.weight_block_size)
            tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = q, s
    return tensors


def dequantized_tensors(config: Qwen3Config, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float tensors of a checkpoint: FP8 projections replaced by ``decode(q) * scale_inv`` (float32)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if t.dtype == np.uint8:
            out[name] = blockwise.dequantize(t, tensors[name + "_scale_inv"], config.quantization.weight_block_size)
        else:
            out[name] = t
    return out


def random_model(config: Qwen3Config, seed: int = 0, backend=None) -> tuple[Qwen3Model, dict[str, np.ndarray]]:
    """A model with seeded random weights (quantized when ``config`` is FP8) and its checkpoint tensors."""
    tensors = quantize_tensors(config, random_float_tensors(config, np.random.default_rng(seed)))
    return Qwen3Model(config, tensors, backend), tensors


class Runner:
    """A model with its own paged cache, for feeding sequences chunk by chunk in tests."""

    def __init__(self, model: Qwen3Model, kv_cache_dtype: str = "fp32", num_blocks: int = 64, block_size: int = 4):
        self.model = model
        self.manager = KVCacheManager(num_blocks, block_size)
        self.cache = model.allocate_kv_cache(num_blocks, block_size, kv_cache_dtype)

    def step(self, chunks: list[tuple[object, list[int]]], all_logits: bool = False) -> np.ndarray:
        """One forward over ``(sequence id, new tokens)`` chunks; new ids are added on first use."""
        for seq, _ in chunks:
            if seq not in self.manager.sequences:
                self.manager.add_sequence(seq)
        return self.model.forward(make_batch(self.manager, chunks), self.cache, all_logits=all_logits)


def prefill_logits(model: Qwen3Model, tokens, kv_cache_dtype: str = "fp32", block_size: int = 4) -> np.ndarray:
    """Logits ``[T, vocab]`` of every position from one prefill of ``tokens``."""
    return Runner(model, kv_cache_dtype, block_size=block_size).step([("s", list(tokens))], all_logits=True)


def stepwise_logits(model: Qwen3Model, tokens, chunk_sizes=None, kv_cache_dtype: str = "fp32", block_size: int = 4) -> np.ndarray:
    """Logits ``[T, vocab]`` of every position, feeding ``tokens`` in chunks (default: one token at a time)."""
    tokens = list(tokens)
    chunk_sizes = chunk_sizes or [1] * len(tokens)
    assert sum(chunk_sizes) == len(tokens)
    runner, rows, start = Runner(model, kv_cache_dtype, block_size=block_size), [], 0
    for n in chunk_sizes:
        rows.append(runner.step([("s", tokens[start : start + n])], all_logits=True))
        start += n
    return np.concatenate(rows)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||``; NaN anywhere gives inf (NaN never passes a bound)."""
    if not (np.all(np.isfinite(got)) and np.all(np.isfinite(want))):
        return float("inf")
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))


# ---------------------------------------------------------------------------- a fake tokenizer


class FakeTokenizer:
    """Byte-level: ids 0..255 are bytes, 256 is ``<eos>``, the rest of the vocab are silent specials."""

    eos_token_ids = (EOS_ID,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class FakeStreamDecoder:
    """Emits complete UTF-8 text as bytes arrive (an incomplete tail waits for its next byte)."""

    def __init__(self, tokenizer: FakeTokenizer):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id])) if token_id < BYTE_VOCAB else ""


def install_fake_io(monkeypatch, folder, config=None, tensors=None):
    """Fake ``fp8lab.engine.checkpoint``, ``fp8lab.engine.tokenizer`` and ``fp8lab.engine.demo`` modules for the commands' tests:
    ``load_checkpoint`` serves ``config`` and ``tensors`` (default: the tiny random model, seed 5) from any
    folder holding a ``config.json`` (``folder`` gets one, and is the default model's folder too), and
    raises ``ValueError`` for a folder without one; the tokenizer is ``FakeTokenizer``. Returns ``folder``."""
    import sys
    import types

    # the parser of `fp8lab` imports these modules, which import the real checkpoint module: load them
    # before it is faked (else the test passes only when an earlier test happened to import them)
    import fp8lab.engine.checkpoint_commands  # noqa: F401
    import fp8lab.engine.eval_command  # noqa: F401

    if config is None:
        config = tiny_config()
        _, tensors = random_model(config, seed=5)

    def load_checkpoint(path, progress=True):
        if not (path / "config.json").exists():
            raise ValueError(f"{path}: no config.json")
        return types.SimpleNamespace(path=path, config=config, tensors=tensors, stored_dtypes={},
                                     generation_config={"eos_token_id": EOS_ID},
                                     is_fp8=config.quantization is not None)

    class Tokenizer(FakeTokenizer):
        @classmethod
        def from_dir(cls, path):
            return cls()

    (folder / "config.json").write_text("{}")
    for name, attrs in {
        "fp8lab.engine.checkpoint": {"load_checkpoint": load_checkpoint},
        "fp8lab.engine.tokenizer": {"Tokenizer": Tokenizer, "StreamDecoder": FakeStreamDecoder},
        "fp8lab.engine.demo": {"default_model_dir": lambda fp8=True: folder},
    }.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    return folder


def dense_forward64(config, tensors, ids) -> np.ndarray:
    """Logits ``[T, vocab]`` (float64) of one causal pass over ``ids``: Qwen3 written out densely in float64
    from the checkpoint's float tensors (embedding, RMSNorm, q/k/v, q/k-norm, NeoX RoPE, causal GQA
    softmax attention, SwiGLU, final norm, lm_head: the embeddings when tied)."""
    c = config
    w = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
    t_len, hq, hkv, d = len(ids), c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def rms(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps)

    angles = np.arange(t_len)[:, None] * c.rope_theta ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(x):  # NeoX: dimension i pairs with i + d/2
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    causal = np.triu(np.full((t_len, t_len), -np.inf), k=1)
    h = w["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(t_len, hq, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(t_len, hkv, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(t_len, hkv, d)
        q, k = rope(rms(q, w[p + "self_attn.q_norm.weight"])), rope(rms(k, w[p + "self_attn.k_norm.weight"]))
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)  # query head j reads kv head j // group
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + causal
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(t_len, hq * d)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    lm_head = w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return rms(h, w["model.norm.weight"]) @ lm_head.T


def dense_ppl64(config, tensors, chunks) -> float:
    """``exp`` of the mean NLL of every chunk's tokens 1..n-1, by ``dense_forward64`` (float64 throughout)."""
    nll = []
    for ids in chunks:
        logits = dense_forward64(config, tensors, ids)[:-1]
        m = logits.max(axis=1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
        nll.extend(-logp[np.arange(len(ids) - 1), ids[1:]])
    return math.exp(np.mean(nll))


def one_line_error(capsys, argv, command="generate") -> str:
    """Run ``fp8lab argv``; assert exit 1 and a single stderr line; return that line."""
    from fp8lab import cli

    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fp8lab {command}"), err
    return err


def dense_weights(c) -> dict[str, np.ndarray]:
    """float64 weights; FP8 projections dequantized with their block scales."""
    out = {}
    for name, array in c.tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if c.stored_dtypes[name] == "F8_E4M3":
            array = blockwise.dequantize(array, c.tensors[name + "_scale_inv"], c.block)
        out[name] = array.astype(np.float64)
    return out
