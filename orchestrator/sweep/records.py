"""A sweep's records: one results row per trial, written with the trial's files as one step,
the progress line each finished trial prints, and the summary over every attempt.

``SweepRecords`` is the part of the driver (``orchestrator.sweep.driver._Driver``) that owns the
rows (trial id -> results row, read back from the results store on a resume): the search and
the after-search jobs read them and change them only through its methods. A row is written
together with the files it points to (``RunDir.commit``): after a crash or a full disk, a row
never lacks its files.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from dpsweep.core import layout
from dpsweep.core.errors import describe
from dpsweep.core.layout import RESULTS
from dpsweep.core.records import PrivacyRecord
from dpsweep.core.vocabulary import OK, PRUNED
from dpsweep.orchestrator.audit.membership import row_audit_columns
from dpsweep.orchestrator.release.selection import SELECTED, recorded_choice
from dpsweep.orchestrator.sweep.state import SweepContext, SweepProgress
from dpsweep.orchestrator.sweep.studies import Fronts, Outcome, StudyPlan
from dpsweep.orchestrator.sweep.summary import (
    end_attempt,
    record_retry,
    retried_trials,
    summary_bytes,
)
from dpsweep.orchestrator.sweep.tracking import Tracker
from dpsweep.orchestrator.sweep.tuning import adaptive_summary
from dpsweep.reports import store

#: The id suffix of a study's first trial, which an adaptive study starts at the paper preset.
FIRST_TRIAL_SUFFIX = "-000"
PAPER_PRESET = "paper"
#: Row columns a summary study's copy of a trial carries as user attributes (with every
#: ``hp_*`` column): what the results store already holds of it, nothing more.
FRONT_ATTR_COLUMNS = ("series", "method", "mode", "preset", "lr", "clip_norm", "momentum",
                      "batch_size", "epochs", "epsilon_upper")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def front_attrs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's hyperparameters as plain JSON values (a row read back from Parquet holds
    numpy's), for a summary study's copy of the trial; missing and NaN values are left out."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key not in FRONT_ATTR_COLUMNS and not key.startswith("hp_"):
            continue
        plain = value.item() if hasattr(value, "item") else value  # numpy's scalars
        if isinstance(plain, (str, bool, int)) or (isinstance(plain, float)
                                                  and math.isfinite(plain)):
            out[key] = plain
    return out


def failed_audits(rows: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Finished trials whose membership audit failed: trial id -> the reason (``audit_error``).
    The trained model is kept, so ``dpsweep reaudit`` can audit it again without training."""
    return {str(r["trial_id"]): r["audit_error"] for r in rows
            if r.get("status") == OK and isinstance(r.get("audit_error"), str)
            and r["audit_error"]}


class SweepRecords:
    """Rows, trial records, progress lines and the summary of one sweep attempt."""

    def __init__(self, *, context: SweepContext, progress: SweepProgress,
                 attempts: list[dict[str, Any]], rows: dict[str, dict[str, Any]]) -> None:
        """``attempts``: every attempt at this sweep, this one last (``summary.begin_attempt``;
        the caller records how it ended in the same list); ``rows``: the results store's."""
        self._context = context
        self._run = context.run
        self._progress = progress
        self._attempts = attempts
        self._rows = rows
        #: Each study's best validation accuracy so far, for the progress lines.
        self._best: dict[str, float] = {}
        #: TensorBoard and MLflow, as ``[tracking]`` asks: each recorded row is tracked.
        self._tracker = Tracker.for_run(settings=context.cfg.tracking, run_dir=self._run.path)
        #: The summary study of each target (optuna-dashboard's front across methods); none
        #: under private tuning, whose number of trials is secret.
        self._fronts: Fronts | None = (
            Fronts(storage=self._run.optuna_url, plans=context.plans)
            if context.private is None else None)

    @property
    def rows(self) -> Mapping[str, dict[str, Any]]:
        """Trial id -> results row (read only: rows change through this class's methods)."""
        return MappingProxyType(self._rows)

    def _row(self, plan: StudyPlan, tid: str, outcome: Outcome) -> dict[str, Any]:
        trial_dir = self._run.trial_dir(tid)
        if outcome.status == PRUNED:
            return store.pruned_row(trial_id=tid, method=plan.method, record=outcome.metrics,
                                    spec=read_json(trial_dir / layout.SPEC), series=plan.series,
                                    study=plan.name, preset=self._preset(tid))
        if outcome.status != OK:  # the spec may never have been written: the reason stays
            spec_file = trial_dir / layout.SPEC
            spec = read_json(spec_file) if spec_file.is_file() else None
            return store.failed_row(trial_id=tid, method=plan.method, series=plan.series,
                                    study=plan.name, error=outcome.error, spec=spec)

        spec = read_json(trial_dir / layout.SPEC)
        history = read_json(trial_dir / layout.HISTORY)
        privacy = trial_dir / layout.PRIVACY
        row = store.row_from_trial(
            run_dir=self._run.path, trial_dir=trial_dir,
            checkpoint_dir=trial_dir / layout.CHECKPOINT_DIR, spec=spec,
            privacy=PrivacyRecord.from_dict(read_json(privacy), where=str(privacy)),
            history=history,
            train_seconds=float(outcome.metrics.get("train_seconds", math.nan)),
            num_classes=self._context.setup.num_classes, series=plan.series,
            study=plan.name, preset=self._preset(tid))
        audit_file = trial_dir / layout.AUDIT
        if audit_file.is_file():
            row.update(row_audit_columns(read_json(audit_file), row=row))
        row["audit_error"] = str(outcome.metrics.get("audit_error", "") or "")
        if outcome.metrics.get("noisy_val_score") is not None:
            row["noisy_val_score"] = float(outcome.metrics["noisy_val_score"])
        if "audit_seconds" in outcome.metrics:
            row["audit_seconds"] = float(outcome.metrics["audit_seconds"])
        return row

    def _preset(self, tid: str) -> str:
        """Adaptive studies start from the paper preset; private ones have no fixed point."""
        adaptive = self._context.private is None
        return PAPER_PRESET if tid.endswith(FIRST_TRIAL_SUFFIX) and adaptive else ""

    def record(self, plan: StudyPlan, tid: str, outcome: Outcome, _ot: Any = None) -> None:
        """One finished or failed trial: its row, its files in the manifest, a progress line."""
        try:
            row = self._row(plan, tid, outcome)
        except Exception as exc:  # a record missing after a crash: the failure stays visible
            unread = f"records could not be read: {describe(exc)}"
            row = store.failed_row(trial_id=tid, method=plan.method, series=plan.series,
                                   study=plan.name,
                                   error=f"{outcome.error} ({unread})" if outcome.error
                                   else unread)
        self._rows[tid] = row
        self._write(tid)
        self._tracker.trial(row=row, trial_dir=self._run.trial_dir(tid))
        self._to_front(plan, tid, outcome)
        self._progress_line(plan, row)

    def reconciled(self, plan: StudyPlan, tid: str, outcome: Outcome) -> None:
        """A finished trial met by ``studies.reconcile``: recorded, unless its row exists
        already; then only files a crash of an older dpsweep left out of the manifest are
        added."""
        if tid not in self._rows:
            self.record(plan, tid, outcome)
            return
        self._to_front(plan, tid, outcome)  # a crash may have come between row and copy
        listed = self._run.manifest.get("files", {})
        unlisted = [rel for rel in self._run.trial_files(tid) if rel not in listed]
        if unlisted:
            self._run.record(unlisted)

    def amend(self, tid: str, columns: Mapping[str, Any]) -> None:
        """Columns of ``tid``'s row changed (an audit's, a re-run's origin), and written."""
        self._rows[tid].update(columns)
        self._write(tid)
        self._tracker.amended(row=self._rows[tid], columns=columns)

    def add(self, tid: str, row: dict[str, Any]) -> None:
        """A row that is no search trial's (the non-private baseline), written."""
        self._rows[tid] = row
        self._write(tid)
        self._tracker.trial(row=row, trial_dir=self._run.trial_dir(tid))

    def _to_front(self, plan: StudyPlan, tid: str, outcome: Outcome) -> None:
        """A recorded search trial copied into its target's summary study (once; only a trial
        told COMPLETE); a storage that refuses it switches the fronts off, not the sweep."""
        fronts = self._fronts
        if fronts is None:
            return
        row = self._rows[tid]
        if not self._guarded(lambda: fronts.add(plan, tid, outcome, attrs=front_attrs(row))):
            self._fronts = None

    def _guarded(self, write: Callable[[], object]) -> bool:
        try:
            write()
        except Exception as exc:  # the dashboard's front never takes the sweep down
            print("tracking: the dashboard's fronts switched off for the rest of this sweep: "
                  f"{describe(exc)}", file=sys.stderr, flush=True)
            return False
        return True

    def _progress_line(self, plan: StudyPlan, row: dict[str, Any]) -> None:
        if self._progress.quiet:
            return
        ok = row["status"] == OK
        best = self._best
        if ok and not row.get("degenerate"):
            best[plan.name] = max(best.get(plan.name, -1.0), row["val_accuracy"])
        done = sum(r["status"] == OK for r in self._rows.values())
        pruned = sum(r["status"] == PRUNED for r in self._rows.values())
        failed = len(self._rows) - done - pruned
        if row["status"] == PRUNED:
            what = f"pruned at epoch {row['pruned_at']} (val acc {row['val_accuracy']:.3f})"
        else:
            what = (f"val acc {row['val_accuracy']:.3f}" + (
                f", peak MIA {row['peak_mia_accuracy']:.3f}"
                if isinstance(row.get("peak_mia_accuracy"), float)
                and math.isfinite(row["peak_mia_accuracy"]) else "")
                + (f", audit FAILED: {row['audit_error']}" if row.get("audit_error") else "")
                    if ok else f"FAILED: {row['error']}")
        line = (f"[{plan.name}] {row['trial_id']}: {what} | done {done}, "
                + (f"pruned {pruned}, " if pruned else "") + f"failed {failed}, "
                f"best {best.get(plan.name, float('nan')):.3f}, "
                f"elapsed {time.time() - self._progress.started:.0f} s")
        self._progress.record_line(line)

    def retire_failure(self, tid: str, error: str) -> None:
        """A failed trial (or re-run) about to be trained again (``resume --retry-failed``): the
        reason it failed goes into this attempt's record (attempts.json, where it stays), its
        records out of the manifest and its error record off the disk, in that order, so that
        the retry writes them anew and a resume after a crash at any step finds nothing
        changed. Its results row stays until the retry's replaces it."""
        record_retry(self._run, self._attempts, trial_id=tid, error=error)
        self._run.forget(self._run.trial_files(tid))
        (self._run.trial_dir(tid) / layout.ERROR).unlink(missing_ok=True)
        if not self._progress.quiet:
            print(f"retrying {tid}, which failed: {error}", flush=True)

    def _write(self, tid: str) -> None:
        """The results store with ``tid``'s row, and the trial's files, recorded as one step
        (``RunDir.commit``): after a crash or a full disk, a row never lacks its files."""
        self._run.commit(RESULTS, store.results_bytes(list(self._rows.values())),
                         also=self._run.trial_files(tid))

    def write_summary(self) -> None:
        """The attempt's end, then summary.json over every attempt; under private tuning with the
        trial it selects, the record ``export``, ``pick``, ``report`` and ``audit`` check the
        noisy scores against (``orchestrator.release.selection``)."""
        context, rows = self._context, list(self._rows.values())
        tuning = (adaptive_summary(context.cfg, list(context.plans), rows,
                                   retried=retried_trials(self._attempts))
                  if context.private is None else {
                      "mode": "private", **context.private.plan.to_dict(),
                      SELECTED: recorded_choice(store.frame_of(rows))})
        end_attempt(self._run, self._attempts, ended="finished")
        self._run.commit(layout.SUMMARY, summary_bytes(attempts=self._attempts,
                                                       setup=context.setup, tuning=tuning))
