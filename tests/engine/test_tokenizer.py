"""fp8lab.engine.tokenizer on the tiny model's tokenizer: round trips on random Unicode, stop tokens,
the ChatML chat template, and the streaming decoder (whole characters only; its output joined
equals ``decode`` of all ids, invalid UTF-8 included)."""

from __future__ import annotations

import json
import shutil
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.engine.tiny import TOKEN_IDS, make_tiny
from fp8lab.engine.tokenizer import StreamDecoder, Tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def stream(tok, ids, skip_special_tokens=False) -> list[str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# ----------------------------------------------------------------------------------------------
# encode / decode


@given(st.text(max_size=80))
def test_round_trip_random_unicode(tok, text):
    """Qwen's tokenizer NFC-normalizes its input, and so does the tiny one."""
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_round_trip_prose_and_special_tokens(tok):
    text = "<|im_start|>user\nThe keeper's café costs 12.50 € — naïve? 日本語 🙂<|im_end|>\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == TOKEN_IDS["<|im_start|>"] and TOKEN_IDS["<|im_end|>"] in ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nThe keeper's café costs 12.50 € — naïve? 日本語 🙂\n"


def test_special_and_added_tokens(tok):
    for token, token_id in TOKEN_IDS.items():
        assert tok.encode(token) == [token_id]
        assert tok.token_to_id(token) == token_id
    assert tok.special_ids == {1019, 1020, 1021}  # <think> and </think> are added but not special, as in Qwen3
    assert tok.vocab_size == 1024
    assert tok.encode("") == []


def test_trained_tokens_compress_the_corpus_language(tok):
    ids = tok.encode(" the lighthouse keeper")
    assert len(ids) < len(" the lighthouse keeper") / 2


def test_eos_token_ids(tok, tiny_dir, tmp_path):
    assert tok.eos_token_ids == (1021, 1019)  # generation_config: <|im_end|>, <|endoftext|>
    folder = shutil.copytree(tiny_dir, tmp_path / "t")
    (folder / "generation_config.json").unlink()
    assert Tokenizer.from_dir(folder).eos_token_ids == (1021,)  # config.json's eos_token_id
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = None
    (folder / "config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(folder).eos_token_ids == (1021,)  # tokenizer_config's eos_token
    (folder / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(folder).eos_token_ids == (1021, 1019)  # the vocabulary's ChatML tokens


def test_missing_or_bad_files(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    folder = shutil.copytree(tiny_dir, tmp_path / "t")
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        Tokenizer.from_dir(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json: cannot be read"):
        Tokenizer.from_dir(folder)


# ----------------------------------------------------------------------------------------------
# chat template


def test_chat_template_chatml(tok):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "<think>\nThey greet me.\n</think>\n\nHello."},
        {"role": "user", "content": "Weather?"},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"  # history loses its reasoning, as in Qwen3
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[1:2], enable_thinking=False) == (
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(messages[1:2], add_generation_prompt=False) == "<|im_start|>user\nHi!<|im_end|>\n"
    ids = tok.encode(tok.apply_chat_template(messages[1:2]))
    assert ids[0] == TOKEN_IDS["<|im_start|>"] and ids.count(TOKEN_IDS["<|im_end|>"]) == 1


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "tool", "content": "42"}], "role 'tool' is not supported"),
        ([{"role": "user"}], "expected a dict with 'role' and 'content'"),
        ([{"role": "user", "content": ["a"]}], "content must be a string"),
        ([{"role": "user", "content": "a", "tool_calls": []}], "not supported"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message must come first"),
    ],
)
def test_chat_template_refuses_what_it_does_not_support(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


# ----------------------------------------------------------------------------------------------
# streaming


def test_stream_splits_multibyte_characters_cleanly(tok):
    text = "café € 日本語 🙂 naïve"
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # some character's bytes were spread over several tokens
    assert len(ids) > len(text.encode("utf-8")) / 3


@given(st.lists(st.integers(0, 1023), max_size=60))
def test_stream_equals_decode_on_any_ids(tok, ids):
    """Random ids make arbitrary byte sequences, invalid UTF-8 and special tokens included."""
    assert "".join(stream(tok, ids)) == tok.decode(ids)
    assert "".join(stream(tok, ids, skip_special_tokens=True)) == tok.decode(ids, skip_special_tokens=True)


@given(st.text(max_size=40))
def test_stream_of_encoded_text_never_shows_a_half_character(tok, text):
    pieces = stream(tok, tok.encode(text))
    assert "".join(pieces) == unicodedata.normalize("NFC", text)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_stream_decoder_needs_byte_level(tok):
    from tokenizers import decoders

    other = Tokenizer(tok.hf.__class__.from_str(tok.hf.to_str()))
    other.hf.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="byte-level"):
        StreamDecoder(other)


def test_vocab_size_counts_the_decodable_ids(tok):
    """Every id below ``vocab_size`` is a token (the last one an added token); from there up an id
    is padding of a model's larger vocabulary: ``token_bytes`` (so ``StreamDecoder``) rejects it."""
    assert tok.vocab_size == 1 + max(tok.hf.get_vocab(with_added_tokens=True).values())
    assert all(tok.hf.id_to_token(i) is not None for i in range(tok.vocab_size))
    assert tok.token_bytes(tok.vocab_size - 1) == b"</think>"
    with pytest.raises(ValueError, match="outside the tokenizer's 1024 ids"):
        tok.stream_decoder().push(tok.vocab_size)
