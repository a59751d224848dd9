"""Models with named layers, numbered from the input, and access to each layer's output.

A *layer* is one block that owns parameters (a Conv or Linear, plus whatever activation and
pooling follow it). Layer-wise DP methods clip, weight, noise or freeze per layer, and the audit
attacks each layer's output (its intermediate representation, IR), so both need the same
parameter -> layer map; keeping each block in one named submodule makes that map a prefix rule.
No BatchNorm anywhere: it mixes examples in a batch and breaks per-example gradients (Opacus's
``ModuleValidator`` rejects it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from core.errors import UserInputError

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


class LayeredModel(nn.Module):
    """A feed-forward stack of named blocks; ``blocks[name]`` is one layer."""

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], *, num_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(dict(blocks))
        self.num_classes = num_classes

    @property
    def layer_names(self) -> list[str]:
        """Layer names in order from the input."""
        return list(self.blocks.keys())

    def layer_of_parameter(self) -> dict[str, int]:
        """Parameter name (as in ``named_parameters``) -> index of the layer that owns it."""
        index = {name: i for i, name in enumerate(self.layer_names)}
        return {pname: index[pname.split(".")[1]] for pname, _ in self.named_parameters()}

    def layer_sizes(self) -> list[int]:
        """Number of parameters per layer, in layer order."""
        sizes = [0] * len(self.layer_names)
        params = dict(self.named_parameters())
        for pname, layer in self.layer_of_parameter().items():
            sizes[layer] += params[pname].numel()
        return sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x

    def forward_with_irs(
        self, x: torch.Tensor, layers: Sequence[str] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits and the outputs of the requested layers (all layers by default)."""
        wanted = set(self.layer_names if layers is None else layers)
        unknown = wanted - set(self.layer_names)
        if unknown:
            raise UserInputError(
                field="layers", value=sorted(unknown), allowed=f"names in {self.layer_names}"
            )
        irs: dict[str, torch.Tensor] = {}
        for name, block in self.blocks.items():
            x = block(x)
            if name in wanted:
                irs[name] = x
        return x, irs


def _conv_block(
    cin: int, cout: int, kernel: int, *, stride: int, padding: int, act: str, pool: nn.Module
) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding)
    return nn.Sequential(conv, ACTIVATIONS[act](), pool)


def _dense_block(fin: int, fout: int, *, act: str | None, flatten: bool = False) -> nn.Sequential:
    parts: list[nn.Module] = [nn.Flatten()] if flatten else []
    parts.append(nn.Linear(fin, fout))
    if act is not None:
        parts.append(ACTIVATIONS[act]())
    return nn.Sequential(*parts)


def digits_cnn(*, in_channels: int = 1, num_classes: int = 10, act: str = "tanh") -> LayeredModel:
    """Small CNN for 8x8 digits: 2 conv + 2 dense, ~9k parameters."""
    return LayeredModel(
        [
            ("conv1", _conv_block(in_channels, 16, 3, stride=1, padding=1, act=act,
                                  pool=nn.AvgPool2d(2))),  # 16x4x4
            ("conv2", _conv_block(16, 32, 3, stride=1, padding=1, act=act,
                                  pool=nn.AvgPool2d(2))),  # 32x2x2
            ("fc1", _dense_block(128, 32, act=act, flatten=True)),
            ("fc2", _dense_block(32, num_classes, act=None)),
        ],
        num_classes=num_classes,
    )


def cnn28(*, in_channels: int = 1, num_classes: int = 10, act: str = "tanh") -> LayeredModel:
    """The 2 conv + 2 dense CNN of Papernot et al. (2021) for 28x28 inputs, ~26k parameters.

    Tanh by default: tempered sigmoids train better than ReLU under DP-SGD (same paper).
    """
    return LayeredModel(
        [
            ("conv1", _conv_block(in_channels, 16, 8, stride=2, padding=3, act=act,
                                  pool=nn.MaxPool2d(2, 1))),  # 16x13x13
            ("conv2", _conv_block(16, 32, 4, stride=2, padding=0, act=act,
                                  pool=nn.MaxPool2d(2, 1))),  # 32x4x4
            ("fc1", _dense_block(32 * 4 * 4, 32, act=act, flatten=True)),
            ("fc2", _dense_block(32, num_classes, act=None)),
        ],
        num_classes=num_classes,
    )


def cnn5(
    *, in_channels: int = 1, num_classes: int = 10, act: str = "tanh", image_size: int = 28
) -> LayeredModel:
    """A 5-layer CNN (3 conv + 2 dense) for 28x28 or 32x32 inputs, as used by DP-SGD-LF."""
    side = image_size // 2 // 2 // 2
    return LayeredModel(
        [
            ("conv1", _conv_block(in_channels, 32, 3, stride=1, padding=1, act=act,
                                  pool=nn.MaxPool2d(2))),
            ("conv2", _conv_block(32, 64, 3, stride=1, padding=1, act=act, pool=nn.MaxPool2d(2))),
            ("conv3", _conv_block(64, 64, 3, stride=1, padding=1, act=act, pool=nn.MaxPool2d(2))),
            ("fc1", _dense_block(64 * side * side, 128, act=act, flatten=True)),
            ("fc2", _dense_block(128, num_classes, act=None)),
        ],
        num_classes=num_classes,
    )


MODEL_NAMES = ("digits_cnn", "cnn28", "cnn5")
#: The model used when the config says ``model.name = "auto"``.
DEFAULT_MODEL = {"digits": "digits_cnn", "fashion-mnist": "cnn28", "mnist": "cnn28",
                 "cifar10": "cnn5"}
#: Input shape (C, H, W) each model accepts.
_ACCEPTS: dict[str, set[tuple[int, int, int]]] = {
    "digits_cnn": {(1, 8, 8)},
    "cnn28": {(1, 28, 28)},
    "cnn5": {(1, 28, 28), (3, 28, 28), (1, 32, 32), (3, 32, 32)},
}


def build_model(
    *, name: str, input_shape: tuple[int, int, int], num_classes: int, activation: str = "tanh"
) -> LayeredModel:
    """Instantiate a model by name for the dataset's input shape (seed torch beforehand)."""
    if name not in MODEL_NAMES:
        raise UserInputError(field="model.name", value=name, allowed=f"one of {MODEL_NAMES}")
    if activation not in ACTIVATIONS:
        raise UserInputError(
            field="model.activation", value=activation, allowed=f"one of {tuple(ACTIVATIONS)}"
        )
    shape = tuple(input_shape)
    if shape not in _ACCEPTS[name]:
        raise UserInputError(
            field="model.name",
            value=name,
            allowed=f"a model for inputs of shape {shape}; {name} takes {sorted(_ACCEPTS[name])}",
        )
    channels = shape[0]
    if name == "digits_cnn":
        return digits_cnn(in_channels=channels, num_classes=num_classes, act=activation)
    if name == "cnn28":
        return cnn28(in_channels=channels, num_classes=num_classes, act=activation)
    return cnn5(in_channels=channels, num_classes=num_classes, act=activation, image_size=shape[1])
