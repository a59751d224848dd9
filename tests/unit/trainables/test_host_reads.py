"""A DP step makes no host read of a device value (issue 33, "GPU first").

On the CPU a read costs nothing, so only the guard (``trainables.engine.host_reads``) can show that
the step a GPU runs waits on nothing: it makes the CPU take the GPU's branches and fails on every
read. Every registered method runs a few steps under it in its first DP-valid mode, with the Poisson
draw of each batch inside the guard too, on a small Conv2d + GroupNorm + Linear model. One warm-up
step runs outside the guard first: it holds the once-per-trial work (the engine's plan, a method's
first public refresh), which may read. """

from __future__ import annotations

from typing import Any

import pytest
import torch

from dpsweep.core.schedule import Schedule
from dpsweep.trainables.dp.randomness import Randomness, poisson_batches
from dpsweep.trainables.dp.step import GUARD_ROUNDING, DPStep
from dpsweep.trainables.engine.host_reads import (
    HostRead,
    forbid_host_reads,
    host_reads_allowed,
    host_resident,
)
from dpsweep.trainables.methods import METHODS
from tests.contract.conformance import SIGMA, digits, make_method, prepared_params

#: Steps taken under the guard after the warm-up (none of them a method's periodic refresh at
#: the default periods: public refreshes every 26 steps at batch 50, WW probes every 50).
GUARDED_STEPS = 3
RATE = 0.1
CPU = torch.device("cpu")


def _first_valid_mode(cls: type[DPStep]) -> str:
    return next(m.name for m in cls.modes if m.dp_valid)


def _method(name: str, **extra: Any) -> DPStep:
    """The method on ``norm_model`` (Conv2d + GroupNorm, Linear + LayerNorm, Linear) with its
    defaults, its once-per-sweep preparation, and its first DP-valid mode."""
    cls = METHODS[name]
    params = cls.validate_params({"lr": 0.1, "clip_norm": 1.0, **dict(prepared_params(name)),
                                  "mode": _first_valid_mode(cls), **extra})
    return make_method(cls, params=params, model="norm",
                       schedule=Schedule.constant(noise_multiplier=SIGMA, steps=1_000))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_methods_step_and_poisson_draw_read_nothing_on_the_host(name: str) -> None:
    method = _method(name)
    data = digits()
    x, y = data.train.x[:500], data.train.y[:500]
    sampler = Randomness(kind="reproducible", device=CPU, seed=3)
    batches = poisson_batches(n=len(y), rate=RATE, steps=1 + GUARDED_STEPS,
                              randomness=sampler, device=CPU)
    warm = next(batches)
    method.step(x[warm], y[warm])  # outside: the engine's plan, a first public refresh
    before = {n: p.detach().clone() for n, p in method.model.named_parameters()}
    losses: list[torch.Tensor] = []
    with forbid_host_reads():
        for idx in batches:
            losses.append(method.step(x[idx], y[idx]))
    assert method.step_count == 1 + GUARDED_STEPS
    assert all(torch.isfinite(loss).all() for loss in losses)
    assert any(not torch.equal(before[n], p) for n, p in method.model.named_parameters())
    # the counters stayed on the device and are read here, once, as plain numbers
    assert isinstance(method.guard_capped, int) and method.guard_capped == 0
    assert isinstance(method.last_guard_ratio, float) \
        and method.last_guard_ratio <= 1 + GUARD_ROUNDING


def test_lm_dpsgd_refreshes_u_from_public_data_without_a_read() -> None:
    """Its public refresh (a public batch's per-example norms -> u -> w) stays on the device
    too, so even a refresh at every step reads nothing (the 'risk' rule; ``bias_optimal``
    bisects on the host)."""
    method = _method("lm_dpsgd", u_every=1)
    x, y = digits().train.x[:40], digits().train.y[:40]
    method.step(x, y)
    w = method.weight_vector
    with forbid_host_reads():
        for _ in range(GUARDED_STEPS):
            method.step(x, y)
    assert method.weight_vector != w  # refreshed under the guard


def test_the_guard_catches_a_step_that_reads_on_the_host() -> None:
    """The test above can fail: a rule that asks a device value a question is caught."""

    class Reading(METHODS["dpsgd"]):  # type: ignore[misc, valid-type]
        def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
            if bool((norms > 1e3).any()):  # a host read, as the engine's old skips made
                norms = norms.clamp(max=1e3)
            return super().clip_coefficients(norms)

    method = _method("dpsgd")
    method.__class__ = Reading
    data = digits()
    x, y = data.train.x[:40], data.train.y[:40]
    method.step(x, y)
    with forbid_host_reads(), pytest.raises(HostRead, match="host"):
        method.step(x, y)


@pytest.mark.parametrize("read", [
    lambda t: t.sum().item(), lambda t: bool(t.sum() > 0), lambda t: float(t.sum()),
    lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy(),
    lambda t: torch.nonzero(t), lambda t: t[t > 0]])
def test_the_guard_refuses_each_kind_of_read(read: Any) -> None:
    t = torch.arange(4.0)
    assert host_reads_allowed(CPU)
    with forbid_host_reads(), pytest.raises(HostRead):
        assert not host_reads_allowed(CPU)
        read(t)
    assert host_reads_allowed(CPU)
    read(t)  # outside the guard every read works again


def test_only_a_tensor_marked_host_resident_may_be_read() -> None:
    """Adam's step counter lives on the host on every device; the guard lets it alone pass."""
    counter, value = torch.tensor(3.0), torch.tensor(3.0)
    host_resident(counter)
    with forbid_host_reads():
        assert counter.item() == 3.0 and float(counter) == 3.0
        with pytest.raises(HostRead):
            float(value)
    with pytest.raises(ValueError, match="host"):
        host_resident(torch.empty(1, device="meta"))
