"""Calibrated per-example membership scores from one scalar signal (numpy / scipy only).

Every attack here compares, candidate by candidate, the target model's value of a signal with
the values that reference models produced for the *same* candidate, so that examples that are
naturally easy (low loss in every model) are not mistaken for members. Inputs, per signal:

* ``target`` ``[N]`` — the target's signal on the N candidates;
* ``references`` ``[K, N]`` — K reference models' signal on the same candidates, NaN where a
  reference's value is not to be used;
* ``in_mask`` ``[K, N]`` — True where reference k trained on candidate n (all False for offline
  references).

Attacks (each returns scores where larger means "member", whatever the signal's direction):

* :func:`lira_online` — Carlini et al. 2022, "Membership Inference Attacks From First
  Principles" (arXiv 2112.03570): Gaussian fits of the IN and OUT reference values per
  candidate (per-candidate means), score = log N(s; mu_in, sd_in) - log N(s; mu_out, sd_out).
  The paper uses per-example variances from 64 shadow models on and one global variance per side
  below that (few references estimate a variance badly; a mean is estimated well); ``variance=
  "auto"`` follows it. The global variance is the within-candidate variance pooled over
  candidates (the between-candidate spread is what the per-candidate means remove). The natural
  threshold is LLR 0: the Bayes decision at equal prior odds.
* :func:`lira_offline` — the same paper's offline variant, OUT references only: the one-sided
  standardised distance direction * (s - mu_out) / sd_out (LiRA's 1 - Pr[Z > s] is Phi of it).
  With no IN distribution there is no Bayes point; its threshold is calibrated on a reference
  model acting as the target (:func:`pseudo_target_threshold`), which uses only the auditor's
  own reference data, never the target's membership.
* :func:`rmia_log_ratio` — Zarifzadeh et al. 2024, "Low-Cost High-Power Membership Inference
  Attacks" (arXiv 2312.03262): log Pr(x | theta) / Pr(x), with Pr(x) the average of the IN and
  OUT references' Pr(x | theta'), and, where a candidate has no IN reference, the paper's
  offline approximation Pr_IN(x) ~ a Pr_OUT(x) + (1 - a) (so Pr(x) = ((1 + a) Pr_OUT + 1 - a)
  / 2), ``a`` fitted on a reference acting as the target (:func:`fit_rmia_a`), as the paper
  does. RMIA's score (:func:`rmia_score`) is the fraction of population samples z with
  LR(x, z) = [Pr(x|theta)/Pr(x)] / [Pr(z|theta)/Pr(z)] >= gamma; for a fixed target it is a
  non-decreasing function of the log ratio, so ranking (ROC, AUC, TPR at low FPR) by the log
  ratio is the same attack without the ties a finite z sample creates. The natural threshold is
  log ratio >= log gamma with gamma = 1: Pr(x|theta) / Pr(x) = 2 LR / (1 + LR), LR the
  likelihood ratio of theta under IN vs OUT, so ratio >= 1 is again the Bayes decision at equal
  prior odds.
* :func:`lira_pooled` — online LiRA whose IN - OUT shift is pooled over candidates of similar
  difficulty: with few references each candidate's IN and OUT means
  come from K/2 models each, and their difference, the shift membership causes, is mostly
  noise; pooled, the default 4 online references find about as many members at 1% FPR as
  plain online LiRA does with 16 (``bench/audit_strength.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import norm, rankdata

from dpsweep.core.errors import UserInputError

LIRA_ONLINE = "lira_online"
LIRA_OFFLINE = "lira_offline"
RMIA = "rmia"
LOSS_THRESHOLD = "loss_threshold"
LIRA_POOLED = "lira_pooled"
ATTACKS = (LIRA_ONLINE, LIRA_POOLED, LIRA_OFFLINE, RMIA)
#: Difficulty bins :func:`lira_pooled` pools the IN - OUT shift over, and the fewest
#: candidates a bin holds (fewer candidates, fewer bins): 10-40 bins measured alike on the
#: digits target, a bin of fewer than ~25 candidates is a noisy median again.
POOLED_BINS = 20
POOLED_MIN_PER_BIN = 25
VARIANCES = ("auto", "global", "per_example")
#: From this many references on, ``variance="auto"`` fits per-candidate variances (Carlini et
#: al. use a global variance below 64 shadow models).
PER_EXAMPLE_VARIANCE_MIN_MODELS = 64
#: Floor on a fitted standard deviation (signals are O(1) log quantities).
MIN_STD = 1e-9
#: Floor on probabilities before their log (RMIA).
MIN_PROBABILITY = 1e-300
#: RMIA's gamma: the natural decision is Pr(x|theta)/Pr(x) >= gamma (see the module docstring).
RMIA_GAMMA = 1.0
#: Candidate values of RMIA's offline parameter a (0: Pr_IN = 1; 1: Pr_IN = Pr_OUT).
RMIA_A_GRID = tuple(np.round(np.linspace(0.0, 1.0, 21), 3))
#: References that act in turn as the target to calibrate thresholds and RMIA's a (more cost
#: nothing but numpy time; four already pool 4 x N labelled scores).
MAX_PSEUDO_TARGETS = 4


# --- per-candidate Gaussian fits -------------------------------------------------------------


@dataclass(frozen=True)
class _Side:
    """Per-candidate count, mean and within-candidate sum of squares of one side's values."""

    count: np.ndarray
    mean: np.ndarray
    ss: np.ndarray


def _as_inputs(target: np.ndarray, references: np.ndarray,
               in_mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = np.asarray(target, dtype=np.float64)
    r = np.asarray(references, dtype=np.float64)
    if r.ndim != 2 or t.ndim != 1 or r.shape[1] != t.shape[0]:
        raise ValueError(f"references {r.shape} must be [K, N] for a target of shape {t.shape}")
    mask = (np.zeros(r.shape, dtype=bool) if in_mask is None
            else np.asarray(in_mask, dtype=bool))
    if mask.shape != r.shape:
        raise ValueError(f"in_mask {mask.shape} must match references {r.shape}")
    return t, r, mask


def _side(references: np.ndarray, use: np.ndarray) -> _Side:
    use = use & np.isfinite(references)
    count = use.sum(axis=0)
    values = np.where(use, references, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, values.sum(axis=0) / np.maximum(count, 1), np.nan)
    ss = np.where(use, (references - np.nan_to_num(mean)) ** 2, 0.0).sum(axis=0)
    return _Side(count=count, mean=mean, ss=ss)


def _check_variance(variance: str) -> None:
    if variance not in VARIANCES:
        raise UserInputError(field="audit.variance", value=variance,
                             allowed=f"one of {VARIANCES}")


def _std(side: _Side, *, variance: str, n_models: int) -> np.ndarray:
    """Per-candidate standard deviations: pooled within-candidate (global), or per candidate
    where it has two values or more (global elsewhere)."""
    _check_variance(variance)
    dof = np.maximum(side.count - 1, 0)
    if dof.sum() == 0:
        raise ValueError("a variance needs two references on the same side of some candidate")
    pooled = float(np.sqrt(side.ss.sum() / dof.sum()))
    std = np.full(side.count.shape, pooled)
    if variance == "per_example" or (variance == "auto"
                                     and n_models >= PER_EXAMPLE_VARIANCE_MIN_MODELS):
        own = dof > 0
        std[own] = np.sqrt(side.ss[own] / dof[own])
    return np.maximum(std, MIN_STD)


def lira_online(*, target: np.ndarray, references: np.ndarray, in_mask: np.ndarray,
                variance: str = "auto") -> np.ndarray:
    """Online LiRA's log-likelihood ratio per candidate (module docstring); threshold 0.

    A candidate that happens to have no IN (or no OUT) reference gets that side's mean from the
    other side's plus the average IN - OUT shift of the candidates that have both.
    """
    t, r, mask = _as_inputs(target, references, in_mask)
    _check_variance(variance)
    inside, outside = _side(r, mask), _side(r, ~mask)
    both = (inside.count > 0) & (outside.count > 0)
    if not both.any():
        raise ValueError("online LiRA needs candidates with both IN and OUT references")
    shift = float(np.mean(inside.mean[both] - outside.mean[both]))
    mu_in = np.where(inside.count > 0, inside.mean, outside.mean + shift)
    mu_out = np.where(outside.count > 0, outside.mean, inside.mean - shift)
    k = r.shape[0]
    sd_in = _std(inside, variance=variance, n_models=k)
    sd_out = _std(outside, variance=variance, n_models=k)
    return norm.logpdf(t, mu_in, sd_in) - norm.logpdf(t, mu_out, sd_out)


def difficulty_bins(values: np.ndarray, *, bins: int = POOLED_BINS,
                    min_per_bin: int = POOLED_MIN_PER_BIN) -> np.ndarray:
    """Bin index per candidate: equal-count bins of ``values`` by rank (ties broken by
    position, so repeated values never empty a bin)."""
    n = len(values)
    count = max(1, min(bins, n // max(1, min_per_bin)))
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(values, kind="stable")] = np.arange(n)
    return rank * count // max(n, 1)


def lira_pooled(*, target: np.ndarray, references: np.ndarray, in_mask: np.ndarray,
                bins: int = POOLED_BINS) -> np.ndarray:
    """Online LiRA with the IN - OUT shift pooled over candidates of similar difficulty;
    threshold 0 (an LLR).

    A candidate's difficulty is the mean of *all* its references (IN and OUT alike: with the
    online plan's pairs every candidate is IN for exactly half, so the mean says nothing about
    the target's membership). The shift is the median of (mu_in - mu_out) over the candidates
    in the same difficulty bin, the fitted means are difficulty -/+ shift / 2, and one variance
    is pooled over every reference value around its side's fitted mean. Per-candidate LiRA
    estimates the shift from K/2 + K/2 models, the noisiest quantity it uses; the variance is
    already pooled for the same reason (Carlini et al. 2022 fit one below 64 models)."""
    t, r, mask = _as_inputs(target, references, in_mask)
    inside, outside = _side(r, mask), _side(r, ~mask)
    both = (inside.count > 0) & (outside.count > 0)
    if not both.any():
        raise ValueError("pooled LiRA needs candidates with both IN and OUT references")
    every = _side(r, np.ones_like(mask))
    level = every.mean
    seen = np.isfinite(level)
    where = np.flatnonzero(seen)
    shift = np.full(t.shape, np.nan)
    group = difficulty_bins(level[where], bins=bins)
    raw = inside.mean - outside.mean
    overall = float(np.median(raw[both]))
    for b in np.unique(group):
        rows = where[group == b]
        known = raw[rows][both[rows]]
        shift[rows] = float(np.median(known)) if known.size else overall
    mu_in, mu_out = level + shift / 2, level - shift / 2
    fitted = np.where(mask, mu_in, mu_out)
    resid = np.where(np.isfinite(r), r - fitted, np.nan)
    sd = max(float(np.sqrt(np.nanmean(resid ** 2))), MIN_STD)
    return ((t - mu_out) ** 2 - (t - mu_in) ** 2) / (2.0 * sd ** 2)


def lira_offline(*, target: np.ndarray, references: np.ndarray, direction: int,
                 in_mask: np.ndarray | None = None, variance: str = "auto") -> np.ndarray:
    """Offline LiRA's one-sided statistic direction * (s - mu_out) / sd_out per candidate.

    Only OUT values are used (IN ones, if ``in_mask`` marks any, are ignored); a candidate
    without OUT values scores NaN.
    """
    if direction not in (1, -1):
        raise ValueError(f"direction must be +1 or -1, not {direction!r}")
    t, r, mask = _as_inputs(target, references, in_mask)
    outside = _side(r, ~mask)
    sd = _std(outside, variance=variance, n_models=r.shape[0])
    return direction * (t - outside.mean) / sd


def _log(p: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(p, MIN_PROBABILITY))


def rmia_log_ratio(*, target: np.ndarray, references: np.ndarray,
                   in_mask: np.ndarray | None = None, a: float) -> np.ndarray:
    """log Pr(x | theta) / Pr(x) per candidate from probabilities in [0, 1] (module docstring).

    ``a`` only matters for candidates without IN references (offline); a candidate without OUT
    references inverts the same approximation (Pr_OUT = (Pr_IN - 1 + a) / a, clipped).
    """
    if not 0.0 <= a <= 1.0:
        raise UserInputError(field="audit.rmia_a", value=a, allowed="a number in [0, 1]")
    t, r, mask = _as_inputs(target, references, in_mask)
    inside, outside = _side(r, mask), _side(r, ~mask)
    if not ((inside.count > 0) | (outside.count > 0)).all():
        raise ValueError("every candidate needs at least one reference value")
    p_in = np.where(inside.count > 0, inside.mean, a * outside.mean + (1.0 - a))
    with np.errstate(invalid="ignore", divide="ignore"):
        inverted = np.clip((inside.mean - (1.0 - a)) / a, 0.0, 1.0) if a > 0 else inside.mean
    p_out = np.where(outside.count > 0, outside.mean, inverted)
    return _log(t) - _log(0.5 * (p_in + p_out))


def rmia_score(*, log_ratio: np.ndarray, population_log_ratio: np.ndarray,
               gamma: float = RMIA_GAMMA) -> np.ndarray:
    """RMIA's Score_MIA(x): the fraction of population samples z (non-members of the target)
    with LR(x, z) >= gamma, from the candidates' and the samples' log ratios."""
    if gamma <= 0:
        raise UserInputError(field="audit.rmia_gamma", value=gamma, allowed="a number > 0")
    z = np.sort(np.asarray(population_log_ratio, dtype=np.float64))
    if z.size == 0:
        raise ValueError("RMIA needs population samples")
    x = np.asarray(log_ratio, dtype=np.float64)
    return np.searchsorted(z, x - np.log(gamma), side="right") / z.size


# --- calibration on references acting as the target -----------------------------------------


def auc(*, scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs positives and negatives")
    ranks = rankdata(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def best_threshold(*, scores: np.ndarray, labels: np.ndarray) -> float:
    """The threshold (decide "member" when score >= it) with the best balanced accuracy,
    i.e. the largest TPR - FPR (Youden's J), midway between neighbouring distinct scores."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    keep = np.isfinite(s)
    s, y = s[keep], y[keep]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("a threshold needs labelled members and non-members")
    order = np.argsort(-s, kind="stable")
    s, y = s[order], y[order]
    j = np.cumsum(y) / n_pos - np.cumsum(~y) / n_neg
    last = np.r_[s[1:] != s[:-1], True]  # cut only between distinct scores
    k = int(np.flatnonzero(last)[np.argmax(j[last])])
    return float(s[k] if k == len(s) - 1 else 0.5 * (s[k] + s[k + 1]))


#: ``attack(target [M], references [K-1, M], in_mask [K-1, M]) -> scores [M]``.
PseudoAttack = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def pseudo_target_scores(*, attack: PseudoAttack, signals: np.ndarray, in_mask: np.ndarray,
                         max_targets: int = MAX_PSEUDO_TARGETS
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(scores, labels) of ``attack`` when references 0, 1, ... take turns as the target and
    the others as its references, on examples whose membership in each is known."""
    r = np.asarray(signals, dtype=np.float64)
    mask = np.asarray(in_mask, dtype=bool)
    k = r.shape[0]
    if k < 2:
        raise ValueError("a reference acting as the target needs at least one other reference")
    scores, labels = [], []
    for j in range(min(k, max_targets)):
        others = np.r_[0:j, j + 1:k]
        scores.append(attack(r[j], r[others], mask[others]))
        labels.append(mask[j])
    s, y = np.concatenate(scores), np.concatenate(labels)
    keep = np.isfinite(s)
    return s[keep], y[keep]


def pseudo_target_threshold(*, attack: PseudoAttack, signals: np.ndarray, in_mask: np.ndarray,
                            max_targets: int = MAX_PSEUDO_TARGETS) -> float:
    """:func:`best_threshold` of ``attack`` on references acting as the target."""
    s, y = pseudo_target_scores(attack=attack, signals=signals, in_mask=in_mask,
                                max_targets=max_targets)
    return best_threshold(scores=s, labels=y)


def offline_view(references: np.ndarray, in_mask: np.ndarray) -> np.ndarray:
    """The references with every IN value hidden (NaN): what an offline attacker would see."""
    return np.where(np.asarray(in_mask, dtype=bool), np.nan, references)


def fit_rmia_a(*, probabilities: np.ndarray, in_mask: np.ndarray,
               grid: tuple[float, ...] = RMIA_A_GRID,
               max_targets: int = MAX_PSEUDO_TARGETS) -> float:
    """RMIA's offline ``a``: the grid value whose offline attack (IN values hidden) has the best
    AUC when references take turns as the target (Zarifzadeh et al., Sec. 4)."""
    best, best_auc = grid[0], -np.inf
    for a in grid:
        def attack(t: np.ndarray, refs: np.ndarray, mask: np.ndarray, a: float = a
                   ) -> np.ndarray:
            return rmia_log_ratio(target=t, references=offline_view(refs, mask), a=a)

        s, y = pseudo_target_scores(attack=attack, signals=probabilities, in_mask=in_mask,
                                    max_targets=max_targets)
        value = auc(scores=s, labels=y)
        if value > best_auc + 1e-12:
            best, best_auc = a, value
    return float(best)


# --- one signal, every attack ----------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SignalObservations:
    """One signal of the target and the references, on the candidates and on labelled
    reference data (the population) used for calibration."""

    name: str
    direction: int  # +1: members have larger values; -1: smaller
    probability: Callable[[np.ndarray], np.ndarray]  # RMIA's Pr(x | theta) from values
    target: np.ndarray  # [N]
    references: np.ndarray  # [K, N]
    in_mask: np.ndarray  # [K, N]
    population_references: np.ndarray  # [K, M]
    population_in_mask: np.ndarray  # [K, M]

    def calibration(self) -> tuple[np.ndarray, np.ndarray]:
        """(signals, in_mask) of the examples whose membership in each reference is known and
        mixed: the candidates for online references, the population for offline ones."""
        if self.in_mask.any():
            return self.references, self.in_mask
        return self.population_references, self.population_in_mask

    def head(self, k: int) -> SignalObservations:
        """The same observations with only the first ``k`` references."""
        return SignalObservations(
            name=self.name, direction=self.direction, probability=self.probability,
            target=self.target, references=self.references[:k], in_mask=self.in_mask[:k],
            population_references=self.population_references[:k],
            population_in_mask=self.population_in_mask[:k])


@dataclass(frozen=True, eq=False)
class AttackScores:
    """One attack on one signal: per-candidate scores (larger = member) and the decision
    threshold, chosen without the target's membership labels (``rule`` says how)."""

    signal: str
    attack: str
    scores: np.ndarray
    threshold: float
    rule: str
    params: dict[str, Any] = field(default_factory=dict)

    def decisions(self) -> np.ndarray:
        """1 = "member" where score >= threshold."""
        return (self.scores >= self.threshold).astype(np.int64)


def attack_signal(obs: SignalObservations, *, attacks: tuple[str, ...] = ATTACKS,
                  variance: str = "auto",
                  max_pseudo_targets: int = MAX_PSEUDO_TARGETS) -> dict[str, AttackScores]:
    """Every requested attack on one signal; online LiRA only when some references trained on
    the candidates. Thresholds: LLR 0 (online LiRA), gamma = 1 (RMIA), and for offline LiRA
    the best balanced accuracy on references acting as the target."""
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise UserInputError(field="audit.attacks", value=sorted(unknown),
                             allowed=f"names in {ATTACKS}")
    _check_variance(variance)
    out: dict[str, AttackScores] = {}
    cal_signals, cal_mask = obs.calibration()
    online = bool(obs.in_mask.any())
    if LIRA_ONLINE in attacks and online:
        out[LIRA_ONLINE] = AttackScores(
            signal=obs.name, attack=LIRA_ONLINE, threshold=0.0, rule="LLR >= 0",
            scores=lira_online(target=obs.target, references=obs.references,
                               in_mask=obs.in_mask, variance=variance))
    if LIRA_POOLED in attacks and online:
        out[LIRA_POOLED] = AttackScores(
            signal=obs.name, attack=LIRA_POOLED, threshold=0.0, rule="pooled-shift LLR >= 0",
            scores=lira_pooled(target=obs.target, references=obs.references,
                               in_mask=obs.in_mask))
    if LIRA_OFFLINE in attacks:
        def offline(t: np.ndarray, refs: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return lira_offline(target=t, references=refs, in_mask=mask,
                                direction=obs.direction, variance=variance)

        out[LIRA_OFFLINE] = AttackScores(
            signal=obs.name, attack=LIRA_OFFLINE, rule="pseudo-target balanced accuracy",
            scores=offline(obs.target, obs.references, obs.in_mask),
            threshold=pseudo_target_threshold(attack=offline, signals=cal_signals,
                                              in_mask=cal_mask, max_targets=max_pseudo_targets))
    if RMIA in attacks:
        cal_p = obs.probability(cal_signals)
        needs_a = bool((~obs.in_mask).all(axis=0).any())
        a = (fit_rmia_a(probabilities=cal_p, in_mask=cal_mask, max_targets=max_pseudo_targets)
             if needs_a else None)
        out[RMIA] = AttackScores(
            signal=obs.name, attack=RMIA, threshold=float(np.log(RMIA_GAMMA)),
            rule=f"Pr(x|theta)/Pr(x) >= gamma = {RMIA_GAMMA:g}", params={"a": a},
            scores=rmia_log_ratio(target=obs.probability(obs.target),
                                  references=obs.probability(obs.references),
                                  in_mask=obs.in_mask, a=1.0 if a is None else a))
    return out


def loss_threshold(obs: SignalObservations, *,
                   max_pseudo_targets: int = MAX_PSEUDO_TARGETS) -> AttackScores:
    """The uncalibrated baseline (Yeom et al. 2018): score = direction * signal (for the loss:
    -loss), one global threshold with the best balanced accuracy on references acting as the
    target. It ignores the references' per-candidate values: that is what calibration adds."""
    def plain(t: np.ndarray, refs: np.ndarray, mask: np.ndarray) -> np.ndarray:
        del refs, mask
        return obs.direction * np.asarray(t, dtype=np.float64)

    cal_signals, cal_mask = obs.calibration()
    return AttackScores(
        signal=obs.name, attack=LOSS_THRESHOLD, rule="pseudo-target balanced accuracy",
        scores=plain(obs.target, obs.references, obs.in_mask),
        threshold=pseudo_target_threshold(attack=plain, signals=cal_signals, in_mask=cal_mask,
                                          max_targets=max_pseudo_targets))
