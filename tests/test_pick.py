"""pick: constraints, the validity rule, a loadable pick.toml, and clear refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from core.errors import UserInputError
from orchestrator import results
from orchestrator.config import from_dict, load
from reports.pick import PICK_CONFIG_FILE, PICK_FILE, config_from_spec, format_pick, pick
from tests.test_report import INVALID_REASON, make_run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("pick"))


def _pick(run: Path, **kw: object) -> object:
    args = {"max_peak_mia": None, "min_test_acc": None, "method": None,
            "allow_invalid_dp": False, **kw}
    return pick(run, **args)  # type: ignore[arg-type]


def test_default_pick_is_the_most_accurate_valid_front_trial(run_dir: Path) -> None:
    result = _pick(run_dir)
    assert result.trial_id == "t4" and result.dp_valid  # t7 is more accurate but invalid
    doc = tomllib.loads((run_dir / PICK_FILE).read_text())
    sel = doc["selection"]
    assert sel["trial_id"] == "t4" and sel["method"] == "ww_dpsgd" and sel["dp_valid"] is True
    assert sel["test_accuracy"] == pytest.approx(0.91)
    assert sel["peak_mia_accuracy"] == pytest.approx(0.58) and sel["peak_layer"] == "fc1"
    assert sel["constraints"] == {"allow_invalid_dp": False}
    config = from_dict(doc["config"])  # loadable as a dpsweep config
    assert config == result.config
    assert load(run_dir / PICK_CONFIG_FILE) == config
    assert config.sweep.methods == ["ww_dpsgd"]
    assert config.training.method == "ww_dpsgd" and config.training.lr == pytest.approx(0.8)
    assert config.training.seed == 3 and config.data.train_size == 600
    assert config.method_params["K"] == 50 and config.privacy.epsilon == 3.0
    checkpoint = Path(doc["checkpoint"]["path"])
    assert checkpoint.is_absolute() and checkpoint == run_dir.resolve() / "trials/t4/epoch_002"
    privacy = doc["privacy"]
    assert privacy["epsilon_upper"] == pytest.approx(2.99)
    assert privacy["accountant"] == "prv" and privacy["mechanism"].startswith("poisson")
    assert privacy["noise_schedule"] == [{"noise_multiplier": 1.21, "steps": 20}]
    assert "accountant_fallback" not in privacy  # null in the record: TOML has no null
    text = format_pick(result)
    assert "picked trial t4 (ww_dpsgd)" in text and str(checkpoint) in text
    assert "WARNING" not in text


def test_constraints_and_ties(run_dir: Path) -> None:
    # t9 and t10 tie at (.89, .54): the readable-first trial id wins
    assert _pick(run_dir, max_peak_mia=0.55).trial_id == "t9"
    assert _pick(run_dir, max_peak_mia=0.55, method="dpsgd").trial_id == "t2"
    assert _pick(run_dir, min_test_acc=0.9, max_peak_mia=0.57).trial_id == "t1"
    result = _pick(run_dir, max_peak_mia=0.53)
    assert result.trial_id == "t6" and result.qualifying == ("t6",)
    assert result.test_accuracy <= 0.87 and result.peak_mia_accuracy <= 0.53


def test_invalid_dp_only_when_allowed(run_dir: Path) -> None:
    with pytest.raises(UserInputError) as info:
        _pick(run_dir, max_peak_mia=0.55, min_test_acc=0.9)
    message = str(info.value)
    assert info.value.field == "--max-peak-mia/--min-test-acc"
    assert "2 have peak MIA accuracy > 0.55" in message
    assert "3 have test accuracy < 0.9" in message
    assert "--allow-invalid-dp admits them; 1 of them would qualify" in message
    assert "closest: t1 (dpsgd) test acc 0.9000, peak MIA 0.5600" in message
    result = _pick(run_dir, max_peak_mia=0.55, min_test_acc=0.9, allow_invalid_dp=True)
    assert result.trial_id == "t7" and not result.dp_valid
    doc = tomllib.loads((run_dir / PICK_FILE).read_text())
    assert doc["selection"]["dp_valid"] is False
    assert doc["selection"]["validity_reason"] == INVALID_REASON
    assert doc["privacy"]["dp_valid"] is False
    assert doc["config"]["method_params"]["mode"] == "faithful"
    assert "risk_meta" not in doc["config"]["method_params"]  # prepared, not a hyperparameter
    assert "WARNING: epsilon claim invalid" in format_pick(result)
    assert _pick(run_dir, allow_invalid_dp=True).trial_id == "t7"


def test_nothing_qualifies_names_the_constraint_and_closest_trials(run_dir: Path) -> None:
    with pytest.raises(UserInputError) as info:
        _pick(run_dir, max_peak_mia=0.5)
    assert info.value.field == "--max-peak-mia" and info.value.value == 0.5
    message = str(info.value)
    assert "of the 5 valid-DP front trials (all methods), 5 have peak MIA accuracy > 0.5" \
        in message
    assert "none of them would qualify either" in message
    closest = message.split("closest: ")[1].split("; ")
    assert [c.split(" ")[0] for c in closest] == ["t6", "t9", "t10"]
    with pytest.raises(UserInputError, match=r"valid-DP front trials \(method dp_adamilg\)"):
        _pick(run_dir, method="dp_adamilg", min_test_acc=0.9)


def test_bad_arguments_and_stores_are_user_errors(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="--method"):
        _pick(run_dir, method="nope")
    with pytest.raises(UserInputError, match="--max-peak-mia"):
        _pick(run_dir, max_peak_mia=1.5)
    with pytest.raises(UserInputError, match="--min-test-acc"):
        _pick(run_dir, min_test_acc=float("nan"))
    with pytest.raises(UserInputError, match="RUN_DIR"):
        _pick(tmp_path / "missing")
    (tmp_path / results.RESULTS_FILE).write_bytes(b"garbage")
    with pytest.raises(UserInputError, match="readable Parquet"):
        _pick(tmp_path)
    unaudited = make_run(tmp_path / "unaudited", audited=False)
    with pytest.raises(UserInputError, match="run the audit first"):
        _pick(unaudited)


def test_missing_checkpoint_or_spec_is_a_user_error(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "trials/t4/spec.json").unlink()  # falls back to the checkpoint's spec (fake here)
    with pytest.raises(UserInputError, match="checkpoint"):
        _pick(run)
    for path in sorted((run / "trials/t4/epoch_002").iterdir()):
        path.unlink()
    (run / "trials/t4/epoch_002").rmdir()
    with pytest.raises(UserInputError, match="checkpoint directory of the picked trial 't4'"):
        _pick(run)
    assert not (run / PICK_FILE).exists()


@pytest.mark.parametrize("method", ["ww_dpsgd", "dpsgd_lf"])
def test_config_reproduces_the_trial_spec(method: str) -> None:
    """plan_trial(config_from_spec(spec)) gives back the same spec: the config is complete."""
    from orchestrator.trial import plan_trial
    from tests.conftest import tiny_config

    spec = plan_trial(tiny_config(method=method, lr=0.7, seed=5), trial_id="x").to_dict()
    again = plan_trial(config_from_spec(json.loads(json.dumps(spec))), trial_id="x").to_dict()
    for d in (spec, again):
        d["calibration"].pop("cached")
        d["calibration"].pop("seconds")
    assert again == spec


def test_prepared_parameters_are_not_written_as_hyperparameters() -> None:
    from tests.test_report import make_spec
    from trainables.methods import get_method

    spec = make_spec("x", "dpsgd", "", 0)
    spec["method"] = "lm_dpsgd"
    spec["method_params"] = {**get_method("lm_dpsgd").validate_params({"r": 2.0}),
                             "risk": [0.4, 0.3, 0.2, 0.1], "risk_meta": {"cache_file": "c.json"}}
    params = config_from_spec(spec).method_params
    assert params["r"] == 2.0 and "risk" not in params and "risk_meta" not in params
