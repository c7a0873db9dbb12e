"""Named Qwen3 shapes, seeded random FP8 checkpoints of them, and the bytes a decode step reads.

Shapes (``SHAPES``; ``shape_config(name)``), all FP8 with Qwen3-FP8's ``quantization_config``
(E4M3, ``weight_block_size`` [128, 128]; embeddings, norms and ``lm_head`` BF16):

============  ======  ============  ======  =======  ========  ========  ======  ====
name          hidden  intermediate  layers  q heads  kv heads  head_dim  vocab   tied
============  ======  ============  ======  =======  ========  ========  ======  ====
tiny          256     768           4       4        2         64        1024    yes
qwen3-0.6b    1024    3072          28      16       8         128       151936  yes
qwen3-8b      4096    12288         36      32       8         128       151936  no
============  ======  ============  ======  =======  ========  ========  ======  ====

``qwen3-0.6b`` and ``qwen3-8b`` are the architectures of Hugging Face's ``Qwen/Qwen3-0.6B(-FP8)``
and ``Qwen/Qwen3-8B(-FP8)`` ``config.json`` (rope_theta 1e6, rms_norm_eps 1e-6,
max_position_embeddings 40960); ``tiny`` is ``fp8lab.engine.tiny.tiny_config(fp8=True)``. One more
shape, ``test-mini`` (``TEST_SHAPES``: 2 layers, hidden 320, intermediate 704, untied), exists for
the CPU tests: its projections have partial 128 x 128 edge blocks and its checkpoint is 4 MB.

**Random FP8 weights** (``random_tensor``; ``random_checkpoint`` in memory, ``make_random`` on
disk). Quantizing 7 billion random floats with ``fp8lab.reference.blockwise.quantize`` would take about
half an hour of NumPy, so the codes are drawn directly: every code of a projection is an
independent draw from the distribution of ``encode(x)`` for ``x ~ N(0, (448 / AMAX_OVER_STD)^2)``,
i.e. of the codes of a normal weight block whose absolute maximum is ``AMAX_OVER_STD`` standard
deviations (a 128 x 128 block of normals has its maximum near 4 std) after scaling that maximum
to 448. Sampling is a lookup of a random 16-bit number in a 65536-entry table (``code_table``), so
codes with a probability below 2^-16 (zero and the smallest subnormals) do not occur; NaN codes
never do. Each block's ``weight_scale_inv`` is ``WEIGHT_STD * AMAX_OVER_STD / 448`` times a random
factor ``exp(SCALE_JITTER * N(0, 1))``, so the dequantized weights have a standard deviation of
about ``WEIGHT_STD`` = 0.02 (transformers' ``initializer_range``). Embeddings and ``lm_head`` are
BF16 ``N(0, 0.02^2)``, drawn the same way through a table of 65536 normal quantiles
(``normal_bf16_table``); norms are ones. These are *random FP8 weights*, which is
what a speed benchmark needs; the model says nothing sensible, and the random stream is stable
under changes of the layer count and the thread count: each tensor's numbers come from
``default_rng([seed, crc32(name), chunk])`` per chunk of ``CHUNK_ELEMENTS``.

**Tokenizer.** A random checkpoint carries the tiny model's tokenizer (``fp8lab.engine.tiny``: 1024 ids,
``<|endoftext|>`` 1019, ``<|im_end|>`` 1021; ``config.json``'s ``bos/eos_token_id`` and
``generation_config.json`` name those ids). For the real shapes the model's vocabulary (151936)
is far larger than the tokenizer's, as it is slightly larger in Qwen's own checkpoints (151669
tokenizer ids): prompts of text work, and ``fp8lab.engine.generate`` never generates an id the tokenizer
cannot decode (it masks the padding ids before sampling, as for Qwen's own padded vocabulary).
Benchmarks feed random token ids and never decode (``bench/engine.py``).

**Bytes per decode step** (``decode_bytes_per_step``): what one decode step of a batch must read
from memory at least, the numerator of the bandwidth roofline: every projection weight (FP8
codes, one byte each) and its F32 scales, the BF16 ``lm_head`` (the embedding matrix when tied),
the BF16 norms, one BF16 embedding row per sequence, and each sequence's K and V cache up to its
context length (FP8: one byte per element plus an F32 scale per token and kv head; BF16: two
bytes per element). Writes (the new K/V, activations) are left out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fp8lab.reference import e4m3
from fp8lab.reference.kv_cache import kv_cache_format

from .checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SAFETENSORS_METADATA,
    WEIGHTS_FILE,
    WRITE_DTYPES,
    Checkpoint,
    build_atomically,
    write_json,
)
from .config import FP8QuantConfig, Qwen3Config
from .layout import expected_tensors
from .safetensors_io import (
    STORAGE_DTYPES,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    header_bytes,
)
from .tiny import (
    TOKEN_IDS,
    generation_config,
    tiny_config,
    tokenizer_config,
    train_tokenizer,
)
from .tokenizer import ENDOFTEXT, IM_END

BLOCK = (128, 128)
"""Qwen3-FP8's ``weight_block_size``."""
WEIGHT_STD = 0.02
EMBED_STD = 0.02
AMAX_OVER_STD = 4.0
SCALE_JITTER = 0.05
CHUNK_ELEMENTS = 1 << 22
"""Elements per independently seeded chunk of a tensor (the unit of work of the thread pool)."""
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000
"""transformers' default shard size ("5GB")."""


def _qwen3(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied, max_position=40960) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=max_position,
        tie_word_embeddings=tied,
        bos_token_id=TOKEN_IDS[ENDOFTEXT],
        eos_token_id=TOKEN_IDS[IM_END],
        torch_dtype="bfloat16",
        quantization=FP8QuantConfig(weight_block_size=BLOCK),
    )


def _shapes() -> dict[str, Qwen3Config]:
    return {
        "tiny": tiny_config(fp8=True),
        "qwen3-0.6b": _qwen3(151936, 1024, 3072, 28, 16, 8, 128, tied=True),
        "qwen3-8b": _qwen3(151936, 4096, 12288, 36, 32, 8, 128, tied=False),
    }


SHAPES: dict[str, Qwen3Config] = _shapes()
"""The public shapes, by name (see the module docstring)."""
TEST_SHAPES: dict[str, Qwen3Config] = {
    "test-mini": _qwen3(1536, 320, 704, 2, 4, 2, 64, tied=False, max_position=4096),
}
"""Shapes for the CPU tests (accepted everywhere, not listed in help texts)."""


def shape_names(include_test: bool = False) -> list[str]:
    return list(SHAPES) + (list(TEST_SHAPES) if include_test else [])


def shape_config(name: str, num_hidden_layers: int | None = None) -> Qwen3Config:
    """The ``Qwen3Config`` of a named shape; ``num_hidden_layers`` overrides the layer count
    (a quick benchmark of a big shape with a few layers)."""
    config = SHAPES.get(name) or TEST_SHAPES.get(name)
    if config is None:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(shape_names())}")
    if num_hidden_layers is not None:
        if int(num_hidden_layers) <= 0:
            raise ValueError(f"num_hidden_layers: expected a positive number of layers, got {num_hidden_layers}")
        config = dataclasses.replace(config, num_hidden_layers=int(num_hidden_layers))
    return config


def parameter_counts(config: Qwen3Config) -> dict[str, int]:
    """Parameters by role: ``embedding``, ``lm_head`` (0 when tied), ``layers`` (projections and
    norms of all layers, what model cards call non-embedding parameters with the final norm) and ``total``."""
    counts = {"embedding": 0, "lm_head": 0, "layers": 0}
    for name, spec in expected_tensors(config).items():
        if spec.kind == "scale":
            continue
        role = {"model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}.get(name, "layers")
        counts[role] += math.prod(spec.shape)
    counts["total"] = sum(counts.values())
    return counts


# ----------------------------------------------------------------------------------------------
# Bytes per decode step (the roofline)


"""Per (token, kv head) scale bytes, for K and for V each."""


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step reads, by source (see the module docstring)."""

    weights: int
    """Projection weights: FP8 codes (BF16 for projections left unquantized)."""
    scales: int
    """``weight_scale_inv``, F32."""
    lm_head: int
    """The BF16 ``lm_head`` (the embedding matrix when tied), read whole every step."""
    norms: int
    embedding_rows: int
    """One BF16 embedding row per sequence."""
    kv_cache: float
    """K and V of every sequence up to its context length (a float: the context may be an average)."""

    @property
    def total(self) -> float:
        return self.weights + self.scales + self.lm_head + self.norms + self.embedding_rows + self.kv_cache


def kv_bytes_per_token(config: Qwen3Config, kv_format="fp8") -> int:
    """Cache bytes of one token in all layers (a kernel's cache): K and V of every kv head, plus their scales."""
    c = config
    per_head = 2 * kv_cache_format(kv_format).vector_bytes(c.head_dim)
    return c.num_hidden_layers * c.num_key_value_heads * per_head


def decode_bytes_per_step(config: Qwen3Config, batch: int, context_len: float, kv_format="fp8",
                          scale_bytes: int = 4, float_bytes: int = 2) -> DecodeBytes:  # fmt: skip
    """Bytes a decode step of ``batch`` sequences of ``context_len`` cached tokens each (new token
    included; a float for an average over steps) reads at least."""
    weights = scales = lm_head = norms = 0
    lm_head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for name, spec in expected_tensors(config).items():
        n = math.prod(spec.shape)
        if name == lm_head_name:
            lm_head += n * float_bytes
        elif name == "model.embed_tokens.weight":
            pass  # untied: only the rows of the batch's tokens, below
        elif spec.kind == "fp8":
            weights += n
        elif spec.kind == "scale":
            scales += n * scale_bytes
        elif name.endswith("norm.weight"):
            norms += n * float_bytes
        else:  # a projection left in BF16
            weights += n * float_bytes
    return DecodeBytes(
        weights=weights,
        scales=scales,
        lm_head=lm_head,
        norms=norms,
        embedding_rows=batch * config.hidden_size * float_bytes,
        kv_cache=batch * context_len * kv_bytes_per_token(config, kv_format),
    )


# ----------------------------------------------------------------------------------------------
# Random tensors


def code_table(amax_over_std: float = AMAX_OVER_STD, bits: int = 16) -> np.ndarray:
    """``uint8[2**bits]``: E4M3 codes laid out by their probability under ``encode(x)``,
    ``x ~ N(0, (448 / amax_over_std)^2)`` (saturating); indexing it with uniform random
    ``bits``-bit numbers samples that distribution. Never holds a NaN code."""
    sigma = e4m3.MAX / amax_over_std
    magnitudes = e4m3.VALUES[: e4m3.MAX_CODE + 1].astype(np.float64)  # codes 0x00..0x7E, increasing
    edges = np.concatenate([[0.0], (magnitudes[:-1] + magnitudes[1:]) / 2, [np.inf]])
    cdf_abs = np.array([math.erf(e / (sigma * math.sqrt(2))) if np.isfinite(e) else 1.0 for e in edges])
    p_magnitude = np.diff(cdf_abs)  # P(|x| rounds to each magnitude)
    p = np.zeros(256)
    p[: e4m3.MAX_CODE + 1] = p_magnitude / 2  # positive codes
    p[0x80 : 0x80 + e4m3.MAX_CODE + 1] = p_magnitude / 2  # negative codes (0x80 is -0)
    cdf = np.cumsum(p) / p.sum()
    u = (np.arange(1 << bits) + 0.5) / (1 << bits)
    table = np.minimum(np.searchsorted(cdf, u, side="right"), 0x80 + e4m3.MAX_CODE).astype(np.uint8)
    assert not e4m3.is_nan(table).any()
    return table


_CODE_TABLE = code_table()


@functools.lru_cache(maxsize=8)
def _specs(config: Qwen3Config):
    return expected_tensors(config)


def _stored_dtype(config: Qwen3Config, name: str) -> str:
    return WRITE_DTYPES[_specs(config)[name].kind]


def _pool_map(pool: ThreadPoolExecutor | None, fn, items) -> None:
    if pool is None:
        for item in items:
            fn(item)
    else:
        list(pool.map(fn, items))


def _fill_chunks(out: np.ndarray, key: list[int], draw, pool) -> np.ndarray:
    """Fill ``out`` (flat view) chunk by chunk: ``draw(rng, count)`` with a per-chunk generator."""
    flat = out.reshape(-1)
    chunks = range(-(-flat.size // CHUNK_ELEMENTS))

    def job(i):
        lo, hi = i * CHUNK_ELEMENTS, min(flat.size, (i + 1) * CHUNK_ELEMENTS)
        flat[lo:hi] = draw(np.random.default_rng(key + [i]), hi - lo)

    _pool_map(pool, job, chunks)
    return out


def _draw_codes(rng, count):
    return _CODE_TABLE[rng.integers(0, 1 << 16, count, dtype=np.uint16)]


@functools.cache
def normal_bf16_table(std: float, bits: int = 16) -> np.ndarray:
    """``uint16[2**bits]``: BF16 bit patterns of the ``(i + 0.5) / 2**bits`` quantiles of
    ``N(0, std^2)``; indexing it with uniform random ``bits``-bit numbers samples a normal
    (cut at about 4.2 std), six times faster than ``standard_normal``."""
    dist = statistics.NormalDist(0.0, std)
    quantiles = np.array([dist.inv_cdf((i + 0.5) / (1 << bits)) for i in range(1 << bits)], dtype=np.float32)
    return float32_to_bf16_bits(quantiles)


def _draw_bf16(std, as_float32: bool):
    table = normal_bf16_table(float(std))
    if as_float32:
        table = bf16_bits_to_float32(table)

    def draw(rng, count):
        return table[rng.integers(0, 1 << 16, count, dtype=np.uint16)]

    return draw


def random_tensor(config: Qwen3Config, name: str, seed: int = 0, pool: ThreadPoolExecutor | None = None,
                  engine_form: bool = False) -> np.ndarray:  # fmt: skip
    """Tensor ``name`` of a random checkpoint for ``config``, in its *storage* form: uint8 E4M3
    codes (F8_E4M3), float32 (F32 scales) or uint16 BF16 bit patterns (BF16); with
    ``engine_form``, BF16 tensors come as the float32 values ``fp8lab.engine.checkpoint`` would load
    (the same numbers). See the module docstring for the distributions. ``pool`` spreads the
    chunks over threads (same numbers whatever the number of threads)."""
    spec = _specs(config)[name]
    key = [int(seed), zlib.crc32(name.encode())]
    dtype = WRITE_DTYPES[spec.kind]
    as_float32 = engine_form and dtype == "BF16"
    out = np.empty(spec.shape, np.float32 if as_float32 else STORAGE_DTYPES[dtype].newbyteorder("="))
    if spec.kind == "fp8":
        return _fill_chunks(out, key, _draw_codes, pool)
    if spec.kind == "scale":
        rng = np.random.default_rng(key)
        base = WEIGHT_STD * AMAX_OVER_STD / e4m3.MAX
        out[...] = (base * np.exp(SCALE_JITTER * rng.standard_normal(spec.shape))).astype(np.float32)
        return out
    if name.endswith("norm.weight"):
        out[...] = 1.0 if as_float32 else 0x3F80  # 0x3F80 is BF16 1.0
        return out
    std = EMBED_STD if name in ("model.embed_tokens.weight", "lm_head.weight") else WEIGHT_STD
    return _fill_chunks(out, key, _draw_bf16(std, as_float32), pool)


def _threads(threads: int | None) -> int:
    return max(1, int(threads) if threads else min(32, os.cpu_count() or 1))


def _progress(items, progress: bool, desc: str):
    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, disable=not progress, leave=False)


def iter_random_tensors(config: Qwen3Config, seed: int = 0, threads: int | None = None, progress: bool = False,
                        engine_form: bool = False) -> Iterator[tuple[str, str, np.ndarray]]:  # fmt: skip
    """``(name, stored dtype, array)`` for every tensor of ``config`` (``random_tensor``), in
    ``expected_tensors`` order, one at a time, generated on ``threads`` threads."""
    names = list(_specs(config))
    with ThreadPoolExecutor(_threads(threads)) as pool:
        for name in _progress(names, progress, "random tensors"):
            yield name, _stored_dtype(config, name), random_tensor(config, name, seed, pool, engine_form)


def random_checkpoint(shape: str | Qwen3Config, seed: int = 0, num_hidden_layers: int | None = None,
                      threads: int | None = None, progress: bool = False) -> Checkpoint:  # fmt: skip
    """A random checkpoint in memory, as ``fp8lab.engine.checkpoint.load_checkpoint`` would return the
    one ``make_random`` writes with the same arguments (nothing touches the disk)."""
    config = shape_config(shape, num_hidden_layers) if isinstance(shape, str) else shape
    if config.quantization is None:
        raise ValueError("random checkpoints are FP8: the config needs a quantization_config")
    tensors, dtypes = {}, {}
    for name, dtype, array in iter_random_tensors(config, seed, threads, progress, engine_form=True):
        tensors[name], dtypes[name] = array, dtype
    label = shape if isinstance(shape, str) else "config"
    return Checkpoint(Path(f"<random {label} seed {seed}>"), config, tensors, dtypes, generation_config())


# ----------------------------------------------------------------------------------------------
# Writing a random checkpoint folder


def _shards(config: Qwen3Config, max_shard_bytes: int) -> list[list[tuple[str, str, tuple, int]]]:
    """Tensors ``(name, dtype, shape, nbytes)`` grouped into shards of at most ``max_shard_bytes``
    (a larger tensor gets a shard of its own), in ``expected_tensors`` order."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list] = [[]]
    used = 0
    for name, spec in _specs(config).items():
        dtype = WRITE_DTYPES[spec.kind]
        nbytes = math.prod(spec.shape) * STORAGE_DTYPES[dtype].itemsize
        if groups[-1] and used + nbytes > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, dtype, spec.shape, nbytes))
        used += nbytes
    return groups


def write_random(folder: Path, config: Qwen3Config, seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 threads: int | None = None, progress: bool = False) -> None:  # fmt: skip
    """Write a random checkpoint's files into an existing empty ``folder``, one tensor in memory at a time;
    the tokenizer files are the tiny model's (``fp8lab.engine.tiny``)."""
    write_json(folder / CONFIG_FILE, config.to_dict())
    groups = _shards(config, max_shard_bytes)
    files = [WEIGHTS_FILE] if len(groups) == 1 else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    with ThreadPoolExecutor(_threads(threads)) as pool:
        bar = _progress(range(sum(len(g) for g in groups)), progress, f"writing {folder.name}")
        for file, group in zip(files, groups):
            with open(folder / file, "wb") as f:
                f.write(header_bytes(group, SAFETENSORS_METADATA))
                for name, dtype, shape, nbytes in group:
                    raw = random_tensor(config, name, seed, pool)
                    assert raw.nbytes == nbytes and raw.flags.c_contiguous
                    f.write(memoryview(raw.astype(STORAGE_DTYPES[dtype], copy=False)).cast("B"))
                    bar.update(1)
        bar.close()
    if len(groups) > 1:
        weight_map = {name: file for file, group in zip(files, groups) for name, *_ in group}
        total = sum(entry[3] for group in groups for entry in group)
        write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(folder / GENERATION_CONFIG_FILE, generation_config())
    tokenizer_json = json.loads(train_tokenizer().to_str())
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    write_json(folder / "tokenizer_config.json", tokenizer_config())


def make_random(dst, shape: str, seed: int = 0, num_hidden_layers: int | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, threads: int | None = None,
                progress: bool = False) -> Path:  # fmt: skip
    """Write a random FP8 checkpoint of a named shape to ``dst`` (which must not exist, or be
    empty): ``config.json``, safetensors shards (``model.safetensors`` when one shard is enough,
    else ``model-0000i-of-0000n.safetensors`` plus the index), ``generation_config.json`` and the
    tiny tokenizer. The folder appears only once complete; returns ``dst``.
    Qwen3-8B: about 9.5 GB, written in well under a minute on a machine with a few cores."""
    config = shape_config(shape, num_hidden_layers)
    return build_atomically(dst, lambda tmp: write_random(tmp, config, seed, max_shard_bytes, threads, progress))
