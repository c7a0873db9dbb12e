"""fp8lab.reference.kv_cache: the per-(token, head) scale formula, write/gather round trips, bad input."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import kv_cache
from fp8lab.reference import strategies as fst


@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 6), heads=st.integers(1, 4), head_dim=st.sampled_from([1, 8, 64, 128]))
def test_kv_scale_formula(seed, tokens, heads, head_dim):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((tokens, heads, head_dim)) * 10.0 ** rng.uniform(-4, 3, (tokens, heads, 1))).astype(np.float32)
    x[0, 0] = 0.0  # amax == 0 gives scale 1 and zero codes
    codes, scales = kv_cache.quantize_kv(x)
    assert scales.shape == (tokens, heads) and scales.dtype == np.float32
    for t in range(tokens):
        for h in range(heads):
            amax = np.max(np.abs(x[t, h]))
            expected_scale = np.float32(amax) / np.float32(448) if amax > 0 else np.float32(1)
            assert scales[t, h] == expected_scale
            # the oracle: ml_dtypes' cast of the scaled vector, clipped (saturating)
            oracle = np.clip(x[t, h] / expected_scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            np.testing.assert_array_equal(codes[t, h], oracle)
    np.testing.assert_array_equal(codes[0, 0], 0)
    dq = kv_cache.dequantize_kv(codes, scales)
    assert np.all(np.abs(dq - x) <= 2.0**-4 * np.abs(x) * (1 + 2.0**-20) + 2.0**-10 * scales[..., None])


@given(layout=fst.paged_kv_layouts(), seed=st.integers(0, 2**32 - 1), fp8=st.booleans())
def test_write_then_gather_round_trips(layout, seed, fp8):
    rng = np.random.default_rng(seed)
    shape = (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim)
    cache = np.full(shape, 0x7F, np.uint8) if fp8 else np.full(shape, np.nan, np.float32)
    scales = np.full(shape[:3], np.nan, np.float32) if fp8 else None
    written = []
    for table, length in zip(layout.block_tables, layout.seq_lens):
        x = rng.standard_normal((int(length), layout.num_kv_heads, layout.head_dim)).astype(np.float32)
        # write in two pieces (prefill then decode steps), as an engine does
        cut = int(rng.integers(0, length + 1))
        for lo, hi in ((0, cut), (cut, int(length))):
            slots = kv_cache.slots_for_positions(table, np.arange(lo, hi), layout.block_size)
            kv_cache.write(cache, scales, x[lo:hi], slots)
        written.append(x)
    for table, length, x in zip(layout.block_tables, layout.seq_lens, written):
        got = kv_cache.gather(cache, scales, table, int(length))
        assert got.shape == x.shape and np.all(np.isfinite(got))
        expected = kv_cache.dequantize_kv(*kv_cache.quantize_kv(x)) if fp8 else x
        np.testing.assert_array_equal(got, expected)


def test_slot_mapping_follows_the_block_table():
    table = np.array([5, 2, 7])
    slots = kv_cache.slots_for_positions(table, np.arange(10), block_size=4)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]


def test_bf16_cache_stores_rounded_values(rng):
    cache = np.zeros((2, 1, 4, 8), ml_dtypes.bfloat16)
    x = rng.standard_normal((3, 1, 8)).astype(np.float32)
    kv_cache.write(cache, None, x, np.array([1, 4, 6]))
    got = kv_cache.gather(cache, None, np.array([0, 1]), 7)
    np.testing.assert_array_equal(got[[1, 4, 6]], x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_bad_input_names_the_problem(rng):
    cache = np.zeros((4, 2, 8, 16), np.uint8)
    scales = np.zeros((4, 2, 8), np.float32)
    x = rng.standard_normal((3, 2, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="FP8 cache of codes.*needs its scales"):
        kv_cache.write(cache, None, x, [0, 1, 2])
    with pytest.raises(ValueError, match="float cache.*scales=None"):
        kv_cache.write(cache.astype(np.float32), scales, x, [0, 1, 2])
    with pytest.raises(ValueError, match=r"cache scales: expected shape \(4, 2, 8\), got \(4, 2, 4\)"):
        kv_cache.write(cache, scales[:, :, :4], x, [0, 1, 2])
    with pytest.raises(ValueError, match="cache scales: expected a float32 array"):
        kv_cache.write(cache, scales.astype(np.float16), x, [0, 1, 2])
    with pytest.raises(ValueError, match=r"slot_mapping: slots must lie in \[0, 32\), got 0..32"):
        kv_cache.write(cache, scales, x, [0, 1, 32])
    with pytest.raises(ValueError, match="more than once"):
        kv_cache.write(cache, scales, x, [3, 1, 3])
    with pytest.raises(ValueError, match=r"x: expected shape \(3, 2, 16\), got \(3, 2, 8\)"):
        kv_cache.write(cache, scales, x[..., :8], [0, 1, 2])
    with pytest.raises(ValueError, match="3 blocks of 8, the table has 2"):
        kv_cache.gather(cache, scales, [0, 1], 17)
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 4\)"):
        kv_cache.gather(cache, scales, [0, 9], 10)
    with pytest.raises(ValueError, match="codes: expected E4M3 codes"):
        kv_cache.dequantize_kv(np.zeros((2, 4), np.float32), np.ones(2, np.float32))


def test_the_formats_are_one_registry_each_storage_naming_one_format():
    formats = kv_cache.KV_CACHE_FORMATS
    assert list(formats) == ["fp8", "bf16", "fp32"]
    assert len({f.kernel_storage for f in formats.values()}) == len(formats)  # a kernel cache's dtype names its format
    for name, fmt in formats.items():
        assert kv_cache.kv_cache_format(name) is fmt and kv_cache.kv_cache_format(fmt) is fmt
        assert kv_cache.kernel_cache_format(fmt.kernel_storage) is fmt
    assert kv_cache.kernel_cache_format(np.float16) is None
    assert [f.scaled for f in formats.values()] == [True, False, False]
    assert kv_cache.FP8_E4M3.vector_bytes(128) == 128 + 4 and kv_cache.BF16.vector_bytes(128) == 256
    assert kv_cache.BF16.vector_bytes(128, numpy=True) == 512  # NumPy has no bfloat16: BF16 values in float32
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of fp8, bf16, fp32, got 'fp16'"):
        kv_cache.kv_cache_format("fp16")
