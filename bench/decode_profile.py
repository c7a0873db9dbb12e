"""Where a decode step's (or a prefill forward's) time goes: per-kernel times from CUPTI.

    from decode_profile import profile_decode_steps, profile_prefill, breakdown_table
    profile = profile_decode_steps(model, step, cache, steps=20)   # after the step's graph is captured
    print(breakdown_table(profile))
    print(breakdown_table(profile_prefill(model, prompt_batch, cache, repeats=3)))

``profile_decode_steps`` replays the captured decode step ``steps`` times under ``torch.profiler``
(CUDA activities: CUPTI records every kernel of a graph replay, Numba's included) and attributes each
kernel of a step to the launch of the model's plan that made it: the step's plan
(``model.planner.decode``) lists its launches in order, each with a label (``Launch.label``: "q/k/v
gemv", "input norm", ...) and its kernel count, and a replay runs exactly those kernels in that
order. It reports, per step and label: the launches, the time each kernel *adds to the step* (from the
previous kernel's end to its own end: its work plus the gap before it, what removing it would save),
and its CUPTI duration (start to end); then the kernel count, the kernel-busy span (first kernel start
to last kernel end, the sum of the added times) and the *gaps*: span minus the sum of durations. With
programmatic dependent launch (``fp8lab.numba_kernels.pdl``) a kernel starts while its predecessor
runs and its duration includes its wait, so durations overlap, their sum exceeds the span and the
"gap" is negative (the overlap); the added times stay a partition of the span. Nothing here is
imported by the engine (torch is a benchmark dependency only).

``profile_prefill`` does the same for a prefill forward (a graph replay of its padded shape over the tensor-core
prefill attention, after the warm-up run captured it; else eager launches, whose gaps include the host's launch time),
against the labels of the plan the model runs (``model.prefill_shape``, ``model.planner.prefill``) and of the lm_head
of the prompts' last rows (``model.planner.lm_head``), which stays eager. ``attribute`` is the attribution
itself, on ``(name, start_us, duration_us)`` events, with no profiler.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class DecodeProfile:
    """Per-step averages of one profiled decode bucket; times in microseconds."""

    bucket: int
    steps: int
    kernels_per_step: int
    kernel_us: float  # sum of kernel durations
    span_us: float  # first kernel start to last kernel end
    by_label: dict = field(default_factory=dict)  # label -> {"launches": n, "us": duration, "added_us": t}
    attributed: bool = True  # False: the kernel sequence did not match the plan (labels are kernel names)
    kind: str = "decode"  # "decode": replayed steps of a bucket; "prefill": eager forwards of `bucket` tokens

    @property
    def gap_us(self) -> float:
        return self.span_us - self.kernel_us

    def as_dict(self) -> dict:
        return {"bucket": self.bucket, "steps": self.steps, "kernels_per_step": self.kernels_per_step,
                "kernel_us": self.kernel_us, "span_us": self.span_us, "gap_us": self.gap_us,
                "attributed": self.attributed, "by_label": self.by_label, "kind": self.kind}


def plan_labels(plan) -> list[str]:
    """One label per kernel the plan launches, in launch order (``launch_labels``)."""
    return launch_labels(plan.launches)


def launch_labels(launches) -> list[str]:
    """One label per kernel the launches make, in launch order (a launch of ``k`` kernels gives ``k``: the split-kv
    attention's second kernel is its combine)."""
    labels = []
    for launch in launches:
        name = launch.label or getattr(launch.kernel, "__name__", "kernel")
        labels.extend([name] if launch.kernels == 1 else [f"{name} [{i + 1}/{launch.kernels}]" for i in range(launch.kernels)])
    return labels


def _kernel_events(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, duration_us)`` of every GPU kernel the profiler recorded, in start order."""
    events = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.elapsed_us() >= 0:
            name = e.name
            if name.startswith(("Memcpy", "Memset", "cudaMemcpy")) or "memcpy" in name.lower():
                continue
            events.append((name, float(e.time_range.start), float(e.time_range.elapsed_us())))
    events.sort(key=lambda t: t[1])
    return events


def profile_decode_steps(model, step_batch, cache, steps: int = 20) -> DecodeProfile:
    """Replay ``model``'s decode step for ``step_batch`` (whose bucket's graph is captured) ``steps``
    times under the profiler; see the module docstring. ``step_batch``'s tokens are written to the
    same cache slots every time (the same work each step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fp8lab.engine.cuda.plan import decode_context_bound

    bucket = model._bucket(step_batch.num_seqs)
    bound = decode_context_bound(int(max(step_batch.context_lens)), cache.capacity)
    labels = plan_labels(model.planner.decode(bucket, cache, bound))
    model.greedy_tokens(step_batch, cache)  # warm (the graph exists after the first step of a bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.greedy_tokens(step_batch, cache)
        torch.cuda.synchronize()
    return attribute(_kernel_events(prof), labels, steps, bucket)


def profile_prefill(model, batch, cache, repeats: int = 3) -> DecodeProfile:
    """Run the prefill forward of ``batch`` (a ``ForwardBatch`` of prompts, its K/V written to the same slots each
    time) once to warm up and ``repeats`` times under the profiler; its kernels attributed to the prefill plan's
    launches and the lm_head's (see the module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    tokens, seqs = len(batch.token_ids), batch.num_seqs
    plan = model.planner.prefill(*model.prefill_shape(batch, cache), cache)  # what the model runs (or replays)
    labels = plan_labels(plan) + launch_labels([model.planner.lm_head(model.activations.selected[:seqs], seqs)])
    model.forward(batch, cache)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            model.forward(batch, cache)
        torch.cuda.synchronize()
    return attribute(_kernel_events(prof), labels, repeats, tokens, kind="prefill")


def attribute(events, labels: list[str], steps: int, bucket: int, kind: str = "decode") -> DecodeProfile:
    """``events`` (``(name, start_us, duration_us)`` in start order) of ``steps`` runs of the same launches, one
    ``labels`` entry per kernel of a run: per label the launches, summed CUPTI durations and the time each kernel adds
    to its run (from the previous kernel's end to its own), averaged over the runs. When the events are not ``steps``
    times ``len(labels)`` kernels, the labels are the kernels' short names instead (``attributed`` False)."""
    per_step = len(events) // steps if steps else 0
    attributed = per_step == len(labels) and len(events) == per_step * steps
    totals: dict = defaultdict(lambda: {"launches": 0, "us": 0.0, "added_us": 0.0})
    spans, busy = [], []
    for s in range(steps):
        chunk = events[s * per_step : (s + 1) * per_step]
        if not chunk:
            continue
        spans.append(chunk[-1][1] + chunk[-1][2] - chunk[0][1])
        busy.append(sum(d for _, _, d in chunk))
        previous_end = chunk[0][1]
        for i, (name, start, duration) in enumerate(chunk):
            label = labels[i] if attributed else short_kernel_name(name)
            totals[label]["launches"] += 1
            totals[label]["us"] += duration
            end = start + duration
            totals[label]["added_us"] += max(end - previous_end, 0.0)
            previous_end = max(previous_end, end)
    by_label = {k: {key: value / steps for key, value in v.items()} for k, v in totals.items()}
    return DecodeProfile(bucket, steps, per_step, statistics.fmean(busy) if busy else 0.0,
                         statistics.fmean(spans) if spans else 0.0, by_label, attributed, kind)


def short_kernel_name(name: str) -> str:
    """A readable name for a Numba kernel's demangled name (``cudapy::fp8lab::numba_kernels::layers::...``)."""
    name = name.split("[abi")[0].split("(")[0]
    parts = [p for p in name.split("::") if p and p not in ("cudapy", "fp8lab", "numba_kernels", "$3clocals$3e")]
    return ".".join(parts[-2:]) if parts else name


def breakdown_table(profile: DecodeProfile, title: str = "") -> str:
    """A Markdown table of ``profile``: label, launches per step, us added to the step and their share of the
    span, us of CUPTI duration (see the module docstring)."""
    lines = [title, ""] if title else []
    lines += ["| kernel (plan launch) | launches per step | us added to the step | share of the span | us duration |",
              "|---|---|---|---|---|"]
    span = profile.span_us or 1.0
    for label, v in sorted(profile.by_label.items(), key=lambda kv: -kv[1]["added_us"]):
        lines.append(f"| {label} | {v['launches']:.0f} | {v['added_us']:,.1f} | {100 * v['added_us'] / span:.1f}% "
                     f"| {v['us']:,.1f} |")
    lines.append(f"| **all kernels** | {profile.kernels_per_step} | {profile.span_us:,.1f} | 100% | {profile.kernel_us:,.1f} |")
    lines.append("")
    lines.append(f"Per step: {profile.kernels_per_step} kernels, {profile.kernel_us:,.1f} us of kernel time, span "
                 f"{profile.span_us:,.1f} us (first kernel start to last end), gaps between kernels "
                 f"{profile.gap_us:,.1f} us ({profile.gap_us / max(profile.kernels_per_step - 1, 1):.2f} us per gap); "
                 + (f"mean of {profile.steps} replayed steps of bucket {profile.bucket}" if profile.kind == "decode" else
                    f"mean of {profile.steps} prefill forwards of {profile.bucket} tokens after an untimed one (CUDA-graph "
                    "replays where the model captures prefills, the tensor-core attention's case; eager launches, whose "
                    "gaps include the host's time, otherwise)")
                 + ("" if profile.attributed else "; kernels could not be matched to the plan, labels are kernel names") + ".")
    return "\n".join(lines) + "\n"
