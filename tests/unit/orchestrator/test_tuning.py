"""Private tuning (Papernot & Steinke 2022, arXiv 2110.03620): the accounting, checked.

Known answers: dp_accounting's own result for an event the test builds; the paper's Theorem 6
(Poisson) and Corollary 4 (Gaussian base, truncated negative binomial) re-derived here from
the single-trial RDP curve; the exact optimal composition of N (epsilon, delta)-DP mechanisms
(Kairouz, Oh & Viswanath, "The Composition Theorem for Differential Privacy", arXiv 1311.0776).
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, stats

from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Phase, Schedule
from dpsweep.core.vocabulary import ATTACK_OBJECTIVE, NOISY_OBJECTIVE, VALIDATION_OBJECTIVE
from dpsweep.orchestrator.accounting.tuning.adaptive import adaptive_statement
from dpsweep.orchestrator.accounting.tuning.private import (
    PLD_DISCRETIZATION,
    SIGMA_RANGE,
    WINDOW,
    PrivateTuningPlan,
    draw_trial_count,
    end_to_end_epsilon,
    noisy_score,
    plan_private_tuning,
    trial_event,
    tuning_event,
)
from dpsweep.orchestrator.door import check

DELTA = 1e-5
#: What an adaptive sampler can see: validation accuracy alone, or with the in-trial attack.
VAL = (VALIDATION_OBJECTIVE,)
VAL_AND_ATTACK = (VALIDATION_OBJECTIVE, ATTACK_OBJECTIVE)
# A small DP-SGD run keeps each plan at ~1-2 s on a shared CPU.
Q, STEPS, SIGMA_S, TARGET = 0.02, 300, 50.0, 2.0
DRAWS = 4000
SE_TOLERANCE = 5.0  # empirical means within 5 standard errors: false alarm ~ 6e-7


def _plan(mean: float, distribution: str = "poisson", eta: float | None = None,
          target: float = TARGET) -> PrivateTuningPlan:
    return plan_private_tuning(target_epsilon=target, delta=DELTA, sample_rate=Q, steps=STEPS,
                               mean_trials=mean, distribution=distribution, shape_eta=eta,
                               score_noise_multiplier=SIGMA_S)


@pytest.fixture(scope="module")
def plans() -> dict[str, PrivateTuningPlan]:
    return {
        "poisson2": _plan(2.0),
        "poisson10": _plan(10.0),
        "poisson100": _plan(100.0),
        "geometric10": _plan(10.0, "truncated_negative_binomial", 1.0),
        "logarithmic10": _plan(10.0, "truncated_negative_binomial", 0.0),
    }


def _rdp_curve(event: dp_event.DpEvent) -> tuple[np.ndarray, np.ndarray]:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event)
    return np.asarray(accountant._orders), np.asarray(accountant._rdp)


# --------------------------------------------------------------------------------------------
# The end-to-end figure


@pytest.mark.parametrize("distribution, eta, mean", [
    ("poisson", None, 10.0), ("truncated_negative_binomial", 1.0, 10.0),
    ("truncated_negative_binomial", 0.5, 3.0)])
def test_end_to_end_equals_dp_accounting_on_a_hand_built_event(distribution, eta, mean):
    schedule = Schedule.of([Phase(noise_multiplier=1.2, steps=200),
                            Phase(noise_multiplier=0.9, steps=100)])
    training = dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(1.2)), 200),
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(0.9)), 100)])
    event = dp_event.RepeatAndSelectDpEvent(
        dp_event.ComposedDpEvent([training, dp_event.GaussianDpEvent(SIGMA_S)]), mean,
        math.inf if eta is None else eta)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event)
    ours = end_to_end_epsilon(schedule=schedule, sample_rate=Q, score_noise_multiplier=SIGMA_S,
                              mean_trials=mean, delta=DELTA, distribution=distribution,
                              shape_eta=eta)
    assert ours == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-12)


def test_only_rdp_supports_repeat_and_select():
    event = tuning_event(schedule=Schedule.constant(noise_multiplier=1.0, steps=10),
                         sample_rate=Q, score_noise_multiplier=SIGMA_S, mean_trials=10.0)
    assert not pld_privacy_accountant.PLDAccountant().supports(event)
    assert rdp_privacy_accountant.RdpAccountant().supports(event)


def _theorem6_epsilon(orders: np.ndarray, rdp: np.ndarray, mean: float) -> float:
    """Papernot & Steinke Theorem 6: eps + mean * delta_hat + log(mean) / (lambda - 1), where
    Q is (eps_hat, delta_hat)-DP at eps_hat = log(1 + 1/(lambda - 1))."""
    out = np.full_like(rdp, np.inf)
    for i, lam in enumerate(orders):
        if lam <= 1:
            continue
        delta_hat, _ = rdp_privacy_accountant.compute_delta(orders, rdp,
                                                            math.log1p(1 / (lam - 1)))
        out[i] = rdp[i] + mean * delta_hat + math.log(mean) / (lam - 1)
    return rdp_privacy_accountant.compute_epsilon(orders, out, DELTA)[0]


@pytest.mark.parametrize("mean", [1.0, 10.0, 100.0])
def test_poisson_is_theorem_6(mean):
    schedule = Schedule.constant(noise_multiplier=1.1, steps=STEPS)
    orders, rdp = _rdp_curve(trial_event(schedule=schedule, sample_rate=Q,
                                         score_noise_multiplier=SIGMA_S))
    ours = end_to_end_epsilon(schedule=schedule, sample_rate=Q, score_noise_multiplier=SIGMA_S,
                              mean_trials=mean, delta=DELTA)
    assert ours == pytest.approx(_theorem6_epsilon(orders, rdp, mean), rel=1e-9)


def test_mean_one_degenerate_cases():
    """Poisson(1) is not K = 1 (P(K=0) = 1/e, K = 2 happens): the bound is the single trial's
    plus Theorem 6's mean * delta_hat, no log(mean) term. The truncated negative binomial at
    mean 1 is K = 1: the bound approaches the single-trial bound."""
    schedule = Schedule.constant(noise_multiplier=1.1, steps=STEPS)
    event = trial_event(schedule=schedule, sample_rate=Q, score_noise_multiplier=SIGMA_S)
    single = rdp_privacy_accountant.RdpAccountant()
    single.compose(event)
    single_eps = single.get_epsilon(DELTA)
    kw = dict(schedule=schedule, sample_rate=Q, score_noise_multiplier=SIGMA_S, delta=DELTA)
    poisson1 = end_to_end_epsilon(mean_trials=1.0, **kw)
    orders, rdp = _rdp_curve(event)
    delta_hat = np.array([rdp_privacy_accountant.compute_delta(
        orders, rdp, math.log1p(1 / (lam - 1)))[0] for lam in orders])
    assert poisson1 == pytest.approx(
        rdp_privacy_accountant.compute_epsilon(orders, rdp + delta_hat, DELTA)[0], rel=1e-9)
    assert poisson1 > single_eps
    geometric1 = end_to_end_epsilon(mean_trials=1.0, distribution="truncated_negative_binomial",
                                    shape_eta=1.0, **kw)
    assert single_eps <= geometric1 <= 1.02 * single_eps
    # more trials never cost less
    assert poisson1 < end_to_end_epsilon(mean_trials=2.0, **kw) < end_to_end_epsilon(
        mean_trials=10.0, **kw)


@pytest.mark.parametrize("eta, gamma", [(0.0, 0.05), (1.0, 0.1), (3.0, 0.3)])
def test_gaussian_base_matches_corollary_4(eta, gamma):
    """A Gaussian base (q = 1, one step, plus the score) is rho-zCDP, rho = sum 1/(2 sigma^2).
    Corollary 4 gives the repeated mechanism's RDP in closed form with the optimal lambda_hat;
    dp_accounting optimises lambda_hat over a grid, so it is above, and close."""
    sigma = 4.0
    rho = 0.5 / sigma**2 + 0.5 / SIGMA_S**2
    assert rho <= -math.log(gamma)
    mean = (eta * (1 - gamma) / (gamma * (1 - gamma**eta)) if eta > 0
            else (1 - gamma) / (gamma * math.log(1 / gamma)))
    orders = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=float)
    lam_star = 1 + math.sqrt(math.log(mean) / rho)
    tail = 2 * (1 + eta) * math.sqrt(rho * -math.log(gamma)) - eta * rho
    corollary = np.where(orders <= lam_star, 2 * math.sqrt(rho * math.log(mean)),
                         rho * (orders - 1) + math.log(mean) / (orders - 1)) + tail
    expected = rdp_privacy_accountant.compute_epsilon(orders, corollary, DELTA)[0]
    ours = end_to_end_epsilon(schedule=Schedule.constant(noise_multiplier=sigma, steps=1),
                              sample_rate=1.0, score_noise_multiplier=SIGMA_S, mean_trials=mean,
                              delta=DELTA, distribution="truncated_negative_binomial",
                              shape_eta=eta)
    assert expected <= ours <= 1.001 * expected


# --------------------------------------------------------------------------------------------
# The plan


def test_more_trials_leave_a_smaller_per_trial_budget(plans):
    p2, p10, p100 = plans["poisson2"], plans["poisson10"], plans["poisson100"]
    assert p2.noise_multiplier < p10.noise_multiplier < p100.noise_multiplier
    assert p2.per_trial_epsilon > p10.per_trial_epsilon > p100.per_trial_epsilon
    assert p2.per_trial_training_epsilon > p10.per_trial_training_epsilon


@pytest.mark.parametrize("name", ["poisson2", "poisson10", "poisson100", "geometric10",
                                  "logarithmic10"])
def test_bisection_lands_in_the_window(plans, name):
    plan = plans[name]
    assert WINDOW * TARGET <= plan.end_to_end_epsilon <= TARGET
    recomputed = end_to_end_epsilon(
        schedule=plan.schedule, sample_rate=Q, score_noise_multiplier=SIGMA_S,
        mean_trials=plan.mean_trials, delta=DELTA, distribution=plan.distribution,
        shape_eta=plan.shape_eta)
    assert recomputed == plan.end_to_end_epsilon
    # score noise costs something; RDP is looser than PLD; selection costs something
    assert plan.per_trial_training_epsilon < plan.per_trial_epsilon < plan.per_trial_epsilon_rdp
    assert plan.per_trial_epsilon_rdp < plan.end_to_end_epsilon
    d = plan.to_dict()
    assert Schedule.from_list(d["schedule"]) == plan.schedule
    assert "non-selected trials" in plan.statement and "OS entropy" in plan.statement


def test_trial_count_law_in_the_plan(plans):
    assert plans["poisson10"].prob_no_release == pytest.approx(math.exp(-10))
    geometric = plans["geometric10"]
    assert geometric.prob_no_release == 0.0
    assert geometric.tnb_gamma == pytest.approx(0.1, rel=1e-12)  # geometric: gamma = 1/mean
    assert geometric.expected_trials <= 10.0
    assert geometric.expected_trials == pytest.approx(10.0, rel=1e-9)
    # dp_accounting accounts with a gamma at most ours: its log(1/gamma) is at least ours
    logarithmic = plans["logarithmic10"]
    assert rdp_privacy_accountant._gamma_truncated_negative_binomial(0.0, 10.0) <= \
        logarithmic.tnb_gamma
    assert logarithmic.expected_trials <= 10.0


def test_a_decaying_shape_is_scaled_by_one_factor():
    shape = Schedule.of([Phase(noise_multiplier=1.0, steps=100),
                         Phase(noise_multiplier=0.8, steps=200)])
    plan = plan_private_tuning(target_epsilon=TARGET, delta=DELTA, sample_rate=Q, shape=shape,
                               mean_trials=5.0, score_noise_multiplier=SIGMA_S)
    a, b = plan.schedule.phases
    assert (a.steps, b.steps) == (100, 200)
    assert b.noise_multiplier / a.noise_multiplier == pytest.approx(0.8, rel=1e-12)
    assert WINDOW * TARGET <= plan.end_to_end_epsilon <= TARGET


def test_reference_configuration_and_its_run_time():
    """q = 1/118, 1770 steps, target 3, mean 10 (the numbers in the report)."""
    start = time.perf_counter()
    plan = plan_private_tuning(target_epsilon=3.0, delta=DELTA, sample_rate=1 / 118, steps=1770,
                               mean_trials=10.0, score_noise_multiplier=20.0)
    seconds = time.perf_counter() - start
    assert 2.97 <= plan.end_to_end_epsilon <= 3.0
    assert 1.3 < plan.noise_multiplier < 1.42
    assert 1.1 < plan.per_trial_training_epsilon < 1.3
    assert seconds < 30.0


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kwargs, field", [
    (dict(mean_trials=0.5), "sweep.expected_trials"),
    (dict(mean_trials=float("nan")), "sweep.expected_trials"),
    (dict(distribution="truncated_negative_binomial", shape_eta=-0.5), "sweep.trial_count_shape"),
    (dict(distribution="truncated_negative_binomial", shape_eta=None), "sweep.trial_count_shape"),
    (dict(shape_eta=1.0), "sweep.trial_count_shape"),
    (dict(distribution="binomial"), "sweep.trial_count_distribution"),
    (dict(score_noise_multiplier=0.0), "sweep.score_noise"),
    # the score alone at sigma_s = 1 costs ~10 at mean 10: no training noise helps
    (dict(score_noise_multiplier=1.0), "sweep.score_noise"),
    (dict(target_epsilon=-1.0), "privacy.epsilon"),
    (dict(target_epsilon=0.02, score_noise_multiplier=1e4), "privacy.epsilon"),  # unreachable
    (dict(target_epsilon=1e4), "privacy.epsilon"),  # beyond the smallest sigma
    (dict(delta=1.0), "privacy.delta"),
    (dict(steps=None), "steps"),
])
def test_bad_input_names_the_config_field(kwargs, field):
    args = dict(target_epsilon=TARGET, delta=DELTA, sample_rate=Q, steps=STEPS,
                mean_trials=10.0, score_noise_multiplier=SIGMA_S)
    args.update(kwargs)
    with pytest.raises(UserInputError) as info:
        plan_private_tuning(**args)
    assert info.value.field == field


def test_sigma_range_is_what_the_error_quotes():
    with pytest.raises(UserInputError, match=f"{SIGMA_RANGE[0]:g}"):
        plan_private_tuning(target_epsilon=1e4, delta=DELTA, sample_rate=Q, steps=STEPS,
                            mean_trials=10.0, score_noise_multiplier=SIGMA_S)


# --------------------------------------------------------------------------------------------
# Secret randomness


def _draws(plan: PrivateTuningPlan) -> np.ndarray:
    return np.array([draw_trial_count(plan=plan) for _ in range(DRAWS)])


@pytest.mark.parametrize("name", ["poisson10", "geometric10", "logarithmic10"])
def test_draw_trial_count_has_the_planned_law(plans, name):
    plan = plans[name]
    if plan.distribution == "poisson":
        law = stats.poisson(plan.mean_trials)
        p_min = law.pmf(0)
    else:
        gamma, eta = plan.tnb_gamma, plan.shape_eta
        law = (stats.logser(1 - gamma) if eta == 0 else None)
        if law is None:  # negative binomial conditioned on K >= 1
            base = stats.nbinom(eta, gamma)
            ks = np.arange(1, 20_000)
            pmf = base.pmf(ks) / base.sf(0)
            law = stats.rv_discrete(values=(ks, pmf))
        p_min = law.pmf(1)
    k = _draws(plan)
    assert abs(k.mean() - law.mean()) <= SE_TOLERANCE * law.std() / math.sqrt(DRAWS)
    assert law.mean() == pytest.approx(plan.expected_trials, rel=1e-6)
    k_min = 0 if plan.distribution == "poisson" else 1
    assert k.min() >= k_min
    share = (k == k_min).mean()
    assert abs(share - p_min) <= SE_TOLERANCE * math.sqrt(p_min * (1 - p_min) / DRAWS) + 1e-9


def test_poisson_draws_no_trial_with_probability_exp_minus_mean(plans):
    k = _draws(plans["poisson2"])
    p0 = math.exp(-2.0)
    assert abs((k == 0).mean() - p0) <= SE_TOLERANCE * math.sqrt(p0 * (1 - p0) / DRAWS)
    assert abs(k.mean() - 2.0) <= SE_TOLERANCE * math.sqrt(2.0 / DRAWS)


def test_global_seeds_do_not_reach_the_secret_randomness(plans):
    runs = []
    for _ in range(2):
        np.random.seed(0)
        random.seed(0)
        runs.append(([draw_trial_count(plan=plans["poisson10"]) for _ in range(30)],
                     noisy_score(correct=10, total=100, noise_multiplier=5.0)))
    assert runs[0] != runs[1]


def test_noisy_score_mean_and_variance():
    correct, total, sigma = 700, 1000, 20.0
    x = np.array([noisy_score(correct=correct, total=total, noise_multiplier=sigma)
                  for _ in range(DRAWS)])
    var = (sigma / total) ** 2
    assert abs(x.mean() - 0.7) <= SE_TOLERANCE * math.sqrt(var / DRAWS)
    # the sample variance's relative standard error is sqrt(2 / (n - 1))
    assert abs(x.var(ddof=1) / var - 1) <= SE_TOLERANCE * math.sqrt(2 / (DRAWS - 1))


@pytest.mark.parametrize("kwargs, field", [
    (dict(correct=11), "correct"), (dict(correct=-1), "correct"), (dict(total=0), "total"),
    (dict(correct=True), "correct"), (dict(noise_multiplier=0.0), "sweep.score_noise")])
def test_noisy_score_rejects_bad_input(kwargs, field):
    args = dict(correct=5, total=10, noise_multiplier=1.0)
    args.update(kwargs)
    with pytest.raises(UserInputError) as info:
        noisy_score(**args)
    assert info.value.field == field


# --------------------------------------------------------------------------------------------
# Adaptive sweeps


def _optimal_composition_epsilon(eps: float, delta: float, n: int, total_delta: float) -> float:
    """Exact: the n-fold composition of the (eps, delta) dominating pair (privacy loss +-eps
    with probabilities 1/(1+e^-eps), 1/(1+e^eps), infinite with probability delta)."""
    p = 1 / (1 + math.exp(-eps))
    j = np.arange(n + 1)
    losses = (n - 2 * j) * eps
    probs = (1 - delta) ** n * stats.binom.pmf(j, n, 1 - p)
    infinite = 1 - (1 - delta) ** n

    def hockey(e: float) -> float:
        return infinite + float(np.sum(probs * np.clip(1 - np.exp(e - losses), 0, None)))

    return optimize.brentq(lambda e: hockey(e) - total_delta, 0.0, n * eps, xtol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 10])
def test_adaptive_black_box_composition_is_the_optimal_one(n):
    s = adaptive_statement(n_trials=n, per_trial_epsilon=1.0, delta=DELTA, objectives=VAL)
    assert s.composed_delta == pytest.approx((n + 1) * DELTA)
    exact = _optimal_composition_epsilon(1.0, DELTA, n, s.composed_delta)
    # PLD is pessimistic: above the exact value by at most its discretisation per trial
    assert exact - 1e-9 <= s.composed_epsilon <= exact + n * PLD_DISCRETIZATION + 1e-6
    assert "NOT covered" in s.statement and "no guarantee" in s.statement
    assert s.to_dict()["composed_epsilon"] == s.composed_epsilon


def test_adaptive_exact_composition_of_identical_runs():
    schedule = Schedule.constant(noise_multiplier=1.1, steps=STEPS)
    s = adaptive_statement(n_trials=10, per_trial_epsilon=1.0, delta=DELTA, sample_rate=Q,
                           schedule=schedule, objectives=VAL)
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(1.1)), STEPS), 10))
    assert s.composed_epsilon == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
    assert s.composed_delta == DELTA
    with pytest.raises(UserInputError) as info:
        adaptive_statement(n_trials=10, per_trial_epsilon=1.0, delta=DELTA, sample_rate=Q,
                           objectives=VAL)
    assert info.value.field == "schedule"


def test_adaptive_statement_says_what_composition_covers_given_what_the_sampler_saw():
    """Validation accuracy alone: for the training set, every proposal and choice is
    post-processing of earlier DP models, so composition over all models (re-runs counted)
    covers releasing them all and the selection; the validation set has no guarantee. With
    the in-trial attack on training members, nothing adaptively chosen is covered, and no
    composed number is given that could be read as a guarantee."""
    val = adaptive_statement(n_trials=10, reruns=2, per_trial_epsilon=1.0, delta=DELTA,
                             objectives=VAL)
    twelve = adaptive_statement(n_trials=12, per_trial_epsilon=1.0, delta=DELTA, objectives=VAL)
    assert val.models == 12 and val.composed_epsilon == twelve.composed_epsilon
    assert val.composed_delta == pytest.approx(13 * DELTA)
    text = val.statement
    for covered in ("12 DP-trained models (10 search trials and 2 re-runs of front trials)",
                    "adaptive composition over all 12 models bounds releasing all of them",
                    "any choice among them made from validation metrics, the selected model "
                    "included", f"({val.composed_epsilon:.4g}, {val.composed_delta:.3g})-DP",
                    "not by the per-trial epsilon"):
        assert covered in text, covered
    for not_covered in ("training loss", "pick --max-peak-mia",
                        "For a person in the validation set there is no guarantee at all"):
        assert not_covered in text, not_covered
    assert "membership-inference attack run inside" not in text

    attack = adaptive_statement(n_trials=10, reruns=2, per_trial_epsilon=1.0, delta=DELTA,
                                objectives=VAL_AND_ATTACK)
    assert attack.composed_epsilon is None and attack.composed_delta is None
    assert attack.to_dict()["composed_epsilon"] is None
    assert attack.to_dict()["objectives"] == list(VAL_AND_ATTACK)
    text = attack.statement
    for said in ("membership-inference attack run inside every trial on training members",
                 "not post-processing of a DP output",
                 "no bound covers releasing any of those models with its hyperparameters, or "
                 "the selection", "composition over the 12 models does not either",
                 "For a person in the validation or holdout set there is no guarantee at all"):
        assert said in text, said
    assert "bounds releasing all of them" not in text
    assert ")-DP" not in text  # no composed (epsilon, delta) is stated as covering anything


@pytest.mark.parametrize("objectives", [(ATTACK_OBJECTIVE,), (NOISY_OBJECTIVE,), (),
                                        (ATTACK_OBJECTIVE, VALIDATION_OBJECTIVE), "val_accuracy"])
def test_adaptive_statement_refuses_objectives_no_adaptive_sampler_had(objectives):
    with pytest.raises(UserInputError) as info:
        adaptive_statement(n_trials=3, per_trial_epsilon=1.0, delta=DELTA,
                           objectives=objectives)
    assert info.value.field == "objectives"


def test_private_plan_targets_the_budget_epsilon():
    """With budget.epsilons = [1] the end-to-end target is 1, not privacy.epsilon's default 3
    (which the studies' planning never reads once budget.epsilons is set)."""
    from dpsweep.orchestrator.api import from_dict
    from dpsweep.orchestrator.sweep.tuning import private_tuning_plan

    raw = {"budget": {"epsilons": [1.0]}, "training": {"epochs": 1},
           "sweep": {"tuning": "private", "methods": ["dpsgd"]},
           "audit": {"in_trial": False}}
    plan = private_tuning_plan(check(from_dict(raw)))
    assert plan.target_epsilon == 1.0
    assert plan.end_to_end_epsilon <= 1.0
