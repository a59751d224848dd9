"""The no-gradient max-pooling forward against ``F.max_pool2d``: the same values (NaN,
infinities, ties and signed zeros included), the built-in CNNs' logits bit for bit, and the
kernel's path whenever a gradient is taken or the settings are not a plain 2 x 2 window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpsweep.trainables.models.networks import cnn5, cnn28
from dpsweep.trainables.models.pooling import MaxPool2d, shifted_max_pool2d

#: Batch, channel and side sizes: odd and even sides (an odd side drops a row at stride 2).
SHAPES = ((3, 2, 5, 5), (256, 16, 14, 14), (7, 3, 9, 6), (4, 32, 5, 5), (2, 1, 2, 2), (5, 8, 3))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, NaN where the other has NaN (-0.0 == 0.0, as IEEE has it)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and bit patterns."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _awkward(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Few distinct values (many ties within a window), signed zeros, +-inf and NaN."""
    x = torch.randint(-2, 3, shape, generator=generator).float()
    x[x == 0] = torch.where(torch.rand(x.shape, generator=generator) < 0.5, 0.0, -0.0)[x == 0]
    picks = torch.rand(shape, generator=generator)
    x[picks < 0.03] = float("nan")
    x[(picks >= 0.03) & (picks < 0.06)] = float("inf")
    x[(picks >= 0.06) & (picks < 0.09)] = -float("inf")
    return x


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_shifted_slices_give_the_kernels_values(shape: tuple[int, ...], stride: int) -> None:
    generator = torch.Generator().manual_seed(sum(shape) + stride)
    for x in (_awkward(shape, generator), torch.randn(shape, generator=generator),
              torch.zeros(shape) * torch.where(torch.rand(shape, generator=generator) < 0.5,
                                               1.0, -1.0)):
        want = F.max_pool2d(x, 2, stride)
        assert _same_values(shifted_max_pool2d(x, stride=stride), want)
        with torch.no_grad():
            assert _same_values(MaxPool2d(2, stride)(x), want)
        assert _same_values(shifted_max_pool2d(x.to(memory_format=torch.channels_last)
                                             if x.dim() == 4 else x, stride=stride), want)


def test_a_gradient_takes_the_kernel() -> None:
    # On ties torch.maximum would split the gradient; max_pool2d routes it to one entry.
    x = torch.ones(1, 1, 4, 4, requires_grad=True)
    MaxPool2d(2, 2)(x).sum().backward()
    want = torch.ones(1, 1, 4, 4, requires_grad=True)
    F.max_pool2d(want, 2, 2).sum().backward()
    assert torch.equal(x.grad, want.grad)
    assert set(x.grad.unique().tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("settings", [
    {"kernel_size": 3}, {"kernel_size": 2, "stride": 3}, {"kernel_size": 2, "padding": 1},
    {"kernel_size": 2, "dilation": 2}, {"kernel_size": 2, "ceil_mode": True},
    {"kernel_size": (2, 2), "stride": (1, 2)},
])
def test_other_settings_take_the_kernel(settings: dict[str, object]) -> None:
    pool = MaxPool2d(**settings) if set(settings) <= {"kernel_size", "stride"} else None
    if pool is None:
        pool = MaxPool2d(2)
        for name, value in settings.items():
            setattr(pool, name, value)
    assert pool.fast_stride() is None
    x = torch.randn(2, 3, 7, 7)
    with torch.no_grad():
        assert _same_values(pool(x), F.max_pool2d(x, pool.kernel_size, pool.stride, pool.padding,
                                                pool.dilation, ceil_mode=pool.ceil_mode))


def test_the_builtin_cnns_give_the_same_logits_with_and_without_a_gradient() -> None:
    torch.manual_seed(0)
    for model, side in ((cnn28(), 28), (cnn5(), 28), (cnn5(image_size=32), 32)):
        pools = [m for m in model.modules() if isinstance(m, torch.nn.MaxPool2d)]
        assert pools and all(type(m) is MaxPool2d and m.fast_stride() for m in pools)
        x = torch.randn(16, 1, side, side)
        with torch.no_grad():
            fast = model(x)
        assert _same_bits(fast, model(x).detach())
