"""Text generation: prefill, then step-by-step decode of a batch of prompts over a paged KV cache.

The loop (continuous batching, as in nano-vllm, without preemption)::

    while requests wait or run:
        admit waiting requests while their worst case fits in the cache
        if a running sequence still has prompt tokens: a PREFILL step (its next chunk)
        else: a DECODE step (one new token for every running sequence)
        sample each sequence that has reached its end, stream its text, retire the finished

``ContinuousBatch`` is that loop one step at a time (requests may join and leave between steps, each
with its own sampling parameters); ``Generator.generate`` runs it to the end over its prompts.

- **Admission.** A request reserves its worst case at admission: the cache holds at most
  ``prompt + max_new_tokens - 1`` of its tokens (the last sampled token is never written), so
  ``ceil(that / block_size)`` blocks. Requests are admitted in order while the reservations
  fit; a finished sequence frees its blocks and lets the next in. So a running sequence never
  runs out of blocks mid-generation. A request that does not fit even in an empty cache raises
  ``KVCacheExhausted`` before anything is computed.
- **Prefill first.** Prefill steps take priority over decode steps (so timing splits cleanly):
  prompt tokens per second = prompt tokens / time in prefill steps; decode tokens per second =
  tokens sampled in decode steps / time in decode steps. The first token of each sequence is
  sampled from its prefill logits and counts as neither (it is the time to first token).
- **Stopping.** A sequence finishes with ``"stop"`` when it samples a stop token (kept in
  ``token_ids``, not in ``text`` and not streamed) and with ``"length"`` after
  ``max_new_tokens`` tokens (or at ``max_position_embeddings``). Sequences finish independently.
- **Streaming.** Each sequence has a ``StreamDecoder`` (``fp8lab.engine.tokenizer``) that turns token
  ids into complete UTF-8 text pieces; ``on_text(index, piece)`` gets every piece, and the
  pieces of a sequence concatenate to its final ``text``.
- **Sampling.** ``fp8lab.engine.sampling``; request ``i`` draws from ``np.random.default_rng([seed, i])``,
  so a seed reproduces it whatever else is in the batch. Padding ids (the model's vocabulary
  beyond the tokenizer's ``vocab_size``: Qwen3 pads 151669 ids to 151936 rows) are never chosen:
  their logits are masked to ``-inf`` before sampling and greedy argmax.
- **Failures.** One sequence's problem never loses the others' results: when choosing or decoding
  its next token fails (NaN logits, an id the tokenizer cannot decode), that sequence alone
  finishes with ``"error"`` and a message naming it and the token number; the others go on. A
  failing *forward* (for example ``fp8lab.engine.model.NonFiniteError``) concerns the whole batch and
  raises; sequences finished before it have already been given to ``on_finish``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from fp8lab.reference.dense import NAN_ROW
from fp8lab.reference.kv_cache import kv_cache_format

from .kv_manager import KVCacheExhausted, KVCacheManager, blocks_for
from .model import CausalLM, make_batch
from .sampling import SamplingParams, sample


@dataclass
class GenerationResult:
    """One request's outcome. ``token_ids``: generated ids (a final stop token included);
    ``text``: their decoded text without the stop token; ``finish_reason``: ``"stop"``,
    ``"length"``, ``"error"`` (then ``error`` says what went wrong, and ``text`` is what was
    streamed before) or ``"abort"`` (``ContinuousBatch.abort``: dropped by its caller); times in
    seconds since the start of ``generate`` (of the ``ContinuousBatch``)."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    first_token_time: float
    finish_time: float
    error: str | None = None


@dataclass
class GenerationStats:
    """Throughput of one ``generate`` call (see the module docstring for what counts where)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def summary(self) -> str:
        return (f"prompt: {self.prompt_tokens} tokens in {self.prompt_seconds:.3f} s "
                f"({self.prompt_tokens_per_s:.1f} tokens/s); decode: {self.decode_tokens} tokens in "
                f"{self.decode_seconds:.3f} s ({self.decode_tokens_per_s:.1f} tokens/s)")


@dataclass
class GenerationOutput:
    results: list[GenerationResult]
    stats: GenerationStats


@dataclass(eq=False)
class _Sequence:
    """A request while it runs."""

    index: int
    prompt: list[int]
    max_new_tokens: int
    rng: np.random.Generator
    decoder: object | None
    sampling: SamplingParams = SamplingParams()
    output: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    streamed: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float = float("nan")

    @property
    def max_cached_tokens(self) -> int:
        """Most tokens this sequence will ever hold in the cache."""
        return len(self.prompt) + self.max_new_tokens - 1


def collect_stop_token_ids(tokenizer=None, generation_config: dict | None = None, config=None) -> tuple[int, ...]:
    """The union of the tokenizer's ``eos_token_ids``, ``generation_config``'s ``eos_token_id``
    (an id or a list) and the model config's; sorted."""
    ids: set[int] = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    eos = (generation_config or {}).get("eos_token_id")
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if config is not None:
        ids.update(config.eos_token_ids)
    return tuple(sorted(int(i) for i in ids))


def sampleable_token_ids(model_vocab_size: int, tokenizer=None) -> int:
    """How many ids, from 0 up, a generated token may take: the model's vocabulary, cut to the
    tokenizer's ``vocab_size`` when that is smaller (the ids above are padding, no text decodes
    to them). A tokenizer without ``vocab_size`` (or none) cuts nothing."""
    n = getattr(tokenizer, "vocab_size", None)
    return model_vocab_size if n is None else min(model_vocab_size, int(n))


def _default_stream_decoder(tokenizer):
    from .tokenizer import StreamDecoder

    return StreamDecoder(tokenizer)


class Generator:
    """Generates text with a model (``fp8lab.engine.model.CausalLM``) over a paged KV cache of its own.

    ``kv_format``: the KV cache's format (a ``fp8lab.reference.kv_cache.KVCacheFormat`` or its name).
    ``num_blocks=None`` sizes the cache for every request of a ``generate`` call at once.
    ``prefill_chunk_size`` splits long prompts into chunks (None: one chunk).
    ``stream_decoder(tokenizer)`` makes the per-sequence streaming decoder (default:
    ``fp8lab.engine.tokenizer.StreamDecoder``).
    """

    def __init__(
        self,
        model: CausalLM,
        tokenizer=None,
        *,
        kv_format="fp8",
        block_size: int = 16,
        num_blocks: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prefill_chunk_size: int | None = None,
        stream_decoder: Callable | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.kv_format = kv_cache_format(kv_format)
        if int(block_size) <= 0 or (num_blocks is not None and int(num_blocks) <= 0):
            raise ValueError(f"block_size ({block_size}) and num_blocks ({num_blocks}) must be positive")
        self.block_size = int(block_size)
        self.num_blocks = num_blocks
        self.stop_token_ids = frozenset(
            stop_token_ids if stop_token_ids is not None else collect_stop_token_ids(tokenizer, None, model.config))
        if prefill_chunk_size is not None and prefill_chunk_size <= 0:
            raise ValueError(f"prefill_chunk_size: expected a positive number of tokens, got {prefill_chunk_size}")
        self.prefill_chunk_size = prefill_chunk_size
        self.stream_decoder = stream_decoder or _default_stream_decoder
        self.num_token_ids = sampleable_token_ids(model.config.vocab_size, tokenizer)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        max_new_tokens: int = 64,
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        on_text: Callable[[int, str], None] | None = None,
        on_finish: Callable[[GenerationResult], None] | None = None,
    ) -> GenerationOutput:
        """Generate for every prompt (a string, or token ids); results in prompt order.

        ``on_text(index, piece)`` gets each new text piece of request ``index`` as it is
        generated; ``on_finish(result)`` gets each result as soon as its sequence finishes.
        """
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        seqs = [self._new_sequence(i, p, max_new_tokens, seed, sampling) for i, p in enumerate(prompts)]
        num_blocks = self.num_blocks or sum(blocks_for(s.max_cached_tokens, self.block_size) for s in seqs)
        batch = ContinuousBatch(self, num_blocks)
        for s in seqs:  # fail before any work when a request cannot fit even alone
            batch.check_fits(s)
        for s in seqs:
            batch.waiting.append(s)
        results: list[GenerationResult | None] = [None] * len(seqs)
        while batch.busy:
            for result in batch.step(on_text):
                results[result.index] = result
                if on_finish:
                    on_finish(result)
        return GenerationOutput(results, batch.stats)

    # -- steps of the loop

    def _new_sequence(self, index: int, prompt, max_new_tokens: int, seed: int | None,
                      sampling: SamplingParams = SamplingParams(), rng_index: int | None = None) -> _Sequence:
        """Request ``index`` (its rng is ``default_rng([seed, rng_index])``, ``rng_index`` defaulting to
        ``index``), after the checks of its prompt."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty: a sequence needs at least one token")
        max_pos = self.model.config.max_position_embeddings
        if len(ids) >= max_pos:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; the model's max_position_embeddings is {max_pos}")
        rng_key = index if rng_index is None else rng_index
        rng = np.random.default_rng([seed, rng_key]) if seed is not None else np.random.default_rng()
        decoder = self.stream_decoder(self.tokenizer) if self.tokenizer is not None else None
        return _Sequence(index, ids, min(max_new_tokens, max_pos - len(ids)), rng, decoder, sampling)

    def _admit(self, waiting: deque, running: list, manager: KVCacheManager, max_running: int | None = None) -> None:
        """Admit waiting requests in order while their worst-case blocks fit beside the running ones' (and
        fewer than ``max_running`` run)."""
        reserved = sum(blocks_for(s.max_cached_tokens, self.block_size) for s in running)
        while waiting and (max_running is None or len(running) < max_running):
            need = blocks_for(waiting[0].max_cached_tokens, self.block_size)
            if reserved + need > manager.num_blocks:
                break
            s = waiting.popleft()
            manager.add_sequence(s.index)
            running.append(s)
            reserved += need

    def _prefill_step(self, prefilling: list[_Sequence], manager, cache) -> tuple[list[_Sequence], np.ndarray, int]:
        """The next prompt chunk of every prefilling sequence in one forward; returns the
        sequences whose prompt is now complete (they sample their first token), their logits,
        and the number of prompt tokens processed."""
        chunks = [(s, self._next_prompt_chunk(s)) for s in prefilling]
        logits = self.model.forward(make_batch(manager, [(s.index, ids) for s, ids in chunks]), cache)
        done = [i for i, (s, _) in enumerate(chunks) if s.num_prefilled == len(s.prompt)]
        return [chunks[i][0] for i in done], logits[done], sum(len(ids) for _, ids in chunks)

    def _decode_step(self, running: list[_Sequence], manager, cache) -> np.ndarray:
        """One forward of every running sequence's last sampled token; its logits."""
        return self.model.forward(self._decode_batch(running, manager), cache)

    @staticmethod
    def _decode_batch(running: list[_Sequence], manager):
        """The batch of every running sequence's last sampled token."""
        return make_batch(manager, [(s.index, s.output[-1:]) for s in running])

    def _peek_prompt_chunk(self, s: _Sequence) -> list[int]:
        """The prompt tokens ``s``'s next prefill step takes."""
        end = len(s.prompt)
        if self.prefill_chunk_size is not None:
            end = min(end, s.num_prefilled + self.prefill_chunk_size)
        return s.prompt[s.num_prefilled : end]

    def _next_prompt_chunk(self, s: _Sequence) -> list[int]:
        chunk = self._peek_prompt_chunk(s)
        s.num_prefilled += len(chunk)
        return chunk

    # -- one sequence's next token

    def _greedy_on_device(self, sampling: SamplingParams) -> bool:
        """Whether a decode step takes the model's own greedy ids (``greedy_tokens``: the argmax
        where the logits are, on the device for the GPU model) instead of the logits. Only when no id
        is padding: that argmax runs over every id, and the host cannot mask what it never sees."""
        return sampling.greedy and self.num_token_ids == self.model.config.vocab_size

    def _mask_padding(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with the padding ids' columns at ``-inf``: they can never be chosen."""
        if self.num_token_ids >= logits.shape[-1]:
            return logits
        masked = np.array(logits, dtype=np.float32)  # a copy: the model's array stays as it was
        masked[:, self.num_token_ids:] = -np.inf
        return masked

    def _advance(self, s: _Sequence, choice, sampling: SamplingParams, on_text, now: float) -> None:
        """Give ``s`` its next token, from a (masked) logits row or a device greedy id, and stream
        the text it completes. A failure in choosing or decoding finishes ``s`` alone, with
        ``"error"``; the ``on_text`` callback runs outside, so its own errors are not the sequence's."""
        num_streamed, token_number = len(s.streamed), len(s.output) + 1
        try:
            self._append_token(s, self._choose(s, choice, sampling), now)
        except (ValueError, LookupError, OverflowError) as e:  # what samplers and tokenizers raise
            s.finish_reason = "error"
            s.error = f"request {s.index}, token {token_number}: {e}"
        if on_text:
            for piece in s.streamed[num_streamed:]:
                on_text(s.index, piece)

    def _choose(self, s: _Sequence, choice, sampling: SamplingParams) -> int:
        """The token id: sampled from a logits row, or the device's greedy id; never a padding id."""
        token = sample(choice, sampling, s.rng) if np.ndim(choice) == 1 else int(choice)
        if token == NAN_ROW:
            raise ValueError("logits: contain NaN (the greedy argmax found no token)")
        if not 0 <= token < self.num_token_ids:  # masked ids cannot be sampled: a device id can
            raise ValueError(f"token id {token} is not in [0, {self.num_token_ids}), the ids that can be generated "
                             "(from the tokenizer's vocab_size up they are padding)")
        return token

    def _append_token(self, s: _Sequence, token: int, now: float) -> None:
        """Record ``token``, finish ``s`` at a stop token or its length, and add the text pieces it
        completes to ``s.streamed``."""
        if not s.output:
            s.first_token_time = now
        s.output.append(token)
        if token in self.stop_token_ids:
            s.finish_reason = "stop"
        else:
            if s.decoder is not None:
                self._record(s, s.decoder.push(token))
            if len(s.output) >= s.max_new_tokens:
                s.finish_reason = "length"
        if s.finish_reason and s.decoder is not None:
            # whatever the final decode holds beyond the streamed pieces (an unfinished UTF-8
            # tail, shown as U+FFFD), so that the pieces always add up to ``text``
            self._record(s, self._final_text(s)[len("".join(s.streamed)):])

    @staticmethod
    def _record(s: _Sequence, piece: str) -> None:
        if piece:
            s.streamed.append(piece)

    def _final_text(self, s: _Sequence) -> str:
        if self.tokenizer is None:
            return ""
        if s.finish_reason == "error":  # decoding may be what failed: keep what was streamed
            return "".join(s.streamed)
        ids = s.output[:-1] if s.finish_reason == "stop" else s.output
        full = self.tokenizer.decode(ids)
        streamed = "".join(s.streamed)
        # the streamed pieces are the contract; the full decode only adds an unfinished tail
        return full if full.startswith(streamed) else streamed

    def _result(self, s: _Sequence, now: float) -> GenerationResult:
        return GenerationResult(s.index, s.prompt, s.output, self._final_text(s), s.finish_reason,
                                s.first_token_time, now, s.error)


class ContinuousBatch:
    """The generator's loop one step at a time, over one KV cache of ``num_blocks`` blocks: requests
    join (``add``) and leave (``abort``) between steps, each with its own sampling parameters.

    ``Generator.generate`` runs one to the end over a fixed list of requests; a server
    (``fp8lab.engine.serving.EngineLoop``) keeps one alive and feeds it. A step is the module
    docstring's loop body: admit what fits, one forward (a prefill chunk, else one decode step of every
    running sequence), the next token of each ready sequence, retire the finished. A decode step
    samples on the device (``greedy_tokens``) when every running sequence is greedy, else from the
    logits, each sequence with its own parameters.

    ``max_num_seqs``: at most this many sequences run at once (the rest wait); ``max_num_tokens``: a
    prefill step takes the prefilling sequences' next chunks in order while their tokens fit in it (the
    first always runs; give the generator a ``prefill_chunk_size`` of at most this). Both are what the
    GPU model's preallocated buffers hold; None: no limit.
    """

    def __init__(self, generator: Generator, num_blocks: int, max_num_seqs: int | None = None,
                 max_num_tokens: int | None = None):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_tokens", max_num_tokens)):
            if value is not None and int(value) <= 0:
                raise ValueError(f"{name}: expected a positive number or None, got {value}")
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.generator = generator
        self.manager = KVCacheManager(num_blocks, generator.block_size)
        self.cache = generator.model.allocate_kv_cache(num_blocks, generator.block_size, generator.kv_format)
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.stats = GenerationStats()
        self.start = time.perf_counter()
        self._pending: _GreedyStep | None = None  # a greedy step enqueued ahead (see ``step``)

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    @property
    def busy(self) -> bool:
        """Whether a request waits or runs, or a step enqueued ahead is still to be taken (``step``)."""
        return bool(self.waiting or self.running or self._pending)

    def check_fits(self, s: _Sequence) -> None:
        """``KVCacheExhausted`` when request ``s`` cannot fit even alone in this cache."""
        need = blocks_for(s.max_cached_tokens, self.generator.block_size)
        if need > self.num_blocks:
            raise KVCacheExhausted(need, self.num_blocks, f"request {s.index}: {len(s.prompt)} prompt + "
                                   f"{s.max_new_tokens} new - 1 = {s.max_cached_tokens} tokens in blocks "
                                   f"of {self.generator.block_size}; the whole cache has {self.num_blocks} blocks")

    def new_request(self, index: int, prompt, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                    seed: int | None = None, rng_index: int | None = None) -> _Sequence:
        """Request ``index``, checked, not yet queued: a string or token ids, at most ``max_new_tokens`` new
        tokens (clamped to the model's positions), its own ``sampling`` and rng (``default_rng([seed,
        rng_index])``, ``rng_index`` defaulting to ``index``). A bad request raises ``ValueError``, one that
        cannot fit even alone ``KVCacheExhausted``. Reads nothing that steps change (any thread may call it)."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        s = self.generator._new_sequence(index, prompt, max_new_tokens, seed, sampling, rng_index)
        self.check_fits(s)
        return s

    def enqueue(self, s: _Sequence) -> None:
        """Queue a request from ``new_request`` (its index not already in the batch)."""
        if any(other.index == s.index for other in (*self.waiting, *self.running)):
            raise ValueError(f"request {s.index} is already in the batch")
        self.waiting.append(s)

    def add(self, index: int, prompt, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
            seed: int | None = None, rng_index: int | None = None) -> None:
        """``enqueue(new_request(...))``: nothing is queued when a check fails."""
        if any(s.index == index for s in (*self.waiting, *self.running)):
            raise ValueError(f"request {index} is already in the batch")
        self.enqueue(self.new_request(index, prompt, max_new_tokens, sampling, seed, rng_index))

    def abort(self, index: int) -> GenerationResult | None:
        """Drop request ``index`` now, its KV blocks freed at once; its result (``finish_reason``
        ``"abort"``, the tokens it had), or None when it is not in the batch."""
        s = next((s for s in (*self.waiting, *self.running) if s.index == index), None)
        if s is None:
            return None
        if s in self.running:
            self.running.remove(s)
            self.manager.free(s.index)
        else:
            self.waiting.remove(s)
        s.finish_reason = "abort"
        return self.generator._result(s, time.perf_counter() - self.start)

    def _prefill_group(self) -> list[_Sequence]:
        """The running sequences with prompt tokens left whose next chunks fit in ``max_num_tokens``, in
        order (at least the first)."""
        group, tokens = [], 0
        for s in self.running:
            if s.num_prefilled < len(s.prompt):
                chunk = len(self.generator._peek_prompt_chunk(s))
                if group and self.max_num_tokens is not None and tokens + chunk > self.max_num_tokens:
                    break
                group.append(s)
                tokens += chunk
        return group

    def step(self, on_text: Callable[[int, str], None] | None = None,
             on_tokens: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """One step (see the class docstring); returns the results of the sequences it finished.
        ``on_tokens(index, ids)`` gets each sequence's new token ids (before its text pieces),
        ``on_text(index, piece)`` each new text piece.

        Greedy decode steps on a model that can pipeline them (``submit_greedy``, the GPU model) overlap:
        before a step's ids are read, the next step is enqueued with them as its tokens, on the device
        (``fp8lab.engine.cuda.pipeline``), when it is certain to be wanted but for stop tokens: the same
        sequences, all still greedy, none at its length limit. So a step may find its forward already
        enqueued by the step before (``_pending``); a row of a sequence that finished or was aborted
        meanwhile is dropped.
        """
        g = self.generator
        g._admit(self.waiting, self.running, self.manager, self.max_num_seqs)
        t0 = time.perf_counter()
        if self._pending is not None:
            current, self._pending = self._pending, None
            return self._finish_greedy_step(current, on_text, on_tokens, t0)
        if not self.running:
            return []
        prefilling = self._prefill_group()
        if prefilling:
            ready, logits, num_prompt_tokens = g._prefill_step(prefilling, self.manager, self.cache)
            self._advance_all(ready, g._mask_padding(logits), on_text, on_tokens)
            self.stats.prompt_tokens += num_prompt_tokens
            self.stats.prompt_seconds += time.perf_counter() - t0
            return self._retire_finished()
        if all(g._greedy_on_device(s.sampling) for s in self.running):  # sampled where the logits are
            current = _GreedyStep(list(self.running), self._submit_greedy(g._decode_batch(self.running, self.manager)))
            return self._finish_greedy_step(current, on_text, on_tokens, t0)
        logits = g._decode_step(self.running, self.manager, self.cache)
        self._advance_all(self.running, g._mask_padding(logits), on_text, on_tokens)
        self.stats.decode_tokens += len(self.running)
        self.stats.decode_seconds += time.perf_counter() - t0
        return self._retire_finished()

    # -- the pieces of a step

    def _submit_greedy(self, batch, feed=None):
        """A decode step with greedy sampling where the logits are: enqueued (``submit_greedy``) on a model
        that pipelines, else computed now; either way an object whose ``tokens()`` are its ids."""
        model = self.generator.model
        if hasattr(model, "submit_greedy"):
            return model.submit_greedy(batch, self.cache, feed=feed)
        return _ReadyTokens(model.greedy_tokens(batch, self.cache))

    def _can_chain(self, step: _GreedyStep) -> bool:
        """Whether the step after ``step`` is certain to be a greedy decode step of the same sequences, in
        order, unless one samples a stop token: nothing joined, left or switched to host sampling, and no
        sequence reaches its length limit with ``step``'s token."""
        g = self.generator
        return (hasattr(g.model, "submit_greedy") and self.running == step.seqs  # (so none has prompt left)
                and all(g._greedy_on_device(s.sampling) and len(s.output) + 1 < s.max_new_tokens for s in step.seqs))

    def _finish_greedy_step(self, step: _GreedyStep, on_text, on_tokens, t0: float) -> list[GenerationResult]:
        """Enqueue the next greedy step behind ``step`` where it is certain to be wanted (``_can_chain``), then
        wait for ``step``'s ids and advance its sequences that still run."""
        if self._can_chain(step):
            placeholders = [(s.index, [0]) for s in step.seqs]  # the ids come from ``step``, on the device
            self._pending = _GreedyStep(step.seqs, self._submit_greedy(make_batch(self.manager, placeholders),
                                                                       feed=step.pending))
        ids = step.pending.tokens()
        alive = [(s, i) for s, i in zip(step.seqs, ids) if s in self.running and not s.finish_reason]
        self._advance_all([s for s, _ in alive], [i for _, i in alive], on_text, on_tokens)
        self.stats.decode_tokens += len(alive)
        self.stats.decode_seconds += time.perf_counter() - t0
        return self._retire_finished()

    def _advance_all(self, ready: list[_Sequence], choices, on_text, on_tokens) -> None:
        """Give each ready sequence its next token (``Generator._advance``) and report what it adds."""
        g, now = self.generator, time.perf_counter() - self.start
        for s, choice in zip(ready, choices):
            num_tokens, num_pieces = len(s.output), len(s.streamed)
            g._advance(s, choice, s.sampling, None, now)
            if on_tokens and len(s.output) > num_tokens:
                on_tokens(s.index, s.output[num_tokens:])
            if on_text:
                for piece in s.streamed[num_pieces:]:
                    on_text(s.index, piece)

    def _retire_finished(self) -> list[GenerationResult]:
        """Remove the finished sequences, free their blocks; their results."""
        results = []
        for s in [s for s in self.running if s.finish_reason]:
            self.running.remove(s)
            self.manager.free(s.index)
            results.append(self.generator._result(s, time.perf_counter() - self.start))
        return results


@dataclass(eq=False)
class _GreedyStep:
    """A greedy decode step of ``seqs`` (its rows, in order) whose ids ``pending.tokens()`` gives."""

    seqs: list[_Sequence]
    pending: object


@dataclass(eq=False)
class _ReadyTokens:
    """The ids of a greedy step computed at once (a model that does not pipeline)."""

    ids: np.ndarray

    def tokens(self) -> np.ndarray:
        return self.ids
