"""The light model catalog the config validates against agrees with the models themselves."""

from __future__ import annotations

import pytest

from core.errors import UserInputError
from orchestrator.config import MODEL_CHOICES, from_dict
from orchestrator.sweep.plans import study_plans
from tests.conftest import tiny_config
from trainables.data.splits import DATASET_NAMES, INPUT_SHAPES
from trainables.models import catalog
from trainables.models.networks import build_model


@pytest.mark.parametrize("name", catalog.MODEL_NAMES)
def test_layer_counts_match_the_built_models(name: str) -> None:
    for shape in catalog.ACCEPTED_SHAPES[name]:
        model = build_model(name=name, input_shape=shape, num_classes=10)
        assert len(model.layer_names) == catalog.LAYER_COUNTS[name]


def test_catalog_names_are_the_models_and_the_config_choices() -> None:
    assert set(catalog.LAYER_COUNTS) == set(catalog.ACCEPTED_SHAPES) == set(catalog.MODEL_NAMES)
    assert set(catalog.MODEL_NAMES) == set(MODEL_CHOICES) - {"auto"}


def test_auto_resolves_to_a_model_that_takes_the_dataset() -> None:
    assert set(catalog.DEFAULT_MODEL) == set(DATASET_NAMES)
    for dataset in DATASET_NAMES:
        name = catalog.model_for(model="auto", dataset=dataset)
        assert INPUT_SHAPES[dataset] in catalog.ACCEPTED_SHAPES[name]
        assert catalog.model_for(model="cnn5", dataset=dataset) == "cnn5"


def test_planning_refuses_a_model_that_does_not_take_the_dataset() -> None:
    """Layer counts come from the catalog, so planning builds no model; it still refuses a
    model the dataset's inputs do not fit, with build_model's message."""
    raw = tiny_config().to_dict()  # digits: 1 x 8 x 8
    raw["model"]["name"] = "cnn28"
    with pytest.raises(UserInputError) as info:
        study_plans(from_dict(raw))
    assert info.value.field == "model.name" and "(1, 8, 8)" in str(info.value)
