"""Crafted inputs for the conformance suite: per-example gradients whose rank-one terms cancel,
neighbouring batches of crafted copies, and long blocks in the worst float32 layout.

A Linear layer applied at two positions, whose outputs the head subtracts, receives output
gradients b and -b; with inputs u and u + eps v (scaled x30) the example's weight gradient is
-eps b v^T, a near-cancellation of two large rank-one terms. A float32 ghost norm of it can
come out low while every decision that trusts a float32 value sees nothing wrong: the engine's
norm must be certified, not estimated.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from dpsweep.core.schedule import Schedule
from dpsweep.trainables.dp.step import DPStep
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.engine.host_reads import forbid_host_reads
from dpsweep.trainables.models.networks import LayeredModel
from tests.contract.conformance import (
    Workload,
    _excess,
    _fork,
    _layer_sq,
    _Masked,
    lifecycle_params,
    make_method,
)

#: Input features, output features and classes of the crafted model.
FEATURES, HIDDEN, CLASSES = 16, 8, 4
#: Scale of the crafted inputs (large rank-one terms) and the cancellation sweep's eps.
INPUT_SCALE = 30.0
CANCELLING_EPS = (0.003, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03)
#: Clipping norm of the crafted runs: below the crafted examples' norms, so they are clipped.
CRAFTED_CLIP = 1e-3
#: Copies in the neighbouring batches, and the added example's input scales.
COPIES = (1, 100, 1000)
OUTLIER_SCALES = (1e8, 1e-20)
#: The two branches of the engine: the CPU's (host reads allowed) and an accelerator's.
BRANCHES = ("cpu", "accelerator")


class Difference(nn.Module):
    """[B, 2, p] -> [B, p]: the first position minus the second (output gradients b, -b)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, 0, :] - h[:, 1, :]


def cancelling_model() -> LayeredModel:
    torch.manual_seed(0)
    return LayeredModel([
        ("lin", nn.Sequential(nn.Linear(FEATURES, HIDDEN))),
        ("head", nn.Sequential(Difference(), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))),
    ], num_classes=CLASSES)


def cancelling_batch(eps: float, *, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n examples [n, 2, FEATURES]: positions u and u + eps v, scaled by ``INPUT_SCALE``."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, FEATURES, generator=gen)
    v = torch.randn(n, FEATURES, generator=gen)
    return torch.stack([u, u + eps * v], 1) * INPUT_SCALE, torch.arange(n) % CLASSES


def cancelling_workload() -> Workload:
    x, y = cancelling_batch(0.01, n=200, seed=3)
    return Workload(model=cancelling_model, train=(x, y),
                    public=cancelling_batch(0.01, n=200, seed=4), crafted=(x[:4], y[:4]),
                    prepared={"lm_dpsgd": {"risk": [0.4, 0.3]}})


def crafted_method(cls: type[DPStep], mode: str, *, clip: float = CRAFTED_CLIP) -> DPStep:
    """The method on the cancelling model at step 0 (begin_step applied), clipping at
    ``clip``."""
    workload = cancelling_workload()
    params = cls.validate_params({**lifecycle_params(cls, mode, workload=workload),
                                  "clip_norm": clip})
    method = make_method(cls, params=params, workload=workload,
                         schedule=Schedule.constant(noise_multiplier=1.0, steps=100))
    method.begin_step(0)
    return method


@contextlib.contextmanager
def branch(name: str) -> Iterator[None]:
    """The engine's CPU branch, or the branch an accelerator takes (no host reads)."""
    if name == "accelerator":
        with forbid_host_reads():
            yield
    else:
        yield


def worst_cancelling_excess(method: DPStep, *, branch_name: str) -> float:
    """The largest realised contribution over its bound of any crafted example of the eps
    sweep, one example at a time through the real engine, ``clip()`` and the guard."""
    worst = 0.0
    for k, eps in enumerate(CANCELLING_EPS):
        x, y = cancelling_batch(eps, n=8, seed=100 + k)
        with branch(branch_name):
            view = method.gradients(x, y)
        for i in range(x.shape[0]):
            state = _fork(method)
            with branch(branch_name):
                sums = state.clip(_Masked(view, i))
            worst = max(worst, _excess(state, _layer_sq(method, sums)))
    return worst


def _clip_sum(method: DPStep, x: torch.Tensor, y: torch.Tensor, *,
              branch_name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the clip phase's released sum of the batch, the engine's per-example norms)."""
    state = _fork(method)
    with branch(branch_name):
        view = state.gradients(x, y)
        return state.clip(view), view.norms


def neighbours() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(the crafted example D is made of, the example added to it before scaling)."""
    return cancelling_batch(0.01, n=1, seed=7), cancelling_batch(0.5, n=1, seed=8)


def neighbour_clip(copies: int) -> float:
    """A clipping norm for D of ``copies``: below D's example's norm for one copy (D is
    clipped), and 2 x copies above it otherwise, so that D's released sum stays under the
    bound and float32's rounding of that sum (about 6e-8 of it) cannot pass for a
    dependence between examples."""
    (x, y), _ = neighbours()
    norm = float(GradEngine(cancelling_model(), strategy="vmap").compute(
        x, y, live=[True, True]).norms.norm())
    return norm / 4 if copies == 1 else 2 * copies * norm


def neighbouring_excess(method: DPStep, *, copies: int, scale: float,
                        branch_name: str) -> tuple[float, bool]:
    """(||clip(D + x) - clip(D)|| over the bound, in float64 from the released float32 sums;
    whether D's examples kept bit-identical norms): D is ``copies`` identical crafted examples,
    x one more with inputs scaled by ``scale``."""
    (dx, dy), (ox, oy) = neighbours()
    x = dx.expand(copies, *dx.shape[1:]).contiguous()
    y = dy.expand(copies).contiguous()
    without, alone = _clip_sum(method, x, y, branch_name=branch_name)
    with_, joined = _clip_sum(method, torch.cat([x, ox * scale]), torch.cat([y, oy]),
                              branch_name=branch_name)
    same = torch.equal(alone, joined[:copies])
    return _excess(method, _layer_sq(method, with_, without)), same


def worst_layout(n: int, *, every: int = 1024, small: float = 2.0 ** -12.5) -> torch.Tensor:
    """[1, n] float32: one entry 1 per ``every``, ``small`` elsewhere (float32 loses the small
    squares beside the large one in any lane that holds both)."""
    x = torch.full((1, n), small)
    x[0, ::every] = 1.0
    return x


def relative_to_float64(value: float, exact: float) -> float:
    return value / exact - 1 if exact else (0.0 if value == 0 else math.inf)
