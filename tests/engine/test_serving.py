"""The server's engine side: ``ContinuousBatch`` (the generator's loop as steps, requests joining and
leaving between them) and ``EngineLoop`` (that loop on its own thread, fed through queues).

The oracle of every output is ``Generator.generate`` of the same request alone: continuous batching
must not change what a request gets (greedy tokens; seeded sampling, whose rng is per request).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.engine import FakeStreamDecoder, FakeTokenizer, random_model, tiny_config

from fp8lab.engine.generate import ContinuousBatch, Generator
from fp8lab.engine.kv_manager import KVCacheExhausted, blocks_for
from fp8lab.engine.sampling import SamplingParams
from fp8lab.engine.serving import EngineLoop, FinishEvent, Request, TokenEvent

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=21)[0]


def make_generator(model, **kw) -> Generator:
    kw.setdefault("stop_token_ids", ())
    return Generator(model, FakeTokenizer(), stream_decoder=FakeStreamDecoder, **kw)


def alone(model, prompt, max_new_tokens, sampling=SamplingParams(), seed=None):
    """The oracle: ``generate`` of this one request (its rng: ``[seed, 0]``)."""
    return make_generator(model).generate([prompt], max_new_tokens=max_new_tokens, sampling=sampling,
                                          seed=seed).results[0]


def random_prompt(rng, vocab, low=1, high=12):
    return rng.integers(0, vocab, int(rng.integers(low, high))).tolist()


# ---------------------------------------------------------------------------- ContinuousBatch


def test_requests_joining_mid_run_get_what_they_get_alone(model, rng):
    """Requests join at different steps, greedy and seeded sampling mixed (so decode steps take the
    logits path): every result equals that request generated alone."""
    vocab = model.config.vocab_size
    requests = [(random_prompt(rng, vocab), int(rng.integers(1, 9)), SAMPLED if i % 2 else SamplingParams(), 100 + i)
                for i in range(6)]
    batch = ContinuousBatch(make_generator(model), num_blocks=64)
    results, joined = {}, 0
    for step in range(200):
        if joined < len(requests) and step % 3 == 0:
            prompt, n, sampling, seed = requests[joined]
            batch.add(joined, prompt, n, sampling, seed, rng_index=0)
            joined += 1
        for r in batch.step():
            results[r.index] = r
        if joined == len(requests) and not batch.busy:
            break
    assert sorted(results) == list(range(len(requests)))
    for i, (prompt, n, sampling, seed) in enumerate(requests):
        want = alone(model, prompt, n, sampling, seed)
        assert results[i].token_ids == want.token_ids, i
        assert results[i].text == want.text and results[i].finish_reason == want.finish_reason
    assert batch.manager.num_free_blocks == batch.num_blocks


def test_abort_frees_the_blocks_at_once_and_the_others_go_on(model, rng):
    vocab = model.config.vocab_size
    prompts = [random_prompt(rng, vocab, 4, 10) for _ in range(3)]
    batch = ContinuousBatch(make_generator(model), num_blocks=32)
    for i, p in enumerate(prompts):
        batch.add(i, p, 12)
    batch.step()  # the prefill: every sequence holds blocks now
    batch.step()
    before = batch.manager.num_free_blocks
    aborted = batch.abort(1)
    assert aborted.finish_reason == "abort" and aborted.index == 1 and len(aborted.token_ids) == 2
    assert batch.manager.num_free_blocks > before
    assert batch.abort(1) is None  # gone
    results = {}
    while batch.busy:
        results.update((r.index, r) for r in batch.step())
    assert sorted(results) == [0, 2]
    for i in (0, 2):
        assert results[i].token_ids == alone(model, prompts[i], 12).token_ids
    assert batch.manager.num_free_blocks == batch.num_blocks


def test_a_request_waits_until_blocks_free(model):
    """A cache with room for one request at a time: the second waits (it is not refused), then runs."""
    generator = make_generator(model, block_size=4)
    need = blocks_for(5 + 8 - 1, 4)
    batch = ContinuousBatch(generator, num_blocks=need)
    batch.add(0, [1, 2, 3, 4, 5], 8)
    batch.add(1, [6, 7, 8, 9, 10], 8)
    batch.step()
    assert [s.index for s in batch.running] == [0] and [s.index for s in batch.waiting] == [1]
    done = []
    while batch.busy:
        done += [r.index for r in batch.step()]
    assert done == [0, 1]


class RecordingModel:
    """Wraps a model; records ``(tokens, sequences)`` of every forward."""

    def __init__(self, model):
        self.model, self.config, self.shapes = model, model.config, []

    def allocate_kv_cache(self, *args):
        return self.model.allocate_kv_cache(*args)

    def forward(self, batch, cache, all_logits=False):
        self.shapes.append((len(batch.token_ids), batch.num_seqs))
        return self.model.forward(batch, cache, all_logits)

    def greedy_tokens(self, batch, cache):
        self.shapes.append((len(batch.token_ids), batch.num_seqs))
        return self.model.greedy_tokens(batch, cache)


def test_the_limits_of_the_gpu_models_buffers(model, rng):
    """``max_num_seqs`` caps the running sequences, ``max_num_tokens`` the tokens of a prefill step;
    the results stay those of each request alone."""
    vocab = model.config.vocab_size
    recording = RecordingModel(model)
    generator = make_generator(recording, prefill_chunk_size=6)
    batch = ContinuousBatch(generator, num_blocks=64, max_num_seqs=2, max_num_tokens=8)
    prompts = [random_prompt(rng, vocab, 3, 14) for _ in range(5)]
    for i, p in enumerate(prompts):
        batch.add(i, p, 5)
    results = {}
    while batch.busy:
        assert len(batch.running) <= 2
        results.update((r.index, r) for r in batch.step())
    assert all(t <= 8 and s <= 2 for t, s in recording.shapes), recording.shapes
    assert any(s == 2 for _, s in recording.shapes)  # the limit was reached, not just respected
    for i, p in enumerate(prompts):
        assert results[i].token_ids == alone(model, p, 5).token_ids
    with pytest.raises(ValueError, match="max_num_seqs"):
        ContinuousBatch(generator, num_blocks=4, max_num_seqs=0)


def test_bad_requests_are_refused_before_anything_is_queued(model):
    batch = ContinuousBatch(make_generator(model, block_size=4), num_blocks=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batch.add(0, [1, 2], 0)
    with pytest.raises(ValueError, match="empty"):
        batch.add(0, [], 4)
    with pytest.raises(KVCacheExhausted):
        batch.add(0, list(range(1, 20)), 4)
    batch.add(0, [1, 2], 2)
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add(0, [3], 2)
    assert len(batch.waiting) == 1


# ---------------------------------------------------------------------------- EngineLoop


class Collector:
    """``on_event`` of one request: its events, and a flag set at its ``FinishEvent``."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, FinishEvent):
            self.done.set()

    @property
    def result(self):
        assert self.done.wait(60), "no FinishEvent"
        finish = self.events[-1]
        assert isinstance(finish, FinishEvent) and all(isinstance(e, TokenEvent) for e in self.events[:-1])
        return finish.result

    @property
    def streamed_ids(self):
        return [t for e in self.events[:-1] for t in e.token_ids]

    @property
    def streamed_text(self):
        return "".join(e.text for e in self.events[:-1])


@pytest.fixture
def loop(model):
    engine = EngineLoop(make_generator(model), num_blocks=48)
    engine.start()
    yield engine
    engine.shutdown()


def test_concurrent_submissions_from_threads_match_alone(model, loop, rng):
    vocab = model.config.vocab_size
    requests = [Request(random_prompt(rng, vocab), int(rng.integers(1, 10)), SAMPLED if i % 3 == 0 else SamplingParams(),
                        seed=i) for i in range(12)]
    collectors = [Collector() for _ in requests]
    threads = [threading.Thread(target=loop.submit, args=(r, c)) for r, c in zip(requests, collectors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, c in zip(requests, collectors):
        got, want = c.result, alone(model, r.prompt_ids, r.max_new_tokens, r.sampling, r.seed)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert c.streamed_ids == got.token_ids and c.streamed_text == got.text  # every token and piece, once
    state = loop.state
    assert state.running == state.waiting == 0 and state.free_blocks == state.num_blocks


def test_abort_from_another_thread(model, loop):
    c = Collector()
    request_id = loop.submit(Request([1, 2, 3], 10_000 // 1000), c)
    loop.abort(request_id)
    result = c.result
    assert result.finish_reason in ("abort", "length")  # it may have finished first: 10 tokens are quick
    loop.abort(request_id)  # after the finish: nothing happens
    other = Collector()
    loop.submit(Request([4, 5], 3), other)
    assert other.result.token_ids == alone(model, [4, 5], 3).token_ids


def test_submit_checks_at_once(model, loop):
    with pytest.raises(ValueError, match="max_new_tokens"):
        loop.submit(Request([1], 0), Collector())
    with pytest.raises(ValueError, match="empty"):
        loop.submit(Request([], 3), Collector())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        loop.submit(Request([1] * model.config.max_position_embeddings, 3), Collector())
    small = EngineLoop(make_generator(model, block_size=4), num_blocks=2)
    small.start()
    try:
        with pytest.raises(KVCacheExhausted):
            small.submit(Request(list(range(1, 20)), 3), Collector())
    finally:
        small.shutdown()


class FailingModel:
    """Wraps a model; its forwards raise while ``fail`` is set."""

    def __init__(self, model):
        self.model, self.config, self.fail = model, model.config, False

    def allocate_kv_cache(self, *args):
        return self.model.allocate_kv_cache(*args)

    def forward(self, batch, cache, all_logits=False):
        if self.fail:
            raise RuntimeError("a broken forward")
        return self.model.forward(batch, cache, all_logits)

    def greedy_tokens(self, batch, cache):
        if self.fail:
            raise RuntimeError("a broken forward")
        return self.model.greedy_tokens(batch, cache)


def test_a_failing_forward_fails_its_requests_and_the_loop_goes_on(model):
    failing = FailingModel(model)
    engine = EngineLoop(make_generator(failing), num_blocks=16)
    engine.start()
    try:
        failing.fail = True
        c = Collector()
        engine.submit(Request([1, 2, 3], 4), c)
        result = c.result
        assert result.finish_reason == "error" and "a broken forward" in result.error
        failing.fail = False
        ok = Collector()
        engine.submit(Request([1, 2, 3], 4), ok)
        assert ok.result.token_ids == alone(model, [1, 2, 3], 4).token_ids
    finally:
        engine.shutdown()


def test_a_failing_callback_drops_only_its_request(model, loop, capsys):
    def broken(event):
        raise KeyError("the callback's own bug")

    loop.submit(Request([1, 2, 3], 6), broken)
    c = Collector()
    loop.submit(Request([7, 8], 5), c)
    assert c.result.token_ids == alone(model, [7, 8], 5).token_ids
    assert np.all([loop.state.free_blocks == loop.state.num_blocks])
    assert "event callback of request" in capsys.readouterr().err
