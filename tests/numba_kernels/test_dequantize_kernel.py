"""fp8lab.numba_kernels.dequantize against fp8lab.reference.blockwise.dequantize and fp8lab.simulators.bit_placement.

The kernel's float32 result is ``fl32((decode(c) * 2^-8) * (scale_inv * 2^8))``: both factors are
exact and their real product is ``decode(c) * scale_inv``, so it is the reference's one float32
rounding, bit for bit. float16 and BF16 outputs are that float32 value rounded once more (round to
nearest even), i.e. ``fp8lab.reference.blockwise.dequantize(...).astype(float16 / bfloat16)``. NaN codes
give the finite ``+-480 * scale_inv`` (the reference gives NaN).

- CUDA simulator (marker ``cudasim``): every code at every byte position of a 32-bit word; random
  shapes and blocks, including blocks whose K edge falls inside a word; outputs poisoned with NaN
  and checked all written; bad arguments raise ``ValueError`` with nothing launched.
- GPU (marker ``gpu``): the same at Qwen3-8B sizes, fresh random data each run.
"""

import secrets

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

from fp8lab.numba_kernels import dequantize as kernel_module
from fp8lab.numba_kernels.dequantize import dequantize, dequantize_launch_info
from fp8lab.reference import blockwise, e4m3
from fp8lab.simulators import bit_placement

OUTPUT_FORMATS = ("f32", "f16", "bf16", "bf16-int16")


def poisoned_output(shape, fmt: str) -> np.ndarray:
    """NaN everywhere (BF16: the NaN pattern 0x7FC1), so an unwritten element shows."""
    if fmt.startswith("bf16"):
        out = np.full(shape, 0x7FC1, np.uint16)
        return out.view(np.int16) if fmt == "bf16-int16" else out
    return np.full(shape, np.nan, np.float32 if fmt == "f32" else np.float16)


def expected_output(q, scale_inv, block, fmt: str) -> np.ndarray:
    """The reference's float32 dequantize, NaN codes replaced by the placement's +-480 * scale,
    rounded once to the output format (as bit patterns for BF16)."""
    ref = blockwise.dequantize(q, scale_inv, block)
    scales = blockwise.expand_scales(scale_inv, q.shape, block)
    nan_value = np.where(q & 0x80, np.float32(-480), np.float32(480)) * scales
    ref = np.where(e4m3.is_nan(q), nan_value, ref).astype(np.float32)
    if fmt.startswith("bf16"):
        return ref.astype(ml_dtypes.bfloat16).view(np.uint16)
    return ref.astype(np.float16) if fmt == "f16" else ref


def check_output(out, q, scale_inv, block, fmt: str, label: str = ""):
    got = np.asarray(out)
    if fmt.startswith("bf16"):
        got = got.view(np.uint16)
        written = ~np.isnan(bit_placement.bf16_bits_to_float32(got))
    else:
        written = ~np.isnan(got)
    assert np.all(written), f"{label}: {np.count_nonzero(~written)} outputs unwritten (still poisoned)"
    expected = expected_output(q, scale_inv, block, fmt)
    mismatches = np.count_nonzero(got != expected)
    assert mismatches == 0, f"{label}: {mismatches} outputs differ from the reference"


def random_scales(rng, shape) -> np.ndarray:
    return (rng.uniform(0.5, 2.0, shape) * 10.0 ** rng.uniform(-4, 0, shape)).astype(np.float32)


# ---------------------------------------------------------------------------- placement and launch shape


@pytest.mark.cudasim
def test_placed_codes_match_bit_placement():
    """Every code at every byte position of a word, the other bytes set to 0x5A (the device
    function runs as Python in the simulator; on a GPU the kernel tests below cover it)."""
    codes = np.arange(256, dtype=np.uint8)
    expected = bit_placement.placed_values(codes, "f16")
    for position in range(4):
        words = (codes.astype(np.uint32) << np.uint32(8 * position)) | np.uint32(0x5A5A5A5A & ~(0xFF << (8 * position)))
        got = np.array([kernel_module.placed_codes(w)[position] for w in words], np.float32)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), position


def words_with_every_code_at_every_position() -> tuple[np.ndarray, np.ndarray]:
    """``(words, codes)``: word ``i`` of block ``p`` holds code ``i`` at byte ``p``, the other bytes
    0x5A; ``codes[p, i] = i``."""
    codes = np.arange(256, dtype=np.uint32)
    words = np.concatenate([(codes << np.uint32(8 * p)) | np.uint32(0x5A5A5A5A & ~(0xFF << (8 * p))) for p in range(4)])
    return words.astype(np.uint32), np.tile(np.arange(256, dtype=np.uint8), (4, 1))


def decoded_codes_kernel():
    @cuda.jit
    def kernel(words, out):
        i = cuda.grid(1)
        if i < words.shape[0]:
            v0, v1, v2, v3 = kernel_module.decoded_codes(words[i])
            out[i, 0] = v0
            out[i, 1] = v1
            out[i, 2] = v2
            out[i, 3] = v3

    return kernel


def check_decoded_codes(out: np.ndarray, words: np.ndarray) -> None:
    """``out[i, b]`` must be ``decode`` of byte ``b`` of ``words[i]``: bit for bit, NaN codes NaN."""
    expected = e4m3.decode(words.view(np.uint8).reshape(-1, 4))
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan), "NaN codes must decode to NaN, and only they"
    assert np.array_equal(out[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("where", [pytest.param("cudasim", marks=pytest.mark.cudasim), pytest.param("gpu", marks=pytest.mark.gpu)])
def test_decoded_codes_is_decode(where):
    """The hardware decode (``cvt.rn.f16x2.e4m3x2``, then F16 to float32) of every code at every byte
    position: exactly ``fp8lab.reference.e4m3.decode``, the NaN codes NaN."""
    words, _ = words_with_every_code_at_every_position()
    out = np.full((words.size, 4), 1e30, np.float32)  # poison: no code decodes to it, and it is not NaN
    decoded_codes_kernel()[(words.size + 127) // 128, 128](words, out)
    check_decoded_codes(out, words)


def test_launch_info():
    info = dequantize_launch_info(4096, 12288)
    assert info.words == 4096 * 3072 and info.block == (256,) and info.grid == (kernel_module.MAX_CTAS,)
    assert dequantize_launch_info(3, 8).grid == (1,)
    assert dequantize_launch_info(3, 8).words == 6


# ---------------------------------------------------------------------------- CUDA simulator


@pytest.mark.cudasim
@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_every_code_at_every_byte_position(rng, fmt):
    """Row n holds codes (k + 61 n) mod 256: over 4 rows every code sits at every position of a
    word; the NaN codes are among them. Block (3, 102): a K block ends inside a word."""
    n, k, block = 4, 256, (3, 102)
    q = ((np.arange(k)[None, :] + 61 * np.arange(n)[:, None]) % 256).astype(np.uint8)
    scale_inv = random_scales(rng, blockwise.scale_shape((n, k), block))
    out = poisoned_output((n, k), fmt)
    assert dequantize(q, scale_inv, out, block) is out
    check_output(out, q, scale_inv, block, fmt, fmt)


@pytest.mark.cudasim
def test_float32_output_is_the_reference_bit_for_bit(rng):
    """Finite codes: the float32 output is exactly fp8lab.reference.blockwise.dequantize."""
    n, k, block = 5, 384, (2, 128)
    q = rng.integers(0, 0x7F, (n, k)).astype(np.uint8) | (rng.integers(0, 2, (n, k)) << 7).astype(np.uint8)
    scale_inv = random_scales(rng, blockwise.scale_shape((n, k), block))
    out = poisoned_output((n, k), "f32")
    dequantize(q, scale_inv, out, block)
    assert np.array_equal(out.view(np.uint32), blockwise.dequantize(q, scale_inv, block).view(np.uint32))


@st.composite
def tiny_problems(draw):
    n = draw(st.integers(1, 9))
    k = 4 * draw(st.integers(1, 80))
    block = (draw(st.integers(1, n + 2)), draw(st.integers(1, k + 5)))
    fmt = draw(st.sampled_from(OUTPUT_FORMATS))
    return n, k, block, fmt, draw(st.integers(0, 2**32 - 1))


@pytest.mark.cudasim
@settings(max_examples=20)
@given(tiny_problems())
def test_random_shapes_and_blocks(problem):
    n, k, block, fmt, seed = problem
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (n, k)).astype(np.uint8)
    scale_inv = random_scales(rng, blockwise.scale_shape((n, k), block))
    out = poisoned_output((n, k), fmt)
    dequantize(q, scale_inv, out, block)
    check_output(out, q, scale_inv, block, fmt, str(problem))


# ---------------------------------------------------------------------------- bad arguments (any process)


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was requested for a bad call")

    monkeypatch.setattr(kernel_module, "dequantize_kernel", refuse)


@pytest.mark.parametrize(
    "q_shape, scale_shape, scale_dtype, out_shape, out_dtype, block, message",
    [
        ((4, 130), (1, 2), np.float32, (4, 130), np.float32, (128, 128), "multiple of 4"),
        ((0, 128), (0, 1), np.float32, (0, 128), np.float32, (128, 128), "N >= 1"),
        ((4, 256), (1, 3), np.float32, (4, 256), np.float32, (128, 128), "scale_inv: expected float32 \\[1, 2\\]"),
        ((4, 256), (1, 2), np.float64, (4, 256), np.float32, (128, 128), "scale_inv"),
        ((4, 256), (1, 2), np.float32, (4, 128), np.float32, (128, 128), "out: expected \\[4, 256\\]"),
        ((4, 256), (1, 2), np.float32, (4, 256), np.float64, (128, 128), "out"),
        ((4, 256), (1, 2), np.float32, (4, 256), np.float32, (0, 128), "block"),
        ((4, 256), (1, 2), np.float32, (4, 256), np.float32, "big", "block"),
    ],
)
def test_bad_arguments_raise_before_launch(no_launch, q_shape, scale_shape, scale_dtype, out_shape, out_dtype, block,
                                           message):
    q = np.zeros(q_shape, np.uint8)
    out = np.full(out_shape, np.nan, out_dtype)
    with pytest.raises(ValueError, match=message):
        dequantize(q, np.ones(scale_shape, scale_dtype), out, block)
    assert np.all(np.isnan(out))


def test_bad_code_arrays_raise(no_launch):
    ones = np.ones((1, 2), np.float32)
    out = np.zeros((4, 256), np.float32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(np.zeros((4, 256), np.int8), ones, out)
    with pytest.raises(ValueError, match="C-contiguous"):
        dequantize(np.zeros((256, 4), np.uint8).T, ones, out)
    with pytest.raises(ValueError, match="NumPy array"):
        dequantize([[1, 2, 3, 4]], ones, out)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096), (4096, 12288), (1000, 516)])
@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_gpu_dequantize_is_the_reference(n, k, fmt):
    from numba import cuda

    seed = secrets.randbits(32)  # fresh data every run; the seed is in the failure message
    rng = np.random.default_rng(seed)
    block = (128, 128)
    q = rng.integers(0, 256, (n, k)).astype(np.uint8)
    scale_inv = random_scales(rng, blockwise.scale_shape((n, k), block))
    out = cuda.to_device(poisoned_output((n, k), fmt))
    dequantize(cuda.to_device(q), cuda.to_device(scale_inv), out, block)
    check_output(out.copy_to_host(), q, scale_inv, block, fmt, f"seed {seed}, N={n} K={k} {fmt}")
