"""``api.run`` refuses a config that ``from_dict`` would refuse, however it was built: a
``Config`` changed with ``dataclasses.replace`` meets every cross-field rule before anything is
written or the sweep (Ray, Optuna) is imported."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from dpsweep.orchestrator import api


def _replace(cfg: api.Config, **sections: dict[str, Any]) -> api.Config:
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)
                                       for name, values in sections.items()})


CASES = {
    "delta-not-below-one-over-n": ({"privacy": {"delta": 0.5}}, "privacy.delta"),
    "asha-inside-private-tuning": (
        {"sweep": {"tuning": "private", "pruner": "asha", "seeds": 0},
         "audit": {"in_trial": False}}, "sweep.pruner"),
    "first-rung-after-the-last-epoch": (
        {"sweep": {"pruner": "asha", "pruner_min_epochs": 5}, "training": {"epochs": 2}},
        "sweep.pruner_min_epochs"),
    "freezing-every-layer": ({"sweep": {"methods": ["dpsgd_lf"]},
                              "method_params": None}, "method_params.m_f"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_replaced_config_is_refused_before_anything_runs(name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    sections, field = CASES[name]
    sections = dict(sections)
    cfg = api.Config()
    if sections.pop("method_params", 0) is None:
        cfg = dataclasses.replace(cfg, method_params={"dpsgd_lf": {"m_f": 4}})
    cfg = _replace(cfg, **sections)
    monkeypatch.delitem(sys.modules, "dpsweep.orchestrator.sweep.driver", raising=False)
    out = tmp_path / "out"
    with pytest.raises(api.UserInputError) as exc:
        api.run(cfg, out=out)
    assert exc.value.field == field, str(exc.value)
    assert not out.exists()
    assert "dpsweep.orchestrator.sweep.driver" not in sys.modules


def test_the_same_config_intact_passes_the_door() -> None:
    cfg = api.Config()
    assert api._checked(cfg, model=None, machine=True).config == cfg


def test_something_else_than_a_config_is_refused() -> None:
    with pytest.raises(api.UserInputError) as exc:
        api.run({"privacy": {"delta": 1e-5}}, out="x")  # type: ignore[arg-type]
    assert exc.value.field == "cfg" and "dict" in str(exc.value)
