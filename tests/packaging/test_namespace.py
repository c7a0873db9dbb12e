"""fp8lab installs one top-level name, and its layers import with only their own dependencies.

- A wheel built from this checkout holds ``fp8lab/`` and its ``.dist-info`` and nothing else at
  the top level of site-packages (a kernel author's own ``reference`` or ``engine`` module must
  never be shadowed), and carries the files the engine and the kernels read at run time.
- ``import fp8lab`` loads no subpackage; the oracle (``fp8lab.reference``) and the simulators run
  with NumPy alone; ``fp8lab.reference.strategies`` and the kit ``fp8lab.testing`` (its torch and
  CuPy adapters included, which import those only when called) need only Hypothesis more; the
  engine's command line runs the main job (the demo model on the reference backend) without numba,
  Hypothesis or matplotlib (``fp8lab check`` without the engine: ``tests/testing/test_check_command.py``).
  Each check runs in a subprocess whose imports of the packages a layer must not need raise
  ``ImportError``, as they would where those packages are not installed (``helpers.imports``).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.imports import ROOT, run_without


def test_import_fp8lab_loads_no_subpackage_and_says_what_is_inside():
    result = run_without(["numba", "safetensors", "tokenizers", "tqdm", "matplotlib", "hypothesis"], """
        import sys
        import fp8lab
        assert not [m for m in sys.modules if m.startswith('fp8lab.')], 'a subpackage was imported eagerly'
        for name in ('fp8lab.reference', 'fp8lab.simulators', 'fp8lab.numba_kernels', 'fp8lab.engine', 'fp8lab.testing'):
            assert name in fp8lab.__doc__, name
        print('ok')
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_oracle_and_the_simulators_need_only_numpy():
    result = run_without(["numba", "safetensors", "tokenizers", "tqdm", "matplotlib", "hypothesis", "ml_dtypes"], """
        import pkgutil, importlib
        import numpy as np
        import fp8lab.reference, fp8lab.simulators
        for package in (fp8lab.reference, fp8lab.simulators):
            for module in pkgutil.iter_modules(package.__path__):
                if module.name != 'strategies':  # the Hypothesis strategies: the test below
                    importlib.import_module(f'{package.__name__}.{module.name}')
        from fp8lab.reference import blockwise, e4m3
        from fp8lab.simulators import gemv_simt
        rng = np.random.default_rng(0)
        w = rng.standard_normal((130, 256)).astype(np.float32)
        q, s = blockwise.quantize(w)
        a = rng.standard_normal((2, 256)).astype(np.float32)
        got = gemv_simt.gemv_simt(a, q, s)
        want = blockwise.gemm(a, q, s)
        assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want)), 'simulator and oracle disagree'
        assert e4m3.encode(464.0, saturate=False) == 0x7E
        print('ok')
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_strategies_need_only_hypothesis_more():
    result = run_without(["numba", "safetensors", "tokenizers", "tqdm", "matplotlib", "ml_dtypes"], """
        from hypothesis import given, settings
        from fp8lab.reference import strategies
        seen = []
        @settings(max_examples=5, database=None)
        @given(strategies.e4m3_codes())
        def collect(codes):
            seen.append(codes)
        collect()
        assert seen and all(c.dtype.name == 'uint8' for c in seen)
        print('ok')
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_testing_kit_needs_only_hypothesis_more():
    result = run_without(["numba", "safetensors", "tokenizers", "tqdm", "matplotlib", "ml_dtypes", "torch", "cupy"], """
        import numpy as np
        from fp8lab import testing
        from fp8lab.testing import adapters
        for adapter in (adapters.on_torch, adapters.on_cupy):
            try:
                adapter(lambda x: x)
            except ImportError as missing:
                assert 'pip install' in str(missing) and '\\n' not in str(missing), str(missing)
            else:
                raise SystemExit(f'{adapter.__name__} worked without its package')
        from fp8lab.reference import blockwise, e4m3
        testing.check_e4m3_encode(e4m3.encode)
        try:
            testing.check_e4m3_encode(lambda x: e4m3.encode(x, saturate=False))
        except testing.KernelCheckFailed as failure:
            assert 'overflow_policy_swapped' in str(failure)
        else:
            raise SystemExit('the kit passed a wrong encoder')
        testing.check_blockwise_dequantize(blockwise.dequantize, max_examples=5)
        print('ok')
    """)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_main_job_runs_without_the_kernels_or_plotting(tmp_path):
    """The README's main job (the demo model, greedy) on a CPU with only the engine's dependencies."""
    result = run_without(["numba", "hypothesis", "matplotlib", "ml_dtypes"], """
        import sys
        from fp8lab import cli
        sys.exit(cli.main(['generate', '--prompt', 'The os module provides', '--max-new-tokens', '4']))
    """, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), "no text was generated"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of this checkout's package sources (setuptools, no network)."""
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    tracked = subprocess.run(["git", "ls-files", "fp8lab"], cwd=ROOT, capture_output=True, text=True)
    files = tracked.stdout.split() if tracked.returncode == 0 and tracked.stdout else [
        str(p.relative_to(ROOT)) for p in (ROOT / "fp8lab").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((ROOT / rel).read_bytes())
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (built,) = out.glob("fp8lab-*.whl")
    return built


def test_the_wheel_installs_only_fp8lab(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"fp8lab"}, f"the wheel installs other top-level names: {sorted(top - dist_info)}"
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "fp8lab = fp8lab.cli:main" in entry_points
    assert "[pytest11]\nfp8lab = fp8lab.pytest_plugin" in entry_points


def test_the_wheel_carries_the_data_the_package_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {"fp8lab/numba_kernels/mma_m16n8k16.cu", "fp8lab/engine/data/demo_heldout.txt",
              "fp8lab/engine/data/tiny_corpus.txt", "fp8lab/engine/data/demo/config.json",
              "fp8lab/engine/data/demo/tokenizer.json"}
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
    assert not [n for n in names if n.startswith(("fp8lab/tests", "tests/", "bench/", "tools/"))]
