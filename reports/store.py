"""The results store: one Parquet row per trial, the only thing the report stage reads.

A run directory holds ``results.parquet`` (this schema) and, per trial, ``trials/<trial_id>/``
with the final checkpoint and the trial's records. Rows are appended trial by trial by the
sweep's driver, and the audit fills the MIA columns. Every column is documented in ``COLUMNS``
with its type, its meaning and whether the trial's epsilon **covers** it:

* covered — the released weights and values computed from them and public data only, and
  values that do not depend on private data at all (hyperparameters, the noise schedule, the
  accountant's bounds);
* not covered — anything computed on private data without noise (train loss, validation and
  test metrics, every audit number). Such values stay in the run directory for the person who
  ran the sweep; ``dpsweep export`` never releases them, and the report labels them.

The trial's privacy record (``trials/<id>/privacy.json``, ``core.records.PrivacyRecord``) is
classed the same way, value by value, in ``RECORD``: one declaration for everything a trial
stores beside its weights, so a value computed on private examples without noise cannot be
recorded without being named here as not covered (``tests/unit/reports/test_private_values.py``
walks a real record and a real row against it).

Readers validate the file and refuse one that is missing columns, has a column of the wrong
type, or is unreadable, with one clear error.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pandas as pd

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.records import PrivacyRecord
from dpsweep.core.storage import atomic_write
from dpsweep.core.vocabulary import FAILED, OK, PRUNED


@dataclass(frozen=True)
class Column:
    dtype: str
    meaning: str
    covered: bool


def _c(dtype: str, meaning: str, covered: bool) -> Column:
    return Column(dtype, meaning, covered)


#: column -> (dtype, meaning, covered by the trial's epsilon). Method hyperparameters are
#: flattened into ``hp_<name>`` columns (covered; null where a method lacks the hyperparameter).
COLUMNS: dict[str, Column] = {
    "trial_id": _c("string", "unique id of the trial in the run (<series>-<index>)", True),
    "series": _c("string", "what fronts and reports compare: 'method' or 'method:mode'", True),
    "study": _c("string", "the Optuna study the trial belongs to (series at one target)", True),
    "method": _c("string", "registered method name (trainables/methods/)", True),
    "mode": _c("string", "method mode (where its statistics come from)", True),
    "preset": _c("string", "preset the trial started from ('' = none)", True),
    "status": _c("string", f"'{OK}', '{FAILED}' or '{PRUNED}' (stopped at a rung of the pruner)",
                 True),
    "pruned_at": _c("int64", "the epoch (rung) a pruned trial was stopped at (-1 = not pruned)",
                    True),
    "error": _c("string", "why a failed trial failed, 'Type: message' ('' when ok)", True),
    "dp_valid": _c("bool", "whether the epsilon claim holds for this trial's method and mode",
                   True),
    "validity_reason": _c("string", "the statement behind dp_valid, derived from the mode",
                          True),
    "randomness": _c("string", "where noise and sampling came from: secret (OS entropy), "
                               "secure (CSPRNG), reproducible (seeded: replayable)", True),
    "release_safe": _c("bool", "false for reproducible trials: their noise can be replayed "
                               "from recorded seeds, so no epsilon holds for their release",
                       True),
    "seed": _c("int64", "seed of model initialisation and public-batch order (not the noise)",
               True),
    "lr": _c("float64", "learning rate", True),
    "clip_norm": _c("float64", "clipping norm C (the initial C_0 of a method that moves it)", True),
    "momentum": _c("float64", "SGD momentum", True),
    "batch_size": _c("int64", "expected Poisson batch size", True),
    "epochs": _c("int64", "training epochs", True),
    "method_params": _c("string", "JSON of every method hyperparameter (also hp_* columns)",
                        True),
    "noise_multiplier": _c("float64", "sigma (sigma_0 for a decaying schedule)", True),
    "noise_schedule": _c("string", "JSON list of {noise_multiplier, steps} phases", True),
    "sample_rate": _c("float64", "Poisson sampling rate q the accountant used", True),
    "steps": _c("int64", "optimizer steps", True),
    "delta": _c("float64", "delta", True),
    "target_epsilon": _c("float64", "the budget the trial is held to", True),
    "epsilon_lower": _c("float64", "accountant's lower epsilon bound (null for RDP)", True),
    "epsilon_estimate": _c("float64", "accountant's epsilon estimate (null for RDP)", True),
    "epsilon_upper": _c("float64", "accountant's upper epsilon bound (the claim)", True),
    "epsilon_spent": _c("float64", "upper epsilon bound of the steps the trial ran: its claim "
                                   "when finished, below its target when pruned", True),
    "accountant": _c("string", "'prv' or 'rdp'", True),
    "accountant_fallback": _c("string", "why RDP was used instead of PRV ('' if not)", True),
    "val_accuracy": _c("float64", "final validation accuracy: what selection reads (private "
                                  "data, no noise)", False),
    "val_loss": _c("float64", "final validation cross-entropy", False),
    "test_accuracy": _c("float64", "final test accuracy: reported, never a basis for choosing",
                        False),
    "noisy_val_score": _c("float64", "private tuning: validation accuracy with Gaussian noise on "
                                     "the correct count (what selection reads; accounted in the "
                                     "end-to-end epsilon)", True),
    "test_loss": _c("float64", "final test cross-entropy", False),
    "train_loss": _c("float64", "final epoch's mean training loss on private data, no noise "
                                "(monitoring only)", False),
    "clipped_fraction": _c("float64", "final epoch's fraction of clipped examples (an example "
                                      "is clipped when a norm its method bounds exceeds its "
                                      "bound), averaged over the epoch's steps: private data, no "
                                      "noise (monitoring only)", False),
    "degenerate": _c("bool", "validation accuracy below chance + the stated margin: kept off "
                             "fronts and picks", False),
    "train_seconds": _c("float64", "wall time of training", True),
    "audit_seconds": _c("float64", "wall time of the audit (reference training + scoring)",
                        True),
    "peak_mia_accuracy": _c("float64", "max over layers and attacks of the attack accuracy",
                            False),
    "peak_mia_upper": _c("float64", "simultaneous upper confidence bound of that maximum "
                                    "(what pick constrains)", False),
    "peak_layer": _c("string", "name of the layer where the peak is", False),
    "peak_layer_index": _c("int64", "index of that layer, from the input (-1 = output only)",
                           False),
    "peak_attack": _c("string", "the attack that reached the peak", False),
    "leak_detected": _c("bool", "peak p-value, corrected for layers x attacks, below the "
                                "audit's alpha", False),
    "leak_p_value": _c("float64", "that corrected p-value", False),
    "loss_attack_accuracy": _c("float64", "loss-threshold baseline attack accuracy", False),
    "loss_attack_auc": _c("float64", "loss-threshold baseline attack AUC", False),
    "mia_layers": _c("string", "JSON list per layer and attack: accuracy with its interval, AUC "
                               "with its interval, TPR at 1% and 0.1% FPR with Clopper-Pearson "
                               "intervals, p-value, counts", False),
    "mia_epsilon_lower": _c("float64", "empirical epsilon lower bound (95%, all ROC points of "
                                       "all attacks simultaneously) against the claimed delta",
                            False),
    "mia_pointwise_violations": _c("int64", "ROC points whose own 95% intervals lie outside the "
                                            "claimed (epsilon, delta) region (-1 = not checked)",
                                   False),
    "audit_mode": _c("string", "reference models: 'offline' (public pool only) or 'online' "
                               "(random halves of the candidates' population)", True),
    "audit_error": _c("string", "why the audit of an otherwise finished trial failed", True),
    "eps_lower_bound": _c("float64", "empirical epsilon lower bound of a canary audit (95%)",
                          False),
    "eps_lower_bound_kind": _c("string", "'black-box' (input canaries) or 'white-box' "
                                         "(gradient canaries)", True),
    "canaries": _c("int64", "canaries in that audit (m)", True),
    "audit_contradicts": _c("bool", "a valid claim is below an empirical lower bound (the canary "
                                    "audit's or the MIA ROC points'): the claim is contradicted "
                                    "by the audit", False),
    "repeat_of": _c("string", "for a re-run with fresh noise: the trial it repeats ('' if not)",
                    True),
    "checkpoint": _c("string", "final checkpoint directory, relative to the run dir", True),
    "privacy_record": _c("string", "privacy.json, relative to the run dir", True),
    "trajectories": _c("string", "JSON of per-step series logged by the method (WW's C_t)",
                       True),
}

REQUIRED = ("trial_id", "method", "status", "dp_valid", "test_accuracy", "epsilon_upper")
#: Absolute margin over chance (1 / classes) below which a trial is degenerate.
DEGENERATE_MARGIN = 0.1
_NUMERIC = ("float64", "int64")


def not_covered() -> list[str]:
    """Columns the trial's epsilon does not cover (for reports and the export statement); the
    privacy record's are ``not_covered_in_record``."""
    return [name for name, c in COLUMNS.items() if not c.covered]


# ---- the privacy record: every value, covered or not ------------------------------------------
@dataclass(frozen=True)
class Stored:
    """Whether the trial's epsilon covers one value of the privacy record, and why.

    ``adaptive``: a statistic of the mode's declared sources (``core.modes``), computed from
    public data or released outputs in a DP-valid mode but from the private batch without noise
    in an invalid one (``faithful``); it is covered only where the record's ``dp_valid`` holds.
    """

    covered: bool
    why: str
    adaptive: bool = False

    def covers(self, *, dp_valid: bool) -> bool:
        return self.covered and (dp_valid or not self.adaptive)


_CONFIG = Stored(True, "fixed before training: configuration, calibration or the model's "
                       "structure (no data)")
_ACCOUNTING = Stored(True, "the accountant's calibration and the ledger of the multipliers it "
                           "certified (no data)")
_ENVIRONMENT = Stored(True, "software versions (no data)")
_PUBLIC = Stored(True, "computed from the public shadow pool only (a method's public stage)")
_RELEASED = Stored(True, "computed from the weights, which every step released: "
                         "post-processing")
_PLAN = Stored(True, "the engine's kernel plan and its timings, measured on public examples "
                     "only (trainables.training.loop.plan_engine)")
_ADAPTIVE = Stored(True, "the adaptive statistic's last value: from public data or released "
                         "gradients in a DP-valid mode, from the private batch without noise "
                         "in faithful mode", adaptive=True)
_GUARD = Stored(False, "example-steps whose coefficients overreached the bound: a count over "
                       "private examples without noise (a health counter of the mechanism, 0 "
                       "for every shipped method); never exported")


def _declare(stored: Stored, *paths: str) -> dict[str, Stored]:
    return dict.fromkeys(paths, stored)


#: privacy.json's values: dotted path -> how the epsilon covers it. Lists are transparent (a
#: list's items share its path), ``*`` matches one key and ``**`` the rest of a path.
RECORD: dict[str, Stored] = {
    **_declare(_CONFIG, "mechanism", "method", "mode", "dp_valid", "validity_reason",
               "randomness", "release_safe", "clip_norm", "delta", "target_epsilon"),
    **_declare(_ACCOUNTING, "sample_rate", "steps", "noise_multiplier",
               "noise_schedule.noise_multiplier", "noise_schedule.steps", "epsilon_lower",
               "epsilon_estimate", "epsilon_upper", "accountant", "accountant_fallback",
               "eps_error", "ledger.sample_rate",
               *(f"ledger.events.{key}" for key in (
                   "kind", "sampling_probability", "noise_multiplier", "count"))),
    "guard_capped": _GUARD,
    **_declare(_ENVIRONMENT, "versions.*"),
    # ww_dpsgd's probes of its weights (the results store's ``trajectories`` copies them)
    **_declare(_RELEASED, *(f"trajectories.{key}" for key in (
        "step", "clip_norm", "zeta_hat", "zeta", "clamp", "zeta:*"))),
    # the training loop's own entries
    **_declare(_CONFIG, "method_record.per_example_path", "method_record.data_placement",
               "method_record.trained_layers", "method_record.trained_parameters",
               "method_record.model_parameters", "method_record.model_fixes.**"),
    **_declare(_PLAN, *(f"method_record.engine_plan.{key}" for key in (
        "module", "kind", "label", "source", "geometry.*", "choice.*", "timings_ms.*"))),
    # each method's extra_record(): dpsgd_lf
    **_declare(_CONFIG, *(f"method_record.{key}" for key in (
        "t_f", "t_f_fraction", "m_f", "frozen_layers"))),
    # ww_dpsgd (its controller reads the probe layers' weights)
    **_declare(_CONFIG, *(f"method_record.{key}" for key in (
        "probe_layers", "clip_norm_0", "clamp", "clip_norm_bounds", "ema_init", "probes",
        "estimator"))),
    **_declare(_RELEASED, "method_record.clip_norm_final", "method_record.clamp_hits.min",
               "method_record.clamp_hits.max"),
    # lm_dpsgd
    **_declare(_CONFIG, *(f"method_record.{key}" for key in (
        "weights", "r", "public_batch_size", "u_every", "lagged_beta"))),
    **_declare(_PUBLIC, "method_record.risk", "method_record.risk_effective",
               "method_record.risk_meta", "method_record.risk_meta.identity.**",
               *(f"method_record.risk_meta.{key}" for key in (
                   "layers", "er_eval", "members", "nonmembers", "attack_eval_examples",
                   "shadow_train_accuracy", "shadow_test_accuracy", "attack_accuracy",
                   "attack_fit_accuracy", "cache_file"))),
    "method_record.final_weights": _ADAPTIVE,
    # dp_adamilg
    **_declare(_CONFIG, *(f"method_record.{key}" for key in (
        "alpha", "alpha_role", "k", "sigma_floor", "sigma_floor_is", "sigma_floor_absolute",
        "refresh_every", "layer_noise_std"))),
    "method_record.thresholds": _ADAPTIVE,
}


def _matches(pattern: Sequence[str], path: Sequence[str]) -> bool:
    if pattern and pattern[-1] == "**":
        head = pattern[:-1]
        return len(path) >= len(head) and _matches(head, path[:len(head)])
    return len(pattern) == len(path) and all(
        fnmatchcase(key, part) for part, key in zip(pattern, path, strict=True))


def record_entry(path: Sequence[str]) -> Stored | None:
    """The declaration of the value at ``path`` (keys from the record's top), or None."""
    return next((stored for pattern, stored in RECORD.items()
                 if _matches(pattern.split("."), path)), None)


def record_paths(record: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Every leaf's path in ``record`` (a privacy.json object), once each, in file order."""
    def walk(value: Any, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        if isinstance(value, Mapping):
            for key, item in value.items():
                yield from walk(item, (*path, str(key)))
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item, path)
        else:
            yield path
    return list(dict.fromkeys(walk(record, ())))


def undeclared(record: Mapping[str, Any]) -> list[str]:
    """Dotted paths of the values in ``record`` that ``RECORD`` does not class: each one is a
    value stored without saying whether the epsilon covers it."""
    return [".".join(p) for p in record_paths(record) if record_entry(p) is None]


def not_covered_in_record(record: Mapping[str, Any]) -> list[str]:
    """Dotted paths of the values in ``record`` that its epsilon does not cover (an undeclared
    value counts as not covered): what an export must never copy."""
    valid = bool(record.get("dp_valid"))
    return [".".join(p) for p in record_paths(record)
            if not ((stored := record_entry(p)) and stored.covers(dp_valid=valid))]


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def is_degenerate(val_accuracy: float, *, num_classes: int) -> bool:
    return not (val_accuracy >= 1.0 / num_classes + DEGENERATE_MARGIN)


def row_from_trial(*, run_dir: Path, trial_dir: Path, checkpoint_dir: Path,
                   spec: Mapping[str, Any], privacy: PrivacyRecord,
                   history: list[dict[str, Any]], train_seconds: float, num_classes: int,
                   series: str = "", study: str = "", preset: str = "",
                   repeat_of: str = "") -> dict[str, Any]:
    """A results row for a finished trial (MIA columns empty until the audit fills them)."""
    last = history[-1]
    params = dict(spec.get("method_params") or {})
    row: dict[str, Any] = {
        "trial_id": spec["trial_id"], "series": series or spec["method"], "study": study,
        "method": spec["method"], "mode": str(params.get("mode", "")), "preset": preset,
        "status": OK, "error": "", "dp_valid": privacy.dp_valid,
        "validity_reason": privacy.validity_reason, "randomness": privacy.randomness,
        "release_safe": privacy.release_safe, "seed": int(spec["seed"]),
        "lr": float(params["lr"]), "clip_norm": float(params["clip_norm"]),
        "momentum": float(params.get("momentum", 0.0)), "batch_size": int(spec["batch_size"]),
        "epochs": int(spec["epochs"]),
        "method_params": _json({k: v for k, v in params.items() if k != "risk_meta"}),
        "noise_multiplier": float(privacy.noise_multiplier),
        "noise_schedule": _json(privacy.noise_schedule.to_list()),
        "sample_rate": float(privacy.sample_rate), "steps": privacy.steps,
        "delta": float(privacy.delta), "target_epsilon": float(privacy.target_epsilon),
        "epsilon_lower": _num(privacy.epsilon_lower),
        "epsilon_estimate": _num(privacy.epsilon_estimate),
        "epsilon_upper": float(privacy.epsilon_upper),
        "epsilon_spent": float(privacy.epsilon_upper), "pruned_at": -1,
        "accountant": privacy.accountant,
        "accountant_fallback": privacy.accountant_fallback or "",
        "val_accuracy": float(last["val_accuracy"]), "val_loss": float(last["val_loss"]),
        "test_accuracy": float(last["test_accuracy"]), "test_loss": float(last["test_loss"]),
        "train_loss": float(last["train_loss_nonprivate"]),
        "clipped_fraction": _num(last.get("clipped_fraction")),
        "degenerate": is_degenerate(float(last["val_accuracy"]), num_classes=num_classes),
        "noisy_val_score": math.nan,
        "train_seconds": float(train_seconds), "audit_seconds": math.nan,
        **empty_audit(),
        "eps_lower_bound": math.nan, "eps_lower_bound_kind": "", "canaries": -1,
        "audit_contradicts": False, "repeat_of": repeat_of,
        "checkpoint": os.path.relpath(checkpoint_dir, run_dir),
        "privacy_record": os.path.relpath(Path(trial_dir) / layout.PRIVACY, run_dir),
        "trajectories": _json(privacy.trajectories),
    }
    for key, value in params.items():
        if isinstance(value, (int, float, str, bool)):
            row[f"hp_{key}"] = value
    return row


def empty_audit() -> dict[str, Any]:
    """The MIA columns of a trial without an audit (also what a failed audit leaves)."""
    return {"peak_mia_accuracy": math.nan, "peak_mia_upper": math.nan, "peak_layer": "",
            "peak_layer_index": -1, "peak_attack": "", "leak_detected": False,
            "leak_p_value": math.nan, "loss_attack_accuracy": math.nan,
            "loss_attack_auc": math.nan, "mia_layers": "[]", "audit_mode": "",
            "mia_epsilon_lower": math.nan, "mia_pointwise_violations": -1,
            "audit_error": ""}


def failed_row(*, trial_id: str, method: str, error: str, series: str = "", study: str = "",
               spec: Mapping[str, Any] | None = None, preset: str = "") -> dict[str, Any]:
    """A row for a trial that failed: it is recorded with its reason, never dropped."""
    spec = spec or {}
    params = dict(spec.get("method_params") or {})
    row: dict[str, Any] = {name: None for name in COLUMNS}
    row.update({"trial_id": trial_id, "series": series or method, "study": study,
                "method": method, "status": FAILED, "error": error, "preset": preset,
                "dp_valid": False, "mode": str(params.get("mode", "")), "validity_reason": "",
                "release_safe": False, "degenerate": False, "test_accuracy": math.nan,
                "val_accuracy": math.nan, "epsilon_upper": math.nan,
                "epsilon_spent": math.nan, "pruned_at": -1, **empty_audit(),
                "audit_contradicts": False, "trajectories": "{}", "repeat_of": "",
                "canaries": -1})
    for key in ("seed", "batch_size", "epochs"):
        if key in spec:
            row[key] = spec[key]
    for key in ("lr", "clip_norm", "momentum"):
        if key in params:
            row[key] = params[key]
    if params:
        row["method_params"] = _json({k: v for k, v in params.items() if k != "risk_meta"})
    return row


def pruned_row(*, trial_id: str, method: str, record: Mapping[str, Any],
               spec: Mapping[str, Any], series: str = "", study: str = "",
               preset: str = "") -> dict[str, Any]:
    """A trial the pruner stopped: kept with its rung, its validation accuracy there, the
    epochs it ran and the epsilon they spent; no test accuracy, never on a front or picked."""
    row = failed_row(trial_id=trial_id, method=method, error="", series=series, study=study,
                     spec=spec, preset=preset)
    row.update({"status": PRUNED, "pruned_at": int(record["pruned_at"]),
                "epochs": int(record["epochs_run"]),
                "val_accuracy": float(record["val_accuracy"]),
                "epsilon_spent": float(record["epsilon_spent"]),
                "train_seconds": float(record.get("train_seconds", math.nan)),
                "target_epsilon": float(spec["calibration"]["target_epsilon"]),
                "randomness": str(spec.get("randomness", ""))})
    return row


def unfinished(row: Mapping[str, Any]) -> str:
    """Why a row is not a finished trial, in words for a refusal ('' when it is one): a pruned
    trial did not fail, and saying so with an empty reason sends the user looking for an error."""
    if row["status"] == OK:
        return ""
    if row["status"] == PRUNED:
        return f"this one was pruned at epoch {int(row['pruned_at'])}, weaker than its rivals"
    return f"this one failed: {row['error']}"


def frame_of(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows as a frame with every documented column, in schema order, then hp_* columns."""
    frame = pd.DataFrame(rows)
    for name in COLUMNS:
        if name not in frame:
            frame[name] = None
    hp = sorted(c for c in frame.columns if c.startswith("hp_"))
    rest = sorted(c for c in frame.columns if c not in COLUMNS and not c.startswith("hp_"))
    return frame[[*COLUMNS, *hp, *rest]]


def results_bytes(rows: list[dict[str, Any]]) -> bytes:
    """The results store's file content for ``rows`` (what ``RunDir.commit`` writes)."""
    buffer = io.BytesIO()
    frame_of(rows).to_parquet(buffer, index=False)
    return buffer.getvalue()


def write_results(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Write all rows atomically, so a reader never sees half a file."""
    frame = frame_of(rows)
    return atomic_write(Path(run_dir) / layout.RESULTS,
                        lambda fh: frame.to_parquet(fh, index=False))


def append_row(run_dir: Path, row: dict[str, Any]) -> Path:
    """Append (or replace, by trial_id) one row."""
    path = Path(run_dir) / layout.RESULTS
    rows = read_results(run_dir).to_dict("records") if path.exists() else []
    rows = [r for r in rows if r["trial_id"] != row["trial_id"]] + [row]
    return write_results(run_dir, rows)


def read_results(run_dir: Path, *, allow_empty: bool = False) -> pd.DataFrame:
    """Read and validate the store; any problem is one UserInputError naming the path."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserInputError(field="RUN_DIR", value=str(run), allowed="an existing run directory")
    path = run / layout.RESULTS
    if not path.is_file():
        if allow_empty:
            return frame_of([])
        raise UserInputError(field="RUN_DIR", value=str(run),
                             allowed=f"a run directory containing {layout.RESULTS}")
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
    for name in frame.columns:
        column = COLUMNS.get(name)
        if column is None or column.dtype not in _NUMERIC or frame[name].isna().all():
            continue
        if not pd.api.types.is_numeric_dtype(frame[name]):
            raise UserInputError(field=f"results.{name}", value=str(frame[name].dtype),
                                 allowed=f"a numeric column ({column.dtype}) in {path}")
    if frame.empty and not allow_empty:
        raise UserInputError(field="results", value=str(path), allowed="at least one trial row")
    return frame
