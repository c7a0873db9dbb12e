"""The ``fp8lab`` commands' errors: each is one line on stderr that names the option and the fix, exit
status 1 (130 for Ctrl-C); never a traceback. ``generate`` runs on a fake checkpoint/tokenizer I/O half
(``helpers.engine.install_fake_io``: a tiny random model, a byte tokenizer), as in ``tests/engine/test_generate.py``."""

from __future__ import annotations

import pytest
from helpers.engine import install_fake_io, one_line_error, tiny_config

from fp8lab import cli
from fp8lab.engine import eval_command, generate_command

MAX_POS = 512  # tiny_config's max_position_embeddings


@pytest.fixture
def fake_io(monkeypatch, tmp_path):
    return install_fake_io(monkeypatch, tmp_path)


# ---------------------------------------------------------------------------- generate: options


@pytest.mark.parametrize("argv, names", [
    (["--block-size", "0"], ["--block-size", "positive"]),
    (["--block-size", "-4"], ["--block-size", "positive"]),
    (["--block-size", str(10**9)], ["--block-size", "max_position_embeddings 512"]),
    (["--num-blocks", "0"], ["--num-blocks", "positive"]),
    (["--num-blocks", "-1"], ["--num-blocks", "positive"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--seed", "-1"], ["--seed", ">= 0"]),
    (["--top-k", "5"], ["--top-k needs --temperature > 0"]),
    (["--top-p", "0.9"], ["--top-p needs --temperature > 0"]),
    (["--top-k", "5", "--temperature", "0"], ["--top-k needs --temperature > 0"]),
    (["--kv-cache-memory-fraction", "0"], ["--kv-cache-memory-fraction", "(0, 1]"]),
    (["--kv-cache-memory-fraction", "1.5"], ["--kv-cache-memory-fraction", "(0, 1]"]),
    (["--kv-cache-memory-fraction", "nan"], ["--kv-cache-memory-fraction", "(0, 1]"]),
    (["--prompt", "x" * MAX_POS], ["--prompt", "prompt 1 has 512 tokens", "max_position_embeddings"]),
    (["--prompt", ""], ["--prompt", "prompt 1 is empty"]),
])
def test_generate_option_errors_name_the_option(fake_io, capsys, argv, names):
    err = one_line_error(capsys, ["generate", "--prompt", "hello", *argv])
    for name in names:
        assert name in err, err


def test_invalid_utf8_in_a_prompt_names_the_prompt_and_the_byte(fake_io, capsys):
    # a non-UTF-8 byte on the command line reaches Python as a lone surrogate (surrogateescape)
    prompt = b"caf\xe9".decode("utf-8", errors="surrogateescape")
    err = one_line_error(capsys, ["generate", "--prompt", "fine", "--prompt", prompt])
    assert "--prompt: prompt 1 is not valid UTF-8 (byte 0xE9 at character 3)" in err


def test_top_k_and_top_p_with_a_temperature_sample(fake_io, capsys):
    argv = ["generate", "--prompt", "hi", "--max-new-tokens", "3", "--temperature", "0.8", "--top-k", "5",
            "--top-p", "0.9", "--seed", "0"]
    assert cli.main(argv) == 0


def test_a_huge_max_new_tokens_is_clamped_with_a_note(fake_io, capsys):
    """Generation stops at max_position_embeddings anyway: clamp (and say so) rather than refuse."""
    assert cli.main(["generate", "--prompt", "abcd", "--prompt", "ab", "--max-new-tokens", str(10**12)]) == 0
    out, err = capsys.readouterr()
    note, closing = err.splitlines()
    assert note == (f"fp8lab generate: note: --max-new-tokens {10**12} is clamped to {MAX_POS - 4} for the longest "
                    f"prompt (the model's max_position_embeddings is {MAX_POS})")
    assert "prompt: 6 tokens" in closing


# ---------------------------------------------------------------------------- --backend cudasim


def big_config():
    """hidden 64 x intermediate 4096 x 2 layers: above the simulator's limit (tensors are never needed)."""
    return tiny_config(intermediate_size=4096)


def test_generate_cudasim_refuses_a_big_model_naming_the_override(monkeypatch, tmp_path, capsys):
    install_fake_io(monkeypatch, tmp_path, big_config(), tensors={})
    err = one_line_error(capsys, ["generate", "--prompt", "hi", "--backend", "cudasim"])
    assert "--backend cudasim" in err and "minutes per token" in err and "--allow-slow-simulator" in err
    assert "--backend reference" in err


def test_allow_slow_simulator_goes_on_to_load_the_model(monkeypatch, tmp_path, capsys):
    import fp8lab.engine.loading

    install_fake_io(monkeypatch, tmp_path, big_config(), tensors={})

    def load_model(checkpoint, backend, **options):
        assert backend == "cudasim"
        raise RuntimeError("load_model reached")

    monkeypatch.setattr(fp8lab.engine.loading, "load_model", load_model)
    argv = ["generate", "--prompt", "hi", "--backend", "cudasim", "--allow-slow-simulator"]
    assert "load_model reached" in one_line_error(capsys, argv)


def test_eval_cudasim_refuses_a_big_model(monkeypatch, tmp_path, capsys):
    install_fake_io(monkeypatch, tmp_path, big_config(), tensors={})
    err = one_line_error(capsys, ["eval", "--quiet", "--model", str(tmp_path), "--backend", "cudasim"], "eval")
    assert "--backend cudasim" in err and "--allow-slow-simulator" in err


def test_the_micro_models_of_the_simulator_tests_pass_the_check():
    from fp8lab.engine.loading import simulator_too_slow

    assert simulator_too_slow(tiny_config(hidden_size=128, intermediate_size=128, num_hidden_layers=2)) is None
    assert simulator_too_slow(tiny_config()) is None
    demo = tiny_config(hidden_size=384, intermediate_size=1024, num_hidden_layers=6)
    assert "roughly 10 minutes per token" in simulator_too_slow(demo)


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_help_says_what_cudasim_is_for_and_names_the_new_options(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "testing the kernels on micro models, about ten minutes per token" in out
    assert "--allow-slow-simulator" in out
    if command == "generate":
        assert "--kv-cache-memory-fraction F" in out and "(default 0.5)" in out
        assert "needs --temperature > 0" in out


# ---------------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize("command, module", [("generate", generate_command), ("eval", eval_command)])
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, command, module):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_run", interrupted)
    argv = [command, "--prompt", "hi"] if command == "generate" else [command]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == f"fp8lab {command}: interrupted\n"


def test_a_failed_sequence_is_reported_and_the_others_are_printed(fake_io, monkeypatch, capsys):
    """One prompt whose sequence fails (``finish_reason == "error"``) exits 1 with a line naming it; the
    other prompt's text is still printed."""
    from fp8lab.engine import generate as gen

    real_generate = gen.Generator.generate

    def generate_with_one_failure(self, prompts, **kw):
        out = real_generate(self, prompts, **kw)
        out.results[1].finish_reason, out.results[1].error = "error", "logits: contain NaN (at token ids 3)"
        return out

    monkeypatch.setattr(gen.Generator, "generate", generate_with_one_failure)
    assert cli.main(["generate", "--prompt", "one", "--prompt", "two", "--max-new-tokens", "3"]) == 1
    out, err = capsys.readouterr()
    assert "=== [0]" in out
    assert "fp8lab generate: error in prompt 2: logits: contain NaN (at token ids 3)" in err
