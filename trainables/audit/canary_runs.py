"""One audited training run: a trial re-trained once with canaries (white-box or black-box),
its canaries scored, and the epsilon lower bound that the guesses support.

Kept apart from the canaries themselves because it drives the training loop
(:mod:`trainables.training.loop`); the canaries only instrument a method.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.core.trial import TrialSpec
from dpsweep.trainables.audit.canaries import (
    BLACK_BOX,
    WHITE_BOX,
    CanaryCounts,
    WhiteBoxInstrument,
    canary_sampler,
    draw_membership,
)
from dpsweep.trainables.audit.input_canaries import BlackBoxInstrument, choose_input_canaries
from dpsweep.trainables.audit.stats.attacks import DEFAULT_CONFIDENCE
from dpsweep.trainables.audit.stats.onerun import (
    CanaryBound,
    canary_audit,
    default_guess_counts,
    epsilon_lower_bound,
)
from dpsweep.trainables.training.loop import load_trial_data, train_trial

if TYPE_CHECKING:
    from dpsweep.trainables.data.splits import DataSplits
    from dpsweep.trainables.dp.step import DPStep
    from dpsweep.trainables.training.loop import Reporter


def guess_counts(*, m: int, delta: float,
                 confidence: float = DEFAULT_CONFIDENCE) -> tuple[tuple[int, int], ...]:
    """(k_plus, k_minus) candidates: the paper's symmetric guesses (k IN, k OUT) and IN-only
    guesses (k, 0) at the same k, less those too few to bound epsilon above 0 even if all right.

    Why IN-only too: an IN canary never sampled (probability (1 - q)^T) scores like an OUT one,
    and a leak confined to some canaries (the mislabelled inputs a model memorised) lifts only
    those, so the top of the ranking can be far more reliable than its bottom. Why the pruning:
    every candidate is tested at 1 - (1 - confidence) / K (union bound), and r guesses all right
    reject epsilon = 0 only when 2^-r is below that; with 300 black-box canaries (the digits
    holdout split) (3, 3), (3, 0) and (8, 0) never could, and would only dilute the others.
    """
    symmetric = default_guess_counts(m=m)
    pairs = list(dict.fromkeys([*symmetric, *((k, 0) for k, _ in symmetric)]))
    level = 1 - (1 - confidence) / len(pairs)
    useful = [p for p in pairs if epsilon_lower_bound(m=m, r=sum(p), v=sum(p), delta=delta,
                                                      confidence=level) > 0]
    return tuple(useful) or (max(pairs, key=sum),)


@dataclass(frozen=True)
class CanaryRun:
    """One training run with canaries: the scores, the secret membership, and the claim."""

    kind: str
    m: int
    scores: tuple[float, ...]
    is_member: tuple[bool, ...]
    delta: float
    claimed_epsilon: float  # the accountant's upper bound for the run (same calibration)
    dp_valid: bool
    steps: int
    joins: int
    dropped_joins: int
    test_accuracy: float
    seconds: float
    design: dict[str, Any] = field(default_factory=dict)  # where the canaries are (public)

    def bound(self, *, confidence: float = DEFAULT_CONFIDENCE) -> CanaryBound:
        """The epsilon lower bound at ``confidence`` (``stats.onerun.canary_audit``)."""
        return canary_audit(scores=np.asarray(self.scores), is_member=np.asarray(self.is_member),
                            delta=self.delta, confidence=confidence,
                            guess_counts=guess_counts(m=self.m, delta=self.delta,
                                                      confidence=confidence))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "m": self.m, "delta": self.delta,
                "claimed_epsilon": self.claimed_epsilon, "dp_valid": self.dp_valid,
                "steps": self.steps, "joins": self.joins, "dropped_joins": self.dropped_joins,
                "in_canaries": int(sum(self.is_member)), "test_accuracy": self.test_accuracy,
                "seconds": self.seconds, "design": self.design,
                "scores": [s if math.isfinite(s) else None for s in self.scores],
                "is_member": [bool(b) for b in self.is_member]}


def _finish(*, kind: str, spec: TrialSpec, result: Any, scores: np.ndarray,
            is_member: np.ndarray, counts: CanaryCounts, design: dict[str, Any],
            start: float) -> CanaryRun:
    cal = spec.calibration
    return CanaryRun(kind=kind, m=len(scores), scores=tuple(float(s) for s in scores),
                     is_member=tuple(bool(b) for b in is_member), delta=cal.delta,
                     claimed_epsilon=float(result.privacy_record.epsilon_upper),
                     dp_valid=result.privacy_record.dp_valid, steps=counts.steps,
                     joins=counts.joins, dropped_joins=counts.dropped,
                     test_accuracy=float(result.test_accuracy),
                     seconds=time.perf_counter() - start, design=design)


def white_box_run(spec: TrialSpec, *, m: int, seed: int, data: DataSplits | None = None,
                  report: Reporter | None = None,
                  on_install: Callable[[WhiteBoxInstrument], None] | None = None) -> CanaryRun:
    """Re-train ``spec`` once with m layer canaries; score them (module docstring)."""
    start = time.perf_counter()
    data = load_trial_data(spec) if data is None else data
    is_member = draw_membership(m)
    inst = WhiteBoxInstrument(m=m, seed=seed, is_member=is_member, sampler=canary_sampler(spec),
                              reference=(data.train.x, data.train.y))

    def install(method: DPStep) -> None:
        device = next(method.model.parameters()).device
        inst.reference = (data.train.x.to(device), data.train.y.to(device))
        inst(method)
        if on_install is not None:
            on_install(inst)

    result = train_trial(spec, data=data, report=report, instrument=install)
    assert inst.canaries is not None
    return _finish(kind=WHITE_BOX, spec=spec, result=result, scores=inst.scores(),
                   is_member=is_member, counts=inst.counts, design=inst.canaries.to_dict(),
                   start=start)


def black_box_run(spec: TrialSpec, *, m: int, seed: int, data: DataSplits | None = None,
                  report: Reporter | None = None) -> CanaryRun:
    """Re-train ``spec`` once with m mislabelled holdout canaries; score them by -loss."""
    start = time.perf_counter()
    data = load_trial_data(spec) if data is None else data
    canaries = choose_input_canaries(data, m=m, seed=seed)
    is_member = draw_membership(canaries.m)
    inst = BlackBoxInstrument(canaries=canaries, is_member=is_member,
                              sampler=canary_sampler(spec))
    result = train_trial(spec, data=data, report=report, instrument=inst)
    return _finish(kind=BLACK_BOX, spec=spec, result=result, scores=inst.scores(),
                   is_member=is_member, counts=inst.counts, design=canaries.to_dict(),
                   start=start)
