"""``fp8lab.testing.adapters``: a kernel on another array library's tensors, checked by the NumPy kit.

Without torch: the generic path (``adapt``) over a made-up library whose tensors are readable only
through DLPack (NumPy arrays implement it), the in-place copy-back through a real check, and the routing of
device memory (a fake ``__cuda_array_interface__`` object is no real device copy: only that it goes to the
adapter's device-to-host copy is tested). With torch (``pytest.importorskip``): torch's own casts pass and
fail through ``on_torch`` with their bug class named, dtypes are viewed as the module docstring says, the
paged cache write fills the kit's caches in place; on a GPU (``gpu``), the same on ``device="cuda"``, and
CuPy's (``pytest.importorskip("cupy")``).
"""

from __future__ import annotations

import numpy as np
import pytest

from fp8lab import testing
from fp8lab.reference import e4m3, kv_cache
from fp8lab.testing.adapters import adapt, as_numpy, on_cupy, on_torch


class DLPackOnly:
    """A tensor of a made-up array library: its own copy of the data, readable only through DLPack."""

    def __init__(self, array):
        self.data = np.array(array, copy=True)

    def __dlpack__(self, **kwargs):
        return self.data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.data.__dlpack_device__()


class FakeDeviceArray:
    """Claims device memory (``__cuda_array_interface__``); NOT a device copy, just a routing probe."""

    def __init__(self, array):
        self.host = np.asarray(array)
        self.__cuda_array_interface__ = {"shape": self.host.shape, "typestr": self.host.dtype.str,
                                         "data": (0, False), "version": 3}


# ---------------------------------------------------------------------------- the generic path, no torch


def test_arguments_become_tensors_and_outputs_come_back_as_numpy(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    seen = {}

    def kernel(t, scale, block, nothing):
        seen.update(t=t, scale=scale, block=block, nothing=nothing)
        return DLPackOnly(t.data * 2), [DLPackOnly(t.data[:1])], None

    doubled, rows, none = adapt(kernel, DLPackOnly)(x, np.float32(0.5), (128, 128), None)
    assert isinstance(seen["t"], DLPackOnly) and np.array_equal(seen["t"].data, x)
    assert type(seen["scale"]) is float and seen["scale"] == 0.5  # a NumPy scalar as a Python number
    assert seen["block"] == (128, 128) and seen["nothing"] is None  # tuples and None pass through
    assert isinstance(doubled, np.ndarray) and np.array_equal(doubled, x * 2)
    assert isinstance(rows, list) and np.array_equal(rows[0], x[:1]) and none is None  # structure kept


def test_outputs_own_their_memory(rng):
    out = DLPackOnly(rng.standard_normal(4).astype(np.float32))
    got = as_numpy(out)
    out.data[:] = np.nan  # the producer reuses its buffer
    assert np.isfinite(got).all()


def test_in_place_writes_are_copied_back_to_writable_arguments(rng):
    cache = np.full((2, 3), np.nan, np.float32)
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    values = rng.standard_normal(3).astype(np.float32)

    def write(c, f, v):
        c.data[1] = v.data  # into the library's own copy: only the copy-back makes the kit see it
        return None

    assert adapt(write, DLPackOnly)(cache, frozen, values) is None
    assert np.array_equal(cache[1], values) and np.isnan(cache[0]).all()


def test_the_paged_cache_write_check_passes_through_the_copy_back():
    """A correct cache write on the made-up library passes ``check_paged_cache_write``: its writes reach the
    kit's caches only through the adapter."""
    def write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
        keep = slot_mapping.data >= 0
        kv_cache.write(k_cache.data, k_scale.data, k.data[keep], slot_mapping.data[keep])
        kv_cache.write(v_cache.data, v_scale.data, v.data[keep], slot_mapping.data[keep])

    testing.check_paged_cache_write(adapt(write, DLPackOnly), max_examples=8)


def test_device_memory_goes_to_the_device_to_host_copy(rng):
    x = rng.standard_normal(5).astype(np.float32)
    copied = []

    def to_host(value):
        copied.append(value)
        return value.host

    probe = FakeDeviceArray(x)
    assert np.array_equal(as_numpy(probe, to_host), x) and copied == [probe]
    with pytest.raises(TypeError, match="device memory"):  # never read as if it were host memory
        as_numpy(probe)

    class OnCuda(DLPackOnly):
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    assert np.array_equal(as_numpy(OnCuda(x), lambda v: v.data), x)


def test_cupy_missing_is_one_line():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install cupy") as missing:
            on_cupy(lambda x: x)
        assert "\n" not in str(missing.value)
    else:
        pytest.skip("CuPy is installed")


# ---------------------------------------------------------------------------- torch on the CPU


def torch_encode_saturating(x):
    """torch's own cast behind a clamp (NaN stays NaN through ``clamp``): a correct saturating encoder."""
    import torch

    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def torch_encode_fnuz_max(x):
    """Clamps to the e4m3fnuz maximum 240 before the cast: the fnuz_max_240 mistake."""
    import torch

    return x.clamp(-240, 240).to(torch.float8_e4m3fn)


def torch_cache_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """A torch paged cache write into fp8lab's layout (caches float8_e4m3fn ``[blocks, heads, block_size,
    dim]``): per (token, head) ``scale = max(amax / 448, 2^-126)`` (1 for a zero vector)."""
    import torch

    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block, offset = slots // k_cache.shape[2], slots % k_cache.shape[2]
    for x, cache, scales in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        amax = x.abs().amax(dim=-1)
        s = torch.where(amax == 0, 1.0, torch.clamp(amax / 448, min=2.0**-126))
        codes = (x / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        cache.view(torch.uint8)[block, :, offset] = codes.view(torch.uint8)  # index_put on the bytes
        scales[block, :, offset] = s


def test_torch_casts_pass_and_fail_with_their_class_named():
    torch = pytest.importorskip("torch")
    testing.check_e4m3_encode(on_torch(torch_encode_saturating))
    testing.check_e4m3_decode(on_torch(lambda codes: codes.to(torch.float32)))  # uint8 arrives as float8_e4m3fn
    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_e4m3_encode(on_torch(torch_encode_fnuz_max))
    assert "fnuz_max_240" in [b.name for b in failure.value.report.diagnoses]
    with pytest.raises(testing.KernelCheckFailed) as failure:  # raw bytes read as the fnuz format
        testing.check_e4m3_decode(on_torch(lambda c: c.view(torch.float8_e4m3fnuz).float(), raw_bits=True))
    assert "fnuz_max_240" in str(failure.value)


def test_torch_dtype_views_both_ways():
    torch = pytest.importorskip("torch")
    seen = {}

    def kernel(codes, bits):
        seen.update(codes=codes.dtype, bits=bits.dtype, one=float(bits[0]))
        return codes, bits, bits.float().requires_grad_()  # float8 and bf16 out; a tensor that requires grad

    codes, bits = np.array([0x38, 0x7E], np.uint8), np.array([0x3F80, 0xC000], np.uint16)  # 1.0, 448; 1.0, -2.0
    out_codes, out_bits, values = on_torch(kernel)(codes, bits)
    assert seen == {"codes": torch.float8_e4m3fn, "bits": torch.bfloat16, "one": 1.0}
    assert out_codes.dtype == np.uint8 and np.array_equal(out_codes, codes)  # float8 back as its codes
    assert out_bits.dtype == np.uint16 and np.array_equal(out_bits, bits)  # bf16 back as bit patterns
    assert np.array_equal(values, [1.0, -2.0])
    on_torch(lambda c, b: seen.update(raw=(c.dtype, b.dtype)), raw_bits=True)(codes, bits)
    assert seen["raw"] == (torch.uint8, torch.uint16)


def test_torch_cache_write_fills_the_kits_caches_in_place():
    pytest.importorskip("torch")
    testing.check_paged_cache_write(on_torch(torch_cache_write), max_examples=10)


def test_torch_device_that_cannot_be_used_is_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(RuntimeError, match="cannot use device 'cuda'") as failure:
        on_torch(torch_encode_saturating, device="cuda")
    assert "\n" not in str(failure.value)


# ---------------------------------------------------------------------------- torch on a GPU


@pytest.mark.gpu
def test_torch_on_cuda_passes_and_copies_in_place_writes_back():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    seen = []
    testing.check_e4m3_encode(on_torch(lambda x: seen.append(x.device.type) or torch_encode_saturating(x),
                                       device="cuda"))
    assert seen == ["cuda"]
    testing.check_paged_cache_write(on_torch(torch_cache_write, device="cuda"), max_examples=20)
    with pytest.raises(testing.KernelCheckFailed) as failure:
        testing.check_e4m3_encode(on_torch(torch_encode_fnuz_max, device="cuda"))
    assert "fnuz_max_240" in str(failure.value)


def cupy_cache_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """A paged cache write on CuPy arrays: the oracle's quantizer on the host, the writes into the device caches."""
    import cupy

    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block, offset = slots // k_cache.shape[2], slots % k_cache.shape[2]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes, s = kv_cache.quantize_kv(cupy.asnumpy(x[keep]))
        cache[block, :, offset] = cupy.asarray(codes)
        scales[block, :, offset] = cupy.asarray(s)


@pytest.mark.gpu
def test_cupy_on_the_gpu_passes_and_copies_in_place_writes_back():
    cupy = pytest.importorskip("cupy")
    values = cupy.asarray(e4m3.decode(np.arange(256, dtype=np.uint8)))
    testing.check_e4m3_decode(on_cupy(lambda codes: values[codes]))  # a table lookup on the device
    testing.check_paged_cache_write(on_cupy(cupy_cache_write), max_examples=20)
