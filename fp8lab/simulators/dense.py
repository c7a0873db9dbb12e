"""*How* the dense kernels compute: their float32 operations in their order, vectorized in NumPy.

Models ``fp8lab.numba_kernels.layers`` (norms, RoPE, SwiGLU, BF16 linear, argmax) bit for bit. Checked
(``tests/simulators/test_dense_simulator.py``): against ``fp8lab.reference.dense`` bit for bit where the
math is exact or the operations are the same, within a float32 bound otherwise, and against by-hand
lane loops. What the kernels compute is ``fp8lab.reference.dense``; they differ from it only in the
order of their sums and in where they fuse a multiply-add (``fp8lab.simulators.fma.fma_f32``, the
FFMA's single rounding):

- ``rms_norm(x, weight, eps, threads)`` (and ``add_rms_norm``): the ``threads`` of a row
  (``layers.rms_norm_threads_per_row(n)``: one warp, or a CTA of warps) each chain
  ``acc = fma(x_k, x_k, acc)`` over ``k = t, t + threads, ...`` from 0; a butterfly per warp
  (``common.butterfly_sum``); the warps' totals added in warp order from 0. Then
  ``denom = sqrt(ss / n + eps)`` and ``weight * (x / denom)``, each rounded once.
  ``add_parts_rms_norm(parts, ...)``: the residual add of a split-K product, ``sum_parts(parts)``
  (``parts[0] + parts[1] + ...``, float32, in part order) added to the residual in one addition.
- ``rope(x, positions, cos_sin)``: from the float32 table of ``layers.rope_table``,
  ``y_i = fma(x_i, c, -(x_{i+h} s))``, ``y_{i+h} = fma(x_{i+h}, c, x_i s)``; a position outside
  the table gives a NaN vector.
- ``silu_mul(gate_up)``: ``gate / (1 + exp(-gate)) * up`` elementwise, each operation float32
  (``exp_f32``, NumPy's float32 exp, is what the kernel calls in the CUDA simulator; a GPU's
  ``expf`` is within 2 ulp of it, not equal).
- ``bf16_linear(x, w_bits)``: lane ``L`` of a weight row's warp owns the 8-element chunks
  ``c = L, L + 32, ...`` and chains ``acc = fma(x[m, k], w[n, k], acc)`` over its ``k`` in
  increasing order from 0; then the butterfly; lane 0's total is the output. The order depends on
  ``K`` only (not on ``M`` or the launch's tiles).
- ``argmax_rows(logits, threads)``: thread ``t`` scans ``k = t, t + threads, ...`` keeping the
  winner under ``beats`` (a NaN beats every number, then the larger value, then the lower
  index), a butterfly merges each warp, thread 0 merges the warps in order; a NaN winner gives
  ``NAN_ROW``. That is one CTA of the kernel, which splits a row into slices of CTAs
  (``layers.argmax_launch``) and merges their winners; ``beats`` is a total order, so any split and
  any number of threads give the same answer, ``reference.dense.argmax_rows``'s.
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference.dense import NAN_ROW, bf16_bits_to_float32

from .common import BUTTERFLY_OFFSETS, WARP_SIZE, butterfly_sum
from .fma import fma_f32

ELEMENTS_PER_CHUNK = 8
"""bf16_linear: a lane's chunk is 8 BF16 weights (one 128-bit load)."""
NO_INDEX = 0x7FFFFFFF
"""argmax_rows' starting index: loses every tie against a real element."""


def exp_f32(x) -> np.float32:
    """float32 ``e^x`` of one value by NumPy's float32 loop on a 1-element array (the loop the
    vectorized ``silu_mul`` takes); ``layers.exp_f32`` in the CUDA simulator. Overflow gives inf."""
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(np.array([x], dtype=np.float32))[0]


def _check_threads(threads: int) -> int:
    threads = int(threads)
    if threads <= 0 or threads % WARP_SIZE:
        raise ValueError(f"threads: expected a positive multiple of {WARP_SIZE}, got {threads}")
    return threads


# ---------------------------------------------------------------------------- RMSNorm


def sum_of_squares(x: np.ndarray, threads: int) -> np.ndarray:
    """The kernel's float32 sum of squares of each row of ``x[rows, n]`` with ``threads`` per row
    (the order in the module docstring)."""
    threads = _check_threads(threads)
    rows, n = x.shape
    acc = np.zeros((rows, threads), np.float32)
    for start in range(0, n, threads):
        k = start + np.arange(threads)
        v = x[:, np.minimum(k, n - 1)]
        acc = np.where(k < n, fma_f32(v, v, acc), acc)  # threads past the row's end add nothing
    warp_totals = butterfly_sum(acc.reshape(rows, threads // WARP_SIZE, WARP_SIZE))[..., 0]
    total = np.zeros(rows, np.float32)
    for w in range(threads // WARP_SIZE):
        total = total + warp_totals[:, w]
    return total


def rms_norm(x, weight, eps, threads: int) -> np.ndarray:
    """``layers.rms_norm`` of float32 ``x[..., n]`` with float32 ``weight[n]``, ``threads`` per row."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    total = sum_of_squares(rows, threads)
    denom = np.sqrt(total / np.float32(n) + np.float32(eps))
    return (np.asarray(weight, np.float32) * (rows / denom[:, None])).reshape(x.shape)


def add_rms_norm(x, residual, weight, eps, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """``layers.add_rms_norm``: ``(rms_norm(h), h)`` with ``h = residual + x`` (one float32 addition),
    the new residual that the kernel stores."""
    h = np.asarray(residual, np.float32) + np.asarray(x, np.float32)
    return rms_norm(h, weight, eps, threads), h


def sum_parts(parts) -> np.ndarray:
    """A split-K product from its parts ``[S, ...]``: ``((parts[0] + parts[1]) + parts[2]) + ...`` in
    float32, in part order (one part is itself). What the consumer of ``gemv_simt_split_k`` computes."""
    parts = np.asarray(parts, np.float32)
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total


def add_parts_rms_norm(parts, residual, weight, eps, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """``layers.add_parts_rms_norm``: ``add_rms_norm(sum_parts(parts), residual, ...)``."""
    return add_rms_norm(sum_parts(parts), residual, weight, eps, threads)


# ---------------------------------------------------------------------------- rotary embedding


def rope(x, positions, cos_sin) -> np.ndarray:
    """``layers.rope`` of float32 ``x[T, heads, head_dim]`` at int ``positions[T]`` with the float32
    table ``cos_sin[max_positions, head_dim]`` (cos in the first half of a row, sin in the second)."""
    x = np.asarray(x, np.float32)
    positions = np.asarray(positions)
    half = x.shape[-1] // 2
    inside = (positions >= 0) & (positions < cos_sin.shape[0])
    row = np.where(inside, positions, 0)
    c, s = cos_sin[row, None, :half], cos_sin[row, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    out = np.concatenate([fma_f32(x1, c, -(x2 * s)), fma_f32(x2, c, x1 * s)], axis=-1)
    out[~inside] = np.nan  # the kernel does not read the table there
    return out


# ---------------------------------------------------------------------------- SwiGLU


def silu_mul(gate_up) -> np.ndarray:
    """``layers.silu_mul`` of the fused float32 ``gate_up[T, 2 I]``: ``[T, I]``."""
    gate_up = np.asarray(gate_up, np.float32)
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    with np.errstate(over="ignore", under="ignore"):  # exp(-gate) overflows below -88.7: silu -> -0
        return gate / (np.float32(1) + np.exp(-gate)) * up


# ---------------------------------------------------------------------------- BF16 linear


def bf16_linear(x, w_bits) -> np.ndarray:
    """``layers.bf16_linear``: float32 ``x[M, K] @ W^T`` for BF16 patterns ``w_bits[N, K]`` (uint16 or
    int16), ``K`` a multiple of 8; float32 ``[M, N]`` in the kernel's order (module docstring)."""
    x, w = np.asarray(x, np.float32), bf16_bits_to_float32(w_bits)
    m, k = x.shape
    if w.ndim != 2 or w.shape[1] != k or k % ELEMENTS_PER_CHUNK:
        raise ValueError(f"w_bits: expected BF16 patterns [N, {k}] with K a multiple of 8, got shape {w.shape}")
    lanes = np.arange(WARP_SIZE)
    acc = np.zeros((m, w.shape[0], WARP_SIZE), np.float32)
    steps = -(-(k // ELEMENTS_PER_CHUNK) // WARP_SIZE)
    for step in range(steps):
        for e in range(ELEMENTS_PER_CHUNK):
            kk = ELEMENTS_PER_CHUNK * (WARP_SIZE * step + lanes) + e  # lane L's e-th element of its chunk
            kc = np.minimum(kk, k - 1)
            acc = np.where(kk < k, fma_f32(x[:, None, kc], w[None, :, kc], acc), acc)
    return butterfly_sum(acc)[..., 0]


# ---------------------------------------------------------------------------- greedy sampling


def beats(v, i, best_v, best_i) -> np.ndarray:
    """Does ``(v, i)`` win over ``(best_v, best_i)``? A NaN beats every number (the lower index
    among NaNs), else the larger value, else (equal, ``-0 == 0``) the lower index. Elementwise."""
    v_nan, best_nan = np.isnan(v), np.isnan(best_v)
    nan_rule = v_nan & (~best_nan | (i < best_i))
    value_rule = np.where(v != best_v, v > best_v, i < best_i)
    return np.where(v_nan | best_nan, nan_rule, value_rule)


def argmax_rows(logits, threads: int) -> np.ndarray:
    """``layers.argmax_rows`` of float32 ``logits[rows, V]`` with ``threads`` per row: int32 ``[rows]``."""
    threads = _check_threads(threads)
    logits = np.asarray(logits, np.float32)
    rows, vocab = logits.shape
    best_v = np.full((rows, threads), -np.inf, np.float32)
    best_i = np.full((rows, threads), NO_INDEX, np.int64)
    for start in range(0, vocab, threads):
        k = start + np.arange(threads)
        v = logits[:, np.minimum(k, vocab - 1)]
        win = (k < vocab) & beats(v, k, best_v, best_i)
        best_v, best_i = np.where(win, v, best_v), np.where(win, k, best_i)
    warps = threads // WARP_SIZE
    best_v, best_i = best_v.reshape(rows, warps, WARP_SIZE), best_i.reshape(rows, warps, WARP_SIZE)
    lanes = np.arange(WARP_SIZE)
    for off in BUTTERFLY_OFFSETS:
        other_v, other_i = best_v[..., lanes ^ off], best_i[..., lanes ^ off]
        win = beats(other_v, other_i, best_v, best_i)
        best_v, best_i = np.where(win, other_v, best_v), np.where(win, other_i, best_i)
    v, i = best_v[:, 0, 0], best_i[:, 0, 0]
    for w in range(1, warps):  # thread 0 merges the warps' winners in warp order
        win = beats(best_v[:, w, 0], best_i[:, w, 0], v, i)
        v, i = np.where(win, best_v[:, w, 0], v), np.where(win, best_i[:, w, 0], i)
    return np.where(np.isnan(v), NAN_ROW, i).astype(np.int32)
