"""Pipelined greedy decode: step ``n + 1`` is enqueued before step ``n``'s token ids reach the host.

A greedy decode step needs the token step ``n`` chose, but only as an id for the embedding, and that id
is already on the device: the step's argmax (``layers.argmax_rows``, the last kernel of the decode plan)
writes it into the cache's decode index, ``decode_index.token_ids``, exactly where the next step's
embedding reads its ids. So the host can build and enqueue step ``n + 1`` (``make_batch``, the model's
checks, the index copy without the token ids, the graph launch: 90 to 230 us of host time per step on
the H200, ``bench/RESULTS.md``) while the GPU still runs step ``n``, and then read step ``n``'s ids (4
bytes per sequence) to stream its text. The GPU goes from one step to the next without waiting for the
host; the host's work per step is hidden as long as it is shorter than the GPU's.

``CudaQwen3Model.submit_greedy(batch, cache, feed=pending)`` is that step: ``feed`` is the step whose ids
this batch takes, row for row (the same sequences in the same order; the batch's own token ids are
placeholders). ``fp8lab.engine.generate.ContinuousBatch`` chains steps so while every running sequence
is greedy and none joins, leaves or reaches its length limit; a sequence that samples a stop token has
had one more step enqueued, whose row is dropped.

Host buffers: each step in flight needs its own page-locked copy of the decode index (the host fills
step ``n + 1``'s while the copy-in of step ``n``'s may still be queued) and of its ids (copied out after
the step). ``DecodeStaging`` holds ``STAGING_SLOTS`` of each, used in turn; taking a slot first waits
for the step that used it last, so nothing a pending copy reads or writes is ever overwritten.
"""

from __future__ import annotations

import time

import numpy as np

from .memory import DeviceMemory, new_event, wait

STAGING_SLOTS = 2
"""Decode steps whose host buffers can be in use at once: the step the GPU runs and the one enqueued behind it."""


class PendingGreedy:
    """A decode step enqueued by ``CudaQwen3Model.submit_greedy``: ``tokens()`` waits for it and returns its
    greedy ids, int64 ``[num_seqs]`` (``NAN_ROW``, -1, for a row whose logits hold NaN)."""

    def __init__(self, staging: DecodeStaging, slot: int, num_seqs: int, start: float, on_done):
        self.num_seqs = num_seqs
        self._staging, self._slot, self._start, self._on_done = staging, slot, start, on_done
        self._ids: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """The step's greedy ids (waits for the step the first time)."""
        if self._ids is None:
            wait(self._staging.events[self._slot])
            self._ids = np.array(self._staging.ids[self._slot][: self.num_seqs], dtype=np.int64)
            self._on_done(time.perf_counter() - self._start)
        return self._ids


class DecodeStaging:
    """The host side of one cache's decode steps in flight: ``STAGING_SLOTS`` slots used in turn, slot ``i``
    being the decode index's host copy ``i`` (``StagedIndex.hosts[i]``), a page-locked buffer ``ids[i]`` for
    the step's greedy ids and an event ``events[i]`` recorded after they are copied out; ``last`` is the last
    greedy step enqueued on the cache (the only one a next step may take its ids from)."""

    def __init__(self, memory: DeviceMemory, max_num_seqs: int):
        self.ids = [memory.pinned((max_num_seqs,), np.int32) for _ in range(STAGING_SLOTS)]
        self.events = [new_event() for _ in range(STAGING_SLOTS)]
        self.owners: list[PendingGreedy | None] = [None] * STAGING_SLOTS
        self.last: PendingGreedy | None = None
        self._next = 0

    def take(self) -> int:
        """The next slot, free: the step that used it last is complete and its ids are on the host (this
        waits for that step when nobody has asked for its ids yet)."""
        slot = self._next
        self._next = (slot + 1) % STAGING_SLOTS
        owner, self.owners[slot] = self.owners[slot], None
        if owner is not None:
            owner.tokens()
        return slot
