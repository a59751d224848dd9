"""Pareto fronts (validation accuracy vs peak MIA, ties kept), their hypervolumes, the trials kept
off them, and the per-trial table (trials.csv) that records which fronts hold each trial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.storage import atomic_write_text
from dpsweep.reports import plots
from dpsweep.reports.html.fmt import (
    NOT_COVERED_TAG,
    REPLAYABLE_TAG,
    TEST_NOTE,
    ci_text,
    count_text,
    eps_tag,
    esc,
    flags_html,
    flags_text,
    hyperparameters_text,
    ids_text,
    note_html,
    num_text,
    sci_text,
    table_html,
    th,
)
from dpsweep.reports.html.records import RunData, as_float
from dpsweep.reports.html.svgfront import front_svg, legend_html
from dpsweep.reports.pareto import (
    ACC,
    ACC_HI,
    ACC_LO,
    KIND_ALL,
    KIND_STUDY,
    KIND_VALID,
    MIA,
    MIA_HI,
    MIA_LO,
    NONPRIVATE,
    REFERENCE,
    Front,
    exclusion_reasons,
    sort_trials,
)
from dpsweep.reports.store import DEGENERATE_MARGIN


def chance_halfwidth(points: pd.DataFrame) -> float:
    """Median upper half-width of the peak-MIA intervals: peaks inside 0.5 +- this are
    indistinguishable from guessing at the audit's sample size."""
    widths = (points[MIA_HI] - points[MIA]).to_numpy(dtype=float)
    widths = widths[np.isfinite(widths) & (widths > 0)]
    return float(np.median(widths)) if widths.size else math.nan


def baseline_point(data: RunData) -> plots.Baseline | None:
    """The non-private baseline's point on the figures, or None without one."""
    rows = data.ok[data.ok["method"] == NONPRIVATE]
    if rows.empty:
        return None
    row = rows.iloc[0]
    return plots.Baseline(val_accuracy=float(row[ACC]), test_accuracy=float(row["test_accuracy"]),
                          peak_mia=float(row[MIA]))


def front_point_rows(front_list: Sequence[Front]) -> pd.DataFrame:
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
    headers = [th("trial"), th("series"), th("DP validity"), th("on fronts"),
               th("validation accuracy [95%]", ACC),
               th(f"test accuracy ({TEST_NOTE})", "test_accuracy"),
               th("peak MIA accuracy [95%]", MIA),
               th("peak at; leak (corrected p)", "peak_layer"), th("sigma; eps ≤"),
               th("hyperparameters")]
    body, classes = [], []
    for _, r in rows.iterrows():
        tid = r["trial_id"]
        leak = ("leak" if r["leak_detected"] else "no leak") + f" (p {sci_text(r['leak_p_value'])})"
        phases = len(data.parsed[tid]["noise_schedule"])
        sigma = ("σ0 " if phases > 1 else "") + num_text(r["noise_multiplier"], 3)
        hyper = hyperparameters_text(r, data.parsed[tid]["method_params"],
                                     prepared=data.prepared.get(r["method"], ()))
        body.append([
            esc(tid), esc(r["series"]), flags_html(r),
            esc(", ".join(membership.get(tid, []))),
            ci_text(r[ACC], r[ACC_LO], r[ACC_HI]), num_text(r["test_accuracy"], 3),
            ci_text(r[MIA], r[MIA_LO], r[MIA_HI]),
            esc(f"{r['peak_layer'] or '—'} × {r['peak_attack'] or '—'}") + f"<br>{esc(leak)}",
            f"{esc(sigma)}; {num_text(r['epsilon_upper'], 3)}",
            f'<span class="hp">{hyper}</span>'])
        classes.append("" if bool(r["dp_valid"]) and bool(r["release_safe"]) else "bad")
    return table_html(headers, body, row_classes=classes, cls="fronttable")


def front_section(data: RunData, *, front_list: Sequence[Front], pool: pd.DataFrame,
                  out: Path, csvs: dict[str, pd.DataFrame]) -> str:
    if pool.empty:
        return note_html("No front: no finished, audited, non-degenerate DP trial (see "
                         "<a href=\"#excluded\">kept off the fronts</a>).")
    baseline = baseline_point(data)
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
            parts.append(f"<h3>ε = {target:g}</h3>"
                         + note_html("No eligible trial at this target."))
            continue
        overall = next(f for f in here if f.kind == KIND_ALL)
        study_fronts = {f.series: set(f.trial_ids) for f in here if f.kind == KIND_STUDY}
        deltas = sorted({float(d) for d in at["delta"] if math.isfinite(as_float(d))})
        half = chance_halfwidth(at)
        tag = eps_tag(target)
        colours = plots.series_colours(pool["series"])
        hyper = {r["trial_id"]: hyperparameters_text(
            r, data.parsed[r["trial_id"]]["method_params"],
            prepared=data.prepared.get(r["method"], ())) for _, r in at.iterrows()}
        svg, skipped = front_svg(at, study_fronts=study_fronts, overall=overall.trials,
                                          colours=colours, hyper=hyper, half=half,
                                          baseline=baseline, eps=target,
                                          delta=deltas[0] if deltas else math.nan)
        atomic_write_text(out / f"front_{tag}.svg", svg)
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
            + f'<figure>{svg}<figcaption>Pareto fronts at ε = {target:g} '
              f"(<code>front_{tag}.svg</code>, data in <code>front_{tag}.csv</code>). Hover "
              "a point for its trial, method, hyperparameters, accuracies and peak MIA"
              + (f"; {count_text(skipped, 'label')} left off where it would overlap another"
                 if skipped else "")
              + f'. <span class="nc">{NOT_COVERED_TAG}</span></figcaption></figure>'
            + legend_html(colours)
            + "<p>Colour = series; joined points = that series' front; faded points are "
              "dominated within their series; the wide grey staircase is the front over all "
              f"series; crosses: {INVALID_TAG}; hollow: {REPLAYABLE_TAG}; dashed line and "
              "star: the non-private baseline; grey band: chance.</p>"
            + f"<p>Front over all series: <b>{ids_text(overall.trial_ids)}</b>. Front over "
              f"valid-DP, release-safe trials: <b>{ids_text(valid.trial_ids) or 'none'}</b>. "
              "In the table, <i>on fronts</i> says which fronts at this target hold the trial: "
              "<i>all</i> series, <i>valid</i> DP and release-safe, its <i>own</i> series.</p>"
            + _front_table(data, on_any, membership))
    return "\n".join(parts)


def hypervolume_section(front_list: Sequence[Front], *, num_classes: int) -> str:
    if not front_list:
        return note_html("No hypervolumes: no front.")
    rows = [[esc(f.name), num_text(f.target_epsilon, 3), str(f.pool_size), str(len(f.trials)),
             num_text(f.hypervolume), ids_text(list(f.trial_ids))] for f in front_list]
    chance = 1.0 / num_classes
    return (f"<p>Area each front dominates on normalised axes: accuracy above chance "
            f"(val_acc − {chance:g}) / (1 − {chance:g}) and attack advantage 2 × peak MIA − 1, "
            f"both clipped to [0, 1], against the <b>reference point ({REFERENCE[0]:g}, "
            f"{REFERENCE[1]:g})</b>: no accuracy above chance, an attacker with advantage 1. "
            "Point estimates; 1 is a perfect classifier no attack beats chance on; larger is "
            "better.</p>"
            + table_html([th("front"), th("target eps"), th("trials in pool"), th("front size"),
                          th("hypervolume", ACC), th("front trials")], rows))


def hypervolume_frame(front_list: Sequence[Front], *, num_classes: int) -> pd.DataFrame:
    """One row per front: its hypervolume and the reference point it is measured from."""
    return pd.DataFrame(
        [{"front": f.name, "kind": f.kind, "target_epsilon": f.target_epsilon,
          "series": f.series, "trials": f.pool_size, "front_size": len(f.trials),
          "hypervolume": f.hypervolume, "reference_accuracy_above_chance": REFERENCE[0],
          "reference_attack_advantage": REFERENCE[1], "chance_accuracy": 1.0 / num_classes,
          "front_trials": " ".join(f.trial_ids)} for f in front_list],
        columns=["front", "kind", "target_epsilon", "series", "trials", "front_size",
                 "hypervolume", "reference_accuracy_above_chance", "reference_attack_advantage",
                 "chance_accuracy", "front_trials"])


def excluded_section(excluded: pd.DataFrame) -> str:
    if excluded.empty:
        return "<p>Every trial is eligible for the fronts.</p>"
    rows = [[esc(r["trial_id"]), esc(r["series"] or "—"), num_text(r["target_epsilon"], 3),
             esc(r["reason"])] for _, r in excluded.iterrows()]
    counts = excluded["reason"].map(lambda s: s.split(":")[0].split(" (")[0]).value_counts()
    lead = "; ".join(f"{n} {esc(k)}" for k, n in sorted(counts.items()))
    return (f"<p>Kept off every front and every pick ({lead}). Degenerate means validation "
            f"accuracy below chance + {DEGENERATE_MARGIN:g}: such a model has learned nothing "
            "and would sit on the front only because no attack beats a constant.</p>"
            + table_html([th("trial"), th("series"), th("target eps"), th("reason")], rows))


def front_trials_at(front_list: Sequence[Front], target: float) -> pd.DataFrame:
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


def trials_frame(data: RunData, front_list: Sequence[Front], pool: pd.DataFrame
                 ) -> pd.DataFrame:
    """Every trial with its exclusion reason, front memberships, intervals and flags:
    trials.csv."""
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
