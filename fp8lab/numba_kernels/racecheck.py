"""A shared-memory race checker for kernels run in Numba's CUDA simulator: what compute-sanitizer's
``racecheck`` does on a GPU, for CPU-only tests.

    from fp8lab.numba_kernels import racecheck

    with racecheck.checking():          # in the simulator (NUMBA_ENABLE_CUDASIM=1)
        my_kernel[grid, block](...)     # raises SharedMemoryRace at the first race

Why: the simulator runs a block's threads as Python threads and honours ``syncthreads``, so a missing
barrier usually still gives the right answer there (the threads happen to run in a friendly order).
A pipeline that overwrites a stage before every warp is done reading it passes every CPU test and
corrupts results on a GPU. The checker finds such orderings from the accesses themselves, whatever
order the threads ran in.

How: while checking, ``cuda.shared.array`` (static and dynamic) returns a ``SharedArray``, a NumPy
array that records every element read and write with the thread, its *barrier epoch* (the
``syncthreads`` it has passed), its *warp epoch* (the ``syncwarp`` it has passed) and the source line.
Two accesses to the same byte by different threads of a block **race** when at least one writes and
nothing orders them: they are in the same barrier epoch, and not in the same warp with a ``syncwarp``
between them. Then ``SharedMemoryRace`` names the kind (read-after-write, write-after-read,
write-after-write), the array (where it was allocated), the element, both threads and both source
lines. The launch raises it (the simulator re-raises a thread's exception).

- ``cuda.atomic`` operations on a shared array are ordered among themselves: they race only with
  plain accesses.
- ``cp.async`` copies (``fp8lab.numba_kernels.cp_async``) are writes by the issuing thread at the
  moment its ``wait_group`` lands them, the latest moment the hardware may.
- Only element reads and writes through indexing are seen (``a[i]``, ``a[i] = x``, ``a[i] += x``,
  slices); NumPy functions that work on a whole shared array (``a.fill``, ``np.copyto``) are not.
- ``perturb=seed``: threads also yield at random points between their accesses (a seeded shuffle of
  the interleaving), so that a race that changes results also tends to show in them.

Blocks run one after another in the simulator, so records start afresh with each block. Checked
by ``tests/numba_kernels/test_racecheck.py``: planted races of each kind are reported, their fixed
twins run clean, and every fp8lab kernel that uses shared memory runs clean at tiny sizes.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np

from . import cudasim

_ENABLED = False  # process-wide: the simulated threads read it
_PERTURB: int | None = None
_SESSION: "Session | None" = None
_installed = False
_install_lock = threading.Lock()


class SharedMemoryRace(RuntimeError):
    """Two threads of a block access a shared-memory element in an order nothing guarantees."""


@dataclass
class Session:
    """What one ``checking`` block saw: element accesses recorded, per shared array (its name)."""

    accesses: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.accesses.values())


@dataclass(frozen=True)
class Access:
    """One thread's access to shared memory."""

    thread: int  # linear thread id in the block
    thread_idx: tuple[int, int, int]
    epoch: int  # syncthreads passed
    warp: int
    warp_epoch: int  # syncwarp passed
    line: str  # file:line of the access
    write: bool
    atomic: bool

    def ordered_with(self, other: "Access") -> bool:
        """Whether a barrier (or this being one thread) orders the two accesses."""
        if self.thread == other.thread or self.epoch != other.epoch:
            return True
        return self.warp == other.warp and self.warp_epoch != other.warp_epoch

    def conflicts_with(self, other: "Access") -> bool:
        return (self.write or other.write) and not (self.atomic and other.atomic) and not self.ordered_with(other)


class _Records:
    """The accesses of one block to one shared buffer: per byte, the writes that may still race (the last plain
    write and the atomic writes since) and the reads since."""

    def __init__(self, name: str, shape: tuple[int, ...], itemsize: int):
        self.name, self.shape, self.itemsize = name, shape, itemsize
        self.lock = threading.Lock()
        self.block = None
        # per byte, by thread: the last plain write, or the atomic writes since it (atomics do not order one
        # another, so a plain access must be checked against each of them, not only the latest)
        self.writes: dict[int, dict[int, Access]] = {}
        self.reads: dict[int, dict[int, Access]] = {}

    def element(self, cell: int) -> str:
        """The element of the buffer that holds byte ``cell``."""
        index = np.unravel_index(cell // self.itemsize, self.shape)
        return str(tuple(int(i) for i in index)) if len(self.shape) > 1 else str(int(index[0]))

    def record(self, cells: np.ndarray, access: Access, block) -> None:
        with self.lock:
            if _SESSION is not None:
                _SESSION.accesses[self.name] = _SESSION.accesses.get(self.name, 0) + 1
            if block != self.block:  # a new block: nothing of the previous one can race with it
                self.block, self.writes, self.reads = block, {}, {}
            for cell in cells.tolist():
                writers = self.writes.setdefault(cell, {})
                for earlier in writers.values():
                    if access.conflicts_with(earlier):
                        self._report(earlier, access, cell)
                readers = self.reads.setdefault(cell, {})
                if access.write:
                    for earlier in readers.values():
                        if access.conflicts_with(earlier):
                            self._report(earlier, access, cell)
                    if not access.atomic:
                        writers.clear()
                    writers[access.thread] = access
                    readers.clear()
                else:
                    readers[access.thread] = access

    def _report(self, first: Access, second: Access, cell: int) -> None:
        kind = {(True, False): "read-after-write", (False, True): "write-after-read",
                (True, True): "write-after-write"}[(first.write, second.write)]
        verb = {True: "wrote", False: "read"}
        why = ("with no syncthreads or syncwarp between them" if first.warp == second.warp
               else "with no syncthreads between them")
        raise SharedMemoryRace(
            f"{kind} race on shared array {self.name}, element {self.element(cell)}: thread {first.thread_idx} "
            f"{verb[first.write]} it at {first.line}, then thread {second.thread_idx} {verb[second.write]} it at "
            f"{second.line}, {why} (barrier epoch {second.epoch})")


class SharedArray(np.ndarray):
    """A shared-memory array (or a view of one) whose indexed accesses are recorded (see the module docstring)."""

    _records: _Records | None = None
    _buffer_address: int = 0

    def __array_finalize__(self, obj):
        self._records = getattr(obj, "_records", None)
        self._buffer_address = getattr(obj, "_buffer_address", 0)

    def _cells(self, index) -> np.ndarray:
        """The bytes (offsets into the shared buffer) that ``self[index]`` touches."""
        offsets = np.full(self.shape, self.__array_interface__["data"][0] - self._buffer_address, np.int64)
        for grid, stride in zip(np.indices(self.shape, sparse=True), self.strides):
            offsets = offsets + grid * stride
        chosen = np.atleast_1d(offsets[index]).ravel()
        return (chosen[:, None] + np.arange(self.itemsize)[None, :]).ravel()

    def _record(self, index, write: bool) -> None:
        records = self._records
        if records is None or not _ENABLED:
            return
        thread = threading.current_thread()
        if not hasattr(thread, "thread_id"):  # the host touching the array (e.g. after the launch)
            return
        frame = sys._getframe(2)
        idx = thread.threadIdx
        access = Access(thread.thread_id, (idx.x, idx.y, idx.z), getattr(thread, "barriers_passed", 0),
                        thread.thread_id // 32, getattr(thread, "warp_barriers_passed", 0),
                        f"{frame.f_code.co_filename}:{frame.f_lineno}", write, getattr(thread, "in_atomic", False))
        b = thread.blockIdx
        records.record(self._cells(index), access, (b.x, b.y, b.z))
        if _PERTURB is not None:
            _yield_at_random(thread)

    def __getitem__(self, index):
        result = super().__getitem__(index)
        if isinstance(result, np.ndarray) and result.ndim and np.may_share_memory(result, self):
            return result  # a view: its own element accesses are recorded
        self._record(index, write=False)
        return result.view(np.ndarray) if isinstance(result, SharedArray) else result

    def __setitem__(self, index, value):
        self._record(index, write=True)
        super().__setitem__(index, value)


def _yield_at_random(thread) -> None:
    rng = getattr(thread, "racecheck_rng", None)
    if rng is None:
        rng = thread.racecheck_rng = random.Random(hash((_PERTURB, thread.thread_id)))
    if rng.random() < 0.3:
        time.sleep(rng.random() * 2e-4)


def _shared(array: np.ndarray, buffer: np.ndarray, records: _Records) -> SharedArray:
    view = array.view(SharedArray)
    view._records = records
    view._buffer_address = buffer.__array_interface__["data"][0]
    return view


def _install() -> None:
    """Patch the simulator's shared memory and atomics, once (inactive until ``checking``)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from numba.core import types
        from numba.cuda.simulator import kernelapi
        from numba.np import numpy_support

        def array(self, shape, dtype, alignment=None):
            # the simulator's own allocation rule (one array per source line of the kernel; dynamic shared
            # memory one buffer), written out here: it finds the calling line on the stack, which must be
            # the kernel's, not this wrapper's
            if alignment is not None:
                raise RuntimeError("Array alignment is not supported in cudasim")
            dtype = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)
            caller = traceback.extract_stack(sys._getframe(1), limit=1)[-1]
            site = f"{caller.filename}:{caller.lineno}"
            key = (caller.filename, caller.lineno)
            if not _ENABLED:  # the simulator's rule, as cudasim has it (per CTA inside a cluster launch)
                return cudasim.allocate_shared(self, shape, dtype, key)
            if cudasim.in_cluster_launch():
                raise RuntimeError("racecheck: cluster launches are not checked (each CTA has its own shared memory)")
            if shape == 0:  # dynamic shared memory: every request views the one buffer
                count = self._dynshared_size // dtype.itemsize
                plain = np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
                records = self.__dict__.setdefault("_racecheck", {}).setdefault("dynamic", _Records(
                    f"(dynamic shared memory, first requested at {site}; elements in bytes)", (self._dynshared_size,), 1))
                return _shared(plain, self._dynshared, records)
            allocations = self.__dict__.setdefault("_racecheck", {})
            if key not in allocations:
                buffer = np.empty(shape, dtype)
                allocations[key] = _shared(buffer, buffer, _Records(f"allocated at {site}", buffer.shape, dtype.itemsize))
            return allocations[key]

        kernelapi.FakeCUDAShared.array = array

        for name in [n for n in vars(kernelapi.FakeCUDAAtomic) if not n.startswith("_")]:
            setattr(kernelapi.FakeCUDAAtomic, name, _marked_atomic(getattr(kernelapi.FakeCUDAAtomic, name)))
        _installed = True


def _marked_atomic(operation):
    """An atomic of the simulator, its accesses recorded as atomic (ordered among atomics)."""

    def atomic(self, *args, **kwargs):
        thread = threading.current_thread()
        thread.in_atomic = True
        try:
            return operation(self, *args, **kwargs)
        finally:
            thread.in_atomic = False

    atomic.__name__ = getattr(operation, "__name__", "atomic")
    return atomic


@contextlib.contextmanager
def checking(perturb: int | None = None):
    """Check every kernel launched inside for shared-memory races (simulator only); ``perturb``: a seed
    for random yields between accesses. Yields a ``Session`` that counts the accesses it recorded (so a
    test can tell that the checker saw its kernel's shared memory). One checking block at a time."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        raise RuntimeError("racecheck: needs Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 before numba is imported)")
    global _ENABLED, _PERTURB, _SESSION
    _install()
    previous = (_ENABLED, _PERTURB, _SESSION)
    session = Session({})
    _ENABLED, _PERTURB, _SESSION = True, perturb, session
    try:
        yield session
    finally:
        _ENABLED, _PERTURB, _SESSION = previous
