"""``dpsweep export RUN_DIR --trial ID``: a trial's release, read from a verified run directory.

Every file the export reads (results store, privacy record, spec, checkpoint) is checked against
the run's manifest first, so an edited record can never be exported as a privacy claim. How the
run selects its release, and the tuning statement the release carries, come from
``orchestrator.release.selection`` (config.toml, summary.json and the other records, verified
and consistent), the audit's lower bound from the trial's results row. A private-tuning run
releases one trial, the best noisy score (``reports.pick.choose_private``): its end-to-end
statement covers no other, and an unfinished or damaged private run releases none.

A degenerate trial (at chance level, ``reports.store.is_degenerate``: never on a front or
picked) is refused unless ``allow_degenerate``, and an export made anyway says so in its
``model.json``. Under private tuning it is judged on the noisy validation score, the one score
the end-to-end epsilon covers, so the refusal itself reveals nothing uncovered.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from dpsweep.core import layout
from dpsweep.core.datasets import NUM_CLASSES
from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import RESULTS
from dpsweep.core.records import PrivacyRecord
from dpsweep.orchestrator.release.bundle import (
    OUT_FIELD,
    ExportResult,
    check_outside_run,
    export_trial,
)
from dpsweep.orchestrator.release.selection import read_selection
from dpsweep.orchestrator.rundir import RunDir, check_trial_id
from dpsweep.reports import store
from dpsweep.reports.pick import choose_private
from dpsweep.trainables.training.loop import load_spec, load_trial_data

#: Confidence of the canary audits' epsilon lower bounds (``orchestrator.audit.canary``).
CANARY_CONFIDENCE = 0.95
#: ``method`` of the non-private baseline's row (``reports.pareto.NONPRIVATE``, the sweep's
#: ``BASELINE_ID``): a reference line, no DP trial.
NONPRIVATE = "nonprivate"
ALLOW_DEGENERATE_FLAG = "--allow-degenerate"


def check_not_baseline(row: dict[str, Any], trial_id: str, *, why: str) -> None:
    """Refuse the non-private baseline by name: its row has no privacy record or checkpoint a
    DP command could use, and ``why`` says what the command would need from it."""
    if str(row.get("method")) == NONPRIVATE:
        raise UserInputError(field="--trial", value=trial_id,
                             allowed=f"a DP trial of this run: {trial_id!r} is the non-private "
                                     f"baseline (no clipping, no noise), {why}")


def _row(frame: pd.DataFrame, trial_id: str) -> dict[str, Any]:
    """The trial's row of the verified results store: a finished DP trial of the run."""
    rows = frame[frame["trial_id"] == trial_id]
    if rows.empty:
        raise UserInputError(field="--trial", value=trial_id,
                             allowed=f"a trial of this run: {sorted(frame['trial_id'])[:10]}")
    row = rows.iloc[0].to_dict()
    check_not_baseline(row, trial_id, why="which has no DP guarantee to export: it is the "
                                          "report's reference line, never a release")
    if why := store.unfinished(row):
        raise UserInputError(field="--trial", value=trial_id, allowed=f"a finished trial ({why})")
    return row


def _check_selected(frame: pd.DataFrame, trial_id: str, *, allow_invalid_dp: bool,
                    allow_replayable: bool) -> None:
    """Under private tuning only the best noisy score may leave: releasing another trial would
    carry an end-to-end statement that does not cover it."""
    chosen = choose_private(frame, allow_invalid_dp=allow_invalid_dp,
                            allow_replayable=allow_replayable).trial_id
    if chosen != trial_id:
        raise UserInputError(field="--trial", value=trial_id,
                             allowed="the trial private tuning selected, the best noisy "
                                     "validation score (dpsweep pick RUN_DIR --export DIR "
                                     "exports it): the end-to-end epsilon covers releasing "
                                     "that trial only")


def audit_bound(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row's canary lower bound in the export's form, if an audit measured one."""
    bound = row.get("eps_lower_bound")
    if bound is None or not math.isfinite(float(bound)):
        return None
    return {"eps_lower_bound": float(bound), "canaries": int(row["canaries"]),
            "confidence": CANARY_CONFIDENCE, "kind": str(row["eps_lower_bound_kind"])}


def _num_classes(run: RunDir, trial_id: str) -> int:
    """The trial's class count, from its verified spec (a user's data is read for it)."""
    rel = f"{layout.TRIALS}/{trial_id}/{layout.SPEC}"
    try:
        spec = json.loads(run.verify(rel).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserInputError(field="spec", value=rel,
                             allowed=f"valid JSON ({type(exc).__name__})") from None
    if spec.get("dataset") in NUM_CLASSES:
        return NUM_CLASSES[spec["dataset"]]
    return load_trial_data(load_spec(spec)).num_classes


def check_degenerate(run: RunDir, row: dict[str, Any], trial_id: str, *, private: bool,
                     allow_degenerate: bool) -> str | None:
    """Why the trial is at chance level (None if it is not); refused unless allowed. Under
    private tuning the noisy score decides (covered by the end-to-end epsilon); otherwise the
    row's ``degenerate``, from the noiseless validation accuracy like every adaptive choice."""
    if private:
        noisy = row.get("noisy_val_score")
        score = math.nan if noisy is None else float(noisy)
        if not store.is_degenerate(score, num_classes=_num_classes(run, trial_id)):
            return None
        why = "its noisy validation score"
    elif not bool(row.get("degenerate")):
        return None
    else:
        why = "its validation accuracy"
    reason = (f"{why} is below chance (1 / classes) + {store.DEGENERATE_MARGIN:g}, so it "
              f"predicts no better than guessing")
    if not allow_degenerate:
        raise UserInputError(field="--trial", value=trial_id,
                             allowed=f"a trial above chance level: this one is degenerate "
                                     f"({reason}; kept off fronts and picks); "
                                     f"{ALLOW_DEGENERATE_FLAG} exports it anyway")
    return reason


def export_from_run(run_dir: Path, *, trial_id: str, out: Path, allow_replayable: bool = False,
                    allow_invalid_dp: bool = False,
                    allow_degenerate: bool = False, out_field: str = OUT_FIELD) -> ExportResult:
    """Verify, then export the trial's weights, model description, code, loader and privacy
    statement; ``out_field`` names ``out`` as the user typed it (``--out``, ``--export``)."""
    check_trial_id(trial_id)
    check_outside_run(out, run_dir=run_dir, field=out_field)
    run = RunDir.open(Path(run_dir), write=False)
    run.verify(RESULTS)
    frame = store.read_results(run.path)
    row = _row(frame, trial_id)
    selection = read_selection(run, frame=frame, release=True)
    tuning = selection.statement(target=float(row["target_epsilon"]))
    private = selection.private
    if private:
        _check_selected(frame, trial_id, allow_invalid_dp=allow_invalid_dp,
                        allow_replayable=allow_replayable)
    degenerate = check_degenerate(run, row, trial_id, private=private,
                                  allow_degenerate=allow_degenerate)
    privacy = PrivacyRecord.load(run.verify(str(row["privacy_record"])))
    checkpoint = run.path / str(row["checkpoint"])
    run.verify(str(Path(str(row["checkpoint"])) / layout.CHECKPOINT_FILE))
    return export_trial(checkpoint_dir=checkpoint, privacy=privacy, out=Path(out),
                        tuning=tuning,
                        audit_bound=audit_bound(row),
                        allow_replayable=allow_replayable, allow_invalid_dp=allow_invalid_dp,
                        code_sha256=(run.manifest.get("inputs") or {}).get("model_code"),
                        degenerate=degenerate, out_field=out_field)
