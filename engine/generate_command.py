"""``fp8lab generate``: text generation with the Qwen3-FP8 engine.

Without ``--model`` it runs the embedded demo model (``engine.demo``: a small Qwen3 trained on
Python's documentation and source), quantized to FP8 on first use (``engine.demo.default_model_dir``). Output: with one prompt the generated text streams to stdout piece by
piece; with several (``--prompt`` repeated: one batch) each completion is printed to stdout
under a ``=== [i] ===`` header as soon as its sequence finishes. The closing line (prompt and
decode tokens per second) goes to stderr, so stdout holds only generated text. Errors (a bad
model directory, an exhausted KV cache, bad options) print one line to stderr and exit 1.

Sampling is greedy unless ``--temperature`` is above 0 (the checkpoint's
``generation_config`` sampling defaults are not applied: the default run is reproducible);
stop tokens are the tokenizer's, ``generation_config``'s and ``config.json``'s EOS ids.

Backends (``--backend``, ``engine.backend.load_model``): ``cuda`` runs ``engine.cuda_model`` on an
NVIDIA GPU, sized for this call (every prompt prefilled in one forward, every sequence in one decode
step); ``reference`` the NumPy model; ``cudasim`` the GPU model in Numba's CUDA simulator; ``auto``
(the default) ``cuda`` when a GPU is there, else ``reference``. The closing line names the backend used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .backend import BACKEND_CHOICES
from .kv_manager import KVCacheExhausted


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
                   help="prompt text; repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt (default 64)")
    p.add_argument("--kv-cache-dtype", choices=["fp8", "bf16"], default="fp8",
                   help="KV cache storage: fp8 (E4M3 + one scale per token and kv head) or bf16 (default fp8)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="cuda: the numba_kernels on an NVIDIA GPU; reference: NumPy on the CPU; cudasim: the "
                   "kernels in Numba's CUDA simulator (very slow, tiny models only); auto (default): cuda when "
                   "numba-cuda sees a GPU and the kernels take the model, else reference"),
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1: all)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed for sampling (reproducible runs)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks (default: enough for the whole batch at once)")
    p.add_argument("--block-size", type=int, default=16, metavar="B", help="tokens per KV cache block (default 16)")
    p.set_defaults(handler=_generate_command)


def _generate_command(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KVCacheExhausted as e:
        print(f"fp8lab generate: {e}; raise --num-blocks or lower --max-new-tokens", file=sys.stderr)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"fp8lab generate: error: {e}", file=sys.stderr)
    return 1


def _run(args: argparse.Namespace) -> int:
    # imported here: the I/O half (checkpoint, tokenizer, tiny model) loads only when used
    from .backend import load_model, resolve_backend
    from .checkpoint import load_checkpoint
    from .generate import Generator, collect_stop_token_ids
    from .sampling import SamplingParams
    from .tokenizer import Tokenizer

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.model is None:
        from .demo import default_model_dir

        model_dir = default_model_dir(fp8=True)
    else:
        model_dir = args.model
        if not model_dir.is_dir():
            raise ValueError(f"--model {model_dir}: not a directory")
    checkpoint = load_checkpoint(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt]
    backend = resolve_backend(args.backend, checkpoint.config)
    # the GPU model's activation buffers: every prompt prefilled in one forward, every sequence decoded at once
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    model = load_model(checkpoint, backend, max_num_tokens=max(prompt_tokens, len(prompts), 1),
                       max_num_seqs=len(prompts))
    generator = Generator(
        model, tokenizer,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        stop_token_ids=collect_stop_token_ids(tokenizer, checkpoint.generation_config, checkpoint.config),
    )

    if len(prompts) == 1:
        on_text = lambda _, piece: print(piece, end="", flush=True)  # noqa: E731
        on_finish = lambda _: print(flush=True)  # noqa: E731
    else:
        on_text = None
        on_finish = lambda r: print(f"=== [{r.index}] ({r.finish_reason}) ===\n{r.text}", flush=True)  # noqa: E731
    out = generator.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                             seed=args.seed, on_text=on_text, on_finish=on_finish)
    print(f"{len(prompts)} sequence(s), backend {backend}, kv cache {args.kv_cache_dtype}; {out.stats.summary()}",
          file=sys.stderr)
    return 0
