"""optuna-dashboard's front across methods (issue 43, item 3): one read-only summary study per
target beside the per-(method, target) studies, read back from a real SQLite storage as the
dashboard reads it; none under private tuning. And the non-private baseline, tracked like the
search's trials."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpsweep.core.vocabulary import ATTACK_OBJECTIVE, FAILED, OK, PRUNED, VALIDATION_OBJECTIVE
from dpsweep.orchestrator import api
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.sweep import jobs as postsweep
from dpsweep.orchestrator.sweep.plans import study_plans
from dpsweep.orchestrator.sweep.records import SweepRecords
from dpsweep.orchestrator.sweep.state import PrivateTuning, SweepContext, SweepProgress
from dpsweep.orchestrator.sweep.studies import (
    AUDIT_ERROR_ATTR,
    FRONT_ID_ATTR,
    FRONT_PARAM,
    OBJECTIVES,
    READ_ONLY_ATTR,
    UNMEASURED_ATTACK,
    Fronts,
    Outcome,
    StudyPlan,
    finished_trial_ids,
    front_name,
)
from dpsweep.orchestrator.sweep.tracking import FINAL_PREFIX, TENSORBOARD_DIR
from dpsweep.reports import store

EPSILON = 3.0
AUDIT_FAILURE = "RuntimeError: reference model diverged"

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def setup() -> Any:
    """Two methods at one target, audited: two studies with (validation up, attack down)."""
    return check(api.from_dict({
        "training": {"epochs": 2}, "audit": {"enabled": True}, "privacy": {"epsilon": EPSILON},
        "sweep": {"methods": ["dpsgd", "auto_s"], "trials_per_method": 3}}))


def _ok(val: float, attack: float | None = None, audit_error: str = "") -> Outcome:
    metrics: dict[str, Any] = {VALIDATION_OBJECTIVE: val, "audit_error": audit_error}
    if attack is not None:
        metrics[ATTACK_OBJECTIVE] = attack
    return Outcome(OK, metrics, "")


def _front(url: str) -> dict[str, Any]:
    """Copied trial id -> trial, as a fresh reader of the storage (the dashboard) sees them."""
    study = optuna.load_study(study_name=front_name(EPSILON), storage=url)
    return {t.user_attrs[FRONT_ID_ATTR]: t for t in study.get_trials()}


def test_every_methods_complete_trials_share_one_front_once(setup: Any, tmp_path: Path) -> None:
    dpsgd, auto_s = plans = study_plans(setup)
    assert {p.epsilon for p in plans} == {EPSILON}
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    fronts = Fronts(storage=url, plans=plans)
    added = [fronts.add(dpsgd, dpsgd.trial_id(0), _ok(0.8, 0.55), attrs={"lr": 0.5}),
             fronts.add(auto_s, auto_s.trial_id(0), _ok(0.7, 0.51), attrs={"lr": 2.0}),
             fronts.add(auto_s, auto_s.trial_id(1), _ok(0.75, audit_error=AUDIT_FAILURE),
                        attrs={}),
             fronts.add(dpsgd, dpsgd.trial_id(1), Outcome(FAILED, {}, "diverged"), attrs={}),
             fronts.add(dpsgd, dpsgd.trial_id(2), Outcome(PRUNED, {"pruned_at": 1}, ""),
                        attrs={}),
             # a re-run with fresh noise is no point of the search
             fronts.add(dpsgd, dpsgd.trial_id(0) + "-r1", _ok(0.79, 0.54), attrs={})]
    assert added == [True, True, True, False, False, False]
    # a resume records its trials again through a new instance: nothing is copied twice
    again = Fronts(storage=url, plans=plans)
    assert not again.add(dpsgd, dpsgd.trial_id(0), _ok(0.8, 0.55), attrs={"lr": 0.5})
    assert again.add(dpsgd, dpsgd.trial_id(3), _ok(0.6, 0.5), attrs={})

    shown = _front(url)
    assert sorted(shown) == sorted([dpsgd.trial_id(0), dpsgd.trial_id(3), auto_s.trial_id(0),
                                    auto_s.trial_id(1)])
    assert {t.state.name for t in shown.values()} == {"COMPLETE"}
    assert shown[dpsgd.trial_id(0)].values == [0.8, 0.55]
    assert shown[dpsgd.trial_id(0)].params == {FRONT_PARAM: dpsgd.series}
    assert shown[auto_s.trial_id(0)].user_attrs["lr"] == 2.0
    failed_audit = shown[auto_s.trial_id(1)]
    assert failed_audit.values == [0.75, UNMEASURED_ATTACK]
    assert failed_audit.user_attrs[AUDIT_ERROR_ATTR] == AUDIT_FAILURE
    study = optuna.load_study(study_name=front_name(EPSILON), storage=url)
    assert [d.name.lower() for d in study.directions] == [OBJECTIVES[o]
                                                         for o in dpsgd.objectives]
    assert study.metric_names == list(dpsgd.objectives)
    assert study.user_attrs[READ_ONLY_ATTR] is True
    # the Pareto front spans both methods; the copies never count as the search's trials
    assert {t.params[FRONT_PARAM] for t in study.best_trials} == {dpsgd.series, auto_s.series}
    assert finished_trial_ids(tmp_path / "optuna.db") == set()


def _records(setup: Any, tmp_path: Path, *, private: PrivateTuning | None) -> SweepRecords:
    run = RunDir.create(tmp_path / "run", config_text=setup.config.to_toml())
    context = SweepContext(setup=setup, run=run, plans=tuple(study_plans(setup)),
                           private=private)
    return SweepRecords(context=context, progress=SweepProgress(quiet=True), attempts=[],
                        rows={})


def _row(plan: StudyPlan, tid: str) -> dict[str, Any]:
    row = store.failed_row(trial_id=tid, method=plan.method, series=plan.series,
                           study=plan.name, error="")
    row.update(status=OK, val_accuracy=0.8, lr=0.5, hp_mode="standard", degenerate=False)
    return row


def test_a_resumed_sweep_copies_its_recorded_trials_unless_tuning_is_private(
        setup: Any, tmp_path: Path) -> None:
    """``SweepRecords.reconciled`` (a resume meeting a recorded trial) fills in a copy a crash
    left out; under private tuning no summary study is made (the trial count is secret)."""
    for private in (None, PrivateTuning(plan=None, certified=None)):
        root = tmp_path / ("private" if private else "adaptive")
        records = _records(setup, root, private=private)
        plan = study_plans(setup)[0]
        tid = plan.trial_id(0)
        records._rows[tid] = _row(plan, tid)
        records.reconciled(plan, tid, _ok(0.8, 0.55))
        records.reconciled(plan, tid, _ok(0.8, 0.55))
        names = {s.study_name for s in optuna.get_all_study_summaries(
            storage=f"sqlite:///{root / 'run' / 'optuna.db'}")}
        if private is None:
            (copy,) = _front(f"sqlite:///{root / 'run' / 'optuna.db'}").values()
            assert (copy.user_attrs["lr"], copy.user_attrs["hp_mode"]) == (0.5, "standard")
        else:
            assert front_name(EPSILON) not in names


def test_the_nonprivate_baseline_is_tracked(setup: Any, tmp_path: Path) -> None:
    records = _records(setup, tmp_path, private=None)
    row = postsweep.baseline_row({"val_accuracy": 0.9, "val_loss": 0.3, "test_accuracy": 0.88,
                                  "test_loss": 0.35, "train_seconds": 4.0},
                                 num_classes=setup.num_classes)
    records.add(postsweep.BASELINE_ID, row)
    events = EventAccumulator(str(tmp_path / "run" / TENSORBOARD_DIR / postsweep.BASELINE_ID))
    events.Reload()
    (test_acc,) = events.Scalars(FINAL_PREFIX + "test_accuracy")
    assert test_acc.value == pytest.approx(0.88)
    assert not any(math.isinf(e.value) for tag in events.Tags()["scalars"]
                   for e in events.Scalars(tag))
