"""The report: built from a synthetic run directory (``bench/synthetic_run.py``, no training),
deterministic, complete."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch  # noqa: F401  (the methods' torch is lazy: matplotlib would import it in a test)

from bench.synthetic_run import (
    INVALID_REASON,
    TRIALS,
    make_run,
)
from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.reports import html as report_html
from dpsweep.reports.html import build_report
from dpsweep.reports.html.fmt import hyperparameters_text
from dpsweep.reports.html.overview import when_text
from dpsweep.reports.pareto import KIND_ALL, KIND_VALID, front_name
from dpsweep.trainables.methods import report_series


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def built(run_dir: Path) -> Path:
    return build_report(run_dir, series=report_series())


def _without_stamp(text: str) -> str:
    return "\n".join(line for line in text.splitlines()
                     if f'class="{report_html.STAMP_CLASS}"' not in line)


def test_report_files_and_self_contained_html(run_dir: Path, built: Path) -> None:
    out = run_dir / layout.REPORT
    assert built == out / report_html.HTML_FILE
    names = {p.name for p in out.iterdir()}
    pngs = {n for n in names if n.endswith((".png", ".svg"))}
    assert pngs == {"front_eps1.svg", "front_eps3.svg", "mia_heatmap_eps1.png",
                    "mia_heatmap_eps3.png", "validation_curves_eps1.png",
                    "validation_curves_eps3.png", "privacy_utility.png", "roc.svg",
                    "ww_trajectories.png"}
    for png in pngs:  # every figure's data as CSV of the same name
        assert png[:-4] + ".csv" in names, png
    assert {"trials.csv", "fronts.csv", "hypervolume.csv", "excluded.csv", "budget.csv",
            "dp_validity.csv", "failed_trials.csv", "mia_layers.csv", "canary_bounds.csv",
            "leakage.csv", "covered_by_epsilon.csv"} <= names
    page = built.read_text()
    assert "<script" not in page and not re.search(r'(src|href)="(https?:)?//', page)
    svgs = {n for n in pngs if n.endswith(".svg")}
    assert page.count('<img src="data:image/png;base64,') == len(pngs - svgs)
    # inline: hover works offline
    assert page.count('<svg class="front"') + page.count('<svg class="roc"') == len(svgs)
    for text in ("fashion-mnist (10 classes)", "train 5,000, validation 2,000",
                 "cnn28", "prv (PRV accountant", "1, 3; delta 1e-05", "torch 2.4.0",
                 "1 h 02 min (3,723 s) over 3 attempts (the run and its resumes); 1 attempt "
                 "killed with no recorded end",
                 "Adaptive hyperparameter search over private metrics is not covered",
                 "<b>21</b> trials", "epsilon claim invalid", INVALID_REASON,
                 "claim contradicted by audit", "replayable: not releasable",
                 "TrialDiverged: train loss became nan", "shadow model diverged",
                 "σ0 1.9000; 1.900×50, 1.600×50", "reference point (0, 1)",
                 "reported, not used to choose", "not covered by epsilon",
                 "leakage detected</b> in 1 of 4 audited trials; strongest in t4 (ε = 3) at "
                 "layer <b>fc1</b>, attack <b>lira</b>",
                 "<b>dpsgd_lf</b>: no leakage detected in any of 2 audited trials",
                 "re-run with fresh noise of t1", "non-private baseline (not a DP trial)",
                 "degenerate: validation accuracy below chance + 0.1",
                 # the audits' reference models are much weaker than the targets: said so
                 "offline references train on half the pool (150 examples). Their mean test "
                 "accuracy is 0.30", "these attack numbers understate"):
        assert html.unescape(text) in html.unescape(page), text
    # every figure title names its epsilon; not-covered figures say so in the caption
    assert page.count("not covered by epsilon</span></figcaption>") == len(pngs) - 1


def test_fronts_hypervolume_and_exclusions_in_the_csvs(built: Path) -> None:
    out = built.parent
    fronts = pd.read_csv(out / "fronts.csv")
    at3 = fronts[fronts["target_epsilon"] == 3.0]
    overall = at3[at3["front"] == front_name(kind=KIND_ALL, target_epsilon=3.0)]
    assert list(overall["trial_id"]) == ["t6", "t7", "t13"]  # along the front: MIA up
    valid = at3[at3["front"] == front_name(kind=KIND_VALID, target_epsilon=3.0)]
    assert list(valid["trial_id"]) == ["t6", "t2", "t9", "t10", "t5", "t1", "t4"]
    assert (valid["val_accuracy_hi"] > valid["val_accuracy"]).all()
    assert (valid["peak_mia_hi"] - valid["peak_mia_accuracy"]).round(6).eq(0.03).all()
    hv = pd.read_csv(out / "hypervolume.csv").set_index("front")
    # all series at eps 3 on normalised axes: x = (acc - .1) / .9, y = 2 * mia - 1
    x = {t: (a - 0.1) / 0.9 for t, a in (("t7", 0.93), ("t13", 0.92), ("t6", 0.87))}
    expected = x["t6"] * (1 - 0.04) + (x["t7"] - x["t6"]) * (1 - 0.06)  # t13 adds nothing
    assert hv.loc[front_name(kind=KIND_ALL, target_epsilon=3.0), "hypervolume"] == \
        pytest.approx(expected)
    excluded = pd.read_csv(out / "excluded.csv").set_index("trial_id")
    assert list(excluded.index) == ["base", "t11", "t12", "t14", "t15", "t24"]
    assert excluded.loc["t14", "reason"].startswith("degenerate")
    assert excluded.loc["t15", "reason"].startswith("re-run with fresh noise of t1")
    utility = pd.read_csv(out / "privacy_utility.csv")
    dpsgd3 = utility[(utility["series"] == "dpsgd") & (utility["target_epsilon"] == 3.0)].iloc[0]
    # best configuration t13 (.92) has no re-run; at eps 1 t21 and its re-run t24
    assert dpsgd3["best_trial"] == "t13" and dpsgd3["runs"] == 1
    dpsgd1 = utility[(utility["series"] == "dpsgd") & (utility["target_epsilon"] == 1.0)].iloc[0]
    assert dpsgd1["trials"] == "t21 t24" and dpsgd1["val_mean"] == pytest.approx(0.795)
    assert dpsgd1["val_sd"] == pytest.approx(np.std([0.80, 0.79], ddof=1))
    canary = pd.read_csv(out / "canary_bounds.csv").set_index("trial_id")
    assert bool(canary.loc["t7", "audit_contradicts"]) and canary.loc["t1", "canaries"] == 1000
    failed = pd.read_csv(out / "failed_trials.csv")
    assert list(failed["trial_id"]) == ["t11", "t12"]
    assert list(failed["stage"]) == ["training", "audit"]
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == len(TRIALS) + 2
    heat = pd.read_csv(out / "mia_heatmap_eps3.csv")
    assert set(heat["attack"]) == {"lira", "rmia", "shadow_classifier", "loss"}
    assert heat[heat["significant"]]["trial_id"].tolist() == ["t4"]


def test_rebuild_is_identical_but_for_the_stamp(run_dir: Path, built: Path) -> None:
    out = built.parent
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != report_html.HTML_FILE}
    html_before = built.read_text()
    again = build_report(run_dir, series=report_series())
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != report_html.HTML_FILE}
    assert before == after  # CSVs and PNGs byte for byte
    assert _without_stamp(html_before) == _without_stamp(again.read_text())
    stamps = [line for line in again.read_text().splitlines()
              if f'class="{report_html.STAMP_CLASS}"' in line]
    assert len(stamps) == 1 and stamps[0].startswith('<p class="stamp">Generated ')
    assert not (run_dir / ".report.tmp").exists() and not (run_dir / ".report.old").exists()


def test_old_run_without_summary_or_audit_still_builds(tmp_path: Path) -> None:
    def few(rows: list[dict[str, Any]]) -> None:
        keep = {"t1", "t2", "t4", "t11", "base"}
        rows[:] = [r for r in rows if r["trial_id"] in keep]

    run = make_run(tmp_path, audited=False, summary=False, rows_hook=few)
    page = build_report(run, series=report_series()).read_text()
    assert "No front: no finished, audited, non-degenerate DP trial" in page
    assert "summary.json absent" in page
    assert "Adaptive hyperparameter search over private metrics is not covered" in page
    assert "no audited" not in page and "no trial was audited" in page
    assert page.count("<img ") == 1  # only the WW trajectories (covered by epsilon)
    assert pd.read_csv(run / "report" / "fronts.csv").empty


def test_private_tuning_states_the_end_to_end_bound() -> None:
    text = report_html.tuning_statement(summary={"tuning": {
        "mode": "private", "statement": "End-to-end guarantee: (2.5, 1e-05)-DP ...",
        "n_trials": 17, "end_to_end_epsilon": 2.5}}, trials=17)
    assert "Papernot &amp; Steinke" in text and "<b>epsilon = 2.5</b>" in text
    assert "End-to-end guarantee" in text and "not covered" not in text.split("It covers")[0]


def test_adaptive_tuning_text_follows_what_the_sampler_saw() -> None:
    """Validation alone: composition covers the training set, not the validation set; with the
    in-trial attack nothing adaptively chosen is covered; an older summary claims neither."""
    def text(objectives: list[str] | None) -> str:
        entry = {"mode": "adaptive", "statement": "s", "n_trials": 4}
        if objectives is not None:
            entry["objectives"] = objectives
        return report_html.tuning_statement(summary={"tuning": {
            "mode": "adaptive", "statement": "s", "n_trials": 4,
            "by_target": {"3": entry}}}, trials=4)

    alone, attack, old = text(["val_accuracy"]), text(["val_accuracy", "peak_mia_accuracy"]), \
        text(None)
    assert "validation accuracy alone" in alone and "composition over every trained model " \
        "covers" in alone and "validation set nothing does" in alone
    assert "attack on the training members" in attack
    assert "no composition bound covers" in attack and "covers releasing" not in attack
    assert "composition" not in old
    for page in (alone, attack, old):
        assert "Adaptive hyperparameter search over private metrics is not covered" in page


def test_corrupt_inputs_are_one_user_error_and_write_nothing(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="RUN_DIR"):
        build_report(tmp_path / "missing")
    with pytest.raises(UserInputError, match=r"results\.parquet"):
        build_report(tmp_path)  # no results file
    (tmp_path / layout.RESULTS).write_bytes(b"PAR1 garbage")
    with pytest.raises(UserInputError, match="readable Parquet"):
        build_report(tmp_path)

    def strings(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            row["val_accuracy"] = f"{row['val_accuracy']}"

    run = make_run(tmp_path / "strings", audited=False, summary=False, rows_hook=strings)
    with pytest.raises(UserInputError, match=r"results\.val_accuracy"):
        build_report(run)

    def bad_json(rows: list[dict[str, Any]]) -> None:
        rows[0]["mia_layers"] = "[{not json"

    run = make_run(tmp_path / "json", summary=False, rows_hook=bad_json)
    with pytest.raises(UserInputError, match=r"results\.mia_layers.*t1"):
        build_report(run)

    def few(rows: list[dict[str, Any]]) -> None:
        rows[:] = [r for r in rows if r["trial_id"] in {"t1", "t6", "t11"}]

    run = make_run(tmp_path / "files", rows_hook=few)
    summary = (run / "summary.json").read_text()
    (run / "summary.json").write_text("{truncated")
    with pytest.raises(UserInputError, match="summary"):
        build_report(run)
    (run / "summary.json").write_text(summary)
    config = (run / "config.toml").read_text()
    (run / "config.toml").write_text("[data\n")
    with pytest.raises(UserInputError, match="config"):
        build_report(run)
    (run / "config.toml").write_text(config)
    (run / "trials" / "t6" / "history.json").write_text("[{")
    with pytest.raises(UserInputError, match="history"):
        build_report(run)
    assert not (run / "report").exists() and not (run / ".report.tmp").exists()


def test_the_header_shows_run_times_as_utc_text_not_posix_seconds() -> None:
    assert when_text(1795440017.17) == "2026-11-23 13:20:17 UTC"
    assert when_text("2025-01-01T10:00:00+00:00") == "2025-01-01T10:00:00+00:00"


def test_prepared_parameters_are_not_shown_as_hyperparameters() -> None:
    """Which parameters are prepared comes from the method declarations (given by the caller:
    reports sits below trainables), not from a list of names kept in the report."""
    from dpsweep.trainables.methods import prepared_params  # torch: only this test needs it

    prepared = prepared_params()["lm_dpsgd"]
    assert prepared == ("risk", "risk_meta")
    params = {"mode": "public", "r": 2.0, **dict.fromkeys(prepared, 0.5)}
    assert hyperparameters_text(pd.Series(dtype=object), params, prepared=prepared) == \
        "mode=public, r=2"
