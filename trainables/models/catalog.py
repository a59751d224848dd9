"""The model catalog: which models exist, what "auto" means, their input shapes and layer counts.

The one place these facts live, as data and without importing torch, so ``dpsweep config
--check`` can validate method settings against a model (e.g. DP-SGD-LF can freeze at most
L - 1 of a model's L layers) without building one. :func:`trainables.models.networks.build_model`
checks names and shapes against this table; a test builds every model and checks the counts.
"""

from __future__ import annotations

from core.errors import UserInputError

#: Every model :func:`trainables.models.networks.build_model` can build.
MODEL_NAMES = ("digits_cnn", "cnn28", "cnn5", "resnet20_gn", "wrn16_4")
#: The model a dataset gets when the config says ``model.name = "auto"``.
DEFAULT_MODEL = {"digits": "digits_cnn", "fashion-mnist": "cnn28", "mnist": "cnn28",
                 "cifar10": "cnn5"}
#: Input shapes (C, H, W) each model accepts.
ACCEPTED_SHAPES: dict[str, frozenset[tuple[int, int, int]]] = {
    "digits_cnn": frozenset({(1, 8, 8)}),
    "cnn28": frozenset({(1, 28, 28)}),
    "cnn5": frozenset({(1, 28, 28), (3, 28, 28), (1, 32, 32), (3, 32, 32)}),
    "resnet20_gn": frozenset({(1, 28, 28), (3, 28, 28), (1, 32, 32), (3, 32, 32)}),
    "wrn16_4": frozenset({(1, 28, 28), (3, 28, 28), (1, 32, 32), (3, 32, 32)}),
}
#: Named layers (blocks that own parameters) of each model.
LAYER_COUNTS = {"digits_cnn": 4, "cnn28": 4, "cnn5": 5, "resnet20_gn": 11, "wrn16_4": 8}


def model_for(*, model: str, dataset: str) -> str:
    """The concrete model name: ``model`` itself, or the dataset's default for "auto"."""
    return DEFAULT_MODEL[dataset] if model == "auto" else model


def layer_count(*, model: str, dataset: str) -> int:
    """How many layers the (resolved) model has, without building it."""
    return LAYER_COUNTS[model_for(model=model, dataset=dataset)]


def check_input_shape(*, model: str, input_shape: tuple[int, ...]) -> None:
    """Refuse a concrete model that does not take ``input_shape``: one message for building a
    model and for planning a sweep, which counts layers without building one."""
    shape = tuple(input_shape)
    if shape not in ACCEPTED_SHAPES[model]:
        raise UserInputError(field="model.name", value=model,
                             allowed=f"a model for inputs of shape {shape}; "
                                     f"{model} takes {sorted(ACCEPTED_SHAPES[model])}")
