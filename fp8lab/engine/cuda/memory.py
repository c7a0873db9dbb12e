"""Device memory of the GPU model: every allocation and every host/device copy goes through here.

On a GPU the arrays are Numba device arrays; in Numba's CUDA simulator they are NumPy arrays (what the
simulated kernels take), and a "copy to the device" is a NumPy assignment. Running out of memory while
loading the weights or allocating the KV cache raises ``RuntimeError`` naming what did not fit and how
many bytes it needed (and, on a GPU, how many were free), not a crash in a kernel.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from fp8lab.numba_kernels.bits import SIMULATOR

POISON_BYTE = 0xFF
"""A fresh KV cache is filled with 0xFF bytes: NaN in E4M3 (0xFF), BF16 (0xFFFF) and float32 scales, so a
slot read before it was written gives NaN, as the reference cache's NaN poison does."""


def gpu_memory_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current GPU's memory, as the driver reports them now (GPU only)."""
    free, total = cuda.current_context().get_memory_info()
    return int(free), int(total)


def _cuda_memory_errors() -> tuple[type, ...]:
    if SIMULATOR:
        return (MemoryError,)
    from numba.cuda.cudadrv.driver import CudaAPIError, CudaDriverError

    return (MemoryError, CudaAPIError, CudaDriverError)


class DeviceMemory:
    """Every device allocation of one model: NumPy arrays in the simulator (what its kernels take), Numba
    device arrays on a GPU. Running out of memory is a ``RuntimeError`` naming the array;
    ``allocated_bytes`` counts what the model holds."""

    def __init__(self):
        self.allocated_bytes = 0

    def _out_of_memory(self, what: str, nbytes: int, error: Exception) -> RuntimeError:
        free = ""
        if not SIMULATOR:
            try:
                free_bytes, total_bytes = cuda.current_context().get_memory_info()
                free = f"; {free_bytes:,} of {total_bytes:,} bytes of GPU memory are free"
            except Exception:  # the context may be unusable after the failure
                pass
        where = "host memory (CUDA simulator)" if SIMULATOR else "GPU memory"
        return RuntimeError(f"out of {where}: {what} needs {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB){free}; "
                            f"this model holds {self.allocated_bytes:,} bytes so far ({type(error).__name__}: {error})")

    def empty(self, what: str, shape, dtype):
        """An uninitialized device array; ``what`` names it in an out-of-memory error."""
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        try:
            array = np.empty(shape, dtype) if SIMULATOR else cuda.device_array(shape, dtype)
        except _cuda_memory_errors() as e:
            raise self._out_of_memory(what, nbytes, e) from None
        self.allocated_bytes += nbytes
        return array

    def upload(self, what: str, host: np.ndarray):
        """A device copy of the host array ``host``."""
        host = np.ascontiguousarray(host)
        if SIMULATOR:
            self.allocated_bytes += host.nbytes
            return host.copy()
        try:
            array = cuda.to_device(host)
        except _cuda_memory_errors() as e:
            raise self._out_of_memory(what, host.nbytes, e) from None
        self.allocated_bytes += host.nbytes
        return array

    def poisoned(self, what: str, shape, dtype):
        """An array of ``shape`` filled with 0xFF bytes (``POISON_BYTE``)."""
        array = self.empty(what, shape, dtype)
        if SIMULATOR:
            array.view(np.uint8)[...] = POISON_BYTE
        else:
            from numba.cuda.cudadrv.driver import device_memset

            device_memset(array, POISON_BYTE, array.nbytes)
        return array

    @staticmethod
    def pinned(shape, dtype) -> np.ndarray:
        """Page-locked host memory (fast, asynchronous copies); plain NumPy in the simulator."""
        return np.zeros(shape, dtype) if SIMULATOR else cuda.pinned_array(shape, dtype)


def new_stream():
    """The stream a model orders its work on (0, the default, in the simulator)."""
    return 0 if SIMULATOR else cuda.stream()


def to_device(dst, src: np.ndarray, stream) -> None:
    """Copy host ``src`` into the device array ``dst`` (same size), ordered on ``stream``."""
    if SIMULATOR:
        dst[...] = src.reshape(dst.shape)
    else:
        dst.copy_to_device(src, stream=stream)


def to_host(dst: np.ndarray, src, stream) -> None:
    """Copy the device array ``src`` into host ``dst``, ordered on ``stream`` (complete after ``synchronize``)."""
    if SIMULATOR:
        dst[...] = src
    else:
        src.copy_to_host(dst, stream=stream)


def device_copy(dst, src, stream) -> None:
    """Copy device ``src`` into device ``dst``, ordered on ``stream``."""
    if SIMULATOR:
        dst[...] = src
    else:
        dst.copy_to_device(src, stream=stream)


def synchronize(stream) -> None:
    """Wait until everything ordered on ``stream`` is done (nothing to wait for in the simulator)."""
    if not SIMULATOR:
        stream.synchronize()
