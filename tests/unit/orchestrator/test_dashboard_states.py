"""optuna-dashboard shows each trial in the state dpsweep gives it (issue 43, item 3): the
Optuna storage, read back as the dashboard reads it, against the results store's statuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from dpsweep.core.storage import atomic_write_json
from dpsweep.core.vocabulary import ATTACK_OBJECTIVE, FAILED, OK, PRUNED, VALIDATION_OBJECTIVE
from dpsweep.orchestrator import api
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep.plans import study_plans
from dpsweep.orchestrator.sweep.raytune import SweepSearcher
from dpsweep.orchestrator.sweep.studies import (
    AUDIT_ERROR_ATTR,
    ID_ATTR,
    UNMEASURED_ATTACK,
    Outcome,
    StudyPlan,
    finished_trial_ids,
    make_sampler,
    open_study,
    reconcile,
)

#: The Optuna state that shows each results-store status.
DASHBOARD_STATE = {OK: "COMPLETE", PRUNED: "PRUNED", FAILED: "FAIL"}
AUDIT_FAILURE = "RuntimeError: reference model diverged"

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def audited(tmp_path: Path) -> tuple[StudyPlan, Any, str]:
    """A two-objective study (validation up, attack down) in a SQLite storage."""
    cfg = api.from_dict({"training": {"epochs": 2}, "audit": {"enabled": True},
                         "sweep": {"methods": ["dpsgd"], "trials_per_method": 4}})
    (plan,) = study_plans(check(cfg))
    assert plan.objectives == (VALIDATION_OBJECTIVE, ATTACK_OBJECTIVE)
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    storage = optuna.storages.RDBStorage(url)
    open_study(plan, storage=storage, sampler=make_sampler("tpe", seed=0, parallel=True))
    return plan, storage, url


def _write(root: Path, tid: str, name: str, record: dict[str, Any]) -> None:
    atomic_write_json(root / tid / name, {"trial_id": tid, **record})


def _dashboard(url: str, name: str) -> dict[str, tuple[str, Any]]:
    """Trial id -> (state, trial) as a fresh reader of the storage sees them."""
    study = optuna.load_study(study_name=name, storage=url)
    return {t.user_attrs[ID_ATTR]: (t.state.name, t) for t in study.get_trials()}


def test_every_trial_shows_the_state_dpsweep_records_it_in(
        audited: tuple[StudyPlan, Any, str], tmp_path: Path) -> None:
    plan, storage, url = audited
    root = tmp_path / "trials"
    study = optuna.load_study(study_name=plan.name, storage=storage)
    tallies = {plan.name: reconcile(study, plan, storage=storage, trials_root=root,
                                    on_finished=lambda *a: None)}
    statuses: dict[str, str] = {}

    def recorded(_plan: StudyPlan, tid: str, outcome: Outcome, _ot: Any) -> None:
        statuses[tid] = outcome.status  # the results row's status (records.SweepRecords._row)

    searcher = SweepSearcher(plans=[plan], studies={plan.name: study}, tallies=tallies,
                             make_config=lambda _p, _params, tid: {"trial_id": tid},
                             on_outcome=recorded, trials_root=root)
    tids = [searcher.suggest(f"tune{i}")["trial_id"] for i in range(4)]
    _write(root, tids[0], "result.json", {"status": OK, "val_accuracy": 0.8,
                                          ATTACK_OBJECTIVE: 0.55, "audit_error": ""})
    _write(root, tids[1], "result.json", {"status": OK, "val_accuracy": 0.7,
                                          "audit_error": AUDIT_FAILURE})
    _write(root, tids[2], "error.json", {"status": FAILED, "error": "TrialDiverged: loss nan"})
    _write(root, tids[3], "result.json", {"status": PRUNED, "pruned_at": 1,
                                          "val_accuracy": 0.3})
    for i in range(4):
        searcher.on_trial_complete(f"tune{i}")

    shown = _dashboard(url, plan.name)
    assert statuses == dict(zip(tids, (OK, OK, FAILED, PRUNED), strict=True))
    assert {tid: state for tid, (state, _) in shown.items()} == {
        tid: DASHBOARD_STATE[status] for tid, status in statuses.items()}
    failed_audit = shown[tids[1]][1]
    assert failed_audit.values == [0.7, UNMEASURED_ATTACK]
    assert failed_audit.user_attrs[AUDIT_ERROR_ATTR] == AUDIT_FAILURE
    assert AUDIT_ERROR_ATTR not in shown[tids[0]][1].user_attrs


def test_a_crash_after_an_audit_failed_reconciles_to_complete(
        audited: tuple[StudyPlan, Any, str], tmp_path: Path) -> None:
    """The driver died before telling Optuna: resume tells the audit-failed trial COMPLETE,
    and the resume checks count it finished (it has its result.json)."""
    plan, storage, url = audited
    root = tmp_path / "trials"
    study = optuna.load_study(study_name=plan.name, storage=storage)
    asked = study.ask()
    asked.set_user_attr(ID_ATTR, plan.trial_id(0))
    _write(root, plan.trial_id(0), "result.json", {"status": OK, "val_accuracy": 0.7,
                                                   "audit_error": AUDIT_FAILURE})
    seen: list[str] = []
    tally = reconcile(study, plan, storage=storage, trials_root=root,
                      on_finished=lambda tid, out, _t: seen.append(out.status))
    state, trial = _dashboard(url, plan.name)[plan.trial_id(0)]
    assert (state, seen, tally.done) == ("COMPLETE", [OK], {plan.trial_id(0)})
    assert trial.user_attrs[AUDIT_ERROR_ATTR] == AUDIT_FAILURE
    assert finished_trial_ids(tmp_path / "optuna.db") == {plan.trial_id(0)}
