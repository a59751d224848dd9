"""``bench.chaos``'s pure parts: the seeded fault schedule, the end-state checks on a synthetic
run directory, and its docs table.

The soak itself runs for minutes on the real CLI; what it concludes rests on these checks, so
each must see the fault it is there to see (a lost trial, a finished trial trained again, an
Optuna trial left RUNNING, a results row that disagrees with its record) and nothing else.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
import pytest

from bench import chaos
from bench.docgen import runs as docgen_runs
from dpsweep.core import layout
from dpsweep.orchestrator.api import load_config as load
from dpsweep.reports.store import failed_row, pruned_row, write_results

ID_ATTR = "dpsweep_trial_id"  # orchestrator.sweep.studies.ID_ATTR
OK_ID, PRUNED_ID, FLIGHT_ID = "dpsgd_eps3-000", "dpsgd_eps3-001", "dpsgd_eps3-002"
OK_RECORD = {"status": "ok", "trial_id": OK_ID, "val_accuracy": 0.61, "test_accuracy": 0.58}
PRUNED_RECORD = {"status": "pruned", "trial_id": PRUNED_ID, "val_accuracy": 0.21,
                 "pruned_at": 1, "epochs_run": 1, "epsilon_spent": 1.9}


def test_the_schedule_is_seeded_balanced_and_in_range() -> None:
    plan = chaos.fault_schedule(seed=44, faults=18)
    assert plan == chaos.fault_schedule(seed=44, faults=18)
    assert plan != chaos.fault_schedule(seed=45, faults=18)
    assert Counter(f.kind for f in plan) == dict.fromkeys(chaos.KINDS, 6)
    assert [f.index for f in plan] == list(range(18))
    for f in plan:
        assert f.anchor == chaos.RECORD or f.kind != chaos.WORKER  # a worker holds a trial
        lo, hi = (chaos.WORKER_DELAY_S if f.kind == chaos.WORKER else
                  chaos.START_DELAY_S if f.anchor == chaos.START else chaos.RECORD_DELAY_S)
        assert lo <= f.delay_s <= hi
    assert {f.anchor for f in plan if f.kind != chaos.WORKER} == {chaos.START, chaos.RECORD}
    assert Counter(f.kind for f in chaos.fault_schedule(seed=1, faults=7)) == {
        chaos.DRIVER: 3, chaos.WORKER: 2, chaos.GROUP: 2}


def test_the_soak_configs_are_what_the_issue_asks(tmp_path: Path) -> None:
    for key, part in chaos.PARTS.items():
        path = tmp_path / f"{key}.toml"
        path.write_text(part.config.format(seed=44))
        cfg = load(path)
        assert not cfg.audit.enabled and cfg.training.epochs <= chaos.PRIVATE_EPOCHS
        if key == "asha":
            assert cfg.sweep.pruner == "asha" and cfg.sweep.trials_per_method >= 60
            assert part.faults >= part.min_faults >= 15
        else:
            assert cfg.sweep.tuning == "private" and cfg.sweep.pruner == "none"


def _row(record: dict[str, Any]) -> dict[str, Any]:
    if record["status"] == "pruned":
        return pruned_row(trial_id=record["trial_id"], method="dpsgd", record=record,
                          spec={"calibration": {"target_epsilon": 3.0}, "epochs": 3})
    row = failed_row(trial_id=record["trial_id"], method="dpsgd", error="")
    row.update(status="ok", val_accuracy=record["val_accuracy"],
               test_accuracy=record["test_accuracy"])
    return row


def _optuna(run: Path, states: dict[str, str]) -> None:
    study = optuna.create_study(study_name="dpsgd@eps3", storage=f"sqlite:///{run / 'optuna.db'}")
    for tid, state in states.items():
        trial = study.ask()
        trial.set_user_attr(ID_ATTR, tid)
        if state == "COMPLETE":
            study.tell(trial, 0.5)
        elif state == "PRUNED":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    """A run directory after a crash: one trial finished, one pruned, one in flight (a folder
    without a record, RUNNING in Optuna, no results row)."""
    run = tmp_path / "run"
    for record in (OK_RECORD, PRUNED_RECORD):
        trial = run / layout.TRIALS / record["trial_id"]
        trial.mkdir(parents=True)
        (trial / layout.RESULT).write_text(json.dumps(record))
    (run / layout.TRIALS / FLIGHT_ID).mkdir()
    write_results(run, [_row(OK_RECORD), _row(PRUNED_RECORD)])
    _optuna(run, {OK_ID: "COMPLETE", PRUNED_ID: "PRUNED", FLIGHT_ID: "RUNNING"})
    return run


def test_check_run_finds_the_lost_trial_and_the_running_one(run: Path) -> None:
    checks = chaos.check_run(run, planned=frozenset({OK_ID, PRUNED_ID, FLIGHT_ID}))
    assert checks["lost"] == [FLIGHT_ID] and len(checks["running_left"]) == 1
    assert (checks["ok"], checks["pruned"], checks["failed"]) == (1, 1, 0)
    assert checks["store_mismatches"] == [] and checks["optuna_agrees"]
    assert checks["unplanned"] == [] and checks["two_final_records"] == []
    assert chaos.in_flight(run) == [FLIGHT_ID]
    clean = chaos.check_run(run, planned=frozenset({OK_ID, PRUNED_ID}))
    assert clean["unplanned"] == [] and clean["lost"] == []
    (run / layout.TRIALS / FLIGHT_ID / layout.ERROR).write_text("{}")
    (run / layout.TRIALS / OK_ID / layout.ERROR).write_text("{}")
    after = chaos.check_run(run, planned=frozenset({OK_ID, PRUNED_ID}))
    assert after["two_final_records"] == [OK_ID] and after["unplanned"] == [FLIGHT_ID]


def test_store_mismatches_names_each_disagreement() -> None:
    records = {OK_ID: OK_RECORD, PRUNED_ID: PRUNED_RECORD}
    rows = [_row(OK_RECORD), _row(PRUNED_RECORD)]
    assert chaos.store_mismatches(records, rows) == []
    failed = failed_row(trial_id="dpsgd_eps3-009", method="dpsgd", error="planning failed")
    assert chaos.store_mismatches(records, [*rows, failed]) == []  # a failed plan: a row only
    found = chaos.store_mismatches(
        {**records, "dpsgd_eps3-005": OK_RECORD},
        [{**rows[0], "val_accuracy": 0.5}, rows[1], rows[1]])
    assert found == [f"{PRUNED_ID}: 2 rows", "dpsgd_eps3-005: a record, no row",
                     f"{OK_ID}: val_accuracy row 0.5, record 0.61"]
    assert chaos.store_mismatches({OK_ID: PRUNED_RECORD}, [rows[0]]) == [
        f"{OK_ID}: row ok, record pruned"]


def test_identity_sees_a_finished_trial_trained_again(run: Path) -> None:
    identity = chaos.Identity(run)
    identity.observe()
    identity.observe()
    assert set(identity.first) == {OK_ID, PRUNED_ID} and not identity.changed
    (run / layout.TRIALS / OK_ID / layout.RESULT).write_text(
        json.dumps({**OK_RECORD, "val_accuracy": 0.62}))
    (run / layout.TRIALS / PRUNED_ID / layout.RESULT).unlink()
    identity.observe()
    assert identity.changed == {OK_ID} and identity.vanished == {PRUNED_ID}


def test_the_docs_table_says_not_measured_without_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docgen_runs, "RESULTS_DIR", tmp_path)
    assert docgen_runs.chaos_table().startswith("Not measured: its results file (`chaos.json`")
    assert docgen_runs.GENERATORS["chaos"] is docgen_runs.chaos_table
