"""The page's opening: the run's facts (data, model, budget, software, time), the headline per
target, and what the hyperparameter search costs in privacy (private vs adaptive tuning).
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.vocabulary import OK, PRUNED, SPLIT_NAMES
from dpsweep.reports.html.fmt import (
    CONTRADICTED_TAG,
    NOT_COVERED_TAG,
    REPLAYABLE_TAG,
    count_text,
    esc,
    facts_table,
)
from dpsweep.reports.html.recommend import recommended
from dpsweep.reports.html.records import RunData, as_float
from dpsweep.reports.html.validity import REAUDIT_COMMAND, STAGE_AUDIT, failed_frame
from dpsweep.reports.pareto import KIND_VALID, Front, exclusion_reasons, natural_key
from dpsweep.reports.pick import Choice


def when_text(value: Any) -> str:
    """A timestamp as UTC text (summary.json stores POSIX seconds; other text is shown as is)."""
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


def _attempts_text(summary: dict[str, Any]) -> str:
    """How the wall time splits over a resumed run's attempts (nothing for a single one)."""
    attempts = as_float(summary.get("attempts"))
    unended = as_float(summary.get("attempts_without_end"))
    if not (math.isfinite(attempts) and attempts > 1):
        return ""
    text = f" over {attempts:.0f} attempts (the run and its resumes)"
    if math.isfinite(unended) and unended > 0:
        text += (f"; {count_text(int(unended), 'attempt')} killed with no recorded end, "
                 "whose time is not counted")
    return text


def _deploy_text(data: RunData) -> str:
    """Which trial to deploy, as a pointer to the recommendation (which says why) rather
    than a list of front ids to choose from."""
    choice = recommended(data)
    if isinstance(choice, Choice):
        return (f'Deploy <a href="#recommend"><b>{esc(choice.trial_id)}</b></a>: the '
                "recommendation above says why and how to release it.")
    return 'No trial to deploy at the stated bound: the <a href="#recommend">recommendation' \
           "</a> says what to relax."


def glance(data: RunData, front_list: Sequence[Front]) -> str:
    """The headline: the trial to deploy, how many trials each target's valid-DP,
    release-safe front holds, then how many trials carry a flag."""
    sizes = [f"ε = {f.target_epsilon:g}: {count_text(len(f.trials), 'trial')}"
             for f in front_list if f.kind == KIND_VALID]
    fronts_text = (f' Valid-DP, release-safe <a href="#fronts">fronts</a>: '
                   f"{esc('; '.join(sizes))}." if sizes else "")
    dp = data.dp
    flags = [f"{int((~dp['dp_valid']).sum())} {INVALID_TAG}",
             f"{int(dp['audit_contradicts'].sum())} {CONTRADICTED_TAG}",
             f"{int((~dp['release_safe']).sum())} {REPLAYABLE_TAG}",
             f"{int((exclusion_reasons(data.frame) != '').sum())} kept off the fronts"]
    return ("<p><b>At a glance.</b> " + _deploy_text(data) + fronts_text
            + " Trials flagged: " + esc("; ".join(flags)) + "."
            + _failed_audits_text(data) + "</p>")


def _failed_audits_text(data: RunData) -> str:
    """Each finished trial whose audit failed, with the reason: such a trial has no peak MIA,
    so it is on no front and no pick, although its model was trained and kept."""
    failed = failed_frame(data)
    failed = failed[failed["stage"] == STAGE_AUDIT]
    if failed.empty:
        return ""
    named = "; ".join(f"<b>{esc(r.trial_id)}</b>: {esc(r.error)}" for r in failed.itertuples())
    return (f" <b>{count_text(len(failed), 'audit')} failed</b> ({named}): "
            f"{'that trial is' if len(failed) == 1 else 'those trials are'} on no front until "
            f"<code>{REAUDIT_COMMAND}</code> audits "
            f"{'it' if len(failed) == 1 else 'them'} again (no training).")


def header_section(data: RunData) -> str:
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
        accountant += f"; {count_text(fallbacks, 'trial')} fell back to RDP (see the budget table)"
    deltas = sorted({float(d) for d in dp["delta"] if math.isfinite(d)})
    delta = ", ".join(f"{d:g}" for d in deltas) or str(privacy.get("delta", "—"))
    versions = summary.get("versions") if isinstance(summary.get("versions"), dict) else {}
    version_text = ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) or \
        "— (summary.json absent)"
    wall = as_float(summary.get("wall_seconds"))
    if math.isfinite(wall):
        wall_text = _duration(wall) + _attempts_text(summary)
        if summary.get("started") and summary.get("finished"):
            wall_text += (f", {esc(when_text(summary['started']))} → "
                          f"{esc(when_text(summary['finished']))}")
    else:
        spent = float(np.nansum(ok["train_seconds"]) + np.nansum(ok["audit_seconds"]))
        wall_text = f"{_duration(spent)}: sum of trial training and audit times " \
                    "(summary.json absent)"
    failed = int((~frame["status"].isin([OK, PRUNED])).sum())
    pruned = int((frame["status"] == PRUNED).sum())
    series = sorted(frame["series"].unique(), key=natural_key)
    rows = [
        ("run directory", esc(data.run_dir.resolve())),
        ("dataset", esc(info.dataset or "—") + f" ({info.num_classes} classes)"),
        ("split sizes", esc(sizes or "—")),
        ("model", esc(summary.get("model") or model_cfg.get("name") or "—")
         + (f", activation {esc(model_cfg['activation'])}" if model_cfg.get("activation")
            else "")),
        ("epochs", esc(", ".join(map(str, epochs)) or training.get("epochs", "—"))),
        ("batch size (expected, Poisson)",
         esc(", ".join(map(str, batches)) or training.get("batch_size", "—"))),
        ("accountant", esc(accountant)),
        ("target epsilons", esc(", ".join(f"{t:g}" for t in info.targets) or "—")
         + f"; delta {esc(delta)}"),
        ("trials", f"{len(frame)} ({len(ok)} finished, "
                   + (f"{pruned} pruned, " if pruned else "") + f"{failed} failed); series: "
                   + esc(", ".join(series))),
        ("software versions", esc(version_text)),
        ("wall time", wall_text),
    ]
    return facts_table(rows)


_SPLIT_ORDER = {name: i for i, name in enumerate(SPLIT_NAMES)}


def tuning_statement(*, summary: dict[str, Any], trials: int,
                     config: dict[str, Any] | None = None) -> str:
    """The privacy cost of choosing hyperparameters, in plain words: the Papernot & Steinke
    end-to-end bound when tuning was private, else why no epsilon covers the search.
    ``config`` (config.toml as read) names the tuning while summary.json holds none (a sweep
    that has not finished), so an unfinished private sweep is never described as adaptive."""
    tuning = summary.get("tuning") if isinstance(summary.get("tuning"), dict) else {}
    sweep = (config or {}).get("sweep")
    declared = sweep.get("tuning") if isinstance(sweep, dict) else None
    mode = str(tuning.get("mode") or declared or "")
    statement = str(tuning.get("statement") or "")
    n_trials = tuning.get("n_trials", trials)
    end_to_end = as_float(tuning.get("end_to_end_epsilon"))
    if mode == "private" and math.isfinite(end_to_end):
        head = (f"<p><b>Tuning was private</b> (random search with a random number of trials, "
                f"one DP selection score per trial, only the selected model released: "
                f"Papernot &amp; Steinke, 2022, <i>Hyperparameter Tuning with Renyi "
                f"Differential Privacy</i>). The end-to-end bound over the search is "
                f"<b>epsilon = {end_to_end:.4g}</b> ({esc(n_trials)} trials ran). It covers the "
                f"selected model and its noisy score only; everything else in this report "
                f"(other trials, noiseless validation and audit numbers) is "
                f"<b>{NOT_COVERED_TAG}</b>. The bound also assumes the number of trials stays "
                f"secret, and this report shows it: like the rest of the run directory, the "
                f"report stays with whoever ran the sweep; share the export "
                f"(<code>dpsweep pick RUN_DIR --export DIR</code>).</p>")
        return head + (f"<p>{esc(statement)}</p>" if statement else "")
    if mode == "private":
        head = ("<p><b>Tuning is private, but summary.json records no end-to-end epsilon</b> "
                "(it is written when the sweep finishes): no tuning-aware bound is claimed, and "
                "no trial can be exported yet.</p>")
    else:
        head = (
            f"<p>This sweep ran <b>{esc(n_trials)}</b> trials and chose hyperparameters "
            f"<b>adaptively</b> (Optuna), from {_adaptive_inputs(tuning)} measured on private "
            "data without noise. Each trial's epsilon bounds what training <em>that one "
            "model</em> reveals, its hyperparameters taken as given. It does <b>not</b> cover "
            "the search: choosing one model from many after looking at noiseless private "
            f"metrics leaks more than any single trial's epsilon. {_adaptive_cover(tuning)}</p>"
            "<p>A tuning-aware epsilon (Papernot &amp; Steinke, 2022) needs random search, a "
            "random number of trials, a DP selection score and release of the selected model "
            "only (<code>tuning = \"private\"</code>). <b>Adaptive hyperparameter search over "
            "private metrics is not covered by the per-trial epsilon.</b></p>")
    return head + _recorded(tuning, statement)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=\.)\s+", text.strip()) if s]


def _recorded(tuning: dict[str, Any], statement: str) -> str:
    """summary.json's statement, folded, each sentence once: the per-target statements repeat
    each other but for their numbers, so after the first target only what differs is shown."""
    by_target = [(key, str(v.get("statement") or "")) for key, v in
                 sorted((tuning.get("by_target") or {}).items(), key=lambda kv: as_float(kv[0]))
                 if isinstance(v, dict) and v.get("statement")]
    if len(by_target) < 2:
        if not statement:
            return ""
        body = f"<p>{esc(statement)}</p>"
    else:
        first = _sentences(by_target[0][1])
        body = f"<p>ε = {esc(by_target[0][0])}: {esc(' '.join(first))}</p>"
        for key, text in by_target[1:]:
            changed = [s for s in _sentences(text) if s not in first]
            body += (f"<p>ε = {esc(key)}: the same, except: {esc(' '.join(changed))}</p>"
                     if changed else f"<p>ε = {esc(key)}: the same.</p>")
    return ("<details><summary>The statement the run recorded (summary.json), in full"
            f"</summary>{body}</details>")


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
