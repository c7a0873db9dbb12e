"""``fp8lab check MODULE:FUNCTION --op OP``: a pass prints what was checked and exits 0, a wrong function
prints the report with its bug class and exits 1, every usage error is one line and exit 2; the op table
covers every check of the kit and spells every parameter as an option. The zoo-style functions live in a
temporary ``.py`` file, as a kernel author's would. In subprocesses: ``fp8lab check`` runs where the
engine's dependencies are missing (and the engine's subcommands then refuse in one line naming the
extra), and ``fp8lab e4m3`` runs where Hypothesis is missing too."""

from __future__ import annotations

import inspect
import sys
import textwrap

import pytest
from helpers.imports import run_without

from fp8lab import cli, testing
from fp8lab.testing import cli as check_cli

KERNELS = textwrap.dedent(
    """
    import numpy as np
    from fp8lab.reference import blockwise, e4m3

    def encode(x):
        return e4m3.encode(x, saturate=True)

    def encode_nan_on_overflow(x):
        '''NaN on overflow although the check asks to saturate: overflow_policy_swapped.'''
        return e4m3.encode(x, saturate=False)

    def dequantize(codes, scale_inv, block):
        return blockwise.dequantize(codes, scale_inv, block)

    def crash(x):
        return 1 / 0

    NOT_A_FUNCTION = 3
    """
)

TORCH_KERNELS = textwrap.dedent(
    """
    import torch

    def encode(x):
        return x.clamp(-448, 448).to(torch.float8_e4m3fn)

    def encode_fnuz_max(x):
        return x.clamp(-240, 240).to(torch.float8_e4m3fn)
    """
)


@pytest.fixture
def kernels(tmp_path) -> str:
    """The path of a ``.py`` file of zoo-style functions (a fresh module name per test)."""
    path = tmp_path / f"kernels_{tmp_path.name.replace('-', '_')}.py"
    path.write_text(KERNELS)
    yield str(path)
    sys.modules.pop(path.stem, None)


def run(capsys, *argv) -> tuple[int, str, str]:
    """``fp8lab check argv``: (exit status, stdout, stderr); argparse's ``SystemExit`` counts as a status."""
    try:
        status = cli.main(["check", *argv])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------- pass and fail


def test_a_correct_function_passes_and_says_what_was_checked(capsys, kernels):
    status, out, _ = run(capsys, f"{kernels}:encode", "--op", "e4m3-encode")
    assert status == 0, out
    assert "passed" in out and "e4m3-encode" in out and "check_e4m3_encode" in out and "saturate=True" in out
    assert "tolerance: exact" in out and "called 1 time" in out


def test_a_wrong_function_fails_with_the_report_and_its_bug_class(capsys, kernels):
    status, out, _ = run(capsys, f"{kernels}:encode_nan_on_overflow", "--op", "e4m3-encode")
    assert status == 1
    assert "FAILED" in out and "overflow_policy_swapped" in out and "465" in out  # the minimal input


def test_options_reach_the_check(capsys, kernels):
    status, out, _ = run(capsys, f"{kernels}:encode_nan_on_overflow", "--op", "e4m3-encode", "--no-saturate")
    assert status == 0 and "saturate=False" in out
    status, out, _ = run(capsys, f"{kernels}:dequantize", "--op", "blockwise-dequantize", "--block", "64x128",
                         "--max-examples", "4")
    assert status == 0, out
    assert "block=(64, 128)" in out and "max_examples=4" in out
    calls = int(out.split("called ")[1].split()[0])
    assert 1 <= calls <= 4


def test_a_module_name_is_imported_from_the_current_directory(capsys, kernels, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    module = kernels.rsplit("/", 1)[1][:-3]
    status, out, _ = run(capsys, f"{module}:encode", "--op", "e4m3-encode")
    assert status == 0, out
    assert tmp_path.as_posix() not in sys.path  # put back as it was


def test_a_torch_function_through_the_adapter(capsys, tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "torch_kernels_of_the_check_test.py"
    path.write_text(TORCH_KERNELS)
    try:
        status, out, _ = run(capsys, f"{path}:encode", "--op", "e4m3-encode", "--torch", "cpu")
        assert status == 0 and "through torch on cpu" in out, out
        status, out, _ = run(capsys, f"{path}:encode_fnuz_max", "--op", "e4m3-encode", "--torch", "cpu")
        assert status == 1 and "fnuz_max_240" in out
    finally:
        sys.modules.pop(path.stem, None)


def test_a_function_that_raises_fails_with_its_traceback(capsys, kernels):
    status, _, err = run(capsys, f"{kernels}:crash", "--op", "e4m3-encode")
    assert status == 1
    assert "Traceback" in err and err.strip().splitlines()[-1].endswith("raised ZeroDivisionError: division by zero")


# ---------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize("argv, words", [
    (["{k}:encode", "--op", "e4m3-encoder"], ["argument --op", "invalid choice", "e4m3-encoder"]),
    (["{k}:encode"], ["--op", "required"]),
    (["{k}", "--op", "e4m3-encode"], ["MODULE:FUNCTION", "expected"]),
    (["{k}:missing", "--op", "e4m3-encode"], ["has no function 'missing'"]),
    (["{k}:NOT_A_FUNCTION", "--op", "e4m3-encode"], ["NOT_A_FUNCTION is not callable"]),
    (["no_such_module_of_fp8lab:f", "--op", "e4m3-encode"], ["no module named 'no_such_module_of_fp8lab'"]),
    (["{d}/absent.py:f", "--op", "e4m3-encode"], ["no such file", "absent.py"]),
    (["{k}:encode", "--op", "e4m3-encode", "--block", "64x64"], ["--block is not an option of --op e4m3-encode",
                                                                  "--no-saturate"]),
    (["{k}:dequantize", "--op", "blockwise-dequantize", "--no-saturate"], ["--no-saturate is not an option",
                                                                            "--block", "--max-examples"]),
    (["{k}:encode", "--op", "e4m3-decode", "--max-examples", "5"], ["--max-examples is not an option",
                                                                    "its options: none"]),
    (["{k}:encode", "--op", "blockwise-gemm", "--block", "64y"], ["argument --block", "BNxBK"]),
    (["{k}:encode", "--op", "paged-cache-write", "--layout", "columns"], ["--op paged-cache-write", "layout",
                                                                          "columns"]),
    (["{k}:encode", "--op", "e4m3-encode", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["{k}:encode", "--op", "e4m3-encode", "--torch", "no-such-device"], ["--torch"]),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, kernels, argv, words):
    status, out, err = run(capsys, *(a.format(k=kernels, d=kernels.rsplit("/", 1)[0]) for a in argv))
    assert status == 2 and not out
    assert err.count("\n") == 1 and err.startswith("fp8lab check: "), err
    for word in words:
        assert word in err, err


# ---------------------------------------------------------------------------- the op table


def test_every_check_of_the_kit_is_an_op_and_every_parameter_an_option():
    checks = {getattr(testing, name) for name in testing.__all__ if name.startswith("check_")}
    assert {check for check, _ in check_cli.OPS.values()} == checks
    flags = check_cli.option_flags()  # raises for a parameter the command cannot spell
    names = {spec["name"] for spec in flags.values()}
    assert names == {name for op in check_cli.OPS for name in check_cli.parameters(op)}
    assert names <= set(check_cli.HELP), f"options without help: {sorted(names - set(check_cli.HELP))}"
    for check, tolerance in check_cli.OPS.values():
        assert tolerance and next(iter(inspect.signature(check).parameters)) == "fn"


def test_the_engine_stand_ins_are_the_engines_subcommands():
    """``fp8lab.cli.ENGINE_COMMANDS`` (listed where the engine is missing) are what the engine registers; ``serve``
    is the server's."""
    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert commands == {"e4m3", "check", *cli.ENGINE_COMMANDS, "serve"}


# ---------------------------------------------------------------------------- with packages missing


ENGINE = ["safetensors", "tokenizers", "tqdm", "numba", "matplotlib", "torch"]


def test_check_runs_without_the_engines_dependencies(kernels, tmp_path):
    code = """
        import sys
        from fp8lab import cli
        sys.exit(cli.main(['check', sys.argv[2], '--op', 'e4m3-encode']))
    """
    failed = run_without(ENGINE, code, f"{kernels}:encode_nan_on_overflow", cwd=tmp_path)
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert "overflow_policy_swapped" in failed.stdout
    passed = run_without(ENGINE, code, f"{kernels}:encode", cwd=tmp_path)
    assert passed.returncode == 0 and "passed" in passed.stdout, passed.stderr[-2000:]


def test_without_the_engine_its_subcommands_refuse_in_one_line(tmp_path):
    result = run_without(ENGINE, """
        import sys
        from fp8lab import cli
        sys.exit(cli.main(['generate', '--prompt', 'The os module provides', '--max-new-tokens', '4']))
    """, cwd=tmp_path)
    assert result.returncode == 1 and not result.stdout
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("fp8lab generate: ")
    assert 'pip install "fp8lab[engine]"' in result.stderr


def test_without_hypothesis_e4m3_runs_and_check_names_the_testing_extra(tmp_path):
    result = run_without(["hypothesis", *ENGINE], """
        import sys
        from fp8lab import cli
        assert cli.main(['e4m3', '448']) == 0
        sys.exit(cli.main(['check', 'kernels:encode', '--op', 'e4m3-encode']))
    """, cwd=tmp_path)
    assert result.returncode == 1 and "0x7E" in result.stdout
    assert result.stderr.count("\n") == 1 and 'pip install "fp8lab[testing]"' in result.stderr, result.stderr
