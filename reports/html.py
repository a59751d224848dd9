"""``dpsweep report RUN_DIR``: one self-contained HTML page plus every figure as PNG and its data
as CSV.

The page is built from the run directory's files only (results store, config.toml,
summary.json, each trial's history.json and audit.json), so it can be rebuilt at any time
without training. Images are embedded as data URIs and the CSS is inline: the HTML file alone
can be mailed to a reviewer. Everything is sorted and the PNGs carry no metadata, so a rebuild
from the same run gives byte-identical PNGs and CSVs, and the same HTML except the one line
holding the timestamp (``class="stamp"``).

What it says is what the numbers mean: fronts are of **validation** accuracy (what selection
reads) against peak MIA accuracy, with 95% intervals on both axes and ties kept
(``reports.pareto``); test accuracy is shown beside it, labelled as reported only; every value
computed on private data without noise carries "not covered by epsilon"
(``reports.store.not_covered``); every place that shows DP validity also shows "claim
contradicted by audit" and "replayable: not releasable" where they apply.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.errors import UserInputError
from core.modes import INVALID_TAG
from core.storage import atomic_write_text
from reports import plots
from reports.pareto import (
    ACC,
    ACC_HI,
    ACC_LO,
    DEFAULT_NUM_CLASSES,
    KIND_ALL,
    KIND_STUDY,
    KIND_VALID,
    MIA,
    MIA_HI,
    MIA_LO,
    NONPRIVATE,
    REFERENCE,
    Front,
    eligible,
    exclusion_reasons,
    exclusions,
    fronts,
    natural_key,
    parse_mia_layers,
    sort_trials,
)
from reports.store import COLUMNS, DEGENERATE_MARGIN, TRIALS_DIR, not_covered, read_results

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPORT_DIR = "report"
HTML_FILE = "report.html"
CONFIG_FILE = "config.toml"
SUMMARY_FILE = "summary.json"
HISTORY_FILE = "history.json"
AUDIT_FILE = "audit.json"
#: Test-accuracy gap beyond which the report calls the audit's references weaker than the target.
REFERENCE_GAP = 0.05
AUDIT_ERROR = "audit_error"
STAMP_CLASS = "stamp"
CONTRADICTED_TAG = "claim contradicted by audit"
REPLAYABLE_TAG = "replayable: not releasable"
NOT_COVERED_TAG = "not covered by epsilon"
TEST_NOTE = "reported, not used to choose"
#: Classes per dataset (trainables.data.NUM_CLASSES; reports cannot import trainables, a test
#: keeps the two equal). The hypervolume's chance accuracy is 1 / classes.
DATASET_CLASSES = {"digits": 10, "fashion-mnist": 10, "mnist": 10, "cifar10": 10}
#: Method parameters that are prepared from public data, not hyperparameters.
PREPARED_PARAMS = ("risk", "risk_meta")
#: Most trial ids listed in one table cell before "… (n in all)".
MAX_IDS = 12
#: Most curves in one validation-curve figure (further ones are in the CSV).
MAX_CURVES = 14
NOT_COVERED = frozenset(not_covered())


# ---- reading ---------------------------------------------------------------------------------
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


def _float(value: Any) -> float:
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
    per trial, and the run's config and summary."""

    run_dir: Path
    frame: pd.DataFrame
    parsed: dict[str, dict[str, Any]]
    info: RunInfo = field(default_factory=lambda: RunInfo({}, {}, "", DEFAULT_NUM_CLASSES, {},
                                                          None, ()))

    @property
    def ok(self) -> pd.DataFrame:
        return self.frame[self.frame["status"] == "ok"]

    @property
    def dp(self) -> pd.DataFrame:
        """Finished DP trials (everything but the non-private baseline)."""
        ok = self.ok
        return ok[ok["method"] != NONPRIVATE]


def trial_dirs(run: Path, row: pd.Series) -> list[Path]:
    """Where a trial's records may be: trials/<trial_id>, beside its privacy record, or its
    checkpoint directory."""
    out = [run / TRIALS_DIR / str(row["trial_id"])]
    record, checkpoint = row.get("privacy_record"), row.get("checkpoint")
    if isinstance(record, str) and record:
        out.append((run / record).parent)
    if isinstance(checkpoint, str) and checkpoint:
        out.append(run / checkpoint)
    return list(dict.fromkeys(out))


def _trial_file(run: Path, row: pd.Series, name: str) -> Path | None:
    return next((d / name for d in trial_dirs(run, row) if (d / name).is_file()), None)


def _read_config(run: Path) -> dict[str, Any]:
    path = run / CONFIG_FILE
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
    path = run / SUMMARY_FILE
    if not path.is_file():
        return {}
    parsed = _read_json_file(path, what="summary")
    if not isinstance(parsed, dict):
        raise UserInputError(field="summary", value=str(path), allowed="a JSON object")
    return parsed


def _int_or_none(value: Any) -> int | None:
    number = _float(value)
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
        for _, row in frame[frame["status"] == "ok"].iterrows():
            path = _trial_file(run, row, "spec.json")
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
    targets = {float(e) for e in budget.get("epsilons", []) if math.isfinite(_float(e))}
    targets |= {float(e) for e in frame["target_epsilon"] if math.isfinite(e)}
    classes = num_classes or DATASET_CLASSES.get(dataset, DEFAULT_NUM_CLASSES)
    return RunInfo(config=config, summary=summary, dataset=dataset, num_classes=classes,
                   split_sizes=sizes, validation_size=sizes.get("validation"),
                   targets=tuple(sorted(targets)))


def load_run(run_dir: Path, *, num_classes: int | None = None) -> RunData:
    """Read and normalise the store and the run's records; anything corrupt is one
    UserInputError naming it."""
    run = Path(run_dir)
    frame = read_results(run).copy()
    for name in COLUMNS:
        if name not in frame.columns:
            frame[name] = None
    frame["trial_id"] = frame["trial_id"].astype(str)
    frame["method"] = frame["method"].fillna("").astype(str)
    frame["status"] = frame["status"].fillna("failed").astype(str)
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
                   info=_run_info(run, frame, num_classes))


# ---- formatting --------------------------------------------------------------------------------
def _num(value: Any, digits: int = 4) -> str:
    x = _float(value)
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def _sci(value: Any) -> str:
    x = _float(value)
    return "—" if math.isnan(x) else f"{x:.3g}"


def _int(value: Any) -> str:
    x = _float(value)
    return "—" if math.isnan(x) else str(int(x))


def _ci(point: Any, lo: Any, hi: Any, digits: int = 3) -> str:
    if math.isnan(_float(point)):
        return "—"
    if _float(lo) == _float(point) == _float(hi):
        return _num(point, digits)
    return (f"{_num(point, digits)} <span class=\"ci\">[{_num(lo, digits)}, "
            f"{_num(hi, digits)}]</span>")


def schedule_text(*, sigma: float, schedule: Sequence[dict[str, Any]]) -> str:
    """sigma for a constant schedule; sigma_0 and the phases (sigma x steps) for a decay."""
    if len(schedule) <= 1:
        return _num(sigma)
    phases = [f"{_float(p.get('noise_multiplier')):.3f}×{_int(p.get('steps'))}"
              for p in schedule[:4]]
    more = f", … ({len(schedule)} phases)" if len(schedule) > 4 else ""
    return f"σ0 {_num(sigma)}; " + ", ".join(phases) + more


def _e(value: Any) -> str:
    return html.escape(str(value))


def _h(label: str, column: str | None = None) -> str:
    """A table header; columns the epsilon does not cover carry the label."""
    text = _e(label)
    if column is not None and column in NOT_COVERED:
        text += f'<br><span class="nc">{NOT_COVERED_TAG}</span>'
    return text


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *,
           row_classes: Sequence[str] | None = None, cls: str = "") -> str:
    """An HTML table; headers (from :func:`_h`) and cells are pre-escaped HTML."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        rc = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{rc}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    klass = f' class="{cls}"' if cls else ""
    return (f'<div class="scroll"><table{klass}><thead><tr>{head}</tr></thead><tbody>\n'
            + "\n".join(body) + "\n</tbody></table></div>")


def _badge(text: str, kind: str = "invalid") -> str:
    return f'<span class="{kind}">{_e(text)}</span>'


def flags_html(row: pd.Series | dict[str, Any]) -> str:
    """DP validity as the report shows it everywhere: valid / epsilon claim invalid, plus
    claim contradicted by audit and replayable: not releasable where they apply."""
    parts = ["valid" if bool(row["dp_valid"]) else _badge(INVALID_TAG)]
    if bool(row.get("audit_contradicts", False)):
        parts.append(_badge(CONTRADICTED_TAG))
    if not bool(row.get("release_safe", True)):
        parts.append(_badge(REPLAYABLE_TAG, "replay"))
    return " ".join(parts)


def flags_text(row: pd.Series | dict[str, Any]) -> str:
    """:func:`flags_html` as plain text (CSVs)."""
    parts = ["valid" if bool(row["dp_valid"]) else INVALID_TAG]
    if bool(row.get("audit_contradicts", False)):
        parts.append(CONTRADICTED_TAG)
    if not bool(row.get("release_safe", True)):
        parts.append(REPLAYABLE_TAG)
    return "; ".join(parts)


def _image(path: Path, alt: str, *, covered: bool = False) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    label = "" if covered else f' <span class="nc">{NOT_COVERED_TAG}</span>'
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_e(alt)}">'
            f"<figcaption>{_e(alt)} (<code>{_e(path.name)}</code>, data in "
            f"<code>{_e(path.stem)}.csv</code>){label}</figcaption></figure>")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:MAX_IDS])
    return _e(shown + (f", … ({len(ids)} in all)" if len(ids) > MAX_IDS else ""))


def _eps_tag(eps: float) -> str:
    """The file-name form of a target: front_eps3.png, front_eps0.5.png."""
    return f"eps{eps:g}"


def _hyperparameters(row: pd.Series, params: dict[str, Any]) -> str:
    """The trial's method hyperparameters (mode, lr, clip_norm, ...), prepared ones left out."""
    values = {k: v for k, v in params.items()
              if k not in PREPARED_PARAMS and isinstance(v, (int, float, str, bool))}
    if not values:
        values = {c[3:]: row[c] for c in row.index if c.startswith("hp_")
                  and not (isinstance(row[c], float) and math.isnan(row[c]))}
    parts = []
    for key in sorted(values):
        value = values[key]
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        parts.append(f"{key}={text}")
    return _e(", ".join(parts) or "—")


# ---- header and tuning -------------------------------------------------------------------------
def _section_table(rows: Sequence[tuple[str, str]]) -> str:
    return ('<table class="facts"><tbody>\n'
            + "\n".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
            + "\n</tbody></table>")


def _when(value: Any) -> str:
    """A timestamp as UTC text (summary.json stores POSIX seconds; other text is shown as is)."""
    import datetime

    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(seconds):
        return str(value)
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "—"
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"
            ) + f" ({seconds:,.0f} s)"


def _glance(data: RunData, front_list: Sequence[Front]) -> str:
    """The headline: per target, the valid-DP, release-safe front and its most accurate trial,
    then how many trials carry a flag."""
    parts = []
    for front in front_list:
        if front.kind != KIND_VALID:
            continue
        if front.trials.empty:
            parts.append(f"ε = {front.target_epsilon:g}: no valid-DP, release-safe trial on a "
                         "front.")
            continue
        best = sort_trials(front.trials, by=[ACC], ascending=[False]).iloc[0]
        parts.append(
            f"ε = {front.target_epsilon:g}: valid-DP, release-safe front "
            f"<b>{_ids(list(front.trial_ids))}</b>; most accurate "
            f"<b>{_e(best['trial_id'])}</b> ({_e(best['series'])}), validation accuracy "
            f"{_ci(best[ACC], best[ACC_LO], best[ACC_HI])}, peak MIA "
            f"{_ci(best[MIA], best[MIA_LO], best[MIA_HI])}.")
    dp = data.dp
    flags = [f"{int((~dp['dp_valid']).sum())} {INVALID_TAG}",
             f"{int(dp['audit_contradicts'].sum())} {CONTRADICTED_TAG}",
             f"{int((~dp['release_safe']).sum())} {REPLAYABLE_TAG}",
             f"{int((exclusion_reasons(data.frame) != '').sum())} kept off the fronts"]
    return ("<p><b>At a glance</b> (accuracies and MIA: "
            f'<span class="nc">{NOT_COVERED_TAG}</span>). '
            + " ".join(parts) + " Trials flagged: " + _e("; ".join(flags)) + ".</p>")


def _header_section(data: RunData) -> str:
    info, frame = data.info, data.frame
    cfg = info.config
    model_cfg = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    training = cfg.get("training") if isinstance(cfg.get("training"), dict) else {}
    privacy = cfg.get("privacy") if isinstance(cfg.get("privacy"), dict) else {}
    summary = info.summary
    ok, dp = data.ok, data.dp
    sizes = ", ".join(f"{k} {v:,}" for k, v in sorted(info.split_sizes.items(),
                                                        key=lambda kv: _SPLIT_ORDER.get(kv[0], 9)))
    epochs = sorted({int(e) for e in ok["epochs"] if math.isfinite(e)})
    batches = sorted({int(b) for b in ok["batch_size"] if math.isfinite(b)})
    accountants = dp["accountant"].replace("", "—").value_counts().sort_index()
    accountant = str(summary.get("accountant") or "") or ", ".join(
        f"{a} ({n})" for a, n in accountants.items()) or "—"
    fallbacks = int((dp["accountant_fallback"] != "").sum())
    if fallbacks:
        accountant += f"; {_count(fallbacks, 'trial')} fell back to RDP (see the budget table)"
    deltas = sorted({float(d) for d in dp["delta"] if math.isfinite(d)})
    delta = ", ".join(f"{d:g}" for d in deltas) or str(privacy.get("delta", "—"))
    versions = summary.get("versions") if isinstance(summary.get("versions"), dict) else {}
    version_text = ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) or \
        "— (summary.json absent)"
    wall = _float(summary.get("wall_seconds"))
    if math.isfinite(wall):
        wall_text = _duration(wall)
        if summary.get("started") and summary.get("finished"):
            wall_text += f", {_e(_when(summary['started']))} → {_e(_when(summary['finished']))}"
    else:
        spent = float(np.nansum(ok["train_seconds"]) + np.nansum(ok["audit_seconds"]))
        wall_text = f"{_duration(spent)}: sum of trial training and audit times " \
                    "(summary.json absent)"
    failed = int((frame["status"] != "ok").sum())
    series = sorted(frame["series"].unique(), key=natural_key)
    rows = [
        ("run directory", _e(data.run_dir.resolve())),
        ("dataset", _e(info.dataset or "—") + f" ({info.num_classes} classes)"),
        ("split sizes", _e(sizes or "—")),
        ("model", _e(summary.get("model") or model_cfg.get("name") or "—")
         + (f", activation {_e(model_cfg['activation'])}" if model_cfg.get("activation")
            else "")),
        ("epochs", _e(", ".join(map(str, epochs)) or training.get("epochs", "—"))),
        ("batch size (expected, Poisson)",
         _e(", ".join(map(str, batches)) or training.get("batch_size", "—"))),
        ("accountant", _e(accountant)),
        ("target epsilons", _e(", ".join(f"{t:g}" for t in info.targets) or "—")
         + f"; delta {_e(delta)}"),
        ("trials", f"{len(frame)} ({len(ok)} finished, {failed} failed); series: "
                   + _e(", ".join(series))),
        ("software versions", _e(version_text)),
        ("wall time", wall_text),
    ]
    return _section_table(rows)


_SPLIT_ORDER = {"train": 0, "validation": 1, "holdout": 2, "test": 3, "shadow": 4}


def tuning_statement(*, summary: dict[str, Any], trials: int) -> str:
    """The privacy cost of choosing hyperparameters, in plain words: the Papernot & Steinke
    end-to-end bound when tuning was private, else why no epsilon covers the search."""
    tuning = summary.get("tuning") if isinstance(summary.get("tuning"), dict) else {}
    mode = str(tuning.get("mode") or "")
    statement = str(tuning.get("statement") or "")
    n_trials = tuning.get("n_trials", trials)
    end_to_end = _float(tuning.get("end_to_end_epsilon"))
    if mode == "private" and math.isfinite(end_to_end):
        head = (f"<p><b>Tuning was private</b> (random search with a random number of trials, "
                f"one DP selection score per trial, only the selected model released: "
                f"Papernot &amp; Steinke, 2022, <i>Hyperparameter Tuning with Renyi "
                f"Differential Privacy</i>). The end-to-end bound over the search is "
                f"<b>epsilon = {end_to_end:.4g}</b> ({_e(n_trials)} trials ran). It covers the "
                f"selected model and its noisy score only; everything else in this report "
                f"(other trials, noiseless validation and audit numbers) is "
                f"<b>{NOT_COVERED_TAG}</b>. The bound also assumes the number of trials stays "
                f"secret, and this report shows it: like the rest of the run directory, the "
                f"report stays with whoever ran the sweep; share the export "
                f"(<code>dpsweep pick RUN_DIR --export DIR</code>).</p>")
        return head + (f"<p>{_e(statement)}</p>" if statement else "")
    if mode == "private":
        head = ("<p><b>Tuning was meant to be private, but summary.json records no end-to-end "
                "epsilon</b>: no tuning-aware bound is claimed.</p>")
    else:
        head = (
            f"<p>This sweep ran <b>{_e(n_trials)}</b> trials and chose hyperparameters "
            f"<b>adaptively</b> (Optuna), from {_adaptive_inputs(tuning)} measured on private "
            "data without noise. Each trial's epsilon bounds what training <em>that one "
            "model</em> reveals, its hyperparameters taken as given. It does <b>not</b> cover "
            "the search: choosing one model from many after looking at noiseless private "
            f"metrics leaks more than any single trial's epsilon. {_adaptive_cover(tuning)}</p>"
            "<p>A tuning-aware epsilon (Papernot &amp; Steinke, 2022) needs random search, a "
            "random number of trials, a DP selection score and release of the selected model "
            "only (<code>tuning = \"private\"</code>). <b>Adaptive hyperparameter search over "
            "private metrics is not covered by the per-trial epsilon.</b></p>")
    return head + (f"<p>Recorded statement: {_e(statement)}</p>" if statement else "")


def _attack_seen(tuning: dict[str, Any]) -> bool | None:
    """Whether the adaptive sampler saw the in-trial attack (None: an older summary)."""
    seen = [v.get("objectives") for v in (tuning.get("by_target") or {}).values()
            if isinstance(v, dict) and v.get("objectives")]
    return any(len(o) > 1 for o in seen) if seen else None


def _adaptive_inputs(tuning: dict[str, Any]) -> str:
    attack = _attack_seen(tuning)
    if attack is None:
        return "validation accuracy (and, with the audit in the trial, MIA accuracy)"
    return ("validation accuracy and the MIA accuracy of an attack on the training members"
            if attack else "validation accuracy alone")


def _adaptive_cover(tuning: dict[str, Any]) -> str:
    """What composition over every trained model covers, given what the sampler saw."""
    attack = _attack_seen(tuning)
    if attack is None:
        return ""
    if attack:
        return ("Because the sampler adapted to an attack run on the training members, no "
                "composition bound covers the hyperparameters it chose, the models trained "
                "with them or the selection.")
    return ("For a person in the training set, composition over every trained model covers "
            "releasing them all and any choice made from validation accuracy (the recorded "
            "statement gives the bound); for a person in the validation set nothing does.")


# ---- fronts ------------------------------------------------------------------------------------
def _chance_halfwidth(points: pd.DataFrame) -> float:
    """Median upper half-width of the peak-MIA intervals: peaks inside 0.5 +- this are
    indistinguishable from guessing at the audit's sample size."""
    widths = (points[MIA_HI] - points[MIA]).to_numpy(dtype=float)
    widths = widths[np.isfinite(widths) & (widths > 0)]
    return float(np.median(widths)) if widths.size else math.nan


def _baseline(data: RunData) -> plots.Baseline | None:
    rows = data.ok[data.ok["method"] == NONPRIVATE]
    if rows.empty:
        return None
    row = rows.iloc[0]
    return plots.Baseline(val_accuracy=float(row[ACC]), test_accuracy=float(row["test_accuracy"]),
                          peak_mia=float(row[MIA]))


def _front_point_rows(front_list: Sequence[Front]) -> pd.DataFrame:
    """One row per (front, trial): the fronts CSV."""
    records = []
    for front in front_list:
        for position, (_, r) in enumerate(front.trials.iterrows()):
            records.append({
                "front": front.name, "kind": front.kind, "target_epsilon": front.target_epsilon,
                "position": position, "trial_id": r["trial_id"], "series": r["series"],
                ACC: r[ACC], ACC_LO: r[ACC_LO], ACC_HI: r[ACC_HI], MIA: r[MIA],
                MIA_LO: r[MIA_LO], MIA_HI: r[MIA_HI], "peak_layer": r["peak_layer"],
                "peak_attack": r["peak_attack"], "dp_valid": r["dp_valid"],
                "release_safe": r["release_safe"], "audit_contradicts": r["audit_contradicts"],
                "flags": flags_text(r)})
    return pd.DataFrame(records, columns=[
        "front", "kind", "target_epsilon", "position", "trial_id", "series", ACC, ACC_LO, ACC_HI,
        MIA, MIA_LO, MIA_HI, "peak_layer", "peak_attack", "dp_valid", "release_safe",
        "audit_contradicts", "flags"])


def _membership(front_list: Sequence[Front], target: float) -> dict[str, list[str]]:
    """trial id -> the fronts at ``target`` it is on ('all', 'valid', 'series')."""
    short = {KIND_ALL: "all", KIND_VALID: "valid", KIND_STUDY: "own"}
    out: dict[str, list[str]] = {}
    for front in front_list:
        if front.target_epsilon != target:
            continue
        for tid in front.trial_ids:
            out.setdefault(tid, []).append(short[front.kind])
    return out


def _front_table(data: RunData, rows: pd.DataFrame, membership: dict[str, list[str]]) -> str:
    headers = [_h("trial"), _h("series"), _h("DP validity"), _h("on fronts"),
               _h("validation accuracy [95%]", ACC),
               _h(f"test accuracy ({TEST_NOTE})", "test_accuracy"),
               _h("peak MIA accuracy [95%]", MIA),
               _h("peak at; leak (corrected p)", "peak_layer"), _h("sigma; eps ≤"),
               _h("hyperparameters")]
    body, classes = [], []
    for _, r in rows.iterrows():
        tid = r["trial_id"]
        leak = ("leak" if r["leak_detected"] else "no leak") + f" (p {_sci(r['leak_p_value'])})"
        phases = len(data.parsed[tid]["noise_schedule"])
        sigma = ("σ0 " if phases > 1 else "") + _num(r["noise_multiplier"], 3)
        body.append([
            _e(tid), _e(r["series"]), flags_html(r),
            _e(", ".join(membership.get(tid, []))),
            _ci(r[ACC], r[ACC_LO], r[ACC_HI]), _num(r["test_accuracy"], 3),
            _ci(r[MIA], r[MIA_LO], r[MIA_HI]),
            _e(f"{r['peak_layer'] or '—'} × {r['peak_attack'] or '—'}") + f"<br>{_e(leak)}",
            f"{_e(sigma)}; {_num(r['epsilon_upper'], 3)}",
            f'<span class="hp">{_hyperparameters(r, data.parsed[tid]["method_params"])}</span>'])
        classes.append("" if bool(r["dp_valid"]) and bool(r["release_safe"]) else "bad")
    return _table(headers, body, row_classes=classes, cls="fronttable")


def _front_section(data: RunData, *, front_list: Sequence[Front], pool: pd.DataFrame,
                   out: Path, csvs: dict[str, pd.DataFrame]) -> str:
    if pool.empty:
        return _note("No front: no finished, audited, non-degenerate DP trial (see "
                     "<a href=\"#excluded\">kept off the fronts</a>).")
    baseline = _baseline(data)
    parts = [
        "<p>Fronts of <b>validation accuracy</b> (what selection reads; higher is better) "
        "against <b>peak MIA accuracy</b> (the strongest attack over every layer and attack; "
        "lower is better). Error bars are 95% intervals: validation accuracy a Wilson interval "
        + (f"on the {data.info.validation_size:,} validation examples"
           if data.info.validation_size else
           "(none here: the validation size is recorded neither in config.toml, summary.json "
           "nor the trials' specs)")
        + ", peak MIA "
        "the audit's interval (upper end simultaneous over layers × attacks). "
        "<b>Ties:</b> a trial is dominated only when another is at least as good at both ends "
        "of its interval on both axes and better beyond the intervals on at least one; trials "
        "whose intervals overlap on both axes are ties and all stay on the front. The grey "
        "band is chance: peaks within 0.5 ± the median interval half-width cannot be told "
        "from guessing. Test accuracy is shown in the tables, "
        f"<b>{TEST_NOTE}</b>.</p>"]
    for target in data.info.targets:
        at = pool[pool["target_epsilon"] == target]
        here = [f for f in front_list if f.target_epsilon == target]
        if at.empty or not here:
            parts.append(f"<h3>ε = {target:g}</h3>" + _note("No eligible trial at this target."))
            continue
        overall = next(f for f in here if f.kind == KIND_ALL)
        study_fronts = {f.series: set(f.trial_ids) for f in here if f.kind == KIND_STUDY}
        deltas = sorted({float(d) for d in at["delta"] if math.isfinite(_float(d))})
        half = _chance_halfwidth(at)
        tag = _eps_tag(target)
        png = plots.front_plot(at, study_fronts=study_fronts, overall=overall.trials,
                               target_epsilon=target, delta=deltas[0] if deltas else math.nan,
                               chance_halfwidth=half, baseline=baseline,
                               path=out / f"front_{tag}.png")
        csvs[f"front_{tag}.csv"] = pd.DataFrame({
            "trial_id": at["trial_id"], "series": at["series"], ACC: at[ACC],
            ACC_LO: at[ACC_LO], ACC_HI: at[ACC_HI], MIA: at[MIA], MIA_LO: at[MIA_LO],
            MIA_HI: at[MIA_HI], "on_series_front": [t in study_fronts.get(s, set()) for t, s in
                                                    zip(at["trial_id"], at["series"],
                                                        strict=True)],
            "on_overall_front": at["trial_id"].isin(set(overall.trial_ids)),
            "dp_valid": at["dp_valid"], "release_safe": at["release_safe"],
            "chance_halfwidth": half}).reset_index(drop=True)
        membership = _membership(front_list, target)
        on_any = sort_trials(at[at["trial_id"].isin(set(membership))],
                             by=["series", ACC], ascending=[True, False])
        valid = next(f for f in here if f.kind == KIND_VALID)
        parts.append(
            f"<h3>ε = {target:g}</h3>"
            + _image(png, f"Pareto fronts at ε = {target:g}: validation accuracy vs peak MIA "
                          "accuracy, 95% intervals on both axes")
            + "<p>Colour = series; joined points with error bars = that series' front; faded "
              "points are dominated within their series; the wide grey staircase is the front "
              f"over all series; crosses: {INVALID_TAG}; hollow: {REPLAYABLE_TAG}; dashed "
              "line and star: the non-private baseline.</p>"
            + f"<p>Front over all series: <b>{_ids(overall.trial_ids)}</b>. Front over "
              f"valid-DP, release-safe trials: <b>{_ids(valid.trial_ids) or 'none'}</b>. "
              "In the table, <i>on fronts</i> says which fronts at this target hold the trial: "
              "<i>all</i> series, <i>valid</i> DP and release-safe, its <i>own</i> series.</p>"
            + _front_table(data, on_any, membership))
    return "\n".join(parts)


def _hypervolume_section(front_list: Sequence[Front], *, num_classes: int) -> str:
    if not front_list:
        return _note("No hypervolumes: no front.")
    rows = [[_e(f.name), _num(f.target_epsilon, 3), str(f.pool_size), str(len(f.trials)),
             _num(f.hypervolume), _ids(list(f.trial_ids))] for f in front_list]
    chance = 1.0 / num_classes
    return (f"<p>Area each front dominates on normalised axes: accuracy above chance "
            f"(val_acc − {chance:g}) / (1 − {chance:g}) and attack advantage 2 × peak MIA − 1, "
            f"both clipped to [0, 1], against the <b>reference point ({REFERENCE[0]:g}, "
            f"{REFERENCE[1]:g})</b>: no accuracy above chance, an attacker with advantage 1. "
            "Point estimates; 1 is a perfect classifier no attack beats chance on; larger is "
            "better.</p>"
            + _table([_h("front"), _h("target eps"), _h("trials in pool"), _h("front size"),
                      _h("hypervolume", ACC), _h("front trials")], rows))


def _excluded_section(excluded: pd.DataFrame) -> str:
    if excluded.empty:
        return "<p>Every trial is eligible for the fronts.</p>"
    rows = [[_e(r["trial_id"]), _e(r["series"] or "—"), _num(r["target_epsilon"], 3),
             _e(r["reason"])] for _, r in excluded.iterrows()]
    counts = excluded["reason"].map(lambda s: s.split(":")[0].split(" (")[0]).value_counts()
    lead = "; ".join(f"{n} {_e(k)}" for k, n in sorted(counts.items()))
    return (f"<p>Kept off every front and every pick ({lead}). Degenerate means validation "
            f"accuracy below chance + {DEGENERATE_MARGIN:g}: such a model has learned nothing "
            "and would sit on the front only because no attack beats a constant.</p>"
            + _table([_h("trial"), _h("series"), _h("target eps"), _h("reason")], rows))


# ---- leakage, heat maps, curves ---------------------------------------------------------------
def _leakage_frame(data: RunData) -> pd.DataFrame:
    """Per series: audited trials, those with a detected leak, the strongest one, and the
    (layer, attack) cells significant in any trial."""
    dp = data.dp
    audited = dp[np.isfinite(dp[MIA].to_numpy(dtype=float))]
    records = []
    for series in sorted(dp["series"].unique(), key=natural_key):
        rows = audited[audited["series"] == series]
        leaks = rows[rows["leak_detected"]]
        cells: dict[tuple[str, str], int] = {}
        for tid in rows["trial_id"]:
            for cell in data.parsed[tid]["mia_layers"]:
                if cell.get("significant") is True:
                    key = (str(cell.get("layer", "?")), str(cell.get("attack", "?")))
                    cells[key] = cells.get(key, 0) + 1
        strongest = (sort_trials(leaks, by=["leak_p_value", MIA], ascending=[True, False])
                     if len(leaks) else sort_trials(rows, by=["leak_p_value"], ascending=[True]))
        top = strongest.iloc[0] if len(strongest) else None
        records.append({
            "series": series, "audited": len(rows), "leaks": len(leaks),
            "strongest_trial": "" if top is None else top["trial_id"],
            "strongest_epsilon": math.nan if top is None else top["target_epsilon"],
            "peak_layer": "" if top is None else top["peak_layer"],
            "peak_attack": "" if top is None else top["peak_attack"],
            "peak_mia_accuracy": math.nan if top is None else top[MIA],
            "leak_p_value": math.nan if top is None else top["leak_p_value"],
            "significant_cells": "; ".join(f"{layer} × {attack} ({n})" for (layer, attack), n
                                           in sorted(cells.items(), key=lambda kv: (-kv[1],
                                                                                    kv[0])))})
    return pd.DataFrame(records, columns=[
        "series", "audited", "leaks", "strongest_trial", "strongest_epsilon", "peak_layer",
        "peak_attack", "peak_mia_accuracy", "leak_p_value", "significant_cells"])


def _leakage_section(leakage: pd.DataFrame) -> str:
    if leakage.empty:
        return _note("No DP trial finished.")
    items = []
    for _, r in leakage.iterrows():
        name = f"<b>{_e(r['series'])}</b>"
        if r["audited"] == 0:
            items.append(f"<li>{name}: no trial was audited, so nothing can be said about "
                         "leakage.</li>")
        elif r["leaks"]:
            items.append(
                f"<li>{name}: <b>leakage detected</b> in {r['leaks']} of "
                f"{_count(int(r['audited']), 'audited trial')}; strongest in "
                f"{_e(r['strongest_trial'])} (ε = {_float(r['strongest_epsilon']):g}) at layer "
                f"<b>{_e(r['peak_layer'])}</b>, attack <b>{_e(r['peak_attack'])}</b> (accuracy "
                f"{_num(r['peak_mia_accuracy'], 3)}, corrected p = {_sci(r['leak_p_value'])})"
                + (f"; significant layer × attack cells: {_e(r['significant_cells'])}"
                   if r["significant_cells"] else "") + ".</li>")
        else:
            items.append(
                f"<li>{name}: no leakage detected in any of "
                f"{_count(int(r['audited']), 'audited trial')} (smallest corrected p-value "
                f"{_sci(r['leak_p_value'])}, {_e(r['strongest_trial'])} at "
                f"{_e(r['peak_layer'])} × {_e(r['peak_attack'])}). Not detecting a leak at this "
                "sample size is not proof that none exists.</li>")
    return ("<p>A leak is detected when the peak attack's p-value, corrected for the number "
            f"of layers × attacks tested, is below the audit's alpha ({NOT_COVERED_TAG}).</p>"
            f"<ul>{''.join(items)}</ul>")


def _layer_sort(cell: dict[str, Any]) -> tuple[int, int]:
    index = _float(cell.get("index"))
    index = int(index) if math.isfinite(index) else 0
    return (1, 0) if index < 0 else (0, index)  # the output / loss (-1) last


def heat_columns(cell_lists: Iterable[list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(layer, attack) columns: layers from input to output (the output last), attacks in the
    order the audit lists them."""
    layer_keys: dict[str, tuple[int, int]] = {}
    attacks: list[str] = []
    for cells in cell_lists:
        for cell in cells:
            layer = str(cell.get("layer", "?"))
            layer_keys.setdefault(layer, _layer_sort(cell))
            attack = str(cell.get("attack", "?"))
            if attack not in attacks:
                attacks.append(attack)
    present = {(str(c.get("layer", "?")), str(c.get("attack", "?")))
               for cells in cell_lists for c in cells}
    layers = sorted(layer_keys, key=lambda name: (layer_keys[name], name))
    return [(layer, attack) for layer in layers for attack in attacks
            if (layer, attack) in present]


def _chosen(front_list: Sequence[Front], target: float) -> pd.DataFrame:
    """Trials on any front at ``target``: the overall front first, then by series."""
    here = [f for f in front_list if f.target_epsilon == target]
    overall = next((f for f in here if f.kind == KIND_ALL), None)
    frames = [f.trials for f in here if not f.trials.empty]
    if not frames:
        return pd.DataFrame()
    union = pd.concat(frames).drop_duplicates("trial_id")
    first = set(overall.trial_ids) if overall is not None else set()
    union = union.assign(_rank=[0 if t in first else 1 for t in union["trial_id"]])
    return sort_trials(union, by=["_rank", "series", ACC], ascending=[True, True, False]
                       ).drop(columns="_rank")


def _heatmap_section(data: RunData, *, front_list: Sequence[Front], out: Path,
                     csvs: dict[str, pd.DataFrame]) -> str:
    parts = []
    for target in data.info.targets:
        chosen = _chosen(front_list, target)
        if chosen.empty:
            continue
        lists = [data.parsed[tid]["mia_layers"] for tid in chosen["trial_id"]]
        columns = heat_columns(lists)
        if not columns:
            continue
        rows, records = [], []
        for (_, r), cells in zip(chosen.iterrows(), lists, strict=True):
            rows.append(plots.HeatRow(
                label=f"{r['trial_id']} · {r['series']}",
                cells={(str(c.get("layer", "?")), str(c.get("attack", "?"))):
                       (_float(c.get("accuracy")), c.get("significant") is True) for c in cells},
                peak=(r["peak_layer"], r["peak_attack"])))
            records += [{"trial_id": r["trial_id"], "series": r["series"],
                         "layer": c.get("layer"), "index": c.get("index"),
                         "attack": c.get("attack"), "accuracy": _float(c.get("accuracy")),
                         "significant": c.get("significant") is True,
                         "p_value": _float(c.get("p_value"))} for c in cells]
        tag = _eps_tag(target)
        png = plots.mia_heatmap(rows, columns=columns,
                                title=f"Attack accuracy per layer × attack, front trials at "
                                      f"ε = {target:g}", path=out / f"mia_heatmap_{tag}.png")
        csvs[f"mia_heatmap_{tag}.csv"] = pd.DataFrame(records)
        more = len(rows) - plots.MAX_HEAT_ROWS
        parts.append(f"<h3>ε = {target:g}</h3>"
                     + _image(png, f"Per-layer × attack MIA accuracy of the front trials at "
                                   f"ε = {target:g}")
                     + (_note(f"{more} more front trials in the CSV.") if more > 0 else ""))
    if not parts:
        return _note("No heat map: no front trial has per-layer MIA results.")
    return ("<p>Rows: trials on a front at that target; columns: layers from input to output "
            "(the output last), each with its attacks; colour centred on 0.5 (chance): red = "
            "the attack beats guessing, blue = below it. Faded cells with grey values are not "
            "significant after correction for the number of layers × attacks (n.s.); bold "
            "values with * are significant; the black box is the trial's peak. Per-cell "
            "intervals, AUC and TPR at low FPR are in <code>mia_layers.csv</code>.</p>"
            + "\n".join(parts))


@dataclass(frozen=True)
class Records:
    """The per-trial files the figures need, read and validated before anything is drawn."""

    histories: dict[str, list[dict[str, Any]]]
    audits: dict[str, Any]


def read_records(data: RunData, *, trial_ids: Iterable[str]) -> Records:
    """history.json and audit.json of the given trials (absent files are left out: the report
    notes them; corrupt ones are one UserInputError)."""
    rows = data.frame.set_index("trial_id", drop=False)
    histories: dict[str, list[dict[str, Any]]] = {}
    audits: dict[str, Any] = {}
    for tid in sorted(set(trial_ids), key=natural_key):
        row = rows.loc[tid]
        path = _trial_file(data.run_dir, row, HISTORY_FILE)
        if path is not None:
            history = _read_json_file(path, what="history")
            if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
                raise UserInputError(field="history", value=str(path),
                                     allowed="a JSON list of per-epoch objects")
            histories[tid] = history
        path = _trial_file(data.run_dir, row, AUDIT_FILE)
        if path is not None:
            audits[tid] = _read_json_file(path, what="audit")
    return Records(histories=histories, audits=audits)


def _curves_section(data: RunData, *, front_list: Sequence[Front], records: Records,
                    out: Path, csvs: dict[str, pd.DataFrame]) -> str:
    parts, missing = [], []
    baseline = _baseline(data)
    for target in data.info.targets:
        chosen = _chosen(front_list, target)
        curves, rows = [], []
        for _, r in chosen.iterrows():
            history = records.histories.get(r["trial_id"])
            if not history:
                missing.append(str(r["trial_id"]))
                continue
            epochs = [_float(h.get("epoch")) for h in history]
            values = [_float(h.get("val_accuracy")) for h in history]
            curves.append(plots.Curve(label=f"{r['trial_id']} · {r['series']}",
                                      series=r["series"], epochs=tuple(epochs),
                                      values=tuple(values)))
            for h, e, v in zip(history, epochs, values, strict=True):
                rows.append({"trial_id": r["trial_id"], "series": r["series"], "epoch": e,
                             "val_accuracy": v, "epsilon_spent": _float(h.get("epsilon_spent"))})
        if not curves:
            continue
        tag = _eps_tag(target)
        png = plots.validation_curves(
            curves[:MAX_CURVES], title=f"Validation accuracy per epoch, front trials at "
                                       f"ε = {target:g}",
            baseline=baseline.val_accuracy if baseline else math.nan,
            path=out / f"validation_curves_{tag}.png")
        csvs[f"validation_curves_{tag}.csv"] = pd.DataFrame(rows)
        parts.append(f"<h3>ε = {target:g}</h3>"
                     + _image(png, f"Validation accuracy per epoch of the front trials at "
                                   f"ε = {target:g}"))
    text = "\n".join(parts) or _note("No validation curves: no front trial has a history.")
    if missing:
        text += _note(f"No {HISTORY_FILE} for: {_ids(sorted(set(missing), key=natural_key))}.")
    return text


# ---- privacy-utility -------------------------------------------------------------------------
def utility_frame(data: RunData) -> pd.DataFrame:
    """Per series and target: the best configuration (highest validation accuracy among the
    non-degenerate first runs) and its re-runs with fresh noise, mean and sd of validation
    accuracy, test accuracy and peak MIA."""
    dp = data.dp
    firsts = dp[(dp["repeat_of"] == "") & ~dp["degenerate"]
                & np.isfinite(dp[ACC].to_numpy(dtype=float))]
    records = []
    for (series, target), rows in firsts.groupby(["series", "target_epsilon"], sort=True):
        best = sort_trials(rows, by=[ACC], ascending=[False]).iloc[0]
        group = pd.concat([rows[rows["trial_id"] == best["trial_id"]],
                           dp[dp["repeat_of"] == best["trial_id"]]])

        def stats(column: str, group: pd.DataFrame = group) -> tuple[float, float]:
            values = group[column].to_numpy(dtype=float)
            values = values[np.isfinite(values)]
            if values.size == 0:
                return math.nan, math.nan
            return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0

        val, test, mia = stats(ACC), stats("test_accuracy"), stats(MIA)
        records.append({"series": series, "target_epsilon": float(target),
                        "best_trial": best["trial_id"],
                        "runs": len(group), "trials": " ".join(group["trial_id"]),
                        "val_mean": val[0], "val_sd": val[1], "test_mean": test[0],
                        "test_sd": test[1], "mia_mean": mia[0], "mia_sd": mia[1]})
    return pd.DataFrame(records, columns=[
        "series", "target_epsilon", "best_trial", "runs", "trials", "val_mean", "val_sd",
        "test_mean", "test_sd", "mia_mean", "mia_sd"])


def _utility_section(data: RunData, utility: pd.DataFrame, *, out: Path,
                     csvs: dict[str, pd.DataFrame]) -> str:
    if utility["target_epsilon"].nunique() < 2:
        return _note("Results at fewer than two target epsilons: privacy-utility curves need "
                     "several (<code>[budget] epsilons</code>).")
    baseline = _baseline(data)
    series = []
    for name, rows in utility.groupby("series", sort=True):
        rows = rows.sort_values("target_epsilon")
        series.append(plots.UtilitySeries(
            series=str(name), epsilons=tuple(rows["target_epsilon"]),
            val_mean=tuple(rows["val_mean"]), val_sd=tuple(rows["val_sd"]),
            test_mean=tuple(rows["test_mean"]), test_sd=tuple(rows["test_sd"]),
            mia_mean=tuple(rows["mia_mean"]), mia_sd=tuple(rows["mia_sd"])))
    png = plots.privacy_utility(series, baseline=baseline, path=out / "privacy_utility.png")
    csvs["privacy_utility.csv"] = utility
    def mean_sd(r: pd.Series, key: str) -> str:
        sd = f" ± {_num(r[f'{key}_sd'], 3)}" if r["runs"] > 1 else ""
        return _num(r[f"{key}_mean"], 3) + sd

    rows = [[_e(r["series"]), _num(r["target_epsilon"], 3), _e(r["best_trial"]),
             _e(r["trials"].replace(" ", ", ")), mean_sd(r, "val"), mean_sd(r, "test"),
             mean_sd(r, "mia")] for _, r in utility.iterrows()]
    base = ("" if baseline is None else
            f" Non-private baseline: validation {_num(baseline.val_accuracy, 3)}, test "
            f"{_num(baseline.test_accuracy, 3)}, peak MIA {_num(baseline.peak_mia, 3)}.")
    return (_image(png, "Privacy-utility: accuracy and peak MIA vs target epsilon")
            + "<p>Per series and target: the best configuration by validation accuracy and its "
              "re-runs with fresh noise; mean ± sd over those runs (the value alone with one "
              "run)."
            + base + "</p>"
            + _table([_h("series"), _h("target eps"), _h("best trial"), _h("runs (trials)"),
                      _h("validation accuracy", ACC),
                      _h(f"test accuracy ({TEST_NOTE})", "test_accuracy"),
                      _h("peak MIA accuracy", MIA)], rows))


# ---- canaries, ROC, WW -----------------------------------------------------------------------
def canary_frame(data: RunData) -> pd.DataFrame:
    dp = data.dp
    rows = dp[np.isfinite(dp["eps_lower_bound"].to_numpy(dtype=float))
              | (dp["canaries"].fillna(-1) > 0)]
    return pd.DataFrame({
        "trial_id": rows["trial_id"], "series": rows["series"],
        "target_epsilon": rows["target_epsilon"], "eps_lower_bound": rows["eps_lower_bound"],
        "kind": rows["eps_lower_bound_kind"], "canaries": rows["canaries"],
        "claimed_epsilon": rows["epsilon_upper"], "dp_valid": rows["dp_valid"],
        "audit_contradicts": rows["audit_contradicts"],
        "flags": [flags_text(r) for _, r in rows.iterrows()]}).reset_index(drop=True)


def _canary_section(canary: pd.DataFrame) -> str:
    if canary.empty:
        return ("<p>No canary audit has run. <code>dpsweep audit RUN_DIR --trial T</code> "
                "trains with m canaries and turns how well they are guessed into an empirical "
                "95% lower bound on epsilon.</p>")
    rows, classes = [], []
    for _, r in canary.iterrows():
        rows.append([_e(r["trial_id"]), _e(r["series"]), _num(r["target_epsilon"], 3),
                     _num(r["eps_lower_bound"], 3), _e(r["kind"] or "—"), _int(r["canaries"]),
                     _num(r["claimed_epsilon"], 3),
                     _badge(CONTRADICTED_TAG) if r["audit_contradicts"] else "no",
                     flags_html(r)])
        classes.append("bad" if r["audit_contradicts"] else "")
    contradicted = int(canary["audit_contradicts"].sum())
    lead = (f"<p><b>{contradicted}</b> claim(s) contradicted: the empirical lower bound exceeds "
            "the claimed epsilon, so that claim cannot hold.</p>" if contradicted else
            "<p>No claimed epsilon is contradicted by its canary audit (a lower bound below "
            "the claim is consistent with it, not a proof of it).</p>")
    return lead + _table([_h("trial"), _h("series"), _h("target eps"),
                          _h("epsilon lower bound (95%)", "eps_lower_bound"), _h("kind"),
                          _h("canaries m"), _h("claimed epsilon"), _h(CONTRADICTED_TAG),
                          _h("DP validity")], rows, row_classes=classes)


def _curve(entry: Any) -> tuple[list[float], list[float]] | None:
    if not isinstance(entry, dict):
        return None
    source = entry.get("roc") if isinstance(entry.get("roc"), dict) else entry
    for fkey, tkey in (("roc_fpr", "roc_tpr"), ("fpr", "tpr")):
        fpr, tpr = source.get(fkey), source.get(tkey)
        if isinstance(fpr, list) and isinstance(tpr, list) and len(fpr) == len(tpr) and fpr:
            return [_float(v) for v in fpr], [_float(v) for v in tpr]
    return None


def roc_by_cell(document: Any) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """ROC points per (layer, attack) from an audit.json: its ``attacks`` list (older files:
    ``layers`` with ``name``; the attack is then '')."""
    found: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    if not isinstance(document, dict):
        return found
    for key in ("attacks", "layers"):
        entries = document.get(key)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            curve = _curve(entry)
            if curve is None:
                continue
            layer = entry.get("layer", entry.get("name"))
            found.setdefault((str(layer), str(entry.get("attack", ""))), curve)
    return found


def _roc_section(data: RunData, *, front_list: Sequence[Front], records: Records, out: Path,
                 csvs: dict[str, pd.DataFrame]) -> str:
    curves, rows, missing = [], [], []
    targets = []
    for front in front_list:
        if front.kind != KIND_ALL:
            continue
        for _, r in front.trials.iterrows():
            document = records.audits.get(r["trial_id"])
            if document is None:
                missing.append(f"{r['trial_id']} (no {AUDIT_FILE})")
                continue
            cells = roc_by_cell(document)
            curve = cells.get((r["peak_layer"], r["peak_attack"])) or cells.get(
                (r["peak_layer"], ""))
            if curve is None:
                missing.append(f"{r['trial_id']} (no ROC points for {r['peak_layer']} × "
                               f"{r['peak_attack']})")
                continue
            targets.append(front.target_epsilon)
            curves.append(plots.RocCurve(
                label=f"{r['trial_id']} · ε {front.target_epsilon:g} · {r['series']} · "
                      f"{r['peak_layer']} × {r['peak_attack']}",
                fpr=tuple(curve[0]), tpr=tuple(curve[1])))
            rows += [{"trial_id": r["trial_id"], "target_epsilon": front.target_epsilon,
                      "fpr": f, "tpr": t} for f, t in zip(*curve, strict=True)]
    text = ""
    if curves:
        png = plots.roc_plot(curves, title=f"ROC at the peak layer × attack, front over all "
                                           f"series, {plots.eps_text(targets)}",
                             path=out / "roc.png")
        csvs["roc.csv"] = pd.DataFrame(rows)
        text = (_image(png, "ROC of the peak layer × attack for the trials on the front over "
                            "all series (log-log)")
                + "<p>The true positive rate at 1% and 0.1% false positive rate (grey lines) is "
                  "the headline number for strong attacks; per cell in "
                  "<code>mia_layers.csv</code>.</p>")
    else:
        text = _note("No ROC: no front trial has ROC points.")
    if missing:
        text += _note("No ROC drawn for: " + _e("; ".join(missing)) + ".")
    return text + _reference_note(front_list, records)


def _reference_note(front_list: Sequence[Front], records: Records) -> str:
    """What the front trials' audits say about their reference models when those deviate
    from the target (e.g. offline references on a small shadow pool), with how much weaker
    they are: a weak reference weakens every calibrated attack number above."""
    notes: dict[str, list[tuple[float, float]]] = {}
    for front in front_list:
        if front.kind != KIND_ALL:
            continue
        for _, r in front.trials.iterrows():
            document = records.audits.get(r["trial_id"]) or {}
            note = document.get("note")
            refs = [_float(x.get("test_accuracy")) for x in document.get("references", [])
                    if isinstance(x, dict)]
            if isinstance(note, str) and note and refs:
                notes.setdefault(note, []).append((float(np.nanmean(refs)),
                                                   _float(r.get("test_accuracy"))))
    out = []
    for note, pairs in notes.items():
        ref, own = (float(np.nanmean([p[i] for p in pairs])) for i in (0, 1))
        weaker = (" References weaker than the audited model make the calibrated attacks "
                  "weaker: these attack numbers understate what an audit with references "
                  "like the target would find." if ref < own - REFERENCE_GAP else "")
        out.append(_note(_e(f"Reference models: {note}. Their mean test accuracy is {ref:.2f}, "
                            f"the audited models' {own:.2f}.{weaker}")))
    return "".join(out)


def _series_values(traj: dict[str, Any], keys: Sequence[str]) -> tuple[float, ...]:
    for key in keys:
        values = traj.get(key)
        if isinstance(values, list) and values:
            return tuple(_float(v) for v in values)
    return ()


def _ww_section(data: RunData, *, out: Path, csvs: dict[str, pd.DataFrame]) -> str:
    ww = data.dp[data.dp["method"] == "ww_dpsgd"]
    trajs, rows, records = [], [], []
    for _, r in ww.iterrows():
        traj = data.parsed[r["trial_id"]]["trajectories"]
        params = data.parsed[r["trial_id"]]["method_params"]
        clip = _series_values(traj, ("clip_norm", "C_t", "C"))
        zeta_hat = _series_values(traj, ("zeta_hat", "zeta_ema"))
        if not clip and not zeta_hat:
            continue
        n = max(len(clip), len(zeta_hat))
        steps = _series_values(traj, ("step", "steps")) or tuple(float(i + 1) for i in range(n))
        c0 = float(r["clip_norm"])
        if clip and math.isfinite(c0) and len(steps) >= len(clip):
            c_steps, clip_line = (0.0, *steps[:len(clip)]), (c0, *clip)  # C_0 until the probe
        else:
            c_steps, clip_line = steps, clip
        zeta = _series_values(traj, ("zeta",))
        trajs.append(plots.Trajectory(
            label=f"{r['trial_id']} (ε {r['target_epsilon']:g})", steps=steps,
            clip_steps=c_steps, clip_norm=clip_line, zeta_hat=zeta_hat, zeta=zeta,
            zeta_star=_float(params.get("zeta_star")), radius=_float(params.get("radius"))))
        for k in range(n):
            records.append({"trial_id": r["trial_id"], "target_epsilon": r["target_epsilon"],
                            "step": steps[k] if k < len(steps) else math.nan,
                            "clip_norm": clip[k] if k < len(clip) else math.nan,
                            "zeta_hat": zeta_hat[k] if k < len(zeta_hat) else math.nan,
                            "zeta": zeta[k] if k < len(zeta) else math.nan})
        clamp = _series_values(traj, ("clamp",))
        rows.append([_e(r["trial_id"]), _num(r["target_epsilon"], 3), str(n),
                     _num(r["clip_norm"]), _num(clip[-1]) if clip else "—",
                     f"{_num(min(clip))} – {_num(max(clip))}" if clip else "—",
                     _num(zeta_hat[-1], 3) if zeta_hat else "—",
                     str(sum(1 for c in clamp if c and c == c)) if clamp else "—"])
    if not trajs:
        return _note("No WW-DP-SGD trajectories (no finished ww_dpsgd trial logged C_t).")
    targets = [t for t in data.info.targets if t in set(ww["target_epsilon"])]
    png = plots.ww_trajectories(trajs, title=f"WW-DP-SGD, {plots.eps_text(targets)}",
                                path=out / "ww_trajectories.png")
    csvs["ww_trajectories.csv"] = pd.DataFrame(records)
    return (_image(png, "WW-DP-SGD clipping norm and tail exponent trajectories", covered=True)
            + "<p>Computed from the released noisy updates (post-processing): covered by "
              "epsilon.</p>"
            + _table([_h("trial"), _h("target eps"), _h("probes"), _h("C_0"), _h("final C"),
                      _h("C range"), _h("final zeta^"), _h("clamp hits")], rows))


# ---- budget, validity, failures ----------------------------------------------------------------
def budget_frame(data: RunData) -> pd.DataFrame:
    """The budget-matching table, one row per finished DP trial."""
    records = []
    for _, r in data.dp.iterrows():
        schedule = data.parsed[r["trial_id"]]["noise_schedule"]
        records.append({
            "trial_id": r["trial_id"], "series": r["series"], "method": r["method"],
            "mode": r["mode"], "noise_multiplier": r["noise_multiplier"],
            "schedule": schedule_text(sigma=r["noise_multiplier"], schedule=schedule),
            "phases": len(schedule), "sample_rate": r["sample_rate"], "steps": r["steps"],
            "delta": r["delta"], "target_epsilon": r["target_epsilon"],
            "epsilon_lower": r["epsilon_lower"], "epsilon_estimate": r["epsilon_estimate"],
            "epsilon_upper": r["epsilon_upper"], "accountant": r["accountant"],
            "accountant_fallback": r["accountant_fallback"], "dp_valid": r["dp_valid"],
            "release_safe": r["release_safe"], "audit_contradicts": r["audit_contradicts"],
            "flags": flags_text(r)})
    return pd.DataFrame(records, columns=[
        "trial_id", "series", "method", "mode", "noise_multiplier", "schedule", "phases",
        "sample_rate", "steps", "delta", "target_epsilon", "epsilon_lower", "epsilon_estimate",
        "epsilon_upper", "accountant", "accountant_fallback", "dp_valid", "release_safe",
        "audit_contradicts", "flags"])


def _budget_section(budget: pd.DataFrame) -> str:
    if budget.empty:
        return _note("No finished DP trial: nothing was budgeted.")
    rows = [[_e(r["trial_id"]), _e(r["series"]), _e(r["schedule"]), _sci(r["sample_rate"]),
             _int(r["steps"]), _sci(r["delta"]), _num(r["target_epsilon"], 3),
             _num(r["epsilon_lower"]), _num(r["epsilon_estimate"]), _num(r["epsilon_upper"]),
             _e(r["accountant"]), _e(r["accountant_fallback"] or "—"), flags_html(r)]
            for _, r in budget.iterrows()]
    return ("<p>Every trial is held to its target: the noise multiplier (sigma, or sigma_0 of a "
            "decaying schedule) is chosen so that the accountant's <b>upper</b> epsilon bound "
            "is at most the target. The lower bound and the estimate show how tight the claim "
            "is; RDP (the fallback) gives only an upper bound.</p>"
            + _table([_h("trial"), _h("series"), _h("sigma / schedule"), _h("q"), _h("steps"),
                      _h("delta"), _h("target eps"), _h("eps lower"), _h("eps estimate"),
                      _h("eps upper"), _h("accountant"), _h("fallback"), _h("DP validity")],
                     rows))


def validity_frame(data: RunData) -> pd.DataFrame:
    dp = data.dp
    return pd.DataFrame({
        "trial_id": dp["trial_id"], "series": dp["series"], "method": dp["method"],
        "mode": dp["mode"], "dp_valid": dp["dp_valid"], "validity_reason": dp["validity_reason"],
        "randomness": dp["randomness"], "release_safe": dp["release_safe"],
        "audit_contradicts": dp["audit_contradicts"],
        "flags": [flags_text(r) for _, r in dp.iterrows()]}).reset_index(drop=True)


def _validity_section(validity: pd.DataFrame) -> str:
    if validity.empty:
        return _note("No finished DP trial.")
    groups = validity.groupby(["series", "dp_valid", "validity_reason"], sort=True, dropna=False)
    rows, classes = [], []
    for (series, valid, reason), group in groups:
        ids = list(group["trial_id"])
        flags = ["valid" if valid else _badge(INVALID_TAG)]
        for mask, tag, kind in ((group["audit_contradicts"], CONTRADICTED_TAG, "invalid"),
                                (~group["release_safe"], REPLAYABLE_TAG, "replay")):
            if mask.any():
                flags.append(_badge(f"{tag}: {', '.join(group['trial_id'][mask])}", kind))
        rows.append([_e(series), " ".join(flags), str(len(ids)), _e(reason or "—"), _ids(ids)])
        classes.append("" if valid else "bad")
    invalid = int((~validity["dp_valid"]).sum())
    contradicted = validity[validity["audit_contradicts"]]
    replayable = validity[~validity["release_safe"]]
    lead = (f"<p>Finished trials flagged {_badge(INVALID_TAG)}: <b>{invalid}</b> of "
            f"{len(validity)}. They follow a paper's algorithm whose privacy argument does not "
            "hold (a statistic computed from private data without noise), so their epsilon is "
            "not a guarantee. <code>dpsweep pick</code> refuses them unless given "
            "<code>--allow-invalid-dp</code>.</p>" if invalid else
            "<p>Every finished trial's epsilon claim holds by construction.</p>")
    lead += (f"<p>{_badge(CONTRADICTED_TAG)}: <b>{len(contradicted)}</b> trial(s) "
             f"({_ids(list(contradicted['trial_id']))}): a canary audit's lower bound exceeds "
             "the claimed epsilon.</p>" if len(contradicted) else
             "<p>No claim is contradicted by a canary audit.</p>")
    table = _table([_h("series"), _h("DP validity"), _h("trials"), _h("reason"),
                    _h("trial ids")], rows, row_classes=classes)
    if len(replayable):
        release = (f"<p>{_badge(REPLAYABLE_TAG, 'replay')}: <b>{len(replayable)}</b> trial(s) "
                   f"({_ids(list(replayable['trial_id']))}) ran with "
                   "<code>reproducible = true</code>: their noise and sampling are seeded, so "
                   "anyone with the seed can replay and subtract the noise; no epsilon holds "
                   "for their release. <code>pick</code> and <code>export</code> refuse them "
                   "unless given <code>--allow-replayable</code>.</p>")
    else:
        sources = ", ".join(sorted(set(validity["randomness"]) - {""})) or "—"
        release = (f"<p>Release safety: every finished trial drew its noise from a secret "
                   f"source ({_e(sources)}); none is replayable.</p>")
    return lead + table + "<h3>Release safety</h3>" + release


def failed_frame(data: RunData) -> pd.DataFrame:
    """Trials that failed in training, and finished trials whose audit failed."""
    frame = data.frame
    bad = frame[frame["status"] != "ok"]
    out = pd.DataFrame({"trial_id": bad["trial_id"], "series": bad["series"],
                        "stage": "training", "error": bad["error"]})
    audit_bad = frame[(frame["status"] == "ok") & (frame[AUDIT_ERROR] != "")]
    out = pd.concat([out, pd.DataFrame({
        "trial_id": audit_bad["trial_id"], "series": audit_bad["series"], "stage": "audit",
        "error": audit_bad[AUDIT_ERROR]})])
    return sort_trials(out).reset_index(drop=True)


def _failed_section(failed: pd.DataFrame) -> str:
    if failed.empty:
        return "<p>No trial failed.</p>"
    rows = [[_e(r["trial_id"]), _e(r["series"]), _e(r["stage"]),
             _e(r["error"] or "(no reason recorded)")] for _, r in failed.iterrows()]
    training = int((failed["stage"] == "training").sum())
    audit = len(failed) - training
    return (f"<p>{_count(training, 'trial')} failed in training; the sweep went on without "
            "them." + (f" {_count(audit, 'finished trial')} could not be audited." if audit
                       else "") + "</p>"
            + _table([_h("trial"), _h("series"), _h("stage"), _h("reason")], rows))


def mia_layers_frame(data: RunData) -> pd.DataFrame:
    """Long table: one row per (trial, layer, attack), every scalar the audit stored (intervals
    split into _lo / _hi)."""
    records = []
    for _, r in data.ok.iterrows():
        for cell in data.parsed[r["trial_id"]]["mia_layers"]:
            flat: dict[str, Any] = {}
            for k, v in cell.items():
                if isinstance(v, list) and len(v) == 2 and k.endswith("_ci"):
                    flat[f"{k}_lo"], flat[f"{k}_hi"] = _float(v[0]), _float(v[1])
                elif isinstance(v, (int, float, str, bool)) or v is None:
                    flat[k] = v
            records.append({"trial_id": r["trial_id"], "series": r["series"], **flat})
    if not records:
        return pd.DataFrame(columns=["trial_id", "series", "layer", "attack", "accuracy"])
    frame = pd.DataFrame(records)
    fixed = ["trial_id", "series"]
    return frame[fixed + sorted(c for c in frame.columns if c not in fixed)]


def _coverage_section() -> str:
    rows = [[f"<code>{_e(name)}</code>", "covered" if column.covered else
             f'<span class="nc">{NOT_COVERED_TAG}</span>', _e(column.meaning)]
            for name, column in COLUMNS.items()]
    return ("<p>Which values the trials' epsilon covers. Values computed on private data "
            "without noise (validation and test metrics, every audit number) are not covered: "
            f"they carry <span class=\"nc\">{NOT_COVERED_TAG}</span> wherever they appear, stay "
            "in the run directory and are never exported.</p>"
            "<details><summary>Every results column</summary>"
            + _table([_h("column"), _h("epsilon"), _h("meaning")], rows) + "</details>")


def _trials_frame(data: RunData, front_list: Sequence[Front], pool: pd.DataFrame
                  ) -> pd.DataFrame:
    frame = data.frame.copy()
    frame["excluded_because"] = exclusion_reasons(frame).to_numpy()
    on_all = {t for f in front_list if f.kind == KIND_ALL for t in f.trial_ids}
    on_valid = {t for f in front_list if f.kind == KIND_VALID for t in f.trial_ids}
    on_study = {t for f in front_list if f.kind == KIND_STUDY for t in f.trial_ids}
    frame["on_front_all_series"] = frame["trial_id"].isin(on_all)
    frame["on_front_valid"] = frame["trial_id"].isin(on_valid)
    frame["on_front_series"] = frame["trial_id"].isin(on_study)
    bounds = pool.set_index("trial_id")[[ACC_LO, ACC_HI, MIA_LO, MIA_HI]]
    frame = frame.join(bounds, on="trial_id")
    frame["flags"] = [flags_text(r) for _, r in frame.iterrows()]
    return frame


# ---- the page ----------------------------------------------------------------------------------
_CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;margin:20px auto;max-width:1320px;
color:#222;line-height:1.45;padding:0 18px}
h1{font-size:1.55em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;
margin-top:1.8em}h3{margin-bottom:.3em}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;margin:.6em 0;font-size:.84em}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600}table.facts th{white-space:nowrap;width:16em}
tbody tr:nth-child(even){background:#fafafa}
tr.bad{background:#fff0f0 !important}
.invalid{color:#fff;background:#b00020;border-radius:3px;padding:0 4px;font-size:.9em;
white-space:nowrap}
.replay{color:#5a3d00;background:#ffd27a;border-radius:3px;padding:0 4px;font-size:.9em;
white-space:nowrap}
.nc{color:#b00020;font-size:.78em;font-weight:normal;white-space:nowrap}
.ci{color:#666;font-size:.9em;white-space:nowrap}
.note{background:#fff8e1;border-left:4px solid #f0b400;padding:6px 10px}
.stamp{color:#777;font-size:.85em;margin-top:0}
.privacy{background:#eef4ff;border-left:4px solid #2a5db0;padding:4px 14px}
figure{margin:.6em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#555;font-size:.85em}
nav{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #eee;
z-index:1;font-size:.9em}nav a{margin-right:11px;white-space:nowrap}
code{background:#f3f3f3;padding:0 3px}
details summary{cursor:pointer;color:#2a5db0}
.hp{display:inline-block;min-width:14em;max-width:22em;font-size:.86em;color:#333}
table.fronttable td:nth-child(4){white-space:nowrap}
ul.files{columns:4 14em;padding-left:1.2em}
"""

_SECTIONS = (("run", "Run"), ("tuning", "Privacy cost of tuning"),
             ("fronts", "Pareto fronts"), ("hypervolume", "Hypervolume"),
             ("excluded", "Kept off the fronts"), ("leakage", "Leakage per series"),
             ("heatmap", "Per-layer × attack MIA"), ("curves", "Validation curves"),
             ("utility", "Privacy-utility"), ("canary", "Epsilon lower bounds"),
             ("roc", "ROC"), ("ww", "WW-DP-SGD trajectories"), ("budget", "Privacy budget"),
             ("validity", "DP validity and release safety"), ("failed", "Failed trials"),
             ("coverage", "What epsilon covers"), ("files", "Files"))


def _page(*, title: str, stamp: str, sections: dict[str, str]) -> str:
    nav = " ".join(f'<a href="#{key}">{_e(name)}</a>' for key, name in _SECTIONS)
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{_e(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{_e(title)}</h1>", f'<p class="{STAMP_CLASS}">{_e(stamp)}</p>',
             f"<nav>{nav}</nav>"]
    for key, name in _SECTIONS:
        cls = ' class="privacy"' if key == "tuning" else ""
        parts.append(f'<section id="{key}"{cls}><h2>{_e(name)}</h2>\n{sections[key]}\n'
                     "</section>")
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _write_csv(frame: pd.DataFrame, path: Path) -> Path:
    return atomic_write_text(path, frame.to_csv(index=False, lineterminator="\n"))


def build_report(run_dir: Path, *, num_classes: int | None = None) -> Path:
    """Build ``run_dir/report/`` (HTML, PNGs, CSVs) from the run's files; return the HTML.

    Everything is read and validated first; the report is assembled in a temporary sibling
    directory and swapped in at the end, so bad input writes nothing and a failed build never
    leaves a half-written report or stale figures. ``num_classes`` overrides the dataset's.
    """
    data = load_run(Path(run_dir), num_classes=num_classes)
    run = data.run_dir
    final = run / REPORT_DIR
    work = run / f".{REPORT_DIR}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _build_into(data, out=work)
        old = run / f".{REPORT_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(work, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final / HTML_FILE


def _build_into(data: RunData, *, out: Path) -> None:
    info = data.info
    pool = eligible(data.frame, validation_size=info.validation_size)
    front_list = fronts(data.frame, validation_size=info.validation_size,
                        num_classes=info.num_classes)
    excluded = exclusions(data.frame)
    records = read_records(data, trial_ids=(t for f in front_list for t in f.trial_ids))
    csvs: dict[str, pd.DataFrame] = {}
    sections = {
        "run": _header_section(data) + _glance(data, front_list),
        "tuning": tuning_statement(summary=info.summary, trials=len(data.frame)),
        "fronts": _front_section(data, front_list=front_list, pool=pool, out=out, csvs=csvs),
        "hypervolume": _hypervolume_section(front_list, num_classes=info.num_classes),
        "excluded": _excluded_section(excluded),
    }
    leakage = _leakage_frame(data)
    utility = utility_frame(data)
    canary = canary_frame(data)
    budget = budget_frame(data)
    validity = validity_frame(data)
    failed = failed_frame(data)
    sections.update({
        "leakage": _leakage_section(leakage),
        "heatmap": _heatmap_section(data, front_list=front_list, out=out, csvs=csvs),
        "curves": _curves_section(data, front_list=front_list, records=records, out=out,
                                  csvs=csvs),
        "utility": _utility_section(data, utility, out=out, csvs=csvs),
        "canary": _canary_section(canary),
        "roc": _roc_section(data, front_list=front_list, records=records, out=out, csvs=csvs),
        "ww": _ww_section(data, out=out, csvs=csvs),
        "budget": _budget_section(budget),
        "validity": _validity_section(validity),
        "failed": _failed_section(failed),
        "coverage": _coverage_section(),
    })
    csvs.update({
        "trials.csv": _trials_frame(data, front_list, pool),
        "fronts.csv": _front_point_rows(front_list),
        "hypervolume.csv": pd.DataFrame(
            [{"front": f.name, "kind": f.kind, "target_epsilon": f.target_epsilon,
              "series": f.series, "trials": f.pool_size, "front_size": len(f.trials),
              "hypervolume": f.hypervolume, "reference_accuracy_above_chance": REFERENCE[0],
              "reference_attack_advantage": REFERENCE[1],
              "chance_accuracy": 1.0 / info.num_classes,
              "front_trials": " ".join(f.trial_ids)} for f in front_list],
            columns=["front", "kind", "target_epsilon", "series", "trials", "front_size",
                     "hypervolume", "reference_accuracy_above_chance",
                     "reference_attack_advantage", "chance_accuracy", "front_trials"]),
        "excluded.csv": excluded,
        "leakage.csv": leakage,
        "canary_bounds.csv": canary,
        "budget.csv": budget,
        "dp_validity.csv": validity,
        "failed_trials.csv": failed,
        "mia_layers.csv": mia_layers_frame(data),
        "covered_by_epsilon.csv": pd.DataFrame(
            [{"column": n, "dtype": c.dtype, "covered": c.covered, "meaning": c.meaning}
             for n, c in COLUMNS.items()]),
    })
    for name, frame in sorted(csvs.items()):
        _write_csv(frame, out / name)
    files = sorted([*(p.name for p in out.iterdir()), HTML_FILE])
    sections["files"] = ("<p>Written next to this page (the images above are embedded; each "
                         "figure's data is the CSV of the same name):</p>"
                         + '<ul class="files">'
                         + "".join(f'<li><a href="{_e(f)}">{_e(f)}</a></li>' for f in files)
                         + "</ul>")
    stamp = (f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}"
             " from the run directory; rebuild with dpsweep report RUN_DIR.")
    title = f"dpsweep report: {data.run_dir.resolve().name}"
    atomic_write_text(out / HTML_FILE, _page(title=title, stamp=stamp, sections=sections))
