"""fp8lab.engine.shapes (named Qwen3 shapes, random FP8 checkpoints, bytes per decode step) and the engine
benchmark's CPU-side parts: ``fp8lab make-tiny --shape``, the arguments, the driver
loop of ``bench/engine.py`` over a stand-in for ``CudaQwen3Model``, its report and figure.

The real shapes are only described here (configs, parameter counts, byte counts); the checkpoints
written and loaded are the ``test-mini`` shape (4 MB, partial 128 x 128 edge blocks).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fp8lab import cli
from fp8lab.engine import checkpoint as ck
from fp8lab.engine import shapes
from fp8lab.engine.layout import expected_tensors
from fp8lab.engine.tiny import tiny_config
from fp8lab.reference import blockwise, e4m3

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# shapes


@pytest.mark.parametrize(
    "name, hidden, intermediate, layers, heads, kv_heads, tied",
    [("qwen3-0.6b", 1024, 3072, 28, 16, 8, True), ("qwen3-8b", 4096, 12288, 36, 32, 8, False)],
)
def test_real_shapes_match_the_hugging_face_configs(name, hidden, intermediate, layers, heads, kv_heads, tied):
    c = shapes.shape_config(name)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (hidden, intermediate, layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (heads, kv_heads, 128)
    assert (c.vocab_size, c.tie_word_embeddings) == (151936, tied)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (1e6, 1e-6, 40960)
    assert c.quantization.weight_block_size == (128, 128) and c.quantization.quant_method == "fp8"
    specs = expected_tensors(c)
    assert specs["model.embed_tokens.weight"].kind == "float"
    assert ("lm_head.weight" in specs) == (not tied)
    assert specs["model.layers.0.self_attn.q_norm.weight"].kind == "float"
    assert specs["model.layers.0.mlp.down_proj.weight"].kind == "fp8"
    d = c.to_dict()
    assert d["quantization_config"]["weight_block_size"] == [128, 128]


def test_parameter_counts_match_the_model_cards():
    # Qwen3-0.6B: 0.6 B parameters, 0.44 B non-embedding; Qwen3-8B: 8.2 B, 6.95 B non-embedding
    small, big = (shapes.parameter_counts(shapes.shape_config(n)) for n in ("qwen3-0.6b", "qwen3-8b"))
    assert small["lm_head"] == 0 and round(small["layers"] / 1e9, 2) == 0.44 and round(small["total"] / 1e9, 1) == 0.6
    assert round(big["layers"] / 1e9, 2) == 6.95 and round(big["total"] / 1e9, 1) == 8.2
    assert big["embedding"] == big["lm_head"] == 151936 * 4096


def test_tiny_shape_is_the_tiny_model_and_names_are_checked():
    assert shapes.shape_config("tiny") == tiny_config(fp8=True)
    assert shapes.shape_names() == ["tiny", "qwen3-0.6b", "qwen3-8b"]
    assert "test-mini" in shapes.shape_names(include_test=True)
    assert shapes.shape_config("qwen3-8b", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.shape_config("qwen3-80b")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        shapes.shape_config("qwen3-8b", num_hidden_layers=0)


# ----------------------------------------------------------------------------------------------
# random weights


def test_code_table_samples_blockwise_quantized_normals():
    table = shapes.code_table()
    assert table.shape == (65536,) and not e4m3.is_nan(table).any()
    config = shapes.shape_config("test-mini")
    name = "model.layers.0.mlp.gate_proj.weight"
    q = shapes.random_tensor(config, name)
    s = shapes.random_tensor(config, name + "_scale_inv")
    assert q.dtype == np.uint8 and q.shape == (704, 320) and s.shape == (6, 3) and s.dtype == np.float32
    w = blockwise.dequantize(q, s)
    assert abs(w.std() / shapes.WEIGHT_STD - 1) < 0.05 and abs(w.mean()) < 1e-3
    # the code histogram is that of blockwise.quantize applied to normal weights
    normal = np.random.default_rng(5).standard_normal((1024, 1024)).astype(np.float32) * shapes.WEIGHT_STD
    q_ref, s_ref = blockwise.quantize(normal)
    h, h_ref = (np.bincount(c.ravel(), minlength=256) / c.size for c in (q, q_ref))
    assert 0.5 * np.abs(h - h_ref).sum() < 0.06
    assert abs(float(np.median(s)) / float(np.median(s_ref)) - 1) < 0.1


def test_random_tensors_are_seeded_and_independent_of_threads_and_layers(monkeypatch):
    monkeypatch.setattr(shapes, "CHUNK_ELEMENTS", 5000)  # many chunks per tensor
    two, one = shapes.shape_config("test-mini"), shapes.shape_config("test-mini", num_hidden_layers=1)
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
        serial = shapes.random_tensor(two, name, seed=3)
        with ThreadPoolExecutor(3) as pool:
            assert np.array_equal(shapes.random_tensor(two, name, seed=3, pool=pool), serial)
        assert np.array_equal(shapes.random_tensor(one, name, seed=3), serial)
        assert not np.array_equal(shapes.random_tensor(two, name, seed=4), serial)
    bits = shapes.random_tensor(two, "lm_head.weight")
    assert bits.dtype == np.uint16
    values = shapes.random_tensor(two, "lm_head.weight", engine_form=True)
    assert values.dtype == np.float32 and np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), values)
    assert abs(values.std() / shapes.EMBED_STD - 1) < 0.05
    assert np.all(shapes.random_tensor(two, "model.norm.weight", engine_form=True) == 1.0)


def test_make_random_writes_shards_that_load_as_the_in_memory_checkpoint(tmp_path):
    folder = shapes.make_random(tmp_path / "mini", "test-mini", seed=1, max_shard_bytes=1_500_000)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    loaded = ck.load_checkpoint(folder, progress=False)
    memory = shapes.random_checkpoint("test-mini", seed=1)
    assert loaded.config == memory.config == shapes.shape_config("test-mini")
    assert loaded.stored_dtypes == memory.stored_dtypes
    assert loaded.generation_config == memory.generation_config
    assert loaded.tensors.keys() == memory.tensors.keys()
    for name, array in memory.tensors.items():
        assert loaded.tensors[name].dtype == array.dtype and np.array_equal(loaded.tensors[name], array), name
    assert ck.summarize_checkpoint(folder).ok
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        (folder / f).stat().st_size - 8 - int.from_bytes((folder / f).read_bytes()[:8], "little")
        for f in set(index["weight_map"].values()))
    from fp8lab.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(folder)
    assert tokenizer.vocab_size == 1024 and set(tokenizer.eos_token_ids) == {1019, 1021}
    with pytest.raises(FileExistsError):
        shapes.make_random(folder, "test-mini")


def test_random_checkpoint_runs_in_the_reference_model():
    from fp8lab.engine.kv_manager import KVCacheManager
    from fp8lab.engine.model import Qwen3Model, make_batch

    checkpoint = shapes.random_checkpoint("test-mini", num_hidden_layers=1)
    model = Qwen3Model.from_checkpoint(checkpoint)
    manager = KVCacheManager(4, 16)
    manager.add_sequence(0)
    logits = model.forward(make_batch(manager, [(0, [1, 2, 3, 4])]), model.allocate_kv_cache(4, 16, "fp8"))
    assert logits.shape == (1, 1536) and np.all(np.isfinite(logits)) and 0.1 < logits.std() < 10


# ----------------------------------------------------------------------------------------------
# bytes per decode step


def test_decode_bytes_against_a_hand_count():
    c = shapes.shape_config("test-mini")  # 2 layers, hidden 320, intermediate 704, 4 q / 2 kv heads of 64, vocab 1536
    b = shapes.decode_bytes_per_step(c, batch=2, context_len=100, kv_format="fp8")
    per_layer = 256 * 320 + 2 * 128 * 320 + 320 * 256 + 2 * 704 * 320 + 320 * 704  # q, k + v, o, gate + up, down
    assert b.weights == 2 * per_layer == 1_843_200
    blocks = 2 * 3 + 2 * (1 * 3) + 3 * 2 + 2 * (6 * 3) + 3 * 6  # ceil(N/128) * ceil(K/128) per projection
    assert b.scales == 2 * blocks * 4 == 576
    assert b.lm_head == 1536 * 320 * 2
    assert b.norms == (2 * (2 * 320 + 2 * 64) + 320) * 2
    assert b.embedding_rows == 2 * 320 * 2
    assert b.kv_cache == 2 * 2 * 100 * 2 * (2 * 64 + 2 * 4)  # batch, layers, tokens, kv heads, K + V codes and scales
    assert b.total == 2_940_608
    bf16 = shapes.decode_bytes_per_step(c, batch=2, context_len=100, kv_format="bf16")
    assert bf16.kv_cache == 2 * 2 * 100 * 2 * (2 * 64 * 2)
    tied = shapes.decode_bytes_per_step(shapes.shape_config("tiny"), batch=1, context_len=0)
    assert tied.lm_head == 1024 * 256 * 2 and tied.embedding_rows == 256 * 2 and tied.kv_cache == 0
    big = shapes.decode_bytes_per_step(shapes.shape_config("qwen3-8b"), batch=1, context_len=544.5)
    assert 8.1e9 < big.total < 8.3e9  # 6.95 GB of FP8 weights + 1.24 GB of BF16 lm_head + ~75 MB of KV
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        shapes.decode_bytes_per_step(c, 1, 1, kv_format="int4")


# ----------------------------------------------------------------------------------------------
# command line


def test_make_tiny_with_a_shape_writes_a_random_checkpoint(tmp_path, capsys):
    dst = tmp_path / "mini"
    assert cli.main(["make-tiny", "--shape", "test-mini", "--out", str(dst), "--quiet", "--max-shard-gb", "0.002"]) == 0
    assert "random FP8 Qwen3 checkpoint" in capsys.readouterr().out
    assert ck.load_checkpoint(dst, progress=False).config == shapes.shape_config("test-mini")
    assert (dst / "model.safetensors.index.json").is_file()
    args = cli.build_parser().parse_args(["make-tiny", "--shape", "qwen3-8b", "--out", "somewhere", "--layers", "2"])
    assert (args.shape, args.out, args.layers, args.dst) == ("qwen3-8b", "somewhere", 2, None)
    assert cli.build_parser().parse_args(["make-tiny", "x"]).shape == "tiny"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["make-tiny", "--shape", "qwen3-80b", "x"])
    assert cli.main(["make-tiny", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 1
    assert "once" in capsys.readouterr().err


def test_bench_help_and_arguments(bench_script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_script.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--shapes" in out and "--decode-tokens" in out and "--no-transformers" in out
    parser = argparse.ArgumentParser()
    bench_script.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.shapes, args.batches, args.prompt_len, args.decode_tokens) == (["qwen3-0.6b", "qwen3-8b"], [1, 4, 16], 512, 64)
    args = parser.parse_args(["--shapes", "qwen3-8b", "--batches", "1,16", "--out", "o"])
    assert (args.shapes, args.batches, args.out) == (["qwen3-8b"], [1, 16], Path("o"))
    for bad in (["--shapes", "qwen3-80b"], ["--batches", "0"], ["--batches", "a"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_the_installed_cli_has_no_bench_subcommand():
    """The benchmark is a script of the source checkout (it needs torch); the CLI must not offer it."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench"])


def test_engine_imports_neither_torch_nor_transformers():
    code = ("import sys, fp8lab.cli, fp8lab.engine.shapes; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'imported torch'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ----------------------------------------------------------------------------------------------
# the benchmark's driver, report and figure, over the reference model standing in for the GPU one


class FakeCudaModel:
    """``CudaQwen3Model``'s interface over the reference ``Qwen3Model`` (and made-up stats)."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        self.stats = {"launches_per_decode_step": 321, "host_us_per_decode_step": 45.0, "graph": "captured"}

    @classmethod
    def from_checkpoint(cls, checkpoint, max_num_tokens, max_num_seqs):
        from fp8lab.engine.model import Qwen3Model

        assert max_num_tokens >= max_num_seqs >= 1
        return cls(Qwen3Model.from_checkpoint(checkpoint))

    def allocate_kv_cache(self, num_blocks, block_size, kv_format):
        return self.model.allocate_kv_cache(num_blocks, block_size, kv_format)

    def forward(self, batch, kv_cache, all_logits=False):
        return self.model.forward(batch, kv_cache, all_logits)

    def greedy_tokens(self, batch, kv_cache):
        return self.model.greedy_tokens(batch, kv_cache)

    def submit_greedy(self, batch, kv_cache, feed=None):
        """Computed at once; a fed step's token ids are ``feed``'s ids, as on the device (the batch's are
        placeholders)."""
        if feed is not None:
            batch = dataclasses.replace(batch, token_ids=feed.tokens())
        ids = self.model.greedy_tokens(batch, kv_cache)
        return types.SimpleNamespace(tokens=lambda: ids)


def load_script(path: Path, name: str):
    """A script of the repository (not part of the package) as a module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_script():
    yield load_script(ROOT / "bench" / "engine.py", "fp8lab_bench_engine")
    sys.modules.pop("fp8lab_bench_engine", None)


def test_bench_driver_report_and_figure(bench_script, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "fp8lab.engine.cuda.model", types.SimpleNamespace(CudaQwen3Model=FakeCudaModel))
    config = shapes.shape_config("test-mini", num_hidden_layers=1)
    # f32_max_rows None: the engine's default, so no keyword reaches the model (FakeCudaModel takes none)
    args = argparse.Namespace(batches=[1, 2], prompt_len=6, decode_tokens=2, warmup_steps=1, block_size=4, kv_cache_dtype="fp8",
                              profile_steps=0, f32_max_rows=None)
    context = 6 + 1 + (2 + 1) / 2
    rows = {}
    for batch in args.batches:
        total = shapes.decode_bytes_per_step(config, batch, context).total
        rows[batch] = bench_script.Row("test-mini", batch, 6, 2, context, total, batch / (total / 4e12))
    prompts = bench_script.random_prompts(config.vocab_size, 2, 6, seed=0)
    assert prompts.shape == (2, 6) and prompts.max() < config.vocab_size
    bench_script.bench_ours(shapes.random_checkpoint(config), prompts, rows, args)
    for r in rows.values():
        assert not r.errors and r.ours_prefill_tok_s > 0 and r.ours_decode_tok_s > 0 and len(r.ours_step_ms) == 2
        assert (r.launches_per_step, r.host_us_per_step) == (321, 45.0)
    rows[1].hf_prefill_tok_s, rows[1].hf_decode_tok_s = 1000.0, 10.0
    rows[2].errors.append("transformers: skipped")
    meta = {"date": "today", "gpu": "a GPU", "command": "bench/engine.py", "copy_tb_s": 4.0, "prompt_len": 6,
            "decode_tokens": 2, "warmup_steps": 1, "kv_cache_dtype": "fp8", "block_size": 4}
    bench_script.write_results(tmp_path, list(rows.values()), meta, {})
    table = (tmp_path / "engine_results.md").read_text()
    assert table.count("| test-mini |") == 2 and "| n/a |" in table and "**error** transformers: skipped" in table
    assert (tmp_path / "engine.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "engine_results.json").read_text())
    assert [r["batch"] for r in saved["rows"]] == [1, 2]


def test_bench_reads_host_time_in_any_unit(bench_script):
    read = bench_script.host_us_per_step
    assert read({"host_us_per_decode_step": 12.5}) == 12.5
    assert read({"launches_per_decode_step": 300, "host_ms_per_step": 0.5}) == 500.0
    assert read({"decode_host_s": 2e-5}) == pytest.approx(20.0)
    assert read({"launches_per_decode_step": 300}) is None


def test_transformers_peer_runs_on_the_cpu(bench_script):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = shapes.shape_config("test-mini", num_hidden_layers=1)
    row = bench_script.Row("test-mini", 1, 5, 2, 7.5, 1.0, 1.0)
    prompts = bench_script.random_prompts(config.vocab_size, 1, 5, seed=0)
    bench_script.bench_transformers(config, prompts, {1: row}, [1], 2, device="cpu")
    assert not row.errors and row.hf_prefill_tok_s > 0 and row.hf_decode_tok_s > 0


def test_kernel_attribution_of_profiled_runs():
    """``bench/decode_profile.attribute`` on hand-made CUPTI events: two runs of three kernels, each attributed to
    its plan label (the time it adds from the previous kernel's end, its duration), averaged per run; the span and
    gaps; events that do not match the labels fall back to the kernels' names; a prefill table says so."""
    profile_module = load_script(ROOT / "bench" / "decode_profile.py", "fp8lab_bench_decode_profile")
    try:
        kernel = "cudapy::fp8lab::numba_kernels::layers::rms_norm_kernel[abi:v1](Array<float>)"
        run = [(kernel, 0.0, 2.0), ("gemm", 3.0, 10.0), ("attention", 12.0, 4.0)]  # attention overlaps gemm by 1
        events = run + [(name, start + 100.0, duration) for name, start, duration in run]
        labels = ["input norm", "q/k/v gemm", "attention"]
        p = profile_module.attribute(events, labels, 2, 5, kind="prefill")
        assert p.attributed and p.kernels_per_step == 3 and p.kind == "prefill"
        assert p.by_label["q/k/v gemm"] == {"launches": 1, "us": 10.0, "added_us": 11.0}  # 1 us gap + 10
        assert p.by_label["attention"]["added_us"] == 3.0  # ends at 16, the gemm at 13
        assert (p.span_us, p.kernel_us) == (16.0, 16.0) and p.gap_us == 0.0
        assert sum(v["added_us"] for v in p.by_label.values()) == p.span_us  # the added times partition the span
        table = profile_module.breakdown_table(p, "#### Prefill")
        assert "| q/k/v gemm | 1 | 11.0 | 68.8% | 10.0 |" in table and "prefill forwards of 5 tokens after an untimed one" in table
        unmatched = profile_module.attribute(events, labels[:2], 2, 5)
        assert not unmatched.attributed and "layers.rms_norm_kernel" in unmatched.by_label
        assert profile_module.DecodeProfile(**{k: v for k, v in p.as_dict().items() if k != "gap_us"}) == p
    finally:
        sys.modules.pop("fp8lab_bench_decode_profile", None)
