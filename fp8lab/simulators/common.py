"""What every simulated kernel shares: the warp's width, its butterfly reduction, float32 ``exp2``.

One definition for the view (the kernels' twin is ``fp8lab.numba_kernels.warp``). Checked through the
simulators that use it (``tests/simulators/test_gemv_simt.py``, ``test_splitkv.py``: ``exp2_f32`` within
4 ulp of the exact power).

- ``WARP_SIZE``: 32 lanes;
- ``butterfly_sum(acc)``: ``acc += shfl_xor(acc, off)`` for ``off = 16, 8, 4, 2, 1`` over the last
  (lane) axis, the float32 order of ``fp8lab.numba_kernels.warp.warp_sum``;
- ``exp2_f32(x)``: float32 ``2^x`` of one value by NumPy's float32 loop, which
  ``fp8lab.numba_kernels.mathops.exp2`` calls in the CUDA simulator, so a simulated kernel and its
  simulator agree bit for bit;
- ``exp2_flush(x)``: the same, with results below ``2^-126`` (float32 subnormals) flushed to ``+0``, as the
  hardware's ``ex2.approx.ftz.f32`` does (``fp8lab.numba_kernels.mathops.exp2_flush``); arrays or one value.
"""

from __future__ import annotations

import numpy as np

WARP_SIZE = 32
BUTTERFLY_OFFSETS = (16, 8, 4, 2, 1)


def butterfly_sum(acc: np.ndarray) -> np.ndarray:
    """``acc += shfl_xor(acc, off)`` for ``off = 16, 8, 4, 2, 1`` over the last (lane) axis, float32.

    Lane ``L`` adds lane ``L ^ off``'s value; afterwards every lane holds the warp's total (float32
    addition commutes, so the partners compute the same bits).
    """
    lanes = np.arange(WARP_SIZE)
    for off in BUTTERFLY_OFFSETS:
        acc = acc + acc[..., lanes ^ off]
    return acc


def exp2_f32(x) -> np.float32:
    """``2^x`` of one float32 through the same NumPy loop as the arrays above (for kernels in the CUDA simulator).

    ``fp8lab.numba_kernels.mathops.exp2`` calls this in simulator mode, so a kernel matches this model bit
    for bit. It evaluates a contiguous 1-element array rather than a scalar so that NumPy takes the
    same (SIMD) inner loop as for the model's arrays.
    """
    return np.exp2(np.array([x], dtype=np.float32))[0]


SMALLEST_NORMAL_F32 = np.float32(2.0**-126)


def exp2_flush(x):
    """``2^x`` in float32 (NumPy's loop, as ``exp2_f32``), ``+0`` where the result is below ``2^-126``: the flash
    prefill's exponent (``ex2.approx.ftz.f32`` on a GPU). NaN stays NaN. Arrays in, an array out; one value in, one
    float32 out."""
    scalar = np.ndim(x) == 0
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.exp2(np.array(x, dtype=np.float32, ndmin=1))
    y = np.where(y < SMALLEST_NORMAL_F32, np.float32(0), y)
    return y[0] if scalar else y
