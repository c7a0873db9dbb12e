"""fp8lab.testing: point it at your FP8 kernel and it tells you what is wrong.

Each ``check_*`` function takes your implementation of one operator of the contract (a callable on
NumPy arrays) and returns ``None`` when it meets the contract; otherwise it raises
``KernelCheckFailed`` (an ``AssertionError``, so pytest shows it as a failure) whose report holds the
smallest failing input found, the expected and actual values, the tolerance that applies, and the
known bug classes (``fp8lab.testing.bugs.CATALOG``) consistent with the wrong output::

    from fp8lab.testing import check_blockwise_gemm

    def test_my_gemm():
        check_blockwise_gemm(lambda a, q, s, block: my_fp8_gemm(a, q, s, block))

Operators so far: E4M3 encode and decode, blockwise weight quantize / dequantize, the W8A16
and W8A8 blockwise GEMMs, per-token-group activation quantization, FP8 KV quantization per (token, head), the
paged cache write (fp8lab's or vLLM's layout), paged decode attention (GQA, length-0 rows, ALiBi, fp8lab's or
vLLM's layout) and causal prefill (chunked, GQA, ALiBi). Needs NumPy and Hypothesis only
(``pip install "fp8lab[testing]"``).
"""

from .bugs import CATALOG, BugClass
from .checks import (
    check_activation_quantize,
    check_blockwise_dequantize,
    check_blockwise_gemm,
    check_blockwise_quantize,
    check_e4m3_decode,
    check_e4m3_encode,
    check_w8a8_gemm,
)
from .kv_checks import (
    check_kv_quantize,
    check_paged_cache_write,
    check_paged_decode,
    check_prefill,
)
from .report import KernelCheckFailed, Report

__all__ = ["CATALOG", "BugClass", "KernelCheckFailed", "Report", "check_activation_quantize",
           "check_blockwise_dequantize", "check_blockwise_gemm", "check_blockwise_quantize", "check_e4m3_decode",
           "check_e4m3_encode", "check_kv_quantize", "check_paged_cache_write", "check_paged_decode", "check_prefill",
           "check_w8a8_gemm"]
