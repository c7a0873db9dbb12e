"""fp8lab.engine.checkpoint: load(save(x)) == x, sharding, quantize_checkpoint's exact output format and
error bound, inspect, the command line, and a clear error for every kind of bad checkpoint
(each built by corrupting a freshly made tiny checkpoint)."""

from __future__ import annotations

import json
import shutil
import time
import warnings

import numpy as np
import pytest

from fp8lab import cli
from fp8lab.engine import checkpoint as ck
from fp8lab.engine import safetensors_io as sio
from fp8lab.engine.config import Qwen3Config
from fp8lab.engine.layout import expected_tensors
from fp8lab.engine.tiny import make_tiny, random_bf16_tensors
from fp8lab.reference import blockwise

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"
Q_SCALE = Q_PROJ + "_scale_inv"
NORM = "model.layers.2.input_layernorm.weight"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"bf16": make_tiny(root / "bf16", seed=3), "fp8": make_tiny(root / "fp8", fp8=True, seed=3)}


@pytest.fixture
def fp8_dir(tiny_dirs, tmp_path):
    """A fresh copy of the tiny FP8 checkpoint, to corrupt."""
    return shutil.copytree(tiny_dirs["fp8"], tmp_path / "ckpt")


@pytest.fixture
def bf16_dir(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs["bf16"], tmp_path / "ckpt")


def rewrite_weights(folder, edit, file="model.safetensors"):
    """Read every tensor of one weights file, let ``edit(tensors, dtypes)`` change them, write back."""
    path = folder / file
    tensors, dtypes = sio.read_safetensors(path)
    edit(tensors, dtypes)
    sio.write_safetensors(path, tensors, dtypes, {"format": "pt"})


def edit_json(path, edit):
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def odd_config(**overrides) -> Qwen3Config:
    """A config whose projections have partial blocks for a (16, 32) block size."""
    fields = dict(vocab_size=50, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=24, tie_word_embeddings=False)  # fmt: skip
    fields.update(overrides)
    return Qwen3Config(**fields)


def assert_same_checkpoint(a: ck.Checkpoint, b: ck.Checkpoint):
    assert a.config == b.config
    assert a.stored_dtypes == b.stored_dtypes
    assert a.generation_config == b.generation_config
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        np.testing.assert_array_equal(a.tensors[name], b.tensors[name], err_msg=name)


# ----------------------------------------------------------------------------------------------
# loading and saving


def test_load_tiny_fp8(tiny_dirs):
    c = ck.load_checkpoint(tiny_dirs["fp8"], progress=False)
    assert c.path == tiny_dirs["fp8"] and c.is_fp8 and c.block == (128, 128)
    assert list(c.tensors) == list(expected_tensors(c.config))
    assert "lm_head.weight" not in c.tensors  # tied
    assert c.tensors[Q_PROJ].dtype == np.uint8 and c.tensors[Q_PROJ].shape == (256, 256)
    assert c.tensors[Q_SCALE].dtype == np.float32 and c.tensors[Q_SCALE].shape == (2, 2)
    assert c.tensors["model.embed_tokens.weight"].dtype == np.float32
    assert c.stored_dtypes[Q_PROJ] == "F8_E4M3" and c.stored_dtypes[Q_SCALE] == "F32"
    assert c.stored_dtypes["model.embed_tokens.weight"] == "BF16"
    assert c.generation_config["eos_token_id"] == [1021, 1019]


def test_load_without_generation_config_gives_empty_dict(bf16_dir):
    (bf16_dir / "generation_config.json").unlink()
    assert ck.load_checkpoint(bf16_dir, progress=False).generation_config == {}


@pytest.mark.parametrize("key, value", [("eos_token_id", "x"), ("eos_token_id", [1021, 4.5]), ("eos_token_id", True),
                                        ("bos_token_id", 1024), ("pad_token_id", -1), ("bos_token_id", [1019])])
def test_generation_config_token_ids_are_checked_not_coerced(bf16_dir, key, value):
    path = bf16_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(ValueError, match=rf"generation_config.json: {key} must be a token id.* in \[0, vocab_size=1024\)"):
        ck.load_checkpoint(bf16_dir, progress=False)


def test_generation_config_must_be_an_object(bf16_dir):
    (bf16_dir / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json: expected a JSON object, got list"):
        ck.load_checkpoint(bf16_dir, progress=False)


def test_progress_bar_goes_to_stderr(tiny_dirs, capsys):
    ck.load_checkpoint(tiny_dirs["fp8"], progress=True)
    captured = capsys.readouterr()
    assert "loading" in captured.err and captured.out == ""


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_load_save_load_is_identity(tiny_dirs, tmp_path, kind):
    first = ck.load_checkpoint(tiny_dirs[kind], progress=False)
    ck.save_checkpoint(tmp_path / "again", first.config, first.tensors, first.stored_dtypes, first.generation_config)
    second = ck.load_checkpoint(tmp_path / "again", progress=False)
    assert_same_checkpoint(first, second)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_dirs[kind] / name).read_bytes()


def test_save_keeps_requested_dtypes(tmp_path, rng):
    config = odd_config()
    tensors = random_bf16_tensors(config, seed=int(rng.integers(1 << 30)))
    tensors["lm_head.weight"] = rng.standard_normal((50, 40)).astype(np.float32)  # not BF16-representable
    dtypes = {"lm_head.weight": "F32", NORM.replace("2", "1"): "F16"}
    ck.save_checkpoint(tmp_path / "c", config, tensors, dtypes)
    loaded = ck.load_checkpoint(tmp_path / "c", progress=False)
    assert loaded.stored_dtypes["lm_head.weight"] == "F32"
    assert loaded.stored_dtypes["model.layers.1.input_layernorm.weight"] == "F16"
    assert loaded.stored_dtypes["model.embed_tokens.weight"] == "BF16"
    np.testing.assert_array_equal(loaded.tensors["lm_head.weight"], tensors["lm_head.weight"])


@pytest.mark.parametrize("max_shard_bytes", [300_000, 1_000_000, 10])
def test_sharded_equals_unsharded(tiny_dirs, tmp_path, max_shard_bytes):
    c = ck.load_checkpoint(tiny_dirs["fp8"], progress=False)
    ck.save_checkpoint(tmp_path / "s", c.config, c.tensors, c.stored_dtypes, c.generation_config, max_shard_bytes=max_shard_bytes)
    index = json.loads((tmp_path / "s" / ck.INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "s" / ck.WEIGHTS_FILE).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(c.tensors)
    sizes = {name: sio.SafetensorsFile(tmp_path / "s" / f).info(name).nbytes for name, f in index["weight_map"].items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    if max_shard_bytes > 10:
        for shard in shards:
            in_shard = [n for n, f in index["weight_map"].items() if f == shard]
            assert sum(sizes[n] for n in in_shard) <= max_shard_bytes or len(in_shard) == 1
    assert_same_checkpoint(c, ck.load_checkpoint(tmp_path / "s", progress=False))


def test_save_refuses_bad_tensors_and_existing_checkpoints(tiny_dirs, tmp_path):
    c = ck.load_checkpoint(tiny_dirs["fp8"], progress=False)
    with pytest.raises(FileExistsError, match="already holds checkpoint files"):
        ck.save_checkpoint(tiny_dirs["fp8"], c.config, c.tensors)
    bad = dict(c.tensors)
    bad[Q_PROJ] = bad[Q_PROJ].astype(np.float32)
    with pytest.raises(ValueError, match=f"{Q_PROJ}.*must be uint8 E4M3 codes"):
        ck.save_checkpoint(tmp_path / "x", c.config, bad)
    bad = dict(c.tensors)
    bad[Q_PROJ] = bad[Q_PROJ].copy()
    bad[Q_PROJ][3, 4] = 0xFF
    with pytest.raises(ValueError, match=r"1 NaN codes.*first at \[3, 4\]"):
        ck.save_checkpoint(tmp_path / "x", c.config, bad)
    with pytest.raises(ValueError, match="stored as F16; config.json quantizes"):
        ck.save_checkpoint(tmp_path / "x", c.config, c.tensors, {Q_PROJ: "F16"})
    with pytest.raises(ValueError, match="missing tensor"):
        ck.save_checkpoint(tmp_path / "x", c.config, {k: v for k, v in c.tensors.items() if k != NORM})
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------
# quantize_checkpoint


def assert_within_blockwise_bound(w, q, s, block):
    """|dequantize(q, s) - w| <= 2^-4 |w| + 2^-10 s per element (fp8lab/reference/blockwise.py)."""
    w_hat = blockwise.dequantize(q, s, block)
    s_full = blockwise.expand_scales(s, w.shape, block)
    bound = (2.0**-4 * np.abs(w) + 2.0**-10 * s_full) * (1 + 2.0**-22)
    assert np.all(np.abs(w_hat - w) <= bound)


def test_quantize_checkpoint_format_and_error_bound(tiny_dirs, tmp_path):
    src = tiny_dirs["bf16"]
    dst = ck.quantize_checkpoint(src, tmp_path / "q", progress=False)
    source = ck.load_checkpoint(src, progress=False)
    out = ck.load_checkpoint(dst, progress=False)

    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }  # fmt: skip
    src_config = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == src_config

    # names, stored dtypes and shapes straight from the safetensors header
    f = sio.SafetensorsFile(dst / "model.safetensors")
    assert set(f.names()) == set(expected_tensors(out.config))
    for name in f.names():
        info = f.info(name)
        if name.endswith("_scale_inv"):
            assert info.dtype == "F32"
        elif name.endswith("_proj.weight"):
            assert info.dtype == "F8_E4M3"
        else:
            assert info.dtype == "BF16", name  # embeddings and norms (incl. q_norm/k_norm)
    assert f.metadata == {"format": "pt"}

    for name, spec in expected_tensors(out.config).items():
        if spec.kind == "fp8":
            assert_within_blockwise_bound(source.tensors[name], out.tensors[name], out.tensors[name + "_scale_inv"], (128, 128))
        elif spec.kind == "float":
            np.testing.assert_array_equal(out.tensors[name], source.tensors[name])

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert sorted(p.name for p in dst.iterdir()) == sorted(p.name for p in src.iterdir())


def test_quantize_partial_blocks_separate_lm_head_and_side_files(tmp_path, rng):
    config = odd_config()
    tensors = random_bf16_tensors(config, seed=int(rng.integers(1 << 30)))
    src = ck.save_checkpoint(tmp_path / "src", config, tensors)
    (src / "README.md").write_text("model card\n")
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    dst = ck.quantize_checkpoint(src, tmp_path / "dst", block=(16, 32), progress=False)
    out = ck.load_checkpoint(dst, progress=False)
    assert out.block == (16, 32)
    assert out.stored_dtypes["lm_head.weight"] == "BF16"
    assert out.tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (3, 3)  # [40, 72] / (16, 32)
    for name, spec in expected_tensors(out.config).items():
        if spec.kind == "fp8":
            assert_within_blockwise_bound(tensors[name], out.tensors[name], out.tensors[name + "_scale_inv"], (16, 32))
    assert (dst / "README.md").read_text() == "model card\n"
    assert not (dst / "pytorch_model.bin").exists() and not (dst / "generation_config.json").exists()


def test_quantize_sharded_source(tiny_dirs, tmp_path):
    c = ck.load_checkpoint(tiny_dirs["bf16"], progress=False)
    src = ck.save_checkpoint(tmp_path / "src", c.config, c.tensors, c.stored_dtypes, c.generation_config, max_shard_bytes=2_000_000)
    assert (src / ck.INDEX_FILE).exists()
    dst = ck.quantize_checkpoint(src, tmp_path / "dst", progress=False)
    assert (dst / "model.safetensors").read_bytes() == (tiny_dirs["fp8"] / "model.safetensors").read_bytes()


def test_quantize_refuses(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="already an FP8 checkpoint"):
        ck.quantize_checkpoint(tiny_dirs["fp8"], tmp_path / "x", progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        ck.quantize_checkpoint(tiny_dirs["bf16"], tmp_path / "full", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["full"]  # no temporary folder left behind


def test_quantize_failure_leaves_nothing(bf16_dir, tmp_path):
    rewrite_weights(bf16_dir, lambda t, d: t[Q_PROJ].__setitem__((0, 0), np.inf))
    with pytest.raises(ValueError, match=f"{Q_PROJ}.*NaN or infinite"):
        ck.quantize_checkpoint(bf16_dir, tmp_path / "dst", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ----------------------------------------------------------------------------------------------
# bad checkpoints: each gives its clear error, naming the file and the tensor


def expect_error(folder, exc, *fragments):
    with pytest.raises(exc) as e:
        ck.load_checkpoint(folder, progress=False)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    return str(e.value)


def test_missing_tensor(fp8_dir):
    rewrite_weights(fp8_dir, lambda t, d: (t.pop(NORM), d.pop(NORM)))
    expect_error(fp8_dir, ValueError, "model.safetensors", f"missing tensor '{NORM}'")


def test_unexpected_tensor(fp8_dir):
    extra = "model.layers.4.input_layernorm.weight"
    rewrite_weights(fp8_dir, lambda t, d: (t.__setitem__(extra, np.ones(256, np.float32)), d.__setitem__(extra, "BF16")))
    expect_error(fp8_dir, ValueError, "model.safetensors", f"unexpected tensor '{extra}'", "num_hidden_layers=4")


def test_fp8_scale_in_a_bf16_checkpoint(bf16_dir):
    rewrite_weights(bf16_dir, lambda t, d: (t.__setitem__(Q_SCALE, np.ones((2, 2), np.float32)), d.__setitem__(Q_SCALE, "F32")))
    expect_error(bf16_dir, ValueError, Q_SCALE, "no quantization_config")


def test_tied_checkpoint_with_stored_lm_head_loads_with_warning(fp8_dir):
    def add_lm_head(t, d):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
        d["lm_head.weight"] = "BF16"

    rewrite_weights(fp8_dir, add_lm_head)
    with pytest.warns(UserWarning, match="ignoring lm_head.weight"):
        c = ck.load_checkpoint(fp8_dir, progress=False)
    assert "lm_head.weight" not in c.tensors


def test_wrong_shape(fp8_dir):
    rewrite_weights(fp8_dir, lambda t, d: t.__setitem__(NORM, np.ones(255, np.float32)))
    expect_error(fp8_dir, ValueError, "model.safetensors", NORM, "(255,)", "expected (256,)")


def test_bf16_where_fp8_is_expected(fp8_dir, rng):
    rewrite_weights(fp8_dir, lambda t, d: (t.__setitem__(Q_PROJ, rng.standard_normal((256, 256)).astype(np.float32)), d.__setitem__(Q_PROJ, "BF16")))
    expect_error(fp8_dir, ValueError, "model.safetensors", Q_PROJ, "stored as BF16", "F8_E4M3")


def test_fp8_where_float_is_expected(fp8_dir):
    rewrite_weights(fp8_dir, lambda t, d: (t.__setitem__(NORM, np.full(256, 0x38, np.uint8)), d.__setitem__(NORM, "F8_E4M3")))
    expect_error(fp8_dir, ValueError, NORM, "stored as F8_E4M3", "not quantized")


def test_scale_shape_that_does_not_match_the_block(fp8_dir):
    rewrite_weights(fp8_dir, lambda t, d: t.__setitem__(Q_SCALE, np.ones((1, 2), np.float32)))
    expect_error(fp8_dir, ValueError, "model.safetensors", Q_SCALE, "(1, 2)", "weight_block_size (128, 128)", "expected (2, 2)")


def test_block_size_in_config_that_does_not_match_the_scales(fp8_dir):
    edit_json(fp8_dir / "config.json", lambda d: d["quantization_config"].__setitem__("weight_block_size", [64, 128]))
    expect_error(fp8_dir, ValueError, "_scale_inv", "weight_block_size (64, 128)")


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_in_an_fp8_weight(fp8_dir, rng, code):
    rows, cols = rng.integers(0, 256, 3), rng.integers(0, 256, 3)

    def poison(t, d):
        t[Q_PROJ][rows, cols] = code

    rewrite_weights(fp8_dir, poison)
    first = sorted(set(zip(rows.tolist(), cols.tolist())))[0]
    count = len(set(zip(rows.tolist(), cols.tolist())))
    expect_error(fp8_dir, ValueError, "model.safetensors", Q_PROJ, f"{count} NaN codes", f"first at [{first[0]}, {first[1]}]")
    # validate_values=False loads it (for diagnosis), inspect reports it
    c = ck.load_checkpoint(fp8_dir, progress=False, validate_values=False)
    assert np.count_nonzero((c.tensors[Q_PROJ] & 0x7F) == 0x7F) == count
    summary = ck.summarize_checkpoint(fp8_dir)
    assert not summary.ok and summary.problems[0][1] == Q_PROJ
    assert f"{count} NaN codes" in ck.format_summary(summary)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, -1.0])
def test_bad_scale_values(fp8_dir, bad):
    rewrite_weights(fp8_dir, lambda t, d: t[Q_SCALE].__setitem__((1, 0), bad))
    expect_error(fp8_dir, ValueError, Q_SCALE, "not finite and positive", "first at [1, 0]")


def test_nan_in_a_bf16_weight(bf16_dir):
    rewrite_weights(bf16_dir, lambda t, d: t[Q_PROJ].__setitem__((5, 6), np.nan))
    expect_error(bf16_dir, ValueError, Q_PROJ, "1 NaN or infinite values", "first at [5, 6]")


def test_truncated_safetensors(fp8_dir, rng):
    path = fp8_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(rng.integers(0, len(data)))])
    expect_error(fp8_dir, ValueError, str(path))


def test_corrupt_safetensors_header(fp8_dir):
    path = fp8_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("[")
    path.write_bytes(bytes(data))
    expect_error(fp8_dir, ValueError, str(path), "not valid JSON")


def test_unknown_quant_method(fp8_dir):
    edit_json(fp8_dir / "config.json", lambda d: d["quantization_config"].__setitem__("quant_method", "gptq"))
    expect_error(fp8_dir, ValueError, str(fp8_dir / "config.json"), "unknown quant_method 'gptq'")


def test_corrupt_config_json(fp8_dir):
    (fp8_dir / "config.json").write_text("{not json")
    expect_error(fp8_dir, ValueError, str(fp8_dir / "config.json"), "not valid JSON")
    (fp8_dir / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    expect_error(fp8_dir, ValueError, "config.json", "missing required fields")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_file(fp8_dir, name):
    (fp8_dir / name).unlink()
    expect_error(fp8_dir, FileNotFoundError, str(fp8_dir), name)


def test_missing_folder(tmp_path):
    expect_error(tmp_path / "nowhere", FileNotFoundError, "nowhere", "no such checkpoint folder")


def sharded(tiny_dirs, tmp_path):
    c = ck.load_checkpoint(tiny_dirs["fp8"], progress=False)
    return ck.save_checkpoint(tmp_path / "s", c.config, c.tensors, c.stored_dtypes, max_shard_bytes=1_000_000)


def test_index_pointing_to_a_missing_shard(tiny_dirs, tmp_path):
    folder = sharded(tiny_dirs, tmp_path)
    (folder / "model-00002-of-00004.safetensors").unlink()
    expect_error(folder, FileNotFoundError, ck.INDEX_FILE, "model-00002-of-00004.safetensors", "does not exist")


def test_index_and_shard_disagree(tiny_dirs, tmp_path):
    folder = sharded(tiny_dirs, tmp_path)
    index = json.loads((folder / ck.INDEX_FILE).read_text())
    name = next(n for n, f in index["weight_map"].items() if f == "model-00001-of-00004.safetensors")
    index["weight_map"][name] = "model-00002-of-00004.safetensors"
    (folder / ck.INDEX_FILE).write_text(json.dumps(index))
    expect_error(folder, ValueError, "model-00001-of-00004.safetensors", name, "not listed for this shard")


def test_index_outside_the_folder(tiny_dirs, tmp_path):
    folder = sharded(tiny_dirs, tmp_path)
    edit_json(folder / ck.INDEX_FILE, lambda d: d["weight_map"].__setitem__(NORM, "../elsewhere.safetensors"))
    expect_error(folder, ValueError, ck.INDEX_FILE, "must be a file name inside the checkpoint folder")


# ----------------------------------------------------------------------------------------------
# inspect and the command line


def test_inspect_summary(tiny_dirs):
    s = ck.summarize_checkpoint(tiny_dirs["fp8"])
    assert s.ok
    assert s.kinds["fp8"].count == 28 and s.kinds["scale"].count == 28 and s.kinds["float"].count == 18
    assert int(s.code_histogram.sum()) == s.kinds["fp8"].params == 4 * (256 * 256 * 2 + 128 * 256 * 2 + 768 * 256 * 3)
    assert s.scale_inv.size == 4 * (4 + 2 + 2 + 4 + 12 + 12 + 12)
    assert s.fp8_projections["mlp.down_proj"] == ((256, 768), (2, 6), 4)
    text = ck.format_summary(s)
    for fragment in ("4 layers", "hidden 256", "4 heads / 2 kv heads", "head_dim 64", "vocab 1024", "tied embeddings yes",
                     "weight_block_size [128, 128]", "scale_inv    min", "E=15", "NaN codes 0", "Checkpoint OK"):  # fmt: skip
        assert fragment in text, fragment


def test_inspect_bf16(tiny_dirs):
    text = ck.inspect_checkpoint(tiny_dirs["bf16"])
    assert "FP8 weights: none" in text and "not quantized" in text


def test_cli_make_tiny_quantize_inspect(tiny_dirs, tmp_path, capsys):
    assert cli.main(["make-tiny", str(tmp_path / "t"), "--seed", "3"]) == 0
    assert (tmp_path / "t" / "model.safetensors").read_bytes() == (tiny_dirs["bf16"] / "model.safetensors").read_bytes()
    assert cli.main(["quantize", str(tmp_path / "t"), str(tmp_path / "q"), "--block", "128", "128", "--quiet"]) == 0
    assert (tmp_path / "q" / "model.safetensors").read_bytes() == (tiny_dirs["fp8"] / "model.safetensors").read_bytes()
    assert cli.main(["make-tiny", str(tmp_path / "t8"), "--fp8", "--seed", "3"]) == 0
    assert (tmp_path / "t8" / "model.safetensors").read_bytes() == (tiny_dirs["fp8"] / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "q"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "FP8 blockwise E4M3" in out and "Checkpoint OK" in out


def test_cli_errors_are_one_line(tiny_dirs, fp8_dir, tmp_path, capsys):
    cases = [
        (["inspect", str(tmp_path / "nowhere")], "fp8lab inspect: error:"),
        (["quantize", str(tiny_dirs["fp8"]), str(tmp_path / "x")], "already an FP8 checkpoint"),
        (["make-tiny", str(tiny_dirs["fp8"])], "not an empty folder"),
    ]
    for argv, fragment in cases:
        capsys.readouterr()
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    rewrite_weights(fp8_dir, lambda t, d: t[Q_PROJ].__setitem__((0, 0), 0x7F))
    capsys.readouterr()
    assert cli.main(["inspect", str(fp8_dir), "--quiet"]) == 1
    assert "PROBLEMS" in capsys.readouterr().out


def test_cli_help_lists_checkpoint_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("quantize", "inspect", "make-tiny"):
        assert command in out


def test_no_warnings_on_a_good_checkpoint(tiny_dirs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.load_checkpoint(tiny_dirs["bf16"], progress=False)


# ----------------------------------------------------------------------------------------------
# config.json against the files, values that overflow float32, Ctrl-C (GitHub issue 12)


def test_config_field_of_the_wrong_type_names_the_file_and_the_field(fp8_dir, capsys):
    edit_json(fp8_dir / "config.json", lambda d: d.__setitem__("tie_word_embeddings", "false"))
    expect_error(fp8_dir, ValueError, str(fp8_dir / "config.json"), "tie_word_embeddings must be true or false, got 'false'")
    edit_json(fp8_dir / "config.json", lambda d: d.update(tie_word_embeddings=True, num_key_value_heads=0))
    assert cli.main(["inspect", str(fp8_dir), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "config.json: num_key_value_heads must be an integer >= 1" in err and len(err.strip().splitlines()) == 1


def test_absurd_layer_count_fails_at_once(fp8_dir):
    edit_json(fp8_dir / "config.json", lambda d: d.__setitem__("num_hidden_layers", 10_000_000))
    start = time.perf_counter()
    expect_error(fp8_dir, ValueError, "model.safetensors", "num_hidden_layers=10000000", "only 4 layers")
    with pytest.raises(ValueError, match="only 4 layers"):
        ck.summarize_checkpoint(fp8_dir)
    assert time.perf_counter() - start < 1.0


def test_one_layer_more_than_stored(fp8_dir):
    edit_json(fp8_dir / "config.json", lambda d: d.__setitem__("num_hidden_layers", 5))
    expect_error(fp8_dir, ValueError, "num_hidden_layers=5", "only 4 layers")


def test_scale_that_overflows_float32_is_refused(fp8_dir):
    rewrite_weights(fp8_dir, lambda t, d: t[Q_SCALE].__setitem__((0, 1), 1e36))  # 448e36 > 3.4e38
    expect_error(fp8_dir, ValueError, "model.safetensors", Q_SCALE, "448 * scale overflows float32", "first at [0, 1]")
    summary = ck.summarize_checkpoint(fp8_dir)
    assert not summary.ok and summary.problems[0][1] == Q_SCALE
    assert "Checkpoint OK" not in ck.format_summary(summary)


def test_scale_that_may_overflow_at_run_time_is_a_warning(fp8_dir, capsys):
    rewrite_weights(fp8_dir, lambda t, d: t[Q_SCALE].__setitem__((1, 1), 1e17))  # 448e17 * sqrt(256) ~ 7e20
    ck.load_checkpoint(fp8_dir, progress=False)  # it loads...
    summary = ck.summarize_checkpoint(fp8_dir)
    assert summary.ok and [w[1] for w in summary.warnings] == [Q_SCALE]
    assert "dot product of 256 activations" in summary.warnings[0][2]
    capsys.readouterr()
    assert cli.main(["inspect", str(fp8_dir), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "WARNINGS (1 tensors" in out and Q_SCALE in out and "Checkpoint OK" not in out  # ...but is not OK


def test_huge_bf16_weight_is_a_warning(bf16_dir):
    rewrite_weights(bf16_dir, lambda t, d: t[Q_PROJ].__setitem__((3, 4), 1e19))
    summary = ck.summarize_checkpoint(bf16_dir)
    assert summary.ok and [w[1] for w in summary.warnings] == [Q_PROJ]
    assert "Checkpoint OK" not in ck.format_summary(summary)


@pytest.mark.parametrize("name, index", [("model.embed_tokens.weight", (7, 3)), (NORM, (9,))])
def test_non_finite_embedding_or_norm_is_refused(fp8_dir, name, index):
    rewrite_weights(fp8_dir, lambda t, d: t[name].__setitem__(index, np.inf))
    expect_error(fp8_dir, ValueError, "model.safetensors", name, "1 NaN or infinite values")
    assert not ck.summarize_checkpoint(fp8_dir).ok


def test_ctrl_c_during_quantize_leaves_nothing(tiny_dirs, tmp_path, monkeypatch, capsys):
    def interrupt(src, dst):  # after the weights are written into the temporary folder
        assert (dst / "model.safetensors").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "copy_side_files", interrupt)
    dst = tmp_path / "q"
    assert cli.main(["quantize", str(tiny_dirs["bf16"]), str(dst), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == f"fp8lab quantize: interrupted; {dst} was not written"
    assert list(tmp_path.iterdir()) == []  # neither DST nor a temporary folder
