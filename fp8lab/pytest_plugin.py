"""fp8lab's pytest plugin (entry point ``pytest11``, loaded in every pytest run where fp8lab is installed).

The kit needs no plugin: a ``check_*`` function raises ``KernelCheckFailed``, an ``AssertionError``
whose message is the report, so it works from any plain test. The plugin adds one option:

- ``--fp8lab-max-examples N``: every check of ``fp8lab.testing`` runs ``N`` Hypothesis examples instead
  of its own count (a quick run while developing, a thorough one in a nightly job). It sets the
  environment variable ``FP8LAB_MAX_EXAMPLES`` for the run, which ``fp8lab.testing.compare
  .hypothesis_settings`` reads (outside pytest, set the variable yourself); the checks that run a
  fixed exhaustive set (E4M3 encode and decode) are not affected.

The plugin sits beside ``fp8lab.testing``, not in it, and imports only the standard library and pytest:
loading ``fp8lab.testing`` would import NumPy, Hypothesis and the oracle into every pytest run.
"""

from __future__ import annotations

import os

import pytest

VARIABLE = "FP8LAB_MAX_EXAMPLES"
"""The environment variable that ``fp8lab.testing.compare.hypothesis_settings`` reads."""

_SAVED = pytest.StashKey[object]()


def pytest_addoption(parser) -> None:
    parser.getgroup("fp8lab").addoption(
        "--fp8lab-max-examples", type=int, metavar="N", default=None,
        help=f"every fp8lab.testing check runs N Hypothesis examples (sets {VARIABLE} for the run)")


def pytest_configure(config) -> None:
    n = config.getoption("fp8lab_max_examples")
    if n is None:
        return
    if n < 1:
        raise pytest.UsageError(f"--fp8lab-max-examples: expected a positive integer, got {n}")
    config.stash[_SAVED] = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = str(n)


def pytest_unconfigure(config) -> None:
    """Put the environment back as it was (pytest may run again in the same process)."""
    if _SAVED not in config.stash:
        return
    saved = config.stash[_SAVED]
    if saved is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = saved


def pytest_report_header(config) -> str | None:
    n = config.getoption("fp8lab_max_examples")
    return f"fp8lab: every check runs {n} examples (--fp8lab-max-examples)" if n else None
