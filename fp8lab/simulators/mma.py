"""Warp-level model of the tensor-core instruction ``mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32``.

Models one warp's ``mma`` (``fp8lab.numba_kernels.mma``; its simulator twin is built on this). Checked
(``tests/simulators/test_mma.py``): fragment maps against ARCHITECTURE.md's table, ``D`` against float64
``A @ B + C``.

One ``mma`` is a *warp* instruction: 32 lanes together compute ``D = A @ B + C`` for a 16x16
A (row-major, ``.row``), a 16x8 B (k x n, column-major, ``.col``) and a 16x8 float32 C/D. No lane
holds a whole matrix; each holds a *fragment*, a few elements at fixed coordinates. With lane
``L``, ``g = L >> 2`` (group id) and ``t = L & 3`` (thread in group), PTX ISA "Matrix Fragments
for mma.m16n8k16 with floating point type" gives:

========  =====================================================================================
A a0..a7  (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1) (g, 2t+8) (g, 2t+9) (g+8, 2t+8) (g+8, 2t+9)
B b0..b3  (k, n) = (2t, g) (2t+1, g) (2t+8, g) (2t+9, g)
C c0..c3  (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1)
========  =====================================================================================

``A_COORDS[L, i]``, ``B_COORDS[L, i]`` and ``C_COORDS[L, i]`` hold those ``(row, col)`` pairs
(``(k, n)`` for B). A and B elements are 16-bit and travel two per 32-bit register, lower index in
the low half: ``a`` is 4 registers ``{a0|a1, a2|a3, a4|a5, a6|a7}``, ``b`` is 2; C/D are 4
float32 registers. ``b0, b1`` are ``B[2t, g], B[2t+1, g]``: adjacent K of one column, i.e. two
adjacent bytes of weight row ``g`` when the weight is stored ``[N, K]`` (n-major), which is why
FP8 weight rows feed B without a transpose (``load_b_from_nk``).

**Accumulation model** (``mma``), deterministic and simple enough to re-implement bit for bit::

    d[i, j] = fl32( c[i, j] + fl32( S[i, j] ) ),   S[i, j] = sum_{k=0..15} a[i, k] * b[k, j]

where each product is formed exactly and ``S`` is summed in float64 in ascending ``k``; ``fl32``
rounds to nearest float32 (ties to even). BF16 x BF16 products have 16 significant bits and
F16 x F16 products 22, so they are exact in float64 (even float32 x float32, 48 bits, would be).
The float64 sum of the 16 products is exact too, hence order-free and equal to the true sum, as
long as the products' exponents span at most ``49 - p`` binades, ``p`` being the significant
bits of a product: 33 binades for BF16 (p = 16), 27 for F16 (p = 22). Only beyond that does the
ascending order matter, and the model still defines the result.

This is an *idealized* tensor core. Real HMMA hardware aligns the products to the largest
exponent in a limited-width adder and truncates, so its rounding error is relative to the
*largest terms*, not to the result. Measured on an H200 (20 000 random warps per case, BF16 and
F16): integer-valued fragments match the model bit for bit; on random data about half to 90 %
of outputs are bit-identical and ``|d_gpu - d_model| <= 3 * 2^-23 * (|c| + sum_k |a b|)`` (about
``2^-23 * sum_k |a b|`` with ``c = 0``; up to ``8 * 2^-23`` with F16-subnormal activations; a
couple of ``2^-149`` where results are float32 subnormals), which is many ulp of ``d`` where the
sum cancels. Subnormal inputs and results are not flushed to zero.
That is why GPU checks use a relative-error bound while simulator-vs-simulator checks are bit
for bit.

Every function accepts leading batch axes (``[..., 32, 8]`` fragments and so on) so a whole grid
of warps can be modelled in one vectorized call.
"""

from __future__ import annotations

import numpy as np

from . import bit_placement
from .common import WARP_SIZE

MMA_M, MMA_N, MMA_K = 16, 8, 16
"""The instruction shape m16n8k16."""
A_PER_LANE, B_PER_LANE, C_PER_LANE = 8, 4, 4
"""Elements per lane: A 16*16/32, B 16*8/32, C 16*8/32."""
A_REGISTERS, B_REGISTERS, C_REGISTERS = 4, 2, 4
"""32-bit registers per lane: A and B pack two 16-bit elements per register, C is float32."""


def group_id(lane):
    """``lane >> 2``: the row (of A and C) or column (of B) group a lane belongs to, 0..7."""
    return np.asarray(lane) >> 2


def thread_in_group(lane):
    """``lane & 3``: a lane's position inside its group of four, 0..3."""
    return np.asarray(lane) & 3


# ---------------------------------------------------------------------------- coordinate maps

_LANES = np.arange(WARP_SIZE)[:, None]


def _a_coords() -> np.ndarray:
    g, t, i = group_id(_LANES), thread_in_group(_LANES), np.arange(A_PER_LANE)[None, :]
    row = g + 8 * ((i >> 1) & 1)  # a2, a3, a6, a7 sit 8 rows further down
    col = 2 * t + (i & 1) + 8 * (i >> 2)  # a4..a7 sit in the right half (k + 8)
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def _b_coords() -> np.ndarray:
    g, t, i = group_id(_LANES), thread_in_group(_LANES), np.arange(B_PER_LANE)[None, :]
    k = 2 * t + (i & 1) + 8 * (i >> 1)  # b2, b3 sit in the lower half (k + 8)
    n = g
    return np.stack(np.broadcast_arrays(k, n), axis=-1)


def _c_coords() -> np.ndarray:
    g, t, i = group_id(_LANES), thread_in_group(_LANES), np.arange(C_PER_LANE)[None, :]
    row = g + 8 * (i >> 1)  # c2, c3 sit 8 rows further down
    col = 2 * t + (i & 1)
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def _owners(coords: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Invert a coordinate map: ``owners[r, c] = (lane, index)`` of the element at ``(r, c)``."""
    owners = np.full((*shape, 2), -1, dtype=np.int64)
    lanes, index = np.meshgrid(np.arange(coords.shape[0]), np.arange(coords.shape[1]), indexing="ij")
    owners[coords[..., 0], coords[..., 1]] = np.stack([lanes, index], axis=-1)
    assert (owners >= 0).all(), "a fragment map must cover every element exactly once"
    return owners


def _frozen(x: np.ndarray) -> np.ndarray:
    x.setflags(write=False)
    return x


A_COORDS = _frozen(_a_coords())
"""``[32, 8, 2]``: ``A_COORDS[lane, i] = (row, col)`` of ``a_i`` in the 16x16 A."""
B_COORDS = _frozen(_b_coords())
"""``[32, 4, 2]``: ``B_COORDS[lane, i] = (k, n)`` of ``b_i`` in the 16x8 B."""
C_COORDS = _frozen(_c_coords())
"""``[32, 4, 2]``: ``C_COORDS[lane, i] = (row, col)`` of ``c_i`` (and ``d_i``) in the 16x8 C/D."""
A_OWNERS = _frozen(_owners(A_COORDS, (MMA_M, MMA_K)))
"""``[16, 16, 2]``: ``A_OWNERS[row, col] = (lane, i)``, the inverse of ``A_COORDS``."""
B_OWNERS = _frozen(_owners(B_COORDS, (MMA_K, MMA_N)))
"""``[16, 8, 2]``: ``B_OWNERS[k, n] = (lane, i)``."""
C_OWNERS = _frozen(_owners(C_COORDS, (MMA_M, MMA_N)))
"""``[16, 8, 2]``: ``C_OWNERS[row, col] = (lane, i)``."""


# ---------------------------------------------------------------------------- tiles <-> fragments


def _require_tail(name: str, x: np.ndarray, tail: tuple[int, int]) -> np.ndarray:
    if x.ndim < 2 or x.shape[-2:] != tail:
        raise ValueError(f"{name}: expected shape [..., {tail[0]}, {tail[1]}], got {x.shape}")
    return x


def load_a(a_tile) -> np.ndarray:
    """A 16x16 A tile ``[..., 16, 16]`` (row, k) -> the warp's A fragments ``[..., 32, 8]``."""
    a = _require_tail("a_tile", np.asarray(a_tile), (MMA_M, MMA_K))
    return a[..., A_COORDS[..., 0], A_COORDS[..., 1]]


def load_b(b_tile) -> np.ndarray:
    """A 16x8 B tile ``[..., 16, 8]`` (k, n) -> the warp's B fragments ``[..., 32, 4]``."""
    b = _require_tail("b_tile", np.asarray(b_tile), (MMA_K, MMA_N))
    return b[..., B_COORDS[..., 0], B_COORDS[..., 1]]


def load_b_from_nk(w_tile) -> np.ndarray:
    """B stored n-major, as weight rows are: ``w_tile[..., n, k]`` of shape ``[..., 8, 16]``
    (so ``B = w_tile^T``) -> B fragments ``[..., 32, 4]``. Lane ``L`` reads row ``g`` of the
    weight; its ``(b0, b1)`` and ``(b2, b3)`` are 2 adjacent elements each."""
    w = _require_tail("w_tile", np.asarray(w_tile), (MMA_N, MMA_K))
    return w[..., B_COORDS[..., 1], B_COORDS[..., 0]]


def load_c(c_tile) -> np.ndarray:
    """A 16x8 C tile ``[..., 16, 8]`` -> accumulator fragments ``[..., 32, 4]``."""
    c = _require_tail("c_tile", np.asarray(c_tile), (MMA_M, MMA_N))
    return c[..., C_COORDS[..., 0], C_COORDS[..., 1]]


def store_c(c_frag) -> np.ndarray:
    """Accumulator (C or D) fragments ``[..., 32, 4]`` -> the 16x8 tile ``[..., 16, 8]``."""
    c = _require_tail("c_frag", np.asarray(c_frag), (WARP_SIZE, C_PER_LANE))
    return c[..., C_OWNERS[..., 0], C_OWNERS[..., 1]]


def assemble_a(a_frag) -> np.ndarray:
    """A fragments ``[..., 32, 8]`` -> the 16x16 A tile they describe (what the tensor core
    gathers from the 32 lanes). Inverse of ``load_a``."""
    a = _require_tail("a_frag", np.asarray(a_frag), (WARP_SIZE, A_PER_LANE))
    return a[..., A_OWNERS[..., 0], A_OWNERS[..., 1]]


def assemble_b(b_frag) -> np.ndarray:
    """B fragments ``[..., 32, 4]`` -> the 16x8 (k, n) B tile. Inverse of ``load_b``."""
    b = _require_tail("b_frag", np.asarray(b_frag), (WARP_SIZE, B_PER_LANE))
    return b[..., B_OWNERS[..., 0], B_OWNERS[..., 1]]


# ---------------------------------------------------------------------------- registers


def pack_registers(halves) -> np.ndarray:
    """16-bit fragment elements ``[..., 2r]`` (uint16) -> ``r`` uint32 registers ``[..., r]``;
    element ``2j`` goes to the low half of register ``j``, element ``2j+1`` to the high half."""
    h = np.asarray(halves)
    if h.dtype != np.uint16 or h.ndim == 0 or h.shape[-1] % 2:
        raise ValueError(f"halves: expected uint16 [..., 2r], got dtype {h.dtype}, shape {h.shape}")
    return h[..., 0::2].astype(np.uint32) | (h[..., 1::2].astype(np.uint32) << 16)


def unpack_registers(registers) -> np.ndarray:
    """uint32 registers ``[..., r]`` -> their 16-bit halves ``[..., 2r]`` (uint16), low half first."""
    r = np.asarray(registers)
    if r.dtype != np.uint32:
        raise ValueError(f"registers: expected uint32, got dtype {r.dtype}")
    low, high = bit_placement.split_register(r)
    return np.stack([low, high], axis=-1).reshape(*r.shape[:-1], 2 * r.shape[-1])


# ---------------------------------------------------------------------------- the accumulation model


def k16_sum(a_tile, b_tile) -> np.ndarray:
    """``S[..., i, j] = sum_k a[..., i, k] * b[..., k, j]`` over the 16 k, each product exact and
    the sum taken in float64 in ascending k: the inner part of the ``mma`` model. Returns float64
    ``[..., 16, 8]``; batch axes broadcast.

    The loop runs over k only; each iteration is one multiply-add over every (i, j) of every tile
    in the batch. The row axis i goes first and the column axis j last during the loop, so NumPy's
    innermost loop runs over (batch, j) together instead of over 8 columns at a time.
    """
    a = _require_tail("a_tile", np.asarray(a_tile, dtype=np.float64), (MMA_M, MMA_K))
    b = _require_tail("b_tile", np.asarray(b_tile, dtype=np.float64), (MMA_K, MMA_N))
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.reshape((1,) * (len(batch) + 2 - a.ndim) + a.shape)
    b = b.reshape((1,) * (len(batch) + 2 - b.ndim) + b.shape)
    a_ik = np.ascontiguousarray(np.moveaxis(a, (-2, -1), (0, 1)))[..., None]  # [16 i, 16 k, *batch, 1]
    b_kj = np.ascontiguousarray(np.moveaxis(b, -2, 0))  # [16 k, *batch, 8 j]
    total = a_ik[:, 0] * b_kj[0]  # k = 0: [16 i, *batch, 8 j]
    product = np.empty_like(total)
    for k in range(1, MMA_K):
        np.multiply(a_ik[:, k], b_kj[k], out=product)
        total += product
    return np.moveaxis(total, 0, -2)


def _float_operand(name: str, x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise ValueError(f"{name}: expected float values (use mma_registers for bit patterns), got dtype {arr.dtype}")
    return arr


def mma(a_frag, b_frag, c_frag, *, sums_are_exact: bool = False) -> np.ndarray:
    """One warp-wide ``D = A @ B + C`` on fragments, with the accumulation model of this module.

    ``a_frag``: ``[..., 32, 8]`` values of BF16 or F16 numbers (any float dtype holding them);
    ``b_frag``: ``[..., 32, 4]`` likewise; ``c_frag``: ``[..., 32, 4]`` float32. Batch axes
    broadcast. Returns the D fragments, float32 ``[..., 32, 4]``::

        d[i, j] = fl32(c[i, j] + fl32(S[i, j])),   S = k16_sum(A, B)  (exact products, float64 sum)

    ``sums_are_exact=True`` is a promise by the caller that every float64 partial sum of every
    ``S[i, j]`` is exact (``gemm_mma`` proves it from the operands' exponent ranges). Then the
    order of the additions cannot matter, and ``S`` is computed with ``np.matmul`` (BLAS, any
    order, much faster) instead of the ascending-k loop, with identical bits.
    """
    a = assemble_a(_float_operand("a_frag", a_frag)).astype(np.float64, order="C")  # C order: BLAS-friendly
    b = assemble_b(_float_operand("b_frag", b_frag)).astype(np.float64, order="C")
    c = np.asarray(c_frag)
    if c.dtype != np.float32:
        raise ValueError(f"c_frag: expected the float32 accumulator, got dtype {c.dtype}")
    _require_tail("c_frag", c, (WARP_SIZE, C_PER_LANE))
    products_sum = np.matmul(a, b) if sums_are_exact else k16_sum(a, b)
    products_sum = load_c(products_sum.astype(np.float32))  # first rounding: fl32(S)
    return c + products_sum  # second rounding: one float32 add per element


def mma_registers(a_regs, b_regs, c_frag, fmt: str) -> np.ndarray:
    """``mma`` on register contents, as a kernel issues it: ``a_regs`` uint32 ``[..., 32, 4]``
    and ``b_regs`` uint32 ``[..., 32, 2]`` hold BF16 or F16 (``fmt``) bit patterns, two per
    register, lower index in the low half; ``c_frag`` float32 ``[..., 32, 4]``."""
    a_bits = unpack_registers(_require_tail("a_regs", np.asarray(a_regs), (WARP_SIZE, A_REGISTERS)))
    b_bits = unpack_registers(_require_tail("b_regs", np.asarray(b_regs), (WARP_SIZE, B_REGISTERS)))
    a = bit_placement.bits_to_float32(a_bits, fmt)
    b = bit_placement.bits_to_float32(b_bits, fmt)
    return mma(a, b, c_frag)
