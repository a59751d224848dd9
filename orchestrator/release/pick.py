"""``dpsweep pick RUN_DIR``: choose the deployable trial and write ``pick.toml`` and
``pick_config.toml``.

Selection itself is pure and lives in ``reports.pick`` (validation accuracy only; the rule, the
constraints and the tie rule are documented there; a private-tuning run is chosen by its noisy
score alone, and its pick.toml holds that score and the end-to-end statement, no noiseless
metric). This module does what the report floor cannot: it opens the run directory through its
manifest and verifies every file it reads (results, config, the chosen trial's spec, privacy
record and checkpoint) before reading it, reads whether the run was tuned privately from its
verified, consistent records (``orchestrator.release.selection``), rebuilds a config that
retrains the trial (``orchestrator.trial.plan.config_from_spec``), optionally exports the
trial's release (``orchestrator.release.export``), and writes both TOML files atomically, after
everything else has succeeded, so bad input writes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import RESULTS
from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.records import PrivacyRecord
from dpsweep.core.storage import atomic_write_text
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.release.selection import read_run_config, read_selection
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.trial.plan import config_from_spec
from dpsweep.reports import store
from dpsweep.reports.pareto import ACC, ACC_HI, ACC_LO, MIA, MIA_UPPER, NONPRIVATE
from dpsweep.reports.pick import (
    NOISY,
    PRIVATE_RULE,
    REPLAYABLE_TAG,
    TIE_RULE,
    Choice,
    choose,
    choose_private,
    describe,
)
from dpsweep.trainables.data.splits import DEFAULT_SIZES

#: The config alone, ready for ``dpsweep train PICK_CONFIG --out DIR``.
TEST_NOTE = "reported, not used to choose"
#: The flag ``dpsweep pick`` takes the release directory as (its messages name it).
EXPORT_FIELD = "--export"
#: The label of the export's line, also the first word of the export's summary
#: (``bundle.SUMMARY_VERB``; bundle is imported only when exporting, it loads torch).
EXPORTED = "exported"
NOT_COVERED_NOTE = ("not covered by epsilon: computed on private data without noise; stays "
                    "with whoever ran the sweep")
#: Fields of the privacy record (``core.records.PrivacyRecord``) copied into pick.toml's
#: [privacy] table: the scalars a reader of the pick needs (not the ledger or the counts).
PRIVACY_FIELDS = ("mechanism", "method", "mode", "dp_valid", "validity_reason", "randomness",
                  "release_safe", "sample_rate", "steps", "noise_multiplier", "clip_norm",
                  "delta", "target_epsilon", "epsilon_lower", "epsilon_estimate",
                  "epsilon_upper", "accountant", "accountant_fallback", "eps_error")
#: The private-tuning plan's fields pick.toml's [tuning] table copies (summary.json holds them;
#: none reveals the secret number of trials).
PRIVATE_TUNING_FIELDS = ("end_to_end_epsilon", "delta", "end_to_end_accountant", "distribution",
                         "mean_trials", "shape_eta", "score_noise_multiplier",
                         "per_trial_epsilon", "statement")
PRIVATE_NOTE = ("private tuning: only the noisy score is written here; the noiseless "
                "validation, test and audit metrics are not covered by the end-to-end epsilon. "
                "They, the number of trials and every other trial's score are in the run "
                "directory, which stays with whoever ran the sweep, as does this file (its "
                "trial id bounds the secret number of trials from below): share the export")


@dataclass(frozen=True)
class Pick:
    """What ``pick_and_write`` chose and wrote."""

    choice: Choice
    config: Config
    privacy: dict[str, Any]
    checkpoint: Path
    path: Path
    export_summary: str
    #: summary.json's private-tuning plan, verified (``orchestrator.release.selection``); None
    #: for an adaptive run.
    private: dict[str, Any] | None = None


# ---- reading, verified -----------------------------------------------------------------------
def _verified_json(run: RunDir, rel: str, *, what: str) -> dict[str, Any]:
    path = run.verify(rel)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserInputError(field=what, value=str(path),
                             allowed=f"valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise UserInputError(field=what, value=str(path), allowed="a JSON object")
    return value


def _validation_size(run: RunDir) -> int | None:
    """The run's validation size: config.toml's, else the dataset default it stands for."""
    raw = read_run_config(run)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    size = data.get("validation_size", 0)
    if isinstance(size, int) and size > 0:
        return size
    defaults = DEFAULT_SIZES.get(str(data.get("dataset", "digits")))
    return defaults.validation if defaults is not None else None


def _checkpoint(run: RunDir, row: Mapping[str, Any]) -> Path:
    """The chosen trial's checkpoint directory, every file of it verified by the manifest."""
    rel = str(row.get("checkpoint") or "")
    tid = row["trial_id"]
    directory = (run.path / rel).resolve() if rel else None
    if directory is None or not directory.is_dir():
        raise UserInputError(field="checkpoint", value=str(directory) if rel else "(none)",
                             allowed=f"the checkpoint directory of the picked trial {tid!r} "
                                     "(missing)")
    prefix = run.relative(directory).rstrip("/") + "/"
    listed = sorted(r for r in run.manifest.get("files", {}) if r.startswith(prefix))
    if not listed:
        raise UserInputError(field="checkpoint", value=str(directory),
                             allowed=f"a checkpoint recorded in the manifest (trial {tid!r})")
    for rel_file in listed:
        run.verify(rel_file)
    return directory


def _privacy(run: RunDir, row: Mapping[str, Any]) -> dict[str, Any]:
    """pick.toml's [privacy] table: the verified record's scalar fields, its schedule, its path."""
    rel = str(row.get("privacy_record") or f"{layout.TRIALS}/{row['trial_id']}/{layout.PRIVACY}")
    record = PrivacyRecord.from_dict(_verified_json(run, rel, what="privacy_record"), where=rel)
    out: dict[str, Any] = {k: getattr(record, k) for k in PRIVACY_FIELDS}
    out["noise_schedule"] = record.noise_schedule.to_list()
    out["record"] = rel
    return out


# ---- writing ---------------------------------------------------------------------------------
def _toml_safe(value: Any) -> Any:
    """TOML has no null and pick.toml should hold no NaN: drop both, recursively; numpy
    scalars become Python ones."""
    if isinstance(value, dict):
        return {str(k): _toml_safe(v) for k, v in value.items()
                if v is not None and not (isinstance(v, float) and math.isnan(v))}
    if isinstance(value, (list, tuple)):
        return [_toml_safe(v) for v in value if v is not None]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return _toml_safe(value.item())
    return value


def _summary_of(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"trial_id": row["trial_id"], "series": row["series"],
            "target_epsilon": row["target_epsilon"], "val_accuracy": row[ACC],
            "val_accuracy_ci": [row[ACC_LO], row[ACC_HI]],
            "peak_mia_accuracy": row[MIA], "peak_mia_upper": row.get(MIA_UPPER)}


def _private_document(pick: Pick) -> dict[str, Any]:
    """pick.toml of a private-tuning run: the noisy score and the end-to-end statement, no
    noiseless metric, no list of the other trials (their number is the secret K)."""
    row, plan = pick.choice.trial, pick.private or {}
    selection = {
        "rule": PRIVATE_RULE, "trial_id": row["trial_id"], "series": row["series"],
        "method": row["method"], "mode": row.get("mode", ""),
        "target_epsilon": row["target_epsilon"], NOISY: float(row[NOISY]),
        "dp_valid": bool(row["dp_valid"]), "validity_reason": row.get("validity_reason", ""),
        "release_safe": bool(row["release_safe"]), "randomness": row.get("randomness", ""),
        "not_written": PRIVATE_NOTE,
    }
    tuning = {"mode": "private", **{k: plan[k] for k in PRIVATE_TUNING_FIELDS if k in plan}}
    return {"selection": selection, "tuning": tuning, "config": pick.config.to_dict(),
            "checkpoint": {"path": str(pick.checkpoint)}, "privacy": pick.privacy}


def _document(pick: Pick) -> dict[str, Any]:
    if pick.private is not None:
        return _private_document(pick)
    row = pick.choice.trial
    selection = {
        "constraints": {k: v for k, v in pick.choice.constraints.items() if v is not None},
        "rule": "highest validation accuracy among admissible front trials meeting the "
                "constraints (--max-peak-mia bounds peak_mia_upper)",
        "tie_rule": TIE_RULE,
        "trial_id": row["trial_id"], "series": row["series"], "method": row["method"],
        "mode": row.get("mode", ""), "study": row.get("study", ""),
        "target_epsilon": row["target_epsilon"],
        "val_accuracy": row[ACC], "val_accuracy_ci": [row[ACC_LO], row[ACC_HI]],
        "test_accuracy": row.get("test_accuracy"), "test_accuracy_note": TEST_NOTE,
        "peak_mia_accuracy": row[MIA], "peak_mia_upper": row.get(MIA_UPPER),
        "peak_layer": row.get("peak_layer", ""), "peak_attack": row.get("peak_attack", ""),
        "leak_detected": bool(row.get("leak_detected", False)),
        "not_covered_by_epsilon": NOT_COVERED_NOTE + " (val_accuracy, test_accuracy, "
                                  "peak_mia_*, leak_detected)",
        "dp_valid": bool(row["dp_valid"]), "validity_reason": row.get("validity_reason", ""),
        "release_safe": bool(row["release_safe"]), "randomness": row.get("randomness", ""),
        "audit_contradicts": bool(row.get("audit_contradicts", False)),
        "ties": [_summary_of(t) for t in pick.choice.ties],
        "qualifying_front_trials": list(pick.choice.qualifying),
        "front_trials": list(pick.choice.front),
    }
    return {"selection": selection, "config": pick.config.to_dict(),
            "checkpoint": {"path": str(pick.checkpoint)}, "privacy": pick.privacy}


def _write(pick: Pick) -> None:
    text = ("# dpsweep pick: the chosen trial. [config] is a full dpsweep config that retrains "
            f"it;\n# {layout.PICK_CONFIG} holds it alone: dpsweep train {layout.PICK_CONFIG} "
            "--out DIR.\n"
            + ("# Private tuning: chosen by the noisy validation score; keep this file with the "
               "run directory.\n" if pick.private is not None
               else "# Test accuracy is reported, not used to choose.\n")
            + tomli_w.dumps(_toml_safe(_document(pick))))
    config_text = (f"# dpsweep config of trial {pick.choice.trial_id} (written by dpsweep pick)\n"
                   + tomli_w.dumps(_toml_safe(pick.config.to_dict())))
    atomic_write_text(pick.path.with_name(layout.PICK_CONFIG), config_text)
    atomic_write_text(pick.path, text)


def _float_or_nan(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _opt(value: Any) -> str:
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flags(row: Mapping[str, Any]) -> list[str]:
    flags = ["valid DP" if row["dp_valid"] else f"WARNING: {INVALID_TAG}"]
    if row.get("audit_contradicts"):
        flags.append("WARNING: claim contradicted by audit")
    flags.append("release-safe" if row["release_safe"] else f"WARNING: {REPLAYABLE_TAG}")
    return flags


def _tail(pick: Pick) -> list[str]:
    lines = [f"  checkpoint           {pick.checkpoint}",
             f"  written              {pick.path} and {layout.PICK_CONFIG}",
             f"  retrain with         dpsweep train {pick.path.with_name(layout.PICK_CONFIG)} "
             "--out DIR"]
    if pick.export_summary:  # the export's own summary starts "exported OUT: ...": once only
        first, *rest = pick.export_summary.splitlines()
        lines.append(f"  {EXPORTED:<20} {first.removeprefix(f'{EXPORTED} ')}")
        lines += [f"  {'':<20} {line}" for line in rest]
    return lines


def _format_private(pick: Pick) -> str:
    """The terminal after a private pick: the noisy score and both epsilons, nothing noiseless."""
    row, p, plan = pick.choice.trial, pick.privacy, pick.private or {}
    lines = [
        f"picked trial {row['trial_id']} (series {row['series']}): the best noisy validation "
        "score (private tuning)",
        f"  noisy val score      {float(row[NOISY]):.4f}  (what pick chose on; covered by the "
        "end-to-end epsilon)",
        f"  end to end           epsilon <= {_opt(plan.get('end_to_end_epsilon'))} (delta "
        f"{_opt(plan.get('delta'))}, {plan.get('end_to_end_accountant', '?')}) for the "
        "released model and its selection",
        f"  training alone       epsilon <= {_opt(p.get('epsilon_upper'))} (delta "
        f"{_opt(p.get('delta'))}, accountant {p.get('accountant', '?')}), sigma "
        f"{_opt(p.get('noise_multiplier'))}; " + "; ".join(_flags(row)),
        f"  {'':<20} {PRIVATE_NOTE}",
    ]
    return "\n".join(lines + _tail(pick))


def format_pick(pick: Pick) -> str:
    """What the terminal shows after a pick."""
    if pick.private is not None:
        return _format_private(pick)
    row, p, c = pick.choice.trial, pick.privacy, pick.choice.constraints
    upper = _float_or_nan(row.get(MIA_UPPER))
    upper_text = f"{upper:.4f}" if math.isfinite(upper) else "none"
    flags = _flags(row)
    eps = p.get("epsilon_upper", row.get("epsilon_upper"))
    lines = [
        f"picked trial {row['trial_id']} (series {row['series']}, target epsilon "
        f"{float(row['target_epsilon']):g})",
        f"  validation accuracy  {row[ACC]:.4f} [{row[ACC_LO]:.4f}, {row[ACC_HI]:.4f}]"
        "  (what pick chose on)",
        f"  test accuracy        {float(row.get('test_accuracy', math.nan)):.4f}  ({TEST_NOTE})",
        f"  peak MIA accuracy    {row[MIA]:.4f}, upper bound {upper_text} (layer "
        f"{row.get('peak_layer') or '?'}, attack {row.get('peak_attack') or '?'})",
        f"  {'':<20} accuracies and MIA: {NOT_COVERED_NOTE}",
        f"  privacy              epsilon <= {_opt(eps)} (target "
        f"{_opt(p.get('target_epsilon'))}, delta {_opt(p.get('delta'))}, accountant "
        f"{p.get('accountant', '?')}), sigma {_opt(p.get('noise_multiplier'))}; "
        + "; ".join(flags),
        f"  constraints          max peak MIA upper bound {_opt(c['max_peak_mia'])}, min "
        f"validation accuracy {_opt(c['min_val_acc'])}, series {c['series'] or 'any'}; "
        f"{len(pick.choice.qualifying)} of {len(pick.choice.front)} front trials qualified",
    ]
    if pick.choice.ties:
        lines.append(f"  ties                 {len(pick.choice.ties)} trial(s) tied within their "
                     "validation intervals (returned: the highest point estimate):")
        lines += [f"  {'':<20} {describe(t)}" for t in pick.choice.ties]
    lines += _tail(pick)
    if not row["dp_valid"]:
        reason = str(row.get("validity_reason", "")).removeprefix(f"{INVALID_TAG}: ")
        lines.insert(1, f"  WARNING: {INVALID_TAG} (admitted by --allow-invalid-dp): {reason}")
    if not row["release_safe"]:
        lines.insert(1, f"  WARNING: {REPLAYABLE_TAG} (admitted by --allow-replayable)")
    return "\n".join(lines)


def pick_and_write(run_dir: Path, *, max_peak_mia: float | None, min_val_acc: float | None,
                   series: str | None, allow_invalid_dp: bool, allow_replayable: bool,
                   export_to: Path | None, allow_degenerate: bool = False) -> str:
    """Choose the trial, verify and read its records, export it if asked, write pick.toml and
    pick_config.toml; return the terminal text."""
    if export_to is not None:  # before anything is read or written
        from dpsweep.orchestrator.release.bundle import check_outside_run

        check_outside_run(export_to, run_dir=run_dir, field=EXPORT_FIELD)
    run = RunDir.open(Path(run_dir), write=False)
    run.verify(RESULTS)
    frame = store.read_results(run.path)
    if series == NONPRIVATE:  # a known series of a run with a baseline, but never a pick
        raise UserInputError(field="--series", value=series,
                             allowed="a DP series of this run: 'nonprivate' is the non-private "
                                     "baseline (no clipping, no noise), a reference line that "
                                     "is never picked or released")
    selection = read_selection(run, frame=frame, release=True)
    private = selection.tuning if selection.private else None
    if private is not None:
        _no_constraints(max_peak_mia=max_peak_mia, min_val_acc=min_val_acc, series=series)
        choice = choose_private(frame, allow_invalid_dp=allow_invalid_dp,
                                allow_replayable=allow_replayable, run_dir=run_dir)
    else:
        choice = choose(frame, validation_size=_validation_size(run),
                        max_peak_mia=max_peak_mia, min_val_acc=min_val_acc, series=series,
                        allow_invalid_dp=allow_invalid_dp, allow_replayable=allow_replayable,
                        run_dir=run_dir)
    row = choice.trial
    tid = choice.trial_id
    spec = _verified_json(run, f"{layout.TRIALS}/{tid}/{layout.SPEC}", what="spec")
    privacy = _privacy(run, row)
    checkpoint = _checkpoint(run, row)
    try:
        config = config_from_spec(spec)
    except (KeyError, TypeError, ValueError, UserInputError) as exc:
        raise UserInputError(field="spec", value=f"trial {tid}",
                             allowed=f"a spec that maps onto a valid config ({exc})") from None
    export_summary = ""
    if export_to is not None:
        from dpsweep.orchestrator.release.export import export_from_run

        result = export_from_run(run.path, trial_id=tid, out=Path(export_to),
                                 allow_replayable=allow_replayable,
                                 allow_invalid_dp=allow_invalid_dp,
                                 allow_degenerate=allow_degenerate, out_field=EXPORT_FIELD)
        summary = getattr(result, "summary", None)
        export_summary = summary() if callable(summary) else str(export_to)
    pick = Pick(choice=choice, config=config, privacy=privacy, checkpoint=checkpoint,
                path=run.path / layout.PICK, export_summary=export_summary, private=private)
    _write(pick)
    return format_pick(pick)


def _no_constraints(*, max_peak_mia: float | None, min_val_acc: float | None,
                    series: str | None) -> None:
    """Private tuning releases exactly the best noisy validation score: its end-to-end epsilon
    covers that selection and no other (a constraint on a noiseless metric, or a series chosen
    after seeing them, would choose with unaccounted information)."""
    for flag, value in (("--max-peak-mia", max_peak_mia), ("--min-val-acc", min_val_acc),
                        ("--series", series)):
        if value is not None:
            raise UserInputError(field=flag, value=value,
                                 allowed="nothing in a private-tuning run: its end-to-end "
                                         "epsilon covers releasing the best noisy validation "
                                         "score only")
