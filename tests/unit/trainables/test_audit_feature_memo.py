"""ir_features keeps one forward's features per (model, input) for the audit's readers
(trainables/audit/layer_attack.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dpsweep.trainables.audit.layer_attack import ir_features
from dpsweep.trainables.audit.prefix import without_savings
from dpsweep.trainables.models.networks import LayeredModel


def model() -> LayeredModel:
    torch.manual_seed(0)
    return LayeredModel([("fc1", nn.Sequential(nn.Linear(6, 5), nn.Tanh())),
                         ("fc2", nn.Linear(5, 3))], num_classes=3)


def forwards(net: LayeredModel) -> list[int]:
    """A counter of ``net``'s forwards."""
    calls: list[int] = []
    net.blocks["fc1"].register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_one_forward_serves_every_reader_until_the_model_changes() -> None:
    net, x = model(), torch.randn(20, 6)
    calls = forwards(net)
    digests: dict[str, str] = {}
    first = ir_features(net, x, digests=digests)
    again = ir_features(net, x, layers=["fc2"])
    assert len(calls) == 1 and set(digests) == {"fc1", "fc2"}
    assert again["fc2"] is first["fc2"] and not again["fc2"].flags.writeable
    with without_savings():
        fresh = ir_features(net, x, digests=(own := {}))
    assert len(calls) == 2 and own == digests
    for name in fresh:
        np.testing.assert_array_equal(fresh[name], first[name])
    ir_features(net, x.clone())  # another input tensor: its own forward
    assert len(calls) == 3
    with torch.no_grad():
        net.blocks["fc2"].bias.add_(1.0)  # trained in place: the kept features are stale
    changed = ir_features(net, x)
    assert len(calls) == 4
    assert not np.array_equal(changed["fc2"], first["fc2"])


def test_sorted_or_other_reductions_are_not_kept() -> None:
    net, x = model(), torch.randn(8, 6)
    calls = forwards(net)
    ir_features(net, x, sort_units=True)
    ir_features(net, x, sort_units=True)
    assert len(calls) == 2
    with pytest.raises(ValueError):
        ir_features(net, x)["fc1"][0, 0] = 1.0  # shared arrays are read-only
