"""Shared test set-up: Hypothesis profiles and the ``gpu`` marker.

Profiles (choose with ``pytest --hypothesis-profile=NAME``; ``ci`` is the default):

- ``ci``: fast and reproducible (derandomized), for the CPU-only run on every submission;
- ``nightly``: thorough, randomized, many examples, for a long run on a big machine.

Tests marked ``gpu`` run only where numba-cuda sees an NVIDIA GPU and skip cleanly elsewhere.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

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


@pytest.fixture
def rng(request) -> "np.random.Generator":
    """A NumPy generator seeded from the test's name: fresh per test, reproducible across runs."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
