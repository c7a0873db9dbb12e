"""``bench/serve.py`` (the GPU benchmark of ``fp8lab serve``) runs end to end on the CPU: a random
``test-mini`` checkpoint on the reference backend, served to 1 and 2 concurrent clients."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parents[2]


def test_the_serving_benchmark_runs_and_reports(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("fp8lab_bench_serve", ROOT / "bench" / "serve.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    try:
        spec.loader.exec_module(script)
        assert script.main(["--shape", "test-mini", "--backend", "reference", "--clients", "1,2", "--prompt-len", "8",
                            "--max-tokens", "4", "--requests-per-client", "2", "--out", str(tmp_path)]) == 0
    finally:
        sys.modules.pop(spec.name, None)
    results = json.loads((tmp_path / "serve_results.json").read_text())
    assert [r["clients"] for r in results["rows"]] == [1, 2]
    assert all(r["served_tok_s"] > 0 and r["generate_tok_s"] > 0 for r in results["rows"])
    table = (tmp_path / "serve_results.md").read_text()
    assert "| clients | served tok/s |" in table and "\n| 1 | " in table and "\n| 2 | " in table
    assert "served 0" not in capsys.readouterr().err
