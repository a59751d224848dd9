"""The light model catalog the config validates against agrees with the models themselves."""

from __future__ import annotations

import pytest

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.api import from_dict
from dpsweep.orchestrator.config import MODEL_CHOICES
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep.plans import study_plans
from dpsweep.trainables.data.splits import DATASET_NAMES, INPUT_SHAPES
from dpsweep.trainables.models import catalog
from dpsweep.trainables.models.networks import BUILDERS, build_model, builds
from tests.conftest import tiny_config


@pytest.mark.parametrize("name", catalog.MODEL_NAMES)
def test_layer_counts_match_the_built_models(name: str) -> None:
    spec = catalog.CATALOG[name]
    for shape in spec.accepted_shapes:
        model = build_model(name=name, input_shape=shape, num_classes=10)
        assert len(model.layer_names) == spec.layer_count


def test_catalog_names_are_the_models_and_the_config_choices() -> None:
    assert set(catalog.MODEL_NAMES) == set(MODEL_CHOICES) - {"auto"}
    assert all(spec.name == name for name, spec in catalog.CATALOG.items())


def test_the_builders_registered_are_the_catalog_models() -> None:
    """Every declared model has exactly one builder, registered under its spec's name."""
    assert list(BUILDERS) == list(catalog.MODEL_NAMES)


def test_a_builder_for_an_undeclared_model_is_refused() -> None:
    stray = catalog.ModelSpec("not_in_catalog", frozenset({(1, 8, 8)}), layer_count=1)
    with pytest.raises(RuntimeError, match="not declared"):
        builds(stray)
    twin = catalog.ModelSpec("cnn5", catalog.CNN5.accepted_shapes, layer_count=5)
    with pytest.raises(RuntimeError, match="not declared"):
        builds(twin)  # equal facts, but not the catalog's declaration
    with pytest.raises(RuntimeError, match="twice"):
        builds(catalog.CNN5)(lambda **_: None)


def test_auto_resolves_to_a_model_that_takes_the_dataset() -> None:
    assert set(catalog.DEFAULT_MODEL) == set(DATASET_NAMES)
    for dataset in DATASET_NAMES:
        name = catalog.model_for(model="auto", dataset=dataset)
        assert INPUT_SHAPES[dataset] in catalog.CATALOG[name].accepted_shapes
        assert catalog.model_for(model="cnn5", dataset=dataset) == "cnn5"


def test_planning_refuses_a_model_that_does_not_take_the_dataset() -> None:
    """Layer counts come from the catalog, so planning builds no model; it still refuses a
    model the dataset's inputs do not fit, with build_model's message."""
    raw = tiny_config().to_dict()  # digits: 1 x 8 x 8
    raw["model"]["name"] = "cnn28"
    with pytest.raises(UserInputError) as info:
        study_plans(check(from_dict(raw)))
    assert info.value.field == "model.name" and "(1, 8, 8)" in str(info.value)
