"""Warp intrinsics for Numba's CUDA simulator, with CUDA's semantics.

Simulator only, no kernel; checked against CUDA's documented semantics in
``tests/numba_kernels/test_cudasim.py``. ``WARP_SIZE`` and ``FULL_MASK`` are those of
``fp8lab.numba_kernels.warp`` (one definition for the view).

numba-cuda 0.30's simulator (``NUMBA_ENABLE_CUDASIM=1``) runs every CUDA thread of a block as a
Python thread but has no warp-level intrinsics. ``install()`` adds them to the simulator's fake
``cuda`` module, so a kernel written idiomatically (``cuda.shfl_xor_sync(0xFFFFFFFF, x, 16)``)
runs unchanged on a GPU and in the simulator:

- ``shfl_sync``, ``shfl_up_sync``, ``shfl_down_sync``, ``shfl_xor_sync`` (width 32);
- ``syncwarp``, ``ballot_sync``, ``any_sync``, ``all_sync``, ``activemask`` (for converged code);
- and it replaces the simulator's ``fma`` (two roundings) by a fused one (one rounding);
- and it makes the simulator's ``BlockManager`` (which starts a block's threads and releases them
  together from each ``syncthreads``) check on its threads every ``MANAGER_POLL_S`` instead of in a
  busy loop: the loop held the GIL against the threads it waits for, which made kernels several times
  slower, and on a loaded machine often 10 to 30 times slower.

And thread-block clusters (``fp8lab.numba_kernels.cluster``), which the simulator does not have: inside
``clusters(dims)`` a launch runs the CTAs of each cluster at once, each with shared memory of its own, and
``cluster_rank``, ``cluster_sync`` and ``remote_shared`` give a CTA its rank, the cluster barrier and another CTA's
shared array. A thread of the cluster that exits without reaching a cluster barrier the others wait at is a
``RuntimeError``: ``cluster.sync`` needs every thread of the cluster. (The hardware's barrier waits only for threads
that have not exited, but its ``.aligned`` form, which ``cluster.sync`` uses, is undefined when a warp's threads do
not all execute it.)

How a collective works here: each lane named in ``mask`` deposits its value in a rendezvous
keyed by ``(warp, mask, n)``, where ``n`` counts that lane's earlier collectives with the same
mask, and waits until every lane of ``mask`` has deposited. So lanes that diverge into disjoint
masks each meet their own group, as on the hardware.

Misuse that CUDA leaves undefined (or hangs on) is a clear ``RuntimeError`` here:

- the calling lane is not in ``mask``; ``mask`` names lanes the warp does not have;
- a lane named in ``mask`` exits, or waits at ``syncthreads``, without arriving (a deadlock on
  the hardware): reported as soon as it is seen, naming the lane;
- a lane reads (shuffles from) a lane that is not in ``mask``;
- any other wait longer than ``TIMEOUT_S`` (e.g. two groups waiting on each other).

Nothing here is used on a GPU: ``install()`` does nothing unless the simulator is enabled.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import traceback
import weakref
from collections import defaultdict

import numpy as np

from fp8lab.simulators.fma import fma_f32_scalar

from .warp import FULL_MASK, WARP_SIZE

TIMEOUT_S = 300.0  # generous: a loaded 2-core CI machine can stall simulated threads for many seconds
_POLL_S = 0.01  # how often a lane waiting in a collective checks for a deadlock (it is woken when the collective completes)
MANAGER_POLL_S = 0.0005  # how often the block manager looks at its threads (see _run_block)
ABORT_JOIN_S = 10.0  # how long a failed block waits for its aborted threads to end (see _join_aborted)


_NOT_YET = object()


class _Rendezvous:
    """One warp collective in flight: what each lane deposited, and how many lanes have read."""

    def __init__(self, lanes: tuple[int, ...]):
        self.lanes = lanes
        self.values: dict[int, object] = {}
        self.readers = 0
        self.combined = _NOT_YET  # exchange(..., combine=f): f(values), computed by the first lane to need it


class _WarpState:
    """Per warp of a block: the collectives in flight and each lane's per-mask counters."""

    def __init__(self):
        self.condition = threading.Condition()
        self.in_flight: dict[tuple[int, int], _Rendezvous] = {}
        self.counters: dict[tuple[int, int], int] = defaultdict(int)


# One _WarpState per (block manager, warp); the weak keys drop them when the block finishes.
_warps: "weakref.WeakKeyDictionary[object, dict[int, _WarpState]]" = weakref.WeakKeyDictionary()
_warps_lock = threading.Lock()


class CommitGroups:
    """Asynchronous operations of each simulated thread, with PTX's commit-group semantics (``cp.async`` and
    ``wgmma`` both): ``issue`` queues one, ``commit`` closes the ones issued since into a group, and
    ``take_all_but(n)`` removes and returns, oldest first, the operations of every group but the ``n`` youngest
    (what a ``wait_group n`` must have completed)."""

    def __init__(self):
        self._local = threading.local()

    def _queues(self):
        if not hasattr(self._local, "pending"):
            self._local.pending, self._local.groups = [], []
        return self._local

    def issue(self, operation) -> None:
        self._queues().pending.append(operation)

    def commit(self) -> None:
        queues = self._queues()
        queues.groups.append(queues.pending)
        queues.pending = []

    def uncommitted(self) -> bool:
        return bool(self._queues().pending)

    def take_all_but(self, n: int) -> list:
        queues = self._queues()
        taken = []
        while len(queues.groups) > n:
            taken.extend(queues.groups.pop(0))
        return taken


def _current_thread():
    thread = threading.current_thread()
    if not hasattr(thread, "thread_id") or not hasattr(thread, "_manager"):
        raise RuntimeError("warp intrinsics can only be called from inside a simulated kernel")
    return thread


# Every simulated thread, by block manager and linear thread id, registered when created (see
# install()), so that a lane that has not started yet can be told from one that has exited. The
# threads are held weakly: a thread refers to its manager, so a strong reference here would keep
# every finished block (its manager, threads and warp states: thousands of objects per launch)
# alive for the rest of the process. The simulator's BlockManager holds its block's threads while
# the block runs, which is as long as a lane looks them up.
_threads: "weakref.WeakKeyDictionary[object, weakref.WeakValueDictionary[int, threading.Thread]]" = (
    weakref.WeakKeyDictionary()
)


def _block_threads(manager) -> dict[int, threading.Thread]:
    """All simulated threads of one block created so far, by linear thread id."""
    with _warps_lock:
        return dict(_threads.get(manager, {}))


def _exited(thread: threading.Thread) -> bool:
    # Not ``thread.ident``: Python sets it before the thread counts as started, so a lane still
    # starting up would look exited.
    return thread._started.is_set() and not thread.is_alive()


def _warp_state(thread) -> _WarpState:
    with _warps_lock:
        per_manager = _warps.setdefault(thread._manager, {})
        return per_manager.setdefault(thread.thread_id // WARP_SIZE, _WarpState())


def _lanes_of(mask: int, warp: int, block_size: int, op: str) -> tuple[int, ...]:
    mask = int(mask) & FULL_MASK
    lanes = tuple(lane for lane in range(WARP_SIZE) if mask >> lane & 1)
    warp_lanes = min(WARP_SIZE, block_size - warp * WARP_SIZE)
    if not lanes:
        raise RuntimeError(f"{op}: mask 0x{mask:08x} names no lane")
    if lanes[-1] >= warp_lanes:
        raise RuntimeError(f"{op}: mask 0x{mask:08x} names lane {lanes[-1]}, but warp {warp} has only {warp_lanes} lanes")
    return lanes


def _block_size(thread) -> int:
    x, y, z = thread._manager._block_dim
    return x * y * z


def _barriers_passed(thread) -> int:
    return getattr(thread, "barriers_passed", 0)


def _check_missing_lanes(op: str, mask: int, warp: int, rendezvous: _Rendezvous, manager) -> None:
    """Raise if a lane that has not arrived never can: it exited or waits at syncthreads."""
    threads = _block_threads(manager)
    for lane in rendezvous.lanes:
        if lane in rendezvous.values:
            continue
        t = threads.get(warp * WARP_SIZE + lane)
        if t is None:
            continue  # not started yet
        if _exited(t):
            raise RuntimeError(f"{op}: lane {lane} of warp {warp} is named in mask 0x{mask:08x} but exited without arriving")
        # A lane blocked at a barrier the caller has already passed is merely not released yet
        # (the simulator's BlockManager releases threads one by one): only a barrier the caller
        # has not passed is a deadlock.
        if getattr(t, "syncthreads_blocked", False) and _barriers_passed(t) >= _barriers_passed(_current_thread()):
            raise RuntimeError(
                f"{op}: lane {lane} of warp {warp} is named in mask 0x{mask:08x} but waits at syncthreads "
                "(a deadlock on the GPU)"
            )


def exchange(op: str, mask: int, value, combine=None):
    """Deposit ``value`` for this lane in the collective named by ``mask``; return every lane's value (a dict by
    lane), or with ``combine``, ``combine(that dict)``, computed once for the whole collective and shared by its
    lanes (a warp-wide operation such as the tensor-core ``mma``, whose result every lane reads its part of).

    The building block of every intrinsic here, and of warp-collective twins of linked device
    functions (the tensor-core ``mma`` in ``fp8lab.numba_kernels.mma``); ``op`` names the caller in errors.
    """
    thread = _current_thread()
    warp, lane = divmod(thread.thread_id, WARP_SIZE)
    lanes = _lanes_of(mask, warp, _block_size(thread), op)
    if lane not in lanes:
        raise RuntimeError(f"{op}: calling lane {lane} of warp {warp} is not in mask 0x{int(mask) & FULL_MASK:08x}")
    state = _warp_state(thread)
    with state.condition:
        mask_key = int(mask) & FULL_MASK
        n = state.counters[(lane, mask_key)]
        state.counters[(lane, mask_key)] = n + 1
        key = (mask_key, n)
        rendezvous = state.in_flight.setdefault(key, _Rendezvous(lanes))
        rendezvous.values[lane] = value
        # The last lane to arrive wakes the others (waking them on every deposit costs n^2 wake-ups per
        # collective); meanwhile they wake every _POLL_S to look for a deadlock. The look comes after a first
        # wait, not before it: nearly always the other lanes arrive within it, and the look copies the block's
        # thread table.
        if len(rendezvous.values) == len(lanes):
            state.condition.notify_all()
        deadline = time.monotonic() + TIMEOUT_S
        while len(rendezvous.values) < len(lanes):
            state.condition.wait(_POLL_S)
            if len(rendezvous.values) == len(lanes):
                break
            if getattr(thread, "abort", False):
                raise RuntimeError(f"{op}: aborted because another simulated thread failed")
            _check_missing_lanes(op, mask_key, warp, rendezvous, thread._manager)
            if time.monotonic() > deadline:
                missing = [x for x in lanes if x not in rendezvous.values]
                raise RuntimeError(f"{op}: lanes {missing} of warp {warp} did not arrive within {TIMEOUT_S} s")
        if combine is not None and rendezvous.combined is _NOT_YET:
            rendezvous.combined = combine(rendezvous.values)
        rendezvous.readers += 1
        if rendezvous.readers == len(lanes):
            del state.in_flight[key]
        return rendezvous.values if combine is None else rendezvous.combined


def _lane() -> int:
    return _current_thread().thread_id % WARP_SIZE


def _shuffle(op: str, mask: int, value, source: int, in_range: bool):
    values = exchange(op, mask, value)
    if not in_range:
        return value  # shfl_up/down past the warp's edge: the lane keeps its own value
    if source not in values:
        raise RuntimeError(f"{op}: lane {_lane()} reads lane {source}, which is not in mask 0x{int(mask) & FULL_MASK:08x}")
    return values[source]


def shfl_sync(mask, value, src_lane):
    """Value of ``value`` in lane ``src_lane % 32``."""
    return _shuffle("shfl_sync", mask, value, int(src_lane) % WARP_SIZE, True)


def shfl_up_sync(mask, value, delta):
    """Value in lane ``lane - delta``; lanes below ``delta`` keep their own."""
    source = _lane() - int(delta)
    return _shuffle("shfl_up_sync", mask, value, source, source >= 0)


def shfl_down_sync(mask, value, delta):
    """Value in lane ``lane + delta``; lanes past the end keep their own."""
    source = _lane() + int(delta)
    return _shuffle("shfl_down_sync", mask, value, source, source < WARP_SIZE)


def shfl_xor_sync(mask, value, lane_mask):
    """Value in lane ``lane ^ lane_mask`` (the butterfly of reductions)."""
    return _shuffle("shfl_xor_sync", mask, value, _lane() ^ (int(lane_mask) & (WARP_SIZE - 1)), True)


def syncwarp(mask=FULL_MASK):
    """Wait until every lane of ``mask`` has arrived (counted per thread: ``racecheck``'s warp epochs)."""
    exchange("syncwarp", mask, None)
    thread = _current_thread()
    thread.warp_barriers_passed = getattr(thread, "warp_barriers_passed", 0) + 1


def ballot_sync(mask, predicate):
    """Bit ``i`` set where lane ``i`` of ``mask`` has a true predicate."""
    values = exchange("ballot_sync", mask, bool(predicate))
    return sum(1 << lane for lane, p in values.items() if p)


def any_sync(mask, predicate):
    """True if the predicate holds in any lane of ``mask``."""
    return any(exchange("any_sync", mask, bool(predicate)).values())


def all_sync(mask, predicate):
    """True if the predicate holds in every lane of ``mask``."""
    return all(exchange("all_sync", mask, bool(predicate)).values())


def activemask():
    """Every lane this warp has.

    On a GPU it is the set of lanes converged at the call; the simulator does not track
    convergence, so it answers for converged code. Do not use it to detect divergence.
    """
    thread = _current_thread()
    warp = thread.thread_id // WARP_SIZE
    warp_lanes = min(WARP_SIZE, _block_size(thread) - warp * WARP_SIZE)
    return (1 << warp_lanes) - 1


WARP_INTRINSICS = {
    "shfl_sync": shfl_sync,
    "shfl_up_sync": shfl_up_sync,
    "shfl_down_sync": shfl_down_sync,
    "shfl_xor_sync": shfl_xor_sync,
    "syncwarp": syncwarp,
    "ballot_sync": ballot_sync,
    "any_sync": any_sync,
    "all_sync": all_sync,
    "activemask": activemask,
}


def fma(a, b, c):
    """``cuda.fma`` with one rounding, as the hardware's FFMA does.

    The stock simulator computes ``a * b + c`` in two roundings, so a kernel's float32 fma chains
    would not match the simulators bit for bit. float32 operands go through the exact emulation
    of ``simulators``; float64 ones fall back to two roundings (no float64 kernel relies on it).
    """
    if type(a) is type(b) is type(c) is np.float32:
        return fma_f32_scalar(a, b, c)
    return a * b + c


def _run_block(self, grid_point, *args):
    """``BlockManager.run``: ``_run_block_loop``, or inside ``clusters()`` the CTA on a thread of its own beside the
    others of its cluster."""
    if _cluster_launch is not None:
        _start_in_cluster(self, grid_point, args)
    else:
        _run_block_loop(self, grid_point, args)


def _run_block_loop(self, grid_point, args):
    """numba-cuda 0.30's ``BlockManager.run``, step for step: start every thread of the block; whenever every
    live thread waits at ``syncthreads``, release them all (one by one, as ``_check_missing_lanes`` expects);
    on a thread's exception, abort the others and raise it. Two changes: where a look at the threads finds
    nothing to do, the manager sleeps ``MANAGER_POLL_S`` before the next look, instead of spinning and taking
    the GIL from the threads it waits for; and a failed block waits for its aborted threads to end
    (``_join_aborted``) before it raises."""
    from numba.cuda.simulator.kernel import BlockThread

    threads, livethreads, blockedthreads = set(), set(), set()
    for block_point in np.ndindex(*self._block_dim):

        def target():
            self._f(*args)

        t = BlockThread(target, self, grid_point, block_point, self._debug)
        t.start()
        threads.add(t)
        livethreads.add(t)
    while livethreads:
        for t in livethreads:
            if t.syncthreads_blocked:
                blockedthreads.add(t)
            elif t.exception:
                for t_other in threads:  # abort every other thread
                    t_other.abort = True
                    t_other.syncthreads_blocked = False
                    t_other.syncthreads_event.set()
                _join_aborted(threads)
                raise t.exception[0].with_traceback(t.exception[1])
        released = livethreads == blockedthreads
        if released:
            for t in blockedthreads:
                t.syncthreads_blocked = False
                t.syncthreads_event.set()
            blockedthreads = set()
        livethreads = {t for t in livethreads if t.is_alive()}
        if livethreads and not released:
            time.sleep(MANAGER_POLL_S)
    for t in threads:  # an exception set just before its thread finished
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def _join_aborted(threads) -> None:
    """Wait, ``ABORT_JOIN_S`` at most in all, for a failed block's aborted threads to end. Each raises at its next
    barrier or collective, or finishes its kernel. (numba-cuda does not wait: a thread it left running went on
    writing into the next launch's state, e.g. the accesses a later ``racecheck`` session counts.)"""
    deadline = time.monotonic() + ABORT_JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def _block_manager_is_numba_cudas(kernel) -> bool:
    """Whether numba-cuda's ``BlockManager`` and ``BlockThread`` are those ``_run_block`` copies (0.30's); with
    another version the simulator keeps its own loop (correct, only slower)."""
    import inspect

    try:
        manager = inspect.signature(kernel.BlockManager.__init__).parameters
        thread = inspect.signature(getattr(kernel.BlockThread.__init__, "_fp8lab_original", kernel.BlockThread.__init__))
    except (TypeError, ValueError):
        return False
    return (list(manager) == ["self", "f", "grid_dim", "block_dim", "debug"]
            and list(thread.parameters) == ["self", "f", "manager", "blockIdx", "threadIdx", "debug"]
            and all(hasattr(kernel.BlockThread, name) for name in ("syncthreads", "run")))


def install() -> bool:
    """Add the warp intrinsics to the simulator's fake ``cuda`` module (and its block manager's polling, see
    ``_run_block``); True if the simulator is on."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        return False
    from numba.cuda.simulator import kernel, kernelapi

    for name, fn in WARP_INTRINSICS.items():
        if not hasattr(kernelapi.FakeCUDAModule, name):
            setattr(kernelapi.FakeCUDAModule, name, staticmethod(fn))
    kernelapi.FakeCUDAModule.fma = staticmethod(fma)
    if not getattr(kernel.BlockThread, "_fp8lab_counts_barriers", False):
        original_syncthreads = kernel.BlockThread.syncthreads

        def counting_syncthreads(self):
            original_syncthreads(self)
            self.barriers_passed = _barriers_passed(self) + 1

        kernel.BlockThread.syncthreads = counting_syncthreads
        kernel.BlockThread._fp8lab_counts_barriers = True
    if not getattr(kernel.BlockThread, "_fp8lab_registered", False):
        original_init = kernel.BlockThread.__init__

        def registering_init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            with _warps_lock:
                _threads.setdefault(self._manager, weakref.WeakValueDictionary())[self.thread_id] = self

        registering_init._fp8lab_original = original_init
        kernel.BlockThread.__init__ = registering_init
        kernel.BlockThread._fp8lab_registered = True
    if not getattr(kernel.BlockManager, "_fp8lab_polls", False) and _block_manager_is_numba_cudas(kernel):
        kernel.BlockManager.run = _run_block
        kernel.BlockManager._fp8lab_polls = True
    if not getattr(kernelapi.FakeCUDAShared, "_fp8lab_per_cta", False):
        kernelapi.FakeCUDAShared.array = _shared_array
        kernelapi.FakeCUDAShared._fp8lab_per_cta = True
    return True


# ---------------------------------------------------------------------------- thread-block clusters


class _Cluster:
    """The CTAs of one cluster while they run: the barrier's count, their shared memory, their block managers."""

    def __init__(self, size: int):
        self.size = size  # CTAs
        self.condition = threading.Condition()
        self.arrived = 0  # threads at the barrier of this generation
        self.generation = 0
        self.failed = False
        self.shared: dict[int, dict] = defaultdict(dict)  # rank -> {allocation site: array}
        self.sites: dict[int, tuple] = {}  # id(array) -> its allocation site
        self.managers: list = []
        self.runners: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def threads(self) -> int:
        """Threads of the whole cluster: every one arrives at each barrier."""
        return self.size * math.prod(self.managers[0]._block_dim)


_cluster_launch: dict | None = None  # {"dims": (cx, cy, cz), "clusters": {index: _Cluster}} inside clusters()
_cluster_lock = threading.Lock()
# Each CTA's cluster and rank, by its block manager, bound when the CTA starts. A thread finds its cluster here, never
# through ``_cluster_launch``: a thread a failed launch left running (a failed block waits ``ABORT_JOIN_S`` at most for
# its aborted threads) would otherwise find the next launch's cluster of the same index and arrive at its barrier.
_cluster_of_manager: "weakref.WeakKeyDictionary[object, tuple[_Cluster, int]]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def clusters(dims: tuple[int, int, int]):
    """Within: a simulated launch runs in clusters of ``dims`` CTAs (``cluster.launch`` checks that they divide the
    grid). The simulator runs one launch at a time, so one setting serves the whole launch."""
    global _cluster_launch
    from numba.cuda.simulator import kernel

    if kernel.BlockManager.run is not _run_block:
        raise RuntimeError("clusters: the cluster emulation needs numba-cuda 0.30's simulator (see _run_block)")
    if _cluster_launch is not None:
        raise RuntimeError("clusters: a cluster launch is already running")
    _cluster_launch = {"dims": tuple(dims), "clusters": {}}
    try:
        yield
    finally:
        pending = [c for c in _cluster_launch["clusters"].values() if c.runners and len(c.runners) < c.size]
        _cluster_launch = None
        if pending:
            raise RuntimeError("clusters: the launch ended with a cluster whose CTAs did not all start")


def in_cluster_launch() -> bool:
    """Whether the calling simulated thread runs in a CTA of a cluster launch."""
    return _cluster_entry() is not None


def _cluster_of(block_idx) -> tuple[_Cluster, int]:
    """The cluster of the CTA at ``block_idx`` (created when its first CTA starts) and the CTA's rank in it."""
    cx, cy, cz = _cluster_launch["dims"]
    index = (block_idx.x // cx, block_idx.y // cy, block_idx.z // cz)
    rank = block_idx.x % cx + cx * (block_idx.y % cy + cy * (block_idx.z % cz))
    with _cluster_lock:
        cluster = _cluster_launch["clusters"].setdefault(index, _Cluster(cx * cy * cz))
    return cluster, rank


def _cluster_entry() -> tuple[_Cluster, int] | None:
    """The calling simulated thread's cluster and its CTA's rank; None outside a CTA started in a cluster."""
    manager = getattr(threading.current_thread(), "_manager", None)
    with _cluster_lock:
        return None if manager is None else _cluster_of_manager.get(manager)


def _current_cluster() -> tuple[_Cluster, int]:
    entry = _cluster_entry()
    if entry is None:
        raise RuntimeError("cluster functions can only be called in a kernel launched by cluster.launch")
    return entry


def _start_in_cluster(manager, grid_point, args) -> None:
    """Run a CTA's block manager on a thread of its own; once every CTA of its cluster has started, wait for them all
    and raise the first error. (The simulator's launch loop starts the CTAs one after the other.)"""
    from numba.cuda.simulator.kernel import Dim3

    cluster, rank = _cluster_of(Dim3(*grid_point))

    def run():
        try:
            _run_block_loop(manager, grid_point, args)
        except BaseException as error:  # noqa: BLE001 - handed to the thread that joins the cluster
            with cluster.condition:
                cluster.errors.append(error)
                cluster.failed = True
                cluster.condition.notify_all()

    runner = threading.Thread(target=run, daemon=True)
    with _cluster_lock:
        _cluster_of_manager[manager] = (cluster, rank)
        cluster.managers.append(manager)
        cluster.runners.append(runner)
        complete = len(cluster.runners) == cluster.size
    runner.start()
    if complete:
        for r in cluster.runners:
            r.join()
        if cluster.errors:
            raise cluster.errors[0]


def cluster_rank() -> int:
    """This CTA's rank in its cluster (``%cluster_ctarank``)."""
    return _current_cluster()[1]


def _exited_thread_in(cluster: _Cluster) -> bool:
    """Whether a thread of the cluster has exited (it can never arrive at a barrier)."""
    return any(_exited(t) for manager in list(cluster.managers) for t in _block_threads(manager).values())


def _raise_if_aborted(thread, cluster: _Cluster) -> None:
    if getattr(thread, "abort", False) or cluster.failed:
        raise RuntimeError("cluster_sync: aborted because another simulated thread failed")


def cluster_sync() -> None:
    """The cluster barrier (``barrier.cluster.arrive.release`` then ``wait.acquire``): returns once every thread of
    every CTA of the cluster has arrived."""
    thread = _current_thread()
    cluster, _ = _current_cluster()
    with cluster.condition:
        _raise_if_aborted(thread, cluster)  # an aborted thread must not count as an arrival
        generation = cluster.generation
        cluster.arrived += 1
        if len(cluster.managers) == cluster.size and cluster.arrived == cluster.threads():
            cluster.arrived = 0
            cluster.generation += 1
            cluster.condition.notify_all()
            return
        started = time.monotonic()
        while cluster.generation == generation:
            cluster.condition.wait(_POLL_S)
            if cluster.generation != generation:
                break
            _raise_if_aborted(thread, cluster)
            waited = time.monotonic() - started
            if waited > 1.0 and len(cluster.managers) == cluster.size and _exited_thread_in(cluster):
                raise RuntimeError("cluster_sync: a thread of the cluster exited without arriving (it needs them all)")
            if waited > TIMEOUT_S:
                raise RuntimeError(f"cluster_sync: threads of the cluster did not arrive within {TIMEOUT_S} s")


def remote_shared(array, rank: int):
    """CTA ``rank``'s copy of the shared array ``array`` (this CTA's, from ``cuda.shared.array``) in this cluster."""
    cluster, _ = _current_cluster()
    if not 0 <= rank < cluster.size:
        raise RuntimeError(f"remote_shared: rank {rank} is not in a cluster of {cluster.size} CTAs")
    site = cluster.sites.get(id(array))
    if site is None:
        raise RuntimeError("remote_shared: the array is not a shared array of this cluster (pass the array itself)")
    remote = cluster.shared[rank].get(site)
    if remote is None:
        raise RuntimeError(f"remote_shared: CTA {rank} of the cluster has not allocated this shared array yet")
    return remote


def _shared_array(self, shape, dtype, alignment=None):
    """numba-cuda 0.30's ``FakeCUDAShared.array``: ``allocate_shared`` at the calling line of the kernel."""
    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    site = tuple(traceback.extract_stack(sys._getframe())[-2][0:2])  # the kernel's line, as numba-cuda keys it
    return allocate_shared(self, shape, dtype, site)


def allocate_shared(shared, shape, dtype, site: tuple):
    """The shared array of allocation ``site`` (the kernel's ``(file, line)``) of the simulator's ``FakeCUDAShared``
    ``shared``: numba-cuda's rule (one array per site, shared by the launch's CTAs, which run one at a time; shape 0:
    a view of the one dynamic buffer), except inside ``clusters()``, where the CTAs run at once and each has its own.
    ``racecheck``'s allocation calls it too, so that the two patches of ``FakeCUDAShared.array`` agree."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support

    dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
    count = shared._dynshared_size // dtype.itemsize
    entry = _cluster_entry()
    if entry is None:  # numba-cuda's rule
        if shape == 0:  # dynamic shared memory: one buffer, every such array a view of it
            return np.frombuffer(shared._dynshared.data, dtype=dtype, count=count)
        array = shared._allocations.get(site)
        if array is None:
            array = shared._allocations[site] = np.empty(shape, dtype)
        return array
    cluster, rank = entry
    with _cluster_lock:
        allocations = cluster.shared[rank]
        if shape == 0:  # this CTA's dynamic buffer; remote_shared finds the view of a dtype by ("dynamic", dtype)
            buffer = allocations.setdefault("dynamic", np.zeros(shared._dynshared_size, dtype=np.byte))
            site = ("dynamic", dtype.str)
            array = allocations[site] = np.frombuffer(buffer.data, dtype=dtype, count=count)
        else:
            array = allocations.get(site)
            if array is None:
                array = allocations[site] = np.empty(shape, dtype)
        cluster.sites[id(array)] = site
    return array
