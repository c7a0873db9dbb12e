"""The dense operators of a Qwen3 layer as Numba CUDA kernels: RMSNorm (and the fused residual add),
RoPE, SwiGLU, embedding, the BF16 linear (lm_head), greedy argmax, the residual add, BF16 rounding.

What they compute is ``fp8lab.reference.dense``; how (each kernel's float32 operations in its order,
``cuda.fma`` wherever a product is accumulated, so the GPU compiler cannot contract differently) is
``fp8lab.simulators.dense``. In the CUDA simulator each kernel matches that simulator bit for bit; on a
GPU it matches it wherever the GPU's operations are correctly rounded (all but ``silu_mul``'s ``expf``)
and the oracle within a stated float32 bound (``tests/numba_kernels/test_layer_kernels.py``).

Kernels and launch shapes (CTAs x threads):

1. ``rms_norm(x, weight, eps, out)``: ``weight * (x / sqrt(mean(x^2) + eps))`` over the last axis. For
   ``n <= 256`` (q/k-norm) a warp per row, 4 rows per CTA; otherwise a CTA of
   ``rms_norm_threads_per_row(n)`` threads per row. ``add_rms_norm(x, residual, weight, eps, out)``:
   ``residual += x``, then the norm of the new residual, in one launch (bit for bit ``add_into`` +
   ``rms_norm``); ``add_parts_rms_norm(parts, ...)`` adds a split-K GEMV's parts ``[S, ...]``, summed in
   part order (``gemv_simt.gemv_simt_split_k``), the same way. The order depends on ``n`` only: batch-invariant. A kernel per ``n``: each thread
   loads its (at most 8) elements and weights at once, keeps them in registers and reads the row once;
   ``n > 8192`` takes the generic loop kernel (two passes over the row), in the same order. BF16 output:
   a uint16 ``out`` gets each float32 result as BF16 bits (``bf16_round``'s rounding, in the same
   launch: the input of the FP8 tensor-core GEMM without a rounding launch of its own); the kernels
   are built per output (the factories' ``bf16_out``), the float32 work and the residual unchanged.
2. ``rope(x, positions, cos_sin, out)``: NeoX rotation of ``x[T, heads, head_dim]`` (in place allowed)
   by the float32 table of ``rope_table`` (``reference.dense.rope_cos_sin``, once at load). Launch
   ``(T, heads)``, a thread per pair ``(i, i + head_dim / 2)``.
3. ``silu_mul(gate_up, out)``: ``silu(gate) * up`` of a fused ``gate_up[T, 2I]``. For ``I`` a multiple of 4
   (every model's) launch ``(T, ceil(I / 1024))`` x 256, four elements a thread from two 128-bit loads;
   otherwise ``(T, ceil(I / 256))`` x 256, a thread per element. A uint16 ``out`` gets BF16 bits, as the
   norms'. Each element's operations are the same either way.
4. ``embedding(table, ids, out)``: BF16 table rows as float32 (exact). Launch ``(T, ceil(hidden / 256))`` x 256.
5. ``bf16_linear(x, w_bits, out)``: ``out[M, N] = x[M, K] @ W^T``, ``W`` BF16 bit patterns. Launch
   ``(ceil(N / (4 rows_per_warp)), ceil(M / 8))`` x 128: a warp per ``rows_per_warp`` weight rows and
   a tile of up to 8 rows of ``x``; the order depends on ``K`` only (batch-invariant).
6. ``argmax_rows(logits, out_ids, workspace=argmax_workspace(rows, V))``: greedy sampling, the lowest
   index among equal maxima; a row holding NaN gives ``NAN_ROW`` (-1). One launch ``(rows, P)`` x ``B``
   (``argmax_launch(V)``; vocab 151936: 38 CTAs of 256 threads per row, 4096 logits each): each CTA writes
   its slice's winner to the workspace, the row's last CTA to finish merges them (an atomic counter per
   row, reset by that CTA).
7. ``add_into(x, y)``: ``x += y``. Launch 1-D, a thread per element.
8. ``bf16_round(x, out)``: float32 to BF16 bit patterns, round to nearest even, NaN kept NaN (the input
   cast of the FP8 tensor-core GEMM; the norms and ``silu_mul`` do it themselves for a uint16 ``out``).
   Launch 1-D, a thread per element.

Calling convention (every public function): arrays are Numba device arrays, ``__cuda_array_interface__``
objects (torch, CuPy) or NumPy arrays (on a GPU copied to the device and the results copied back,
which synchronizes; in the simulator NumPy arrays are what kernels take). The caller provides
``out``; ``stream`` is a Numba stream or a ``cuda.core`` GraphBuilder (0: the default stream). With
device arrays a call allocates no device memory and reads nothing back to the host, so it can be
captured in a CUDA graph; shapes, dtypes, contiguity and alignment are checked on the host before
launching (``ValueError`` naming the argument, expected against got). A call with zero rows or
tokens launches nothing. Index arrays are never read on the host: an out-of-range token id or
position gives a NaN row (documented per function) instead of an out-of-bounds read.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, types, uint32

from fp8lab.reference.dense import NAN_ROW, rope_cos_sin

from . import mathops, pdl
from .arguments import (
    as_kernel_array,
    overlaps,
    reject,
    require_c_contiguous,
    require_load_alignment,
)
from .bits import SIMULATOR, bf16_bits_to_f32, f32_as_u32, u32_as_f32
from .dequantize import STORE
from .kv_cache import on_device
from .warp import (
    BUTTERFLY_OFFSETS,
    FULL_MASK,
    WARP_SIZE,
    load_u32x4,
    warp_sum,
)

MAX_THREADS_PER_CTA = 1024
MAX_WARPS_PER_CTA = MAX_THREADS_PER_CTA // WARP_SIZE
MAX_GRID_Y = 65535
ELEMENTWISE_THREADS = 256
"""Threads per CTA of the elementwise kernels (silu_mul, embedding, add_into)."""
NORM_ROWS_PER_CTA = 4
"""Warp-per-row norms: 4 warps, one row each, per CTA."""
WARP_PER_ROW_MAX_N = 256
"""Rows up to this length get a warp each (q/k-norm, head_dim 128); longer rows a CTA."""
NORM_ELEMENTS_PER_THREAD = 8
"""A CTA-per-row norm gives each thread about this many elements (hidden 4096: 512 threads)."""
NORM_THREADS_PER_SM = 1024
"""A CTA-per-row norm launches at most this many threads' worth of CTAs per SM, each walking its rows with the next
row's loads in flight: two CTAs of 512 threads at Qwen3-8B's hidden size, where the registers (52 to 63 a thread) allow
two; eight of 128 at Qwen3-0.6B's, so that a 1,000-token prefill there keeps a CTA per row as before (two CTAs of 128
threads per SM ran its norms 6% slower: ``bench/RESULTS.md``, thirty-second session)."""
NORM_MAX_REGISTER_ELEMENTS = 8
"""The register norm kernels hold up to this many elements (and as many weights; the fused norm also x)
per thread: every n <= 8192 (a 1024-thread CTA has at most 64 registers per thread). Longer rows take
the generic loop kernel."""
ARGMAX_THREADS = 256
"""argmax_rows: threads per CTA (fewer for a slice of under 2048 logits)."""
ARGMAX_LOADS_IN_FLIGHT = 8
"""argmax_rows: a thread issues this many logit loads together before comparing them."""
ARGMAX_MIN_SLICE = 4096
"""argmax_rows: each CTA's slice of a row has at least this many logits (by default)."""
ARGMAX_MAX_CTAS = 64
"""argmax_rows: at most this many CTAs per row (the last one merges their winners with one warp, two each)."""
ARGMAX_MERGES_PER_LANE = ARGMAX_MAX_CTAS // WARP_SIZE
LINEAR_WARPS_PER_CTA = 4
LINEAR_MAX_M_TILE = 8
"""bf16_linear computes up to 8 rows of x per weight load; more rows take more row tiles."""
LINEAR_ROWS_PER_WARP = (1, 2, 4)
LINEAR_CHUNKS_PER_ITERATION = 2
"""A lane issues the weight loads of 2 of its chunks before computing either (more bytes in flight)."""
ELEMENTS_PER_CHUNK = 8
"""8 BF16 weights = 16 bytes = one 128-bit load; K must be a multiple of 8."""
NO_INDEX = 0x7FFFFFFF
"""argmax_rows' starting index: loses every tie against a real element."""
NAN = float32(np.nan)
NEG_INF = float32(-np.inf)


# ---------------------------------------------------------------------------- scalar helpers

if SIMULATOR:
    # NumPy's float32 exp through the loop of the simulator's silu_mul
    from fp8lab.simulators.dense import exp_f32

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def exp_f32(x):
        """float32 ``e^x``: libdevice ``__nv_expf`` (CUDA's ``expf``, at most 2 ulp); overflow gives inf."""
        return libdevice.expf(x)


@cuda.jit(device=True, inline=True)
def sqrt_f32(x):
    """Correctly rounded float32 square root (``sqrt.rn.f32`` on a GPU; in the simulator float64's
    sqrt rounded to float32, which is the same number: 53 >= 2 * 24 + 2 bits)."""
    return float32(math.sqrt(x))


# ---------------------------------------------------------------------------- 1. RMSNorm (and the fused residual add)


@cuda.jit(device=True, inline=True)
def plain_value(x, residual, row, k):
    """rms_norm's first pass: the element itself."""
    return x[row, k]


@cuda.jit(device=True, inline=True)
def summed_parts(parts, row, k):
    """``parts[0][row, k] + parts[1][row, k] + ...`` in float32, in part order (one part: itself): the
    product of a split-K GEMV from its K slices' parts ``[S, rows, n]``
    (``fp8lab.simulators.dense.sum_parts``)."""
    total = parts[0, row, k]
    for s in range(1, parts.shape[0]):
        total += parts[s, row, k]
    return total


@cuda.jit(device=True, inline=True)
def residual_sum(x, residual, row, k):
    """add_rms_norm's first pass: ``residual += x`` (``x`` as parts ``[S, rows, n]``, summed first); the
    new residual is what gets normalized."""
    s = residual[row, k] + summed_parts(x, row, k)
    residual[row, k] = s
    return s


@cuda.jit(device=True, inline=True)
def plain_input(x, residual, row, k):
    return x[row, k]


@cuda.jit(device=True, inline=True)
def residual_input(x, residual, row, k):
    return residual[row, k]


FIRST_PASS = {False: plain_value, True: residual_sum}
"""The generic (long-row) kernel: the value a thread squares (and for the fused norm, stores into the
residual) in the first pass."""
SECOND_PASS = {False: plain_input, True: residual_input}
"""Where the generic kernel's second pass rereads that value. Each element is read and written by one
thread only, so a float32 ``out`` may be ``x`` (the thread has read ``x[k]`` before it writes ``out[k]``)."""


def rms_norm_threads_per_row(n: int) -> int:
    """Threads that sum one row of length ``n``: a warp up to ``WARP_PER_ROW_MAX_N``, else a CTA of
    about ``NORM_ELEMENTS_PER_THREAD`` elements per thread (at most 1024 threads). The summation order
    depends on this number only."""
    if n <= WARP_PER_ROW_MAX_N:
        return WARP_SIZE
    warps = -(-n // (WARP_SIZE * NORM_ELEMENTS_PER_THREAD))
    return WARP_SIZE * min(warps, MAX_WARPS_PER_CTA)


def norm_grid(rows: int, threads: int) -> int:
    """CTAs ``C`` of a CTA-per-row norm over ``rows`` rows of ``threads`` threads: ``NORM_THREADS_PER_SM`` threads' worth
    per SM at most, each CTA taking every ``C``-th row (the register kernel; the loop kernel walks its rows the same way)."""
    from .splitkv import device_num_sms  # splitkv imports this module

    return max(1, min(rows, max(1, NORM_THREADS_PER_SM // threads) * device_num_sms()))


def norm_elements_per_thread(n: int) -> int | None:
    """Elements each thread of a row holds in registers (``ceil(n / threads)``), or None for a row too
    long for that (more than ``NORM_MAX_REGISTER_ELEMENTS`` per thread: the generic loop kernel)."""
    elements = -(-n // rms_norm_threads_per_row(n))
    return elements if elements <= NORM_MAX_REGISTER_ELEMENTS else None


@cuda.jit(device=True, inline=True)
def add_warp_totals(warp_totals, warps):
    """Every thread adds the CTA's warp totals in warp order, from 0."""
    total = float32(0)
    for w in range(warps):
        total += warp_totals[w]
    return total


def rms_norm_register_function(fused: bool, warp_per_row: bool, n: int, bf16_out: bool = False, parts: int = 1):
    """The Python source of the norm kernel ``(x, residual, weight, eps, out)`` for rows of length ``n``
    (non-fused: ``residual`` is ``x``; fused: ``x`` is the parts ``[S, rows, n]`` of what is added, one
    part for a plain add), the row held in registers. ``bf16_out``: ``out`` is uint16 and gets the BF16
    bits of each float32 result (``dequantize.STORE``, ``bf16_round``'s rounding); otherwise float32.

    ``warp_per_row``: launch ``[ceil(rows / 4), 128]``, warp ``w`` of CTA ``b`` takes row ``4 b + w``.
    Otherwise: launch ``[C, rms_norm_threads_per_row(n)]`` with ``C <= rows`` CTAs (``norm_grid``), CTA ``b`` takes
    rows ``b, b + C, b + 2 C, ...`` and issues the loads of its next row before the barrier of the current one, so
    that they fly while it normalizes and stores (a row per CTA left a prefill's norms at half the bandwidth: every
    CTA of a wave loaded, then stored, in step). Thread ``t``
    of a row's ``B`` threads owns ``k = t + B j``, ``j < E = norm_elements_per_thread(n)``: it issues
    all their loads (x, the residual, weight) in one unrolled loop, so they are in flight together,
    then chains ``acc = fma(v, v, acc)`` over ``j`` in order (the generic kernel's order: k increasing),
    reduces as the generic kernel does, and normalizes from the registers (no second read of the row).
    ``parts`` (fused only): the ``S`` of ``x``, a constant of the kernel so that the loads of every part are
    unrolled and in flight together (with ``S`` read at run time the loop went two parts per round trip to the
    L2, one after another). Checked bit for bit against ``fp8lab.simulators.dense.rms_norm`` / ``add_rms_norm``.
    """
    threads = rms_norm_threads_per_row(n)
    elements = norm_elements_per_thread(n)
    if elements is None or warp_per_row != (threads == WARP_SIZE):
        raise ValueError(f"n: no register norm kernel {'warp' if warp_per_row else 'cta'} per row for n = {n}")
    warps = threads // WARP_SIZE
    whole = n % threads == 0  # every thread owns exactly `elements` elements: no bound check
    store = STORE["bf16" if bf16_out else "f32"]
    PARTS_ELEMENTS = parts * elements  # local array sizes must be plain constants

    @cuda.jit(device=True, inline=True)
    def load_weights(weight, t, weights):
        for j in range(elements):
            k = t + threads * j
            if whole or k < n:
                weights[j] = weight[k]

    @cuda.jit(device=True, inline=True)
    def issue_row(x, residual, row, t, values, loaded):
        """The loads of the thread's elements of row ``row`` (the fused norm: the residual, and every part into
        ``loaded [part][element]``), all issued before any is used, so they are in flight together."""
        for j in range(elements):
            k = t + threads * j
            if whole or k < n:
                values[j] = residual[row, k] if fused else x[row, k]
                if fused:
                    for s in range(parts):
                        loaded[s * elements + j] = x[s, row, k]

    @cuda.jit(device=True, inline=True)
    def add_row(residual, row, t, values, loaded):
        """The fused norm: ``values += parts`` (summed in part order first, then one addition), stored back into the
        residual; nothing for the plain norm."""
        if fused:
            for j in range(elements):
                k = t + threads * j
                if whole or k < n:
                    total = loaded[j]
                    for s in range(1, parts):  # the further parts of a split-K product, in part order
                        total = total + loaded[s * elements + j]
                    values[j] = values[j] + total  # residual + x, one float32 addition
                    residual[row, k] = values[j]

    @cuda.jit(device=True, inline=True)
    def load_row(x, residual, weight, row, t, values, weights):
        """The thread's elements of row ``row`` (for the fused norm ``residual + x``, stored back once) and weights."""
        loaded = cuda.local.array(PARTS_ELEMENTS, float32)
        load_weights(weight, t, weights)
        issue_row(x, residual, row, t, values, loaded)
        add_row(residual, row, t, values, loaded)

    @cuda.jit(device=True, inline=True)
    def partial_sum_of_squares(t, values):
        acc = float32(0)
        for j in range(elements):
            if whole or t + threads * j < n:
                acc = cuda.fma(values[j], values[j], acc)
        return acc

    @cuda.jit(device=True, inline=True)
    def normalize(residual, eps, out, row, t, values, weights, sum_of_squares):
        # residual.shape[1] (== n) read at run time, as the generic kernel does: a constant power-of-two n would let
        # the compiler turn the division into a multiply and contract it with `+ eps` into an fma
        denom = sqrt_f32(sum_of_squares / float32(residual.shape[1]) + eps)
        for j in range(elements):
            k = t + threads * j
            if whole or k < n:
                store(out, row, k, weights[j] * (values[j] / denom))

    def rms_norm_warp_kernel(x, residual, weight, eps, out):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        lane = cuda.threadIdx.x % WARP_SIZE
        row = cuda.blockIdx.x * NORM_ROWS_PER_CTA + cuda.threadIdx.x // WARP_SIZE
        if row >= residual.shape[0]:
            return  # the whole warp leaves together
        values = cuda.local.array(elements, float32)
        weights = cuda.local.array(elements, float32)
        load_row(x, residual, weight, row, lane, values, weights)
        total = warp_sum(partial_sum_of_squares(lane, values))
        normalize(residual, eps, out, row, lane, values, weights, total)

    def rms_norm_cta_kernel(x, residual, weight, eps, out):
        t = uint32(cuda.threadIdx.x)  # unsigned indices: no negative-index wraparound in the address arithmetic
        weights = cuda.local.array(elements, float32)
        load_weights(weight, t, weights)  # before the wait: no kernel writes a weight
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        warp_totals = cuda.shared.array((2, MAX_WARPS_PER_CTA), float32)  # two rows' in turn: one barrier per row
        values = cuda.local.array(elements, float32)
        loaded = cuda.local.array(PARTS_ELEMENTS, float32)
        next_values = cuda.local.array(elements, float32)
        next_loaded = cuda.local.array(PARTS_ELEMENTS, float32)
        rows = uint32(residual.shape[0])
        row = uint32(cuda.blockIdx.x)  # the grid has at most `rows` CTAs
        issue_row(x, residual, row, t, values, loaded)
        turn = 0
        while row < rows:
            add_row(residual, row, t, values, loaded)
            warp_total = warp_sum(partial_sum_of_squares(t, values))
            if t % WARP_SIZE == 0:
                warp_totals[turn, t // WARP_SIZE] = warp_total
            following = row + uint32(cuda.gridDim.x)
            if following < rows:  # the next row's loads fly during this row's barrier, normalization and stores
                issue_row(x, residual, following, t, next_values, next_loaded)
            cuda.syncthreads()
            normalize(residual, eps, out, row, t, values, weights, add_warp_totals(warp_totals[turn], warps))
            for j in range(elements):
                values[j] = next_values[j]
            for i in range(PARTS_ELEMENTS):
                loaded[i] = next_loaded[i]
            row = following
            turn = 1 - turn

    return rms_norm_warp_kernel if warp_per_row else rms_norm_cta_kernel


def rms_norm_loop_function(fused: bool, bf16_out: bool = False):
    """The generic CTA-per-row norm kernel ``(x, residual, weight, eps, out)``, any ``n``: the fallback for
    rows too long for registers (``norm_elements_per_thread(n)`` None: ``n > 8192``). Launch ``[C,
    rms_norm_threads_per_row(n)]`` (``norm_grid``), CTA ``b`` taking rows ``b, b + C, ...``; thread ``t`` loops over
    ``k = t, t + B, ...`` twice (the sum of
    squares, then the normalization, rereading the row). The same order as the register kernels.
    Fused: ``x`` is the parts ``[S, rows, n]`` of what is added to the residual (one part: a plain add).
    ``bf16_out``: ``out`` is uint16 BF16 bits, as in ``rms_norm_register_function``.
    Checked bit for bit against ``fp8lab.simulators.dense.rms_norm`` / ``add_rms_norm``.
    """
    first_pass, second_pass, store = FIRST_PASS[fused], SECOND_PASS[fused], STORE["bf16" if bf16_out else "f32"]

    @cuda.jit(device=True, inline=True)
    def normalize(x, residual, weight, eps, out, row, first, stride, sum_of_squares):
        denom = sqrt_f32(sum_of_squares / float32(residual.shape[1]) + eps)
        for k in range(first, residual.shape[1], stride):
            store(out, row, k, weight[k] * (second_pass(x, residual, row, k) / denom))

    @cuda.jit(device=True, inline=True)
    def partial_sum_of_squares(x, residual, row, first, stride):
        acc = float32(0)
        for k in range(first, residual.shape[1], stride):
            v = first_pass(x, residual, row, k)
            acc = cuda.fma(v, v, acc)
        return acc

    def rms_norm_loop_kernel(x, residual, weight, eps, out):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        warp_totals = cuda.shared.array(MAX_WARPS_PER_CTA, float32)
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, residual.shape[0], cuda.gridDim.x):  # rows b, b + C, ... (norm_grid)
            warp_total = warp_sum(partial_sum_of_squares(x, residual, row, t, cuda.blockDim.x))
            if t % WARP_SIZE == 0:
                warp_totals[t // WARP_SIZE] = warp_total
            cuda.syncthreads()
            total = add_warp_totals(warp_totals, cuda.blockDim.x // WARP_SIZE)
            normalize(x, residual, weight, eps, out, row, t, cuda.blockDim.x, total)
            cuda.syncthreads()  # every thread has read the totals before the next row writes them

    return rms_norm_loop_kernel


@functools.cache
def _rms_norm_kernel(fused: bool, n: int, bf16_out: bool, parts: int = 1):
    """The norm kernel for rows of length ``n`` writing float32 or (``bf16_out``) BF16 bits, the fused one adding
    ``parts`` parts (compiled once per ``(fused, n, bf16_out, parts)``). On a GPU it is compiled for its CTA size
    (``launch_bounds``): ptxas keeps within the registers a launch can have."""
    threads = rms_norm_threads_per_row(n)
    warp_per_row = threads == WARP_SIZE
    options = {} if SIMULATOR else {"launch_bounds": WARP_SIZE * NORM_ROWS_PER_CTA if warp_per_row else threads}
    if norm_elements_per_thread(n) is None:
        return cuda.jit(rms_norm_loop_function(fused, bf16_out), **options)
    return cuda.jit(rms_norm_register_function(fused, warp_per_row, n, bf16_out, parts), **options)


def _check_norm(x, weight, out, residual=None):
    """Check the norm arguments; return them as kernel arrays viewed as ``[rows, n]``. ``out``: float32 or
    uint16 (BF16 bits); ``x`` and ``residual``: float32."""
    x, weight, out = (as_kernel_array(n, a) for n, a in (("x", x), ("weight", weight), ("out", out)))
    if x.ndim < 1 or np.dtype(x.dtype) != np.float32 or x.shape[-1] == 0:
        reject("x", "float32 [..., n] with n >= 1", x)
    require_c_contiguous("x", x)
    n = x.shape[-1]
    if tuple(weight.shape) != (n,) or np.dtype(weight.dtype) != np.float32:
        reject("weight", f"float32 [{n}]", weight)
    require_c_contiguous("weight", weight)
    arrays = [] if residual is None else [("residual", as_kernel_array("residual", residual))]
    for name, a in arrays:
        if tuple(a.shape) != tuple(x.shape) or np.dtype(a.dtype) != np.float32:
            reject(name, f"float32 of x's shape {tuple(x.shape)}", a)
        require_c_contiguous(name, a)
    if tuple(out.shape) != tuple(x.shape) or np.dtype(out.dtype) not in (np.float32, np.uint16):
        reject("out", f"float32 or uint16 (BF16 bits) of x's shape {tuple(x.shape)}", out)
    require_c_contiguous("out", out)
    arrays.append(("out", out))
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    flat = [a.reshape(rows, n) for a in (x, *(a for _, a in arrays))]
    return flat, weight, rows, n


def _launch_norm(fused, x, residual, weight, eps, out, rows, n, stream):
    """Launch the norm kernel for ``out``'s dtype (float32, or uint16 BF16 bits). Only a float32 ``out`` may
    be ``x``: a thread writes ``out[k]`` over the ``x[k]`` it has read. A uint16 ``out`` in ``x``'s (or the
    residual's) memory would put an element's bits where another thread may still read, so it must not
    share memory with ``x`` (the parts) or ``residual`` at all."""
    bf16_out = np.dtype(out.dtype) == np.uint16
    if bf16_out and (overlaps(out, x) or overlaps(out, residual)):
        raise ValueError("out: a uint16 (BF16 bits) out must not share memory with x (parts) or residual")
    if rows == 0:
        return
    threads = rms_norm_threads_per_row(n)
    warp_per_row = threads == WARP_SIZE
    grid = -(-rows // NORM_ROWS_PER_CTA) if warp_per_row else norm_grid(rows, threads)
    block = WARP_SIZE * NORM_ROWS_PER_CTA if warp_per_row else threads
    args = [x, residual, weight, np.float32(eps), out]
    written = (1, 4) if fused else (4,)
    parts = x.shape[0] if fused and norm_elements_per_thread(n) is not None else 1  # the loop kernel reads S itself
    _run(_rms_norm_kernel(fused, n, bf16_out, parts), grid, block, stream, args, written)


def rms_norm(x, weight, eps, out, stream=0):
    """``out = weight * (x / sqrt(mean(x^2) + eps))`` over the last axis (Qwen3RMSNorm); returns ``out``.

    ``x``: float32 ``[..., n]``, C-contiguous; ``weight``: float32 ``[n]``; ``eps``: a float (used as
    float32); ``out``: ``x``'s shape, C-contiguous, float32 (may be ``x``) or uint16. A uint16 ``out``
    gets BF16 bit patterns: each float32 result rounded to nearest even, NaN kept NaN, bit for bit
    the float32 call then ``bf16_round``, in one launch (the input of an FP8 tensor-core GEMM); it
    shares no memory with ``x``. The summation order is ``fp8lab.simulators.dense.rms_norm``'s; a warp
    per row for ``n <= 256`` (q/k-norm over ``[T * heads, head_dim]``), a CTA per row otherwise (the
    hidden size).
    """
    (x2, out2), weight, rows, n = _check_norm(x, weight, out)
    _launch_norm(False, x2, x2, weight, eps, out2, rows, n, stream)
    return out


def add_rms_norm(x, residual, weight, eps, out, stream=0):
    """Fused residual add and norm: ``residual += x`` (one float32 addition per element, in place),
    then ``out = rms_norm(residual, weight, eps)`` of the updated residual; returns ``out``.

    The Qwen3 layer's ``h = residual + attn(...)``; ``residual = h``; ``post_norm(h)`` (and the same
    after the MLP, the next layer's input norm, or the final norm) in one launch. ``x``,
    ``residual``: float32 ``[..., n]`` of one shape, C-contiguous; ``out``: that shape, C-contiguous,
    float32 (may be ``x``, never ``residual``) or uint16 (BF16 bits, as ``rms_norm``'s; sharing no
    memory with ``x`` or ``residual``); the residual is float32 and updated the same way for both.
    Bit for bit equal to ``add_into(residual, x)`` then ``rms_norm(residual)``.
    """
    (x2, residual2, out2), weight, rows, n = _check_norm(x, weight, out, residual)
    _launch_norm(True, x2.reshape(1, rows, n), residual2, weight, eps, out2, rows, n, stream)
    return out


def add_parts_rms_norm(parts, residual, weight, eps, out, stream=0):
    """``add_rms_norm`` of a split-K product given as its parts: ``residual += sum_parts(parts)``, the
    parts ``parts[0] + parts[1] + ...`` added in float32 in part order first (what
    ``gemv_simt.gemv_simt_split_k`` leaves: ``fp8lab.simulators.dense.sum_parts``), then ``out =
    rms_norm(residual)``; returns ``out``.

    ``parts``: float32 ``[S, ...]`` with ``S >= 1`` parts of ``residual``'s shape, C-contiguous; the rest
    as ``add_rms_norm`` (a float32 ``out`` may be ``parts[0]``; a uint16 ``out`` gets BF16 bits and
    shares no memory with ``parts`` or ``residual``). One part is ``add_rms_norm`` bit for bit.
    """
    parts, residual = as_kernel_array("parts", parts), as_kernel_array("residual", residual)
    if parts.ndim < 2 or parts.shape[0] < 1 or tuple(parts.shape[1:]) != tuple(residual.shape) \
            or np.dtype(parts.dtype) != np.float32:
        reject("parts", f"float32 [S, {', '.join(map(str, residual.shape))}] (S >= 1 parts of residual's shape)",
               parts)
    require_c_contiguous("parts", parts)
    (_, residual2, out2), weight, rows, n = _check_norm(parts[0], weight, out, residual)
    _launch_norm(True, parts.reshape(parts.shape[0], rows, n), residual2, weight, eps, out2, rows, n, stream)
    return out


# ---------------------------------------------------------------------------- 2. rotary embedding


def rope_table(max_positions: int, head_dim: int, theta: float) -> np.ndarray:
    """float32 ``[max_positions, head_dim]`` (host): ``cos`` of the angles ``p * theta^(-2i / head_dim)``,
    ``i < head_dim / 2``, in the first half of each row and ``sin`` in the second.

    The angles are ``fp8lab.reference.dense.rope_cos_sin``'s (float64, rounded once); copy the table
    to the device once.
    """
    return np.concatenate(rope_cos_sin(np.arange(max_positions), head_dim, theta), axis=1)


def rope_kernel(x, positions, cos_sin, out):
    """Launch ``[(T, heads), threads]``: CTA ``(t, h)`` rotates ``x[t, h]``; thread ``i`` the pair ``(i, i + half)``.

    A position outside the table gives a NaN vector (the table is not read).
    """
    pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
    token = cuda.blockIdx.x
    head = cuda.blockIdx.y
    half = x.shape[2] // 2
    p = positions[token]
    in_table = p >= 0 and p < cos_sin.shape[0]
    for i in range(cuda.threadIdx.x, half, cuda.blockDim.x):
        if in_table:
            c = cos_sin[p, i]
            s = cos_sin[p, half + i]
            x1 = x[token, head, i]
            x2 = x[token, head, half + i]
            out[token, head, i] = cuda.fma(x1, c, -(x2 * s))
            out[token, head, half + i] = cuda.fma(x2, c, x1 * s)
        else:
            out[token, head, i] = NAN
            out[token, head, half + i] = NAN


_rope_kernel = cuda.jit(rope_kernel)


def rope(x, positions, cos_sin, out, stream=0):
    """NeoX rotary embedding of ``x[T, heads, head_dim]`` at ``positions[T]`` into ``out`` (may be ``x``); returns ``out``.

    ``x``, ``out``: float32 ``[T, heads, head_dim]`` (``head_dim`` even), C-contiguous;
    ``positions``: int32 ``[T]``; ``cos_sin``: float32 ``[max_positions, head_dim]`` from
    ``rope_table``. Dimension ``i < head_dim / 2`` rotates with ``i + head_dim / 2``:
    ``out_i = x_i cos - x_{i+h} sin``, ``out_{i+h} = x_{i+h} cos + x_i sin`` (the fmas of
    ``fp8lab.simulators.dense.rope``). A position outside ``[0, max_positions)`` makes that token's vectors NaN.
    """
    x, positions, cos_sin, out = (as_kernel_array(n, a) for n, a in
                                  (("x", x), ("positions", positions), ("cos_sin", cos_sin), ("out", out)))
    if x.ndim != 3 or np.dtype(x.dtype) != np.float32 or x.shape[2] == 0 or x.shape[2] % 2:
        reject("x", "float32 [T, heads, head_dim] with head_dim even", x)
    require_c_contiguous("x", x)
    tokens, heads, head_dim = x.shape
    if tuple(out.shape) != tuple(x.shape) or np.dtype(out.dtype) != np.float32:
        reject("out", f"float32 of x's shape {tuple(x.shape)}", out)
    require_c_contiguous("out", out)
    if positions.ndim != 1 or positions.shape[0] != tokens or np.dtype(positions.dtype) != np.int32:
        reject("positions", f"int32 [{tokens}]", positions)
    if cos_sin.ndim != 2 or cos_sin.shape[1] != head_dim or np.dtype(cos_sin.dtype) != np.float32:
        reject("cos_sin", f"float32 [max_positions, {head_dim}] (rope_table)", cos_sin)
    require_c_contiguous("cos_sin", cos_sin)
    if tokens == 0 or heads == 0:
        return out
    threads = min(MAX_THREADS_PER_CTA, WARP_SIZE * -(-(head_dim // 2) // WARP_SIZE))
    _run(_rope_kernel, (tokens, heads), threads, stream, [x, positions, cos_sin, out], (3,))
    return out


# ---------------------------------------------------------------------------- 3. SwiGLU


@cuda.jit(device=True, inline=True)
def silu_times(gate, up):
    """``silu(gate) * up`` in float32, as ``fp8lab.simulators.dense.silu_mul`` orders it (one place for
    every kernel that applies SwiGLU: ``silu_mul`` and ``gemv_simt_swiglu``'s epilogue)."""
    return gate / (float32(1) + exp_f32(-gate)) * up


def silu_mul_function(bf16_out: bool):
    """The ``silu_mul`` kernel ``(gate_up, out)`` writing float32 or (``bf16_out``) the BF16 bits of each
    float32 result (``STORE``). Launch ``[(T, ceil(I / 256)), 256]``: thread ``j`` of CTA ``(t, b)``
    computes ``out[t, 256 b + j]``. Any ``I``; the engine's shapes take ``silu_mul_quads_function``."""
    store = STORE["bf16" if bf16_out else "f32"]

    def silu_mul_kernel(gate_up, out):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        token = cuda.blockIdx.x
        j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        intermediate = out.shape[1]
        if j < intermediate:
            gate = gate_up[token, j]
            up = gate_up[token, intermediate + j]
            store(out, token, j, silu_times(gate, up))

    return silu_mul_kernel


def silu_mul_quads_function(bf16_out: bool):
    """The same values four at a time, for ``I`` a multiple of 4 (16-byte aligned rows): the kernel
    ``(gate_up_words, out_words, intermediate)`` takes ``gate_up`` as its flat uint32 bits and writes a float32 ``out``
    as its flat uint32 bits, a BF16 ``out`` as flat uint32 pairs (element ``2 i`` in the low half); ``intermediate`` is
    ``I`` (uint32: the kernel's index arithmetic is unsigned 32-bit; deriving ``I`` from the shapes cost every thread a
    64-bit division: 456 SASS instructions against 296). Launch
    ``[(T, ceil(I / 1024)), 256]``: thread ``j`` of CTA ``(t, b)`` computes ``out[t, 4 (256 b + j) .. + 3]``
    from one 128-bit load of the gates and one of the ups. Why: one element per thread kept two 4-byte loads
    in flight per thread, too few to cover the memory's latency; it ran at about a third of the copy
    bandwidth at prefill sizes (``bench/RESULTS.md``, twenty-fifth session)."""

    def silu_mul_quads_kernel(gate_up_words, out_words, intermediate):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        token = uint32(cuda.blockIdx.x)
        j = uint32(4) * (uint32(cuda.blockIdx.y) * uint32(cuda.blockDim.x) + uint32(cuda.threadIdx.x))
        if j < intermediate:
            row = token * uint32(2) * intermediate
            g0, g1, g2, g3 = load_u32x4(gate_up_words, row + j)
            u0, u1, u2, u3 = load_u32x4(gate_up_words, row + intermediate + j)
            r0 = silu_times(u32_as_f32(g0), u32_as_f32(u0))
            r1 = silu_times(u32_as_f32(g1), u32_as_f32(u1))
            r2 = silu_times(u32_as_f32(g2), u32_as_f32(u2))
            r3 = silu_times(u32_as_f32(g3), u32_as_f32(u3))
            if bf16_out:
                first = (token * intermediate + j) // uint32(2)
                out_words[first] = mathops.f32_to_bf16_bits_rne(r0) | mathops.f32_to_bf16_bits_rne(r1) << uint32(16)
                out_words[first + uint32(1)] = (mathops.f32_to_bf16_bits_rne(r2)
                                                | mathops.f32_to_bf16_bits_rne(r3) << uint32(16))
            else:
                first = token * intermediate + j
                out_words[first] = f32_as_u32(r0)
                out_words[first + uint32(1)] = f32_as_u32(r1)
                out_words[first + uint32(2)] = f32_as_u32(r2)
                out_words[first + uint32(3)] = f32_as_u32(r3)

    return silu_mul_quads_kernel


_silu_mul_kernels = {bf16_out: cuda.jit(silu_mul_function(bf16_out)) for bf16_out in (False, True)}
_silu_mul_quads_kernels = {bf16_out: cuda.jit(silu_mul_quads_function(bf16_out)) for bf16_out in (False, True)}
"""By ``bf16_out`` (compiled at the first call of each)."""
SILU_QUAD = 4


def silu_mul(gate_up, out, stream=0):
    """SwiGLU: ``out[t, j] = silu(gate) * up = gate / (1 + exp(-gate)) * up`` with ``gate = gate_up[t, j]``,
    ``up = gate_up[t, I + j]``; returns ``out``.

    ``gate_up``: float32 ``[T, 2 I]``, ``out``: ``[T, I]``, both C-contiguous; ``out`` float32, or uint16
    for BF16 bit patterns: each float32 result rounded to nearest even, NaN kept NaN, bit for bit the
    float32 call then ``bf16_round``, in one launch (the input of an FP8 tensor-core GEMM). Why one fused
    array instead of two: gate_proj and up_proj read the same input, so the engine concatenates their
    weights into one ``[2 I, hidden]`` weight and runs one GEMM (one launch, the activations read
    once; vLLM's MergedColumnParallelLinear), whose output is this array. (For FP8 weights the
    concatenation keeps the block scales aligned when ``I`` is a multiple of the block height, 128.)
    The operations are fp8lab.reference.dense.silu_mul's, in float32; ``exp`` is CUDA's ``expf`` (2 ulp) on
    a GPU. ``exp(-gate)`` overflows to inf for ``gate < -88.7``, giving ``-0 * up``, as the reference.
    """
    gate_up, out = as_kernel_array("gate_up", gate_up), as_kernel_array("out", out)
    if gate_up.ndim != 2 or np.dtype(gate_up.dtype) != np.float32 or gate_up.shape[1] % 2 or gate_up.shape[1] == 0:
        reject("gate_up", "float32 [T, 2 * I] (gate in columns [0, I), up in [I, 2 I))", gate_up)
    require_c_contiguous("gate_up", gate_up)
    tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(out.shape) != (tokens, intermediate) or np.dtype(out.dtype) not in (np.float32, np.uint16):
        reject("out", f"float32 or uint16 (BF16 bits) [{tokens}, {intermediate}]", out)
    require_c_contiguous("out", out)
    bf16_out = np.dtype(out.dtype) == np.uint16
    if bf16_out and overlaps(out, gate_up):
        raise ValueError("out: a uint16 (BF16 bits) out must not share memory with gate_up")
    if tokens == 0:
        return out
    if intermediate % SILU_QUAD == 0:  # the engine's shapes: four elements a thread, from 128-bit loads
        if tokens * 2 * intermediate >= 2**32:
            raise ValueError(f"gate_up: {tokens} x {2 * intermediate} elements, more than the kernel's 32-bit indices "
                             "reach (2^32)")
        gate_up_device, out_device = on_device(gate_up, stream), on_device(out, stream)
        require_load_alignment("gate_up", gate_up_device, "silu_mul")
        grid = (tokens, -(-intermediate // (SILU_QUAD * ELEMENTWISE_THREADS)))
        words = [a.view(np.uint32).reshape(-1) for a in (gate_up_device, out_device)]
        _run(_silu_mul_quads_kernels[bf16_out], grid, ELEMENTWISE_THREADS, stream, [*words, np.uint32(intermediate)], ())
        if out_device is not out:
            out_device.copy_to_host(out, stream=stream)
        return out
    grid = (tokens, -(-intermediate // ELEMENTWISE_THREADS))
    _run(_silu_mul_kernels[bf16_out], grid, ELEMENTWISE_THREADS, stream, [gate_up, out], (1,))
    return out


# ---------------------------------------------------------------------------- 4. embedding


def embedding_kernel(table, ids, out):
    """Launch ``[(T, ceil(hidden / 256)), 256]``: thread ``j`` of CTA ``(t, b)`` writes ``out[t, 256 b + j]``.

    An id outside ``[0, vocab)`` writes NaN (the table is not read).
    """
    pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
    token = cuda.blockIdx.x
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if j < out.shape[1]:
        i = ids[token]
        if i >= 0 and i < table.shape[0]:
            out[token, j] = bf16_bits_to_f32(uint32(table[i, j]))
        else:
            out[token, j] = NAN


_embedding_kernel = cuda.jit(embedding_kernel)


def as_bf16_patterns(name: str, x):
    """uint16 BF16 patterns pass; int16 (a torch bfloat16 tensor viewed as ``torch.int16``) is viewed as uint16."""
    if np.dtype(x.dtype) == np.int16:
        return x.view(np.uint16)
    if np.dtype(x.dtype) != np.uint16:
        reject(name, "BF16 bit patterns (uint16, or int16 as torch exports bfloat16)", x)
    return x


def embedding(table, ids, out, stream=0):
    """``out[t] = float32(table[ids[t]])`` (exact); returns ``out``.

    ``table``: BF16 bit patterns ``[vocab, hidden]`` (uint16, or int16), C-contiguous: the checkpoint's
    table as it is (Qwen3-8B: 1.2 GB, half of a float32 copy); ``ids``: int32 ``[T]``; ``out``: float32
    ``[T, hidden]``. The ids are not read on the host (no synchronization): an id outside
    ``[0, vocab)`` writes a NaN row, so a bad id shows up downstream instead of reading out of bounds.
    """
    table, ids, out = (as_kernel_array(n, a) for n, a in (("table", table), ("ids", ids), ("out", out)))
    if table.ndim != 2:
        reject("table", "BF16 bit patterns [vocab, hidden]", table)
    table = as_bf16_patterns("table", table)
    require_c_contiguous("table", table)
    if ids.ndim != 1 or np.dtype(ids.dtype) != np.int32:
        reject("ids", "int32 [T]", ids)
    tokens, hidden = ids.shape[0], table.shape[1]
    if tuple(out.shape) != (tokens, hidden) or np.dtype(out.dtype) != np.float32:
        reject("out", f"float32 [{tokens}, {hidden}]", out)
    require_c_contiguous("out", out)
    if tokens == 0 or hidden == 0:
        return out
    grid = (tokens, -(-hidden // ELEMENTWISE_THREADS))
    _run(_embedding_kernel, grid, ELEMENTWISE_THREADS, stream, [table, ids, out], (2,))
    return out


# ---------------------------------------------------------------------------- 5. BF16 linear


def default_rows_per_warp(m_tile: int) -> int:
    """Weight rows per warp: each x chunk a lane loads is used for this many weight rows. From M = 3 on,
    4 rows per warp keep the x loads (from L1) below the weight bytes' share of L1 bandwidth; at
    M <= 2, 2 rows keep more warps in the grid. Untuned guesses (no GPU sweep yet); the result does
    not depend on them."""
    return 2 if m_tile <= 2 else 4


def bf16_linear_function(m_tile: int, rows_per_warp: int):
    """The Python source of the BF16 linear kernel for one row tile and weight rows per warp.

    Kernel arguments: flat uint32 views of ``x`` (float32 bits, ``K`` words per row) and ``w`` (two
    BF16 per word, low half first, ``K / 2`` words per row), the 2-D float32 ``out`` and ``M, N, K``.
    Launch ``[(ceil(N / (4 rows_per_warp)), ceil(M / m_tile)), 128]``. Warp ``v`` computes weight
    rows ``n = rows_per_warp v + j`` for the rows ``m`` of row tile ``blockIdx.y``; rows past ``M``
    (``N``) compute on a copy of row ``M - 1`` (``N - 1``) and are not stored, so the loop has no
    per-row branch. Lane ``L`` walks its chunks ``c = L, L + 32, ...`` two at a time: the weight
    loads of both are issued before either is computed.
    """
    rows = rows_per_warp
    group = LINEAR_CHUNKS_PER_ITERATION
    accumulators = rows * m_tile  # acc[j * m_tile + r]: weight row j, x row r
    words = group * rows * 4  # the loaded weight words of a group: (chunk g, weight row j) at 4 (g rows + j)
    weight_count = rows * ELEMENTS_PER_CHUNK  # the widened weights of one chunk: weight row j at 8 j

    @cuda.jit(device=True, inline=True)
    def load_chunk_weights(w_words, w_start, chunk, loaded, g):
        for j in range(rows):
            four = load_u32x4(w_words, w_start[j] + 4 * chunk)
            for t in range(4):
                loaded[4 * (g * rows + j) + t] = four[t]

    @cuda.jit(device=True, inline=True)
    def widen_chunk_weights(loaded, g, weights):
        """The chunk's 8 BF16 weights of every weight row, as float32 (exact), in k order."""
        for j in range(rows):
            for t in range(4):
                word = loaded[4 * (g * rows + j) + t]
                weights[8 * j + 2 * t] = bf16_bits_to_f32(word)
                weights[8 * j + 2 * t + 1] = bf16_bits_to_f32(word >> uint32(16))

    @cuda.jit(device=True, inline=True)
    def load_chunk_x(x_words, start, chunk, values):
        """x[m, 8 chunk : 8 chunk + 8] as two 128-bit loads of float32 bits."""
        for half in range(2):
            four = load_u32x4(x_words, start + ELEMENTS_PER_CHUNK * chunk + 4 * half)
            for t in range(4):
                values[4 * half + t] = u32_as_f32(four[t])

    @cuda.jit(device=True, inline=True)
    def accumulate_chunk(x_words, x_start, chunk, weights, values, acc):
        """Every (row, weight row) chain: ``acc = fma(x_k, w_k, acc)`` for the chunk's 8 k in order."""
        for r in range(m_tile):
            load_chunk_x(x_words, x_start[r], chunk, values)
            for j in range(rows):
                a = acc[j * m_tile + r]
                for e in range(ELEMENTS_PER_CHUNK):
                    a = cuda.fma(values[e], weights[8 * j + e], a)
                acc[j * m_tile + r] = a

    def bf16_linear_kernel(x_words, w_words, out, m, n, k):
        pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
        lane = cuda.threadIdx.x % WARP_SIZE
        warp = cuda.blockIdx.x * LINEAR_WARPS_PER_CTA + cuda.threadIdx.x // WARP_SIZE
        first_n = warp * rows
        if first_n >= n:
            return  # the whole warp leaves together
        row0 = cuda.blockIdx.y * m_tile
        chunks = k // ELEMENTS_PER_CHUNK
        x_start = cuda.local.array(m_tile, int64)
        for r in range(m_tile):
            x_start[r] = min(row0 + r, m - 1) * k
        w_start = cuda.local.array(rows, int64)
        for j in range(rows):
            w_start[j] = min(first_n + j, n - 1) * (k // 2)
        acc = cuda.local.array(accumulators, float32)
        for i in range(accumulators):
            acc[i] = float32(0)
        loaded = cuda.local.array(words, uint32)
        weights = cuda.local.array(weight_count, float32)
        values = cuda.local.array(ELEMENTS_PER_CHUNK, float32)

        for base in range(lane, chunks, WARP_SIZE * group):
            for g in range(group):
                chunk = base + WARP_SIZE * g
                if chunk < chunks:
                    load_chunk_weights(w_words, w_start, chunk, loaded, g)
            for g in range(group):
                chunk = base + WARP_SIZE * g
                if chunk < chunks:
                    widen_chunk_weights(loaded, g, weights)
                    accumulate_chunk(x_words, x_start, chunk, weights, values, acc)

        for i in range(accumulators):
            acc[i] = warp_sum(acc[i])
        if lane == 0:
            for j in range(rows):
                for r in range(m_tile):
                    if first_n + j < n and row0 + r < m:
                        out[row0 + r, first_n + j] = acc[j * m_tile + r]

    return bf16_linear_kernel


@functools.cache
def _bf16_linear_kernel(m_tile: int, rows_per_warp: int):
    return cuda.jit(bf16_linear_function(m_tile, rows_per_warp))


def bf16_linear(x, w_bits, out, rows_per_warp=None, stream=0):
    """``out[M, N] = x[M, K] @ W^T`` with ``W`` given as BF16 bit patterns, float32 accumulation; returns ``out``.

    ``x``: float32 ``[M, K]``; ``w_bits``: BF16 patterns ``[N, K]`` (uint16, or int16), C-contiguous,
    ``K`` a positive multiple of 8 (128-bit weight loads), device data 16-byte aligned; ``out``:
    float32 ``[M, N]``. The summation order is ``fp8lab.simulators.dense.bf16_linear``'s (bit for bit
    the same for every ``M``). Rows are computed in tiles of up to 8 sharing each weight load: the decode step
    (``M <= 8``) reads the weights once; a larger ``M`` reads them ``ceil(M / 8)`` times (fine for the
    lm_head of the last tokens; a prefill-sized BF16 GEMM wants a tensor-core kernel).
    ``rows_per_warp`` (1, 2, 4; None: ``default_rows_per_warp``) only changes speed.
    """
    x, w_bits, out = (as_kernel_array(n, a) for n, a in (("x", x), ("w_bits", w_bits), ("out", out)))
    if w_bits.ndim != 2:
        reject("w_bits", "BF16 bit patterns [N, K]", w_bits)
    w_bits = as_bf16_patterns("w_bits", w_bits)
    require_c_contiguous("w_bits", w_bits)
    n, k = w_bits.shape
    if k == 0 or k % ELEMENTS_PER_CHUNK:
        raise ValueError(f"w_bits: bf16_linear needs K to be a positive multiple of {ELEMENTS_PER_CHUNK} "
                         f"(128-bit loads), got K = {k}")
    if x.ndim != 2 or x.shape[1] != k or np.dtype(x.dtype) != np.float32:
        reject("x", f"float32 [M, {k}]", x)
    require_c_contiguous("x", x)
    m = x.shape[0]
    if tuple(out.shape) != (m, n) or np.dtype(out.dtype) != np.float32:
        reject("out", f"float32 [{m}, {n}]", out)
    require_c_contiguous("out", out)
    for name, a in (("x", x), ("w_bits", w_bits)):
        require_load_alignment(name, a, "bf16_linear")
    if m == 0 or n == 0:
        return out
    m_tile = min(m, LINEAR_MAX_M_TILE)
    rows = default_rows_per_warp(m_tile) if rows_per_warp is None else int(rows_per_warp)
    if rows not in LINEAR_ROWS_PER_WARP:
        raise ValueError(f"rows_per_warp: expected one of {LINEAR_ROWS_PER_WARP}, got {rows_per_warp!r}")
    grid = (-(-n // (LINEAR_WARPS_PER_CTA * rows)), -(-m // m_tile))
    if grid[1] > MAX_GRID_Y:
        raise ValueError(f"x: bf16_linear takes at most {MAX_GRID_Y * LINEAR_MAX_M_TILE} rows, got M = {m}")
    args = [x.view(np.uint32).reshape(-1), w_bits.view(np.uint32).reshape(-1), out, m, n, k]
    _run(_bf16_linear_kernel(m_tile, rows), grid, WARP_SIZE * LINEAR_WARPS_PER_CTA, stream, args, (2,))
    return out


# ---------------------------------------------------------------------------- 6. greedy sampling


@cuda.jit(device=True, inline=True)
def beats(v, i, best_v, best_i):
    """Does ``(v, i)`` win over ``(best_v, best_i)`` under ``np.argmax``'s rules? A NaN beats every
    number (the first NaN wins); otherwise the larger value; equal values (``-0 == 0``) the lower index."""
    v_nan = v != v
    best_nan = best_v != best_v
    if v_nan or best_nan:
        return v_nan and (not best_nan or i < best_i)
    if v != best_v:
        return v > best_v
    return i < best_i


@cuda.jit(device=True, inline=True)
def warp_winner(best_v, best_i):
    """The butterfly over a warp's ``(value, index)`` pairs under ``beats``; every lane gets the winner."""
    for offset in BUTTERFLY_OFFSETS:
        other_v = cuda.shfl_xor_sync(FULL_MASK, best_v, offset)
        other_i = cuda.shfl_xor_sync(FULL_MASK, best_i, offset)
        if beats(other_v, other_i, best_v, best_i):
            best_v = other_v
            best_i = other_i
    return best_v, best_i


@cuda.jit(device=True, inline=True)
def scan_slice(logits, row, start, end, best_v, best_i):
    """Thread ``t``'s winner among ``logits[row, k]``, ``k = start + t + B j < end``: groups of
    ``ARGMAX_LOADS_IN_FLIGHT`` loads issued together, then compared in ``k`` order."""
    stride = cuda.blockDim.x
    values = cuda.local.array(ARGMAX_LOADS_IN_FLIGHT, float32)
    for base in range(start + cuda.threadIdx.x, end, stride * ARGMAX_LOADS_IN_FLIGHT):
        for j in range(ARGMAX_LOADS_IN_FLIGHT):
            k = base + stride * j
            values[j] = logits[row, k] if k < end else NEG_INF
        for j in range(ARGMAX_LOADS_IN_FLIGHT):
            k = base + stride * j
            if k < end and beats(values[j], int32(k), best_v, best_i):
                best_v = values[j]
                best_i = int32(k)
    return best_v, best_i


def argmax_kernel(logits, out_ids, slice_length, partial_values, partial_indices, counters):
    """Launch ``[(rows, P), B]`` (``argmax_launch(V)``): CTA ``(r, p)`` finds the winner of row ``r``'s
    slice ``[p L, (p + 1) L)`` (``L = slice_length``); the last of the row's ``P`` CTAs to finish merges
    the ``P`` partial winners and writes ``out_ids[r]``.

    In a CTA: each thread scans its logits (``scan_slice``), a butterfly merges each warp, thread 0
    merges the warps in warp order and writes the partial ``(value, index)`` to the workspace, then
    (``threadfence``, so the partial is visible first) counts the row's finished CTAs with an atomic
    add on ``counters[r]``. The CTA that sees ``P - 1`` merges: lane ``l`` of its first warp takes
    partials ``l`` and ``l + 32``, a butterfly, lane 0 writes the token (``NAN_ROW`` for a NaN winner)
    and resets ``counters[r]`` to 0 for the next launch (or CUDA-graph replay). ``beats`` is a total
    order, so neither the slices nor the merge order change the answer: ``reference.dense.argmax_rows``.
    """
    pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
    best_values = cuda.shared.array(MAX_WARPS_PER_CTA, float32)
    best_indices = cuda.shared.array(MAX_WARPS_PER_CTA, int32)
    last = cuda.shared.array(1, int32)
    row = cuda.blockIdx.x
    part = cuda.blockIdx.y
    parts = cuda.gridDim.y
    t = cuda.threadIdx.x
    start = part * slice_length
    end = min(start + slice_length, logits.shape[1])
    best_v, best_i = scan_slice(logits, row, start, end, NEG_INF, int32(NO_INDEX))
    best_v, best_i = warp_winner(best_v, best_i)
    if t % WARP_SIZE == 0:
        best_values[t // WARP_SIZE] = best_v
        best_indices[t // WARP_SIZE] = best_i
    cuda.syncthreads()
    if t == 0:
        for w in range(1, cuda.blockDim.x // WARP_SIZE):
            if beats(best_values[w], best_indices[w], best_v, best_i):
                best_v = best_values[w]
                best_i = best_indices[w]
        partial_values[row, part] = best_v
        partial_indices[row, part] = best_i
        cuda.threadfence()  # the partial is visible to every CTA before the count says it is there
        finished_before = cuda.atomic.add(counters, row, 1)
        last[0] = 1 if finished_before == parts - 1 else 0
    cuda.syncthreads()
    if last[0] == 0 or t >= WARP_SIZE:
        return
    cuda.threadfence()  # the other CTAs' partials are read after their count
    best_v = NEG_INF
    best_i = int32(NO_INDEX)
    values = cuda.local.array(ARGMAX_MERGES_PER_LANE, float32)
    indices = cuda.local.array(ARGMAX_MERGES_PER_LANE, int32)
    for j in range(ARGMAX_MERGES_PER_LANE):  # lane t's partials t and t + 32, both loads in flight
        if t + WARP_SIZE * j < parts:
            values[j] = partial_values[row, t + WARP_SIZE * j]
            indices[j] = partial_indices[row, t + WARP_SIZE * j]
    for j in range(ARGMAX_MERGES_PER_LANE):
        if t + WARP_SIZE * j < parts and beats(values[j], indices[j], best_v, best_i):
            best_v = values[j]
            best_i = indices[j]
    best_v, best_i = warp_winner(best_v, best_i)
    if t == 0:
        # a row holding NaN has no greedy token: -1 (fp8lab.engine.generate reports it as that sequence's error)
        out_ids[row] = best_i if best_v == best_v else int32(NAN_ROW)
        counters[row] = 0


_argmax_kernel = cuda.jit(argmax_kernel)


def argmax_launch(vocab: int, logits_per_cta: int | None = None) -> tuple[int, int, int]:
    """``(P, L, B)``: the CTAs per row, the logits per CTA (its slice) and the threads per CTA for rows of
    ``vocab`` logits.

    By default ``L`` is at least ``ARGMAX_MIN_SLICE`` (4096) and a multiple of ``ARGMAX_THREADS *
    ARGMAX_LOADS_IN_FLIGHT`` (2048), large enough that ``P <= ARGMAX_MAX_CTAS`` (vocab 151936: 38 CTAs
    of 4096 logits, 16 per thread in two groups of 8 loads). ``logits_per_cta`` sets ``L`` (tests: several
    CTAs at a small vocab). ``B``: 256 threads, fewer (whole warps) for a slice of fewer than 2048 logits.
    """
    group = ARGMAX_THREADS * ARGMAX_LOADS_IN_FLIGHT
    if logits_per_cta is None:
        needed = -(-vocab // ARGMAX_MAX_CTAS)
        length = max(ARGMAX_MIN_SLICE, group * -(-needed // group))
    else:
        length = int(logits_per_cta)
        if length < 1 or -(-vocab // length) > ARGMAX_MAX_CTAS:
            raise ValueError(f"logits_per_cta: expected at least 1 and at most {ARGMAX_MAX_CTAS} CTAs per row "
                             f"for V = {vocab}, got {logits_per_cta!r}")
    ctas = -(-vocab // length)
    per_cta = min(length, vocab)
    threads = WARP_SIZE * min(ARGMAX_THREADS // WARP_SIZE, -(-per_cta // (WARP_SIZE * ARGMAX_LOADS_IN_FLIGHT)))
    return ctas, length, threads


class ArgmaxWorkspace(NamedTuple):
    """``argmax_rows``' scratch: the partial winners of each row's CTAs and a finished-CTA count per row
    (0 between launches: each launch's last CTA resets it)."""

    values: object
    """float32 ``[rows, P]``"""
    indices: object
    """int32 ``[rows, P]``"""
    counters: object
    """int32 ``[rows]``, zero"""


def argmax_workspace(rows: int, vocab: int, logits_per_cta: int | None = None) -> ArgmaxWorkspace:
    """The workspace of ``argmax_rows`` for up to ``rows`` rows of ``vocab`` logits (device arrays on a
    GPU, NumPy arrays in the simulator; counters zeroed). Allocate it once and pass it to every call:
    a call given a workspace allocates nothing (CUDA-graph capture needs that); a replay leaves the
    counters at 0 again. Calls sharing one must not run concurrently (on different streams)."""
    rows, vocab = int(rows), int(vocab)
    if rows < 0:
        raise ValueError(f"rows: expected at least 0, got {rows}")
    if not 0 < vocab < NO_INDEX:
        raise ValueError(f"vocab: expected 1 <= V < 2^31, got {vocab}")
    ctas = argmax_launch(vocab, logits_per_cta)[0]
    host = ArgmaxWorkspace(np.full((rows, ctas), np.nan, np.float32), np.full((rows, ctas), NAN_ROW, np.int32),
                           np.zeros(rows, np.int32))
    return host if SIMULATOR else ArgmaxWorkspace(*(cuda.to_device(a) for a in host))


def _check_argmax_workspace(workspace, rows: int, ctas: int) -> ArgmaxWorkspace:
    if not isinstance(workspace, tuple) or len(workspace) != 3:
        raise ValueError(f"workspace: expected an ArgmaxWorkspace (argmax_workspace), got {type(workspace).__name__}")
    values, indices, counters = (as_kernel_array("workspace", a) for a in workspace)
    for a, dtype in ((values, np.float32), (indices, np.int32)):
        if a.ndim != 2 or a.shape[0] < rows or a.shape[1] < ctas or np.dtype(a.dtype) != dtype:
            reject("workspace", f"partials of at least [{rows}, {ctas}] (argmax_workspace(rows, V))", a)
    if counters.ndim != 1 or counters.shape[0] < rows or np.dtype(counters.dtype) != np.int32:
        reject("workspace", f"int32 counters of at least [{rows}] (argmax_workspace(rows, V))", counters)
    return ArgmaxWorkspace(values, indices, counters)


def argmax_rows(logits, out_ids, stream=0, workspace=None, logits_per_cta=None):
    """Greedy sampling: ``out_ids[r] = np.argmax(logits[r])``; returns ``out_ids``.

    ``logits``: float32 ``[rows, V]`` (``V >= 1``, below 2^31), C-contiguous; ``out_ids``: int32 ``[rows]``.
    NumPy's rules: the first index of the maximum; but a row holding NaN gives ``NAN_ROW`` (-1), not the
    index of its first NaN, so that a NaN never passes as a token.

    One launch of ``argmax_launch(V)[0]`` CTAs per row (``argmax_kernel``). ``workspace``: from
    ``argmax_workspace(R, V)`` with ``R >= rows`` (None: one allocated for this call, which a CUDA-graph
    capture does not allow). ``logits_per_cta``: each CTA's slice (None: ``argmax_launch``'s default);
    the answer does not depend on it.
    """
    logits, out_ids = as_kernel_array("logits", logits), as_kernel_array("out_ids", out_ids)
    if logits.ndim != 2 or np.dtype(logits.dtype) != np.float32 or not 0 < logits.shape[1] < NO_INDEX:
        reject("logits", "float32 [rows, V] with 1 <= V < 2^31", logits)
    require_c_contiguous("logits", logits)
    rows, vocab = logits.shape
    if tuple(out_ids.shape) != (rows,) or np.dtype(out_ids.dtype) != np.int32:
        reject("out_ids", f"int32 [{rows}]", out_ids)
    ctas, length, threads = argmax_launch(vocab, logits_per_cta)
    if workspace is not None:
        workspace = _check_argmax_workspace(workspace, rows, ctas)
    if rows == 0:
        return out_ids
    if workspace is None:
        workspace = argmax_workspace(rows, vocab, logits_per_cta)
    args = [logits, out_ids, length, *workspace]
    _run(_argmax_kernel, (rows, ctas), threads, stream, args, (1,))
    return out_ids


# ---------------------------------------------------------------------------- 7. residual add


def add_into_kernel(x, y):
    """Launch 1-D, a thread per element: ``x[i] += y[i]``."""
    pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += y[i]


_add_into_kernel = cuda.jit(add_into_kernel)


def add_into(x, y, stream=0):
    """``x += y`` in place (the residual add; ``add_rms_norm`` fuses it with the next norm); returns ``x``.

    ``x``, ``y``: float32 of one shape, C-contiguous.
    """
    x, y = as_kernel_array("x", x), as_kernel_array("y", y)
    if np.dtype(x.dtype) != np.float32:
        reject("x", "float32", x)
    if tuple(y.shape) != tuple(x.shape) or np.dtype(y.dtype) != np.float32:
        reject("y", f"float32 of x's shape {tuple(x.shape)}", y)
    require_c_contiguous("x", x)
    require_c_contiguous("y", y)
    size = int(np.prod(x.shape, dtype=np.int64))
    if size == 0:
        return x
    args = [x.reshape(size), y.reshape(size)]
    _run(_add_into_kernel, -(-size // ELEMENTWISE_THREADS), ELEMENTWISE_THREADS, stream, args, (0,))
    return x


def bf16_round_kernel(x, out):
    """Launch 1-D, a thread per element: ``out[i]`` = the BF16 bits of ``x[i]``, round to nearest even
    (NaN stays a NaN)."""
    pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = mathops.f32_to_bf16_bits_rne(x[i])


_bf16_round_kernel = cuda.jit(bf16_round_kernel)


def bf16_round(x, out, stream=0):
    """``out`` = ``x`` rounded to BF16 (round to nearest even), as uint16 bit patterns; returns ``out``.

    ``x``: float32, ``out``: uint16 of ``x``'s shape, both C-contiguous. The input cast of the FP8
    tensor-core GEMM, which takes 16-bit activations (``fp8lab.numba_kernels.fp8_gemm``).
    """
    x, out = as_kernel_array("x", x), as_kernel_array("out", out)
    if np.dtype(x.dtype) != np.float32:
        reject("x", "float32", x)
    if tuple(out.shape) != tuple(x.shape) or np.dtype(out.dtype) != np.uint16:
        reject("out", f"uint16 of x's shape {tuple(x.shape)}", out)
    require_c_contiguous("x", x)
    require_c_contiguous("out", out)
    size = int(np.prod(x.shape, dtype=np.int64))
    if size == 0:
        return out
    _run(_bf16_round_kernel, -(-size // ELEMENTWISE_THREADS), ELEMENTWISE_THREADS, stream,
         [x.reshape(size), out.reshape(size)], (1,))
    return out


# ---------------------------------------------------------------------------- launching


def _run(kernel, grid, block, stream, args, written):
    """Launch ``kernel[grid, block, stream](*args)``; on a GPU NumPy arrays among ``args`` are copied to the
    device first and the arrays at the positions ``written`` copied back (nothing is copied for device arrays)."""
    copies = {}  # one device copy per NumPy array, so an array passed twice (out = x) stays one array
    for a in args:
        if isinstance(a, np.ndarray) and id(a) not in copies:
            copies[id(a)] = on_device(a, stream)
    device = [copies.get(id(a), a) for a in args]
    pdl.launch(kernel, grid, block, stream, *device)
    for i in written:
        if device[i] is not args[i]:
            device[i].copy_to_host(args[i], stream=stream)


# ---------------------------------------------------------------------------- every kernel, for the PTX check

NORM_PTX_SIZES = (128, 4096)
"""The row lengths whose norm kernels the PTX check compiles (Qwen3-8B's head_dim and hidden size)."""


def kernel_variants():
    """``(name, python function, numba signature)`` of every kernel (C-contiguous arrays)."""
    f32_1d, f32_2d, f32_3d = (types.Array(types.float32, d, "C") for d in (1, 2, 3))
    i32_1d = types.Array(types.int32, 1, "C")
    u32_1d = types.Array(types.uint32, 1, "C")
    u16_2d = types.Array(types.uint16, 2, "C")
    variants = []
    for fused in (False, True):
        norm = "add_rms_norm" if fused else "rms_norm"
        # the fused norm's x: the parts [S, rows, n] of what is added to the residual
        norm_signature = types.void(f32_3d if fused else f32_2d, f32_2d, f32_1d, types.float32, f32_2d)
        for n in NORM_PTX_SIZES:  # q/k-norm (a warp per row, 4 elements per lane) and the hidden size (8 per thread)
            warp_per_row = rms_norm_threads_per_row(n) == WARP_SIZE
            variants.append((f"{norm}[{'warp' if warp_per_row else 'cta'} per row, n={n}]",
                             rms_norm_register_function(fused, warp_per_row, n), norm_signature))
        variants.append((f"{norm}[cta per row, loop]", rms_norm_loop_function(fused), norm_signature))
        # BF16 output (uint16 out), which the FP8 tensor-core GEMM reads: the hidden size's kernel and the loop kernel
        bf16_signature = types.void(f32_3d if fused else f32_2d, f32_2d, f32_1d, types.float32, u16_2d)
        variants.append((f"{norm}[cta per row, n={NORM_PTX_SIZES[-1]}, bf16 out]",
                         rms_norm_register_function(fused, False, NORM_PTX_SIZES[-1], bf16_out=True), bf16_signature))
        variants.append((f"{norm}[cta per row, loop, bf16 out]", rms_norm_loop_function(fused, bf16_out=True),
                         bf16_signature))
    variants.append(("rope", rope_kernel, types.void(f32_3d, i32_1d, f32_2d, f32_3d)))
    variants.append(("silu_mul", silu_mul_function(False), types.void(f32_2d, f32_2d)))
    variants.append(("silu_mul[bf16 out]", silu_mul_function(True), types.void(f32_2d, u16_2d)))
    for bf16_out in (False, True):
        variants.append((f"silu_mul[quads{', bf16 out' if bf16_out else ''}]", silu_mul_quads_function(bf16_out),
                         types.void(u32_1d, u32_1d, types.uint32)))
    variants.append(("embedding", embedding_kernel, types.void(u16_2d, i32_1d, f32_2d)))
    for m_tile in range(1, LINEAR_MAX_M_TILE + 1):
        rows = default_rows_per_warp(m_tile)
        variants.append((f"bf16_linear[m_tile={m_tile}, rows_per_warp={rows}]", bf16_linear_function(m_tile, rows),
                         types.void(u32_1d, u32_1d, f32_2d, types.int64, types.int64, types.int64)))
    variants.append(("bf16_linear[m_tile=1, rows_per_warp=1]", bf16_linear_function(1, 1),
                     types.void(u32_1d, u32_1d, f32_2d, types.int64, types.int64, types.int64)))
    variants.append(("argmax_rows", argmax_kernel, types.void(f32_2d, i32_1d, types.int64, f32_2d, types.Array(types.int32, 2, "C"), i32_1d)))
    variants.append(("add_into", add_into_kernel, types.void(f32_1d, f32_1d)))
    variants.append(("bf16_round", bf16_round_kernel, types.void(f32_1d, types.Array(types.uint16, 1, "C"))))
    return variants
