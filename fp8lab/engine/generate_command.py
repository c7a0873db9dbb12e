"""``fp8lab generate``: text generation with the Qwen3-FP8 engine.

Without ``--model`` it runs the embedded demo model (``fp8lab.engine.demo``: a small Qwen3 trained on
Python's documentation and source), quantized to FP8 on first use (``fp8lab.engine.demo.default_model_dir``). Output: with one prompt the generated text streams to stdout piece by
piece; with several (``--prompt`` repeated: one batch) each completion is printed to stdout
under a ``=== [i] ===`` header as soon as its sequence finishes. The closing line (prompt and
decode tokens per second) goes to stderr, so stdout holds only generated text. Errors (a bad
model directory, an exhausted KV cache, bad options) print one line to stderr that names the
option and the fix, and exit 1 (Ctrl-C: 130, ``fp8lab.cli``).

Sampling is greedy unless ``--temperature`` is above 0 (the checkpoint's
``generation_config`` sampling defaults are not applied: the default run is reproducible);
``--top-k`` and ``--top-p`` filter what sampling draws from, so without a temperature they are an
error rather than silently ignored. Stop tokens are the tokenizer's, ``generation_config``'s and
``config.json``'s EOS ids. ``--max-new-tokens`` beyond what the model's positions leave after a
prompt is clamped (a note on stderr says to what): a sequence stops at ``max_position_embeddings``.

The KV cache (``_cache_blocks``): by default the batch's worst case (every prompt's ``prompt +
max_new_tokens - 1`` tokens), capped by a memory budget, ``--kv-cache-memory-fraction`` (default
0.5) of the memory available once the model is loaded: host memory (``MemAvailable``) for the
reference backend and the simulator, free GPU memory for ``cuda``. Under the cap the generator
admits requests in turn as blocks free up (``fp8lab.engine.generate``); a request that cannot fit even
alone is refused before any work. An explicit ``--num-blocks`` is checked against the same budget.
The rest of the memory is headroom: the reference backend's attention gathers a sequence's cache
into float64 temporaries. Where the system does not report free memory there is no cap.

Backends (``--backend``, ``fp8lab.engine.loading.load_model``): ``cuda`` runs ``fp8lab.engine.cuda`` on an
NVIDIA GPU, sized for this call (every prompt prefilled in one forward, every sequence in one decode
step); ``reference`` the NumPy model; ``cudasim`` the GPU model in Numba's CUDA simulator, which is
for testing the kernels on micro models (about ten minutes per token on the demo model, so bigger
models need ``--allow-slow-simulator``); ``auto`` (the default) ``cuda`` when a GPU is there, else
``reference``. The closing line names the backend used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp8lab.reference.kv_cache import BF16, FP8_E4M3

from .kv_manager import KVCacheExhausted
from .loading import BACKEND_CHOICES, SIMULATOR_HELP

DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.5
"""Share of the available memory the KV cache may take by default; the rest is headroom (``vLLM``'s
``--gpu-memory-utilization`` is the same idea, as a share of the whole GPU)."""


GENERATE_KV_FORMATS = {f.name: f for f in (FP8_E4M3, BF16)}
"""The KV cache formats ``--kv-cache-dtype`` offers (``fp32`` is for tests and ``fp8lab eval``)."""


def kv_format_argument(text: str):
    """``--kv-cache-dtype``'s value as its ``KVCacheFormat``, the one value that travels to the kernels."""
    if text not in GENERATE_KV_FORMATS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(GENERATE_KV_FORMATS)}, got {text!r}")
    return GENERATE_KV_FORMATS[text]


def add_kv_cache_dtype_option(p) -> None:
    p.add_argument("--kv-cache-dtype", dest="kv_format", type=kv_format_argument, default=FP8_E4M3, metavar="{fp8,bf16}",
                   help="KV cache storage: fp8 (E4M3 + one scale per token and kv head) or bf16 (default fp8)")


def add_backend_option(p) -> None:
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="cuda: the numba_kernels on an NVIDIA GPU; reference: NumPy on the CPU; " + SIMULATOR_HELP +
                   "; auto (default): cuda when numba-cuda sees a GPU and the kernels take the model, else reference")


def add_kv_cache_memory_option(p) -> None:
    p.add_argument("--kv-cache-memory-fraction", type=float, default=DEFAULT_KV_CACHE_MEMORY_FRACTION, metavar="F",
                   help="share of the memory available after loading the model (host memory; free GPU memory for "
                   f"cuda) that the KV cache may use, in (0, 1] (default {DEFAULT_KV_CACHE_MEMORY_FRACTION})")


def register(subparsers) -> None:
    """Add ``generate`` to the ``fp8lab`` parser."""
    p = subparsers.add_parser(
        "generate",
        help="generate text with a Qwen3 (FP8) checkpoint (GPU kernels or the CPU reference)",
        description="Prefill then decode a batch of prompts with the fp8lab engine (paged KV cache, "
        "FP8 weights with W8A16 numerics): on an NVIDIA GPU with the numba_kernels (--backend cuda), "
        "or on the CPU with the NumPy reference backend. With no --model, the embedded demo model is used "
        "(a small Qwen3 trained on Python's documentation and source, FP8 blockwise weights).",
    )
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="checkpoint directory (config.json, safetensors, tokenizer.json); default: the embedded demo model")
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="prompt text (UTF-8); repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate per prompt (default 64; clamped, with a note, to what the model's "
                   "max_position_embeddings leave after the prompt)")
    add_kv_cache_dtype_option(p)
    add_backend_option(p)
    p.add_argument("--allow-slow-simulator", action="store_true",
                   help="run --backend cudasim on a model bigger than a micro model anyway (minutes per token)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample from the K most likely tokens (needs --temperature > 0; default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the nucleus of probability mass P (needs --temperature > 0; default 1: all)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed >= 0 for sampling (reproducible runs)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks (default: enough for the whole batch at once, capped by "
                   "--kv-cache-memory-fraction; requests beyond it wait their turn)")
    p.add_argument("--block-size", type=int, default=16, metavar="B",
                   help="tokens per KV cache block, 1 to the model's max_position_embeddings (default 16)")
    add_kv_cache_memory_option(p)
    p.set_defaults(handler=_generate_command)


def _generate_command(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KVCacheExhausted as e:
        print(f"fp8lab generate: {e}; raise --num-blocks or lower --max-new-tokens", file=sys.stderr)
    except MemoryError as e:
        print(f"fp8lab generate: out of memory ({e or type(e).__name__}); lower --kv-cache-memory-fraction, "
              "--num-blocks or --max-new-tokens", file=sys.stderr)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"fp8lab generate: error: {e}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------- checks before any loading


def _check_options(args: argparse.Namespace) -> None:
    """One ``ValueError`` naming the first bad option (those that need no model)."""
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.block_size <= 0:
        raise ValueError(f"--block-size: expected a positive number of tokens per block (e.g. 16), "
                         f"got {args.block_size}")
    if args.num_blocks is not None and args.num_blocks <= 0:
        raise ValueError(f"--num-blocks: expected a positive number of KV cache blocks, got {args.num_blocks} "
                         "(leave it out to size the cache from the batch)")
    if not 0 < args.kv_cache_memory_fraction <= 1:  # also false for NaN
        raise ValueError(f"--kv-cache-memory-fraction: expected a share of the available memory in (0, 1], "
                         f"got {args.kv_cache_memory_fraction}")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed: expected an integer >= 0 (NumPy's seeds are non-negative), got {args.seed}")
    for i, prompt in enumerate(args.prompt):
        _check_utf8(i, prompt)


def _check_utf8(index: int, prompt: str) -> None:
    """Bytes of argv that are not UTF-8 arrive as lone surrogates (Python's ``surrogateescape``): refuse them."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        char = prompt[e.start]
        byte = f"byte 0x{ord(char) - 0xDC00:02X}" if 0xDC80 <= ord(char) <= 0xDCFF else f"U+{ord(char):04X}"
        raise ValueError(f"--prompt: prompt {index} is not valid UTF-8 ({byte} at character {e.start}); pass the "
                         "text in UTF-8 (convert it first, e.g. with iconv)") from None


def _sampling(args: argparse.Namespace):
    """The ``SamplingParams`` of the options (which checks their values); ``--top-k`` or ``--top-p`` without a
    temperature is an error: greedy decoding would silently ignore them."""
    from .sampling import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=0 if args.top_k is None else args.top_k,
                              top_p=1.0 if args.top_p is None else args.top_p)
    if sampling.greedy:
        for option, value in (("--top-k", args.top_k), ("--top-p", args.top_p)):
            if value is not None:
                raise ValueError(f"{option} needs --temperature > 0: greedy decoding (the default) ignores it")
    return sampling


# ---------------------------------------------------------------------------- checks against the model


def check_block_size(block_size: int, config) -> None:
    max_pos = config.max_position_embeddings
    if block_size > max_pos:
        raise ValueError(f"--block-size {block_size}: larger than the model's max_position_embeddings {max_pos}, "
                         "the longest a sequence can be; use e.g. 16")


def _check_prompt_lengths(prompt_ids: list[list[int]], config) -> None:
    max_pos = config.max_position_embeddings
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"--prompt: prompt {i} is empty (no tokens); a sequence needs at least one")
        if len(ids) >= max_pos:
            raise ValueError(f"--prompt: prompt {i} has {len(ids)} tokens; the model's max_position_embeddings "
                             f"{max_pos} leave no room for a new token; shorten it")


def _new_tokens_per_prompt(prompt_ids: list[list[int]], max_new_tokens: int, config) -> list[int]:
    """``--max-new-tokens`` per prompt, clamped as the generator does: a sequence stops at the last position.
    A clamp is not an error (the sequence ends with ``length`` either way) but earns a note on stderr."""
    max_pos = config.max_position_embeddings
    new = [min(max_new_tokens, max_pos - len(ids)) for ids in prompt_ids]
    if min(new) < max_new_tokens:
        print(f"fp8lab generate: note: --max-new-tokens {max_new_tokens} is clamped to {min(new)} for the longest "
              f"prompt (the model's max_position_embeddings is {max_pos})", file=sys.stderr)
    return new


# ---------------------------------------------------------------------------- the KV cache size


def human_size(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (``38.2 KiB``, ``3.6 TiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} bytes"


def _cache_blocks(args: argparse.Namespace, config, backend: str, request_blocks: list[int]) -> int:
    """Blocks of the KV cache: ``--num-blocks``, or the batch's worst case; either within the memory budget.

    ``request_blocks``: each request's worst case in blocks. The budget is ``--kv-cache-memory-fraction`` of
    the memory available now (after the model is loaded); None from the system means no budget.
    """
    from .kv_manager import blocks_in_budget, kv_block_bytes
    from .loading import kv_cache_memory_available

    worst_case = sum(request_blocks)
    available, where = kv_cache_memory_available(backend)
    if available is None:
        return args.num_blocks or worst_case
    block_bytes = kv_block_bytes(config, args.block_size, args.kv_format, numpy=backend == "reference")
    fraction = args.kv_cache_memory_fraction
    budget = blocks_in_budget(available, fraction, block_bytes)
    budget_text = (f"the KV cache budget (--kv-cache-memory-fraction {fraction} of {human_size(available)} of {where}) "
                   f"holds {budget:,} blocks of {args.block_size} tokens ({human_size(block_bytes)} each)")
    if args.num_blocks is not None:
        if args.num_blocks > budget:
            raise ValueError(f"--num-blocks {args.num_blocks}: {human_size(args.num_blocks * block_bytes)} of KV cache, but "
                             f"{budget_text}; lower --num-blocks or raise --kv-cache-memory-fraction")
        return args.num_blocks
    largest = max(request_blocks)
    if largest > budget:
        i = request_blocks.index(largest)
        fp8_hint = "" if args.kv_format is FP8_E4M3 else ", use --kv-cache-dtype fp8"
        raise ValueError(f"KV cache exhausted: request {i} alone needs {largest:,} blocks "
                         f"({human_size(largest * block_bytes)}), but {budget_text}; lower --max-new-tokens, shorten the prompt{fp8_hint} or raise "
                         "--kv-cache-memory-fraction")
    if worst_case > budget:
        print(f"fp8lab generate: note: {budget_text}, of the {worst_case:,} the whole batch would take at once; "
              "requests wait their turn", file=sys.stderr)
    return min(worst_case, budget)


# ---------------------------------------------------------------------------- the run


def _run(args: argparse.Namespace) -> int:
    # imported here: the I/O half (checkpoint, tokenizer, tiny model) loads only when used
    from .checkpoint import load_checkpoint
    from .generate import Generator, collect_stop_token_ids
    from .kv_manager import blocks_for
    from .loading import check_simulator_size, load_model, resolve_backend
    from .tokenizer import Tokenizer

    _check_options(args)
    sampling = _sampling(args)
    if args.model is None:
        from .demo import default_model_dir

        model_dir = default_model_dir(fp8=True)
    else:
        model_dir = args.model
        if not model_dir.is_dir():
            raise ValueError(f"--model {model_dir}: not a directory")
    checkpoint = load_checkpoint(model_dir)
    config = checkpoint.config
    check_block_size(args.block_size, config)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt]
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    _check_prompt_lengths(prompt_ids, config)
    new_tokens = _new_tokens_per_prompt(prompt_ids, args.max_new_tokens, config)
    backend = resolve_backend(args.backend, config)
    if backend == "cudasim":
        check_simulator_size(config, args.allow_slow_simulator)
    # the GPU model's activation buffers: every prompt prefilled in one forward, every sequence decoded at once
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    model = load_model(checkpoint, backend, max_num_tokens=max(prompt_tokens, len(prompts), 1),
                       max_num_seqs=len(prompts))
    # a request holds at most prompt + new - 1 tokens in the cache (the last sampled token is never written)
    request_blocks = [blocks_for(len(ids) + n - 1, args.block_size) for ids, n in zip(prompt_ids, new_tokens)]
    generator = Generator(
        model, tokenizer,
        kv_format=args.kv_format,
        block_size=args.block_size,
        num_blocks=_cache_blocks(args, config, backend, request_blocks),
        stop_token_ids=collect_stop_token_ids(tokenizer, checkpoint.generation_config, config),
    )

    if len(prompts) == 1:
        on_text = lambda _, piece: print(piece, end="", flush=True)  # noqa: E731
        on_finish = lambda _: print(flush=True)  # noqa: E731
    else:
        on_text = None
        on_finish = lambda r: print(f"=== [{r.index}] ({r.finish_reason}) ===\n{r.text}", flush=True)  # noqa: E731
    out = generator.generate(prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                             seed=args.seed, on_text=on_text, on_finish=on_finish)
    print(f"{len(prompts)} sequence(s), backend {backend}, kv cache {args.kv_format.name}; {out.stats.summary()}",
          file=sys.stderr)
    # a sequence that failed (e.g. NaN logits) finished alone; the others' text is printed above
    failed = [r for r in out.results if r.finish_reason == "error"]
    for r in failed:
        print(f"fp8lab generate: error in prompt {r.index + 1}: {r.error}", file=sys.stderr)
    return 1 if failed else 0
