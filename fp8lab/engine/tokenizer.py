"""The tokenizer of a Qwen3 checkpoint folder: encode, decode, stop tokens, chat prompts, streaming.

Reads, from the checkpoint folder:

- ``tokenizer.json`` (required): a Hugging Face ``tokenizers`` file. Qwen's is a byte-level BPE
  (NFC normalizer, a regex split, ``ByteLevel`` byte-to-character mapping); so is the one that
  ``fp8lab.engine.tiny`` trains.
- ``tokenizer_config.json`` (optional): ``eos_token`` (a stop token).
- ``generation_config.json`` and ``config.json`` (optional): ``eos_token_id`` (one id or a list).

Contract:

- ``encode(text)`` never adds BOS/EOS; special tokens written in the text (``<|im_start|>``)
  are recognised as such, as transformers does for Qwen.
- ``decode(ids)`` keeps special tokens unless asked not to; with Qwen's NFC normalizer,
  ``decode(encode(t)) == unicodedata.normalize("NFC", t)``; invalid UTF-8 (a random model can
  produce any byte sequence) becomes U+FFFD per maximal invalid subsequence.
- ``StreamDecoder`` emits text only once its UTF-8 bytes are complete; the concatenation of
  everything it emits (after ``flush()``) equals ``decode`` of all the ids pushed.
- ``apply_chat_template`` writes Qwen's ChatML (see its docstring for what is supported); the
  folder's own Jinja ``chat_template`` is not executed (no Jinja dependency).
"""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHAT_ROLES = ("system", "user", "assistant")


def _read_json(path: Path) -> dict:
    """A JSON file as a dict, or {} when the file is absent; a corrupt file is a ValueError naming it."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _as_id_list(value) -> list[int]:
    """``eos_token_id`` may be absent, one id or a list of ids."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@lru_cache(maxsize=1)
def _byte_level_char_to_byte() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: byte-level BPE spells each byte as a printable
    character (bytes 0x21..0x7E and most of Latin-1 as themselves, the rest shifted to U+0100...)."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the checkpoint's stop tokens and Qwen's chat format."""

    def __init__(self, hf_tokenizer: HFTokenizer, eos_token_ids: tuple[int, ...] = (), path: Path | None = None):
        self.hf = hf_tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.path = path
        self.special_ids = frozenset(i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special)
        # one past the highest id (added tokens included), not get_vocab_size(), which counts tokens:
        # the two differ only if the ids had a gap (Qwen's and the tiny tokenizer's have none; an
        # id in a gap would fail to decode, which fp8lab.engine.generate contains to its sequence)
        self._num_ids = 1 + max(hf_tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Load ``tokenizer.json`` and the stop tokens of a checkpoint folder (see the module docstring)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: no such file (a checkpoint folder needs a tokenizer.json)")
        try:
            hf = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises its own Exception type for bad files
            raise ValueError(f"{tokenizer_file}: cannot be read by tokenizers ({e})") from None
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        return cls(hf, _collect_eos_ids(path, hf, tokenizer_config), path)

    @property
    def vocab_size(self) -> int:
        """Number of decodable token ids: ids ``0 .. vocab_size - 1``, added tokens included.

        A model's ``vocab_size`` may be larger (Qwen3 pads its embedding to 151936 rows for 151669
        tokenizer ids; fp8lab's random real-shape checkpoints carry the 1024-id tiny tokenizer):
        ids from here up are padding, which ``decode`` drops and ``token_bytes`` rejects, and
        which ``fp8lab.engine.generate`` therefore never samples.
        """
        return self._num_ids

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS are added."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes that one token stands for in a byte-level BPE (added tokens: their UTF-8 text).

        Mirrors the ``ByteLevel`` decoder of ``tokenizers``: every character of the token string
        is mapped back to its byte; a token with a character outside the table (an added token
        such as ``<think>`` only has ASCII, but one could have anything) is taken as UTF-8 text.
        """
        token = self.hf.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token id {token_id} is outside the tokenizer's {self.vocab_size} ids")
        table = _byte_level_char_to_byte()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode("utf-8")

    def is_byte_level(self) -> bool:
        """True when ``tokenizer.json`` decodes with the ``ByteLevel`` decoder (Qwen, GPT-2 style)."""
        return isinstance(self.hf.decoder, decoders.ByteLevel)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
        """``messages`` in Qwen's ChatML, as Qwen3's own chat template writes them.

        Each message ``{"role": "system" | "user" | "assistant", "content": str}`` becomes
        ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Then, with ``add_generation_prompt``,
        ``<|im_start|>assistant\\n`` opens the model's turn; ``enable_thinking=False`` appends
        Qwen3's empty reasoning block ``<think>\\n\\n</think>\\n\\n`` so the model answers directly.

        Qwen3 specifics kept: an assistant message in the history loses its reasoning (everything
        up to the last ``</think>``, then leading newlines), as Qwen3's template does for turns
        before the last user message. Not supported (``ValueError``): tool calls and ``tool``
        messages, ``reasoning_content`` fields, a system message that is not the first message.
        """
        parts = []
        for i, message in enumerate(messages):
            role, content = _checked_message(i, message)
            if role == "system" and i != 0:
                raise ValueError(f"messages[{i}]: a system message must come first")
            if role == "assistant" and THINK_CLOSE in content:
                content = content.split(THINK_CLOSE)[-1].lstrip("\n")
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
            if not enable_thinking:
                parts.append(f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n")
        return "".join(parts)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


def _checked_message(index: int, message) -> tuple[str, str]:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise ValueError(f"messages[{index}]: expected a dict with 'role' and 'content', got {message!r}")
    role, content = message["role"], message["content"]
    if role not in CHAT_ROLES:
        raise ValueError(f"messages[{index}]: role {role!r} is not supported; fp8lab's chat format has {CHAT_ROLES}")
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}]: content must be a string, got {type(content).__name__}")
    extra = set(message) - {"role", "content"}
    if extra:
        raise ValueError(f"messages[{index}]: fields {sorted(extra)} are not supported (no tools, no reasoning_content)")
    return role, content


def _collect_eos_ids(path: Path, hf: HFTokenizer, tokenizer_config: dict) -> tuple[int, ...]:
    """Stop tokens, in this order of precedence and without repeats: ``generation_config.json``'s
    ``eos_token_id``, ``config.json``'s, ``tokenizer_config.json``'s ``eos_token``; when none of
    them names one, the ids of ``<|im_end|>`` and ``<|endoftext|>`` if the vocabulary has them."""
    ids = _as_id_list(_read_json(path / "generation_config.json").get("eos_token_id"))
    ids += _as_id_list(_read_json(path / "config.json").get("eos_token_id"))
    eos_token = tokenizer_config.get("eos_token")
    if isinstance(eos_token, dict):  # older files spell it {"content": "<|im_end|>", ...}
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str) and hf.token_to_id(eos_token) is not None:
        ids.append(hf.token_to_id(eos_token))
    if not ids:
        ids = [i for i in (hf.token_to_id(IM_END), hf.token_to_id(ENDOFTEXT)) if i is not None]
    return tuple(dict.fromkeys(ids))


class StreamDecoder:
    """Incremental detokenizer for streaming: ``push(token_id)`` returns the text that became complete.

    Byte-level BPE tokens are byte strings, and a multi-byte character (``é``, ``€``, an emoji)
    is often split across tokens; printing each token's ``decode`` would show U+FFFD halves.
    So bytes are collected and fed to Python's incremental UTF-8 decoder, which returns only
    complete characters and keeps an unfinished one for the next push; an invalid sequence
    becomes U+FFFD as soon as it can no longer start a valid character, exactly as ``decode``
    (Rust's ``from_utf8_lossy``) replaces it. ``flush()`` ends the stream: a truncated character
    at the end becomes U+FFFD, as ``decode`` would show it.

    Only byte-level tokenizers are supported (Qwen's and fp8lab's tiny one are).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        if not tokenizer.is_byte_level():
            raise ValueError("StreamDecoder supports byte-level BPE tokenizers (a ByteLevel decoder), as Qwen's is")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (often "", never a partial character)."""
        if self.skip_special_tokens and int(token_id) in self.tokenizer.special_ids:
            return ""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever bytes are pending, as text (U+FFFD for an unfinished character)."""
        return self._utf8.decode(b"", final=True)
