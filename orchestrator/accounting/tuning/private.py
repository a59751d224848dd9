"""The privacy cost of hyperparameter tuning, computed (``tuning = "private"``).

An Optuna sweep that adapts (TPE) to validation scores computed without noise is not covered by
the per-trial epsilon: the chosen hyperparameters and the choice of the best trial depend on
private data through a channel no accountant saw. The private mode follows Papernot & Steinke,
"Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022, arXiv 2110.03620):

* random search: every trial draws its hyperparameters independently of the data and of the
  other trials, trains with DP-SGD and computes one DP selection score;
* the number of trials K is itself random (Poisson, or truncated negative binomial), drawn from
  OS entropy and never revealed;
* only the best-scoring trial (its model and its noisy score) is released.

The end-to-end guarantee of that procedure is the paper's Theorem 2 (truncated negative
binomial) or Theorem 6 (Poisson), which dp_accounting implements for its RDP accountant as
``RepeatAndSelectDpEvent``; its PLD accountant does not support that event, so the end-to-end
figure is RDP while per-trial figures are also given with the tighter PLD accountant.

One trial's mechanism is training (Poisson-subsampled Gaussian, one event per phase of the
noise schedule) *composed* with the selection score (the count of correct validation
predictions plus N(0, sigma_s^2): sensitivity 1 under add/remove of one validation example).
Validation and training examples are disjoint, so a person's record changes only one of the
two; the maximum of the two RDP curves would therefore be a valid, tighter bound ("parallel
composition"). We compose instead (the RDP curves add), which is safe without relying on the
split being disjoint, at a small cost when sigma_s is large.

Every trial must be covered by the plan's (sample_rate, schedule): hyperparameters that change
the sampling rate or the number of steps (batch size, epochs) must either be fixed, or the plan
computed for the least private candidate. Any score released besides the one final noisy score
per trial (per-epoch validation reports for pruning, say) is not covered.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpsweep.core.checks import number, whole
from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Schedule
from dpsweep.orchestrator.accounting.certificate import (
    WINDOW,  # a plan is matched within 1% too
    check_delta,
    check_positive,
    check_sample_rate,
)

__all__ = [
    "DISTRIBUTIONS",
    "END_TO_END_ACCOUNTANT",
    "PER_TRIAL_ACCOUNTANT",
    "PLD_DISCRETIZATION",
    "SIGMA_RANGE",
    "WINDOW",
    "PrivateTuningPlan",
    "draw_trial_count",
    "end_to_end_epsilon",
    "noisy_score",
    "plan_private_tuning",
    "training_event",
    "trial_event",
    "tuning_event",
]

Distribution = Literal["poisson", "truncated_negative_binomial"]
DISTRIBUTIONS: tuple[str, ...] = ("poisson", "truncated_negative_binomial")

SIGMA_RANGE = (0.5, 100.0)
"""Absolute training noise multipliers the plan may choose (every phase stays inside): below
0.5 DP-SGD is useless at any sensible epsilon (and dp_accounting's RDP series stop converging at
low orders), above 100 it learns nothing."""

MAX_EXPECTED_TRIALS = 10_000.0
"""Upper limit on the mean number of trials: each is a full training run."""

PLD_DISCRETIZATION = 1e-4
"""dp_accounting's default value discretization for the per-trial PLD figures."""

END_TO_END_ACCOUNTANT = "rdp (dp_accounting RdpAccountant, RepeatAndSelectDpEvent)"
PER_TRIAL_ACCOUNTANT = "pld (dp_accounting PLDAccountant, pessimistic estimate)"

_MAX_BISECTION_STEPS = 200
_BRACKET_RATIO = 2.0
_GAMMA_BISECTION_STEPS = 200
_POISSON_TAIL_SDS = 40  # P(K > mean + 40 sd) is far below the resolution of a double

_F_EPSILON = "privacy.epsilon"
_F_MEAN = "sweep.expected_trials"
_F_SHAPE = "sweep.trial_count_shape"
_F_DISTRIBUTION = "sweep.trial_count_distribution"
_F_SCORE = "sweep.score_noise"


# --------------------------------------------------------------------------------------------
# Validation (the checks shared with the other accountants are in certificate and core.checks)


def _schedule(value: Any, *, field: str = "schedule") -> Schedule:
    if not isinstance(value, Schedule):
        raise UserInputError(field=field, value=repr(value)[:200],
                             allowed="a core.schedule.Schedule")
    return value


def _trial_count(mean_trials: Any, distribution: Any, shape_eta: Any) -> tuple[float, str,
                                                                              float | None]:
    """Validated (mean, distribution, eta): mu >= 1 and eta >= 0 are what dp_accounting takes."""
    allowed_mean = f"a number in [1, {MAX_EXPECTED_TRIALS:g}] (the mean number of trials)"
    mean = number(mean_trials, field=_F_MEAN, low=1.0, high=MAX_EXPECTED_TRIALS,
                  allowed=allowed_mean)
    if distribution not in DISTRIBUTIONS:
        raise UserInputError(field=_F_DISTRIBUTION, value=distribution,
                             allowed=" or ".join(repr(d) for d in DISTRIBUTIONS))
    if distribution == "poisson":
        if shape_eta is not None:
            raise UserInputError(field=_F_SHAPE, value=shape_eta,
                                 allowed="unset for the Poisson distribution (its shape is "
                                         "infinite)")
        return mean, distribution, None
    # Papernot & Steinke's Theorem 2 holds for eta in (-1, inf); dp_accounting 0.6 implements
    # it for eta >= 0 only (0: logarithmic, 1: geometric), so that is what we accept.
    allowed_eta = ("a finite number >= 0 (Papernot & Steinke allow eta > -1; dp_accounting "
                   "implements eta >= 0: 0 logarithmic, 1 geometric)")
    if shape_eta is None:
        raise UserInputError(field=_F_SHAPE, value=None, allowed=allowed_eta)
    eta = number(shape_eta, field=_F_SHAPE, low=0.0, allowed=allowed_eta)
    return mean, distribution, eta


# --------------------------------------------------------------------------------------------
# Events


def training_event(*, schedule: Schedule, sample_rate: float) -> dp_event.DpEvent:
    """DP-SGD as a dp_accounting event: one self-composed subsampled Gaussian per phase."""
    schedule = _schedule(schedule)
    q = check_sample_rate(sample_rate)
    phases = [dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(p.noise_multiplier)),
        p.steps) for p in schedule.merged().phases]
    return phases[0] if len(phases) == 1 else dp_event.ComposedDpEvent(phases)


def trial_event(*, schedule: Schedule, sample_rate: float,
                score_noise_multiplier: float) -> dp_event.DpEvent:
    """One trial: training composed with the noisy correct-count score (sensitivity 1).

    Composition, not the tighter maximum, although validation and training are disjoint: see
    the module docstring.
    """
    sigma_s = check_positive(score_noise_multiplier, field=_F_SCORE)
    return dp_event.ComposedDpEvent([training_event(schedule=schedule, sample_rate=sample_rate),
                                     dp_event.GaussianDpEvent(sigma_s)])


def _dp_accounting_shape(distribution: str, eta: float | None) -> float:
    return math.inf if distribution == "poisson" else float(eta)  # type: ignore[arg-type]


def tuning_event(*, schedule: Schedule, sample_rate: float, score_noise_multiplier: float,
                 mean_trials: float, distribution: Distribution = "poisson",
                 shape_eta: float | None = None) -> dp_event.RepeatAndSelectDpEvent:
    """The whole tuning run: K random trials, only the best-scoring one released."""
    mean, distribution, eta = _trial_count(mean_trials, distribution, shape_eta)
    event = trial_event(schedule=schedule, sample_rate=sample_rate,
                        score_noise_multiplier=score_noise_multiplier)
    return dp_event.RepeatAndSelectDpEvent(event, mean, _dp_accounting_shape(distribution, eta))


def _rdp_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def end_to_end_epsilon(*, schedule: Schedule, sample_rate: float,
                       score_noise_multiplier: float, mean_trials: float, delta: float,
                       distribution: Distribution = "poisson",
                       shape_eta: float | None = None) -> float:
    """Epsilon at ``delta`` of the released (selected) model: dp_accounting RDP, the only
    dp_accounting accountant that supports ``RepeatAndSelectDpEvent``."""
    d = check_delta(delta)
    event = tuning_event(schedule=schedule, sample_rate=sample_rate,
                         score_noise_multiplier=score_noise_multiplier,
                         mean_trials=mean_trials, distribution=distribution, shape_eta=shape_eta)
    return _rdp_epsilon(event, d)


def _score_only_epsilon(*, score_noise_multiplier: float, mean_trials: float, delta: float,
                        distribution: str, eta: float | None) -> float:
    """End-to-end epsilon with infinitely noisy training: the floor the score noise sets."""
    event = dp_event.RepeatAndSelectDpEvent(dp_event.GaussianDpEvent(score_noise_multiplier),
                                            mean_trials, _dp_accounting_shape(distribution, eta))
    return _rdp_epsilon(event, delta)


def _per_trial_pld(*, schedule: Schedule, sample_rate: float, score_noise_multiplier: float,
                   delta: float) -> tuple[float, float]:
    """(training alone, training + score) epsilons of one trial, PLD pessimistic."""
    accountant = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=PLD_DISCRETIZATION)
    accountant.compose(training_event(schedule=schedule, sample_rate=sample_rate))
    training = float(accountant.get_epsilon(delta))
    accountant.compose(dp_event.GaussianDpEvent(score_noise_multiplier))
    return training, float(accountant.get_epsilon(delta))


# --------------------------------------------------------------------------------------------
# The number of trials


def _tnb_mean(gamma: float, eta: float) -> float:
    """E[K] of the truncated negative binomial D_{eta, gamma} (paper, Section 2)."""
    if gamma >= 1:
        return 1.0
    log_g = math.log(gamma)
    if eta == 0:  # logarithmic distribution
        return (1 - gamma) / (gamma * -log_g)
    return eta * (1 - gamma) / (gamma * -math.expm1(eta * log_g))


def _tnb_gamma(eta: float, mean: float) -> float:
    """The gamma to draw K with: E[K] <= mean, and gamma >= the one dp_accounting accounts with.

    dp_accounting returns the smaller end of its bracket (E[K] >= mean, larger log(1/gamma));
    drawing with the larger end keeps both terms of Theorem 2 that depend on the distribution,
    log(1/gamma) and log(E[K]), at or below what was accounted.
    """
    if mean <= 1:
        return 1.0
    lo, hi = 0.0, 1.0  # E[K] decreases in gamma: infinite at 0, 1 at 1
    for _ in range(_GAMMA_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if _tnb_mean(mid, eta) <= mean:
            hi = mid
        else:
            lo = mid
    return hi


def _draw_poisson(u: float, mean: float) -> int:
    """Inverse CDF of Poisson(mean) at u, in log space (exp(-mean) underflows past 745)."""
    k, cum, log_mean = 0, 0.0, math.log(mean)
    tail = mean + _POISSON_TAIL_SDS * math.sqrt(mean) + _POISSON_TAIL_SDS
    while True:
        cum += math.exp(-mean + k * log_mean - math.lgamma(k + 1))
        if cum > u or k >= tail:  # past the tail only when rounding left cum short of u
            return k
        k += 1


def _draw_tnb(u: float, eta: float, gamma: float) -> int:
    """Inverse CDF of D_{eta, gamma} at u; P(K=k+1)/P(K=k) = (1-gamma)(k+eta)/(k+1)."""
    if gamma >= 1:
        return 1
    log_g = math.log(gamma)
    if eta == 0:
        p = (1 - gamma) / -log_g
    else:
        p = eta * (1 - gamma) * gamma ** eta / -math.expm1(eta * log_g)
    k, cum = 1, p
    while cum <= u and p > 0:
        p *= (1 - gamma) * (k + eta) / (k + 1)
        k += 1
        cum += p
    return k


# --------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class PrivateTuningPlan:
    """A private tuning run: per-trial noise, trial-count law, and what the epsilon covers.

    ``per_trial_*`` figures are PLD (tight); ``end_to_end_epsilon`` is RDP, the only
    accountant for selection, so the overhead of tuning alone is end_to_end_epsilon over
    ``per_trial_epsilon_rdp`` (the same trial under RDP).
    """

    target_epsilon: float
    delta: float
    sample_rate: float
    mean_trials: float
    distribution: str
    shape_eta: float | None
    tnb_gamma: float | None
    schedule: Schedule
    score_noise_multiplier: float
    per_trial_training_epsilon: float
    per_trial_epsilon: float
    per_trial_epsilon_rdp: float
    per_trial_accountant: str
    end_to_end_epsilon: float
    end_to_end_accountant: str
    expected_trials: float
    prob_no_release: float
    statement: str
    seconds: float

    @property
    def noise_multiplier(self) -> float:
        """First phase's multiplier: sigma for a constant schedule, sigma_0 for a decay."""
        return self.schedule.first

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "mean_trials": self.mean_trials,
            "distribution": self.distribution,
            "shape_eta": self.shape_eta,
            "tnb_gamma": self.tnb_gamma,
            "schedule": self.schedule.to_list(),
            "score_noise_multiplier": self.score_noise_multiplier,
            "per_trial_training_epsilon": self.per_trial_training_epsilon,
            "per_trial_epsilon": self.per_trial_epsilon,
            "per_trial_epsilon_rdp": self.per_trial_epsilon_rdp,
            "per_trial_accountant": self.per_trial_accountant,
            "end_to_end_epsilon": self.end_to_end_epsilon,
            "end_to_end_accountant": self.end_to_end_accountant,
            "expected_trials": self.expected_trials,
            "prob_no_release": self.prob_no_release,
            "statement": self.statement,
            "seconds": self.seconds,
        }


def _law(distribution: str, mean: float, eta: float | None, gamma: float | None) -> str:
    if distribution == "poisson":
        return f"K ~ Poisson(mean {mean:g})"
    return (f"K ~ truncated negative binomial (eta {eta:g}, gamma {gamma:.6g}, "
            f"mean {mean:g}, K >= 1)")


def _plan_statement(*, end_to_end: float, delta: float, law: str, sample_rate: float,
                    schedule: Schedule, sigma_s: float, per_trial: float,
                    per_trial_rdp: float, p0: float) -> str:
    sigmas = ", ".join(f"{p.noise_multiplier:.4g} x {p.steps}" for p in schedule.phases)
    nothing = (f" With probability {p0:.3g} (K = 0) nothing is released."
               if p0 > 0 else "")
    return (
        f"End-to-end guarantee: ({end_to_end:.4g}, {delta:g})-DP (RDP accountant, Papernot & "
        f"Steinke 2022, arXiv 2110.03620) for one person's record, in the training or the "
        f"validation set, added or removed. It covers the released model and its selection: "
        f"{law} trials, each drawing its hyperparameters at random independently of the data, "
        f"training with DP-SGD (sampling rate {sample_rate:.6g}, noise multiplier x steps "
        f"{sigmas}) and computing one validation score, the number of correct predictions plus "
        f"Gaussian noise of standard deviation {sigma_s:g} divided by the fixed public "
        f"validation size; the best-scoring trial's model and noisy score are released. It "
        f"holds only if K is drawn from OS entropy and never revealed, and only the selected "
        f"model and its noisy score leave the run directory.{nothing} It does not cover "
        f"anything else in the run directory: the non-selected trials (their models, "
        f"checkpoints, scores, logs), the number of trials, any validation or audit metric "
        f"computed without noise, or per-epoch reports; these must stay private or be deleted. "
        f"One trial alone is ({per_trial:.4g}, {delta:g})-DP (PLD; {per_trial_rdp:.4g} under "
        f"RDP), so choosing among random trials costs {end_to_end - per_trial_rdp:.3g} in "
        f"epsilon under RDP."
    )


def plan_private_tuning(*, target_epsilon: float, delta: float, sample_rate: float,
                        steps: int | None = None, shape: Schedule | None = None,
                        mean_trials: float, distribution: Distribution = "poisson",
                        shape_eta: float | None = None,
                        score_noise_multiplier: float) -> PrivateTuningPlan:
    """The per-trial training noise whose end-to-end epsilon is in [0.99 T, T], by bisection.

    Exactly one of ``steps`` (constant noise) or ``shape`` (relative multipliers, scaled by
    one factor) is given. The end-to-end epsilon decreases in the factor, so bisection on its
    logarithm converges; the score noise is fixed and sets a floor below which no training
    noise reaches the target.
    """
    start = time.perf_counter()
    target = check_positive(target_epsilon, field=_F_EPSILON)
    d = check_delta(delta)
    q = check_sample_rate(sample_rate)
    sigma_s = check_positive(score_noise_multiplier, field=_F_SCORE)
    mean, distribution, eta = _trial_count(mean_trials, distribution, shape_eta)
    shape = _plan_shape(steps, shape)
    lo, hi = _factor_range(shape)

    def eps_at(factor: float) -> float:
        return end_to_end_epsilon(schedule=shape.scaled(factor), sample_rate=q,
                                  score_noise_multiplier=sigma_s, mean_trials=mean, delta=d,
                                  distribution=distribution, shape_eta=eta)  # type: ignore[arg-type]

    eps_hi = eps_at(hi)
    if eps_hi > target:
        floor = _score_only_epsilon(score_noise_multiplier=sigma_s, mean_trials=mean, delta=d,
                                    distribution=distribution, eta=eta)
        if floor >= WINDOW * target:
            raise UserInputError(
                field=_F_SCORE, value=score_noise_multiplier,
                allowed=f"more noise: with sigma_s = {sigma_s:g} the score and selection alone "
                        f"cost epsilon {floor:.4g} >= {WINDOW:g} x target {target:g}")
        raise UserInputError(
            field=_F_EPSILON, value=target_epsilon,
            allowed=f"at least {eps_hi:.4g}: even at training noise multiplier "
                    f"{SIGMA_RANGE[1]:g} the end-to-end epsilon is {eps_hi:.4g} (or fewer "
                    f"{_F_MEAN}, more {_F_SCORE})")
    if eps_hi >= WINDOW * target:
        factor, eps = hi, eps_hi
    else:
        factor, eps = _bisect_factor(eps_at, lo=lo, hi=hi, eps_hi=eps_hi, target=target,
                                     asked=target_epsilon)
    return _plan(target=target, delta=d, sample_rate=q, mean=mean, distribution=distribution,
                 eta=eta, schedule=shape.scaled(factor), sigma_s=sigma_s, end_to_end=eps,
                 start=start)


def _plan_shape(steps: Any, shape: Any) -> Schedule:
    """The relative multipliers to scale: constant for ``steps``, else ``shape``."""
    if (steps is None) == (shape is None):
        raise UserInputError(field="steps", value={"steps": steps, "shape": repr(shape)},
                             allowed="exactly one of steps or shape")
    if shape is None:
        n = whole(steps, field="steps", low=1)
        shape = Schedule.constant(noise_multiplier=1.0, steps=n)
    return _schedule(shape, field="shape")


def _factor_range(shape: Schedule) -> tuple[float, float]:
    """The common scales that keep every phase's multiplier inside SIGMA_RANGE."""
    multipliers = [p.noise_multiplier for p in shape.phases]
    lo = SIGMA_RANGE[0] / min(multipliers)
    hi = SIGMA_RANGE[1] / max(multipliers)
    if lo >= hi:
        raise UserInputError(field="shape", value=shape.to_list()[:8],
                             allowed=f"relative multipliers that fit in {SIGMA_RANGE} after "
                                     f"one common scale (max/min ratio < "
                                     f"{SIGMA_RANGE[1] / SIGMA_RANGE[0]:g})")
    return lo, hi


def _bisect_factor(eps_at: Callable[[float], float], *, lo: float, hi: float, eps_hi: float,
                   target: float, asked: Any) -> tuple[float, float]:
    """The factor in [lo, hi) whose end-to-end epsilon is in [WINDOW * target, target], and
    that epsilon, given eps_at(hi) = eps_hi below the window.

    Brackets downwards by halving (small sigma is slow for the accountant and rarely needed),
    then bisects log(factor): eps_at(low) > target >= eps_at(high) throughout.
    """
    high, factor, eps = hi, hi, eps_hi
    low = max(lo, hi / _BRACKET_RATIO)
    while True:
        e = eps_at(low)
        if e > target:
            break
        high, factor, eps = low, low, e
        if e >= WINDOW * target:
            break
        if low <= lo:
            raise UserInputError(
                field=_F_EPSILON, value=asked,
                allowed=f"at most {e:.4g}: even at training noise multiplier "
                        f"{SIGMA_RANGE[0]:g} the end-to-end epsilon is only {e:.4g}")
        low = max(lo, low / _BRACKET_RATIO)
    for _ in range(_MAX_BISECTION_STEPS):
        if eps >= WINDOW * target:
            break
        mid = math.sqrt(low * high)
        e = eps_at(mid)
        if e > target:
            low = mid
        else:
            high, factor, eps = mid, mid, e
    else:  # pragma: no cover - continuity of epsilon in sigma makes this unreachable
        raise RuntimeError("bisection did not reach the 1% window")
    return factor, eps


def _plan(*, target: float, delta: float, sample_rate: float, mean: float, distribution: str,
          eta: float | None, schedule: Schedule, sigma_s: float, end_to_end: float,
          start: float) -> PrivateTuningPlan:
    """The plan for the matched schedule: per-trial figures, the trial-count law, the text."""
    training, per_trial = _per_trial_pld(schedule=schedule, sample_rate=sample_rate,
                                         score_noise_multiplier=sigma_s, delta=delta)
    per_trial_rdp = _rdp_epsilon(trial_event(schedule=schedule, sample_rate=sample_rate,
                                             score_noise_multiplier=sigma_s), delta)
    if distribution == "poisson":
        gamma, expected, p0 = None, mean, math.exp(-mean)
    else:
        gamma = _tnb_gamma(eta, mean)  # type: ignore[arg-type]
        expected, p0 = _tnb_mean(gamma, eta), 0.0  # type: ignore[arg-type]
    statement = _plan_statement(end_to_end=end_to_end, delta=delta,
                                law=_law(distribution, mean, eta, gamma), sample_rate=sample_rate,
                                schedule=schedule, sigma_s=sigma_s, per_trial=per_trial,
                                per_trial_rdp=per_trial_rdp, p0=p0)
    return PrivateTuningPlan(
        target_epsilon=target, delta=delta, sample_rate=sample_rate, mean_trials=mean,
        distribution=distribution, shape_eta=eta, tnb_gamma=gamma, schedule=schedule,
        score_noise_multiplier=sigma_s, per_trial_training_epsilon=training,
        per_trial_epsilon=per_trial, per_trial_epsilon_rdp=per_trial_rdp,
        per_trial_accountant=PER_TRIAL_ACCOUNTANT, end_to_end_epsilon=end_to_end,
        end_to_end_accountant=END_TO_END_ACCOUNTANT, expected_trials=expected,
        prob_no_release=p0, statement=statement, seconds=time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# Secret randomness


def draw_trial_count(*, plan: PrivateTuningPlan) -> int:
    """K for this run, from OS entropy: never seed it, log it or write it anywhere.

    The guarantee assumes K is secret; the number of trial directories, or a progress line,
    reveals it just as well, so keep those private too.
    """
    if not isinstance(plan, PrivateTuningPlan):
        raise UserInputError(field="plan", value=type(plan).__name__,
                             allowed="a PrivateTuningPlan")
    u = secrets.SystemRandom().random()
    if plan.distribution == "poisson":
        return _draw_poisson(u, plan.mean_trials)
    return _draw_tnb(u, plan.shape_eta, plan.tnb_gamma)  # type: ignore[arg-type]


def noisy_score(*, correct: int, total: int, noise_multiplier: float) -> float:
    """(correct + N(0, noise_multiplier^2)) / total, the noise from secret entropy.

    ``total`` must be the public, fixed validation size (not a data-dependent count), so the
    sensitivity of the numerator is 1 and the division is post-processing. Not hardened
    against floating-point side channels of the Gaussian sampler.
    """
    n = whole(total, field="total", low=1, allowed="an integer >= 1 (validation size)")
    c = whole(correct, field="correct", low=0, high=n)
    sigma = check_positive(noise_multiplier, field=_F_SCORE)
    rng = np.random.default_rng(secrets.randbits(128))
    return (c + float(rng.normal(0.0, sigma))) / n
