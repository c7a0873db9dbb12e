"""Causal prefill attention over a paged FP8 or float KV cache, as decode of every query token.

Computes ``fp8lab.reference.attention.prefill`` per sequence over ``fp8lab.reference.kv_cache.gather``.
Launch: the expansion ``(num_query_tokens,)`` x 32 (device index arrays only), then the split-kv
decode kernels of ``fp8lab.numba_kernels.splitkv`` with one row per query token. Checked
(``tests/numba_kernels/test_prefill_kernel.py``): bit for bit against ``fp8lab.simulators.splitkv.paged_decode``
on the expanded rows in the CUDA simulator, against the oracle by an error bound.

What it computes: ``q`` float32
``[num_query_tokens, num_heads, head_dim]`` holds the new tokens of every sequence back to back;
sequence ``s`` has ``context_lens[s]`` tokens in the cache (already written; its new tokens are the
last ``query_lens[s]`` of them), so its query ``i`` sits at position
``context_lens[s] - query_lens[s] + i`` and attends keys ``0 .. that position``, reading kv head
``h // (num_heads // num_kv_heads)`` (GQA). ``out``: ``q``'s shape, float32, or uint16 BF16 bit
patterns (the float32 result rounded to nearest even as the decode kernels store it, bit for bit
float32 then ``layers.bf16_round``: ``fp8lab.numba_kernels.splitkv``). ``context_lens[s] >
query_lens[s]`` is a chunked prefill over a cached prefix; ``query_lens[s] = 0`` adds no rows.

How: causal attention of query ``i`` is exactly decode attention over its causal prefix. So the
batch is *expanded* to one decode row per query token: row ``r`` (query ``i`` of sequence ``s``)
gets the block-table row ``block_tables[s]`` and the length ``context_lens[s] - query_lens[s] + i +
1``, and ``fp8lab.numba_kernels.splitkv.paged_decode`` runs on ``q`` (already one row per token) with
``num_splits="auto"``. Nothing of the attention is new code.

Kernels and launch shapes:

1. the expansion. Host index arrays (NumPy): vectorized NumPy (``expand_rows_host``). Device index
   arrays (Numba device arrays, ``__cuda_array_interface__`` objects): ``expand_prefill_rows``, grid
   ``(num_query_tokens,)``, one warp per row; every lane finds the row's sequence by walking
   ``query_lens`` (a prefix sum of ``num_seqs`` loads, the same addresses in every lane), then the
   lanes copy the table row, lane ``L`` columns ``L, L + 32, ...``. A row past ``sum(query_lens)``
   gets length 0 (a zero output row, never a stale one). Nothing is read back to the host when the
   caller passes ``max_context_len``, and nothing is allocated when it passes ``rows``
   (``prefill_rows_workspace``) and the decode ``workspace``: the call can be captured in a CUDA graph.
2. the split-kv decode kernels on the expanded rows, ``num_query_tokens`` in place of ``num_seqs``:
   their grid, CTA and combine are those of ``fp8lab.numba_kernels.splitkv.paged_decode``.

Checked against (``tests/numba_kernels/test_prefill_kernel.py``): in the CUDA simulator, bit for bit against
``fp8lab.simulators.splitkv.paged_decode`` on the expanded rows (computed there by a plain loop), and
within the split-kv float32 error bound against ``fp8lab.reference.attention.prefill``; on a GPU against
``fp8lab.reference.attention.prefill`` by ``||out - ref|| / ||ref||``.

Cost model, honestly: every query re-reads its whole prefix from the cache, so a prompt of ``T``
tokens after a prefix of ``P`` reads about ``T * (P + T / 2)`` K and V rows per kv head, where a flash-attention prefill reads each K/V tile once per tile of queries and
multiplies on tensor cores. This is SIMT decode work, O(T * L) reads and O(T * L * head_dim) FMAs
without tensor cores: fine for short prompts and small prefill chunks, and the decode kernels are
already validated; not a replacement for a tensor-core flash-attention prefill on long prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda, types

from fp8lab.reference.checks import check_block_tables
from fp8lab.reference.kv_cache import KVCacheFormat

from . import pdl
from .arguments import as_kernel_array, reject, require_c_contiguous
from .bits import SIMULATOR
from .kv_cache import check_cache, on_device, to_host
from .splitkv import OUT_DTYPES, paged_decode
from .warp import WARP_SIZE

MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------- the expanded rows


@dataclass(frozen=True)
class PrefillRows:
    """The expanded decode rows: int32 ``block_tables [num_query_tokens, max_blocks_per_seq]`` and
    ``seq_lens [num_query_tokens]`` (row ``r`` = one query token and its causal prefix length)."""

    block_tables: object
    seq_lens: object


def prefill_rows_workspace(num_query_tokens: int, max_blocks_per_seq: int) -> PrefillRows:
    """Preallocated ``PrefillRows`` for ``paged_prefill(..., rows=...)``: no allocation per call.

    Device arrays on a GPU, NumPy arrays in the simulator (as ``splitkv.decode_workspace``).
    ``max_blocks_per_seq`` is the width of the caller's ``block_tables``.
    """
    tables_shape, lens_shape = (int(num_query_tokens), int(max_blocks_per_seq)), (int(num_query_tokens),)
    if SIMULATOR:
        return PrefillRows(np.empty(tables_shape, np.int32), np.empty(lens_shape, np.int32))
    return PrefillRows(cuda.device_array(tables_shape, np.int32), cuda.device_array(lens_shape, np.int32))


def expand_rows_host(block_tables, context_lens, query_lens) -> tuple[np.ndarray, np.ndarray]:
    """The expansion in NumPy: ``(tables [T, width], lens [T])`` int32, ``T = sum(query_lens)``."""
    tables = np.asarray(block_tables)
    context = np.asarray(context_lens, np.int64)
    queries = np.asarray(query_lens, np.int64)
    seq_of_row = np.repeat(np.arange(queries.shape[0]), queries)
    first_row = np.cumsum(queries) - queries  # query_start of each sequence
    i = np.arange(seq_of_row.shape[0]) - first_row[seq_of_row]  # index of the query within its sequence
    lens = context[seq_of_row] - queries[seq_of_row] + i + 1
    return np.ascontiguousarray(tables[seq_of_row], np.int32), lens.astype(np.int32)


def expand_prefill_rows(block_tables, context_lens, query_lens, row_tables, row_lens):
    """Expansion kernel: CTA ``r`` (one warp) fills expanded row ``r``. Launch ``[num_rows, 32]``.

    Every lane walks ``query_lens`` to the sequence ``s`` holding row ``r`` (``start`` = its first
    row); a row past the last sequence's tokens gets length 0 and a zero table row.
    """
    pdl.prologue()  # griddepcontrol: wait for the previous kernel, then let the next one launch
    r = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    num_seqs = query_lens.shape[0]
    s = 0
    start = 0
    while s < num_seqs and start + query_lens[s] <= r:
        start += query_lens[s]
        s += 1
    width = block_tables.shape[1]
    if s < num_seqs:
        if lane == 0:
            row_lens[r] = context_lens[s] - query_lens[s] + (r - start) + 1
        for column in range(lane, width, WARP_SIZE):
            row_tables[r, column] = block_tables[s, column]
    else:
        if lane == 0:
            row_lens[r] = 0
        for column in range(lane, width, WARP_SIZE):
            row_tables[r, column] = 0


_expand_kernel = cuda.jit(expand_prefill_rows)


# ---------------------------------------------------------------------------- argument checks


@dataclass(frozen=True)
class PrefillCall:
    """A checked ``paged_prefill`` call: kernel-ready arrays and what the expansion needs."""

    q: object
    out: object
    block_tables: object
    context_lens: object
    query_lens: object
    rows: PrefillRows | None
    host_indices: bool
    max_seq_len: int
    block_size: int
    kv_format: KVCacheFormat


def _is_host(x) -> bool:
    return isinstance(x, np.ndarray)


def _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_lens, out, k_scale, v_scale, kv_format):
    """Shapes and dtypes of every array (values are checked by ``_check_values``); returns the caches' format."""
    if q.ndim != 3 or np.dtype(q.dtype) != np.float32:
        reject("q", "float32 [num_query_tokens, num_heads, head_dim]", q)
    num_tokens, num_heads, head_dim = q.shape
    kv_format = check_cache("k_cache", k_cache, k_scale, "k_scale", kv_format)
    if np.dtype(v_cache.dtype) != np.dtype(k_cache.dtype) or tuple(v_cache.shape) != tuple(k_cache.shape):
        reject("v_cache", f"the shape {tuple(k_cache.shape)} and dtype {k_cache.dtype} of k_cache", v_cache)
    check_cache("v_cache", v_cache, v_scale, "v_scale", kv_format)
    num_kv_heads, cache_head_dim = k_cache.shape[1], k_cache.shape[3]
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_head_dim} does not match q's head_dim {head_dim}")
    if head_dim == 0 or head_dim % WARP_SIZE or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be a multiple of 32 from 32 to {MAX_HEAD_DIM}, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) for GQA")
    if block_tables.ndim != 2 or np.dtype(block_tables.dtype).kind not in "iu":
        reject("block_tables", "an integer array [num_seqs, max_blocks_per_seq]", block_tables)
    num_seqs = block_tables.shape[0]
    for name, lens in (("context_lens", context_lens), ("query_lens", query_lens)):
        if tuple(lens.shape) != (num_seqs,) or np.dtype(lens.dtype).kind not in "iu":
            reject(name, f"an integer array [{num_seqs}] (one length per row of block_tables)", lens)
    if tuple(out.shape) != tuple(q.shape) or np.dtype(out.dtype) not in OUT_DTYPES:
        reject("out", f"float32 or uint16 (BF16 bits) [{num_tokens}, {num_heads}, {head_dim}] like q", out)
    require_c_contiguous("out", out)
    return kv_format


def _check_values(tables, context, queries, num_tokens: int, block_size: int, num_blocks: int,
                  padding_rows: bool = False) -> None:
    """The index arrays' values (host copies): lengths, the token count (at most ``num_tokens`` with
    ``padding_rows``, else exactly), and the blocks of every sequence that has query rows (a sequence without new
    tokens adds no row, so nothing reads its table)."""
    for name, lens in (("context_lens", context), ("query_lens", queries)):
        if lens.size and lens.min() < 0:
            s = int(np.argmin(lens))
            raise ValueError(f"{name}: expected lengths >= 0, sequence {s} has {lens[s]}")
    if np.any(queries > context):
        s = int(np.argmax(queries > context))
        raise ValueError(f"query_lens: sequence {s} has {queries[s]} new tokens but context_lens says only "
                         f"{context[s]} tokens are cached (its new tokens must be the last query_lens of them)")
    total = int(queries.sum())
    if total > num_tokens:
        raise ValueError(f"query_lens: sum(query_lens) = {total} is more than q's {num_tokens} query tokens (q.shape[0])")
    if total != num_tokens and not padding_rows:
        raise ValueError(f"query_lens: sum(query_lens) = {total} does not match q's {num_tokens} query tokens "
                         f"(q.shape[0])")
    check_block_tables(tables, np.where(queries > 0, context, 0), block_size, num_blocks)  # what the rows read


def _check_rows(rows, num_tokens: int, width: int) -> PrefillRows:
    """A caller's ``PrefillRows``: int32, C-contiguous, exactly ``[T, width]`` and ``[T]``; returned as
    kernel arrays (``__cuda_array_interface__`` objects wrapped)."""
    if not isinstance(rows, PrefillRows):
        raise ValueError(f"rows: expected a PrefillRows (prefill_rows_workspace) or None, got {type(rows).__name__}")
    checked = []
    for name, x, shape in (("rows.block_tables", rows.block_tables, (num_tokens, width)),
                           ("rows.seq_lens", rows.seq_lens, (num_tokens,))):
        x = as_kernel_array(name, x)
        if tuple(x.shape) != shape or np.dtype(x.dtype) != np.int32:
            reject(name, f"int32 {list(shape)} (prefill_rows_workspace({num_tokens}, {width}))", x)
        require_c_contiguous(name, x)
        checked.append(x)
    return PrefillRows(*checked)


def check_prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, out, k_scale=None, v_scale=None,
                  max_context_len=None, rows=None, kv_format=None, padding_rows: bool = False) -> PrefillCall:
    """Every argument check of ``paged_prefill``; nothing is launched here. ``padding_rows``: ``q`` may hold more
    rows than ``sum(query_lens)`` (the tensor-core prefill's padded forwards: no sequence owns the rows past the
    sum, and nothing reads or writes them)."""
    names = ("q", "k_cache", "v_cache", "block_tables", "context_lens", "query_lens", "out")
    arrays = (q, k_cache, v_cache, block_tables, context_lens, query_lens, out)
    q, k_cache, v_cache, block_tables, context_lens, query_lens, out = (
        as_kernel_array(n, x) for n, x in zip(names, arrays))
    k_scale = None if k_scale is None else as_kernel_array("k_scale", k_scale)
    v_scale = None if v_scale is None else as_kernel_array("v_scale", v_scale)
    kv_format = _check_shapes(q, k_cache, v_cache, block_tables, context_lens, query_lens, out, k_scale, v_scale,
                              kv_format)
    num_tokens = q.shape[0]
    num_blocks, _, block_size, _ = k_cache.shape
    if rows is not None:
        rows = _check_rows(rows, num_tokens, block_tables.shape[1])

    host_indices = all(_is_host(x) for x in (block_tables, context_lens, query_lens))
    if max_context_len is None or host_indices:  # read the values (device arrays: a synchronizing copy)
        context = to_host(context_lens).astype(np.int64)
        queries = to_host(query_lens).astype(np.int64)
        _check_values(to_host(block_tables).astype(np.int64), context, queries, num_tokens, block_size, num_blocks,
                      padding_rows)
        longest = int(context[queries > 0].max(initial=0))  # the longest expanded row
        if max_context_len is not None and int(max_context_len) < int(context.max(initial=0)):
            raise ValueError(f"max_context_len: {max_context_len} is shorter than the longest context "
                             f"({int(context.max(initial=0))})")
    else:  # device indices and a bound from the caller: nothing read back, the caller vouches for the values
        longest = int(max_context_len)
        if longest < 0 or -(-longest // block_size) > block_tables.shape[1]:
            raise ValueError(f"max_context_len: {longest} tokens need {-(-longest // block_size)} blocks of "
                             f"{block_size}, block_tables has {block_tables.shape[1]} columns")
    max_seq_len = longest if max_context_len is None else int(max_context_len)
    return PrefillCall(q, out, block_tables, context_lens, query_lens, rows, host_indices, max_seq_len, block_size,
                       kv_format)


# ---------------------------------------------------------------------------- the expansion, then decode


def _store(host: np.ndarray, target):
    """Copy a host array into a NumPy or device array of the same shape."""
    if isinstance(target, np.ndarray):
        target[...] = host
    else:
        target.copy_to_device(host)


def expand_rows(call: PrefillCall, stream=0) -> PrefillRows:
    """The expanded rows of a checked call: NumPy for host index arrays, the kernel for device ones."""
    num_tokens = call.q.shape[0]
    if call.host_indices:
        tables, lens = expand_rows_host(call.block_tables, call.context_lens, call.query_lens)
        if call.rows is None:
            return PrefillRows(tables, lens)
        _store(tables, call.rows.block_tables)
        _store(lens, call.rows.seq_lens)
        return call.rows
    rows = call.rows
    if rows is None:
        rows = prefill_rows_workspace(num_tokens, call.block_tables.shape[1])
    if num_tokens:
        indices = [on_device(x, stream) for x in (call.block_tables, call.context_lens, call.query_lens)]
        pdl.launch(_expand_kernel, num_tokens, WARP_SIZE, stream, *indices, rows.block_tables, rows.seq_lens)
    return rows


def paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, softmax_scale, out, k_scale=None,
                  v_scale=None, *, kv_format=None, max_context_len=None, rows=None, workspace=None, stream=0):
    """Causal prefill attention of ``q`` over a paged cache, into ``out``; returns ``out``.

    ``q``: float32 ``[sum(query_lens), num_heads, head_dim]``, the new tokens of every sequence back to
    back; ``k_cache``, ``v_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]`` of uint8 E4M3
    codes (then float32 ``k_scale``, ``v_scale`` ``[num_blocks, num_kv_heads, block_size]`` are
    required), float32, or uint16 BF16 patterns, with every sequence's tokens already written;
    ``block_tables``: integer ``[num_seqs, max_blocks_per_seq]``; ``context_lens``, ``query_lens``:
    integer ``[num_seqs]``, ``0 <= query_lens <= context_lens``; ``out``: ``q``'s shape, written entirely,
    float32 or uint16: with uint16 each element is the BF16 bit pattern of the float32 result (round to
    nearest even, as ``splitkv.paged_decode`` stores it; no extra launch).

    ``kv_format`` (keyword): the format the caches hold (as ``splitkv.paged_decode``).

    ``max_context_len`` (keyword): an upper bound of ``context_lens``. Without it the index arrays are
    checked on the host (device arrays copied back). With it and device index arrays nothing is read
    back, the expansion runs on the device and the caller vouches for the values (a row past
    ``sum(query_lens)`` then gets a zero output row); the ``"auto"`` split count then uses it. ``rows``: a ``prefill_rows_workspace(len(q), block_tables.shape[1])``
    to fill instead of allocating; ``workspace``: a ``splitkv.decode_workspace(len(q), num_heads,
    head_dim)`` passed to the decode (allocated per call when None and the decode splits). With both,
    device arrays and ``max_context_len``, a call allocates nothing and reads nothing back.

    Arrays: NumPy, Numba device arrays or ``__cuda_array_interface__`` objects. Every bad argument is a
    ``ValueError`` before any launch.
    """
    call = check_prefill(q, k_cache, v_cache, block_tables, context_lens, query_lens, out, k_scale, v_scale,
                         max_context_len, rows, kv_format)
    if call.q.shape[0] == 0:
        return out
    expanded = expand_rows(call, stream)
    paged_decode(call.q, k_cache, v_cache, expanded.block_tables, expanded.seq_lens, softmax_scale, call.out, k_scale,
                 v_scale, num_splits="auto", workspace=workspace, kv_format=kv_format, max_seq_len=call.max_seq_len,
                 stream=stream)
    return out


# ---------------------------------------------------------------------------- every variant, for the PTX check


def kernel_variants():
    """``(name, python function, numba signature)`` of the expansion kernel (C-contiguous int32 indices)."""
    i32 = types.int32
    signature = types.void(types.Array(i32, 2, "C"), types.Array(i32, 1, "C"), types.Array(i32, 1, "C"),
                           types.Array(i32, 2, "C"), types.Array(i32, 1, "C"))
    return [("expand_prefill_rows", expand_prefill_rows, signature)]
