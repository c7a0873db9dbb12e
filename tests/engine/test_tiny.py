"""fp8lab.engine.tiny: the config, determinism (byte-identical builds), FP8 tiny == quantize(BF16 tiny),
the cache folder, and that greedy decoding of the random model does not collapse at once.

``helpers.engine.dense_forward64`` is the compact float64 Qwen3 forward pass it decodes with (no cache,
full recompute); ``tests/engine/test_transformers_loads_tiny.py`` checks it against transformers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers.engine import dense_forward64, dense_weights

from fp8lab.engine import checkpoint as ck
from fp8lab.engine import tiny
from fp8lab.engine.layout import expected_tensors, projection_shapes
from fp8lab.engine.tokenizer import Tokenizer


def folder_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"bf16": tiny.make_tiny(root / "bf16"), "fp8": tiny.make_tiny(root / "fp8", fp8=True)}


# ----------------------------------------------------------------------------------------------
# a float64 Qwen3 forward pass, for behavioural checks of the random weights






def greedy(config, weights, ids, steps):
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(np.argmax(dense_forward64(config, weights, ids)[-1])))
    return ids


# ----------------------------------------------------------------------------------------------
# tests


def test_tiny_config():
    c = tiny.tiny_config(fp8=True)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (1024, 256, 768, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (4, 2, 64, True)
    assert c.quantization.weight_block_size == (128, 128)
    assert tiny.tiny_config(fp8=False).quantization is None
    for n, k in projection_shapes(c).values():
        assert n % 128 == 0 and k % 128 == 0  # only full FP8 blocks
    assert c.eos_token_ids == (1021,)


def test_written_files(tiny_dirs):
    for kind, folder in tiny_dirs.items():
        assert sorted(p.name for p in folder.iterdir()) == [
            "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        ]  # fmt: skip
        c = ck.load_checkpoint(folder, progress=False)
        assert c.config == tiny.tiny_config(fp8=(kind == "fp8"))
        assert list(c.tensors) == list(expected_tensors(c.config))
        assert Tokenizer.from_dir(folder).vocab_size == c.config.vocab_size
    assert not list(tiny_dirs["bf16"].parent.glob(".*tmp*"))  # no temporary folders left


def test_make_tiny_is_deterministic(tiny_dirs, tmp_path):
    again = tiny.make_tiny(tmp_path / "again", fp8=True)
    assert folder_bytes(again) == folder_bytes(tiny_dirs["fp8"])
    other_seed = tiny.make_tiny(tmp_path / "seed1", fp8=True, seed=1)
    a, b = folder_bytes(other_seed), folder_bytes(tiny_dirs["fp8"])
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_fp8_tiny_is_quantize_of_bf16_tiny(tiny_dirs, tmp_path):
    quantized = ck.quantize_checkpoint(tiny_dirs["bf16"], tmp_path / "q", progress=False)
    assert folder_bytes(quantized) == folder_bytes(tiny_dirs["fp8"])


def test_random_weights_statistics(tiny_dirs):
    c = ck.load_checkpoint(tiny_dirs["bf16"], progress=False)
    embed = c.tensors["model.embed_tokens.weight"]
    assert abs(embed.std() - tiny.EMBED_STD) < 0.005 and np.all(embed != 0).mean() > 0.99
    norm = c.tensors["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15
    q = c.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std() - tiny.PROJ_STD) < 0.005


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_greedy_decoding_varies(tiny_dirs, kind):
    c = ck.load_checkpoint(tiny_dirs[kind], progress=False)
    tok = Tokenizer.from_dir(tiny_dirs[kind])
    prompt = tok.encode("The lighthouse keeper")
    weights = dense_weights(c)
    out = greedy(c.config, weights, prompt, steps=12)[len(prompt) :]
    assert len(set(out)) >= 8, out
    assert out[0] != out[1] or out[1] != out[2], out  # not stuck on one token from the start
    logits = dense_forward64(c.config, weights, prompt)
    assert np.all(np.isfinite(logits)) and logits[-1].std() > 0.3


def test_fp8_and_bf16_tiny_agree_roughly(tiny_dirs):
    """The FP8 model is the BF16 one with E4M3 rounding noise (~2.5% rms per weight): over four
    layers of random weights the logits move by about 12% (relative, measured 0.09..0.15 across
    prompts and recipes), so greedy tokens of the two agree for a few steps only."""
    ids = Tokenizer.from_dir(tiny_dirs["bf16"]).encode("Rain from first light until three")
    bf16 = dense_forward64(tiny.tiny_config(False), dense_weights(ck.load_checkpoint(tiny_dirs["bf16"], progress=False)), ids)
    fp8 = dense_forward64(tiny.tiny_config(True), dense_weights(ck.load_checkpoint(tiny_dirs["fp8"], progress=False)), ids)
    assert np.linalg.norm(fp8 - bf16) / np.linalg.norm(bf16) < 0.25


def test_default_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8LAB_CACHE", str(tmp_path / "cache"))
    first = tiny.default_model_dir(fp8=True)
    assert first == tmp_path / "cache" / f"tiny-qwen3-fp8-v{tiny.RECIPE_VERSION}"
    stamp = os.stat(first / "model.safetensors").st_mtime_ns
    assert tiny.default_model_dir(fp8=True) == first
    assert os.stat(first / "model.safetensors").st_mtime_ns == stamp  # reused, not rebuilt
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [first.name]
    bf16 = tiny.default_model_dir(fp8=False)
    assert bf16.name == f"tiny-qwen3-bf16-v{tiny.RECIPE_VERSION}"
    assert ck.load_checkpoint(bf16, progress=False).config.quantization is None


def test_default_model_dir_ignores_half_built_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8LAB_CACHE", str(tmp_path))
    half = tmp_path / f".tiny-qwen3-fp8-v{tiny.RECIPE_VERSION}.tmp-crashed"
    half.mkdir()
    (half / "config.json").write_text("{")
    folder = tiny.default_model_dir(fp8=True)
    assert folder != half and ck.load_checkpoint(folder, progress=False).is_fp8


def test_make_tiny_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        tiny.make_tiny(tmp_path / "x")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    assert tiny.make_tiny(tmp_path / "empty") == tmp_path / "empty"


def truncate(path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: truncate(f / "model.safetensors", 1000), "model.safetensors has 1000 bytes"),
        (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda f: (f / tiny.CACHE_MANIFEST).unlink(), "no readable .fp8lab-cache.json: built by an older fp8lab"),
    ],
)
def test_default_model_dir_rebuilds_a_damaged_cache(tmp_path, monkeypatch, damage, reason):
    monkeypatch.setenv("FP8LAB_CACHE", str(tmp_path))
    folder = tiny.default_model_dir(fp8=False)
    good = folder_bytes(folder)
    damage(folder)
    with pytest.warns(UserWarning, match=f"{folder}: damaged model cache \\({reason}"):
        assert tiny.default_model_dir(fp8=False) == folder
    assert folder_bytes(folder) == good and tiny.cache_damage(folder) is None
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # the damaged copy is gone


def test_demo_cache_is_rebuilt_when_damaged(tiny_dirs, tmp_path, monkeypatch):
    from fp8lab.engine import demo

    monkeypatch.setenv("FP8LAB_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "DEMO_DIR", tiny_dirs["bf16"])  # quantizing the tiny model is quicker
    folder = demo.default_model_dir(fp8=True)
    assert (folder / "model.safetensors").read_bytes() == (tiny_dirs["fp8"] / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.warns(UserWarning, match="damaged model cache"):
        assert demo.default_model_dir(fp8=True) == folder
    assert ck.load_checkpoint(folder, progress=False).is_fp8
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_an_undeletable_damaged_cache_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8LAB_CACHE", str(tmp_path))
    folder = tiny.default_model_dir(fp8=False)
    (folder / "config.json").unlink()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tiny.os, "rename", refuse)
    with pytest.warns(UserWarning), pytest.raises(OSError, match=f"{folder}: damaged model cache .* delete this folder"):
        tiny.default_model_dir(fp8=False)
