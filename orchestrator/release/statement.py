"""The privacy statement of a release: what its epsilon covers, and what it does not cover.

A DP guarantee covers the released model (and anything computed from it alone), nothing else.
A run directory holds much that the epsilon does not cover: the training loss, validation and
test scores, audit metrics, every other trial, seeds and data paths. The statement says which is
which for a reviewer (``privacy_statement.json`` / ``.md``), from the trial's privacy record and
spec alone. ``orchestrator.release.bundle`` writes it into the export beside the weights, the
model description, the network's code and the loader.

No trial id is written either: under private tuning the index of the selected trial bounds the
secret number of trials.
"""

from __future__ import annotations

import decimal
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from dpsweep.core import layout
from dpsweep.core.checks import number, whole
from dpsweep.core.errors import UserInputError
from dpsweep.core.records import PrivacyRecord
from dpsweep.reports.store import record_entry

__all__ = [
    "PrivacyStatement",
    "privacy_statement",
]

STATEMENT_FORMAT = "dpsweep-privacy-statement"
STATEMENT_VERSION = 1
#: Decimals of displayed privacy figures. Upper bounds round up and lower bounds round down,
#: so a displayed figure never overstates the protection.
DISPLAY_DECIMALS = 4

NEIGHBOURING = ("datasets that differ by adding or removing one example of the training split "
                "(Poisson subsampling, add/remove adjacency)")
ACCOUNTANTS = {
    "prv": ("PRV accountant (Gopi, Lee & Wutschitz 2021, numerical composition of privacy "
            "random variables); the upper bound includes its certified error eps_error"),
    "rdp": ("RDP accountant (Mironov 2017; Opacus's orders), an analytic upper bound; "
            "no lower bound or estimate is available"),
}
MECHANISM = ("Poisson-subsampled Gaussian mechanism (DP-SGD): at every step each training "
             "example enters the batch independently with probability q, each example's gradient "
             "is clipped to the recorded bound, and Gaussian noise with standard deviation sigma "
             "times the sum's L2 sensitivity is added before the update")
RANDOMNESS_NOTES = {
    "secret": ("noise and Poisson sampling seeded from fresh operating-system entropy; the seeds "
               "lived only in memory and were never written"),
    "secure": ("noise and Poisson sampling from a cryptographically secure source (os.urandom), "
               "each Gaussian coordinate a normalised sum of float64 Box-Muller samples against "
               "floating-point attacks (timing side channels are not addressed)"),
    "reproducible": ("noise and Poisson sampling seeded from the recorded trial seed: anyone "
                     "with the run's records can replay the noise, so no epsilon holds for "
                     "this release"),
}
#: method_record keys that describe clipping (per-layer bounds, adaptive clip norms, frozen
#: layers). Only these leave the run, and only where the epsilon covers them
#: (``reports.store.RECORD``: an adaptive statistic of a faithful mode comes from the private
#: batch): other keys may hold cache names, provenance or counts over private examples.
CLIPPING_RECORD_KEYS = ("thresholds", "layer_noise_std", "clip_norm_0", "clip_norm_final",
                        "clip_norm_bounds", "clamp", "frozen_layers", "weights", "final_weights")

NOT_COVERED_ALWAYS = (
    "validation accuracy and validation loss (computed on the private validation split "
    "without noise)",
    "test accuracy and test loss (computed on the test split without noise)",
    "the training loss (computed on the private training split without noise)",
    "membership-inference and canary audit metrics, including any audit figure quoted in this "
    "statement",
    "every non-selected trial of the sweep: its model, checkpoints, scores and records",
    "everything else in the run directory (configuration, seeds, logs, per-epoch reports)",
)
NOT_COVERED_SELECTION = ("the selection of this trial and its hyperparameters (chosen from "
                         "scores computed without noise; see Hyperparameter tuning)")
NOT_COVERED_PRIVATE_K = ("the number of trials of the private tuning run (the end-to-end "
                         "guarantee assumes it stays secret) and any score other than one "
                         "noisy score per trial")

TUNING_MODES = ("adaptive", "private")


# --------------------------------------------------------------------------------------------
# Small validators (every failure is one UserInputError naming the field)


def _bad(field: str, value: Any, allowed: str) -> UserInputError:
    return UserInputError(field=field, value=value, allowed=allowed)


def _get(record: dict[str, Any], key: str, *, where: str) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise _bad(f"{where}.{key}", None, "present (a dpsweep record)")
    return record[key]


def _number(record: dict[str, Any], key: str, *, where: str, low: float = 0.0,
            low_open: bool = True, high: float = math.inf) -> float:
    return number(_get(record, key, where=where), field=f"{where}.{key}", low=low,
                  low_open=low_open, high=high)


def _text(record: dict[str, Any], key: str, *, where: str, optional: bool = False
          ) -> str | None:
    value = _get(record, key, where=where)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}", value, "a string")
    return value


def _count(record: dict[str, Any], key: str, *, where: str) -> int:
    return whole(_get(record, key, where=where), field=f"{where}.{key}", low=1)


def _covered(path: tuple[str, ...], *, dp_valid: bool) -> bool:
    """Whether the record's value at ``path`` is covered by the epsilon (undeclared: not)."""
    stored = record_entry(path)
    return stored is not None and stored.covers(dp_valid=dp_valid)


def round_up(value: float) -> str:
    """``value`` at DISPLAY_DECIMALS, rounded towards +infinity (for upper bounds)."""
    return _rounded(value, decimal.ROUND_CEILING)


def round_down(value: float) -> str:
    """``value`` at DISPLAY_DECIMALS, rounded towards -infinity (for lower bounds)."""
    return _rounded(value, decimal.ROUND_FLOOR)


def _rounded(value: float, rounding: str) -> str:
    """Rounds the shortest decimal that reads back as ``value`` (0.008 stays 0.0080, where its
    binary expansion 0.0080000000000000002 would round up to 0.0081); the float of the result
    is still on the safe side of ``value``."""
    quantum = decimal.Decimal(1).scaleb(-DISPLAY_DECIMALS)
    return str(decimal.Decimal(repr(float(value))).quantize(quantum, rounding=rounding))


# --------------------------------------------------------------------------------------------
# The statement


@dataclass(frozen=True)
class PrivacyStatement:
    """Everything a reviewer needs to check a release's DP claim, and what it does not cover.

    ``epsilon`` is the accountant's upper bound rounded up at DISPLAY_DECIMALS (the exact value
    is ``epsilon_exact``); ``holds`` is false when the mode is invalid, the noise is replayable
    or an audit contradicts the claim, and ``headline`` then says so first.
    """

    holds: bool
    headline: str
    epsilon: float
    epsilon_display: str
    epsilon_exact: float
    epsilon_lower: float | None
    epsilon_estimate: float | None
    target_epsilon: float
    delta: float
    neighbouring: str
    dataset: str
    accountant: str
    accountant_description: str
    eps_error: float | None
    accountant_fallback: str | None
    mechanism: str
    sample_rate: float
    steps: int
    epochs: int
    noise_multiplier: float
    noise_schedule: tuple[dict[str, Any], ...]
    clipping: dict[str, Any]
    method: str
    mode: str
    dp_valid: bool
    validity_reason: str
    randomness: str
    randomness_note: str
    release_safe: bool
    tuning: dict[str, Any] | None
    selection_covered: bool
    audit: dict[str, Any] | None
    audit_contradicts: bool
    not_covered: tuple[str, ...]
    versions: dict[str, str]
    artifacts: dict[str, str] = field(default_factory=dict)
    format: str = STATEMENT_FORMAT
    version: int = STATEMENT_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (tuples become lists); refuses NaN rather than writing it."""
        return json.loads(json.dumps(asdict(self), allow_nan=False))

    def to_markdown(self) -> str:
        return _markdown(self)


def privacy_statement(*, privacy: PrivacyRecord, spec: dict[str, Any],
                      tuning: dict[str, Any] | None, audit_bound: dict[str, Any] | None
                      ) -> PrivacyStatement:
    """The statement for one trial from its privacy record and spec (``TrialSpec.to_dict()``).

    The record must belong to the spec (method, mode, randomness, sampling rate, schedule,
    delta and epsilon bound are compared). ``tuning`` is how the trial was selected:
    ``{"mode": "adaptive", "n_trials", "statement", ...}`` (``AdaptiveStatement.to_dict()``)
    or ``{"mode": "private", "end_to_end_epsilon", "statement", ...}``
    (``PrivateTuningPlan.to_dict()``); ``audit_bound`` a canary audit's
    ``{"eps_lower_bound", "canaries", "confidence", "kind"?}``.
    """
    record = _record_fields(privacy)
    _check_same_trial(privacy, spec)
    epochs = _count(spec, "epochs", where="spec")
    dataset = _text(spec, "dataset", where="spec")

    tuning_info = _tuning(tuning, delta=record["delta"])
    audit = _audit(audit_bound, claimed=record["epsilon_exact"])
    contradicts = audit is not None and bool(audit["contradicts"])
    selection_covered = bool(tuning_info and tuning_info["mode"] == "private")
    failures = _failures(record, audit=audit, contradicts=contradicts)
    eps_display = round_up(record["epsilon_exact"])
    headline = _headline(failures, eps_display=eps_display, delta=record["delta"],
                         tuning_info=tuning_info, selection_covered=selection_covered)

    not_covered = list(NOT_COVERED_ALWAYS)
    not_covered.append(NOT_COVERED_PRIVATE_K if selection_covered else NOT_COVERED_SELECTION)
    return PrivacyStatement(
        holds=not failures, headline=headline, epsilon=float(eps_display),
        epsilon_display=eps_display, neighbouring=NEIGHBOURING, dataset=dataset,
        mechanism=MECHANISM, epochs=epochs, tuning=tuning_info,
        selection_covered=selection_covered, audit=audit, audit_contradicts=contradicts,
        not_covered=tuple(not_covered), **record,
    )


def _record_fields(privacy: PrivacyRecord) -> dict[str, Any]:
    """The record's fields as the statement's fields of the same meaning.

    The record has checked each field on its own (types and ranges, delta <= 1 included);
    a statement adds rules of its own: the schedule's phases add up to the recorded steps, and
    a lower bound or estimate it states is >= 0 (the record admits a PRV lower bound a little
    below 0, its error).
    """
    schedule, steps = privacy.noise_schedule, privacy.steps
    if schedule.steps != steps:
        raise _bad("privacy.noise_schedule", schedule.to_list()[:8],
                   f"phases that add up to the record's {steps} steps")
    for key in ("epsilon_lower", "epsilon_estimate"):
        value = getattr(privacy, key)
        if value is not None and value < 0:
            raise _bad(f"privacy.{key}", value, "a finite number in [0, inf]")
    clipping: dict[str, Any] = {"clip_norm": float(privacy.clip_norm)}
    clipping.update({k: privacy.method_record[k] for k in CLIPPING_RECORD_KEYS
                     if k in privacy.method_record and _covered(("method_record", k),
                                                                dp_valid=privacy.dp_valid)})
    optional = {k: None if getattr(privacy, k) is None else float(getattr(privacy, k))
                for k in ("epsilon_lower", "epsilon_estimate", "eps_error")}
    return dict(
        epsilon_exact=float(privacy.epsilon_upper), **optional,
        target_epsilon=float(privacy.target_epsilon), delta=float(privacy.delta),
        accountant=privacy.accountant, accountant_description=ACCOUNTANTS[privacy.accountant],
        accountant_fallback=privacy.accountant_fallback,
        sample_rate=float(privacy.sample_rate), steps=steps,
        noise_multiplier=float(privacy.noise_multiplier),
        noise_schedule=tuple(schedule.to_list()), clipping=clipping, method=privacy.method,
        mode=privacy.mode, dp_valid=privacy.dp_valid, validity_reason=privacy.validity_reason,
        randomness=privacy.randomness, randomness_note=RANDOMNESS_NOTES[privacy.randomness],
        release_safe=privacy.release_safe and privacy.randomness != "reproducible",
        versions=dict(privacy.versions),
    )


def _failures(record: dict[str, Any], *, audit: dict[str, Any] | None,
              contradicts: bool) -> list[str]:
    """Why no differential-privacy guarantee holds for the release (empty when one does)."""
    failures = []
    if not record["dp_valid"]:
        failures.append(f"the method's mode is not differentially private "
                        f"({record['validity_reason']})")
    if not record["release_safe"]:
        failures.append("the noise is replayable from recorded seeds (reproducible randomness)")
    if audit is not None and contradicts:
        failures.append(f"a canary audit's empirical lower bound epsilon >= "
                        f"{audit['eps_lower_bound_display']} exceeds the claimed bound")
    return failures


def _headline(failures: list[str], *, eps_display: str, delta: float,
              tuning_info: dict[str, Any] | None, selection_covered: bool) -> str:
    """The statement's first sentence: what holds for this release, or that nothing does."""
    if failures:
        return ("NO differential-privacy guarantee holds for this release: "
                + "; ".join(failures) + f". The accountant's figure for the noise alone "
                f"is epsilon <= {eps_display} at delta {delta!r}.")
    if tuning_info is not None and selection_covered:
        return (f"({tuning_info['end_to_end_epsilon_display']}, {tuning_info['delta']!r})-"
                f"differential privacy end to end for the released model and its selection "
                f"by private tuning; training alone is ({eps_display}, {delta!r})-DP.")
    return (f"({eps_display}, {delta!r})-differential privacy for the released model "
            f"weights; the selection of this trial is not covered.")


def _check_same_trial(privacy: PrivacyRecord, spec: dict[str, Any]) -> None:
    """The record must be this spec's: a statement about another trial would be false."""
    cal = _get(spec, "calibration", where="spec")
    params = _get(spec, "method_params", where="spec")
    if not isinstance(params, dict) or not isinstance(cal, dict):
        raise _bad("spec", "method_params/calibration", "a TrialSpec.to_dict()")
    bounds = _get(cal, "bounds", where="spec.calibration")
    pairs = {
        "method": (privacy.method, _get(spec, "method", where="spec")),
        "mode": (privacy.mode, params.get("mode")),
        "randomness": (privacy.randomness, _get(spec, "randomness", where="spec")),
        "sample_rate": (privacy.sample_rate, _get(cal, "sample_rate", where="spec.calibration")),
        "noise_schedule": (privacy.noise_schedule.to_list(),
                           _get(cal, "schedule", where="spec.calibration")),
        "delta": (privacy.delta, _get(cal, "delta", where="spec.calibration")),
        "epsilon_upper": (privacy.epsilon_upper, _get(bounds, "upper", where="spec.bounds")),
    }
    for key, (recorded, specified) in pairs.items():
        if recorded != specified:
            raise _bad(f"privacy.{key}", recorded,
                       f"the value of the checkpoint's own trial ({specified!r}): this privacy "
                       f"record belongs to another trial")


def _tuning(tuning: dict[str, Any] | None, *, delta: float) -> dict[str, Any] | None:
    """The selection's cost, whitelisted: under private tuning the trial count is never copied."""
    if tuning is None:
        return None
    where = "tuning"
    mode = _text(tuning, "mode", where=where)
    if mode not in TUNING_MODES:
        raise _bad(f"{where}.mode", mode, f"one of {TUNING_MODES}")
    statement = _text(tuning, "statement", where=where)
    if mode == "adaptive":
        info: dict[str, Any] = {"mode": mode, "statement": statement,
                                "n_trials": _count(tuning, "n_trials", where=where)}
        for key in ("per_trial_epsilon", "composed_epsilon"):
            if tuning.get(key) is not None:
                value = _number(tuning, key, where=where)
                info[key] = value
                info[f"{key}_display"] = round_up(value)
        for key in ("composed_delta", "composition"):
            if tuning.get(key) is not None:
                info[key] = tuning[key]
        return info
    e2e = _number(tuning, "end_to_end_epsilon", where=where)
    info = {"mode": mode, "statement": statement, "end_to_end_epsilon": e2e,
            "end_to_end_epsilon_display": round_up(e2e),
            "delta": _number(tuning, "delta", where=where, high=1.0)
            if tuning.get("delta") is not None else delta}
    for key in ("end_to_end_accountant", "distribution", "mean_trials",
                "score_noise_multiplier", "per_trial_epsilon"):
        if tuning.get(key) is not None:
            info[key] = tuning[key]
    return info


def _audit(bound: dict[str, Any] | None, *, claimed: float) -> dict[str, Any] | None:
    if bound is None:
        return None
    where = "audit_bound"
    lb = _number(bound, "eps_lower_bound", where=where, low_open=False)
    confidence = _number(bound, "confidence", where=where, high=1.0)
    canaries = _count(bound, "canaries", where=where)
    kind = _text(bound, "kind", where=where, optional=True) if "kind" in bound else None
    if confidence >= 1.0:
        raise _bad(f"{where}.confidence", confidence, "a number in (0, 1)")
    return {"eps_lower_bound": lb, "eps_lower_bound_display": round_down(lb),
            "canaries": canaries, "confidence": confidence, "kind": kind,
            "claimed_epsilon": claimed, "contradicts": lb > claimed}


# --------------------------------------------------------------------------------------------
# Markdown


def _markdown(s: PrivacyStatement) -> str:
    yes = {True: "yes", False: "**NO**"}
    lines = ["# Privacy statement", "", f"**{s.headline}**", ""]
    lines += ["## Guarantee", "",
              f"- epsilon: **{s.epsilon_display}** (the accountant's upper bound, rounded up; "
              f"target {s.target_epsilon!r}; exact {s.epsilon_exact!r})",
              f"- delta: **{s.delta!r}**",
              f"- neighbouring datasets: {s.neighbouring}; dataset: {s.dataset}",
              f"- covers: the released weights ({layout.EXPORT_WEIGHTS}, "
              f"{layout.EXPORT_SAFETENSORS}) and anything computed from them without private "
              "data (post-processing)",
              f"- guarantee holds: {yes[s.holds]}", ""]
    lines += ["## Accountant", "", f"- {s.accountant}: {s.accountant_description}"]
    if s.epsilon_lower is not None and s.epsilon_estimate is not None:
        lines.append(f"- epsilon lower {round_down(s.epsilon_lower)}, estimate "
                     f"{round_up(s.epsilon_estimate)}, upper {s.epsilon_display}")
    if s.eps_error is not None and s.accountant == "prv":  # RDP's bound is analytic
        lines.append(f"- eps_error: {round_up(s.eps_error)}")
    if s.accountant_fallback:
        lines.append(f"- RDP fallback, because: {s.accountant_fallback}")
    sigmas = ", ".join(f"sigma {p['noise_multiplier']!r} for {p['steps']} steps"
                       for p in s.noise_schedule)
    lines += ["", "## Mechanism", "", f"- {s.mechanism}",
              f"- Poisson sampling rate q = {s.sample_rate!r}, {s.steps} steps "
              f"({s.epochs} epochs)",
              f"- noise schedule: {sigmas}",
              f"- clipping norm C = {s.clipping['clip_norm']!r}"]
    lines += [f"- {key}: {json.dumps(value)}" for key, value in s.clipping.items()
              if key != "clip_norm"]
    lines += ["", "## Method", "", f"- method {s.method}, mode {s.mode}",
              f"- DP-valid: {yes[s.dp_valid]}; {s.validity_reason}", ""]
    lines += ["## Randomness", "", f"- {s.randomness}: {s.randomness_note}",
              f"- release-safe: {yes[s.release_safe]}", ""]
    lines += ["## Hyperparameter tuning", ""]
    if s.tuning is None:
        lines.append("- Not stated. How this trial and its hyperparameters were chosen is NOT "
                     "covered by the epsilon above.")
    elif s.tuning["mode"] == "private":
        lines += [f"- private tuning: end-to-end epsilon "
                  f"**{s.tuning['end_to_end_epsilon_display']}** (delta "
                  f"{s.tuning['delta']!r}) covers training and selection",
                  f"- {s.tuning['statement']}"]
    else:
        lines += [f"- adaptive sweep of {s.tuning['n_trials']} trials: the selection is NOT "
                  f"covered by the epsilon above", f"- {s.tuning['statement']}"]
    lines += ["", "## Empirical audit", ""]
    if s.audit is None:
        lines.append("- No canary audit was given.")
    else:
        a = s.audit
        verdict = ("**CONTRADICTS the claim**" if a["contradicts"]
                   else "consistent with the claim")
        kind = f" ({a['kind']})" if a["kind"] else ""
        lines.append(f"- canary audit{kind}: epsilon >= {a['eps_lower_bound_display']} at "
                     f"confidence {a['confidence']!r} from {a['canaries']} canaries; "
                     f"{verdict} epsilon <= {s.epsilon_display}")
    lines += ["", "## Not covered by this epsilon", ""]
    lines += [f"- {item}" for item in s.not_covered]
    if s.artifacts:
        lines += ["", "## Files (SHA-256)", ""]
        lines += [f"- {name}: `{digest}`" for name, digest in sorted(s.artifacts.items())]
    lines += ["", "## Versions", ""]
    lines += [f"- {name}: {value}" for name, value in sorted(s.versions.items())]
    return "\n".join(lines) + "\n"
