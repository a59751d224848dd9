"""The report: built from a synthetic results store (no training), deterministic, complete.

``make_run`` writes a realistic run directory without training a model: every results
column, four methods, a decaying noise schedule, WW trajectories, an invalid-DP trial that
dominates the valid ones, a tie, a failed trial, a trial whose audit failed, and per-trial
spec.json / privacy.json / audit.json / checkpoint directories. test_pick uses it too.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from scipy.stats import norm

from core.errors import UserInputError
from orchestrator import results
from reports import html as report_html
from reports.html import build_report, roc_by_layer
from reports.pareto import ALL_METHODS, ALL_VALID

LAYERS = ("conv1", "conv2", "fc1", "fc2")
#: trial_id, method, mode, test accuracy, peak MIA, dp_valid. Valid front: t6 (.87/.52),
#: t9 and t10 (.89/.54, a tie), t1 (.90/.56), t4 (.91/.58); t7 (.93/.53, invalid) dominates
#: most of them; t11 failed in training; t12 finished but its audit failed.
TRIALS: tuple[tuple[str, str, str, float, float, bool], ...] = (
    ("t1", "dpsgd", "", 0.90, 0.56, True),
    ("t2", "dpsgd", "", 0.86, 0.53, True),
    ("t3", "dpsgd", "", 0.80, 0.55, True),
    ("t4", "ww_dpsgd", "", 0.91, 0.58, True),
    ("t5", "ww_dpsgd", "", 0.88, 0.545, True),
    ("t8", "ww_dpsgd", "", 0.84, 0.57, True),
    ("t6", "dp_adamilg", "public", 0.87, 0.52, True),
    ("t7", "dp_adamilg", "faithful", 0.93, 0.53, False),
    ("t9", "dpsgd_lf", "", 0.89, 0.54, True),
    ("t10", "dpsgd_lf", "", 0.89, 0.54, True),
    ("t12", "dpsgd_lf", "", 0.85, math.nan, True),
)
INVALID_REASON = ("faithful mode: clipping thresholds come from the private batch; the "
                  "epsilon claim does not hold")


def _params(method: str, mode: str) -> dict[str, Any]:
    from trainables.methods import get_method

    return get_method(method).validate_params({"mode": mode} if mode else {})


def _schedule(method: str) -> list[dict[str, Any]]:
    if method == "dp_adamilg":
        return [{"noise_multiplier": 1.9, "steps": 10}, {"noise_multiplier": 1.6, "steps": 10}]
    return [{"noise_multiplier": 1.21, "steps": 20}]


def _layers(peak: float, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Per-layer metrics rising towards the output, the peak at fc1 (index 2)."""
    accs = [0.5 + (peak - 0.5) * f for f in (0.55, 0.8, 1.0, 0.9)]
    out = []
    for i, (name, acc) in enumerate(zip(LAYERS, accs, strict=True)):
        auc = float(norm.cdf(2 * norm.ppf(acc) / math.sqrt(2)))
        out.append({"name": name, "index": i, "accuracy": acc, "ci_low": acc - 0.04,
                    "ci_high": acc + 0.04, "auc": auc,
                    "tpr_at_1pct_fpr": 0.01 + 0.1 * (acc - 0.5) + 0.001 * rng.random(),
                    "tpr_at_0.1pct_fpr": 0.001, "tpr_at_1pct_fpr_meaningful": True,
                    "tpr_at_0.1pct_fpr_meaningful": False, "n_members": 300,
                    "n_nonmembers": 300})
    return out


def _roc(auc: float) -> tuple[list[float], list[float]]:
    """Binormal ROC with the given AUC (what reports.audit thins to ~200 points)."""
    d = math.sqrt(2) * norm.ppf(auc)
    fpr = np.concatenate([[0.0], np.geomspace(1e-3, 1.0, 60)])
    tpr = norm.cdf(d + norm.ppf(np.clip(fpr, 1e-12, 1.0)))
    tpr[0] = 0.0
    return [float(v) for v in fpr], [float(v) for v in tpr]


def _trajectories(seed: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    steps = [50.0 * (k + 1) for k in range(8)]
    zeta = [6.5 - 0.3 * k + 0.2 * rng.standard_normal() for k in range(8)]
    zeta_hat, clip, c, z = [], [], 1.0, zeta[0]
    for value in zeta:
        z = 0.95 * z + 0.05 * value
        c = float(np.clip(c * math.exp(0.1 * max(-1, min(1, (z - 4) / 2))), 0.3, 5.0))
        zeta_hat.append(z)
        clip.append(c)
    return {"step": steps, "clip_norm": clip, "zeta_hat": zeta_hat, "zeta": zeta,
            "clamp": [0.0] * 8, "zeta:fc1": zeta}


def make_spec(tid: str, method: str, mode: str, seed: int) -> dict[str, Any]:
    schedule = _schedule(method)
    return {"method": method, "lr": 0.8, "clip_norm": 1.0, "epochs": 2, "batch_size": 60,
            "calibration": {"schema": 1, "target_epsilon": 3.0, "delta": 1e-5,
                            "sample_rate": 0.1, "schedule": schedule, "scale": 1.0,
                            "bounds": {"lower": 2.93, "estimate": 2.96, "upper": 2.99,
                                       "accountant": "prv"},
                            "accountant": "prv", "fallback_reason": None, "eps_error": 0.01,
                            "seconds": 0.5, "cached": False},
            "epsilon_curve": [2.1, 2.99], "seed": seed,
            "method_params": {**_params(method, mode),
                              **({"risk_meta": {"note": "prepared"}} if mode else {})},
            "momentum": 0.0, "dataset": "digits", "data_dir": None, "split_seed": 0,
            "sizes": {"train": 600, "holdout": 300, "test": 297, "shadow": 600},
            "model": "auto", "activation": "tanh", "device": "auto", "threads": 1,
            "max_physical_batch": 512, "trial_id": tid}


def make_run(root: Path, *, audited: bool = True) -> Path:
    """A run directory with the results store and trial files of ``TRIALS``."""
    run = root / "run"
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for seed, (tid, method, mode, acc, mia, valid) in enumerate(TRIALS):
        trial = run / results.TRIALS_DIR / tid
        checkpoint = trial / "epoch_002"
        checkpoint.mkdir(parents=True)
        (checkpoint / "state.pt").write_bytes(b"not a real checkpoint")
        schedule = _schedule(method)
        spec = make_spec(tid, method, mode, seed)
        reason = INVALID_REASON if not valid else "noise calibrated to clipped per-example " \
                                                  "gradients; post-processing only"
        privacy = {"mechanism": "poisson_subsampled_gaussian", "method": method,
                   "dp_valid": valid, "validity_reason": reason, "sample_rate": 0.1,
                   "steps": 20, "noise_multiplier": schedule[0]["noise_multiplier"],
                   "noise_schedule": schedule, "clip_norm": 1.0, "delta": 1e-5,
                   "target_epsilon": 3.0, "epsilon_lower": 2.93, "epsilon_estimate": 2.96,
                   "epsilon_upper": 2.99, "accountant": "prv", "accountant_fallback": None,
                   "eps_error": 0.01, "ledger": {"events": []}, "method_record": {"mode": mode},
                   "trajectories": _trajectories(seed) if method == "ww_dpsgd" else {},
                   "versions": {"dpsweep": "0.1.0"}}
        (trial / "spec.json").write_text(json.dumps(spec))
        (trial / "privacy.json").write_text(json.dumps(privacy))
        history = [{"epoch": 2, "test_accuracy": acc, "test_loss": 0.4, "train_loss": 0.5,
                    "epoch_seconds": 1.0}]
        row = results.row_from_trial(run_dir=run, trial_dir=trial, spec=spec, privacy=privacy,
                                     history=history, train_seconds=2.0)
        row["mode"] = mode
        row["audit_error"] = ""
        if audited and math.isfinite(mia):
            layers = _layers(mia, rng)
            row.update({"peak_mia_accuracy": mia, "peak_layer": "fc1", "peak_layer_index": 2,
                        "loss_attack_accuracy": 0.5 + (mia - 0.5) * 0.7,
                        "loss_attack_auc": 0.5 + (mia - 0.5) * 0.8,
                        "mia_layers": json.dumps(layers), "audit_seconds": 3.0})
            audit = {"trial_id": tid, "layers": [
                {**layer, "roc_fpr": _roc(layer["auc"])[0], "roc_tpr": _roc(layer["auc"])[1]}
                for layer in layers], "peak_layer": "fc1"}
            (trial / report_html.AUDIT_FILE).write_text(json.dumps(audit))
        elif audited:
            row["audit_error"] = "RuntimeError: shadow model diverged (train loss nan)"
        rows.append(row)
    rows.append(results.failed_row(trial_id="t11", method="ww_dpsgd",
                                   error="TrialDiverged: train loss became nan in epoch 1",
                                   spec={"seed": 11, "lr": 9.0, "clip_norm": 5.0}))
    results.write_results(run, rows)
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def built(run_dir: Path) -> Path:
    return build_report(run_dir)


def _without_stamp(text: str) -> str:
    return "\n".join(line for line in text.splitlines()
                     if f'class="{report_html.STAMP_CLASS}"' not in line)


def test_report_files_and_self_contained_html(run_dir: Path, built: Path) -> None:
    out = run_dir / report_html.REPORT_DIR
    assert built == out / report_html.HTML_FILE
    names = {p.name for p in out.iterdir()}
    assert {"front.png", "mia_heatmap.png", "roc_peak_layer.png", "ww_trajectories.png",
            "trials.csv", "fronts.csv", "hypervolume.csv", "budget.csv", "dp_validity.csv",
            "failed_trials.csv", "mia_layers.csv", "report.html"} <= names
    page = built.read_text()
    assert "<script" not in page and not re.search(r'(src|href)="(https?:)?//', page)
    images = re.findall(r'<img src="data:image/png;base64,', page)
    assert len(images) == 4  # front, heat map, ROC, WW
    for text in ("Papernot", "random number of trials", "only the selected model",
                 "adaptive hyperparameter search over private metrics is not covered",
                 "<b>12</b> trials", "epsilon claim invalid", INVALID_REASON,
                 "TrialDiverged: train loss became nan", "shadow model diverged",
                 "σ0 1.9000; 1.900×10, 1.600×10", ALL_VALID):
        assert text in page, text


def test_csvs_hold_fronts_hypervolumes_budget_and_failures(run_dir: Path, built: Path) -> None:
    out = built.parent
    fronts = pd.read_csv(out / "fronts.csv")
    overall = fronts[fronts["front"] == ALL_METHODS]
    assert list(overall["trial_id"]) == ["t6", "t7"]  # ordered along the front: MIA up
    valid = fronts[fronts["front"] == ALL_VALID]
    assert list(valid["trial_id"]) == ["t6", "t9", "t10", "t1", "t4"]
    hv = pd.read_csv(out / "hypervolume.csv").set_index("front")
    # all-methods front: t6 (.87/.52) and t7 (.93/.53) against (0.1, 1.0)
    assert hv.loc[ALL_METHODS, "hypervolume"] == pytest.approx(
        (0.93 - 0.87) * (1 - 0.53) + (0.87 - 0.1) * (1 - 0.52))
    assert hv.loc["dpsgd_lf", "front_size"] == 2 and hv.loc["dpsgd_lf", "trials"] == 2
    budget = pd.read_csv(out / "budget.csv")
    assert len(budget) == 11 and set(budget["accountant"]) == {"prv"}
    assert budget.set_index("trial_id").loc["t6", "phases"] == 2
    failed = pd.read_csv(out / "failed_trials.csv")
    assert list(failed["trial_id"]) == ["t11", "t12"]
    assert list(failed["stage"]) == ["training", "audit"]
    trials = pd.read_csv(out / "trials.csv")
    assert list(trials["trial_id"])[:3] == ["t1", "t2", "t3"] and len(trials) == 12
    assert set(trials[trials["on_front"]]["trial_id"]) == {"t6", "t7"}
    layers = pd.read_csv(out / "mia_layers.csv")
    assert len(layers) == 10 * len(LAYERS)


def test_rebuild_is_identical_but_for_the_stamp(run_dir: Path, built: Path) -> None:
    out = built.parent
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != report_html.HTML_FILE}
    html_before = built.read_text()
    again = build_report(run_dir)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != report_html.HTML_FILE}
    assert before == after  # CSVs and PNGs byte for byte
    assert _without_stamp(html_before) == _without_stamp(again.read_text())
    assert not (run_dir / ".report.tmp").exists() and not (run_dir / ".report.old").exists()


def test_report_without_audit_still_builds_and_says_so(tmp_path: Path) -> None:
    run = make_run(tmp_path, audited=False)
    page = build_report(run).read_text()
    assert "the audit has not run" in page
    assert "No front" in page and page.count("<img ") == 1  # only the WW trajectories
    assert pd.read_csv(run / "report" / "fronts.csv").empty


def test_missing_audit_json_skips_that_roc_with_a_note(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "trials" / "t7" / report_html.AUDIT_FILE).unlink()
    page = build_report(run).read_text()
    assert "No ROC drawn for: t7 (no audit.json)" in page
    assert (run / "report" / "roc_peak_layer.png").is_file()


def test_bad_run_dirs_and_corrupt_results_are_one_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="RUN_DIR"):
        build_report(tmp_path / "missing")
    with pytest.raises(UserInputError, match=r"results\.parquet"):
        build_report(tmp_path)
    (tmp_path / results.RESULTS_FILE).write_bytes(b"PAR1 garbage")
    with pytest.raises(UserInputError, match="readable Parquet"):
        build_report(tmp_path)
    results.write_results(tmp_path, [])
    with pytest.raises(UserInputError):
        build_report(tmp_path)
    run = make_run(tmp_path / "corrupt")
    frame = results.read_results(run)
    frame.loc[0, "mia_layers"] = "[{not json"
    results.write_results(run, frame.to_dict("records"))
    with pytest.raises(UserInputError, match=r"results\.mia_layers.*t1"):
        build_report(run)
    assert not (run / "report").exists()


def test_roc_reader_matches_reports_audit_format() -> None:
    """audit.json as reports.audit writes it: {"layers": [{name, roc_fpr, roc_tpr, ...}]}."""
    from reports import audit

    assert audit.AUDIT_FILE == report_html.AUDIT_FILE
    assert audit.AUDIT_ERROR_COLUMN == report_html.AUDIT_ERROR
    rng = np.random.default_rng(0)
    labels = np.repeat([1, 0], 50)
    scores = rng.random(100) + 0.3 * labels
    metrics = [audit.attack_metrics(name=name, index=i, labels=labels, scores=scores,
                                    predicted=(scores > 0.6).astype(int))
               for i, name in enumerate(LAYERS)]
    document = json.loads(json.dumps({"layers": [m.to_dict() for m in metrics]}))
    curves = roc_by_layer(document)
    assert list(curves) == list(LAYERS)
    assert curves["fc1"][0] == list(metrics[2].roc_fpr)
