"""One trial under Ray Tune: train (resuming from its own checkpoint), audit, record, report.

The trial's records live in ``RUN_DIR/trials/<trial_id>/`` and nowhere else: ``spec.json``,
``history.json``, ``privacy.json``, the one rolling checkpoint ``checkpoint/state.pt`` (the last
epoch's is the final model: every model is stored once), ``audit.json``, and last of all either
``result.json`` (finished) or ``error.json`` (failed, with the exception's type and message).
The driver reads those files, never Tune's copies, so a reason survives any Ray failure and a
finished trial is recognised even if the driver died before hearing about it.

Heavy modules are imported once per worker process and the data splits are cached per process
(``trainables.data.splits``), so a reused actor starts its next trial without either cost; the raw
data come from the driver through Ray's object store (``orchestrator.trial.plan.data_pool``), read
once per sweep. """

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpsweep.core import layout
from dpsweep.core.errors import DiskFull, UserInputError, describe, disk_full
from dpsweep.core.layout import CHECKPOINT_DIR
from dpsweep.core.storage import atomic_write_json
from dpsweep.core.trial import TrialSpec
from dpsweep.core.vocabulary import DISK_FULL_KEY, FAILED, OK, PRUNED
from dpsweep.orchestrator.trial.pruning import TrialPruned, ask_board
from dpsweep.trainables.data.files import FileSource
from dpsweep.trainables.data.splits import share_pool
from dpsweep.trainables.training.loop import (
    CHECKPOINT_FILE,
    TrialResult,
    load_checkpoint_state,
    load_spec,
    load_trial_data,
    train_trial,
)

#: Lines of traceback kept in error.json (the type and message are always kept in full).
TRACEBACK_LINES = 12
#: A trial's records that an unfinished trial's re-run writes again (training writes them at
#: its end, resumed from the checkpoint): given up to record why a full disk stopped it.
PROVISIONAL = (layout.SPEC, layout.HISTORY, layout.PRIVACY, layout.AUDIT)
#: Least time between a trial's progress reports to Tune. A report blocks the trial until the
#: driver has handled it, and the driver shares the cores with the trials: reporting a digits
#: epoch (a tenth of a second) every time cost more than the epochs. Nothing reads the
#: reports' numbers (the records are the trial's own files); they let Tune stop a trial at the
#: next one, which still comes within a second or one epoch.
REPORT_INTERVAL_S = 1.0
#: The phases a trial reports while it runs (``PHASE_KEY``), which the driver shows (a trial is
#: starting from when the searcher hands it out): training
#: (with ``epoch``/``epochs`` and the last ``val_accuracy``), then, when it audits itself, its
#: references (``reference``/``references``) and the scoring. Nothing else travels with them:
#: epoch numbers and validation accuracy are what the results store already declares.
PHASE_KEY = "phase"
STARTING, TRAINING, AUDIT, SCORING = "starting", "training", "audit", "scoring"
#: The audit's progress lines that name its references: "N references" in its plan's line,
#: "reference k/K" per reference (``orchestrator.audit.membership.audit_model``).
AUDIT_PLAN_LINE = re.compile(r"(\d+) references")
AUDIT_REFERENCE_LINE = re.compile(r"reference (\d+)/(\d+)")


def resumable_checkpoint(trial_dir: Path, spec: TrialSpec) -> Path | None:
    """The trial's own checkpoint when it belongs to this very spec (a re-run after an
    interrupt); anything else is not resumed from."""
    ckpt = trial_dir / CHECKPOINT_DIR
    if not (ckpt / CHECKPOINT_FILE).is_file():
        return None
    try:
        state = load_checkpoint_state(ckpt)
    except UserInputError:
        return None
    return ckpt if state.get("spec") == spec.to_dict() else None


def execute(config: dict[str, Any], *,
            report: Callable[[dict[str, Any]], None] | None = None,
            audit: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the trial described by ``config`` (from the searcher) and write its records.

    Returns the final record (also ``result.json``); on failure writes ``error.json`` and
    re-raises. ``audit(spec=, result=, trial_dir=, config=)`` returns the audit's summary; its
    failure keeps the trained trial and records ``audit_error``.
    """
    trial_dir = Path(config["run_dir"]) / layout.TRIALS / config["trial_id"]
    trial_dir.mkdir(parents=True, exist_ok=True)
    for stale in (layout.RESULT, layout.ERROR):
        (trial_dir / stale).unlink(missing_ok=True)
    started, started_at = time.perf_counter(), time.time()
    try:
        spec = load_spec(config["spec"])
        data = load_trial_data(spec)

        last_report = -math.inf  # the first epoch is always shown
        history: list[dict[str, Any]] = []

        def per_epoch(metrics: dict[str, Any], _ckpt: Path | None) -> None:
            nonlocal last_report
            history.append(metrics)
            if config.get("pruning"):
                ask_board(config["pruning"], trial_id=spec.trial_id, epoch=metrics["epoch"],
                          value=metrics["val_accuracy"])
            if report is not None and time.perf_counter() - last_report >= REPORT_INTERVAL_S:
                report({PHASE_KEY: TRAINING, "epoch": metrics["epoch"], "epochs": spec.epochs,
                        "val_accuracy": metrics["val_accuracy"]})
                last_report = time.perf_counter()

        try:
            result: TrialResult = train_trial(
                spec, data=data, checkpoint_root=trial_dir, rolling_checkpoint=CHECKPOINT_DIR,
                resume_from=resumable_checkpoint(trial_dir, spec), report=per_epoch,
                plan_cache=Path(config["run_dir"]) / layout.CACHE)
        except TrialPruned as pruned:
            return _pruned_record(spec, trial_dir, pruned, history=history, started=started,
                                  started_at=started_at)
        record: dict[str, Any] = {
            "status": OK, "trial_id": spec.trial_id, "node": _ray_node(), "pid": os.getpid(),
            "val_accuracy": result.val_accuracy, "test_accuracy": result.test_accuracy,
            "epsilon_upper": result.privacy_record.epsilon_upper,
            "train_seconds": sum(m["epoch_seconds"] for m in result.history),
            "audit_error": "",
        }
        tuning = config.get("tuning") or {}
        if tuning.get("score_noise") is not None:
            from dpsweep.orchestrator.accounting.tuning.private import noisy_score

            total = len(data.validation)
            record["noisy_val_score"] = noisy_score(
                correct=round(result.val_accuracy * total), total=total,
                noise_multiplier=float(tuning["score_noise"]))
        if audit is not None and config.get("audit", {}).get("in_trial"):
            audit_started = time.perf_counter()
            try:
                record.update(audit(spec=spec, result=result, trial_dir=trial_dir,
                                    config=config, data=data,
                                    progress=None if report is None else audit_phases(report)))
            except Exception as exc:  # the trained model is kept; the audit's failure noted
                if disk_full(exc) is not None:
                    raise  # not the audit's failure: the trial runs again
                record["audit_error"] = describe(exc)
            record["audit_seconds"] = time.perf_counter() - audit_started
        record["seconds"] = time.perf_counter() - started
        record["started_at"], record["finished_at"] = started_at, time.time()
        atomic_write_json(trial_dir / layout.RESULT, record)
        return record
    except Exception as exc:
        _record_failure(trial_dir, config, exc)
        raise


def audit_phases(report: Callable[[dict[str, Any]], None]) -> Callable[[str], None]:
    """The audit's progress lines as phase reports: each reference as it ends (at most one
    per ``REPORT_INTERVAL_S``, the first and the last always), then the scoring."""
    last = -math.inf

    def progress(line: str) -> None:
        nonlocal last
        planned, done = AUDIT_PLAN_LINE.search(line), AUDIT_REFERENCE_LINE.search(line)
        if done is not None:
            k, n = int(done.group(1)), int(done.group(2))
            if k < n and time.perf_counter() - last < REPORT_INTERVAL_S:
                return
            phase = {PHASE_KEY: AUDIT, "reference": k, "references": n} if k < n \
                else {PHASE_KEY: SCORING}
        elif planned is not None and "reference " not in line:
            phase = {PHASE_KEY: AUDIT, "reference": 0, "references": int(planned.group(1))}
        else:
            return
        report(phase)
        last = time.perf_counter()

    return progress


def _record_failure(trial_dir: Path, config: dict[str, Any], exc: Exception) -> None:
    """``error.json`` with the reason; raises :class:`DiskFull` when the disk is why.

    A trial stopped by a full disk did not fail: its record says so (``DISK_FULL_KEY``: read
    as interrupted, so it runs again). To make room for that record the trial gives up the
    records it wrote so far (``PROVISIONAL``: its re-run writes them again; the checkpoint, its
    progress, stays); with no room even then there is no record at all, which reads as
    interrupted too. Either way the sweep hears ``DiskFull`` and stops."""
    full = disk_full(exc)
    record = {"status": FAILED, "trial_id": config.get("trial_id"),
              "error": describe(full or exc), "type": type(full or exc).__name__,
              "traceback": traceback.format_exc().splitlines()[-TRACEBACK_LINES:]}
    if full is not None:
        record[DISK_FULL_KEY] = {"what": full.what, "reason": full.reason}
    try:
        atomic_write_json(trial_dir / layout.ERROR, record)
    except DiskFull as unwritten:
        if full is not None:
            for name in PROVISIONAL:
                (trial_dir / name).unlink(missing_ok=True)
            with contextlib.suppress(DiskFull):
                atomic_write_json(trial_dir / layout.ERROR, record)
        full = full or unwritten
    if full is not None and full is not exc:
        raise full from exc


def _pruned_record(spec: TrialSpec, trial_dir: Path, pruned: TrialPruned, *,
                   history: list[dict[str, Any]], started: float,
                   started_at: float) -> dict[str, Any]:
    """A trial stopped at a rung: its history so far and a final record (``result.json``,
    status ``pruned``) with the rung, the epochs run and the epsilon its ledger spent."""
    atomic_write_json(trial_dir / layout.SPEC, spec.to_dict())
    atomic_write_json(trial_dir / layout.HISTORY, history)
    last = history[-1]
    record: dict[str, Any] = {
        "status": PRUNED, "trial_id": spec.trial_id, "node": _ray_node(), "pid": os.getpid(),
        "pruned_at": pruned.rung, "epochs_run": int(last["epoch"]),
        "val_accuracy": pruned.value, "epsilon_spent": float(last["epsilon_spent"]),
        "train_seconds": sum(m["epoch_seconds"] for m in history), "audit_error": "",
        "seconds": time.perf_counter() - started, "started_at": started_at,
        "finished_at": time.time()}
    atomic_write_json(trial_dir / layout.RESULT, record)
    return record


def _ray_node() -> str | None:
    """The Ray node that ran the trial (None outside Ray): where each trial ran on a cluster."""
    ray = sys.modules.get("ray")  # never imported here: a trial outside Ray has no node
    if ray is None:
        return None
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def use_data_pool(shared: dict[str, Any] | None) -> None:
    """Serve this worker's data splits from the driver's pool
    (``orchestrator.trial.plan.data_pool``: no scikit-learn import, no file read per worker);
    None leaves the worker to read the data."""
    if shared is not None:
        raw = shared.get("source")  # the pool travels with it: the files need not be here
        source = None if raw is None else FileSource.from_dict(raw, check_files=False)
        share_pool(shared["pool"], dataset=shared["dataset"], data_dir=shared["data_dir"],
                   source=source)
