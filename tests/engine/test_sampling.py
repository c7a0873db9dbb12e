"""Sampling: greedy ties, the exact support of top-k and top-p, seeds, the temperature -> 0 limit."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from fp8lab.engine.sampling import (
    SamplingParams,
    greedy,
    rank_order,
    sample,
    sampling_probs,
    scaled_logits,
    softmax,
    top_k_mask,
    top_p_mask,
)

# small integer logits make ties common
tied_logits = st.lists(st.integers(-4, 4), min_size=1, max_size=24).map(lambda x: np.array(x, dtype=np.float32))


@given(tied_logits)
def test_greedy_is_the_lowest_index_among_the_maxima(logits):
    assert greedy(logits) == min(i for i, x in enumerate(logits) if x == logits.max())
    assert sample(logits, SamplingParams()) == greedy(logits)


@given(tied_logits, st.integers(0, 30))
def test_top_k_keeps_exactly_the_k_best_ties_to_lower_ids(logits, k):
    # independent statement: sort (-logit, id) pairs, keep the first k
    ranked = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    expected = set(ranked[: k if 0 < k < len(logits) else len(logits)])
    assert set(np.flatnonzero(top_k_mask(logits, k))) == expected
    assert rank_order(logits).tolist() == ranked


@given(st.lists(st.integers(0, 20), min_size=1, max_size=16).filter(any), st.integers(1, 99))
def test_top_p_keeps_the_smallest_prefix_reaching_p(weights, p_percent):
    """Exact rationals as the independent statement; p is kept away from every prefix mass so
    that float64 rounding cannot decide the case."""
    total = sum(weights)
    probs_exact = [Fraction(w, total) for w in weights]
    p = Fraction(p_percent, 100)
    ranked = sorted(range(len(weights)), key=lambda i: (-probs_exact[i], i))
    prefix = np.cumsum([float(probs_exact[i]) for i in ranked])
    assume(np.all(np.abs(prefix - float(p)) > 1e-9))
    kept, mass = set(), Fraction(0)
    for i in ranked:
        if mass >= p or probs_exact[i] == 0:
            break
        kept.add(i)
        mass += probs_exact[i]
    probs = np.array([float(x) for x in probs_exact])
    assert set(np.flatnonzero(top_p_mask(probs, float(p)))) == kept
    assert set(np.flatnonzero(top_p_mask(probs, 1.0))) == {i for i, w in enumerate(weights) if w}


def test_top_p_always_keeps_the_top_token():
    assert np.flatnonzero(top_p_mask(np.array([0.2, 0.5, 0.3]), 1e-9)).tolist() == [1]


@given(st.lists(st.floats(-5, 5), min_size=2, max_size=20), st.integers(0, 6), st.floats(0.05, 1.0),
       st.floats(0.2, 3.0), st.integers(0, 2**32 - 1))
def test_samples_land_only_in_the_filtered_support(logits, k, p, temperature, seed):
    logits = np.array(logits)
    params = SamplingParams(temperature=temperature, top_k=k, top_p=p)
    probs = sampling_probs(logits, params)
    assert np.isclose(probs.sum(), 1.0) and np.all(probs >= 0)
    support = set(np.flatnonzero(probs))
    assert support <= set(np.flatnonzero(top_k_mask(logits, k)))
    rng = np.random.default_rng(seed)
    assert {sample(logits, params, rng) for _ in range(30)} <= support


def test_sample_frequencies_follow_the_distribution():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    probs = sampling_probs(logits, params)
    rng = np.random.default_rng(123)
    n = 20_000
    counts = np.bincount([sample(logits, params, rng) for _ in range(n)], minlength=logits.size)
    # each frequency within 5 binomial standard deviations of its probability
    assert np.all(np.abs(counts / n - probs) <= 5 * np.sqrt(probs * (1 - probs) / n) + 1e-12)
    assert counts[probs == 0].sum() == 0


def test_seeds_reproduce_and_differ(rng):
    logits = rng.standard_normal(50)
    params = SamplingParams(temperature=1.0)
    draw = lambda seed: [sample(logits, params, g) for g in [np.random.default_rng(seed)] for _ in range(20)]
    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_temperature_to_zero_is_greedy(rng):
    for _ in range(20):
        logits = rng.standard_normal(100)
        top2 = np.sort(logits)[-2:]
        margin = top2[1] - top2[0]
        # the runner-up has weight exp(-margin / T) relative to the top: e^-50 at T = margin / 50
        params = SamplingParams(temperature=float(margin) / 50)
        assert all(sample(logits, params, np.random.default_rng(s)) == greedy(logits) for s in range(10))
        assert sampling_probs(logits, params)[greedy(logits)] > 1 - 1e-15


def test_nan_logits_and_bad_params_are_rejected():
    with pytest.raises(ValueError, match="NaN"):
        greedy(np.array([0.0, np.nan]))
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0.0, np.nan]), SamplingParams(temperature=1.0), np.random.default_rng(0))
    bad_params = [dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")),
                  dict(temperature=-1e-300), dict(top_k=-1), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5),
                  dict(top_p=float("nan"))]
    for bad in bad_params:
        (name,) = bad
        with pytest.raises(ValueError, match=f"^{name}: expected"):  # the message names the parameter
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="Generator"):
        sample(np.zeros(3), SamplingParams(temperature=1.0))


def test_softmax_handles_masked_logits():
    probs = softmax(np.array([0.0, -np.inf, 0.0]))
    assert probs.tolist() == [0.5, 0.0, 0.5]


# ---------------------------------------------------------------------------- extreme values (issue 12)

# temperatures spread over every decade from 1e-320 (subnormal) to 1e6
temperatures = st.one_of(
    st.sampled_from([1e-320, 5e-324 * 2**10, 1e-310, 2.2250738585072014e-308, 1e-30, 1.0, 1e6]),
    st.builds(lambda m, e: m * 10.0**e, st.floats(1.0, 9.99), st.integers(-320, 5)),
)
# any finite float64 (huge magnitudes included) or -inf (a masked token), at least one finite
extreme_logits = (st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.just(-np.inf),
                                     st.integers(-3, 3).map(float)), min_size=1, max_size=40)
                  .filter(lambda xs: any(np.isfinite(xs))).map(np.array))


@given(extreme_logits, temperatures, st.integers(0, 50), st.floats(1e-300, 1.0), st.integers(0, 2**32 - 1))
@example(np.array([0.0, 1000.0, 5.0]), 1e-310, 0, 1.0, 0)  # the issue: NaN probabilities, always the last id
def test_every_temperature_samples_a_valid_token_of_positive_probability(logits, temperature, k, p, seed):
    params = SamplingParams(temperature=temperature, top_k=k, top_p=p)
    probs = sampling_probs(logits, params)
    assert np.all(np.isfinite(probs)) and np.all(probs >= 0) and np.isclose(probs.sum(), 1.0)
    token = sample(logits, params, np.random.default_rng(seed))
    assert 0 <= token < logits.size and probs[token] > 0 and np.isfinite(logits[token])
    assert top_k_mask(logits, k)[token]


@given(st.lists(st.integers(-4, 4), min_size=1, max_size=24).map(lambda x: np.array(x, dtype=np.float32)),
       st.builds(lambda m, e: m * 10.0**e, st.floats(1.0, 9.99), st.integers(-320, -4)),
       st.integers(0, 30), st.integers(0, 2**32 - 1))
def test_as_the_temperature_goes_to_zero_sampling_is_greedy(logits, temperature, k, seed):
    """Integer logits: the runner-up is at least 1 below the top, so at T <= 1e-3 its weight is
    ``exp(-1000) = 0`` in float64. One maximum: the sample is greedy's token. Tied maxima: the
    limit of softmax(x / T) shares the mass equally among them; greedy (T == 0) takes the lowest."""
    params = SamplingParams(temperature=temperature, top_k=k)
    maxima = np.flatnonzero(logits == logits.max())
    probs = sampling_probs(logits, params)
    kept = maxima[top_k_mask(logits, k)[maxima]]  # top-k may cut ties: it keeps the lower ids
    np.testing.assert_allclose(probs[kept], 1.0 / kept.size, rtol=1e-14)
    assert np.all(np.delete(probs, kept) == 0)
    token = sample(logits, params, np.random.default_rng(seed))
    assert token in kept
    if maxima.size == 1:
        assert token == greedy(logits)


def test_scaling_subtracts_the_maximum_before_dividing():
    x = np.array([3.0, 1e3, -2e300, 1e3, -np.inf])
    np.testing.assert_array_equal(scaled_logits(x, 1e-310), [-np.inf, 0.0, -np.inf, 0.0, -np.inf])
    assert np.all(np.isfinite(scaled_logits(np.array([1e308, -1e308]), 1e6)[:1]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            scaled_logits(x, bad)


def test_top_k_beyond_the_vocabulary_and_a_tiny_top_p():
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.0])
    everything = sampling_probs(logits, SamplingParams(temperature=1.0))
    np.testing.assert_array_equal(sampling_probs(logits, SamplingParams(temperature=1.0, top_k=10**9)), everything)
    # top_p tiny: only the top-ranked token (the lower id among the tied maxima)
    tiny_p = SamplingParams(temperature=1.0, top_p=5e-324)
    assert sampling_probs(logits, tiny_p).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert {sample(logits, tiny_p, np.random.default_rng(s)) for s in range(20)} == {1}


@pytest.mark.parametrize("logits, message", [
    ([0.0, np.nan, 1.0], "NaN"),
    ([0.0, np.inf], r"\+inf"),
    ([-np.inf, -np.inf], "every logit is -inf"),
])
def test_logits_that_cannot_be_sampled_are_rejected(logits, message):
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=1)):
        with pytest.raises(ValueError, match=f"^logits: .*{message}"):
            sample(np.array(logits), params, np.random.default_rng(0))
