"""Generation when something goes wrong (issue 12): padding ids in the model's vocabulary, a token
that one sequence cannot decode, NaN logits in one sequence, the device's greedy path.

The contract (``fp8lab.engine.generate``): padding ids (at and above the tokenizer's ``vocab_size``) are
never chosen, and one sequence's failure finishes that sequence alone with ``"error"`` and a
message naming it and the token number, while the others run to their normal end.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine import (
    BYTE_VOCAB,
    FakeStreamDecoder,
    FakeTokenizer,
    random_model,
    tiny_config,
)

from fp8lab.engine.generate import Generator, sampleable_token_ids
from fp8lab.engine.sampling import SamplingParams
from fp8lab.engine.tiny import make_tiny
from fp8lab.engine.tokenizer import Tokenizer
from fp8lab.reference.dense import argmax_rows

PROMPTS = ["The cat", "A longer prompt", "x"]
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95)


class ByteTokenizer(FakeTokenizer):
    """The fake byte tokenizer, telling its size: ids 0..256 (bytes and ``<eos>``) decode."""

    vocab_size = BYTE_VOCAB + 1


class PaddingLovingModel:
    """Stands in for a model with a padded vocabulary whose padding rows win: every logits row
    peaks at the last id (a padding id), then falls off towards the low ids. ``nan_at``:
    ``(sequence row, decode step)`` whose logits are all NaN."""

    def __init__(self, nan_at: tuple[int, int] | None = None, greedy_ids=None):
        self.config = tiny_config()
        self.nan_at, self.steps = nan_at, 0
        self.greedy_ids, self.greedy_calls = greedy_ids, 0

    def allocate_kv_cache(self, num_blocks, block_size, kv_cache_dtype):
        return []

    def forward(self, batch, kv_cache):
        batch.check()
        vocab = self.config.vocab_size
        logits = np.tile(np.linspace(-5.0, 5.0, vocab, dtype=np.float32), (batch.num_seqs, 1))
        if self.nan_at is not None and self.nan_at[1] == self.steps:
            logits[self.nan_at[0]] = np.nan
        self.steps += 1
        return logits

    def greedy_tokens(self, batch, kv_cache):
        """``greedy_ids`` for every sequence (a device-side greedy path, as CudaQwen3Model's), or the host's."""
        self.greedy_calls += 1
        if self.greedy_ids is None:
            return argmax_rows(self.forward(batch, kv_cache))
        return np.full(batch.num_seqs, self.greedy_ids, dtype=np.int64)


def generator(model, tokenizer=None, **kw) -> Generator:
    kw.setdefault("stop_token_ids", ())
    return Generator(model, tokenizer or ByteTokenizer(), stream_decoder=FakeStreamDecoder, **kw)


# ---------------------------------------------------------------------------- padding ids


def test_sampleable_token_ids():
    assert sampleable_token_ids(272, ByteTokenizer()) == 257
    assert sampleable_token_ids(100, ByteTokenizer()) == 100  # a tokenizer larger than the model cuts nothing
    assert sampleable_token_ids(272, FakeTokenizer()) == sampleable_token_ids(272, None) == 272


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, SamplingParams(temperature=1e-310)])
def test_padding_ids_are_never_chosen(sampling):
    out = generator(PaddingLovingModel()).generate(PROMPTS, max_new_tokens=6, sampling=sampling, seed=0)
    for r in out.results:
        assert r.finish_reason == "length" and r.error is None
        assert all(0 <= t < ByteTokenizer.vocab_size for t in r.token_ids)
    if sampling.greedy or sampling.temperature < 1e-300:
        # the highest id the tokenizer knows wins once the padding is masked
        assert all(r.token_ids == [ByteTokenizer.vocab_size - 1] * 6 for r in out.results)


def test_the_device_greedy_path_is_skipped_when_it_could_choose_padding():
    """``greedy_tokens`` takes the argmax over every id on the device: with padding ids in the
    vocabulary the generator masks host logits instead."""
    padded = PaddingLovingModel(greedy_ids=271)
    out = generator(padded).generate(PROMPTS, max_new_tokens=4)
    assert padded.greedy_calls == 0
    assert all(r.finish_reason == "length" and max(r.token_ids) == 256 for r in out.results)
    # no padding (the tokenizer covers the vocabulary): the device path is used
    unpadded = PaddingLovingModel(greedy_ids=65)
    out = generator(unpadded, FakeTokenizer()).generate(PROMPTS, max_new_tokens=4)
    assert unpadded.greedy_calls == 3  # the decode steps; the first token comes from the prefill
    assert all(r.token_ids[1:] == [65] * 3 for r in out.results)


def test_a_device_id_outside_the_vocabulary_finishes_its_sequences_with_an_error():
    model = PaddingLovingModel(greedy_ids=272)  # one past the last id: a broken device argmax
    out = generator(model, FakeTokenizer()).generate(PROMPTS, max_new_tokens=4)
    for r in out.results:
        assert r.finish_reason == "error" and len(r.token_ids) == 1
        assert r.error == (f"request {r.index}, token 2: token id 272 is not in [0, 272), the ids that can be "
                           "generated (from the tokenizer's vocab_size up they are padding)")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tiny(tmp_path_factory.mktemp("tok") / "tiny"))


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED])
def test_a_random_model_with_a_padded_vocabulary_generates_decodable_text(tiny_tokenizer, sampling):
    """The situation of ``fp8lab.engine.shapes``' random real-shape checkpoints: the tiny tokenizer's
    1024 ids under a larger model vocabulary (here 1536), with the real ``StreamDecoder``: before
    the fix the first padding id aborted the whole batch."""
    model = random_model(tiny_config(vocab_size=1536), seed=3)[0]
    pieces: dict[int, list[str]] = {}
    gen = Generator(model, tiny_tokenizer, stop_token_ids=())
    out = gen.generate(PROMPTS, max_new_tokens=12, sampling=sampling, seed=1,
                       on_text=lambda i, p: pieces.setdefault(i, []).append(p))
    for r in out.results:
        assert r.finish_reason == "length" and r.error is None and len(r.token_ids) == 12
        assert max(r.token_ids) < tiny_tokenizer.vocab_size == 1024
        assert r.text == tiny_tokenizer.decode(r.token_ids) == "".join(pieces.get(r.index, []))


# ---------------------------------------------------------------------------- one sequence fails, the others go on


class FailingDecoder(FakeStreamDecoder):
    """The stream decoder of the second sequence created fails on its third token."""

    created = 0

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        FailingDecoder.created += 1
        self.fails, self.pushed = FailingDecoder.created == 2, 0

    def push(self, token_id: int) -> str:
        self.pushed += 1
        if self.fails and self.pushed == 3:
            raise ValueError(f"token id {token_id} is outside the tokenizer's ids")
        return super().push(token_id)


def test_a_decode_error_finishes_only_its_sequence():
    model = random_model(tiny_config(), seed=11)[0]
    want = generator(model, FakeTokenizer()).generate(PROMPTS, max_new_tokens=8).results
    FailingDecoder.created = 0
    pieces: dict[int, list[str]] = {}
    finished = []
    gen = Generator(model, FakeTokenizer(), stream_decoder=FailingDecoder, stop_token_ids=())
    got = gen.generate(PROMPTS, max_new_tokens=8, on_text=lambda i, p: pieces.setdefault(i, []).append(p),
                       on_finish=finished.append).results
    bad = got[1]
    assert bad.finish_reason == "error" and bad.error.startswith("request 1, token 3: token id ")
    assert bad.token_ids == want[1].token_ids[:3]  # the failing token is kept: it was generated
    assert bad.text == "".join(pieces.get(1, [])) == FakeTokenizer().decode(want[1].token_ids[:2])
    for i in (0, 2):
        assert got[i].finish_reason == "length" and got[i].error is None
        assert got[i].token_ids == want[i].token_ids and got[i].text == want[i].text
    assert sorted(r.index for r in finished) == [0, 1, 2]


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED])
def test_nan_logits_finish_their_sequence_with_an_error_naming_it(sampling):
    """Row 1 of the third forward (the second decode step) is NaN: sequence 1's third token."""
    out = generator(PaddingLovingModel(nan_at=(1, 2))).generate(PROMPTS, max_new_tokens=5, sampling=sampling, seed=0)
    bad = out.results[1]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 2
    assert bad.error.startswith("request 1, token 3: logits: contain NaN")
    assert [r.finish_reason for r in out.results] == ["length", "error", "length"]
    assert all(len(r.token_ids) == 5 for r in (out.results[0], out.results[2]))


def test_an_on_text_callback_error_is_not_taken_for_the_sequence():
    """Only choosing and decoding a token are the sequence's own work; a failing callback (a
    closed output, say) raises out of ``generate`` as it always did."""
    def on_text(index, piece):
        raise ValueError("I/O operation on closed file")

    model = random_model(tiny_config(), seed=11)[0]
    with pytest.raises(ValueError, match="closed file"):
        generator(model, FakeTokenizer()).generate(["The cat"], max_new_tokens=64, on_text=on_text)


def test_a_nan_greedy_id_from_the_device_is_that_sequences_error():
    """``greedy_tokens`` answers -1 for a row holding NaN (``layers.argmax_rows``): the sequence finishes
    with an error naming NaN, never with a token."""
    import types

    from fp8lab.reference.dense import NAN_ROW

    gen = Generator.__new__(Generator)
    gen.num_token_ids = 16
    s = types.SimpleNamespace(index=0, rng=None)
    with pytest.raises(ValueError, match="contain NaN"):
        gen._choose(s, NAN_ROW, SamplingParams())
    assert gen._choose(s, 3, SamplingParams()) == 3
