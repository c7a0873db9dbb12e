"""``fp8lab quantize``, ``fp8lab inspect`` and ``fp8lab make-tiny``: checkpoint tools on the command line.

- ``fp8lab quantize SRC DST [--block BN BK]``: BF16 checkpoint -> Qwen3-FP8 blockwise checkpoint;
- ``fp8lab inspect DIR``: validate and summarize; exits 1 when it finds NaN codes or other bad values
  (values that load but may overflow float32 at run time are listed as warnings, exit status 0);
- ``fp8lab make-tiny DST [--fp8] [--seed S]``: write the seeded random tiny Qwen3 checkpoint;
  ``fp8lab make-tiny --shape qwen3-8b --out DST [--layers L] [--seed S]``: a random FP8 checkpoint
  of a real Qwen3 shape (``fp8lab.engine.shapes``: random FP8 weights, the tiny tokenizer), for benchmarks.

A bad checkpoint or argument prints one ``fp8lab COMMAND: error: ...`` line to stderr and exits
with status 1 (no traceback); Ctrl-C prints ``fp8lab COMMAND: interrupted; DST was not written``
and exits with status 130; the library functions in ``fp8lab.engine.checkpoint`` and ``fp8lab.engine.tiny``
raise the same messages as ``ValueError`` / ``FileNotFoundError`` / ``FileExistsError``.
"""

from __future__ import annotations

import argparse
import functools
import sys

from . import checkpoint, tiny

INTERRUPTED_STATUS = 130
"""The shell's status for a command ended by Ctrl-C (128 + SIGINT)."""


def _one_line_errors(command: str, output=None):
    """Turn the checkpoint errors (all ``ValueError`` or ``OSError``) into one stderr line and exit
    status 1, and Ctrl-C into one line and status 130. ``output(args)`` names the folder the
    command writes, so the interrupted line can say it was not written."""

    def wrap(handler):
        @functools.wraps(handler)
        def run(args) -> int:
            try:
                return handler(args)
            except (ValueError, OSError) as e:
                print(f"fp8lab {command}: error: {e}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                # The writers build in a temporary folder that build_atomically removes on any
                # BaseException, KeyboardInterrupt included, so there is no half-written output.
                note = f"; {output(args)} was not written" if output else ""
                print(f"fp8lab {command}: interrupted{note}", file=sys.stderr)
                return INTERRUPTED_STATUS

        return run

    return wrap


@_one_line_errors("quantize", output=lambda args: args.dst)
def _quantize(args) -> int:
    dst = checkpoint.quantize_checkpoint(args.src, args.dst, block=tuple(args.block), progress=not args.quiet)
    print(f"wrote FP8 checkpoint {dst} (weight_block_size {list(args.block)})")
    return 0


@_one_line_errors("inspect")
def _inspect(args) -> int:
    summary = checkpoint.summarize_checkpoint(args.dir, progress=not args.quiet)
    print(checkpoint.format_summary(summary))
    return 0 if summary.ok else 1


@_one_line_errors("make-tiny", output=lambda args: args.dst if args.dst is not None else args.out)
def _make_tiny(args) -> int:
    if (args.dst is None) == (args.out is None):
        raise ValueError("give the new checkpoint folder once: as DST or as --out DIR")
    dst = args.dst if args.dst is not None else args.out
    if args.shape == "tiny" and args.layers is None:
        dst = tiny.make_tiny(dst, fp8=args.fp8, seed=args.seed)
        print(f"wrote tiny {'FP8' if args.fp8 else 'BF16'} Qwen3 checkpoint {dst} (seed {args.seed})")
        return 0
    from . import shapes

    max_shard_bytes = int(args.max_shard_gb * 1e9)
    dst = shapes.make_random(dst, args.shape, seed=args.seed, num_hidden_layers=args.layers,
                             max_shard_bytes=max_shard_bytes, progress=not args.quiet)
    config = shapes.shape_config(args.shape, args.layers)
    params = shapes.parameter_counts(config)["total"]
    print(f"wrote random FP8 Qwen3 checkpoint {dst}: shape {args.shape}, {config.num_hidden_layers} layers, "
          f"{params / 1e9:.2f} B parameters (seed {args.seed})")
    return 0


def _shape_name(name: str) -> str:
    from . import shapes

    if name not in shapes.shape_names(include_test=True):
        raise argparse.ArgumentTypeError(f"unknown shape {name!r} (choose from {', '.join(shapes.shape_names())})")
    return name


def register(subparsers) -> None:
    """Add this module's subcommands to the ``fp8lab`` parser."""
    p = subparsers.add_parser(
        "quantize",
        help="quantize a BF16 Qwen3 checkpoint to FP8 (E4M3, blockwise scales)",
        description="Write an FP8 blockwise checkpoint in the Qwen3-FP8 format: the seven projections of "
        "each layer as F8_E4M3 with F32 weight_scale_inv, everything else BF16; tokenizer and configs are copied.",
    )
    p.add_argument("src", metavar="SRC", help="BF16 checkpoint folder")
    p.add_argument("dst", metavar="DST", help="new folder for the FP8 checkpoint (must not exist)")
    p.add_argument("--block", nargs=2, type=int, default=[128, 128], metavar=("BN", "BK"), help="weight block size (default 128 128)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_quantize)

    p = subparsers.add_parser(
        "inspect",
        help="validate a checkpoint and summarize it (shapes, FP8 tensors, scales, E4M3 code histogram)",
        description="Validate a checkpoint folder and print a summary. Structural problems are errors; "
        "NaN codes and non-finite values are listed and make the exit status 1.",
    )
    p.add_argument("dir", metavar="DIR", help="checkpoint folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_inspect)

    p = subparsers.add_parser(
        "make-tiny",
        help="write a tiny seeded random Qwen3 checkpoint with a trained tokenizer",
        description="Write a tiny random Qwen3 checkpoint (4 layers, hidden 256, vocab 1024) with a byte-level "
        "BPE tokenizer; the same seed gives the same bytes. With --shape qwen3-0.6b or qwen3-8b, write a random FP8 "
        "checkpoint of that real Qwen3 shape instead (fp8lab.engine.shapes), for benchmarks.",
    )
    p.add_argument("dst", metavar="DST", nargs="?", default=None, help="new folder for the checkpoint (must not exist)")
    p.add_argument("--out", metavar="DIR", default=None, help="the new folder, as an option (instead of DST)")
    p.add_argument("--fp8", action="store_true", help="quantize the projections to FP8 (as fp8lab quantize does)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--shape", type=_shape_name, default="tiny", metavar="NAME",
                   help="tiny (default: the trained-tokenizer tiny model above), qwen3-0.6b or qwen3-8b: a random "
                   "FP8 checkpoint of that real shape (random E4M3 codes and block scales, BF16 embeddings; the tiny "
                   "tokenizer, whose 1024 ids cover only part of the vocabulary), for benchmarks; Qwen3-8B is 9.5 GB")
    p.add_argument("--layers", type=int, default=None, metavar="L",
                   help="override the number of layers of a random shape (makes a random FP8 checkpoint)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="largest safetensors shard of a random shape, in GB (default 5)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_make_tiny)
