"""``fp8lab bench``: the engine benchmark on the GPU (``bench/engine.py``) from the command line.

    fp8lab bench [--shapes qwen3-0.6b,qwen3-8b] [--batches 1,4,16] [--prompt-len 512]
                 [--decode-tokens 64] [--out DIR] [--no-transformers] ...

For each shape and batch: prefill and decode tokens per second of the CUDA engine
(``engine.cuda_model.CudaQwen3Model``, CUDA-graph decode) on a random FP8 checkpoint
(``engine.shapes``), of transformers' BF16 ``generate`` on a random model of the same shape in
the same run, and the bandwidth roofline (``engine.shapes.decode_bytes_per_step`` / the measured
copy bandwidth). Writes ``engine_results.md``, ``engine_results.json`` and ``engine.png`` into
``--out``. See ``bench/engine.py`` for what is timed and how.

This module only defines the arguments (``add_arguments``, shared with ``bench/engine.py``) and
runs the benchmark script: the benchmark needs torch and transformers (its peer), which the
engine never imports, and it lives with the other benchmarks in the repository's ``bench/``
folder, so ``fp8lab bench`` works from a source checkout (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

DEFAULT_SHAPES = ("qwen3-0.6b", "qwen3-8b")
DEFAULT_BATCHES = (1, 4, 16)
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "engine.py"


def _shape_list(text: str) -> list[str]:
    from . import shapes

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
    """The benchmark's options (``fp8lab bench`` and ``python bench/engine.py`` take the same)."""
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
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers BF16 peer")
    p.add_argument("--transformers-batches", type=_int_list, default=None, metavar="B,B",
                   help="batches at which to run the transformers peer (default: all of --batches)")
    p.add_argument("--threads", type=_positive, default=None, metavar="T",
                   help="CPU threads that build the random weights (default: all cores, at most 32)")
    p.add_argument("--out", type=Path, default=Path("engine-bench"), metavar="DIR",
                   help="folder for engine_results.md, engine_results.json and engine.png (default ./engine-bench)")


def register(subparsers) -> None:
    """Add ``bench`` to the ``fp8lab`` parser."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark the CUDA engine against transformers BF16 and the bandwidth roofline (needs a GPU)",
        description="Prefill and decode tokens per second of the CUDA engine on random FP8 checkpoints of Qwen3 "
        "shapes, against transformers' BF16 generate on the same GPU in the same run and against the bandwidth "
        "roofline (bytes read per decode step / measured copy bandwidth). Runs the repository's bench/engine.py; "
        "needs an NVIDIA GPU, numba-cuda, torch and (for the peer) transformers.",
    )
    add_arguments(p)
    p.set_defaults(handler=_bench_command)


def load_bench_script(path: Path = BENCH_SCRIPT):
    """``bench/engine.py`` as a module (it is a script of the repository, not part of the package)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: fp8lab bench runs the repository's bench/engine.py; "
                                "install fp8lab from a source checkout (pip install -e .)")
    name = "fp8lab_bench_engine"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _bench_command(args: argparse.Namespace) -> int:
    try:
        return load_bench_script().run(args)
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        print(f"fp8lab bench: error: {e}", file=sys.stderr)
        return 1
