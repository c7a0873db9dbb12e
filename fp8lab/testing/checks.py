"""``check_*``: run someone's implementation of an operator of the contract against the oracle.

Each function takes the implementation (a callable on NumPy arrays), feeds it the inputs that
FP8 code gets wrong (every code, every tie, the overflow threshold, subnormals, all-zero and tiny
blocks, partial edge blocks), then random ones, and compares with ``fp8lab.reference`` under the
operator's tolerance. It returns ``None`` when the implementation meets the contract, else raises
``KernelCheckFailed`` whose ``report`` gives the smallest failing input found (Hypothesis shrinks
it), the expected and actual values, and the bug classes of ``fp8lab.testing.bugs`` whose mutant
reproduces the wrong output.

Tolerances, per operator (``u = 2^-24``, ``gamma(n) = n u / (1 - n u)``):

- ``encode``, ``decode``, ``dequantize``: exact (bit for bit; NaN where the oracle has NaN, with
  ``encode`` keeping the input's sign). ``dequantize`` is one float32 product per element.
- ``quantize`` (weights) and ``quantize_activations``: each scale within 1 float32 ulp of the
  oracle's (``amax / 448`` or ``max(amax, eps) / 448``, 1 for an all-zero weight block, never below
  ``2^-126``), so a reciprocal multiply passes; every element within the round-trip bound
  ``|decode(q) s - x| <= 2^-4 |x| (1 + 2^-20) + 2^-10 s``; no NaN code for finite input.
- ``gemm`` (W8A16): ``|out - ref| <= gamma(K + 2 ceil(K / BK) + 4) * sum_k |a| |w|`` elementwise,
  against the float64 oracle: float32 accumulation in any order, with per-block promotion.
- ``gemm_w8a8``: activations quantized exactly as the contract's float32 formula, then
  ``|out - ref| <= gamma(BK + ceil(K / BK) + 4) * sum |a_s w_s decode(aq) decode(q)|``.
- ``quantize_kv``: as ``quantize``, with one scale per (token, kv head).
- ``paged_decode``: ``decode_tolerance``: a float32 score error moves the softmax weights, the
  float32 sums add ``gamma(2 L + 16)``; relative to the largest value the row averages.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8lab.reference import attention, blockwise, e4m3, kv_cache
from fp8lab.reference import strategies as fst

from . import bugs
from .report import KernelCheckFailed, Report

U = 2.0**-24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise equality with NaN equal to NaN (and bit patterns compared for integers)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    return a == b


def _as_output(name: str, value, shape, operator: str = "", inputs=None, diagnoses=()) -> np.ndarray:
    """The implementation's output as a NumPy array of the expected shape; otherwise a report (the
    output's shape is part of the contract) with the bug classes that give the same wrong shape."""
    array = np.asarray(value)
    if array.shape != tuple(shape):
        raise KernelCheckFailed(Report(operator, inputs or {}, name, (), f"shape {tuple(shape)}", f"shape {array.shape}",
                                       "the output's shape is part of the contract", 1, 1, list(diagnoses)))
    return array


def _report(operator, inputs, output, ok, expected, actual, tolerance, diagnoses) -> Report:
    bad = np.argwhere(~ok)
    index = tuple(int(i) for i in bad[0]) if bad.size else ()
    return Report(operator, inputs, output, index, expected[index].item() if bad.size else None,
                  actual[index].item() if bad.size else None, tolerance, int((~ok).sum()), int(ok.size), diagnoses)


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


def _diagnose_elementwise(candidates, inputs, actual, failing) -> list:
    """Bug classes whose mutant equals the implementation's output on every failing element."""
    return [b for b in candidates if np.all(_same(b.mutant(*inputs)[failing], actual[failing]))]


def check_e4m3_encode(fn, saturate: bool = True) -> None:
    """``fn(x)`` for float32 ``x`` of any 1-D shape must return its uint8 E4M3 codes with the contract's
    rounding (nearest, ties to even) and overflow policy (``saturate``: +-448, else NaN; NaN keeps its sign)."""
    x = encode_inputs()
    expected = e4m3.encode(x, saturate=saturate)
    actual = _as_output("codes", fn(x.copy()), x.shape, f"e4m3 encode (saturate={saturate})").astype(np.uint8)
    ok = _same(actual, expected)
    if ok.all():
        return
    failing = ~ok
    minimal = x[np.argwhere(failing)[0]]
    diagnoses = _diagnose_elementwise([b for b in bugs.ENCODE_BUGS], (x, saturate), actual, failing)
    got = np.asarray(fn(minimal.copy())).astype(np.uint8)
    raise KernelCheckFailed(Report(f"e4m3 encode (saturate={saturate})", {"x": minimal}, "codes", (0,),
                                   f"0x{int(e4m3.encode(minimal, saturate)[0]):02X}", f"0x{int(got[0]):02X}",
                                   "exact", int(failing.sum()), int(x.size), diagnoses))


def check_e4m3_decode(fn) -> None:
    """``fn(codes)`` for uint8 ``codes`` must return their exact float32 values (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256, dtype=np.uint8)
    expected = e4m3.decode(codes)
    actual = _as_output("values", fn(codes.copy()), codes.shape, "e4m3 decode").astype(np.float32)
    ok = _same(actual, expected)
    if ok.all():
        return
    failing = ~ok
    diagnoses = _diagnose_elementwise(bugs.DECODE_BUGS, (codes,), actual, failing)
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


def _round_trip_ok(q, scales, x) -> np.ndarray:
    """The round-trip bound of the module docstring, elementwise, for codes ``q`` with ``scales`` (one per
    element of ``x``)."""
    scales = np.asarray(scales, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        value = e4m3.decode(q).astype(np.float64) * scales
        bound = 2.0**-4 * np.abs(x.astype(np.float64)) * (1 + 2.0**-20) + 2.0**-10 * scales
        return np.abs(value - x) <= bound


def _scales_ok(s, s_ref) -> np.ndarray:
    s64, ref = np.asarray(s, np.float64), np.asarray(s_ref, np.float64)
    return (np.abs(s64 - ref) <= 2.0**-23 * np.abs(ref)) | (np.isnan(s64) & np.isnan(ref))


def _check_quantized(operator, inputs, x, outputs, reference, expand, scale_rule, diagnoses,
                     scales_name: str = "scales") -> None:
    """The tolerance every quantizer shares: ``outputs = (codes, scales)`` of the oracle's shapes, each scale
    within 1 float32 ulp of the oracle's (``scale_rule`` says which), every element of ``x`` within the
    round-trip bound and no NaN code. ``expand(scales)`` spreads the scales over the elements of ``x``."""
    q_ref, s_ref = reference
    q = _as_output("codes", outputs[0], x.shape, operator, inputs, diagnoses).astype(np.uint8)
    s = _as_output(scales_name, outputs[1], s_ref.shape, operator, inputs, diagnoses).astype(np.float32)
    ok = _scales_ok(s, s_ref)
    if not ok.all():
        raise KernelCheckFailed(_report(operator, inputs, scales_name, ok, s_ref, s,
                                        f"within 1 float32 ulp of {scale_rule}", diagnoses))
    ok = _round_trip_ok(q, expand(s), x) & ~e4m3.is_nan(q)
    if not ok.all():
        raise KernelCheckFailed(_report(operator, inputs, "codes", ok, q_ref, q,
                                        "|decode(q) s - x| <= 2^-4 |x| + 2^-10 s, no NaN codes", diagnoses))


def _matches_pair(mutant_out, q, s) -> bool:
    mq, ms = mutant_out
    return np.shape(mq) == q.shape and np.shape(ms) == s.shape and bool(np.all(_same(mq, q)) and np.all(_same(ms, s)))


def check_blockwise_quantize(fn, block=(128, 128), max_examples: int = 40) -> None:
    """``fn(w, block)`` for float32 ``w[N, K]`` must return ``(codes uint8 [N, K], scale_inv float32
    [ceil(N/BN), ceil(K/BK)])``: one scale per block, scales and round trip within the module docstring's tolerance."""
    block = (int(block[0]), int(block[1]))

    @_settings(max_examples)
    @given(weight_cases(block))
    def run(case):
        n, k, seed, kind = case
        w = make_weight(n, k, seed, kind, block)
        q, s = (np.asarray(x) for x in fn(w.copy(), block))
        inputs = {"w": w, "block": block}
        diagnoses = [b for b in bugs.QUANTIZE_BUGS if _matches_pair(b.mutant(w, block), q, s)]
        _check_quantized("blockwise quantize", inputs, w, (q, s), blockwise.quantize(w, block),
                         lambda scales: blockwise.expand_scales(scales, w.shape, block), "the oracle's amax / 448",
                         diagnoses, scales_name="scale_inv")

    run()


def check_blockwise_dequantize(fn, block=(128, 128), max_examples: int = 40) -> None:
    """``fn(codes, scale_inv, block)`` must return ``decode(codes) * scale_inv[n // BN, k // BK]`` as float32,
    bit for bit (codes from the oracle's quantizer over ``weight_cases``, NaN codes excluded)."""
    block = (int(block[0]), int(block[1]))

    @_settings(max_examples)
    @given(weight_cases(block))
    def run(case):
        n, k, seed, kind = case
        q, s = blockwise.quantize(make_weight(n, k, seed, kind, block), block)
        expected = blockwise.dequantize(q, s, block)
        actual = _as_output("w", fn(q.copy(), s.copy(), block), q.shape, "blockwise dequantize").astype(np.float32)
        ok = _same(actual, expected)
        if not ok.all():
            diagnoses = [b for b in bugs.DEQUANTIZE_BUGS if np.all(_same(b.mutant(q, s, block), actual))]
            raise KernelCheckFailed(_report("blockwise dequantize", {"codes": q, "scale_inv": s, "block": block},
                                            "w", ok, expected, actual, "exact (one float32 product)", diagnoses))

    run()


def check_blockwise_gemm(fn, block=(128, 128), max_examples: int = 30, k_multiple: int = 1) -> None:
    """``fn(a, codes, scale_inv, block)`` for float32 ``a[M, K]`` must return ``a @ dequantize(codes,
    scale_inv)^T`` ``[M, N]`` within the float32 bound of the module docstring (W8A16). ``k_multiple``:
    only K that are multiples of it (for kernels that require, e.g., K % 128 == 0)."""
    block = (int(block[0]), int(block[1]))

    @_settings(max_examples)
    @given(weight_cases(block, k_multiple), st.integers(1, 8))
    def run(case, m):
        n, k, seed, kind = case
        q, s = blockwise.quantize(make_weight(n, k, seed, kind, block), block)
        a = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
        expected = blockwise.gemm(a, q, s, block)
        actual = _as_output("out", fn(a.copy(), q.copy(), s.copy(), block), (m, n), "blockwise gemm (W8A16)").astype(np.float64)
        bound = _w8a16_bound(a, np.abs(blockwise.dequantize(q, s, block).astype(np.float64)), block)
        ok = np.abs(actual - expected) <= bound
        if not ok.all():
            diagnoses = [b for b in bugs.GEMM_BUGS if _reproduces_gemm(b, a, q, s, block, actual)]
            raise KernelCheckFailed(_report("blockwise gemm (W8A16)", {"a": a, "codes": q, "scale_inv": s,
                                                                       "block": block}, "out", ok, expected, actual,
                                            "gamma(K + 2 ceil(K/BK) + 4) sum_k |a| |w|", diagnoses))

    run()


def _w8a16_bound(a, w_abs, block) -> np.ndarray:
    """``gamma(K + 2 ceil(K / BK) + 4) sum_k |a| |w|`` (+ an absolute hair for subnormal products): the
    float32 error of a W8A16 GEMM in any summation order with per-block promotion, elementwise."""
    k = a.shape[1]
    return _gamma(k + 2 * math.ceil(k / block[1]) + 4) * (np.abs(a.astype(np.float64)) @ w_abs.T) + 2.0**-140 * k


def _reproduces_gemm(bug, a, q, s, block, actual) -> bool:
    """The GEMM mutant's output equals ``actual`` within the same float32 bound, taken over its own weight."""
    with np.errstate(invalid="ignore", over="ignore"):
        bound = _w8a16_bound(a, np.abs(bug.mutant.dequantize(q, s, block).astype(np.float64)), block)
        return bool(np.all(np.abs(bug.mutant(a, q, s, block) - actual) <= bound))


# ---------------------------------------------------------------------------- activation quantization


def check_activation_quantize(fn, group: int = 128, eps: float = blockwise.DEFAULT_ACTIVATION_EPS,
                              max_examples: int = 40) -> None:
    """``fn(a, group, eps)`` for float32 ``a[M, K]`` must return ``(codes uint8 [M, K], scales float32
    [M, ceil(K/group)])``: per token and group ``s = max(amax, eps) / 448``, within the module docstring's
    tolerance (an all-zero group is among the inputs)."""

    @_settings(max_examples)
    @given(st.integers(1, 6), st.integers(1, (5 * group) // 2), st.integers(0, 2**32 - 1), st.booleans())
    def run(m, k, seed, zero_group):
        rng = np.random.default_rng(seed)
        a = (rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        if zero_group:
            a[0, :group] = 0
        q, s = (np.asarray(x) for x in fn(a.copy(), group, eps))
        inputs = {"a": a, "group": group, "eps": eps}
        diagnoses = [b for b in bugs.ACTIVATION_BUGS if _matches_pair(b.mutant(a, group, eps), q, s)]
        _check_quantized("activation quantize", inputs, a, (q, s), blockwise.quantize_activations(a, group, eps),
                         lambda scales: blockwise.expand_scales(scales, a.shape, (1, group)),
                         "max(amax, eps) / 448", diagnoses)

    run()


# ---------------------------------------------------------------------------- the FP8 KV cache and decode attention


def check_kv_quantize(fn, max_examples: int = 40) -> None:
    """``fn(x)`` for float32 ``x[T, kv_heads, head_dim]`` must return ``(codes uint8 like x, scales float32
    [T, kv_heads])``: one scale per (token, kv head), ``amax / 448`` (1 for a zero vector, at least 2^-126),
    within the tolerance of the module docstring."""

    @_settings(max_examples)
    @given(st.integers(1, 6), st.integers(1, 4), st.sampled_from([8, 16, 64, 128]), st.integers(0, 2**32 - 1),
           st.booleans())
    def run(t, heads, dim, seed, zero_vector):
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal((t, heads, dim)) * rng.uniform(0.01, 100, (t, heads, 1))).astype(np.float32)
        if zero_vector:
            x[0, 0] = 0
        q, s = (np.asarray(v) for v in fn(x.copy()))
        inputs = {"x": x}
        diagnoses = [b for b in bugs.KV_BUGS if _matches_pair(b.mutant(x), q, s)]
        _check_quantized("kv quantize", inputs, x, (q, s), kv_cache.quantize_kv(x),
                         lambda scales: np.broadcast_to(scales[..., None], x.shape),
                         "amax / 448 per (token, kv head)", diagnoses)

    run()


def decode_tolerance(data) -> np.ndarray:
    """Per (sequence, query head): ``(2 gamma(D + 8) B + gamma(2 L + 16)) max|v| + 2^-120``, where ``B`` is the
    largest ``|q| . |k_j| * softmax_scale`` of the sequence (a float32 score error of ``gamma(D) B`` changes
    the softmax weights by a relative ``2 gamma(D) B`` at most) and ``L`` its length (the float32 sums)."""
    q = data.q.astype(np.float64)
    num_seqs, num_heads, dim = q.shape
    group = num_heads // data.k_cache.shape[1]
    tol = np.full((num_seqs, num_heads), 2.0**-120)
    for i, length in enumerate(int(n) for n in data.seq_lens):
        if length == 0:
            continue
        k = kv_cache.gather(data.k_cache, data.k_scale, data.block_tables[i], length).astype(np.float64)
        v = kv_cache.gather(data.v_cache, data.v_scale, data.block_tables[i], length).astype(np.float64)
        for h in range(num_heads):
            b = float(np.max(np.abs(k[:, h // group]) @ np.abs(q[i, h]))) * data.softmax_scale
            tol[i, h] += (2 * _gamma(dim + 8) * b + _gamma(2 * length + 16)) * float(np.max(np.abs(v[:, h // group])))
    return tol


def check_paged_decode(fn, fp8: bool = True, max_examples: int = 30) -> None:
    """``fn(q, k_cache, v_cache, block_tables, seq_lens, softmax_scale, k_scale, v_scale)`` must return decode
    attention ``[num_seqs, num_heads, head_dim]`` over fp8lab's paged layout (``fp8lab.reference.kv_cache``:
    caches ``[blocks, kv_heads, block_size, head_dim]``, E4M3 codes with scales when ``fp8``), GQA by
    ``h // (num_heads / num_kv_heads)``, zero rows for length 0, within ``decode_tolerance`` of the oracle."""

    @_settings(max_examples)
    @given(fst.paged_kv_layouts(), st.integers(0, 2**32 - 1))
    def run(layout, seed):
        data = layout.random_data(np.random.default_rng(seed), fp8=fp8)
        args = data.decode_args()
        expected = attention.paged_decode(*args)
        actual = _as_output("out", fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args)),
                            expected.shape, "paged decode").astype(np.float64)
        tol = decode_tolerance(data)[..., None]
        ok = np.abs(actual - expected) <= tol  # NaN is never within it
        if not ok.all():
            inputs = {"layout": f"{layout.num_heads} query heads over {layout.num_kv_heads} kv heads, head_dim "
                                f"{layout.head_dim}, block_size {layout.block_size}", "seq_lens": data.seq_lens,
                      "block_tables": data.block_tables}
            diagnoses = [b for b in bugs.DECODE_ATTENTION_BUGS if _reproduces(b.mutant(*args), actual, tol)]
            raise KernelCheckFailed(_report("paged decode", inputs, "out", ok, expected, actual,
                                            "(2 gamma(D + 8) B + gamma(2 L + 16)) max|v| per (sequence, head)",
                                            diagnoses))

    run()


def _reproduces(mutant_out, actual, tol) -> bool:
    """The mutant's output equals ``actual`` within ``tol`` where finite, and is NaN exactly where it is."""
    m = np.asarray(mutant_out, np.float64)
    nan_m, nan_a = np.isnan(m), np.isnan(actual)
    close = np.abs(np.where(nan_m, 0, m) - np.where(nan_a, 0, actual)) <= tol
    return bool(np.array_equal(nan_m, nan_a) and np.all(close | nan_m))


def check_w8a8_gemm(fn, block=(128, 128), eps: float = blockwise.DEFAULT_ACTIVATION_EPS, max_examples: int = 30,
                    k_multiple: int = 1) -> None:
    """``fn(a, codes, scale_inv, block, eps)`` for float32 ``a[M, K]`` must return the W8A8 GEMM ``[M, N]`` of
    transformers and vLLM (``fp8lab.reference.blockwise.gemm_w8a8``): activations quantized per token and
    group of ``BK`` exactly as ``quantize_activations`` (``s = max(amax, eps) / 448`` in float32; a kernel
    that rounds its scales otherwise fails here, and ``check_activation_quantize`` says how), then per K
    block ``a_s * w_s * sum decode(aq) decode(q)``, within ``gamma(BK + ceil(K / BK) + 4)`` times the sum of
    the terms' magnitudes, plus ``2^-149`` per unit of the unscaled block sums where ``a_s * w_s`` is a
    float32 subnormal. An all-zero activation group is among the inputs."""
    block = (int(block[0]), int(block[1]))

    @_settings(max_examples)
    @given(weight_cases(block, k_multiple), st.integers(1, 6), st.booleans())
    def run(case, m, zero_group):
        n, k, seed, kind = case
        q, s = blockwise.quantize(make_weight(n, k, seed, kind, block), block)
        a = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
        if zero_group:
            a[0, : block[1]] = 0
        expected = blockwise.gemm_w8a8(a, q, s, block, eps)
        actual = _as_output("out", fn(a.copy(), q.copy(), s.copy(), block, eps), (m, n), "w8a8 gemm").astype(np.float64)
        aq, a_s = blockwise.quantize_activations(a, block[1], eps)
        x = np.abs(blockwise.dequantize(aq, a_s, (1, block[1])).astype(np.float64))
        w = np.abs(blockwise.dequantize(q, s, block).astype(np.float64))
        # the scale products a_s * w_s may be float32 subnormals (tiny weight blocks): each scaled block
        # term then carries an absolute error of up to 2^-149 (|unscaled block sum| + 1)
        unscaled = np.abs(e4m3.decode(aq).astype(np.float64)) @ np.abs(e4m3.decode(q).astype(np.float64)).T
        bound = (_gamma(block[1] + math.ceil(k / block[1]) + 4) * (x @ w.T)
                 + 2.0**-149 * (unscaled + math.ceil(k / block[1]) + 1))
        ok = np.abs(actual - expected) <= bound
        if not ok.all():
            diagnoses = [b for b in bugs.W8A8_BUGS if _reproduces(b.mutant(a, q, s, block, eps), actual, bound)]
            raise KernelCheckFailed(_report("w8a8 gemm", {"a": a, "codes": q, "scale_inv": s, "block": block,
                                                          "eps": eps}, "out", ok, expected, actual,
                                            "gamma(BK + ceil(K/BK) + 4) sum |a_s w_s decode(aq) decode(q)|", diagnoses))

    run()


# ---------------------------------------------------------------------------- the paged cache write

CACHE_LAYOUTS = {"fp8lab": (0, 1, 2, 3), "vllm": (0, 2, 1, 3)}
"""How a caller's cache axes map to fp8lab's ``[blocks, kv_heads, block_size, head_dim]``: ``"vllm"`` is
``[blocks, block_size, kv_heads, head_dim]`` (scales ``[blocks, block_size, kv_heads]``)."""


def _to_layout(array, layout: str):
    """fp8lab's layout -> the caller's (codes 4-D, scales 3-D); a copy in C order."""
    axes = CACHE_LAYOUTS[layout][: array.ndim]
    return np.array(np.transpose(array, axes), order="C", copy=True)  # never the caller's memory


def _from_layout(array, layout: str):
    axes = CACHE_LAYOUTS[layout][: array.ndim]
    return np.transpose(array, np.argsort(axes))


def check_paged_cache_write(fn, layout: str = "fp8lab", max_examples: int = 40) -> None:
    """``fn(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)`` must write float32 ``k``, ``v``
    ``[T, kv_heads, head_dim]`` into the paged FP8 caches in place: token ``t`` at slot ``slot_mapping[t]``
    (``block * block_size + offset``), quantized per (token, kv head) as ``check_kv_quantize`` requires;
    a slot of -1 is padding and writes nothing; every other cache entry is left as it was (the kit
    poisons it with NaN codes and scales). ``layout``: ``"fp8lab"`` (caches ``[blocks, kv_heads,
    block_size, head_dim]``) or ``"vllm"`` (``[blocks, block_size, kv_heads, head_dim]``)."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(CACHE_LAYOUTS)}, got {layout!r}")

    @_settings(max_examples)
    @given(st.integers(1, 6), st.integers(1, 3), st.sampled_from([4, 16, 64]), st.sampled_from([1, 4, 16]),
           st.integers(0, 2**32 - 1), st.booleans())
    def run(t, heads, dim, block_size, seed, padding):
        rng = np.random.default_rng(seed)
        num_blocks = -(-(t + 2) // block_size) + 1
        slots = rng.permutation(num_blocks * block_size)[:t].astype(np.int32)
        if padding:
            slots[rng.integers(0, t)] = -1
        k, v = ((rng.standard_normal((t, heads, dim)) * rng.uniform(0.01, 100, (t, heads, 1))).astype(np.float32)
                for _ in range(2))
        shape = (num_blocks, heads, block_size, dim)
        poisoned = [(np.full(shape, 0x7F, np.uint8), np.full(shape[:3], np.nan, np.float32)) for _ in range(2)]
        expected = [(c.copy(), s.copy()) for c, s in poisoned]
        (ek, eks), (ev, evs) = expected
        kv_cache.write(ek, eks, k[slots >= 0], slots[slots >= 0])
        kv_cache.write(ev, evs, v[slots >= 0], slots[slots >= 0])
        mine = [(_to_layout(c, layout), _to_layout(s, layout)) for c, s in poisoned]
        (mk, mks), (mv, mvs) = mine
        fn(k.copy(), v.copy(), mk, mv, mks, mvs, slots.copy())
        got = [(_from_layout(c, layout), _from_layout(s, layout)) for c, s in mine]
        inputs = {"k": k, "v": v, "slot_mapping": slots, "block_size": block_size, "layout": layout}
        diagnoses = []
        for b in bugs.CACHE_WRITE_BUGS:
            trial = [(c.copy(), s.copy()) for c, s in poisoned]
            b.mutant(k, v, trial[0][0], trial[1][0], trial[0][1], trial[1][1], slots)
            if all(np.all(_same(tc, gc)) and np.all(_same(ts, gs)) for (tc, ts), (gc, gs) in zip(trial, got)):
                diagnoses.append(b)
        for name, (e_codes, e_scales), (g_codes, g_scales) in zip(("k", "v"), expected, got):
            ok = _scales_ok(g_scales, e_scales)
            if not ok.all():
                raise KernelCheckFailed(_report("paged cache write", inputs, f"{name}_scale", ok, e_scales, g_scales,
                                                "written scales within 1 ulp of amax / 448, the others untouched (NaN)",
                                                diagnoses))
            scales = np.broadcast_to(np.nan_to_num(e_scales, nan=1.0)[..., None], e_codes.shape)
            written = ~np.isnan(e_scales)[..., None] & np.ones(e_codes.shape, bool)
            with np.errstate(invalid="ignore", over="ignore"):
                value, target = e4m3.decode(g_codes).astype(np.float64) * scales, e4m3.decode(e_codes).astype(np.float64) * scales
                # a written code: its value within the half-step of the expected one (both quantize the same x)
                close = np.abs(value - target) <= 2.0**-3 * np.abs(target) + 2.0**-9 * scales
            ok = np.where(written, close & ~e4m3.is_nan(g_codes), g_codes == e_codes)
            if not ok.all():
                raise KernelCheckFailed(_report("paged cache write", inputs, f"{name}_cache", ok, e_codes, g_codes,
                                                "written codes as the quantizer's, the others untouched (0x7F)",
                                                diagnoses))

    run()
