"""The results store (``reports/store.py``): rows from finished trials and failed ones, the
covered / not-covered split of the columns, atomic writes, and validation of what is read."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.poisson import poisson_plan
from dpsweep.core.schedule import Schedule
from dpsweep.core.trial import Calibration, EpsilonBounds, TrialSpec
from dpsweep.orchestrator.door import check
from dpsweep.reports import store
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.training.loop import TrialResult, train_trial
from tests.conftest import tiny_config

SIGMA = 1.1
EPSILON_UPPER = 2.9876


def _spec(method: str, trial_id: str, **params: Any) -> TrialSpec:
    """A tiny digits trial with a hand-written calibration (the budget module is not under
    test here; the training loop checks the sampling rate and step count it is given)."""
    cfg = tiny_config()
    setup = check(cfg)
    sizes = dict(setup.split_sizes)
    q, steps_per_epoch = poisson_plan(dataset_size=sizes["train"],
                                      batch_size=cfg.training.batch_size)
    steps = cfg.training.epochs * steps_per_epoch
    calibration = Calibration(
        target_epsilon=3.0, delta=1e-5, sample_rate=q,
        schedule=Schedule.constant(noise_multiplier=SIGMA, steps=steps), scale=1.0,
        bounds=EpsilonBounds(lower=2.95, estimate=2.97, upper=EPSILON_UPPER, accountant="prv"),
        accountant="prv", fallback_reason=None, eps_error=0.01, seconds=0.0, cached=False)
    cls = get_method(method)
    return TrialSpec(method=method, method_params=cls.validate_params(
        {**setup.trial_params(method), **params}), epochs=cfg.training.epochs,
        batch_size=cfg.training.batch_size, calibration=calibration,
        epsilon_curve=[1.9, EPSILON_UPPER], seed=4, randomness="secret", sizes=sizes,
        device="cpu", trial_id=trial_id)


@dataclass
class Run:
    path: Path
    results: dict[str, TrialResult]
    rows: list[dict[str, Any]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    path = tmp_path_factory.mktemp("run")
    results, rows = {}, []
    for tid, method, params, series in [("dpsgd-0", "dpsgd", {}, "dpsgd"),
                                        ("dpsgd_lf-0", "dpsgd_lf", {"m_f": 1}, "dpsgd_lf")]:
        spec = _spec(method, tid, **params)
        trial_dir = path / layout.TRIALS / tid
        result = train_trial(spec, checkpoint_root=trial_dir, rolling_checkpoint="checkpoint")
        results[tid] = result
        rows.append(store.row_from_trial(
            run_dir=path, trial_dir=trial_dir, checkpoint_dir=trial_dir / "checkpoint",
            spec=spec.to_dict(), privacy=result.privacy_record, history=result.history,
            train_seconds=1.5, num_classes=10, series=series, study=f"{series}@eps3"))
    return Run(path=path, results=results, rows=rows)


def test_row_from_a_finished_trial(run: Run) -> None:
    row = run.rows[0]
    result = run.results["dpsgd-0"]
    p, last = result.privacy_record, result.history[-1]
    assert set(store.COLUMNS) <= set(row)
    assert (row["trial_id"], row["method"], row["mode"], row["series"], row["status"]) == (
        "dpsgd-0", "dpsgd", "standard", "dpsgd", "ok")
    assert row["study"] == "dpsgd@eps3" and row["error"] == ""
    assert row["dp_valid"] is True and row["validity_reason"] == p.validity_reason
    assert (row["randomness"], row["release_safe"]) == ("secret", True)
    assert (row["lr"], row["clip_norm"], row["momentum"]) == (1.0, 1.0, 0.0)
    assert (row["batch_size"], row["epochs"], row["seed"], row["steps"]) == (50, 2, 4, 20)
    assert (row["noise_multiplier"], row["sample_rate"]) == (SIGMA, 0.1)
    assert json.loads(row["noise_schedule"]) == [{"noise_multiplier": SIGMA, "steps": 20}]
    assert (row["epsilon_lower"], row["epsilon_upper"], row["target_epsilon"]) == (
        2.95, EPSILON_UPPER, 3.0)
    assert (row["accountant"], row["accountant_fallback"]) == ("prv", "")
    assert row["val_accuracy"] == last["val_accuracy"]
    assert row["test_accuracy"] == last["test_accuracy"]
    assert row["train_loss"] == last["train_loss_nonprivate"]
    assert row["degenerate"] is (last["val_accuracy"] < 0.2)
    assert math.isnan(row["peak_mia_accuracy"]) and row["mia_layers"] == "[]"
    assert row["checkpoint"] == "trials/dpsgd-0/checkpoint"  # relative: the run can move
    assert row["privacy_record"] == "trials/dpsgd-0/privacy.json"
    record = json.loads((run.path / row["privacy_record"]).read_text())
    assert record["epsilon_upper"] == row["epsilon_upper"]
    assert (run.path / row["checkpoint"] / "state.pt").is_file()
    assert json.loads(row["method_params"]) == result.spec.method_params
    assert row["hp_lr"] == 1.0 and "hp_m_f" not in row
    lf = run.rows[1]
    assert (lf["hp_m_f"], lf["hp_t_f_fraction"]) == (1, 0.75)


def test_write_and_read_round_trip_in_schema_order(run: Run) -> None:
    store.write_results(run.path, run.rows)
    frame = store.read_results(run.path)
    assert list(frame["trial_id"]) == ["dpsgd-0", "dpsgd_lf-0"]
    hp = sorted(c for c in frame.columns if c.startswith("hp_"))
    assert list(frame.columns) == [*store.COLUMNS, *hp]
    assert (frame["epsilon_upper"] <= frame["target_epsilon"]).all()
    assert frame.loc[1, "hp_m_f"] == 1 and math.isnan(frame.loc[0, "hp_m_f"])
    assert not [p for p in run.path.iterdir() if p.name.startswith(".tmp-")]  # atomic


def test_failed_rows_are_kept_with_their_reason(run: Run) -> None:
    store.write_results(run.path, run.rows)
    spec = _spec("ww_dpsgd", "ww_dpsgd-0").to_dict()
    failed = store.failed_row(trial_id="ww_dpsgd-0", method="ww_dpsgd", spec=spec,
                              error="TrialDiverged: train loss became nan in epoch 2")
    store.append_row(run.path, failed)
    frame = store.read_results(run.path)
    assert list(frame["trial_id"]) == ["dpsgd-0", "dpsgd_lf-0", "ww_dpsgd-0"]
    row = frame.iloc[2]
    assert row["status"] == "failed" and row["error"].startswith("TrialDiverged: train loss")
    assert not row["dp_valid"] and not row["release_safe"]
    assert math.isnan(row["test_accuracy"]) and math.isnan(row["epsilon_upper"])
    assert (row["mode"], row["lr"], row["epochs"]) == ("standard", 1.0, 2)
    assert json.loads(row["method_params"])["K"] == 50


def test_append_replaces_a_row_by_trial_id(run: Run) -> None:
    store.write_results(run.path, run.rows)
    again = {**run.rows[0], "test_accuracy": 0.123}
    store.append_row(run.path, again)
    frame = store.read_results(run.path)
    assert list(frame["trial_id"]) == ["dpsgd_lf-0", "dpsgd-0"]
    assert frame.loc[1, "test_accuracy"] == 0.123


def test_covered_columns_are_exactly_those_without_private_data() -> None:
    """What the epsilon does not cover never leaves the run (export) and is labelled."""
    uncovered = set(store.not_covered())
    private = {"val_accuracy", "val_loss", "test_accuracy", "test_loss", "train_loss",
               "clipped_fraction",
               "degenerate", "peak_mia_accuracy", "peak_mia_upper", "peak_layer",
               "peak_layer_index", "peak_attack", "leak_detected", "leak_p_value",
               "loss_attack_accuracy", "loss_attack_auc", "mia_layers", "eps_lower_bound",
               "mia_epsilon_lower", "mia_pointwise_violations",
               "audit_contradicts"}
    assert uncovered == private
    for name in ("lr", "clip_norm", "method_params", "noise_schedule", "epsilon_upper",
                 "delta", "sample_rate", "steps", "trajectories", "dp_valid"):
        assert store.COLUMNS[name].covered, name
    assert all(c.meaning and c.dtype in ("string", "bool", "int64", "float64")
               for c in store.COLUMNS.values())


@pytest.mark.parametrize(("accuracy", "degenerate"), [
    (0.2, False), (0.1999, True), (0.1, True), (0.95, False), (math.nan, True)])
def test_degenerate_is_chance_plus_the_margin(accuracy: float, degenerate: bool) -> None:
    assert store.is_degenerate(accuracy, num_classes=10) is degenerate


def test_bad_run_dirs_are_user_errors(tmp_path: Path, run: Run) -> None:
    with pytest.raises(UserInputError) as err:
        store.read_results(tmp_path / "nope")
    assert err.value.field == "RUN_DIR"
    with pytest.raises(UserInputError, match=r"results\.parquet"):
        store.read_results(tmp_path)
    empty = store.read_results(tmp_path, allow_empty=True)
    assert empty.empty and list(empty.columns) == list(store.COLUMNS)
    (tmp_path / layout.RESULTS).write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(UserInputError, match="readable Parquet"):
        store.read_results(tmp_path)
    pd.DataFrame({"trial_id": ["a"], "method": ["dpsgd"]}).to_parquet(
        tmp_path / layout.RESULTS)
    with pytest.raises(UserInputError) as err:
        store.read_results(tmp_path)
    assert err.value.field == "results" and "missing columns" in err.value.allowed
    bad = pd.DataFrame(run.rows).astype({"epsilon_upper": str})
    bad["epsilon_upper"] = "three"
    bad.to_parquet(tmp_path / layout.RESULTS)
    with pytest.raises(UserInputError) as err:
        store.read_results(tmp_path)
    assert err.value.field == "results.epsilon_upper"
    store.write_results(tmp_path, [])
    with pytest.raises(UserInputError, match="at least one trial row"):
        store.read_results(tmp_path)
    assert store.read_results(tmp_path, allow_empty=True).empty
