"""Models: named layers in input order, IRs of any layer, per-example gradients that are each
example's own (no BatchNorm or other batch mixing), the parameter -> layer map."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.models.catalog import DEFAULT_MODEL, MODEL_NAMES
from dpsweep.trainables.models.networks import build_model

SHAPES = {"digits_cnn": (1, 8, 8), "cnn28": (1, 28, 28), "cnn5": (3, 32, 32),
          "resnet20_gn": (3, 32, 32), "wrn16_4": (3, 32, 32)}
LAYERS = {
    "digits_cnn": ["conv1", "conv2", "fc1", "fc2"],
    "cnn28": ["conv1", "conv2", "fc1", "fc2"],
    "cnn5": ["conv1", "conv2", "conv3", "fc1", "fc2"],
    "resnet20_gn": ["stem", *(f"block{i}" for i in range(1, 10)), "head"],
    "wrn16_4": ["stem", *(f"block{i}" for i in range(1, 7)), "head"],
}


def _conv(cin: int, cout: int, k: int = 3, bias: bool = False) -> int:
    return cin * cout * k * k + (cout if bias else 0)


def _resnet20_parameters() -> int:
    """Counted by hand: 3x3 convs without bias, GroupNorm (2 per channel), option-A skips."""
    total = _conv(3, 16) + 2 * 16  # stem
    cin = 16
    for width in (16, 32, 64):
        for _ in range(3):
            total += _conv(cin, width) + _conv(width, width) + 2 * 2 * width
            cin = width
    return total + 64 * 10 + 10  # head


def _wrn16_4_parameters() -> int:
    """Pre-activation blocks: GN(cin), conv, GN(cout), conv, a 1x1 conv skip on a change."""
    total = _conv(3, 16)  # stem
    cin = 16
    for width in (64, 128, 256):
        for _ in range(2):
            total += 2 * cin + _conv(cin, width) + 2 * width + _conv(width, width)
            if cin != width:
                total += _conv(cin, width, k=1)
            cin = width
    return total + 2 * 256 + 256 * 10 + 10  # head: GN, linear


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_layers_and_irs(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name=name, input_shape=SHAPES[name], num_classes=10)
    model.eval()
    assert model.layer_names == LAYERS[name]
    x = torch.randn(3, *SHAPES[name])
    logits, irs = model.forward_with_irs(x)
    assert logits.shape == (3, 10)
    assert list(irs) == LAYERS[name]
    assert torch.equal(irs[LAYERS[name][-1]], logits)
    assert torch.allclose(model(x), logits)
    # a single requested layer comes back alone and equals the full pass's IR
    second = LAYERS[name][1]
    _, one = model.forward_with_irs(x, [second])
    assert list(one) == [second] and torch.equal(one[second], irs[second])
    # every parameter belongs to exactly one layer, in layer order; sizes add up
    owner = model.layer_of_parameter()
    assert set(owner) == {n for n, _ in model.named_parameters()}
    assert all(n.split(".")[1] == LAYERS[name][i] for n, i in owner.items())
    assert sum(model.layer_sizes()) == sum(p.numel() for p in model.parameters())
    assert all(s > 0 for s in model.layer_sizes())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_per_example_gradients_are_each_examples_own(name: str) -> None:
    """No layer mixes examples (BatchNorm would): the vmapped per-example gradient of one
    example equals its gradient computed alone, and no gradient depends on the others."""
    torch.manual_seed(1)
    model = build_model(name=name, input_shape=SHAPES[name], num_classes=10)
    x = torch.randn(2, *SHAPES[name])
    y = torch.tensor([3, 7])
    layer_of = model.layer_of_parameter()
    live = [True] * len(model.layer_names)
    view = GradEngine(model, strategy="vmap").compute(x, y, live=live)
    model.zero_grad()
    nn.functional.cross_entropy(model(x[1:]), y[1:]).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(view.grads[n][1], p.grad, atol=1e-5, rtol=1e-4), n
    norms = torch.zeros(len(live), dtype=torch.float64)  # engine norms are float64
    for n, p in model.named_parameters():
        norms[layer_of[n]] += p.grad.pow(2).sum()
    assert torch.allclose(view.norms[1], norms.sqrt(), rtol=1e-4)


@pytest.mark.parametrize(("name", "count"), [
    ("cnn28", 26010),  # Papernot et al. (2021)'s CNN
    ("digits_cnn", 16 * 9 + 16 + 32 * 16 * 9 + 32 + 128 * 32 + 32 + 32 * 10 + 10),
    ("resnet20_gn", _resnet20_parameters()),  # ~0.27M
    ("wrn16_4", _wrn16_4_parameters()),  # ~2.75M
])
def test_parameter_counts(name: str, count: int) -> None:
    model = build_model(name=name, input_shape=SHAPES[name], num_classes=10)
    assert sum(p.numel() for p in model.parameters()) == count


def test_resnets_take_28x28_and_grey_inputs() -> None:
    for name in ("resnet20_gn", "wrn16_4", "cnn5"):
        model = build_model(name=name, input_shape=(1, 28, 28), num_classes=10)
        assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert set(DEFAULT_MODEL) == {"digits", "fashion-mnist", "mnist", "cifar10"}
    assert set(DEFAULT_MODEL.values()) <= set(MODEL_NAMES)


def test_activation_is_applied() -> None:
    relu = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10,
                       activation="relu")
    assert any(isinstance(m, nn.ReLU) for m in relu.modules())
    assert not any(isinstance(m, nn.Tanh) for m in relu.modules())


def test_unknown_layer_and_bad_shape_are_user_errors() -> None:
    model = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(UserInputError, match="layers"):
        model.forward_with_irs(torch.zeros(1, 1, 8, 8), ["conv9"])
    with pytest.raises(UserInputError, match=r"model\.name") as err:
        build_model(name="cnn28", input_shape=(1, 8, 8), num_classes=10)
    assert "(1, 28, 28)" in err.value.allowed
    with pytest.raises(UserInputError, match=r"model\.name"):
        build_model(name="resnet20_gn", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(UserInputError, match=r"model\.name"):
        build_model(name="resnet", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(UserInputError, match=r"model\.activation"):
        build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10,
                    activation="gelu")
