"""The shipped study configs: valid, and the full-size study's parts form one study.

Every range a shipped config pins in ``[search.*]`` lies inside the declared bounds of its
hyperparameter (``configs/fmnist.toml`` pins the ranges the README's study ran with, not the
shipped ones).

The full-size Fashion-MNIST study runs as four resumable parts (``configs/fmnist_full_*.toml``)
whose tables docs/studies.md puts side by side, so everything but what a part runs (its series, its
targets, whether it audits and trains the baseline) must be the same in every part.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dpsweep.core.params import Param
from dpsweep.orchestrator.api import load_config as load
from dpsweep.orchestrator.config import read_toml
from dpsweep.orchestrator.door import check
from dpsweep.search_spaces import STEP, STEP_PARAM
from dpsweep.trainables.methods import METHODS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PARTS = sorted(CONFIGS.glob("fmnist_full_[a-z].toml"))
#: The published hyperparameters on the same setting (nothing searched).
PUBLISHED = CONFIGS / "fmnist_full_published.toml"
#: What the reference point must share with the parts.
SHARED_SECTIONS = ("data", "model", "privacy", "training", "resources")
#: The study whose pinned ranges differ from the shipped ones (docs/search.md).
FMNIST = CONFIGS / "fmnist.toml"
#: What may differ between parts.
PER_PART = {("sweep", "methods"), ("budget", "epsilons"), ("sweep", "baseline")}


def _flat(raw: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    out: dict[tuple[str, ...], object] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and key not in ("search",):
            out.update(_flat(value, (*prefix, key)))
        elif key != "search":
            out[(*prefix, key)] = value
    return out


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path: Path) -> None:
    load(path)


def _declared(method: str, name: str) -> Param:
    """The declaration a ``[search.<method>]`` key is checked against (lr * C: the step's)."""
    return STEP_PARAM if name == STEP else METHODS[method].declaration()[name]


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_pinned_range_lies_inside_the_declared_bounds(path: Path) -> None:
    for method, table in read_toml(path).get("search", {}).items():
        for name, dim in table.items():
            param = _declared(method, name)
            values = dim["choices"] if "choices" in dim else [dim["low"], dim["high"]]
            for value in values:
                assert param.low is None or value > param.low or \
                    (value == param.low and not param.low_open), (path.name, method, name, dim)
                assert param.high is None or value < param.high or \
                    (value == param.high and not param.high_open), (path.name, method, name, dim)
            if "choices" not in dim:
                assert dim["low"] < dim["high"], (path.name, method, name, dim)


def test_the_fmnist_study_pins_a_range_for_every_method_it_runs() -> None:
    cfg = load(FMNIST)
    assert set(cfg.search) == set(cfg.sweep.methods or METHODS) == set(METHODS)


def test_full_study_parts_share_every_setting_but_what_they_run() -> None:
    assert len(PARTS) == 4, PARTS
    flats = {p.name: _flat({k: v for k, v in read_toml(p).items() if k != "audit"})
             for p in PARTS}
    keys = set().union(*flats.values())
    for key in keys - PER_PART:
        values = {name: flat.get(key) for name, flat in flats.items()}
        assert len({repr(v) for v in values.values()}) == 1, (key, values)
    # a method searched in two parts is searched over the same ranges
    ranges: dict[str, dict] = {}
    for p in PARTS:
        for method, space in read_toml(p).get("search", {}).items():
            assert ranges.setdefault(method, space) == space, (p.name, method)


def test_full_study_covers_what_the_readme_claims() -> None:
    runs: dict[tuple[str, float], bool] = {}
    members = set()
    for p in PARTS:
        cfg = load(p)
        members.add(cfg.data.train_size)
        audited = cfg.audit.enabled and not cfg.audit.in_trial
        for method in cfg.sweep.methods:
            for eps in cfg.budget.epsilons:
                assert (method, eps) not in runs, (p.name, method, eps)
                runs[(method, eps)] = audited
                assert method in cfg.search, (p.name, method)  # the study's own ranges
        assert cfg.sweep.pruner == "asha" and cfg.sweep.seeds == 2, p.name
    assert members == {50_000}
    assert {m for m, e in runs if e == 3.0} == set(METHODS)
    assert {m for m, e in runs if e == 1.0} == {"dpsgd", "dpsgd_lf"}
    assert runs[("dpsgd", 3.0)] and runs[("lm_dpsgd", 3.0)]
    assert sum(load(p).sweep.baseline for p in PARTS) == 1


def test_published_point_runs_on_the_parts_setting() -> None:
    point = read_toml(PUBLISHED)
    part = read_toml(PARTS[0])
    for section in SHARED_SECTIONS:
        assert point[section] == part[section], section
    cfg = load(PUBLISHED)
    assert cfg.sweep.methods == ["dpsgd"] and cfg.sweep.seeds == 2
    dpsgd = check(cfg).trial_params("dpsgd")
    assert dpsgd["lr"] * dpsgd["clip_norm"] == pytest.approx(0.4)
