"""The report's decision: the trial ``dpsweep pick`` would release at the stated thresholds, for
the whole run and per series, with the rule, why it won, its epsilon statement and the command;
or why none qualifies and what to relax. It calls ``reports.pick`` itself, so the report and
``pick`` cannot disagree.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from typing import Any

import pandas as pd

from dpsweep.core.errors import UserInputError
from dpsweep.reports.html.fmt import ci_text, esc, num_text, table_html, th
from dpsweep.reports.html.fronts import chance_halfwidth
from dpsweep.reports.html.records import RunData, as_float
from dpsweep.reports.pareto import (
    ACC,
    ACC_HI,
    ACC_LO,
    MIA,
    MIA_HI,
    MIA_LO,
    MIA_UPPER,
    NONPRIVATE,
    eligible,
)
from dpsweep.reports.pick import (
    PRIVATE_RULE,
    SUGGESTED_MAX_PEAK_MIA,
    TIE_RULE,
    Choice,
    choose,
    choose_private,
)

#: Where ``--export`` writes, as the shown command names it.
EXPORT_PLACEHOLDER = "RELEASE_DIR"
#: The class of the recommendation's box (the Chromium test looks for it).
DECISION_CLASS = "decision"
PRIVATE = "private"


def _is_private(data: RunData) -> bool:
    """Whether the sweep tuned privately (summary.json, else config.toml's declaration)."""
    tuning = data.info.summary.get("tuning")
    mode = tuning.get("mode") if isinstance(tuning, dict) else None
    sweep = data.info.config.get("sweep")
    declared = sweep.get("tuning") if isinstance(sweep, dict) else None
    return str(mode or declared or "") == PRIVATE


def pick_command(data: RunData, *, series: str | None = None, export: bool = False,
                 private: bool = False) -> str:
    """The ``dpsweep pick`` line that makes the choice shown (with ``--export``: releases it)."""
    words = ["dpsweep", "pick", str(data.run_dir.resolve())]
    if not private:
        words += ["--max-peak-mia", f"{SUGGESTED_MAX_PEAK_MIA:g}"]
    if series:
        words += ["--series", series]
    if export:
        words += ["--export", EXPORT_PLACEHOLDER]
    return " ".join(shlex.quote(w) for w in words)


def _choose(data: RunData, *, series: str | None, max_peak_mia: float | None
            ) -> Choice | UserInputError:
    try:
        return choose(data.frame, validation_size=data.info.validation_size,
                      max_peak_mia=max_peak_mia, series=series)
    except UserInputError as err:
        return err


def _epsilon_text(row: dict[str, Any]) -> str:
    valid = ("valid DP claim" if bool(row.get("dp_valid")) else
             f"epsilon claim invalid: {row.get('validity_reason') or ''}")
    return (f"ε ≤ {num_text(row.get('epsilon_upper'), 4)} at δ = "
            f"{as_float(row.get('delta')):g} (target ε = {as_float(row['target_epsilon']):g}, "
            f"{esc(row.get('accountant') or '—')} accountant), {esc(valid)}. It covers training "
            "this one model with its hyperparameters taken as given, not the search that chose "
            'it (<a href="#tuning">privacy cost of tuning</a>); the export\'s privacy statement '
            "says the same.")


def _chance_text(choice: Choice, *, qualifying: pd.DataFrame, half: float) -> str:
    """What the grey chance band means for this choice: whether the audit can rank the
    qualifying trials by leakage at all."""
    if not math.isfinite(half) or qualifying.empty:
        return ""
    inside = (qualifying[MIA] - 0.5).abs() <= half
    band = f"the chance band 0.5 ± {half:.3f} (grey on the fronts)"
    lowest = float(pd.to_numeric(qualifying[MIA_UPPER], errors="coerce").min())
    if bool(inside.all()):
        return (f"Every qualifying trial's peak MIA lies inside {band}: at this audit's size no "
                "attack is told apart from guessing, so the audit cannot rank them by leakage "
                "and the choice rests on validation accuracy. A stricter --max-peak-mia does "
                f"not separate them: the lowest upper bound is {lowest:.3f}, and below it "
                "nothing qualifies.")
    chosen_inside = bool(inside[qualifying["trial_id"] == choice.trial_id].any())
    return (f"{int(inside.sum())} of {len(qualifying)} qualifying trials have their peak inside "
            f"{band}; the chosen one's is {'inside' if chosen_inside else 'above'} it"
            + ("." if chosen_inside else
               ": the attack beats guessing on it, and a lower --max-peak-mia trades "
               "validation accuracy for less measured leakage."))


def _why_text(choice: Choice, *, qualifying: pd.DataFrame) -> str:
    row = choice.trial
    text = (f"the highest validation accuracy, {ci_text(row[ACC], row[ACC_LO], row[ACC_HI])}, "
            f"of {len(qualifying)} qualifying front trials; peak MIA "
            f"{ci_text(row[MIA], row[MIA_LO], row[MIA_HI])}, upper bound "
            f"{num_text(row.get(MIA_UPPER), 3)} ≤ {SUGGESTED_MAX_PEAK_MIA:g}.")
    if choice.ties:
        ids = ", ".join(esc(t["trial_id"]) for t in choice.ties)
        text += (f" Tied within the validation intervals: {ids} (pick's tie rule: "
                 f"{esc(TIE_RULE)}; prefer one of them with --series).")
    return text


def _decision(data: RunData, choice: Choice, *, private: bool) -> str:
    row = choice.trial
    pool = eligible(data.frame, validation_size=data.info.validation_size)
    qualifying = pool[pool["trial_id"].isin(choice.qualifying)]
    rule = (PRIVATE_RULE if private else
            f"among the valid-DP, release-safe trials on the front over every target and "
            f"series, those whose peak MIA upper bound is ≤ {SUGGESTED_MAX_PEAK_MIA:g}; the "
            "highest validation accuracy wins (test accuracy is never read)")
    items = [("Rule", esc(rule))]
    if not private:
        items.append(("Why it won", _why_text(choice, qualifying=qualifying)))
    items.append(("Epsilon", _epsilon_text(row)))
    if not private:
        chance = _chance_text(choice, qualifying=qualifying,
                              half=chance_halfwidth(pool))
        if chance:
            items.append(("Chance band", esc(chance)))
    items.append(("Release it", f"<code>{esc(pick_command(data, export=True, private=private))}"
                                "</code>"))
    lis = "".join(f"<li><b>{name}:</b> {text}</li>" for name, text in items)
    return (f'<div class="{DECISION_CLASS}"><p class="verdict">Release '
            f'<b id="recommended">{esc(choice.trial_id)}</b> ({esc(row["series"])}, ε = '
            f"{as_float(row['target_epsilon']):g}): what "
            f"<code>{esc(pick_command(data, private=private))}</code> chooses.</p>"
            f"<ul>{lis}</ul></div>")


def _relax_text(data: RunData, *, series: str | None, err: UserInputError) -> str:
    """Why nothing qualifies, and the smallest --max-peak-mia that would admit a trial."""
    loose = _choose(data, series=series, max_peak_mia=None)
    if isinstance(loose, UserInputError):
        return esc(loose.allowed)
    front = data.frame[data.frame["trial_id"].isin(loose.front)]
    lowest = float(pd.to_numeric(front[MIA_UPPER], errors="coerce").min())
    return (f"none qualifies at --max-peak-mia {SUGGESTED_MAX_PEAK_MIA:g} ({esc(err.allowed)}). "
            + (f"The lowest upper bound on this front is {lowest:.3f}: "
               f"<code>--max-peak-mia {math.ceil(lowest * 100) / 100:g}</code> admits a trial."
               if math.isfinite(lowest) else ""))


def _series_rows(data: RunData, names: Sequence[str]) -> list[list[str]]:
    rows = []
    for name in names:
        got = _choose(data, series=name, max_peak_mia=SUGGESTED_MAX_PEAK_MIA)
        if isinstance(got, UserInputError):
            rows.append([esc(name), _relax_text(data, series=name, err=got), "", "", ""])
            continue
        r = got.trial
        rows.append([esc(name), f"<b>{esc(got.trial_id)}</b> (ε = "
                                f"{as_float(r['target_epsilon']):g}, ε ≤ "
                                f"{num_text(r.get('epsilon_upper'), 3)})",
                     ci_text(r[ACC], r[ACC_LO], r[ACC_HI]),
                     ci_text(r[MIA], r[MIA_LO], r[MIA_HI])
                     + f" (upper {num_text(r.get(MIA_UPPER), 3)})",
                     f"<code>--series {esc(name)}</code>"])
    return rows


def recommended(data: RunData) -> Choice | UserInputError:
    """The run's recommendation (or why there is none), shared by the decision box and the
    at-a-glance line so the two cannot name different trials."""
    if _is_private(data):
        try:
            return choose_private(data.frame)
        except UserInputError as err:
            return err
    return _choose(data, series=None, max_peak_mia=SUGGESTED_MAX_PEAK_MIA)


def recommend_section(data: RunData) -> str:
    """The decision box for the whole run, then one row per series."""
    private = _is_private(data)
    whole = recommended(data)
    if isinstance(whole, Choice):
        parts = [_decision(data, whole, private=private)]
    else:
        parts = [f'<div class="{DECISION_CLASS}"><p class="verdict"><b>No trial qualifies</b> '
                 f"for <code>{esc(pick_command(data, private=private))}</code>: "
                 + (_relax_text(data, series=None, err=whole) if not private
                    else esc(whole.allowed)) + "</p></div>"]
    if private:
        parts.append("<p>Private tuning releases one model, the search's best noisy score: a "
                     "choice per series is not covered by its end-to-end epsilon.</p>")
        return "\n".join(parts)
    names = sorted({str(s) for s in data.frame["series"].dropna()} - {"", NONPRIVATE})
    parts.append(
        f"<p>Per series, what <code>dpsweep pick RUN_DIR --max-peak-mia "
        f"{SUGGESTED_MAX_PEAK_MIA:g} --series S</code> would release (the same rule within "
        "one series):</p>"
        + table_html([th("series"), th("pick"), th("validation accuracy [95%]", ACC),
                      th("peak MIA [95%]", MIA), th("pick with")], _series_rows(data, names)))
    return "\n".join(parts)
