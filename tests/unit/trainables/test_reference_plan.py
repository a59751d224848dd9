"""DP references take the target's engine plan from the run's cache folder (the audit's
``plan_cache``) instead of timing the engine's candidates again, which cost each reference a
few steps' time; without the folder each reference times them itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.audit.references import Budget, dp_trainer
from dpsweep.trainables.data.splits import load_splits
from dpsweep.trainables.engine import plan as engine_plan
from dpsweep.trainables.training.loop import train_trial
from tests.conftest import tiny_config


def test_references_take_the_targets_plan_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[str] = []
    real = engine_plan.time_candidates

    def counting(handler: Any, *args: Any, **kwargs: Any) -> Any:
        timed.append(handler.qualname)
        return real(handler, *args, **kwargs)

    monkeypatch.setattr(engine_plan, "time_candidates", counting)
    data = load_splits(dataset="digits", seed=0)
    spec = plan_trial(check(tiny_config()), trial_id="target", data=data)
    budgets = {len(data.train): Budget(calibration=spec.calibration,
                                       epsilon_curve=list(spec.epsilon_curve))}
    train_trial(spec, data=data, plan_cache=tmp_path, evaluate_epochs=False)
    assert timed, "the target timed no candidate: nothing to share"
    timed.clear()
    dp_trainer(spec, budgets=budgets, plan_cache=tmp_path)(data, 11, 0)
    assert timed == []
    dp_trainer(spec, budgets=budgets)(data, 12, 1)
    assert timed, "without the folder a reference times the candidates itself"
