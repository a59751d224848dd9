"""The audit's statistics against known answers: closed-form intervals, exact small-sample
p-values, calibration under a synthetic null, power under a strong signal, and the one-run
canary bound against the paper's printed numbers and its delta = 0 closed form."""

from __future__ import annotations

import gc
import itertools
import json
import math
import time

import numpy as np
import pytest
from scipy import special, stats
from sklearn.metrics import roc_auc_score

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.audit.stats.attacks import (
    AttackStatistics,
    attack_statistics,
    binomial_interval,
    combine_attacks,
    consistent_with_dp,
    delong_auc_variance,
    roc_points,
    thin_roc,
)
from dpsweep.trainables.audit.stats.onerun import (
    canary_audit,
    canary_guesses,
    epsilon_lower_bound,
    one_run_p_value,
)

ALPHA = 0.05
#: Quantile of the binomial slack allowed on a simulated error rate.
SLACK_QUANTILE = 0.999


def _null_attack(rng: np.random.Generator, n: int, **kwargs: object) -> AttackStatistics:
    labels = np.r_[np.ones(n, dtype=int), np.zeros(n, dtype=int)]
    return attack_statistics(labels=labels, scores=rng.normal(size=2 * n), **kwargs)


def _shifted(rng: np.random.Generator, n: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    labels = np.r_[np.ones(n, dtype=int), np.zeros(n, dtype=int)]
    return labels, np.r_[rng.normal(shift, 1.0, n), rng.normal(0.0, 1.0, n)]


# --- binomial intervals -------------------------------------------------------------------


def test_clopper_pearson_matches_closed_forms_and_textbook_values() -> None:
    # k = 0 and k = n have closed forms: (0, 1 - (a/2)^(1/n)) and ((a/2)^(1/n), 1).
    none = binomial_interval(successes=0, trials=10)
    assert none.low == 0.0
    assert none.high == pytest.approx(1 - 0.025 ** (1 / 10), abs=1e-12)
    assert none.high == pytest.approx(0.3084971078, abs=1e-9)
    every = binomial_interval(successes=10, trials=10)
    assert (every.low, every.high) == (pytest.approx(0.025 ** 0.1, abs=1e-12), 1.0)
    # 5 of 10: the tabulated exact interval (0.1871, 0.8129).
    half = binomial_interval(successes=5, trials=10)
    assert (half.low, half.high) == (pytest.approx(0.187086, abs=1e-6),
                                     pytest.approx(0.812914, abs=1e-6))
    wilson = binomial_interval(successes=5, trials=10, method="wilson")
    assert (wilson.low, wilson.high) == (pytest.approx(0.236593, abs=1e-6),
                                         pytest.approx(0.763407, abs=1e-6))
    assert binomial_interval(successes=5, trials=10, confidence=0.99).low < half.low


@pytest.mark.parametrize("kwargs", [
    {"successes": 11, "trials": 10},
    {"successes": 1, "trials": 0},
    {"successes": 1, "trials": 10, "method": "wald"},
    {"successes": 1, "trials": 10, "confidence": 1.0},
])
def test_binomial_interval_rejects_bad_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(UserInputError):
        binomial_interval(**kwargs)


# --- one attack ---------------------------------------------------------------------------


def test_small_example_by_hand() -> None:
    labels = [1, 1, 1, 0, 0, 0]
    scores = [3.0, 2.0, 0.5, 1.0, 0.0, -1.0]
    given = attack_statistics(labels=labels, scores=scores, decision_threshold=0.0)
    # Members > 0: 3 of 3; non-members <= 0: 2 of 3 -> balanced accuracy 5/6 over 6 decisions.
    assert given.accuracy == pytest.approx(5 / 6)
    assert (given.accuracy_correct, given.accuracy_trials) == (5, 6)
    exact = binomial_interval(successes=5, trials=6)
    assert (given.accuracy_low, given.accuracy_high) == (exact.low, exact.high)
    assert not given.accuracy_is_optimistic
    # 8 of 9 member/non-member pairs are ordered right; U >= 8 in 2 of the C(6,3) = 20 equally
    # likely arrangements under the null: exact p = 0.1.
    assert given.auc == pytest.approx(8 / 9)
    assert given.p_value == pytest.approx(0.1)
    # No threshold given: the first accuracy-maximising one (scores > 1) and a flag.
    fitted = attack_statistics(labels=labels, scores=scores)
    assert fitted.threshold == 1.0
    assert fitted.accuracy == pytest.approx(5 / 6)
    assert fitted.accuracy_is_optimistic
    assert "optimistic" in fitted.accuracy_note


def test_unbalanced_accuracy_counts_the_balanced_sample() -> None:
    rng = np.random.default_rng(3)
    labels = np.r_[np.ones(30, dtype=int), np.zeros(50, dtype=int)]
    result = attack_statistics(labels=labels, scores=rng.normal(size=80), decision_threshold=0.0)
    assert result.accuracy_trials == 60
    assert result.accuracy_correct == round(result.accuracy * 60)


def test_auc_matches_sklearn_and_its_interval_covers_the_truth() -> None:
    shift = 0.5
    true_auc = stats.norm.cdf(shift / math.sqrt(2))  # P(N(shift, 1) > N(0, 1))
    rng = np.random.default_rng(11)
    repeats, covered = 120, 0
    for _ in range(repeats):
        labels, scores = _shifted(rng, 100, shift)
        result = attack_statistics(labels=labels, scores=scores, fprs=(0.01,))
        assert result.auc == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
        assert result.auc_low <= result.auc <= result.auc_high
        covered += result.auc_low <= true_auc <= result.auc_high
    # 95% intervals: coverage near 0.95 (binomial sd 0.02 at 120 repeats).
    assert 0.87 <= covered / repeats <= 1.0


def test_auc_interval_is_exact_with_ties_and_reproducible() -> None:
    rng = np.random.default_rng(5)
    labels, scores = _shifted(rng, 300, 0.4)
    scores = np.round(scores, 1)  # many ties
    first = attack_statistics(labels=labels, scores=scores)
    assert first.auc == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    again = attack_statistics(labels=labels, scores=scores)
    assert (again.auc_low, again.auc_high) == (first.auc_low, first.auc_high)


def _brute_force_delong(members: np.ndarray, nonmembers: np.ndarray) -> tuple[float, float]:
    """DeLong's structural components from every member/non-member pair (O(n^2))."""
    psi = (members[:, None] > nonmembers[None, :]) + 0.5 * (members[:, None] == nonmembers[None, :])
    v10, v01 = psi.mean(axis=1), psi.mean(axis=0)
    s10 = np.sum((v10 - psi.mean()) ** 2) / (len(members) - 1)
    s01 = np.sum((v01 - psi.mean()) ** 2) / (len(nonmembers) - 1)
    return float(psi.mean()), float(s10 / len(members) + s01 / len(nonmembers))


def test_delong_variance_equals_the_pairwise_structural_components() -> None:
    rng = np.random.default_rng(13)
    for m, n, levels in ((2, 2, 3), (5, 9, 4), (37, 23, 6), (120, 80, 10), (50, 50, 1000)):
        members = rng.integers(0, levels, m) + (rng.random() < 0.5)  # ties within and across
        nonmembers = rng.integers(0, levels, n).astype(float)
        auc, variance = delong_auc_variance(members=members, nonmembers=nonmembers)
        want_auc, want_variance = _brute_force_delong(members.astype(float), nonmembers)
        assert auc == pytest.approx(want_auc, abs=1e-12)
        assert variance == pytest.approx(want_variance, rel=1e-10, abs=1e-15)
        labels = np.r_[np.ones(m, dtype=int), np.zeros(n, dtype=int)]
        result = attack_statistics(labels=labels, scores=np.r_[members, nonmembers])
        half = stats.norm.ppf(0.975) * math.sqrt(want_variance)
        assert result.auc_low == pytest.approx(max(want_auc - half, 0.0), abs=1e-12)
        assert result.auc_high == pytest.approx(min(want_auc + half, 1.0), abs=1e-12)
        assert "DeLong" in result.auc_method


def test_delong_interval_covers_the_known_auc_of_two_gaussians() -> None:
    # P(N(d, 1) > N(0, 1)) = Phi(d / sqrt 2): the interval's coverage over many samples.
    rng = np.random.default_rng(17)
    repeats = 2000
    for shift, n in ((0.5, 150), (1.5, 300)):
        true_auc = stats.norm.cdf(shift / math.sqrt(2))
        covered = 0
        for _ in range(repeats):
            members, nonmembers = rng.normal(shift, 1.0, n), rng.normal(0.0, 1.0, n)
            auc, variance = delong_auc_variance(members=members, nonmembers=nonmembers)
            half = stats.norm.ppf(0.975) * math.sqrt(variance)
            covered += auc - half <= true_auc <= auc + half
        # 95% nominal; binomial sd at 2,000 repeats is 0.005
        assert 0.93 <= covered / repeats <= 0.97


def test_perfectly_separated_classes_give_a_point_interval_at_one() -> None:
    labels = np.r_[np.ones(20, dtype=int), np.zeros(30, dtype=int)]
    result = attack_statistics(labels=labels, scores=np.r_[np.arange(20) + 100.0, np.arange(30)])
    assert (result.auc_low, result.auc, result.auc_high) == (1.0, 1.0, 1.0)


def test_tpr_at_fpr_never_exceeds_the_target_on_the_nonmembers() -> None:
    rng = np.random.default_rng(7)
    for n0 in (37, 100, 999, 1000, 2500):
        labels = np.r_[np.ones(400, dtype=int), np.zeros(n0, dtype=int)]
        for decimals in (None, 1):  # continuous scores, then heavy ties
            scores = np.r_[rng.normal(1.0, 1.0, 400), rng.normal(0.0, 1.0, n0)]
            if decimals is not None:
                scores = np.round(scores, decimals)
            result = attack_statistics(labels=labels, scores=scores, fprs=(0.1, 0.01, 0.001))
            nonmembers, members = scores[labels == 0], scores[labels == 1]
            for point in result.tpr_at_fpr:
                assert np.mean(nonmembers > point.threshold) == point.fpr
                assert point.fpr <= point.target_fpr
                assert point.tpr == np.mean(members > point.threshold)
                exact = binomial_interval(successes=round(point.tpr * 400), trials=400)
                assert (point.tpr_low, point.tpr_high) == (exact.low, exact.high)
                assert point.meaningful == (n0 >= 1 / point.target_fpr)
                if decimals is None:  # continuous: the threshold uses the whole allowance
                    assert point.fpr == math.floor(point.target_fpr * n0 + 1e-9) / n0


def test_thinned_roc_keeps_its_shape_on_a_log_fpr_axis() -> None:
    rng = np.random.default_rng(2)
    labels, scores = _shifted(rng, 20_000, 1.0)
    fpr, tpr, thresholds = roc_points(labels=labels, scores=scores)
    assert len(fpr) == 40_001 and thresholds[-1] == -np.inf
    kept_fpr, kept_tpr = thin_roc(fpr=fpr, tpr=tpr, max_points=200)
    assert len(kept_fpr) <= 200
    assert (kept_fpr[0], kept_tpr[0], kept_fpr[-1], kept_tpr[-1]) == (0.0, 0.0, 1.0, 1.0)
    assert kept_tpr[1] == tpr[fpr == 0].max()  # the zero-false-alarm TPR survives
    positive = kept_fpr[kept_fpr > 0]
    # The geometric half of the budget (99 grid values from the smallest FPR to 1): between two
    # kept points, every skipped point of the full curve lies within one grid step of the upper
    # one, so a log-FPR plot loses nothing wider than a step.
    step = math.log10(1 / fpr[fpr > 0].min()) / (99 - 1)
    distinct = np.unique(fpr[fpr > 0])
    for low, high in itertools.pairwise(positive):
        first_skipped = distinct[np.searchsorted(distinct, low, side="right")]
        assert first_skipped == high or math.log10(high / first_skipped) <= step + 1e-9
    # Every kept point is a real ROC point, and the curve at 1e-3 and 1e-2 is unchanged.
    for target in (1e-3, 1e-2, 0.1):
        full = tpr[fpr <= target].max()
        thinned = kept_tpr[kept_fpr <= target].max()
        assert thinned == pytest.approx(full, abs=0.01)


# --- many attacks -------------------------------------------------------------------------


def test_null_p_values_are_uniform() -> None:
    rng = np.random.default_rng(20_240_601)
    p_values = [_null_attack(rng, 40, fprs=()).p_value for _ in range(400)]
    assert stats.kstest(p_values, "uniform").pvalue > 0.01


def test_null_leak_rate_and_peak_bound_hold_their_levels() -> None:
    rng = np.random.default_rng(42)
    layers, attacks, repeats = 4, 2, 120
    leaks = bound_misses = 0
    # statsmodels' Holm runs a full gc.collect() per call; frozen objects are skipped by it.
    gc.freeze()
    for _ in range(repeats):
        family = {(f"layer{i}", f"attack{j}"): _null_attack(rng, 30, decision_threshold=0.0,
                                                            fprs=())
                  for i in range(layers) for j in range(attacks)}
        combined = combine_attacks(per_attack_stats=family, alpha=ALPHA)
        assert combined.n_tests == layers * attacks
        leaks += combined.leak_detected
        bound_misses += combined.peak_upper < 0.5  # every true accuracy is 0.5 here
    gc.unfreeze()
    limit = stats.binom.ppf(SLACK_QUANTILE, repeats, ALPHA)
    assert leaks <= limit
    assert bound_misses <= limit


def test_strong_signal_is_detected_and_located() -> None:
    rng = np.random.default_rng(9)
    family = {(f"layer{i}", "loss"): _null_attack(rng, 200, decision_threshold=0.0)
              for i in range(4)}
    labels, scores = _shifted(rng, 200, 1.5)
    leaky = attack_statistics(labels=labels, scores=scores, decision_threshold=0.75)
    family[("layer2", "logreg")] = leaky
    combined = combine_attacks(per_attack_stats=family)
    assert combined.leak_detected
    assert (combined.peak_layer, combined.peak_attack) == ("layer2", "logreg")
    assert (combined.min_p_layer, combined.min_p_attack) == ("layer2", "logreg")
    assert combined.peak_accuracy == leaky.accuracy > 0.7
    assert combined.peak_half_width == pytest.approx((leaky.accuracy_high - leaky.accuracy_low) / 2)
    assert combined.peak_p_corrected == pytest.approx(min(1.0, 5 * leaky.p_value))  # Holm's 1st
    simultaneous = binomial_interval(successes=leaky.accuracy_correct,
                                     trials=leaky.accuracy_trials, confidence=1 - 2 * ALPHA / 5)
    assert combined.peak_upper == pytest.approx(simultaneous.high)
    assert not combined.accuracy_is_optimistic
    json.dumps(combined.to_dict(), allow_nan=False)
    json.dumps(leaky.to_dict(), allow_nan=False)


def test_ten_large_attacks_are_fast() -> None:
    rng = np.random.default_rng(1)
    data = [_shifted(rng, 2500, 0.1 * a) for a in range(10)]
    start = time.process_time()  # CPU time: other processes on the machine do not count
    for labels, scores in data:
        attack_statistics(labels=labels, scores=scores)
    # About 0.1 s of CPU (DeLong: three sorts per attack); a step quadratic in the examples
    # (a BCa jackknife) would take seconds per attack.
    assert time.process_time() - start < 8


@pytest.mark.parametrize("kwargs", [
    {"labels": [0, 1, 2], "scores": [0.0, 1.0, 2.0]},
    {"labels": [1, 1, 1], "scores": [0.0, 1.0, 2.0]},
    {"labels": [0, 1], "scores": [0.0, 1.0]},  # DeLong's variance needs two of each
    {"labels": [0, 0, 1, 1], "scores": [0.0, 1.0, 2.0, np.nan]},
    {"labels": [0, 0, 1, 1], "scores": [0.0, 1.0, 2.0, 3.0], "fprs": (0.0,)},
    {"labels": [0, 0, 1, 1], "scores": [0.0, 1.0, 2.0, 3.0], "max_roc_points": 2},
])
def test_attack_statistics_rejects_bad_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(UserInputError) as caught:
        attack_statistics(**kwargs)
    bad = {"labels", "scores"} & set(caught.value.field.split("/"))
    assert bad or caught.value.field in kwargs


# --- consistency with (epsilon, delta)-DP -------------------------------------------------


def test_dp_check_flags_a_point_above_the_privacy_region() -> None:
    result = consistent_with_dp(fpr=[0.01], tpr=[0.5], n_members=1000, n_nonmembers=1000,
                                epsilon=1.0, delta=1e-5)
    assert not result.consistent and result.n_violations == 1
    assert 1.0 < result.epsilon_lower < math.log((0.5 - 1e-5) / 0.01)
    assert result.worst_epsilon_estimate == pytest.approx(math.log((0.5 - 1e-5) / 0.01))
    # The reverse inequality (TNR <= e^eps FNR + delta) is checked too.
    reverse = consistent_with_dp(fpr=[0.5], tpr=[0.99], n_members=1000, n_nonmembers=1000,
                                 epsilon=1.0, delta=1e-5)
    assert not reverse.consistent
    json.dumps(result.to_dict(), allow_nan=False)


def test_dp_check_passes_points_on_the_boundary_and_picks_the_worst() -> None:
    eps = 1.0
    fpr = np.array([0.0, 0.01, 0.05, 0.2, 1.0])
    tpr = np.minimum(math.exp(eps) * fpr, 1.0)
    result = consistent_with_dp(fpr=fpr, tpr=tpr, n_members=10_000, n_nonmembers=10_000,
                                epsilon=eps, delta=0.0)
    assert result.consistent and result.n_violations == 0
    assert result.epsilon_lower < eps
    leaky = np.r_[tpr, 0.6]
    worst = consistent_with_dp(fpr=np.r_[fpr, 0.01], tpr=leaky, n_members=10_000,
                               n_nonmembers=10_000, epsilon=eps, delta=0.0)
    assert not worst.consistent
    assert (worst.worst_index, worst.worst_fpr, worst.worst_tpr) == (5, 0.01, 0.6)


def test_dp_check_lower_bound_has_its_closed_form() -> None:
    # A perfect point (FPR 0, TPR 1) on n = 1000 each, one point, delta = 0: each one-sided
    # bound fails with probability 0.025, so TPR >= 0.025^(1/n) and FPR <= 1 - 0.025^(1/n).
    n = 1000
    result = consistent_with_dp(fpr=[0.0], tpr=[1.0], n_members=n, n_nonmembers=n,
                                epsilon=0.0, delta=0.0)
    low = 0.025 ** (1 / n)
    assert result.bound_level == pytest.approx(0.025)
    assert result.epsilon_lower == pytest.approx(math.log(low / (1 - low)), rel=1e-9)
    assert result.worst_epsilon_estimate == math.inf
    assert result.to_dict()["worst_epsilon_estimate"] is None
    two = consistent_with_dp(fpr=[0.0, 0.0], tpr=[1.0, 1.0], n_members=n, n_nonmembers=n,
                             epsilon=0.0, delta=0.0)
    assert two.bound_level == pytest.approx(0.0125)  # Bonferroni over the points
    assert two.epsilon_lower < result.epsilon_lower


# --- one-run canary audit -----------------------------------------------------------------


def test_one_run_bound_reproduces_the_papers_numbers() -> None:
    # Steinke, Nasr & Jagielski (arXiv 2305.08846v1): Appendix D's worked example prints 0.673
    # (m = 1000, r = 100, v = 75, delta = 1e-4, 95%); Section 7 (Fig. 11) prints 2.675 for
    # m = 100,000, r = 1510, v = 1439, delta = 1e-5, 95% (digits truncated).
    assert epsilon_lower_bound(m=1000, r=100, v=75, delta=1e-4) == pytest.approx(0.673, abs=5e-4)
    figure = epsilon_lower_bound(m=100_000, r=1510, v=1439, delta=1e-5)
    assert 2.675 <= figure < 2.676


@pytest.mark.parametrize(("r", "v"), [(1000, 1000), (100, 75), (500, 300), (37, 30)])
def test_one_run_bound_with_zero_delta_is_the_binomial_closed_form(r: int, v: int) -> None:
    # delta = 0: reject eps iff P[Binomial(r, e^eps/(1+e^eps)) >= v] < 0.05, i.e. eps below
    # logit of the one-sided Clopper–Pearson lower bound of v / r.
    closed = special.logit(stats.beta.ppf(0.05, v, r - v + 1))
    assert epsilon_lower_bound(m=1000, r=r, v=v, delta=0.0) == pytest.approx(closed, abs=2e-6)
    if r == v == 1000:
        assert closed == pytest.approx(math.log(0.05 ** 1e-3 / (1 - 0.05 ** 1e-3)))
        assert epsilon_lower_bound(m=1000, r=r, v=v, delta=1e-5) < closed


def test_one_run_bound_is_monotone_and_pays_for_confidence() -> None:
    bounds = [epsilon_lower_bound(m=1000, r=100, v=v, delta=1e-5) for v in range(50, 101)]
    assert all(b <= c for b, c in itertools.pairwise(bounds))
    assert bounds[0] == 0.0 and bounds[-1] > 3
    positive = [b for b in bounds if b > 0]
    assert all(b < c for b, c in itertools.pairwise(positive))
    assert (epsilon_lower_bound(m=1000, r=100, v=80, delta=1e-5, confidence=0.99)
            < epsilon_lower_bound(m=1000, r=100, v=80, delta=1e-5, confidence=0.95))
    assert one_run_p_value(m=1000, r=100, v=50, epsilon=0.0, delta=0.0) == pytest.approx(
        stats.binom.sf(49, 100, 0.5))


def test_canary_guesses_by_hand_and_ties_are_not_ordered_by_index() -> None:
    scores = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    members = [1, 1, 0, 0, 1, 0]
    guesses = canary_guesses(scores=scores, is_member=members, k_plus=2, k_minus=2)
    # IN on 5 and 4 (both members), OUT on 0 (right) and 1 (a member: wrong).
    assert (guesses.r, guesses.v, guesses.m) == (4, 3, 6)
    # Equal scores with members listed first: guessing must not read the listing order.
    tied = canary_guesses(scores=np.zeros(1000), is_member=np.r_[np.ones(500), np.zeros(500)],
                          k_plus=250, k_minus=250)
    assert 200 < tied.v < 300


def test_canary_audit_random_guessing_rarely_bounds_and_signal_does() -> None:
    rng = np.random.default_rng(17)
    positives = 0
    repeats = 100
    for _ in range(repeats):
        members = rng.random(1000) < 0.5
        audit = canary_audit(scores=rng.normal(size=1000), is_member=members, delta=1e-5)
        assert audit.epsilon_lower < 0.5
        positives += audit.epsilon_lower > 0
        if audit.epsilon_lower == 0:  # a tie at zero reports the most guesses made
            assert audit.best.r == max(g.r for g, _ in audit.candidates)
    assert positives <= stats.binom.ppf(SLACK_QUANTILE, repeats, ALPHA)
    members = rng.random(1000) < 0.5
    scores = rng.normal(size=1000) + 4.0 * members
    audit = canary_audit(scores=scores, is_member=members, delta=1e-5)
    k = len(audit.candidates)
    assert audit.per_candidate_confidence == pytest.approx(1 - ALPHA / k)
    assert audit.epsilon_lower > 1.5
    assert audit.epsilon_lower == max(bound for _, bound in audit.candidates)
    best = audit.best
    assert audit.epsilon_lower == epsilon_lower_bound(
        m=1000, r=best.r, v=best.v, delta=1e-5, confidence=audit.per_candidate_confidence)
    json.dumps(audit.to_dict(), allow_nan=False)


@pytest.mark.parametrize("kwargs", [
    {"m": 10, "r": 11, "v": 5, "delta": 0.0},
    {"m": 10, "r": 5, "v": 6, "delta": 0.0},
    {"m": 10, "r": 5, "v": 5, "delta": 1.0},
    {"m": 10, "r": 5, "v": 5, "delta": 0.0, "confidence": 0.0},
])
def test_epsilon_lower_bound_rejects_bad_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(UserInputError):
        epsilon_lower_bound(**kwargs)


def test_canary_guesses_reject_too_many_guesses() -> None:
    with pytest.raises(UserInputError):
        canary_guesses(scores=[0.0, 1.0], is_member=[0, 1], k_plus=2, k_minus=1)
