"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p (nucleus).

Pure functions of the logits (and, for sampling, a ``numpy.random.Generator`` per request, so
a seed reproduces a request's tokens whatever else is in the batch). The order is that of
transformers and vLLM: divide by the temperature, keep the top-k logits, keep the top-p
nucleus of the renormalized probabilities, renormalize, draw.

Tie-breaking, everywhere: among equal logits the lowest token id ranks first. So greedy is the
lowest index among the maxima (``np.argmax``), and top-k keeps exactly ``k`` tokens even when
the ``k``-th logit ties with the ``k+1``-th (the lower id wins).

Top-p keeps the smallest set of highest-ranked tokens whose probability mass reaches ``p``:
token number ``j`` in rank order is kept when the mass of the tokens ranked before it is
``< p``, so the top token is always kept. ``top_p >= 1`` keeps everything.

``temperature == 0`` means greedy; as ``temperature -> 0`` sampling concentrates on the maxima
(tested from 1e-320 up): with one maximum it is greedy's token; tied maxima share the mass equally
(greedy, at exactly 0, takes the lowest id among them).

Numerics: every accepted temperature is safe. The logits are taken in float64 and the maximum is
subtracted *before* dividing by the temperature, so the scaled logits are ``<= 0`` and finite or
``-inf``: a tiny temperature sends every non-maximal logit to ``-inf`` (probability 0) instead of
overflowing to ``inf - inf = NaN``, and the distribution degenerates to the maxima, which is the
greedy limit. The top-k ranking is taken on the unscaled logits, where dividing cannot round two
different logits into a tie.

Rejected with a ``ValueError`` naming what is wrong: a temperature that is negative, infinite or
NaN; logits with a NaN or a ``+inf`` (a broken forward, never something to sample), and a row with
no finite logit (nothing can be sampled). ``-inf`` is a masked token: probability 0, never greedy's
choice unless every logit is masked (rejected).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # ``not x >= 0`` is also true for NaN, which compares false with everything
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: expected a finite number >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k != int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _checked(logits) -> np.ndarray:
    """One float64 row of logits, each finite or ``-inf`` (masked), at least one finite."""
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits: expected one non-empty row [vocab], got shape {x.shape}")
    for bad, name in ((np.isnan(x), "NaN"), (np.isposinf(x), "+inf")):
        if bad.any():
            raise ValueError(f"logits: contain {name} (at token ids {_some(np.flatnonzero(bad))})")
    if not np.isfinite(x).any():
        raise ValueError("logits: every logit is -inf (masked), there is no token to choose")
    return x


def _some(ids: np.ndarray, n: int = 5) -> str:
    """The first ``n`` ids for a message, ``"3, 7, ..."`` when there are more."""
    return ", ".join(str(i) for i in ids[:n]) + (", ..." if ids.size > n else "")


def rank_order(logits) -> np.ndarray:
    """Token ids from the highest logit to the lowest; ties: lower id first."""
    return np.argsort(-_checked(logits), kind="stable")


def greedy(logits) -> int:
    """The argmax; among equal maxima the lowest token id."""
    return int(np.argmax(_checked(logits)))


def top_k_mask(logits, k: int) -> np.ndarray:
    """Boolean mask of exactly ``min(k, vocab)`` kept tokens (the ``k`` best ranked); ``k == 0`` keeps all."""
    x = _checked(logits)
    if k <= 0 or k >= x.size:
        return np.ones(x.size, dtype=bool)
    keep = np.zeros(x.size, dtype=bool)
    keep[rank_order(x)[:k]] = True
    return keep


def softmax(logits) -> np.ndarray:
    """float64 softmax; ``-inf`` logits get probability 0."""
    x = _checked(logits)
    e = np.exp(x - np.max(x))
    return e / e.sum()


def top_p_mask(probs, p: float) -> np.ndarray:
    """Boolean mask of the nucleus: highest-ranked tokens until their mass reaches ``p``.

    ``probs`` must be a probability row (tokens with probability 0 are never kept).
    """
    probs = np.asarray(probs, dtype=np.float64)
    if p >= 1:
        return probs > 0
    order = np.argsort(-probs, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(probs.size, dtype=bool)
    keep[order[mass_before < p]] = True
    keep[order[0]] = True  # the top token, even if p is tiny
    return keep & (probs > 0)


def scaled_logits(logits, temperature: float) -> np.ndarray:
    """``(logits - max) / temperature`` in float64: ``<= 0``, the maxima exactly 0, never NaN.

    The order matters: dividing first overflows for a tiny temperature (``1e3 / 1e-310 = inf``)
    and the softmax's ``inf - inf`` is NaN. Subtracting first leaves ``0 / T = 0`` for the maxima
    and ``(negative) / T``, at worst ``-inf``, for the rest: probability 0, the greedy limit.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: expected a finite number > 0 here, got {temperature}")
    x = _checked(logits)
    with np.errstate(over="ignore"):  # overflow to -inf is the intended result
        return (x - np.max(x)) / temperature


def sampling_probs(logits, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy ``sample`` draws from (float64, sums to 1)."""
    if params.greedy:
        raise ValueError("sampling_probs: temperature 0 is greedy, there is no distribution")
    x = _checked(logits)
    scaled = scaled_logits(x, params.temperature)
    scaled = np.where(top_k_mask(x, params.top_k), scaled, -np.inf)
    probs = softmax(scaled)
    probs = np.where(top_p_mask(probs, params.top_p), probs, 0.0)
    return probs / probs.sum()


def sample(logits, params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """The next token: greedy when ``params.temperature == 0``, else one draw (inverse CDF, one
    ``rng.random()``) from ``sampling_probs``. A distribution degenerated to one token (a tiny
    temperature, a tiny ``top_p``, ``top_k == 1``) gives that token whatever the draw: greedy."""
    if params.greedy:
        return greedy(logits)
    if rng is None:
        raise ValueError("sample: sampling with temperature > 0 needs a numpy Generator")
    probs = sampling_probs(logits, params)
    cdf = np.cumsum(probs)
    # the first token whose cdf exceeds u: always one of positive probability
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if token >= probs.size:  # u rounded up to cdf[-1]: take the last token in the support
        token = int(np.flatnonzero(probs)[-1])
    return token
