"""Stopping weak trials early: asynchronous successive halving (ASHA) at epoch rungs.

Li et al. 2020, "A System for Massively Parallel Hyperparameter Tuning" (arXiv 1810.05934):
a trial reaching rung k (epoch ``r * eta**k``) continues only if its validation accuracy is at
least the ``1 - 1/eta`` quantile of the values earlier trials of its study recorded there; the
first trial at a rung always continues. It is asynchronous, so no trial waits for others at a
rung (with two cores and ``max_concurrent_trials`` slots, a synchronous rung would hold slots
idle), and a trial's decision depends only on what came before it. This is the stopping variant
Ray Tune's ``ASHAScheduler`` implements; it runs here rather than as Tune's scheduler because a
pruned trial must leave its own record (status, rung, epochs, the epsilon its ledger spent) in
its directory like any other trial, so that ``resume`` never re-runs it and a killed driver
loses nothing.

One board per sweep lives in a Ray actor the driver creates; each study is its own bracket.
The driver seeds it from the trial records on disk when a sweep resumes, so decisions already
taken stay taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dpsweep.core.errors import UserInputError

#: The actor's name prefix (one per sweep) and its Ray namespace (every trial worker looks it
#: up there, whatever namespace Tune's actors run in).
ACTOR_PREFIX = "dpsweep-rungs-"
NAMESPACE = "dpsweep"


def rungs(*, epochs: int, min_epochs: int, factor: int) -> tuple[int, ...]:
    """Epochs at which a trial may be stopped: ``r, r eta, r eta^2, ...`` below ``epochs``."""
    if factor < 2 or min_epochs < 1:
        raise UserInputError(field="sweep.pruner_factor", value=factor,
                             allowed="an integer >= 2 (with sweep.pruner_min_epochs >= 1)")
    out: list[int] = []
    epoch = min_epochs
    while epoch < epochs:
        out.append(epoch)
        epoch *= factor
    return tuple(out)


def cutoff(values: list[float], *, factor: int) -> float | None:
    """The ``1 - 1/eta`` quantile (linear interpolation, as numpy's default) of ``values``."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * (1.0 - 1.0 / factor)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class RungBoard:
    """Values recorded per (study, rung) in arrival order, and every decision taken."""

    factor: int
    recorded: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    decided: dict[tuple[str, int, str], bool] = field(default_factory=dict)

    def decide(self, *, study: str, trial_id: str, rung: int, value: float) -> bool:
        """Whether ``trial_id`` continues past ``rung``; asked twice, the same answer."""
        key = (study, rung, trial_id)
        if key in self.decided:
            return self.decided[key]
        earlier = self.recorded.setdefault((study, rung), {})
        threshold = cutoff(list(earlier.values()), factor=self.factor)
        keep = threshold is None or not value < threshold  # a NaN value never continues
        keep = keep and math.isfinite(value)
        earlier[trial_id] = value
        self.decided[key] = keep
        return keep

    def seed(self, *, study: str, trial_id: str, rung: int, value: float, kept: bool) -> None:
        """A decision taken before the driver restarted (from the trial's records)."""
        self.recorded.setdefault((study, rung), {})[trial_id] = value
        self.decided[(study, rung, trial_id)] = kept


class TrialPruned(Exception):
    """Raised from a trial's per-epoch report when the board stops it at a rung."""

    def __init__(self, *, rung: int, value: float) -> None:
        super().__init__(f"pruned at epoch {rung} (validation accuracy {value:.4f})")
        self.rung = rung
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_pruned, (self.rung, self.value))


def _pruned(rung: int, value: float) -> TrialPruned:
    return TrialPruned(rung=rung, value=value)


def start_board(*, name: str, factor: int) -> Any:
    """The sweep's board as a named Ray actor owned by the driver: the caller keeps the handle
    for the sweep's duration (the actor dies with it, and with the driver)."""
    import ray

    actor = ray.remote(num_cpus=0)(_BoardActor)
    return actor.options(name=name, namespace=NAMESPACE).remote(factor)


class _BoardActor:
    """The board behind a Ray actor: one decision at a time, in arrival order."""

    def __init__(self, factor: int) -> None:
        self.board = RungBoard(factor=factor)

    def decide(self, study: str, trial_id: str, rung: int, value: float) -> bool:
        return self.board.decide(study=study, trial_id=trial_id, rung=rung, value=value)

    def seed(self, study: str, trial_id: str, rung: int, value: float, kept: bool) -> None:
        self.board.seed(study=study, trial_id=trial_id, rung=rung, value=value, kept=kept)


def ask_board(pruning: dict[str, Any], *, trial_id: str, epoch: int, value: float) -> None:
    """In a trial: at a rung, ask the sweep's board; raise :class:`TrialPruned` to stop."""
    if epoch not in pruning["rungs"]:
        return
    import ray

    board = ray.get_actor(pruning["actor"], namespace=NAMESPACE)
    keep = ray.get(board.decide.remote(pruning["study"], trial_id, epoch, float(value)))
    if not keep:
        raise TrialPruned(rung=epoch, value=float(value))
