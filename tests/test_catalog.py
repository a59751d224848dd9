"""The light model catalog the config validates against agrees with the models themselves."""

from __future__ import annotations

import pytest

from orchestrator.config import MODEL_CHOICES
from trainables import catalog
from trainables.models import DEFAULT_MODEL, MODEL_NAMES, build_model

SHAPES = {"digits_cnn": (1, 8, 8), "cnn28": (1, 28, 28), "cnn5": (3, 32, 32),
          "resnet20_gn": (3, 32, 32), "wrn16_4": (3, 32, 32)}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_layer_counts_match_the_built_models(name: str) -> None:
    model = build_model(name=name, input_shape=SHAPES[name], num_classes=10)
    assert len(model.layer_names) == catalog.LAYER_COUNTS[name]


def test_catalog_names_are_the_models_and_the_config_choices() -> None:
    assert set(catalog.LAYER_COUNTS) == set(MODEL_NAMES) == set(MODEL_CHOICES) - {"auto"}
    assert catalog.DEFAULT_MODEL == DEFAULT_MODEL
