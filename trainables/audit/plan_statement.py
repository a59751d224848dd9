"""What an audit's plan can and cannot see, in words for the report, with the measured strength
of each plan (bench/audit_strength.py) quoted beside it."""

from __future__ import annotations

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.audit.references import PLANS
from dpsweep.trainables.audit.scores import PER_EXAMPLE_VARIANCE_MIN_MODELS

#: TPR at 1% FPR of the audit's strongest attack on a memorising digits model (300 members),
#: median, min and max over 10 seeds, per (plan, references): bench/audit_strength.py's
#: results (bench/results/audit_strength.json; a test keeps the two equal), quoted by
#: :func:`plan_statement`.
#: The key of the pooled plan's measurement (bench/audit_strength.py's pooled row: each trial
#: trains ``POOLED_PER_TRIAL`` references).
POOLED = "pooled"
POOLED_PER_TRIAL = 4
MEASURED_TPR_AT_1PCT_FPR: dict[tuple[str, int], tuple[float, float, float]] = {
    ("offline", 4): (0.10, 0.07, 0.15), ("online", 4): (0.16, 0.11, 0.18),
    ("online", 16): (0.18, 0.14, 0.20), (POOLED, 16): (0.17, 0.15, 0.20)}


def _plan_words(plan: str, n: int) -> str:
    if plan == POOLED:
        return (f"{n} online references pooled over {n // POOLED_PER_TRIAL} trials of a study "
                "with different hyperparameters")
    return f"{n} {plan} references"


def plan_statement(*, kind: str, n_references: int, trials: int = 1) -> str:
    """What an audit with this plan can and cannot see, for the report (from the plan and the
    measurements above); ``trials`` > 1: its references were trained by that many trials of
    one study, each like itself (``orchestrator.audit.pooling``)."""
    if kind not in PLANS:
        raise UserInputError(field="audit.references", value=kind, allowed=f"one of {PLANS}")
    k = n_references
    if kind == "online":
        text = (f"Online audit, {k} reference models each trained on a random half of the "
                f"audited members and non-members: every candidate is compared with {k // 2} "
                "models that trained on it and as many that did not (online LiRA, with its "
                "IN - OUT shift per candidate and pooled over candidates of similar "
                "difficulty; RMIA), the stronger plan.")
    else:
        text = (f"Offline audit, {k} reference models trained on the public pool only: no "
                "reference trained on any candidate, so each is compared with models that did "
                "not see it (offline LiRA, RMIA's offline approximation) and online LiRA is "
                "not run: no reference trains on the private data, and the attack is weaker.")
    if trials > 1:
        text += (f" The {k} references are pooled over {trials} trials of the study, each "
                 f"trained with that trial's hyperparameters on its own random halves (about "
                 f"{k // trials} per trial): the candidates' expected IN and OUT values are "
                 "estimated from more models, while a reference's hyperparameters may differ "
                 "from this trial's.")
    this = (POOLED, k) if trials > 1 else (kind, k)
    measured = "; ".join(
        f"{_plan_words(plan, n)}{' (this plan)' if (plan, n) == this else ''} reached "
        f"{mid:.2f} ({lo:.2f}-{hi:.2f})"
        for (plan, n), (mid, lo, hi) in sorted(MEASURED_TPR_AT_1PCT_FPR.items()))
    text += (" On a memorising digits model, TPR at 1% FPR of the strongest attack (median and "
             f"range over 10 seeds): {measured}.")
    if k < PER_EXAMPLE_VARIANCE_MIN_MODELS:
        text += (f" With fewer than {PER_EXAMPLE_VARIANCE_MIN_MODELS} references LiRA fits one "
                 "pooled variance per side, not one per example.")
    return (text + " A detected leak is significant at the audit's alpha after Holm "
            "correction over layers x attacks; no detection only says these signals found "
            "none at this power. It is not a privacy guarantee: no audit bounds epsilon from "
            "above (`dpsweep audit` gives a lower bound).")
