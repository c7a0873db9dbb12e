"""The KV cache's memory budget: what the system says is free (``/proc/meminfo`` and its fallbacks, the
GPU's free memory through a fake numba context), how many blocks fit, and how ``fp8lab generate`` sizes
its cache: the worst case of the batch, capped by ``--kv-cache-memory-fraction`` of what is free, with
``--num-blocks`` checked against the same budget and a request that cannot fit refused before any work."""

from __future__ import annotations

import types

import pytest
from helpers.engine import install_fake_io, one_line_error, tiny_config

import fp8lab.engine.generate
import fp8lab.engine.loading
from fp8lab import cli
from fp8lab.engine import kv_manager
from fp8lab.engine.kv_manager import (
    blocks_for,
    blocks_in_budget,
    host_available_bytes,
    kv_block_bytes,
)
from fp8lab.engine.loading import kv_cache_memory_available

# ---------------------------------------------------------------------------- what is free


def test_meminfo_available_reads_kilobytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    assert kv_manager._meminfo_available(str(meminfo)) == 8_000_000 * 1024
    meminfo.write_text("MemTotal:       16000000 kB\n")  # old kernels have no MemAvailable
    assert kv_manager._meminfo_available(str(meminfo)) is None
    assert kv_manager._meminfo_available(str(tmp_path / "missing")) is None


def test_host_available_bytes_falls_back_to_sysconf_then_none(monkeypatch):
    import os

    monkeypatch.setattr(kv_manager, "_meminfo_available", lambda: None)
    monkeypatch.setitem(__import__("sys").modules, "psutil", None)  # import psutil -> ImportError
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert host_available_bytes() == 1000 * 4096

    def no_such_name(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(os, "sysconf", no_such_name)
    assert host_available_bytes() is None


def test_host_available_bytes_is_positive_here():
    assert host_available_bytes() > 0


def test_gpu_memory_info_asks_the_current_context(monkeypatch):
    from fp8lab.engine.cuda import memory

    context = types.SimpleNamespace(get_memory_info=lambda: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(memory, "cuda", types.SimpleNamespace(current_context=lambda: context))
    assert memory.gpu_memory_info() == (3 * 2**30, 80 * 2**30)
    monkeypatch.setattr(memory, "gpu_memory_info", lambda: (5, 10))
    assert kv_cache_memory_available("cuda") == (5, "free GPU memory")


def test_the_reference_backend_and_the_simulator_budget_host_memory(monkeypatch):
    monkeypatch.setattr(fp8lab.engine.loading, "host_available_bytes", lambda: 1234)
    assert kv_cache_memory_available("reference") == (1234, "available host memory")
    assert kv_cache_memory_available("cudasim") == (1234, "available host memory")


def test_blocks_in_budget_rounds_down():
    assert blocks_in_budget(1000, 0.5, 100) == 5
    assert blocks_in_budget(1000, 0.5, 101) == 4
    assert blocks_in_budget(1000, 0.05, 100) == 0


# ---------------------------------------------------------------------------- fp8lab generate's cache size

CONFIG = tiny_config()  # what install_fake_io serves: 2 layers, 2 kv heads of 16
FP8_BLOCK_BYTES = kv_block_bytes(CONFIG, 4, "fp8")  # block size 4 below; the reference stores FP8 as bytes
PROMPTS = ["hello", "hi there", "a"]  # 5, 8 and 1 bytes = tokens
NEW = 10


def worst_case_blocks(prompts=PROMPTS, new=NEW, block_size=4):
    return [blocks_for(len(p) + new - 1, block_size) for p in prompts]


@pytest.fixture
def run(monkeypatch, tmp_path, capsys):
    """``run(available_bytes, *options)``: ``fp8lab generate`` over ``PROMPTS`` with that much memory free;
    returns (exit status, stdout, stderr, the num_blocks the Generator got)."""
    install_fake_io(monkeypatch, tmp_path)
    seen = {}

    class Generator(fp8lab.engine.generate.Generator):
        def __init__(self, *args, **kw):
            seen["num_blocks"] = kw["num_blocks"]
            super().__init__(*args, **kw)

    monkeypatch.setattr(fp8lab.engine.generate, "Generator", Generator)

    def run(available, *options):
        monkeypatch.setattr(fp8lab.engine.loading, "kv_cache_memory_available", lambda backend: (available, "test memory"))
        argv = ["generate", "--backend", "reference", "--block-size", "4", "--max-new-tokens", str(NEW)]
        for p in PROMPTS:
            argv += ["--prompt", p]
        code = cli.main(argv + list(options))
        out, err = capsys.readouterr()
        return code, out, err, seen.get("num_blocks")

    return run


def test_plenty_of_memory_gives_the_worst_case(run):
    code, _, err, num_blocks = run(2**40)
    assert code == 0 and num_blocks == sum(worst_case_blocks()) and "note" not in err


def test_unknown_free_memory_gives_the_worst_case(run):
    assert run(None)[3] == sum(worst_case_blocks())


def test_a_tight_budget_caps_the_cache_and_requests_take_turns(run):
    """The budget holds the largest request but not the batch: the same text, a note, fewer blocks."""
    _, want_out, _, _ = run(2**40)
    blocks = max(worst_case_blocks()) + 1
    code, out, err, num_blocks = run(2 * blocks * FP8_BLOCK_BYTES)  # the default fraction is 0.5
    assert code == 0 and num_blocks == blocks
    assert sorted(out.split("=== [")) == sorted(want_out.split("=== ["))  # the same completions, maybe reordered
    note = err.splitlines()[0]
    assert note.startswith("fp8lab generate: note: the KV cache budget (--kv-cache-memory-fraction 0.5 of ")
    assert f"holds {blocks} blocks of 4 tokens" in note and f"of the {sum(worst_case_blocks())} the whole batch" in note


def test_the_fraction_scales_the_budget(run):
    blocks = max(worst_case_blocks())
    assert run(4 * blocks * FP8_BLOCK_BYTES, "--kv-cache-memory-fraction", "0.25")[3] == blocks


def test_a_request_that_cannot_fit_in_the_budget_fails_before_any_work(run):
    largest = max(worst_case_blocks())
    code, out, err, num_blocks = run(2 * (largest - 1) * FP8_BLOCK_BYTES)
    assert code == 1 and out == "" and num_blocks is None and err.count("\n") == 1
    assert f"KV cache exhausted: request 1 alone needs {largest} blocks" in err
    assert f"holds {largest - 1} blocks" in err and "--kv-cache-memory-fraction" in err and "--max-new-tokens" in err


def test_an_explicit_num_blocks_is_checked_against_the_budget(run):
    code, _, err, _ = run(2 * 10 * FP8_BLOCK_BYTES, "--num-blocks", "11")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("fp8lab generate: error: --num-blocks 11: ")
    assert "holds 10 blocks" in err and "lower --num-blocks or raise --kv-cache-memory-fraction" in err
    code, _, _, num_blocks = run(2 * 10 * FP8_BLOCK_BYTES, "--num-blocks", "10")
    assert code == 0 and num_blocks == 10


def test_bf16_on_the_reference_backend_is_budgeted_at_float32(run):
    """The NumPy cache keeps BF16 values in float32 arrays: 4 bytes per element, not 2."""
    blocks = sum(worst_case_blocks())
    bytes_per_block = kv_block_bytes(CONFIG, 4, "bf16", numpy=True)
    assert run(2 * blocks * bytes_per_block, "--kv-cache-dtype", "bf16")[3] == blocks
    assert run(2 * blocks * bytes_per_block - 1, "--kv-cache-dtype", "bf16")[3] == blocks - 1


def test_a_huge_num_blocks_is_refused_instead_of_allocated(monkeypatch, tmp_path, capsys):
    """The real free memory: a terabyte-sized cache is an error naming the option, not an OOM kill."""
    install_fake_io(monkeypatch, tmp_path)
    err = one_line_error(capsys, ["generate", "--prompt", "hi", "--num-blocks", str(10**12)])
    assert "--num-blocks 1000000000000: " in err and "TiB of KV cache" in err
