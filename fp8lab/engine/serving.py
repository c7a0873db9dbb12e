"""The engine loop a server runs: one thread owns the model and a ``ContinuousBatch``; other threads hand
requests in and get their tokens back through queues.

    loop = EngineLoop(generator, num_blocks)      # generator: fp8lab.engine.generate.Generator
    loop.start()
    rid = loop.submit(Request(prompt_ids, max_new_tokens=32), on_event)   # any thread
    ...                                            # on_event(TokenEvent / FinishEvent), engine thread
    loop.abort(rid)                                # any thread: the sequence and its KV blocks go at once
    loop.shutdown()

- **One place runs the model.** Only the loop's thread calls the model, the cache and the KV
  manager. ``submit`` checks a request at once (``ValueError`` for a bad one, ``KVCacheExhausted``
  for one that can never fit) and queues it; ``abort`` queues a cancellation. Between two steps the
  thread takes every queued submission and cancellation, then runs one ``ContinuousBatch.step``, so
  every running request shares that step's forward (continuous batching); with nothing to do it
  sleeps on the queue.
- **Admission.** Requests join in submission order while their worst case fits the cache beside the
  running ones (``fp8lab.engine.generate``); the rest wait, and join as finished or aborted requests
  free their blocks. Nothing that can fit is refused.
- **Events** go to the request's ``on_event``, called on the loop's thread (keep it short: hand the
  event to your own queue): a ``TokenEvent`` per step that gave the request tokens (their ids and
  the text they complete, possibly empty), then one ``FinishEvent`` with its
  ``fp8lab.engine.generate.GenerationResult``: ``finish_reason`` ``"stop"``, ``"length"``, ``"error"``
  or ``"abort"``. A request gets nothing after its ``FinishEvent``.
- **Failures.** A forward that raises (say a ``NonFiniteError``) fails the running requests, each
  with a ``FinishEvent`` of ``finish_reason`` ``"error"`` naming the exception; the loop then goes
  on with the waiting ones on a fresh cache. An exception in an ``on_event`` callback is the
  callback's: it is reported on stderr and that request is aborted; the others go on.
- **Seeds.** A request's rng is ``default_rng([seed, 0])``, as ``fp8lab generate --seed`` gives its
  first prompt, whatever else runs beside it.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from dataclasses import dataclass, replace
from typing import Callable

from .generate import ContinuousBatch, GenerationResult, Generator
from .sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    """What a client asks for: prompt token ids, at most ``max_new_tokens`` new tokens (clamped to the
    model's positions), the sampling parameters and an optional seed."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of request ``request_id`` from one step, and the text they complete ("" while a
    UTF-8 character or a stop token is incomplete)."""

    request_id: int
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class FinishEvent:
    """Request ``request_id`` is done; nothing follows."""

    request_id: int
    result: GenerationResult


Event = TokenEvent | FinishEvent


@dataclass(frozen=True)
class LoopState:
    """A snapshot, taken on the loop's thread between steps."""

    waiting: int
    running: int
    free_blocks: int
    num_blocks: int
    steps: int


class EngineLoop:
    """Serves ``generator``'s model over one KV cache of ``num_blocks`` blocks, at most ``max_num_seqs``
    sequences and ``max_num_tokens`` prefill tokens per step (``ContinuousBatch``); see the module
    docstring."""

    def __init__(self, generator: Generator, num_blocks: int, max_num_seqs: int | None = None,
                 max_num_tokens: int | None = None):
        self.generator = generator
        self._limits = (max_num_seqs, max_num_tokens)
        self.batch = ContinuousBatch(generator, num_blocks, *self._limits)
        self._commands: queue.Queue = queue.Queue()
        self._listeners: dict[int, Callable[[Event], None]] = {}
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._steps = 0
        self._state = LoopState(0, 0, num_blocks, num_blocks, 0)

    # -- any thread

    def start(self) -> None:
        """Start the loop's thread (once)."""
        if self._thread is not None:
            raise RuntimeError("EngineLoop: already started")
        self._thread = threading.Thread(target=self._run, name="fp8lab-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop after its current step; queued and running requests get no more events."""
        self._stopping.set()
        self._commands.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> int:
        """Queue ``request``; returns its id. Checked here, at once: ``ValueError`` for a bad request (an
        empty prompt, one that leaves the model no position, ``max_new_tokens < 1``) and
        ``fp8lab.engine.kv_manager.KVCacheExhausted`` for one that cannot fit even in the empty cache."""
        if self._thread is None or self._stopping.is_set():
            raise RuntimeError("EngineLoop: not running (start it first)")
        with self._id_lock:
            request_id = self._next_id
            self._next_id += 1
        sequence = self.batch.new_request(request_id, request.prompt_ids, request.max_new_tokens, request.sampling,
                                          request.seed, rng_index=0)
        self._commands.put(("submit", request_id, (sequence, on_event)))
        return request_id

    def abort(self, request_id: int) -> None:
        """Cancel request ``request_id`` (a no-op once it has finished); it gets a ``FinishEvent`` with
        ``finish_reason`` ``"abort"`` and its KV blocks are free before the next step."""
        self._commands.put(("abort", request_id, None))

    @property
    def state(self) -> LoopState:
        """The loop as it was before the last event it sent (or after its last step)."""
        return self._state

    # -- the loop's thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._take_commands(block=not self.batch.busy)
            if self._stopping.is_set():
                break
            if self.batch.busy:
                self._step()
            self._refresh_state()

    def _refresh_state(self) -> None:
        self._state = LoopState(len(self.batch.waiting), len(self.batch.running), self.batch.manager.num_free_blocks,
                                self.batch.num_blocks, self._steps)

    def _take_commands(self, block: bool) -> None:
        """Every queued command; with ``block``, wait for the first."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            kind, request_id, payload = command
            if kind == "submit":
                sequence, on_event = payload
                self._listeners[request_id] = on_event
                self.batch.enqueue(sequence)  # checked in submit; its id is new
            elif kind == "abort":
                result = self.batch.abort(request_id)
                if result is not None:
                    self._emit(FinishEvent(request_id, result))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        tokens: dict[int, list[int]] = {}
        texts: dict[int, list[str]] = {}
        try:
            finished = self.batch.step(on_text=lambda i, piece: texts.setdefault(i, []).append(piece),
                                       on_tokens=lambda i, ids: tokens.setdefault(i, []).extend(ids))
        except Exception as e:  # the forward failed: every request of this batch fails, the loop goes on
            self._fail_batch(e)
            return
        self._steps += 1
        for request_id in tokens.keys() | texts.keys():
            self._emit(TokenEvent(request_id, tokens.get(request_id, []), "".join(texts.get(request_id, []))))
        for result in finished:
            self._emit(FinishEvent(result.index, result))

    def _emit(self, event: Event) -> None:
        self._refresh_state()  # what a listener sees of the loop is never older than its event
        listener = self._listeners.get(event.request_id)
        if listener is None:
            return
        if isinstance(event, FinishEvent):
            del self._listeners[event.request_id]
        try:
            listener(event)
        except Exception:  # the callback's bug: report it, drop that request, serve the others
            print(f"fp8lab serve: the event callback of request {event.request_id} failed:", file=sys.stderr)
            traceback.print_exc()
            self._listeners.pop(event.request_id, None)
            self.batch.abort(event.request_id)

    def _fail_batch(self, error: Exception) -> None:
        message = f"the forward failed: {type(error).__name__}: {error}"
        waiting = list(self.batch.waiting)
        for s in list(self.batch.running):
            result = self.batch.abort(s.index)
            self._emit(FinishEvent(s.index, replace(result, finish_reason="error", error=f"request {s.index}: {message}")))
        self.batch = ContinuousBatch(self.generator, self.batch.num_blocks, *self._limits)  # a fresh cache
        self.batch.waiting.extend(waiting)
