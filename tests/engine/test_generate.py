"""Generation: stop tokens, max_new_tokens, batching, streaming, the cache admission, timings,
and ``fp8lab generate`` (with a fake checkpoint/tokenizer I/O half, and end to end with the real
one when it is there)."""

from __future__ import annotations

import importlib.util
import math
import sys

import numpy as np
import pytest
from helpers.engine import (
    EOS_ID,
    FakeStreamDecoder,
    FakeTokenizer,
    install_fake_io,
    random_model,
    tiny_config,
)

from fp8lab import cli
from fp8lab.engine.generate import Generator, collect_stop_token_ids
from fp8lab.engine.kv_manager import KVCacheExhausted
from fp8lab.engine.sampling import SamplingParams
from fp8lab.reference.dense import argmax_rows

PROMPTS = ["The cat", "A longer prompt, with more bytes in it", "x"]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=11)[0]


def make_generator(model, **kw) -> Generator:
    kw.setdefault("stop_token_ids", ())
    return Generator(model, FakeTokenizer(), stream_decoder=FakeStreamDecoder, **kw)


class ScriptedModel:
    """Stands in for ``Qwen3Model``: the next token after position ``p`` is ``script[p + 1 - prompt_len]``
    (the last entry repeats), whatever the sequence; checks that positions follow the prompt."""

    def __init__(self, script: list[int], prompt_len: int):
        self.config = tiny_config()
        self.script, self.prompt_len = script, prompt_len

    def allocate_kv_cache(self, num_blocks, block_size, kv_cache_dtype):
        return []

    def forward(self, batch, kv_cache):
        batch.check()
        logits = np.zeros((batch.num_seqs, self.config.vocab_size), dtype=np.float32)
        for i, row in enumerate(batch.last_token_rows):
            step = int(batch.positions[row]) + 1 - self.prompt_len
            assert step >= 0 and int(batch.context_lens[i]) == int(batch.positions[row]) + 1
            logits[i, self.script[min(step, len(self.script) - 1)]] = 10.0
        return logits

    def greedy_tokens(self, batch, kv_cache):
        return argmax_rows(self.forward(batch, kv_cache))


# ---------------------------------------------------------------------------- stopping


def test_max_new_tokens_is_honoured(model):
    out = make_generator(model).generate(PROMPTS, max_new_tokens=7)
    for r, prompt in zip(out.results, PROMPTS):
        assert r.finish_reason == "length" and len(r.token_ids) == 7
        assert r.prompt_token_ids == list(prompt.encode())


def test_a_stop_token_ends_its_sequence_only(model):
    reference = make_generator(model).generate(PROMPTS, max_new_tokens=16).results
    stop = reference[0].token_ids[3]
    out = make_generator(model, stop_token_ids=[stop]).generate(PROMPTS, max_new_tokens=16).results
    for ref, r in zip(reference, out):
        if stop in ref.token_ids:
            cut = ref.token_ids.index(stop)
            assert r.finish_reason == "stop" and r.token_ids == ref.token_ids[: cut + 1]
            assert r.text == FakeTokenizer().decode(ref.token_ids[:cut])  # the stop token is not text
        else:
            assert r.finish_reason == "length" and r.token_ids == ref.token_ids


def test_eos_from_the_tokenizer_stops_and_utf8_streams_whole():
    text = "héllo wörld €1 𝄞!"
    script = [*text.encode(), EOS_ID]
    gen = Generator(ScriptedModel(script, prompt_len=2), FakeTokenizer(), stream_decoder=FakeStreamDecoder, block_size=4)
    assert gen.stop_token_ids == {EOS_ID}  # tokenizer's eos + config's eos
    pieces: dict[int, list[str]] = {}
    out = gen.generate(["ab", "cd"], max_new_tokens=100, on_text=lambda i, p: pieces.setdefault(i, []).append(p))
    for r in out.results:
        assert r.finish_reason == "stop" and r.token_ids == script
        assert r.text == text and "".join(pieces[r.index]) == text
        assert all("\ufffd" not in p for p in pieces[r.index])  # multi-byte characters never split


def test_an_unfinished_utf8_tail_is_streamed_at_the_end():
    script = [*"ok €".encode()[:-1]]  # stops one byte short of the euro sign
    gen = Generator(ScriptedModel(script, prompt_len=1), FakeTokenizer(), stream_decoder=FakeStreamDecoder,
                    stop_token_ids=())
    pieces = []
    (r,) = gen.generate(["a"], max_new_tokens=len(script), on_text=lambda i, p: pieces.append(p)).results
    assert r.finish_reason == "length"
    assert "".join(pieces) == r.text == FakeTokenizer().decode(script) and r.text.startswith("ok ")


def test_collect_stop_token_ids():
    assert collect_stop_token_ids(FakeTokenizer(), {"eos_token_id": [5, 7]}, tiny_config()) == (5, 7, EOS_ID)
    assert collect_stop_token_ids(None, {"eos_token_id": 3}, None) == (3,)
    assert collect_stop_token_ids() == ()


def test_max_position_embeddings_caps_generation():
    m = random_model(tiny_config(max_position_embeddings=20), seed=2)[0]
    (r,) = make_generator(m).generate([list(range(15))], max_new_tokens=10).results
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_generator(m).generate([list(range(20))])
    with pytest.raises(ValueError, match="empty"):
        make_generator(m).generate([""])


# ---------------------------------------------------------------------------- batching and streaming


def test_a_batch_gives_each_prompt_its_tokens_alone(model):
    batch = make_generator(model).generate(PROMPTS, max_new_tokens=10).results
    for prompt, r in zip(PROMPTS, batch):
        (alone,) = make_generator(model).generate([prompt], max_new_tokens=10).results
        assert r.token_ids == alone.token_ids


def test_streamed_pieces_concatenate_to_the_text(model):
    """Sampled random bytes: invalid UTF-8 galore, and sequences that stop at different times."""
    pieces: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    finished = []
    gen = make_generator(model, stop_token_ids=[ord("e"), ord(" ")])
    out = gen.generate(PROMPTS, max_new_tokens=24, sampling=SamplingParams(temperature=1.5), seed=4,
                       on_text=lambda i, p: pieces[i].append(p), on_finish=finished.append)
    assert sorted(r.index for r in finished) == [0, 1, 2] and all(r in out.results for r in finished)
    for r in out.results:
        assert "".join(pieces[r.index]) == r.text
        body = r.token_ids[:-1] if r.finish_reason == "stop" else r.token_ids
        assert r.text == FakeTokenizer().decode(body)


def test_seeds_reproduce_sampled_generations(model):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    run = lambda seed: [r.token_ids for r in make_generator(model).generate(
        PROMPTS, max_new_tokens=8, sampling=params, seed=seed).results]
    assert run(1) == run(1)
    assert run(1) != run(2)


# ---------------------------------------------------------------------------- the cache


def test_a_small_cache_runs_requests_in_turn_with_the_same_tokens(model):
    big = make_generator(model, kv_format="bf16").generate(PROMPTS, max_new_tokens=6).results
    # room for the longest request alone (38 prompt + 6 new - 1 = 43 tokens: 11 blocks of 4)
    small = make_generator(model, kv_format="bf16", num_blocks=11, block_size=4).generate(PROMPTS, max_new_tokens=6)
    assert [r.token_ids for r in small.results] == [r.token_ids for r in big]


def test_a_request_that_cannot_fit_fails_before_any_work(model):
    gen = make_generator(model, num_blocks=2, block_size=4)
    with pytest.raises(KVCacheExhausted, match="3 blocks needed, 2 free.*request 0"):
        gen.generate(["0123456"], max_new_tokens=4)


def test_chunked_prefill_gives_the_same_tokens(model):
    whole = make_generator(model).generate(PROMPTS, max_new_tokens=6).results
    chunked = make_generator(model, prefill_chunk_size=5).generate(PROMPTS, max_new_tokens=6).results
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]


def test_stats_count_prompt_and_decode_tokens(model):
    out = make_generator(model).generate(PROMPTS, max_new_tokens=5)
    s = out.stats
    assert s.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)
    assert s.decode_tokens == sum(len(r.token_ids) for r in out.results) - len(PROMPTS)  # first tokens: prefill
    assert s.prompt_seconds > 0 and s.decode_seconds > 0
    assert math.isfinite(s.prompt_tokens_per_s) and math.isfinite(s.decode_tokens_per_s)
    assert "tokens/s" in s.summary()
    assert all(0 < r.first_token_time <= r.finish_time for r in out.results)


# ---------------------------------------------------------------------------- fp8lab generate


@pytest.fixture
def fake_io(monkeypatch, tmp_path):
    """The tiny random model served from ``tmp_path`` by fake I/O modules (``helpers.engine.install_fake_io``)."""
    return install_fake_io(monkeypatch, tmp_path)


def test_cli_streams_one_prompt_and_closes_with_rates(fake_io, capsys):
    assert cli.main(["generate", "--prompt", "hello", "--max-new-tokens", "6", "--kv-cache-dtype", "bf16"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n")
    assert "prompt: 5 tokens" in err and "tokens/s" in err and err.count("\n") == 1


def test_cli_batch_chat_and_sampling(fake_io, capsys):
    argv = ["generate", "--model", str(fake_io), "--prompt", "one", "--prompt", "two", "--chat",
            "--max-new-tokens", "4", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9", "--seed", "3"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "=== [0]" in out and "=== [1]" in out
    chat_len = len(FakeTokenizer().apply_chat_template([{"role": "user", "content": "one"}]).encode())
    assert f"prompt: {2 * chat_len} tokens" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/dir"], "not a directory"),
    (["--num-blocks", "1", "--block-size", "2"], "KV cache exhausted"),
    (["--temperature", "1", "--top-p", "0"], "top_p"),
])
def test_cli_errors_are_one_line_and_exit_non_zero(fake_io, capsys, argv, message):
    assert cli.main(["generate", "--prompt", "hello there", *argv]) == 1
    out, err = capsys.readouterr()
    assert message in err and err.count("\n") == 1 and err.startswith("fp8lab generate")


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_cli_a_forward_that_overflows_names_the_layer_in_one_line(fake_io, capsys):
    """Scales that load but overflow at run time: ``fp8lab.engine.model.NonFiniteError`` through the
    command's error handling, naming the layer, not the KV cache's anonymous check."""
    tensors = sys.modules["fp8lab.engine.checkpoint"].load_checkpoint(fake_io).tensors  # the fake's own dict
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = np.full_like(tensors[name], 3e38)
    assert cli.main(["generate", "--prompt", "hello", "--max-new-tokens", "3", "--backend", "reference"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fp8lab generate: error: layer 1: the residual stream after the MLP is not finite")
    assert "weights or scales too large?" in err and err.count("\n") == 1


def test_cli_bad_model_directory_names_the_problem(fake_io, capsys, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    assert cli.main(["generate", "--model", str(empty), "--prompt", "hi"]) == 1
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("fp8lab.engine.tiny") is None, reason="the checkpoint I/O half is not there yet")
def test_cli_end_to_end_with_the_embedded_demo_model(capsys):
    assert cli.main(["generate", "--prompt", "Hello", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert "tokens/s" in err
