"""fp8lab.numba_kernels.gemv_simt: the SIMT decode GEMV kernel against fp8lab.simulators.gemv_simt and reference.

- CUDA simulator (marker ``cudasim``, tiny shapes): bit for bit equal to ``fp8lab.simulators.gemv_simt``
  for every ``chunks_per_iteration`` x ``columns_per_warp`` pair (each with a different activation
  format, CTA size and row tile), every output format, with tails in M (partial row tiles), N
  (partial CTAs, warps with clamped columns, warps with no column) and K (a partial warp step,
  empty steps in the last group, odd and even group counts, partial K blocks); within the
  simulator's float32 bound of ``fp8lab.reference.blockwise.gemm``; outputs poisoned before launch and
  every element checked written; bad arguments raise ``ValueError`` before anything is launched.
- GPU (marker ``gpu``, Qwen3-8B sizes, default and tuned knobs): fresh random inputs each run, poisoned outputs, against
  ``fp8lab.reference.blockwise.gemm`` by ``||out - ref|| / ||ref||`` and element by element within the
  float32 bound, and bit for bit against ``fp8lab.simulators.gemv_simt`` (the kernel's float32 operations
  are the simulator's, so the GPU must match it exactly).
- SwiGLU in the epilogue (``gemv_simt_swiglu``): in the CUDA simulator (I = 5, 8, 24, 128, M = 1 to 4,
  K = 128 and 256, BF16, float16 and float32 activations, every G with NC = 2 and 4, poisoned outputs) bit for
  bit against ``simulators.gemv_simt.gemv_simt_swiglu`` and, on half the cases, against ``gemv_simt``
  then ``layers.silu_mul``; against ``blockwise.gemm`` then ``dense.silu_mul_float64`` within the bound
  below plus silu's (``check_swiglu``); bad arguments raise ``ValueError`` before anything is
  launched. GPU: Qwen3-8B's gate_up (24576 x 4096), M = 1 and 4, bit for bit the two launches.

Error bound (from ``tests/simulators/test_gemv_simt.py``): every product enters the float32 sum through at
most ``16 + T + 5`` roundings (``T = ceil(K / 512)`` promotions), so
``|out - ref| <= (gamma(22 + T) + K 2^-52) * sum_k |a_k| |w_k|`` for a float32 output; a float16
or BF16 output adds its own rounding, at most ``u_out * |out|`` (``u_out`` = 2^-11 or 2^-8).
Norm-wise the tests ask ``||out - ref|| / ||ref|| <= u_out + 1e-5`` (``u_out = 0`` for float32).
"""

import secrets

import ml_dtypes
import numpy as np
import pytest
from helpers.numerics import gamma
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import gemv_simt as kernel_module
from fp8lab.numba_kernels import layers
from fp8lab.numba_kernels.gemv_simt import (
    gemv_simt,
    gemv_simt_launch_info,
    gemv_simt_swiglu,
)
from fp8lab.reference import blockwise, dense, e4m3
from fp8lab.simulators import bit_placement
from fp8lab.simulators import gemv_simt as simulator

OUTPUT_UNIT = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}
ACTIVATION_FORMATS = ("bf16", "f16", "f32")
OUTPUT_FORMATS = ("f32", "f16", "bf16")
FINITE_CODES = np.array([c for c in range(256) if c not in e4m3.NAN_CODES], np.uint8)


# ---------------------------------------------------------------------------- data in every format


def activations(values: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 values -> (what the kernel gets in format ``fmt``, the float32 values it computes on)."""
    if fmt in ("bf16", "bf16-int16"):
        bits = bit_placement.float32_to_bf16_bits(values)
        kernel_input = bits.view(np.int16) if fmt == "bf16-int16" else bits
        return kernel_input, bit_placement.bf16_bits_to_float32(bits)
    if fmt == "f16":
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    return values, values


def poisoned_output(shape, fmt: str) -> np.ndarray:
    """An output array full of NaN (BF16: the NaN pattern 0x7FC1), so an unwritten element shows."""
    if fmt == "bf16":
        return np.full(shape, 0x7FC1, np.uint16)
    return np.full(shape, np.nan, np.float32 if fmt == "f32" else np.float16)


def as_float32(out: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "bf16":
        return bit_placement.bf16_bits_to_float32(np.asarray(out).view(np.uint16))
    return np.asarray(out).astype(np.float32)


def rounded_like(out32: np.ndarray, fmt: str) -> np.ndarray:
    """The simulator's float32 result rounded once to the output format (what the kernel stores)."""
    if fmt == "bf16":
        return bit_placement.float32_to_bf16_bits(out32)
    return out32.astype(np.float16) if fmt == "f16" else out32


def random_problem(rng, m, n, k, block):
    """Random float32 activations, finite codes and scales shaped like a checkpoint's."""
    a = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    q = rng.choice(FINITE_CODES, size=(n, k))
    nb, kb = blockwise.scale_shape((n, k), block)
    scale_inv = (rng.uniform(0.5, 2.0, (nb, kb)) * 10.0 ** rng.uniform(-4, -1, (nb, kb))).astype(np.float32)
    return a, q, scale_inv


def float32_bound(a32, q, scale_inv, block) -> np.ndarray:
    """The per-element bound of a float32 output against the float64 reference (module docstring)."""
    k = a32.shape[1]
    magnitude = np.abs(a32.astype(np.float64)) @ np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64)).T
    return (gamma(22 + simulator.num_steps(k)) + k * 2.0**-52) * magnitude


def check_against_simulator_and_reference(a32, q, scale_inv, block, out_fmt, out, label=""):
    """The checks every launch gets: all written, bit-exact vs the simulator, within the bound.

    The simulator's own row tile is left at its default: no tile changes a bit (the kernel's
    knobs do not either, which is what these checks show)."""
    got32 = as_float32(out, out_fmt)
    assert np.all(np.isfinite(got32)), f"{label}: unwritten (poisoned) or non-finite outputs"
    expected32 = simulator.gemv_simt(a32, q, scale_inv, block)
    expected = rounded_like(expected32, out_fmt)
    mismatches = np.count_nonzero(np.asarray(out).view(expected.dtype) != expected)
    assert mismatches == 0, f"{label}: {mismatches} outputs differ from fp8lab.simulators.gemv_simt"
    reference = blockwise.gemm(a32, q, scale_inv, block)
    bound = float32_bound(a32, q, scale_inv, block) + OUTPUT_UNIT[out_fmt] * np.abs(got32)
    assert np.all(np.abs(got32 - reference) <= bound), f"{label}: outside the float32 error bound"
    rel = np.linalg.norm(got32 - reference) / np.linalg.norm(reference)
    assert rel <= OUTPUT_UNIT[out_fmt] + 1e-5, f"{label}: ||out - ref|| / ||ref|| = {rel:.3g}"


# ---------------------------------------------------------------------------- launch shape (any process)


def test_launch_info():
    knobs = {"warps_per_cta": 4, "chunks_per_iteration": 2, "columns_per_warp": 1}
    info = gemv_simt_launch_info(1, 4096, 12288, **knobs)
    assert info.grid == (1024, 1, 1) and info.block == (128,) and info.m_tile == 1 and info.steps == 24
    info = gemv_simt_launch_info(5, 6, 640, **knobs)
    assert info.m_tile == 5 and info.grid == (2, 1, 1) and info.steps == 2  # default: all rows in one tile
    info = gemv_simt_launch_info(16, 10, 512, m_tile=4, warps_per_cta=8, chunks_per_iteration=4, columns_per_warp=2)
    assert info.grid == (1, 4, 1) and info.block == (256,) and info.m_tile == 4 and info.chunks_per_iteration == 4
    info = gemv_simt_launch_info(3, 4097, 4096, m_tile=2, warps_per_cta=2, columns_per_warp=4)
    assert info.grid == (513, 2, 1) and info.block == (64,) and info.columns_per_warp == 4
    info = gemv_simt_launch_info(1, 4096, 12288, k_splits=3)  # a layer of CTAs per K slice of 4096
    assert info.grid == (256, 1, 3) and info.k_splits == 3 and info.steps == 8
    for m in range(1, 17):  # the defaults and the tuning candidates are valid knobs, one tile of all rows
        defaults = kernel_module.default_knobs(m, 4096, 4096)
        info = gemv_simt_launch_info(m, 4096, 4096)
        assert info.m_tile == m and info.grid[1] == 1
        assert all(getattr(info, name) == value for name, value in defaults.items())
        for knobs in kernel_module.tuning_candidates(m):
            assert gemv_simt_launch_info(m, 4096, 4096, **knobs).m_tile == m
    for bad in ({"m": 17}, {"m": 0}, {"m_tile": 0}, {"m_tile": 17}, {"warps_per_cta": 0}, {"warps_per_cta": 33},
                {"chunks_per_iteration": 3}, {"columns_per_warp": 3}, {"columns_per_warp": 0},
                {"chunks_per_iteration": 4, "columns_per_warp": 4}, {"m": 9, "columns_per_warp": 4}):
        args = {"m": 2, "n": 4, "k": 128, **bad}
        with pytest.raises(ValueError):
            gemv_simt_launch_info(**args)


# ---------------------------------------------------------------------------- CUDA simulator: tiny shapes


# Every allowed (chunks_per_iteration, columns_per_warp) pair once (4 x 4 would spill), each with
# another activation format, CTA size and row tile, so that every format meets every G and every NC.
# M = 3 rows; N = 5 columns; K = 1152 = 72 chunks, three warp steps of 32, 32 and 8 busy lanes:
# G = 1 walks 3 groups (an odd count: the loop leaves after its first half), G = 2 walks 2 (the
# second half-empty), G = 4 one group with an empty step; block (2, 256): partial blocks in N and K.
KNOB_MATRIX = [  # (chunks_per_iteration, columns_per_warp, activation format, warps_per_cta, m_tile)
    (1, 1, "bf16", 2, 2),  # two row tiles, the second with a clamped row; the last CTA's warp 1 has no column
    (1, 2, "f16", 1, 3),
    (1, 4, "f32", 3, 1),  # three row tiles of one row; warp 1 with column 4 and three clamped ones
    (2, 1, "f16", 3, 5),  # one tile of 5 rows for M = 3: two clamped rows
    (2, 2, "f32", 2, 2),  # warp 0 of CTA 1 with column 4 and a clamped one, warp 1 with none
    (2, 4, "bf16-int16", 1, None),
    (4, 1, "f32", 1, None),
    (4, 2, "bf16", 3, 1),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("group, columns, act_fmt, warps, m_tile", KNOB_MATRIX)
def test_simulated_kernel_knobs_equal_the_simulator(rng, group, columns, act_fmt, warps, m_tile):
    m, n, k, block = 3, 5, 1152, (2, 256)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    a_in, a32 = activations(a, act_fmt)
    out = poisoned_output((m, n), "f32")
    knobs = {"m_tile": m_tile, "warps_per_cta": warps, "chunks_per_iteration": group, "columns_per_warp": columns}
    gemv_simt(a_in, q, scale_inv, out, block, **knobs)
    check_against_simulator_and_reference(a32, q, scale_inv, block, "f32", out, f"{act_fmt} {knobs}")


@pytest.mark.cudasim
@pytest.mark.parametrize("m, n, k, knobs", [
    # K = 2688: 168 chunks, 6 warp steps (the last with 8 busy lanes)
    (2, 3, 2688, {"chunks_per_iteration": 4, "columns_per_warp": 2, "warps_per_cta": 2}),  # 2 groups, 2 empty steps
    (2, 3, 2688, {"chunks_per_iteration": 2, "columns_per_warp": 1, "warps_per_cta": 1}),  # 3 groups: 2 rounds
    (9, 3, 256, {}),  # the default knobs for M = 9: one tile of 9 rows
])
def test_simulated_kernel_long_rows_and_many_rows(rng, m, n, k, knobs):
    """The group loop through several rounds (the last group partly empty), and a tall tile."""
    block = (2, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    a_in, a32 = activations(a, "bf16")
    out = poisoned_output((m, n), "f32")
    gemv_simt(a_in, q, scale_inv, out, block, **knobs)
    check_against_simulator_and_reference(a32, q, scale_inv, block, "f32", out, str(knobs))


@pytest.mark.cudasim
@pytest.mark.parametrize("out_fmt", ["f16", "bf16", "bf16-int16"])
def test_simulated_kernel_output_formats(rng, out_fmt):
    """float16 and BF16 outputs are the float32 sum rounded once (BF16 also given as int16)."""
    m, n, k, block = 2, 3, 256, (128, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    a_in, a32 = activations(a, "bf16")
    fmt = "bf16" if out_fmt.startswith("bf16") else out_fmt
    out = poisoned_output((m, n), fmt)
    if out_fmt == "bf16-int16":
        out = out.view(np.int16)
    gemv_simt(a_in, q, scale_inv, out, block)
    check_against_simulator_and_reference(a32, q, scale_inv, block, fmt, out, out_fmt)


@st.composite
def tiny_problems(draw):
    """Shapes with tails everywhere, any block, any formats, any knobs, seeded random data."""
    m = draw(st.integers(1, 3))
    n = draw(st.integers(1, 9))
    k = draw(st.sampled_from([128, 256, 640]))
    block = (draw(st.integers(1, n + 2)), draw(st.sampled_from([128, 256])))
    columns = draw(st.sampled_from((None,) + kernel_module.COLUMNS_PER_WARP))
    groups = [g for g in kernel_module.CHUNKS_PER_ITERATION if g * (columns or 2) <= kernel_module.MAX_GROUP_SLOTS]
    knobs = {"m_tile": draw(st.sampled_from((None, 1, 2, 4))), "warps_per_cta": draw(st.sampled_from((None, 1, 2, 3))),
             "chunks_per_iteration": draw(st.sampled_from([None] + groups)), "columns_per_warp": columns}
    act_fmt = draw(st.sampled_from(ACTIVATION_FORMATS + ("bf16-int16",)))
    out_fmt = draw(st.sampled_from(OUTPUT_FORMATS))
    seed = draw(st.integers(0, 2**32 - 1))
    return m, n, k, block, knobs, act_fmt, out_fmt, seed


@pytest.mark.cudasim
@settings(max_examples=6)
@given(tiny_problems())
def test_simulated_kernel_on_random_shapes(problem):
    m, n, k, block, knobs, act_fmt, out_fmt, seed = problem
    a, q, scale_inv = random_problem(np.random.default_rng(seed), m, n, k, block)
    a_in, a32 = activations(a, act_fmt)
    out = poisoned_output((m, n), out_fmt)
    gemv_simt(a_in, q, scale_inv, out, block, **knobs)
    check_against_simulator_and_reference(a32, q, scale_inv, block, out_fmt, out, str(problem))


@pytest.mark.cudasim
def test_simulated_kernel_exact_on_exact_data(rng):
    """Integer activations, weights that are multiples of 1/8, power-of-two scales: every float32
    sum is exact, so the kernel equals the float64 reference exactly."""
    m, n, k, block = 2, 3, 640, (2, 128)
    small = np.array([c for c in FINITE_CODES if abs(e4m3.VALUES[c]) <= 4 and float(e4m3.VALUES[c] * 8).is_integer()],
                     np.uint8)
    a = rng.integers(-8, 9, (m, k)).astype(np.float32)
    q = rng.choice(small, size=(n, k))
    scale_inv = np.ldexp(1.0, rng.integers(-2, 3, blockwise.scale_shape((n, k), block))).astype(np.float32)
    a_bf16, a32 = activations(a, "bf16")  # small integers are exact in BF16
    out = poisoned_output((m, n), "f32")
    gemv_simt(a_bf16, q, scale_inv, out, block)
    assert np.array_equal(a32, a) and np.array_equal(out, blockwise.gemm(a, q, scale_inv, block))


@pytest.mark.cudasim
def test_simulated_kernel_reads_nan_codes_as_finite(rng):
    """The placement turns the NaN codes into +-480 * scale, as the simulator does (weights are
    checked for NaN codes when loaded, not per product)."""
    m, n, k, block = 1, 2, 128, (128, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    q[0, 3], q[1, 100] = 0x7F, 0xFF
    out = poisoned_output((m, n), "f32")
    gemv_simt(a, q, scale_inv, out, block)
    assert np.all(np.isfinite(out))
    assert np.array_equal(out, simulator.gemv_simt(a, q, scale_inv, block, m_tile=1))


def check_a_nan_activation_or_scale_reaches_exactly_its_outputs(rng, out_fmt):
    """A NaN activation makes its row NaN in every column, a NaN block scale (the GPU's own NaN pattern) its block's
    columns in every row; every other output is finite."""
    m, n, k, block = 3, 16, 256, (8, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    a[1, 200] = np.nan
    scale_inv[1, 1] = np.uint32(0x7FFFFFFF).view(np.float32)  # columns 8..15, second K block
    a_in, _ = activations(a, "bf16")
    out = np.full((m, n), 7.0, np.float32) if out_fmt == "f32" else np.full((m, n), 0x1234, np.uint16)
    gemv_simt(a_in, q, scale_inv, out, block)
    expected_nan = np.zeros((m, n), bool)
    expected_nan[1] = True
    expected_nan[:, 8:] = True
    assert np.array_equal(np.isnan(as_float32(out, out_fmt)), expected_nan)


@pytest.mark.cudasim
@pytest.mark.parametrize("out_fmt", ["f32", "bf16"])
def test_simulated_kernel_passes_a_nan_activation_or_scale_through(rng, out_fmt):
    check_a_nan_activation_or_scale_reaches_exactly_its_outputs(rng, out_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("out_fmt", ["f32", "bf16"])
def test_gpu_passes_a_nan_activation_or_scale_through(out_fmt):
    check_a_nan_activation_or_scale_reaches_exactly_its_outputs(np.random.default_rng(secrets.randbits(32)), out_fmt)


# ---------------------------------------------------------------------------- bad arguments (any process)


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a kernel would be built or launched."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was requested for a bad call")

    monkeypatch.setattr(kernel_module, "gemv_simt_kernel", refuse)


def good_arguments(rng, m=2, n=4, k=256):
    a = bit_placement.float32_to_bf16_bits(rng.standard_normal((m, k)).astype(np.float32))
    q = rng.choice(FINITE_CODES, size=(n, k))
    scale_inv = np.ones(blockwise.scale_shape((n, k)), np.float32)
    return a, q, scale_inv, poisoned_output((m, n), "f32")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a, q, s, o: (a[:, :192].copy(), q[:, :192].copy(), s, o), "multiple of 128"),
        (lambda a, q, s, o: (np.zeros((17, 256), np.uint16), q, s, np.full((17, 4), np.nan, np.float32)), "M <= 16"),
        (lambda a, q, s, o: (a, q, s.astype(np.float64), o), "scale_inv"),
        (lambda a, q, s, o: (a, q, np.ones((1, 3), np.float32), o), "scale_inv"),
        (lambda a, q, s, o: (a, q, s, o[:, :3].copy()), "out: expected"),
        (lambda a, q, s, o: (a, q, s, o.astype(np.float64)), "out: expected"),
        (lambda a, q, s, o: (a.astype(np.float64), q, s, o), "a: expected activations"),
        (lambda a, q, s, o: (a[:, :128].copy(), q, s, o), "a: expected activations"),
        (lambda a, q, s, o: (a, q.astype(np.int8), s, o), "q: expected uint8"),
        (lambda a, q, s, o: (a, np.asfortranarray(q), s, o), "C-contiguous"),
    ],
)
def test_bad_arguments_raise_before_launch(rng, no_launch, change, message):
    a, q, scale_inv, out = change(*good_arguments(rng))
    with pytest.raises(ValueError, match=message):
        gemv_simt(a, q, scale_inv, out)
    if out.dtype.kind == "f":
        assert np.all(np.isnan(out))  # untouched


@pytest.mark.parametrize("kwargs, message", [
    ({"m_tile": 17}, "m_tile"), ({"block": (128, 192)}, "block_k"), ({"block": (0, 128)}, "block_n"),
    ({"warps_per_cta": 40}, "warps_per_cta"), ({"chunks_per_iteration": 3}, "chunks_per_iteration"),
    ({"columns_per_warp": 8}, "columns_per_warp"),
])
def test_bad_options_raise_before_launch(rng, no_launch, kwargs, message):
    a, q, scale_inv, out = good_arguments(rng)
    with pytest.raises(ValueError, match=message):
        gemv_simt(a, q, scale_inv, out, **kwargs)


# ---------------------------------------------------------------------------- GPU: real sizes


GPU_SHAPES = [  # (M, N, K): Qwen3-8B projections, with tails in M (partial row tiles) and N (partial CTAs)
    (1, 4096, 4096), (1, 24576, 4096), (3, 4096, 12288), (5, 1000, 4096), (11, 6144, 4096), (16, 4096, 12288),
]


def run_on_gpu(m, n, k, act_fmt, out_fmt, **knobs):
    """Fresh random inputs (the seed goes into any failure message), device arrays, a poisoned
    output; the result checked against the simulator and the reference."""
    from numba import cuda

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    block = (128, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    a_in, a32 = activations(a, act_fmt)
    out = cuda.to_device(poisoned_output((m, n), out_fmt))
    gemv_simt(cuda.to_device(a_in), cuda.to_device(q), cuda.to_device(scale_inv), out, block, **knobs)
    check_against_simulator_and_reference(a32, q, scale_inv, block, out_fmt, out.copy_to_host(),
                                          f"seed {seed}, M={m} N={n} K={k} {act_fmt}->{out_fmt} {knobs}")


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", GPU_SHAPES)
@pytest.mark.parametrize("act_fmt, out_fmt", [("bf16", "bf16"), ("f16", "f32")])
def test_gpu_kernel_against_reference_and_simulator(m, n, k, act_fmt, out_fmt):
    run_on_gpu(m, n, k, act_fmt, out_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (3, 1000, 4096)])
def test_gpu_float32_activations(m, n, k):
    """float32 activations with all 24 bits (the simulator then emulates every fma: smaller shapes)."""
    run_on_gpu(m, n, k, "f32", "f16")


@pytest.mark.gpu
@pytest.mark.parametrize("m_tile", (1, 2, 4, 5, 8, 16))
def test_gpu_row_tiles(m_tile):
    """M = 13 rows (partial tiles for every M_TILE but 1), K with a partial last warp step."""
    run_on_gpu(13, 2048, 4096 + 512 + 128, "bf16", "f32", m_tile=m_tile)


@pytest.mark.gpu
@pytest.mark.parametrize("group, columns, act_fmt, warps, m_tile", KNOB_MATRIX)
def test_gpu_knobs(group, columns, act_fmt, warps, m_tile):
    """The simulator's knob matrix at a real K: N = 1027 (partial CTAs, clamped columns; small, as
    float32 activations make the simulator emulate every fma), K with a partial last warp step, M = 3."""
    knobs = {"m_tile": m_tile, "warps_per_cta": warps, "chunks_per_iteration": group, "columns_per_warp": columns}
    run_on_gpu(3, 1027, 4096 + 512 + 128, act_fmt, "bf16", **knobs)


@pytest.mark.gpu
def test_gpu_misaligned_device_array_is_refused():
    from numba import cuda

    n, k = 4, 256
    storage = cuda.to_device(np.zeros(n * k + 16, np.uint8))
    q = storage[8 : 8 + n * k].reshape(n, k)  # data 8 bytes past a 16-byte boundary
    a = cuda.to_device(np.zeros((1, k), np.uint16))
    with pytest.raises(ValueError, match="16-byte boundary"):
        gemv_simt(a, q, cuda.to_device(np.ones((1, 2), np.float32)), cuda.to_device(np.zeros((1, n), np.float32)))


# ---------------------------------------------------------------------------- SwiGLU in the epilogue

SILU_SLOPE = 1.1
"""``|silu'(x)| <= 1.0999`` for every x: a gate off by ``e`` moves ``silu(gate)`` by at most ``1.1 |e|``."""
SILU_ROUNDING = 10 * 2.0**-24
"""The float32 epilogue's own relative error: ``exp`` (2 ulp for CUDA's ``expf``, NumPy's less), add,
divide, multiply; 10 units of 2^-24 leave room."""


def swiglu_problem(rng, m, intermediate, k, block):
    """``random_problem`` for the fused ``[2 I, K]`` weight, the activations scaled so that the gates of
    the first block row of weights have an RMS of 3: silu's curved part, its linear part and its
    vanishing tail all occur."""
    a, q, scale_inv = random_problem(rng, m, 2 * intermediate, k, block)
    rows = min(block[0], intermediate)  # gate rows all in scale_inv's first row
    gate = blockwise.gemm(a, q[:rows], scale_inv[:1], (rows, block[1]))
    return (a * np.float32(3.0 / np.sqrt(np.mean(np.square(gate))))).astype(np.float32), q, scale_inv


def check_swiglu(a32, q, scale_inv, block, out, label, kernel_sequence=None):
    """All written; bit for bit ``simulators.gemv_simt.gemv_simt_swiglu`` (and ``kernel_sequence``, the
    output of ``gemv_simt`` then ``layers.silu_mul``, when given); within the float64 oracle's bound."""
    assert np.all(np.isfinite(out)), f"{label}: unwritten (poisoned) or non-finite outputs"
    expected = simulator.gemv_simt_swiglu(a32, q, scale_inv, block)
    assert np.array_equal(out, expected), f"{label}: {np.count_nonzero(out != expected)} outputs differ from the simulator"
    if kernel_sequence is not None:
        differ = np.count_nonzero(out != kernel_sequence)
        assert differ == 0, f"{label}: {differ} outputs differ from gemv_simt + layers.silu_mul"
    intermediate = q.shape[0] // 2
    gate_up = blockwise.gemm(a32, q, scale_inv, block)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    reference = dense.silu_mul_float64(gate, up)
    column_bound = float32_bound(a32, q, scale_inv, block)  # of every gemv column
    gate_bound, up_bound = column_bound[:, :intermediate], column_bound[:, intermediate:]
    # |silu(g~) u~ - silu(g) u| <= |silu(g~) - silu(g)| |u~| + |silu(g)| |u~ - u|, then the epilogue's rounding
    silu = dense.silu_mul_float64(gate, np.ones_like(gate))
    bound = (SILU_SLOPE * gate_bound * (np.abs(up) + up_bound) + np.abs(silu) * up_bound
             + SILU_ROUNDING * np.abs(out) + 1e-30)
    assert np.all(np.abs(out - reference) <= bound), f"{label}: outside the float32 error bound"
    rel = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    assert rel <= 1e-5, f"{label}: ||out - ref|| / ||ref|| = {rel:.3g}"


def gemv_then_silu_mul(a_in, q, scale_inv, block, **knobs):
    """The sequence the SwiGLU GEMV replaces: ``gemv_simt`` into ``gate_up[M, 2 I]``, ``layers.silu_mul``."""
    m, n = a_in.shape[0], q.shape[0]
    gate_up = poisoned_output((m, n), "f32")
    gemv_simt(a_in, q, scale_inv, gate_up, block, **knobs)
    act = poisoned_output((m, n // 2), "f32")
    layers.silu_mul(gate_up, act)
    return act


def test_swiglu_launch_info():
    info = gemv_simt_launch_info(1, 24576, 4096, swiglu=True)  # defaults for M = 1: 4 warps, two pairs each
    assert info.grid == (12288 // 8, 1, 1) and info.block == (128,) and info.columns_per_warp == 4
    info = gemv_simt_launch_info(3, 10, 256, warps_per_cta=2, columns_per_warp=4, swiglu=True)
    assert info.grid == (2, 1, 1)  # I = 5 outputs, 2 per warp, 4 per CTA
    for m in range(1, 17):
        for knobs in kernel_module.tuning_candidates(m, swiglu=True):
            assert gemv_simt_launch_info(m, 4096, 4096, swiglu=True, **knobs).columns_per_warp in (2, 4)
    with pytest.raises(ValueError, match="columns_per_warp"):
        gemv_simt_launch_info(1, 16, 128, columns_per_warp=1, swiglu=True)


# (M, I, K, knobs, activation format, block, also against the kernel sequence): I = 8, 24, 128 and an odd
# I = 5 (the last warp's second pair clamped to output I - 1's rows, never stored); row tiles with
# clamped rows; every G with NC = 2 or 4. The two-launch sequence costs as much again in the CUDA
# simulator, so it runs on the cheaper half (it equals the simulator too: the other tests of this file).
SWIGLU_CASES = [
    (1, 8, 128, {}, "bf16", (128, 128), True),  # the defaults: one pair per warp, 8 warps
    (3, 24, 128, {"columns_per_warp": 4, "warps_per_cta": 2, "m_tile": 2}, "f16", (16, 128), False),
    (2, 12, 256, {"chunks_per_iteration": 2, "warps_per_cta": 3}, "bf16-int16", (2, 256), False),
    (1, 128, 128, {"columns_per_warp": 4, "warps_per_cta": 8}, "bf16", (128, 128), False),
    (4, 5, 256, {"columns_per_warp": 4, "chunks_per_iteration": 2, "m_tile": 3, "warps_per_cta": 1}, "f32", (3, 128),
     False),
    (2, 8, 256, {"chunks_per_iteration": 4, "columns_per_warp": 2, "warps_per_cta": 2}, "bf16", (4, 128), True),  # a group with an empty step
]


@pytest.mark.cudasim
@pytest.mark.parametrize("m, intermediate, k, knobs, act_fmt, block, sequence", SWIGLU_CASES)
def test_simulated_swiglu_equals_simulator_and_kernel_sequence(rng, m, intermediate, k, knobs, act_fmt, block,
                                                                sequence):
    a, q, scale_inv = swiglu_problem(rng, m, intermediate, k, block)
    a_in, a32 = activations(a, act_fmt)
    out = poisoned_output((m, intermediate), "f32")
    assert gemv_simt_swiglu(a_in, q, scale_inv, out, block, **knobs) is out
    label = f"M={m} I={intermediate} K={k} {act_fmt} {knobs}"
    kernels = gemv_then_silu_mul(a_in, q, scale_inv, block, **knobs) if sequence else None
    check_swiglu(a32, q, scale_inv, block, out, label, kernels)


def good_swiglu_arguments(rng, m=2, intermediate=4, k=256):
    a, q, scale_inv, _ = good_arguments(rng, m, 2 * intermediate, k)
    return a, q, scale_inv, poisoned_output((m, intermediate), "f32")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a, q, s, o: (a, q[:7].copy(), s, o), "q: expected uint8 E4M3 codes \\[2 I, K\\]"),  # N odd
        (lambda a, q, s, o: (a, q, s, poisoned_output((2, 8), "f32")), "out: expected float32 \\[2, 4\\]"),  # [M, N]
        (lambda a, q, s, o: (a, q, s, o.astype(np.float16)), "out: expected float32"),
        (lambda a, q, s, o: (a, q, s, np.full((4, 2), np.nan, np.float32).T), "C-contiguous"),
        (lambda a, q, s, o: (a[:, :192].copy(), q[:, :192].copy(), s, o), "multiple of 128"),
        (lambda a, q, s, o: (np.zeros((17, 256), np.uint16), q, s, np.full((17, 4), np.nan, np.float32)), "M <= 16"),
        (lambda a, q, s, o: (a, q, np.ones((1, 3), np.float32), o), "scale_inv"),
        (lambda a, q, s, o: (a.astype(np.float64), q, s, o), "a: expected activations"),
        (lambda a, q, s, o: (a, q.astype(np.int8), s, o), "q: expected uint8"),
    ],
)
def test_swiglu_bad_arguments_raise_before_launch(rng, no_launch, change, message):
    a, q, scale_inv, out = change(*good_swiglu_arguments(rng))
    with pytest.raises(ValueError, match=message):
        gemv_simt_swiglu(a, q, scale_inv, out)
    if out.dtype.kind == "f":
        assert np.all(np.isnan(out))  # untouched


@pytest.mark.parametrize("kwargs, message", [
    ({"columns_per_warp": 1}, "columns_per_warp"), ({"m_tile": 17}, "m_tile"), ({"block": (128, 192)}, "block_k"),
    ({"chunks_per_iteration": 4, "columns_per_warp": 4}, "chunks_per_iteration x columns_per_warp"),
])
def test_swiglu_bad_options_raise_before_launch(rng, no_launch, kwargs, message):
    a, q, scale_inv, out = good_swiglu_arguments(rng)
    with pytest.raises(ValueError, match=message):
        gemv_simt_swiglu(a, q, scale_inv, out, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 4))
@pytest.mark.parametrize("knobs", [{}, {"columns_per_warp": 4, "chunks_per_iteration": 2}])
def test_gpu_swiglu_equals_gemv_then_silu_mul(m, knobs):
    """Qwen3-8B's gate_up (2 I x K = 24576 x 4096): bit for bit the two launches it replaces, on the
    GPU (the same libdevice expf in both), fresh random inputs, poisoned outputs."""
    from numba import cuda

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    intermediate, k, block = 12288, 4096, (128, 128)
    a, q, scale_inv = swiglu_problem(rng, m, intermediate, k, block)
    a_in, _ = activations(a, "bf16")
    a_dev, q_dev, s_dev = cuda.to_device(a_in), cuda.to_device(q), cuda.to_device(scale_inv)
    gate_up = cuda.to_device(poisoned_output((m, 2 * intermediate), "f32"))
    expected = cuda.to_device(poisoned_output((m, intermediate), "f32"))
    gemv_simt(a_dev, q_dev, s_dev, gate_up, block, **knobs)
    layers.silu_mul(gate_up, expected)
    out = cuda.to_device(poisoned_output((m, intermediate), "f32"))
    gemv_simt_swiglu(a_dev, q_dev, s_dev, out, block, **knobs)
    got, expected = out.copy_to_host(), expected.copy_to_host()
    label = f"seed {seed}, M={m} {knobs}"
    assert np.all(np.isfinite(got)), f"{label}: unwritten (poisoned) or non-finite outputs"
    assert np.array_equal(got, expected), f"{label}: {np.count_nonzero(got != expected)} outputs differ"


def test_bf16_oracle_helpers_agree_with_ml_dtypes(rng):
    """The test's own BF16 rounding is ml_dtypes' (so the bit-exact output checks mean something)."""
    x = (rng.standard_normal(1000) * 100).astype(np.float32)
    assert np.array_equal(rounded_like(x, "bf16"), x.astype(ml_dtypes.bfloat16).view(np.uint16))


# ---------------------------------------------------------------------------- split-K (gemv_simt_split_k)


def check_split_k(a32, q, scale_inv, block, parts, label):
    """All written; every part bit for bit ``simulators.gemv_simt.gemv_simt_split_k``; the parts' sum in
    slice order within the float32 bound of the float64 oracle (each product passes at most ``S - 1``
    more roundings: the additions of the parts)."""
    splits = parts.shape[0]
    assert np.all(np.isfinite(parts)), f"{label}: unwritten (poisoned) or non-finite parts"
    expected = simulator.gemv_simt_split_k(a32, q, scale_inv, splits, block)
    differ = np.count_nonzero(parts.view(np.uint32) != expected.view(np.uint32))
    assert differ == 0, f"{label}: {differ} part elements differ from the simulator"
    total = simulator.sum_parts(parts).astype(np.float64)
    k = a32.shape[1]
    magnitude = np.abs(a32.astype(np.float64)) @ np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64)).T
    bound = (gamma(22 + simulator.num_steps(k // splits) + splits) + k * 2.0**-52) * magnitude
    reference = blockwise.gemm(a32, q, scale_inv, block)
    assert np.all(np.abs(total - reference) <= bound), f"{label}: the parts' sum is outside the float32 bound"


@st.composite
def split_k_problems(draw):
    """Tiny shapes with tails in M and N, K of 2 to 9 blocks of 128 split into 1 to K / 128 slices, any knobs."""
    m, n = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    blocks = draw(st.sampled_from([2, 3, 4, 6, 9]))
    splits = draw(st.sampled_from([s for s in range(1, blocks + 1) if blocks % s == 0]))
    columns = draw(st.sampled_from(kernel_module.COLUMNS_PER_WARP))
    groups = [g for g in kernel_module.CHUNKS_PER_ITERATION if g * columns <= kernel_module.MAX_GROUP_SLOTS]
    knobs = {"warps_per_cta": draw(st.sampled_from((1, 2, 3))), "chunks_per_iteration": draw(st.sampled_from(groups)),
             "columns_per_warp": columns, "m_tile": draw(st.sampled_from((None, 1, 2)))}
    block = (draw(st.integers(1, n + 2)), 128)
    return m, n, 128 * blocks, splits, block, knobs, draw(st.sampled_from(ACTIVATION_FORMATS)), draw(st.integers(0, 2**32 - 1))


@pytest.mark.cudasim
@settings(max_examples=5)
@given(split_k_problems())
def test_simulated_split_k_on_random_shapes(problem):
    """Each layer of CTAs sums its K slice as the plain kernel sums a row: the parts are the simulator's."""
    m, n, k, splits, block, knobs, act_fmt, seed = problem
    a, q, scale_inv = random_problem(np.random.default_rng(seed), m, n, k, block)
    a_in, a32 = activations(a, act_fmt)
    parts = np.full((splits, m, n), np.nan, np.float32)
    kernel_module.gemv_simt_split_k(a_in, q, scale_inv, parts, block, **knobs)
    check_split_k(a32, q, scale_inv, block, parts, str(problem))


@pytest.mark.cudasim
def test_simulated_split_k_of_one_slice_is_the_plain_gemv(rng):
    """S = 1: one part, the plain kernel's output bit for bit (K = 1152: a partial last warp step)."""
    m, n, k, block = 2, 5, 1152, (2, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    parts, out = np.full((1, m, n), np.nan, np.float32), poisoned_output((m, n), "f32")
    kernel_module.gemv_simt_split_k(a, q, scale_inv, parts, block)
    gemv_simt(a, q, scale_inv, out, block)
    assert np.array_equal(parts[0].view(np.uint32), out.view(np.uint32))


@pytest.mark.parametrize("change, message", [
    (lambda p: p[0].copy(), "parts: expected float32 \\[S, 2, 4\\]"),
    (lambda p: p[:, :, :3].copy(), "parts: expected float32 \\[S, 2, 4\\]"),
    (lambda p: p.astype(np.float16), "parts: expected float32"),
    (lambda p: np.full((3, 2, 4), np.nan, np.float32), "K / 3 is not a multiple of 128"),
    (lambda p: np.full((4, 2, 4), np.nan, np.float32), "K / 4 is not a multiple of 128"),
    (lambda p: np.asfortranarray(np.full((2, 2, 4), np.nan, np.float32)), "C-contiguous"),
])
def test_bad_split_k_arguments_raise_before_launch(rng, no_launch, change, message):
    a, q, scale_inv, _ = good_arguments(rng)
    parts = change(np.full((2, 2, 4), np.nan, np.float32))
    with pytest.raises(ValueError, match=message):
        kernel_module.gemv_simt_split_k(a, q, scale_inv, parts)
    assert np.all(np.isnan(parts))  # untouched


def test_the_split_rule_on_the_qwen3_shapes():
    """``choose_k_splits`` on an H200's 132 SMs: the narrow residual GEMMs split, the wide ones do not,
    and a K of one block cannot."""
    assert [simulator.choose_k_splits(n, k, 128, 132) for n, k in
            [(4096, 4096), (4096, 12288), (1024, 2048), (1024, 3072), (24576, 4096), (6144, 4096)]] == [2, 2, 4, 4, 1, 1]
    assert simulator.choose_k_splits(16, 128, 128, 132) == 1
    for n, k in [(4096, 4096), (1024, 3072), (128, 768)]:
        s = simulator.choose_k_splits(n, k, 128, 132)
        assert k % (s * 128) == 0 and s in simulator.K_SPLITS


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (1, 4096, 12288), (4, 4096, 12288), (1, 1024, 3072),
                                     (3, 1024, 2048)])
def test_gpu_split_k_against_simulator_and_reference(m, n, k):
    """The engine's split counts at Qwen3-8B and Qwen3-0.6B o_proj / down_proj sizes, float32 activations."""
    from numba import cuda

    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    block = (128, 128)
    a, q, scale_inv = random_problem(rng, m, n, k, block)
    splits = simulator.choose_k_splits(n, k, 128, cuda.get_current_device().MULTIPROCESSOR_COUNT)
    parts = cuda.to_device(np.full((splits, m, n), np.nan, np.float32))
    kernel_module.gemv_simt_split_k(cuda.to_device(a), cuda.to_device(q), cuda.to_device(scale_inv), parts, block)
    check_split_k(a, q, scale_inv, block, parts.copy_to_host(), f"seed {seed}, M={m} N={n} K={k} S={splits}")
