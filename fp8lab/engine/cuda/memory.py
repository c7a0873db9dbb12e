"""Device memory of the GPU model: every allocation and every host/device copy goes through here.

On a GPU the arrays are Numba device arrays; in Numba's CUDA simulator they are NumPy arrays (what the
simulated kernels take), and a "copy to the device" is a NumPy assignment. Running out of memory while
loading the weights or allocating the KV cache raises ``RuntimeError`` naming what did not fit and how
many bytes it needed (and, on a GPU, how many were free), not a crash in a kernel.
"""

from __future__ import annotations

import functools

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


def _copied_bytes(dst, src, count, what: str) -> int:
    """Bytes that copying the first ``count`` elements (C order; all of ``src`` when None) of ``src`` into
    ``dst`` moves: one dtype, both C-contiguous, ``count`` within both."""
    n = src.size if count is None else int(count)
    if np.dtype(dst.dtype) != np.dtype(src.dtype) or not 0 <= n <= min(dst.size, src.size):
        raise ValueError(f"{what}: cannot copy {n} elements of {src.dtype} {tuple(src.shape)} into "
                         f"{dst.dtype} {tuple(dst.shape)}")
    for x in (dst, src):
        contiguous = x.flags["C_CONTIGUOUS"] if isinstance(x, np.ndarray) else x.is_c_contiguous()
        if not contiguous:
            raise ValueError(f"{what}: needs C-contiguous arrays, got strides {x.strides}")
    return n * np.dtype(src.dtype).itemsize


# The copies call the driver directly: a Numba ``copy_to_device`` / ``copy_to_host`` (and the slice that
# would name the prefix) costs 100 to 300 us of host time per call, against a few us here; a decode step
# makes two of them while the GPU waits. Like Numba's methods they first make the CUDA context current in
# the calling thread (``require_context``): a server runs the model on a thread of its own.


@functools.cache
def _driver_copy(name: str):
    """Numba's ``driver.host_to_device`` or ``driver.device_to_host``, in the thread's CUDA context."""
    from numba.cuda.cudadrv import devices, driver

    return devices.require_context(getattr(driver, name))


def to_device(dst, src: np.ndarray, stream, count: int | None = None) -> None:
    """Copy the first ``count`` elements (C order; all of host ``src`` when None) of host ``src`` into the
    device array ``dst``, ordered on ``stream``."""
    nbytes = _copied_bytes(dst, src, count, "to_device")
    if SIMULATOR:
        dst.reshape(-1)[: nbytes // src.itemsize] = src.reshape(-1)[: nbytes // src.itemsize]
    elif nbytes:
        _driver_copy("host_to_device")(dst, src, nbytes, stream=stream)


def to_host(dst: np.ndarray, src, stream, count: int | None = None) -> None:
    """Copy the first ``count`` elements (C order; all of ``src`` when None) of the device array ``src`` into
    host ``dst``, ordered on ``stream`` (complete after ``synchronize``; ``dst`` page-locked for the copy
    to be asynchronous)."""
    nbytes = _copied_bytes(dst, src, count, "to_host")
    if SIMULATOR:
        dst.reshape(-1)[: nbytes // src.itemsize] = src.reshape(-1)[: nbytes // src.itemsize]
    elif nbytes:
        _driver_copy("device_to_host")(dst, src, nbytes, stream=stream)


def column_slice(matrix, start: int, stop: int):
    """``matrix[:, start:stop]`` of a C-contiguous 2-D array, built in constant host time.

    Numba's slicing of a device array walks every row of a strided result to list its memory extents
    (a prefill of 8,192 tokens spent 0.6 s of host time per forward in it); this view is made from its
    shape, its strides and the one memory range it spans."""
    rows, columns = matrix.shape
    if SIMULATOR or rows == 0 or not 0 <= start < stop <= columns:
        return matrix[:, start:stop]
    if not matrix.is_c_contiguous():
        raise ValueError(f"column_slice: needs a C-contiguous matrix, got strides {matrix.strides}")
    itemsize = np.dtype(matrix.dtype).itemsize
    first, end = start * itemsize, ((rows - 1) * columns + stop) * itemsize
    return type(matrix)(shape=(rows, stop - start), strides=(columns * itemsize, itemsize), dtype=matrix.dtype,
                        gpu_data=matrix.gpu_data.view(first, end), stream=matrix.stream)


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


def new_event():
    """A CUDA event (``record``, ``wait``): a point in a stream's order the host can wait for (None in the
    simulator, where every copy and kernel is done when its call returns)."""
    return None if SIMULATOR else cuda.event(timing=False)


def record(event, stream) -> None:
    """Mark ``event`` at this point of ``stream``'s order."""
    if event is not None:
        event.record(stream=stream)


def wait(event) -> None:
    """Wait until the work ordered on the event's stream before its last ``record`` is done (nothing to wait
    for when it was never recorded, or in the simulator)."""
    if event is not None:
        event.synchronize()
