"""What every check shares: the float32 error constants, the Hypothesis settings, NaN-aware equality,
the output's shape check, the report of the first wrong element, and the quantizers' common tolerance."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, Phase, settings

from fp8lab.reference import e4m3

from .report import KernelCheckFailed, Report

U = 2.0**-24
"""The float32 unit roundoff."""


def gamma(n: int) -> float:
    """``n u / (1 - n u)``: the relative error bound of ``n`` float32 roundings in a row."""
    return n * U / (1 - n * U)


def hypothesis_settings(max_examples: int):
    """Deterministic (derandomized, no example database) and reporting one failure, so a check always
    raises ``KernelCheckFailed`` with the shrunk example. ``max_examples``, unless the environment variable
    ``FP8LAB_MAX_EXAMPLES`` overrides it for every check (the pytest option ``--fp8lab-max-examples N`` of
    ``fp8lab.pytest_plugin`` sets it for a test run: a quick one, or a thorough one)."""
    override = os.environ.get("FP8LAB_MAX_EXAMPLES")
    if override is not None:
        if not override.strip().isdigit() or int(override) < 1:
            raise ValueError(f"FP8LAB_MAX_EXAMPLES: expected a positive integer, got {override!r}")
        max_examples = int(override)
    # no "explain" phase: the report already says what is wrong, and Hypothesis' list of the kit's own lines
    # that only failing examples ran would be noise in it
    phases = [phase for phase in Phase if phase.name != "explain"]
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                    phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise equality with NaN equal to NaN (and bit patterns compared for integers)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
    return a == b


def as_output(name: str, value, shape, operator: str = "", inputs=None, diagnoses=()) -> np.ndarray:
    """The implementation's output as a NumPy array of the expected shape; otherwise a report (the
    output's shape is part of the contract) with the bug classes that give the same wrong shape."""
    array = np.asarray(value)
    if array.shape != tuple(shape):
        raise KernelCheckFailed(Report(operator, inputs or {}, name, (), f"shape {tuple(shape)}", f"shape {array.shape}",
                                       "the output's shape is part of the contract", 1, 1, list(diagnoses)))
    return array


def report_of(operator, inputs, output, ok, expected, actual, tolerance, diagnoses) -> Report:
    """The ``Report`` of a failed elementwise comparison ``ok``: its first wrong element and how many are wrong."""
    bad = np.argwhere(~ok)
    index = tuple(int(i) for i in bad[0]) if bad.size else ()
    return Report(operator, inputs, output, index, expected[index].item() if bad.size else None,
                  actual[index].item() if bad.size else None, tolerance, int((~ok).sum()), int(ok.size), diagnoses)


def round_trip_ok(q, scales, x) -> np.ndarray:
    """The round-trip bound of the module docstring, elementwise, for codes ``q`` with ``scales`` (one per
    element of ``x``)."""
    scales = np.asarray(scales, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        value = e4m3.decode(q).astype(np.float64) * scales
        bound = 2.0**-4 * np.abs(x.astype(np.float64)) * (1 + 2.0**-20) + 2.0**-10 * scales
        return np.abs(value - x) <= bound


FLOAT32_SCALE_TOLERANCE = (4 * 2.0**-23, "4 float32 ulps")
"""How far a float32 scale may be from the contract's formula (relative, and in words): 4 ulps, so a scale
computed in a few float32 operations passes (a reciprocal multiply ``amax * (1 / 448)``: 1 ulp;
``1 / (448 / amax)`` as torch evaluates it: up to 2) while every scale bug of the catalog, off by factors,
fails. What the scale does to the values is the round-trip bound's business."""


def scales_ok(s, s_ref, rel: float = FLOAT32_SCALE_TOLERANCE[0]) -> np.ndarray:
    """Elementwise: ``s`` within ``rel * |s_ref|`` of ``s_ref`` (NaN only where ``s_ref`` is NaN)."""
    s64, ref = np.asarray(s, np.float64), np.asarray(s_ref, np.float64)
    return (np.abs(s64 - ref) <= rel * np.abs(ref)) | (np.isnan(s64) & np.isnan(ref))


def check_quantized(operator, inputs, x, outputs, reference, expand, scale_rule, diagnoses,
                    scales_name: str = "scales", scale_tolerance=FLOAT32_SCALE_TOLERANCE) -> None:
    """The tolerance every quantizer shares: ``outputs = (codes, scales)`` of the oracle's shapes, each scale
    within ``scale_tolerance`` (relative, words) of the oracle's (``scale_rule`` says which), every
    element of ``x`` within the round-trip bound and no NaN code. ``expand(scales)`` spreads the scales over
    the elements of ``x``."""
    q_ref, s_ref = reference
    q = as_output("codes", outputs[0], x.shape, operator, inputs, diagnoses).astype(np.uint8)
    s = as_output(scales_name, outputs[1], s_ref.shape, operator, inputs, diagnoses).astype(np.float32)
    ok = scales_ok(s, s_ref, scale_tolerance[0])
    if not ok.all():
        raise KernelCheckFailed(report_of(operator, inputs, scales_name, ok, s_ref, s,
                                          f"within {scale_tolerance[1]} of {scale_rule}", diagnoses))
    ok = round_trip_ok(q, expand(s), x) & ~e4m3.is_nan(q)
    if not ok.all():
        raise KernelCheckFailed(report_of(operator, inputs, "codes", ok, q_ref, q,
                                          "|decode(q) s - x| <= 2^-4 |x| + 2^-10 s, no NaN codes", diagnoses))


def quantized_alike(mutant_out, q, s, scale_rel: float = FLOAT32_SCALE_TOLERANCE[0]) -> bool:
    """A quantizer mutant's ``(codes, scales)`` agree with ``(q, s)``: the same shapes, each scale within
    ``scale_rel`` (relative) of the mutant's, NaN where it is NaN, and each code the mutant's or its neighbour
    of the same sign (a scale a few ulps off moves ``x / s`` by less than one E4M3 step)."""
    mq, ms = np.asarray(mutant_out[0]), np.asarray(mutant_out[1], np.float64)
    q, s = np.asarray(q), np.asarray(s, np.float64)
    if mq.shape != q.shape or ms.shape != s.shape:
        return False
    with np.errstate(invalid="ignore"):
        scales_close = (np.abs(ms - s) <= scale_rel * np.abs(ms)) | (np.isnan(ms) & np.isnan(s))
    mq, q = mq.astype(np.int16), q.astype(np.int16)
    codes_close = ((mq & 0x80) == (q & 0x80)) & (np.abs((mq & 0x7F) - (q & 0x7F)) <= 1)
    return bool(scales_close.all() and codes_close.all())


def consistent_classes(candidates, reproduced) -> list:
    """The bug classes among ``candidates`` for which ``reproduced(bug)`` holds, each name once: a class written
    as several mutants (one per shard count, per wrong block size, ...) is named by the first that reproduces
    the output, whose summary then says which."""
    found = {}
    for bug in candidates:
        if bug.name not in found and reproduced(bug):
            found[bug.name] = bug
    return list(found.values())


def reproduces(mutant_out, actual, tol) -> bool:
    """The mutant's output equals ``actual`` within ``tol`` where finite, and is NaN exactly where it is."""
    m = np.asarray(mutant_out, np.float64)
    nan_m, nan_a = np.isnan(m), np.isnan(actual)
    close = np.abs(np.where(nan_m, 0, m) - np.where(nan_a, 0, actual)) <= tol
    return bool(np.array_equal(nan_m, nan_a) and np.all(close | nan_m))
