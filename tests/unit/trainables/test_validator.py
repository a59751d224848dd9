"""A user's network checked before anything runs: each problem one line with the module, the
reason and the fix; what passes gets layers in forward order and a per-example path."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.engine.grad_engine import (
    BLOCK_EXACT_PATH,
    ENGINE_PATH,
    WHOLE_EXACT_PATH,
    GradEngine,
)
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.source import ModelSource, source_of_callable
from dpsweep.trainables.models.trainable import trainable_layers
from dpsweep.trainables.models.validator import sample_batch, wrap_checked

IMAGE = sample_batch(input_shape=(1, 8, 8), tokens=False, rows=4)
#: The factory reference every refusal shows as ``model.factory``'s value.
REF = "my_models:build"


def _wrap(net: nn.Module, layers: tuple[str, ...] = (), sample: torch.Tensor = IMAGE,
          classes: int = 10):
    return wrap_checked(net, layers=layers, sample=sample, num_classes=classes, reference=REF)


def _cnn(norm: nn.Module) -> nn.Module:
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), norm, nn.Tanh()),
        head=nn.Sequential(nn.Flatten(), nn.Linear(4 * 64, 10))))


class _Reversed(nn.Module):
    """Children declared in one order, called in the other."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 10)
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _Scale(nn.Module):
    """A parameterised module the engine has no algebra for."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        return x * self.gain + (0 if shift is None else shift)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))
        self.scale = _Scale(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(self.scale(h, shift=h.detach() * 0))


class _FoldedScale(nn.Module):
    """Runs its parameterised module on the batch folded into rows of 8."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = _Scale(8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.scale(h.reshape(-1, 8)).reshape(h.shape)


class _Folded(nn.Module):
    """The engine cannot follow the batch inside ``mix``; the exact path over the whole model
    can."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16))
        self.mix = _FoldedScale()
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.body(x)))


class _MixesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out - out.mean(0, keepdim=True)


class _CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(x)


@pytest.mark.parametrize(("norm", "says"), [
    (nn.BatchNorm2d(4), r"set \[model\] fix = true to replace every BatchNorm with GroupNorm.* "
                        r"\(1 BatchNorm module \('features.1'\): BatchNorm normalises"),
    (nn.InstanceNorm2d(4, track_running_stats=True),
     r"track_running_stats=False \(1 InstanceNorm module \('features.1'\)"),
])
def test_batch_statistics_are_refused_with_the_fix(norm: nn.Module, says: str) -> None:
    with pytest.raises(UserInputError, match=says) as err:
        _wrap(_cnn(norm))
    assert err.value.field == "model.factory" and err.value.value == REF
    assert str(err.value).startswith(f"model.factory = {REF!r} is not allowed")


def test_every_batchnorm_is_counted_and_the_first_named_in_one_line() -> None:
    blocks = [nn.Sequential(nn.Conv2d(1 if i == 0 else 4, 4, 3, padding=1), nn.BatchNorm2d(4),
                            nn.ReLU()) for i in range(5)]
    net = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(4 * 64, 10))
    with pytest.raises(UserInputError) as err:
        _wrap(net)
    text = str(err.value)
    assert "\n" not in text and err.value.value == REF
    assert "5 BatchNorm modules ('0.1', '1.1', '2.1' and 2 more)" in text
    assert "[model] fix = true" in text


@pytest.mark.parametrize(("net", "field", "says"), [
    (_MixesBatch(), "model.factory", "changes when another example joins its batch"),
    (_CountsCalls(), "model.factory", "stop updating 'calls' in forward"),
    (nn.Sequential(nn.Flatten(), nn.Linear(64, 7)), "model.factory",
     r"logits of shape \[batch, 10\]"),
    (nn.Sequential(nn.Flatten(), nn.Embedding(3, 4, max_norm=1.0)), "model.factory",
     "without max_norm"),
])
def test_what_dp_training_cannot_use_is_named(net: nn.Module, field: str, says: str) -> None:
    with pytest.raises(UserInputError, match=says) as err:
        _wrap(net)
    assert err.value.field == field


def test_frozen_parameters_are_not_trained_and_a_parents_parameter_is_a_layer() -> None:
    frozen = _cnn(nn.GroupNorm(2, 4))
    for p in frozen.features.parameters():
        p.requires_grad_(False)
    frozen.head[1].bias.requires_grad_(False)
    model = _wrap(frozen)
    assert model.layer_names == ["features", "head"]  # the audit still reads the frozen one
    trained = trainable_layers(model)
    assert trained.layer_names == ["head"]
    assert [n for n, _ in trained.named_parameters()] == ["net.head.1.weight"]
    stray = _Reversed()
    stray.offset = nn.Parameter(torch.zeros(10))
    trained = trainable_layers(_wrap(stray))
    assert trained.layer_names == ["offset", "body", "head"]
    assert trained.layer_sizes() == [10, 64 * 16 + 16, 16 * 10 + 10]
    given = trainable_layers(_wrap(_cnn(nn.GroupNorm(2, 4)), layers=("features.0",
                                                                        "features.1")))
    assert given.layer_names == ["head.1", "features.0", "features.1"]  # its module's
    every = _cnn(nn.GroupNorm(2, 4)).requires_grad_(False)
    with pytest.raises(UserInputError, match="every parameter is frozen") as err:
        _wrap(every)
    assert err.value.value == REF


def test_layers_follow_the_forward_order_and_given_layers_must_be_modules() -> None:
    model = _wrap(_Reversed())
    assert model.layer_names == ["body", "head"]  # called order, not declared order
    assert model.layer_sizes() == [64 * 16 + 16, 16 * 10 + 10]
    assert set(model.layer_of_parameter().values()) == {0, 1}
    given = _wrap(_cnn(nn.GroupNorm(2, 4)), layers=("features.0", "features.1", "head"))
    assert given.layer_names == ["features.0", "features.1", "head"]
    _, irs = given.forward_with_irs(IMAGE)
    assert [tuple(v.shape) for v in irs.values()] == [(4, 4, 8, 8), (4, 4, 8, 8), (4, 10)]
    with pytest.raises(UserInputError, match="module names of the model \\('tail' is not") as err:
        _wrap(_Reversed(), layers=("body", "tail"))
    assert err.value.field == "model.layers" and err.value.value == ["body", "tail"]
    with pytest.raises(UserInputError, match="do not nest"):
        _wrap(_cnn(nn.GroupNorm(2, 4)), layers=("features", "features.0", "head"))


def test_each_model_gets_the_per_example_path_it_can_use() -> None:
    assert _wrap(_cnn(nn.GroupNorm(2, 4))).per_example_path == ENGINE_PATH
    block = nn.Sequential(OrderedDict(body=nn.Sequential(nn.Flatten(), nn.Linear(64, 16),
                                                         _Scale(16)),
                                      head=nn.Linear(16, 10)))
    assert _wrap(block).per_example_path == BLOCK_EXACT_PATH
    assert _wrap(_TwoInputs()).per_example_path == BLOCK_EXACT_PATH  # kwargs, any inputs
    whole = _wrap(_Folded())
    assert whole.per_example_path == WHOLE_EXACT_PATH
    assert GradEngine(whole).strategy == "vmap" and GradEngine(whole).path == WHOLE_EXACT_PATH


@pytest.mark.parametrize("build", ["block", "whole"])
def test_the_exact_paths_agree_with_the_reference(build: str) -> None:
    torch.manual_seed(0)
    net = (nn.Sequential(OrderedDict(body=nn.Sequential(nn.Flatten(), nn.Linear(64, 16),
                                                        _Scale(16)),
                                     head=nn.Linear(16, 10)))
           if build == "block" else _Folded())
    model = _wrap(net.double(), sample=IMAGE.double())
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    y = torch.arange(6) % 10
    live = [True] * len(model.layer_names)
    ours = GradEngine(model).compute(x, y, live=live)
    reference = GradEngine(model, strategy="vmap").compute(x, y, live=live)
    torch.testing.assert_close(ours.norms, reference.norms, rtol=1e-10, atol=0)
    coef = torch.rand(6, len(live), dtype=torch.float64)
    for name, value in ours.weighted_sum(coef).items():
        torch.testing.assert_close(value, reference.weighted_sum(coef)[name], rtol=1e-10,
                                   atol=1e-12)


def test_a_factory_reference_and_a_callable_name_the_same_code(tmp_path) -> None:
    (tmp_path / "callable_net.py").write_text(
        "from torch import nn\n\ndef build(input_shape, num_classes, width=4):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.Tanh(),"
        " nn.Linear(width, num_classes))\n")
    source = ModelSource(factory="callable_net:build", args={"width": 6}, code_dir=str(tmp_path))
    model = build_network(source, input_shape=(1, 8, 8), num_classes=10, dataset="")
    assert model.layer_names == ["1", "3"] and model.layer_sizes()[0] == 64 * 6 + 6
    import importlib
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        fn = importlib.import_module("callable_net").build
    finally:
        sys.path.remove(str(tmp_path))
    assert source_of_callable(fn).factory == "callable_net:build"
    assert source_of_callable(fn).code_dir == str(tmp_path.resolve())
    with pytest.raises(UserInputError, match="top level of a module file"):
        source_of_callable(lambda input_shape, num_classes: None)
    with pytest.raises(UserInputError, match="unset: arguments go to"):
        ModelSource(args={"width": 3})


def test_tied_weights_are_refused() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 64)
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh())
            self.head = nn.Linear(64, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    with pytest.raises(UserInputError, match=r"untie 'head\.weight' from 'embed\.weight'"):
        _wrap(Tied())
    with pytest.raises(UserInputError, match="scale_grad_by_freq"):
        _wrap(nn.Sequential(nn.Embedding(3, 4, scale_grad_by_freq=True), nn.Flatten()),
              sample=torch.zeros(2, 1, dtype=torch.int64), classes=4)


class _UnfreezesInForward(nn.Module):
    """A frozen first layer whose forward turns its gradient back on (issue 44, item 5)."""

    def __init__(self, *, freeze: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh())
        self.head = nn.Linear(16, 10)
        self.freeze = freeze
        self.body.requires_grad_(not freeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.body.requires_grad_(self.freeze)  # unfreezes a frozen layer (or freezes one)
        return self.head(self.body(x))


@pytest.mark.parametrize(("freeze", "change"), [(True, "False -> True"),
                                                (False, "True -> False")])
def test_a_forward_that_changes_requires_grad_is_named_as_such(freeze: bool,
                                                               change: str) -> None:
    """Not 'something mixes examples' (what the norm check saw): the cause, by parameter."""
    with pytest.raises(UserInputError) as err:
        _wrap(_UnfreezesInForward(freeze=freeze))
    text = str(err.value)
    assert err.value.field == "model.factory" and err.value.value == REF
    assert "\n" not in text and "mixes examples" not in text
    assert (f"parameter 'body.1.weight' (and 1 more): the forward changes its requires_grad "
            f"({change})") in text
    assert "set requires_grad once, where the factory builds the model" in text
