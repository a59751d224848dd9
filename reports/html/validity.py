"""What each epsilon is worth: the budget-matching table, DP validity and release safety, the
failed trials, and which results columns the epsilon covers.
"""

from __future__ import annotations

import pandas as pd

from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.vocabulary import OK, PRUNED
from dpsweep.reports.html.fmt import (
    CONTRADICTED_TAG,
    NOT_COVERED_TAG,
    REPLAYABLE_TAG,
    badge,
    count_text,
    esc,
    flags_html,
    flags_text,
    ids_text,
    int_text,
    note_html,
    num_text,
    schedule_text,
    sci_text,
    table_html,
    th,
)
from dpsweep.reports.html.records import RunData
from dpsweep.reports.pareto import sort_trials
from dpsweep.reports.store import COLUMNS

AUDIT_ERROR = "audit_error"
#: The stage a failure happened in (the failed-trials table and CSV, the at-a-glance line).
STAGE_TRAINING = "training"
STAGE_AUDIT = "audit"
#: The command that audits finished trials again without training them (``dpsweep reaudit``).
REAUDIT_COMMAND = "dpsweep reaudit RUN_DIR"


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


def budget_section(budget: pd.DataFrame) -> str:
    if budget.empty:
        return note_html("No finished DP trial: nothing was budgeted.")
    rows = [[esc(r["trial_id"]), esc(r["series"]), esc(r["schedule"]), sci_text(r["sample_rate"]),
             int_text(r["steps"]), sci_text(r["delta"]), num_text(r["target_epsilon"], 3),
             num_text(r["epsilon_lower"]), num_text(r["epsilon_estimate"]),
             num_text(r["epsilon_upper"]),
             esc(r["accountant"]), esc(r["accountant_fallback"] or "—"), flags_html(r)]
            for _, r in budget.iterrows()]
    return ("<p>Every trial is held to its target: the noise multiplier (sigma, or sigma_0 of a "
            "decaying schedule) is chosen so that the accountant's <b>upper</b> epsilon bound "
            "is at most the target. The lower bound and the estimate show how tight the claim "
            "is; RDP (the fallback) gives only an upper bound.</p>"
            + table_html([th("trial"), th("series"), th("sigma / schedule"), th("q"), th("steps"),
                          th("delta"), th("target eps"), th("eps lower"), th("eps estimate"),
                          th("eps upper"), th("accountant"), th("fallback"), th("DP validity")],
                         rows))


def validity_frame(data: RunData) -> pd.DataFrame:
    dp = data.dp
    return pd.DataFrame({
        "trial_id": dp["trial_id"], "series": dp["series"], "method": dp["method"],
        "mode": dp["mode"], "dp_valid": dp["dp_valid"], "validity_reason": dp["validity_reason"],
        "randomness": dp["randomness"], "release_safe": dp["release_safe"],
        "audit_contradicts": dp["audit_contradicts"],
        "flags": [flags_text(r) for _, r in dp.iterrows()]}).reset_index(drop=True)


def validity_section(validity: pd.DataFrame) -> str:
    if validity.empty:
        return note_html("No finished DP trial.")
    groups = validity.groupby(["series", "dp_valid", "validity_reason"], sort=True, dropna=False)
    rows, classes = [], []
    for (series, valid, reason), group in groups:
        ids = list(group["trial_id"])
        flags = ["valid" if valid else badge(INVALID_TAG)]
        for mask, tag, kind in ((group["audit_contradicts"], CONTRADICTED_TAG, "invalid"),
                                (~group["release_safe"], REPLAYABLE_TAG, "replay")):
            if mask.any():
                flags.append(badge(f"{tag}: {', '.join(group['trial_id'][mask])}", kind))
        rows.append([esc(series), " ".join(flags), str(len(ids)), esc(reason or "—"),
                     ids_text(ids)])
        classes.append("" if valid else "bad")
    invalid = int((~validity["dp_valid"]).sum())
    contradicted = validity[validity["audit_contradicts"]]
    replayable = validity[~validity["release_safe"]]
    lead = (f"<p>Finished trials flagged {badge(INVALID_TAG)}: <b>{invalid}</b> of "
            f"{len(validity)}. They follow a paper's algorithm whose privacy argument does not "
            "hold (a statistic computed from private data without noise), so their epsilon is "
            "not a guarantee. <code>dpsweep pick</code> refuses them unless given "
            "<code>--allow-invalid-dp</code>.</p>" if invalid else
            "<p>Every finished trial's epsilon claim holds by construction.</p>")
    lead += (f"<p>{badge(CONTRADICTED_TAG)}: <b>{len(contradicted)}</b> trial(s) "
             f"({ids_text(list(contradicted['trial_id']))}): a canary audit's lower bound exceeds "
             "the claimed epsilon.</p>" if len(contradicted) else
             "<p>No claim is contradicted by a canary audit.</p>")
    table = table_html([th("series"), th("DP validity"), th("trials"), th("reason"),
                        th("trial ids")], rows, row_classes=classes)
    if len(replayable):
        release = (f"<p>{badge(REPLAYABLE_TAG, 'replay')}: <b>{len(replayable)}</b> trial(s) "
                   f"({ids_text(list(replayable['trial_id']))}) ran with "
                   "<code>reproducible = true</code>: their noise and sampling are seeded, so "
                   "anyone with the seed can replay and subtract the noise; no epsilon holds "
                   "for their release. <code>pick</code> and <code>export</code> refuse them "
                   "unless given <code>--allow-replayable</code>.</p>")
    else:
        sources = ", ".join(sorted(set(validity["randomness"]) - {""})) or "—"
        release = (f"<p>Release safety: every finished trial drew its noise from a secret "
                   f"source ({esc(sources)}); none is replayable.</p>")
    return lead + table + "<h3>Release safety</h3>" + release


def failed_frame(data: RunData) -> pd.DataFrame:
    """Trials that failed in training, and finished trials whose audit failed."""
    frame = data.frame
    bad = frame[~frame["status"].isin([OK, PRUNED])]
    out = pd.DataFrame({"trial_id": bad["trial_id"], "series": bad["series"],
                        "stage": STAGE_TRAINING, "error": bad["error"]})
    audit_bad = frame[(frame["status"] == OK) & (frame[AUDIT_ERROR] != "")]
    out = pd.concat([out, pd.DataFrame({
        "trial_id": audit_bad["trial_id"], "series": audit_bad["series"], "stage": STAGE_AUDIT,
        "error": audit_bad[AUDIT_ERROR]})])
    return sort_trials(out).reset_index(drop=True)


def failed_section(failed: pd.DataFrame) -> str:
    if failed.empty:
        return "<p>No trial failed.</p>"
    rows = [[esc(r["trial_id"]), esc(r["series"]), esc(r["stage"]),
             esc(r["error"] or "(no reason recorded)")] for _, r in failed.iterrows()]
    training = int((failed["stage"] == STAGE_TRAINING).sum())
    audit = len(failed) - training
    return (f"<p>{count_text(training, 'trial')} failed in training; the sweep went on without "
            "them." + (f" {count_text(audit, 'finished trial')} could not be audited: "
                       f"<code>{REAUDIT_COMMAND}</code> audits them again from their stored "
                       "checkpoints, without training." if audit else "") + "</p>"
            + table_html([th("trial"), th("series"), th("stage"), th("reason")], rows))


def pruned_frame(data: RunData) -> pd.DataFrame:
    """Trials the pruner stopped: where, with what validation accuracy, at what epsilon."""
    frame = data.frame
    if "pruned_at" not in frame:
        return pd.DataFrame(columns=["trial_id", "series", "study", "pruned_at",
                                     "val_accuracy", "epsilon_spent", "target_epsilon"])
    cut = frame[frame["status"] == PRUNED][["trial_id", "series", "study", "pruned_at",
                                               "val_accuracy", "epsilon_spent",
                                               "target_epsilon"]]
    cut = cut.astype({"pruned_at": "int64"})
    return sort_trials(cut).reset_index(drop=True)


def pruned_section(pruned: pd.DataFrame, *, config: dict) -> str:
    sweep = config.get("sweep") if isinstance(config.get("sweep"), dict) else {}
    if sweep.get("pruner", "none") == "none" and pruned.empty:
        return "<p>No pruner: every trial ran all its epochs.</p>"
    lead = (f"<p>ASHA (asynchronous successive halving) at epoch rungs from "
            f"{esc(sweep.get('pruner_min_epochs', 1))}, factor "
            f"{esc(sweep.get('pruner_factor', 3))}: a trial continued past a rung only if its "
            "validation accuracy was in the top 1/factor of its study's earlier trials there. "
            f"{count_text(len(pruned), 'trial')} pruned; none is on a front or can be picked. "
            "Their epochs spent the epsilon shown, below the target.</p>")
    if pruned.empty:
        return lead
    by_rung = pruned.groupby("pruned_at").size()
    lead += "<p>Pruned per rung: " + ", ".join(
        f"epoch {int(r)}: {int(n)}" for r, n in by_rung.items()) + ".</p>"
    rows = [[esc(r["trial_id"]), esc(r["series"]), int_text(r["pruned_at"]),
             num_text(r["val_accuracy"]), num_text(r["epsilon_spent"]),
             num_text(r["target_epsilon"])] for _, r in pruned.iterrows()]
    return lead + table_html([th("trial"), th("series"), th("stopped at epoch"),
                              th("validation accuracy there"), th("epsilon spent"), th("target")],
                             rows)


def coverage_frame() -> pd.DataFrame:
    """Every results column, its dtype and whether the trials' epsilon covers it."""
    return pd.DataFrame([{"column": n, "dtype": c.dtype, "covered": c.covered,
                          "meaning": c.meaning} for n, c in COLUMNS.items()])


def coverage_section() -> str:
    rows = [[f"<code>{esc(name)}</code>", "covered" if column.covered else
             f'<span class="nc">{NOT_COVERED_TAG}</span>', esc(column.meaning)]
            for name, column in COLUMNS.items()]
    return ("<p>Which values the trials' epsilon covers. Values computed on private data "
            "without noise (validation and test metrics, every audit number) are not covered: "
            f"they carry <span class=\"nc\">{NOT_COVERED_TAG}</span> wherever they appear, stay "
            "in the run directory and are never exported.</p>"
            "<details><summary>Every results column</summary>"
            + table_html([th("column"), th("epsilon"), th("meaning")], rows) + "</details>")
