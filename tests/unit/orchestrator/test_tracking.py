"""Tracking (issue 43, item 3): a run's recorded trials as TensorBoard event files, read back
with TensorBoard's own reader, and as MLflow runs in a local store, read back with MLflow's
client; a tracker that fails is reported once and the trials go on being recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bench.synthetic_run import make_run
from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.vocabulary import FAILED, OK
from dpsweep.orchestrator import api, door
from dpsweep.orchestrator.config import MLFLOW_EXTRA, TrackingConfig
from dpsweep.orchestrator.sweep.tracking import (
    EPOCH_PREFIX,
    FINAL_PREFIX,
    MLFLOW_ARTIFACTS_DIR,
    NOT_COVERED_TAG,
    STATEMENT_ARTIFACT,
    TENSORBOARD_DIR,
    TRIAL_TAG,
    Tracker,
)
from dpsweep.reports import store

AUDIT_FAILED = "t12"  # the synthetic run's trial whose audit failed
NEVER_TRAINED = "t11"  # its failed trial: no records


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The synthetic run and its search trials' rows, as a resume reads them."""
    path = make_run(tmp_path_factory.mktemp("tracking"))
    rows = store.read_results(path).to_dict("records")
    return path, [r for r in rows if r["trial_id"].startswith("t")]


def _track(run_dir: Path, rows: list[dict[str, Any]], settings: TrackingConfig,
           warnings: list[str], *, out: Path | None = None) -> Tracker:
    """Each row tracked from ``run_dir``'s records, into ``out`` (the run directory itself
    unless given: the synthetic run is shared by the module's tests)."""
    tracker = Tracker.for_run(settings=settings, run_dir=out or run_dir, warn=warnings.append)
    for row in rows:
        tracker.trial(row=row, trial_dir=run_dir / layout.TRIALS / row["trial_id"])
    return tracker


def _history(run_dir: Path, tid: str) -> list[dict[str, Any]]:
    return json.loads((run_dir / layout.TRIALS / tid / layout.HISTORY).read_text())


def test_tensorboard_event_files_hold_every_trials_epochs_and_audit(
        run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    run_dir, rows = run
    out = tmp_path / "out"
    warnings: list[str] = []
    _track(run_dir, rows, TrackingConfig(tensorboard=True), warnings, out=out)
    trained = [r for r in rows if r["status"] == OK]
    assert warnings == []
    assert sorted(p.name for p in (out / TENSORBOARD_DIR).iterdir()) == sorted(
        r["trial_id"] for r in trained)  # a trial that never trained has nothing to show
    for row in trained:
        events = EventAccumulator(str(out / TENSORBOARD_DIR / row["trial_id"]))
        events.Reload()
        history = _history(run_dir, row["trial_id"])
        for key, tag in (("val_accuracy", "val_accuracy"), ("train_loss_nonprivate",
                                                             "train_loss"),
                         ("epsilon_spent", "epsilon_spent")):
            assert [(e.step, pytest.approx(e.value)) for e in
                    events.Scalars(EPOCH_PREFIX + tag)] == [(h["epoch"], h[key])
                                                            for h in history]
        tags = events.Tags()["scalars"]
        audited = row["trial_id"] != AUDIT_FAILED
        assert (FINAL_PREFIX + "peak_mia_accuracy" in tags) == audited
        if audited:
            (peak,) = events.Scalars(FINAL_PREFIX + "peak_mia_accuracy")
            assert (peak.step, peak.value) == (row["epochs"], pytest.approx(
                row["peak_mia_accuracy"]))


def test_one_mlflow_run_per_trial_in_a_local_store(
        run: tuple[Path, list[dict[str, Any]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A local SQLite store (MLflow 3 refuses its file store), its artifacts in the run
    directory, none in the working directory."""
    run_dir, rows = run
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    warnings: list[str] = []
    _track(run_dir, rows, TrackingConfig(tensorboard=False, mlflow_uri=uri), warnings)
    assert warnings == []
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(f"dpsweep/{run_dir.name}")
    runs = {r.data.tags[TRIAL_TAG]: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted(r["trial_id"] for r in rows)
    for row in rows:
        got = runs[row["trial_id"]]
        assert got.data.tags["dpsweep.status"] == row["status"]
        assert got.info.status == ("FAILED" if row["status"] == FAILED else "FINISHED")
        if row["status"] != OK:
            continue
        assert float(got.data.params["lr"]) == pytest.approx(row["lr"])
        history = _history(run_dir, row["trial_id"])
        assert [(m.step, m.value) for m in client.get_metric_history(
            got.info.run_id, "val_accuracy")] == [(h["epoch"], pytest.approx(h["val_accuracy"]))
                                                  for h in history]
        not_covered = got.data.tags[NOT_COVERED_TAG].split(",")
        assert "val_accuracy" in not_covered and "epsilon_spent" not in not_covered
        assert "clipped_fraction" in not_covered
        statement = json.loads(Path(client.download_artifacts(
            got.info.run_id, STATEMENT_ARTIFACT, str(tmp_path))).read_text())
        assert statement["epsilon_exact"] == pytest.approx(row["epsilon_upper"])
        assert statement["dp_valid"] == row["dp_valid"]
    assert not (tmp_path / "mlruns").exists()
    assert any((run_dir / MLFLOW_ARTIFACTS_DIR).rglob(STATEMENT_ARTIFACT))


def test_a_failing_tracker_is_reported_once_and_switched_off(
        run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    run_dir, rows = run
    out = tmp_path / "out"
    out.mkdir()
    (out / TENSORBOARD_DIR).write_text("not a folder")  # every write fails
    warnings: list[str] = []
    tracker = _track(run_dir, rows, TrackingConfig(tensorboard=True), warnings, out=out)
    assert len(warnings) == 1 and "TensorBoard switched off" in warnings[0]
    assert tracker.backends == ()
    tracker.amended(row=rows[0], columns={"audit_error": ""})  # nothing left to write: no error
    unreachable: list[str] = []
    bad = Tracker.for_run(settings=TrackingConfig(tensorboard=False, mlflow_uri="nosuch://x"),
                          run_dir=out, warn=unreachable.append)
    assert bad.backends == () and len(unreachable) == 1 and "MLflow" in unreachable[0]


def test_an_mlflow_uri_without_mlflow_is_refused_naming_the_field_and_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = api.from_dict({"tracking": {"mlflow_uri": "http://localhost:5000"}})
    door.check(cfg)  # installed here (the dev extra)
    monkeypatch.setattr(door, "find_spec", lambda name: None)
    with pytest.raises(UserInputError, match=r"tracking\.mlflow_uri") as refused:
        door.check(cfg)
    assert MLFLOW_EXTRA in str(refused.value)


def test_the_clipped_fraction_is_tracked_per_epoch(
        run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    """history.json's ``clipped_fraction`` (the training loop's) is an ``epoch/`` scalar."""
    run_dir, rows = run
    row = next(r for r in rows if r["status"] == OK)
    trial = tmp_path / "trial"
    trial.mkdir()
    history = [{**h, "clipped_fraction": 0.25 * h["epoch"]}
               for h in _history(run_dir, row["trial_id"])]
    (trial / layout.HISTORY).write_text(json.dumps(history))
    warnings: list[str] = []
    Tracker.for_run(settings=TrackingConfig(tensorboard=True), run_dir=tmp_path,
                    warn=warnings.append).trial(row=row, trial_dir=trial)
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR / row["trial_id"]))
    events.Reload()
    assert warnings == []
    assert [(e.step, e.value) for e in events.Scalars(EPOCH_PREFIX + "clipped_fraction")] == [
        (h["epoch"], pytest.approx(h["clipped_fraction"])) for h in history]
