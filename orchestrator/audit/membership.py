"""The audit of a trained model: calibrated membership attacks per layer, with statistics.

Four parts, each in its floor: which examples are audited and what each reference model trains
on (``trainables.audit.references``: the *online* plan trains references on random halves of the
private population of members and non-members; the *offline* plan only on the public pool), the
per-example signals of target and references (``trainables.audit.signals``: every layer's log
gradient norm, the logit-scaled confidence, the loss), the attacks that turn them into
membership scores (``trainables.audit.scores``: LiRA online / offline, RMIA, the loss threshold;
``trainables.audit.classifier``: the pooled shadow classifier kept for comparison), and the
statistics (``trainables.audit.stats``: intervals, p-values, the Holm-corrected peak, its
simultaneous upper bound). This module wires them for one model and writes ``audit.json``
and, beside it, ``audit_scores.npz``: every candidate's pool index, membership and score per
layer x attack, the exact float32 values the statistics were computed from, so anyone can
re-analyse an audit (``docs/reanalyse_audit.py``); the ROC in ``audit.json`` is thinned.
RMIA runs once on the output: on ``logit`` and on ``loss`` it reads the same true-class
probability (``trainables.audit.signals.rmia_input``), and a duplicate would only be counted
twice by the Holm correction. Reference models are kept in the run's cache and reused when
recipe, data and budget are identical (``trainables.audit.cache``).

A layer x attack cell whose input is bit-identical in the target and every reference (a frozen
backbone shared through one weights file), or whose scores are not finite, is not scored: the
record lists it under ``excluded`` with its reason, ``layers`` gives each layer's status, and
the peak, its upper bound and the Holm family range over the scored cells only
(``trainables.audit.exclusion``).

Every attack's decision threshold is chosen without the target's membership labels, so the
reported accuracies are not optimistic; a reference model is trained with the target's method,
hyperparameters and epsilon (its budget matched for its own training-set size before the sweep
starts), never with the target's noise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import CACHE, CHECKPOINT_DIR, TRIALS
from dpsweep.core.storage import atomic_write_bytes, atomic_write_json
from dpsweep.core.trial import Calibration, TrialSpec
from dpsweep.orchestrator.audit.stored import Cell, ModelCells, write_signals
from dpsweep.orchestrator.trial.plan import match_budget
from dpsweep.trainables.audit.cache import caching
from dpsweep.trainables.audit.classifier import THRESHOLD, ShadowClassifier
from dpsweep.trainables.audit.exclusion import (
    NON_FINITE,
    SCORED,
    SHARED,
    UNSCORABLE,
    Exclusion,
    absent_peak_reason,
    frozen_layers,
    identical_signals,
    layer_statuses,
    non_finite_reason,
    shared_reason,
)
from dpsweep.trainables.audit.plan_statement import plan_statement
from dpsweep.trainables.audit.probes import MIN_PER_CLASS, probe_set_of, probe_signals
from dpsweep.trainables.audit.references import (
    AuditSignals,
    Budget,
    ReferencePlan,
    collect_signals,
    dp_trainer,
    plan_references,
    reference_block,
    score_signals,
)
from dpsweep.trainables.audit.scores import ATTACKS, RMIA
from dpsweep.trainables.audit.signals import rmia_input, signal_kind
from dpsweep.trainables.audit.stats.attacks import (
    attack_statistics,
    combine_attacks,
    consistent_with_dp,
)
from dpsweep.trainables.data.splits import DataSplits
from dpsweep.trainables.training.loop import load_model

if TYPE_CHECKING:
    from dpsweep.trainables.models.networks import LayeredModel
    from dpsweep.trainables.training.loop import TrialResult

logger = logging.getLogger(__name__)

#: Row of the output-layer signals (logit confidence, loss) in the per-layer tables.
OUTPUT = "output"
SHADOW_CLASSIFIER = "shadow_classifier"
#: The ``signal`` of the shadow classifier's cells: each layer's sorted representation.
IR_SIGNAL = "sorted IR"
#: The ``format`` entry of the per-candidate scores file (:func:`write_scores`).
SCORES_FORMAT = "dpsweep-audit-scores-1"


@dataclasses.dataclass(frozen=True)
class AuditSettings:
    """The ``[audit]`` section, as the trial and the driver read it."""

    references: str
    reference_models: int
    max_candidates: int
    alpha: float
    seed: int
    layer_probes: bool = True

    @classmethod
    def from_config(cls, section: Any) -> AuditSettings:
        get = (section.get if isinstance(section, Mapping)
               else lambda k, d=None: getattr(section, k, d))
        return cls(references=str(get("references")),
                   reference_models=int(get("reference_models")),
                   max_candidates=int(get("max_candidates")), alpha=float(get("alpha")),
                   seed=int(get("seed")),
                   # a run directory written before the field existed audited without probes
                   layer_probes=bool(get("layer_probes") or False))


def reference_plan(data: DataSplits, settings: AuditSettings, *, block: int = 0
                   ) -> ReferencePlan:
    return plan_references(data=data, kind=settings.references,
                           n_references=settings.reference_models, seed=settings.seed,
                           max_candidates=settings.max_candidates or None, block=block)


def _layer_of(signal: str, layers: list[str]) -> tuple[str, int, str]:
    """(layer, index, signal kind) of a signal name: gradient norms belong to their layer, the
    logit confidence and the loss to the output row."""
    kind = signal_kind(signal)
    if ":" in signal:
        layer = signal.split(":", 1)[1]
        return layer, layers.index(layer), kind
    return OUTPUT, len(layers), kind


#: ``progress(line)``: one human-readable line per reference and stage of an audit.
Progress = Callable[[str], None]


def _say(progress: Progress | None, line: str) -> None:
    """To the caller's progress callback, or this module's logger (INFO) without one."""
    if progress is None:
        logger.info(line)
    else:
        progress(line)


def audit_model(*, target: LayeredModel, data: DataSplits, settings: AuditSettings,
                trainer: Any, cache_dir: Path | None = None, scores_out: Path | None = None,
                signals_out: Path | None = None, block: int = 0,
                progress: Progress | None = None) -> dict[str, Any]:
    """Every attack on every layer of ``target`` with its statistics: the audit record.

    ``cache_dir`` keeps reference models between calls (``trainables.audit.cache``: reused
    where recipe, data and budget are identical); ``scores_out`` receives every candidate's
    score per layer x attack (:func:`write_scores`), exactly the values the statistics were
    computed from; ``signals_out`` the signals and the target's own cells, which a sweep pools
    over a study's trials (``orchestrator.audit.pooling``); ``block`` picks the references
    (``trainables.audit.references.reference_block``); ``progress`` gets a line per reference
    and stage.
    """
    started = time.perf_counter()
    plan = reference_plan(data, settings, block=block)
    _say(progress, f"audit: {plan.kind} plan, {plan.n_references} references, "
                   f"{len(plan.candidates)} candidates")
    classifier = ShadowClassifier(plan, classes=data.num_classes, seed=settings.seed)
    extra = None
    if settings.layer_probes:
        extra = probe_signals(probe_set=probe_set_of(data.validation, seed=settings.seed),
                              num_classes=data.num_classes)
    base = caching(trainer, cache_dir)
    hits: set[int] = getattr(base, "hits", set())

    def reference_done(r: Any) -> None:
        how = ("loaded from the cache" if r.index in hits
               else f"trained in {r.train_seconds:.1f} s")
        _say(progress, f"audit: reference {r.index + 1}/{plan.n_references} {how}, test "
                       f"accuracy {r.test_accuracy:.3f}")

    signals = collect_signals(target=target, data=data, plan=plan,
                              trainer=classifier.wrap(base), extra=extra,
                              progress=reference_done)
    trained = time.perf_counter()
    model = model_cells(classifier, target)
    if signals_out is not None:
        write_signals(Path(signals_out), signals=signals, model=model)
    record = audit_record(signals=signals, model=model, alpha=settings.alpha,
                          scores_out=scores_out)
    record["references"] = [{**dataclasses.asdict(r), "cached": r.index in hits}
                            for r in signals.records]
    record["reference_train_seconds"] = trained - started
    _say(progress, f"audit: {record['n_scored']} attacks scored, {len(record['excluded'])} "
                   f"excluded in {record['scoring_seconds']:.1f} s (references "
                   f"{record['reference_train_seconds']:.1f} s)")
    return record


def audit_signals(*, signals: AuditSignals, classifier: ShadowClassifier,
                  target: LayeredModel, alpha: float,
                  scores_out: Path | None = None) -> dict[str, Any]:
    """The audit record of collected signals (all but the references' list and training time):
    :func:`audit_record` with the target's shadow-classifier cells."""
    return audit_record(signals=signals, model=model_cells(classifier, target), alpha=alpha,
                        scores_out=scores_out)


def audit_record(*, signals: AuditSignals, model: ModelCells, alpha: float,
                 scores_out: Path | None = None, trials: int = 1,
                 write: Callable[[Path, bytes], None] = atomic_write_bytes) -> dict[str, Any]:
    """The audit record of collected signals and the target's own cells: every layer x attack
    cell scored or excluded with its reason, the statistics of the scored ones, and the peak
    and Holm family over them alone (absent, with the reason, when no cell is scored).
    ``trials``: how many trials' references ``signals`` pools (``orchestrator.audit.pooling``);
    ``write(path, data)`` writes the scores file (a run directory's commit, for one).
    """
    started = time.perf_counter()
    plan = signals.plan
    cells = _scored(signals, model)
    entries, combined = _statistics(cells.scored, labels=plan.is_member, alpha=alpha)
    record: dict[str, Any] = {
        "mode": plan.kind, "n_references": plan.n_references,
        "reference_size": plan.reference_size, "note": plan.note,
        "plan_statement": plan_statement(kind=plan.kind, n_references=plan.n_references,
                                         trials=trials),
        "n_candidates": len(plan.is_member), "alpha": alpha,
        "attacks": entries, "excluded": [e.to_dict() for e in cells.excluded],
        "layers": cells.statuses, "n_scored": len(entries),
        "combined": None if combined is None else combined.to_dict(),
    }
    if scores_out is not None:
        record.update(write_scores(Path(scores_out), plan=plan, scored=cells.scored,
                                   write=write))
    record.update(_peak(record, combined))
    record["scoring_seconds"] = time.perf_counter() - started
    return record


def _statistics(scored: Mapping[tuple[str, str], tuple[np.ndarray, dict[str, Any]]], *,
                labels: np.ndarray, alpha: float) -> tuple[list[dict[str, Any]], Any]:
    """The record's entry per scored cell and the Holm-corrected combination over them (None
    without a scored cell: nothing to combine)."""
    per_attack = {key: attack_statistics(labels=labels, scores=scores,
                                         decision_threshold=meta["threshold"])
                  for key, (scores, meta) in scored.items()}
    if not per_attack:
        return [], None
    combined = combine_attacks(per_attack_stats=per_attack, alpha=alpha)
    corrected = {(c["layer"], c["attack"]): c["p"]
                 for c in combined.to_dict()["corrected_p_values"]}
    entries = []
    for key, stats in per_attack.items():
        entry = _entry(key, stats, scored[key][1])
        entry["p_corrected"] = corrected[key]
        entry["significant"] = bool(corrected[key] < alpha)
        entries.append(entry)
    return entries, combined


def stored_scores(scores: Any) -> np.ndarray:
    """The float32 values :func:`write_scores` keeps, as float64: the audit's statistics are
    computed from these, so the stored file reproduces them exactly (ranks that float32 merges
    become ties, counted half, for members and non-members alike)."""
    big = float(np.finfo(np.float32).max)
    return np.clip(np.asarray(scores, dtype=np.float64), -big, big) \
        .astype(np.float32).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class _Cells:
    """Every layer x attack cell of an audit: scored (stored scores and metadata, in the order
    the record lists them), or excluded with its reason; and each layer's status."""

    scored: dict[tuple[str, str], Cell]
    excluded: list[Exclusion]
    statuses: list[dict[str, Any]]


def _scored(signals: AuditSignals, model: ModelCells) -> _Cells:
    """Every calibrated attack on every signal, then the target's own cells (the shadow
    classifier's); a cell whose input is identical in the target and every reference, or whose
    scores are not finite, is excluded (``trainables.audit.exclusion``)."""
    layers = list(model.layers)
    frozen = set(model.frozen)
    plan = signals.plan
    n_examples = len(plan.candidates) + len(plan.population)
    same = identical_signals(signals)
    scored: dict[tuple[str, str], Cell] = {}
    excluded: list[Exclusion] = []
    names = list(signals.target)
    for signal in names:
        layer, index, kind = _layer_of(signal, layers)

        def drop(attack: str, status: str, reason: str, *, layer: str = layer,
                 index: int = index, signal: str = signal) -> None:
            excluded.append(Exclusion(layer=layer, index=index, attack=attack, signal=signal,
                                      status=status, reason=reason))

        shared = (shared_reason(frozen=layer in frozen, what=f"its signal '{signal}'",
                                n_references=plan.n_references, n_examples=n_examples)
                  if signal in same else None)
        try:
            attacks = _signal_attacks(signals, signal, names)
        except ValueError as exc:  # e.g. too few finite reference values for a variance
            drop(f"*:{kind}", SHARED if shared else UNSCORABLE, shared or
                 f"no attack on '{signal}' could be computed: {exc}")
            continue
        for name, result in attacks.items():
            attack = f"{name}:{kind}"
            if shared:
                drop(attack, SHARED, shared)
            elif not np.isfinite(result.scores).all():
                drop(attack, NON_FINITE, non_finite_reason(
                    result.scores, what=f"the signal '{signal}'",
                    target=signals.target[signal], references=signals.references[signal]))
            else:
                scored[(layer, attack)] = (stored_scores(result.scores), {
                    "index": index, "signal": signal, "rule": result.rule,
                    "threshold": result.threshold})
    scored.update(model.shadow)
    excluded.extend(model.shadow_excluded)
    rows = [(name, i) for i, name in enumerate(layers)] + [(OUTPUT, len(layers))]
    return _Cells(scored=scored, excluded=excluded,
                  statuses=layer_statuses(layers=rows, scored=scored, excluded=excluded,
                                          frozen=frozen))


def _signal_attacks(signals: AuditSignals, signal: str, names: list[str]) -> dict[str, Any]:
    """Every attack on one signal, as ``score_signals`` runs it among ``names``: RMIA only once
    per probability it reads (``rmia_input``), so none on ``loss`` beside ``logit``."""
    own = rmia_input(signal)
    attacks = tuple(a for a in ATTACKS if a != RMIA or own == signal or own not in names)
    return score_signals(signals, names=[signal], attacks=attacks)[signal]


def model_cells(classifier: ShadowClassifier, target: LayeredModel) -> ModelCells:
    """The shadow classifier's cell of every layer, except layers whose raw output is
    identical in the target and every reference."""
    layers = list(target.layer_names)
    frozen = frozen_layers(target)
    attack = f"{SHADOW_CLASSIFIER}:ir"
    split, _ = classifier.calibration()
    same = set(classifier.identical_layers(target))
    scored: dict[tuple[str, str], Cell] = {}
    excluded = [Exclusion(layer=layer, index=layers.index(layer), attack=attack,
                          signal=IR_SIGNAL, status=SHARED, reason=shared_reason(
                              frozen=layer in frozen, what="its output",
                              n_references=classifier.plan.n_references,
                              n_examples=len(split)))
                for layer in layers if layer in same]
    result = classifier.scores(target, layers=[name for name in layers if name not in same])
    for layer, why in result.failed.items():
        excluded.append(Exclusion(layer=layer, index=layers.index(layer), attack=attack,
                                  signal=IR_SIGNAL, status=UNSCORABLE, reason=why))
    for layer, probs in result.scores.items():
        if not np.isfinite(probs).all():
            excluded.append(Exclusion(
                layer=layer, index=layers.index(layer), attack=attack, signal=IR_SIGNAL,
                status=NON_FINITE, reason=non_finite_reason(probs, what="P(member)")))
            continue
        scored[(layer, attack)] = (stored_scores(probs), {
            "index": layers.index(layer), "signal": IR_SIGNAL,
            "rule": f"P(member) >= {THRESHOLD:g}", "threshold": THRESHOLD})
    return ModelCells(layers=tuple(layers), frozen=frozenset(frozen), shadow=scored,
                      shadow_excluded=tuple(excluded))


def write_scores(path: Path, *, plan: Any,
                 scored: Mapping[tuple[str, str], tuple[np.ndarray, Any]],
                 write: Callable[[Path, bytes], None] = atomic_write_bytes) -> dict[str, Any]:
    """Write every candidate's scores (compressed npz, no pickles; ``SCORES_FORMAT``):
    ``pool_index`` [N] int64 (the candidate's index in the dataset's pool), ``is_member`` [N]
    int8, ``layer`` and ``attack`` [A] strings, ``scores`` [A, N] float32 (row a is the record
    entry with that layer and attack; larger = member). Returns the record's reference to it."""
    keys = list(scored)
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, format=np.array(SCORES_FORMAT),
        pool_index=np.asarray(plan.candidates.indices, dtype=np.int64),
        is_member=np.asarray(plan.is_member, dtype=np.int8),
        layer=np.array([k[0] for k in keys], dtype=str),
        attack=np.array([k[1] for k in keys], dtype=str),
        scores=(np.stack([scored[k][0] for k in keys]) if keys
                else np.zeros((0, len(plan.is_member)))).astype(np.float32))
    blob = buffer.getvalue()
    write(path, blob)
    return {"scores_file": path.name, "scores_sha256": hashlib.sha256(blob).hexdigest()}


def _entry(key: tuple[str, str], stats: Any, meta: dict[str, Any]) -> dict[str, Any]:
    d = stats.to_dict()
    tprs = {round(t["target_fpr"], 6): t for t in d["tpr_at_fpr"]}
    out = {"layer": key[0], "attack": key[1], "index": meta["index"], "signal": meta["signal"],
           "rule": meta["rule"], "threshold": meta["threshold"], "accuracy": d["accuracy"],
           "accuracy_ci": [d["accuracy_low"], d["accuracy_high"]], "auc": d["auc"],
           "auc_ci": [d["auc_low"], d["auc_high"]]}
    for alpha, label in ((0.01, "1pct"), (0.001, "0.1pct")):
        t = tprs[round(alpha, 6)]
        out[f"tpr_at_{label}_fpr"] = t["tpr"]
        out[f"tpr_at_{label}_fpr_ci"] = [t["tpr_low"], t["tpr_high"]]
        out[f"tpr_at_{label}_fpr_meaningful"] = t["meaningful"]
    return {**out,
        "p_value": d["p_value"], "n_members": d["n_members"],
        "n_nonmembers": d["n_nonmembers"], "roc_fpr": d["roc_fpr"], "roc_tpr": d["roc_tpr"],
    }


def _peak(record: dict[str, Any], combined: Any) -> dict[str, Any]:
    """The record's peak fields: over the scored cells only; absent (None) with the reason when
    no cell is scored."""
    loss = next((e for e in record["attacks"] if e["attack"].startswith("loss_threshold")),
                None)
    losses = {"loss_attack_accuracy": None if loss is None else loss["accuracy"],
              "loss_attack_auc": None if loss is None else loss["auc"]}
    if combined is None:
        return {"peak_mia_accuracy": None, "peak_mia_upper": None, "peak_layer": None,
                "peak_layer_index": None, "peak_attack": None, "leak_detected": False,
                "leak_p_value": None, "peak_half_width": None,
                "peak_absent_reason": absent_peak_reason(record["layers"]), **losses}
    c = combined.to_dict()
    layer, attack = c["peak_layer"], c["peak_attack"]
    peak = next(e for e in record["attacks"] if e["layer"] == layer and e["attack"] == attack)
    return {"peak_mia_accuracy": peak["accuracy"], "peak_mia_upper": c["peak_upper"],
            "peak_layer": layer, "peak_layer_index": peak["index"], "peak_attack": attack,
            "leak_detected": bool(c["leak_detected"]),
            "leak_p_value": c["min_p_corrected"],
            "peak_half_width": c["peak_half_width"], "peak_absent_reason": None, **losses}


def claim_check(record: Mapping[str, Any], *, epsilon: float,
                delta: float) -> dict[str, Any]:
    """Every measured ROC point of every attack against the claimed (epsilon, delta).

    A (epsilon, delta)-DP mechanism bounds every membership test by TPR <= e^eps FPR + delta
    (and the mirror inequality). ``mia_epsilon_lower`` is the empirical epsilon lower bound at
    95% with the bounds of all points and attacks holding simultaneously (Bonferroni), so it
    may be compared with the claim although the worst point was picked;
    ``mia_pointwise_violations`` counts points whose own 95% intervals lie wholly outside the
    claimed region (a looser, per-point reading, reported so a reviewer sees both).
    """
    fpr: list[float] = []
    tpr: list[float] = []
    n_members = n_nonmembers = 0
    for entry in record["attacks"]:
        fpr.extend(entry["roc_fpr"])
        tpr.extend(entry["roc_tpr"])
        n_members, n_nonmembers = int(entry["n_members"]), int(entry["n_nonmembers"])
    joint = consistent_with_dp(fpr=fpr, tpr=tpr, n_members=n_members,
                               n_nonmembers=n_nonmembers, epsilon=epsilon, delta=delta)
    each = consistent_with_dp(fpr=fpr, tpr=tpr, n_members=n_members,
                              n_nonmembers=n_nonmembers, epsilon=epsilon, delta=delta,
                              simultaneous=False)
    return {"mia_epsilon_lower": joint.epsilon_lower, "mia_roc_points": joint.n_points,
            "mia_pointwise_violations": each.n_violations,
            "mia_worst_point": [joint.worst_fpr, joint.worst_tpr]}


def row_audit_columns(record: Mapping[str, Any], *,
                      row: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The results row's MIA columns from an audit record (ROC points stay in audit.json).

    With the trial's ``row``, its claimed epsilon is checked against every ROC point
    (:func:`claim_check`); a valid claim below the measured bound is contradicted.
    """
    cells = [{**{k: v for k, v in e.items() if k not in ("roc_fpr", "roc_tpr")},
              "status": SCORED} for e in record["attacks"]]
    cells += list(record.get("excluded", []))  # status and reason, no statistics
    nan = math.nan
    index = record["peak_layer_index"]
    return {"peak_mia_accuracy": _or_nan(record["peak_mia_accuracy"]),
            "peak_mia_upper": _or_nan(record["peak_mia_upper"]),
            "peak_layer": record["peak_layer"] or "",
            "peak_layer_index": -1 if index is None else int(index),
            "peak_attack": record["peak_attack"] or "",
            "leak_detected": bool(record["leak_detected"]),
            "leak_p_value": _or_nan(record["leak_p_value"]),
            "loss_attack_accuracy": record["loss_attack_accuracy"] or nan,
            "loss_attack_auc": record["loss_attack_auc"] or nan,
            "mia_layers": json.dumps(cells, sort_keys=True), "audit_mode": record["mode"],
            "audit_seconds": record["reference_train_seconds"] + record["scoring_seconds"],
            **_claim_columns(record, row)}


def _or_nan(value: Any) -> float:
    """A record's number, NaN where the record has none (an audit without a scored cell)."""
    return math.nan if value is None else float(value)


def _claim_columns(record: Mapping[str, Any], row: Mapping[str, Any] | None) -> dict[str, Any]:
    claim = math.nan if row is None else float(row.get("epsilon_upper") or math.nan)
    if not math.isfinite(claim) or not record["attacks"]:
        return {"mia_epsilon_lower": math.nan, "mia_pointwise_violations": -1}
    check = claim_check(record, epsilon=claim, delta=float(row["delta"]))
    out = {"mia_epsilon_lower": check["mia_epsilon_lower"],
           "mia_pointwise_violations": check["mia_pointwise_violations"]}
    if bool(row.get("dp_valid")) and check["mia_epsilon_lower"] > claim:
        out["audit_contradicts"] = True
    return out


def budgets_from_config(raw: Mapping[str, Any]) -> dict[int, Budget]:
    return {int(size): Budget(calibration=Calibration.from_dict(b["calibration"]),
                              epsilon_curve=list(b["epsilon_curve"]))
            for size, b in raw.items()}


def trial_audit_paths(trial_dir: Path) -> dict[str, Any]:
    """``audit_model``'s files and block for the trial in ``trial_dir`` (``RUN_DIR/trials/<id>``):
    its per-candidate scores and signals beside its records, its references in the run's cache
    (none outside a run directory), their block drawn from the trial id."""
    trial_dir = Path(trial_dir)
    run = trial_dir.parent.parent if trial_dir.parent.name == TRIALS else None
    return {"scores_out": trial_dir / layout.AUDIT_SCORES,
            "signals_out": trial_dir / layout.AUDIT_SIGNALS,
            "cache_dir": None if run is None else run / CACHE,
            "block": reference_block(trial_dir.name)}


def audit_trial_model(*, spec: TrialSpec, checkpoint: Path, data: DataSplits,
                      settings: AuditSettings, budgets: Mapping[int, Budget],
                      cache_dir: Path | None = None, scores_out: Path | None = None,
                      signals_out: Path | None = None, block: int = 0,
                      progress: Progress | None = None) -> dict[str, Any]:
    """Audit a trained DP trial: references trained like it (``dp_trainer``); the options are
    :func:`audit_model`'s."""
    target, _ = load_model(checkpoint, data=data, device="cpu")
    return audit_model(target=target, data=data, settings=settings,
                       trainer=dp_trainer(spec, budgets=dict(budgets), plan_cache=cache_dir),
                       cache_dir=cache_dir, scores_out=scores_out, signals_out=signals_out,
                       block=block, progress=progress)


def audit_in_trial(*, spec: TrialSpec, result: TrialResult, trial_dir: Path,
                   config: Mapping[str, Any], data: DataSplits,
                   progress: Progress | None = None) -> dict[str, Any]:
    """The trial runner's audit hook: audit_scores.npz and audit.json written, the objectives
    returned; ``progress`` as :func:`audit_model`'s."""
    del result
    settings = AuditSettings.from_config(config["audit"])
    budgets = budgets_from_config(config["audit"].get("budgets", {}))
    record = audit_trial_model(spec=spec, checkpoint=Path(trial_dir) / CHECKPOINT_DIR,
                               data=data, settings=settings, budgets=budgets,
                               progress=progress, **trial_audit_paths(Path(trial_dir)))
    atomic_write_json(Path(trial_dir) / layout.AUDIT, record)
    # no scored cell: no peak (NaN, which the searcher reads as a trial without objectives);
    # audit.json says why
    return {"peak_mia_accuracy": _or_nan(record["peak_mia_accuracy"]),
            "peak_mia_upper": _or_nan(record["peak_mia_upper"]),
            "leak_detected": bool(record["leak_detected"])}


def reference_size(data: DataSplits, settings: AuditSettings) -> int:
    """The training-set size of the references (the budget the driver precomputes)."""
    return reference_plan(data, settings).reference_size


def check_settings(data: DataSplits, settings: AuditSettings) -> None:
    """Split sizes the audit needs, refused before any trial runs."""
    try:
        plan = reference_plan(data, settings)
    except ValueError as exc:
        raise UserInputError(field="audit", value=settings.references,
                             allowed=f"split sizes the audit can plan ({exc})") from None
    if len(plan.candidates) < 2 * 2:
        raise UserInputError(field="data.holdout_size", value=len(data.holdout),
                             allowed="enough members and non-members to audit (>= 2 of each)")
    if settings.layer_probes:
        probe = probe_set_of(data.validation, seed=settings.seed)
        fewest = int(np.bincount(probe.y.numpy(), minlength=data.num_classes).min())
        if fewest < MIN_PER_CLASS:
            raise UserInputError(field="data.validation_size", value=len(data.validation),
                                 allowed=f"a validation split with >= {MIN_PER_CLASS} examples "
                                         f"of every class (its probe set has {fewest} of one), "
                                         f"or audit.layer_probes = false")


def reference_budgets(cfg: Any, *, method: str, params: Mapping[str, Any], epsilon: float,
                      data: DataSplits, cache_dir: Path | None) -> dict[str, dict[str, Any]]:
    """The references' budget: the trial's method and (epsilon, delta), matched for the
    references' own training-set size (their sampling rate differs from the target's)."""
    size = reference_size(data, AuditSettings.from_config(cfg.audit))
    cal, curve = match_budget(method=method, params=dict(params), dataset_size=size,
                              batch_size=min(cfg.training.batch_size, size),
                              epochs=cfg.training.epochs, epsilon=epsilon,
                              delta=cfg.privacy.delta, cache_dir=cache_dir,
                              timeout_s=cfg.privacy.accountant_timeout_s)
    return {str(size): {"calibration": cal.to_dict(), "epsilon_curve": curve}}
