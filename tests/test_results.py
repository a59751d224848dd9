"""The results store: rows from finished trials, failed rows, validation of what is read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from core.errors import UserInputError
from orchestrator import results
from orchestrator.trial import plan_trial
from tests.conftest import tiny_config
from trainables.training import train_trial


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("run")
    for i, method in enumerate(["dpsgd", "dpsgd_lf"]):
        spec = plan_trial(tiny_config(method=method), trial_id=f"t{i}")
        train_trial(spec, checkpoint_root=run / results.TRIALS_DIR / f"t{i}")
    return run


def test_collect_builds_documented_rows(run_dir: Path) -> None:
    results.collect_trials(run_dir)
    frame = results.read_results(run_dir)
    assert list(frame["trial_id"]) == ["t0", "t1"]
    assert set(results.COLUMNS) <= set(frame.columns)
    assert (frame["epsilon_upper"] <= frame["target_epsilon"]).all()
    assert (frame["status"] == "ok").all() and frame["dp_valid"].all()
    assert frame.loc[1, "hp_t_f_fraction"] == 0.75 and math.isnan(frame.loc[0, "hp_t_f_fraction"])
    ckpt = run_dir / frame.loc[0, "checkpoint"]
    assert (ckpt / "state.pt").is_file()
    record = json.loads((run_dir / frame.loc[0, "privacy_record"]).read_text())
    assert record["epsilon_upper"] == frame.loc[0, "epsilon_upper"]


def test_append_replaces_by_id_and_keeps_failures(run_dir: Path) -> None:
    results.collect_trials(run_dir)
    results.append_row(run_dir, results.failed_row(trial_id="t9", method="ww_dpsgd",
                                                   error="train loss became nan in epoch 2"))
    frame = results.read_results(run_dir)
    assert list(frame["trial_id"]) == ["t0", "t1", "t9"]
    failed = frame[frame["status"] == "failed"].iloc[0]
    assert failed["error"].startswith("train loss became nan") and not failed["dp_valid"]


def test_bad_run_dirs_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="RUN_DIR"):
        results.read_results(tmp_path / "nope")
    with pytest.raises(UserInputError, match=r"results\.parquet"):
        results.read_results(tmp_path)
    (tmp_path / results.RESULTS_FILE).write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(UserInputError, match="readable Parquet"):
        results.read_results(tmp_path)
    with pytest.raises(UserInputError, match="none found"):
        results.collect_trials(tmp_path)
