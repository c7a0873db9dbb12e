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

``temperature == 0`` means greedy; as ``temperature -> 0`` sampling concentrates on the argmax,
so the two agree in the limit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _checked(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits: expected one non-empty row [vocab], got shape {x.shape}")
    if np.isnan(x).any():
        raise ValueError("logits: contain NaN")
    return x


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


def sampling_probs(logits, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy ``sample`` draws from (float64, sums to 1)."""
    if params.greedy:
        raise ValueError("sampling_probs: temperature 0 is greedy, there is no distribution")
    x = _checked(logits) / params.temperature
    x = np.where(top_k_mask(x, params.top_k), x, -np.inf)
    probs = softmax(x)
    probs = np.where(top_p_mask(probs, params.top_p), probs, 0.0)
    return probs / probs.sum()


def sample(logits, params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """The next token: greedy when ``params.temperature == 0``, else one draw (inverse CDF, one
    ``rng.random()``) from ``sampling_probs``."""
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
