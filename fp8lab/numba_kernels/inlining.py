"""Faster Numba inlining: the same IR, in about half the compile time of this project's kernels.

numba-cuda's inliner (``InlineWorker.inline_ir``) copies the callee's IR block by block, each block with a
``copy.deepcopy`` of its own, so every block drags along its own copy of the function's whole ``Scope`` (all its
variables): the cost grows with blocks times variables, for each of the two copies an inlining makes. The kernels
here inline tiles of hundreds of blocks, and that copying was about two thirds of a kernel's compile (the flash
prefill: 32 s alone, 18 s with this; ``bench/RESULTS.md``, thirty-first session). With one ``deepcopy`` memo per
``inline_ir`` call the blocks of a copy share one copy of the scope, as the blocks of the IR they copy share one
scope: the same IR, and the same PTX (``tests/numba_kernels/test_kernels_compile.py`` compiles a kernel with and
without it and compares; every variant of the compile checks was compared once by hash).

``install()`` patches numba-cuda's module for the whole process. Nothing in fp8lab calls it on import; the engine's
GPU model (``fp8lab.engine.cuda.model.CudaQwen3Model``) does when it is built (its first forwards at Qwen3-0.6B
compiled in 55 s against 84 s without: ``bench/RESULTS.md``, thirty-second session), and so do the tests' compile
processes and GPU runs and ``bench/engine.py``. Where numba-cuda's inliner is not the shape this patch
expects (another version), it leaves it as it is and returns False, so it can only make compiles faster, never
different.
"""

from __future__ import annotations

import copy
import types

_memos: list[dict] = []
"""The memo of each ``inline_ir`` call in progress (innermost last)."""


def _deepcopy(x, memo=None):
    """``copy.deepcopy`` with the memo of the ``inline_ir`` call in progress, where the caller gives none."""
    if memo is None and _memos:
        memo = _memos[-1]
    return copy.deepcopy(x, memo)


def install() -> bool:
    """Patch numba-cuda's inliner to share one deepcopy memo per inlining; whether it was patched."""
    try:
        from numba.cuda.core import inline_closurecall as inliner
    except ImportError:
        return False
    if getattr(inliner, "_fp8lab_shared_memo", False):
        return True  # installed before
    worker = getattr(inliner, "InlineWorker", None)
    if getattr(inliner, "copy", None) is not copy or worker is None or not hasattr(worker, "inline_ir"):
        return False  # not the inliner this patch knows
    original = worker.inline_ir

    def inline_ir(self, *args, **kwargs):
        _memos.append({})
        try:
            return original(self, *args, **kwargs)
        finally:
            _memos.pop()

    inliner.copy = types.SimpleNamespace(deepcopy=_deepcopy, copy=copy.copy)
    worker.inline_ir = inline_ir
    inliner._fp8lab_shared_memo = True
    return True
