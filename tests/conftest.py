"""Shared test set-up: Hypothesis profiles, the ``gpu`` and ``cudasim`` markers, the ``rng`` and
``gemm_twins`` fixtures (the helpers the test modules share are in ``helpers/``).

Profiles (choose with ``pytest --hypothesis-profile=NAME``; ``ci`` is the default):

- ``ci``: fast and reproducible (derandomized), for the CPU-only run on every submission;
- ``nightly``: thorough, randomized, many examples, for a long run on a big machine.

On a GPU, Numba's inliner gets a faster IR copy (``fp8lab.numba_kernels.inlining``: the same PTX).

Tests marked ``gpu`` run only where numba-cuda sees an NVIDIA GPU and skip cleanly elsewhere;
tests marked ``cudasim`` run kernels in Numba's CUDA simulator, which this file switches on when
there is no GPU.
"""

from __future__ import annotations

import os
import shutil


def _nvidia_gpu_present() -> bool:
    """A cheap look for an NVIDIA driver, without importing numba."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


# Numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported: decide before any test module
# imports it. Without a GPU the kernels run in the CUDA simulator; with one, on the GPU (run
# `NUMBA_ENABLE_CUDASIM=1 pytest -m cudasim` there for the simulator tests).
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _nvidia_gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# The embedded tiny model is built on first use into $FP8LAB_CACHE: give the test session its own
# folder, so that tests never read (or write) a user's cache.
if "FP8LAB_CACHE" not in os.environ:
    import tempfile

    os.environ["FP8LAB_CACHE"] = tempfile.mkdtemp(prefix="fp8lab-test-cache-")

import pytest
from hypothesis import HealthCheck, settings

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":  # on a GPU the tests compile their kernels: the same PTX, sooner
    from fp8lab.numba_kernels.inlining import install

    install()

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _gpu_available() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # numba-cuda missing or no driver: no GPU here
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to numba-cuda")
        for item in gpu_items:
            item.add_marker(skip)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        skip = pytest.mark.skip(reason="simulator test; run with NUMBA_ENABLE_CUDASIM=1")
        for item in items:
            if "cudasim" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's file name and name (not its folder, so that moving a
    test module keeps its data): fresh per test, reproducible across runs."""
    import zlib
    from pathlib import Path

    import numpy as np

    seed_name = f"tests/{Path(request.node.path).name}::{request.node.nodeid.split('::', 1)[1]}"
    return np.random.default_rng(zlib.crc32(seed_name.encode()))


@pytest.fixture
def gemm_twins(monkeypatch):
    """The GPU model's GEMM kernels replaced by their bit-exact NumPy simulators (``helpers.cuda_twins``)."""
    from helpers.cuda_twins import install_gemm_twins

    install_gemm_twins(monkeypatch)


def pytest_collection_finish(session):
    """Start the sm_90 PTX compiles in the background right after collection: pytest runs tests on one
    core, so the compiles of the modules that declare ``PTX_VARIANT_SETS`` (``helpers.ptx``) use the
    other one while the simulator tests run, and their checks later find the PTX ready. Not in a
    ``pytest-xdist`` worker (``-n``): every worker collects every test, so each would compile every set; there
    the module that runs the checks compiles its sets when it needs them (``--dist loadfile`` keeps a module's
    tests in one worker, so each set compiles once)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for module in {item.module for item in session.items if getattr(item, "module", None) is not None}:
        sets = getattr(module, "PTX_VARIANT_SETS", None)
        if sets:
            from helpers.ptx import start_compiling

            start_compiling(sets)
