"""A CNN with BatchNorm: dpsweep refuses it before anything runs and says what to use instead.

BatchNorm normalises each example with its batch's statistics, so one example's gradient
depends on the others and per-example clipping no longer bounds one person's influence.
``[model] fix = true`` replaces it with a GroupNorm instead (see sweep.toml).
"""

from torch import nn


def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes),
    )
