"""``dpsweep report RUN_DIR``: one self-contained HTML page plus its PNGs and CSVs.

The page is built from the results store (and each trial's ``audit.json`` for ROC curves)
only, so it can be rebuilt at any time without training. Images are embedded as data URIs and
the CSS is inline: the HTML file alone can be mailed to a reviewer. Everything is sorted and
the PNGs carry no metadata, so a rebuild from the same results gives the same CSVs and the
same HTML except for the one line holding the timestamp (``class="stamp"``).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from core.errors import UserInputError
from orchestrator.results import COLUMNS, TRIALS_DIR, read_results
from reports import plots
from reports.pareto import (
    ACC,
    ALL_METHODS,
    ALL_VALID,
    DEFAULT_NUM_CLASSES,
    MIA,
    REFERENCE_MIA,
    FrontSummary,
    eligible,
    fronts,
    natural_key,
    summarize,
)

REPORT_DIR = "report"
HTML_FILE = "report.html"
AUDIT_FILE = "audit.json"  # reports.audit.AUDIT_FILE (not imported: it pulls in torch)
AUDIT_ERROR = "audit_error"  # reports.audit.AUDIT_ERROR_COLUMN
STAMP_CLASS = "stamp"
INVALID_TAG = "epsilon claim invalid"
LOSS_COLUMN = "loss baseline"
JSON_COLUMNS = ("mia_layers", "trajectories", "noise_schedule", "method_params")


# ---- reading -----------------------------------------------------------------------------
def _parse_json(value: Any, *, column: str, trial_id: str, empty: list[Any] | dict[str, Any]
                ) -> Any:
    """A JSON cell of the store; null is ``empty``; bad JSON or the wrong shape is corrupt."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return empty
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        parsed = None
    if not isinstance(parsed, type(empty)) or (
            isinstance(parsed, list) and not all(isinstance(x, dict) for x in parsed)):
        kind = "a JSON list of objects" if isinstance(empty, list) else "a JSON object"
        raise UserInputError(field=f"results.{column}", value=f"trial {trial_id}",
                             allowed=f"{kind} (the results file is corrupt)")
    return parsed


def _float(value: Any) -> float:
    """A number from a JSON record; NaN when absent or not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


@dataclass(frozen=True)
class RunData:
    """The results store, normalised: all documented columns, rows in trial order, the JSON
    columns parsed per trial."""

    run_dir: Path
    frame: pd.DataFrame
    parsed: dict[str, dict[str, Any]]

    @property
    def ok(self) -> pd.DataFrame:
        return self.frame[self.frame["status"] == "ok"]


def load_run(run_dir: Path) -> RunData:
    """Read and normalise the store; a corrupt JSON cell is one UserInputError."""
    run = Path(run_dir)
    frame = read_results(run).copy()
    for name in COLUMNS:
        if name not in frame.columns:
            frame[name] = None
    frame["trial_id"] = frame["trial_id"].astype(str)
    frame["method"] = frame["method"].astype(str)
    frame["status"] = frame["status"].fillna("failed").astype(str)
    frame["dp_valid"] = frame["dp_valid"].fillna(False).astype(bool)
    for name in ("mode", "error", "validity_reason", "peak_layer", "accountant",
                 "accountant_fallback", "preset"):
        frame[name] = frame[name].fillna("").astype(str)
    for name in (ACC, MIA, "epsilon_lower", "epsilon_estimate", "epsilon_upper", "delta",
                 "sample_rate", "noise_multiplier", "target_epsilon", "steps", "clip_norm",
                 "loss_attack_accuracy", "loss_attack_auc"):
        frame[name] = pd.to_numeric(frame[name], errors="coerce").astype(float)
    order = sorted(range(len(frame)), key=lambda i: natural_key(frame["trial_id"].iloc[i]))
    frame = frame.iloc[order].reset_index(drop=True)
    hp = sorted(c for c in frame.columns if c.startswith("hp_"))
    rest = sorted(c for c in frame.columns if c not in COLUMNS and c not in hp)
    frame = frame[[*COLUMNS, *hp, *rest]]
    parsed: dict[str, dict[str, Any]] = {}
    for _, row in frame.iterrows():
        tid = row["trial_id"]
        parsed[tid] = {
            "mia_layers": _parse_json(row["mia_layers"], column="mia_layers", trial_id=tid,
                                      empty=[]),
            "trajectories": _parse_json(row["trajectories"], column="trajectories",
                                        trial_id=tid, empty={}),
            "noise_schedule": _parse_json(row["noise_schedule"], column="noise_schedule",
                                          trial_id=tid, empty=[]),
            "method_params": _parse_json(row["method_params"], column="method_params",
                                         trial_id=tid, empty={}),
        }
    return RunData(run_dir=run, frame=frame, parsed=parsed)


def trial_dirs(run: Path, row: pd.Series) -> list[Path]:
    """Where a trial's files may be: beside its privacy record, trials/<trial_id>, or its
    checkpoint directory (the audit writes audit.json to the second, else the third)."""
    out: list[Path] = []
    record, checkpoint = row.get("privacy_record"), row.get("checkpoint")
    if isinstance(record, str) and record:
        out.append((run / record).parent)
    out.append(run / TRIALS_DIR / str(row["trial_id"]))
    if isinstance(checkpoint, str) and checkpoint:
        out.append(run / checkpoint)
    return list(dict.fromkeys(out))


def _curve(entry: Any) -> tuple[list[float], list[float]] | None:
    """ROC points of one audit entry: roc_fpr/roc_tpr (reports.audit), fpr/tpr, or a nested
    roc: {fpr, tpr}."""
    if not isinstance(entry, dict):
        return None
    source = entry.get("roc") if isinstance(entry.get("roc"), dict) else entry
    for fkey, tkey in (("roc_fpr", "roc_tpr"), ("fpr", "tpr")):
        fpr, tpr = source.get(fkey), source.get(tkey)
        if isinstance(fpr, list) and isinstance(tpr, list) and len(fpr) == len(tpr) and fpr:
            return [float(v) for v in fpr], [float(v) for v in tpr]
    return None


def roc_by_layer(document: Any) -> dict[str, tuple[list[float], list[float]]]:
    """Per-layer ROC points from an audit.json: its ``layers`` list of {name, roc_fpr,
    roc_tpr} (reports.audit), or a bare list of such dicts (fpr/tpr keys accepted too)."""
    entries = document.get("layers") if isinstance(document, dict) else document
    found: dict[str, tuple[list[float], list[float]]] = {}
    if isinstance(entries, list):
        for entry in entries:
            curve = _curve(entry)
            name = entry.get("name") if isinstance(entry, dict) else None
            if curve is not None and isinstance(name, str):
                found.setdefault(name, curve)
    return found


# ---- formatting --------------------------------------------------------------------------
def _num(value: Any, digits: int = 4) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def _sci(value: Any) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(x) else f"{x:.3g}"


def _int(value: Any) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(x) else str(int(x))


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


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *,
           row_classes: Sequence[str] | None = None) -> str:
    """An HTML table; cells are pre-escaped HTML."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + \
        "\n</tbody></table>"


def _flag(valid: bool) -> str:
    return "valid" if valid else f'<span class="invalid">{INVALID_TAG}</span>'


def _image(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_e(alt)}">'
            f'<figcaption>{_e(alt)} ({_e(path.name)})</figcaption></figure>')


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'


# ---- sections ----------------------------------------------------------------------------
def tuning_statement(*, trials: int, finished: int, failed: int) -> str:
    """The privacy cost of tuning, in plain words (DESIGN: "Privacy budget matching")."""
    return (
        f"<p>This sweep ran <b>{trials}</b> trials ({finished} finished, {failed} failed). "
        "Each trial's epsilon bounds what training <em>that one model</em> reveals about its "
        "training data. It does <b>not</b> cover the hyperparameter search: the sweep chose "
        "hyperparameters adaptively (Optuna TPE) from test accuracy and MIA accuracy measured on "
        "private data, and choosing one model from many after looking at private metrics leaks "
        "more than any single trial's epsilon. That extra cost is not accounted here; releasing "
        f"all {trials} models would, by basic composition, cost up to {trials} times the "
        "per-trial budget.</p>"
        "<p>A tuning-aware epsilon (Papernot &amp; Steinke, 2022, <i>Hyperparameter Tuning with "
        "Renyi Differential Privacy</i>) applies only when all of these hold: (1) the "
        "hyperparameters are drawn by <b>random search</b>, independently of earlier results, "
        "with a <b>random number of trials</b> (e.g. truncated-geometric or Poisson); (2) "
        "<b>only the selected model</b> is released; (3) the <b>selection score</b> comes from "
        "public data or is itself computed with DP. The sweep uses adaptive TPE search, so "
        "condition (1) fails and no tuning-aware epsilon is claimed: <b>adaptive "
        "hyperparameter search over private metrics is not covered by the per-trial "
        "epsilon.</b></p>")


def _summary(data: RunData, *, audited: int, num_classes: int) -> str:
    frame, ok = data.frame, data.ok
    failed = int((frame["status"] != "ok").sum())
    methods = frame.groupby("method", sort=True).size()
    method_text = ", ".join(f"{_e(m)} ({n})" for m, n in methods.items())
    budgets = sorted({(float(e), float(d)) for e, d in zip(ok["target_epsilon"], ok["delta"],
                                                           strict=True)
                      if math.isfinite(e) and math.isfinite(d)})
    budget_text = "; ".join(f"epsilon {e:g}, delta {d:g}" for e, d in budgets) or "—"
    invalid = int((~ok["dp_valid"]).sum())
    rows = [("run directory", _e(data.run_dir.resolve())),
            ("trials", f"{len(frame)} ({len(ok)} finished, {failed} failed)"),
            ("methods", method_text),
            ("target budget", budget_text),
            ("audited (MIA measured)", f"{audited} of {len(ok)} finished trials"),
            ("epsilon claim invalid", f"{invalid} of {len(ok)} finished trials"),
            ("hypervolume reference", f"test accuracy {1.0 / num_classes:g} (chance, "
                                      f"{num_classes} classes), MIA accuracy {REFERENCE_MIA:g}")]
    out = ('<table class="facts"><tbody>\n'
           + "\n".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
           + "\n</tbody></table>")
    if audited == 0:
        out += _note("The MIA columns are empty: the audit has not run on these trials. "
                     "Fronts, hypervolumes, the heat map and the ROC need it; run the audit, "
                     "then <code>dpsweep report</code> again.")
    elif audited < len(ok):
        out += _note(f"{_count(len(ok) - audited, 'finished trial')} without MIA results "
                     "(audit not run or failed) left out of the fronts.")
    return out


def _front_section(*, front_frames: dict[str, pd.DataFrame], png: Path | None) -> str:
    if png is None:
        return _note("No front: no finished trial has both a test accuracy and a peak MIA "
                     "accuracy.")
    front = front_frames[ALL_METHODS].sort_values([ACC, MIA, "trial_id"],
                                                  ascending=[False, True, True], kind="stable")
    rows = [[_e(r["trial_id"]), _e(r["method"]), _e(r["mode"] or "—"), _num(r[ACC]),
             _num(r[MIA]),
             _e(r["peak_layer"]), _flag(bool(r["dp_valid"]))] for _, r in front.iterrows()]
    return (_image(png, "Pareto front: peak-layer MIA accuracy vs test accuracy")
            + "<p>Colour = method; joined solid points = that method's front; faded points are "
              "dominated within their method; the wide grey band is the front over all "
              f"methods; crosses mark trials whose {INVALID_TAG}.</p>"
            + "<h3>Front over all methods</h3>"
            + _table(["trial", "method", "mode", "test accuracy", "peak MIA accuracy",
                      "peak layer", "DP validity"], rows))


def _hypervolume_section(summaries: Sequence[FrontSummary], *, num_classes: int) -> str:
    rows = [[_e(s.front), str(s.trials), str(s.front_size), _num(s.hypervolume),
             _num(s.best_test_accuracy), _num(s.lowest_peak_mia),
             _e(", ".join(s.front_trials))] for s in summaries]
    return (f"<p>Area dominated by each front inside the box from the reference point (test "
            f"accuracy {1.0 / num_classes:g}, MIA accuracy {REFERENCE_MIA:g}); larger is "
            "better.</p>"
            + _table(["front", "trials", "front size", "hypervolume", "best test accuracy",
                      "lowest peak MIA", "front trials"], rows))


def _front_trials(front_frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Union of the per-method fronts (which contains the overall front), by method then
    accuracy: the trials worth a closer look."""
    parts = [f for name, f in front_frames.items() if name not in (ALL_METHODS, ALL_VALID)]
    if not parts or all(p.empty for p in parts):
        return pd.DataFrame()
    union = pd.concat([p for p in parts if not p.empty]).drop_duplicates("trial_id")
    return union.sort_values(["method", ACC, MIA, "trial_id"], ascending=[True, False, True,
                                                                          True], kind="stable")


def _layer_order(layer_lists: Iterable[list[dict[str, Any]]]) -> list[str]:
    order: list[str] = []
    for layers in layer_lists:
        for layer in layers:
            name = str(layer.get("name", ""))
            if name and name not in order:
                order.append(name)
    return order


def _heatmap_section(data: RunData, *, chosen: pd.DataFrame, out: Path) -> tuple[str, Path | None]:
    if chosen.empty:
        return _note("No heat map: no trial has per-layer MIA results (audit not run)."), None
    heat_rows, lists = [], []
    for _, r in chosen.iterrows():
        layers = data.parsed[r["trial_id"]]["mia_layers"]
        lists.append(layers)
        acc = {str(x.get("name")): _float(x.get("accuracy")) for x in layers}
        loss = float(r["loss_attack_accuracy"])
        if math.isfinite(loss):
            acc[LOSS_COLUMN] = loss
        heat_rows.append(plots.HeatRow(label=f"{r['trial_id']} · {r['method']}",
                                       accuracies=acc, peak_layer=str(r["peak_layer"])))
    layer_names = _layer_order(lists)
    if any(LOSS_COLUMN in row.accuracies for row in heat_rows):
        layer_names.append(LOSS_COLUMN)
    if not layer_names:
        return _note("No heat map: the front's trials have no per-layer MIA results."), None
    png = plots.mia_heatmap(heat_rows, layers=layer_names, path=out / "mia_heatmap.png")
    return (_image(png, "Per-layer MIA accuracy of the front's trials")
            + "<p>Rows: trials on their method's front; columns: attacked layers from input to "
              "output, then the loss-threshold baseline on the output; cells: attack "
              "accuracy; red box: the trial's peak layer. Per-layer intervals, AUC and TPR at "
              "low FPR are in <code>mia_layers.csv</code>.</p>"), png


def _roc_section(data: RunData, *, chosen: pd.DataFrame, out: Path) -> tuple[str, Path | None]:
    if chosen.empty:
        return _note("No ROC: no trial has MIA results (audit not run)."), None
    curves, missing = [], []
    for _, r in chosen.iterrows():
        path = next((d / AUDIT_FILE for d in trial_dirs(data.run_dir, r)
                     if (d / AUDIT_FILE).is_file()), trial_dirs(data.run_dir, r)[0] / AUDIT_FILE)
        document: Any = None
        if path.is_file():
            try:
                document = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                document = None
        by_layer = roc_by_layer(document) if document is not None else {}
        curve = by_layer.get(str(r["peak_layer"]))
        if curve is None:
            why = "no audit.json" if not path.is_file() else (
                "unreadable audit.json" if document is None else
                f"no ROC points for layer {r['peak_layer']!r}")
            missing.append(f"{r['trial_id']} ({why})")
            continue
        auc = next((_float(x.get("auc")) for x in data.parsed[r["trial_id"]]["mia_layers"]
                    if x.get("name") == r["peak_layer"]), math.nan)
        label = f"{r['trial_id']} · {r['method']} · {r['peak_layer']}" + (
            f" (AUC {auc:.3f})" if math.isfinite(auc) else "")
        curves.append(plots.RocCurve(label=label, fpr=tuple(curve[0]), tpr=tuple(curve[1])))
    text, png = "", None
    if curves:
        png = plots.roc_plot(curves, path=out / "roc_peak_layer.png")
        text += (_image(png, "ROC of the peak layer for the front's trials")
                 + "<p>Right: log-log axes; the true positive rate at 1% and 0.1% false "
                   "positive rate is the headline number for strong attacks (see "
                   "<code>mia_layers.csv</code>).</p>")
    if missing:
        text += _note("No ROC drawn for: " + _e("; ".join(missing)) + ".")
    return text, png


def _series(traj: dict[str, Any], keys: Sequence[str]) -> tuple[float, ...]:
    for key in keys:
        values = traj.get(key)
        if isinstance(values, list) and values:
            return tuple(_float(v) for v in values)
    return ()


def _ww_section(data: RunData, *, out: Path) -> tuple[str, Path | None]:
    ww = data.ok[data.ok["method"] == "ww_dpsgd"]
    trajs, rows = [], []
    for _, r in ww.iterrows():
        traj = data.parsed[r["trial_id"]]["trajectories"]
        params = data.parsed[r["trial_id"]]["method_params"]
        if not isinstance(traj, dict):
            continue
        clip = _series(traj, ("clip_norm", "C_t", "C", "c_t"))
        zeta_hat = _series(traj, ("zeta_hat", "zeta_ema"))
        if not clip and not zeta_hat:
            continue
        n = max(len(clip), len(zeta_hat))
        steps = _series(traj, ("step", "steps")) or tuple(float(i + 1) for i in range(n))
        c0 = float(r["clip_norm"])
        if clip and math.isfinite(c0) and len(steps) >= len(clip):
            # C_0 holds until the first probe: start the C_t line at step 0
            c_steps, clip_line = (0.0, *steps[:len(clip)]), (c0, *clip)
        else:
            c_steps, clip_line = steps, clip
        trajs.append(plots.Trajectory(
            label=str(r["trial_id"]), steps=steps, clip_steps=c_steps, clip_norm=clip_line,
            zeta_hat=zeta_hat,
            zeta=_series(traj, ("zeta",)),
            zeta_star=_float(params.get("zeta_star")), radius=_float(params.get("radius"))))
        clamp = _series(traj, ("clamp",))
        rows.append([_e(r["trial_id"]), str(n), _num(r["clip_norm"]),
                     _num(clip[-1]) if clip else "—",
                     f"{_num(min(clip))} – {_num(max(clip))}" if clip else "—",
                     _num(zeta_hat[-1], 3) if zeta_hat else "—",
                     str(sum(1 for c in clamp if c and c == c)) if clamp else "—"])
    if not trajs:
        return _note("No WW-DP-SGD trajectories (no finished ww_dpsgd trial logged C_t)."), None
    png = plots.ww_trajectories(trajs, path=out / "ww_trajectories.png")
    return (_image(png, "WW-DP-SGD clipping norm and tail exponent trajectories")
            + _table(["trial", "probes", "C_0", "final C", "C range", "final zeta^",
                      "clamp hits"], rows)), png


def budget_frame(data: RunData) -> pd.DataFrame:
    """The budget-matching table, one row per finished trial."""
    records = []
    for _, r in data.ok.iterrows():
        schedule = data.parsed[r["trial_id"]]["noise_schedule"]
        records.append({
            "trial_id": r["trial_id"], "method": r["method"], "mode": r["mode"],
            "noise_multiplier": r["noise_multiplier"],
            "schedule": schedule_text(sigma=r["noise_multiplier"], schedule=schedule),
            "phases": len(schedule), "sample_rate": r["sample_rate"], "steps": r["steps"],
            "delta": r["delta"], "target_epsilon": r["target_epsilon"],
            "epsilon_lower": r["epsilon_lower"], "epsilon_estimate": r["epsilon_estimate"],
            "epsilon_upper": r["epsilon_upper"], "accountant": r["accountant"],
            "accountant_fallback": r["accountant_fallback"], "dp_valid": r["dp_valid"]})
    return pd.DataFrame(records, columns=[
        "trial_id", "method", "mode", "noise_multiplier", "schedule", "phases", "sample_rate",
        "steps", "delta", "target_epsilon", "epsilon_lower", "epsilon_estimate",
        "epsilon_upper", "accountant", "accountant_fallback", "dp_valid"])


def _budget_section(budget: pd.DataFrame) -> str:
    if budget.empty:
        return _note("No finished trial: nothing was budgeted.")
    rows = [[_e(r["trial_id"]), _e(r["method"]), _e(r["schedule"]), _sci(r["sample_rate"]),
             _int(r["steps"]), _sci(r["delta"]), _num(r["target_epsilon"], 3),
             _num(r["epsilon_lower"]), _num(r["epsilon_estimate"]), _num(r["epsilon_upper"]),
             _e(r["accountant"]), _e(r["accountant_fallback"] or "—"),
             _flag(bool(r["dp_valid"]))] for _, r in budget.iterrows()]
    return ("<p>Every trial is held to the same target: the noise multiplier (sigma, or the "
            "initial sigma_0 of a decaying schedule) is chosen so that the accountant's "
            "<b>upper</b> epsilon bound is at most the target. The lower bound and the "
            "estimate show how tight the claim is; RDP (the fallback) gives only an upper "
            "bound.</p>"
            + _table(["trial", "method", "sigma / schedule", "q", "steps", "delta",
                      "target eps", "eps lower", "eps estimate", "eps upper", "accountant",
                      "fallback", "DP validity"], rows))


def validity_frame(data: RunData) -> pd.DataFrame:
    ok = data.ok
    return pd.DataFrame({"trial_id": ok["trial_id"], "method": ok["method"],
                         "mode": ok["mode"], "dp_valid": ok["dp_valid"],
                         "validity_reason": ok["validity_reason"]}).reset_index(drop=True)


def _validity_section(validity: pd.DataFrame) -> str:
    if validity.empty:
        return _note("No finished trial.")
    groups = validity.groupby(["method", "mode", "dp_valid", "validity_reason"], sort=True,
                              dropna=False)
    rows, classes = [], []
    for (method, mode, valid, reason), group in groups:
        ids = list(group["trial_id"])
        shown = ", ".join(ids[:12]) + (f", … ({len(ids)} in all)" if len(ids) > 12 else "")
        rows.append([_e(method), _e(mode or "—"), _flag(bool(valid)), str(len(ids)),
                     _e(reason or "—"), _e(shown)])
        classes.append("" if valid else "bad")
    invalid = int((~validity["dp_valid"]).sum())
    lead = (f"<p>Finished trials flagged <span class=\"invalid\">{INVALID_TAG}</span>: "
            f"<b>{invalid}</b> of {len(validity)}. Such trials follow a paper's algorithm whose "
            "privacy argument does not hold, so their epsilon is not a guarantee. "
            "<code>dpsweep pick</code> refuses them unless given "
            "<code>--allow-invalid-dp</code>.</p>" if invalid else
            "<p>Every finished trial's epsilon claim holds.</p>")
    return lead + _table(["method", "mode", "DP validity", "trials", "reason", "trial ids"],
                         rows, row_classes=classes)


def failed_frame(data: RunData) -> pd.DataFrame:
    """Trials that failed in training, and finished trials whose audit failed (the audit
    records those in an ``audit_error`` column)."""
    frame = data.frame
    bad = frame[frame["status"] != "ok"]
    out = pd.DataFrame({"trial_id": bad["trial_id"], "method": bad["method"],
                        "stage": "training", "preset": bad["preset"], "error": bad["error"]})
    if AUDIT_ERROR in frame.columns:
        errors = frame[AUDIT_ERROR].fillna("").astype(str)
        audit_bad = frame[(frame["status"] == "ok") & (errors != "")]
        out = pd.concat([out, pd.DataFrame({
            "trial_id": audit_bad["trial_id"], "method": audit_bad["method"], "stage": "audit",
            "preset": audit_bad["preset"], "error": errors[audit_bad.index]})])
    return out.reset_index(drop=True)


def _failed_section(failed: pd.DataFrame) -> str:
    if failed.empty:
        return "<p>No trial failed.</p>"
    rows = [[_e(r["trial_id"]), _e(r["method"]), _e(r["stage"]),
             _e(r["error"] or "(no reason recorded)")] for _, r in failed.iterrows()]
    training = int((failed["stage"] == "training").sum())
    audit = len(failed) - training
    return (f"<p>{_count(training, 'trial')} failed in training; the sweep went on without "
            "them." + (f" {_count(audit, 'finished trial')} could not be audited." if audit
                       else "") + "</p>"
            + _table(["trial", "method", "stage", "reason"], rows))


def mia_layers_frame(data: RunData) -> pd.DataFrame:
    """Long table: one row per (trial, attacked layer), every metric the audit stored."""
    records = []
    for _, r in data.ok.iterrows():
        for index, layer in enumerate(data.parsed[r["trial_id"]]["mia_layers"]):
            if isinstance(layer, dict):
                flat = {k: v for k, v in layer.items()
                        if isinstance(v, (int, float, str, bool)) or v is None}
                records.append({"trial_id": r["trial_id"], "method": r["method"],
                                "layer_index": index, **flat})
    if not records:
        return pd.DataFrame(columns=["trial_id", "method", "layer_index", "name", "accuracy"])
    frame = pd.DataFrame(records)
    fixed = ["trial_id", "method", "layer_index"]
    return frame[fixed + sorted(c for c in frame.columns if c not in fixed)]


def fronts_frame(front_frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    records = []
    for name, front in front_frames.items():
        for position, (_, r) in enumerate(front.iterrows()):
            records.append({"front": name, "position": position, "trial_id": r["trial_id"],
                            "method": r["method"], "mode": r["mode"], ACC: r[ACC], MIA: r[MIA],
                            "peak_layer": r["peak_layer"], "dp_valid": r["dp_valid"]})
    return pd.DataFrame(records, columns=["front", "position", "trial_id", "method", "mode", ACC,
                                          MIA, "peak_layer", "dp_valid"])


def _trials_frame(data: RunData, front_frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    frame = data.frame.copy()
    overall = set(front_frames[ALL_METHODS]["trial_id"])
    per_method = {tid for name, f in front_frames.items()
                  if name not in (ALL_METHODS, ALL_VALID) for tid in f["trial_id"]}
    frame["on_front"] = frame["trial_id"].isin(overall)
    frame["on_method_front"] = frame["trial_id"].isin(per_method)
    return frame


_CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1250px;
color:#222;line-height:1.45;padding:0 16px}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;
margin-top:1.8em}h3{margin-bottom:.3em}
table{border-collapse:collapse;margin:.6em 0;font-size:.86em}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f5}table.facts th{white-space:nowrap}
tbody tr:nth-child(even){background:#fafafa}
tr.bad{background:#fff0f0 !important}
.invalid{color:#fff;background:#b00020;border-radius:3px;padding:0 4px;font-size:.9em;
white-space:nowrap}
.note{background:#fff8e1;border-left:4px solid #f0b400;padding:6px 10px}
.stamp{color:#777;font-size:.85em;margin-top:0}
.privacy{background:#eef4ff;border-left:4px solid #2a5db0;padding:4px 14px}
figure{margin:.6em 0}figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#666;font-size:.85em}
nav a{margin-right:12px}code{background:#f3f3f3;padding:0 3px}
"""

_SECTIONS = (("summary", "Summary"), ("tuning", "Privacy cost of tuning"),
             ("front", "Pareto front"), ("hypervolume", "Hypervolume per method"),
             ("heatmap", "Per-layer MIA of front trials"), ("roc", "ROC of the peak layer"),
             ("ww", "WW-DP-SGD trajectories"), ("budget", "Privacy budget"),
             ("validity", "DP validity"), ("failed", "Failed trials"), ("files", "Files"))


def _page(*, title: str, stamp: str, sections: dict[str, str]) -> str:
    nav = " ".join(f'<a href="#{key}">{_e(name)}</a>' for key, name in _SECTIONS)
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
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
    frame.to_csv(path, index=False, lineterminator="\n")
    return path


def build_report(run_dir: Path, *, num_classes: int = DEFAULT_NUM_CLASSES) -> Path:
    """Build ``run_dir/report/`` (HTML, PNGs, CSVs) from the results store; return the HTML.

    The new report is assembled in a temporary sibling directory and swapped in at the end,
    so a failed build never leaves a half-written report and stale figures never survive.
    """
    data = load_run(Path(run_dir))
    run = data.run_dir
    final = run / REPORT_DIR
    work = run / f".{REPORT_DIR}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _build_into(data, out=work, num_classes=num_classes)
        old = run / f".{REPORT_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(work, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final / HTML_FILE


def _build_into(data: RunData, *, out: Path, num_classes: int) -> None:
    ok = data.ok
    audited = len(eligible(data.frame))
    front_frames = fronts(data.frame)
    summaries = summarize(data.frame, num_classes=num_classes)
    chosen = _front_trials(front_frames)

    front_png = (plots.front_plot(data.frame, path=out / "front.png", num_classes=num_classes)
                 if audited else None)
    heat_html, _ = _heatmap_section(data, chosen=chosen, out=out)
    roc_html, _ = _roc_section(data, chosen=chosen, out=out)
    ww_html, _ = _ww_section(data, out=out)
    budget = budget_frame(data)
    validity = validity_frame(data)
    failed = failed_frame(data)

    csvs = {
        "trials.csv": _trials_frame(data, front_frames),
        "fronts.csv": fronts_frame(front_frames),
        "hypervolume.csv": pd.DataFrame(
            [{"front": s.front, "trials": s.trials, "front_size": s.front_size,
              "hypervolume": s.hypervolume, "reference_test_accuracy": 1.0 / num_classes,
              "reference_mia_accuracy": REFERENCE_MIA,
              "best_test_accuracy": s.best_test_accuracy, "lowest_peak_mia": s.lowest_peak_mia,
              "front_trials": " ".join(s.front_trials)} for s in summaries]),
        "budget.csv": budget,
        "dp_validity.csv": validity,
        "failed_trials.csv": failed,
        "mia_layers.csv": mia_layers_frame(data),
    }
    for name, frame in csvs.items():
        _write_csv(frame, out / name)

    files = [*sorted(p.name for p in out.iterdir()), HTML_FILE]
    file_list = "<ul>" + "".join(f'<li><a href="{_e(f)}">{_e(f)}</a></li>'
                                 for f in sorted(files)) + "</ul>"
    sections = {
        "summary": _summary(data, audited=audited, num_classes=num_classes),
        "tuning": tuning_statement(trials=len(data.frame), finished=len(ok),
                                   failed=len(data.frame) - len(ok)),
        "front": _front_section(front_frames=front_frames, png=front_png),
        "hypervolume": (_hypervolume_section(summaries, num_classes=num_classes) if audited
                        else _note("No hypervolumes: no trial has MIA results.")),
        "heatmap": heat_html,
        "roc": roc_html,
        "ww": ww_html,
        "budget": _budget_section(budget),
        "validity": _validity_section(validity),
        "failed": _failed_section(failed),
        "files": "<p>Written next to this page (the images above are embedded):</p>"
                 + file_list,
    }
    stamp = (f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}"
             " from the results store; rebuild with dpsweep report RUN_DIR.")
    title = f"dpsweep report: {data.run_dir.resolve().name}"
    (out / HTML_FILE).write_text(_page(title=title, stamp=stamp, sections=sections),
                                 encoding="utf-8")
