"""A user-defined CNN for 28x28 grey images: GroupNorm instead of BatchNorm, three layers.

dpsweep calls ``build(input_shape=..., num_classes=..., **[model] args)``; each top-level child
that owns parameters (``features``, ``hidden``, ``head``) is one layer for the per-layer methods
and the per-layer audit, in the order forward calls them.
"""

from collections import OrderedDict

from torch import nn


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    channels, height, side = input_shape
    groups = 4 if width % 4 == 0 else 1
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv2d(channels, width, 3, padding=1),
                               nn.GroupNorm(groups, width), nn.Tanh(), nn.AvgPool2d(2)),
        hidden=nn.Sequential(nn.Flatten(), nn.Linear(width * (height // 2) * (side // 2), 32),
                             nn.Tanh()),
        head=nn.Linear(32, num_classes),
    ))
