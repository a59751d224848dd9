"""What an export says about its network: how to rebuild it and what its inputs must look like.

A built-in model is named; a user's model is its factory reference, arguments, layers and the
SHA-256 of the code folder the weights were trained with, so whoever loads the weights can
check they have the same code. Input normalisation is part of the model: for a user's data its
constants are the ones the run used (user constants or public-pool statistics).
"""

from __future__ import annotations

from typing import Any

from core.datasets import FILE_DATASET, INPUT_SHAPES, NUM_CLASSES
from core.errors import UserInputError
from orchestrator import __version__
from trainables.data import NORMALIZATION
from trainables.model_source import ModelSource
from trainables.models import LayeredModel

MODEL_FORMAT = "dpsweep-model"
MODEL_VERSION = 2


def _bad(field: str, value: object, allowed: str) -> UserInputError:
    return UserInputError(field=field, value=value, allowed=allowed)


def model_description(spec: dict[str, Any]) -> dict[str, Any]:
    """How to rebuild the model from the spec (a user's data is read for its shape, classes
    and normalisation; built-in datasets need no data)."""
    from trainables.training import TrialSpec, load_trial_data

    dataset = spec.get("dataset")
    if dataset not in INPUT_SHAPES and dataset != FILE_DATASET:
        raise _bad("spec.dataset", dataset, f"one of {(*INPUT_SHAPES, FILE_DATASET)}")
    trial = TrialSpec.from_dict(spec)
    source = trial.model_source
    if dataset == FILE_DATASET:
        data = load_trial_data(trial)
        shape, classes, n = list(data.input_shape), data.num_classes, data.normalization
    else:
        shape, classes = list(INPUT_SHAPES[dataset]), NUM_CLASSES[dataset]
        n = NORMALIZATION[dataset]
    norm = None if n is None else {
        "max_value": n.max_value, "mean": list(n.mean), "std": list(n.std),
        "rule": "x / max_value, then (x - mean) / std per channel or feature"}
    info: dict[str, Any] = {
        "format": MODEL_FORMAT, "version": MODEL_VERSION,
        "architecture": source.describe(dataset=dataset if dataset != FILE_DATASET else ""),
        "input_shape": shape, "num_classes": classes, "activation": source.activation,
        "input_normalization": norm, "dpsweep_version": __version__}
    if source.is_user:
        info["model_source"] = source.to_dict()
        info["code_sha256"] = source.fingerprint().get("model_code", "")
    return info


def fresh_model(info: dict[str, Any]) -> LayeredModel:
    """An untrained network matching ``info`` (to load the exported weights into)."""
    source = (ModelSource.from_dict(info["model_source"]) if "model_source" in info
              else ModelSource(name=info["architecture"], activation=info["activation"]))
    return source.build(input_shape=tuple(info["input_shape"]),
                        num_classes=info["num_classes"], dataset="")


def load_instructions(info: dict[str, Any], *, weights: str) -> str:
    """The line of Python that rebuilds the released model."""
    if "model_source" in info:
        source = info["model_source"]
        module, name = source["factory"].split(":")
        return (f"from {module} import {name}; model = {name}(input_shape=tuple(input_shape), "
                f"num_classes=num_classes, **model_source['args']); "
                f"model.load_state_dict(torch.load('{weights}', weights_only=True)) (the "
                "factory's code folder on the import path; code_sha256 hashes it)")
    return ("model = trainables.models.build_model(name=architecture, input_shape=input_shape, "
            "num_classes=num_classes, activation=activation); "
            f"model.load_state_dict(torch.load('{weights}', weights_only=True))")
