"""Where the decode step that crosses a context bound spends its seconds (a GPU diagnostic, issue 15).

A decode step is planned for its context bound (``fp8lab.engine.cuda.plan.decode_context_bound``: a power of two),
and the first step of a (bucket, bound) runs eagerly and captures a graph. In ``bench/engine.py`` with a 1,000-token
prompt and 3 + 32 decode steps, the step whose context passed 1,024 tokens cost about 3.5 s, while the graph captures
of the whole run took 0.26 s (``bench/RESULTS.md``, thirty-first session). This probe repeats that run on a random
Qwen3 checkpoint (default the 0.6B shape) and prints every kernel specialization Numba compiles (kernel, seconds,
time since start) and every decode step's host time, so a compile at the new bound shows as a line between the steps.

    python bench/bound_crossing_probe.py [qwen3-0.6b|qwen3-8b]
"""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fp8lab.numba_kernels.inlining import install  # noqa: E402

install()
from numba.cuda import dispatcher  # noqa: E402

START = time.perf_counter()
_compile = dispatcher.CUDADispatcher.compile


def compile_logged(self, sig):
    """``CUDADispatcher.compile`` that prints each new specialization and its time."""
    argtypes = dispatcher.sigutils.normalize_signature(sig)[0]
    if argtypes in self.overloads:
        return _compile(self, sig)
    start = time.perf_counter()
    kernel = _compile(self, sig)
    print(f"[{time.perf_counter() - START:8.2f} s] compiled {self.py_func.__name__} in "
          f"{time.perf_counter() - start:.2f} s", flush=True)
    return kernel


dispatcher.CUDADispatcher.compile = compile_logged


def main(shape: str = "qwen3-0.6b", prompt_len: int = 1000) -> None:
    import engine as bench_engine

    from fp8lab.engine import shapes
    from fp8lab.engine.cuda.model import CudaQwen3Model

    config = shapes.shape_config(shape, None)
    prompts = bench_engine.random_prompts(config.vocab_size, 1, prompt_len, 0)
    model = CudaQwen3Model.from_checkpoint(shapes.random_checkpoint(shape, 0, None), max_num_tokens=prompt_len,
                                           max_num_seqs=1)
    print(f"[{time.perf_counter() - START:8.2f} s] model ready", flush=True)
    bench_engine.run_once(model, prompts, 0, 3, 16, "fp8")  # the bench's warm run: compiles, captures
    print(f"[{time.perf_counter() - START:8.2f} s] warm run done", flush=True)
    run = bench_engine.run_once(model, prompts, 3, 32, 16, "fp8")  # its context crosses 1,024 tokens
    print(f"[{time.perf_counter() - START:8.2f} s] timed run done; host ms per step (after 3 untimed):",
          [round(s * 1e3, 2) for s in run["step_s"]], flush=True)
    print("stats", run["stats"], flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
