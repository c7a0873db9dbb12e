"""A tiny, seeded, random Qwen3 checkpoint: the engine's built-in default model and test fixture.

``make_tiny(dst, fp8, seed)`` writes a complete Hugging Face checkpoint folder:

- ``config.json``: ``tiny_config(fp8)``, with Qwen3's field names (transformers'
  ``Qwen3ForCausalLM`` loads the BF16 variant);
- ``model.safetensors``: random weights under Qwen3's exact tensor names, BF16; with ``fp8=True``
  the same BF16 weights quantized by ``fp8lab.engine.checkpoint.quantize_tensors``, so the FP8 tiny model
  is byte for byte ``quantize_checkpoint`` of the BF16 one with the same seed;
- ``tokenizer.json``: a byte-level BPE with Qwen's normalizer (NFC) and pre-tokenizer regex,
  trained by ``tokenizers`` on ``fp8lab/engine/data/tiny_corpus.txt`` (prose written for fp8lab), 1019
  learned tokens plus Qwen's added tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``
  (special) and ``<think>``, ``</think>`` (ordinary added tokens, as in Qwen3) at ids 1019..1023;
- ``tokenizer_config.json`` (Qwen2Tokenizer, ChatML ``chat_template``) and ``generation_config.json``.

Everything is deterministic: the same ``seed`` gives the same bytes on every run.

The dimensions (``tiny_config``): vocab 1024, hidden 256, intermediate 768, 4 layers, 4 query
heads and 2 KV heads of head_dim 64 (GQA 2:1), tied embeddings (as Qwen3-0.6B..4B). Every
projection's N and K (256, 128, 768) is a multiple of 128, so the FP8 variant has only full
128 x 128 blocks, as real Qwen3-FP8 checkpoints do. About 3.4 M parameters: a 6.5 MiB
BF16 file, 3.5 MiB as FP8.

Random weights: embeddings normal with std 0.05, projections std 0.1, norms ``1 + 0.1 * normal``.
With these the attention and MLP outputs dominate the residual stream (the embedding alone
would make a tied model predict its own input token forever; with projections of std 0.05
greedy decoding still fell into runs of one token), so greedy decoding wanders through varied
tokens, with last-position logits of std about 0.8; the text is gibberish, as from any random model.

``default_model_dir(fp8)`` builds the model once into a cache folder and reuses it; ``cached_build``
checks the folder against the file sizes recorded when it was built and rebuilds a damaged one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import numpy as np

from fp8lab.reference.dense import round_to_bf16

from .checkpoint import build_atomically, quantize_tensors, save_checkpoint
from .config import FP8QuantConfig, Qwen3Config
from .layout import expected_tensors
from .tokenizer import ENDOFTEXT, IM_END, IM_START, THINK_CLOSE, THINK_OPEN

RECIPE_VERSION = "1"
"""Part of the cache folder name: change it whenever the recipe (weights, tokenizer, corpus) changes."""
CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"
LEARNED_TOKENS = 1019
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS = (THINK_OPEN, THINK_CLOSE)
TOKEN_IDS = {t: LEARNED_TOKENS + i for i, t in enumerate(SPECIAL_TOKENS + ADDED_TOKENS)}  # = added_token_ids(1019)
"""``<|endoftext|>`` 1019, ``<|im_start|>`` 1020, ``<|im_end|>`` 1021, ``<think>`` 1022, ``</think>`` 1023."""
VOCAB_SIZE = 1024
EMBED_STD = 0.05
PROJ_STD = 0.1
NORM_STD = 0.1

QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The pre-tokenizer split of Qwen2/Qwen3's tokenizer.json: words, single digits, punctuation runs."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
"""Jinja twin of ``Tokenizer.apply_chat_template`` (for transformers' ``apply_chat_template``):
Qwen3's ChatML without tools."""


def tiny_config(fp8: bool) -> Qwen3Config:
    """The tiny model's architecture (see the module docstring); ``fp8`` adds Qwen3-FP8's
    ``quantization_config`` with 128 x 128 blocks."""
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=TOKEN_IDS[ENDOFTEXT],
        eos_token_id=TOKEN_IDS[IM_END],
        torch_dtype="bfloat16",
        quantization=FP8QuantConfig(weight_block_size=(128, 128)) if fp8 else None,
    )


def added_token_ids(learned_tokens: int) -> dict[str, int]:
    """Ids of Qwen's added tokens after ``learned_tokens`` learned ones (``TOKEN_IDS`` for the tiny model)."""
    return {t: learned_tokens + i for i, t in enumerate(SPECIAL_TOKENS + ADDED_TOKENS)}


def generation_config(token_ids: dict[str, int] = TOKEN_IDS) -> dict:
    """Stop at ``<|im_end|>`` or ``<|endoftext|>``, as Qwen3's generation_config.json does; no
    sampling defaults, so greedy decoding is the default."""
    return {
        "bos_token_id": token_ids[ENDOFTEXT],
        "eos_token_id": [token_ids[IM_END], token_ids[ENDOFTEXT]],
        "pad_token_id": token_ids[ENDOFTEXT],
    }


def random_bf16_tensors(config: Qwen3Config, seed: int) -> dict[str, np.ndarray]:
    """Seeded random weights for ``config`` (BF16 layout), rounded to BF16 so that what is
    stored is exactly what is returned. Drawn in ``expected_tensors`` order from one generator."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, spec in expected_tensors(config).items():
        if name.endswith("norm.weight"):
            values = 1.0 + NORM_STD * rng.standard_normal(spec.shape, dtype=np.float32)
        else:
            std = EMBED_STD if name == "model.embed_tokens.weight" else PROJ_STD
            values = std * rng.standard_normal(spec.shape, dtype=np.float32)
        tensors[name] = round_to_bf16(values.astype(np.float32))
    return tensors


def train_tokenizer():
    """The tiny model's byte-level BPE, trained on ``CORPUS`` (a ``tokenizers.Tokenizer``)."""
    return train_byte_level_bpe([CORPUS], LEARNED_TOKENS)


def train_byte_level_bpe(files, learned_tokens: int):
    """A byte-level BPE as Qwen3's (NFC normalizer, Qwen's split regex) with ``learned_tokens`` tokens
    learned from ``files``, followed by Qwen's added tokens (``TOKEN_IDS`` shifted to start at
    ``learned_tokens``): a ``tokenizers.Tokenizer``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=learned_tokens,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    if tok.get_vocab_size() != learned_tokens:
        raise RuntimeError(f"{files}: BPE training learned {tok.get_vocab_size()} tokens, expected {learned_tokens}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    for i, token in enumerate(SPECIAL_TOKENS + ADDED_TOKENS):
        assert tok.token_to_id(token) == learned_tokens + i, (token, tok.token_to_id(token))
    return tok


def tokenizer_config(token_ids: dict[str, int] = TOKEN_IDS, model_max_length: int = 4096) -> dict:
    """``tokenizer_config.json`` as Qwen3 writes it, cut to what the tiny tokenizer has."""
    added = {
        str(token_ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": t in SPECIAL_TOKENS}  # fmt: skip
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tiny(folder: Path, fp8: bool, seed: int) -> None:
    """Write the tiny checkpoint's files into an existing (empty) ``folder``."""
    config = tiny_config(fp8=False)
    tensors = random_bf16_tensors(config, seed)
    stored_dtypes = None
    if fp8:
        config, tensors, stored_dtypes = quantize_tensors(config, tensors, block=(128, 128))
    save_checkpoint(folder, config, tensors, stored_dtypes, generation_config=generation_config())
    write_tokenizer_files(folder, train_tokenizer(), tokenizer_config())


def write_tokenizer_files(folder: Path, tokenizer, tokenizer_config: dict) -> None:
    """``tokenizer.json`` (a ``tokenizers.Tokenizer``) and ``tokenizer_config.json`` into ``folder``."""
    # Re-serialised with json (pretty, UTF-8, like Qwen's file) so the bytes do not depend on tokenizers' printer.
    tokenizer_json = json.loads(tokenizer.to_str())
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")


def make_tiny(dst, fp8: bool = False, seed: int = 0) -> Path:
    """Write the tiny checkpoint to ``dst`` (which must not exist, or be empty); returns ``dst``.
    The folder appears only once complete."""
    return build_atomically(dst, lambda tmp: write_tiny(tmp, fp8, seed))


def cache_root() -> Path:
    """``$FP8LAB_CACHE``, or ``~/.cache/fp8lab``."""
    env = os.environ.get("FP8LAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp8lab"


# ----------------------------------------------------------------------------------------------
# The model cache: folders built once, checked cheaply on every use, rebuilt when damaged

CACHE_MANIFEST = ".fp8lab-cache.json"
"""Written last into a cache folder: the size of every file in it. A folder without it, or whose
files no longer have those sizes (a truncated or deleted ``model.safetensors``), is damaged."""


def write_cache_manifest(folder: Path) -> None:
    """Record the name and size of every file of ``folder`` in its ``CACHE_MANIFEST``."""
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / CACHE_MANIFEST).write_text(json.dumps({"files": sizes}, indent=2) + "\n", encoding="utf-8")


def cache_damage(folder: Path) -> str | None:
    """Why the cache ``folder`` cannot be used, or ``None`` when it is complete. Costs a stat per
    file: sizes catch truncated and deleted files (not bit flips, which the loader reports)."""
    try:
        sizes = json.loads((folder / CACHE_MANIFEST).read_text(encoding="utf-8"))["files"]
        for name, size in sizes.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} has {path.stat().st_size} bytes, {size} when built"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"no readable {CACHE_MANIFEST}: built by an older fp8lab, or edited"
    return None


def _discard(folder: Path, reason: str) -> None:
    """Move a damaged cache folder out of the way (one rename, so another process sees either the
    damaged folder or none) and delete it; say which folder to delete by hand if that fails."""
    warnings.warn(f"{folder}: damaged model cache ({reason}); rebuilding it")
    trash = folder.with_name(f".{folder.name}.damaged-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return  # another process moved it first
    except OSError as e:
        raise OSError(f"{folder}: damaged model cache ({reason}) that cannot be removed ({e}); delete this folder") from None
    shutil.rmtree(trash, ignore_errors=True)


def cached_build(final: Path, build) -> Path:
    """``final``, built on first use by ``build(tmp)`` into a temporary folder that is renamed into
    place (``build_atomically``), so a half-built folder is never used; if two processes build at
    once, one rename wins and the other's copy is discarded. A damaged folder is rebuilt."""
    if final.is_dir() and (reason := cache_damage(final)) is None:
        return final
    if final.exists():
        _discard(final, reason if final.is_dir() else "not a folder")

    def build_with_manifest(tmp: Path) -> None:
        build(tmp)
        write_cache_manifest(tmp)  # last: its presence says the build completed

    try:
        build_atomically(final, build_with_manifest)
    except OSError:
        if cache_damage(final) is not None:  # not a lost race with another process: a real error
            raise
    return final


def default_model_dir(fp8: bool = True) -> Path:
    """The tiny model (seed 0) in the cache, built on first use (``cached_build``):
    ``<cache>/tiny-qwen3-fp8-v1`` (or ``-bf16-``). A new ``RECIPE_VERSION`` gives a new folder."""
    final = cache_root() / f"tiny-qwen3-{'fp8' if fp8 else 'bf16'}-v{RECIPE_VERSION}"
    return cached_build(final, lambda tmp: write_tiny(tmp, fp8, seed=0))
