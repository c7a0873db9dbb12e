"""What the GPU model did: forwards, decode steps, graph captures and replays, launches, host and wall time.

Host time is the time until a step's work is enqueued (index copies, launches or the graph launch, the
copy out); the rest of a step's wall time is the GPU (and, for pipelined greedy steps,
``fp8lab.engine.cuda.pipeline``, the step enqueued before it, so wall times overlap). The launch count of a decode step is its plan's
(``fp8lab.engine.cuda.plan.Plan.kernel_launches``), recorded when the step of a bucket first runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CudaModelStats:
    """What the model did. Host time: from ``forward``'s (``greedy_tokens``', ``submit_greedy``'s) entry until
    all of the step's work is enqueued (index copies, launches or the graph launch, the copy out); wall time:
    until the logits (the ids) are on the host."""

    prefill_forwards: int = 0
    decode_steps: int = 0
    graph_replays: int = 0
    """Decode steps run as a graph replay."""
    prefill_graph_replays: int = 0
    """Prefills run as a graph replay (``CudaQwen3Model.prefill_shape``)."""
    graphs_captured: int = 0
    capture_seconds: float = 0.0
    decode_host_seconds: float = 0.0
    decode_wall_seconds: float = 0.0
    replay_host_seconds: float = 0.0
    launches_by_bucket: dict[int, int] = field(default_factory=dict)
    """Kernel launches of one decode step (eager or captured) per batch bucket."""
    last_decode_bucket: int | None = None
    graph_error: str | None = None

    @property
    def launches_per_decode_step(self) -> int | None:
        """Kernel launches of the last decode step's bucket (one graph replay runs them all)."""
        return self.launches_by_bucket.get(self.last_decode_bucket)

    @property
    def host_us_per_decode_step(self) -> float:
        """Mean host time of every decode step, the eager ones included: a bucket's or context bound's first step
        compiles (seconds, on a fresh process) and captures (about 130 ms at Qwen3-0.6B), so this mean says little
        about a steady step; ``host_us_per_replay`` is that."""
        return 1e6 * self.decode_host_seconds / self.decode_steps if self.decode_steps else float("nan")

    @property
    def wall_us_per_decode_step(self) -> float:
        return 1e6 * self.decode_wall_seconds / self.decode_steps if self.decode_steps else float("nan")

    @property
    def host_us_per_replay(self) -> float:
        return 1e6 * self.replay_host_seconds / self.graph_replays if self.graph_replays else float("nan")

    def as_dict(self) -> dict:
        return {
            "prefill_forwards": self.prefill_forwards, "decode_steps": self.decode_steps,
            "graph_replays": self.graph_replays, "prefill_graph_replays": self.prefill_graph_replays,
            "graphs_captured": self.graphs_captured,
            "capture_seconds": self.capture_seconds, "launches_per_decode_step": self.launches_per_decode_step,
            "launches_by_bucket": dict(self.launches_by_bucket),
            "host_us_per_decode_step": self.host_us_per_decode_step,
            "wall_us_per_decode_step": self.wall_us_per_decode_step,
            "host_us_per_replay": self.host_us_per_replay, "graph_error": self.graph_error,
        }
