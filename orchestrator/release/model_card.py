"""What an export says about its network: how to rebuild it and what its inputs must look like.

A built-in model is named; a user's model is its factory reference, arguments, layers and the
SHA-256 of the code folder the weights were trained with, so whoever loads the weights can
check they have the same code. Input normalisation is part of the model: for a user's data its
constants are the ones the run used (user constants or public-pool statistics). The classes are
named in label order (an image folder's folder names, a built-in dataset's class names, else the
labels themselves), so a prediction can be read without the training data.
"""

from __future__ import annotations

from typing import Any

from dpsweep.core.datasets import CLASS_NAMES, FILE_DATASET, INPUT_SHAPES, NUM_CLASSES
from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import __version__
from dpsweep.orchestrator.release.standalone import build_record
from dpsweep.trainables.data.files import class_names
from dpsweep.trainables.data.splits import NORMALIZATION
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.networks import LayeredModel
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.training.loop import (
    load_spec,
    load_trial_data,
    spec_file_source,
    spec_model_source,
)

MODEL_FORMAT = "dpsweep-model"
MODEL_VERSION = 3
#: ``model.json``'s ``input_kind``: what a raw input row is.
INPUT_KINDS = {"images": "[C, H, W] images, normalised per channel",
               "features": "feature rows, normalised per index of axis 1",
               "tokens": "integer token ids, never normalised"}


def _bad(field: str, value: object, allowed: str) -> UserInputError:
    return UserInputError(field=field, value=value, allowed=allowed)


def model_description(spec: dict[str, Any]) -> dict[str, Any]:
    """How to rebuild the model from the spec (a user's data is read for its shape, classes
    and normalisation; built-in datasets need no data)."""
    dataset = spec.get("dataset")
    if dataset not in INPUT_SHAPES and dataset != FILE_DATASET:
        raise _bad("spec.dataset", dataset, f"one of {(*INPUT_SHAPES, FILE_DATASET)}")
    trial = load_spec(spec)
    source = spec_model_source(trial)
    if dataset == FILE_DATASET:
        data = load_trial_data(trial)
        shape, classes, n = list(data.input_shape), data.num_classes, data.normalization
        named = class_names(files) if (files := spec_file_source(trial)) is not None else ()
    else:
        shape, classes = list(INPUT_SHAPES[dataset]), NUM_CLASSES[dataset]
        n, named = NORMALIZATION[dataset], CLASS_NAMES[dataset]
    norm = None if n is None else {
        "max_value": n.max_value, "mean": list(n.mean), "std": list(n.std),
        "rule": "x / max_value, then (x - mean) / std per channel or feature"}
    kind = "tokens" if norm is None else "images" if len(shape) == 3 else "features"
    architecture = source.describe(dataset=dataset if dataset != FILE_DATASET else "")
    info: dict[str, Any] = {
        "format": MODEL_FORMAT, "version": MODEL_VERSION, "architecture": architecture,
        "input_shape": shape, "num_classes": classes, "activation": source.activation,
        "classes": [*named, *(str(i) for i in range(len(named), classes))][:classes],
        "input_kind": kind, "input_kind_means": INPUT_KINDS[kind],
        "input_normalization": norm, "dpsweep_version": __version__,
        "build": build_record(source, architecture=architecture)}
    if source.is_user:
        info["model_source"] = source.to_dict()
        info["code_sha256"] = source.fingerprint().get("model_code", "")
    return info


def source_of(info: dict[str, Any]) -> ModelSource:
    """The model source ``info`` describes (a built-in by its concrete name)."""
    return (ModelSource.from_dict(info["model_source"]) if "model_source" in info
            else ModelSource(name=info["architecture"], activation=info["activation"]))


def fresh_model(info: dict[str, Any]) -> LayeredModel:
    """An untrained network matching ``info`` (to load the exported weights into)."""
    return build_network(source_of(info), input_shape=tuple(info["input_shape"]),
                         num_classes=info["num_classes"], dataset="")


def load_instructions(info: dict[str, Any], *, loader: str, weights: str) -> str:
    """How to use the release, in one line (docs/export.md has the full snippet)."""
    build = info["build"]
    return (f"import {loader.removesuffix('.py')}; model = {loader.removesuffix('.py')}.load("
            f"EXPORT_DIR)  # raw inputs in, logits out; model.classes names the labels. "
            f"By hand: {build['factory']} from {info['code']['dir']}/, called with "
            f"input_shape, num_classes and build.args, then load_state_dict(torch.load("
            f"'{weights}', weights_only=True)) and the input_normalization before it")
