"""``fp8lab.pytest_plugin``: ``--fp8lab-max-examples N`` makes every check of the kit run N examples (through
``FP8LAB_MAX_EXAMPLES``, read by ``compare.hypothesis_settings``), refuses N < 1, leaves the environment as
it was; the plugin loads with the standard library and pytest only. Inner pytest runs use ``pytester``."""

from __future__ import annotations

import os
import re

import pytest
from helpers.imports import run_without

from fp8lab import pytest_plugin
from fp8lab.testing.compare import hypothesis_settings

pytest_plugins = ["pytester"]

COUNTING_TEST = """
from fp8lab.reference import blockwise
from fp8lab.testing import check_blockwise_dequantize

def test_count():
    calls = []

    def dequantize(codes, scale_inv, block):
        calls.append(1)
        return blockwise.dequantize(codes, scale_inv, block)

    check_blockwise_dequantize(dequantize, block=(16, 16), max_examples=6)
    print(f"CALLS={len(calls)}")
"""


def plugin_args() -> list[str]:
    """The plugin by module name, its entry point (``fp8lab``) blocked: whether an installation's metadata
    declares the entry point (the wheel's test checks that it does) depends on how it was installed."""
    return ["-p", "no:fp8lab", "-p", "fp8lab.pytest_plugin"]


def calls_of(result) -> int:
    (count,) = re.findall(r"CALLS=(\d+)", result.stdout.str())
    return int(count)


def test_the_option_sets_every_checks_example_count(pytester, monkeypatch):
    monkeypatch.delenv(pytest_plugin.VARIABLE, raising=False)
    pytester.makepyfile(COUNTING_TEST)
    plain = pytester.runpytest(*plugin_args(), "-s", "-p", "no:cacheprovider")
    plain.assert_outcomes(passed=1)
    assert calls_of(plain) == 6
    quick = pytester.runpytest(*plugin_args(), "-s", "-p", "no:cacheprovider", "--fp8lab-max-examples", "2")
    quick.assert_outcomes(passed=1)
    assert calls_of(quick) == 2
    assert any("every check runs 2 examples" in line for line in quick.outlines)  # the report header says so
    assert pytest_plugin.VARIABLE not in os.environ  # put back after the run


def test_a_count_below_one_is_a_usage_error(pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "--fp8lab-max-examples", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--fp8lab-max-examples: expected a positive integer, got 0" in "\n".join(result.errlines)


def test_hypothesis_settings_reads_the_variable(monkeypatch):
    monkeypatch.delenv(pytest_plugin.VARIABLE, raising=False)
    assert hypothesis_settings(40).max_examples == 40
    monkeypatch.setenv(pytest_plugin.VARIABLE, "7")
    assert hypothesis_settings(40).max_examples == 7
    monkeypatch.setenv(pytest_plugin.VARIABLE, "many")
    with pytest.raises(ValueError, match="FP8LAB_MAX_EXAMPLES: expected a positive integer"):
        hypothesis_settings(40)


def test_the_plugin_loads_with_pytest_alone():
    """It loads in every pytest run where fp8lab is installed: no NumPy, no Hypothesis, no kit."""
    result = run_without(["numpy", "hypothesis"], """
        import sys
        import fp8lab.pytest_plugin
        assert not [m for m in sys.modules if m.startswith('fp8lab.') and m != 'fp8lab.pytest_plugin'], 'fp8lab loaded more'
        print('ok')
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
