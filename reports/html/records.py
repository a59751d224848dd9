"""Reading a run directory for the report: the results store normalised, its JSON cells parsed,
config.toml, summary.json and the per-trial history.json / audit.json / audit_scores.npz, each
validated before anything is drawn so that bad input is one UserInputError and writes nothing.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpsweep.core import layout
from dpsweep.core.datasets import NUM_CLASSES
from dpsweep.core.errors import UserInputError
from dpsweep.core.toml import tomllib
from dpsweep.core.vocabulary import FAILED, OK
from dpsweep.reports.pareto import (
    DEFAULT_NUM_CLASSES,
    NONPRIVATE,
    natural_key,
    parse_mia_layers,
    sort_trials,
)
from dpsweep.reports.store import COLUMNS, read_results


def _parse_json_cell(value: Any, *, column: str, trial_id: str,
                     empty: list[Any] | dict[str, Any]) -> Any:
    """A JSON cell of the store; null is ``empty``; bad JSON or the wrong shape is corrupt."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return empty
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, type(empty)):
        kind = "a JSON list" if isinstance(empty, list) else "a JSON object"
        raise UserInputError(field=f"results.{column}", value=f"trial {trial_id}",
                             allowed=f"{kind} (the results file is corrupt)")
    return parsed


def _read_json_file(path: Path, *, what: str) -> Any:
    """A JSON record of the run directory; unreadable or invalid is one UserInputError."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserInputError(field=what, value=str(path),
                             allowed=f"a readable JSON file written by dpsweep "
                                     f"({exc.__class__.__name__})") from None


def as_float(value: Any) -> float:
    """A number from a JSON record; NaN when absent or not a number."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


@dataclass(frozen=True)
class RunInfo:
    """What the sweep was: config.toml and summary.json (either may be absent in old runs),
    with the facts the report needs resolved from them."""

    config: dict[str, Any]
    summary: dict[str, Any]
    dataset: str
    num_classes: int
    split_sizes: dict[str, int]
    validation_size: int | None
    targets: tuple[float, ...]


@dataclass(frozen=True)
class RunData:
    """The results store, normalised (documented columns, trial order), the JSON columns parsed
    per trial, and the run's config and summary.

    ``prepared`` maps a method to the parameters its preparation fills (``role="prepared"``):
    they are not hyperparameters, so the report does not show them as such. The caller reads
    them from the method declarations, which sit above reports.
    """

    run_dir: Path
    frame: pd.DataFrame
    parsed: dict[str, dict[str, Any]]
    info: RunInfo = field(default_factory=lambda: RunInfo({}, {}, "", DEFAULT_NUM_CLASSES, {},
                                                          None, ()))
    prepared: Mapping[str, Collection[str]] = field(default_factory=dict)

    @property
    def ok(self) -> pd.DataFrame:
        return self.frame[self.frame["status"] == OK]

    @property
    def dp(self) -> pd.DataFrame:
        """Finished DP trials (everything but the non-private baseline)."""
        ok = self.ok
        return ok[ok["method"] != NONPRIVATE]


def trial_dirs(run: Path, row: pd.Series) -> list[Path]:
    """Where a trial's records may be: trials/<trial_id>, beside its privacy record, or its
    checkpoint directory."""
    out = [run / layout.TRIALS / str(row["trial_id"])]
    record, checkpoint = row.get("privacy_record"), row.get("checkpoint")
    if isinstance(record, str) and record:
        out.append((run / record).parent)
    if isinstance(checkpoint, str) and checkpoint:
        out.append(run / checkpoint)
    return list(dict.fromkeys(out))


def _trial_file(run: Path, row: pd.Series, name: str) -> Path | None:
    return next((d / name for d in trial_dirs(run, row) if (d / name).is_file()), None)


def _read_config(run: Path) -> dict[str, Any]:
    path = run / layout.CONFIG
    if not path.is_file():
        return {}
    try:
        parsed = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserInputError(field="config", value=str(path),
                             allowed=f"a readable TOML config ({exc.__class__.__name__})"
                             ) from None
    return parsed


def _read_summary(run: Path) -> dict[str, Any]:
    path = run / layout.SUMMARY
    if not path.is_file():
        return {}
    parsed = _read_json_file(path, what="summary")
    if not isinstance(parsed, dict):
        raise UserInputError(field="summary", value=str(path), allowed="a JSON object")
    return parsed


def _int_or_none(value: Any) -> int | None:
    number = as_float(value)
    return int(number) if math.isfinite(number) and number > 0 else None


def _run_info(run: Path, frame: pd.DataFrame, num_classes: int | None) -> RunInfo:
    config, summary = _read_config(run), _read_summary(run)
    data_cfg = config.get("data") if isinstance(config.get("data"), dict) else {}
    dataset = str(data_cfg.get("dataset", "") or "")
    sizes: dict[str, int] = {}
    raw_sizes = summary.get("split_sizes")
    if isinstance(raw_sizes, dict):
        sizes = {str(k): int(v) for k, v in raw_sizes.items() if _int_or_none(v)}
    if not sizes:
        sizes = {k[:-5]: int(v) for k, v in data_cfg.items()
                 if k.endswith("_size") and _int_or_none(v)}
    if "validation" not in sizes:  # 0 in the config = dataset default: the spec has it
        for _, row in frame[frame["status"] == OK].iterrows():
            path = _trial_file(run, row, layout.SPEC)
            if path is not None:
                spec = _read_json_file(path, what="spec")
                spec_sizes = spec.get("sizes") if isinstance(spec, dict) else None
                if isinstance(spec_sizes, dict):
                    dataset = dataset or str(spec.get("dataset", ""))
                    for k, v in spec_sizes.items():
                        if _int_or_none(v):
                            sizes.setdefault(str(k), int(v))
                break
    budget = config.get("budget") if isinstance(config.get("budget"), dict) else {}
    targets = {float(e) for e in budget.get("epsilons", []) if math.isfinite(as_float(e))}
    targets |= {float(e) for e in frame["target_epsilon"] if math.isfinite(e)}
    recorded = summary.get("num_classes")
    classes = (num_classes or (recorded if _int_or_none(recorded) else None)
               or NUM_CLASSES.get(dataset, DEFAULT_NUM_CLASSES))
    return RunInfo(config=config, summary=summary, dataset=dataset, num_classes=classes,
                   split_sizes=sizes, validation_size=sizes.get("validation"),
                   targets=tuple(sorted(targets)))


def load_run(run_dir: Path, *, num_classes: int | None = None,
             prepared: Mapping[str, Collection[str]] | None = None) -> RunData:
    """Read and normalise the store and the run's records; anything corrupt is one
    UserInputError naming it. ``prepared``: see :class:`RunData`."""
    run = Path(run_dir)
    frame = read_results(run).copy()
    for name in COLUMNS:
        if name not in frame.columns:
            frame[name] = None
    frame["trial_id"] = frame["trial_id"].astype(str)
    frame["method"] = frame["method"].fillna("").astype(str)
    frame["status"] = frame["status"].fillna(FAILED).astype(str)
    for name, default in (("dp_valid", False), ("release_safe", True), ("degenerate", False),
                          ("leak_detected", False), ("audit_contradicts", False)):
        frame[name] = frame[name].fillna(default).astype(bool)
    for name, column in COLUMNS.items():
        if column.dtype == "string":
            frame[name] = frame[name].fillna("").astype(str)
        elif column.dtype in ("float64", "int64"):
            frame[name] = pd.to_numeric(frame[name], errors="coerce").astype(float)
    frame["series"] = frame["series"].where(frame["series"] != "", frame["method"])
    frame = sort_trials(frame).reset_index(drop=True)
    hp = sorted(c for c in frame.columns if c.startswith("hp_"))
    rest = sorted(c for c in frame.columns if c not in COLUMNS and c not in hp)
    frame = frame[[*COLUMNS, *hp, *rest]]
    parsed: dict[str, dict[str, Any]] = {}
    for _, row in frame.iterrows():
        tid = row["trial_id"]
        parsed[tid] = {
            "mia_layers": parse_mia_layers(row["mia_layers"], trial_id=tid),
            "trajectories": _parse_json_cell(row["trajectories"], column="trajectories",
                                             trial_id=tid, empty={}),
            "noise_schedule": _parse_json_cell(row["noise_schedule"], column="noise_schedule",
                                               trial_id=tid, empty=[]),
            "method_params": _parse_json_cell(row["method_params"], column="method_params",
                                              trial_id=tid, empty={}),
        }
    return RunData(run_dir=run, frame=frame, parsed=parsed,
                   info=_run_info(run, frame, num_classes), prepared=dict(prepared or {}))


@dataclass(frozen=True)
class Records:
    """The per-trial files the figures need, read and validated before anything is drawn."""

    histories: dict[str, list[dict[str, Any]]]
    audits: dict[str, Any]
    #: Per trial, every audited candidate's scores (:func:`read_audit_scores`).
    scores: dict[str, pd.DataFrame] = field(default_factory=dict)


#: Arrays of an audit_scores.npz (``orchestrator.audit.membership.write_scores``).
_SCORE_ARRAYS = ("format", "pool_index", "is_member", "layer", "attack", "scores")


def read_audit_scores(path: Path) -> pd.DataFrame:
    """An audit_scores.npz as one row per candidate: ``pool_index``, ``is_member`` and one
    float32 column ``<layer>/<attack>`` per attack. Read without pickles; a file of another
    shape is one UserInputError."""
    def bad(why: str) -> UserInputError:
        return UserInputError(field="audit scores", value=str(path),
                              allowed=f"an audit_scores.npz written by dpsweep ({why})")

    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in _SCORE_ARRAYS}
    except (OSError, ValueError, KeyError, EOFError, TypeError, AttributeError,
            zipfile.BadZipFile) as exc:
        raise bad(exc.__class__.__name__) from None
    scores = arrays["scores"]
    n, a = len(arrays["pool_index"]), len(arrays["layer"])
    if (not str(arrays["format"]).startswith("dpsweep-audit-scores-") or scores.ndim != 2
            or scores.shape != (a, n) or arrays["is_member"].shape != (n,)
            or arrays["attack"].shape != (a,)):
        raise bad("inconsistent shapes")
    columns = {"pool_index": arrays["pool_index"].astype(np.int64),
               "is_member": arrays["is_member"].astype(np.int8)}
    for layer, attack, row in zip(arrays["layer"], arrays["attack"], scores, strict=True):
        columns[f"{layer}/{attack}"] = row.astype(np.float32)
    return pd.DataFrame(columns)


def plan_statement(data: RunData, trial_id: str) -> str:
    """What the trial's audit plan can and cannot see, as its audit.json states it ("" when
    the trial has no audit record or the record predates the statement)."""
    rows = data.frame[data.frame["trial_id"] == trial_id]
    path = None if rows.empty else _trial_file(data.run_dir, rows.iloc[0], layout.AUDIT)
    if path is None:
        return ""
    document = _read_json_file(path, what="audit")
    text = document.get("plan_statement") if isinstance(document, dict) else None
    return text if isinstance(text, str) else ""


def read_records(data: RunData, *, trial_ids: Iterable[str]) -> Records:
    """history.json, audit.json and audit_scores.npz of the given trials (absent files are
    left out: the report notes them; corrupt ones are one UserInputError)."""
    rows = data.frame.set_index("trial_id", drop=False)
    histories: dict[str, list[dict[str, Any]]] = {}
    audits: dict[str, Any] = {}
    scores: dict[str, pd.DataFrame] = {}
    for tid in sorted(set(trial_ids), key=natural_key):
        row = rows.loc[tid]
        path = _trial_file(data.run_dir, row, layout.HISTORY)
        if path is not None:
            history = _read_json_file(path, what="history")
            if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
                raise UserInputError(field="history", value=str(path),
                                     allowed="a JSON list of per-epoch objects")
            histories[tid] = history
        path = _trial_file(data.run_dir, row, layout.AUDIT)
        if path is not None:
            audits[tid] = _read_json_file(path, what="audit")
        path = _trial_file(data.run_dir, row, layout.AUDIT_SCORES)
        if path is not None:
            scores[tid] = read_audit_scores(path)
    return Records(histories=histories, audits=audits, scores=scores)
