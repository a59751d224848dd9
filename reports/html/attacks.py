"""What the audits measured: leakage per series (with what the audit plan can and cannot see),
the per-layer x attack heat maps with the cells each audit did not score and why (a layer
frozen and shared with every reference is at chance by construction), ROC curves at the peak
cell (with a note when the reference models are weaker than the target), every front trial's
per-candidate scores (``mia_scores.parquet``), and the canary lower bounds on epsilon.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dpsweep.core import layout
from dpsweep.core.storage import atomic_write_text
from dpsweep.reports import plots
from dpsweep.reports.html.fmt import (
    CONTRADICTED_TAG,
    NOT_COVERED_TAG,
    badge,
    count_text,
    eps_tag,
    esc,
    figure_html,
    flags_html,
    flags_text,
    ids_text,
    int_text,
    note_html,
    num_text,
    sci_text,
    table_html,
    th,
)
from dpsweep.reports.html.fronts import front_trials_at
from dpsweep.reports.html.records import Records, RunData, as_float, plan_statement
from dpsweep.reports.html.svgroc import roc_legend, roc_svg
from dpsweep.reports.pareto import KIND_ALL, MIA, SCORED, Front, natural_key, sort_trials

#: Test-accuracy gap beyond which the report calls the audit's references weaker than the target.
REFERENCE_GAP = 0.05
#: The front trials' per-candidate audit scores (one row per trial and candidate).
SCORES_FILE = "mia_scores.parquet"


def leakage_frame(data: RunData) -> pd.DataFrame:
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
                                                                                    kv[0]))),
            "audit_plan": "" if top is None else plan_statement(data, top["trial_id"])})
    return pd.DataFrame(records, columns=[
        "series", "audited", "leaks", "strongest_trial", "strongest_epsilon", "peak_layer",
        "peak_attack", "peak_mia_accuracy", "leak_p_value", "significant_cells", "audit_plan"])


def leakage_section(leakage: pd.DataFrame) -> str:
    if leakage.empty:
        return note_html("No DP trial finished.")
    items = []
    for _, r in leakage.iterrows():
        name = f"<b>{esc(r['series'])}</b>"
        if r["audited"] == 0:
            items.append(f"<li>{name}: no trial was audited, so nothing can be said about "
                         "leakage.</li>")
        elif r["leaks"]:
            items.append(
                f"<li>{name}: <b>leakage detected</b> in {r['leaks']} of "
                f"{count_text(int(r['audited']), 'audited trial')}; strongest in "
                f"{esc(r['strongest_trial'])} (ε = {as_float(r['strongest_epsilon']):g}) at layer "
                f"<b>{esc(r['peak_layer'])}</b>, attack <b>{esc(r['peak_attack'])}</b> (accuracy "
                f"{num_text(r['peak_mia_accuracy'], 3)}, "
                f"corrected p = {sci_text(r['leak_p_value'])})"
                + (f"; significant layer × attack cells: {esc(r['significant_cells'])}"
                   if r["significant_cells"] else "") + ".</li>")
        else:
            items.append(
                f"<li>{name}: no leakage detected in any of "
                f"{count_text(int(r['audited']), 'audited trial')} (smallest corrected p-value "
                f"{sci_text(r['leak_p_value'])}, {esc(r['strongest_trial'])} at "
                f"{esc(r['peak_layer'])} × {esc(r['peak_attack'])}). Not detecting a leak at this "
                "sample size is not proof that none exists.</li>")
    return ("<p>A leak is detected when the peak attack's p-value, corrected for the number "
            f"of layers × attacks tested, is below the audit's alpha ({NOT_COVERED_TAG}).</p>"
            f"<ul>{''.join(items)}</ul>" + _plan_note(leakage))


def _plan_note(leakage: pd.DataFrame) -> str:
    """What the audit plans can and cannot see, once per distinct plan (each audit record
    states its own, generated from its plan)."""
    plans: dict[str, list[str]] = {}
    for _, r in leakage.iterrows():
        if isinstance(r.get("audit_plan"), str) and r["audit_plan"]:
            plans.setdefault(r["audit_plan"], []).append(str(r["series"]))
    if len(plans) == 1:
        return f"<p><b>What this audit can see.</b> {esc(next(iter(plans)))}</p>"
    return "".join(f"<p><b>What the audit of {esc(', '.join(series))} can see.</b> "
                   f"{esc(text)}</p>" for text, series in plans.items())


def _layer_sort(cell: dict[str, Any]) -> tuple[int, int]:
    index = as_float(cell.get("index"))
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


def heatmap_section(data: RunData, *, front_list: Sequence[Front], out: Path,
                    csvs: dict[str, pd.DataFrame]) -> str:
    parts = []
    for target in data.info.targets:
        chosen = front_trials_at(front_list, target)
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
                       (as_float(c.get("accuracy")), c.get("significant") is True) for c in cells},
                peak=(r["peak_layer"], r["peak_attack"])))
            records += [{"trial_id": r["trial_id"], "series": r["series"],
                         "layer": c.get("layer"), "index": c.get("index"),
                         "attack": c.get("attack"), "accuracy": as_float(c.get("accuracy")),
                         "significant": c.get("significant") is True,
                         "p_value": as_float(c.get("p_value"))} for c in cells]
        tag = eps_tag(target)
        png = plots.mia_heatmap(rows, columns=columns,
                                title=f"Attack accuracy per layer × attack, front trials at "
                                      f"ε = {target:g}", path=out / f"mia_heatmap_{tag}.png")
        csvs[f"mia_heatmap_{tag}.csv"] = pd.DataFrame(records)
        more = len(rows) - plots.MAX_HEAT_ROWS
        parts.append(f"<h3>ε = {target:g}</h3>"
                     + figure_html(png, f"Per-layer × attack MIA accuracy of the front trials at "
                                   f"ε = {target:g}", wide=True)
                     + (note_html(f"{more} more front trials in the CSV.") if more > 0 else ""))
    unscored = unscored_section(unscored_frame(data))
    if not parts:
        return note_html("No heat map: no front trial has per-layer MIA results.") + unscored
    return ("<p>Rows: trials on a front at that target; columns: layers from input to output "
            "(the output last), each with its attacks; colour centred on 0.5 (chance): red = "
            "the attack beats guessing, blue = below it. Faded cells with grey values are not "
            "significant after correction for the number of scored layers × attacks (n.s.); "
            "bold values with * are significant; the black box is the trial's peak; plain "
            "grey cells without a value were not scored (below). Per-cell intervals, AUC and "
            "TPR at low FPR are in <code>mia_layers.csv</code>.</p>"
            + "\n".join(parts) + unscored)


def _scored(cell: dict[str, Any]) -> bool:
    return str(cell.get("status", SCORED)) == SCORED


def unscored_frame(data: RunData) -> pd.DataFrame:
    """One row per (layer, status, reason) that some audited trial did not score, with the
    trials and the attacks concerned."""
    groups: dict[tuple[str, str, str], tuple[list[str], list[str]]] = {}
    for tid in data.ok["trial_id"]:
        for cell in data.parsed[tid]["mia_layers"]:
            if _scored(cell):
                continue
            key = (str(cell.get("layer", "?")), str(cell.get("status", "?")),
                   str(cell.get("reason", "")))
            trials, attacks = groups.setdefault(key, ([], []))
            if tid not in trials:
                trials.append(tid)
            if str(cell.get("attack", "?")) not in attacks:
                attacks.append(str(cell.get("attack", "?")))
    rows = [{"layer": layer, "status": status, "reason": reason, "trials": len(trials),
             "trial_ids": " ".join(trials), "attacks": " ".join(attacks)}
            for (layer, status, reason), (trials, attacks) in groups.items()]
    return pd.DataFrame(rows, columns=["layer", "status", "reason", "trials", "trial_ids",
                                       "attacks"])


def unscored_section(frame: pd.DataFrame) -> str:
    """The cells no audit scored, per layer and reason: they are outside every peak, its upper
    bound and the multiple-testing correction."""
    if frame.empty:
        return ""
    items = [f"<li>layer <b>{esc(r['layer'])}</b> ({esc(r['status'])}; "
             f"{esc(r['attacks'])}) in {count_text(int(r['trials']), 'trial')} "
             f"({ids_text(str(r['trial_ids']).split())}): {esc(r['reason'])}</li>"
             for _, r in frame.iterrows()]
    return ("<p><b>Not scored.</b> These layer × attack cells are reported, not scored: they "
            "are outside the peak, its upper bound and the correction for the number of "
            "layers × attacks, which count the scored cells only.</p>"
            f"<ul>{''.join(items)}</ul>")


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


def canary_section(canary: pd.DataFrame) -> str:
    if canary.empty:
        return ("<p>No canary audit has run. <code>dpsweep audit RUN_DIR --trial T</code> "
                "trains with m canaries and turns how well they are guessed into an empirical "
                "95% lower bound on epsilon.</p>")
    rows, classes = [], []
    for _, r in canary.iterrows():
        rows.append([esc(r["trial_id"]), esc(r["series"]), num_text(r["target_epsilon"], 3),
                     num_text(r["eps_lower_bound"], 3), esc(r["kind"] or "—"),
                     int_text(r["canaries"]),
                     num_text(r["claimed_epsilon"], 3),
                     badge(CONTRADICTED_TAG) if r["audit_contradicts"] else "no",
                     flags_html(r)])
        classes.append("bad" if r["audit_contradicts"] else "")
    contradicted = int(canary["audit_contradicts"].sum())
    lead = (f"<p><b>{contradicted}</b> claim(s) contradicted: the empirical lower bound exceeds "
            "the claimed epsilon, so that claim cannot hold.</p>" if contradicted else
            "<p>No claimed epsilon is contradicted by its canary audit (a lower bound below "
            "the claim is consistent with it, not a proof of it).</p>")
    return lead + table_html([th("trial"), th("series"), th("target eps"),
                              th("epsilon lower bound (95%)", "eps_lower_bound"), th("kind"),
                              th("canaries m"), th("claimed epsilon"), th(CONTRADICTED_TAG),
                              th("DP validity")], rows, row_classes=classes)


def _curve(entry: Any) -> tuple[list[float], list[float]] | None:
    """An attack entry's ROC points (``roc_fpr`` / ``roc_tpr``, as the audit writes them)."""
    if not isinstance(entry, dict):
        return None
    fpr, tpr = entry.get("roc_fpr"), entry.get("roc_tpr")
    if isinstance(fpr, list) and isinstance(tpr, list) and len(fpr) == len(tpr) and fpr:
        return [as_float(v) for v in fpr], [as_float(v) for v in tpr]
    return None


def roc_by_cell(document: Any) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """ROC points per (layer, attack) from an audit.json's ``attacks`` list."""
    found: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    entries = document.get("attacks") if isinstance(document, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        curve = _curve(entry)
        if curve is not None:
            found.setdefault((str(entry.get("layer")), str(entry.get("attack", ""))), curve)
    return found


def roc_section(data: RunData, *, front_list: Sequence[Front], records: Records, out: Path,
                csvs: dict[str, pd.DataFrame]) -> str:
    curves, rows, missing = [], [], []
    targets = []
    for front in front_list:
        if front.kind != KIND_ALL:
            continue
        for _, r in front.trials.iterrows():
            document = records.audits.get(r["trial_id"])
            if document is None:
                missing.append(f"{r['trial_id']} (no {layout.AUDIT})")
                continue
            cells = roc_by_cell(document)
            curve = cells.get((r["peak_layer"], r["peak_attack"]))
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
        title = (f"ROC at the peak layer × attack, front over all series, "
                 f"{plots.eps_text(targets)}")
        svg = roc_svg(curves, title=title)
        atomic_write_text(out / "roc.svg", svg)
        csvs["roc.csv"] = pd.DataFrame(rows)
        text = (f"<figure>{svg}<figcaption>ROC of the peak layer × attack for the trials on "
                "the front over all series, log-log (<code>roc.svg</code>, data in "
                "<code>roc.csv</code>). Point at a line for its trial and its TPR at 1% and "
                "0.1% FPR. "
                f'<span class="nc">{NOT_COVERED_TAG}</span></figcaption></figure>'
                + roc_legend(curves)
                + "<p>The true positive rate at 1% and 0.1% false positive rate (grey lines) is "
                  "the headline number for strong attacks; per cell in "
                  "<code>mia_layers.csv</code>.</p>")
    else:
        text = note_html("No ROC: no front trial has ROC points.")
    if missing:
        text += note_html("No ROC drawn for: " + esc("; ".join(missing)) + ".")
    return text + _scores_text(records, out=out) + _reference_note(front_list, records)


def scores_frame(records: Records) -> pd.DataFrame:
    """One row per (front trial, audited candidate): its pool index, membership and score per
    ``<layer>/<attack>`` (larger = member), as the trial's audit_scores.npz stores them."""
    frames = [frame.assign(trial_id=tid)[["trial_id", *frame.columns]]
              for tid, frame in sorted(records.scores.items(), key=lambda kv: natural_key(kv[0]))]
    if not frames:
        return pd.DataFrame(columns=["trial_id", "pool_index", "is_member"])
    return pd.concat(frames, ignore_index=True)


def _scores_text(records: Records, *, out: Path) -> str:
    """Write the front trials' per-candidate scores beside the page and say what they are."""
    frame = scores_frame(records)
    if frame.empty:
        return note_html("No per-candidate audit scores: the front trials' audits predate them.")
    frame.to_parquet(out / SCORES_FILE, index=False)
    return (f"<p>Every front trial's audited candidates are in <code>{SCORES_FILE}</code>: "
            "pool index, membership and one float32 score per layer × attack (larger = "
            "member), the exact values the statistics above were computed from; every audited "
            "trial keeps its own in <code>trials/&lt;id&gt;/audit_scores.npz</code>, and "
            "<code>docs/reanalyse_audit.py RUN_DIR TRIAL</code> recomputes the recorded AUC and "
            "TPR at 1% FPR from it.</p>")


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
            refs = [as_float(x.get("test_accuracy")) for x in document.get("references", [])
                    if isinstance(x, dict)]
            if isinstance(note, str) and note and refs:
                notes.setdefault(note, []).append((float(np.nanmean(refs)),
                                                   as_float(r.get("test_accuracy"))))
    out = []
    for note, pairs in notes.items():
        ref, own = (float(np.nanmean([p[i] for p in pairs])) for i in (0, 1))
        weaker = (" References weaker than the audited model make the calibrated attacks "
                  "weaker: these attack numbers understate what an audit with references "
                  "like the target would find." if ref < own - REFERENCE_GAP else "")
        out.append(note_html(esc(f"Reference models: {note}. Their mean test accuracy is "
                                 f"{ref:.2f}, the audited models' {own:.2f}.{weaker}")))
    return "".join(out)


def mia_layers_frame(data: RunData) -> pd.DataFrame:
    """Long table: one row per (trial, layer, attack), every scalar the audit stored (intervals
    split into _lo / _hi)."""
    records = []
    for _, r in data.ok.iterrows():
        for cell in data.parsed[r["trial_id"]]["mia_layers"]:
            flat: dict[str, Any] = {}
            for k, v in cell.items():
                if isinstance(v, list) and len(v) == 2 and k.endswith("_ci"):
                    flat[f"{k}_lo"], flat[f"{k}_hi"] = as_float(v[0]), as_float(v[1])
                elif isinstance(v, (int, float, str, bool)) or v is None:
                    flat[k] = v
            records.append({"trial_id": r["trial_id"], "series": r["series"], **flat})
    if not records:
        return pd.DataFrame(columns=["trial_id", "series", "layer", "attack", "accuracy"])
    frame = pd.DataFrame(records)
    fixed = ["trial_id", "series"]
    return frame[fixed + sorted(c for c in frame.columns if c not in fixed)]
