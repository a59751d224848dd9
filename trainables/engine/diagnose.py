"""Why the engine's per-example norms differ from autograd's, parameter by parameter.

The validator compares the engine's norms with autograd on one example at a time. A
difference has two causes with different fixes, and a user must be told which: the model
*mixes examples* (example i's gradient in a batch is not its gradient alone: a batch
statistic, a gradient that crosses rows), or the engine does not follow how the model uses a
parameter (a construct its rules miss; nothing mixes). :func:`explain` tells them apart
exactly: per parameter, each example's gradient alone, its gradient in the batch (the
backward of its own loss in the batched forward), and the engine's (the view's weighted sum
with a one-hot coefficient row) are formed; the parameter furthest off names the construct.
It runs only after a check failed, so its cost (a backward per example) is never paid twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dpsweep.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.engine.grad_engine import GradEngine, PerExampleView
else:
    torch = lazy_module("torch")


@dataclass(frozen=True)
class Mismatch:
    """The parameter whose per-example gradient is furthest from autograd's alone."""

    parameter: str
    module: str  # its owner's path ('' for the root)
    kind: str  # its owner's type
    mixes: bool  # its gradient in the batch differs from its gradient alone
    error: float  # relative distance of the engine's (or the batch's) gradient


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.double().norm())
    return float((got.double() - want.double()).norm()) / max(scale, 1e-30)


def explain(engine: GradEngine, view: PerExampleView, x: torch.Tensor, y: torch.Tensor, *,
            tol: float) -> Mismatch | None:
    """The worst parameter (None if every per-example gradient agrees to ``tol``): mixing
    first, since no rule of the engine's can make a batch-dependent gradient per example."""
    params = dict(engine.model.named_parameters())
    names = list(params)
    n = x.shape[0]
    logits = engine.model(x)
    losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    worst_mix: tuple[float, str] = (0.0, "")
    worst_engine: tuple[float, str] = (0.0, "")
    for i in range(n):
        loss = torch.nn.functional.cross_entropy(engine.model(x[i:i + 1]), y[i:i + 1])
        alone = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        batched = torch.autograd.grad(losses[i], list(params.values()), allow_unused=True,
                                      retain_graph=True)
        coef = torch.zeros(n, engine.num_layers, dtype=torch.float64, device=x.device)
        coef[i] = 1.0
        ours = view.weighted_sum(coef)
        for name, a, b in zip(names, alone, batched, strict=True):
            want = torch.zeros_like(params[name]) if a is None else a
            inside = torch.zeros_like(want) if b is None else b
            worst_mix = max(worst_mix, (_relative(inside, want), name))
            if name in ours:
                worst_engine = max(worst_engine, (_relative(ours[name], want), name))
    mixes = worst_mix[0] > tol
    error, name = worst_mix if mixes else worst_engine
    if error <= tol:
        return None
    module = name.rpartition(".")[0]
    owner = dict(engine.model.named_modules())[module]
    return Mismatch(parameter=name, module=module, kind=type(owner).__name__, mixes=mixes,
                    error=error)
