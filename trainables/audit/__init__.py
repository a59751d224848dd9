"""Calibrated per-example membership attacks per layer (LiRA / RMIA family).

* :mod:`trainables.audit.signals` — per-example, per-layer scalar signals of one model that mean
  the same thing in independently trained networks (log gradient norms per layer, the output's
  logit-scaled confidence, the loss).
* :mod:`trainables.audit.scores` — numpy-only membership scores of a target from its signal and
  reference models' signals of the same candidates: online / offline LiRA and RMIA, each with a
  decision threshold that does not use the target's membership.
* :mod:`trainables.audit.references` — which data reference models train on (online / offline
  plans), how (dpsweep's DP loop or the non-private recipe), their signals, and what a plan can
  and cannot see (:func:`plan_statement`).
* :mod:`trainables.audit.cache` — reference models kept between audits (safetensors, verified),
  reused where recipe, data and budget are identical.
* :mod:`trainables.audit.stats` — the statistics of attacks (intervals, corrected p-values) and
  the one-run canary lower bound (:mod:`trainables.audit.canaries` makes its canaries).
"""

from __future__ import annotations

from trainables.audit.references import (
    PLANS,
    AuditSignals,
    Budget,
    DPReferenceTrainer,
    NonPrivateRecipe,
    NonPrivateReferenceTrainer,
    ReferencePlan,
    collect_signals,
    dp_trainer,
    nonprivate_trainer,
    plan_references,
    plan_statement,
    score_signals,
    train_nonprivate,
)
from trainables.audit.scores import ATTACKS, AttackScores, attack_signal
from trainables.audit.signals import per_example_signals

__all__ = ["ATTACKS", "PLANS", "AttackScores", "AuditSignals", "Budget", "DPReferenceTrainer",
           "NonPrivateRecipe", "NonPrivateReferenceTrainer", "ReferencePlan", "attack_signal",
           "collect_signals", "dp_trainer", "nonprivate_trainer", "per_example_signals",
           "plan_references", "plan_statement", "score_signals", "train_nonprivate"]
