"""``fp8lab eval``: perplexity of a checkpoint over a text, or a table comparing numeric formats.

- ``fp8lab eval [--model DIR] [--text FILE] [--chunk 512] [--max-tokens N] [--kv-cache-dtype fp8|bf16|fp32]
  [--gemm-input float32|bf16] [--backend auto|reference|cuda|cudasim] [--json FILE]``: the perplexity of
  the checkpoint as it is (FP8 or BF16 weights) in non-overlapping chunks, with tokens per second
  (``fp8lab.engine.evaluate`` states the protocol).
- ``fp8lab eval --compare [--compare-backends] [--prompts 16 --prompt-tokens 32 --new-tokens 32] ...``:
  the rows of ``fp8lab.engine.evaluate.default_rows`` (BF16 / FP8 weights, BF16 / FP8 KV cache, float32 / BF16
  GEMM inputs) over the same chunks and prompts, as one table: perplexity, its deviation from the
  comparison row and from the all-BF16 baseline, mean KL divergence, greedy agreement, tokens per
  second. ``--model`` must be a BF16 checkpoint; its FP8 twin is quantized in memory (128 x 128
  blocks, as ``fp8lab quantize``). ``--compare-backends`` (implies ``--compare``) adds the same rows on
  the GPU kernels (``cuda``; with ``--backend cudasim``, the kernels in Numba's CUDA simulator), each
  compared with its twin on the reference backend.

``--backend cudasim`` is for testing the kernels on micro models: the simulator runs every GPU thread in
Python, about ten minutes per token on the demo model, so a bigger model needs ``--allow-slow-simulator``
(``fp8lab.engine.loading.simulator_too_slow``).

Defaults: ``--model``: the embedded demo model (FP8 for a perplexity run, BF16 for ``--compare``;
``_default_model``); ``--text``: the shipped held-out text (``fp8lab.engine.evaluate.default_eval_text``).
The report goes to stdout, progress bars to stderr; ``--json FILE`` writes every number and the
settings (``fp8lab.engine.evaluate.evaluation_json``). Errors (bad options, a missing file, a text too
short) print one line to stderr and exit 1 (Ctrl-C: 130, ``fp8lab.cli``); so does a NaN or infinite
logit, after the report, whose numbers then read ``nan``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .backend import GEMM_INPUTS
from .kv_manager import KVCacheExhausted
from .loading import BACKEND_CHOICES, SIMULATOR_HELP

SCHEMA_VERSION = 1


def _default_model(fp8: bool) -> Path:
    """The checkpoint used without ``--model``: the embedded demo model (FP8 or BF16)."""
    from .demo import default_model_dir

    return default_model_dir(fp8=fp8)


def register(subparsers) -> None:
    """Add ``eval`` to the ``fp8lab`` parser."""
    p = subparsers.add_parser(
        "eval",
        help="perplexity over a text, or a table comparing BF16/FP8 weights, KV cache and GEMM inputs",
        description="Perplexity of a checkpoint over a text in non-overlapping chunks, each from an empty KV "
        "cache (the protocol of published perplexity tables), with tokens per second. With --compare: BF16 / "
        "FP8 weights, BF16 / FP8 KV cache and float32 / BF16 GEMM inputs over the same text and prompts, in one "
        "table (perplexity and its deviation, KL divergence, greedy agreement).",
    )
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="checkpoint directory (with tokenizer.json); --compare needs a BF16 one; default: the embedded "
                   "demo model")
    p.add_argument("--text", type=Path, default=None, metavar="FILE",
                   help="UTF-8 text to evaluate on; default: the shipped held-out text")
    p.add_argument("--chunk", type=int, default=512, metavar="N", help="tokens per chunk (default 512)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="evaluate only the first N tokens of the text (quick runs)")
    p.add_argument("--kv-cache-dtype", choices=["fp8", "bf16", "fp32"], default=None,
                   help="KV cache format of a perplexity run (default fp8; --compare sets it per row)")
    p.add_argument("--gemm-input", choices=GEMM_INPUTS, default=None,
                   help="format of the activations entering the FP8 GEMMs and the lm_head in a perplexity run (default float32; "
                   "--compare sets it per row)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="backend of every row: reference (NumPy), cuda (the GPU kernels), " + SIMULATOR_HELP +
                   ", auto (default): cuda when there is a GPU")
    p.add_argument("--allow-slow-simulator", action="store_true",
                   help="run --backend cudasim on a model bigger than a micro model anyway (minutes per token)")
    p.add_argument("--compare", action="store_true",
                   help="run the comparison table instead of one perplexity (needs a BF16 --model)")
    p.add_argument("--compare-backends", action="store_true",
                   help="with the comparison on the reference backend, the same rows on the GPU kernels (cuda; "
                   "cudasim with --backend cudasim), each against its reference twin; implies --compare")
    p.add_argument("--prompts", type=int, default=16, metavar="N", help="greedy agreement: prompts (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=32, metavar="P",
                   help="greedy agreement: tokens per prompt, cut from the text (default 32)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="T",
                   help="greedy agreement: greedy tokens per prompt and row (default 32)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write every number and setting as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_eval_command)


def _eval_command(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KVCacheExhausted as e:
        print(f"fp8lab eval: {e}", file=sys.stderr)
    except MemoryError as e:
        print(f"fp8lab eval: out of memory ({e or type(e).__name__}); lower --chunk, --prompts or --max-tokens",
              file=sys.stderr)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"fp8lab eval: error: {e}", file=sys.stderr)
    return 1


def _check_options(args: argparse.Namespace, compare: bool) -> None:
    """One ``ValueError`` naming the first bad option."""
    if args.chunk < 2:
        raise ValueError(f"--chunk: expected at least 2 tokens (one to condition on, one to predict), got {args.chunk}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens: expected at least 2, got {args.max_tokens}")
    for option, value in (("--prompts", args.prompts), ("--prompt-tokens", args.prompt_tokens),
                          ("--new-tokens", args.new_tokens)):
        if value < 1:
            raise ValueError(f"{option}: expected at least 1, got {value}")
    if compare:
        for option, value in (("--kv-cache-dtype", args.kv_cache_dtype), ("--gemm-input", args.gemm_input)):
            if value is not None:
                raise ValueError(f"{option}: not with --compare, whose rows set it")
    if args.model is not None and not args.model.is_dir():
        raise ValueError(f"--model {args.model}: not a directory")
    if args.text is not None and not args.text.is_file():
        raise ValueError(f"--text {args.text}: no such file")


def _check_lengths(config, longest_chunk: int, greedy_tokens: int | None) -> None:
    """Chunks and greedy runs must fit in the model's positions."""
    max_pos = config.max_position_embeddings
    if longest_chunk > max_pos:
        raise ValueError(f"--chunk: chunks of {longest_chunk} tokens exceed the model's max_position_embeddings {max_pos}")
    if greedy_tokens is not None and greedy_tokens > max_pos:
        raise ValueError(f"--prompt-tokens + --new-tokens = {greedy_tokens} exceeds the model's "
                         f"max_position_embeddings {max_pos}")


def _run(args: argparse.Namespace) -> int:
    # imported here: the I/O half (checkpoint, tokenizer, tiny model) loads only when used
    from . import evaluate as ev
    from .checkpoint import load_checkpoint
    from .loading import check_simulator_size, gpu_available, resolve_backend
    from .tokenizer import Tokenizer

    compare = args.compare or args.compare_backends
    _check_options(args, compare)
    model_dir = args.model if args.model is not None else _default_model(fp8=not compare)
    text_path = args.text if args.text is not None else ev.default_eval_text()
    checkpoint = load_checkpoint(model_dir, progress=not args.quiet)
    if compare and checkpoint.is_fp8:
        raise ValueError(f"--model {model_dir}: an FP8 checkpoint; --compare needs the BF16 checkpoint it was "
                         "quantized from (it makes the FP8 weights itself)")
    if args.backend == "cudasim":
        check_simulator_size(checkpoint.config, args.allow_slow_simulator)
    tokenizer = Tokenizer.from_dir(model_dir)
    text = ev.read_eval_text(text_path, tokenizer, args.max_tokens)
    if len(text.ids) < 2:
        raise ValueError(f"--text {text_path}: {len(text.ids)} token(s) after tokenizing; perplexity needs at least 2")
    chunks = ev.split_chunks(text.ids, args.chunk)
    longest = max(len(c) for c in chunks)
    settings = {"fp8lab_eval": SCHEMA_VERSION, "mode": "compare" if compare else "perplexity",
                "model": str(model_dir), "text": str(text_path), "text_sha256": text.sha256,
                "text_tokens": text.total_tokens, "eval_tokens": len(text.ids), "max_tokens": args.max_tokens,
                "chunk": args.chunk}
    progress = not args.quiet

    if compare:
        backend, kernel_backend = resolve_backend(args.backend, checkpoint.config), None
        if args.compare_backends:
            kernel_backend = "cudasim" if args.backend == "cudasim" else "cuda"
            if kernel_backend == "cuda" and not gpu_available():
                raise ValueError("--compare-backends: numba-cuda sees no NVIDIA GPU (--backend cudasim compares with "
                                 "the kernels in the CUDA simulator)")
            backend = "reference"
        _check_lengths(checkpoint.config, longest, args.prompt_tokens + args.new_tokens)
        offsets, prompts = ev.greedy_prompts(text.ids, args.prompts, args.prompt_tokens)
        rows = ev.default_rows(backend, kernel_backend)
        checkpoints = {"bf16": checkpoint, "fp8": ev.fp8_checkpoint(checkpoint)}
        runners = ev.build_runners(checkpoints, [r.config for r in rows], max_len=max(longest, args.prompt_tokens),
                                   num_seqs=args.prompts, max_cached_tokens=args.prompt_tokens + args.new_tokens - 1)
        result = ev.evaluate(rows, runners, chunks, prompts, offsets, args.new_tokens, progress=progress)
        report = ev.format_table(result)
    else:
        _check_lengths(checkpoint.config, longest, None)
        config = ev.EvalConfig("fp8" if checkpoint.is_fp8 else "bf16", args.kv_cache_dtype or "fp8",
                               args.gemm_input or "float32", resolve_backend(args.backend, checkpoint.config))
        runners = ev.build_runners({config.weights: checkpoint}, [config], max_len=longest)
        result = ev.evaluate([ev.CompareRow("perplexity", config)], runners, chunks, progress=progress)
        report = ev.format_perplexity(result, settings)

    print(report, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(ev.evaluation_json(result, settings), indent=1, allow_nan=False) + "\n",
                             encoding="utf-8")
    if not result.ok:
        bad = "; ".join(f"row {i} ({r.row.config.label}): {', '.join(r.nonfinite)}"
                        for i, r in enumerate(result.rows) if r.nonfinite)
        raise ValueError(f"non-finite results, the numbers above are not valid: {bad}")
    return 0
