"""The DP conformance checks (``tests/contract/conformance.py``) on a token model that uses every
module the engine handles (Embedding, LayerNorm, Conv1d, GroupNorm, Conv2d, Linear), through
the engine's algebra and through the two exact ``torch.func`` paths: a layer with no algebra
(block fallback) and the whole model (strategy "vmap").

No slack beyond rounding, as in ``test_conformance.py``: every realised contribution of every
adversarial pattern and of the real engine's views of crafted token batches meets the declared
bound within ``REL_TOL``, and the noise is as declared, over the same whole lifecycle (every
``fast_lifecycle`` change and a resume). Float32 only: the float64 neighbouring comparison
reads explicit gradients, which do not depend on the model's modules.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dpsweep.core.schedule import Schedule
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.methods import METHODS
from tests.contract.conformance import (
    LIFECYCLE_STEPS,
    NOISE_STEPS,
    SIGMA,
    STEPS_PER_EPOCH,
    Workload,
    check_release,
    lifecycle,
    lifecycle_params,
    make_method,
    token_workload,
)

SOUND = [pytest.param(name, mode.name, id=f"{name}:{mode.name}")
         for name, cls in sorted(METHODS.items()) for mode in cls.modes if mode.dp_valid]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workloads() -> dict[str, Workload]:
    return {"engine": token_workload(), "block": token_workload(gate=True),
            "whole": token_workload(strategy="vmap")}


def test_the_workloads_take_the_paths_they_are_named_for(
        workloads: dict[str, Workload]) -> None:
    """Engine algebra for every module of the token model; the gate (no algebra) alone by
    ``torch.func``; strategy "vmap" over the whole model."""
    x = workloads["engine"].crafted[0]
    plans = {name: {(p.layer, p.kind): p.norm
                    for p in GradEngine(w.model(), strategy=w.strategy).plan(x)}
             for name, w in workloads.items()}
    kinds = {kind for _, kind in plans["engine"]}
    assert kinds == {"Embedding", "LayerNorm", "Conv1d", "GroupNorm", "Conv2d", "Linear"}
    assert "vmap" not in plans["engine"].values()
    assert plans["block"][("gate", "torch.func")] == "vmap"
    assert {norm for (layer, _), norm in plans["block"].items() if layer != "gate"} <= {
        "ghost", "materialize", "per-channel"}
    assert set(plans["whole"].values()) <= {"vmap", "per-channel"}
    assert bool((x == 0).any())  # the crafted batch holds padding ...
    assert any(len(set(row.tolist())) < len(row) for row in x)  # ... and repeated tokens


@pytest.mark.parametrize("path", ["engine", "block"])
@pytest.mark.parametrize(("method", "mode"), SOUND)
def test_release_is_bounded_over_the_whole_lifecycle(workloads: dict[str, Workload],
                                                     method: str, mode: str, path: str) -> None:
    """``conformance.lifecycle`` on the token workload, through the engine's algebra and
    through the block fallback: 30 steps with every ``fast_lifecycle`` change and a resume
    into a fresh instance, the real engine's views of crafted token batches at
    ``ENGINE_STEPS``."""
    w = workloads[path]
    run = lifecycle(METHODS[method], mode, workload=w)
    assert len(run.releases) == LIFECYCLE_STEPS and len(run.noises) == len(NOISE_STEPS)
    broken = [c for c in run.releases if not c.holds]
    assert not broken, f"sensitivity bound broken at {broken[0]}"
    assert all(n.holds for n in run.noises), f"noise not as declared: {run.noises}"


@pytest.mark.parametrize(("method", "mode"), SOUND)
def test_release_is_bounded_through_the_whole_model_exact_path(
        workloads: dict[str, Workload], method: str, mode: str) -> None:
    """The same checks, with the real engine's views, through ``torch.func`` over the whole
    model (strategy "vmap"), at the start and after a few steps of training (the lifecycle's
    state changes are the engine path's above; only the gradients' path differs here)."""
    w = workloads["whole"]
    cls = METHODS[method]
    params = lifecycle_params(cls, mode, workload=w)
    shape = cls.noise_shape(epochs=1, steps_per_epoch=STEPS_PER_EPOCH, params=params)
    step = make_method(cls, params=params, schedule=shape.scaled(SIGMA), workload=w)
    assert step.engine.strategy == "vmap"
    x, y = w.train
    for t in range(2):
        probe = copy.deepcopy(step)
        probe.begin_step(probe.step_count)
        check = check_release(probe, engine=True, crafted=w.crafted)
        assert check.holds, f"state {t}: {check}"
        for _ in range(3):
            rows = slice(50 * step.step_count, 50 * (step.step_count + 1))
            step.step(x[rows], y[rows])
    assert all(bool(torch.isfinite(p).all()) for p in step.model.parameters())


def test_forced_strategies_release_within_the_bound(workloads: dict[str, Workload]) -> None:
    """Ghost or materialise forced on every module (``auto`` materialises this small
    vocabulary's embedding, so this is where its ghost norm meets the adversarial views): the
    choice of algorithm never changes what is released."""
    cls = METHODS["dpsgd"]
    w = workloads["engine"]
    for strategy in ("ghost", "materialize"):
        forced = Workload(model=w.model, train=w.train, public=w.public, crafted=w.crafted,
                          strategy=strategy, prepared=w.prepared)
        step = make_method(cls, params=lifecycle_params(cls, "standard", workload=forced),
                           schedule=Schedule.constant(noise_multiplier=SIGMA, steps=100),
                           workload=forced)
        assert step.engine.strategy == strategy
        check = check_release(step, engine=True, crafted=w.crafted)
        assert check.holds, f"{strategy}: {check}"
