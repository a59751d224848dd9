"""How training went: validation curves of the front trials, privacy-utility across targets
(best configuration and its re-runs), and WW-DP-SGD's clipping-norm trajectories.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core import layout
from reports import plots
from reports.html.fmt import (
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
from reports.html.fronts import baseline_point, front_trials_at
from reports.html.records import Records, RunData, as_float
from reports.pareto import ACC, MIA, Front, natural_key, sort_trials

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


def _series_values(traj: dict[str, Any], key: str) -> tuple[float, ...]:
    """One logged trajectory (the keys ww_dpsgd's ``trajectories`` writes); () when absent."""
    values = traj.get(key)
    return tuple(as_float(v) for v in values) if isinstance(values, list) else ()


def ww_section(data: RunData, *, out: Path, csvs: dict[str, pd.DataFrame]) -> str:
    ww = data.dp[data.dp["method"] == "ww_dpsgd"]
    trajs, rows, records = [], [], []
    for _, r in ww.iterrows():
        traj = data.parsed[r["trial_id"]]["trajectories"]
        params = data.parsed[r["trial_id"]]["method_params"]
        clip = _series_values(traj, "clip_norm")
        zeta_hat = _series_values(traj, "zeta_hat")
        if not clip and not zeta_hat:
            continue
        n = max(len(clip), len(zeta_hat))
        steps = _series_values(traj, "step") or tuple(float(i + 1) for i in range(n))
        c0 = float(r["clip_norm"])
        if clip and math.isfinite(c0) and len(steps) >= len(clip):
            c_steps, clip_line = (0.0, *steps[:len(clip)]), (c0, *clip)  # C_0 until the probe
        else:
            c_steps, clip_line = steps, clip
        zeta = _series_values(traj, "zeta")
        trajs.append(plots.Trajectory(
            label=f"{r['trial_id']} (ε {r['target_epsilon']:g})", steps=steps,
            clip_steps=c_steps, clip_norm=clip_line, zeta_hat=zeta_hat, zeta=zeta,
            zeta_star=as_float(params.get("zeta_star")), radius=as_float(params.get("radius"))))
        for k in range(n):
            records.append({"trial_id": r["trial_id"], "target_epsilon": r["target_epsilon"],
                            "step": steps[k] if k < len(steps) else math.nan,
                            "clip_norm": clip[k] if k < len(clip) else math.nan,
                            "zeta_hat": zeta_hat[k] if k < len(zeta_hat) else math.nan,
                            "zeta": zeta[k] if k < len(zeta) else math.nan})
        clamp = _series_values(traj, "clamp")
        rows.append([esc(r["trial_id"]), num_text(r["target_epsilon"], 3), str(n),
                     num_text(r["clip_norm"]), num_text(clip[-1]) if clip else "—",
                     f"{num_text(min(clip))} – {num_text(max(clip))}" if clip else "—",
                     num_text(zeta_hat[-1], 3) if zeta_hat else "—",
                     str(sum(1 for c in clamp if c and c == c)) if clamp else "—"])
    if not trajs:
        return note_html("No WW-DP-SGD trajectories (no finished ww_dpsgd trial logged C_t).")
    targets = [t for t in data.info.targets if t in set(ww["target_epsilon"])]
    png = plots.ww_trajectories(trajs, title=f"WW-DP-SGD, {plots.eps_text(targets)}",
                                path=out / "ww_trajectories.png")
    csvs["ww_trajectories.csv"] = pd.DataFrame(records)
    return (figure_html(png, "WW-DP-SGD clipping norm and tail exponent trajectories", covered=True)
            + "<p>Computed from the released noisy updates (post-processing): covered by "
              "epsilon.</p>"
            + table_html([th("trial"), th("target eps"), th("probes"), th("C_0"), th("final C"),
                          th("C range"), th("final zeta^"), th("clamp hits")], rows))
