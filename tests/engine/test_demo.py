"""The shipped demo model (``fp8lab.engine.demo``): what it is, that it is trained, what FP8 costs it, and that
the main job and ``fp8lab eval`` run it.

The slice: the first 1,024 tokens of the held-out text as 4 chunks of 256 (``SLICE``). Bounds:

- **float64 check**: ``fp8lab eval``'s perplexity of the BF16 checkpoint (reference backend, float32
  KV cache) against ``helpers.engine.dense_ppl64``, a dense float64 forward written independently: within
  ``1e-5`` relative (float32 ulps, see ``tests/engine/test_eval.py``; measured 1.3e-7).
- **trained**: the BF16 perplexity on the slice is below 8 (measured 4.45; a model that knows nothing
  of the text scores the vocabulary size, 4096, and the random tiny model hundreds).
- **FP8 cost on the slice** (measured 2026-12-01): FP8 weights + FP8 KV cache vs BF16 weights + BF16
  KV +0.68% (bound 2%); FP8 KV vs BF16 KV +0.26% (bound 1%). Over the whole held-out text the same
  deviations are +0.32% and +0.11% (``bench/RESULTS.md``); a 1,024-token slice is noisier, hence the
  margins of about 3x.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers.engine import dense_ppl64

from fp8lab import cli
from fp8lab.engine import demo
from fp8lab.engine import evaluate as ev
from fp8lab.engine.checkpoint import load_checkpoint, open_checkpoint
from fp8lab.engine.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer

SLICE = (1024, 256)
FLOAT64_BOUND = 1e-5
TRAINED_PPL_BOUND = 8.0
FP8_WEIGHTS_AND_KV_BOUND = 0.02
FP8_KV_BOUND = 0.01


@pytest.fixture(scope="module")
def bf16():
    return load_checkpoint(demo.DEMO_DIR, progress=False)


@pytest.fixture(scope="module")
def slice_chunks(bf16):
    tokens, chunk = SLICE
    text = ev.read_eval_text(demo.HELDOUT_TEXT, Tokenizer.from_dir(demo.DEMO_DIR), max_tokens=tokens)
    chunks = ev.split_chunks(text.ids, chunk)
    assert [len(c) for c in chunks] == [chunk] * (tokens // chunk)
    return chunks


def slice_ppl(checkpoints, config: ev.EvalConfig, chunks) -> float:
    return ev.perplexity(ev.build_runners(checkpoints, [config], max_len=SLICE[1])[config], chunks).ppl


def test_the_demo_checkpoint_is_what_engine_demo_describes(bf16):
    assert bf16.config == demo.demo_config()
    c = bf16.config
    assert c.tie_word_embeddings and c.num_key_value_heads > 1 and c.hidden_size % 128 == 0
    params = sum(int(np.prod(t.shape)) for t in bf16.tensors.values())
    assert 10e6 <= params <= 20e6, params
    # K/V projections of 3 x 64 = 192 rows: their FP8 blocks end in a partial block of 64 rows
    assert (c.num_key_value_heads * c.head_dim) % 128 == 64
    weights = sum(p.stat().st_size for p in demo.DEMO_DIR.iterdir())
    assert weights <= 25 * 2**20, weights
    assert all(str(t.dtype) in ("bfloat16", "float32") for t in bf16.tensors.values())


def test_the_demo_tokenizer_has_qwens_added_tokens():
    tok = Tokenizer.from_dir(demo.DEMO_DIR)
    for token in (ENDOFTEXT, IM_START, IM_END):
        assert tok.encode(token) == [demo.TOKEN_IDS[token]]
    text = "def read(path):\n    return open(path).read()  # the os module\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text) / 2.5  # a BPE learned on Python: about 3.4 characters per token


def test_the_fp8_default_is_what_fp8lab_quantize_writes(tmp_path, monkeypatch):
    from fp8lab.engine.checkpoint import quantize_checkpoint

    monkeypatch.setenv("FP8LAB_CACHE", str(tmp_path / "cache"))
    folder = demo.default_model_dir(fp8=True)
    assert folder == tmp_path / "cache" / f"demo-qwen3-fp8-v{demo.RECIPE_VERSION}"
    assert demo.default_model_dir(fp8=True) == folder  # built once
    want = quantize_checkpoint(demo.DEMO_DIR, tmp_path / "quantized", progress=False)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (folder / name).read_bytes() == (want / name).read_bytes(), name
    assert open_checkpoint(folder).config.quantization is not None


def test_perplexity_on_a_held_out_slice_matches_a_float64_forward(bf16, slice_chunks):
    got = slice_ppl({"bf16": bf16}, ev.EvalConfig("bf16", "fp32", "float32"), slice_chunks)
    want = dense_ppl64(bf16.config, bf16.tensors, slice_chunks)
    assert np.isfinite(got) and abs(got / want - 1) <= FLOAT64_BOUND, (got, want)
    assert want < TRAINED_PPL_BOUND, want


def test_fp8_costs_little_perplexity_on_the_slice(bf16, slice_chunks):
    checkpoints = {"bf16": bf16, "fp8": ev.fp8_checkpoint(bf16)}
    base = slice_ppl(checkpoints, ev.EvalConfig("bf16", "bf16", "float32"), slice_chunks)
    fp8 = slice_ppl(checkpoints, ev.EvalConfig("fp8", "fp8", "float32"), slice_chunks)
    fp8_kv = slice_ppl(checkpoints, ev.EvalConfig("bf16", "fp8", "float32"), slice_chunks)
    assert 0 < fp8 / base - 1 <= FP8_WEIGHTS_AND_KV_BOUND, (fp8, base)
    assert abs(fp8_kv / base - 1) <= FP8_KV_BOUND, (fp8_kv, base)


def test_fp8lab_eval_runs_the_embedded_model(capsys):
    assert cli.main(["eval", "--max-tokens", "1024", "--chunk", "256", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "demo-qwen3-fp8" in out and "FP8 weights / FP8 KV" in out
    ppl = float(re.search(r"^ppl\s+([0-9.]+)", out, re.MULTILINE).group(1))
    assert 1 < ppl < TRAINED_PPL_BOUND


def known_word_share(text: str) -> tuple[float, int]:
    """Share of ``text``'s words (runs of letters) that occur in the held-out text, and the word count."""
    known = set(re.findall(r"[A-Za-z]+", demo.HELDOUT_TEXT.read_text(encoding="utf-8")))
    words = re.findall(r"[A-Za-z]+", text)
    return sum(w in known for w in words) / max(1, len(words)), len(words)


def generated_text(capsys, *model: str) -> str:
    assert cli.main(["generate", "--prompt", "The os module provides", "--max-new-tokens", "48", *model]) == 0
    return capsys.readouterr().out


def test_the_main_job_writes_recognisable_text(capsys):
    """``fp8lab generate`` on the embedded model (FP8, greedy): at least 10 words, at least 70% of them words
    of the held-out documents (which the model never saw; measured 84% of 25 words, and 89% and 94% from
    two other prompts). The random tiny model glues BPE fragments together: on the same prompt 37% (17%
    and 20% on the others), which the same check rejects."""
    from fp8lab.engine.tiny import default_model_dir

    share, count = known_word_share(out := generated_text(capsys))
    assert count >= 10 and share >= 0.7, (share, count, out)
    share, count = known_word_share(out := generated_text(capsys, "--model", str(default_model_dir(fp8=True))))
    assert share < 0.5, (share, count, out)
