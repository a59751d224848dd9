"""``trainables.dp.optim.Update`` is torch.optim's SGD and Adam, bit for bit, without
torch._dynamo."""

from __future__ import annotations

import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.dp.optim import Update

STEPS = 6


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _grads(model: torch.nn.Module, step: int) -> None:
    """Seeded gradients; the first layer's weight gets none on odd steps (a frozen layer)."""
    gen = torch.Generator().manual_seed(100 + step)
    for name, p in model.named_parameters():
        p.grad = None if (name == "0.weight" and step % 2) else torch.randn(
            p.shape, generator=gen)


CASES = [("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)]


def _torch_optimizer(kind: str, momentum: float, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


@pytest.mark.parametrize(("kind", "momentum"), CASES)
def test_updates_are_bit_identical_to_torch_optim(kind: str, momentum: float) -> None:
    ours, theirs = _model(), _model()
    update = Update(ours.named_parameters(), kind=kind, lr=0.01 if kind == "adam" else 0.1,
                    momentum=momentum)
    reference = _torch_optimizer(kind, momentum, theirs)
    frozen_before = ours[0].weight.detach().clone()
    for step in range(STEPS):
        _grads(ours, step)
        _grads(theirs, step)
        update.step()
        reference.step()
        if step == 0:
            assert not torch.equal(ours[0].weight, frozen_before)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), (kind, momentum, step, name)
    # a parameter that got no gradient on a step keeps its state: compare the states too
    theirs_state = reference.state_dict()["state"]
    for i, (name, _) in enumerate(ours.named_parameters()):
        for key, value in update.state.get(name, {}).items():
            assert torch.equal(value, theirs_state[i][key]), (name, key)


@pytest.mark.parametrize(("kind", "momentum"), CASES)
def test_a_restored_state_continues_exactly(kind: str, momentum: float) -> None:
    straight, resumed = _model(), _model()
    lr = 0.01 if kind == "adam" else 0.1
    a = Update(straight.named_parameters(), kind=kind, lr=lr, momentum=momentum)
    for step in range(STEPS):
        _grads(straight, step)
        a.step()
    b = Update(resumed.named_parameters(), kind=kind, lr=lr, momentum=momentum)
    for step in range(3):
        _grads(resumed, step)
        b.step()
    saved = {k: v for k, v in b.state_dict().items()}
    c = Update(resumed.named_parameters(), kind=kind, lr=lr, momentum=momentum)
    c.load_state_dict(saved)
    for step in range(3, STEPS):
        _grads(resumed, step)
        c.step()
    for x, y in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(x, y)


def test_a_state_that_does_not_fit_is_refused_whole() -> None:
    model = _model()
    update = Update(model.named_parameters(), kind="adam", lr=0.01)
    _grads(model, 0)
    update.step()
    good = update.state_dict()
    sgd = Update(model.named_parameters(), kind="sgd", lr=0.01, momentum=0.9)
    with pytest.raises(UserInputError, match=r"checkpoint\.optimizer"):
        sgd.load_state_dict(good)  # another kind
    bad_shape = {**good, "state": {**good["state"], "0.bias": {
        **good["state"]["0.bias"], "exp_avg": torch.zeros(7)}}}
    unknown = {**good, "state": {**good["state"], "9.weight": good["state"]["0.bias"]}}
    not_finite = {**good, "state": {**good["state"], "2.bias": {
        **good["state"]["2.bias"], "exp_avg_sq": torch.full((3,), float("nan"))}}}
    missing = {k: v for k, v in good.items() if k != "lr"}
    fresh = Update(model.named_parameters(), kind="adam", lr=0.01)
    for state in (bad_shape, unknown, not_finite, missing, {**good, "lr": 0.5}):
        with pytest.raises(UserInputError, match=r"checkpoint\.optimizer"):
            fresh.load_state_dict(state)
        assert fresh.state == {}  # nothing half-restored
    with pytest.raises(ValueError, match="kind"):
        Update(model.named_parameters(), kind="rmsprop", lr=0.1)


