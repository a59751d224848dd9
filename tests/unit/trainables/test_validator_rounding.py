"""The validator's norm check refuses a model only when a float64 copy fails it too: a float32
disagreement that float64 does not repeat is rounding (ShuffleNetV2's GroupNorms over a few
values of a 1 x 1 map failed float32 at some initialisations), not a wrong per-example
gradient, and was refused as "mixes examples"."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.models import validator
from dpsweep.trainables.models.validator import sample_batch, wrap_checked

IMAGE = sample_batch(input_shape=(1, 8, 8), tokens=False, rows=4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh()),
        head=nn.Sequential(nn.Flatten(), nn.Linear(4 * 64, 10))))


@pytest.mark.parametrize(("off", "accepted"), [((torch.float32,), True),
                                                ((torch.float32, torch.float64), False)])
def test_a_disagreement_only_float32_shows_is_rounding(
        monkeypatch: pytest.MonkeyPatch, off: tuple[torch.dtype, ...], accepted: bool) -> None:
    real = validator._loop_norms

    def reference(engine: GradEngine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        norms = real(engine, x, y)
        dtype = next(engine.model.parameters()).dtype
        return norms * 2 if dtype in off else norms  # the engine "off" by half in these

    monkeypatch.setattr(validator, "_loop_norms", reference)
    if accepted:
        model = wrap_checked(_net(), layers=(), sample=IMAGE, num_classes=10, reference="m:b")
        assert next(model.parameters()).dtype == torch.float32  # the copy was float64, not it
    else:
        with pytest.raises(UserInputError, match="differ from one-example-at-a-time autograd"):
            wrap_checked(_net(), layers=(), sample=IMAGE, num_classes=10, reference="m:b")


@pytest.mark.parametrize(("off", "accepted"), [((torch.float32,), True),
                                                ((torch.float32, torch.float64), False)])
def test_an_output_difference_only_float32_shows_is_rounding(
        monkeypatch: pytest.MonkeyPatch, off: tuple[torch.dtype, ...], accepted: bool) -> None:
    real = validator._alone_agrees

    def agrees(model: nn.Module, sample: torch.Tensor, out: torch.Tensor) -> bool:
        return False if sample.dtype in off else real(model, sample, out)

    monkeypatch.setattr(validator, "_alone_agrees", agrees)
    if accepted:
        wrap_checked(_net(), layers=(), sample=IMAGE, num_classes=10, reference="m:b")
    else:
        with pytest.raises(UserInputError, match="changes when another example joins"):
            wrap_checked(_net(), layers=(), sample=IMAGE, num_classes=10, reference="m:b")
