"""The demo model: a small Qwen3 trained on Python's documentation and source, fp8lab's default model.

What ships in the package (``fp8lab/engine/data/demo/``, the Hugging Face layout): the BF16 checkpoint
(``config.json``, two safetensors shards and their index, ``generation_config.json``) and its
tokenizer (``tokenizer.json``, ``tokenizer_config.json``); beside it ``fp8lab/engine/data/demo_heldout.txt``,
the held-out documents of its corpus, the default text of ``fp8lab eval``. ``tools/train_demo.py``
trained it (on an H200, with torch: see ``bench/RESULTS.md`` and ``docs/08_accuracy.md``) from the
corpus of ``tools/demo_corpus.py`` and the tokenizer of ``train_tokenizer``.

The architecture (``demo_config``) is Qwen3's: q/k-norm, GQA (6 query heads, 3 KV heads of
head_dim 64), NeoX RoPE, SwiGLU, tied embeddings (as Qwen3-0.6B). hidden 384, intermediate 1024,
6 layers, vocabulary 4096 (4091 learned byte-level BPE tokens + Qwen's 5 added ones):
about 11.3 M parameters, 22.6 MB in BF16. The K/V projections have ``3 * 64 = 192`` rows, so
their 128 x 128 FP8 blocks end in a partial block of 64 rows; every K is a multiple of 128, as
the GPU kernels need. It was trained on 512-token windows, so ``max_position_embeddings`` is 512.

``default_model_dir(fp8)``: the shipped BF16 folder, or (``fp8=True``, what ``fp8lab generate``
runs) its FP8 blockwise version made by ``fp8lab.engine.checkpoint.quantize_checkpoint`` on first use into
the cache folder (``fp8lab.engine.tiny.cache_root``), exactly what ``fp8lab quantize`` writes (plus the
cache's file-size record, ``fp8lab.engine.tiny.CACHE_MANIFEST``, that detects a damaged folder).
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import quantize_checkpoint
from .config import Qwen3Config
from .tiny import (
    added_token_ids,
    cache_root,
    cached_build,
    generation_config,
    tokenizer_config,
    train_byte_level_bpe,
    write_tokenizer_files,  # fmt: skip
)
from .tokenizer import ENDOFTEXT, IM_END

DEMO_DIR = Path(__file__).parent / "data" / "demo"
"""The shipped BF16 checkpoint and tokenizer."""
HELDOUT_TEXT = Path(__file__).parent / "data" / "demo_heldout.txt"
"""The held-out documents of the demo corpus (``tools/demo_corpus.py``), joined by ``<|endoftext|>``."""
RECIPE_VERSION = "1"
"""Part of the FP8 cache folder's name: change it whenever the shipped checkpoint changes."""
LEARNED_TOKENS = 4091
TOKEN_IDS = added_token_ids(LEARNED_TOKENS)
"""``<|endoftext|>`` 4091, ``<|im_start|>`` 4092, ``<|im_end|>`` 4093, ``<think>`` 4094, ``</think>`` 4095."""
VOCAB_SIZE = 4096
CONTEXT = 512
"""Training window, and ``max_position_embeddings``."""


def demo_config() -> Qwen3Config:
    """The demo model's architecture (see the module docstring); BF16, no quantization_config."""
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=TOKEN_IDS[ENDOFTEXT],
        eos_token_id=TOKEN_IDS[IM_END],
        torch_dtype="bfloat16",
    )


def train_tokenizer(train_text: Path):
    """The demo tokenizer: byte-level BPE with ``LEARNED_TOKENS`` tokens learned from the training split."""
    return train_byte_level_bpe([train_text], LEARNED_TOKENS)


SHARD_BYTES = 14 * 2**20
"""Shards of at most 14 MiB: small enough to pass every file-size limit on the way into the repository."""


def save_demo_checkpoint(folder: Path, tensors: dict, tokenizer) -> Path:
    """Write the demo checkpoint (``demo_config``, BF16 ``tensors`` under Qwen3's names, sharded), its
    ``generation_config.json`` and its tokenizer files into ``folder``."""
    from .checkpoint import save_checkpoint

    save_checkpoint(folder, demo_config(), tensors, generation_config=generation_config(TOKEN_IDS),
                    max_shard_bytes=SHARD_BYTES)
    write_tokenizer_files(folder, tokenizer, tokenizer_config(TOKEN_IDS, model_max_length=CONTEXT))
    return folder


def default_model_dir(fp8: bool = True) -> Path:
    """The shipped BF16 demo checkpoint, or its FP8 version ``<cache>/demo-qwen3-fp8-v1``, quantized on
    first use and rebuilt when damaged (``fp8lab.engine.tiny.cached_build``)."""
    if not fp8:
        return DEMO_DIR
    final = cache_root() / f"demo-qwen3-fp8-v{RECIPE_VERSION}"
    # quantize_checkpoint accepts the empty temporary folder cached_build hands it as its DST.
    return cached_build(final, lambda tmp: quantize_checkpoint(DEMO_DIR, tmp, progress=False))
