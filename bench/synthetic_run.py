"""A synthetic run directory for the report: realistic, complete, and written without training.

``make_run`` writes config.toml, summary.json, a manifest with every file's hash, the results
store with every column, two targets (eps 1 and 3), five series (one invalid-DP mode), ties
within intervals, a reproducible (replayable) trial, a degenerate trial, re-runs with fresh
noise, a failed trial, a trial whose audit failed, canary bounds (one contradicting its claim),
the non-private baseline, and per trial spec.json / privacy.json / history.json / audit.json /
checkpoint. The report, pick and pareto tests build on it, and ``bench/render_report.sh``
screenshots its report.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.core import layout
from dpsweep.core.events import PoissonSubsampledGaussian, events_to_list
from dpsweep.core.records import PrivacyRecord
from dpsweep.orchestrator.config import Config, DataConfig, PrivacyConfig, SweepConfig
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.reports import store

DATASET = "fashion-mnist"
SIZES = {"train": 5000, "validation": 2000, "holdout": 2000, "test": 2000, "shadow": 5000}
LAYERS = (("conv1", 0), ("conv2", 1), ("fc1", 2), ("output", -1))
ATTACKS = ("lira", "rmia", "shadow_classifier")
INVALID_REASON = ("epsilon claim invalid: clipping thresholds computed from private data "
                  "without noise")


@dataclass(frozen=True)
class T:
    """One synthetic trial."""

    tid: str
    method: str
    mode: str
    eps: float
    val: float
    mia: float  # NaN = audit failed
    valid: bool = True
    reproducible: bool = False
    repeat_of: str = ""
    leak: bool = False
    canary: tuple[float, bool] | None = None  # (lower bound, contradicts)

    @property
    def series(self) -> str:
        return self.method if self.mode in ("", "public") else f"{self.method}:{self.mode}"

    @property
    def test(self) -> float:
        return round(self.val - 0.01, 4)


#: At eps 3 (Wilson intervals on 2,000 validation examples are about +-0.014; MIA intervals are
#: [mia - 0.02, mia + 0.03]): over all series the front is t6, t7, t13; over valid, release-safe
#: trials it is t6, t2, t9, t10, t5, t1, t4, of which t2 and t5 are there only as ties (plain
#: Pareto dominance would drop them).
TRIALS: tuple[T, ...] = (
    T("t1", "dpsgd", "", 3.0, 0.90, 0.56, canary=(0.8, False)),
    T("t2", "dpsgd", "", 3.0, 0.86, 0.53),
    T("t3", "dpsgd", "", 3.0, 0.80, 0.55),
    T("t4", "ww_dpsgd", "", 3.0, 0.91, 0.585, leak=True),
    T("t5", "ww_dpsgd", "", 3.0, 0.88, 0.545),
    T("t6", "dp_adamilg", "public", 3.0, 0.87, 0.52),
    T("t7", "dp_adamilg", "faithful", 3.0, 0.93, 0.53, valid=False, canary=(3.4, True)),
    T("t8", "ww_dpsgd", "", 3.0, 0.84, 0.57),
    T("t9", "dpsgd_lf", "", 3.0, 0.89, 0.54),
    T("t10", "dpsgd_lf", "", 3.0, 0.89, 0.54),
    T("t12", "dpsgd_lf", "", 3.0, 0.85, math.nan),
    T("t13", "dpsgd", "", 3.0, 0.92, 0.55, reproducible=True),
    T("t14", "dpsgd", "", 3.0, 0.15, 0.50),
    T("t15", "dpsgd", "", 3.0, 0.895, 0.565, repeat_of="t1"),
    T("t21", "dpsgd", "", 1.0, 0.80, 0.52),
    T("t22", "ww_dpsgd", "", 1.0, 0.82, 0.525),
    T("t23", "dp_adamilg", "public", 1.0, 0.78, 0.51),
    T("t24", "dpsgd", "", 1.0, 0.79, 0.52, repeat_of="t21"),
    T("t25", "dp_adamilg", "faithful", 1.0, 0.85, 0.54, valid=False),
)
BASELINE = {"val": 0.97, "test": 0.965, "mia": 0.70}
SERIES = ("dpsgd", "ww_dpsgd", "dp_adamilg", "dp_adamilg:faithful", "dpsgd_lf")


def _params(method: str, mode: str) -> dict[str, Any]:
    from dpsweep.trainables.methods import get_method

    values: dict[str, Any] = {"lr": 0.8, "clip_norm": 1.0}
    if mode:
        values["mode"] = mode
    return dict(get_method(method).validate_params(values))


def _schedule(method: str) -> list[dict[str, Any]]:
    if method == "dp_adamilg":
        return [{"noise_multiplier": 1.9, "steps": 50}, {"noise_multiplier": 1.6, "steps": 50}]
    return [{"noise_multiplier": 1.21, "steps": 100}]


def _cells(t: T, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Per (layer, attack) metrics; the peak at fc1 x lira."""
    cells = []
    for name, index in LAYERS:
        attacks = (*ATTACKS, "loss") if index == -1 else ATTACKS
        for attack in attacks:
            peak = (name, attack) == ("fc1", "lira")
            acc = t.mia if peak else round(0.5 + (t.mia - 0.5) * (0.4 + 0.5 * rng.random()), 4)
            cells.append({
                "layer": name, "index": index, "attack": attack, "accuracy": acc,
                "accuracy_ci": [acc - 0.02, acc + 0.02], "auc": acc + 0.01,
                "auc_ci": [acc - 0.01, acc + 0.03], "tpr_at_1pct_fpr": 0.012,
                "tpr_at_1pct_fpr_ci": [0.005, 0.02], "tpr_at_0.1pct_fpr": 0.001,
                "tpr_at_0.1pct_fpr_ci": [0.0, 0.004], "tpr_at_1pct_fpr_meaningful": True,
                "tpr_at_0.1pct_fpr_meaningful": False,
                "p_value": 0.001 if (t.leak and peak) else 0.4,
                "significant": bool(t.leak and peak), "n_members": 1000,
                "n_nonmembers": 1000})
    return cells


def _roc(auc: float) -> tuple[list[float], list[float]]:
    fpr = [0.0, 0.001, 0.01, 0.1, 0.3, 0.6, 1.0]
    power = max(0.05, (1 - auc) / auc)
    return fpr, [f ** power for f in fpr]


def _trajectories(seed: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    steps = [25.0 * (k + 1) for k in range(8)]
    zeta = [6.5 - 0.3 * k + 0.2 * float(rng.standard_normal()) for k in range(8)]
    zeta_hat, clip, c, z = [], [], 1.0, zeta[0]
    for value in zeta:
        z = 0.95 * z + 0.05 * value
        c = float(np.clip(c * math.exp(0.1 * max(-1, min(1, (z - 4) / 2))), 0.3, 5.0))
        zeta_hat.append(z)
        clip.append(c)
    return {"step": steps, "clip_norm": clip, "zeta_hat": zeta_hat, "zeta": zeta,
            "clamp": [0.0] * 8}


def make_spec(t: T, seed: int) -> dict[str, Any]:
    schedule = _schedule(t.method)
    return {"method": t.method, "method_params": _params(t.method, t.mode), "epochs": 2,
            "batch_size": 100,
            "calibration": {"schema": 1, "target_epsilon": t.eps, "delta": 1e-5,
                            "sample_rate": 0.02, "schedule": schedule, "scale": 1.0,
                            "bounds": {"lower": t.eps * 0.97, "estimate": t.eps * 0.98,
                                       "upper": t.eps * 0.997, "accountant": "prv"},
                            "accountant": "prv", "fallback_reason": None, "eps_error": 0.01,
                            "seconds": 0.5, "cached": False},
            "epsilon_curve": [t.eps * 0.7, t.eps * 0.997], "seed": seed,
            "randomness": "reproducible" if t.reproducible else "secret",
            "dataset": DATASET, "data_dir": None, "split_seed": 0, "sizes": dict(SIZES),
            "model": "auto", "activation": "tanh", "device": "auto", "threads": 1,
            "max_physical_batch": 512, "trial_id": t.tid, "extra": {}}


def _config() -> Config:
    return dataclasses.replace(
        Config(), data=DataConfig(dataset=DATASET, **{f"{k}_size": v for k, v in SIZES.items()}),
        privacy=PrivacyConfig(epsilon=3.0, delta=1e-5),
        budget=dataclasses.replace(Config().budget, epsilons=[1.0, 3.0]),
        sweep=SweepConfig(methods=list(SERIES), trials_per_method=4))


SUMMARY = {"started": "2025-01-01T10:00:00+00:00", "finished": "2025-01-01T11:02:03+00:00",
           "wall_seconds": 3723.0, "attempts": 3, "attempts_without_end": 1,
           "versions": {"dpsweep": "0.2.0", "torch": "2.4.0",
                                                "opacus": "1.5.2", "python": "3.11.2"},
           "accountant": "prv (PRV accountant, Gopi et al. 2021)",
           "split_sizes": dict(SIZES), "model": "cnn28",
           "tuning": {"mode": "adaptive", "statement": "Adaptive TPE search over noiseless "
                      "validation accuracy: not covered.", "n_trials": 21,
                      "end_to_end_epsilon": None}}


def _privacy_record(t: T, spec: dict[str, Any], seed: int) -> PrivacyRecord:
    """What training would have recorded for ``t`` (its ledger: one event per phase)."""
    schedule = _schedule(t.method)
    reason = INVALID_REASON if not t.valid else (
        "noise calibrated to clipped per-example gradients; post-processing only")
    events = [PoissonSubsampledGaussian(sampling_probability=0.02, count=p["steps"],
                                        noise_multiplier=p["noise_multiplier"])
              for p in schedule]
    return PrivacyRecord.from_dict({
        "mechanism": "poisson_subsampled_gaussian", "method": t.method,
        "mode": spec["method_params"]["mode"], "dp_valid": t.valid, "validity_reason": reason,
        "randomness": spec["randomness"], "release_safe": not t.reproducible,
        "sample_rate": 0.02, "steps": 100, "noise_multiplier": schedule[0]["noise_multiplier"],
        "noise_schedule": schedule, "clip_norm": 1.0, "delta": 1e-5, "target_epsilon": t.eps,
        "epsilon_lower": t.eps * 0.97, "epsilon_estimate": t.eps * 0.98,
        "epsilon_upper": t.eps * 0.997, "accountant": "prv", "accountant_fallback": None,
        "eps_error": 0.01, "ledger": {"sample_rate": 0.02, "events": events_to_list(events)},
        "guard_capped": 0, "method_record": {},
        "trajectories": _trajectories(seed) if t.method == "ww_dpsgd" else {},
        "versions": {"dpsweep": "0.2.0", "torch": "2.4.0"}})


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def _baseline_row() -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in store.COLUMNS}
    row.update({"trial_id": "base", "series": "nonprivate", "study": "nonprivate",
                "method": "nonprivate", "mode": "", "status": "ok", "error": "",
                "dp_valid": False, "validity_reason": "non-private baseline: no DP",
                "release_safe": False, "degenerate": False, "val_accuracy": BASELINE["val"],
                "test_accuracy": BASELINE["test"], "epsilon_upper": math.nan,
                "target_epsilon": math.nan, **store.empty_audit(),
                "peak_mia_accuracy": BASELINE["mia"], "peak_mia_upper": BASELINE["mia"] + 0.03,
                "peak_layer": "output", "peak_attack": "loss", "leak_detected": True,
                "leak_p_value": 1e-6, "audit_contradicts": False, "trajectories": "{}",
                "repeat_of": "", "canaries": -1, "epochs": 2, "batch_size": 100})
    return row


#: An audit whose references deviate from the target (what the demo's small shadow pool gives).
REFERENCE_NOTE = ("the shadow pool (300) is smaller than twice the target's training set (800): "
                  "offline references train on half the pool (150 examples)")


def make_run(root: Path, *, audited: bool = True, summary: bool = True,
             rows_hook: Callable[[list[dict[str, Any]]], None] | None = None) -> Path:
    """A run directory of ``TRIALS`` with its manifest (``rows_hook`` edits the rows before
    the store is written, so the manifest still vouches for it)."""
    run_path = root / "run"
    run = RunDir.create(run_path, config_text=_config().to_toml())
    rels: list[str] = []
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    try:
        for seed, t in enumerate(TRIALS):
            trial = run.path / layout.TRIALS / t.tid
            checkpoint = trial / layout.CHECKPOINT_DIR
            checkpoint.mkdir(parents=True)
            (checkpoint / layout.CHECKPOINT_FILE).write_bytes(
                b"synthetic checkpoint " + t.tid.encode())
            spec = make_spec(t, seed)
            privacy = _privacy_record(t, spec, seed)
            history = [{"epoch": e, "val_accuracy": t.val * f, "val_loss": 0.5 / f,
                        "test_accuracy": t.test * f, "test_loss": 0.5 / f,
                        "train_loss_nonprivate": 0.6 / f, "epsilon_spent": t.eps * f,
                        "epoch_seconds": 1.0} for e, f in ((1, 0.9), (2, 1.0))]
            _write_json(trial / layout.SPEC, spec)
            _write_json(trial / layout.PRIVACY, privacy.to_dict())
            _write_json(trial / layout.HISTORY, history)
            row = store.row_from_trial(
                run_dir=run.path, trial_dir=trial, checkpoint_dir=checkpoint, spec=spec,
                privacy=privacy, history=history, train_seconds=30.0, num_classes=10,
                series=t.series, study=f"{t.series}@eps{t.eps:g}", repeat_of=t.repeat_of)
            if audited and math.isfinite(t.mia):
                cells = _cells(t, rng)
                row.update({"peak_mia_accuracy": t.mia, "peak_mia_upper": t.mia + 0.03,
                            "peak_layer": "fc1", "peak_layer_index": 2, "peak_attack": "lira",
                            "leak_detected": t.leak, "leak_p_value": 0.004 if t.leak else 0.6,
                            "loss_attack_accuracy": 0.5 + (t.mia - 0.5) * 0.5,
                            "mia_layers": json.dumps(cells), "audit_seconds": 12.0,
                            "audit_mode": "offline"})
                _write_json(trial / layout.AUDIT, {"trial_id": t.tid, "attacks": [
                    {**c, "roc_fpr": _roc(c["accuracy"])[0], "roc_tpr": _roc(c["accuracy"])[1]}
                    for c in cells], "note": REFERENCE_NOTE,
                    "references": [{"index": k, "test_accuracy": 0.3} for k in range(4)]})
            elif audited:
                row["audit_error"] = "RuntimeError: shadow model diverged (train loss nan)"
            if t.canary is not None:
                row.update({"eps_lower_bound": t.canary[0], "eps_lower_bound_kind": "black-box",
                            "canaries": 1000, "audit_contradicts": t.canary[1]})
            rows.append(row)
            rels += [run.relative(p) for p in sorted(trial.rglob("*")) if p.is_file()]
        rows.append(store.failed_row(trial_id="t11", method="ww_dpsgd", series="ww_dpsgd",
                                     study="ww_dpsgd@eps3",
                                     error="TrialDiverged: train loss became nan in epoch 1",
                                     spec={"seed": 11, "batch_size": 100,
                                           "method_params": {"lr": 9.0, "clip_norm": 5.0}}))
        rows.append(_baseline_row())
        if rows_hook is not None:
            rows_hook(rows)
        store.write_results(run.path, rows)
        rels.append(layout.RESULTS)
        if summary:
            _write_json(run.path / layout.SUMMARY, SUMMARY)
            rels.append(layout.SUMMARY)
        run.record(rels)
    finally:
        run.release()
    return run.path
