"""A real private-tuning sweep on digits, then ``pick`` and ``pick --export`` (Papernot &
Steinke): the study holds only random draws, pick.toml holds no noiseless metric, the release
states the end-to-end epsilon, and no other trial can be exported.

The secret trial count is fixed at 3 for the test (``draw_trial_count`` patched in the driver's
process), so that a release exists and the run stays small; everything else is the product's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import optuna
import pytest

from dpsweep.core import layout
from dpsweep.core.toml import tomllib
from dpsweep.orchestrator import api
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep import tuning as sweep_tuning
from dpsweep.orchestrator.sweep.driver import run_sweep
from dpsweep.reports.store import read_results
from tests.conftest import leaves

pytestmark = pytest.mark.slow

TRIALS = 3
#: Keys that would carry a noiseless metric, or list the trials (their number is the secret K).
NOISELESS_KEYS = {"val_accuracy", "val_accuracy_ci", "test_accuracy", "val_loss", "test_loss",
                  "peak_mia_accuracy", "peak_mia_upper", "leak_detected", "ties",
                  "qualifying_front_trials", "front_trials"}
#: Values fixed before any training (the accountant's inputs, hyperparameters): public.
PUBLIC_INPUTS = {"sample_rate", "delta", "target_epsilon", "noise_multiplier", "clip_norm", "lr",
                 "momentum"}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = api.from_dict({
        "training": {"epochs": 2, "batch_size": 50},
        "sweep": {"methods": ["dpsgd"], "tuning": "private", "expected_trials": 3.0,
                  "max_concurrent_trials": 2, "baseline": False},
        "audit": {"enabled": False}})
    out = tmp_path_factory.mktemp("private") / "run"
    patch = pytest.MonkeyPatch()
    patch.setattr(sweep_tuning, "draw_trial_count", lambda *, plan: TRIALS)  # where it is used
    try:
        run_sweep(check(cfg), run_dir=out, quiet=True)
    finally:
        patch.undo()
    return out


def test_the_study_holds_only_random_draws(run: Path) -> None:
    frame = read_results(run)
    assert len(frame) == TRIALS and (frame["status"] == "ok").all()
    assert frame["noisy_val_score"].map(math.isfinite).all()
    assert (frame["preset"] == "").all()
    storage = f"sqlite:///{run / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).trials
    assert len(trials) == TRIALS
    for t in trials:
        assert "fixed_params" not in t.system_attrs and "preset" not in t.user_attrs
    assert len({json.dumps(t.params, sort_keys=True) for t in trials}) == TRIALS


def test_pick_writes_the_noisy_score_and_no_noiseless_metric(
        run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frame = read_results(run)
    assert main(["pick", str(run)]) == 0
    out = capsys.readouterr().out
    doc = tomllib.loads((run / layout.PICK).read_text())
    best = frame.loc[frame["noisy_val_score"].idxmax()]
    sel = doc["selection"]
    assert sel["trial_id"] == best["trial_id"]
    assert sel["noisy_val_score"] == pytest.approx(float(best["noisy_val_score"]), abs=0)
    summary = json.loads((run / "summary.json").read_text())["tuning"]
    assert doc["tuning"]["end_to_end_epsilon"] == summary["end_to_end_epsilon"]
    assert doc["tuning"]["statement"] == summary["statement"]
    noiseless = {float(frame[k].iloc[i]) for k in ("val_accuracy", "test_accuracy")
                 for i in range(len(frame))}
    for tid in frame["trial_id"]:
        history = json.loads((run / "trials" / tid / "history.json").read_text())
        noiseless |= {float(v) for epoch in history for k, v in epoch.items()
                      if "accuracy" in k or "loss" in k}
    values = leaves(doc)
    assert not [p for p, _ in values if p.rsplit(".", 1)[-1] in NOISELESS_KEYS]
    # a public input (a sampling rate of 0.1, a learning rate) can equal an accuracy by
    # coincidence (10 of 100 validation rows): it is set before training, not measured
    assert not [(p, v) for p, v in values if isinstance(v, float) and v in noiseless
                and p.rsplit(".", 1)[-1] not in PUBLIC_INPUTS]
    assert f"{float(best['val_accuracy']):.4f}" not in out


def test_pick_export_states_the_end_to_end_epsilon_and_no_other_trial_leaves(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dpsweep.orchestrator.release.statement import round_up

    assert main(["pick", str(run), "--export", str(tmp_path / "release")]) == 0
    statement = json.loads((tmp_path / "release" / layout.EXPORT_STATEMENT_JSON).read_text())
    e2e = json.loads((run / "summary.json").read_text())["tuning"]["end_to_end_epsilon"]
    assert statement["holds"] and statement["selection_covered"]
    assert statement["tuning"]["end_to_end_epsilon"] == e2e
    assert statement["headline"].startswith(f"({round_up(e2e)}, ")
    assert "end to end" in statement["headline"]
    released = "".join(p.read_bytes().decode("latin-1")
                       for p in (tmp_path / "release").rglob("*") if p.is_file())
    frame = read_results(run)
    assert not any(str(tid) in released for tid in frame["trial_id"])

    chosen = tomllib.loads((run / layout.PICK).read_text())["selection"]["trial_id"]
    other = next(t for t in frame["trial_id"] if t != chosen)
    capsys.readouterr()
    assert main(["export", str(run), "--trial", other, "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dpsweep: error: --trial = '{other}'") and err.count("\n") == 1
    assert not (tmp_path / "other").exists()


def test_the_selection_is_on_record_and_a_deleted_summary_releases_nothing(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44: with summary.json gone, `export` of a trial private tuning did not select
    exited 0 (the run read as adaptive) while `report` refused; every command refuses now."""
    frame = read_results(run)
    best = frame.loc[frame["noisy_val_score"].idxmax(), "trial_id"]
    assert json.loads((run / layout.SUMMARY).read_text())["tuning"]["selected"] == best
    copy = Path(shutil.copytree(run, tmp_path / "copy", symlinks=True))
    (copy / layout.SUMMARY).unlink()
    out = tmp_path / "release"
    for argv in ([["export", str(copy), "--trial", str(tid), "--out", str(out)]
                  for tid in frame["trial_id"]]
                 + [["pick", str(copy)], ["report", str(copy)]]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("dpsweep: error: RUN_DIR = 'summary.json' is not allowed: "
                              "expected an existing file") and err.count("\n") == 1, err
        assert not out.exists()
