"""Choosing a backend and loading a model on it: ``load_model(checkpoint, backend)``.

The backends (``BACKEND_CHOICES``, what ``fp8lab generate --backend`` and ``fp8lab eval --backend`` take):
``reference`` (``fp8lab.engine.model.Qwen3Model`` on ``fp8lab.engine.backend.ReferenceBackend``),
``cuda`` and ``cudasim`` (``fp8lab.engine.cuda.model.CudaQwen3Model`` on a GPU or in Numba's CUDA
simulator), ``auto``. The GPU model is imported only here and only when asked for, so that choosing
``cudasim`` can still switch numba to its simulator before numba is first imported (``enable_cudasim``).
Also here: the simulator's size guard (``simulator_too_slow``) and the memory a KV cache may take
(``kv_cache_memory_available``).
"""

from __future__ import annotations

from .backend import BACKENDS, GEMM_INPUTS, Backend, ReferenceBackend
from .kv_manager import host_available_bytes

BACKEND_CHOICES = ("auto", "reference", "cuda", "cudasim")
"""What ``fp8lab generate --backend`` takes (``load_model``):

- ``reference``: ``Qwen3Model`` on ``ReferenceBackend`` (NumPy on the CPU);
- ``cuda``: ``fp8lab.engine.cuda.model.CudaQwen3Model``, the kernels of ``numba_kernels`` on an NVIDIA GPU;
- ``cudasim``: the same model and kernels in Numba's CUDA simulator, which runs every GPU thread in Python:
  for testing the kernels on micro models, about ten minutes per token on the demo model
  (``simulator_too_slow``);
- ``auto``: ``cuda`` when numba-cuda sees a GPU and the kernels take the model's shapes, else ``reference``.
"""


SIMULATOR_SECONDS_PER_WORK = 600 / (384 * 1024 * 6)
"""Simulator seconds per generated token per unit of ``simulator_work``: about ten minutes a token on the demo
model (hidden 384, intermediate 1024, 6 layers). A rough scale, for messages, not a benchmark."""
SIMULATOR_MAX_WORK = 2**16
"""Largest ``simulator_work`` the commands run in the simulator without being asked (about 15 s a token):
the micro models of the tests (hidden and intermediate 128, 1 or 2 layers) are well below it."""
SIMULATOR_HELP = ("cudasim: the kernels in Numba's CUDA simulator, which runs every GPU thread in Python: for "
                  "testing the kernels on micro models, about ten minutes per token on the demo model (bigger "
                  "models need --allow-slow-simulator)")
"""What ``--help`` of ``fp8lab generate`` and ``fp8lab eval`` says about ``cudasim``."""


def simulator_work(config) -> int:
    """The size that the simulator's time per token grows with: ``hidden_size * intermediate_size * layers``."""
    return config.hidden_size * config.intermediate_size * config.num_hidden_layers


def simulator_too_slow(config) -> str | None:
    """Why ``config`` is too big for the CUDA simulator (its rough time per token), or None when it is small."""
    work = simulator_work(config)
    if work <= SIMULATOR_MAX_WORK:
        return None
    minutes = work * SIMULATOR_SECONDS_PER_WORK / 60
    return (f"the CUDA simulator runs every GPU thread in Python, to test the kernels on micro models; this model "
            f"(hidden {config.hidden_size} x intermediate {config.intermediate_size} x {config.num_hidden_layers} "
            f"layers) would take roughly {minutes:.0f} minutes per token")


def check_simulator_size(config, allow_slow: bool) -> None:
    """The commands' check before ``--backend cudasim``: a ``ValueError`` naming the way out (and
    ``--allow-slow-simulator``) when ``simulator_too_slow(config)``, unless ``allow_slow``."""
    reason = simulator_too_slow(config)
    if reason is not None and not allow_slow:
        raise ValueError(f"--backend cudasim: {reason}; use --backend reference (NumPy on the CPU) or cuda (a GPU), "
                         "or pass --allow-slow-simulator to run it anyway")


def kv_cache_memory_available(backend: str) -> tuple[int | None, str]:
    """Bytes free now for a KV cache on ``backend`` (``reference``, ``cuda``, ``cudasim``), and where: free GPU
    memory for ``cuda``, host memory otherwise (the simulator's device arrays are NumPy arrays). None where
    the system does not say. Call it after loading the model, so that the weights are already counted."""
    if backend == "cuda":
        from .cuda.memory import gpu_memory_info

        return gpu_memory_info()[0], "free GPU memory"
    return host_available_bytes(), "available host memory"


def get_backend(name: str) -> Backend:
    """A per-operator backend by its command-line name (``reference``). The GPU path is a whole model,
    not a per-operator backend: ``load_model(checkpoint, "cuda")``."""
    if name in ("cuda", "cudasim"):
        raise ValueError(f"backend {name!r} runs as fp8lab.engine.cuda.model.CudaQwen3Model, not as a per-operator "
                         "Backend: use fp8lab.engine.loading.load_model(checkpoint, name)")
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None


def _nvidia_driver_present() -> bool:
    """A cheap look for an NVIDIA driver, without importing numba."""
    import os
    import shutil

    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def gpu_available() -> bool:
    """True when numba-cuda sees an NVIDIA GPU (False in a process that runs the CUDA simulator)."""
    import os

    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not _nvidia_driver_present():
        return False
    try:
        from numba import config, cuda

        return not config.ENABLE_CUDASIM and bool(cuda.is_available())
    except Exception:  # numba-cuda missing, or a driver without a usable GPU
        return False


def enable_cudasim() -> None:
    """Switch numba to its CUDA simulator. Numba reads ``NUMBA_ENABLE_CUDASIM`` once, when it is first
    imported, so this must run before anything imports numba (``engine`` imports it lazily, only here and
    in ``fp8lab.engine.cuda``); a process that already drives a real GPU gets a ``RuntimeError``."""
    import os
    import sys

    if "numba" in sys.modules:
        from numba import config

        if not config.ENABLE_CUDASIM:
            raise RuntimeError("backend 'cudasim': numba was already imported without NUMBA_ENABLE_CUDASIM=1 in "
                               "this process; start it with NUMBA_ENABLE_CUDASIM=1")
        return
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def resolve_backend(name: str, config=None) -> str:
    """``reference``, ``cuda`` or ``cudasim`` for a ``BACKEND_CHOICES`` name; ``auto`` picks ``cuda`` when a
    GPU is there and (given ``config``) the kernels take the model, else ``reference``."""
    if name not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKEND_CHOICES)}")
    if name != "auto":
        return name
    if not gpu_available():
        return "reference"
    if config is not None:
        from .cuda.weights import unsupported_reason

        if unsupported_reason(config) is not None:
            return "reference"
    return "cuda"


def load_model(checkpoint, backend: str = "auto", gemm_input: str = "float32", **cuda_options):
    """The model for ``checkpoint`` on ``backend`` (a ``BACKEND_CHOICES`` name): ``Qwen3Model`` on
    ``ReferenceBackend(gemm_input=gemm_input)``, or ``CudaQwen3Model`` (``cuda_options``: its
    constructor's keywords, e.g. ``max_num_tokens``, ``max_num_seqs``, ``f32_max_rows``) on a GPU or in
    the simulator. ``cuda`` without a GPU is a ``RuntimeError``.

    On the GPU model ``gemm_input="bf16"`` means ``f32_max_rows=0``: every FP8 GEMM rounds its input
    to BF16. ``"float32"`` keeps ``f32_max_rows`` (default ``plan.DEFAULT_F32_MAX_ROWS``, 1): GEMMs of at most that many rows take float32 inputs, larger ones BF16, so a caller
    that wants float32 throughout feeds at most ``f32_max_rows`` tokens per forward (as
    ``fp8lab.engine.evaluate`` does)."""
    if gemm_input not in GEMM_INPUTS:
        raise ValueError(f"gemm_input: expected one of {', '.join(GEMM_INPUTS)}, got {gemm_input!r}")
    name = resolve_backend(backend, checkpoint.config)
    if name == "reference":
        from .model import Qwen3Model

        return Qwen3Model.from_checkpoint(checkpoint, ReferenceBackend(gemm_input=gemm_input))
    if gemm_input == "bf16":
        if cuda_options.get("f32_max_rows", 0) != 0:
            raise ValueError(f"gemm_input 'bf16' means f32_max_rows=0, got f32_max_rows={cuda_options['f32_max_rows']}")
        cuda_options["f32_max_rows"] = 0
    if name == "cudasim":
        enable_cudasim()
    elif not gpu_available():
        raise RuntimeError("backend 'cuda': numba-cuda sees no NVIDIA GPU (use --backend reference, or cudasim "
                           "for the kernels in the CUDA simulator)")
    from .cuda.model import CudaQwen3Model

    return CudaQwen3Model.from_checkpoint(checkpoint, **cuda_options)
