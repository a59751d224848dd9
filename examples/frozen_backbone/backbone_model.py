"""A frozen pretrained backbone with a trainable head: torchvision's ResNet-18 with GroupNorm
(BatchNorm mixes the examples of a batch, which DP-SGD cannot clip per example), its weights
read from a file, every backbone parameter frozen, and a linear head on its 512 features.

Only the head trains, is clipped and is noised; the audit's reference models start from the
same backbone, so the backbone's layers are identical in every model and reported as
"chance by construction" rather than scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torchvision
from torch import nn

#: Channels per GroupNorm group (at most 32 groups).
MAX_GROUPS = 32
FEATURES = 512


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(MAX_GROUPS, channels), channels)


def make_backbone() -> nn.Module:
    """ResNet-18 (GroupNorm) without its classifier: [N, 3, H, W] -> [N, 512]."""
    net = torchvision.models.resnet18(norm_layer=_group_norm)
    net.fc = nn.Identity()
    return net


def build(input_shape: Sequence[int], num_classes: int, weights: str = "") -> nn.Module:
    """The frozen backbone (loaded from ``weights`` when given) and a trainable head."""
    del input_shape  # adaptive pooling: any image of at least 32 x 32
    backbone = make_backbone()
    if weights:
        state = torch.load(Path(weights), weights_only=True, map_location="cpu")
        backbone.load_state_dict(state)
    backbone.requires_grad_(False)
    return nn.Sequential(backbone, nn.Linear(FEATURES, num_classes))
