"""``fp8lab quantize``, ``fp8lab inspect`` and ``fp8lab make-tiny``: checkpoint tools on the command line.

- ``fp8lab quantize SRC DST [--block BN BK]``: BF16 checkpoint -> Qwen3-FP8 blockwise checkpoint;
- ``fp8lab inspect DIR``: validate and summarize; exits 1 when it finds NaN codes or other bad values;
- ``fp8lab make-tiny DST [--fp8] [--seed S]``: write the seeded random tiny Qwen3 checkpoint.

A bad checkpoint or argument prints one ``fp8lab COMMAND: error: ...`` line to stderr and exits
with status 1 (no traceback); the library functions in ``engine.checkpoint`` and ``engine.tiny``
raise the same messages as ``ValueError`` / ``FileNotFoundError`` / ``FileExistsError``.
"""

from __future__ import annotations

import functools
import sys

from . import checkpoint, tiny


def _one_line_errors(command: str):
    """Turn the checkpoint errors (all ``ValueError`` or ``OSError``) into one stderr line and exit status 1."""

    def wrap(handler):
        @functools.wraps(handler)
        def run(args) -> int:
            try:
                return handler(args)
            except (ValueError, OSError) as e:
                print(f"fp8lab {command}: error: {e}", file=sys.stderr)
                return 1

        return run

    return wrap


@_one_line_errors("quantize")
def _quantize(args) -> int:
    dst = checkpoint.quantize_checkpoint(args.src, args.dst, block=tuple(args.block), progress=not args.quiet)
    print(f"wrote FP8 checkpoint {dst} (weight_block_size {list(args.block)})")
    return 0


@_one_line_errors("inspect")
def _inspect(args) -> int:
    summary = checkpoint.summarize_checkpoint(args.dir, progress=not args.quiet)
    print(checkpoint.format_summary(summary))
    return 0 if summary.ok else 1


@_one_line_errors("make-tiny")
def _make_tiny(args) -> int:
    dst = tiny.make_tiny(args.dst, fp8=args.fp8, seed=args.seed)
    print(f"wrote tiny {'FP8' if args.fp8 else 'BF16'} Qwen3 checkpoint {dst} (seed {args.seed})")
    return 0


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
        "BPE tokenizer; the same seed gives the same bytes.",
    )
    p.add_argument("dst", metavar="DST", help="new folder for the checkpoint (must not exist)")
    p.add_argument("--fp8", action="store_true", help="quantize the projections to FP8 (as fp8lab quantize does)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.set_defaults(handler=_make_tiny)
