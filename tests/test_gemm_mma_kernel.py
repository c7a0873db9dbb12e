"""numba_kernels.gemm_mma, the tensor-core FP8 GEMM kernel.

- In the CUDA simulator (``cudasim``): bit for bit ``simulators.gemm_mma.gemm_mma`` (the kernel's
  float32 operations in the model's order), every output written (outputs poisoned with NaN),
  ``reference.blockwise.gemm`` within the simulator's stated bound, bad calls raise ``ValueError``
  before anything is launched. Shapes stay tiny: the simulator runs each of a CTA's 128 threads
  as a Python thread.
- On a GPU (``gpu``): real sizes against ``reference.blockwise.gemm`` by relative error, with the
  bound built from the GPU error budget in ``simulators.gemm_mma``'s docstring, on fresh random
  inputs each run; integer-valued inputs with power-of-two scales bit for bit the simulator.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from numba_kernels import gemm_mma as kernel
from reference import blockwise, e4m3
from reference import strategies as fst
from simulators import bit_placement as bp
from simulators import gemm_mma as model

U32 = 2.0**-24
CODES = np.array(fst.NON_NAN_CODES, dtype=np.uint8)
SMALL_CODES = np.array([c for c in fst.NON_NAN_CODES if abs(float(e4m3.VALUES[c])) <= 4.0], dtype=np.uint8)
OUTPUT_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "bf16-int16": np.int16}
OUTPUT_ROUNDING = {"f32": (0.0, 0.0), "f16": (2.0**-11, 2.0**-25), "bf16": (2.0**-8, 2.0**-134)}
"""(relative, absolute) error of rounding the float32 result once to the output format."""


# ---------------------------------------------------------------------------- inputs and outputs


def activations(a32: np.ndarray, fmt: str, int16: bool = False) -> np.ndarray:
    """What the kernel takes: BF16 bit patterns (uint16, or int16 as torch hands them over) or float16."""
    bits = bp.activation_bits(a32, fmt)
    if fmt == "f16":
        return bits.view(np.float16)
    return bits.view(np.int16) if int16 else bits


def activation_values(a: np.ndarray, fmt: str) -> np.ndarray:
    """The activations' exact values, float64."""
    return bp.bits_to_float32(a.view(np.uint16), fmt).astype(np.float64)


def poisoned_output(m: int, n: int, output: str) -> np.ndarray:
    """NaN everywhere (BF16 quiet NaN 0x7FC0 for the bit-pattern outputs)."""
    dtype = OUTPUT_DTYPES[output]
    if dtype in (np.uint16, np.int16):
        return np.full((m, n), 0x7FC0, dtype=dtype)
    return np.full((m, n), np.nan, dtype=dtype)


def output_values(out: np.ndarray, output: str) -> np.ndarray:
    """The kernel's output as float64 values."""
    if out.dtype in (np.uint16, np.int16):
        return bp.bf16_bits_to_float32(out.view(np.uint16)).astype(np.float64)
    return out.astype(np.float64)


def expected_bits(model_out: np.ndarray, output: str) -> np.ndarray:
    """The model's float32 result rounded once to the output format, as the bytes the kernel must write."""
    if output == "f32":
        return model_out
    if output == "f16":
        return model_out.astype(np.float16)
    return bp.float32_to_bf16_bits(model_out)


def base_format(output: str) -> str:
    return "bf16" if output.startswith("bf16") else output


def random_weights(rng, n: int, k: int, block, codes=CODES, scale=1e-2):
    q = rng.choice(codes, size=(n, k))
    scale_inv = (rng.uniform(0.5, 2.0, size=blockwise.scale_shape((n, k), block)) * scale).astype(np.float32)
    return q, scale_inv


# ---------------------------------------------------------------------------- error bounds


def simulator_bound(a64, q, scale_inv, block, fmt):
    """``simulators.gemm_mma``'s stated float32 bound per output, against the oracle on the
    activations the kernel multiplies (already 16-bit)."""
    chunks = q.shape[1] // model.K_CHUNK
    w = np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64))
    relative = (chunks + 9) * U32 * (np.abs(a64) @ w.T)
    underflow = 15 * chunks * 2.0 ** (bp.EXPONENT_OFFSET[fmt] - 150) * float(np.max(scale_inv)) + chunks * 2.0**-150
    return relative + underflow


def gpu_budget(a64, q, scale_inv, block, fmt):
    """The GPU error budget of ``simulators.gemm_mma`` per output: a real HMMA rounds up to about
    ``6 u`` per k16 step (8 per chunk), so ``(48 + C + 1) u sum |a w|`` plus the same underflow term."""
    chunks = q.shape[1] // model.K_CHUNK
    w = np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64))
    relative = (48 + chunks + 1) * U32 * (np.abs(a64) @ w.T)
    underflow = 15 * chunks * 2.0 ** (bp.EXPONENT_OFFSET[fmt] - 150) * float(np.max(scale_inv)) + chunks * 2.0**-150
    return relative + underflow


def with_output_rounding(bound, ref, output):
    relative, absolute = OUTPUT_ROUNDING[base_format(output)]
    return bound + relative * (np.abs(ref) + bound) + absolute


# ---------------------------------------------------------------------------- the schedule's geometry (no kernel run)


def test_constants_are_the_simulators():
    assert kernel.CTA_N == model.CTA_N and kernel.WARPS_PER_CTA == model.WARPS_PER_CTA
    assert kernel.K_CHUNK == model.K_CHUNK and kernel.K_STEPS_PER_CHUNK == model.K_STEPS_PER_CHUNK
    assert kernel.M_BLOCKS_CHOICES == model.M_BLOCKS_CHOICES
    assert kernel.BLOCK_N_MULTIPLE == model.BLOCK_N_MULTIPLE
    assert kernel.FOLDED_SCALE_EXPONENT == bp.EXPONENT_OFFSET
    assert {f: 8 - s for f, s in kernel.PLACEMENT_SHIFT.items()} == bp.MAGNITUDE_SHIFT
    assert (kernel.SIGN_MASK_X2, kernel.MAGNITUDE_MASK_X2) == (bp.SIGN_MASK_X2, bp.MAGNITUDE_MASK_X2)


@pytest.mark.parametrize(
    "m, n, k, m_blocks", [(1, 8, 128, 1), (33, 100, 384, 2), (17, 24576, 4096, 1), (64, 6144, 4096, 2)]
)
def test_launch_info_is_the_simulators_grid(m, n, k, m_blocks):
    launch = kernel.launch_info(m, n, k, m_blocks)
    assert launch.grid == model.Schedule(m=m, n=n, k=k, m_blocks=m_blocks).grid
    assert launch.block == (128,)
    # two buffers of (M_TILE rows x 272 bytes + 32 weight rows x 136 bytes), under the 48 KiB default
    assert launch.shared_bytes == 2 * (16 * m_blocks * 272 + 32 * 136) == {1: 17408, 2: 26112}[m_blocks]
    assert launch.shared_bytes <= 48 * 1024


def test_padded_rows_make_fragment_loads_conflict_free():
    """The bank argument of the module docstring, counted: lane (g, t) reads A word t of row g and
    the B halfword t of weight row g; 32 banks of 4 bytes."""
    g, t = np.divmod(np.arange(32), 4)
    a_words = g * (kernel.A_ROW_BYTES // 4) + t
    assert len(set(a_words % 32)) == 32
    b_words = (g * kernel.B_ROW_BYTES + 2 * t) // 4
    banks = {}
    for word in b_words:
        banks.setdefault(word % 32, set()).add(word)
    assert all(len(words) == 1 for words in banks.values())  # one word per bank: no conflict
    # without padding, 8-way conflicts
    assert len(set((g * 64 + t) % 32)) == 4


def test_choose_m_blocks_and_launch_limits():
    assert [kernel.choose_m_blocks(m) for m in (1, 16, 17, 4096)] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="m_blocks"):
        kernel.launch_info(4, 8, 128, 3)
    with pytest.raises(ValueError, match="M tiles"):
        kernel.launch_info(16 * 65535 + 1, 8, 128, 1)
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel.launch_info(4, 8, 100, 1)


# ---------------------------------------------------------------------------- in the CUDA simulator

SIMULATOR_CASES = [
    # m, n, k, m_blocks, activation, output, block: M tails, N tails, one and two chunks (the
    # double buffer), both m_blocks (m_blocks=2 with M < 16 too), every output format
    (1, 8, 128, 1, "bf16", "f32", (128, 128)),
    (5, 33, 256, 1, "bf16", "f32", (8, 128)),
    (17, 33, 128, 2, "f16", "f32", (16, 128)),
    (17, 8, 256, 2, "bf16", "f16", (128, 256)),
    (5, 8, 256, 2, "f16", "bf16", (8, 128)),
    (17, 8, 128, 1, "f16", "bf16-int16", (128, 128)),
    (1, 33, 128, 1, "f16", "f16", (32, 128)),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("m, n, k, m_blocks, fmt, output, block", SIMULATOR_CASES)
def test_bit_for_bit_the_simulator(m, n, k, m_blocks, fmt, output, block, rng):
    a = activations(rng.standard_normal((m, k)).astype(np.float32), fmt, int16=m % 2 == 1)
    q, scale_inv = random_weights(rng, n, k, block)
    out = poisoned_output(m, n, output)
    assert kernel.gemm_mma(a, q, scale_inv, out, block, m_blocks=m_blocks) is out

    modelled = model.gemm_mma(a.view(np.uint16), q, scale_inv, block, m_blocks=m_blocks, activation=fmt)
    values = output_values(out, output)
    assert np.all(np.isfinite(values)), "an output was not written (still NaN)"
    assert np.array_equal(out.view(np.uint8), expected_bits(modelled, base_format(output)).view(np.uint8))

    a64 = activation_values(a, fmt)
    ref = blockwise.gemm(a64, q, scale_inv, block)
    bound = with_output_rounding(simulator_bound(a64, q, scale_inv, block, fmt), ref, output)
    assert np.any(ref != 0) and np.all(np.abs(values - ref) <= bound)


@pytest.mark.cudasim
@settings(max_examples=4)  # each example simulates 1 to 4 CTAs of 128 Python threads
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 40),
    chunks=st.integers(1, 2),
    fmt=st.sampled_from(bp.FORMATS),
    m_blocks=st.sampled_from([None, 1, 2]),
    output=st.sampled_from(sorted(OUTPUT_DTYPES)),
    block=st.tuples(st.sampled_from([8, 24, 128]), st.sampled_from([128, 256])),
    seed=st.integers(0, 2**32 - 1),
)
def test_bit_for_bit_the_simulator_property(m, n, chunks, fmt, m_blocks, output, block, seed):
    rng = np.random.default_rng(seed)
    k = 128 * chunks
    a = activations(rng.standard_normal((m, k)).astype(np.float32), fmt, int16=seed % 2 == 1)
    q, scale_inv = random_weights(rng, n, k, block)
    out = poisoned_output(m, n, output)
    kernel.gemm_mma(a, q, scale_inv, out, block, m_blocks=m_blocks)
    modelled = model.gemm_mma(a.view(np.uint16), q, scale_inv, block, m_blocks=m_blocks or 1, activation=fmt)
    assert np.all(np.isfinite(output_values(out, output)))
    assert np.array_equal(out.view(np.uint8), expected_bits(modelled, base_format(output)).view(np.uint8))


@pytest.mark.cudasim
def test_bit_for_bit_where_the_k16_sums_are_not_exact(rng):
    """Activations spanning many binades defeat the model's exactness proof: it falls back to the
    ascending-k float64 sum, which the kernel's mma (in the simulator) must match too."""
    binades = np.ldexp(1.0, rng.integers(-12, 13, (3, 128))).astype(np.float32)
    a32 = rng.standard_normal((3, 128)).astype(np.float32) * binades
    a32[:, 3], a32[:, 5] = 2.0**12, 2.0**-13
    a = activations(a32, "bf16")
    assert not model.every_k16_sum_is_exact(bp.bits_to_float32(a, "bf16"), "bf16")
    q, scale_inv = random_weights(rng, 8, 128, (8, 128))
    out = poisoned_output(3, 8, "f32")
    kernel.gemm_mma(a, q, scale_inv, out, (8, 128))
    assert np.array_equal(out, model.gemm_mma(a, q, scale_inv, (8, 128), activation="bf16"))


@pytest.mark.cudasim
@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_place_code_pair_is_the_simulators(fmt, rng):
    # every code in the low byte and in the high byte, plus random pairs
    codes = np.arange(256, dtype=np.uint16)
    random_pairs = rng.integers(0, 2**16, 1024).astype(np.uint16)
    pairs = np.concatenate([codes, codes << 8, codes | (codes[::-1] << 8), random_pairs])
    got = np.array([kernel.place_code_pair(p, kernel.PLACEMENT_SHIFT[fmt]) for p in pairs], dtype=np.uint32)
    assert np.array_equal(got, bp.place_code_pair(pairs, fmt))


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a kernel is even looked up: a bad call must raise first."""

    def refuse(*args):
        raise AssertionError("a kernel was launched for a bad call")

    monkeypatch.setattr(kernel, "compiled_kernel", refuse)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=100), "multiple of 128"),
        (dict(block=(12, 128)), "block_n"),
        (dict(block=(16, 64)), "block_k"),
        (dict(scale_shape=(3, 1)), "scale_inv"),
        (dict(scale_dtype=np.float64), "scale_inv"),
        (dict(a_dtype=np.float32), "activations"),
        (dict(a_k=256), "activations"),
        (dict(q_dtype=np.int8), "uint8"),
        (dict(out_shape=(4, 31)), "out"),
        (dict(out_dtype=np.float64), "out"),
        (dict(m_blocks=3), "m_blocks"),
        (dict(m=0), "M >= 1"),
    ],
)
def test_bad_calls_raise_before_any_launch(change, message, no_launch, rng):
    m, k = change.get("m", 4), change.get("k", 128)
    block = change.get("block", (16, 128))
    q = rng.integers(0, 0x7E, size=(32, k)).astype(change.get("q_dtype", np.uint8))
    a = rng.standard_normal((m, change.get("a_k", k))).astype(change.get("a_dtype", np.float16))
    scale_inv = np.ones(change.get("scale_shape", (-(-32 // block[0]), max(1, -(-k // block[1])))),
                        dtype=change.get("scale_dtype", np.float32))
    out = np.full(change.get("out_shape", (m, 32)), np.nan, dtype=change.get("out_dtype", np.float32))
    with pytest.raises(ValueError, match=message):
        kernel.gemm_mma(a, q, scale_inv, out, block, m_blocks=change.get("m_blocks"))
    assert np.all(np.isnan(out))


def test_misaligned_device_data_is_refused():
    class Misaligned:
        __cuda_array_interface__ = {"data": (0x1001, False), "shape": (4, 128), "typestr": "|u1", "version": 3}

    with pytest.raises(ValueError, match="8-byte aligned"):
        kernel._as_words("q", Misaligned(), np.uint64)


# ---------------------------------------------------------------------------- on a GPU

GPU_CASES = [
    # m, n, k, m_blocks, activation, output, block (N up to 24576, K up to 12288, N tails)
    (9, 6144, 4096, None, "bf16", "f32", (128, 128)),
    (16, 4096, 12288, 1, "f16", "f32", (128, 128)),
    (17, 24576, 4096, 2, "bf16", "bf16", (128, 128)),
    (24, 6144, 4096, 1, "bf16", "f16", (128, 128)),
    (32, 4096, 4096, 2, "f16", "f16", (128, 128)),
    (33, 12290, 2048, 2, "bf16", "f32", (64, 256)),
    (64, 1000, 12288, None, "f16", "bf16-int16", (128, 128)),
]


def fresh_rng():
    """A new seed every run (printed on failure), as the architecture asks of GPU checks."""
    seed = int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng(seed), seed


def run_on_gpu(a, q, scale_inv, block, m_blocks, output):
    """Device arrays in, output poisoned on the device, launched on a stream of its own, result copied back."""
    from numba import cuda

    m, n = a.shape[0], q.shape[0]
    d_out = cuda.to_device(poisoned_output(m, n, output))
    stream = cuda.stream()
    kernel.gemm_mma(cuda.to_device(a), cuda.to_device(q), cuda.to_device(scale_inv), d_out, block, m_blocks=m_blocks,
                    stream=stream)
    stream.synchronize()
    return d_out.copy_to_host()


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, m_blocks, fmt, output, block", GPU_CASES)
def test_gpu_against_the_oracle_within_the_gpu_budget(m, n, k, m_blocks, fmt, output, block):
    rng, seed = fresh_rng()
    a = activations(rng.standard_normal((m, k)).astype(np.float32), fmt, int16=output == "bf16-int16")
    q, scale_inv = random_weights(rng, n, k, block, scale=1e-3)
    out = run_on_gpu(a, q, scale_inv, block, m_blocks, output)

    values = output_values(out, output)
    unwritten = np.argwhere(~np.isfinite(values))
    assert unwritten.size == 0, f"seed {seed}: unwritten (NaN) outputs at {unwritten[:5].tolist()}"
    a64 = activation_values(a, fmt)
    ref = blockwise.gemm(a64, q, scale_inv, block)
    budget = with_output_rounding(gpu_budget(a64, q, scale_inv, block, fmt), ref, output)
    error = np.linalg.norm(values - ref) / np.linalg.norm(ref)
    bound = np.linalg.norm(budget) / np.linalg.norm(ref)
    assert error <= bound, f"seed {seed}: relative error {error:.3g} > bound {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, n, k, m_blocks, fmt",
    [(33, 1000, 1024, 2, "bf16"), (16, 4096, 512, 1, "f16"), (64, 257, 384, 1, "bf16"), (9, 2056, 2048, 2, "f16")],
)
def test_gpu_bit_for_bit_the_simulator_on_integer_data(m, n, k, m_blocks, fmt):
    """Small integer activations, codes of magnitude <= 4 and power-of-two scales: every
    intermediate is exact in float32 (see tests/test_gemm_mma.py), so the tensor cores' rounding
    cannot show and the GPU must equal the simulator, and the oracle, bit for bit."""
    rng, seed = fresh_rng()
    block = (128, 128)
    a = activations(rng.integers(-4, 5, size=(m, k)).astype(np.float32), fmt)
    q = rng.choice(SMALL_CODES, size=(n, k))
    scale_inv = np.ldexp(1.0, rng.integers(-1, 2, size=blockwise.scale_shape((n, k), block))).astype(np.float32)
    out = run_on_gpu(a, q, scale_inv, block, m_blocks, "f32")
    modelled = model.gemm_mma(a.view(np.uint16), q, scale_inv, block, m_blocks=m_blocks, activation=fmt)
    assert np.all(np.isfinite(out)) and np.any(out != 0), f"seed {seed}"
    assert np.array_equal(out, modelled), f"seed {seed}"
    assert np.array_equal(out.astype(np.float64), blockwise.gemm(activation_values(a, fmt), q, scale_inv, block))


@pytest.mark.gpu
def test_gpu_accepts_host_arrays_and_returns_out(rng):
    a = activations(rng.standard_normal((20, 256)).astype(np.float32), "bf16")
    q, scale_inv = random_weights(rng, 40, 256, (128, 128))
    out = poisoned_output(20, 40, "f32")
    assert kernel.gemm_mma(a, q, scale_inv, out) is out
    assert np.all(np.isfinite(out))
