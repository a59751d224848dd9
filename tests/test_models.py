"""Models: named layers in input order, IRs of any layer, Opacus-valid, parameter -> layer map."""

from __future__ import annotations

import pytest
import torch
from opacus.validators import ModuleValidator

from core.errors import UserInputError
from trainables.models import MODEL_NAMES, build_model

SHAPES = {"digits_cnn": (1, 8, 8), "cnn28": (1, 28, 28), "cnn5": (3, 32, 32)}
LAYERS = {"digits_cnn": ["conv1", "conv2", "fc1", "fc2"], "cnn28": ["conv1", "conv2", "fc1", "fc2"],
          "cnn5": ["conv1", "conv2", "conv3", "fc1", "fc2"]}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_layers_irs_and_validity(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name=name, input_shape=SHAPES[name], num_classes=10)
    assert model.layer_names == LAYERS[name]
    assert ModuleValidator.validate(model, strict=False) == []
    x = torch.randn(5, *SHAPES[name])
    logits, irs = model.forward_with_irs(x)
    assert logits.shape == (5, 10)
    assert list(irs) == LAYERS[name]
    assert torch.equal(irs[LAYERS[name][-1]], logits)
    assert torch.allclose(model(x), logits)
    # a single requested layer comes back alone and equals the full pass's IR
    _, one = model.forward_with_irs(x, ["conv2"])
    assert list(one) == ["conv2"] and torch.equal(one["conv2"], irs["conv2"])
    # every parameter belongs to exactly one layer; sizes add up
    owner = model.layer_of_parameter()
    assert set(owner) == {n for n, _ in model.named_parameters()}
    assert sum(model.layer_sizes()) == sum(p.numel() for p in model.parameters())
    assert all(s > 0 for s in model.layer_sizes())


def test_cnn28_is_papernot_size() -> None:
    model = build_model(name="cnn28", input_shape=(1, 28, 28), num_classes=10)
    assert sum(p.numel() for p in model.parameters()) == 26010


def test_unknown_layer_and_bad_shape_are_user_errors() -> None:
    model = build_model(name="digits_cnn", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(UserInputError, match="layers"):
        model.forward_with_irs(torch.zeros(1, 1, 8, 8), ["conv9"])
    with pytest.raises(UserInputError, match=r"model\.name"):
        build_model(name="cnn28", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(UserInputError, match=r"model\.name"):
        build_model(name="resnet", input_shape=(1, 8, 8), num_classes=10)
