"""The sweep machinery in-process: fail-safe Optuna bookkeeping, failed rows, overrides."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from orchestrator import results
from orchestrator.config import Config
from orchestrator.sweep import _failsafe_searcher_cls, _ResultsCallback, spaces_for, with_overrides
from search_spaces import BUILDERS
from trainables.methods import METHODS

ray = pytest.importorskip("ray")
from ray import tune  # noqa: E402


def _flaky(config: dict) -> None:
    from ray import tune as t

    t.report({"test_accuracy": config["x"]})  # an intermediate value Optuna must not keep
    if config["x"] > 0.5:
        raise RuntimeError("diverged")
    t.report({"test_accuracy": config["x"], "peak_mia_accuracy": 1 - config["x"]})


def test_failed_trials_are_fail_in_optuna_never_complete_or_running(ray_local: None,
                                                                     tmp_path: Path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'o.db'}")
    searcher = _failsafe_searcher_cls()(
        space={"x": optuna.distributions.FloatDistribution(0.0, 1.0)},
        metric=["test_accuracy", "peak_mia_accuracy"], mode=["max", "min"],
        points_to_evaluate=[{"x": 0.9}, {"x": 0.2}, {"x": 0.7}, {"x": 0.4}],
        sampler=optuna.samplers.TPESampler(seed=0), study_name="s", storage=storage)
    tune.Tuner(_flaky, tune_config=tune.TuneConfig(search_alg=searcher, num_samples=4,
                                                    max_concurrent_trials=2),
               run_config=tune.RunConfig(storage_path=str(tmp_path / "t"), verbose=0)).fit()
    study = optuna.load_study(study_name="s", storage=storage)
    states = {round(t.params["x"], 1): t.state for t in study.trials}
    assert states == {0.9: optuna.trial.TrialState.FAIL, 0.2: optuna.trial.TrialState.COMPLETE,
                      0.7: optuna.trial.TrialState.FAIL, 0.4: optuna.trial.TrialState.COMPLETE}
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(tuple(t.values) for t in complete) == [(0.2, 0.8), (0.4, 0.6)]


def test_error_callback_records_failed_row_with_reason(tmp_path: Path) -> None:
    cb = _ResultsCallback(run_dir=tmp_path, method="dpsgd", total=1, quiet=True)
    out = tmp_path / results.TRIALS_DIR / "dpsgd-abc"
    out.mkdir(parents=True)
    (out / "error.txt").write_text("TrialDiverged: train loss became nan in epoch 3")
    cb.error(SimpleNamespace(trial_id="abc", config={}))
    frame = results.read_results(tmp_path)
    row = frame.iloc[0]
    assert row["status"] == "failed" and row["trial_id"] == "dpsgd-abc"
    assert row["error"] == "TrialDiverged: train loss became nan in epoch 3"
    assert not row["dp_valid"] and math.isnan(row["test_accuracy"])


def test_overrides_make_one_trial_config() -> None:
    cfg = Config()
    trial = with_overrides(cfg, method="ww_dpsgd",
                           overrides={"lr": 0.3, "clip_norm": 2.0,
                                      "method_params.kappa": 0.2})
    assert trial.training.method == "ww_dpsgd" and trial.training.lr == 0.3
    assert trial.trial_params()["method_params"]["kappa"] == 0.2


def test_every_method_has_a_space_containing_its_paper_defaults() -> None:
    assert set(BUILDERS) == set(METHODS)
    spaces = spaces_for(Config())
    for method, space in spaces.items():
        assert space.contains(space.first_point), method
        preset = METHODS[method].presets.get("paper", {})
        for key, dist in space.distributions.items():
            name = key.split(".", 1)[-1]
            if name in preset:
                value = preset[name]
                assert dist._contains(dist.to_internal_repr(value)), (method, name, value)
