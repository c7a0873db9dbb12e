"""The engine on the GPU: prefill and decode tokens per second against transformers BF16 and the roofline.

    python bench/engine.py [--out DIR] [--shapes qwen3-0.6b,qwen3-8b] [--batches 1,4,16]
                           [--prompt-len 512] [--decode-tokens 64] [--no-transformers] ...

For each shape (``fp8lab.engine.shapes``: random FP8 checkpoints of the Qwen3-0.6B and Qwen3-8B
architectures, built in memory, seeded) and each batch size it measures, in one process on one GPU:

1. **ours**: ``fp8lab.engine.cuda.model.CudaQwen3Model`` over a paged KV cache (FP8 by default), driven
   by a plain loop of ``forward`` calls and ``fp8lab.engine.kv_manager`` (no scheduler): a warm-up run
   first (kernel compilation, CUDA-graph capture for this batch size), then a timed run. Prefill:
   the wall time of one ``forward`` of all the batch's prompts (``P`` random token ids each), the
   faster of the two runs.
   Decode: ``W`` untimed steps, then ``N`` timed steps of one greedy token per sequence (EOS
   ignored), pipelined as ``fp8lab.engine.generate`` runs them (``submit_greedy``: the next step's
   ``make_batch`` and graph launch, its token ids fed on the device, before this step's ids are read;
   ``fp8lab.engine.cuda.pipeline``); a step's time is the host wall time from one step's ids to the
   next's, i.e. what a user of the engine waits for. The logits are checked to be finite before anything is reported.
2. **transformers** BF16: ``Qwen3ForCausalLM`` from a ``Qwen3Config`` of the same shape, random
   init, ``dtype=bfloat16`` on the GPU (default attention, sdpa), after the engine is freed.
   Prefill: one forward of the prompts (``logits_to_keep=1``, median of 3 after a warm-up). Decode:
   ``(t(generate N + 1 tokens) - t(generate 1 token)) / N`` (``do_sample=False``,
   ``min_new_tokens`` = ``max_new_tokens``), so the prompt and the first token cancel out.
3. **roofline**: bytes a decode step must read (``fp8lab.engine.shapes.decode_bytes_per_step``: FP8
   weights, F32 scales, BF16 ``lm_head``, norms, embedding rows, KV cache at the average context
   of the timed steps) divided by the device-to-device copy bandwidth measured at the start
   (``bench/timing.copy_bandwidth_tb_s``, bytes read + written); batch / that time = tokens/s.

4. **where a decode step's time goes** (``--profile-steps N``, default 20; 0: off): after the timed
   runs of every shape and batch (a ``torch.profiler`` session leaves CUPTI attached to the process, and
   from then on every CUDA-graph launch costs the host about 0.35 us more per kernel node: 105 us for a
   300-kernel graph, measured on an H200, 2026-12-02), a fresh prefill and step per batch, then ``N`` more
   replays of that step under ``torch.profiler`` (CUPTI kernel times), each
   kernel attributed to the labelled launch of the model's plan that made it
   (``bench/decode_profile.py``): microseconds and launches per label, kernels per step, kernel
   time, and the gaps between kernels, as a table per (shape, batch) in ``engine_results.md``; and the same
   for the batch's prefill forward (``PREFILL_PROFILE_REPEATS`` eager forwards of its prompts under the
   profiler, ``decode_profile.profile_prefill``).

It also reports the model's ``stats`` (launches per decode step, host time per step). Results go
to ``engine_results.md`` (a Markdown table with the command, date and GPU), ``engine_results.json``
and ``engine.png`` (decode tokens/s bars: ours, transformers, roofline, per shape and batch) in
``--out``; they are rewritten after every phase, so a run cut short still leaves what it measured.
GPU memory: one model at a time (ours is deleted, ``torch.cuda.empty_cache()``, then the peer).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a source checkout runs without installing fp8lab

from fp8lab.engine import shapes  # noqa: E402

T0 = time.perf_counter()

DEFAULT_SHAPES = ("qwen3-0.6b", "qwen3-8b")
DEFAULT_BATCHES = (1, 4, 16)
PREFILL_PROFILE_REPEATS = 3
"""Eager prefill forwards profiled per batch for the prefill breakdown (after one unprofiled warm-up)."""


def _shape_list(text: str) -> list[str]:
    names = [s for s in text.split(",") if s]
    unknown = [n for n in names if n not in shapes.shape_names(include_test=True)]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown shapes {unknown} (choose from {', '.join(shapes.shape_names())})")
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (``python bench/engine.py --help``)."""
    p.add_argument("--shapes", type=_shape_list, default=list(DEFAULT_SHAPES), metavar="A,B",
                   help=f"comma-separated shapes (default {','.join(DEFAULT_SHAPES)}; also: tiny)")
    p.add_argument("--batches", type=_int_list, default=list(DEFAULT_BATCHES), metavar="B,B",
                   help=f"comma-separated batch sizes (default {','.join(map(str, DEFAULT_BATCHES))})")
    p.add_argument("--prompt-len", type=_positive, default=512, metavar="P", help="random prompt tokens per sequence (default 512)")
    p.add_argument("--decode-tokens", type=_positive, default=64, metavar="N",
                   help="timed decode steps, greedy, EOS ignored (default 64)")
    p.add_argument("--warmup-steps", type=int, default=3, metavar="W",
                   help="untimed decode steps before the timed ones (graph capture; default 3)")
    p.add_argument("--kv-cache-dtype", choices=["fp8", "bf16"], default="fp8", help="our KV cache (default fp8)")
    p.add_argument("--block-size", type=_positive, default=16, metavar="B", help="tokens per KV cache block (default 16)")
    p.add_argument("--layers", type=_positive, default=None, metavar="L",
                   help="override every shape's layer count (quick runs; the roofline follows)")
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="benchmark this checkpoint folder instead of random --shapes")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random weights and prompts (default 0)")
    p.add_argument("--f32-max-rows", type=int, default=None, metavar="R",
                   help="our GEMMs of at most R rows take float32 activations, larger ones BF16 (default: the engine's)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers BF16 peer")
    p.add_argument("--profile-steps", type=int, default=20, metavar="N",
                   help="replayed decode steps profiled for the per-kernel breakdown (CUPTI via torch.profiler; 0: none)")
    p.add_argument("--transformers-batches", type=_int_list, default=None, metavar="B,B",
                   help="batches at which to run the transformers peer (default: all of --batches)")
    p.add_argument("--threads", type=_positive, default=None, metavar="T",
                   help="CPU threads that build the random weights (default: all cores, at most 32)")
    p.add_argument("--out", type=Path, default=Path("engine-bench"), metavar="DIR",
                   help="folder for engine_results.md, engine_results.json and engine.png (default ./engine-bench)")



def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {message}", flush=True)


@dataclass
class Row:
    """One (shape, batch) of the table; times in seconds, rates in tokens per second."""

    shape: str
    batch: int
    prompt_len: int
    decode_tokens: int
    avg_context: float
    bytes_per_step: float
    roofline_tok_s: float
    ours_prefill_tok_s: float | None = None
    ours_first_prefill_tok_s: float | None = None
    ours_decode_tok_s: float | None = None
    ours_step_ms: list[float] = field(default_factory=list)
    launches_per_step: float | None = None
    host_us_per_step: float | None = None
    model_stats: dict = field(default_factory=dict)
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None
    decode_profile: dict | None = None
    prefill_profile: dict | None = None
    errors: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# helpers


def free_gpu_memory() -> None:
    """Release what deleted models held: Numba's deferred deallocations and torch's cache."""
    gc.collect()
    try:
        from numba import cuda

        cuda.current_context().deallocations.clear()
    except Exception:  # noqa: BLE001 - best effort
        pass
    try:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def gpu_memory_line() -> str:
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        return f"GPU memory {(total - free) / 2**30:.1f} of {total / 2**30:.0f} GiB in use"
    except Exception:  # noqa: BLE001
        return "GPU memory: unknown"


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) else None


def host_us_per_step(stats: dict) -> float | None:
    """The model's host time per replayed (CUDA-graph) decode step in microseconds: ``host_us_per_replay``
    when the model reports it (the eager first step of each bucket compiles kernels and would swamp a
    mean), else whichever ``stats`` key holds host time (``host`` in its name; unit from its suffix)."""
    if _number(stats.get("host_us_per_replay")) is not None and np.isfinite(stats["host_us_per_replay"]):
        return float(stats["host_us_per_replay"])
    for key, value in stats.items():
        v = _number(value)
        if v is None or "host" not in key:
            continue
        parts = key.lower().split("_")
        if "us" in parts:
            return v
        if "ms" in parts:
            return v * 1e3
        if "s" in parts or "seconds" in parts or "sec" in parts:
            return v * 1e6
    return None


def check_logits(logits: np.ndarray, batch: int, vocab: int, what: str) -> None:
    if logits.shape != (batch, vocab):
        raise RuntimeError(f"{what}: logits of shape {logits.shape}, expected {(batch, vocab)}")
    if not np.all(np.isfinite(logits)):
        raise RuntimeError(f"{what}: {int((~np.isfinite(logits)).sum())} non-finite logits")


def random_prompts(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 1]).integers(0, vocab, (batch, length), dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# ours


def run_once(model, prompts: np.ndarray, warmup: int, steps: int, block_size: int, kv_cache_dtype: str,
             profile_steps: int = 0) -> dict:
    """Prefill ``prompts`` ``[B, P]`` in one forward, then ``warmup + steps`` greedy decode steps; then, with
    ``profile_steps``, that many more replays of the last step under the profiler and ``PREFILL_PROFILE_REPEATS``
    prefill forwards of the prompts (``decode_profile``)."""
    from fp8lab.engine.kv_manager import KVCacheManager, blocks_for
    from fp8lab.engine.model import make_batch

    batch, length = prompts.shape
    vocab = model.config.vocab_size
    per_seq = blocks_for(length + warmup + steps, block_size)
    manager = KVCacheManager(batch * per_seq, block_size)
    for i in range(batch):
        manager.add_sequence(i)
    cache = model.allocate_kv_cache(batch * per_seq, block_size, kv_cache_dtype)
    prefill = make_batch(manager, [(i, prompts[i].tolist()) for i in range(batch)])
    start = time.perf_counter()
    first = model.forward(prefill, cache)
    first_prefill_s = time.perf_counter() - start
    # the same prompts again (the same slots, the same K/V written): what every later prompt of the bucket costs, a
    # graph replay where the model captured the first (CudaQwen3Model.prefill_shape), bit for bit the first's logits
    start = time.perf_counter()
    logits = model.forward(prefill, cache)
    prefill_s = time.perf_counter() - start
    check_logits(logits, batch, vocab, f"prefill, batch {batch}")
    if not np.array_equal(np.asarray(first).view(np.uint32), np.asarray(logits).view(np.uint32)):
        raise RuntimeError(f"prefill, batch {batch}: a second prefill of the same prompts changed the logits")
    tokens = np.argmax(logits, axis=-1)
    # greedy decode as fp8lab.engine.generate.ContinuousBatch runs it on the GPU model (submit_greedy): step n + 1
    # is enqueued, its token ids taken on the device from step n, before step n's ids are read on the host
    step_s, pending, total = [], None, warmup + steps
    for n in range(total):
        start = time.perf_counter()
        if pending is None:
            last = make_batch(manager, [(i, [int(tokens[i])]) for i in range(batch)])
            current = model.submit_greedy(last, cache)
        else:
            current = pending
        pending = None
        if n + 1 < total:
            last = make_batch(manager, [(i, [0]) for i in range(batch)])  # placeholder ids: fed from ``current``
            pending = model.submit_greedy(last, cache, feed=current)
        inputs, tokens = tokens, current.tokens()
        step_s.append(time.perf_counter() - start)
    # the last step once more with its logits (its real token ids, the same slots, the same K/V written again):
    # all finite, and the device's greedy choice is the host's argmax of them
    step = dataclasses.replace(last, token_ids=np.asarray(inputs, dtype=np.int64))
    logits = model.forward(step, cache)
    check_logits(logits, batch, vocab, f"decode, batch {batch}")
    if not np.array_equal(np.asarray(tokens), np.argmax(logits, axis=-1)):
        raise RuntimeError(f"decode, batch {batch}: the greedy tokens are not the argmax of the logits")
    profile = prefill_profile = None
    if profile_steps:
        from decode_profile import profile_decode_steps, profile_prefill

        profile = profile_decode_steps(model, step, cache, profile_steps).as_dict()
        # the prompts' forward again: the same slots, the same K/V written, the same work
        prefill_profile = profile_prefill(model, prefill, cache, PREFILL_PROFILE_REPEATS).as_dict()
    del cache
    stats = getattr(model, "stats", None)
    stats = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats or {})  # CudaModelStats, or a test's dict
    return {"prefill_s": prefill_s, "first_prefill_s": first_prefill_s, "step_s": step_s[warmup:], "stats": stats, "profile": profile,
            "prefill_profile": prefill_profile}


def bench_ours(checkpoint, prompts: np.ndarray, rows: dict, args):
    """Fill the ``ours_*`` fields of ``rows`` (batch -> Row); errors are recorded per batch. Returns the model,
    for ``profile_ours`` to profile after every timing."""
    from fp8lab.engine.cuda.model import CudaQwen3Model

    max_batch = max(args.batches)
    # the engine's defaults (f32_max_rows among them), as fp8lab generate runs them
    limits = {"max_num_tokens": max_batch * args.prompt_len, "max_num_seqs": max_batch}
    if args.f32_max_rows is not None:  # a row that is not the engine's default says so in the command line
        limits["f32_max_rows"] = args.f32_max_rows
    start = time.perf_counter()
    model = CudaQwen3Model.from_checkpoint(checkpoint, **limits)
    log(f"  ours: model on the GPU in {time.perf_counter() - start:.1f} s; {gpu_memory_line()}")
    for batch in args.batches:
        row = rows[batch]
        try:
            start = time.perf_counter()
            warm = run_once(model, prompts[:batch], 0, max(1, args.warmup_steps), args.block_size, args.kv_cache_dtype)
            log(f"  ours: batch {batch} warm-up (compile, graph capture) {time.perf_counter() - start:.1f} s")
            r = run_once(model, prompts[:batch], args.warmup_steps, args.decode_tokens, args.block_size, args.kv_cache_dtype)
        except Exception as e:  # noqa: BLE001 - keep the other batches' results
            traceback.print_exc()
            row.errors.append(f"ours: {type(e).__name__}: {e}")
            log(f"  ours: batch {batch} FAILED: {e}")
            continue
        decode_s = sum(r["step_s"])
        # the warm-up run's prefill is the same work: the faster of the two (compilation happens in the first)
        row.ours_prefill_tok_s = batch * args.prompt_len / min(r["prefill_s"], warm["prefill_s"])
        # a fresh cache's first prefill of the bucket: eager launches, then the graph capture (the warm-up run compiled)
        row.ours_first_prefill_tok_s = batch * args.prompt_len / r["first_prefill_s"]
        row.ours_decode_tok_s = batch * len(r["step_s"]) / decode_s
        row.ours_step_ms = [round(s * 1e3, 4) for s in r["step_s"]]
        row.model_stats = {k: v for k, v in r["stats"].items() if _number(v) is not None or isinstance(v, str)}
        row.launches_per_step = _number(r["stats"].get("launches_per_decode_step"))
        row.host_us_per_step = host_us_per_step(r["stats"])
        log(f"  ours: batch {batch}: prefill {row.ours_prefill_tok_s:,.0f} tok/s (first {row.ours_first_prefill_tok_s:,.0f}), decode {row.ours_decode_tok_s:,.1f} tok/s "
            f"(median step {1e3 * statistics.median(r['step_s']):.2f} ms; roofline {row.roofline_tok_s:,.1f} tok/s); "
            f"stats {row.model_stats}")
    return model


def profile_ours(model, prompts: np.ndarray, rows: dict, args) -> None:
    """The per-kernel breakdown of each batch's decode step (``decode_profile``) into ``rows``; then the model is
    released. Runs after every timed run of the benchmark (see the module docstring: the profiler slows the
    host side of every later graph launch)."""
    try:
        for batch, row in rows.items():
            if row.errors or row.ours_decode_tok_s is None:
                continue
            try:
                r = run_once(model, prompts[:batch], 0, 1, args.block_size, args.kv_cache_dtype, args.profile_steps)
                row.decode_profile = r["profile"]
                row.prefill_profile = r["prefill_profile"]
            except Exception as e:  # noqa: BLE001 - keep the other batches' breakdowns
                traceback.print_exc()
                row.errors.append(f"ours, profile: {type(e).__name__}: {e}")
    finally:
        del model
        free_gpu_memory()


# ----------------------------------------------------------------------------------------------
# transformers


def hf_config_dict(config) -> dict:
    """Our ``config.json`` dict without the quantization (transformers runs the BF16 model)."""
    d = config.to_dict()
    d.pop("quantization_config", None)
    return d


def time_transformers(model, ids, decode_tokens: int, device: str) -> tuple[float, float, float]:
    """Seconds of one prefill forward (median of 3 after a warm-up), of ``generate`` of 1 token
    and of ``generate`` of ``1 + decode_tokens`` tokens, for the prompts ``ids`` ``[B, P]``."""
    import torch

    batch, length = ids.shape
    mask = torch.ones_like(ids)

    def timed(fn) -> float:
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def prefill():
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

    def generate(n):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.shape == (batch, length + n), out.shape

    with torch.inference_mode():
        timed(prefill)
        prefill_s = statistics.median(timed(prefill) for _ in range(3))
        timed(lambda: generate(2))
        first = timed(lambda: generate(1))
        full = timed(lambda: generate(1 + decode_tokens))
    return prefill_s, first, full


def bench_transformers(config, prompts: np.ndarray, rows: dict, batches: list[int], decode_tokens: int,
                       device: str = "cuda") -> str:  # fmt: skip
    """Fill the ``hf_*`` fields of ``rows``; returns the transformers version. (``device="cpu"``
    runs the same code path on the CPU, for a test with a tiny shape.)"""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    hf_config = transformers.Qwen3Config.from_dict(hf_config_dict(config))
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.eval()
    memory = gpu_memory_line() if device != "cpu" else "on the CPU"
    log(f"  transformers {transformers.__version__}: random BF16 model in {time.perf_counter() - start:.1f} s; {memory}")
    length = prompts.shape[1]

    try:
        for batch in batches:
            row = rows[batch]
            ids = torch.from_numpy(prompts[:batch]).to(device)
            try:
                prefill_s, first, full = time_transformers(model, ids, decode_tokens, device)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row.errors.append(f"transformers: {type(e).__name__}: {e}")
                log(f"  transformers: batch {batch} FAILED: {e}")
                continue
            row.hf_prefill_tok_s = batch * length / prefill_s
            row.hf_decode_tok_s = batch * decode_tokens / (full - first)
            log(f"  transformers: batch {batch}: prefill {row.hf_prefill_tok_s:,.0f} tok/s, decode {row.hf_decode_tok_s:,.1f} tok/s")
    finally:
        del model
        free_gpu_memory()
    return transformers.__version__


# ----------------------------------------------------------------------------------------------
# the report


def _fmt(value, spec: str = ",.0f") -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(a, b) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def report(rows: list[Row], meta: dict, breakdowns: dict) -> str:
    lines = [
        f"### Engine prefill and decode, {meta['date']}, {meta['gpu']}",
        "",
        f"Command: `{meta['command']}`. Copy bandwidth (read + write): {meta['copy_tb_s']:.2f} TB/s. "
        f"Random FP8 checkpoints (`fp8lab.engine.shapes`: random E4M3 codes and block scales, BF16 embeddings), "
        f"{meta['prompt_len']} random prompt tokens per sequence, {meta['decode_tokens']} timed greedy decode steps after "
        f"{meta['warmup_steps']} untimed ones (EOS ignored), KV cache {meta['kv_cache_dtype']}, block {meta['block_size']}. "
        "Ours: `CudaQwen3Model`, host wall time per step, pipelined as `fp8lab generate` runs it (`submit_greedy`: the "
        "CUDA-graph decode step with the argmax on the device, the next step enqueued with its token ids fed on the "
        "device before this step's ids come to the host); prefill is one forward of the whole batch, timed the second time "
        "its prompts run in a cache (a CUDA-graph replay of its padded shape; \"first prefill\": the cache's first, "
        "eager launches and the capture). "
        f"transformers {meta.get('transformers', 'n/a')} BF16 (random init, sdpa): prefill one forward "
        "(`logits_to_keep=1`), decode (generate of N + 1 tokens - generate of 1) / N. Roofline: bytes read per decode "
        "step (FP8 weights + F32 scales + BF16 lm_head + norms + embedding rows + KV cache at the average context) / copy "
        "bandwidth.",
        "",
        "| shape | batch | prefill tok/s ours | first prefill tok/s ours | prefill tok/s transformers | decode tok/s ours | decode tok/s transformers "
        "| decode roofline tok/s | ours / roofline | ours / transformers (decode) | MB read per step | launches per step "
        "| host us per replayed step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pct = "n/a" if r.ours_decode_tok_s is None else f"{100 * r.ours_decode_tok_s / r.roofline_tok_s:.0f}%"
        lines.append(
            f"| {r.shape} | {r.batch} | {_fmt(r.ours_prefill_tok_s)} | {_fmt(r.ours_first_prefill_tok_s)} | {_fmt(r.hf_prefill_tok_s)} | {_fmt(r.ours_decode_tok_s, ',.1f')} "
            f"| {_fmt(r.hf_decode_tok_s, ',.1f')} | {r.roofline_tok_s:,.1f} | {pct} | {_ratio(r.ours_decode_tok_s, r.hf_decode_tok_s)} "
            f"| {r.bytes_per_step / 1e6:,.1f} | {_fmt(r.launches_per_step, '.0f')} | {_fmt(r.host_us_per_step, ',.0f')} |"
        )
    lines.append("")
    for shape, b in breakdowns.items():
        lines.append(f"- {shape}: bytes per decode step at batch 1, context {b['context']:.0f}: weights {b['weights'] / 1e9:.3f} GB, "
                     f"scales {b['scales'] / 1e6:.1f} MB, lm_head {b['lm_head'] / 1e9:.3f} GB, KV cache {b['kv_cache'] / 1e6:.2f} MB "
                     f"(+{b['kv_per_seq'] / 1e6:.2f} MB per extra sequence); {b['params'] / 1e9:.2f} B parameters.")
    for r in rows:
        if r.decode_profile:
            from decode_profile import DecodeProfile, breakdown_table

            p = dict(r.decode_profile)
            p.pop("gap_us", None)
            lines.append("")
            lines.append(breakdown_table(DecodeProfile(**p), f"#### Decode step breakdown, {r.shape}, batch {r.batch}"))
        if r.prefill_profile:
            from decode_profile import DecodeProfile, breakdown_table

            p = dict(r.prefill_profile)
            p.pop("gap_us", None)
            lines.append("")
            lines.append(breakdown_table(DecodeProfile(**p), f"#### Prefill forward breakdown, {r.shape}, batch {r.batch} "
                                                            f"({r.batch} x {r.prompt_len} tokens)"))
    for r in rows:
        if r.model_stats:
            lines.append(f"- {r.shape} batch {r.batch}, model stats: `{json.dumps(r.model_stats)}`")
        for e in r.errors:
            lines.append(f"- {r.shape} batch {r.batch}: **error** {e}")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape_names = list(dict.fromkeys(r.shape for r in rows))
    fig, axes = plt.subplots(1, len(shape_names), figsize=(5.5 * len(shape_names), 4.5), squeeze=False)
    series = [("ours (FP8, CUDA engine)", "ours_decode_tok_s", "C0"), ("transformers BF16 generate", "hf_decode_tok_s", "C1"),
              ("bandwidth roofline (FP8)", "roofline_tok_s", "0.6")]
    width = 0.27
    for ax, shape in zip(axes[0], shape_names):
        srows = [r for r in rows if r.shape == shape]
        x = np.arange(len(srows))
        for i, (label, attr, color) in enumerate(series):
            values = [getattr(r, attr) or 0.0 for r in srows]
            bars = ax.bar(x + (i - 1) * width, values, width, label=label, color=color)
            if attr == "ours_decode_tok_s":
                for bar, r in zip(bars, srows):
                    if r.ours_decode_tok_s:
                        ax.annotate(f"{100 * r.ours_decode_tok_s / r.roofline_tok_s:.0f}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [f"batch {r.batch}" for r in srows])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.set_title(f"{shape}: decode, prompt {srows[0].prompt_len}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Qwen3 decode throughput (labels: ours as % of the roofline)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out: Path, rows: list[Row], meta: dict, breakdowns: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_results.md").write_text(report(rows, meta, breakdowns))
    (out / "engine_results.json").write_text(json.dumps({"meta": meta, "breakdowns": breakdowns, "rows": [asdict(r) for r in rows]}, indent=1))
    if rows:
        plot(rows, out / "engine.png")


# ----------------------------------------------------------------------------------------------
# the run


def targets(args):
    """``(label, config, build_checkpoint)`` for each model to benchmark."""
    if args.model is not None:
        from fp8lab.engine.checkpoint import load_checkpoint, read_config

        config = read_config(args.model)
        return [(args.model.name, config, lambda: load_checkpoint(args.model, progress=False))]
    out = []
    for name in args.shapes:
        config = shapes.shape_config(name, args.layers)
        label = name if args.layers is None else f"{name} ({args.layers} layer{'' if args.layers == 1 else 's'})"
        out.append((label, config, lambda name=name: shapes.random_checkpoint(name, args.seed, args.layers, threads=args.threads)))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        raise RuntimeError("the engine benchmark needs torch (for the copy bandwidth and the transformers peer)") from None
    if not torch.cuda.is_available():
        raise RuntimeError("the engine benchmark needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    from timing import copy_bandwidth_tb_s

    from fp8lab.numba_kernels.inlining import install as faster_inlining

    faster_inlining()  # compiles in about half the time, the same PTX: only the warm-up's log line changes

    hf_batches = [b for b in (args.transformers_batches or args.batches) if b in args.batches]
    meta = {
        "date": str(datetime.date.today()),
        "gpu": torch.cuda.get_device_name(),
        "command": " ".join(["fp8lab" if Path(sys.argv[0]).name == "fp8lab" else f"python {sys.argv[0]}"] + sys.argv[1:]),
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "warmup_steps": args.warmup_steps,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "seed": args.seed,
    }
    log(f"{meta['gpu']}; torch {torch.__version__}; measuring the copy bandwidth")
    meta["copy_tb_s"] = copy_tb_s = copy_bandwidth_tb_s()
    log(f"copy bandwidth {copy_tb_s:.2f} TB/s (read + write)")
    all_rows: list[Row] = []
    breakdowns: dict = {}
    to_profile = []  # (model, prompts, rows) of each shape: profiled after every timing
    avg_context = args.prompt_len + args.warmup_steps + (args.decode_tokens + 1) / 2
    for label, config, build in targets(args):
        if args.prompt_len + args.warmup_steps + args.decode_tokens >= config.max_position_embeddings:
            raise ValueError(f"{label}: prompt + decode tokens exceed max_position_embeddings {config.max_position_embeddings}")
        rows = {}
        for batch in args.batches:
            b = shapes.decode_bytes_per_step(config, batch, avg_context, args.kv_cache_dtype)
            rows[batch] = Row(label, batch, args.prompt_len, args.decode_tokens, avg_context, b.total,
                              batch / (b.total / (copy_tb_s * 1e12)))
        b1 = shapes.decode_bytes_per_step(config, 1, avg_context, args.kv_cache_dtype)
        breakdowns[label] = {**asdict(b1), "context": avg_context, "params": shapes.parameter_counts(config)["total"],
                             "kv_per_seq": b1.kv_cache + b1.embedding_rows}
        all_rows.extend(rows.values())
        prompts = random_prompts(config.vocab_size, max(args.batches), args.prompt_len, args.seed)
        log(f"{label}: {config.num_hidden_layers} layers, hidden {config.hidden_size}; building the checkpoint")
        start = time.perf_counter()
        try:
            checkpoint = build()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            for r in rows.values():
                r.errors.append(f"checkpoint: {type(e).__name__}: {e}")
            write_results(args.out, all_rows, meta, breakdowns)
            continue
        log(f"{label}: checkpoint ready in {time.perf_counter() - start:.1f} s")
        try:
            model = bench_ours(checkpoint, prompts, rows, args)
            if args.profile_steps:
                to_profile.append((model, prompts, rows))
            del model  # released below unless it waits for its profile
        except Exception as e:  # noqa: BLE001 - e.g. fp8lab.engine.cuda missing: still run the peer
            traceback.print_exc()
            for r in rows.values():
                r.errors.append(f"ours: {type(e).__name__}: {e}")
        del checkpoint
        free_gpu_memory()
        write_results(args.out, all_rows, meta, breakdowns)
        if not args.no_transformers and hf_batches:
            try:
                meta["transformers"] = bench_transformers(config, prompts, rows, hf_batches, args.decode_tokens)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                for r in rows.values():
                    r.errors.append(f"transformers: {type(e).__name__}: {e}")
            write_results(args.out, all_rows, meta, breakdowns)
    while to_profile:
        profile_ours(*to_profile.pop(0), args)
        write_results(args.out, all_rows, meta, breakdowns)
    table = report(all_rows, meta, breakdowns)
    print(table, flush=True)
    log(f"wrote {args.out / 'engine_results.md'}, engine_results.json and engine.png")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
