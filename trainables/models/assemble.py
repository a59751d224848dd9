"""A network made from its :class:`~trainables.models.source.ModelSource` record.

A built-in model is built by name (:func:`trainables.models.networks.build_model`); a user's
factory is resolved, called, optionally fixed (:mod:`trainables.models.fix`) and checked
(:mod:`trainables.models.validator`). Kept apart from the record because all of this needs
torch, while the record is read by commands that must not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from dpsweep.trainables.models import usercode
from dpsweep.trainables.models.catalog import model_for
from dpsweep.trainables.models.fix import fix_model
from dpsweep.trainables.models.networks import LayeredModel, build_model
from dpsweep.trainables.models.validator import sample_batch, wrap_checked

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.models.source import ModelSource


def build_network(source: ModelSource, *, input_shape: Sequence[int], num_classes: int,
                  dataset: str, sample: torch.Tensor | None = None) -> LayeredModel:
    """A fresh network for ``source`` (seed torch first); a user's is checked by
    ``trainables.models.validator``.

    ``sample`` is a small batch shaped like the data (its dtype tells token ids from
    features); by default standard-normal features. With ``fix``, a user's network is fixed
    (``trainables.models.fix``) before the checks, and the model's ``model_fixes`` lists what
    was replaced (plain dicts, for the privacy record)."""
    if not source.is_user:  # nothing to fix: no built-in model has a BatchNorm
        return build_model(name=model_for(model=source.name, dataset=dataset),
                           input_shape=tuple(input_shape), num_classes=num_classes,
                           activation=source.activation)
    fn = usercode.resolve(field="model.factory", reference=source.factory,
                          code_dir=source.code_dir or None)
    net = usercode.call_user(field="model.factory", fn=fn, reference=source.factory,
                             kwargs={"input_shape": tuple(input_shape),
                                     "num_classes": num_classes, **source.args})
    fixes = None
    if source.fix and isinstance(net, nn.Module):
        net, fixes = fix_model(net)
    batch = sample if sample is not None else sample_batch(input_shape=input_shape,
                                                           tokens=False)
    model = wrap_checked(net, layers=source.layers, sample=batch, num_classes=num_classes,
                         reference=source.factory)
    if fixes is not None:
        model.model_fixes = [r.to_dict() for r in fixes]
    return model
