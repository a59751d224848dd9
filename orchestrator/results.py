"""The results store: one Parquet row per trial, the only thing the report stage reads.

A run directory holds ``results.parquet`` (this schema) and, per trial, ``trials/<trial_id>/``
with the final checkpoint, ``privacy.json`` and ``history.json``. Rows are appended trial by
trial (the sweep) or built from a directory of finished trials (:func:`collect_trials`), and
the audit fills the MIA columns in place. Every column is documented in ``COLUMNS``; readers
validate the file and refuse one that is missing columns or unreadable, with one clear error.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from core.errors import UserInputError

RESULTS_FILE = "results.parquet"
TRIALS_DIR = "trials"

#: column -> (dtype, meaning). Method hyperparameters are flattened into ``hp_<name>`` columns
#: (null where a method lacks the hyperparameter); per-layer MIA results are JSON in
#: ``mia_layers`` (a list of dicts, one per layer, in layer order).
COLUMNS: dict[str, tuple[str, str]] = {
    "trial_id": ("string", "unique id of the trial in the run"),
    "method": ("string", "registered method name (dpsgd, lm_dpsgd, ...)"),
    "mode": ("string", "method mode (public, lagged, faithful, ...); '' when the method has none"),
    "preset": ("string", "preset the trial started from ('' = none)"),
    "status": ("string", "'ok' or 'failed'"),
    "error": ("string", "why a failed trial failed ('' when ok)"),
    "dp_valid": ("bool", "whether the epsilon claim holds for this trial's method and mode"),
    "validity_reason": ("string", "the method's statement behind dp_valid"),
    "seed": ("int64", "seed of model init, sampling and noise"),
    "lr": ("float64", "learning rate"),
    "clip_norm": ("float64", "clipping norm C (initial C_0 for ww_dpsgd)"),
    "momentum": ("float64", "SGD momentum"),
    "batch_size": ("int64", "expected Poisson batch size"),
    "epochs": ("int64", "training epochs"),
    "method_params": ("string", "JSON of every method hyperparameter (also flattened to hp_*)"),
    "noise_multiplier": ("float64", "sigma (sigma_0 for a decaying schedule)"),
    "noise_schedule": ("string", "JSON list of {noise_multiplier, steps} phases"),
    "sample_rate": ("float64", "Poisson sampling rate q the accountant used"),
    "steps": ("int64", "optimizer steps"),
    "delta": ("float64", "delta"),
    "target_epsilon": ("float64", "the budget every trial is held to"),
    "epsilon_lower": ("float64", "accountant's lower epsilon bound (null for RDP)"),
    "epsilon_estimate": ("float64", "accountant's epsilon estimate (null for RDP)"),
    "epsilon_upper": ("float64", "accountant's upper epsilon bound (the claim)"),
    "accountant": ("string", "'prv' or 'rdp'"),
    "accountant_fallback": ("string", "why RDP was used instead of PRV ('' if it was not)"),
    "test_accuracy": ("float64", "final test accuracy"),
    "test_loss": ("float64", "final test cross-entropy"),
    "train_loss": ("float64", "final epoch's mean training loss (monitoring, not DP)"),
    "train_seconds": ("float64", "wall time of training"),
    "audit_seconds": ("float64", "wall time of the audit (shadow training + attacks)"),
    "peak_mia_accuracy": ("float64", "max over layers of the per-layer attack accuracy"),
    "peak_layer": ("string", "name of the layer where the peak is"),
    "peak_layer_index": ("int64", "index of that layer, from the input"),
    "loss_attack_accuracy": ("float64", "loss-threshold baseline attack accuracy"),
    "loss_attack_auc": ("float64", "loss-threshold baseline attack AUC"),
    "mia_layers": ("string", "JSON list per layer: name, index, accuracy, ci_low, ci_high "
                             "(95% Wilson), auc, tpr_at_1pct_fpr, tpr_at_0.1pct_fpr and whether "
                             "each is meaningful for the non-member count, n_members, "
                             "n_nonmembers"),
    "audit_error": ("string", "why the audit of an otherwise finished trial failed ('' if not)"),
    "checkpoint": ("string", "path of the final checkpoint directory, relative to the run dir"),
    "privacy_record": ("string", "path of privacy.json, relative to the run dir"),
    "trajectories": ("string", "JSON of per-step series logged by the method (e.g. WW C_t)"),
}

REQUIRED = ("trial_id", "method", "status", "dp_valid", "test_accuracy", "epsilon_upper")


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _final_checkpoint(trial_dir: Path, epochs: int) -> Path:
    last = Path(trial_dir) / f"epoch_{epochs:03d}"
    return last if last.is_dir() else Path(trial_dir)


def row_from_trial(*, run_dir: Path, trial_dir: Path, spec: dict[str, Any],
                   privacy: dict[str, Any], history: list[dict[str, Any]],
                   train_seconds: float, preset: str = "") -> dict[str, Any]:
    """A results row for a finished trial (MIA columns empty until the audit fills them)."""
    last = history[-1]
    params = dict(spec.get("method_params") or {})
    record = privacy.get("method_record") or {}
    row: dict[str, Any] = {
        "trial_id": spec["trial_id"], "method": spec["method"],
        "mode": str(record.get("mode", params.get("mode", ""))), "preset": preset,
        "status": "ok", "error": "", "dp_valid": bool(privacy["dp_valid"]),
        "validity_reason": privacy["validity_reason"], "seed": int(spec["seed"]),
        "lr": float(spec["lr"]), "clip_norm": float(spec["clip_norm"]),
        "momentum": float(spec["momentum"]), "batch_size": int(spec["batch_size"]),
        "epochs": int(spec["epochs"]),
        "method_params": _json({k: v for k, v in params.items() if k != "risk_meta"}),
        "noise_multiplier": float(privacy["noise_multiplier"]),
        "noise_schedule": _json(privacy["noise_schedule"]),
        "sample_rate": float(privacy["sample_rate"]), "steps": int(privacy["steps"]),
        "delta": float(privacy["delta"]), "target_epsilon": float(privacy["target_epsilon"]),
        "epsilon_lower": _num(privacy["epsilon_lower"]),
        "epsilon_estimate": _num(privacy["epsilon_estimate"]),
        "epsilon_upper": float(privacy["epsilon_upper"]),
        "accountant": privacy["accountant"],
        "accountant_fallback": privacy.get("accountant_fallback") or "",
        "test_accuracy": float(last["test_accuracy"]), "test_loss": float(last["test_loss"]),
        "train_loss": float(last["train_loss"]), "train_seconds": float(train_seconds),
        "audit_seconds": math.nan, "peak_mia_accuracy": math.nan, "peak_layer": "",
        "peak_layer_index": -1, "loss_attack_accuracy": math.nan, "loss_attack_auc": math.nan,
        "mia_layers": "[]",
        "checkpoint": os.path.relpath(_final_checkpoint(trial_dir, int(spec["epochs"])),
                                      run_dir),
        "privacy_record": os.path.relpath(trial_dir / "privacy.json", run_dir),
        "trajectories": _json(privacy.get("trajectories") or {}),
    }
    for key, value in params.items():
        if isinstance(value, (int, float, str, bool)):
            row[f"hp_{key}"] = value
    return row


def failed_row(*, trial_id: str, method: str, error: str, spec: dict[str, Any] | None = None,
               preset: str = "") -> dict[str, Any]:
    """A row for a trial that failed: it is recorded with its reason, never dropped."""
    spec = spec or {}
    row = {name: None for name in COLUMNS}
    row.update({"trial_id": trial_id, "method": method, "status": "failed", "error": error,
                "preset": preset, "dp_valid": False, "mode": "", "validity_reason": "",
                "test_accuracy": math.nan, "epsilon_upper": math.nan, "mia_layers": "[]",
                "trajectories": "{}", "peak_layer": "", "peak_layer_index": -1})
    for key in ("seed", "lr", "clip_norm", "momentum", "batch_size", "epochs"):
        if key in spec:
            row[key] = spec[key]
    if spec.get("method_params"):
        row["method_params"] = _json(spec["method_params"])
    return row


def write_results(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Write all rows atomically (temp file + rename), so a reader never sees half a file."""
    frame = pd.DataFrame(rows)
    for name in COLUMNS:
        if name not in frame:
            frame[name] = None
    path = Path(run_dir) / RESULTS_FILE
    tmp = path.with_suffix(".parquet.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return path


def append_row(run_dir: Path, row: dict[str, Any]) -> Path:
    """Append (or replace, by trial_id) one row."""
    path = Path(run_dir) / RESULTS_FILE
    rows = read_results(run_dir).to_dict("records") if path.exists() else []
    rows = [r for r in rows if r["trial_id"] != row["trial_id"]] + [row]
    return write_results(run_dir, rows)


def read_results(run_dir: Path) -> pd.DataFrame:
    """Read and validate the store; any problem is one UserInputError naming the path."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserInputError(field="RUN_DIR", value=str(run), allowed="an existing run directory")
    path = run / RESULTS_FILE
    if not path.is_file():
        raise UserInputError(field="RUN_DIR", value=str(run),
                             allowed=f"a run directory containing {RESULTS_FILE}")
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise UserInputError(field="results", value=str(path),
                             allowed=f"a readable Parquet file ({exc.__class__.__name__})"
                             ) from None
    missing = [c for c in REQUIRED if c not in frame.columns]
    if missing:
        raise UserInputError(field="results", value=str(path),
                             allowed=f"a dpsweep results file (missing columns {missing})")
    if frame.empty:
        raise UserInputError(field="results", value=str(path), allowed="at least one trial row")
    return frame


def collect_trials(run_dir: Path) -> Path:
    """Build the store from ``run_dir/trials/*`` written by ``trainables.training``."""
    run = Path(run_dir)
    trials = sorted(p for p in (run / TRIALS_DIR).glob("*") if p.is_dir())
    rows = []
    for trial in trials:
        privacy_path, history_path = trial / "privacy.json", trial / "history.json"
        spec_path = trial / "spec.json"
        if not (privacy_path.is_file() and history_path.is_file() and spec_path.is_file()):
            continue
        try:
            privacy = json.loads(privacy_path.read_text())
            history = json.loads(history_path.read_text())
            spec = json.loads(spec_path.read_text())
        except json.JSONDecodeError as exc:
            raise UserInputError(field="trial", value=str(trial),
                                 allowed=f"valid JSON records ({exc})") from None
        rows.append(row_from_trial(run_dir=run, trial_dir=trial, spec=spec, privacy=privacy,
                                   history=history,
                                   train_seconds=sum(m["epoch_seconds"] for m in history)))
    if not rows:
        raise UserInputError(field="RUN_DIR", value=str(run),
                             allowed=f"finished trials under {TRIALS_DIR}/ (none found)")
    return write_results(run, rows)
