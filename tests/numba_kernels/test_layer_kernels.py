"""fp8lab.numba_kernels.layers: the dense Qwen3 operators (norms, RoPE, SwiGLU, embedding, BF16 linear, argmax, add).

- CUDA simulator (``cudasim``, tiny shapes): bit for bit against ``fp8lab.simulators.dense``, the
  kernels' float32 order (``rms_norm``/``add_rms_norm``: the threads' fma chains, butterfly, warp
  order; ``rope``: the two fmas; ``silu_mul``; ``bf16_linear``: the lanes' fma chains and the
  butterfly; the generic long-row norm kernel launched directly); ``embedding``, ``argmax_rows`` (one
  to 40 CTAs per row, merged by the last; its workspace's counters back at 0 after every call),
  ``add_into`` and ``bf16_round`` exactly against ``fp8lab.reference.dense`` / NumPy / ``ml_dtypes``.
  The norms' and ``silu_mul``'s BF16 output (a uint16 ``out``): bit for bit their float32 output
  then ``bf16_round`` (and ``ml_dtypes``' rounding), exact ties and NaN rows included.
  Every float kernel is also checked against ``fp8lab.reference.dense`` (float32 and float64) within
  the bounds derived next to each test. Outputs are poisoned with NaN before every call (a uint16
  ``out`` with a finite pattern, ``BF16_POISON``); bad
  arguments raise ``ValueError`` and launch nothing.
- ``rope_table`` against ``fp8lab.reference.dense.rope_cos_sin`` bit for bit.
- The sm_90 PTX of every kernel, compiled in a subprocess with the simulator off: no local memory,
  no float64, the expected instructions (128-bit loads, fma, butterflies, correctly rounded
  sqrt and division); no spills where nvJitLink can run ptxas.
- GPU (``gpu``, Qwen3-8B sizes: hidden 4096, head_dim 128, intermediate 12288, vocab 151936): fresh
  random inputs each run (the seed is in any failure message), device arrays, poisoned outputs;
  bit for bit against the same simulators where the GPU's operations are correctly rounded (all but
  ``silu_mul``'s ``expf``), and against ``fp8lab.reference.dense`` in float64 within the bound; and
  every kernel captured in a CUDA graph and replayed; the BF16 outputs bit for bit ``bf16_round`` of the
  float32 outputs, both computed on the GPU.

``u = 2^-24`` is float32's unit roundoff, ``gamma(n) = n u / (1 - n u)``.
"""

import os
import re

import ml_dtypes
import numpy as np
import pytest
from helpers.numerics import U, gamma, spread_activations
from helpers.ptx import check_pdl_rules, compile_sets, each_variant, progress_printer
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import layers
from fp8lab.reference import dense
from fp8lab.simulators import dense as sim

TINY = 1e-30
"""Absolute slack for results in or near float32's subnormal range."""
SIMULATOR_EXAMPLES = max(4, settings().max_examples // 8)
"""Simulated kernels are slow: few Hypothesis examples (ci: 5)."""


def poisoned(shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def random_bf16_bits(rng, shape) -> np.ndarray:
    """BF16 patterns of random finite values in +-[2^-8, 2^2): random sign and 7 mantissa bits."""
    bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    exponent = np.uint16(119) + (bits >> np.uint16(7) & np.uint16(7))  # float32 biased exponents 119..126, +1 below
    return (bits & np.uint16(0x807F)) | (exponent + np.uint16(2)) << np.uint16(7)


def bf16_values(bits) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


def fresh_rng():
    seed = int.from_bytes(os.urandom(8), "little")
    return seed, np.random.default_rng(seed)


# ---------------------------------------------------------------------------- rms_norm


def simulated_rms_norm(x, weight, eps):
    """The simulator of the kernel launched for rows of ``x``'s length."""
    return sim.rms_norm(x, weight, eps, layers.rms_norm_threads_per_row(x.shape[-1]))


def rms_norm_bound(x: np.ndarray, weight: np.ndarray, eps: float):
    """float64 result and the kernel's error bound: the sum of squares has at most ``L = ceil(n / G) + 5
    + warps`` roundings (``gamma(L)`` relative); the division by n, ``+ eps`` and sqrt halve it and add
    ``1.5 u``; ``x / denom`` and ``* weight`` add ``2 u``: ``(gamma(L) / 2 + 4 u) |exact|``."""
    n = x.shape[-1]
    exact = dense.rms_norm_float64(x, weight, eps)
    threads = layers.rms_norm_threads_per_row(n)
    roundings = -(-n // threads) + 5 + threads // 32
    return exact, 1.01 * (gamma(roundings) / 2 + 4 * U) * np.abs(exact) + TINY


def check_rms_norm(x, weight, eps, got):
    np.testing.assert_array_equal(got.view(np.uint32), simulated_rms_norm(x, weight, eps).view(np.uint32))
    exact, bound = rms_norm_bound(x, weight, eps)
    assert np.all(np.abs(got - exact) <= bound)
    # the float32 reference sums with NumPy's pairwise float32 sum (at most n roundings): within both bounds
    reference = dense.rms_norm(x, weight, eps)
    assert np.all(np.abs(got - reference) <= 2 * bound + gamma(x.shape[-1]) / 2 * np.abs(exact))


NORM_SIZES = st.sampled_from([32, 40, 128, 200, 256, 300, 520])
"""Up to 256 a warp per row (one or several elements per lane, lanes without elements); above, a CTA
of 2 or 3 warps."""


@pytest.mark.cudasim
@settings(max_examples=SIMULATOR_EXAMPLES)
@given(rows=st.integers(1, 5), n=NORM_SIZES, eps=st.sampled_from([1e-6, 1e-5, 0.5]), seed=st.integers(0, 2**32 - 1))
def test_rms_norm_matches_the_simulator_bit_for_bit(rows, n, eps, seed):
    rng = np.random.default_rng(seed)
    x = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    out = poisoned(x.shape)
    assert layers.rms_norm(x, weight, eps, out) is out
    check_rms_norm(x, weight, eps, out)


@pytest.mark.cudasim
@pytest.mark.parametrize("shape", [(3, 2, 128), (2, 300)], ids=["q-norm, warp per row", "cta per row"])
def test_rms_norm_in_place_and_over_the_last_axis(rng, shape):
    """``out`` may be ``x``; a ``[T, heads, head_dim]`` array is normalized per head vector."""
    x = spread_activations(rng, shape)
    weight = spread_activations(rng, shape[-1:], spread=1)
    expected = simulated_rms_norm(x, weight, 1e-6)
    y = x.copy()
    layers.rms_norm(y, weight, 1e-6, y)
    np.testing.assert_array_equal(y.view(np.uint32), expected.view(np.uint32))


@pytest.mark.cudasim
@pytest.mark.parametrize("rows, n", [(5, 96), (2, 520)], ids=["warp per row", "cta per row"])
def test_add_rms_norm_adds_then_normalizes(rng, rows, n):
    """``residual += x`` exactly (one float32 add), then the norm of the new residual; the same bits
    as ``add_into`` followed by ``rms_norm``; ``out`` may be ``x``."""
    x = spread_activations(rng, (rows, n))
    original = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    residual, out = original.copy(), poisoned(x.shape)
    layers.add_rms_norm(x, residual, weight, 1e-6, out)
    np.testing.assert_array_equal(residual.view(np.uint32), (original + x).view(np.uint32))
    check_rms_norm(original + x, weight, 1e-6, out)
    simulated, total = sim.add_rms_norm(x, original, weight, 1e-6, layers.rms_norm_threads_per_row(n))
    np.testing.assert_array_equal(out.view(np.uint32), simulated.view(np.uint32))
    np.testing.assert_array_equal(residual.view(np.uint32), total.view(np.uint32))
    np.testing.assert_array_equal(residual.view(np.uint32), dense.add_rms_norm(x, original, weight, 1e-6)[1].view(np.uint32))

    staged, unfused = original.copy(), poisoned(x.shape)
    layers.add_into(staged, x)
    layers.rms_norm(staged, weight, 1e-6, unfused)
    np.testing.assert_array_equal(unfused.view(np.uint32), out.view(np.uint32))

    in_place, residual = x.copy(), original.copy()
    layers.add_rms_norm(in_place, residual, weight, 1e-6, in_place)
    np.testing.assert_array_equal(in_place.view(np.uint32), out.view(np.uint32))


@pytest.mark.cudasim
@pytest.mark.parametrize("rows, n", [(5, 96), (2, 520)], ids=["warp per row", "cta per row"])
def test_add_parts_rms_norm_adds_the_parts_in_order(rng, rows, n):
    """A split-K product's 3 parts: summed in part order (``simulators.dense.sum_parts``), added to the
    residual in one addition, normalized; the same bits as ``add_rms_norm`` of that sum; one part is
    ``add_rms_norm`` bit for bit."""
    parts = spread_activations(rng, (3, rows, n))
    original = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    residual, out = original.copy(), poisoned((rows, n))
    layers.add_parts_rms_norm(parts, residual, weight, 1e-6, out)
    summed = (parts[0] + parts[1]) + parts[2]
    np.testing.assert_array_equal(residual.view(np.uint32), (original + summed).view(np.uint32))
    check_rms_norm(original + summed, weight, 1e-6, out)
    simulated, total = sim.add_parts_rms_norm(parts, original, weight, 1e-6, layers.rms_norm_threads_per_row(n))
    np.testing.assert_array_equal(out.view(np.uint32), simulated.view(np.uint32))
    np.testing.assert_array_equal(residual.view(np.uint32), total.view(np.uint32))

    staged, plain = original.copy(), poisoned((rows, n))
    layers.add_rms_norm(summed, staged, weight, 1e-6, plain)
    np.testing.assert_array_equal(plain.view(np.uint32), out.view(np.uint32))

    one_part, fused = original.copy(), poisoned((rows, n))
    layers.add_parts_rms_norm(parts[:1], one_part, weight, 1e-6, fused)
    staged, plain = original.copy(), poisoned((rows, n))
    layers.add_rms_norm(parts[0], staged, weight, 1e-6, plain)
    np.testing.assert_array_equal(fused.view(np.uint32), plain.view(np.uint32))
    np.testing.assert_array_equal(one_part.view(np.uint32), staged.view(np.uint32))


@pytest.mark.parametrize("parts, message", [
    (np.full((2, 3, 64), np.nan, np.float32), "parts: expected float32 \\[S, 2, 64\\]"),
    (np.full((2, 64), np.nan, np.float32), "parts: expected float32"),
    (np.full((0, 2, 64), np.nan, np.float32), "parts: expected float32"),
    (np.full((2, 2, 64), np.nan, np.float64), "parts: expected float32"),
    (np.full((2, 2, 128), np.nan, np.float32)[:, :, ::2], "parts: expected a C-contiguous"),
])
def test_bad_parts_raise_before_launch(parts, message):
    residual, out = np.ones((2, 64), np.float32), poisoned((2, 64))
    with pytest.raises(ValueError, match=message):
        layers.add_parts_rms_norm(parts, residual, np.ones(64, np.float32), 1e-6, out)
    assert np.all(np.isnan(out)) and np.all(residual == 1)


@pytest.mark.cudasim
@pytest.mark.parametrize("kernel", ["loop", "register"])
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_a_cta_per_row_norm_walks_more_rows_than_ctas(rng, fused, kernel):
    """Both CTA-per-row kernels launched with 2 CTAs over 5 rows (``norm_grid`` gives fewer CTAs than rows on a GPU
    from 265 rows on at 512 threads): each CTA walks rows b, b + 2, ... (the register kernel with the next row's loads in flight,
    two warp-total buffers in turn), the same bits as the simulator, every row written. The loop kernel is the
    fallback for rows too long for registers (n > 8192 on a GPU), run at a small n (3 warps per row)."""
    from numba import cuda

    n, rows, parts_count = 520, 5, 3
    threads = layers.rms_norm_threads_per_row(n)
    assert layers.norm_elements_per_thread(n) is not None and layers.norm_elements_per_thread(8193) is None
    x, original = spread_activations(rng, (rows, n)), spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    residual, out = (original.copy() if fused else x), poisoned(x.shape)
    parts = np.stack([x] + [spread_activations(rng, (rows, n)) for _ in range(parts_count - 1)])
    if kernel == "loop":
        source = layers.rms_norm_loop_function(fused)
    else:
        source = layers.rms_norm_register_function(fused, False, n, parts=parts_count if fused else 1)
    cuda.jit(source)[2, threads](parts if fused else x, residual, weight, np.float32(1e-6), out)
    if fused:
        expected, total = sim.add_parts_rms_norm(parts, original, weight, 1e-6, threads)
        np.testing.assert_array_equal(residual.view(np.uint32), total.view(np.uint32))
    else:
        expected = sim.rms_norm(x, weight, 1e-6, threads)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_the_norm_grid_is_at_most_the_rows():
    assert layers.norm_grid(1, 512) == 1 and layers.norm_grid(7, 128) == 7
    for threads in (128, 512, 1024):
        many = layers.norm_grid(100_000, threads)
        assert 1 <= many < 100_000 and many % (layers.NORM_THREADS_PER_SM // threads) == 0


# ---------------------------------------------------------------------------- rope


@pytest.mark.parametrize("head_dim, theta", [(64, 10000.0), (128, 1000000.0), (128, 10000.0), (256, 5e5)])
def test_rope_table_is_the_reference_cos_sin(head_dim, theta):
    max_positions = 4096
    table = layers.rope_table(max_positions, head_dim, theta)
    cos, sin = dense.rope_cos_sin(np.arange(max_positions), head_dim, theta)
    assert table.dtype == np.float32 and table.shape == (max_positions, head_dim)
    np.testing.assert_array_equal(table.view(np.uint32), np.concatenate([cos, sin], axis=1).view(np.uint32))


def check_rope(x, positions, table, theta, got):
    """Bit for bit against the simulator; against the float32 reference (which rounds both products,
    the kernel only one): both within ``2 u (|x1 c| + |x2 s|)`` of the exact ``x1 c - x2 s`` (and
    ``2 u (|x2 c| + |x1 s|)`` of ``x2 c + x1 s``), so within twice that of each other."""
    np.testing.assert_array_equal(got.view(np.uint32), sim.rope(x, positions, table).view(np.uint32))
    half = x.shape[-1] // 2
    c, s = table[positions, None, :half].astype(np.float64), table[positions, None, half:].astype(np.float64)
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    magnitude = np.concatenate([np.abs(x1 * c) + np.abs(x2 * s), np.abs(x2 * c) + np.abs(x1 * s)], axis=-1)
    bound = 4 * U * magnitude + TINY
    assert np.all(np.abs(got - dense.rope(x, positions, theta)) <= bound)


@pytest.mark.cudasim
@pytest.mark.parametrize("tokens, heads, head_dim", [(3, 2, 128), (2, 3, 64), (1, 1, 96)])
def test_rope_matches_the_simulator_bit_for_bit(rng, tokens, heads, head_dim):
    theta = 1e6
    table = layers.rope_table(200, head_dim, theta)
    positions = np.concatenate([[199], rng.integers(0, 200, tokens - 1)]).astype(np.int32)
    x = spread_activations(rng, (tokens, heads, head_dim))
    out = poisoned(x.shape)
    assert layers.rope(x, positions, table, out) is out
    check_rope(x, positions, table, theta, out)
    layers.rope(x, positions, table, x)  # in place
    np.testing.assert_array_equal(x.view(np.uint32), out.view(np.uint32))


@pytest.mark.cudasim
def test_rope_position_outside_the_table_gives_nan(rng):
    table = layers.rope_table(16, 32, 1e4)
    positions = np.array([3, -1, 16, 15], np.int32)
    x = spread_activations(rng, (4, 2, 32))
    out = poisoned(x.shape)
    out[...] = 7.0  # not NaN: the kernel must write the NaN itself
    layers.rope(x, positions, table, out)
    assert np.all(np.isnan(out[1:3]))
    np.testing.assert_array_equal(out.view(np.uint32), sim.rope(x, positions, table).view(np.uint32))


# ---------------------------------------------------------------------------- silu_mul


def silu_mul_bound(gate_up):
    """float64 result and bound: ``expf`` within 2 ulp (``4 u`` relative), ``1 + e`` adds ``u`` (``5 u``
    for the denominator), the division and the product ``u`` each: ``7 u``, asked ``10 u``; plus
    slack for ``exp(-gate)`` overflowing (``gate < -88.7``), where the exact result is below 1e-36."""
    half = gate_up.shape[1] // 2
    up = gate_up[:, half:].astype(np.float64)
    exact = dense.silu_mul_float64(gate_up[:, :half], gate_up[:, half:])
    return exact, 10 * U * np.abs(exact) + TINY * np.maximum(1, np.abs(up))


def gate_up_values(rng, tokens, intermediate):
    gate_up = (rng.standard_normal((tokens, 2 * intermediate)) * 4).astype(np.float32)
    extremes = np.array([-100, -88.8, -88.5, -20, 30, 88, 100, 1e-30, -1e-30], np.float32)
    gate_up[0, : extremes.size] = extremes
    return gate_up


SILU_WIDTHS = [70, 1028]
"""I = 70: the one-element kernel; 1,028 (a multiple of 4): the four-element kernel, its second CTA holding one
thread's quad."""


@pytest.mark.cudasim
@pytest.mark.parametrize("intermediate", SILU_WIDTHS)
def test_silu_mul_matches_the_simulator_and_its_bound(rng, intermediate):
    gate_up = gate_up_values(rng, 3, intermediate)
    out = poisoned((3, intermediate))
    assert layers.silu_mul(gate_up, out) is out
    np.testing.assert_array_equal(out.view(np.uint32), sim.silu_mul(gate_up).view(np.uint32))
    exact, bound = silu_mul_bound(gate_up)
    assert np.all(np.abs(out - exact) <= bound)
    reference = dense.silu_mul(gate_up[:, :intermediate], gate_up[:, intermediate:])
    assert np.all(np.abs(out - reference) <= 2 * bound)


# ---------------------------------------------------------------------------- BF16 output (uint16 out)

BF16_POISON = 0x1234
"""A uint16 ``out`` before a call: a finite BF16 number, never NaN, so that an element the kernel leaves
unwritten shows, and a NaN row's patterns are the kernel's own."""


def bf16_poisoned(shape) -> np.ndarray:
    return np.full(shape, BF16_POISON, np.uint16)


def is_bf16_nan(bits) -> np.ndarray:
    return (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def bf16_ties(rng, shape) -> np.ndarray:
    """float32 values exactly halfway between two neighbouring BF16 numbers (low 16 bits 0x8000), in
    +-[2^-8, 4): about half round down to an even mantissa, half up."""
    return (random_bf16_bits(rng, shape).astype(np.uint32) << 16 | 0x8000).view(np.float32)


def norm_inputs(rng, parts, rows, n):
    """``(x, residual)``: for ``parts`` 0 ``x`` is ``rms_norm``'s ``[rows, n]``, else the parts ``[parts, rows, n]``
    (1 or 2) of a fused norm's add. Random rows, two made: row 1 is +-2^20 throughout (after the add), so its
    sum of squares, mean and square root are exact (eps is below the mean's ulp) and it normalizes to exactly
    +-1: times the ``bf16_ties`` weights its outputs are BF16 ties. The last row holds a NaN."""
    signs = rng.choice(np.float32([-1, 1]), n)
    residual = spread_activations(rng, (rows, n))
    residual[1] = signs * 2**19
    if parts == 0:
        x = spread_activations(rng, (rows, n))
        x[1] = signs * 2**20
    else:
        x = spread_activations(rng, (parts, rows, n))
        x[:, 1] = signs * (2**19 / parts)
    x[..., rows - 1, n // 3] = np.nan
    return x, residual


def tie_weights(rng, n) -> np.ndarray:
    """Norm weights, every other one a BF16 tie (``bf16_ties``)."""
    weight = spread_activations(rng, (n,), spread=1)
    weight[::2] = bf16_ties(rng, weight[::2].shape)
    return weight


def call_norm(function, x, residual, weight, out):
    """The norm named ``function`` on ``norm_inputs``' arrays (``add_rms_norm`` adds ``x[0]``), eps 1e-6."""
    if function == "rms_norm":
        layers.rms_norm(x, weight, 1e-6, out)
    elif function == "add_rms_norm":
        layers.add_rms_norm(x[0], residual, weight, 1e-6, out)
    else:
        layers.add_parts_rms_norm(x, residual, weight, 1e-6, out)


def check_bf16_out(got, float_out, rounded):
    """A uint16 ``got`` is ``rounded`` (``bf16_round`` of the float32 call's ``float_out``) bit for bit, and,
    independently of fp8lab, ml_dtypes' rounding of each finite result; the last row (it holds a NaN) is
    NaN patterns only, and no other row has one."""
    np.testing.assert_array_equal(got, rounded)
    finite = np.isfinite(float_out)
    np.testing.assert_array_equal(got[finite], float_out[finite].astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.all(is_bf16_nan(got[-1])) and not np.any(is_bf16_nan(got[:-1]))


BF16_NORM_CASES = [("rms_norm", 0, 128), ("rms_norm", 0, 300), ("add_rms_norm", 1, 300), ("add_parts_rms_norm", 1, 128),
                   ("add_parts_rms_norm", 2, 128), ("add_parts_rms_norm", 2, 300)]
"""``(function, parts, n)``: each norm and both kernels (n 128: a warp per row; 300: a CTA of 2 warps), few
cases (the simulator is slow)."""


@pytest.mark.cudasim
@pytest.mark.parametrize("function, parts, n", BF16_NORM_CASES,
                         ids=[f"{f}-S{p}-{'warp' if n <= 256 else 'cta'} per row" for f, p, n in BF16_NORM_CASES])
def test_norms_write_the_bf16_bits_of_their_float32_result(rng, function, parts, n):
    """A uint16 ``out``: bit for bit the float32 call then ``bf16_round``, ties (row 1) to even, the NaN row
    NaN; the fused norms leave the residual exactly as the float32 call does."""
    rows = 3
    x, original = norm_inputs(rng, parts, rows, n)
    weight = tie_weights(rng, n)
    float_out, float_residual = poisoned((rows, n)), original.copy()
    call_norm(function, x, float_residual, weight, float_out)
    bf16_out, bf16_residual = bf16_poisoned((rows, n)), original.copy()
    call_norm(function, x, bf16_residual, weight, bf16_out)
    assert np.all(float_out[1, ::2].view(np.uint32) & 0xFFFF == 0x8000)  # row 1 holds ties, as built
    check_bf16_out(bf16_out, float_out, layers.bf16_round(float_out, bf16_poisoned((rows, n))))
    np.testing.assert_array_equal(bf16_residual.view(np.uint32), float_residual.view(np.uint32))


@pytest.mark.cudasim
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_parts_rms_norm"])
def test_the_generic_loop_norm_kernel_writes_bf16_bits(rng, fused):
    """The long-row fallback built with ``bf16_out`` (launched directly at a small n, as above): the
    float32 kernel's results, rounded as ``bf16_round`` rounds them; the residual the same."""
    from numba import cuda

    rows, n = 3, 300
    threads = layers.rms_norm_threads_per_row(n)
    x, original = norm_inputs(rng, 2 if fused else 0, rows, n)
    weight = tie_weights(rng, n)
    results = {}
    for bf16_out, out in ((False, poisoned((rows, n))), (True, bf16_poisoned((rows, n)))):
        residual = original.copy() if fused else x
        cuda.jit(layers.rms_norm_loop_function(fused, bf16_out))[rows, threads](x, residual, weight, np.float32(1e-6), out)
        results[bf16_out] = out, residual
    (float_out, float_residual), (bf16_out, bf16_residual) = results[False], results[True]
    check_bf16_out(bf16_out, float_out, layers.bf16_round(float_out, bf16_poisoned((rows, n))))
    np.testing.assert_array_equal(bf16_residual.view(np.uint32), float_residual.view(np.uint32))


def silu_mul_inputs(rng, tokens, intermediate):
    """``gate_up_values`` (row 0: the extremes) with BF16 ties in row 1 (gate 128 makes ``silu(gate)``
    exactly 128, ``exp(-128)`` being 0 in float32, so ``out = 128 up``: a tie for a tie ``up``) and a NaN
    gate in the last row."""
    gate_up = gate_up_values(rng, tokens, intermediate)
    gate_up[1, :intermediate] = 128.0
    gate_up[1, intermediate:] = bf16_ties(rng, intermediate)
    gate_up[-1, intermediate // 2] = np.nan
    return gate_up


@pytest.mark.cudasim
@pytest.mark.parametrize("intermediate", SILU_WIDTHS)
def test_silu_mul_writes_the_bf16_bits_of_its_float32_result(rng, intermediate):
    gate_up = silu_mul_inputs(rng, 3, intermediate)
    float_out, bf16_out = poisoned((3, intermediate)), bf16_poisoned((3, intermediate))
    layers.silu_mul(gate_up, float_out)
    assert layers.silu_mul(gate_up, bf16_out) is bf16_out
    assert np.all(float_out[1].view(np.uint32) & 0xFFFF == 0x8000)  # row 1 holds ties, as built
    # one NaN gate makes one NaN element: the last row is not all NaN here
    np.testing.assert_array_equal(bf16_out, layers.bf16_round(float_out, bf16_poisoned((3, intermediate))))
    finite = np.isfinite(float_out)
    np.testing.assert_array_equal(bf16_out[finite], float_out[finite].astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(is_bf16_nan(bf16_out), np.isnan(float_out))
    assert is_bf16_nan(bf16_out[-1, intermediate // 2])


# ---------------------------------------------------------------------------- embedding


@pytest.mark.cudasim
@pytest.mark.parametrize("as_int16", [False, True], ids=["uint16", "int16 (torch bfloat16 view)"])
def test_embedding_rows_are_exact(rng, as_int16):
    vocab, hidden = 300, 272  # hidden: a full and a partial CTA of columns
    bits = random_bf16_bits(rng, (vocab, hidden))
    ids = np.array([0, 299, 17, 17, 150], np.int32)
    out = poisoned((ids.size, hidden))
    assert layers.embedding(bits.view(np.int16) if as_int16 else bits, ids, out) is out
    expected = dense.embedding(bf16_values(bits), ids)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.cudasim
def test_embedding_id_out_of_range_gives_a_nan_row(rng):
    bits = random_bf16_bits(rng, (300, 40))
    ids = np.array([5, -1, 300, 2**31 - 1, 299], np.int32)
    out = np.full((5, 40), 7.0, np.float32)
    layers.embedding(bits, ids, out)
    assert np.all(np.isnan(out[1:4]))
    np.testing.assert_array_equal(out[[0, 4]], bf16_values(bits)[[5, 299]])


# ---------------------------------------------------------------------------- bf16_linear


def bf16_linear_bound(x, w, k):
    """float64 result and bound: each product passes through at most ``8 ceil(K / 256)`` chain roundings
    and 5 butterfly roundings: ``gamma(8 ceil(K / 256) + 5) sum_k |x| |w|``."""
    return dense.linear_float64(x, w), gamma(8 * -(-k // 256) + 5) * dense.linear_float64(np.abs(x), np.abs(w)) + TINY


LINEAR_CASES = [
    # (M, N, K, rows_per_warp): what each covers
    (1, 8, 264, None),  # M = 1 (2 weight rows per warp); lane 0 has a second chunk (the group's other half)
    (3, 5, 64, None),  # 4 weight rows per warp, the second warp's clamped rows; lanes without chunks
    (8, 3, 64, 1),  # a full row tile of 8
    (11, 2, 64, 2),  # two row tiles, the second partial (rows clamped, not stored)
    (2, 20, 64, 4),  # five warps: a full CTA and a partial one
    (1, 2, 520, 1),  # 65 chunks: lane 0 has three, in two groups, the second half-empty
]


@pytest.mark.cudasim
@pytest.mark.parametrize("m, n, k, rows_per_warp", LINEAR_CASES, ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-R{c[3]}" for c in LINEAR_CASES])
def test_bf16_linear_matches_the_simulator_bit_for_bit(rng, m, n, k, rows_per_warp):
    x = spread_activations(rng, (m, k), spread=1)
    bits = random_bf16_bits(rng, (n, k))
    out = poisoned((m, n))
    assert layers.bf16_linear(x, bits, out, rows_per_warp=rows_per_warp) is out
    w = bf16_values(bits)
    np.testing.assert_array_equal(out.view(np.uint32), sim.bf16_linear(x, bits).view(np.uint32))
    exact, bound = bf16_linear_bound(x, w, k)
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.cudasim
def test_bf16_linear_rows_do_not_depend_on_the_batch(rng):
    """Row m of a 9-row call (two row tiles), of a 3-row call and alone: the same bits."""
    x = spread_activations(rng, (9, 64), spread=1)
    bits = random_bf16_bits(rng, (2, 64)).view(np.int16)  # torch's bfloat16 export
    full, three, one = poisoned((9, 2)), poisoned((3, 2)), poisoned((1, 2))
    layers.bf16_linear(x, bits, full, rows_per_warp=2)
    layers.bf16_linear(x[6:9], bits, three, rows_per_warp=1)
    layers.bf16_linear(x[8:9], bits, one, rows_per_warp=4)
    np.testing.assert_array_equal(full[6:9].view(np.uint32), three.view(np.uint32))
    np.testing.assert_array_equal(full[8:9].view(np.uint32), one.view(np.uint32))


# ---------------------------------------------------------------------------- argmax_rows


def check_argmax(logits, got):
    """The reference's tokens (``np.argmax`` per row, but ``NAN_ROW`` for a row holding NaN); the
    simulator's (its single-CTA order: ``beats`` is a total order, so any partition gives the same
    winner); and ``np.argmax`` itself on the rows without NaN."""
    np.testing.assert_array_equal(got, dense.argmax_rows(logits))
    np.testing.assert_array_equal(got, sim.argmax_rows(logits, layers.ARGMAX_THREADS))
    nan_rows = np.isnan(logits).any(axis=1)
    np.testing.assert_array_equal(got[~nan_rows], np.argmax(logits[~nan_rows], axis=1))
    assert np.all(got[nan_rows] == layers.NAN_ROW)


def poisoned_argmax_workspace(rows, vocab, logits_per_cta=None):
    """A fresh workspace whose partials are garbage (NaN values, out-of-range indices): a partial the
    kernel failed to write makes the row NaN or out of range."""
    workspace = layers.argmax_workspace(rows, vocab, logits_per_cta)
    workspace.values[...] = np.nan
    workspace.indices[...] = 2**31 - 1
    return workspace


ID_POISON = -7
"""out_ids before a launch: neither a token nor NAN_ROW."""


def logit_rows(rng, vocab):
    """Rows that exercise np.argmax's rules: random; a repeated maximum (first wins); NaNs (no token,
    even beside a larger number); all -inf; +-0 maxima; the maximum at the last index."""
    rows = rng.standard_normal((7, vocab)).astype(np.float32)
    spots = np.sort(rng.choice(vocab, 3, replace=False))
    rows[1, spots] = 9.0
    rows[2, spots[2]], rows[2, spots[1]], rows[2, spots[0]] = np.nan, np.nan, 1e30
    rows[3] = -np.inf
    rows[4] = -1.0
    rows[4, spots[2]], rows[4, spots[1]] = 0.0, -0.0  # equal under ==: the lower index
    rows[5, -1] = 1e9
    rows[6, 0] = np.nan
    return rows


ARGMAX_CASES = [(300, None), (700, 160)]
"""(V, logits_per_cta): one CTA of 64 threads; 5 CTAs of a warp per row (the last one of a partial
slice, 60 logits; the merging warp's lanes 5 to 31 without partials)."""


@pytest.mark.cudasim
@pytest.mark.parametrize("vocab, logits_per_cta", ARGMAX_CASES, ids=["one cta", "five ctas"])
def test_argmax_rows_follows_numpy(rng, vocab, logits_per_cta):
    logits = logit_rows(rng, vocab)
    if logits_per_cta:  # ties and NaNs across slices: the maximum repeated in the next slice, a NaN in the last
        logits[0, [logits_per_cta - 1, logits_per_cta + 3]] = 50.0
        logits[5, [logits_per_cta + 1, vocab - 1]] = [np.nan, 1e9]
    out = np.full(logits.shape[0], ID_POISON, np.int32)
    workspace = poisoned_argmax_workspace(logits.shape[0], vocab, logits_per_cta)
    assert layers.argmax_rows(logits, out, workspace=workspace, logits_per_cta=logits_per_cta) is out
    check_argmax(logits, out)
    assert out[2] == out[6] == layers.NAN_ROW
    if logits_per_cta:
        assert out[0] == logits_per_cta - 1 and out[5] == layers.NAN_ROW
    np.testing.assert_array_equal(workspace.counters, 0)  # reset for the next launch


@pytest.mark.cudasim
@settings(max_examples=SIMULATOR_EXAMPLES)
@given(rows=st.integers(1, 3), vocab=st.integers(1, 200), ctas=st.integers(1, 3), levels=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
def test_argmax_rows_on_few_distinct_values(rows, vocab, ctas, levels, seed):
    """Few distinct values (many ties, across slices too), sometimes a NaN; 1 to 3 CTAs per row."""
    rng = np.random.default_rng(seed)
    values = np.array([-np.inf, -2.5, 0.0, -0.0, 3.0, np.nan], np.float32)[: levels + 2]
    logits = rng.choice(values, (rows, vocab)).astype(np.float32)
    out = np.full(rows, ID_POISON, np.int32)
    layers.argmax_rows(logits, out, logits_per_cta=-(-vocab // ctas))
    check_argmax(logits, out)


@pytest.mark.cudasim
def test_argmax_rows_reuses_one_workspace(rng):
    """Calls sharing one workspace (allocated for more rows than each uses): every call right, the
    counters back at 0 after each; rows of length 1."""
    workspace = poisoned_argmax_workspace(3, 90, logits_per_cta=32)  # 3 CTAs per row
    for rows in (3, 1, 3):
        logits = rng.choice(np.float32([-1.0, 0.0, -0.0, 2.0]), (rows, 90)).astype(np.float32)
        out = np.full(rows, ID_POISON, np.int32)
        layers.argmax_rows(logits, out, workspace=workspace, logits_per_cta=32)
        check_argmax(logits, out)
        np.testing.assert_array_equal(workspace.counters, 0)
    single = layers.argmax_workspace(3, 1)
    for column in (np.float32([[5.0], [np.nan], [-np.inf]]), np.float32([[-0.0], [1.0], [np.nan]])):
        out = np.full(3, ID_POISON, np.int32)
        layers.argmax_rows(column, out, workspace=single)
        np.testing.assert_array_equal(out, dense.argmax_rows(column))
        np.testing.assert_array_equal(single.counters, 0)


@pytest.mark.cudasim
def test_argmax_rows_merges_more_partials_than_lanes(rng):
    """40 CTAs (of 3 logits) for one row: lanes 0 to 7 of the merging warp take two partials each; the
    maximum, repeated, in the 37th slice (lane 4's second) and the 40th (lane 7's second)."""
    logits = rng.standard_normal((1, 120)).astype(np.float32)
    logits[0, [108, 110, 118]] = 7.0
    logits[0, 2] = 6.5
    out = np.full(1, ID_POISON, np.int32)
    workspace = poisoned_argmax_workspace(1, 120, logits_per_cta=3)
    layers.argmax_rows(logits, out, workspace=workspace, logits_per_cta=3)
    assert out[0] == 108
    check_argmax(logits, out)
    np.testing.assert_array_equal(workspace.counters, 0)


def test_argmax_launch_at_qwen3_vocab():
    """The default partition: at least 4096 logits per CTA, at most 64 CTAs, 256 threads."""
    assert layers.argmax_launch(151936) == (38, 4096, 256)
    assert layers.argmax_launch(1) == (1, 4096, 32)
    assert layers.argmax_launch(64 * 8192 + 1) == (52, 10240, 256)  # 8193 per CTA, rounded up to 5 * 2048
    assert layers.argmax_launch(2100, 512) == (5, 512, 64)
    for vocab in (1, 300, 4097, 151936, 262144, 10**6, 2**31 - 2):
        ctas, length, threads = layers.argmax_launch(vocab)
        assert 1 <= ctas <= layers.ARGMAX_MAX_CTAS and (ctas - 1) * length < vocab <= ctas * length
        assert threads % 32 == 0 and 32 <= threads <= layers.ARGMAX_THREADS


# ---------------------------------------------------------------------------- add_into


@pytest.mark.cudasim
@pytest.mark.parametrize("shape", [(3, 50), (2, 3, 60)])
def test_add_into_is_the_float32_sum(rng, shape):
    x, y = spread_activations(rng, shape), spread_activations(rng, shape)
    expected = x + y
    assert layers.add_into(x, y) is x
    np.testing.assert_array_equal(x.view(np.uint32), expected.view(np.uint32))


# ---------------------------------------------------------------------------- bad calls and empty calls


def good_calls(rng):
    """Each function with good NumPy arguments: ``name -> (function, kwargs)``."""
    x = spread_activations(rng, (2, 64))
    return {
        "rms_norm": (layers.rms_norm, dict(x=x, weight=np.ones(64, np.float32), eps=1e-6, out=poisoned((2, 64)))),
        "add_rms_norm": (layers.add_rms_norm, dict(x=x, residual=x.copy(), weight=np.ones(64, np.float32), eps=1e-6,
                                                   out=poisoned((2, 64)))),
        "rope": (layers.rope, dict(x=spread_activations(rng, (2, 1, 32)), positions=np.array([0, 1], np.int32),
                                   cos_sin=layers.rope_table(8, 32, 1e4), out=poisoned((2, 1, 32)))),
        "silu_mul": (layers.silu_mul, dict(gate_up=x, out=poisoned((2, 32)))),
        "embedding": (layers.embedding, dict(table=random_bf16_bits(rng, (10, 16)), ids=np.array([1, 2], np.int32),
                                             out=poisoned((2, 16)))),
        "bf16_linear": (layers.bf16_linear, dict(x=x, w_bits=random_bf16_bits(rng, (3, 64)), out=poisoned((2, 3)))),
        "argmax_rows": (layers.argmax_rows, dict(logits=x, out_ids=np.full(2, -1, np.int32))),
        "add_into": (layers.add_into, dict(x=x.copy(), y=x)),
    }


def bf16_out_in_memory_of(a, columns):
    """A uint16 ``[1, columns]`` view of the last bytes of the one-row float32 array ``a``."""
    return a.view(np.uint16)[:, -columns:]


ONE_ROW = np.random.default_rng(7).standard_normal((1, 64)).astype(np.float32)


def host_argmax_workspace(rows, ctas, counters=None):
    """An ``ArgmaxWorkspace`` of NumPy arrays (no device needed where the list below is built)."""
    counters = np.zeros(rows, np.int32) if counters is None else counters
    return layers.ArgmaxWorkspace(np.zeros((rows, ctas), np.float32), np.zeros((rows, ctas), np.int32), counters)


BAD_CALLS = [
    ("rms_norm", dict(weight=np.ones(63, np.float32)), "weight: expected float32 \\[64\\]"),
    ("rms_norm", dict(x=np.ones((2, 64))), "x: expected float32 \\[..., n\\]"),
    ("rms_norm", dict(x=np.ones((2, 0), np.float32)), "x: expected float32 \\[..., n\\] with n >= 1"),
    ("rms_norm", dict(out=poisoned((2, 65))), "out: expected float32 or uint16 \\(BF16 bits\\) of x's shape \\(2, 64\\)"),
    ("rms_norm", dict(x=np.ones((2, 128), np.float32)[:, ::2]), "x: expected a C-contiguous"),
    ("rms_norm", dict(x=[[1.0] * 64] * 2), "x: expected a NumPy array, a Numba device array"),
    ("add_rms_norm", dict(residual=poisoned((1, 64))), "residual: expected float32 of x's shape"),
    ("rms_norm", dict(out=np.zeros((2, 64), np.float16)), "^out: expected float32 or uint16 \\(BF16 bits\\) of x's shape"),
    ("add_rms_norm", dict(out=np.zeros((2, 64), np.int32)), "^out: expected float32 or uint16 \\(BF16 bits\\) of x's shape"),
    ("rms_norm", (lambda x: dict(x=x, out=bf16_out_in_memory_of(x, 64)))(ONE_ROW.copy()),
     "^out: a uint16 \\(BF16 bits\\) out must not share memory with x"),
    ("add_rms_norm", (lambda r: dict(x=ONE_ROW.copy(), residual=r, out=bf16_out_in_memory_of(r, 64)))(ONE_ROW.copy()),
     "^out: a uint16 \\(BF16 bits\\) out must not share memory with x \\(parts\\) or residual"),
    ("rope", dict(x=np.ones((2, 1, 33), np.float32), out=poisoned((2, 1, 33))), "x: expected .* head_dim even"),
    ("rope", dict(x=np.ones((2, 32), np.float32)), "x: expected float32 \\[T, heads, head_dim\\]"),
    ("rope", dict(positions=np.array([0, 1], np.int64)), "positions: expected int32 \\[2\\]"),
    ("rope", dict(positions=np.array([0], np.int32)), "positions: expected int32 \\[2\\]"),
    ("rope", dict(cos_sin=layers.rope_table(8, 64, 1e4)), "cos_sin: expected float32 \\[max_positions, 32\\]"),
    ("silu_mul", dict(gate_up=np.ones((2, 63), np.float32)), "gate_up: expected float32 \\[T, 2 \\* I\\]"),
    ("silu_mul", dict(out=poisoned((2, 64))), "out: expected float32 or uint16 \\(BF16 bits\\) \\[2, 32\\]"),
    ("silu_mul", dict(out=np.zeros((2, 32), np.float16)), "^out: expected float32 or uint16 \\(BF16 bits\\) \\[2, 32\\]"),
    ("silu_mul", (lambda g: dict(gate_up=g, out=bf16_out_in_memory_of(g, 32)))(ONE_ROW.copy()),
     "^out: a uint16 \\(BF16 bits\\) out must not share memory with gate_up"),
    ("embedding", dict(table=np.ones((10, 16), np.float32)), "table: expected BF16 bit patterns"),
    ("embedding", dict(ids=np.array([1, 2], np.int64)), "ids: expected int32 \\[T\\]"),
    ("embedding", dict(out=poisoned((2, 17))), "out: expected float32 \\[2, 16\\]"),
    ("bf16_linear", dict(w_bits=random_bf16_bits(np.random.default_rng(0), (3, 60)), x=np.ones((2, 60), np.float32)),
     "w_bits: bf16_linear needs K to be a positive multiple of 8 \\(128-bit loads\\), got K = 60"),
    ("bf16_linear", dict(x=np.ones((2, 72), np.float32)), "x: expected float32 \\[M, 64\\]"),
    ("bf16_linear", dict(w_bits=np.ones((3, 64), np.float32)), "w_bits: expected BF16 bit patterns"),
    ("bf16_linear", dict(out=poisoned((3, 2))), "out: expected float32 \\[2, 3\\]"),
    ("bf16_linear", dict(rows_per_warp=3), "rows_per_warp: expected one of \\(1, 2, 4\\)"),
    ("argmax_rows", dict(out_ids=np.zeros(2, np.int64)), "out_ids: expected int32 \\[2\\]"),
    ("argmax_rows", dict(logits=np.ones((2, 0), np.float32)), "logits: expected float32 \\[rows, V\\]"),
    ("argmax_rows", dict(logits=np.ones((2, 8), np.float64)), "logits: expected float32"),
    ("argmax_rows", dict(logits_per_cta=0), "logits_per_cta: expected at least 1 and at most 64 CTAs per row"),
    ("argmax_rows", dict(logits=np.ones((2, 65), np.float32), logits_per_cta=1), "logits_per_cta: expected"),
    ("argmax_rows", dict(workspace=host_argmax_workspace(1, 1)), "workspace: expected partials of at least \\[2, 1\\]"),
    ("argmax_rows", dict(workspace=host_argmax_workspace(2, 2), logits_per_cta=16),
     "workspace: expected partials of at least \\[2, 4\\]"),
    ("argmax_rows", dict(workspace=host_argmax_workspace(2, 1, counters=np.zeros(2, np.int64))), "workspace: expected int32 counters"),
    ("argmax_rows", dict(workspace=host_argmax_workspace(2, 1)[:2]), "workspace: expected an ArgmaxWorkspace"),
    ("add_into", dict(y=np.ones((2, 63), np.float32)), "y: expected float32 of x's shape \\(2, 64\\)"),
]


@pytest.mark.cudasim
@pytest.mark.parametrize("function, change, message", BAD_CALLS, ids=[f"{c[0]}-{c[2][:40]}" for c in BAD_CALLS])
def test_bad_calls_raise_before_launching(rng, function, change, message):
    fn, kwargs = good_calls(rng)[function]
    kwargs.update(change)
    snapshot = {name: np.copy(a) for name, a in kwargs.items() if isinstance(a, np.ndarray)}
    with pytest.raises(ValueError, match=message):
        fn(**kwargs)
    for name, before in snapshot.items():  # nothing was written: nothing was launched
        assert kwargs[name].tobytes() == before.tobytes(), name


@pytest.mark.cudasim
def test_good_calls_run_and_zero_rows_launch_nothing(rng):
    calls = good_calls(rng)
    for fn, kwargs in calls.values():
        fn(**kwargs)  # the good calls are good
    empty = np.zeros((0, 64), np.float32)
    layers.rms_norm(empty, np.ones(64, np.float32), 1e-6, empty)
    layers.add_rms_norm(empty, empty.copy(), np.ones(64, np.float32), 1e-6, empty)
    layers.rope(np.zeros((0, 2, 32), np.float32), np.zeros(0, np.int32), layers.rope_table(4, 32, 1e4),
                np.zeros((0, 2, 32), np.float32))
    layers.silu_mul(empty, np.zeros((0, 32), np.float32))
    layers.embedding(random_bf16_bits(rng, (4, 8)), np.zeros(0, np.int32), np.zeros((0, 8), np.float32))
    layers.bf16_linear(empty, random_bf16_bits(rng, (3, 64)), np.zeros((0, 3), np.float32))
    layers.argmax_rows(empty, np.zeros(0, np.int32))
    layers.add_into(empty, empty)


# ---------------------------------------------------------------------------- sm_90 PTX of every kernel

PTX_VARIANT_SETS = {"layers": r'''
from fp8lab.numba_kernels import layers
from helpers.ptx import Variant

def variants():
    return [Variant(name, function, signature) for name, function, signature in layers.kernel_variants()]
'''}
"""Compiled once per session with the simulator off, in the background from the end of collection
(``helpers.ptx``, ``conftest.py``)."""


def check_layer_kernel_ptx(c) -> None:
    """What every layer kernel's sm_90 PTX must show: registers only, float32 only, and the instructions of
    its algorithm (``simulators.dense`` states the orders), ptxas reporting no spills."""
    ptx, name = c.ptx, c.name
    assert ".target sm_90" in ptx
    assert ".local" not in ptx  # every per-thread array lives in registers
    assert ".f64" not in ptx  # float32 throughout
    if "rms_norm" in name:
        for needle in ("shfl.sync.bfly.b32", "fma.rn.f32", "sqrt.rn.f32", "div.rn.f32"):
            assert needle in ptx, needle
        assert ("bar.sync" in ptx or "barrier.sync" in ptx) == ("cta" in name)
    if name == "rope":
        assert ptx.count("fma.rn.f32") >= 2
    if name.startswith("silu_mul"):
        assert "div.rn.f32" in ptx and "ex2.approx" in ptx
    if name.startswith("silu_mul[quads"):  # two 128-bit loads; BF16 pairs (or float32 bits) as 32-bit stores
        assert len(re.findall(r"ld\.global\.nc\.v4\.[uf]32", ptx)) == 2
        stores = len(re.findall(r"st\.global\.[uf]32", ptx))
        assert stores == (2 if "bf16 out" in name else 4) and "st.global.u16" not in ptx, stores
    elif "rms_norm" in name or name.startswith("silu_mul"):  # out's stores: BF16 bits for a bf16_out kernel only
        assert ("st.global.u16" in ptx) == ("bf16 out" in name)
    if name.startswith("bf16_linear"):
        m_tile, rows = (int(v) for v in re.findall(r"=(\d+)", name))
        group = layers.LINEAR_CHUNKS_PER_ITERATION
        wide_loads = len(re.findall(r"ld\.global\.nc\.v4\.[uf]32", ptx))
        assert wide_loads == group * rows + group * m_tile * 2, wide_loads  # weights; x (two per row)
        assert ptx.count("fma.rn.f32") == group * rows * m_tile * 8
        assert ptx.count("shfl.sync.bfly.b32") == 5 * rows * m_tile
    if name == "argmax_rows":
        assert ptx.count("shfl.sync.bfly.b32") == 20  # value and index, 5 steps: a CTA's warps, the merging warp
        assert "atom.global.add.u32" in ptx or "atom.global.add.s32" in ptx  # the row's finished-CTA count
        assert ptx.count("membar.gl") + ptx.count("fence.sc.gpu") + ptx.count("fence.acq_rel.gpu") >= 2
    check_pdl_rules(ptx, weights_before_wait="cta per row" in name)  # a CTA-per-row norm loads its weight first
    if c.resources is not None:
        assert "0 bytes spill stores" in c.resources, c.resources


def test_every_layer_kernel_compiles_to_sm90_ptx(request):
    (compiled,) = compile_sets(PTX_VARIANT_SETS, progress=progress_printer(request.config)).values()
    assert len(compiled) == len(layers.kernel_variants())
    each_variant(compiled, check_layer_kernel_ptx)


# ---------------------------------------------------------------------------- on a GPU, at Qwen3-8B sizes

HIDDEN, HEAD_DIM, HEADS, INTERMEDIATE, VOCAB = 4096, 128, 32, 12288, 151936


@pytest.fixture(scope="module")
def lm_head():
    """A ``[151936, 4096]`` BF16 matrix (1.2 GB) on the device and on the host, built in slices."""
    from numba import cuda

    seed, rng = fresh_rng()
    bits = np.empty((VOCAB, HIDDEN), np.uint16)
    for start in range(0, VOCAB, 16384):
        bits[start : start + 16384] = random_bf16_bits(rng, bits[start : start + 16384].shape)
    return seed, bits, cuda.to_device(bits)


def bf16_rows_float64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, n", [(4, HIDDEN), (1, HIDDEN), (4 * HEADS, HEAD_DIM), (3, 1024), (5, 40), (2, 5120),
                                     (2, 8192), (2, 8200)])  # 8200: the generic loop kernel
def test_gpu_rms_norm_bit_for_bit(rows, n):
    from numba import cuda

    seed, rng = fresh_rng()
    x = spread_activations(rng, (rows, n))
    residual = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    out = cuda.to_device(poisoned(x.shape))
    layers.rms_norm(cuda.to_device(x), cuda.to_device(weight), 1e-6, out)
    try:
        check_rms_norm(x, weight, 1e-6, out.copy_to_host())
        residual_device = cuda.to_device(residual)
        out = cuda.to_device(poisoned(x.shape))
        layers.add_rms_norm(cuda.to_device(x), residual_device, cuda.to_device(weight), 1e-6, out)
        total = residual + x
        np.testing.assert_array_equal(residual_device.copy_to_host(), total)
        check_rms_norm(total, weight, 1e-6, out.copy_to_host())
    except AssertionError as error:
        raise AssertionError(f"seed {seed}") from error


@pytest.mark.gpu
@pytest.mark.parametrize("parts, rows, n", [(4, 1, 1024), (4, 4, 1024), (2, 1, HIDDEN), (2, 3, HIDDEN), (3, 2, 8200),
                                            (1, 1000, HIDDEN), (3, 700, 8200)])
def test_gpu_add_parts_rms_norm_bit_for_bit(parts, rows, n):
    """The split-K parts of Qwen3-0.6B (4, hidden 1024) and Qwen3-8B (2, hidden 4096), a 1,000-token prefill's one
    part (more rows than CTAs: each CTA walks several), and the generic loop kernel: the residual bit for bit
    ``residual + sum_parts(parts)``, the norm the simulator's."""
    from numba import cuda

    seed, rng = fresh_rng()
    x = spread_activations(rng, (parts, rows, n))
    residual = spread_activations(rng, (rows, n))
    weight = spread_activations(rng, (n,), spread=1)
    residual_device, out = cuda.to_device(residual), cuda.to_device(poisoned((rows, n)))
    layers.add_parts_rms_norm(cuda.to_device(x), residual_device, cuda.to_device(weight), 1e-6, out)
    expected, total = sim.add_parts_rms_norm(x, residual, weight, 1e-6, layers.rms_norm_threads_per_row(n))
    try:
        np.testing.assert_array_equal(residual_device.copy_to_host().view(np.uint32), total.view(np.uint32))
        check_rms_norm(total, weight, 1e-6, out.copy_to_host())
        np.testing.assert_array_equal(out.copy_to_host().view(np.uint32), expected.view(np.uint32))
    except AssertionError as error:
        raise AssertionError(f"seed {seed}") from error


@pytest.mark.gpu
def test_gpu_rope_bit_for_bit():
    from numba import cuda

    seed, rng = fresh_rng()
    theta, max_positions = 1e6, 40960
    table = layers.rope_table(max_positions, HEAD_DIM, theta)
    positions = rng.integers(0, max_positions, 64).astype(np.int32)
    x = spread_activations(rng, (64, HEADS, HEAD_DIM))
    x_device = cuda.to_device(x)
    layers.rope(x_device, cuda.to_device(positions), cuda.to_device(table), x_device)  # in place
    try:
        check_rope(x, positions, table, theta, x_device.copy_to_host())
    except AssertionError as error:
        raise AssertionError(f"seed {seed}") from error


@pytest.mark.gpu
@pytest.mark.parametrize("intermediate", [INTERMEDIATE, 70])  # four elements a thread; one
def test_gpu_silu_mul_within_its_bound(intermediate):
    from numba import cuda

    seed, rng = fresh_rng()
    gate_up = gate_up_values(rng, 4, intermediate)
    out = cuda.to_device(poisoned((4, intermediate)))
    layers.silu_mul(cuda.to_device(gate_up), out)
    exact, bound = silu_mul_bound(gate_up)
    assert np.all(np.abs(out.copy_to_host() - exact) <= bound), f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [HIDDEN, 8200], ids=["hidden 4096", "loop kernel"])
def test_gpu_norms_bf16_out_is_bf16_round_of_the_float32_out(n):
    """Qwen3-8B's hidden size, 4 rows (and the generic loop kernel): each norm's uint16 ``out`` bit for bit
    ``bf16_round`` of its float32 ``out``, everything on the GPU; the residual as the float32 call leaves it."""
    from numba import cuda

    seed, rng = fresh_rng()
    rows = 4
    for function, parts in (("rms_norm", 0), ("add_rms_norm", 1), ("add_parts_rms_norm", 2)):
        x, original = norm_inputs(rng, parts, rows, n)
        x_device, weight = cuda.to_device(x), cuda.to_device(tie_weights(rng, n))
        float_out, float_residual = cuda.to_device(poisoned((rows, n))), cuda.to_device(original)
        call_norm(function, x_device, float_residual, weight, float_out)
        bf16_out, bf16_residual = cuda.to_device(bf16_poisoned((rows, n))), cuda.to_device(original)
        call_norm(function, x_device, bf16_residual, weight, bf16_out)
        rounded = cuda.to_device(bf16_poisoned((rows, n)))
        layers.bf16_round(float_out, rounded)
        try:
            check_bf16_out(bf16_out.copy_to_host(), float_out.copy_to_host(), rounded.copy_to_host())
            np.testing.assert_array_equal(bf16_residual.copy_to_host().view(np.uint32),
                                          float_residual.copy_to_host().view(np.uint32))
        except AssertionError as error:
            raise AssertionError(f"{function}, seed {seed}") from error


@pytest.mark.gpu
def test_gpu_silu_mul_bf16_out_is_bf16_round_of_the_float32_out():
    from numba import cuda

    seed, rng = fresh_rng()
    gate_up = cuda.to_device(silu_mul_inputs(rng, 4, INTERMEDIATE))
    float_out, bf16_out = cuda.to_device(poisoned((4, INTERMEDIATE))), cuda.to_device(bf16_poisoned((4, INTERMEDIATE)))
    layers.silu_mul(gate_up, float_out)
    layers.silu_mul(gate_up, bf16_out)
    rounded = cuda.to_device(bf16_poisoned((4, INTERMEDIATE)))
    layers.bf16_round(float_out, rounded)
    got = bf16_out.copy_to_host()
    np.testing.assert_array_equal(got, rounded.copy_to_host(), err_msg=f"seed {seed}")
    np.testing.assert_array_equal(is_bf16_nan(got), np.isnan(float_out.copy_to_host()), err_msg=f"seed {seed}")


@pytest.mark.gpu
def test_gpu_embedding_of_the_real_table(lm_head):
    from numba import cuda

    seed, bits, bits_device = lm_head
    ids = np.array([0, VOCAB - 1, 12345, 12345, VOCAB, -7, 99999], np.int32)
    out = cuda.to_device(poisoned((ids.size, HIDDEN)))
    layers.embedding(bits_device, cuda.to_device(ids), out)
    got = out.copy_to_host()
    good = [0, 1, 2, 3, 6]
    np.testing.assert_array_equal(got[good], bf16_values(bits[ids[good]]), err_msg=f"seed {seed}")
    assert np.all(np.isnan(got[4:6]))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 8, 13])
def test_gpu_bf16_linear_lm_head(lm_head, m):
    """The lm_head at Qwen3-8B size: within the float64 bound everywhere, and bit for bit against the
    simulator on 256 random columns (it emulates every fma: a slice is what fits in seconds)."""
    from numba import cuda

    seed, bits, bits_device = lm_head
    rng = np.random.default_rng(seed + m)
    x = spread_activations(rng, (m, HIDDEN), spread=1)
    out = cuda.to_device(poisoned((m, VOCAB)))
    layers.bf16_linear(cuda.to_device(x), bits_device, out)
    got = out.copy_to_host()
    gamma_k = gamma(8 * -(-HIDDEN // 256) + 5)
    x64 = x.astype(np.float64)
    for start in range(0, VOCAB, 16384):
        w64 = bf16_rows_float64(bits[start : start + 16384])
        exact, scale = dense.linear_float64(x64, w64), dense.linear_float64(np.abs(x64), np.abs(w64))
        assert np.all(np.abs(got[:, start : start + 16384] - exact) <= gamma_k * scale + TINY), f"seed {seed}"
    columns = np.sort(rng.choice(VOCAB, 256, replace=False))
    model = sim.bf16_linear(x, bits[columns])
    np.testing.assert_array_equal(got[:, columns].view(np.uint32), model.view(np.uint32), err_msg=f"seed {seed}")


@pytest.mark.gpu
def test_gpu_argmax_rows_at_vocab_size():
    """Vocab 151936 (38 CTAs per row): the reference's tokens for three calls sharing one workspace
    (fresh logits each; the counters back at 0 after each), and for a call that allocates its own."""
    from numba import cuda

    seed, rng = fresh_rng()
    workspace = layers.argmax_workspace(8, VOCAB)
    for _ in range(3):
        logits = logit_rows(rng, VOCAB)
        logits[0, [4095, 4096 + 17]] = 50.0  # the maximum repeated in the next CTA's slice: the first wins
        out = cuda.to_device(np.full(logits.shape[0], ID_POISON, np.int32))
        layers.argmax_rows(cuda.to_device(logits), out, workspace=workspace)
        got = out.copy_to_host()
        np.testing.assert_array_equal(got, dense.argmax_rows(logits), err_msg=f"seed {seed}")
        assert got[0] == 4095, f"seed {seed}"
        np.testing.assert_array_equal(workspace.counters.copy_to_host(), 0, err_msg=f"seed {seed}")
    out = cuda.to_device(np.full(logits.shape[0], ID_POISON, np.int32))
    layers.argmax_rows(cuda.to_device(logits), out)
    np.testing.assert_array_equal(out.copy_to_host(), dense.argmax_rows(logits), err_msg=f"seed {seed}")


@pytest.mark.gpu
def test_gpu_numpy_arguments_are_copied_back():
    """NumPy in, NumPy out on a GPU: copied to the device and back by the call."""
    _, rng = fresh_rng()
    x = spread_activations(rng, (2, 300))
    weight = spread_activations(rng, (300,), spread=1)
    out = poisoned(x.shape)
    layers.rms_norm(x, weight, 1e-6, out)
    check_rms_norm(x, weight, 1e-6, out)


@pytest.mark.gpu
def test_gpu_a_layer_step_captured_in_a_cuda_graph(lm_head):
    """embedding -> rms_norm -> rope (q-norm'd) -> silu_mul -> add_rms_norm -> bf16_linear -> argmax, once
    launched directly and once captured into a CUDA graph (cuda.core) and replayed: the same bits.
    Capture fails if a call allocates, copies or synchronizes."""
    from cuda.core import Device
    from numba import cuda

    seed, _, bits_device = lm_head
    rng = np.random.default_rng(seed + 1)
    tokens = 4
    inputs = dict(ids=cuda.to_device(rng.integers(0, VOCAB, tokens).astype(np.int32)),
                  positions=cuda.to_device(rng.integers(0, 4096, tokens).astype(np.int32)),
                  table=cuda.to_device(layers.rope_table(4096, HEAD_DIM, 1e6)),
                  weight=cuda.to_device(spread_activations(rng, (HIDDEN,), spread=1)),
                  head_weight=cuda.to_device(spread_activations(rng, (HEAD_DIM,), spread=1)),
                  gate_up=cuda.to_device(spread_activations(rng, (tokens, 2 * INTERMEDIATE), spread=1)))
    argmax_workspace = layers.argmax_workspace(tokens, VOCAB)  # preallocated: a captured call allocates nothing

    def buffers():
        return dict(h=cuda.device_array((tokens, HIDDEN), np.float32), normed=cuda.device_array((tokens, HIDDEN), np.float32),
                    q=cuda.device_array((tokens, HEADS, HEAD_DIM), np.float32),
                    act=cuda.device_array((tokens, INTERMEDIATE), np.float32),
                    logits=cuda.device_array((tokens, VOCAB), np.float32), ids_out=cuda.device_array(tokens, np.int32))

    def step(b, stream):
        layers.embedding(bits_device, inputs["ids"], b["h"], stream=stream)
        layers.rms_norm(b["h"], inputs["weight"], 1e-6, b["normed"], stream=stream)
        q_rows = b["q"].reshape(tokens * HEADS, HEAD_DIM)
        layers.rms_norm(b["normed"].reshape(tokens * HEADS, HEAD_DIM), inputs["head_weight"], 1e-6, q_rows, stream=stream)
        layers.rope(b["q"], inputs["positions"], inputs["table"], b["q"], stream=stream)
        layers.silu_mul(inputs["gate_up"], b["act"], stream=stream)
        layers.add_rms_norm(b["q"].reshape(tokens, HIDDEN), b["h"], inputs["weight"], 1e-6, b["normed"], stream=stream)
        layers.bf16_linear(b["normed"], bits_device, b["logits"], stream=stream)
        layers.argmax_rows(b["logits"], b["ids_out"], stream=stream, workspace=argmax_workspace)

    direct = buffers()
    step(direct, 0)
    cuda.synchronize()

    captured = buffers()
    device = Device()
    device.set_current()
    builder = device.create_graph_builder()
    builder.begin_building()
    step(captured, builder)
    graph = builder.end_building().complete()
    stream = device.create_stream()
    for _ in range(2):  # a replay finds argmax_rows' counters at 0 again
        graph.launch(stream)
    stream.sync()
    np.testing.assert_array_equal(argmax_workspace.counters.copy_to_host(), 0)
    for name in direct:
        np.testing.assert_array_equal(captured[name].copy_to_host().view(np.uint8), direct[name].copy_to_host().view(np.uint8),
                                      err_msg=f"{name}, seed {seed}")


@pytest.mark.cudasim
def test_bf16_round_is_ml_dtypes_round_to_nearest_even(rng):
    import ml_dtypes

    x = (rng.standard_normal((3, 37)) * 10.0 ** rng.integers(-30, 30, (3, 37))).astype(np.float32)
    x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    out = np.full(x.shape, 0xDEAD, np.uint16)
    layers.bf16_round(x, out)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = np.isfinite(x)
    np.testing.assert_array_equal(out[finite], want[finite])
    np.testing.assert_array_equal(out[~np.isnan(x)], dense.float32_to_bf16_bits(x)[~np.isnan(x)])
    assert np.all(np.isnan(out.view(ml_dtypes.bfloat16).astype(np.float32)[np.isnan(x)]))
    assert list(out[0, 1:4]) == [0x7F80, 0xFF80, 0x8000]
