"""``fp8lab.engine.evaluate`` and ``fp8lab eval``: perplexity against an independent float64 forward, the chunk
protocol, the comparison table, NaN handling, ``ReferenceBackend(gemm_input="bf16")``, the command line,
and (in the CUDA simulator) the GPU model fed in float32 pieces.

Bounds (``ppl_rel`` = ``|ppl / ppl_64 - 1|`` against ``helpers.engine.dense_forward64``, a dense float64 NumPy Qwen3
written from the checkpoint's tensors, not using ``fp8lab.engine.backend`` or ``fp8lab.reference.attention``):

- **float32 KV cache** (``fp32``): the reference backend computes in float32 (GEMMs, norms, RoPE tables)
  with float64 attention, so each logit is off by a few float32 ulps of the values it is summed from
  (2^-24 relative, times sqrt(K) ~ 16 for K = 256 and 4 layers of growth): about 1e-6 of the logits'
  scale. The mean NLL moves by at most that much and ``ppl_rel`` ~ ``|dNLL|``: measured ~1e-7 on the
  tiny model (three seeds: 4e-8 .. 2e-7); bound ``1e-5``.
- **BF16 KV cache**: K and V rounded to BF16 (relative 2^-9 per element) move the attention outputs by
  ~1e-3 of their scale, the logits by ~1e-3 (``tests/engine/test_cuda_model.py`` measured 1% on the tiny model
  for BF16 GEMM inputs, which round far more values); the mean NLL by a fraction of that since logits
  move in both directions: measured 4e-5 .. 5e-4 (three seeds); bound ``1e-2``.
- **pieces** (a chunk fed as several prefills of one sequence, float32 KV): the same math, a different
  BLAS row blocking: float32 ulps (measured 7e-8 .. 2e-7); bound ``1e-5`` on ``ppl_rel`` against the
  whole-chunk prefill.
- **cudasim** (the GPU model with its GEMMs replaced by bit-exact twins, float32 inputs in pieces of 4):
  ``tests/engine/test_cuda_model.py`` bounds the logits by ``1e-4`` relative (BF16 KV); bound ``1e-4`` on
  ``|dNLL|`` (measured 4e-8).

Runtimes on a shared 2-core CPU: well under a second each (7 s in all) but the simulator test, 10 s.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from helpers.engine import dense_ppl64, float_config, random_float_tensors, tiny_config

from fp8lab import cli
from fp8lab.engine import eval_command
from fp8lab.engine import evaluate as ev
from fp8lab.engine.backend import ReferenceBackend
from fp8lab.engine.checkpoint import load_checkpoint
from fp8lab.engine.loading import load_model
from fp8lab.engine.model import Qwen3Model
from fp8lab.engine.tiny import make_tiny
from fp8lab.reference import blockwise

FP32_KV_PPL_BOUND = 1e-5
BF16_KV_PPL_BOUND = 1e-2
PIECES_PPL_BOUND = 1e-5
CUDASIM_NLL_BOUND = 1e-4

TEXT = (
    "The lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock and wrote the "
    "weather in his log: wind from the west, a grey sea, two ships far out. In the morning he walked along the "
    "shore and counted the gulls, then mended a net that the storm had torn. Nobody visited in winter, but "
    "in spring a boat brought flour, oil, letters and a box of books, and he read them slowly, one each week."
)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """The tiny model (BF16 and its FP8 twin), seed 1, with its tokenizer; and a text file."""
    root = tmp_path_factory.mktemp("eval")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return {"bf16": make_tiny(root / "bf16", seed=1), "fp8": make_tiny(root / "fp8", fp8=True, seed=1),
            "text": root / "text.txt"}


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_dirs):
    return load_checkpoint(tiny_dirs["bf16"], progress=False)


def token_ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n)


def runner_for(checkpoints, config: ev.EvalConfig, max_len: int, **kw) -> ev.ModelRunner:
    return ev.build_runners(checkpoints, [config], max_len=max_len, **kw)[config]


# ---------------------------------------------------------------------------- an independent float64 Qwen3


@pytest.mark.parametrize("kv, bound", [("fp32", FP32_KV_PPL_BOUND), ("bf16", BF16_KV_PPL_BOUND)])
def test_perplexity_matches_an_independent_float64_forward(bf16_checkpoint, kv, bound):
    """The tiny model (BF16 weights, tied lm_head, GQA 2:1), 3 chunks of 24 tokens and a partial one of 9."""
    ck = bf16_checkpoint
    chunks = ev.split_chunks(token_ids(81, ck.config.vocab_size), 24)
    assert [len(c) for c in chunks] == [24, 24, 24, 9]
    config = ev.EvalConfig("bf16", kv, "float32", "reference")
    got = ev.perplexity(runner_for({"bf16": ck}, config, 24), chunks)
    want = dense_ppl64(ck.config, ck.tensors, chunks)
    assert got.predicted_tokens == 3 * 23 + 8
    assert abs(got.ppl / want - 1) <= bound, (got.ppl, want)
    if kv == "bf16":
        assert got.ppl != want  # the BF16 cache did round
    assert got.ppl == pytest.approx(math.exp(got.mean_nll), rel=1e-15)


# ---------------------------------------------------------------------------- the chunk protocol


def test_split_chunks_keeps_partial_chunks_of_two_tokens():
    assert [len(c) for c in ev.split_chunks(np.arange(5), 2)] == [2, 2]  # a 1-token tail predicts nothing
    assert [len(c) for c in ev.split_chunks(np.arange(8), 3)] == [3, 3, 2]
    assert [c.tolist() for c in ev.split_chunks(np.arange(4), 2)] == [[0, 1], [2, 3]]
    assert ev.split_chunks(np.arange(1), 4) == []
    with pytest.raises(ValueError, match="at least 2"):
        ev.split_chunks(np.arange(8), 1)


def test_two_chunks_are_the_nll_weighted_combination_of_each_alone(bf16_checkpoint):
    ck = bf16_checkpoint
    ids = token_ids(32, ck.config.vocab_size, seed=2)
    config = ev.EvalConfig("bf16", "bf16", "float32", "reference")
    runner = runner_for({"bf16": ck}, config, 16)
    both = ev.perplexity(runner, ev.split_chunks(ids, 16))
    first, second = (ev.perplexity(runner, [part]) for part in (ids[:16], ids[16:]))
    assert both.chunk_nll == [first.chunk_nll[0], second.chunk_nll[0]]  # every chunk starts from an empty cache
    combined = math.exp((first.mean_nll * 15 + second.mean_nll * 15) / 30)
    assert both.ppl == pytest.approx(combined, rel=1e-12)
    assert both.nll.per_position == pytest.approx((first.nll.per_position + second.nll.per_position) / 2, rel=1e-12)


def test_a_chunk_fed_in_pieces_continues_one_sequence(bf16_checkpoint):
    """Pieces of 5 tokens (as the GPU model with float32 inputs gets 16): the same logits up to float32 ulps."""
    ck = bf16_checkpoint
    chunks = ev.split_chunks(token_ids(32, ck.config.vocab_size, seed=3), 16)
    config = ev.EvalConfig("bf16", "fp32", "float32", "reference")
    whole = ev.perplexity(runner_for({"bf16": ck}, config, 16), chunks)
    model = Qwen3Model.from_checkpoint(ck)
    pieces = ev.perplexity(ev.ModelRunner(config, model, num_blocks=4, max_tokens_per_forward=5), chunks)
    assert abs(pieces.ppl / whole.ppl - 1) <= PIECES_PPL_BOUND
    assert [len(p) for p in ev.pieces(np.arange(16), 5)] == [5, 5, 5, 1]


def test_greedy_prompts_and_agreement():
    offsets, prompts = ev.greedy_prompts(np.arange(100), 4, 10)
    assert offsets == [0, 30, 60, 90] and prompts[-1].tolist() == list(range(90, 100))
    assert ev.greedy_prompts(np.arange(10), 1, 10)[0] == [0]
    with pytest.raises(ValueError, match="only 5 tokens"):
        ev.greedy_prompts(np.arange(5), 2, 6)
    ref = np.array([[1, 2, 3], [4, 5, 6]])
    assert ev.agreement(ref, ref) == (1.0, 3.0, [3, 3])
    assert ev.agreement(ref, np.array([[1, 2, 9], [0, 5, 6]])) == (0.0, 1.0, [2, 0])


def test_kl_and_log_softmax():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 50)).astype(np.float32), rng.standard_normal((3, 50)).astype(np.float32)
    la, lb = ev.log_softmax64(a), ev.log_softmax64(b)
    pa = np.exp(a.astype(np.float64)) / np.exp(a.astype(np.float64)).sum(axis=1, keepdims=True)
    assert la == pytest.approx(np.log(pa), abs=1e-12)
    kl = ev.kl_divergence(la, lb)
    assert np.all(kl > 0) and kl == pytest.approx(np.sum(pa * (la - lb), axis=1), rel=1e-12)
    assert np.all(ev.kl_divergence(la, la) == 0)
    a[1, 7], a[2, 3] = np.nan, np.inf
    la = ev.log_softmax64(a)
    assert np.isnan(la[1:]).all() and np.isfinite(la[0]).all()
    assert np.isnan(ev.kl_divergence(la, lb)[1:]).all() and np.isnan(ev.kl_divergence(lb, la)[1:]).all()


# ---------------------------------------------------------------------------- the comparison


@pytest.fixture(scope="module")
def comparison(bf16_checkpoint):
    ck = bf16_checkpoint
    ids = token_ids(40, ck.config.vocab_size, seed=4)
    rows = ev.default_rows()
    offsets, prompts = ev.greedy_prompts(ids, 3, 8)
    runners = ev.build_runners({"bf16": ck, "fp8": ev.fp8_checkpoint(ck)}, [r.config for r in rows], max_len=16,
                               num_seqs=3, max_cached_tokens=8 + 6 - 1)
    return ev.evaluate(rows, runners, ev.split_chunks(ids, 16), prompts, offsets, 6)


def test_the_baseline_row_agrees_with_itself_exactly(comparison):
    base = comparison.rows[0]
    assert comparison.deviation(0, 0) == 0 and base.kl[0].mean == 0 and np.all(base.kl[0].sums == 0)
    assert base.greedy[0] == (1.0, 6.0, [6, 6, 6])
    assert comparison.ok and math.isfinite(base.ppl)
    assert comparison.chunk_lengths == [16, 16, 8] and base.predicted_tokens == 15 + 15 + 7


def test_fp8_rows_diverge_from_their_references(comparison):
    rows = comparison.rows
    assert [(r.row.config.weights, r.row.config.kv_cache_dtype, r.row.config.gemm_input, r.row.vs) for r in rows] == [
        ("bf16", "bf16", "float32", 0), ("fp8", "bf16", "float32", 0), ("bf16", "fp8", "float32", 0),
        ("fp8", "bf16", "bf16", 1), ("fp8", "fp8", "float32", 0), ("fp8", "fp8", "bf16", 4)]
    for r in rows[1:]:
        assert r.kl[r.row.vs].mean > 0 and r.kl[0].mean > 0, r.row.what
        assert comparison.deviation(rows.index(r), 0) != 0
    # BF16 inputs change little against the same FP8 weights on float32 inputs, much less than FP8 weights do
    assert rows[3].kl[1].mean < rows[1].kl[0].mean
    table = ev.format_table(comparison)
    assert table.splitlines()[0].split()[:6] == ["#", "weights", "kv", "gemm", "in", "backend"]
    assert "+0.000%" in table.splitlines()[1]


def test_json_has_every_number(comparison):
    out = ev.evaluation_json(comparison, {"model": "m", "chunk": 16})
    json.dumps(out, allow_nan=False)
    assert out["model"] == "m" and out["num_chunks"] == 3 and out["greedy"]["offsets"] == [0, 16, 32]
    row = out["rows"][3]
    assert row["vs"] == 1 and len(row["chunk_nll"]) == 3 and len(row["position_mean_kl_vs"]) == 15
    assert row["ppl"] == pytest.approx(math.exp(sum(row["chunk_nll"]) / row["predicted_tokens"]))
    assert out["rows"][0]["kl_baseline"] == 0 and out["rows"][0]["greedy_identical_vs"] == 1.0
    assert np.shape(row["greedy_tokens"]) == (3, 6)


def test_a_nan_logit_makes_the_perplexity_nan(bf16_checkpoint, monkeypatch):
    ck = bf16_checkpoint
    config = ev.EvalConfig("bf16", "bf16", "float32", "reference")
    runner = runner_for({"bf16": ck}, config, 8)
    forward = runner.model.forward

    def poisoned(batch, cache, all_logits=False):
        logits = forward(batch, cache, all_logits)
        logits[-1, 5] = np.nan  # the last position: its logits predict nothing within the chunk...
        logits[0, 5] = np.nan  # ...but the first one's do
        return logits

    monkeypatch.setattr(runner.model, "forward", poisoned)
    result = ev.evaluate([ev.CompareRow("x", config)], {config: runner}, ev.split_chunks(token_ids(16, 1024), 8))
    assert math.isnan(result.rows[0].ppl) and not result.ok
    assert result.rows[0].nonfinite == ["NaN or infinite logits in chunk 0", "NaN or infinite logits in chunk 1"]
    assert ev.evaluation_json(result, {})["rows"][0]["ppl"] is None


# ---------------------------------------------------------------------------- BF16 GEMM inputs


def test_reference_backend_bf16_gemm_inputs():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    w = (rng.standard_normal((96, 256)) / 16).astype(np.float32)
    q, s = blockwise.quantize(w, (128, 128))
    bf16, f32 = ReferenceBackend(gemm_input="bf16"), ReferenceBackend()
    fp8 = bf16.prepare_linear(q, s, (128, 128))
    x_bf16 = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # an independent round to nearest even
    assert not np.array_equal(x_bf16, x)
    np.testing.assert_array_equal(bf16.linear(x, fp8), np.matmul(x_bf16, fp8.weight.T))
    np.testing.assert_array_equal(f32.linear(x, fp8), np.matmul(x, fp8.weight.T))
    dense = bf16.prepare_linear(w)  # float weights (BF16 checkpoints) keep float32 inputs
    np.testing.assert_array_equal(bf16.linear(x, dense), np.matmul(x, w.T))
    np.testing.assert_array_equal(bf16.lm_head(x, dense), np.matmul(x_bf16, w.T))  # except the lm_head's
    np.testing.assert_array_equal(f32.lm_head(x, dense), np.matmul(x, w.T))
    x[1, 3] = np.nan
    x[2].view(np.uint32)[4] = 0x7FFFFFFF  # a NaN that a plain bit-trick rounding would carry into -0
    for out in (bf16.linear(x, fp8), bf16.lm_head(x, dense)):
        assert np.isnan(out[1:3]).all() and np.isfinite(out[[0, 3, 4]]).all()
    with pytest.raises(ValueError, match="gemm_input"):
        ReferenceBackend(gemm_input="f16")


def test_load_model_passes_gemm_input():
    config = float_config(tiny_config())
    checkpoint = type("Checkpoint", (), {"config": config, "tensors": random_float_tensors(config, np.random.default_rng(0))})
    assert load_model(checkpoint, "reference", gemm_input="bf16").backend.gemm_input == "bf16"
    assert load_model(checkpoint, "reference").backend.gemm_input == "float32"
    with pytest.raises(ValueError, match="gemm_input"):
        load_model(checkpoint, "reference", gemm_input="fp8")


def test_eval_config_validates_and_labels():
    assert ev.EvalConfig("fp8", "bf16", "bf16", "cuda").label == "FP8 weights / BF16 KV / bf16 inputs / cuda"
    with pytest.raises(ValueError, match="EvalConfig.weights"):
        ev.EvalConfig("int4")
    rows = ev.default_rows("reference", "cudasim")
    assert len(rows) == 12 and rows[9].vs == 3 and rows[9].config.backend == "cudasim"
    with pytest.raises(ValueError, match="vs=7"):
        ev.check_rows([ev.CompareRow("x", ev.EvalConfig(), 7)])


def test_fp8_checkpoint_is_what_quantize_writes(bf16_checkpoint, tiny_dirs):
    fp8 = ev.fp8_checkpoint(bf16_checkpoint)
    written = load_checkpoint(tiny_dirs["fp8"], progress=False)  # make_tiny(fp8=True) = quantize of the BF16 one
    assert fp8.config == written.config and fp8.tensors.keys() == written.tensors.keys()
    for name, t in written.tensors.items():
        np.testing.assert_array_equal(fp8.tensors[name], t, err_msg=name)
    with pytest.raises(ValueError, match="BF16 checkpoint"):
        ev.fp8_checkpoint(written)


# ---------------------------------------------------------------------------- the command line


def run_cli(argv, capsys):
    code = cli.main(["eval", "--quiet", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_perplexity(tiny_dirs, tmp_path, capsys):
    argv = ["--model", tiny_dirs["fp8"], "--text", tiny_dirs["text"], "--chunk", 16, "--max-tokens", 64,
            "--backend", "reference", "--json", tmp_path / "out.json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert float(lines["ppl"]) > 1 and "FP8 weights / FP8 KV / float32 inputs / reference" in lines["config"]
    assert "4 of up to 16 tokens" in lines["chunks"] and "60 predicted tokens" in lines["chunks"]
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["mode"] == "perplexity" and data["eval_tokens"] == 64 and data["text_tokens"] > 64
    assert data["rows"][0]["ppl"] == pytest.approx(float(lines["ppl"]), rel=1e-6)
    assert len(data["text_sha256"]) == 64


def test_cli_compare_prints_the_table(tiny_dirs, tmp_path, capsys):
    argv = ["--compare", "--model", tiny_dirs["bf16"], "--text", tiny_dirs["text"], "--chunk", 16, "--max-tokens", 40,
            "--prompts", 2, "--prompt-tokens", 8, "--new-tokens", 4, "--backend", "reference",
            "--json", tmp_path / "c.json"]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("#  weights") and len([line for line in lines[1:7] if line[0].isdigit()]) == 6
    assert "greedy: share of 2 prompts of 8 tokens whose 4 greedy tokens" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["mode"] == "compare" and len(data["rows"]) == 6 and data["greedy"]["new_tokens"] == 4


@pytest.mark.parametrize("extra, message", [
    (["--chunk", "1"], "--chunk: expected at least 2"),
    (["--max-tokens", "1"], "--max-tokens: expected at least 2"),
    (["--prompts", "0"], "--prompts: expected at least 1"),
    (["--text", "/nonexistent/t.txt"], "--text /nonexistent/t.txt: no such file"),
    (["--model", "/nonexistent"], "--model /nonexistent: not a directory"),
    (["--compare", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype: not with --compare"),
    (["--compare", "--model", "FP8"], "--compare needs the BF16 checkpoint"),
    (["--compare", "--prompt-tokens", "4090", "--max-tokens", "50"], "--prompt-tokens + --new-tokens = 4122"),
])
def test_cli_errors_are_one_line(tiny_dirs, capsys, extra, message):
    extra = [str(tiny_dirs["fp8"]) if e == "FP8" else e for e in extra]
    model = [] if "--model" in extra else ["--model", tiny_dirs["fp8" if "--compare" not in extra else "bf16"]]
    text = [] if "--text" in extra else ["--text", tiny_dirs["text"]]
    code, out, err = run_cli([*model, *text, *extra], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("fp8lab eval: error: ") and message in err, err


def test_cli_text_too_short_or_chunks_too_long(tiny_dirs, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("a", encoding="utf-8")
    code, _, err = run_cli(["--model", tiny_dirs["fp8"], "--text", tmp_path / "short.txt"], capsys)
    assert code == 1 and "1 token(s) after tokenizing; perplexity needs at least 2" in err
    (tmp_path / "long.txt").write_text(TEXT * 50, encoding="utf-8")  # more than 4096 tokens
    code, _, err = run_cli(["--model", tiny_dirs["fp8"], "--text", tmp_path / "long.txt", "--chunk", 5000], capsys)
    assert code == 1 and "--chunk: chunks of " in err and "exceed the model's max_position_embeddings 4096" in err


def test_cli_defaults(tiny_dirs, monkeypatch, tmp_path, capsys):
    """Without --text: ``default_eval_text`` (an error naming --text when the file is not shipped); without
    --model: ``_default_model``, FP8 for a perplexity run, BF16 for --compare."""
    monkeypatch.setattr(ev, "DEFAULT_TEXT", tmp_path / "missing.txt")
    code, _, err = run_cli(["--model", tiny_dirs["fp8"]], capsys)
    assert code == 1 and "pass --text FILE" in err and err.count("\n") == 1
    asked = []
    monkeypatch.setattr(eval_command, "_default_model", lambda fp8: asked.append(fp8) or tiny_dirs["fp8" if fp8 else "bf16"])
    monkeypatch.setattr(ev, "DEFAULT_TEXT", tiny_dirs["text"])
    assert run_cli(["--chunk", 16, "--max-tokens", 32, "--backend", "reference"], capsys)[0] == 0
    assert run_cli(["--compare", "--chunk", 16, "--max-tokens", 32, "--prompts", 1, "--prompt-tokens", 4,
                    "--new-tokens", 2, "--backend", "reference"], capsys)[0] == 0
    assert asked == [True, False]


def test_cli_nan_logits_exit_non_zero(tiny_dirs, monkeypatch, capsys):
    forward = Qwen3Model.forward

    def poisoned(self, batch, cache, all_logits=False):
        logits = forward(self, batch, cache, all_logits)
        logits[0, 0] = np.nan
        return logits

    monkeypatch.setattr(Qwen3Model, "forward", poisoned)
    code, out, err = run_cli(["--model", tiny_dirs["fp8"], "--text", tiny_dirs["text"], "--chunk", 16,
                              "--max-tokens", 32, "--backend", "reference"], capsys)
    assert code == 1
    ppl_line = next(line for line in out.splitlines() if line.startswith("ppl"))
    assert ppl_line.split() == ["ppl", "nan"]
    assert err.count("\n") == 1 and "non-finite results" in err and "chunk 0" in err


# ---------------------------------------------------------------------------- the GPU model in the CUDA simulator


@pytest.mark.cudasim
def test_cudasim_perplexity_in_float32_pieces_matches_the_reference(gemm_twins):
    """The micro model of ``helpers.cuda_twins`` (with its GEMM twins): FP8 weights, BF16 KV, float32 GEMM inputs
    fed in pieces of 4 tokens (``f32_rows=4``, so ``f32_max_rows=4``): chunks of 8 and 4 tokens = 3 forwards, the
    second chunk over the first one's cache storage."""
    from helpers.cuda_twins import micro_config, micro_tensors

    from fp8lab.engine.checkpoint import Checkpoint
    config = micro_config()
    checkpoint = Checkpoint(None, config, micro_tensors(config), {})
    chunks = ev.split_chunks(token_ids(12, config.vocab_size, seed=6), 8)
    results = {}
    for backend in ("reference", "cudasim"):
        cfg = ev.EvalConfig("fp8", "bf16", "float32", backend)
        runner = runner_for({"fp8": checkpoint}, cfg, 8, f32_rows=4)
        results[backend] = ev.perplexity(runner, chunks)
        if backend == "cudasim":
            assert runner.max_tokens_per_forward == 4 and runner.model.f32_max_rows == 4
            assert runner.model.stats.prefill_forwards == 3
    assert abs(results["cudasim"].mean_nll - results["reference"].mean_nll) <= CUDASIM_NLL_BOUND
    # BF16 GEMM inputs on the GPU model: every FP8 GEMM rounds its input (f32_max_rows=0)
    assert load_model(checkpoint, "cudasim", gemm_input="bf16", max_num_tokens=8, max_num_seqs=1).f32_max_rows == 0
    with pytest.raises(ValueError, match="means f32_max_rows=0"):
        load_model(checkpoint, "cudasim", gemm_input="bf16", f32_max_rows=4)
