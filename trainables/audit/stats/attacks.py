"""Attack statistics: every number a reviewer reads comes with its interval and significance.

Pure numpy / scipy / statsmodels (no torch), so it imports and tests without a model.

* :func:`binomial_interval` — Clopper–Pearson ("beta") or Wilson intervals via statsmodels.
* :func:`attack_statistics` — one attack on one layer: balanced accuracy with its interval, AUC
  with DeLong's interval, TPR at low FPR with intervals, a Mann–Whitney p-value against
  chance, and a thinned ROC curve.
* :func:`combine_attacks` — the peak over layers x attacks, its multiplicity-corrected p-value
  (Holm), and a simultaneous upper confidence bound on the peak accuracy.
* :func:`consistent_with_dp` — whether measured ROC points respect the hypothesis-testing
  characterisation of (epsilon, delta)-DP (Kairouz, Oh & Viswanath, "The composition theorem for
  differential privacy", arXiv 1311.0776), and the empirical epsilon they imply.

The one-run canary bound is in :mod:`trainables.audit.stats.onerun`.

Conventions: labels are 1 for members and 0 for non-members; larger scores are more
member-like; an example is predicted a member when its score is strictly greater than the
threshold, everywhere in this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.proportion import proportion_confint

from dpsweep.core.errors import UserInputError

#: Two-sided confidence of every interval unless a caller asks otherwise.
DEFAULT_CONFIDENCE = 0.95
#: The false-positive rates the field reports TPR at (Carlini et al., "Membership inference
#: attacks from first principles", arXiv 2112.03570).
DEFAULT_FPRS = (0.01, 0.001)
#: Family-wise error rate of the multi-attack leak decision.
DEFAULT_ALPHA = 0.05
#: Most ROC points kept for plots and audit.json.
MAX_ROC_POINTS = 200
#: Fewest ROC points a caller may ask for: the three fixed points plus a grid on each axis.
MIN_ROC_POINTS = 8
#: Fewest examples per class: DeLong's variance estimates each class's spread of placements
#: (a sample variance) and needs two.
MIN_PER_CLASS = 2
#: What ``AttackStatistics.auc_method`` says of the AUC interval.
AUC_METHOD = ("DeLong (structural components, midrank algorithm of Sun & Xu 2014; ties count "
              "1/2), normal approximation clipped to [0, 1]")
#: Interval methods of :func:`binomial_interval` (statsmodels names; "beta" = Clopper–Pearson).
INTERVAL_METHODS = ("beta", "wilson")
#: Multiplicity correction of :func:`combine_attacks` (a statsmodels ``multipletests`` method).
CORRECTION = "holm"


def check_confidence(value: float, *, field: str = "confidence") -> float:
    """The validated confidence (or level) strictly between 0 and 1; shared with ``onerun``."""
    if not isinstance(value, (int, float)) or not 0 < float(value) < 1:
        raise UserInputError(field=field, value=value, allowed="a number strictly between 0 and 1")
    return float(value)


def _json_float(value: float) -> float | None:
    """JSON has no infinity: an unbounded value is written as null."""
    return float(value) if math.isfinite(value) else None


# --- binomial intervals -------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval of a binomial proportion."""

    low: float
    high: float
    confidence: float
    method: str

    def to_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "confidence": self.confidence,
                "method": self.method}


def binomial_interval(*, successes: int, trials: int, confidence: float = DEFAULT_CONFIDENCE,
                      method: str = "beta") -> Interval:
    """Interval of k successes in n trials. Clopper–Pearson ("beta") is the default because it
    never under-covers, which a reviewer can rely on near 0 and 1 where strong attacks live;
    Wilson is shorter on average but only approximately covers."""
    confidence = check_confidence(confidence)
    if method not in INTERVAL_METHODS:
        raise UserInputError(field="method", value=method, allowed=f"one of {INTERVAL_METHODS}")
    if not isinstance(trials, (int, np.integer)) or trials < 1:
        raise UserInputError(field="trials", value=trials, allowed="an integer >= 1")
    if not isinstance(successes, (int, np.integer)) or not 0 <= successes <= trials:
        raise UserInputError(field="successes", value=successes,
                             allowed=f"an integer in 0..{trials}")
    low, high = proportion_confint(int(successes), int(trials), alpha=1 - confidence,
                                   method=method)
    return Interval(low=float(low), high=float(high), confidence=confidence, method=method)


def _one_sided_cp(successes: np.ndarray, trials: int | np.ndarray,
                  level: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper–Pearson (lower, upper) bounds, each failing with probability
    ``level``: the two-sided interval at 2 x level has exactly these ends."""
    low, high = proportion_confint(successes, trials, alpha=2 * level, method="beta")
    return np.asarray(low, dtype=float), np.asarray(high, dtype=float)


# --- one attack ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TprAtFpr:
    """TPR at a threshold set on the non-members so that their FPR is at most ``target_fpr``."""

    target_fpr: float
    threshold: float  # predicted member iff score > threshold
    fpr: float  # achieved on the non-members, <= target_fpr
    tpr: float
    tpr_low: float
    tpr_high: float
    meaningful: bool  # False when fewer than 1 / target_fpr non-members

    def to_dict(self) -> dict[str, Any]:
        return {"target_fpr": self.target_fpr, "threshold": self.threshold, "fpr": self.fpr,
                "tpr": self.tpr, "tpr_low": self.tpr_low, "tpr_high": self.tpr_high,
                "meaningful": self.meaningful}


@dataclass(frozen=True)
class AttackStatistics:
    """One attack on one layer, every number with its interval (all at ``confidence``)."""

    n_members: int
    n_nonmembers: int
    confidence: float
    threshold: float  # predicted member iff score > threshold
    accuracy_is_optimistic: bool
    accuracy_note: str
    accuracy: float  # balanced accuracy at ``threshold``
    accuracy_low: float  # Clopper–Pearson
    accuracy_high: float
    accuracy_correct: int  # the interval's successes ...
    accuracy_trials: int  # ... out of these trials
    auc: float
    auc_low: float  # DeLong
    auc_high: float
    auc_method: str
    p_value: float  # one-sided Mann–Whitney U against chance
    tpr_at_fpr: tuple[TprAtFpr, ...]
    roc_fpr: tuple[float, ...]
    roc_tpr: tuple[float, ...]

    @property
    def accuracy_half_width(self) -> float:
        return (self.accuracy_high - self.accuracy_low) / 2

    def to_dict(self) -> dict[str, Any]:
        return {"n_members": self.n_members, "n_nonmembers": self.n_nonmembers,
                "confidence": self.confidence, "threshold": self.threshold,
                "accuracy_is_optimistic": self.accuracy_is_optimistic,
                "accuracy_note": self.accuracy_note, "accuracy": self.accuracy,
                "accuracy_low": self.accuracy_low, "accuracy_high": self.accuracy_high,
                "accuracy_correct": self.accuracy_correct,
                "accuracy_trials": self.accuracy_trials, "auc": self.auc,
                "auc_low": self.auc_low, "auc_high": self.auc_high,
                "auc_method": self.auc_method, "p_value": self.p_value,
                "tpr_at_fpr": [t.to_dict() for t in self.tpr_at_fpr],
                "roc_fpr": list(self.roc_fpr), "roc_tpr": list(self.roc_tpr)}


def _check_labels_scores(labels: Any, scores: Any) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels)
    s = np.asarray(scores, dtype=float)
    if y.ndim != 1 or s.ndim != 1 or len(y) != len(s):
        raise UserInputError(field="labels/scores", value=f"shapes {y.shape} and {s.shape}",
                             allowed="two 1-d arrays of one length")
    if not np.isin(y, (0, 1)).all():
        raise UserInputError(field="labels", value=sorted(set(np.unique(y).tolist()))[:5],
                             allowed="0 (non-member) and 1 (member) only")
    if not np.isfinite(s).all():
        raise UserInputError(field="scores", value="non-finite values",
                             allowed="finite numbers")
    y = y.astype(bool)
    if y.all() or not y.any():
        raise UserInputError(field="labels", value=f"{int(y.sum())} members of {len(y)}",
                             allowed="at least one member and one non-member")
    return y, s


def _roc_counts(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """True- and false-positive counts per distinct score, from (0, 0) to (n1, n0), with the
    threshold giving each under "member iff score > threshold" (-inf for the last)."""
    order = np.argsort(-s, kind="stable")
    s_desc, y_desc = s[order], y[order]
    last_of_value = np.r_[np.flatnonzero(np.diff(s_desc)), len(s_desc) - 1]
    tps = np.cumsum(y_desc)[last_of_value]
    fps = last_of_value + 1 - tps
    return np.r_[0, tps], np.r_[0, fps], np.r_[s_desc[last_of_value], -np.inf]


def roc_points(*, labels: Any, scores: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every ROC point (one per distinct score) with its threshold, from (0, 0) to (1, 1).

    ``thresholds[i]`` is the value with "member iff score > threshold" giving point i; the last
    point (everything a member) has threshold -inf.
    """
    y, s = _check_labels_scores(labels, scores)
    tps, fps, thresholds = _roc_counts(y, s)
    return fps / fps[-1], tps / tps[-1], thresholds


def thin_roc(*, fpr: np.ndarray, tpr: np.ndarray,
             max_points: int = MAX_ROC_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` ROC points that keep the curve's shape on linear and log-FPR axes.

    Half the budget is a geometric FPR grid from the smallest non-zero FPR to 1 (the low-FPR
    regime a log plot shows), half a linear grid; each grid value keeps the last point at or
    below it (the staircase corner with the highest TPR there), plus both endpoints and the top
    of the FPR = 0 segment (the attack's zero-false-alarm TPR).
    """
    if not isinstance(max_points, (int, np.integer)) or max_points < MIN_ROC_POINTS:
        raise UserInputError(field="max_points", value=max_points,
                             allowed=f"an integer >= {MIN_ROC_POINTS}")
    fpr = np.asarray(fpr, dtype=float)
    tpr = np.asarray(tpr, dtype=float)
    n = len(fpr)
    if n <= max_points:
        return fpr, tpr
    positive = fpr[fpr > 0]
    budget = max_points - 3
    log_grid = np.geomspace(positive.min(), 1.0, budget - budget // 2)
    lin_grid = np.linspace(0.0, 1.0, budget // 2)
    grid = np.concatenate([log_grid, lin_grid])
    picks = np.searchsorted(fpr, grid, side="right") - 1
    zero_top = np.searchsorted(fpr, 0.0, side="right") - 1
    keep = np.unique(np.concatenate([[0, zero_top, n - 1], picks]))
    return fpr[keep], tpr[keep]


def delong_auc_variance(*, members: Any, nonmembers: Any) -> tuple[float, float]:
    """The AUC (ties count 1/2) and DeLong's estimate of its variance.

    DeLong, DeLong & Clarke-Pearson (Biometrics 1988): the AUC is a two-sample U-statistic whose
    variance is S10 / m + S01 / n, S10 the sample variance over the m members of each one's
    placement (its share of non-members below it) and S01 that over the n non-members of each
    one's share of members above it. The placements come from midranks (Sun & Xu, IEEE Signal
    Processing Letters 2014): a member's rank among all scores less its rank among the members
    counts the non-members below it, ties 1/2. Three sorts: O(n log n), where the bootstrap it
    replaced evaluated the AUC a thousand times.
    """
    x = np.asarray(members, dtype=float)
    y = np.asarray(nonmembers, dtype=float)
    m, n = len(x), len(y)
    both = stats.rankdata(np.concatenate([x, y]))
    member_place = (both[:m] - stats.rankdata(x)) / n
    nonmember_place = 1 - (both[m:] - stats.rankdata(y)) / m
    variance = member_place.var(ddof=1) / m + nonmember_place.var(ddof=1) / n
    return float(member_place.mean()), float(variance)


def _auc_interval(members: np.ndarray, nonmembers: np.ndarray, *, auc: float,
                  confidence: float) -> tuple[float, float]:
    """DeLong's normal interval around ``auc``, clipped to [0, 1].

    Why this: the AUC, a U-statistic, is asymptotically normal and DeLong's variance estimate
    is consistent, so the interval covers like the stratified percentile bootstrap it replaced
    (both let members and non-members vary independently) at three sorts instead of a thousand
    resampled AUCs, which were most of the audit's scoring time. Like the bootstrap's, it
    shrinks to a point when the classes are perfectly separated (every placement 0 or 1): a
    sample of that size shows no spread there.
    """
    _, variance = delong_auc_variance(members=members, nonmembers=nonmembers)
    half = stats.norm.ppf(0.5 + confidence / 2) * math.sqrt(max(variance, 0.0))
    return max(auc - half, 0.0), min(auc + half, 1.0)


def max_false_positives(alpha: float, n_nonmembers: int) -> int:
    """Largest k with k / n <= alpha, robust to floating-point products like 0.01 x 1000."""
    k = math.floor(alpha * n_nonmembers)
    while k + 1 <= n_nonmembers and (k + 1) / n_nonmembers <= alpha:
        k += 1
    while k > 0 and k / n_nonmembers > alpha:
        k -= 1
    return k


def _tpr_at_fprs(members: np.ndarray, nonmembers: np.ndarray, *, fprs: Sequence[float],
                 confidence: float) -> tuple[TprAtFpr, ...]:
    """TPR at each FPR target; the threshold is the (k+1)-th largest non-member score with k
    the most false positives the target allows, so at most k non-members lie above it."""
    if not fprs:
        return ()
    n1, n0 = len(members), len(nonmembers)
    descending = np.sort(nonmembers)[::-1]
    thresholds = [float(descending[max_false_positives(a, n0)]) for a in fprs]  # k < n0: alpha < 1
    tps = np.array([np.count_nonzero(members > t) for t in thresholds])
    lows, highs = proportion_confint(tps, n1, alpha=1 - confidence, method="beta")
    return tuple(
        TprAtFpr(target_fpr=float(a), threshold=t,
                 fpr=float(np.count_nonzero(nonmembers > t) / n0), tpr=int(tp) / n1,
                 tpr_low=float(low), tpr_high=float(high), meaningful=n0 * a >= 1)
        for a, t, tp, low, high in zip(fprs, thresholds, tps, np.atleast_1d(lows),
                                       np.atleast_1d(highs), strict=True))


def _check_attack_options(*, fprs: Sequence[float], max_roc_points: int) -> None:
    """Reject options :func:`attack_statistics` cannot honour before any work is done."""
    for alpha in fprs:
        if not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
            raise UserInputError(field="fprs", value=list(fprs),
                                 allowed="false-positive rates strictly between 0 and 1")
    if not isinstance(max_roc_points, (int, np.integer)) or max_roc_points < MIN_ROC_POINTS:
        raise UserInputError(field="max_roc_points", value=max_roc_points,
                             allowed=f"an integer >= {MIN_ROC_POINTS}")


def _decision_threshold(given: float | None, *, tps: np.ndarray, fps: np.ndarray,
                        thresholds: np.ndarray, n1: int, n0: int) -> tuple[float, bool, str]:
    """(threshold, accuracy_is_optimistic, note): the given label-free threshold, or else the
    accuracy-maximising one on the target's own labels, flagged as optimistic."""
    if given is None:
        # Balanced accuracy x 2 n1 n0 in integers, so equal accuracies tie exactly and the
        # first (highest) threshold wins; the last point (all members) is 0.5 anyway.
        twice = tps[:-1] * n0 + (n0 - fps[:-1]) * n1
        best = int(np.argmax(twice))
        return (float(thresholds[best]), True,
                "threshold maximises accuracy on the target's own labels: the accuracy is "
                "optimistic and its interval ignores that selection")
    if not math.isfinite(given):
        raise UserInputError(field="decision_threshold", value=given,
                             allowed="a finite number or None")
    return float(given), False, "threshold given without the target's labels"


def attack_statistics(*, labels: Any, scores: Any, decision_threshold: float | None = None,
                      fprs: Sequence[float] = DEFAULT_FPRS,
                      confidence: float = DEFAULT_CONFIDENCE,
                      max_roc_points: int = MAX_ROC_POINTS) -> AttackStatistics:
    """Every number of one attack on one layer, with its interval and significance.

    ``decision_threshold`` must be chosen without the target's labels (fitted on reference
    models, or the attack's natural one such as a log-likelihood ratio of 0); with ``None`` the
    accuracy-maximising threshold on these very labels is used and the result is flagged
    ``accuracy_is_optimistic`` (the maximum over thresholds is biased upwards, and its interval
    does not account for the selection). The AUC and the p-value use no threshold.

    Accuracy is balanced accuracy (mean of TPR and TNR). Its Clopper–Pearson interval counts the
    correct decisions over the 2m examples of balanced members and non-members; with unequal
    classes it counts round(accuracy x 2 min(n1, n0)) of 2 min(n1, n0), the balanced sample
    size the data supports. The p-value is the one-sided Mann–Whitney U test (members' scores
    stochastically larger), distribution-free under the null of exchangeable member and
    non-member scores; its U statistic over n1 x n0 is the AUC. scipy's "auto" method: the
    exact null distribution when a class has at most 8 examples and no ties, else the normal
    approximation with tie correction (the exact one takes a minute at 200 per class).
    """
    confidence = check_confidence(confidence)
    y, s = _check_labels_scores(labels, scores)
    _check_attack_options(fprs=fprs, max_roc_points=max_roc_points)
    members, nonmembers = s[y], s[~y]
    n1, n0 = len(members), len(nonmembers)
    if min(n1, n0) < MIN_PER_CLASS:
        raise UserInputError(field="labels", value=f"{n1} members and {n0} non-members",
                             allowed=f"at least {MIN_PER_CLASS} of each")

    tps, fps, thresholds = _roc_counts(y, s)
    fpr, tpr = fps / n0, tps / n1
    threshold, optimistic, note = _decision_threshold(decision_threshold, tps=tps, fps=fps,
                                                      thresholds=thresholds, n1=n1, n0=n0)
    tpr_t = np.count_nonzero(members > threshold) / n1
    tnr_t = np.count_nonzero(nonmembers <= threshold) / n0
    accuracy = float((tpr_t + tnr_t) / 2)
    trials = 2 * min(n1, n0)
    correct = round(accuracy * trials)
    acc_interval = binomial_interval(successes=correct, trials=trials, confidence=confidence)

    test = stats.mannwhitneyu(members, nonmembers, alternative="greater")
    auc = float(test.statistic) / (n1 * n0)
    auc_low, auc_high = _auc_interval(members, nonmembers, auc=auc, confidence=confidence)
    roc_fpr, roc_tpr = thin_roc(fpr=fpr, tpr=tpr, max_points=max_roc_points)
    return AttackStatistics(
        n_members=n1, n_nonmembers=n0, confidence=confidence, threshold=threshold,
        accuracy_is_optimistic=optimistic, accuracy_note=note, accuracy=accuracy,
        accuracy_low=acc_interval.low, accuracy_high=acc_interval.high,
        accuracy_correct=correct, accuracy_trials=trials, auc=auc, auc_low=auc_low,
        auc_high=auc_high,
        auc_method=AUC_METHOD,
        p_value=float(test.pvalue),
        tpr_at_fpr=_tpr_at_fprs(members, nonmembers, fprs=fprs, confidence=confidence),
        roc_fpr=tuple(float(v) for v in roc_fpr), roc_tpr=tuple(float(v) for v in roc_tpr))


# --- many attacks -------------------------------------------------------------------------


@dataclass(frozen=True)
class CombinedAttacks:
    """The peak over layers x attacks and the family-wise decision whether anything leaks.

    Levels: ``leak_detected`` controls the family-wise error rate at ``alpha`` (Holm);
    ``peak_upper`` bounds the largest true accuracy of all ``n_tests`` attacks simultaneously
    with confidence 1 - alpha (each attack's one-sided Clopper–Pearson bound at 1 - alpha /
    n_tests, Bonferroni); ``peak_half_width`` is half the peak attack's own two-sided interval
    (at the confidence its statistics were computed with), which ignores that it was selected.
    """

    n_tests: int
    alpha: float
    correction: str
    peak_layer: str
    peak_attack: str
    peak_accuracy: float
    peak_half_width: float
    peak_confidence: float
    peak_p_value: float
    peak_p_corrected: float
    min_p_corrected: float
    min_p_layer: str
    min_p_attack: str
    leak_detected: bool
    peak_upper: float
    accuracy_is_optimistic: bool
    corrected_p_values: tuple[tuple[str, str, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"n_tests": self.n_tests, "alpha": self.alpha, "correction": self.correction,
                "peak_layer": self.peak_layer, "peak_attack": self.peak_attack,
                "peak_accuracy": self.peak_accuracy, "peak_half_width": self.peak_half_width,
                "peak_confidence": self.peak_confidence, "peak_p_value": self.peak_p_value,
                "peak_p_corrected": self.peak_p_corrected,
                "min_p_corrected": self.min_p_corrected, "min_p_layer": self.min_p_layer,
                "min_p_attack": self.min_p_attack, "leak_detected": self.leak_detected,
                "peak_upper": self.peak_upper,
                "accuracy_is_optimistic": self.accuracy_is_optimistic,
                "corrected_p_values": [{"layer": layer, "attack": attack, "p": p}
                                       for layer, attack, p in self.corrected_p_values]}


def combine_attacks(*, per_attack_stats: Mapping[tuple[str, str], AttackStatistics],
                    alpha: float = DEFAULT_ALPHA) -> CombinedAttacks:
    """Peak accuracy over (layer, attack) pairs and whether any attack beats chance.

    Holm rather than Bonferroni: both control the family-wise error rate under any dependence
    (attacks on one model's layers are strongly dependent), and the leak decision (smallest
    adjusted p < alpha) is identical for the two, but Holm's per-attack adjusted p-values are
    never larger, so fewer real leaks are called insignificant. The peak is chosen by accuracy
    (ties: smaller p-value); its adjusted p-value is reported beside the family's smallest.
    """
    alpha = check_confidence(alpha, field="alpha")
    if not per_attack_stats:
        raise UserInputError(field="per_attack_stats", value="empty",
                             allowed="at least one (layer, attack) entry")
    keys = list(per_attack_stats)
    items = [per_attack_stats[k] for k in keys]
    m = len(items)
    raw = np.array([a.p_value for a in items])
    _, adjusted, _, _ = multipletests(raw, alpha=alpha, method=CORRECTION)
    peak = min(range(m), key=lambda i: (-items[i].accuracy, raw[i]))
    smallest = int(np.argmin(adjusted))
    correct = np.array([a.accuracy_correct for a in items])
    trials = np.array([a.accuracy_trials for a in items])
    _, uppers = _one_sided_cp(correct, trials, alpha / m)
    return CombinedAttacks(
        n_tests=m, alpha=alpha, correction=CORRECTION,
        peak_layer=str(keys[peak][0]), peak_attack=str(keys[peak][1]),
        peak_accuracy=items[peak].accuracy, peak_half_width=items[peak].accuracy_half_width,
        peak_confidence=items[peak].confidence, peak_p_value=float(raw[peak]),
        peak_p_corrected=float(adjusted[peak]), min_p_corrected=float(adjusted[smallest]),
        min_p_layer=str(keys[smallest][0]), min_p_attack=str(keys[smallest][1]),
        leak_detected=bool(adjusted[smallest] < alpha), peak_upper=float(np.max(uppers)),
        accuracy_is_optimistic=any(a.accuracy_is_optimistic for a in items),
        corrected_p_values=tuple((str(k[0]), str(k[1]), float(p))
                                 for k, p in zip(keys, adjusted, strict=True)))


# --- consistency with (epsilon, delta)-DP -------------------------------------------------


@dataclass(frozen=True)
class DPConsistency:
    """Whether measured ROC points are consistent with a claimed (epsilon, delta)-DP.

    ``epsilon_lower`` is the empirical epsilon lower bound at ``confidence`` (all points'
    bounds hold simultaneously); ``consistent`` is False when it exceeds the claimed epsilon.
    ``worst_epsilon_estimate`` is the plug-in epsilon at the worst point (None = unbounded).
    """

    epsilon: float
    delta: float
    confidence: float
    bound_level: float  # failure probability of each one-sided bound
    n_points: int
    consistent: bool
    n_violations: int
    worst_index: int
    worst_fpr: float
    worst_tpr: float
    worst_epsilon_estimate: float
    epsilon_lower: float

    def to_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.delta, "confidence": self.confidence,
                "bound_level": self.bound_level, "n_points": self.n_points,
                "consistent": self.consistent, "n_violations": self.n_violations,
                "worst_index": self.worst_index, "worst_fpr": self.worst_fpr,
                "worst_tpr": self.worst_tpr,
                "worst_epsilon_estimate": _json_float(self.worst_epsilon_estimate),
                "epsilon_lower": self.epsilon_lower}


def _epsilon_from_rates(tpr: np.ndarray, fpr: np.ndarray, delta: float) -> np.ndarray:
    """The smallest epsilon with TPR <= e^eps FPR + delta and TNR <= e^eps FNR + delta
    (both directions of the hypothesis-testing region); -inf where a side carries no
    information, +inf where it is violated for every epsilon."""
    with np.errstate(divide="ignore", invalid="ignore"):
        direct = np.log(tpr - delta) - np.log(fpr)
        reverse = np.log(1 - fpr - delta) - np.log(1 - tpr)
    direct = np.where(tpr - delta > 0, direct, -np.inf)
    reverse = np.where(1 - fpr - delta > 0, reverse, -np.inf)
    return np.maximum(direct, reverse)


def consistent_with_dp(*, fpr: Any, tpr: Any, n_members: int, n_nonmembers: int,
                       epsilon: float, delta: float, confidence: float = DEFAULT_CONFIDENCE,
                       simultaneous: bool = True) -> DPConsistency:
    """Check measured ROC points against the (epsilon, delta)-DP trade-off region.

    Kairouz, Oh & Viswanath (arXiv 1311.0776, Section 2, after Wasserman & Zhou): a mechanism
    is (epsilon, delta)-DP iff every test between neighbouring datasets has
    FPR + e^eps FNR >= 1 - delta and e^eps FPR + FNR >= 1 - delta, i.e.
    TPR <= e^eps FPR + delta and TNR <= e^eps FNR + delta.
    A point violates the claim only if it does so within its intervals: the Clopper–Pearson
    lower bound of TPR (over the members) against the upper bound of FPR (over the
    non-members); those two bounds give both inequalities (TNR = 1 - FPR, FNR = 1 - TPR).
    With ``simultaneous`` the 2 x n_points one-sided bounds are Bonferroni-corrected, so a
    reported violation (and ``epsilon_lower``) holds at ``confidence`` even though the worst of
    many points is picked; pass few preselected points (e.g. the TPR-at-FPR points) for power.
    """
    confidence = check_confidence(confidence)
    f = np.atleast_1d(np.asarray(fpr, dtype=float))
    t = np.atleast_1d(np.asarray(tpr, dtype=float))
    if f.shape != t.shape or f.ndim != 1 or len(f) == 0:
        raise UserInputError(field="fpr/tpr", value=f"shapes {f.shape} and {t.shape}",
                             allowed="two non-empty 1-d arrays of one length")
    if not (np.all((f >= 0) & (f <= 1)) and np.all((t >= 0) & (t <= 1))):
        raise UserInputError(field="fpr/tpr", value="rates outside [0, 1]",
                             allowed="rates in [0, 1]")
    for name, n in (("n_members", n_members), ("n_nonmembers", n_nonmembers)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise UserInputError(field=name, value=n, allowed="an integer >= 1")
    if not math.isfinite(epsilon) or epsilon < 0:
        raise UserInputError(field="epsilon", value=epsilon, allowed="a finite number >= 0")
    if not 0 <= delta < 1:
        raise UserInputError(field="delta", value=delta, allowed="a number in [0, 1)")
    tp = np.rint(t * n_members).astype(np.int64)
    fp = np.rint(f * n_nonmembers).astype(np.int64)
    level = (1 - confidence) / (2 * len(f) if simultaneous else 2)
    tpr_low, _ = _one_sided_cp(tp, n_members, level)
    _, fpr_high = _one_sided_cp(fp, n_nonmembers, level)
    lower = np.maximum(_epsilon_from_rates(tpr_low, fpr_high, delta), 0.0)
    estimate = _epsilon_from_rates(tp / n_members, fp / n_nonmembers, delta)
    worst = int(np.lexsort((-estimate, -lower))[0])
    epsilon_lower = float(lower[worst])
    return DPConsistency(
        epsilon=float(epsilon), delta=float(delta), confidence=confidence, bound_level=level,
        n_points=len(f), consistent=epsilon_lower <= epsilon,
        n_violations=int(np.count_nonzero(lower > epsilon)), worst_index=worst,
        worst_fpr=float(fp[worst] / n_nonmembers), worst_tpr=float(tp[worst] / n_members),
        worst_epsilon_estimate=float(max(estimate[worst], 0.0)), epsilon_lower=epsilon_lower)
