"""How training went: validation curves of the front trials, privacy-utility across targets
(best configuration and its re-runs), and the per-step series each method declares
(``reports.series``: WW-DP-SGD's clipping norm and tail exponent, for one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpsweep.core import layout
from dpsweep.reports import plots
from dpsweep.reports.html.fmt import (
    TEST_NOTE,
    eps_tag,
    esc,
    figure_html,
    ids_text,
    note_html,
    num_text,
    table_html,
    th,
)
from dpsweep.reports.html.fronts import baseline_point, front_trials_at
from dpsweep.reports.html.records import Records, RunData, as_float
from dpsweep.reports.pareto import ACC, MIA, Front, natural_key, sort_trials
from dpsweep.reports.series import LoggedSeries, SummaryColumn

#: Most curves in one validation-curve figure (further ones are in the CSV).
MAX_CURVES = 14


def curves_section(data: RunData, *, front_list: Sequence[Front], records: Records,
                   out: Path, csvs: dict[str, pd.DataFrame]) -> str:
    parts, missing = [], []
    baseline = baseline_point(data)
    for target in data.info.targets:
        chosen = front_trials_at(front_list, target)
        curves, rows = [], []
        for _, r in chosen.iterrows():
            history = records.histories.get(r["trial_id"])
            if not history:
                missing.append(str(r["trial_id"]))
                continue
            epochs = [as_float(h.get("epoch")) for h in history]
            values = [as_float(h.get("val_accuracy")) for h in history]
            curves.append(plots.Curve(label=f"{r['trial_id']} · {r['series']}",
                                      series=r["series"], epochs=tuple(epochs),
                                      values=tuple(values)))
            for h, e, v in zip(history, epochs, values, strict=True):
                rows.append({"trial_id": r["trial_id"], "series": r["series"], "epoch": e,
                             "val_accuracy": v, "epsilon_spent": as_float(h.get("epsilon_spent"))})
        if not curves:
            continue
        tag = eps_tag(target)
        png = plots.validation_curves(
            curves[:MAX_CURVES], title=f"Validation accuracy per epoch, front trials at "
                                       f"ε = {target:g}",
            baseline=baseline.val_accuracy if baseline else math.nan,
            path=out / f"validation_curves_{tag}.png")
        csvs[f"validation_curves_{tag}.csv"] = pd.DataFrame(rows)
        parts.append(f"<h3>ε = {target:g}</h3>"
                     + figure_html(png, f"Validation accuracy per epoch of the front trials at "
                                   f"ε = {target:g}"))
    text = "\n".join(parts) or note_html("No validation curves: no front trial has a history.")
    if missing:
        listed = ids_text(sorted(set(missing), key=natural_key))
        text += note_html(f"No {layout.HISTORY} for: {listed}.")
    return text


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


def utility_section(data: RunData, utility: pd.DataFrame, *, out: Path,
                    csvs: dict[str, pd.DataFrame]) -> str:
    if utility["target_epsilon"].nunique() < 2:
        return note_html("Results at fewer than two target epsilons: privacy-utility curves need "
                         "several (<code>[budget] epsilons</code>).")
    baseline = baseline_point(data)
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
        sd = f" ± {num_text(r[f'{key}_sd'], 3)}" if r["runs"] > 1 else ""
        return num_text(r[f"{key}_mean"], 3) + sd

    rows = [[esc(r["series"]), num_text(r["target_epsilon"], 3), esc(r["best_trial"]),
             esc(r["trials"].replace(" ", ", ")), mean_sd(r, "val"), mean_sd(r, "test"),
             mean_sd(r, "mia")] for _, r in utility.iterrows()]
    base = ("" if baseline is None else
            f" Non-private baseline: validation {num_text(baseline.val_accuracy, 3)}, test "
            f"{num_text(baseline.test_accuracy, 3)}, peak MIA {num_text(baseline.peak_mia, 3)}.")
    return (figure_html(png, "Privacy-utility: accuracy and peak MIA vs target epsilon")
            + "<p>Per series and target: the best configuration by validation accuracy and its "
              "re-runs with fresh noise; mean ± sd over those runs (the value alone with one "
              "run)."
            + base + "</p>"
            + table_html([th("series"), th("target eps"), th("best trial"), th("runs (trials)"),
                          th("validation accuracy", ACC),
                          th(f"test accuracy ({TEST_NOTE})", "test_accuracy"),
                          th("peak MIA accuracy", MIA)], rows))


def _logged(traj: dict[str, Any], key: str) -> tuple[float, ...]:
    """One logged series of a trial (a key of its method's ``trajectories``); () when
    absent."""
    values = traj.get(key)
    return tuple(as_float(v) for v in values) if isinstance(values, list) else ()


def _points(steps: tuple[float, ...], values: tuple[float, ...],
            start: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A line's points; with a finite ``start``, that value from step 0 until the first
    entry."""
    if values and math.isfinite(start) and len(steps) >= len(values):
        return (0.0, *steps[:len(values)]), (start, *values)
    return steps[:len(values)], values


def _summary_cell(column: SummaryColumn, values: tuple[float, ...], start: float) -> str:
    if column.stat == "start":
        return num_text(start, column.digits)
    if not values:
        return "—"
    if column.stat == "last":
        return num_text(values[-1], column.digits)
    if column.stat == "range":
        return f"{num_text(min(values), column.digits)} – {num_text(max(values), column.digits)}"
    return str(sum(1 for v in values if v and v == v))  # hits: set entries, NaN left out


def series_section(data: RunData, declared: LoggedSeries, *, method: str, out: Path,
                   csvs: dict[str, pd.DataFrame]) -> str:
    """The per-step series ``method`` declares (``reports.series``) of its finished trials: a
    figure, the values as a CSV and a summary row per trial."""
    trials = data.dp[data.dp["method"] == method]
    starts = {line.key: line.start for panel in declared.panels for line in panel.lines}
    drawn = [line.key for panel in declared.panels for line in panel.lines
             if line.style != "faint"]
    traces, rows, records = [], [], []
    for _, r in trials.iterrows():
        parsed = data.parsed[r["trial_id"]]
        traj, params = parsed["trajectories"], parsed["method_params"]
        logged = {key: _logged(traj, key)
                  for key in (*declared.keys, *(c.key for c in declared.columns))}
        if not any(logged[key] for key in drawn):
            continue
        n = max(len(logged[key]) for key in drawn)
        steps = _logged(traj, declared.step_key) or tuple(float(i + 1) for i in range(n))
        start = {key: as_float(r[column]) if column else math.nan
                 for key, column in starts.items()}
        traces.append(plots.SeriesTrace(
            label=f"{r['trial_id']} (ε {r['target_epsilon']:g})",
            points={key: _points(steps, logged[key], start[key]) for key in declared.keys},
            zones=tuple(None if p.zone is None else (as_float(params.get(p.zone.centre)),
                                                     as_float(params.get(p.zone.radius)))
                        for p in declared.panels)))
        for k in range(n):
            records.append({"trial_id": r["trial_id"], "target_epsilon": r["target_epsilon"],
                            "step": steps[k] if k < len(steps) else math.nan,
                            **{key: logged[key][k] if k < len(logged[key]) else math.nan
                               for key in declared.keys}})
        rows.append([esc(r["trial_id"]), num_text(r["target_epsilon"], 3), str(n),
                     *(_summary_cell(c, logged[c.key], start.get(c.key, math.nan))
                       for c in declared.columns)])
    if not traces:
        return note_html(f"No {esc(declared.label)} trajectories (no finished trial of the "
                         f"method logged {esc(', '.join(drawn))}).")
    targets = [t for t in data.info.targets if t in set(trials["target_epsilon"])]
    covered = bool(declared.covered_note)
    png = plots.logged_series(traces, declared.panels,
                              title=f"{declared.label}, {plots.eps_text(targets)}",
                              path=out / f"{declared.name}.png", covered=covered)
    csvs[f"{declared.name}.csv"] = pd.DataFrame(records)
    return (figure_html(png, declared.caption, covered=covered)
            + (f"<p>{esc(declared.covered_note)}</p>" if covered else "")
            + table_html([th("trial"), th("target eps"), th(declared.count_label),
                          *(th(c.label) for c in declared.columns)], rows))
