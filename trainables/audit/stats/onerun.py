"""The one-run canary audit: an empirical epsilon lower bound from one training run.

Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run", arXiv 2305.08846:
:func:`one_run_p_value` (the theorem, here only), :func:`epsilon_lower_bound`,
:func:`canary_guesses`, and :func:`canary_audit` (the best of several guess counts,
union-bounded, as a :class:`CanaryBound`). Numpy / scipy only; canaries and their scores are
made in :mod:`trainables.audit.canaries`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special, stats

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.audit.stats.attacks import DEFAULT_CONFIDENCE, check_confidence

#: Seed of random tie-breaking among equal canary scores: reports are reproducible.
DEFAULT_SEED = 0

#: Width at which the epsilon bisection stops (the bound returned is the bracket's low end).
EPSILON_TOLERANCE = 1e-6
#: First upper bracket of the epsilon search; doubled until the p-value reaches the level.
EPSILON_FIRST_BRACKET = 1.0
#: Doublings of the bracket before giving up: 2**12 exceeds any epsilon where the logistic
#: function still differs from 1 in double precision (about 37).
EPSILON_MAX_DOUBLINGS = 12
#: Default canary guess counts of :func:`canary_audit`, as fractions of the m canaries guessed
#: (half IN, half OUT).
DEFAULT_GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise UserInputError(field=name, value=value, allowed="a non-negative integer")
    if not 0 <= v <= r <= m or m < 1:
        raise UserInputError(field="m, r, v", value=(int(m), int(r), int(v)),
                             allowed="0 <= v <= r <= m and m >= 1")


def _check_delta(delta: float) -> float:
    if not isinstance(delta, (int, float)) or not 0 <= delta < 1:
        raise UserInputError(field="delta", value=delta, allowed="a number in [0, 1)")
    return float(delta)


def _one_run_p(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    q = float(special.expit(epsilon))  # e^eps / (1 + e^eps): eps-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    below = stats.binom.pmf(np.arange(v), r, q)[::-1]  # P[B = v-1], P[B = v-2], ...
    slope = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(tail + 2 * m * delta * slope, 1.0)


def one_run_p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of v correct guesses out of r (m canaries) under the null "(epsilon, delta)-DP".

    Steinke, Nasr & Jagielski (arXiv 2305.08846), main theorem for approximate DP (Section 5;
    the p-value computation of its Appendix D): each of the m canaries is included
    independently with probability 1/2, the auditor guesses on r of them (abstaining on the
    rest) and W counts the correct guesses. If the mechanism is (epsilon, delta)-DP, then for
    every v, with f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v],

        P[W >= v] <= f(v) + 2 m delta max_{i = 1..v} (f(v - i) - f(v)) / i

    (for i > v, f(v - i) = 1 and the ratio is at most its value at i = v, so the maximum over
    1..m in the paper's statement equals this one). With delta = 0 the bound is the binomial
    tail f(v) alone.
    """
    _check_counts(m, r, v)
    delta = _check_delta(delta)
    if not math.isfinite(epsilon) or epsilon < 0:
        raise UserInputError(field="epsilon", value=epsilon, allowed="a finite number >= 0")
    return _one_run_p(int(m), int(r), int(v), float(epsilon), delta)


def epsilon_lower_bound(*, m: int, r: int, v: int, delta: float,
                        confidence: float = DEFAULT_CONFIDENCE) -> float:
    """Largest epsilon that v correct guesses of r reject at ``confidence`` (0 if none).

    The null "(eps, delta)-DP" is rejected when :func:`one_run_p_value` < 1 - confidence; the
    search doubles a bracket and bisects to ``EPSILON_TOLERANCE`` keeping that invariant at the
    low end, so the value returned is always itself rejected (conservative by at most the
    tolerance). Rejecting eps also rejects every smaller eps ((eps', delta)-DP with eps' < eps
    implies (eps, delta)-DP), so the result is a lower bound on the mechanism's epsilon.
    With delta = 0 it is logit of the one-sided Clopper–Pearson lower bound of v / r.
    """
    _check_counts(m, r, v)
    delta = _check_delta(delta)
    level = 1 - check_confidence(confidence)
    m, r, v = int(m), int(r), int(v)
    if _one_run_p(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, EPSILON_FIRST_BRACKET
    for _ in range(EPSILON_MAX_DOUBLINGS):
        if _one_run_p(m, r, v, high, delta) >= level:
            break
        low, high = high, 2 * high
    else:
        return low
    while high - low > EPSILON_TOLERANCE:
        middle = (low + high) / 2
        if _one_run_p(m, r, v, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class CanaryGuesses:
    """The auditor's guesses: IN for the k_plus highest scores, OUT for the k_minus lowest."""

    m: int
    k_plus: int
    k_minus: int
    r: int
    v: int

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "k_plus": self.k_plus, "k_minus": self.k_minus, "r": self.r,
                "v": self.v}


def _check_canaries(scores: Any, is_member: Any) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=float)
    y = np.asarray(is_member)
    if s.ndim != 1 or y.shape != s.shape or len(s) == 0:
        raise UserInputError(field="scores/is_member", value=f"shapes {s.shape} and {y.shape}",
                             allowed="two non-empty 1-d arrays of one length")
    if not np.isin(y, (0, 1)).all() or not np.isfinite(s).all():
        raise UserInputError(field="scores/is_member", value="non-binary or non-finite values",
                             allowed="finite scores and 0/1 (or bool) membership")
    return s, y.astype(bool)


def _guess_order(scores: np.ndarray, seed: int) -> np.ndarray:
    """Canary indices by increasing score, ties broken at random: a tie order that followed the
    caller's indexing could correlate with membership and inflate v."""
    tiebreak = np.random.default_rng(seed).permutation(len(scores))
    return np.lexsort((tiebreak, scores))


def _count_correct(order: np.ndarray, is_member: np.ndarray, k_plus: int, k_minus: int) -> int:
    high = order[len(order) - k_plus:] if k_plus else order[:0]
    low = order[:k_minus]
    return int(np.count_nonzero(is_member[high]) + np.count_nonzero(~is_member[low]))


def _check_k(k_plus: int, k_minus: int, m: int) -> None:
    for name, k in (("k_plus", k_plus), ("k_minus", k_minus)):
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise UserInputError(field=name, value=k, allowed="a non-negative integer")
    if k_plus + k_minus > m or k_plus + k_minus == 0:
        raise UserInputError(field="k_plus + k_minus", value=int(k_plus + k_minus),
                             allowed=f"between 1 and the number of canaries ({m})")


def canary_guesses(*, scores: Any, is_member: Any, k_plus: int, k_minus: int,
                   seed: int = DEFAULT_SEED) -> CanaryGuesses:
    """r = k_plus + k_minus guesses and v, how many are right. The canaries must have been
    included independently with probability 1/2 each; the guesses may use the scores (computed
    from the trained model) but never ``is_member``."""
    s, y = _check_canaries(scores, is_member)
    _check_k(k_plus, k_minus, len(s))
    v = _count_correct(_guess_order(s, seed), y, int(k_plus), int(k_minus))
    return CanaryGuesses(m=len(s), k_plus=int(k_plus), k_minus=int(k_minus),
                         r=int(k_plus + k_minus), v=v)


@dataclass(frozen=True)
class CanaryBound:
    """The one-run epsilon lower bound, best over the tried guess counts (union-bounded)."""

    m: int
    delta: float
    confidence: float
    per_candidate_confidence: float
    epsilon_lower: float
    best: CanaryGuesses
    candidates: tuple[tuple[CanaryGuesses, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"m": self.m, "delta": self.delta, "confidence": self.confidence,
                "per_candidate_confidence": self.per_candidate_confidence,
                "epsilon_lower": self.epsilon_lower, "best": self.best.to_dict(),
                "candidates": [{**g.to_dict(), "epsilon_lower": e}
                               for g, e in self.candidates]}


def default_guess_counts(*, m: int) -> tuple[tuple[int, int], ...]:
    """(k_plus, k_minus) pairs guessing ``DEFAULT_GUESS_FRACTIONS`` of the m canaries, half
    IN (highest scores) and half OUT (lowest)."""
    pairs = {(max(1, round(f * m / 2)), max(1, round(f * m / 2))) for f in DEFAULT_GUESS_FRACTIONS}
    return tuple(sorted(p for p in pairs if p[0] + p[1] <= m)) or ((1, 0),)


def canary_audit(*, scores: Any, is_member: Any, delta: float,
                 confidence: float = DEFAULT_CONFIDENCE,
                 guess_counts: Sequence[tuple[int, int]] | None = None,
                 seed: int = DEFAULT_SEED) -> CanaryBound:
    """Empirical epsilon lower bound from one training run's canary scores.

    Trying several (k_plus, k_minus) and reporting the best is a choice made after seeing the
    data, so each of the K candidates is tested at confidence 1 - (1 - confidence) / K (union
    bound): the reported bound then holds at ``confidence``. (Taking the best of several
    without this correction, as is common in experiments, overstates the confidence.) A single
    candidate fixed in advance pays nothing.
    """
    s, y = _check_canaries(scores, is_member)
    delta = _check_delta(delta)
    confidence = check_confidence(confidence)
    m = len(s)
    pairs = tuple(guess_counts) if guess_counts is not None else default_guess_counts(m=m)
    if not pairs:
        raise UserInputError(field="guess_counts", value=list(pairs),
                             allowed="at least one (k_plus, k_minus) pair")
    for k_plus, k_minus in pairs:
        _check_k(k_plus, k_minus, m)
    per_candidate = 1 - (1 - confidence) / len(pairs)
    order = _guess_order(s, seed)
    results = []
    for k_plus, k_minus in pairs:
        guesses = CanaryGuesses(m=m, k_plus=int(k_plus), k_minus=int(k_minus),
                                r=int(k_plus + k_minus),
                                v=_count_correct(order, y, int(k_plus), int(k_minus)))
        bound = epsilon_lower_bound(m=m, r=guesses.r, v=guesses.v, delta=delta,
                                    confidence=per_candidate)
        results.append((guesses, bound))
    # Ties (all zero, typically) go to the most guesses: the report then says how many guesses
    # failed to bound epsilon, not that a handful did.
    best_guesses, best_bound = max(results, key=lambda item: (item[1], item[0].r))
    return CanaryBound(m=m, delta=delta, confidence=confidence,
                       per_candidate_confidence=per_candidate, epsilon_lower=best_bound,
                       best=best_guesses, candidates=tuple(results))
