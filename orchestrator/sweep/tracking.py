"""Tracking where users already look: TensorBoard event files per trial in the run directory
and, with ``tracking.mlflow_uri``, one MLflow run per trial.

Both are written by the driver when a trial's results row is recorded (``SweepRecords``), from
records the run directory already holds (the trial's ``history.json`` and its row), so nothing
new runs in a worker. Only values the results store declares are written: each per-epoch value
of the history is named by the column that declares it (``EPOCH_SCALARS``), every other value is
a column of the row, and ``reports.store.COLUMNS`` says which the trial's epsilon covers (the
MLflow run's ``dpsweep.not_covered`` tag lists those it does not). A tracker that fails (a bad
URI, a full disk, a server that went away) is reported once and switched off: the sweep goes on.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib.util import find_spec
from numbers import Real
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from tensorboardX import SummaryWriter

from dpsweep.core import layout
from dpsweep.core.errors import describe
from dpsweep.core.lazy import lazy_module
from dpsweep.core.records import PrivacyRecord
from dpsweep.core.vocabulary import OK, PRUNED
from dpsweep.orchestrator.config import MLFLOW_EXTRA, MLFLOW_MODULE, TrackingConfig
from dpsweep.orchestrator.release.statement import privacy_statement
from dpsweep.reports.store import COLUMNS

#: MLflow is an optional extra: bound (imported on first use) only where it is installed; the
#: door refuses ``tracking.mlflow_uri`` without it.
mlflow = lazy_module(MLFLOW_MODULE) if find_spec(MLFLOW_MODULE) is not None else None

#: The run directory's folder of event files, one folder per trial: ``tensorboard --logdir``.
TENSORBOARD_DIR = "tensorboard"
#: history.json key -> the results-store column that declares its meaning and coverage.
EPOCH_SCALARS = {"train_loss_nonprivate": "train_loss", "val_accuracy": "val_accuracy",
                 "val_loss": "val_loss", "epsilon_spent": "epsilon_spent",
                 "noise_multiplier": "noise_multiplier", "clip_norm": "clip_norm",
                 "clipped_fraction": "clipped_fraction"}
#: Row columns logged once, at the trial's last epoch: its end and its audit's results.
FINAL_SCALARS = ("val_accuracy", "test_accuracy", "test_loss", "epsilon_upper",
                 "noisy_val_score", "peak_mia_accuracy", "peak_mia_upper", "leak_p_value",
                 "loss_attack_accuracy", "loss_attack_auc", "mia_epsilon_lower",
                 "eps_lower_bound", "train_seconds", "audit_seconds")
#: Row columns an MLflow run carries as parameters (with every ``hp_*`` column).
PARAM_COLUMNS = ("series", "study", "method", "mode", "preset", "lr", "clip_norm", "momentum",
                 "batch_size", "epochs", "seed", "noise_multiplier", "sample_rate", "steps",
                 "delta", "target_epsilon", "accountant", "randomness")
#: Row columns an MLflow run carries as tags (``dpsweep.<column>``).
TAG_COLUMNS = ("trial_id", "status", "error", "audit_error", "dp_valid", "validity_reason",
               "release_safe")
#: Prefixes of the scalars' names: per epoch, and at the end.
EPOCH_PREFIX, FINAL_PREFIX = "epoch/", "final/"
#: Tracking URIs of a store on this machine, whose artifacts (the privacy statements) stay in
#: the run directory, under MLFLOW_ARTIFACTS_DIR, rather than in the working directory.
LOCAL_STORES = ("", "file", "sqlite")
MLFLOW_ARTIFACTS_DIR = "mlflow-artifacts"
#: The MLflow run's artifact holding the trial's privacy statement (an export's name for it).
STATEMENT_ARTIFACT = layout.EXPORT_STATEMENT_JSON
#: MLflow tags that name a run's trial and list the values its epsilon does not cover.
TRIAL_TAG, NOT_COVERED_TAG = "dpsweep.trial_id", "dpsweep.not_covered"
#: The longest tag value written (MLflow's SQL stores cap a tag at 8,000 characters).
MLFLOW_TAG_CHARS = 5000


def _finite(value: Any) -> bool:
    """A real number (the store's rows hold numpy's, which ``numbers.Real`` admits)."""
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def epoch_scalars(history: Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, float, int]]:
    """(column, value, epoch) of every declared, finite per-epoch value."""
    for entry in history:
        for key, column in EPOCH_SCALARS.items():
            if _finite(entry.get(key)):
                yield column, float(entry[key]), int(entry["epoch"])


def final_step(row: Mapping[str, Any]) -> int:
    """The epoch a trial's final values belong to: where it stopped."""
    step = row.get("pruned_at") if row.get("status") == PRUNED else row.get("epochs")
    return int(step) if _finite(step) else 0


def final_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's finite end and audit values (an audit that did not run leaves none)."""
    return {c: float(row[c]) for c in FINAL_SCALARS if _finite(row.get(c))}


class Backend(Protocol):
    """One tracker: a trial's records written once, its audit's values again when they come."""

    name: str

    def trial(self, row: Mapping[str, Any], history: list[dict[str, Any]],
              statement: dict[str, Any] | None) -> None: ...

    def audited(self, row: Mapping[str, Any]) -> None: ...


class TensorBoardLog:
    """Event files under ``RUN_DIR/tensorboard/<trial id>/`` (one file per write)."""

    name = "TensorBoard"

    def __init__(self, *, root: Path) -> None:
        self._root = root

    def _write(self, tid: str, scalars: Iterable[tuple[str, float, int]]) -> None:
        """One event file of ``scalars``; none for a trial with nothing to show."""
        scalars = list(scalars)
        if not scalars:
            return
        writer = SummaryWriter(logdir=str(self._root / tid))
        try:
            for tag, value, step in scalars:
                writer.add_scalar(tag, value, step)
        finally:
            writer.close()

    def trial(self, row: Mapping[str, Any], history: list[dict[str, Any]],
              statement: dict[str, Any] | None) -> None:
        del statement  # MLflow's: TensorBoard holds scalars
        step = final_step(row)
        self._write(str(row["trial_id"]), [
            *((EPOCH_PREFIX + c, v, e) for c, v, e in epoch_scalars(history)),
            *((FINAL_PREFIX + c, v, step) for c, v in final_scalars(row).items())])

    def audited(self, row: Mapping[str, Any]) -> None:
        step = final_step(row)
        self._write(str(row["trial_id"]),
                    ((FINAL_PREFIX + c, v, step) for c, v in final_scalars(row).items()))


class MlflowLog:
    """One MLflow run per trial, in the experiment named after the run directory."""

    name = "MLflow"

    def __init__(self, *, uri: str, experiment: str, artifacts: Path | None) -> None:
        """``artifacts``: where a new experiment keeps its files (the run directory's, for a
        store on this machine; a tracking server decides for itself)."""
        self._client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        found = self._client.get_experiment_by_name(experiment)
        self._experiment = (found.experiment_id if found is not None
                            else self._client.create_experiment(
                                experiment, artifact_location=None if artifacts is None
                                else artifacts.resolve().as_uri()))

    def _run_of(self, tid: str) -> str:
        """The trial's run: the one a resume or an earlier record made, or a new one."""
        runs = self._client.search_runs([self._experiment],
                                        filter_string=f"tags.`{TRIAL_TAG}` = '{tid}'")
        if runs:
            return runs[0].info.run_id
        return self._client.create_run(self._experiment, run_name=tid,
                                       tags={TRIAL_TAG: tid}).info.run_id

    def trial(self, row: Mapping[str, Any], history: list[dict[str, Any]],
              statement: dict[str, Any] | None) -> None:
        run_id = self._run_of(str(row["trial_id"]))
        entities = mlflow.entities
        params = [entities.Param(c, str(row[c])) for c in PARAM_COLUMNS if c in row]
        params += [entities.Param(c, str(v)) for c, v in row.items() if c.startswith("hp_")]
        tags = [entities.RunTag(f"dpsweep.{c}", str(row.get(c, ""))[:MLFLOW_TAG_CHARS])
                for c in TAG_COLUMNS]
        logged = {*EPOCH_SCALARS.values(), *final_scalars(row)}
        tags.append(entities.RunTag(NOT_COVERED_TAG, ",".join(
            sorted(c for c in logged if not COLUMNS[c].covered))))
        metrics = [entities.Metric(c, v, 0, e) for c, v, e in epoch_scalars(history)]
        self._client.log_batch(run_id, metrics=metrics, params=params, tags=tags)
        self._log_final(run_id, row)
        if statement is not None:
            self._client.log_text(run_id, json.dumps(statement, indent=2), STATEMENT_ARTIFACT)
        self._client.set_terminated(run_id, status="FINISHED" if row["status"] in (OK, PRUNED)
                                    else "FAILED")

    def _log_final(self, run_id: str, row: Mapping[str, Any]) -> None:
        step = final_step(row)
        self._client.log_batch(run_id, metrics=[
            mlflow.entities.Metric(FINAL_PREFIX + c, v, 0, step)
            for c, v in final_scalars(row).items()])

    def audited(self, row: Mapping[str, Any]) -> None:
        run_id = self._run_of(str(row["trial_id"]))
        self._log_final(run_id, row)
        self._client.set_tag(run_id, "dpsweep.audit_error", str(row.get("audit_error", "")))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Tracker:
    """The sweep's trackers; each reports its first failure once and is then switched off."""

    def __init__(self, *, backends: list[Backend],
                 warn: Callable[[str], None] = _stderr) -> None:
        self._backends = backends
        self._warn = warn

    @classmethod
    def for_run(cls, *, settings: TrackingConfig, run_dir: Path,
                warn: Callable[[str], None] = _stderr) -> Tracker:
        """The trackers ``[tracking]`` asks for; one that cannot start is reported and left
        out."""
        tracker = cls(backends=[], warn=warn)
        if settings.tensorboard:
            tracker._backends.append(TensorBoardLog(root=run_dir / TENSORBOARD_DIR))
        if settings.mlflow_uri:
            local = urlparse(settings.mlflow_uri).scheme in LOCAL_STORES
            tracker._guarded("MLflow", lambda: tracker._backends.append(MlflowLog(
                uri=settings.mlflow_uri, experiment=f"dpsweep/{run_dir.name}",
                artifacts=run_dir / MLFLOW_ARTIFACTS_DIR if local else None)))
        return tracker

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b.name for b in self._backends)

    def _guarded(self, name: str, write: Callable[[], None]) -> bool:
        try:
            write()
        except Exception as exc:  # tracking never takes the sweep down
            hint = f" ({MLFLOW_EXTRA})" if mlflow is None and name == "MLflow" else ""
            self._warn(f"tracking: {name} switched off for the rest of this sweep: "
                       f"{describe(exc)}{hint}")
            return False
        return True

    def _each(self, call: Callable[[Backend], None]) -> None:
        for backend in list(self._backends):
            if not self._guarded(backend.name, lambda b=backend: call(b)):
                self._backends.remove(backend)

    def trial(self, *, row: Mapping[str, Any], trial_dir: Path) -> None:
        """A recorded trial: its epochs from ``history.json`` (none for a trial that failed
        before its first), its final values and, for MLflow, its privacy statement."""
        if not self._backends:
            return
        try:
            history = _read(trial_dir / layout.HISTORY) or []
            statement = _statement(trial_dir) if row.get("status") == OK else None
        except Exception as exc:  # the row is recorded: tracking leaves this trial out
            self._warn(f"tracking: {row['trial_id']} left out: {describe(exc)}")
            return
        self._each(lambda b: b.trial(row, history, statement))

    def amended(self, *, row: Mapping[str, Any], columns: Mapping[str, Any]) -> None:
        """Columns of a recorded row changed: an audit after the search (or again) is
        tracked, other changes (a re-run's origin) are not."""
        if self._backends and "audit_error" in columns:
            self._each(lambda b: b.audited(row))


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _statement(trial_dir: Path) -> dict[str, Any] | None:
    """The trial's own privacy statement (its selection is the sweep's: not covered)."""
    privacy, spec = _read(trial_dir / layout.PRIVACY), _read(trial_dir / layout.SPEC)
    if privacy is None or spec is None:
        return None
    record = PrivacyRecord.from_dict(privacy, where=str(trial_dir / layout.PRIVACY))
    return privacy_statement(privacy=record, spec=spec, tuning=None,
                             audit_bound=None).to_dict()
