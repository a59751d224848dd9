"""The model catalog: which models exist, what "auto" means, their input shapes and layer counts.

Each built-in model's torch-free facts (name, accepted input shapes, layer count) are declared
once here, as a :class:`ModelSpec`, so ``dpsweep config --check`` can validate method settings
against a model (e.g. DP-SGD-LF can freeze at most L - 1 of a model's L layers) without
importing torch or building one. Its builder in :mod:`trainables.models.networks` registers
against that very spec with the ``@builds(SPEC)`` decorator, next to the builder's code: the
decorator refuses a spec that is not the catalog's and a model built twice, and
:func:`trainables.models.networks.build_model` builds only registered names. The catalog holds
the declarations (rather than the builders' module) because the builders need torch;
``tests/unit/trainables/test_catalog.py`` checks that every catalog model has a builder and
that each built model has its declared layer count. ``DEFAULT_MODEL`` is a fact of each dataset,
not of a model, and stays a table.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpsweep.core.errors import UserInputError


@dataclass(frozen=True)
class ModelSpec:
    """One built-in model's facts that need no torch."""

    name: str
    #: Input shapes (C, H, W) the model accepts.
    accepted_shapes: frozenset[tuple[int, int, int]]
    #: Named layers (blocks that own parameters).
    layer_count: int


#: 28 x 28 and 32 x 32 images, grey or colour: what the size-adaptive models take.
IMAGE_SHAPES = frozenset({(1, 28, 28), (3, 28, 28), (1, 32, 32), (3, 32, 32)})

DIGITS_CNN = ModelSpec("digits_cnn", frozenset({(1, 8, 8)}), layer_count=4)
CNN28 = ModelSpec("cnn28", frozenset({(1, 28, 28)}), layer_count=4)
CNN5 = ModelSpec("cnn5", IMAGE_SHAPES, layer_count=5)
RESNET20_GN = ModelSpec("resnet20_gn", IMAGE_SHAPES, layer_count=11)
WRN16_4 = ModelSpec("wrn16_4", IMAGE_SHAPES, layer_count=8)

#: Every model :func:`trainables.models.networks.build_model` can build, by name.
CATALOG: dict[str, ModelSpec] = {m.name: m for m in (DIGITS_CNN, CNN28, CNN5, RESNET20_GN,
                                                      WRN16_4)}
#: The names, in the catalog's order (the config's choices).
MODEL_NAMES = tuple(CATALOG)
#: The model a dataset gets when the config says ``model.name = "auto"``.
DEFAULT_MODEL = {"digits": DIGITS_CNN.name, "fashion-mnist": CNN28.name, "mnist": CNN28.name,
                 "cifar10": CNN5.name}


def model_for(*, model: str, dataset: str) -> str:
    """The concrete model name: ``model`` itself, or the dataset's default for "auto"."""
    return DEFAULT_MODEL[dataset] if model == "auto" else model


def layer_count(*, model: str, dataset: str) -> int:
    """How many layers the (resolved) model has, without building it."""
    return CATALOG[model_for(model=model, dataset=dataset)].layer_count


def check_input_shape(*, model: str, input_shape: tuple[int, ...]) -> None:
    """Refuse a concrete model that does not take ``input_shape``: one message for building a
    model and for planning a sweep, which counts layers without building one."""
    shape = tuple(input_shape)
    accepted = CATALOG[model].accepted_shapes
    if shape not in accepted:
        raise UserInputError(field="model.name", value=model,
                             allowed=f"a model for inputs of shape {shape}; "
                                     f"{model} takes {sorted(accepted)}")
