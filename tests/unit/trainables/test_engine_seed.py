"""GradEngine.compute(seed=...): the audit's opt-in output gradient (trainables/engine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.models.networks import LayeredModel

#: A power of two that a seed is scaled by: every norm scales by it exactly.
SCALE = 2.0 ** -40


def small_cnn() -> LayeredModel:
    torch.manual_seed(0)
    return LayeredModel([
        ("conv", nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.MaxPool2d(2, 1))),
        ("fc1", nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 8), nn.Tanh())),
        ("fc2", nn.Linear(8, 3))], num_classes=3).eval()


def residual(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=1) - F.one_hot(y, logits.shape[1]).to(logits.dtype)


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(10, 1, 8, 8, generator=g), torch.randint(0, 3, (10,), generator=g)


def test_seed_of_the_residual_gives_the_cross_entropy_norms(batch: tuple) -> None:
    x, y = batch
    engine = GradEngine(small_cnn())
    live = [True] * engine.num_layers
    plain = engine.compute(x, y, live=live)
    seeded = engine.compute(x, y, live=live, seed=residual)
    torch.testing.assert_close(seeded.norms, plain.norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(seeded.losses, plain.losses, rtol=0, atol=0)
    # a seed scaled by a power of two scales every norm by it, exactly
    scaled = engine.compute(x, y, live=live, seed=lambda z, t: residual(z, t) * SCALE)
    assert torch.equal(scaled.norms, seeded.norms * SCALE)


def test_chunked_seeded_view_recomputes_its_sums_with_the_seed(batch: tuple) -> None:
    x, y = batch

    def seed(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return residual(z, t) * SCALE

    coef = torch.ones(len(x), 3, dtype=torch.float64)
    whole = GradEngine(small_cnn()).compute(x, y, live=[True] * 3, seed=seed).weighted_sum(coef)
    chunked = GradEngine(small_cnn(), max_physical_batch=4).compute(x, y, live=[True] * 3,
                                                                     seed=seed)
    for name, total in chunked.weighted_sum(coef).items():
        # without the seed the recomputed chunks would be the cross-entropy's: 2^40 larger
        torch.testing.assert_close(total / SCALE, whole[name] / SCALE, rtol=1e-4, atol=1e-6)


def test_the_whole_model_path_refuses_a_seed(batch: tuple) -> None:
    x, y = batch
    engine = GradEngine(small_cnn(), strategy="vmap")
    with pytest.raises(UserInputError, match="seed"):
        engine.compute(x, y, live=[True] * 3, seed=residual)
