"""``fp8lab serve``: the OpenAI-compatible server over the engine, from the command line.

It loads the model as ``fp8lab generate`` does (``--model``, default the embedded demo model;
``--backend``), sizes the GPU model's buffers for ``--max-num-seqs`` sequences and
``--max-num-batched-tokens`` prefill tokens per step, and the KV cache: ``--num-blocks``, or as many
blocks as ``--kv-cache-memory-fraction`` of the memory available after loading holds, but never more
than ``--max-num-seqs`` sequences at the model's full context need. Then it serves on ``--host``
(default the loopback address) and ``--port`` until Ctrl-C. A port in use, a bad option or a bad
model directory is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web  # the serve extra: refused in one line by fp8lab.cli without it

from fp8lab.engine.generate_command import (
    add_backend_option,
    add_kv_cache_dtype_option,
    add_kv_cache_memory_option,
    check_block_size,
    human_size,
)

DEFAULT_PORT = 8000


def register(subparsers) -> None:
    """Add ``serve`` to the ``fp8lab`` parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a Qwen3 (FP8) checkpoint over the OpenAI HTTP API (completions, chat, streaming)",
        description="An OpenAI-compatible HTTP server over the fp8lab engine: /v1/completions, "
        "/v1/chat/completions (streaming or not), /v1/models, /health. Concurrent requests share "
        "each decode step (continuous batching). With no --model, the embedded demo model is served.",
    )
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="checkpoint directory (config.json, safetensors, tokenizer.json); default: the embedded demo model")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the model directory's name; fp8lab-demo for the demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="PORT", help=f"TCP port (default {DEFAULT_PORT})")
    add_kv_cache_dtype_option(p)
    add_backend_option(p)
    p.add_argument("--max-num-seqs", type=int, default=16, metavar="N",
                   help="sequences decoded together at most; more requests wait (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="T",
                   help="prompt tokens per prefill step at most; longer prompts are prefilled in chunks (default 2048)")
    p.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks (default: what --kv-cache-memory-fraction holds, at most --max-num-seqs "
                   "sequences of the model's full context)")
    p.add_argument("--block-size", type=int, default=16, metavar="B", help="tokens per KV cache block (default 16)")
    add_kv_cache_memory_option(p)
    p.set_defaults(handler=_serve_command)


def _serve_command(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (OSError, ValueError, KeyError, RuntimeError, MemoryError) as e:
        print(f"fp8lab serve: error: {e}", file=sys.stderr)
    return 1


def check_options(args: argparse.Namespace) -> None:
    """One ``ValueError`` naming the first bad option (those that need no model)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected 0 to 65535, got {args.port}")
    for option, value in (("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", args.max_num_batched_tokens),
                          ("--block-size", args.block_size)):
        if value <= 0:
            raise ValueError(f"{option}: expected a positive number, got {value}")
    if args.num_blocks is not None and args.num_blocks <= 0:
        raise ValueError(f"--num-blocks: expected a positive number of KV cache blocks, got {args.num_blocks}")
    if not 0 < args.kv_cache_memory_fraction <= 1:
        raise ValueError(f"--kv-cache-memory-fraction: expected a share in (0, 1], got {args.kv_cache_memory_fraction}")


def cache_blocks(args: argparse.Namespace, config, backend: str) -> int:
    """``--num-blocks`` (checked against the budget), else the budget capped at ``--max-num-seqs`` full contexts."""
    from fp8lab.engine.kv_manager import blocks_for, blocks_in_budget, kv_block_bytes
    from fp8lab.engine.loading import kv_cache_memory_available

    most = args.max_num_seqs * blocks_for(config.max_position_embeddings, args.block_size)
    available, where = kv_cache_memory_available(backend)
    if available is None:
        return args.num_blocks or most
    block_bytes = kv_block_bytes(config, args.block_size, args.kv_format, numpy=backend == "reference")
    budget = blocks_in_budget(available, args.kv_cache_memory_fraction, block_bytes)
    if args.num_blocks is not None:
        if args.num_blocks > budget:
            raise ValueError(f"--num-blocks {args.num_blocks}: {human_size(args.num_blocks * block_bytes)} of KV cache, more "
                             f"than --kv-cache-memory-fraction {args.kv_cache_memory_fraction} of {human_size(available)} of "
                             f"{where} holds ({budget:,} blocks)")
        return args.num_blocks
    if budget < 1:
        raise ValueError(f"--kv-cache-memory-fraction {args.kv_cache_memory_fraction} of {human_size(available)} of {where} "
                         f"holds no KV cache block ({human_size(block_bytes)} each)")
    return min(budget, most)


@dataclass
class Served:
    """What ``build`` makes of a command line: the engine loop (not started) and the application over it."""

    engine: object  # fp8lab.engine.serving.EngineLoop
    app: web.Application
    tokenizer: object
    model_name: str
    config: object
    backend: str


def build(args: argparse.Namespace) -> Served:
    """The model, its engine loop (not started) and the HTTP application for ``args``."""
    from fp8lab.engine.checkpoint import load_checkpoint
    from fp8lab.engine.generate import Generator, collect_stop_token_ids
    from fp8lab.engine.loading import check_simulator_size, load_model, resolve_backend
    from fp8lab.engine.serving import EngineLoop
    from fp8lab.engine.tokenizer import Tokenizer

    from .server import Server

    check_options(args)
    if args.model is None:
        from fp8lab.engine.demo import default_model_dir

        model_dir, name = default_model_dir(fp8=True), "fp8lab-demo"
    else:
        model_dir, name = args.model, args.model.resolve().name
        if not model_dir.is_dir():
            raise ValueError(f"--model {model_dir}: not a directory")
    checkpoint = load_checkpoint(model_dir)
    config = checkpoint.config
    check_block_size(args.block_size, config)
    tokenizer = Tokenizer.from_dir(model_dir)
    backend = resolve_backend(args.backend, config)
    if backend == "cudasim":
        check_simulator_size(config, False)
    model = load_model(checkpoint, backend, max_num_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
                       max_num_seqs=args.max_num_seqs)
    generator = Generator(model, tokenizer, kv_format=args.kv_format, block_size=args.block_size,
                          stop_token_ids=collect_stop_token_ids(tokenizer, checkpoint.generation_config, config),
                          prefill_chunk_size=args.max_num_batched_tokens)
    engine = EngineLoop(generator, cache_blocks(args, config, backend), max_num_seqs=args.max_num_seqs,
                        max_num_tokens=args.max_num_batched_tokens)
    name = args.served_model_name or name
    app = Server(engine, tokenizer, name, config.max_position_embeddings, config.vocab_size).app()
    return Served(engine, app, tokenizer, name, config, backend)


async def serve(app: web.Application, host: str, port: int, ready=None) -> None:
    """Serve ``app`` on ``host:port`` until cancelled; ``ready(port)`` is called once it listens (port 0:
    a free one)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, f"--port {port}: {host}:{port} is already in use (another server?); pick "
                                       "another --port or stop it") from None
            raise OSError(e.errno, f"--host {host} --port {port}: cannot listen there: {e.strerror}") from None
        if ready:
            ready(runner.addresses[0][1])
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _run(args: argparse.Namespace) -> int:
    served = build(args)
    engine = served.engine
    engine.start()

    def ready(port: int) -> None:
        print(f"fp8lab serve: {served.model_name} on http://{args.host}:{port}/v1 (backend {served.backend}, kv cache "
              f"{args.kv_format.name}, {engine.batch.num_blocks:,} blocks of {args.block_size} tokens, up to "
              f"{args.max_num_seqs} sequences); Ctrl-C stops it", file=sys.stderr, flush=True)

    try:
        asyncio.run(serve(served.app, args.host, args.port, ready))
    finally:
        engine.shutdown()
    return 0


class ServerThread:
    """``fp8lab serve ARGV`` inside this process, on a free loopback port, in a background thread with its
    own event loop: for tests and notebooks. ``url`` (``http://127.0.0.1:PORT``), ``engine`` (the
    ``EngineLoop``), ``tokenizer``, ``config``, ``model_name``; ``stop()`` ends it."""

    def __init__(self, *argv: str):
        parser = argparse.ArgumentParser(prog="fp8lab")
        register(parser.add_subparsers(dest="command"))
        served = build(parser.parse_args(["serve", *argv, "--port", "0"]))
        self.engine, self.tokenizer, self.model_name, self.config = (served.engine, served.tokenizer,
                                                                     served.model_name, served.config)
        app = served.app
        self.engine.start()
        self._loop = asyncio.new_event_loop()
        ready, self.port = threading.Event(), None

        def on_ready(port: int) -> None:
            self.port = port
            ready.set()

        self._task = self._loop.create_task(serve(app, "127.0.0.1", 0, on_ready))
        self._thread = threading.Thread(target=self._run, name="fp8lab-serve", daemon=True)
        self._thread.start()
        if not ready.wait(60):
            raise RuntimeError("fp8lab serve: the server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)
        self.engine.shutdown()
