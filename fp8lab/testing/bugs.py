"""The catalog of mistakes FP8 code really makes, each as a wrong variant of the oracle.

A ``BugClass`` names a mistake, says it in one line, and carries a *mutant*: the oracle of one
operator with exactly that mistake. The kit's diagnosis (``fp8lab.testing.checks``) runs every
mutant of the failing operator on the failing input: the classes whose mutant reproduces the
implementation's wrong output are the ones consistent with it. A mutant is written from the
oracle's definition with one change, so reading it shows what the mistake is. The mutants live
beside their operators' family: ``weight_bugs`` (E4M3, blockwise weights, activations, W8A8) and
``kv_bugs`` (the KV cache and attention).
"""

from __future__ import annotations

from .kv_bugs import (
    ALIBI_DECODE_BUGS,
    ALIBI_PREFILL_BUGS,
    CACHE_WRITE_BUGS,
    DECODE_ATTENTION_BUGS,
    KV_BUGS,
    PREFILL_BUGS,
)
from .report import BugClass
from .weight_bugs import (
    ACTIVATION_BUGS,
    DECODE_BUGS,
    DEQUANTIZE_BUGS,
    ENCODE_BUGS,
    GEMM_BUGS,
    QUANTIZE_BUGS,
    W8A8_BUGS,
)

CATALOG = (ENCODE_BUGS + DECODE_BUGS + QUANTIZE_BUGS + DEQUANTIZE_BUGS + GEMM_BUGS + ACTIVATION_BUGS + W8A8_BUGS
           + KV_BUGS + CACHE_WRITE_BUGS + DECODE_ATTENTION_BUGS + ALIBI_DECODE_BUGS + PREFILL_BUGS
           + ALIBI_PREFILL_BUGS)
"""Every bug class, grouped by operator."""

__all__ = ["ACTIVATION_BUGS", "ALIBI_DECODE_BUGS", "ALIBI_PREFILL_BUGS", "CACHE_WRITE_BUGS", "CATALOG",
           "DECODE_ATTENTION_BUGS", "DECODE_BUGS", "DEQUANTIZE_BUGS", "ENCODE_BUGS", "GEMM_BUGS", "KV_BUGS", "PREFILL_BUGS",
           "QUANTIZE_BUGS", "W8A8_BUGS", "BugClass", "bugs_of"]


def bugs_of(operator: str) -> list[BugClass]:
    """The bug classes of one operator."""
    return [b for b in CATALOG if b.operator == operator]
