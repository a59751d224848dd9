"""Torchvision families the validator once refused with a traceback (issue 45): GoogLeNet with
its auxiliary heads, which run in training only, and MaxViT, whose forward loops over a
``ModuleList``. Each goes through the real check with ``[model] fix = true`` and takes one
DP-SGD step equal to one computed by hand from float64 one-example-at-a-time gradients; an
input too small for a module is refused in one line naming the module and the smallest input
that runs; the rules behind them are shown on small stand-ins."""

from __future__ import annotations

import dataclasses
import warnings
from collections import namedtuple
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Schedule
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.methods import METHODS
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.networks import LayeredModel
from dpsweep.trainables.models.source import source_of_callable
from dpsweep.trainables.models.validator import sample_batch, wrap_checked
from tests.contract.conformance import Workload, make_method

torchvision = pytest.importorskip("torchvision")

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = 10
#: GoogLeNet's smallest square input: at 46 px a GroupNorm with one channel per group in
#: inception5a gets a 1x1 map (one value to normalise for one example).
GOOGLENET_SIDE = 47
CLIP = 0.5
SIGMA = 1.3
LR = 0.1
EXPECTED_BATCH = 4.0


def googlenet(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """torchvision's defaults (auxiliary heads on), untrained; BatchNorms left to fix."""
    del input_shape
    with warnings.catch_warnings():  # torchvision's note on its future default initialisation
        warnings.simplefilter("ignore", FutureWarning)
        return torchvision.models.googlenet(weights=None, num_classes=num_classes,
                                            init_weights=True)


def small_maxvit(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """MaxViT's structure (stem, a ``ModuleList`` of stages the forward loops over, a
    classifier; BatchNorm in the stem and MBConv) at 14k parameters."""
    return torchvision.models.MaxVit(
        input_size=tuple(input_shape[1:]), stem_channels=8, partition_size=2,
        block_channels=[8, 16], block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.0,
        num_classes=num_classes)


def _built(factory: object, side: int) -> LayeredModel:
    source = dataclasses.replace(source_of_callable(factory), fix=True)
    return build_network(source, input_shape=(3, side, side), num_classes=CLASSES,
                         dataset="file")


def _hand_step(model: LayeredModel, x: torch.Tensor, y: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """Abadi et al.'s update from float64 gradients of one example at a time (every trainable
    parameter in the flat norm), with the noise the step draws (same seed, same order)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads,
                                                                       strict=True)]
        norm = float(torch.sqrt(sum(g.square().sum() for g in grads)))
        factor = min(1.0, CLIP / (norm + 1e-6))
        for n, g in zip(params, grads, strict=True):
            total[n] += factor * g
    replay = Randomness(kind="reproducible", device=torch.device("cpu"), seed=0)
    noise = {n: replay.normal(p.shape, dtype=p.dtype) for n, p in params.items()}
    return {n: params[n].detach() - LR * (total[n] + SIGMA * CLIP * noise[n]) / EXPECTED_BATCH
            for n in params}


def _one_dp_step_matches_the_hand_step(model: LayeredModel, side: int) -> LayeredModel:
    """One DP-SGD step (the training mode's forward, dropout off so both sides compute one
    function) against :func:`_hand_step`, in float64; returns the stepped model."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 3, side, side, generator=gen, dtype=torch.float64)
    y = torch.tensor([1, 4, 7])
    workload = Workload(model=lambda: model, train=(x, y), public=(x, y), crafted=(x, y))
    step = make_method(METHODS["dpsgd"], params={"lr": LR, "clip_norm": CLIP},
                       schedule=Schedule.constant(noise_multiplier=SIGMA, steps=10),
                       dtype=torch.float64, workload=workload,
                       expected_batch_size=EXPECTED_BATCH)
    model.train()
    expected = _hand_step(model, x, y)
    assert set(expected) == {n for n, _ in step.model.named_parameters()}
    step.step(x, y)
    params = dict(model.named_parameters())
    for name, want in expected.items():
        torch.testing.assert_close(params[name].detach(), want, rtol=1e-9, atol=1e-12)
    return model


def test_googlenet_trains_its_main_logits_and_leaves_the_aux_heads_out() -> None:
    torch.manual_seed(0)
    model = _built(googlenet, GOOGLENET_SIDE)
    assert model.training_only == ["aux1", "aux2"]
    assert model.layer_names == ["conv1", "conv2", "conv3", "inception3a", "inception3b",
                                 "inception4a", "inception4b", "inception4c", "inception4d",
                                 "inception4e", "inception5a", "inception5b", "fc"]
    assert len(model.model_fixes) == 57 + 2 * 1  # every BasicConv2d's BatchNorm, aux ones too
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model.net.conv1.bn.eps == 1e-3  # BasicConv2d's eps, kept by the GroupNorm
    aux = {n: p.detach().clone() for n, p in model.net.named_parameters()
           if n.startswith("aux")}
    assert aux and not any(p.requires_grad for n, p in model.net.named_parameters()
                           if n.startswith("aux"))
    x = sample_batch(input_shape=(3, GOOGLENET_SIDE, GOOGLENET_SIDE), tokens=False, rows=2)
    for training in (True, False):  # both modes: main logits, every layer's output
        model.train(training)
        logits, irs = model.forward_with_irs(x)
        assert tuple(logits.shape) == (2, CLASSES) and list(irs) == model.layer_names
    stepped = _one_dp_step_matches_the_hand_step(model.double(), GOOGLENET_SIDE)
    for name, before in aux.items():  # not trained, not noised
        assert torch.equal(dict(stepped.net.named_parameters())[name].float(), before), name


def test_an_input_too_small_for_a_module_names_it_and_the_smallest_input() -> None:
    torch.manual_seed(0)
    with pytest.raises(UserInputError) as err:
        _built(googlenet, GOOGLENET_SIDE - 1)
    line = str(err.value)
    assert "\n" not in line and "model.factory" in line
    assert "module 'inception5a.branch3.0.bn' (GroupNorm)" in line
    assert "input_shape (3, 46, 46)" in line and "got a (32, 1, 1) input" in line
    assert f"the smallest input_shape it runs at is (3, {GOOGLENET_SIDE}, {GOOGLENET_SIDE})" \
        in line


def test_maxvit_stages_in_a_module_list_are_layers() -> None:
    torch.manual_seed(0)
    model = _built(small_maxvit, 32)
    assert model.layer_names == ["stem", "blocks.0", "blocks.1", "classifier"]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    _one_dp_step_matches_the_hand_step(model.double(), 32)


Outputs = namedtuple("Outputs", ["logits", "aux_logits"])


class _AuxNet(nn.Module):
    """GoogLeNet's pattern: a head called in training only, a named output there; ``mixed``:
    its output reaches the main logits; ``stages``: a ModuleList looped over, one stage
    skipped."""

    def __init__(self, *, mixed: bool = False, skip: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.Tanh())
        self.stages = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.aux = nn.Linear(8, CLASSES)
        self.fc = nn.Linear(8, CLASSES)
        self.mixed, self.skip = mixed, skip

    def forward(self, x: torch.Tensor) -> torch.Tensor | Outputs:
        h = self.stem(x)
        for stage in self.stages[:1] if self.skip else self.stages:
            h = torch.tanh(stage(h))
        out = self.fc(h)
        if not self.training:
            return out
        aux = self.aux(h)
        return Outputs(out + aux if self.mixed else out, aux)


IMAGE = sample_batch(input_shape=(1, 8, 8), tokens=False, rows=2)


def _wrap(net: nn.Module, layers: tuple[str, ...] = ()) -> LayeredModel:
    return wrap_checked(net, layers=layers, sample=IMAGE, num_classes=CLASSES,
                        reference="my_models:build")


def test_training_only_heads_are_frozen_unless_the_logits_use_them() -> None:
    model = _wrap(_AuxNet())
    assert model.layer_names == ["stem", "stages.0", "stages.1", "fc"]
    assert model.training_only == ["aux"] and not model.net.aux.weight.requires_grad
    with pytest.raises(UserInputError, match=r"module 'aux'.*runs in training only, yet the "
                                             r"training logits depend on it"):
        _wrap(_AuxNet(mixed=True))
    with pytest.raises(UserInputError, match=r"'aux' is in 'aux', which runs in training "
                                             r"only") as err:
        _wrap(_AuxNet(), layers=("stem", "aux", "fc"))
    assert err.value.field == "model.layers"
    with pytest.raises(UserInputError, match=r"module 'stages.1': forward never calls it"):
        _wrap(_AuxNet(skip=True))


def test_a_network_built_for_another_size_is_named_when_no_larger_input_runs() -> None:
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, CLASSES))  # 8x8 images only
    with pytest.raises(UserInputError) as err:
        wrap_checked(net, layers=(), num_classes=CLASSES, reference="my_models:build",
                     sample=sample_batch(input_shape=(1, 9, 9), tokens=False))
    line = str(err.value)
    assert "module '1' (Linear): on one example of input_shape (1, 9, 9) in training mode it " \
           "got a (81,) input and raised RuntimeError" in line
    assert "a model built for input_shape (1, 9, 9) (no larger input tried, sides up to 4096, " \
           "runs either)" in line and "\n" not in line
