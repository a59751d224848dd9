"""The conformance checks (``tests/contract/conformance.py``) on stock networks through the real
engine: every sound method's release, adversarial per-example gradients and the engine's own
views of crafted batches (the last layer scaled by 1e12 ... 0, inputs by 1e15), meets its
declared bound within ``REL_TOL`` = 1e-6 on a torchvision ResNet-18 (in-place ReLU,
``out += identity``), the same with a frozen backbone, a ViT (a root-owned class token,
``nn.MultiheadAttention``), an LSTM, a bidirectional GRU and a transformer encoder with a
root-level positional parameter. Then three steps train, and the check holds again."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Schedule
from dpsweep.trainables.methods import METHODS
from dpsweep.trainables.models.networks import LayeredModel
from dpsweep.trainables.models.validator import wrap_checked
from tests import stock_nets
from tests.contract.conformance import (
    SIGMA,
    STEPS_PER_EPOCH,
    Workload,
    check_release,
    lifecycle_params,
    make_method,
)

SOUND = [pytest.param(name, mode.name, id=f"{name}:{mode.name}")
         for name, cls in sorted(METHODS.items()) for mode in cls.modes if mode.dp_valid]
CLASSES = 3
IMAGE = (3, 16, 16)
TOKENS = 12
#: network -> (factory, input kind)
NETWORKS = {"resnet18": ("resnet_gn", "images"), "resnet18_frozen": ("resnet_head", "images"),
            "vit": ("vit", "images"), "lstm": ("lstm", "tokens"), "bigru": ("bigru", "tokens"),
            "encoder": ("encoder", "tokens")}


pytestmark = pytest.mark.usefixtures("one_thread")


def _data(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    if kind == "images":
        return torch.randn(n, *IMAGE, generator=g), y
    return torch.randint(0, 50, (n, TOKENS), generator=g), y


def _model(factory: Callable[..., torch.nn.Module], kind: str) -> LayeredModel:
    shape = IMAGE if kind == "images" else (TOKENS,)
    net = factory(shape, CLASSES)
    return wrap_checked(net, layers=(), sample=_data(kind, 2, 0)[0], num_classes=CLASSES)


@functools.cache
def _workload(name: str) -> Workload:
    factory, kind = NETWORKS[name]
    build = functools.partial(_model, getattr(stock_nets, factory), kind)
    layers = len(build().layer_names)
    x, y = _data(kind, 40, 1)
    return Workload(model=build, train=(x, y), public=_data(kind, 40, 2), crafted=(x[:4], y[:4]),
                    prepared={"lm_dpsgd": {"risk": [0.45 - 0.3 * i / layers
                                                    for i in range(layers)]}})


#: Every sound method on every network but the 11M-parameter ResNet-18: DP-SGD there, through
#: the engine's views (its frozen twin runs every method and the explicit patterns).
#: DP-SGD-LF freezes some of >= 2 trained layers: the frozen backbone trains one (refused below).
CASES = [pytest.param(net, *p.values, id=f"{p.id}-{net}") for net in NETWORKS for p in SOUND
         if (net != "resnet18" or p.values[0] == "dpsgd")
         and (net != "resnet18_frozen" or p.values[0] != "dpsgd_lf")]


@pytest.mark.parametrize(("network", "method", "mode"), CASES)
def test_release_is_bounded_on_stock_networks(network: str, method: str, mode: str) -> None:
    w = _workload(network)
    cls = METHODS[method]
    params = lifecycle_params(cls, mode, workload=w)
    shape = cls.noise_shape(epochs=1, steps_per_epoch=STEPS_PER_EPOCH, params=params)
    step = make_method(cls, params=params, schedule=shape.scaled(SIGMA), workload=w,
                       expected_batch_size=8.0)
    x, y = w.train
    for t in range(2):
        step.begin_step(step.step_count)
        check = check_release(step, engine=True, crafted=w.crafted,
                              patterns=network != "resnet18")
        assert check.holds, f"state {t}: {check}"
        if t == 0:
            for _ in range(3):
                rows = slice(8 * step.step_count, 8 * (step.step_count + 1))
                step.step(x[rows], y[rows])


def test_the_frozen_backbone_is_not_trained_and_the_class_token_is_a_layer() -> None:
    frozen = make_method(METHODS["dpsgd"], params={"lr": 0.1}, workload=_workload(
        "resnet18_frozen"), schedule=Schedule.constant(noise_multiplier=SIGMA, steps=10))
    assert frozen.model.layer_names == ["fc"]
    assert len(frozen.model.model.layer_names) == 7  # conv1, bn1, layer1..4, fc: all audited
    before = {n: p.detach().clone() for n, p in frozen.model.model.named_parameters()}
    x, y = _workload("resnet18_frozen").train
    frozen.step(x[:8], y[:8])
    after = dict(frozen.model.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {"net.fc.weight", "net.fc.bias"}
    with pytest.raises(UserInputError, match=r"m_f = 0 .*for a 1-layer model"):
        make_method(METHODS["dpsgd_lf"], params={"lr": 0.1}, workload=_workload(
            "resnet18_frozen"), schedule=Schedule.constant(noise_multiplier=SIGMA, steps=10))
    vit = make_method(METHODS["dpsgd"], params={"lr": 0.1}, workload=_workload("vit"),
                      schedule=Schedule.constant(noise_multiplier=SIGMA, steps=10))
    assert vit.model.layer_names[0] == "class_token" and vit.engine.path == "engine"
