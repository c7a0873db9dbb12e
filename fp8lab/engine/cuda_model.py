"""The Qwen3-FP8 forward pass on an NVIDIA GPU with ``numba_kernels`` (and, unchanged, in Numba's CUDA simulator).

``CudaQwen3Model`` is a drop-in for ``fp8lab.engine.model.Qwen3Model`` where ``fp8lab.engine.generate.Generator``
uses it: ``config``, ``allocate_kv_cache(num_blocks, block_size, kv_cache_dtype)`` and
``forward(batch, kv_cache, all_logits=False)``, which returns float32 host logits ``[num_seqs, vocab]``
(``[T, vocab]`` with ``all_logits``). It computes what ``Qwen3Model`` computes, in the same order
(see ``fp8lab/engine/model.py``); every operator is a kernel and every activation stays on the device.

What lives on the device (uploaded once by the constructor, never a BF16 or float32 copy of an FP8 weight):

=============================  ==================================================================
weights                        layout
=============================  ==================================================================
q/k/v projections              one fused FP8 weight ``[(Hq + 2 Hkv) D, hidden]`` (uint8 E4M3 codes,
                               rows q, then k, then v) with its float32 ``scale_inv``
gate/up projections            one fused FP8 weight ``[2 I, hidden]`` (gate rows, then up rows):
                               its GEMM writes the ``[T, 2 I]`` that ``layers.silu_mul`` reads
o_proj, down_proj              FP8 codes ``[N, K]`` + float32 ``scale_inv``, as in the checkpoint
norms (incl. q/k-norm)         float32
embed_tokens, lm_head          BF16 bit patterns (uint16) ``[vocab, hidden]``; one array when tied
RoPE                           ``layers.rope_table``: float32 ``[max_position_embeddings, head_dim]``
=============================  ==================================================================

Fusing concatenates codes and ``scale_inv`` rows; when a part's row count is not a multiple of the
checkpoint's ``block_n`` the fused weight is re-blocked to ``block_n' = gcd(block_n, part sizes)``
rows per scale (each scale row repeated), which describes exactly the same dequantized matrix. A
part of a fused weight is a row slice of it (a view: codes, scale rows), so q, k and v can also run
as three GEMMs (a batch of more than one token: see launches below). Projections a checkpoint keeps
in BF16 (``modules_to_not_convert``, or a BF16 checkpoint) are BF16 bit patterns run by
``layers.bf16_linear``; float32 weights that are not BF16 values are rounded to BF16 at load.

Activations live in buffers preallocated for ``max_num_tokens`` tokens and ``max_num_seqs``
sequences: the residual ``h``, the normed ``x``, a block output ``y`` (all float32 ``[T, hidden]``),
q/k/v (one flat float32 buffer: ``[T, Hq, D]``, then ``[T, Hkv, D]`` twice), the attention output,
``gate_up [T, 2 I]``, the SwiGLU output ``[T, I]`` and the logits of ``max_num_seqs`` rows. A forward
copies in the small index arrays (token ids, positions, slots, block tables, lengths: int32, one
copy), launches kernels, and copies the logits out; nothing is allocated and nothing else is read back.

The GEMM input format (``f32_max_rows``): a GEMM of at most ``f32_max_rows`` rows (default
``DEFAULT_F32_MAX_ROWS = 4``, at most 16) runs ``gemv_simt`` directly on the float32 activations, so
the product is the reference's float32 linear up to the summation order; a larger one (long prompts,
decode batches of more than 4) rounds the activations to BF16 (a small kernel, ``layers.bf16_round``)
and runs ``fp8_gemm`` (tensor cores), W8A16 as the kernels are designed. The default comes from the
accuracy table of the trained demo model (``docs/08_accuracy.md``, ``bench/RESULTS.md``): BF16 inputs
into FP8 weights cost far less than the FP8 weights themselves, while at M = 5..16 the tensor-core
GEMM is 3 to 5 times faster than the SIMT GEMV. (The random tiny model is much more sensitive: its
flat logits let BF16 inputs change greedy tokens within a few steps, which is why its GPU tests ask
for ``f32_max_rows=16``.)

Launches of one forward over ``T`` tokens (a decode step: ``T`` = the batch bucket), per layer:
``add_rms_norm`` (the previous residual add fused with this norm; ``rms_norm`` in layer 0), the
q/k/v GEMM (one fused launch for ``T = 1``, else three: a token's q, k and v are not contiguous in a
fused ``[T, N]`` output, and the norm, RoPE and cache-write kernels take contiguous arrays), q-norm,
k-norm, RoPE (one launch over q and k for ``T = 1``, else two), ``paged_cache_write``, attention
(decode: ``paged_decode``, the split kernel and, with more than one split, the combine kernel;
prefill: ``paged_prefill``, the row expansion, the split kernel and maybe the combine), o_proj,
``add_rms_norm``, the gate/up GEMM, ``silu_mul``, down_proj; plus one ``bf16_round`` before each
FP8 GEMM input when ``T > f32_max_rows``. Around the layers: the embedding, the final
``add_rms_norm`` and the lm_head (``bf16_linear``). A decode step of batch 1 is 12 or 13 launches
per layer, plus the greedy argmax (``layers.argmax_rows``, for ``greedy_tokens``), e.g. 13 * 36 + 4 = 472
for Qwen3-8B; ``stats.launches_per_decode_step`` counts them.

Prefill and decode: a batch whose sequences all have one new token is a *decode step*; any other
batch runs eagerly with ``paged_prefill`` over all its rows (a one-token chunk is a prefill chunk
whose attention is exactly a decode; ``fp8lab.engine.generate`` never mixes the two). Logits are computed
only for each sequence's last token (``all_logits``: every token, in chunks of ``max_num_seqs``).

The decode step and CUDA graphs: a decode step pads its batch to a *bucket* (1, 2, 4, 8, ... and
``max_num_seqs``) and runs a fixed kernel sequence on persistent per-cache index buffers, padded rows
having slot -1 (``paged_cache_write`` writes nothing) and length 0 (a zero attention row), with
``check_slots=False`` and ``max_seq_len`` = the cache's capacity per sequence, so that no kernel
wrapper reads anything back or allocates. On a GPU the first decode step of a bucket runs eagerly
(which compiles and warms every kernel) and then captures that sequence into a CUDA graph with a
``cuda.core`` GraphBuilder (``kernel[grid, block, builder]``, as ``bench/timing.py``); later steps of
the bucket copy the index arrays in, replay the graph and copy the logits out: one graph launch
instead of hundreds of Python launches of 10 to 25 us each. The split count of ``paged_decode`` is
chosen from the bucket and the capacity, so the eager step and its replays run the same kernels on
the same arguments and give the same bits. Graphs belong to the KV cache they were captured with
(they hold its addresses) and are dropped with it. In the simulator there are no graphs: the same
padded sequence runs eagerly. ``stats`` reports launches per decode step, graph replays and host
time per step (time until the step's work is enqueued; the rest of a step's wall time is the GPU).

Memory: every device allocation goes through one helper, so running out of GPU memory while loading
or allocating the KV cache raises ``RuntimeError`` naming what did not fit and how many bytes it
needed (and how many were free), not a crash in a kernel. A batch larger than the preallocated
buffers raises ``ValueError`` naming the limit; running out of KV blocks is ``fp8lab.engine.kv_manager``'s
``KVCacheExhausted``, raised before any work, as with the reference model.

Checked against ``Qwen3Model`` on the reference backend (``tests/engine/test_cuda_model.py``, which states
and derives the bounds): in the CUDA simulator on a micro model, every non-GEMM kernel for real and
the three GEMM kernels replaced by their bit-exact NumPy twins (``fp8lab/simulators/``; the simulator spends
milliseconds per simulated thread, so one real-width GEMM takes seconds to minutes there): greedy
tokens identical over prefill and decode steps with BF16 and FP8 KV, a batch of three with a padding
row, logits within ``1e-4`` / ``1e-3`` (measured 2e-7), the BF16-input path within ``2^-6``, padding
rows writing nothing into the cache, launch counts, ``fp8lab generate --backend cudasim``. On a GPU
with the embedded tiny model and the real kernels: 32 greedy tokens identical to the reference (BF16
and FP8 KV, one sequence and a batch of two), logits within ``5e-3``, graph replays bit-identical to
eager steps, a long prompt through the tensor-core path, out-of-memory errors, and
``fp8lab generate --backend cuda``.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from fp8lab.numba_kernels import layers, splitkv
from fp8lab.numba_kernels.bits import SIMULATOR
from fp8lab.numba_kernels.fp8_gemm import fp8_gemm
from fp8lab.numba_kernels.gemv_simt import MAX_ROWS as SIMT_MAX_ROWS
from fp8lab.numba_kernels.gemv_simt import gemv_simt
from fp8lab.numba_kernels.kv_cache import paged_cache_write
from fp8lab.numba_kernels.layers import bf16_linear
from fp8lab.numba_kernels.prefill import PrefillRows, paged_prefill
from fp8lab.reference import blockwise

from .config import Qwen3Config
from .kv_manager import KV_CACHE_DTYPES
from .layout import is_fp8_projection
from .model import ForwardBatch, check_tensors
from .safetensors_io import round_to_bf16

DEFAULT_F32_MAX_ROWS = 4
"""GEMMs of at most this many rows take float32 activations by default (see the module docstring)."""
K_MULTIPLE = 128
"""The FP8 GEMM kernels walk K in 128-wide chunks: every projection's K must be a multiple."""
BLOCK_N_MULTIPLE = 8
"""``fp8_gemm`` needs block_n to be a multiple of 8 (the tensor-core tile)."""
ELEMENTWISE_THREADS = 256
POISON_BYTE = 0xFF
"""A fresh KV cache is filled with 0xFF bytes: NaN in E4M3 (0xFF), BF16 (0xFFFF) and float32 scales, so a
slot read before it was written gives NaN, as the reference cache's NaN poison does."""


# ---------------------------------------------------------------------------- device memory


def gpu_memory_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current GPU's memory, as the driver reports them now (GPU only)."""
    free, total = cuda.current_context().get_memory_info()
    return int(free), int(total)


def _cuda_memory_errors() -> tuple[type, ...]:
    if SIMULATOR:
        return (MemoryError,)
    from numba.cuda.cudadrv.driver import CudaAPIError, CudaDriverError

    return (MemoryError, CudaAPIError, CudaDriverError)


class DeviceMemory:
    """Every device allocation and copy of the model: NumPy arrays in the simulator (what its kernels
    take), Numba device arrays on a GPU. Running out of memory is a ``RuntimeError`` naming the array."""

    def __init__(self):
        self.allocated_bytes = 0

    def _out_of_memory(self, what: str, nbytes: int, error: Exception) -> RuntimeError:
        free = ""
        if not SIMULATOR:
            try:
                free_bytes, total_bytes = cuda.current_context().get_memory_info()
                free = f"; {free_bytes:,} of {total_bytes:,} bytes of GPU memory are free"
            except Exception:  # the context may be unusable after the failure
                pass
        where = "host memory (CUDA simulator)" if SIMULATOR else "GPU memory"
        return RuntimeError(f"out of {where}: {what} needs {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB){free}; "
                            f"this model holds {self.allocated_bytes:,} bytes so far ({type(error).__name__}: {error})")

    def empty(self, what: str, shape, dtype):
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        try:
            array = np.empty(shape, dtype) if SIMULATOR else cuda.device_array(shape, dtype)
        except _cuda_memory_errors() as e:
            raise self._out_of_memory(what, nbytes, e) from None
        self.allocated_bytes += nbytes
        return array

    def upload(self, what: str, host: np.ndarray):
        host = np.ascontiguousarray(host)
        if SIMULATOR:
            self.allocated_bytes += host.nbytes
            return host.copy()
        try:
            array = cuda.to_device(host)
        except _cuda_memory_errors() as e:
            raise self._out_of_memory(what, host.nbytes, e) from None
        self.allocated_bytes += host.nbytes
        return array

    def poisoned(self, what: str, shape, dtype):
        """An array of ``shape`` filled with 0xFF bytes (``POISON_BYTE``)."""
        array = self.empty(what, shape, dtype)
        if SIMULATOR:
            array.view(np.uint8)[...] = POISON_BYTE
        else:
            from numba.cuda.cudadrv.driver import device_memset

            device_memset(array, POISON_BYTE, array.nbytes)
        return array

    @staticmethod
    def pinned(shape, dtype) -> np.ndarray:
        """Page-locked host memory (fast, asynchronous copies); plain NumPy in the simulator."""
        return np.zeros(shape, dtype) if SIMULATOR else cuda.pinned_array(shape, dtype)


def _to_device(dst, src: np.ndarray, stream) -> None:
    """Copy host ``src`` into the device array ``dst`` (same size), ordered on ``stream``."""
    if SIMULATOR:
        dst[...] = src.reshape(dst.shape)
    else:
        dst.copy_to_device(src, stream=stream)


def _to_host(dst: np.ndarray, src, stream) -> None:
    if SIMULATOR:
        dst[...] = src
    else:
        src.copy_to_host(dst, stream=stream)


def _device_copy(dst, src, stream) -> None:
    if SIMULATOR:
        dst[...] = src
    else:
        dst.copy_to_device(src, stream=stream)


def _synchronize(stream) -> None:
    if not SIMULATOR:
        stream.synchronize()


# ---------------------------------------------------------------------------- weights


@dataclass
class DeviceLinear:
    """One projection on the device: ``kind`` ``"fp8"`` (uint8 codes ``weight [N, K]``, float32
    ``scale_inv``, ``block = (BN, BK)``) or ``"bf16"`` (uint16 BF16 patterns ``weight [N, K]``)."""

    kind: str
    weight: object
    scale_inv: object = None
    block: tuple[int, int] | None = None

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    def rows(self, start: int, stop: int) -> "DeviceLinear":
        """Rows ``[start, stop)`` as a view (FP8: ``start`` a multiple of block_n, ``stop`` one or ``N``)."""
        if self.kind == "bf16":
            return DeviceLinear("bf16", self.weight[start:stop])
        bn = self.block[0]
        assert start % bn == 0 and (stop % bn == 0 or stop == self.n), (start, stop, bn)
        return DeviceLinear("fp8", self.weight[start:stop], self.scale_inv[start // bn : -(-stop // bn)], self.block)


@dataclass
class LinearGroup:
    """Projections that read the same input: ``fused`` runs them as one GEMM (None when their formats
    differ), ``parts`` one at a time (row views of ``fused`` when there is one)."""

    fused: DeviceLinear | None
    parts: list[DeviceLinear]
    sizes: tuple[int, ...]


@dataclass
class DeviceLayer:
    input_layernorm: object
    q_norm: object
    k_norm: object
    post_attention_layernorm: object
    qkv: LinearGroup
    o_proj: DeviceLinear
    gate_up: DeviceLinear
    down_proj: DeviceLinear


def bf16_patterns(x: np.ndarray) -> np.ndarray:
    """float32 values as BF16 bit patterns (uint16), rounded to nearest even (exact for BF16 values)."""
    return (round_to_bf16(np.ascontiguousarray(x, np.float32)).view(np.uint32) >> 16).astype(np.uint16)


def reblocked_scales(scale_inv: np.ndarray, rows: int, block_n: int, new_block_n: int) -> np.ndarray:
    """``scale_inv`` rows for blocks of ``new_block_n`` rows (a divisor of ``block_n`` and of ``rows``):
    block ``r`` of the new blocking lies inside the old block ``r * new_block_n // block_n``."""
    old_rows = np.arange(rows // new_block_n) * new_block_n // block_n
    return scale_inv[old_rows]


def fuse_fp8(parts: list[tuple[np.ndarray, np.ndarray]], block: tuple[int, int]):
    """Concatenate FP8 weights ``(codes [N_i, K], scale_inv)`` along N; returns ``(codes, scale_inv, block')``,
    re-blocked to ``block_n' = gcd(block_n, N_0, N_1, ...)`` when a part is not whole blocks, or None
    when that is not a multiple of 8 (the tensor-core kernel's requirement)."""
    bn, bk = block
    sizes = [codes.shape[0] for codes, _ in parts]
    new_bn = math.gcd(bn, *sizes)
    if new_bn % BLOCK_N_MULTIPLE:
        return None
    codes = np.concatenate([c for c, _ in parts])
    scales = np.concatenate([reblocked_scales(s, n, bn, new_bn) for (_, s), n in zip(parts, sizes)])
    return codes, np.ascontiguousarray(scales, np.float32), (new_bn, bk)


def unsupported_reason(config: Qwen3Config) -> str | None:
    """Why ``CudaQwen3Model`` cannot run ``config`` with these kernels (None: it can)."""
    c = config
    if c.head_dim not in splitkv.HEAD_DIMS:
        return f"head_dim {c.head_dim} (the attention kernels take {', '.join(map(str, splitkv.HEAD_DIMS))})"
    ks = {"hidden_size": c.hidden_size, "num_attention_heads * head_dim": c.num_attention_heads * c.head_dim,
          "intermediate_size": c.intermediate_size}
    for name, k in ks.items():
        if c.quantization is not None and k % K_MULTIPLE:
            return f"{name} = {k} (the FP8 GEMM kernels need K to be a multiple of {K_MULTIPLE})"
        if k % 8:
            return f"{name} = {k} (the BF16 linear kernel needs K to be a multiple of 8)"
    if c.quantization is not None:
        bn, bk = c.quantization.weight_block_size
        if bk % K_MULTIPLE or bn % BLOCK_N_MULTIPLE:
            return (f"weight_block_size {[bn, bk]} (the FP8 GEMM kernels need block_k a multiple of {K_MULTIPLE} "
                    f"and block_n a multiple of {BLOCK_N_MULTIPLE})")
    return None


# ---------------------------------------------------------------------------- the KV cache and its index buffers


@dataclass
class DeviceLayerKVCache:
    """One layer's paged caches on the device: ``k``, ``v`` ``[num_blocks, num_kv_heads, block_size,
    head_dim]`` (uint8 E4M3 codes, uint16 BF16 patterns or float32) and, for FP8, float32 scales
    ``k_scale``, ``v_scale`` ``[num_blocks, num_kv_heads, block_size]`` (None otherwise)."""

    k: object
    v: object
    k_scale: object
    v_scale: object
    kv_cache_dtype: str

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


class DeviceKVCache:
    """A model's paged KV cache on the device: one ``DeviceLayerKVCache`` per layer (``len``, indexing and
    iteration as a list) plus the per-cache index buffers of the decode step and its CUDA graphs.

    ``width``: block-table columns per sequence (``min(num_blocks, ceil(max_position_embeddings /
    block_size))``); ``capacity``: ``width * block_size`` tokens, the ``max_seq_len`` of every decode step.

    Index buffers (int32, device, with a host staging copy): the decode step's ``[ids | positions | slots
    | lens]`` (``max_num_seqs`` each) then ``block_tables [bucket, width]``, all filled by one copy; the
    eager forward's ``[ids | positions | slots]`` (``max_num_tokens`` each), ``[context_lens | query_lens]``
    (``max_num_seqs`` each), then ``block_tables``; and ``paged_prefill``'s expanded rows.
    """

    def __init__(self, model: "CudaQwen3Model", num_blocks: int, block_size: int, kv_cache_dtype: str):
        c, mem = model.config, model.memory
        self.model_id = id(model)
        self.num_blocks, self.block_size, self.kv_cache_dtype = int(num_blocks), int(block_size), kv_cache_dtype
        shape = (self.num_blocks, c.num_key_value_heads, self.block_size, c.head_dim)
        dtype = {"fp8": np.uint8, "bf16": np.uint16, "fp32": np.float32}[kv_cache_dtype]
        self.layers = []
        for i in range(c.num_hidden_layers):
            k = mem.poisoned(f"KV cache layer {i} K {list(shape)} {kv_cache_dtype}", shape, dtype)
            v = mem.poisoned(f"KV cache layer {i} V {list(shape)} {kv_cache_dtype}", shape, dtype)
            ks = vs = None
            if kv_cache_dtype == "fp8":
                ks = mem.poisoned(f"KV cache layer {i} K scales {list(shape[:3])}", shape[:3], np.float32)
                vs = mem.poisoned(f"KV cache layer {i} V scales {list(shape[:3])}", shape[:3], np.float32)
            self.layers.append(DeviceLayerKVCache(k, v, ks, vs, kv_cache_dtype))
        self.width = max(1, min(self.num_blocks, -(-c.max_position_embeddings // self.block_size)))
        self.capacity = self.width * self.block_size
        smax, tmax = model.max_num_seqs, model.max_num_tokens
        self.decode_index_size = 4 * smax + smax * self.width
        self.decode_index = mem.empty("decode-step index buffer", (self.decode_index_size,), np.int32)
        self.decode_index_host = mem.pinned((self.decode_index_size,), np.int32)
        self.eager_index_size = 3 * tmax + 2 * smax + smax * self.width
        self.eager_index = mem.empty("forward index buffer", (self.eager_index_size,), np.int32)
        self.eager_index_host = mem.pinned((self.eager_index_size,), np.int32)
        self.prefill_rows = (mem.empty("prefill expanded block tables", (tmax * self.width,), np.int32),
                             mem.empty("prefill expanded lengths", (tmax,), np.int32))
        self.graphs: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def decode_views(self, bucket: int, smax: int):
        """Device views of the decode buffers for ``bucket`` rows: ids, positions, slots, lens, tables."""
        d = self.decode_index
        return (d[0:bucket], d[smax : smax + bucket], d[2 * smax : 2 * smax + bucket],
                d[3 * smax : 3 * smax + bucket], d[4 * smax : 4 * smax + bucket * self.width].reshape(bucket, self.width))


# ---------------------------------------------------------------------------- statistics


@dataclass
class CudaModelStats:
    """What the model did. Host time: from ``forward``'s entry until all of the step's work is enqueued
    (index copies, launches or the graph launch, the logits copy); wall time: until the logits are on
    the host."""

    prefill_forwards: int = 0
    decode_steps: int = 0
    graph_replays: int = 0
    graphs_captured: int = 0
    capture_seconds: float = 0.0
    decode_host_seconds: float = 0.0
    decode_wall_seconds: float = 0.0
    replay_host_seconds: float = 0.0
    replay_wall_seconds: float = 0.0
    launches_by_bucket: dict[int, int] = field(default_factory=dict)
    """Kernel launches of one decode step (eager or captured) per batch bucket."""
    last_decode_bucket: int | None = None
    graph_error: str | None = None

    @property
    def launches_per_decode_step(self) -> int | None:
        """Kernel launches of the last decode step's bucket (one graph replay runs them all)."""
        return self.launches_by_bucket.get(self.last_decode_bucket)

    @property
    def host_us_per_decode_step(self) -> float:
        return 1e6 * self.decode_host_seconds / self.decode_steps if self.decode_steps else float("nan")

    @property
    def wall_us_per_decode_step(self) -> float:
        return 1e6 * self.decode_wall_seconds / self.decode_steps if self.decode_steps else float("nan")

    @property
    def host_us_per_replay(self) -> float:
        return 1e6 * self.replay_host_seconds / self.graph_replays if self.graph_replays else float("nan")

    def as_dict(self) -> dict:
        return {
            "prefill_forwards": self.prefill_forwards, "decode_steps": self.decode_steps,
            "graph_replays": self.graph_replays, "graphs_captured": self.graphs_captured,
            "capture_seconds": self.capture_seconds, "launches_per_decode_step": self.launches_per_decode_step,
            "launches_by_bucket": dict(self.launches_by_bucket),
            "host_us_per_decode_step": self.host_us_per_decode_step,
            "wall_us_per_decode_step": self.wall_us_per_decode_step,
            "host_us_per_replay": self.host_us_per_replay, "graph_error": self.graph_error,
        }


# ---------------------------------------------------------------------------- the model


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a decode step is padded to: powers of two below ``max_num_seqs``, and ``max_num_seqs``."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [int(max_num_seqs)])


class CudaQwen3Model:
    """A Qwen3 (FP8) causal LM whose forward runs as ``numba_kernels`` on the device; see the module docstring.

    ``tensors``: checkpoint tensors as ``fp8lab.engine.checkpoint`` loads them (``Qwen3Model``'s input).
    ``max_num_tokens``: most tokens in one forward (a prefill's prompt tokens); ``max_num_seqs``: most
    sequences in one forward (the decode batch); ``f32_max_rows``: GEMMs of at most this many rows take
    float32 activations (SIMT GEMV), larger ones BF16 (tensor cores); ``cuda_graphs``: capture and
    replay decode steps (GPU only).
    """

    def __init__(self, config: Qwen3Config, tensors: dict[str, np.ndarray], *, max_num_tokens: int = 2048,
                 max_num_seqs: int = 16, f32_max_rows: int = DEFAULT_F32_MAX_ROWS, cuda_graphs: bool = True):
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"CudaQwen3Model: unsupported model: {reason}")
        check_tensors(config, tensors)
        if int(max_num_seqs) < 1 or int(max_num_tokens) < int(max_num_seqs):
            raise ValueError(f"max_num_seqs ({max_num_seqs}) must be >= 1 and max_num_tokens ({max_num_tokens}) "
                             f">= max_num_seqs")
        if not 0 <= int(f32_max_rows) <= SIMT_MAX_ROWS:
            raise ValueError(f"f32_max_rows: expected 0 to {SIMT_MAX_ROWS} (the SIMT GEMV's row limit), got {f32_max_rows}")
        self.config = config
        self.max_num_tokens, self.max_num_seqs = int(max_num_tokens), int(max_num_seqs)
        self.f32_max_rows = int(f32_max_rows)
        self.cuda_graphs = bool(cuda_graphs) and not SIMULATOR
        self.softmax_scale = config.head_dim ** -0.5
        self.buckets = decode_buckets(self.max_num_seqs)
        self.memory = DeviceMemory()
        self.stats = CudaModelStats()
        self._launches = 0
        self._stream = 0 if SIMULATOR else cuda.stream()
        self._core_stream = None
        self._upload_weights(tensors)
        self._allocate_activations()

    @classmethod
    def from_checkpoint(cls, checkpoint, **options) -> "CudaQwen3Model":
        """Build from an ``fp8lab.engine.checkpoint.Checkpoint`` (its ``config`` and ``tensors``); ``options``
        are the constructor's keywords."""
        return cls(checkpoint.config, checkpoint.tensors, **options)

    # -- loading

    def _upload_weights(self, tensors) -> None:
        c, mem = self.config, self.memory

        def f32(name):
            return mem.upload(name, np.ascontiguousarray(tensors[name], np.float32))

        embed = mem.upload("model.embed_tokens.weight (BF16)", bf16_patterns(tensors["model.embed_tokens.weight"]))
        self.embed_tokens = embed
        self.lm_head = embed if c.tie_word_embeddings else mem.upload("lm_head.weight (BF16)",
                                                                       bf16_patterns(tensors["lm_head.weight"]))
        self.norm = f32("model.norm.weight")
        self.rope_cos_sin = mem.upload("RoPE table", layers.rope_table(c.max_position_embeddings, c.head_dim, c.rope_theta))
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = self._group(tensors, [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"])
            gate_up = self._group(tensors, [p + "mlp.gate_proj", p + "mlp.up_proj"])
            if gate_up.fused is None:
                raise ValueError(f"layer {i}: gate_proj and up_proj must share a format (both FP8 or both BF16) "
                                 "to run as one GEMM")
            self.layers.append(DeviceLayer(
                input_layernorm=f32(p + "input_layernorm.weight"), q_norm=f32(p + "self_attn.q_norm.weight"),
                k_norm=f32(p + "self_attn.k_norm.weight"),
                post_attention_layernorm=f32(p + "post_attention_layernorm.weight"),
                qkv=qkv, o_proj=self._group(tensors, [p + "self_attn.o_proj"]).fused, gate_up=gate_up.fused,
                down_proj=self._group(tensors, [p + "mlp.down_proj"]).fused))

    def _host_fp8(self, tensors, name):
        codes = np.ascontiguousarray(tensors[name + ".weight"])
        block = self.config.quantization.weight_block_size
        scales = blockwise.checked_scales(tensors[name + ".weight_scale_inv"], codes.shape, block)
        nan_codes = blockwise.nan_code_positions(codes)
        if len(nan_codes):
            raise ValueError(f"{name}.weight: {len(nan_codes)} NaN codes, e.g. at {tuple(int(i) for i in nan_codes[0])}")
        return codes, np.ascontiguousarray(scales, np.float32)

    def _upload_one(self, tensors, name: str) -> DeviceLinear:
        """One projection as it is in the checkpoint: FP8 codes + scales, or BF16 patterns."""
        if is_fp8_projection(self.config, name):
            codes, scales = self._host_fp8(tensors, name)
            return DeviceLinear("fp8", self.memory.upload(f"{name} (FP8 codes)", codes),
                                self.memory.upload(f"{name}.weight_scale_inv", scales),
                                self.config.quantization.weight_block_size)
        return DeviceLinear("bf16", self.memory.upload(f"{name} (BF16)", bf16_patterns(tensors[name + ".weight"])))

    def _group(self, tensors, names: list[str]) -> LinearGroup:
        """Upload projections that read the same input, fused into one weight when their formats agree."""
        if len(names) == 1:
            linear = self._upload_one(tensors, names[0])
            return LinearGroup(linear, [linear], (linear.n,))
        fp8 = [is_fp8_projection(self.config, n) for n in names]
        what = f"{names[0].rsplit('.', 1)[0]}.{'+'.join(n.rsplit('.', 1)[-1] for n in names)}"
        fused = None
        if all(fp8):
            host = [self._host_fp8(tensors, n) for n in names]
            joined = fuse_fp8(host, self.config.quantization.weight_block_size)
            if joined is not None:
                codes, scales, block = joined
                fused = DeviceLinear("fp8", self.memory.upload(f"{what} (FP8 codes)", codes),
                                     self.memory.upload(f"{what} scale_inv", scales), block)
        elif not any(fp8):
            bits = np.concatenate([bf16_patterns(tensors[n + ".weight"]) for n in names])
            fused = DeviceLinear("bf16", self.memory.upload(f"{what} (BF16)", bits))
        if fused is None:  # mixed formats, or blocks that do not fuse: one weight each
            parts = [self._upload_one(tensors, n) for n in names]
            return LinearGroup(None, parts, tuple(p.n for p in parts))
        sizes = tuple(int(tensors[n + ".weight"].shape[0]) for n in names)
        offsets = np.cumsum((0,) + sizes)
        parts = [fused.rows(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]
        return LinearGroup(fused, parts, sizes)

    def _allocate_activations(self) -> None:
        c, mem = self.config, self.memory
        tmax, smax = self.max_num_tokens, self.max_num_seqs
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = hq * d, hkv * d
        for name in ("h", "x", "y"):
            setattr(self, name, mem.empty(f"activations {name}", (tmax, c.hidden_size), np.float32))
        self.qkv_flat = mem.empty("activations q/k/v", (tmax * (self.q_size + 2 * self.kv_size),), np.float32)
        self.attn = mem.empty("activations attention output", (tmax, hq, d), np.float32)
        self.gate_up = mem.empty("activations gate_up", (tmax, 2 * c.intermediate_size), np.float32)
        self.act = mem.empty("activations SwiGLU", (tmax, c.intermediate_size), np.float32)
        widest = max(c.hidden_size, self.q_size, c.intermediate_size)
        needs_bf16 = self.f32_max_rows < tmax
        self.bf16_flat = mem.empty("activations BF16 GEMM input", (tmax * widest if needs_bf16 else 1,), np.uint16)
        self.selected = mem.empty("last-token rows", (smax, c.hidden_size), np.float32)
        self.logits = mem.empty(f"logits [{smax}, {c.vocab_size}]", (smax, c.vocab_size), np.float32)
        self.logits_host = mem.pinned((smax, c.vocab_size), np.float32)
        self.greedy_ids = mem.empty("greedy token ids", (smax,), np.int32)
        self.greedy_ids_host = mem.pinned((smax,), np.int32)
        # the split-kv workspace: enough for the split count "auto" picks for any number of rows
        sms = splitkv.device_num_sms()
        most = 0
        for rows in range(1, tmax + 1):
            s = splitkv.choose_num_splits(rows, hq, hkv, 2**62, sms, 1)
            if s > 1:
                most = max(most, rows * hq * s * (d + 2))
        self.workspace_flat = mem.empty("attention split-kv workspace", (max(most, 1),), np.float32)

    # -- the KV cache

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_cache_dtype: str) -> DeviceKVCache:
        """A paged KV cache on the device, poisoned with NaN (``POISON_BYTE``); ``kv_cache_dtype``
        ``"fp8"`` (E4M3 codes + float32 scales per token and kv head), ``"bf16"`` or ``"fp32"``."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if int(num_blocks) <= 0 or int(block_size) <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        return DeviceKVCache(self, num_blocks, block_size, kv_cache_dtype)

    # -- the forward pass

    def forward(self, batch: ForwardBatch, kv_cache: DeviceKVCache, all_logits: bool = False) -> np.ndarray:
        """Run the batch's new tokens through the model, writing their K/V into ``kv_cache``.

        Returns float32 host logits ``[num_seqs, vocab]`` of each sequence's last new token, or
        ``[T, vocab]`` of every new token with ``all_logits``.
        """
        start = time.perf_counter()
        self._check(batch, kv_cache)
        if np.all(batch.query_lens == 1):
            return self._decode_step(batch, kv_cache, start)
        self.stats.prefill_forwards += 1
        return self._prefill(batch, kv_cache, all_logits)

    def greedy_tokens(self, batch: ForwardBatch, kv_cache: DeviceKVCache) -> np.ndarray:
        """``forward`` then greedy sampling: int ``[num_seqs]``, the argmax of each sequence's last logits
        row (``np.argmax``'s rule: the first maximum; a row holding NaN gives -1, no token, which
        ``fp8lab.engine.generate`` turns into that sequence's error). A decode step samples on the device
        (``layers.argmax_rows``, part of the captured graph) and copies 4 bytes per sequence back instead
        of the logits; a prefill samples the host logits with the same rule."""
        start = time.perf_counter()
        self._check(batch, kv_cache)
        if np.all(batch.query_lens == 1):
            return self._decode_step(batch, kv_cache, start, ids_only=True)
        self.stats.prefill_forwards += 1
        logits = self._prefill(batch, kv_cache, False)
        return np.where(np.isnan(logits).any(axis=1), layers.NAN_ROW, np.argmax(logits, axis=1))

    def _check(self, batch: ForwardBatch, cache) -> None:
        batch.check()
        c = self.config
        if not isinstance(cache, DeviceKVCache) or cache.model_id != id(self):
            raise ValueError("kv_cache: expected a cache from this model's allocate_kv_cache")
        t, s = len(batch.token_ids), batch.num_seqs
        if t > self.max_num_tokens:
            raise ValueError(f"batch of {t} tokens: more than max_num_tokens={self.max_num_tokens}, the size of the "
                             "preallocated activation buffers (build the model with a larger max_num_tokens, or prefill "
                             "in smaller chunks)")
        if s > self.max_num_seqs:
            raise ValueError(f"batch of {s} sequences: more than max_num_seqs={self.max_num_seqs}, the size of the "
                             "preallocated per-sequence buffers (build the model with a larger max_num_seqs)")
        if np.any(batch.token_ids < 0) or np.any(batch.token_ids >= c.vocab_size):
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        if np.any(batch.positions < 0) or np.any(batch.positions >= c.max_position_embeddings):
            raise ValueError(f"positions must lie in [0, {c.max_position_embeddings}) (max_position_embeddings)")
        slots = np.asarray(batch.slot_mapping)
        num_slots = cache.num_blocks * cache.block_size
        if np.any(slots < 0) or np.any(slots >= num_slots) or np.unique(slots).size != slots.size:
            raise ValueError(f"slot_mapping: slots must be distinct and lie in [0, {num_slots})")
        if batch.block_tables.shape[1] > cache.width or np.any(batch.context_lens > cache.capacity):
            raise ValueError(f"block_tables: at most {cache.width} blocks ({cache.capacity} tokens) per sequence in "
                             "this cache")

    def _count(self, n: int = 1) -> None:
        self._launches += n

    # -- operators (each counts its launches)

    def _linear(self, linear: DeviceLinear, x, out, x_bf16, stream) -> None:
        """``out [M, N] = x [M, K] @ W^T``: float32 ``x`` for a SIMT GEMV (``x_bf16`` None) or ``x_bf16``, its
        BF16 rounding, for ``fp8_gemm``; BF16 weights take the float32 ``x`` in ``bf16_linear``."""
        self._count()
        if linear.kind == "bf16":
            bf16_linear(x, linear.weight, out, stream=stream)
        elif x_bf16 is None:
            gemv_simt(x, linear.weight, linear.scale_inv, out, linear.block, stream=stream)
        else:
            fp8_gemm(x_bf16, linear.weight, linear.scale_inv, out, linear.block, stream=stream)

    def _gemm_input(self, x, uses_fp8: bool, stream):
        """The BF16 rounding of float32 ``x [M, K]`` when ``M > f32_max_rows`` and an FP8 GEMM reads it, else None."""
        m, k = x.shape
        if not uses_fp8 or m <= self.f32_max_rows:
            return None
        out = self.bf16_flat[: m * k].reshape(m, k)
        self._count()
        layers.bf16_round(x.reshape(m * k), out.reshape(m * k), stream=stream)
        return out

    def _layers(self, t: int, positions, slots, cache: DeviceKVCache, attend, stream) -> None:
        """The decoder layers over ``t`` tokens whose embeddings are in ``h[:t]``; leaves the final norm
        of the residual stream in ``x[:t]``."""
        c = self.config
        eps = c.rms_norm_eps
        h, x, y = self.h[:t], self.x[:t], self.y[:t]
        qd, kd, hq, hkv, d = self.q_size, self.kv_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        flat = self.qkv_flat
        q = flat[0 : t * qd].reshape(t, hq, d)
        k = flat[t * qd : t * (qd + kd)].reshape(t, hkv, d)
        v = flat[t * (qd + kd) : t * (qd + 2 * kd)].reshape(t, hkv, d)
        attn = self.attn[:t]
        gate_up, act = self.gate_up[:t], self.act[:t]
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            self._count()
            if i == 0:
                layers.rms_norm(h, layer.input_layernorm, eps, x, stream=stream)
            else:  # the previous layer's MLP residual add, fused with this layer's input norm
                layers.add_rms_norm(y, h, layer.input_layernorm, eps, x, stream=stream)
            group = layer.qkv
            x_bf16 = self._gemm_input(x, any(p.kind == "fp8" for p in group.parts), stream)
            if t == 1 and group.fused is not None:  # one token: q, k, v are contiguous pieces of one row
                self._linear(group.fused, x, flat[0 : qd + 2 * kd].reshape(1, qd + 2 * kd), x_bf16, stream)
            else:
                for part, out in zip(group.parts, (q, k, v)):
                    self._linear(part, x, out.reshape(t, part.n), x_bf16 if part.kind == "fp8" else None, stream)
            self._count(2)
            layers.rms_norm(q, layer.q_norm, eps, q, stream=stream)
            layers.rms_norm(k, layer.k_norm, eps, k, stream=stream)
            if t == 1:  # q and k of one token: [1, Hq + Hkv, D], contiguous
                self._count()
                qk = flat[0 : qd + kd].reshape(1, hq + hkv, d)
                layers.rope(qk, positions, self.rope_cos_sin, qk, stream=stream)
            else:
                self._count(2)
                layers.rope(q, positions, self.rope_cos_sin, q, stream=stream)
                layers.rope(k, positions, self.rope_cos_sin, k, stream=stream)
            self._count()
            paged_cache_write(k, v, layer_cache.k, layer_cache.v, slots, layer_cache.k_scale, layer_cache.v_scale,
                              stream=stream, check_slots=False)
            attend(q, layer_cache, attn)
            o_in = attn.reshape(t, qd)
            self._linear(layer.o_proj, o_in, y, self._gemm_input(o_in, layer.o_proj.kind == "fp8", stream), stream)
            self._count()
            layers.add_rms_norm(y, h, layer.post_attention_layernorm, eps, x, stream=stream)
            self._linear(layer.gate_up, x, gate_up, self._gemm_input(x, layer.gate_up.kind == "fp8", stream), stream)
            self._count()
            layers.silu_mul(gate_up, act, stream=stream)
            self._linear(layer.down_proj, act, y, self._gemm_input(act, layer.down_proj.kind == "fp8", stream), stream)
        self._count()
        layers.add_rms_norm(y, h, self.norm, eps, x, stream=stream)

    def _splits(self, rows: int, max_len: int, block_size: int) -> int:
        c = self.config
        return splitkv.choose_num_splits(rows, c.num_attention_heads, c.num_key_value_heads, max_len,
                                         splitkv.device_num_sms(), block_size)

    def _workspace(self, rows: int, splits: int):
        """A view of the split-kv workspace for ``rows`` rows and ``splits`` shards (None for one shard)."""
        if splits <= 1:
            return None
        c = self.config
        shape = (rows, c.num_attention_heads, splits, c.head_dim + 2)
        return self.workspace_flat[: int(np.prod(shape))].reshape(shape)

    # -- decode steps

    def _bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _decode_launches(self, bucket: int, cache: DeviceKVCache, stream) -> None:
        """One decode step of ``bucket`` rows, reading only the cache's decode index buffers: what a CUDA
        graph captures. Leaves the logits in ``self.logits[:bucket]``."""
        ids, positions, slots, lens, tables = cache.decode_views(bucket, self.max_num_seqs)
        splits = self._splits(bucket, cache.capacity, cache.block_size)
        workspace = self._workspace(bucket, splits)

        def attend(q, layer_cache, out):
            self._count(1 + (splits > 1))
            splitkv.paged_decode(q, layer_cache.k, layer_cache.v, tables, lens, self.softmax_scale, out,
                                 layer_cache.k_scale, layer_cache.v_scale, num_splits=splits, workspace=workspace,
                                 max_seq_len=cache.capacity, stream=stream)

        self._count()
        layers.embedding(self.embed_tokens, ids, self.h[:bucket], stream=stream)
        self._layers(bucket, positions, slots, cache, attend, stream)
        self._count()
        bf16_linear(self.x[:bucket], self.lm_head, self.logits[:bucket], stream=stream)
        self._count()
        layers.argmax_rows(self.logits[:bucket], self.greedy_ids[:bucket], stream=stream)  # for greedy_tokens

    def _decode_step(self, batch: ForwardBatch, cache: DeviceKVCache, start: float, ids_only: bool = False):
        s, smax = batch.num_seqs, self.max_num_seqs
        bucket = self._bucket(s)
        host = cache.decode_index_host
        host[: 4 * smax] = 0
        host[0:s] = batch.token_ids
        host[smax : smax + s] = batch.positions
        host[2 * smax : 2 * smax + bucket] = -1  # padding rows write no slot
        host[2 * smax : 2 * smax + s] = batch.slot_mapping
        host[3 * smax : 3 * smax + s] = batch.context_lens  # padding rows: length 0, a zero attention row
        tables = host[4 * smax : 4 * smax + bucket * cache.width].reshape(bucket, cache.width)
        tables[...] = 0
        tables[:s, : batch.block_tables.shape[1]] = batch.block_tables
        used = 4 * smax + bucket * cache.width
        stream = self._stream
        _to_device(cache.decode_index[:used], host[:used], stream)
        graph = cache.graphs.get(bucket)
        replay = graph is not None
        if replay:
            graph.launch(self._graph_stream())
            self.stats.graph_replays += 1
        else:
            before = self._launches
            self._decode_launches(bucket, cache, stream)
            self.stats.launches_by_bucket[bucket] = self._launches - before
        if ids_only:
            out = self.greedy_ids_host[:s]
            _to_host(out, self.greedy_ids[:s], stream)
        else:
            out = self.logits_host[:s]
            _to_host(out, self.logits[:s], stream)
        enqueued = time.perf_counter()
        _synchronize(stream)
        done = time.perf_counter()
        self.stats.decode_steps += 1
        self.stats.last_decode_bucket = bucket
        self.stats.decode_host_seconds += enqueued - start
        self.stats.decode_wall_seconds += done - start
        if replay:
            self.stats.replay_host_seconds += enqueued - start
            self.stats.replay_wall_seconds += done - start
        result = np.array(out, dtype=np.int64 if ids_only else np.float32)
        if not replay and self.cuda_graphs:
            self._capture(bucket, cache)
        return result

    def _graph_stream(self):
        """The model's Numba stream as a ``cuda.core`` stream (what ``Graph.launch`` takes)."""
        if self._core_stream is None:
            from cuda.core import Stream

            self._core_stream = Stream.from_handle(int(self._stream))  # a Numba stream's int is its CUstream
        return self._core_stream

    def _capture(self, bucket: int, cache: DeviceKVCache) -> None:
        """Capture ``_decode_launches(bucket)`` into a CUDA graph (after an eager run of it compiled and
        warmed every kernel). A failure turns graphs off for this model, with a warning."""
        from cuda.core import Device

        begin = time.perf_counter()
        device = Device()
        device.set_current()
        builder = device.create_graph_builder()
        builder.begin_building()
        try:
            self._decode_launches(bucket, cache, builder)
        except Exception as e:
            try:
                builder.end_building()
            except Exception:
                pass
            self.cuda_graphs = False
            self.stats.graph_error = f"{type(e).__name__}: {e}"
            warnings.warn(f"CudaQwen3Model: CUDA graph capture of the decode step failed, running eagerly: {e}")
            return
        graph = builder.end_building().complete()
        graph.upload(self._graph_stream())  # the first replay then launches at once
        cache.graphs[bucket] = graph
        self.stats.graphs_captured += 1
        self.stats.capture_seconds += time.perf_counter() - begin

    # -- prefill (and any batch that is not a pure decode step): eager

    def _prefill(self, batch: ForwardBatch, cache: DeviceKVCache, all_logits: bool) -> np.ndarray:
        t, s, smax, tmax = len(batch.token_ids), batch.num_seqs, self.max_num_seqs, self.max_num_tokens
        width = batch.block_tables.shape[1]
        host = cache.eager_index_host
        host[0:t] = batch.token_ids
        host[tmax : tmax + t] = batch.positions
        host[2 * tmax : 2 * tmax + t] = batch.slot_mapping
        base = 3 * tmax
        host[base : base + s] = batch.context_lens
        host[base + smax : base + smax + s] = batch.query_lens
        tables_at = base + 2 * smax
        host[tables_at : tables_at + s * width] = batch.block_tables.reshape(-1)
        used = tables_at + s * width
        stream = self._stream
        _to_device(cache.eager_index[:used], host[:used], stream)
        d = cache.eager_index
        ids, positions, slots = d[0:t], d[tmax : tmax + t], d[2 * tmax : 2 * tmax + t]
        context_lens, query_lens = d[base : base + s], d[base + smax : base + smax + s]
        tables = d[tables_at : tables_at + s * width].reshape(s, width)
        max_context = int(np.max(batch.context_lens))
        rows = PrefillRows(cache.prefill_rows[0][: t * width].reshape(t, width), cache.prefill_rows[1][:t])
        workspace = self._workspace(t, self._splits(t, max_context, cache.block_size))

        def attend(q, layer_cache, out):
            self._count(2 + (workspace is not None))
            paged_prefill(q, layer_cache.k, layer_cache.v, tables, context_lens, query_lens, self.softmax_scale, out,
                          layer_cache.k_scale, layer_cache.v_scale, max_context_len=max_context, rows=rows,
                          workspace=workspace, stream=stream)

        self._count()
        layers.embedding(self.embed_tokens, ids, self.h[:t], stream=stream)
        self._layers(t, positions, slots, cache, attend, stream)
        if all_logits:
            logits = np.empty((t, self.config.vocab_size), np.float32)
            for first in range(0, t, smax):
                n = min(smax, t - first)
                self._count()
                bf16_linear(self.x[first : first + n], self.lm_head, self.logits[:n], stream=stream)
                _to_host(self.logits_host[:n], self.logits[:n], stream)
                _synchronize(stream)
                logits[first : first + n] = self.logits_host[:n]
            return logits
        for i, row in enumerate(batch.last_token_rows):
            _device_copy(self.selected[i : i + 1], self.x[int(row) : int(row) + 1], stream)
        self._count()
        bf16_linear(self.selected[:s], self.lm_head, self.logits[:s], stream=stream)
        _to_host(self.logits_host[:s], self.logits[:s], stream)
        _synchronize(stream)
        return np.array(self.logits_host[:s], dtype=np.float32)
