"""``fp8lab serve`` under load: tokens per second served to C concurrent clients, against
``fp8lab generate`` (``Generator.generate``) of a batch of C prompts on the same model.

    python bench/serve.py [--shape qwen3-8b | --model DIR] [--backend cuda] [--clients 1,4,16]
                          [--prompt-len 128] [--max-tokens 64] [--requests-per-client 3] [--out DIR]

One model is loaded (a random FP8 checkpoint of ``--shape``, ``fp8lab.engine.shapes``, or ``--model``)
and shared by both measurements, so they differ only in what drives the engine:

- **served**: the server (``fp8lab.serve.server.Server`` over ``fp8lab.engine.serving.EngineLoop``, the
  ``fp8lab serve`` defaults but ``--max-num-seqs`` = the largest C) on a loopback port in this process;
  C clients (aiohttp), each sending ``--requests-per-client`` non-streaming completions one after the
  other, ``--prompt-len`` random token ids and ``max_tokens = --max-tokens`` each, greedy. Tokens/s =
  the completion tokens of every answer (its ``usage``) / the wall time from the first request to the
  last answer. A warm-up round first (kernel compilation, CUDA-graph capture).
- **generate**: ``Generator.generate`` of C prompts of the same lengths, ``max_new_tokens =
  --max-tokens``: tokens generated / wall time (after a warm-up call).

Random checkpoints have no tokenizer: prompts are token ids, answers are counted in tokens, and EOS
never stops a sequence (no stop tokens). With ``--model`` the checkpoint's tokenizer and stop tokens
are used, so sequences may stop early; the counts are what was generated. Results: a Markdown table
on stdout and in ``--out``/serve_results.md, the numbers in serve_results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a source checkout runs without installing fp8lab


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fp8lab.engine import shapes
    from fp8lab.engine.loading import BACKEND_CHOICES

    p.add_argument("--shape", choices=shapes.shape_names(include_test=True), default="qwen3-8b",
                   help="random FP8 checkpoint of this shape (default qwen3-8b)")
    p.add_argument("--model", type=Path, default=None, metavar="DIR", help="a checkpoint directory instead")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto", help="as fp8lab serve's (default auto)")
    p.add_argument("--clients", default="1,4,16", metavar="C,C", help="concurrent clients (default 1,4,16)")
    p.add_argument("--prompt-len", type=int, default=128, metavar="P", help="prompt tokens (default 128)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens per answer (default 64)")
    p.add_argument("--requests-per-client", type=int, default=3, metavar="R", help="requests per client (default 3)")
    p.add_argument("--kv-cache-dtype", choices=["fp8", "bf16"], default="fp8", help="the KV cache (default fp8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default 0)")
    p.add_argument("--out", type=Path, default=Path("serve-bench"), metavar="DIR", help="where results go")


def load(args):
    """``(model, tokenizer or None, stop token ids, config, backend)``."""
    from fp8lab.engine import shapes
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.generate import collect_stop_token_ids
    from fp8lab.engine.loading import load_model, resolve_backend
    from fp8lab.engine.tokenizer import Tokenizer

    most = max(args.clients)
    if args.model is not None:
        checkpoint = load_checkpoint(args.model)
        tokenizer = Tokenizer.from_dir(args.model)
        stops = collect_stop_token_ids(tokenizer, checkpoint.generation_config, checkpoint.config)
    else:
        checkpoint, tokenizer, stops = shapes.random_checkpoint(args.shape, args.seed), None, ()
    backend = resolve_backend(args.backend, checkpoint.config)
    model = load_model(checkpoint, backend, max_num_tokens=max(2048, most * args.prompt_len), max_num_seqs=most)
    return model, tokenizer, stops, checkpoint.config, backend


def make_generator(model, tokenizer, stops, args):
    from fp8lab.engine.generate import Generator

    return Generator(model, tokenizer, kv_format=args.kv_cache_dtype, stop_token_ids=stops,
                     prefill_chunk_size=max(2048, max(args.clients) * args.prompt_len))


def cache_blocks(config, args) -> int:
    from fp8lab.engine.kv_manager import blocks_for

    return max(args.clients) * blocks_for(args.prompt_len + args.max_tokens, 16)


async def one_round(url: str, clients: int, prompts: np.ndarray, args) -> tuple[int, float]:
    """``(completion tokens, seconds)`` of ``clients`` concurrent clients, ``--requests-per-client`` each."""
    import aiohttp

    async def client(session, i: int) -> int:
        tokens = 0
        for r in range(args.requests_per_client):
            body = {"model": "bench", "prompt": prompts[(i * args.requests_per_client + r) % len(prompts)].tolist(),
                    "max_tokens": args.max_tokens, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"the server answered {response.status}: {answer}")
                tokens += answer["usage"]["completion_tokens"]
        return tokens

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(client(session, i) for i in range(clients)))
        return sum(counts), time.perf_counter() - start


def served_tokens_per_s(model, tokenizer, stops, config, args, clients: int, prompts) -> float:
    from fp8lab.engine.serving import EngineLoop
    from fp8lab.serve.command import serve
    from fp8lab.serve.server import Server

    engine = EngineLoop(make_generator(model, tokenizer, stops, args), cache_blocks(config, args),
                        max_num_seqs=max(args.clients), max_num_tokens=max(2048, max(args.clients) * args.prompt_len))
    app = Server(engine, tokenizer, "bench", config.max_position_embeddings, config.vocab_size).app()
    engine.start()

    async def run() -> tuple[int, float]:
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(app, "127.0.0.1", 0, ready.set_result))
        port = await ready
        url = f"http://127.0.0.1:{port}"
        await one_round(url, clients, prompts, args)  # warm-up: compilation, graph capture of these batch sizes
        result = await one_round(url, clients, prompts, args)
        task.cancel()
        return result

    try:
        tokens, seconds = asyncio.run(run())
    finally:
        engine.shutdown()
    return tokens / seconds


def generate_tokens_per_s(model, tokenizer, stops, args, clients: int, prompts) -> float:
    generator = make_generator(model, tokenizer, stops, args)
    batch = [p.tolist() for p in prompts[:clients]]
    generator.generate(batch, max_new_tokens=args.max_tokens)  # warm-up
    start = time.perf_counter()
    out = generator.generate(batch, max_new_tokens=args.max_tokens)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in out.results) / seconds


def report(rows: list[dict], meta: dict) -> str:
    lines = [f"### fp8lab serve under load, {meta['date']}, {meta['device']}", "",
             f"Command: `{meta['command']}`. {meta['what']}", "",
             "| clients | served tok/s | generate tok/s (same batch) | served / generate |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['served_tok_s']:,.1f} | {r['generate_tok_s']:,.1f} | "
                     f"{r['served_tok_s'] / r['generate_tok_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    if min(args.clients) <= 0 or args.prompt_len <= 0 or args.max_tokens <= 0 or args.requests_per_client <= 0:
        parser.error("--clients, --prompt-len, --max-tokens and --requests-per-client must be positive")
    model, tokenizer, stops, config, backend = load(args)
    vocab = config.vocab_size if tokenizer is None else min(config.vocab_size, tokenizer.vocab_size)
    prompts = np.random.default_rng([args.seed, 2]).integers(0, vocab, (max(args.clients) * args.requests_per_client,
                                                                          args.prompt_len))
    rows = []
    for clients in args.clients:
        served = served_tokens_per_s(model, tokenizer, stops, config, args, clients, prompts)
        generated = generate_tokens_per_s(model, tokenizer, stops, args, clients, prompts)
        rows.append({"clients": clients, "served_tok_s": served, "generate_tok_s": generated})
        print(f"{clients} clients: served {served:,.1f} tok/s, generate {generated:,.1f} tok/s", file=sys.stderr)
    device = backend
    if backend == "cuda":
        from numba import cuda

        device = cuda.get_current_device().name.decode() if isinstance(cuda.get_current_device().name, bytes) \
            else str(cuda.get_current_device().name)
    meta = {"date": datetime.date.today().isoformat(), "device": device, "backend": backend,
            "command": "python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "what": f"{args.model or args.shape} ({backend}), KV cache {args.kv_cache_dtype}, prompts of "
                    f"{args.prompt_len} random token ids, {args.max_tokens} tokens per answer (greedy), "
                    f"{args.requests_per_client} requests per client after a warm-up round."}
    text = report(rows, meta)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_results.md").write_text(text)
    (args.out / "serve_results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
