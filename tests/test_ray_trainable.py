"""The trainable under Ray Tune: reports per epoch, checkpoints, resumes through get_checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.trial import plan_trial
from tests.conftest import tiny_config
from trainables.ray_trainable import dp_trainable, spec_from_tune_config
from trainables.training import load_checkpoint_state, train_trial

ray = pytest.importorskip("ray")
from ray import tune  # noqa: E402


def _flaky(config: dict[str, Any]) -> None:
    """dp_trainable that dies right after its first checkpoint, once (marker file)."""
    from ray import tune as t

    marker = Path(config.pop("marker"))
    real = t.report

    def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
        real(metrics, checkpoint=checkpoint)
        if not marker.exists():
            marker.write_text("died once")
            raise RuntimeError("simulated crash after epoch 1")

    t.report = report
    try:
        dp_trainable(config)
    finally:
        t.report = real


def test_overrides_merge_into_spec() -> None:
    spec = plan_trial(tiny_config())
    merged = spec_from_tune_config({"spec": spec.to_dict(), "lr": 0.25,
                                    "method_params.r": 2.0})
    assert merged.lr == 0.25 and merged.method_params == {"r": 2.0}
    with pytest.raises(KeyError, match="bogus"):
        spec_from_tune_config({"spec": spec.to_dict(), "bogus": 1})


def test_tune_runs_reports_and_resumes_exactly(ray_local: None, tmp_path: Path) -> None:
    spec = plan_trial(tiny_config(epochs=3))
    trainable = tune.with_resources(_flaky, {"cpu": 1})
    tuner = tune.Tuner(
        trainable,
        param_space={"spec": spec.to_dict(), "marker": str(tmp_path / "marker")},
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray"), name="t",
                                  failure_config=tune.FailureConfig(max_failures=1),
                                  verbose=0),
    )
    grid = tuner.fit()
    assert (tmp_path / "marker").exists(), "the trial did crash once"
    result = grid[0]
    assert result.error is None
    assert result.metrics["epoch"] == 3
    assert 0.0 <= result.metrics["test_accuracy"] <= 1.0
    assert result.metrics["epsilon_spent"] <= spec.calibration["target_epsilon"]
    epochs_seen = list(result.metrics_dataframe["epoch"])
    assert epochs_seen[-2:] == [2, 3]
    # resumed from the epoch-1 checkpoint, the final weights equal an uninterrupted run's
    with result.checkpoint.as_directory() as d:
        tuned = load_checkpoint_state(Path(d))["model"]
    straight = train_trial(spec, checkpoint_root=tmp_path / "plain")
    assert straight.history[-1]["epoch"] == 3
    plain = load_checkpoint_state(tmp_path / "plain" / "epoch_003")["model"]
    for k in plain:
        assert torch.equal(plain[k], tuned[k]), k
