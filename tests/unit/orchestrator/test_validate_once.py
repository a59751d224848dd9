"""A trial's method hyperparameters are checked where they enter, and trusted after.

Each layer (the planner, the method's class hooks, the spec, the DP step) may be handed the
values; the check itself runs once per entry point: the searcher's draw in the planner, new
values a preparation adds, and a spec arriving as plain data (Ray, ``spec.json``).
"""

from __future__ import annotations

import json

import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.core.params import ParamSet, ValidatedParams
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.training.loop import load_spec, train_trial
from tests.conftest import tiny_config


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The prefixes of every ``ParamSet.validate`` call from here on."""
    seen: list[str] = []
    real = ParamSet.validate

    def counted(self: ParamSet, values, *, prefix: str, mode_param: str | None = None):
        seen.append(prefix)
        return real(self, values, prefix=prefix, mode_param=mode_param)

    monkeypatch.setattr(ParamSet, "validate", counted)
    return seen


def test_a_drawn_point_is_checked_once_from_plan_to_training(checks: list[str], tmp_path) -> None:
    cfg = tiny_config(epochs=1)
    drawn = {"lr": 0.5, "clip_norm": 2.0}  # what a searcher's decode hands the planner
    setup = check(cfg)  # the door checks the config's own parameters
    checks.clear()
    spec = plan_trial(setup, method="dpsgd", params=drawn, cache_dir=tmp_path)
    assert checks == ["method_params"]
    assert isinstance(spec.method_params, ValidatedParams)
    assert spec.method_params == {**get_method("dpsgd").declaration().defaults(), **drawn}
    train_trial(spec)  # spec, class hooks and DPStep trust the values
    assert checks == ["method_params"]


def test_plain_data_is_checked_when_it_arrives(checks: list[str], tmp_path) -> None:
    spec = plan_trial(check(tiny_config(epochs=1)), method="dp_adamilg",
                      params={"lr": 0.5, "k": 0.1}, cache_dir=tmp_path)
    wire = spec.to_dict()
    assert type(wire["method_params"]) is dict and json.loads(json.dumps(wire)) == wire
    checks.clear()
    again = load_spec(wire)  # what a worker or ``spec.json`` hands over
    assert checks == ["method_params"] and again == spec
    get_method("dp_adamilg").noise_shape(epochs=2, steps_per_epoch=3, params=again.method_params)
    assert checks == ["method_params"]


def test_a_spec_from_disk_with_a_bad_value_is_refused_by_name(tmp_path) -> None:
    wire = plan_trial(check(tiny_config(epochs=1)), method="dpsgd", cache_dir=tmp_path).to_dict()
    wire["method_params"]["clip_norm"] = -1.0
    with pytest.raises(UserInputError, match=r"method_params\.clip_norm"):
        load_spec(wire)


def test_validated_values_are_read_only_and_belong_to_one_method() -> None:
    dpsgd, lf = get_method("dpsgd"), get_method("dpsgd_lf")
    values = dpsgd.validate_params({"lr": 0.3})
    with pytest.raises(TypeError):
        values["lr"] = 1.0  # type: ignore[index]
    assert dpsgd.validate_params(values) is values
    assert lf.validate_params(dict(values)) is not values  # another method checks for itself
    assert lf.validate_params(dict(values)).owner == "dpsgd_lf"
    assert json.loads(json.dumps(values)) == values  # plain data to JSON and TOML
