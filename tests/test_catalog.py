"""The light model catalog the config validates against agrees with the models themselves."""

from __future__ import annotations

import pytest

from orchestrator.config import MODEL_CHOICES
from trainables import catalog
from trainables.data import DATASET_NAMES, INPUT_SHAPES
from trainables.models import build_model


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
