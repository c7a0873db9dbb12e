"""Shared by the sm_90 PTX checks: compile kernel variants with the CUDA simulator off, once each.

A process chooses the simulator once, when it first imports Numba, so compiling happens in
subprocesses. Most of a variant's time is Numba's front end (inlining, typing, lowering); NVVM and
ptxas take a tenth of it. Each compile process installs ``fp8lab.numba_kernels.inlining`` (the inliner's IR
copies share one memo: the same PTX in about half the time). The saving is also in doing each variant
once and in keeping both cores busy:

- ``compile_sets(sets)``: ``sets`` maps a set name to Python source that defines ``variants()``, a
  list of ``Variant``; the source runs in each of ``workers`` compile processes (simulator off, the
  project and ``tests/`` importable). The processes take the variants one at a time from a shared
  queue (a slow one does not hold up the others' share), and each variant's PTX and resource report
  comes back as a ``Compiled``. Results are cached per (set name, source) for the session, so every
  test that needs the same PTX shares one compile. A line of progress per variant goes to
  ``progress`` (``progress_printer``: visible with ``-v`` or ``-s``). ``start_compiling(sets)`` starts
  the same in the background (a session hook may call it right after collection).
- ``each_variant(compiled, check)``: run a test's checks on every variant, then fail once, naming
  every variant that failed to compile or failed a check.
- ``run_compiled(source)``: run one script with the simulator off (for checks that are not compiles).
- ``ptxas_report(ptx)``: ptxas's report (registers, spills) through nvJitLink, where installed.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_env() -> dict:
    """The environment of a compile subprocess: simulator off, the project and this folder importable."""
    return dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))


def run_compiled(source: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -c source`` with the simulator off; its completed process (output as text)."""
    return subprocess.run([sys.executable, "-c", source], check=False, cwd=ROOT, env=compile_env(),
                          capture_output=True, text=True, timeout=timeout)


def ptxas_report(ptx: str, arch: str = "sm_90") -> str | None:
    """ptxas's resource report (registers, spills, performance warnings) of ``ptx`` for ``arch`` through nvJitLink,
    or None where it is not installed."""
    try:
        from cuda.bindings import nvjitlink
    except ImportError:
        return None
    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    data = ptx.encode()
    nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
    nvjitlink.complete(handle)
    log = bytearray(nvjitlink.get_info_log_size(handle))
    nvjitlink.get_info_log(handle, log)
    nvjitlink.destroy(handle)
    return log.decode(errors="replace")


# ---------------------------------------------------------------------------- what a set lists, what comes back


@dataclass
class Variant:
    """One kernel to compile for sm_90: a Python function and its Numba signature.

    ``lto``: compile to LTO-IR and link with link-time optimization through ``cuda.core`` as numba-cuda
    does on a GPU (needed where CUDA C++ is linked in, e.g. the mma helper), with ``launch_bounds``;
    otherwise ``numba.cuda.compile_ptx``. ``resources``: run ptxas for the report (False for PTX that
    calls functions linked in later, which ptxas cannot resolve). ``info``: JSON-able facts the checks
    need (a tiling's stages, ...). ``arch_specific``: compile for sm_90a (Hopper's own instructions, ``wgmma``),
    as numba-cuda does on a compute-capability-9.0 GPU.
    """

    name: str
    function: object
    signature: object
    lto: bool = False
    launch_bounds: object = None
    resources: bool = True
    info: dict = field(default_factory=dict)
    arch_specific: bool = False


@dataclass(frozen=True)
class Compiled:
    """A compiled variant. ``ptx``: its PTX (after the link for LTO variants; None where ``cuda.core`` is
    missing, then only the LTO-IR was built); ``resources``: ptxas's report (the LTO link's log), None where
    nvJitLink is missing; ``error``: the traceback where compiling failed (then ``ptx`` is None)."""

    set_name: str
    name: str
    info: dict
    ptx: str | None
    resources: str | None
    error: str | None
    seconds: float


# ---------------------------------------------------------------------------- the compile process


def _lto_link(codes, output: str):
    """Link LTO-IR ``codes`` with link-time optimization for sm_90: (PTX text or cubin, the linker's log)."""
    from cuda.core import Linker, LinkerOptions, ObjectCode

    objects = [ObjectCode.from_ltoir(c) if isinstance(c, bytes) else c for c in codes]
    linker = Linker(*objects, options=LinkerOptions(arch="sm_90", link_time_optimization=True, ptx=output == "ptx",
                                                    verbose=output == "cubin"))
    code = linker.link(output).code
    return (code.decode().replace("\0", "") if output == "ptx" else code), linker.get_info_log()


def _compile(variant: Variant) -> tuple[str | None, str | None]:
    """(PTX, resource report) of one variant."""
    if not variant.lto:
        from numba import cuda

        cc, arch = ((9, 0, "a"), "sm_90a") if variant.arch_specific else ((9, 0), "sm_90")
        ptx, _ = cuda.compile_ptx(variant.function, variant.signature, cc=cc, launch_bounds=variant.launch_bounds)
        return ptx, ptxas_report(ptx, arch) if variant.resources else None
    from numba.cuda import compiler

    codes, _ = compiler.compile_all(variant.function, variant.signature, device=False, abi="numba", cc=(9, 0),
                                    output="ltoir", launch_bounds=variant.launch_bounds)
    try:
        import cuda.core  # noqa: F401
    except ImportError:  # typed and compiled to LTO-IR is all that can be checked here
        return None, None
    ptx, _ = _lto_link(codes, "ptx")
    _, log = _lto_link(codes, "cubin")  # ptxas's report on what a GPU would run
    return ptx, log


def serve(nice: bool = False) -> None:
    """A compile process: read the sets (one JSON line), answer their variant names (one JSON line), then
    for each request line ``[set, index]`` compile that variant and answer its ``Compiled`` as JSON.
    ``nice``: at a low CPU priority. Ends when its input does (also when the test process is gone)."""
    if nice:
        os.nice(10)
    from fp8lab.numba_kernels.inlining import install

    install()  # the same PTX, sooner
    answer = sys.stdout
    sys.stdout = sys.stderr  # whatever a set's source prints must not mix with the answers
    sets = json.loads(sys.stdin.readline())
    variants = {}
    for set_name, source in sets.items():
        namespace = {"__name__": f"ptx_set_{set_name}"}
        exec(compile(source, f"<variant set {set_name}>", "exec"), namespace)
        variants[set_name] = namespace["variants"]()
    answer.write(json.dumps({s: [v.name for v in vs] for s, vs in variants.items()}) + "\n")
    answer.flush()
    for line in sys.stdin:
        set_name, index = json.loads(line)
        variant = variants[set_name][index]
        start = time.perf_counter()
        try:
            ptx, resources = _compile(variant)
            error = None
        except Exception:
            ptx, resources, error = None, None, traceback.format_exc()
        result = Compiled(set_name, variant.name, variant.info, ptx, resources, error, time.perf_counter() - start)
        answer.write(json.dumps(asdict(result)) + "\n")
        answer.flush()


# ---------------------------------------------------------------------------- the test process

_cache: dict[tuple[str, str], list[Compiled]] = {}
_pending: dict[tuple[str, str], concurrent.futures.Future] = {}
"""Compiles started by ``start_compiling`` and not yet collected: one future per (set name, source)."""


class _Worker:
    """A compile process started by ``compile_sets``, its stderr in a temporary file; ``nice``: at a low
    CPU priority (a background compile must not slow the tests that run meanwhile)."""

    def __init__(self, sets: dict[str, str], nice: bool = False):
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen([sys.executable, "-c", f"from helpers.ptx import serve; serve(nice={nice})"],
                                        cwd=ROOT, env=compile_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True, bufsize=1)
        self.send(sets)

    def send(self, message) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self):
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            self.stderr.seek(0)
            raise RuntimeError(f"a compile process ended (status {self.process.returncode}):\n"
                               f"{self.stderr.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()


def compile_sets(sets: dict[str, str], workers: int = 2, timeout: float = 1800, progress=print) -> dict[str, list[Compiled]]:
    """Every variant of every set compiled (see the module docstring): ``{set name: [Compiled, ...]}`` in
    the order ``variants()`` lists them. Sets already compiled in this session come from the cache, sets
    that ``start_compiling`` started are waited for."""
    for key in [key for key in sets.items() if key in _pending]:
        progress(f"[ptx] waiting for the background compile of {key[0]}")
        _cache.update(_pending.pop(key).result(timeout=timeout))
    todo = {name: source for name, source in sets.items() if (name, source) not in _cache}
    if todo:
        _cache.update(_compile_in_processes(todo, workers, timeout, progress))
    return {name: _cache[name, source] for name, source in sets.items()}


def start_compiling(sets: dict[str, str], workers: int = 2, timeout: float = 1800) -> None:
    """Start compiling ``sets`` in the background, in compile processes at a low CPU priority, and return
    at once; ``compile_sets`` collects the results. For a session hook (``pytest_collection_finish``) on a
    machine where the simulator tests leave a core idle: the compiles then cost no wall time."""
    todo = {name: source for name, source in sets.items() if (name, source) not in _cache and (name, source) not in _pending}
    if not todo:
        return
    future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(_compile_in_processes(todo, workers, timeout, lambda line: None, nice=True))
        except BaseException as error:  # handed to whoever collects the results
            future.set_exception(error)

    threading.Thread(target=run, name="ptx compiles", daemon=True).start()  # never holds up the session's end
    for key in todo.items():
        _pending[key] = future


def _compile_in_processes(sets, workers, timeout, progress, nice=False):
    start = time.perf_counter()
    pool = [_Worker(sets, nice) for _ in range(workers)]
    try:
        names = [worker.receive() for worker in pool][0]
        queue = [(s, i) for s in sets for i in range(len(names[s]))]
        total, results = len(queue), {s: [None] * len(names[s]) for s in sets}
        progress(f"[ptx] compiling {total} variants of {', '.join(sets)} in {workers} processes")
        selector = selectors.DefaultSelector()
        for worker in pool:
            selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
        busy = 0
        for worker in pool:
            if queue:
                worker.send(queue.pop(0))
                busy += 1
        done = 0
        while busy:
            remaining = timeout - (time.perf_counter() - start)
            events = selector.select(timeout=max(remaining, 0))
            if not events:
                raise TimeoutError(f"[ptx] compiling took more than {timeout} s ({done} of {total} done)")
            for key, _ in events:
                worker = key.data
                result = Compiled(**worker.receive())
                results[result.set_name][names[result.set_name].index(result.name)] = result
                done, busy = done + 1, busy - 1
                status = "FAILED" if result.error else f"{result.seconds:.1f} s"
                progress(f"[ptx {done}/{total}] {result.set_name}: {result.name}: {status}")
                if queue:
                    worker.send(queue.pop(0))
                    busy += 1
        progress(f"[ptx] {total} variants in {time.perf_counter() - start:.1f} s")
        return {(name, source): results[name] for name, source in sets.items()}
    finally:
        for worker in pool:
            worker.close()


def progress_printer(config):
    """Where ``compile_sets`` reports: straight to the terminal with ``-v`` (output capture suspended for
    the line), else print (shown with ``-s``)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or config.get_verbosity() < 1:
        return print

    def write(line: str) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    return write


def each_variant(compiled: list[Compiled], check) -> None:
    """``check(c)`` for every compiled variant; then one failure naming every variant that did not compile
    or failed its check (with the message), so that one bad variant does not hide the others."""
    failures = []
    for c in compiled:
        if c.error:
            failures.append(f"{c.name}: did not compile:\n{c.error}")
            continue
        try:
            check(c)
        except AssertionError as error:
            failures.append(f"{c.name}: {error}")
    assert not failures, f"{len(failures)} of {len(compiled)} variants failed:\n" + "\n".join(failures)


def check_pdl_rules(ptx: str, weights_before_wait: bool = False, loads_before_wait: bool = False) -> None:
    """The rules of ``fp8lab.numba_kernels.pdl`` in a kernel's PTX: it waits for the previous kernel
    (``griddepcontrol.wait``) before any store or atomic to global or generic memory and only then lets the next
    kernel launch (``griddepcontrol.launch_dependents``); before the wait it loads nothing from memory either,
    except (``weights_before_wait``, the SIMT GEMV) through the read-only path (``ld.global.nc``, the weight
    codes) and ``ld.global.f32`` (their block scales; a CTA-per-row norm's weight), or (``loads_before_wait``, the
    attention input and the decode attention with it: the norm weights, positions and their cos/sin, the block table
    and the first KV tile, which no kernel of the forward or only kernels before the previous one wrote) any global
    load.
    The PTX of a kernel is straight-line up to its first branch, and the two instructions come first, so "before"
    in the text is before in time (for the attention with its input, whose early loads branch, every path to the
    wait passes through that text)."""
    assert ptx.count("griddepcontrol.launch_dependents;") == 1, "launch_dependents: not exactly once"
    assert ptx.count("griddepcontrol.wait;") == 1, "griddepcontrol.wait: not exactly once"
    before = ptx[: ptx.index("griddepcontrol.wait;")]
    assert "griddepcontrol.launch_dependents;" not in before, "launch_dependents before the wait"
    for line in before.splitlines():
        op = line.strip().split(" ")[0].split("\t")[0]
        if op.startswith(("st.", "atom.", "red.")) and not op.startswith(("st.local", "st.param", "st.shared")):
            raise AssertionError(f"a store before griddepcontrol.wait: {line.strip()}")
        if op.startswith("cp.async"):  # a copy from global memory is a load too
            raise AssertionError(f"an asynchronous copy before griddepcontrol.wait: {line.strip()}")
        if op.startswith("ld.") and not op.startswith(("ld.param", "ld.local", "ld.shared")):
            allowed = (weights_before_wait and (op.startswith("ld.global.nc.") or op == "ld.global.f32")) or (
                loads_before_wait and op.startswith("ld.global."))
            assert allowed, f"a load before griddepcontrol.wait: {line.strip()}"
