"""The schedule of fp8lab's tensor-core decode GEMV (``mma.m16n8k16`` with the weights as the A operand), as NumPy.

Models ``fp8lab.numba_kernels.gemv_mma`` bit for bit. Checked (``tests/simulators/test_gemv_mma.py``): against
``fp8lab.reference.blockwise.gemm`` exactly on integer-valued data and within a float32 bound otherwise.

It computes what ``fp8lab.reference.blockwise.gemm`` computes for a handful of rows (``1 <= M <= 32``, a decode
batch or a short prefill)::

    out[m, n] = sum_k a[m, k] * decode(q[n, k]) * scale_inv[n // BN, k // BK]

The tensor-core GEMM (``fp8lab.simulators.gemm_mma``) puts the activations in the mma's 16 rows, so a decode
batch of 4 wastes 12 of them and a CTA covers 32 columns. Here the roles are swapped, as decode GEMM kernels of
the production engines do ("swap AB"): the **weights are the m16 operand** (16 output columns per warp) and
the **activations the n8 operand** (8 batch rows per mma; each further 8 rows, up to 32, take one more mma on
the same A registers), so every weight byte feeds a useful product for any M up to 32 and a warp reads its
weights straight from global memory into registers. Each output element's order is the same whatever M is (a
row never meets another), so the model below holds for one batch tile or four.

1. **Activations** are BF16 (float32 inputs are rounded once, to nearest even, as ``layers.bf16_round``).
2. **Which k a k16 step sums** (``k_order``): the mma's fragment layout gives lane ``(g, t)`` the k positions
   ``2t, 2t + 1, 2t + 8, 2t + 9`` of a step. Summing contiguous k would make each lane gather 2-byte pieces.
   Instead a warp walks K in 64-wide *spans*; in span ``p`` lane ``(g, t)`` loads the 16 bytes
   ``[64 p + 16 t, 64 p + 16 t + 16)`` of its two weight rows and the 16 activations of its batch row at the
   same k, and k16 step ``j`` (0..3) of the span sums the 16 k ``64 p + 16 t' + 4 j + r`` (``t'``, ``r`` in
   0..3): fragment position ``f`` is ``k = 64 p + 16 ((f % 8) // 2) + 4 j + 2 (f // 8) + f % 2``. The mma's
   float64 sum runs in fragment order, so the model applies ``gemm_mma``'s arithmetic to K permuted that way.
3. **K slices** (``k_slices`` S, the warps of a CTA): the ``C = K / 128`` chunks are cut into S contiguous
   slices of ``ceil(C / S)`` chunks (the last ones may be shorter or empty); warp ``w`` of a CTA runs
   ``gemm_mma``'s per-chunk order on slice ``w`` (``c_part = 0``, 8 mma steps, ``c_fin = fma(s, c_part *
   2^120, c_fin)``, chunks ascending) and the CTA adds the warps' results in warp order,
   ``((fin_0 + fin_1) + fin_2) + ...`` (an empty slice is ``+0``).
4. **SwiGLU** (``gemv_mma_swiglu``): the product with the fused gate/up weight, then ``dense.silu_mul``
   (the kernel's 16 weight rows are 8 gate and the matching 8 up rows, so a lane holds both of an output).

NaN codes are not rejected (they become +-480 by bit placement, as in every view); a NaN activation gives NaN
outputs in its row.
"""

from __future__ import annotations

import numpy as np

from fp8lab.reference import blockwise

from . import bit_placement, dense, gemm_mma, mma

BATCH_TILE = 8
"""Activation rows per mma: the n8 operand."""
MAX_ROWS = 4 * BATCH_TILE
"""Rows of a call: one to four n8 tiles, multiplied on the same A registers (each row's order is the same)."""
SPAN = 64
"""K per span: lane ``(g, t)`` reads the 16 k ``[16 t, 16 t + 16)`` of each span."""
K_CHUNK = gemm_mma.K_CHUNK
ROWS_PER_WARP = 16
"""Weight rows (output columns) per warp: the mma's m16."""
K_SLICES_CHOICES = (1, 2, 4, 8)
"""Warps per CTA: at most 8, so that a CTA fits the SM's 65,536 registers at any register count (255 x 256)."""


def k_order(k: int) -> np.ndarray:
    """The k of each fragment position, step by step: ``order[16 s + f]`` is the k that k16 step ``s`` (of
    the whole K) sums at fragment position ``f``. A permutation of ``range(k)`` within each 64-wide span."""
    if k % SPAN:
        raise ValueError(f"K: expected a multiple of {SPAN}, got {k}")
    f = np.arange(16)
    within_step = 16 * ((f % 8) // 2) + 2 * (f // 8) + f % 2  # [16]: offset of fragment position f
    steps = np.arange(k // 16)
    span, j = steps // 4, steps % 4
    return (SPAN * span[:, None] + 4 * j[:, None] + within_step[None, :]).reshape(k)


def slice_chunks(num_chunks: int, k_slices: int) -> list[range]:
    """The chunks warp ``w`` of a CTA multiplies: ``ceil(C / S)`` contiguous chunks each, the last ones
    shorter or empty."""
    per = -(-num_chunks // k_slices)
    return [range(min(w * per, num_chunks), min((w + 1) * per, num_chunks)) for w in range(k_slices)]


def check_rows(name: str, m: int) -> None:
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"{name}: expected 1 to {MAX_ROWS} rows (four n8 tiles of the mma), got {m}")


def gemv_mma(a, q, scale_inv, block=blockwise.DEFAULT_BLOCK, *, k_slices: int = 4) -> np.ndarray:
    """``a[M, K] @ (decode(q) * scale_inv)^T`` as ``fp8lab.numba_kernels.gemv_mma`` computes it: float32 ``[M, N]``.

    ``a``: float32 values (rounded once to BF16) or BF16 bit patterns (uint16), ``1 <= M <= 32`` rows;
    ``q``: E4M3 codes uint8 ``[N, K]``; ``scale_inv``: ``[ceil(N/BN), ceil(K/BK)]``; ``block = (BN, BK)``,
    ``BN % 8 == 0``, ``BK % 128 == 0``; ``K % 128 == 0``. ``k_slices``: the warps per CTA (1, 2, 4 or 8).
    """
    if k_slices not in K_SLICES_CHOICES:
        raise ValueError(f"k_slices: expected one of {K_SLICES_CHOICES}, got {k_slices!r}")
    # gemm_mma's checks (codes, K and block multiples, scales, activations [..., K]), then at most 32 rows
    a_bits, lead, codes, scales, (bn, bk) = gemm_mma._check_arguments(a, q, scale_inv, block, 1, "bf16")
    if len(lead) != 1:
        raise ValueError(f"a: expected [M, K], got shape {(*lead, codes.shape[1])}")
    check_rows("a", a_bits.shape[0])
    n, k = codes.shape
    # The chunk's block scale, one column per chunk: the slices below then take block (BN, 128).
    chunk_scales = np.ascontiguousarray(scales[:, (np.arange(k // K_CHUNK) * K_CHUNK) // bk])

    order = k_order(k)
    a_steps, q_steps = a_bits[:, order], codes[:, order]
    total = None
    for chunks in slice_chunks(k // K_CHUNK, k_slices):
        if len(chunks):
            cols = slice(chunks.start * K_CHUNK, chunks.stop * K_CHUNK)
            part = gemm_mma.gemm_mma(a_steps[:, cols], q_steps[:, cols], chunk_scales[:, chunks.start : chunks.stop],
                                     (bn, K_CHUNK), activation="bf16")
        else:
            part = np.zeros((a_bits.shape[0], n), np.float32)
        total = part if total is None else total + part
    return total


def gemv_mma_swiglu(a, q, scale_inv, block=blockwise.DEFAULT_BLOCK, *, k_slices: int = 4) -> np.ndarray:
    """``silu(x @ gate^T) * (x @ up^T)`` from the fused gate/up weight ``q[2 I, K]``, as
    ``fp8lab.numba_kernels.gemv_mma_swiglu`` computes it: ``dense.silu_mul`` of ``gemv_mma``, float32 ``[M, I]``."""
    return dense.silu_mul(gemv_mma(a, q, scale_inv, block, k_slices=k_slices))


def gemv_mma_bf16(a, w_bits, *, k_slices: int = 4) -> np.ndarray:
    """``a[M, K] @ W^T`` for BF16 weights (bit patterns ``w_bits [N, K]``, the lm_head) as
    ``fp8lab.numba_kernels.gemv_mma.gemv_mma_bf16`` computes it: float32 ``[M, N]``.

    The order of ``gemv_mma`` without bit placement or block scales: K permuted by ``k_order``; per warp's
    slice of 128-wide chunks, per chunk ``c_part = 0`` and 8 mma steps, each ``c_part = fl32(c_part +
    fl32(S))`` with ``S`` the exact float64 sum of the step's 16 products in fragment order
    (``mma.k16_sum``), then ``c_fin = fl32(c_fin + c_part)``; the slices' results added in warp order.
    ``a``: float32 values (rounded once to BF16) or BF16 bit patterns (uint16), ``1 <= M <= 32``; ``K % 128 == 0``.
    """
    if k_slices not in K_SLICES_CHOICES:
        raise ValueError(f"k_slices: expected one of {K_SLICES_CHOICES}, got {k_slices!r}")
    weights = np.asarray(w_bits)
    if weights.ndim != 2 or weights.dtype not in (np.uint16, np.int16):
        raise ValueError(f"w_bits: expected BF16 patterns [N, K] (uint16), got dtype {weights.dtype}, shape {weights.shape}")
    n, k = weights.shape
    if k == 0 or k % K_CHUNK:
        raise ValueError(f"K: expected a positive multiple of {K_CHUNK}, got {k}")
    a_bits = bit_placement.activation_bits(a, "bf16")
    if a_bits.ndim != 2 or a_bits.shape[1] != k:
        raise ValueError(f"a: expected [M, K] with K = {k}, got shape {a_bits.shape}")
    check_rows("a", a_bits.shape[0])
    order = k_order(k)
    a_values = bit_placement.bits_to_float32(a_bits[:, order], "bf16").astype(np.float64)
    w_values = bit_placement.bits_to_float32(weights.view(np.uint16)[:, order], "bf16").astype(np.float64)
    total = None
    for chunks in slice_chunks(k // K_CHUNK, k_slices):
        c_fin = np.zeros((a_bits.shape[0], n), np.float32)
        for chunk in chunks:
            c_part = np.zeros_like(c_fin)
            for step in range(K_CHUNK // mma.MMA_K):
                ks = slice(chunk * K_CHUNK + step * mma.MMA_K, chunk * K_CHUNK + (step + 1) * mma.MMA_K)
                products = a_values[:, None, ks] * w_values[None, :, ks]  # exact: 8-bit significands
                sums = products[..., 0].copy()
                for f in range(1, mma.MMA_K):  # float64, in fragment order, as mma.k16_sum
                    sums += products[..., f]
                c_part = c_part + sums.astype(np.float32)
            c_fin = c_fin + c_part
        total = c_fin if total is None else total + c_fin
    return total
