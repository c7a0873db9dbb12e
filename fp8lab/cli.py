"""The ``fp8lab`` command line (the console script ``fp8lab = "fp8lab.cli:main"``).

Subcommands:

- ``fp8lab e4m3``: print the 256-code E4M3 table; ``fp8lab e4m3 X [X ...]``: encode numbers to E4M3 and
  show code, bits, value and rounding error (NumPy only);
- ``fp8lab check MODULE:FUNCTION --op OP``: run the kit on your implementation of an operator
  (``fp8lab.testing.cli``; needs ``fp8lab[testing]``);
- the engine's (``fp8lab[engine]``): checkpoint commands (``quantize``, ``inspect``, ``make-tiny``:
  ``fp8lab.engine.checkpoint_commands``), ``generate`` (``fp8lab.engine.generate_command``), ``eval``
  (``fp8lab.engine.eval_command``: perplexity, and the BF16/FP8 comparison table);
- ``fp8lab serve``: the OpenAI-compatible HTTP server (``fp8lab.serve.command``; needs ``fp8lab[serve]``).

A subcommand whose dependencies are not installed is still listed; running it prints one line saying
which extra to install and exits 1. The engine's errors print one line to stderr and exit 1;
``check`` exits 1 when the check fails and 2 on a usage error; Ctrl-C prints one line and exits 130
(128 + SIGINT), the shell's convention.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from fp8lab.reference import e4m3

ENGINE_COMMANDS = ("quantize", "inspect", "make-tiny", "generate", "eval")
"""The engine's subcommands, listed (and refused in one line) where the engine's dependencies are missing."""


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


def _register_e4m3(sub) -> None:
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


def _register_check(sub) -> None:
    # needs Hypothesis
    from fp8lab.testing import cli as check_cli

    check_cli.register(sub)


def _register_engine(sub) -> None:
    # needs safetensors, tokenizers and tqdm
    from fp8lab.engine import checkpoint_commands, eval_command, generate_command

    checkpoint_commands.register(sub)
    generate_command.register(sub)
    eval_command.register(sub)


def _register_serve(sub) -> None:
    # needs aiohttp (and the engine's packages)
    from fp8lab.serve import command as serve_command

    serve_command.register(sub)


def _register_unavailable(sub, names, extra: str, error: ImportError) -> None:
    """Subcommands ``names`` whose dependencies are missing: listed, and refused in one line naming the extra."""
    def refuse(args) -> int:
        print(f'fp8lab {args.command}: needs fp8lab[{extra}] ({error}): pip install "fp8lab[{extra}]"', file=sys.stderr)
        return 1

    for name in names:
        p = sub.add_parser(name, help=f'(not installed: pip install "fp8lab[{extra}]")', add_help=False)
        p.set_defaults(handler=refuse, takes_anything=True)


def _register_optional(sub, register, names, extra: str) -> None:
    """``register(sub)``, or the refusing stand-ins of ``names`` when its imports fail for want of a
    package (an import error inside fp8lab itself is a bug, and raised)."""
    try:
        register(sub)
    except ImportError as error:
        if (error.name or "").split(".")[0] == "fp8lab":
            raise
        _register_unavailable(sub, names, extra, error)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8lab",
        description="fp8lab: reference, simulators, kernels and a small engine for FP8 (E4M3) LLM inference, "
        "and a kit that checks your FP8 kernel.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_e4m3(sub)
    _register_optional(sub, _register_check, ("check",), "testing")
    _register_optional(sub, _register_engine, ENGINE_COMMANDS, "engine")
    _register_optional(sub, _register_serve, ("serve",), "serve")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(_e4m3_values_as_positionals(list(sys.argv[1:] if argv is None else argv)))
    if extras and not getattr(args, "takes_anything", False):
        # what parse_args does, but from the subcommand's parser where it has one (check's errors are one line)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
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
