"""What the config needs to know about the models without building one (no torch import).

``dpsweep config --check`` validates method settings against the model (e.g. DP-SGD-LF can
freeze at most L - 1 of a model's L layers), so the layer counts live here, as data; a test
builds every model and checks them.
"""

from __future__ import annotations

#: The model used when the config says ``model.name = "auto"``.
DEFAULT_MODEL = {"digits": "digits_cnn", "fashion-mnist": "cnn28", "mnist": "cnn28",
                 "cifar10": "cnn5"}
#: Named layers (blocks that own parameters) of each model.
LAYER_COUNTS = {"digits_cnn": 4, "cnn28": 4, "cnn5": 5, "resnet20_gn": 11, "wrn16_4": 8}


def model_for(*, model: str, dataset: str) -> str:
    return DEFAULT_MODEL[dataset] if model == "auto" else model


def layer_count(*, model: str, dataset: str) -> int:
    return LAYER_COUNTS[model_for(model=model, dataset=dataset)]
