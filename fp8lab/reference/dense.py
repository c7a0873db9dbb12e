"""The dense operators of a Qwen3 layer: *what* is computed, in NumPy.

These functions are the engine's reference numerics (``fp8lab.engine.backend.ReferenceBackend``
computes exactly these, bit for bit): float32 NumPy in the order written here. Where a kernel's
error needs an exact yardstick, a ``*_float64`` function gives the same math in float64.

- ``rms_norm(x, weight, eps)``: Qwen3RMSNorm over the last axis,
  ``y = weight * (x / sqrt(mean(x^2) + eps))``; float32 with NumPy's (pairwise) sum of squares and
  ``eps`` rounded to float32. ``add_rms_norm(x, residual, weight, eps)`` is the fused residual add:
  ``h = residual + x`` (one float32 addition), returned beside ``rms_norm(h)``.
- ``rope_cos_sin(positions, head_dim, theta)``: ``cos`` and ``sin`` of the angles
  ``p * theta^(-2i / head_dim)``, ``i < head_dim / 2``, computed in float64 and rounded once to
  float32 (transformers computes them in float32, about ``p * 2^-24`` radians off).
  ``rope(x, positions, theta)``: the NeoX ``rotate_half`` form over the whole head: dimension
  ``i < h = head_dim / 2`` rotates with ``i + h``: ``y_i = x_i c - x_{i+h} s``,
  ``y_{i+h} = x_{i+h} c + x_i s``, each product rounded (float32).
- ``silu_mul(gate, up)``: SwiGLU ``silu(gate) * up = gate / (1 + exp(-gate)) * up`` in float32
  (``exp(-gate)`` overflows to inf below ``gate = -88.7``, giving ``-0 * up``).
- ``embedding(table, ids)``: the rows ``table[ids]`` as float32 (ids outside ``[0, vocab)`` refused).
- ``linear(x, w)``: ``x @ w.T`` by one float32 NumPy matmul (BLAS; not batch-invariant in the last bit).
- BF16: ``float32_to_bf16_bits`` rounds to nearest, ties to even (overflow gives infinity; NaN
  stays a quiet NaN with its sign), ``bf16_bits_to_float32`` widens exactly, ``round_to_bf16`` is
  both: the float32 values that storing as BF16 and reading back gives.
- ``argmax_rows(logits)``: greedy sampling, the lowest index among equal maxima (``-0 == 0``);
  a row holding NaN has no greedy token: ``NAN_ROW`` (-1).

NaN and infinity propagate as IEEE arithmetic does (a NaN in a row of ``x`` makes the row's norm
NaN, ...); nothing turns a NaN into a number, and ``argmax_rows`` never names a NaN as a token.
Bad arguments raise a one-line ``ValueError`` naming the argument.
"""

from __future__ import annotations

import numpy as np

from .checks import as_float, as_index, require_ndim, require_shape

NAN_ROW = -1
"""``argmax_rows``' answer for a row that holds a NaN: no token."""


def _rows(name: str, x, dtype) -> np.ndarray:
    """``x`` as a float array ``[..., n]`` with ``n >= 1``."""
    arr = as_float(name, x, dtype)
    if arr.ndim < 1 or arr.shape[-1] == 0:
        raise ValueError(f"{name}: expected a float array [..., n] with n >= 1, got shape {arr.shape}")
    return arr


def _vector(name: str, x, n: int, dtype) -> np.ndarray:
    arr = as_float(name, x, dtype)
    require_shape(name, arr, (n,))
    return arr


# ---------------------------------------------------------------------------- RMSNorm


def rms_norm(x, weight, eps) -> np.ndarray:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last axis, float32 (Qwen3RMSNorm).

    ``x``: float ``[..., n]`` (used as float32); ``weight``: float ``[n]`` (as float32); ``eps``: a
    number, rounded to float32. The sum of squares is NumPy's pairwise float32 sum.
    """
    x = _rows("x", x, np.float32)
    weight = _vector("weight", weight, x.shape[-1], np.float32)
    variance = np.mean(x * x, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # inf / inf in a row holding inf: NaN, on purpose
        return weight * (x / np.sqrt(variance + np.float32(eps)))


def add_rms_norm(x, residual, weight, eps) -> tuple[np.ndarray, np.ndarray]:
    """The fused residual add and norm: ``(rms_norm(h, weight, eps), h)`` with ``h = residual + x`` (float32).

    ``x``, ``residual``: float ``[..., n]`` of one shape. ``h`` is the new residual stream, which
    the fused kernel writes back into ``residual``.
    """
    x = _rows("x", x, np.float32)
    residual = as_float("residual", residual, np.float32)
    require_shape("residual", residual, x.shape)
    h = residual + x
    return rms_norm(h, weight, eps), h


def rms_norm_float64(x, weight, eps) -> np.ndarray:
    """``rms_norm`` in float64 (the exact yardstick for float32 views): ``x`` and ``weight`` widened
    exactly, ``eps`` rounded to float32 as every float32 view does, then float64 throughout."""
    x = _rows("x", x, np.float64)
    weight = _vector("weight", weight, x.shape[-1], np.float64)
    eps = np.float64(np.float32(eps))
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


# ---------------------------------------------------------------------------- rotary embedding


def rope_cos_sin(positions, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``cos``, ``sin`` float32 ``[T, head_dim // 2]`` of the angles ``p * theta^(-2i / head_dim)``.

    ``positions``: integers ``[T]``; ``head_dim``: positive and even. The angles are computed in
    float64 and rounded once to float32 (transformers computes them in float32, which differs by
    about ``position * 2^-24`` radians).
    """
    positions = as_index("positions", positions)
    require_ndim("positions", positions, 1, "[T]")
    head_dim = int(head_dim)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim: expected a positive even number, got {head_dim}")
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x, positions, theta: float) -> np.ndarray:
    """NeoX rotary embedding of ``x[T, heads, head_dim]`` at ``positions[T]``, float32.

    Dimension ``i < h = head_dim / 2`` rotates with ``i + h`` (``rotate_half``, not ``i + 1``):
    ``y_i = x_i cos - x_{i+h} sin``, ``y_{i+h} = x_{i+h} cos + x_i sin``, with ``cos``, ``sin``
    from ``rope_cos_sin``; each product is rounded, then the sum.
    """
    x = as_float("x", x, np.float32)
    require_ndim("x", x, 3, "[T, heads, head_dim]")
    positions = as_index("positions", positions)
    require_shape("positions", positions, x.shape[:1])
    half = x.shape[-1] // 2
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------------------- SwiGLU


def silu_mul(gate, up) -> np.ndarray:
    """SwiGLU: ``gate / (1 + exp(-gate)) * up``, float32; ``gate``, ``up`` of one shape."""
    gate = as_float("gate", gate, np.float32)
    up = as_float("up", up, np.float32)
    require_shape("up", up, gate.shape)
    # exp(-gate) overflows to inf for gate < -88.7 (silu -> -0) and underflows for large gate: both fine;
    # gate = -inf gives -inf / inf: NaN, on purpose
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return gate / (np.float32(1) + np.exp(-gate)) * up


def silu_mul_float64(gate, up) -> np.ndarray:
    """``silu_mul`` in float64 (inputs widened exactly)."""
    gate = as_float("gate", gate, np.float64)
    up = as_float("up", up, np.float64)
    require_shape("up", up, gate.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        return gate / (1 + np.exp(-gate)) * up


# ---------------------------------------------------------------------------- embedding and linear


def embedding(table, ids) -> np.ndarray:
    """``table[ids]`` as float32: float ``[vocab, hidden]`` rows for integer ``ids`` in ``[0, vocab)``."""
    table = as_float("table", table, np.float32)
    require_ndim("table", table, 2, "[vocab, hidden]")
    ids = as_index("ids", ids)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"ids: expected token ids in [0, {table.shape[0]}), got values in {ids.min()}..{ids.max()}")
    return table[ids]


def _linear_operands(x, w, dtype) -> tuple[np.ndarray, np.ndarray]:
    w = as_float("w", w, dtype)
    require_ndim("w", w, 2, "[N, K]")
    x = as_float("x", x, dtype)
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x: expected shape [..., {w.shape[1]}] (w is {tuple(w.shape)}), got {tuple(x.shape)}")
    return x, w


def linear(x, w) -> np.ndarray:
    """``x[..., K] @ w[N, K]^T`` by one float32 NumPy matmul (what the order of BLAS gives)."""
    x, w = _linear_operands(x, w, np.float32)
    return np.matmul(x, w.T)


def linear_float64(x, w) -> np.ndarray:
    """``linear`` in float64 (inputs widened exactly)."""
    x, w = _linear_operands(x, w, np.float64)
    return np.matmul(x, w.T)


# ---------------------------------------------------------------------------- BF16


def float32_to_bf16_bits(x) -> np.ndarray:
    """float32 (or float16) -> BF16 bit patterns (uint16), round to nearest, ties to even.

    Adding ``0x7FFF + lsb`` to the 32-bit pattern and dropping the low 16 bits rounds half to
    even (the carry propagates into the exponent, so overflow correctly becomes infinity).
    NaN is kept a (quiet) NaN with its sign rather than risking a carry into infinity. float64 is
    refused: going through float32 would round twice.
    """
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16):
        raise ValueError(f"x: expected float32 (or float16) values, got dtype {x.dtype}")
    x = x.astype(np.float32, copy=False)
    bits = x.view(np.uint32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def bf16_bits_to_float32(bits) -> np.ndarray:
    """BF16 bit patterns (uint16, or int16 as torch exports bfloat16) -> float32, exactly: BF16 is
    the upper half of a float32."""
    bits = np.asarray(bits)
    if bits.dtype.kind not in "iu" or bits.dtype.itemsize != 2:
        raise ValueError(f"bits: expected BF16 bit patterns (uint16 or int16), got dtype {bits.dtype}")
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x) -> np.ndarray:
    """The float32 values that storing ``x`` as BF16 and reading it back gives (NaN stays NaN)."""
    return bf16_bits_to_float32(float32_to_bf16_bits(x))


# ---------------------------------------------------------------------------- greedy sampling


def argmax_rows(logits) -> np.ndarray:
    """Greedy tokens of ``logits[..., V]`` (int64 ``[...]``): the lowest index of the row's maximum
    (equal values tie, ``-0 == 0``), or ``NAN_ROW`` (-1) for a row that holds a NaN."""
    logits = _rows("logits", logits, np.float64)  # widening keeps every order, tie and NaN
    return np.where(np.isnan(logits).any(axis=-1), NAN_ROW, np.argmax(logits, axis=-1))
