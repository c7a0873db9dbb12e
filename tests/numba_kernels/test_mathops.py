"""fp8lab.numba_kernels.mathops.divide_by_at_least_one: float32 division without a division instruction.

In the CUDA simulator (its reciprocal approximation made coarse, its float64 fma exact), bit for bit NumPy's
IEEE float32 division, which is what ``div.rn.f32`` computes, on the operands it takes (``d >= 1``, ``+inf``, NaN:
an attention row's sum of weights, which holds its largest weight, 1): every binade of ``x`` (subnormals too), ``d``
from 1 to float32's largest, exact ties and their neighbours, the special values; and the final rounding step from
approximations far worse than the kernel's (on ties a plain rounding of those goes wrong; the step does not). On a
GPU it is checked inside ``prefill_wgmma`` (``tests/numba_kernels/test_prefill_wgmma_kernel.py``: the BF16 output
bit for bit the float32 output rounded, both within the reference's bound).
"""

from __future__ import annotations

import numpy as np
import pytest

import fp8lab.numba_kernels  # noqa: F401  (installs the simulator's warp intrinsics)
from fp8lab.numba_kernels import mathops
from fp8lab.numba_kernels.bits import SIMULATOR

pytestmark = [pytest.mark.skipif(not SIMULATOR, reason="runs the device function on the host: the CUDA simulator"),
              pytest.mark.filterwarnings("ignore:invalid value encountered")]  # inf * 0, as asked


def ieee_quotient(x, d) -> np.float32:
    with np.errstate(all="ignore"):
        return np.float32(x) / np.float32(d)


def same_bits(a, b) -> bool:
    """Equal float32 patterns, any NaN equal to any NaN (the GPU's is 0x7FFFFFFF, NumPy's keeps payloads)."""
    a, b = np.float32(a), np.float32(b)
    return bool(np.isnan(a) and np.isnan(b)) or a.view(np.uint32) == b.view(np.uint32)


def check(xs, ds):
    for x, d in zip(np.asarray(xs, np.float32), np.asarray(ds, np.float32)):
        got, want = mathops.divide_by_at_least_one(x, d), ieee_quotient(x, d)
        assert same_bits(got, want), (x, d, got, want)


TIE_DIVISORS = (2.0, 6.0, 10.0, 14.0, 24.0, 2.0 ** 20 * 6)


def ties(d: float) -> list[np.float32]:
    """Dividends whose quotient by ``d`` (an even integer) is exactly a midpoint between two float32: ``(2 j + 1)
    2^-150``, between subnormals (in the normal range a float32 quotient is never a midpoint: its 25 bits would need
    ``x`` to have more than 24)."""
    out = [np.float32((2 * j + 1) * (d / 2) * 2.0 ** -149) for j in range(0, 300, 7)]
    assert all(np.float64(x) / d == (2 * j + 1) * 2.0 ** -150 for x, j in zip(out, range(0, 300, 7)))
    return out


def test_random_operands_in_every_binade(rng):
    size = 3000
    x = (rng.uniform(1, 2, size) * np.exp2(rng.integers(-149, 128, size).astype(np.float64))
         * rng.choice([-1, 1], size)).astype(np.float32)
    d = (rng.uniform(1, 2, size) * np.exp2(rng.integers(0, 128, size).astype(np.float64))).astype(np.float32)
    d[::5] = np.float32(1) + np.exp(-rng.standard_normal(size // 5).astype(np.float32) * 4)  # just above 1
    d = np.where(np.isfinite(d), d, np.float32(3.0e38))
    check(x, d)


def test_ties_and_near_ties_go_as_ieee_says():
    """Quotients exactly at a float32 midpoint (only possible among subnormals, or for exact products) and one
    float32 ulp of ``x`` around them: the cases the float64 approximation cannot decide alone."""
    xs, ds = [], []
    for d in TIE_DIVISORS:
        for x in ties(d):
            for neighbour in (x, np.nextafter(x, np.float32(1)), np.nextafter(x, np.float32(-1))):
                for sign in (1, -1):
                    xs.append(sign * neighbour)
                    ds.append(d)
    assert len(xs) > 1000
    check(xs, ds)


def test_rounding_settles_any_approximation_near_the_quotient(rng):
    """``round_quotient`` from approximations up to 10^5 float64 ulps off the quotient, on exact ties and random
    operands: the correctly rounded float32 every time (the approximation alone, rounded, is wrong on some ties)."""
    xs, ds = [], []
    for d in TIE_DIVISORS:
        xs += ties(d)
        ds += [d] * len(ties(d))
    size = 400
    xs += list(rng.uniform(1, 2, size) * np.exp2(rng.integers(-140, 120, size).astype(np.float64)))
    ds += list(rng.uniform(1, 2, size) * np.exp2(rng.integers(0, 8, size).astype(np.float64)))
    plainly_wrong = 0
    for x, d in zip(np.asarray(xs, np.float32), np.asarray(ds, np.float32)):
        exact = np.float64(x) / np.float64(d)  # correctly rounded float64
        want = ieee_quotient(x, d)
        for ulps in rng.integers(-100000, 100000, 6):
            q = (exact.view(np.int64) + np.int64(ulps)).view(np.float64)
            got = mathops.round_quotient(q, np.float64(x), np.float64(d))
            assert same_bits(got, want), (x, d, ulps, got, want)
            plainly_wrong += np.float32(q) != want
    assert plainly_wrong > 20


def test_special_values():
    inf, nan, big = np.float32(np.inf), np.float32(np.nan), np.float32(3.4e38)
    xs = [0.0, -0.0, 1.0, -1.0, inf, -inf, nan, big, -big, 1e-45, -1e-45, 0.0, -0.0, inf, 1.0, nan, 2.5]
    ds = [1.0, 1.0, inf, inf, inf, inf, 1.0, 1.0, 1.0, 1.0, 1.0, inf, inf, 2.0, nan, nan, big]
    check(xs, ds)
