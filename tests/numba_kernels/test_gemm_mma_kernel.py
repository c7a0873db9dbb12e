"""fp8lab.numba_kernels.gemm_mma, the tensor-core FP8 GEMM kernel.

- In the CUDA simulator (``cudasim``): bit for bit ``fp8lab.simulators.gemm_mma.gemm_mma`` (the kernel's
  float32 operations in the model's order) for every tiling (warps per CTA, n8 tiles per warp,
  pipeline stages, m16 tiles per warp), every output written (outputs poisoned with NaN),
  ``fp8lab.reference.blockwise.gemm`` within the simulator's stated bound, bad calls raise ``ValueError``
  before anything is launched. Shapes stay tiny: the simulator runs each thread of a CTA as a
  Python thread, and ``cp.async`` copies land as late as the hardware may land them.
- On a GPU (``gpu``): real sizes against ``fp8lab.reference.blockwise.gemm`` by relative error, with the
  bound built from the GPU error budget in ``fp8lab.simulators.gemm_mma``'s docstring, on fresh random
  inputs each run; integer-valued inputs with power-of-two scales bit for bit the simulator; both
  over several tilings, including stage counts past the 48 KiB shared-memory default, and the large-M tilings
  (``warps_m``, 4 m16 / 4 n8 tiles per warp) at M = 300.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import cp_async
from fp8lab.numba_kernels import gemm_mma as kernel
from fp8lab.reference import blockwise, e4m3
from fp8lab.reference import strategies as fst
from fp8lab.simulators import bit_placement as bp
from fp8lab.simulators import gemm_mma as model

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
    """``fp8lab.simulators.gemm_mma``'s stated float32 bound per output, against the oracle on the
    activations the kernel multiplies (already 16-bit)."""
    chunks = q.shape[1] // model.K_CHUNK
    w = np.abs(blockwise.dequantize(q, scale_inv, block).astype(np.float64))
    relative = (chunks + 9) * U32 * (np.abs(a64) @ w.T)
    underflow = 15 * chunks * 2.0 ** (bp.EXPONENT_OFFSET[fmt] - 150) * float(np.max(scale_inv)) + chunks * 2.0**-150
    return relative + underflow


def gpu_budget(a64, q, scale_inv, block, fmt):
    """The GPU error budget of ``fp8lab.simulators.gemm_mma`` per output: a real HMMA rounds up to about
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
    assert kernel.K_CHUNK == model.K_CHUNK and kernel.K_STEPS_PER_CHUNK == model.K_STEPS_PER_CHUNK
    assert kernel.M_BLOCKS_CHOICES == model.M_BLOCKS_CHOICES
    assert kernel.BLOCK_N_MULTIPLE == model.BLOCK_N_MULTIPLE
    assert kernel.PLACEMENT_EXPONENT == bp.EXPONENT_OFFSET
    assert {f: 8 - s for f, s in kernel.PLACEMENT_SHIFT.items()} == bp.MAGNITUDE_SHIFT
    assert (kernel.SIGN_MASK_X2, kernel.MAGNITUDE_MASK_X2) == (bp.SIGN_MASK_X2, bp.MAGNITUDE_MASK_X2)


@pytest.mark.parametrize(
    "m, n, k, m_blocks", [(1, 8, 128, 1), (33, 100, 384, 2), (17, 24576, 4096, 1), (64, 6144, 4096, 2)]
)
def test_four_warps_of_one_n8_tile_is_the_simulators_grid(m, n, k, m_blocks):
    launch = kernel.launch_info(m, n, k, m_blocks, warps_n=model.WARPS_PER_CTA, n8_tiles_per_warp=1)
    assert launch.grid == model.Schedule(m=m, n=n, k=k, m_blocks=m_blocks).grid
    assert launch.block == (128,)


TILINGS = [kernel.Tiling(*t) for t in itertools.product(kernel.M_BLOCKS_CHOICES, kernel.WARPS_N_CHOICES,
                                                       kernel.N8_TILES_PER_WARP_CHOICES, kernel.STAGES_CHOICES,
                                                       kernel.WARPS_M_CHOICES)]


def test_launch_info_for_every_tiling():
    m, n, k = 37, 1000, 1024
    accepted = 0
    for t in TILINGS:
        m_tile, cta_n, threads = 16 * t.m_blocks * t.warps_m, 8 * t.warps_n * t.n8_tiles_per_warp, 32 * t.warps_m * t.warps_n
        # per stage: M_TILE rows of 272 bytes, CTA_N weight rows of 144, a float32 scale per n8 tile
        stage = m_tile * 272 + cta_n * 144 + 16 * -(-(cta_n // 8) * 4 // 16)
        # the 16-byte copies must divide evenly among the threads, and the stages fit a CTA
        even = (m_tile * 16) % threads == 0 and (cta_n * 8) % threads == 0
        knobs = dict(warps_n=t.warps_n, n8_tiles_per_warp=t.n8_tiles_per_warp, stages=t.stages, warps_m=t.warps_m)
        if not even or t.stages * stage > kernel.MAX_SHARED_PER_CTA:
            with pytest.raises(ValueError, match="warps_m, warps_n" if not even else "stages"):
                kernel.launch_info(m, n, k, t.m_blocks, **knobs)
            continue
        accepted += 1
        launch = kernel.launch_info(m, n, k, t.m_blocks, **knobs)
        assert launch.tiling == t
        assert launch.grid == (-(-n // cta_n), -(-m // m_tile))
        assert launch.block == (threads,)
        assert launch.shared_bytes == t.stages * stage
        assert stage % 16 == 0  # every stage, row and copy 16-byte aligned
    assert accepted > len(TILINGS) // 2
    placed = kernel.launch_info(m, n, k, 4, warps_n=4, n8_tiles_per_warp=4, stages=3, warps_m=2, place_once=True)
    assert placed.shared_bytes == 3 * placed.tiling.stage_bytes + 128 * 272  # + the placed rows: 128 of 272 bytes
    assert kernel.A_ROW_BYTES % 16 == 0 and kernel.B_ROW_BYTES % 16 == 0


@pytest.mark.parametrize(
    "m, n, k, expected",
    [
        # (m_blocks, warps_n, n8_tiles_per_warp, stages): the widest CTA that still gives
        # ~every SM a CTA; enough stages for ~32 KiB of weights in flight per SM
        (16, 4096, 4096, (1, 4, 1, 8)),  # 128 CTAs: one per SM, 8 stages (72 KiB)
        (16, 4096, 12288, (1, 4, 1, 8)),
        (1, 6144, 4096, (1, 4, 1, 5)),  # 192 CTAs: two per SM
        (16, 24576, 4096, (1, 4, 2, 3)),  # 384 CTAs of 64 columns: three per SM
        (32, 4096, 4096, (2, 4, 1, 8)),
        (32, 24576, 4096, (2, 4, 2, 3)),
        (8, 1024, 4096, (1, 1, 1, 8)),  # small N: one-warp CTAs
        (4096, 4096, 4096, (2, 4, 2, 2)),  # many waves: no deep pipeline needed
        (1, 8, 256, (1, 1, 1, 3)),  # never more stages than chunks + 1
    ],
)
def test_default_tilings(m, n, k, expected):
    tiling = kernel.choose_tiling(m, n, k)
    assert tiling == kernel.Tiling(*expected)
    ctas = kernel.launch_info(m, n, k).grid
    per_sm = min(-(-ctas[0] * ctas[1] // kernel.SM_COUNT), kernel.MAX_CTAS_PER_SM_COUNTED)
    assert per_sm * (tiling.shared_bytes + 1024) <= kernel.SHARED_PER_SM


def test_given_knobs_are_kept_and_the_rest_defaulted():
    assert kernel.choose_tiling(16, 4096, 4096, warps_n=2) == kernel.Tiling(1, 2, 2, 8)
    assert kernel.choose_tiling(16, 4096, 4096, n8_tiles_per_warp=2).n8_tiles_per_warp == 2
    assert kernel.choose_tiling(16, 4096, 4096, stages=3) == kernel.Tiling(1, 4, 1, 3)
    assert kernel.choose_tiling(16, 4096, 4096, m_blocks=2) == kernel.Tiling(2, 4, 1, 8)


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
    for knob, value in [("m_blocks", 3), ("warps_n", 3), ("warps_n", 16), ("n8_tiles_per_warp", 8),
                        ("stages", 1), ("stages", 9), ("warps_m", 3)]:
        with pytest.raises(ValueError, match=knob):
            kernel.launch_info(4, 8, 128, **{knob: value})
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


TILING_CASES = [
    # (warps_n, n8_tiles_per_warp, stages, m_blocks[, warps_m[, place_once]]), m, n, activation, output, block:
    # every (warps_n, stages) pair and every (warps_n, n8_tiles_per_warp) pair of the small-M
    # knobs (n8 tiles 1 and 2), both their m_blocks; then each large-M value once: 4 n8 tiles
    # per warp, 4 m16 tiles per warp, warps stacked in M (2 and 4; M tails inside the lower
    # warps), 8 warps side by side in N, the codes placed once per CTA. K = 128 (stages + 1), so the ring wraps around and the last iterations commit
    # empty groups; M tails (rows zero-filled), N tails (a partial n8 tile; tiles wholly past N,
    # whose scale copy is a zero fill, in a second CTA); scale blocks of one and two chunks.
    # Sizes kept small: the simulator runs ~0.4 s per n8 tile, chunk and m16 tile.
    ((1, 1, 2, 2), 19, 13, "bf16", "f32", (8, 128)),
    ((1, 2, 3, 1), 5, 21, "f16", "bf16", (8, 256)),
    ((1, 1, 4, 1), 3, 5, "bf16", "f16", (16, 128)),
    ((2, 1, 2, 1), 5, 13, "f16", "f32", (8, 128)),
    ((2, 2, 3, 1), 5, 29, "bf16", "f32", (8, 256)),
    ((2, 1, 4, 2), 19, 13, "bf16", "bf16-int16", (8, 128)),
    ((4, 2, 2, 1), 2, 61, "f16", "f32", (16, 256)),
    ((4, 1, 3, 1), 5, 29, "bf16", "f16", (8, 128)),
    ((4, 1, 4, 1), 1, 29, "f16", "f32", (8, 256)),
    ((1, 4, 2, 1), 5, 29, "bf16", "f32", (16, 128)),
    ((1, 1, 2, 4), 50, 7, "f16", "bf16", (8, 128)),
    ((2, 1, 2, 1, 2), 20, 13, "bf16", "f32", (8, 128)),
    ((1, 2, 2, 1, 4), 60, 13, "bf16", "f16", (8, 256)),
    ((8, 1, 2, 1), 3, 70, "f16", "f32", (8, 128)),
    ((2, 2, 2, 1, 2, True), 20, 29, "bf16", "f32", (8, 128)),  # codes placed once per CTA, BF16 and F16 patterns
    ((1, 1, 3, 2, 1, True), 17, 5, "f16", "bf16", (8, 256)),
]


def full_knobs(knobs) -> tuple:
    """A case's knobs with the defaults of those it leaves out: ``warps_m`` 1, ``place_once`` False."""
    return tuple(knobs) + (1, False)[len(knobs) - 4:]


@pytest.mark.cudasim
@pytest.mark.parametrize("knobs, m, n, fmt, output, block", TILING_CASES)
def test_bit_for_bit_the_simulator_for_every_tiling(knobs, m, n, fmt, output, block, rng):
    warps, n8_tiles, stages, m_blocks, warps_m, place_once = full_knobs(knobs)
    k = 128 * (stages + 1)
    a = activations(rng.standard_normal((m, k)).astype(np.float32), fmt, int16=output == "bf16-int16")
    q, scale_inv = random_weights(rng, n, k, block)
    out = poisoned_output(m, n, output)
    kernel.gemm_mma(a, q, scale_inv, out, block, m_blocks=m_blocks, warps_n=warps, n8_tiles_per_warp=n8_tiles,
                    stages=stages, warps_m=warps_m, place_once=place_once)
    modelled = model.gemm_mma(a.view(np.uint16), q, scale_inv, block, m_blocks=m_blocks, activation=fmt)
    assert np.all(np.isfinite(output_values(out, output))), "an output was not written (still NaN)"
    assert np.array_equal(out.view(np.uint8), expected_bits(modelled, base_format(output)).view(np.uint8))


def test_tiling_cases_cover_every_pair():
    knobs = [full_knobs(case[0]) for case in TILING_CASES]
    small_m = [k for k in knobs if k[0] <= 4 and k[1] <= 2 and k[3] <= 2 and k[4] == 1 and not k[5]]
    assert {(w, s) for w, _, s, _, _, _ in small_m} == set(itertools.product((1, 2, 4), (2, 3, 4)))
    assert {(w, t) for w, t, _, _, _, _ in small_m} == set(itertools.product((1, 2, 4), (1, 2)))
    assert {k[0] for k in knobs} == set(kernel.WARPS_N_CHOICES)
    assert {k[1] for k in knobs} == set(kernel.N8_TILES_PER_WARP_CHOICES)
    assert {k[3] for k in knobs} == set(kernel.M_BLOCKS_CHOICES)
    assert {k[4] for k in knobs} == set(kernel.WARPS_M_CHOICES)
    assert {(k[5], fmt) for k, fmt in zip(knobs, [case[3] for case in TILING_CASES]) if k[5]} == {(True, "bf16"),
                                                                                                  (True, "f16")}


@pytest.mark.cudasim
@settings(max_examples=4)  # each example simulates 1 to 10 CTAs of 32 to 128 Python threads
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 40),
    chunks=st.integers(1, 3),
    fmt=st.sampled_from(bp.FORMATS),
    m_blocks=st.sampled_from([None, 1, 2]),
    warps=st.sampled_from([None, *kernel.WARPS_N_CHOICES]),
    n8_tiles=st.sampled_from([None, *kernel.N8_TILES_PER_WARP_CHOICES]),
    stages=st.sampled_from([None, 2, 3, 4]),
    output=st.sampled_from(sorted(OUTPUT_DTYPES)),
    block=st.tuples(st.sampled_from([8, 24, 128]), st.sampled_from([128, 256])),
    seed=st.integers(0, 2**32 - 1),
)
def test_bit_for_bit_the_simulator_property(m, n, chunks, fmt, m_blocks, warps, n8_tiles, stages, output, block,
                                            seed):
    rng = np.random.default_rng(seed)
    k = 128 * chunks
    a = activations(rng.standard_normal((m, k)).astype(np.float32), fmt, int16=seed % 2 == 1)
    q, scale_inv = random_weights(rng, n, k, block)
    out = poisoned_output(m, n, output)
    kernel.gemm_mma(a, q, scale_inv, out, block, m_blocks=m_blocks, warps_n=warps, n8_tiles_per_warp=n8_tiles,
                    stages=stages)
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



CANONICAL_NAN = np.uint32(0x7FFFFFFF).view(np.float32)
"""The NaN a GPU's float32 arithmetic produces. The add-and-shift BF16 rounding carries it into the sign bit
(``0x8000``, -0.0): a NaN would become a number."""


def check_a_nan_scale_or_activation_reaches_exactly_its_outputs(output, rng):
    """A NaN block scale (with the GPU's canonical payload) makes its block's columns NaN in every row; a NaN
    activation makes its row NaN in every column; every other output is finite."""
    m, n, k, block = 5, 16, 256, (8, 128)
    a = activations(rng.standard_normal((m, k)).astype(np.float32), "bf16")
    a[2, 130] = 0x7FFF  # a BF16 NaN in row 2
    q, scale_inv = random_weights(rng, n, k, block)
    scale_inv[1, 0] = CANONICAL_NAN  # columns 8..15, first chunk
    out = poisoned_output(m, n, output)
    if out.dtype == np.uint16:
        out[:] = 0x1234  # a finite poison here: only the kernel may write a NaN
    else:
        out[:] = 7.0
    kernel.gemm_mma(a, q, scale_inv, out, block)
    expected_nan = np.zeros((m, n), bool)
    expected_nan[2, :] = True
    expected_nan[:, 8:] = True
    assert np.array_equal(np.isnan(output_values(out, output)), expected_nan)


def both_promotion_forms(rng, m: int, n: int, k: int, fmt: str):
    """Data on which the promotion's two forms differ from a plain ``fma(s, c_part * 2^offset, c_fin)`` and from
    each other: row 0 of the activations near the top of the format (a chunk's partial sum is beyond float32, its
    scaled value is not), and block scales per 8 rows that cycle through 2^-20, 2^-20, 2^(129 - offset) (too large
    to fold: that group's row-0 outputs overflow) and NaN. Block ``(8, 128)``: ``(a, q, scale_inv, block)``."""
    block, offset = (8, 128), bp.EXPONENT_OFFSET[fmt]
    a32 = rng.standard_normal((m, k)).astype(np.float32)
    a32[0] *= np.float32(2.0 ** (118 if fmt == "bf16" else 6))
    q, _ = random_weights(rng, n, k, block)
    cycle = np.array([2.0 ** -20, 2.0 ** -20, 2.0 ** (129 - offset), np.nan], np.float32)
    scale_inv = np.resize(cycle, blockwise.scale_shape((n, k), block)[0])[:, None].repeat(k // 128, 1)
    return activations(a32, fmt), q, np.ascontiguousarray(scale_inv), block


def check_both_promotion_forms(modelled, m: int, n: int):
    """The data reach what they are for: finite row-0 outputs where the scale folds, though the partial sums
    overflow (a kernel that multiplies ``c_part`` by ``2^offset`` first gives inf there), and infinite or NaN ones
    (inf - inf over the chunks) where it is too large to."""
    groups = np.arange(n) // 8 % 4
    assert np.all(np.isfinite(modelled[0, groups < 2])) and not np.any(np.isfinite(modelled[0, groups == 2]))
    assert np.all(np.isnan(modelled[:, groups == 3])) and np.all(np.isfinite(modelled[1:, groups < 3]))


@pytest.mark.cudasim
@pytest.mark.filterwarnings("ignore:overflow encountered")  # the inf outputs the data are built for
@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_bit_for_bit_both_promotion_forms(fmt, rng):
    m, n, k = 3, 40, 256
    a, q, scale_inv, block = both_promotion_forms(rng, m, n, k, fmt)
    modelled = model.gemm_mma(a.view(np.uint16), q, scale_inv, block, activation=fmt)
    if fmt == "bf16":
        check_both_promotion_forms(modelled, m, n)
    out = poisoned_output(m, n, "f32")
    kernel.gemm_mma(a, q, scale_inv, out, block, n8_tiles_per_warp=2, warps_n=2)
    assert np.array_equal(out.view(np.uint8), modelled.view(np.uint8))


@pytest.mark.cudasim
@pytest.mark.parametrize("output", ["f32", "f16", "bf16"])
def test_a_nan_scale_or_activation_reaches_exactly_its_outputs(output, rng):
    check_a_nan_scale_or_activation_reaches_exactly_its_outputs(output, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("output", ["f32", "f16", "bf16"])
def test_gpu_a_nan_scale_or_activation_reaches_exactly_its_outputs(output, rng):
    """The same on a GPU, whose arithmetic makes every NaN 0x7FFFFFFF (the pattern a BF16 rounding can lose)."""
    check_a_nan_scale_or_activation_reaches_exactly_its_outputs(output, rng)

@pytest.mark.cudasim
@pytest.mark.parametrize("fmt", bp.FORMATS)
def test_place_code_pair_is_the_simulators(fmt, rng):
    # every code in the low byte and in the high byte, plus random pairs
    codes = np.arange(256, dtype=np.uint16)
    random_pairs = rng.integers(0, 2**16, 1024).astype(np.uint16)
    pairs = np.concatenate([codes, codes << 8, codes | (codes[::-1] << 8), random_pairs])
    got = np.array([kernel.place_code_pair(p, kernel.PLACEMENT_SHIFT[fmt]) for p in pairs], dtype=np.uint32)
    assert np.array_equal(got, bp.place_code_pair(pairs, fmt))


def _copies_in_two_groups(source, seen):
    shared = cuda.shared.array(4, np.uint64)
    for i in range(4):
        shared[i] = 7
    cp_async.copy_16_cg(shared, 0, source, 0, 0, 16)
    cp_async.commit_group()
    cp_async.copy_16_ca(shared, 2, source, 1, 0, 0)  # zero fill: nothing read
    cp_async.commit_group()
    seen[0] = shared[0]  # not landed yet
    cp_async.wait_group_function(1)()
    seen[1], seen[2] = shared[1], shared[2]  # the first group landed, the second not
    cp_async.wait_group_function(0)()
    seen[3], seen[4] = shared[2], shared[3]


@pytest.mark.cudasim
def test_cp_async_twin_lands_copies_at_the_wait():
    """The simulator's cp.async lands a group only when a wait requires it (the latest moment a
    GPU may), so a kernel that reads a stage before waiting for it fails here; zero fill too."""
    source = np.array([[11, 12], [13, 14]], dtype=np.uint64)
    seen = np.zeros(5, dtype=np.uint64)
    cuda.jit(_copies_in_two_groups)[1, 1](source, seen)
    assert seen.tolist() == [7, 12, 7, 0, 0]


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
        __cuda_array_interface__ = {"data": (0x1008, False), "shape": (4, 128), "typestr": "|u1", "version": 3}

    with pytest.raises(ValueError, match="16-byte aligned"):  # 8-byte aligned is not enough for cp.async
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


def run_on_gpu(a, q, scale_inv, block, m_blocks, output, **knobs):
    """Device arrays in, output poisoned on the device, launched on a stream of its own, result copied back."""
    m, n = a.shape[0], q.shape[0]
    d_out = cuda.to_device(poisoned_output(m, n, output))
    stream = cuda.stream()
    kernel.gemm_mma(cuda.to_device(a), cuda.to_device(q), cuda.to_device(scale_inv), d_out, block, m_blocks=m_blocks,
                    stream=stream, **knobs)
    stream.synchronize()
    return d_out.copy_to_host()


GPU_TILINGS = [
    # non-default knobs (warps_n, n8_tiles_per_warp, stages): every CTA width, shallow and
    # deep pipelines (8 stages of 32 rows x 64 columns: 140 KiB of shared memory, past the 48 KiB
    # default), one knob given and the others defaulted
    dict(warps_n=1, n8_tiles_per_warp=1, stages=4),
    dict(warps_n=1, n8_tiles_per_warp=2, stages=2),
    dict(warps_n=2, n8_tiles_per_warp=2, stages=3),
    dict(warps_n=4, n8_tiles_per_warp=2, stages=8),
    dict(warps_n=2),
    dict(stages=6),
]


def tiling_id(knobs):
    return ",".join(f"{name.split('_')[0]}={value}" for name, value in knobs.items())


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, m_blocks, fmt, output, block", GPU_CASES)
def test_gpu_against_the_oracle_within_the_gpu_budget(m, n, k, m_blocks, fmt, output, block):
    check_gpu_against_the_oracle(m, n, k, m_blocks, fmt, output, block)


TILING_SHAPES = [(16, 4096, 12288, 1, "bf16", "f32", (128, 128)), (33, 12290, 2048, 2, "f16", "bf16", (64, 256))]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, n, k, m_blocks, fmt, output, block, knobs",
    [(*TILING_SHAPES[i % 2], knobs) for i, knobs in enumerate(GPU_TILINGS)],
    ids=[tiling_id(knobs) for knobs in GPU_TILINGS],
)
def test_gpu_tilings_against_the_oracle(m, n, k, m_blocks, fmt, output, block, knobs):
    check_gpu_against_the_oracle(m, n, k, m_blocks, fmt, output, block, **knobs)


LARGE_M_TILINGS = [
    # (m_blocks, warps_n, n8_tiles_per_warp, stages, warps_m[, place_once]): CTAs of 128 x 128 (8 warps of 64 x 32,
    # 16 of 32 x 32), 128 x 64 and 64 x 256, the codes placed once per CTA, past the 48 KiB shared-memory default; M and
    # N tails inside the tiles
    (4, 4, 4, 3, 2), (2, 4, 4, 3, 4), (4, 2, 4, 4, 2), (4, 8, 4, 3, 1), (4, 4, 4, 3, 2, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", LARGE_M_TILINGS, ids=str)
def test_gpu_large_m_tilings_against_the_oracle(tiling):
    m_blocks, warps_n, n8_tiles, stages, warps_m, place_once = (*tiling, False)[:6]
    check_gpu_against_the_oracle(300, 1000, 1024, m_blocks, "bf16", "bf16", (128, 128), warps_n=warps_n,
                                 n8_tiles_per_warp=n8_tiles, stages=stages, warps_m=warps_m, place_once=place_once)


def check_gpu_against_the_oracle(m, n, k, m_blocks, fmt, output, block, **knobs):
    rng, seed = fresh_rng()
    a = activations(rng.standard_normal((m, k)).astype(np.float32), fmt, int16=output == "bf16-int16")
    q, scale_inv = random_weights(rng, n, k, block, scale=1e-3)
    out = run_on_gpu(a, q, scale_inv, block, m_blocks, output, **knobs)

    values = output_values(out, output)
    unwritten = np.argwhere(~np.isfinite(values))
    assert unwritten.size == 0, f"seed {seed}: unwritten (NaN) outputs at {unwritten[:5].tolist()}"
    a64 = activation_values(a, fmt)
    ref = blockwise.gemm(a64, q, scale_inv, block)
    budget = with_output_rounding(gpu_budget(a64, q, scale_inv, block, fmt), ref, output)
    error = np.linalg.norm(values - ref) / np.linalg.norm(ref)
    bound = np.linalg.norm(budget) / np.linalg.norm(ref)
    assert error <= bound, f"seed {seed}: relative error {error:.3g} > bound {bound:.3g}"


INTEGER_SHAPES = [(33, 1000, 1024, 2, "bf16"), (16, 4096, 512, 1, "f16"), (64, 257, 384, 1, "bf16"),
                  (9, 2056, 2048, 2, "f16")]
INTEGER_CASES = [(*shape, {}) for shape in INTEGER_SHAPES] + [
    (*INTEGER_SHAPES[i % len(INTEGER_SHAPES)], knobs) for i, knobs in enumerate(GPU_TILINGS)
]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, m_blocks, fmt, knobs", INTEGER_CASES,
                         ids=[f"{case[:5]}-{tiling_id(case[5]) or 'default'}" for case in INTEGER_CASES])
def test_gpu_bit_for_bit_the_simulator_on_integer_data(m, n, k, m_blocks, fmt, knobs):
    """Small integer activations, codes of magnitude <= 4 and power-of-two scales: every
    intermediate is exact in float32 (see tests/simulators/test_gemm_mma.py), so the tensor cores' rounding
    cannot show and the GPU must equal the simulator, and the oracle, bit for bit."""
    rng, seed = fresh_rng()
    block = (128, 128)
    a = activations(rng.integers(-4, 5, size=(m, k)).astype(np.float32), fmt)
    q = rng.choice(SMALL_CODES, size=(n, k))
    scale_inv = np.ldexp(1.0, rng.integers(-1, 2, size=blockwise.scale_shape((n, k), block))).astype(np.float32)
    out = run_on_gpu(a, q, scale_inv, block, m_blocks, "f32", **knobs)
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
