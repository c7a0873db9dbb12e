"""Generation edge cases (issue 18): a stop token as the very first generated token, a stop token that
is also in the prompt, and ``max_new_tokens = 1``, through ``Generator.generate`` and through
``ContinuousBatch`` step by step.

Checked against: what a scripted model must produce (``ChainModel``: the next token is a fixed
function of the last one, so every expected ``token_ids`` / ``text`` / ``finish_reason`` is derived by
hand from its chain), and, for the real tiny random model (``helpers.engine.random_model``), against
the argmax of its own prefill logits (``helpers.engine.prefill_logits``) and against
``Generator.generate`` of the same prompt alone without stop tokens, cut at the stop token.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine import (
    EOS_ID,
    FakeStreamDecoder,
    FakeTokenizer,
    prefill_logits,
    random_model,
    tiny_config,
)

from fp8lab.engine.generate import ContinuousBatch, Generator
from fp8lab.engine.kv_manager import blocks_for
from fp8lab.reference.dense import argmax_rows

A, B, C, H, I = (ord(ch) for ch in "abchi")


class ChainModel:
    """Stands in for ``Qwen3Model``: the next token after token ``t`` is ``chain[t]`` (``default`` when ``t``
    is not in it), whatever the position, so sequences of one batch follow their own chains. Checks that
    the batch's positions and context lengths agree, and records each forward's query lengths."""

    def __init__(self, chain: dict[int, int], default: int = ord("z")):
        self.config = tiny_config()
        self.chain, self.default = chain, default
        self.calls: list[list[int]] = []

    def allocate_kv_cache(self, num_blocks, block_size, kv_cache_dtype):
        return []

    def forward(self, batch, kv_cache):
        batch.check()
        self.calls.append(batch.query_lens.tolist())
        rows = batch.last_token_rows
        assert np.array_equal(batch.context_lens, batch.positions[rows] + 1)
        logits = np.full((batch.num_seqs, self.config.vocab_size), -1.0, dtype=np.float32)
        for i, row in enumerate(rows):
            logits[i, self.chain.get(int(batch.token_ids[row]), self.default)] = 10.0
        return logits

    def greedy_tokens(self, batch, kv_cache):
        return argmax_rows(self.forward(batch, kv_cache))


def scripted_generator(chain, **kw) -> Generator:
    """EOS (the tokenizer's and the config's) is the stop token unless ``stop_token_ids`` says otherwise."""
    return Generator(ChainModel(chain), FakeTokenizer(), stream_decoder=FakeStreamDecoder, block_size=4, **kw)


def generate_one(gen, prompt, max_new_tokens):
    pieces = []
    (r,) = gen.generate([prompt], max_new_tokens=max_new_tokens, on_text=lambda i, p: pieces.append(p)).results
    return r, pieces


# ---------------------------------------------------------------------------- Generator.generate, scripted


def test_stop_token_as_the_first_generated_token():
    gen = scripted_generator({C: EOS_ID})
    assert gen.stop_token_ids == {EOS_ID}
    r, pieces = generate_one(gen, "abc", max_new_tokens=8)
    # the prefill's logits give EOS at once: one token, kept in token_ids, no text, nothing streamed
    assert r.token_ids == [EOS_ID] and r.text == "" and r.finish_reason == "stop" and pieces == []
    assert r.prompt_token_ids == [A, B, C] and r.error is None
    assert gen.model.calls == [[3]]  # the prefill only: no decode step after a first-token stop


def test_a_stop_token_in_the_prompt_stops_nothing():
    # the prompt holds EOS twice, the last time as its final token: generation reads on from it
    prompt = [A, EOS_ID, B, EOS_ID]
    gen = scripted_generator({EOS_ID: H, H: I, I: EOS_ID})
    r, pieces = generate_one(gen, prompt, max_new_tokens=8)
    assert r.token_ids == [H, I, EOS_ID] and r.finish_reason == "stop"
    assert r.text == "hi" and "".join(pieces) == "hi"
    assert r.prompt_token_ids == prompt
    # a byte stop token that the prompt text holds: the generation never samples it, so "length"
    gen = scripted_generator({A: B, B: C, C: A}, stop_token_ids=[ord("x")])
    r, _ = generate_one(gen, "box", max_new_tokens=4)  # the prompt ends with the stop token x
    assert r.token_ids == [ord("z")] * 4 and r.finish_reason == "length" and r.text == "zzzz"


@pytest.mark.parametrize("chain, want_ids, want_text, want_reason", [
    ({C: H}, [H], "h", "length"),
    ({C: EOS_ID}, [EOS_ID], "", "stop"),  # the one token is the stop token: "stop" wins over "length"
])
def test_max_new_tokens_one(chain, want_ids, want_text, want_reason):
    gen = scripted_generator(chain)
    r, pieces = generate_one(gen, "abc", max_new_tokens=1)
    assert r.token_ids == want_ids and r.text == want_text and r.finish_reason == want_reason
    assert "".join(pieces) == want_text
    assert gen.model.calls == [[3]]
    assert gen.generate(["abc"], max_new_tokens=1).stats.decode_tokens == 0  # the first token is prefill's


def test_max_new_tokens_one_reserves_only_the_prompt():
    """``prompt + 1 - 1`` tokens: a 4-token prompt fits one block of 4 (the sampled token is never written)."""
    gen = scripted_generator({B: H}, num_blocks=1)
    r, _ = generate_one(gen, "abab", max_new_tokens=1)
    assert r.token_ids == [H] and r.finish_reason == "length"


# ---------------------------------------------------------------------------- ContinuousBatch, scripted


def run_steps(batch, max_steps=20):
    """Step until idle; per step the finished indices, and every request's ``on_tokens`` / ``on_text``."""
    finished, tokens, texts, results = [], {}, {}, {}
    for _ in range(max_steps):
        done = batch.step(on_text=lambda i, p: texts.setdefault(i, []).append(p),
                          on_tokens=lambda i, ids: tokens.setdefault(i, []).extend(ids))
        finished.append(sorted(r.index for r in done))
        results.update({r.index: r for r in done})
        if not batch.busy:
            return finished, tokens, texts, results
    raise AssertionError("the batch did not finish")


def test_continuous_batch_edge_cases_step_by_step():
    """Four requests admitted together: 0 stops on its first token, 1 holds the stop token in its prompt,
    2 has max_new_tokens 1, 3 is an ordinary request beside them. Each result at the step derived by
    hand; the cache empty at the end."""
    chain = {C: EOS_ID, EOS_ID: H, H: I, I: EOS_ID, ord("x"): ord("y")}
    gen = scripted_generator(chain)
    batch = ContinuousBatch(gen, num_blocks=16)
    batch.add(0, "abc", 5)
    batch.add(1, [A, EOS_ID], 5)
    batch.add(2, "ax", 1)
    batch.add(3, "bx", 3)
    finished, tokens, texts, results = run_steps(batch)
    # step 1: the prefill (0, 2 finish: their first token); 2: 1 -> i, 3 -> z; 3: 1 -> EOS, 3 -> z (length)
    assert finished == [[0, 2], [], [1, 3]]
    assert gen.model.calls == [[3, 2, 2, 2], [1, 1], [1, 1]]
    want = {0: ([EOS_ID], "", "stop"), 1: ([H, I, EOS_ID], "hi", "stop"),
            2: ([ord("y")], "y", "length"), 3: ([ord("y"), ord("z"), ord("z")], "yzz", "length")}
    for i, (ids, text, reason) in want.items():
        r = results[i]
        assert (r.token_ids, r.text, r.finish_reason) == (ids, text, reason), i
        assert tokens[i] == ids and "".join(texts.get(i, [])) == text
    assert batch.manager.num_free_blocks == batch.num_blocks and not batch.running


def test_continuous_batch_request_joining_after_first_token_stops():
    """A request added after one that stopped at its first token: the freed slot serves it and its
    result is what it gets alone."""
    gen = scripted_generator({C: EOS_ID, B: H, H: I, I: EOS_ID})
    batch = ContinuousBatch(gen, num_blocks=1, max_num_seqs=1)  # room for one request at a time
    batch.add(0, "abc", 2)  # 3 + 2 - 1 tokens: the one block
    (r0,) = batch.step()
    assert (r0.token_ids, r0.text, r0.finish_reason) == ([EOS_ID], "", "stop") and not batch.busy
    batch.add(1, "ab", 1)
    (r1,) = batch.step()
    assert (r1.token_ids, r1.text, r1.finish_reason) == ([H], "h", "length")
    alone, _ = generate_one(scripted_generator({B: H}), "ab", max_new_tokens=1)
    assert r1.token_ids == alone.token_ids and r1.text == alone.text
    assert batch.manager.num_free_blocks == 1


# ---------------------------------------------------------------------------- the real tiny model


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=31)[0]


PROMPT = [int(t) for t in np.random.default_rng(1831).integers(0, 256, 7)]


def real_generator(model, **kw) -> Generator:
    kw.setdefault("stop_token_ids", ())
    return Generator(model, FakeTokenizer(), stream_decoder=FakeStreamDecoder, block_size=4, **kw)


@pytest.fixture(scope="module")
def reference_run(model):
    """The prompt generated alone, no stop tokens, 8 tokens: the oracle the edge cases are cut from."""
    return real_generator(model).generate([PROMPT], max_new_tokens=8).results[0]


def test_real_model_max_new_tokens_one_is_the_prefill_argmax(model, reference_run):
    (r,) = real_generator(model).generate([PROMPT], max_new_tokens=1).results
    first = int(np.argmax(prefill_logits(model, PROMPT, kv_cache_dtype="fp8")[-1]))
    assert r.token_ids == [first] == reference_run.token_ids[:1]
    assert r.finish_reason == "length" and r.text == FakeTokenizer().decode([first])


def test_real_model_first_token_stop_and_stop_in_prompt(model, reference_run):
    first = reference_run.token_ids[0]
    (r,) = real_generator(model, stop_token_ids=[first]).generate([PROMPT], max_new_tokens=8).results
    assert (r.token_ids, r.text, r.finish_reason) == ([first], "", "stop")
    # a stop token that the prompt holds and that the generation samples later on: only the sampled copy stops
    prompt = [*PROMPT, *reference_run.token_ids]  # 15 tokens, so that the generation repeats one of them
    ref = real_generator(model).generate([prompt], max_new_tokens=24).results[0]
    in_prompt = [t for t in ref.token_ids if t in prompt]
    assert in_prompt, "the seeded case must hold a token of the prompt"
    stop = in_prompt[0]
    (r,) = real_generator(model, stop_token_ids=[stop]).generate([prompt], max_new_tokens=24).results
    cut = ref.token_ids.index(stop)
    assert r.finish_reason == "stop" and r.token_ids == ref.token_ids[: cut + 1]
    assert r.text == FakeTokenizer().decode(ref.token_ids[:cut])


def test_real_model_continuous_batch_edge_cases_match_generate_alone(model, reference_run):
    """The same edge cases through ContinuousBatch together with an ordinary request: each equals its
    ``Generator.generate`` alone."""
    first = reference_run.token_ids[0]
    stopping = real_generator(model, stop_token_ids=[first])
    other = [int(t) for t in np.random.default_rng(1832).integers(0, 256, 5)]
    requests = {0: (PROMPT, 8), 1: ([first, *other], 6), 2: (other, 1), 3: ([*PROMPT, 7], 1)}
    batch = ContinuousBatch(stopping, num_blocks=sum(blocks_for(len(p) + n - 1, 4) for p, n in requests.values()))
    for i, (prompt, n) in requests.items():
        batch.add(i, prompt, n)
    finished, tokens, _, results = run_steps(batch, max_steps=40)
    assert finished[0][:1] == [0]  # the first-token stop finishes in the prefill step
    assert {2, 3} <= set(finished[0])  # so does every max_new_tokens = 1 request
    for i, (prompt, n) in requests.items():
        want = real_generator(model, stop_token_ids=[first]).generate([prompt], max_new_tokens=n).results[0]
        got = results[i]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), i
        assert tokens[i] == want.token_ids
    assert results[0].token_ids == [first] and results[0].finish_reason == "stop"
    assert batch.manager.num_free_blocks == batch.num_blocks
