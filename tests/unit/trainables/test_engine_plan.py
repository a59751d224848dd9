"""The plan by measurement: every candidate is exact, the fastest is kept (the cost model breaks
near-ties), the plan is cached per device and shapes and a bad cache is measured again, and the
step reads nothing on the host."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dpsweep.orchestrator.door import check
from dpsweep.trainables.engine import plan as engine_plan
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.engine.host_reads import HostRead, forbid_host_reads
from dpsweep.trainables.engine.modules import Choice, Geometry, Handler
from dpsweep.trainables.models.networks import LayeredModel
from tests.unit.trainables.test_engine import (
    _batch,
    _coef,
    _conv_variants,
    _sequence_model,
)

RTOL = 1e-9
ATOL = 1e-12


@pytest.fixture(autouse=True)
def unbounded_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    """No planning budget unless a test sets one: what is timed must not depend on how
    loaded the machine is."""
    monkeypatch.setattr("dpsweep.trainables.engine.grad_engine.PLAN_PASSES", math.inf)


def _forcing(target: Choice | None) -> object:
    """A stand-in for ``time_candidates`` that makes ``target`` (per module, when it is a
    candidate there) the fastest by far, and every other candidate slower."""
    def fake(handler: Handler, a: torch.Tensor, b: torch.Tensor, geometry: Geometry, *,
             cost: Choice, deadline: float = math.inf) -> dict[Choice, float]:
        del a, b, cost, deadline
        return {c: (0.001 if c == target else 1.0 + i)
                for i, c in enumerate(handler.candidates(geometry))}
    return fake


def _token_conv_model() -> LayeredModel:
    torch.manual_seed(6)
    return LayeredModel([
        ("embed", nn.Sequential(nn.Embedding(11, 6, padding_idx=0))),
        ("conv", nn.Sequential(_Transpose(), nn.Conv1d(6, 4, 3, padding=1), nn.Tanh())),
        ("out", nn.Sequential(nn.Flatten(), nn.Linear(4 * 5, 3))),
    ], num_classes=3).double()


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


CANDIDATES = [Choice("ghost", False), Choice("materialize", False), Choice("materialize", True),
              Choice("ghost", False, "unfold"), Choice("materialize", False, "unfold"),
              Choice("materialize", True, "unfold")]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("target", CANDIDATES, ids=lambda c: c.label)
@pytest.mark.parametrize("build", [_conv_variants, _sequence_model, _token_conv_model])
def test_every_candidate_gives_the_reference_norms_and_sums(
        target: Choice, build: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a measurement picks, the norms and weighted sums are the vmap reference's."""
    model = build()
    if build is _token_conv_model:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 3, (6,), generator=g)
    else:
        x, y = _batch((2, 9, 9) if build is _conv_variants else (12,), 6, classes=3)
    live = [True] * len(model.layer_names)
    monkeypatch.setattr(engine_plan, "time_candidates", _forcing(target))
    engine = GradEngine(model, max_physical_batch=4)
    timings = engine.measure_plan(x, y, live=live)
    forced = [t for t in timings if t.choice == target]
    assert forced or target.kernel == "unfold" or target.keep  # not every module offers all
    ref = GradEngine(model, strategy="vmap").compute(x, y, live=live)
    view = engine.compute(x, y, live=live)
    torch.testing.assert_close(view.norms, ref.norms, rtol=RTOL, atol=ATOL)
    coef = _coef(x.shape[0], len(live))
    got, want = view.weighted_sum(coef), ref.weighted_sum(coef)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL, msg=name)


def test_modules_of_one_shape_are_timed_once_and_the_budget_bounds_planning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal convolutions share one timing; once the planning time is spent, the modules left
    keep the cost model's choice and say so."""
    model = LayeredModel([(f"c{i}", nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()))
                          for i in range(3)] + [("fc", nn.Sequential(nn.Flatten(),
                                                                      nn.Linear(48, 3)))],
                         num_classes=3)
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 3, (4,))
    calls: list[str] = []
    real = engine_plan.time_candidates

    def counting(handler: Handler, *args: object, **kwargs: object) -> dict[Choice, float]:
        calls.append(handler.qualname)
        return real(handler, *args, **kwargs)

    monkeypatch.setattr(engine_plan, "time_candidates", counting)
    found = GradEngine(model).measure_plan(x, y, live=[True] * 4)
    assert calls == ["blocks.c0.0", "blocks.fc.1"]
    assert len({tuple(t.timings_ms.items()) for t in found[:3]}) == 1
    monkeypatch.setattr("dpsweep.trainables.engine.grad_engine.PLAN_PASSES", 0.0)
    calls.clear()
    spent = GradEngine(model).measure_plan(x, y, live=[True] * 4)
    assert calls == []
    assert [t.source for t in spent] == [engine_plan.OVER_BUDGET] * 4
    plan = GradEngine(model).plan(x)  # the cost model's, nothing measured
    assert [t.choice for t in spent] == [Choice(p.norm, p.keep, p.kernel) for p in plan]


def test_the_fastest_is_kept_unless_the_cost_model_is_within_the_tie() -> None:
    ghost, kept = Choice("ghost", False), Choice("materialize", True)
    assert engine_plan.pick({ghost: 1.0, kept: 2.0}, cost=kept) == ghost
    assert engine_plan.pick({ghost: 1.0, kept: 1.0 + engine_plan.TIE / 2}, cost=kept) == kept
    assert engine_plan.pick({ghost: 1.0, kept: math.inf}, cost=kept) == ghost


def test_real_timing_runs_every_candidate_once_and_plan_prints_it() -> None:
    model = _conv_variants()
    x, y = _batch((2, 9, 9), 4, classes=3)
    engine = GradEngine(model)
    timings = engine.measure_plan(x, y, live=[True] * 4)
    conv = next(t for t in timings if t.kind == "Conv2d" and t.source == "measured")
    assert conv.choice.label in conv.timings_ms and len(conv.timings_ms) >= 2
    assert set(conv.timings_ms) <= {c.label for c in CANDIDATES}
    assert all(v > 0 for v in conv.timings_ms.values())
    text = "\n".join(p.describe() for p in engine.plan(x[:1]))
    assert "[measured]" in text and "ms" in text


def test_the_plan_is_cached_and_a_bad_cache_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _sequence_model()
    x, y = _batch((12,), 6, classes=3)
    live = [True] * 3
    monkeypatch.setattr(engine_plan, "time_candidates", _forcing(Choice("materialize", False)))
    first = GradEngine(model).measure_plan(x, y, live=live, cache=tmp_path)
    files = list(tmp_path.glob(f"{engine_plan.PLAN_PREFIX}*.json"))
    assert len(files) == 1 and {t.source for t in first} >= {"measured"}

    def refuse(*_a: object) -> None:
        raise AssertionError("a cached plan was timed again")

    monkeypatch.setattr(engine_plan, "time_candidates", refuse)
    again = GradEngine(model).measure_plan(x, y, live=live, cache=tmp_path)
    assert [t.choice for t in again] == [t.choice for t in first]
    assert {t.source for t in again} <= {"cache", "cost model"}

    data = json.loads(files[0].read_text())
    data["modules"][0]["choice"] = {"norm": "ghost", "keep": True, "kernel": "native"}
    files[0].write_text(json.dumps(data))
    monkeypatch.setattr(engine_plan, "time_candidates", _forcing(Choice("ghost", False)))
    remeasured = GradEngine(model).measure_plan(x, y, live=live, cache=tmp_path)
    assert "measured" in {t.source for t in remeasured}
    # another batch size is another shape: measured, not read
    other = GradEngine(model).measure_plan(x[:5], y[:5], live=live, cache=tmp_path)
    assert "measured" in {t.source for t in other}
    assert len(list(tmp_path.glob(f"{engine_plan.PLAN_PREFIX}*.json"))) == 2


def test_a_step_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Norms and weighted sums under the guard, on every candidate's path."""
    model = _conv_variants()
    x, y = _batch((2, 9, 9), 6, classes=3)
    live = [True] * 4
    for target in CANDIDATES:
        monkeypatch.setattr(engine_plan, "time_candidates", _forcing(target))
        engine = GradEngine(model, max_physical_batch=4)
        engine.measure_plan(x, y, live=live)
        coef = _coef(6, 4)
        engine.compute(x, y, live=live).weighted_sum(coef)  # warm (probes read)
        with forbid_host_reads():
            view = engine.compute(x, y, live=live)
            view.weighted_sum(coef)
    with pytest.raises(HostRead), forbid_host_reads():
        float(view.norms.sum())  # the guard itself can fail


def test_a_cancelling_gradient_keeps_a_certified_norm_where_the_host_may_not_read() -> None:
    """On an accelerator (the guard) an example whose terms cancel keeps its certified norm
    (an upper bound of what the native sum releases for it, finite), with no read and nothing
    counted; on the CPU it is materialised and normed exactly."""
    model = LayeredModel([("fc", nn.Sequential(nn.Unflatten(1, (2, 3)), nn.Linear(3, 2))),
                          ("out", nn.Sequential(nn.Flatten(), nn.Linear(4, 3)))],
                         num_classes=3)
    x = torch.randn(4, 6)
    x[0, 3:] = -x[0, :3]  # example 0: two positions whose inputs cancel exactly ...
    y = torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        model.blocks["out"][1].weight.zero_()  # ... under equal output gradients at both
        model.blocks["out"][1].weight[:, :2] = 1.0
        model.blocks["out"][1].weight[:, 2:] = 1.0
    engine = GradEngine(model, strategy="ghost")
    cpu = engine.compute(x, y, live=[True, True])
    assert bool(torch.isfinite(cpu.norms).all())
    exact = GradEngine(model, strategy="vmap").compute(x, y, live=[True, True]).norms
    assert float(cpu.norms[0, 0]) == pytest.approx(float(exact[0, 0]), rel=1e-5, abs=1e-12)
    with forbid_host_reads():
        view = engine.compute(x, y, live=[True, True])
        released = view.weighted_sum(torch.ones(4, 2))
    assert bool(torch.isfinite(view.norms).all())
    assert bool((view.norms >= exact * (1 - 1e-6)).all())
    assert not hasattr(engine, "dropped")
    assert bool(torch.isfinite(released["blocks.fc.1.weight"]).all())


def test_a_trial_measures_its_plan_on_public_data_records_it_and_reuses_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret trial times its plan before the first step (on the shadow pool), records it
    and its timings, and a second trial on the same shapes reads it from the run's cache."""
    from dpsweep.orchestrator.trial.plan import plan_trial
    from dpsweep.trainables.training.loop import train_trial
    from tests.conftest import tiny_config

    seen: list[int] = []
    real = engine_plan.time_candidates

    def spy(handler: Handler, a: torch.Tensor, b: torch.Tensor, geometry: Geometry, *,
            cost: Choice, deadline: float = math.inf) -> dict[Choice, float]:
        seen.append(a.shape[0])
        return real(handler, a, b, geometry, cost=cost)

    monkeypatch.setattr(engine_plan, "time_candidates", spy)
    spec = plan_trial(check(tiny_config(epochs=1)), method="dpsgd",
                      params={"lr": 1.0, "clip_norm": 1.0})
    first = train_trial(spec, plan_cache=tmp_path).privacy_record.method_record
    plan = first["engine_plan"]
    assert [e["kind"] for e in plan] == ["Conv2d", "Conv2d", "Linear", "Linear"]
    assert {e["source"] for e in plan} == {"measured"} and all(e["timings_ms"] for e in plan)
    assert seen and set(seen) == {50}  # one expected batch (batch_size 50) of public data
    assert "cancellation_dropped" not in first
    seen.clear()
    again = train_trial(spec, plan_cache=tmp_path).privacy_record.method_record
    assert not seen and {e["source"] for e in again["engine_plan"]} == {"cache"}
    assert [e["choice"] for e in again["engine_plan"]] == [e["choice"] for e in plan]


def test_an_infinite_norm_with_a_zero_coefficient_is_no_contribution() -> None:
    """What the guard sees for an example the engine gave an infinite norm: a zero realised
    contribution (not NaN), and a positive coefficient on it capped to zero."""
    from dpsweep.trainables.dp.step import bound_coefficients

    norms = torch.tensor([[math.inf, 1.0], [0.5, 0.5]], dtype=torch.float64)
    coef = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    capped, ratio = bound_coefficients(coef, norms, sensitivity=1.0, layer_bounds=None)
    assert ratio.tolist() == [0.0, pytest.approx(math.sqrt(0.5))]
    assert capped.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    capped, ratio = bound_coefficients(coef, norms, sensitivity=1.0, layer_bounds=[1.0, 1.0])
    assert ratio.tolist() == [0.0, 0.5]
    bad, ratio = bound_coefficients(torch.tensor([[0.5, 0.0]]), norms[:1], sensitivity=1.0,
                                    layer_bounds=None)
    assert bad.tolist() == [[0.0, 0.0]] and math.isinf(float(ratio[0]))
