"""The ``fp8lab`` command line.

Subcommands:

- ``fp8lab e4m3``: print the 256-code E4M3 table;
- ``fp8lab e4m3 X [X ...]``: encode numbers to E4M3 and show code, bits, value and rounding error;
- checkpoint commands (``quantize``, ``inspect``, ``make-tiny``): ``fp8lab.engine.checkpoint_commands``;
- ``fp8lab generate``: ``fp8lab.engine.generate_command``;
- ``fp8lab eval``: ``fp8lab.engine.eval_command`` (perplexity, and the BF16/FP8 comparison table);

Errors print one line to stderr and exit 1; Ctrl-C prints one line and exits 130 (128 + SIGINT), the
shell's convention.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from fp8lab.reference import e4m3

from . import checkpoint_commands, eval_command, generate_command


def _print_table(out) -> None:
    """All 256 codes: code, bit fields, value and kind."""
    print(f"{'code':>4}  {'bits':>10}  {'value':>12}  kind", file=out)
    for row in e4m3.table():
        print(f"0x{row['code']:02X}  {row['bits']:>10}  {row['value']:>12.9g}  {row['kind']}", file=out)


def _print_encodings(values: list[float], saturate: bool, out) -> None:
    """Each number with its code, bits, E4M3 value and the rounding error."""
    x = np.array(values, dtype=np.float64)
    codes = e4m3.encode(x, saturate=saturate)
    decoded = e4m3.decode(codes).astype(np.float64)
    print(f"{'input':>14}  {'code':>4}  {'bits':>10}  {'e4m3 value':>12}  {'error':>12}", file=out)
    for value, code, got in zip(x, codes, decoded):
        error = got - value if np.isfinite(got) and np.isfinite(value) else float("nan")
        print(f"{value:>14.9g}  0x{int(code):02X}  {e4m3.bits_string(code):>10}  {got:>12.9g}  {error:>12.4g}", file=out)


def _e4m3_command(args) -> int:
    if args.values:
        _print_encodings(args.values, saturate=not args.no_saturate, out=sys.stdout)
    else:
        _print_table(sys.stdout)
    return 0


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _e4m3_values_as_positionals(argv: list[str]) -> list[str]:
    """``fp8lab e4m3 -inf -1e3``: argparse takes ``-inf`` and ``-1e3`` for options (it only knows plain
    ``-1`` and ``-.5`` as negative numbers), so move every number of the command behind ``--``, where
    nothing is an option. Order among the numbers is kept; an explicit ``--`` is left alone."""
    if not argv or argv[0] != "e4m3" or "--" in argv:
        return argv
    numbers = [a for a in argv[1:] if _is_number(a)]
    if not any(a.startswith("-") for a in numbers):
        return argv
    return ["e4m3", *[a for a in argv[1:] if not _is_number(a)], "--", *numbers]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8lab",
        description="fp8lab: reference, simulators, kernels and a small engine for FP8 (E4M3) LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "e4m3",
        help="print the E4M3 code table, or encode numbers to E4M3",
        description="With no numbers, print all 256 E4M3 codes. With numbers, encode each "
        "(round to nearest, ties to even) and show its code, bits, value and error.",
    )
    p.add_argument("values", nargs="*", type=float, metavar="X", help="numbers to encode")
    p.add_argument(
        "--no-saturate",
        action="store_true",
        help="overflow gives NaN (as torch/ml_dtypes casts) instead of saturating to +-448",
    )
    p.set_defaults(handler=_e4m3_command)
    checkpoint_commands.register(sub)
    generate_command.register(sub)
    eval_command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_e4m3_values_as_positionals(list(sys.argv[1:] if argv is None else argv)))
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        # one line, not a traceback; 130 = 128 + SIGINT, what a shell reports for Ctrl-C
        print(f"fp8lab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
