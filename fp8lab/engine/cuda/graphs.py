"""CUDA graphs of the decode step (GPU only).

A decode step pads its batch to a *bucket* (1, 2, 4, 8, ... and ``max_num_seqs``) and runs a fixed plan
(``fp8lab.engine.cuda.plan.Planner.decode``, one per bucket and context bound) on its cache's persistent
index buffers, padded rows having
slot -1 (``paged_cache_write`` writes nothing) and length 0 (a zero attention row). On a GPU the first
decode step of a (bucket, bound) runs eagerly (which compiles and warms every kernel) and then its plan is
captured into a CUDA graph with a ``cuda.core`` GraphBuilder (``kernel[grid, block, builder]``, as
``bench/timing.py``); later steps of it copy the index arrays in, replay the graph and copy the
result out: one graph launch instead of hundreds of Python launches of 10 to 25 us each. Graphs belong
to the KV cache they were captured with (they hold its addresses) and are dropped with it. In the
simulator there are no graphs: the same padded plan runs eagerly.
"""

from __future__ import annotations

from .plan import Plan


def core_stream(numba_stream):
    """A Numba stream as a ``cuda.core`` stream (what ``Graph.launch`` and ``Graph.upload`` take)."""
    from cuda.core import Stream

    return Stream.from_handle(int(numba_stream))  # a Numba stream's int is its CUstream


def capture(plan: Plan, upload_stream):
    """Record ``plan`` into a CUDA graph (after an eager run of it compiled and warmed every kernel) and
    upload it on ``upload_stream`` (a ``cuda.core`` stream), so that its first replay launches at once.
    A failing capture is ended and its error raised."""
    from cuda.core import Device

    device = Device()
    device.set_current()
    builder = device.create_graph_builder()
    builder.begin_building()
    try:
        plan.run(builder)  # every kernel wrapper takes a stream= argument: here, the builder
    except Exception:
        try:
            builder.end_building()
        except Exception:
            pass
        raise
    graph = builder.end_building().complete()
    graph.upload(upload_stream)
    return graph
