"""What an adaptive sweep's epsilons cover, stated honestly (``sweep.tuning = "adaptive"``).

A sampler such as TPE adapts to metrics computed without noise, so the per-trial epsilon does not
cover the hyperparameters it proposed or the choice of the best trial. What does cover them
depends on what the sampler saw: with validation accuracy alone, composition over every trained
model does (for the training set); with the in-trial attack's score, nothing does. The statement
is written here, next to the composition it quotes, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpsweep.core.checks import whole
from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Schedule
from dpsweep.core.vocabulary import ATTACK_OBJECTIVE, VALIDATION_OBJECTIVE
from dpsweep.orchestrator.accounting.certificate import check_delta, check_positive
from dpsweep.orchestrator.accounting.tuning.private import PLD_DISCRETIZATION, training_event

__all__ = ["AdaptiveStatement", "adaptive_statement"]


@dataclass(frozen=True)
class AdaptiveStatement:
    """What an adaptive sweep's epsilons cover, given the objectives its sampler saw.

    ``composed_epsilon`` / ``composed_delta`` are None when the sampler saw the in-trial attack:
    composition then covers nothing that was chosen adaptively, and a number would read as a
    guarantee.
    """

    n_trials: int
    reruns: int
    per_trial_epsilon: float
    delta: float
    objectives: tuple[str, ...]
    composed_epsilon: float | None
    composed_delta: float | None
    composition: str
    statement: str

    @property
    def models(self) -> int:
        """DP-trained models the composition counts: search trials and re-runs."""
        return self.n_trials + self.reruns

    def to_dict(self) -> dict[str, Any]:
        return {"n_trials": self.n_trials, "reruns": self.reruns,
                "per_trial_epsilon": self.per_trial_epsilon, "delta": self.delta,
                "objectives": list(self.objectives), "composed_epsilon": self.composed_epsilon,
                "composed_delta": self.composed_delta, "composition": self.composition,
                "statement": self.statement}


def _objectives(value: Any) -> tuple[str, ...]:
    """The adaptive sampler's objectives: validation accuracy, optionally the in-trial attack."""
    allowed = (f"({VALIDATION_OBJECTIVE!r},) or ({VALIDATION_OBJECTIVE!r}, "
               f"{ATTACK_OBJECTIVE!r}): what the adaptive sampler saw")
    objectives = tuple(value) if isinstance(value, (list, tuple)) else ()
    if objectives not in ((VALIDATION_OBJECTIVE,), (VALIDATION_OBJECTIVE, ATTACK_OBJECTIVE)):
        raise UserInputError(field="objectives", value=value, allowed=allowed)
    return objectives


def _composed(*, n: int, eps: float, delta: float, sample_rate: float | None,
              schedule: Schedule | None) -> tuple[float, float, str]:
    """(epsilon, delta, how) of n adaptively chosen trials: black-box optimal composition, or
    the exact PLD of n identical DP-SGD runs (hyperparameters that leave the sampling rate and
    the noise schedule alone do not change a trial's privacy loss distribution)."""
    if schedule is None:
        composed_delta = (n + 1) * delta
        if composed_delta >= 1:
            raise UserInputError(field="n_trials", value=n,
                                 allowed=f"fewer than {1 / delta - 1:.0f} trials at delta "
                                         f"{delta:g}")
        pld = pld_lib.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(epsilon=eps, delta=delta),
            value_discretization_interval=PLD_DISCRETIZATION)
        composed = float(pld.self_compose(n).get_epsilon_for_delta(composed_delta))
        return composed, composed_delta, ("pld, black-box (epsilon, delta) per trial, optimal "
                                          "composition")
    accountant = pld_privacy_accountant.PLDAccountant(
        value_discretization_interval=PLD_DISCRETIZATION)
    accountant.compose(dp_event.SelfComposedDpEvent(
        training_event(schedule=schedule, sample_rate=sample_rate),  # type: ignore[arg-type]
        n))
    return (float(accountant.get_epsilon(delta)), delta,
            "pld (pessimistic), exact composition of the DP-SGD runs")


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _adaptive_text(*, n: int, reruns: int, eps: float, delta: float, attack: bool,
                   composed: float | None, composed_delta: float | None, how: str) -> str:
    """The statement, exact about whom each bound covers and why (docs/search.md, "What the
    adaptive statement covers")."""
    models = n + reruns
    what = _plural(n, "search trial") + (
        f" and {_plural(reruns, 're-run')} of front trials" if reruns else "")
    head = (
        f"Adaptive sweep: {_plural(models, 'DP-trained model')} ({what}). The per-trial epsilon "
        f"{eps:.4g} (delta {delta:g}) covers training one model, for a person in the training "
        f"set, with its hyperparameters taken as given. The selection is NOT covered by it: "
        f"the sampler proposed the hyperparameters, and the best trial is chosen, from metrics "
        f"computed without noise. ")
    tail = (" For an end-to-end epsilon that covers the selection, use private tuning "
            "(sweep.tuning = \"private\").")
    if not attack:
        return head + (
            f"The sampler saw validation accuracy alone, a function of one trained model and "
            f"the validation set. For a person with records in the training set only, the "
            f"validation set is fixed, so every proposal, validation score and choice is "
            f"post-processing of models trained before it, and adaptive composition over all "
            f"{models} models bounds releasing all of them, with their hyperparameters, their "
            f"validation scores and any choice among them made from validation metrics, the "
            f"selected model included, at ({composed:.4g}, {composed_delta:.3g})-DP ({how}); "
            f"releasing the selected model alone is covered by this bound, not by the per-trial "
            f"epsilon. It does not cover anything computed on the training records without "
            f"noise (the training loss, a membership-inference or canary audit) or a choice "
            f"made from it (pick --max-peak-mia). For a person in the validation set there is "
            f"no guarantee at all: the hyperparameters tried, the selection and so the released "
            f"model depend on their record through accuracy computed without noise. A person "
            f"only in the holdout or test set influences neither the models nor a choice made "
            f"from validation metrics; the audit and test metrics computed on their records are "
            f"not covered." + tail)
    return head + (
        f"The sampler also saw the peak accuracy of a membership-inference attack run inside "
        f"every trial on training members and holdout non-members, computed without noise. "
        f"That score is a direct function of the training records, not post-processing of a "
        f"DP output, so for a person in the training set the hyperparameters proposed once an "
        f"audited trial had finished, the models trained with them and the selection depend on "
        f"their record outside any DP mechanism: no bound covers releasing any of those "
        f"models with its hyperparameters, or the selection, and composition over the "
        f"{models} models does not either (it would only if the sampler had seen validation "
        f"accuracy alone). The per-trial epsilon covers only a model whose hyperparameters "
        f"were fixed before any audit result existed (each study's first, preset trial), "
        f"released as a choice made in advance. For a person in the validation or holdout set "
        f"there is no guarantee at all: the sampler saw metrics computed on their records "
        f"without noise." + tail)


def adaptive_statement(*, n_trials: int, per_trial_epsilon: float, delta: float,
                       objectives: tuple[str, ...] | list[str], reruns: int = 0,
                       sample_rate: float | None = None,
                       schedule: Schedule | None = None) -> AdaptiveStatement:
    """The honest statement for an adaptive (TPE) sweep, given what its sampler saw.

    ``objectives`` are the sampler's: validation accuracy alone (then the composition over
    every trained model, ``n_trials`` search trials plus ``reruns``, covers releasing all of
    them and any choice made from validation metrics, for the training set), or with the
    in-trial attack's peak accuracy (then no composition covers what was chosen adaptively).
    Without a mechanism, each trial is a black-box (per_trial_epsilon, delta)-DP mechanism
    composed optimally with dp_accounting PLD at (N + 1) delta: N delta for the trials' own
    failure probability plus delta of slack. With ``sample_rate`` and ``schedule`` (every model
    the same DP-SGD run) the N runs are composed exactly at ``delta``.
    """
    n = whole(n_trials, field="n_trials", low=1)
    r = whole(reruns, field="reruns", low=0)
    eps = check_positive(per_trial_epsilon, field="privacy.epsilon")
    d = check_delta(delta)
    seen = _objectives(objectives)
    if (sample_rate is None) != (schedule is None):
        raise UserInputError(field="schedule", value=repr(schedule)[:200],
                             allowed="given together with sample_rate, or both unset")
    attack = len(seen) > 1
    composed: float | None = None
    composed_delta: float | None = None
    how = "none: the sampler adapted to an attack on the training members"
    if not attack:
        composed, composed_delta, how = _composed(n=n + r, eps=eps, delta=d,
                                                  sample_rate=sample_rate, schedule=schedule)
    statement = _adaptive_text(n=n, reruns=r, eps=eps, delta=d, attack=attack,
                               composed=composed, composed_delta=composed_delta, how=how)
    return AdaptiveStatement(n_trials=n, reruns=r, per_trial_epsilon=eps, delta=d,
                             objectives=seen, composed_epsilon=composed,
                             composed_delta=composed_delta, composition=how,
                             statement=statement)
