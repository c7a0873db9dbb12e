"""Adapters: check a kernel that takes and returns torch or CuPy tensors (CPU or GPU) with the kit, which
speaks NumPy.

``on_torch(fn, device)`` and ``on_cupy(fn)`` wrap ``fn`` into the NumPy callable a ``check_*`` function
takes::

    from fp8lab.testing import check_e4m3_encode
    from fp8lab.testing.adapters import on_torch

    check_e4m3_encode(on_torch(lambda x: x.clamp(-448, 448).to(torch.float8_e4m3fn), device="cuda"))

What the wrapper does on each call:

- every NumPy array argument becomes a tensor on the device (NumPy scalars become Python numbers;
  Python scalars, tuples, strings and ``None`` pass through as they are);
- the outputs come back as NumPy arrays: through DLPack (``np.from_dlpack``) from
  host memory, through a device-to-host copy from device memory (``__cuda_array_interface__`` or a
  CUDA DLPack tensor); a tuple (or list) of outputs stays a tuple (list), ``None`` stays ``None``;
- in-place writes reach the kit: after the call every writable array argument gets its tensor's
  contents copied back (the paged cache write fills the caches it is given).

Dtype convention. In NumPy, E4M3 codes are ``uint8`` and BF16 values are ``uint16`` bit patterns (NumPy
has neither dtype). The torch adapter views ``uint8`` arguments as ``torch.float8_e4m3fn`` and
``uint16`` ones as ``torch.bfloat16`` (same bits, no conversion); ``raw_bits=True`` keeps them
``torch.uint8`` / ``torch.uint16``, for kernels that take raw bytes. Outputs of a 1-byte float8 dtype
come back as their ``uint8`` codes and ``bfloat16`` ones as ``uint16`` bit patterns, whatever
``raw_bits`` (a ``float8_e4m3fnuz`` output thus reaches the kit as the fnuz codes it holds, wrong codes,
never silently converted to the right format). CuPy has neither dtype: ``on_cupy`` keeps ``uint8`` and ``uint16``.

fp8lab imports torch (CuPy) only inside ``on_torch`` (``on_cupy``): ``import fp8lab.testing`` needs
NumPy and Hypothesis only. A missing package raises ``ImportError`` and a device that cannot be used
``RuntimeError``, each with a one-line message, when the adapter is made (not in the middle of a check).
``adapt`` is the generic wrapper both are built on, for any other array library with DLPack (JAX, MLX, ...).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

DLPACK_CPU = 1
"""``kDLCPU``, DLPack's device type of host memory (``__dlpack_device__()[0]``)."""


def as_numpy(value, to_host: Callable | None = None) -> np.ndarray:
    """``value`` as a NumPy array: a NumPy array as it is; an object in host memory through DLPack (copied,
    so that the producer may reuse its buffer); one in device memory (a non-CPU
    ``__dlpack_device__`` or a ``__cuda_array_interface__``) through ``to_host``, the caller's
    device-to-host copy; anything else (Python numbers, lists) through ``np.asarray``."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack_device__") and value.__dlpack_device__()[0] == DLPACK_CPU:
        return np.from_dlpack(value).copy()
    if hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack_device__"):
        if to_host is None:
            raise TypeError(f"fp8lab.testing: an output of type {type(value).__name__} is in device memory and "
                            "this adapter has no device-to-host copy (use on_torch or on_cupy)")
        return np.asarray(to_host(value))
    return np.asarray(value)


def adapt(fn: Callable, to_tensor: Callable, to_numpy: Callable = as_numpy) -> Callable:
    """``fn`` on some array library's tensors, as a callable on NumPy arrays: each array argument goes
    through ``to_tensor``, each output through ``to_numpy``, and each writable array argument gets its
    tensor's contents back after the call (in-place writes). See the module docstring."""

    @functools.wraps(fn)
    def on_numpy(*args, **kwargs):
        arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]
        tensors = {id(a): to_tensor(a) for a in arrays}

        def argument(a):
            if isinstance(a, np.ndarray):
                return tensors[id(a)]
            return a.item() if isinstance(a, np.generic) else a

        out = fn(*map(argument, args), **{name: argument(a) for name, a in kwargs.items()})
        for a in arrays:
            if a.flags.writeable:
                np.copyto(a, to_numpy(tensors[id(a)]))
        return _outputs(out, to_numpy)

    return on_numpy


def _outputs(out, to_numpy: Callable):
    """The outputs with every tensor through ``to_numpy``; lists stay lists, other tuples (named ones, torch's
    return types) plain tuples, nested too; ``None`` stays ``None``."""
    if isinstance(out, (tuple, list)):
        items = [_outputs(o, to_numpy) for o in out]
        return items if isinstance(out, list) else tuple(items)
    return None if out is None else to_numpy(out)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---------------------------------------------------------------------------- torch


def on_torch(fn: Callable, device: str = "cpu", raw_bits: bool = False) -> Callable:
    """``fn`` on torch tensors on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...) as a NumPy callable;
    ``uint8`` arguments are viewed as ``torch.float8_e4m3fn`` and ``uint16`` as ``torch.bfloat16`` unless
    ``raw_bits`` (module docstring). Raises ``ImportError`` without torch, ``RuntimeError`` when torch
    cannot allocate on ``device``."""
    try:
        import torch
    except ImportError:
        raise ImportError("fp8lab.testing.on_torch needs PyTorch, which is not installed: pip install torch") from None
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as error:  # torch says "not compiled with CUDA" by assert
        raise RuntimeError(f"fp8lab.testing.on_torch: torch {torch.__version__} cannot use device {device!r}: "
                           f"{_first_line(error)}") from None
    typed = {} if raw_bits else {np.dtype(np.uint8): torch.float8_e4m3fn, np.dtype(np.uint16): torch.bfloat16}

    def to_tensor(a: np.ndarray):
        # torch.from_numpy shares the array's memory; a C-order copy where it is read-only or strided
        # (kernels expect contiguous tensors; in-place writes come back through the copy-back anyway)
        t = torch.from_numpy(a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C"))
        if a.dtype in typed:
            t = t.view(typed[a.dtype])
        return t.to(device)

    def to_numpy(value):
        if not isinstance(value, torch.Tensor):
            return as_numpy(value)
        t = value.detach().cpu()  # the device-to-host copy; DLPack refuses tensors that require grad
        if t.dtype.is_floating_point and t.dtype.itemsize == 1:
            t = t.view(torch.uint8)  # float8 has no DLPack (nor NumPy) dtype: its codes
        elif t.dtype == torch.bfloat16:
            t = t.view(torch.uint16)
        return as_numpy(t)

    return adapt(fn, to_tensor, to_numpy)


# ---------------------------------------------------------------------------- CuPy


def on_cupy(fn: Callable) -> Callable:
    """``fn`` on CuPy arrays on the current CUDA device as a NumPy callable (dtypes kept: E4M3 codes stay
    ``uint8``, BF16 bit patterns ``uint16``). Outputs may be CuPy arrays or any object with
    ``__cuda_array_interface__`` or CUDA DLPack. Raises ``ImportError`` without CuPy, ``RuntimeError``
    without a CUDA device."""
    try:
        import cupy
    except ImportError:
        raise ImportError("fp8lab.testing.on_cupy needs CuPy, which is not installed: pip install cupy-cuda12x "
                          "(or cupy-cuda13x)") from None
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError without a driver
        raise RuntimeError(f"fp8lab.testing.on_cupy: no CUDA device: {_first_line(error)}") from None
    if devices == 0:
        raise RuntimeError("fp8lab.testing.on_cupy: no CUDA device")

    def to_host(value):
        return cupy.asnumpy(value if hasattr(value, "__cuda_array_interface__") else cupy.from_dlpack(value))

    return adapt(fn, cupy.asarray, lambda value: as_numpy(value, to_host))
