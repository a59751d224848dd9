"""A tabular MLP: 64 features in, two hidden layers (LayerNorm between), one layer each."""

from collections import OrderedDict

from torch import nn


def build(input_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Module:
    (features,) = input_shape
    return nn.Sequential(OrderedDict(
        inp=nn.Sequential(nn.Linear(features, hidden), nn.LayerNorm(hidden), nn.Tanh()),
        mid=nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()),
        out=nn.Linear(hidden, num_classes),
    ))
