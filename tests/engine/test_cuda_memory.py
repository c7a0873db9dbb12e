"""The GPU model's host/device copies and column views (``fp8lab.engine.cuda.memory``).

``to_device`` and ``to_host`` copy a prefix of ``count`` elements with one driver call (the decode step's
index upload and token download); ``column_slice`` builds ``matrix[:, a:b]`` without Numba's per-row
walk. In the simulator (``cudasim``) the arrays are NumPy; on a GPU (``gpu``) Numba's own slicing and
``copy_to_host`` are the independent oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

from fp8lab.engine.cuda import memory

POISON = -7


def _poisoned(shape, dtype=np.int32):
    return np.full(shape, POISON, dtype)


@pytest.mark.cudasim
@pytest.mark.parametrize("count", [0, 1, 13, 24])
def test_prefix_copies_move_count_elements_and_nothing_else(rng, count):
    src = rng.integers(-1000, 1000, (4, 6), dtype=np.int32)
    device = _poisoned((4, 6))
    memory.to_device(device, src, 0, count=count)
    assert np.array_equal(device.reshape(-1)[:count], src.reshape(-1)[:count])
    assert np.all(device.reshape(-1)[count:] == POISON)
    host = _poisoned(30)
    memory.to_host(host, device, 0, count=count)
    assert np.array_equal(host[:count], src.reshape(-1)[:count])
    assert np.all(host[count:] == POISON)


@pytest.mark.cudasim
def test_a_whole_copy_without_count(rng):
    src = rng.standard_normal((3, 5)).astype(np.float32)
    device = np.full((3, 5), np.nan, np.float32)
    memory.to_device(device, src, 0)
    host = np.full((3, 5), np.nan, np.float32)
    memory.to_host(host, device, 0)
    assert np.array_equal(host, src)


@pytest.mark.cudasim
@pytest.mark.parametrize("case", ["dtype", "too many", "negative", "strided"])
def test_bad_copies_are_one_line_errors(case):
    src = np.arange(12, dtype=np.int32)
    dst = _poisoned(12)
    if case == "dtype":
        dst = dst.astype(np.int64)
    count = {"too many": 13, "negative": -1}.get(case)
    if case == "strided":
        src = np.arange(24, dtype=np.int32)[::2]
    with pytest.raises(ValueError, match=r"^to_device: ") as error:
        memory.to_device(dst, src, 0, count=count)
    assert "\n" not in str(error.value)
    assert np.all(dst == POISON)


@pytest.mark.cudasim
def test_column_slice_is_numpy_slicing(rng):
    matrix = rng.standard_normal((5, 12)).astype(np.float32)
    view = memory.column_slice(matrix, 3, 7)
    assert np.shares_memory(view, matrix)
    assert np.array_equal(view, matrix[:, 3:7])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_gpu_column_slice_is_numbas_slice(rng, rows):
    from numba import cuda

    host = rng.standard_normal((rows, 96)).astype(np.float32)
    matrix = cuda.to_device(host)
    for start, stop in ((0, 32), (32, 48), (48, 96), (5, 6)):
        view = memory.column_slice(matrix, start, stop)
        want = matrix[:, start:stop]  # Numba's slicing: the oracle
        assert view.__cuda_array_interface__ == want.__cuda_array_interface__
        assert view.alloc_size == want.alloc_size
        assert np.array_equal(view.copy_to_host(), host[:, start:stop])


@pytest.mark.gpu
def test_gpu_prefix_copies(rng):
    from numba import cuda

    src = cuda.pinned_array(40, np.int32)
    src[...] = rng.integers(-1000, 1000, 40, dtype=np.int32)
    device = cuda.to_device(_poisoned(40))
    stream = cuda.stream()
    memory.to_device(device, src, stream, count=17)
    back = cuda.pinned_array(40, np.int32)
    back[...] = POISON
    memory.to_host(back, device, stream, count=40)
    stream.synchronize()
    assert np.array_equal(back[:17], src[:17])
    assert np.all(back[17:] == POISON)
