"""``check_*`` for E4M3 and the blockwise weights: run someone's implementation against the oracle.

Each function takes the implementation (a callable on NumPy arrays), feeds it the inputs that
FP8 code gets wrong (every code, every tie, the overflow threshold, subnormals, all-zero and tiny
blocks, partial edge blocks), then random ones, and compares with ``fp8lab.reference`` under the
operator's tolerance. It returns ``None`` when the implementation meets the contract, else raises
``KernelCheckFailed`` whose ``report`` gives the smallest failing input found (Hypothesis shrinks
it), the expected and actual values, and the bug classes of ``fp8lab.testing.bugs`` whose mutant
reproduces the wrong output. The KV cache and attention checks are in ``fp8lab.testing.kv_checks``.

Tolerances, per operator (``u = 2^-24``, ``gamma(n) = n u / (1 - n u)``):

- ``encode``, ``decode``, ``dequantize``: exact (bit for bit; NaN where the oracle has NaN, with
  ``encode`` keeping the input's sign). ``dequantize`` is one float32 product per element.
- ``quantize`` (weights) and ``quantize_activations``: each scale within 4 float32 ulps of the
  oracle's (``amax / 448`` or ``max(amax, eps) / 448``, 1 for an all-zero weight block, never below
  ``2^-126``), so a scale computed in a few float32 operations passes (``compare.FLOAT32_SCALE_TOLERANCE``;
  BF16 scales: 1 BF16 ulp); every element within the round-trip bound
  ``|decode(q) s - x| <= 2^-4 |x| (1 + 2^-20) + 2^-10 s``; no NaN code for finite input.
- ``gemm`` (W8A16): ``|out - ref| <= gamma(K + 2 ceil(K / BK) + 4) * sum_k |a| |w|`` elementwise,
  against the float64 oracle: float32 accumulation in any order, with per-block promotion.
- ``gemm_w8a8``: activations quantized exactly as the contract's float32 formula, then
  ``|out - ref| <= gamma(BK + ceil(K / BK) + 4) * sum |a_s w_s decode(aq) decode(q)|``.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fp8lab.reference import blockwise, dense, e4m3

from . import bugs
from .compare import (
    as_output,
    check_quantized,
    consistent_classes,
    gamma,
    hypothesis_settings,
    quantized_alike,
    report_of,
    reproduces,
    same,
)
from .report import KernelCheckFailed, Report
from .weight_format import WeightFormat

# ---------------------------------------------------------------------------- E4M3 encode and decode



def encode_inputs(rng: np.random.Generator | None = None) -> np.ndarray:
    """float32 inputs that decide an E4M3 encoder: every finite value, every midpoint between neighbours
    (ties) and the floats next to it, the overflow threshold (464, 465, 480, ...), infinities, zeros,
    NaN, the subnormal range finely, then log-uniform random values of both signs."""
    rng = rng or np.random.default_rng(0)
    values = e4m3.decode(np.arange(256, dtype=np.uint8))
    finite = np.unique(values[np.isfinite(values)].astype(np.float64))
    mid = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact: E4M3 values have 4 significant bits
    near = np.concatenate([np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
    special = np.array([464, 465, 480, 500, 1e9, 3.4e38, np.inf, -np.inf, np.nan, 0.0, -0.0, 240, 241, 256,
                        2.0**-6, 2.0**-9, 2.0**-10, 2.0**-11, 1e-30], np.float32)
    subnormal = np.linspace(-2.0**-6, 2.0**-6, 1001, dtype=np.float32)
    random = (rng.choice([-1.0, 1.0], 4000) * 10.0 ** rng.uniform(-12, 4, 4000)).astype(np.float32)
    return np.concatenate([finite.astype(np.float32), mid, near, special, -special, subnormal, random])


def _diagnose_elementwise(candidates, inputs, actual) -> list:
    """Bug classes whose mutant gives the implementation's output on every element (agreeing only where it is
    wrong is not enough: a NaN-on-overflow cast and an fnuz encoder both give 0x7F for 465)."""
    return consistent_classes(candidates, lambda b: np.all(same(b.mutant(*inputs), actual)))


def check_e4m3_encode(fn, saturate: bool = True) -> None:
    """``fn(x)`` for float32 ``x`` of any 1-D shape must return its uint8 E4M3 codes with the contract's
    rounding (nearest, ties to even) and overflow policy (``saturate``: +-448, else NaN; NaN keeps its sign)."""
    x = encode_inputs()
    expected = e4m3.encode(x, saturate=saturate)
    actual = as_output("codes", fn(x.copy()), x.shape, f"e4m3 encode (saturate={saturate})").astype(np.uint8)
    ok = same(actual, expected)
    if ok.all():
        return
    failing = ~ok
    minimal = x[np.argwhere(failing)[0]]
    diagnoses = _diagnose_elementwise(bugs.ENCODE_BUGS, (x, saturate), actual)
    got = np.asarray(fn(minimal.copy())).astype(np.uint8)
    raise KernelCheckFailed(Report(f"e4m3 encode (saturate={saturate})", {"x": minimal}, "codes", (0,),
                                   f"0x{int(e4m3.encode(minimal, saturate)[0]):02X}", f"0x{int(got[0]):02X}",
                                   "exact", int(failing.sum()), int(x.size), diagnoses))


def check_e4m3_decode(fn) -> None:
    """``fn(codes)`` for uint8 ``codes`` must return their exact float32 values (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256, dtype=np.uint8)
    expected = e4m3.decode(codes)
    actual = as_output("values", fn(codes.copy()), codes.shape, "e4m3 decode").astype(np.float32)
    ok = same(actual, expected)
    if ok.all():
        return
    failing = ~ok
    diagnoses = _diagnose_elementwise(bugs.DECODE_BUGS, (codes,), actual)
    i = int(np.argwhere(failing)[0][0])
    raise KernelCheckFailed(Report("e4m3 decode", {"codes": codes[i : i + 1]}, "values", (0,), float(expected[i]),
                                   float(actual[i]), "exact", int(failing.sum()), 256, diagnoses))



# ---------------------------------------------------------------------------- blockwise weights



@st.composite
def weight_cases(draw, block, k_multiple: int = 1):
    """A weight ``[N, K]`` (N, K up to 2.5 blocks, partial edge blocks likely; K a multiple of
    ``k_multiple`` where the implementation needs one) and how its values look."""
    bn, bk = block
    n = draw(st.integers(1, (5 * bn) // 2))
    k = k_multiple * draw(st.integers(1, max(1, (5 * bk) // (2 * k_multiple))))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["normal", "zero block", "tiny block", "wide range"]))
    return n, k, seed, kind


def make_weight(n: int, k: int, seed: int, kind: str, block) -> np.ndarray:
    """The float32 weight of a ``weight_cases`` example (seeded, never all zeros unless ``kind`` says a block)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-3, 3))
    if kind == "zero block":
        w[: block[0], : block[1]] = 0
    elif kind == "tiny block":
        w[: block[0], : block[1]] *= np.float32(1e-38)
    elif kind == "wide range":
        w *= (10.0 ** rng.uniform(-6, 6, (n, k))).astype(np.float32)
    return w


def check_blockwise_quantize(fn, block=(128, 128), layout: str = "nk", scale_dtype: str = "float32",
                             max_examples: int = 40) -> None:
    """``fn(w, block)`` for float32 ``w[N, K]`` must return ``(codes uint8 [N, K], scale_inv float32
    [ceil(N/BN), ceil(K/BK)])``: one scale per block, scales and round trip within the module docstring's
    tolerance. ``layout`` and ``scale_dtype``: the caller's weight format (``fp8lab.testing.weight_format``:
    ``"kn"`` passes ``w`` transposed and the block as ``(BK, BN)``; ``"bfloat16"`` scales within 1 BF16 ulp)."""
    block, fmt = (int(block[0]), int(block[1])), WeightFormat(layout, scale_dtype)

    @hypothesis_settings(max_examples)
    @given(weight_cases(block))
    def run(case):
        n, k, seed, kind = case
        w = make_weight(n, k, seed, kind, block)
        codes, scales = fn(fmt.codes_to_caller(w), fmt.block(block))
        inputs = {"w": w, "block": block, "format": str(fmt)}
        _require_scale_dtype(fmt, scales, "scale_inv", "blockwise quantize", inputs)
        q, s = fmt.codes_from_caller(codes), fmt.scales_from_caller(scales)
        diagnoses = consistent_classes(bugs.QUANTIZE_BUGS,
                                       lambda b: quantized_alike(b.mutant(w, block), q, s, fmt.scale_tolerance[0]))
        check_quantized("blockwise quantize", inputs, w, (q, s), blockwise.quantize(w, block),
                        lambda grid: blockwise.expand_scales(grid, w.shape, block), "the oracle's amax / 448",
                        diagnoses, scales_name="scale_inv", scale_tolerance=fmt.scale_tolerance)

    run()


def _require_scale_dtype(fmt: WeightFormat, scales, name: str, operator: str, inputs) -> None:
    """A quantizer's scales must come in the format's dtype (BF16 as uint16 bit patterns)."""
    problem = fmt.dtype_error(scales)
    if problem:
        raise KernelCheckFailed(Report(operator, inputs, name, (), fmt.scale_dtype, problem,
                                       "the scales' dtype is part of the format", 1, 1, []))


def quantized_weight(case, block, fmt: WeightFormat):
    """The oracle's codes and scales of a ``weight_cases`` example, the scales as the format stores them."""
    n, k, seed, kind = case
    q, s = blockwise.quantize(make_weight(n, k, seed, kind, block), block)
    return q, fmt.stored_scales(s)


def check_blockwise_dequantize(fn, block=(128, 128), layout: str = "nk", scale_dtype: str = "float32",
                               max_examples: int = 40, k_multiple: int = 1) -> None:
    """``fn(codes, scale_inv, block)`` must return ``decode(codes) * scale_inv[n // BN, k // BK]`` as float32,
    bit for bit (codes from the oracle's quantizer over ``weight_cases``, NaN codes excluded), in the caller's
    ``layout`` with scales in ``scale_dtype`` (see ``check_blockwise_quantize``). ``k_multiple``: only K that
    are multiples of it (a kernel that loads 4 codes at a time needs 4)."""
    block, fmt = (int(block[0]), int(block[1])), WeightFormat(layout, scale_dtype)

    @hypothesis_settings(max_examples)
    @given(weight_cases(block, k_multiple))
    def run(case):
        q, s = quantized_weight(case, block, fmt)
        expected = blockwise.dequantize(q, s, block)
        out = fn(fmt.codes_to_caller(q), fmt.scales_to_caller(s), fmt.block(block))
        actual = as_output("w", fmt.codes_from_caller(out), q.shape, "blockwise dequantize").astype(np.float32)
        ok = same(actual, expected)
        if not ok.all():
            diagnoses = consistent_classes(bugs.DEQUANTIZE_BUGS,
                                           lambda b: np.all(same(b.mutant(q, s, block), actual)))
            raise KernelCheckFailed(report_of("blockwise dequantize", {"codes": q, "scale_inv": s, "block": block,
                                                                       "format": str(fmt)},
                                              "w", ok, expected, actual, "exact (one float32 product)", diagnoses))

    run()


def check_blockwise_gemm(fn, block=(128, 128), layout: str = "nk", scale_dtype: str = "float32",
                         activation_dtype: str = "float32", max_examples: int = 30, k_multiple: int = 1) -> None:
    """``fn(a, codes, scale_inv, block)`` for float32 ``a[M, K]`` must return ``a @ dequantize(codes,
    scale_inv)^T`` ``[M, N]`` within the float32 bound of the module docstring (W8A16), the weight in the
    caller's ``layout`` with scales in ``scale_dtype`` (see ``check_blockwise_quantize``).
    ``activation_dtype="bfloat16"``: ``a`` holds BF16 values and is passed as their uint16 bit patterns (the
    oracle computes with the same values). ``k_multiple``: only K that are multiples of it (for kernels that
    require, e.g., K % 128 == 0)."""
    block, fmt = (int(block[0]), int(block[1])), WeightFormat(layout, scale_dtype)
    if activation_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"activation_dtype: expected one of float32, bfloat16, got {activation_dtype!r}")
    bf16 = activation_dtype == "bfloat16"

    @hypothesis_settings(max_examples)
    @given(weight_cases(block, k_multiple), st.integers(1, 8))
    def run(case, m):
        q, s = quantized_weight(case, block, fmt)
        a = np.random.default_rng(case[2] + 1).standard_normal((m, q.shape[1])).astype(np.float32)
        a = dense.round_to_bf16(a) if bf16 else a
        expected = blockwise.gemm(a, q, s, block)
        a_in = dense.float32_to_bf16_bits(a) if bf16 else a.copy()
        out = fn(a_in, fmt.codes_to_caller(q), fmt.scales_to_caller(s), fmt.block(block))
        actual = as_output("out", out, (m, q.shape[0]), "blockwise gemm (W8A16)").astype(np.float64)
        bound = _w8a16_bound(a, np.abs(blockwise.dequantize(q, s, block).astype(np.float64)), block)
        ok = np.abs(actual - expected) <= bound
        if not ok.all():
            diagnoses = consistent_classes(bugs.GEMM_BUGS, lambda b: _reproduces_gemm(b, a, q, s, block, actual))
            raise KernelCheckFailed(report_of("blockwise gemm (W8A16)", {"a": a, "codes": q, "scale_inv": s,
                                                                         "block": block, "format": str(fmt),
                                                                         "activations": activation_dtype},
                                              "out", ok, expected, actual,
                                              "gamma(K + 2 ceil(K/BK) + 4) sum_k |a| |w|", diagnoses))

    run()


def _w8a16_bound(a, w_abs, block) -> np.ndarray:
    """``gamma(K + 2 ceil(K / BK) + 4) sum_k |a| |w|`` (+ an absolute hair for subnormal products): the
    float32 error of a W8A16 GEMM in any summation order with per-block promotion, elementwise."""
    k = a.shape[1]
    return gamma(k + 2 * math.ceil(k / block[1]) + 4) * (np.abs(a.astype(np.float64)) @ w_abs.T) + 2.0**-140 * k


def _reproduces_gemm(bug, a, q, s, block, actual) -> bool:
    """The GEMM mutant's output equals ``actual`` within the same float32 bound, taken over its own weight."""
    with np.errstate(invalid="ignore", over="ignore"):
        bound = _w8a16_bound(a, np.abs(bug.mutant.dequantize(q, s, block).astype(np.float64)), block)
        return bool(np.all(np.abs(bug.mutant(a, q, s, block) - actual) <= bound))



# ---------------------------------------------------------------------------- activation quantization and the W8A8 GEMM



def check_activation_quantize(fn, group: int = 128, eps: float = blockwise.DEFAULT_ACTIVATION_EPS,
                              max_examples: int = 40) -> None:
    """``fn(a, group, eps)`` for float32 ``a[M, K]`` must return ``(codes uint8 [M, K], scales float32
    [M, ceil(K/group)])``: per token and group ``s = max(amax, eps) / 448``, within the module docstring's
    tolerance (an all-zero group is among the inputs)."""

    @hypothesis_settings(max_examples)
    @given(st.integers(1, 6), st.integers(1, (5 * group) // 2), st.integers(0, 2**32 - 1), st.booleans())
    def run(m, k, seed, zero_group):
        rng = np.random.default_rng(seed)
        a = (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        if zero_group:
            a[0, :group] = 0
        q, s = (np.asarray(x) for x in fn(a.copy(), group, eps))
        inputs = {"a": a, "group": group, "eps": eps}
        diagnoses = consistent_classes(bugs.ACTIVATION_BUGS, lambda b: quantized_alike(b.mutant(a, group, eps), q, s))
        check_quantized("activation quantize", inputs, a, (q, s), blockwise.quantize_activations(a, group, eps),
                         lambda scales: blockwise.expand_scales(scales, a.shape, (1, group)),
                         "max(amax, eps) / 448", diagnoses)

    run()


def check_w8a8_gemm(fn, block=(128, 128), eps: float = blockwise.DEFAULT_ACTIVATION_EPS, layout: str = "nk",
                    scale_dtype: str = "float32", max_examples: int = 30, k_multiple: int = 1) -> None:
    """``fn(a, codes, scale_inv, block, eps)`` for float32 ``a[M, K]`` must return the W8A8 GEMM ``[M, N]`` of
    transformers and vLLM (``fp8lab.reference.blockwise.gemm_w8a8``): activations quantized per token and
    group of ``BK`` exactly as ``quantize_activations`` (``s = max(amax, eps) / 448`` in float32; a kernel
    that rounds its scales otherwise fails here, and ``check_activation_quantize`` says how), then per K
    block ``a_s * w_s * sum decode(aq) decode(q)``, within ``gamma(BK + ceil(K / BK) + 4)`` times the sum of
    the terms' magnitudes, plus ``2^-149`` per unit of the unscaled block sums where ``a_s * w_s`` is a
    float32 subnormal. An all-zero activation group is among the inputs. ``layout`` and ``scale_dtype``: the
    caller's weight format (see ``check_blockwise_quantize``; the activation scales stay float32)."""
    block, fmt = (int(block[0]), int(block[1])), WeightFormat(layout, scale_dtype)

    @hypothesis_settings(max_examples)
    @given(weight_cases(block, k_multiple), st.integers(1, 6), st.booleans())
    def run(case, m, zero_group):
        q, s = quantized_weight(case, block, fmt)
        (n, k), seed = q.shape, case[2]
        a = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
        if zero_group:
            a[0, : block[1]] = 0
        expected = blockwise.gemm_w8a8(a, q, s, block, eps)
        out = fn(a.copy(), fmt.codes_to_caller(q), fmt.scales_to_caller(s), fmt.block(block), eps)
        actual = as_output("out", out, (m, n), "w8a8 gemm").astype(np.float64)
        aq, a_s = blockwise.quantize_activations(a, block[1], eps)
        x = np.abs(blockwise.dequantize(aq, a_s, (1, block[1])).astype(np.float64))
        w = np.abs(blockwise.dequantize(q, s, block).astype(np.float64))
        # the scale products a_s * w_s may be float32 subnormals (tiny weight blocks): each scaled block
        # term then carries an absolute error of up to 2^-149 (|unscaled block sum| + 1)
        unscaled = np.abs(e4m3.decode(aq).astype(np.float64)) @ np.abs(e4m3.decode(q).astype(np.float64)).T
        bound = (gamma(block[1] + math.ceil(k / block[1]) + 4) * (x @ w.T)
                 + 2.0**-149 * (unscaled + math.ceil(k / block[1]) + 1))
        ok = np.abs(actual - expected) <= bound
        if not ok.all():
            diagnoses = consistent_classes(bugs.W8A8_BUGS,
                                           lambda b: reproduces(b.mutant(a, q, s, block, eps), actual, bound))
            raise KernelCheckFailed(report_of("w8a8 gemm", {"a": a, "codes": q, "scale_inv": s, "block": block,
                                                          "eps": eps, "format": str(fmt)}, "out", ok, expected, actual,
                                            "gamma(BK + ceil(K/BK) + 4) sum |a_s w_s decode(aq) decode(q)|", diagnoses))

    run()
