"""``fp8lab check MODULE:FUNCTION --op OP [options]``: run the kit on a function, for people who do not
write tests.

``MODULE`` is a module name importable from the current directory or ``sys.path`` (``mykernels.fp8``)
or the path of a ``.py`` file (``path/to/kernel.py``); ``FUNCTION`` a name in it (``Class.method`` too).
``--op`` names the operator (``OPS``: one line per ``check_*`` function of the kit, with its
tolerance in words); the options of an op are the keyword parameters of its check, spelled
``--name-with-dashes`` (a bool parameter that defaults to True as ``--no-name``, one that defaults to
False as ``--name``; ``block=(128, 128)`` as ``--block 128x128``), so a parameter a check gains is an
option of the command with no change here. ``--torch DEVICE`` and ``--cupy`` wrap the function through
``fp8lab.testing.adapters`` (it takes and returns torch tensors on DEVICE, or CuPy arrays).

It prints ``passed`` with what was checked (operator, options, tolerance, how many examples the function
was called on), or the kit's report. Exit status: 0 passed; 1 the check failed (the report) or the
function raised (its traceback); 2 the command could not run the check, with one line on stderr naming
the option and the problem (an unknown op, a TARGET that is not MODULE:FUNCTION, a module or function
not found, an option the op does not take or a value its check refuses, a missing torch or device).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path

from . import adapters, checks, kv_checks
from .report import KernelCheckFailed

# the operators: ``--op`` name -> (its check, the tolerance it applies, in words); one entry per check of the kit
OPS = {
    "e4m3-encode": (checks.check_e4m3_encode, "exact, bit for bit (NaN with the input's sign)"),
    "e4m3-decode": (checks.check_e4m3_decode, "exact, all 256 codes (NaN for 0x7F and 0xFF)"),
    "blockwise-quantize": (checks.check_blockwise_quantize,
                           "scales within 4 float32 ulps (BF16: 1 ulp) of amax / 448; |decode(q) s - x| <= 2^-4 |x| + 2^-10 s; no NaN codes"),
    "blockwise-dequantize": (checks.check_blockwise_dequantize, "exact (one float32 product per element)"),
    "blockwise-gemm": (checks.check_blockwise_gemm, "|out - ref| <= gamma(K + 2 ceil(K/BK) + 4) sum_k |a| |w|"),
    "activation-quantize": (checks.check_activation_quantize,
                            "scales within 4 float32 ulps of max(amax, eps) / 448; the quantizers' round-trip bound; no NaN codes"),
    "w8a8-gemm": (checks.check_w8a8_gemm, "|out - ref| <= gamma(BK + ceil(K/BK) + 4) sum |a_s w_s decode(aq) decode(q)|"),
    "kv-quantize": (kv_checks.check_kv_quantize,
                    "scales within 4 float32 ulps of amax / 448 per (token, kv head); the quantizers' round-trip bound"),
    "paged-cache-write": (kv_checks.check_paged_cache_write,
                          "written entries as kv-quantize's, every other entry untouched (exact)"),
    "paged-decode": (kv_checks.check_paged_decode, kv_checks.ATTENTION_TOLERANCE),
    "prefill": (kv_checks.check_prefill, kv_checks.ATTENTION_TOLERANCE),
}

# what each check parameter means as an option (its help adds the ops that take it; a test asks for every one)
HELP = {
    "saturate": "overflow gives NaN instead of saturating to +-448",
    "block": "the weight block (BN, BK) as BNxBK, e.g. 128x128",
    "layout": "the caller's layout: weights nk|kn, KV caches fp8lab|vllm",
    "scale_dtype": "the scales' dtype: float32|bfloat16 (BF16 as uint16 bits)",
    "activation_dtype": "the activations' dtype: float32|bfloat16 (BF16 as uint16 bits)",
    "k_multiple": "only K that are multiples of this (for kernels that need K %% 128 == 0)",
    "group": "the activation group size",
    "eps": "the activation scale's epsilon",
    "fp8": "a float32 cache instead of E4M3 codes with scales",
    "alibi": "ALiBi slopes (passed as alibi_slopes=)",
    "head_dims": "only these head sizes, e.g. 64,128 (for kernels that support some)",
    "block_sizes": "only these KV block sizes, e.g. 16,32 (for kernels that support some)",
    "operands": "what a tensor-core decode kernel rounds its operands to: f32 (nothing), f16 or bf16",
    "max_examples": "how many Hypothesis examples (the environment variable FP8LAB_MAX_EXAMPLES overrides it)",
}

DEST = "check_option_"
"""argparse's ``dest`` prefix of a check parameter's option (kept apart from the command's own arguments)."""


class UsageError(Exception):
    """The command cannot run the check; the message is the one line it prints."""


def _block(text: str) -> tuple[int, int]:
    """``128x128`` -> ``(128, 128)``."""
    try:
        bn, bk = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BNxBK such as 128x128, got {text!r}") from None
    return bn, bk


def _int_list(text: str) -> tuple[int, ...]:
    """``64,128`` -> ``(64, 128)``."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 64,128, got {text!r}") from None


def _option(name: str, default) -> tuple[str, dict]:
    """The flag and ``add_argument`` keywords of a check's keyword parameter ``name=default``."""
    flag, dest = "--" + name.replace("_", "-"), DEST + name
    if isinstance(default, bool):
        return (f"--no-{flag[2:]}", dict(dest=dest, action="store_false")) if default else \
            (flag, dict(dest=dest, action="store_true"))
    if name == "block":
        return flag, dict(dest=dest, type=_block, metavar="BNxBK")
    if isinstance(default, tuple):
        return flag, dict(dest=dest, type=_int_list, metavar="N,N,...")
    if isinstance(default, (int, float, str)):
        return flag, dict(dest=dest, type=type(default), metavar=name.upper())
    raise TypeError(f"fp8lab check: no command-line spelling for a check parameter {name}={default!r}")


def parameters(op: str) -> dict[str, object]:
    """The keyword parameters of ``op``'s check with their defaults (its options)."""
    signature = inspect.signature(OPS[op][0])
    return {name: p.default for name, p in list(signature.parameters.items())[1:]}


def option_flags() -> dict[str, dict]:
    """Every option of every op: flag -> ``add_argument`` keywords, with the ops that take it in its help."""
    flags: dict[str, dict] = {}
    for op in OPS:
        for name, default in parameters(op).items():
            flag, spec = _option(name, default)
            entry = flags.setdefault(flag, dict(spec, default=argparse.SUPPRESS, ops=[], name=name))
            entry["ops"].append(op)
    return flags


def register(subparsers) -> None:
    """Add ``check`` to the ``fp8lab`` command's subparsers."""
    p = subparsers.add_parser("check", help="check your implementation of an FP8 operator against the contract",
                              description="Run fp8lab's check of operator OP on FUNCTION and print 'passed' or the "
                              "report: the smallest failing input, expected and actual values, the tolerance and the "
                              "known bug classes consistent with the output. MODULE is a module name or a .py file.",
                              epilog="exit status: 0 passed, 1 the check failed, 2 a usage error")
    p.add_argument("target", metavar="MODULE:FUNCTION", help="the function: a module name or a .py file, a colon, its name")
    p.add_argument("--op", required=True, choices=list(OPS), metavar="OP", help="the operator: " + ", ".join(OPS))
    device = p.add_mutually_exclusive_group()
    device.add_argument("--torch", metavar="DEVICE", help="the function takes and returns torch tensors on DEVICE (cpu, cuda, ...)")
    device.add_argument("--cupy", action="store_true", help="the function takes and returns CuPy arrays")
    for flag, spec in option_flags().items():
        ops, name = spec.pop("ops"), spec.pop("name")
        spec["help"] = f"{HELP.get(name, name)} (ops: {', '.join(ops)})"
        p.add_argument(flag, **spec)

    def one_line_error(message: str):
        print(f"fp8lab check: {message}", file=sys.stderr)
        raise SystemExit(2)

    p.error = one_line_error  # a usage error is one line (argparse would print the usage first)
    p.set_defaults(handler=_check_command, command_parser=p)


# ---------------------------------------------------------------------------- running a check


def load_function(target: str):
    """The callable named by ``MODULE:FUNCTION`` (``MODULE`` a module name, or a path ending in ``.py``)."""
    module_name, colon, attribute = target.rpartition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"MODULE:FUNCTION: expected a module or .py file, a colon and a function name, got {target!r}")
    try:
        module = _import_file(Path(module_name)) if module_name.endswith(".py") else _import_module(module_name)
    except UsageError:
        raise
    except Exception as error:  # the user's module raised while importing
        raise UsageError(f"importing {module_name} raised {type(error).__name__}: {error}") from None
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise UsageError(f"{module_name} has no function {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise UsageError(f"{target} is not callable (a {type(value).__name__})")
    return value


def _import_module(name: str):
    """Import ``name`` with the current directory on ``sys.path`` (as ``python -m`` has it)."""
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and (name == error.name or name.startswith(error.name + ".")):  # not one it imports
            raise UsageError(f"no module named {name!r} (from {os.getcwd()} or sys.path)") from None
        raise
    finally:
        sys.path.remove(os.getcwd())


def _import_file(path: Path):
    """Run the ``.py`` file ``path`` as a module named after it (its folder on ``sys.path`` meanwhile, for
    its own imports)."""
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    # registered by name, as dataclasses and pickling look a module up; never over a module already loaded
    name = path.stem if path.stem not in sys.modules else f"fp8lab_check_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
    return module


class Counted:
    """The function, counting its calls and keeping the last exception it raised."""

    def __init__(self, fn):
        self.fn, self.calls, self.raised = fn, 0, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        try:
            return self.fn(*args, **kwargs)
        except Exception as error:
            self.raised = error
            raise


def _options_given(args, op: str) -> dict:
    """The check parameters given on the command line; a ``UsageError`` for one that ``op`` does not take."""
    given = {key[len(DEST):]: value for key, value in vars(args).items() if key.startswith(DEST)}
    accepted = parameters(op)
    for name in given:
        if name not in accepted:
            flag = next(flag for flag, spec in option_flags().items() if spec["name"] == name)
            flags = ", ".join(_option(n, d)[0] for n, d in accepted.items()) or "none"
            raise UsageError(f"{flag} is not an option of --op {op} (its options: {flags})")
    return given


def _wrapped(fn, args):
    """``fn`` through the adapter the options ask for (``--torch DEVICE``, ``--cupy``), and in words."""
    try:
        if args.torch:
            return adapters.on_torch(fn, device=args.torch), f" through torch on {args.torch}"
        if args.cupy:
            return adapters.on_cupy(fn), " through CuPy"
    except (ImportError, RuntimeError) as error:
        raise UsageError(f"{'--torch' if args.torch else '--cupy'}: {error}") from None
    return fn, ""


def _check_command(args) -> int:
    try:
        given = _options_given(args, args.op)
        fn, through = _wrapped(load_function(args.target), args)
    except UsageError as error:
        print(f"fp8lab check: {error}", file=sys.stderr)
        return 2
    check, tolerance = OPS[args.op]
    counted = Counted(fn)
    try:
        check(counted, **given)
    except KernelCheckFailed as failure:
        print(f"fp8lab check: FAILED: {args.target}{through} as {args.op}\n{failure}")
        return 1
    except Exception as error:
        if error is counted.raised:
            traceback.print_exception(error)
            print(f"fp8lab check: {args.target} raised {type(error).__name__}: {error}", file=sys.stderr)
            return 1
        if isinstance(error, ValueError) and counted.calls == 0:  # the check refused an option's value
            print(f"fp8lab check: --op {args.op}: {error}", file=sys.stderr)
            return 2
        raise
    options = ", ".join(f"{name}={value!r}" for name, value in {**parameters(args.op), **given}.items())
    print(f"fp8lab check: passed: {args.target}{through} as {args.op} (fp8lab.testing.{check.__name__}"
          f"{', ' + options if options else ''})\n"
          f"  tolerance: {tolerance}\n"
          f"  examples: the function was called {counted.calls} time{'s' if counted.calls != 1 else ''}")
    return 0
