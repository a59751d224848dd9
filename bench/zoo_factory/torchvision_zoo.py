"""Every torchvision classifier as a dpsweep factory: ``[model] factory =
"torchvision_zoo:build"``, ``code_dir = "bench/zoo_factory"``, ``args = {name = "vgg16"}``
(``bench.zoo`` checks the whole list through it).

Untrained (``weights=None``) at the config's classes; the remaining ``args`` go to
torchvision's builder as they are (ViT's ``image_size``, GoogLeNet's ``aux_logits``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torchvision
from torch import nn


def build(input_shape: Sequence[int], num_classes: int, name: str, **kwargs: Any) -> nn.Module:
    """``torchvision.models.get_model(name)`` untrained with ``num_classes`` outputs."""
    del input_shape  # torchvision's classifiers take the image size from their input
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
