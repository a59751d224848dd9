"""Crafted inputs against every sound method and mode, on the CPU branch and an accelerator's:
rank-one terms that cancel, neighbouring batches of crafted copies, and long float32 blocks in
the worst layout. Each of these released more than the bound before norms were certified."""

from __future__ import annotations

import math

import pytest
import torch

from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.engine.norms import row_sums, scaled_sq_norms
from dpsweep.trainables.methods import METHODS
from dpsweep.trainables.models.networks import LayeredModel
from tests.contract.conformance import REL_TOL
from tests.contract.crafted import (
    BRANCHES,
    COPIES,
    OUTLIER_SCALES,
    crafted_method,
    neighbour_clip,
    neighbouring_excess,
    relative_to_float64,
    worst_cancelling_excess,
    worst_layout,
)

SOUND = [pytest.param(name, mode.name, id=f"{name}:{mode.name}")
         for name, cls in sorted(METHODS.items()) for mode in cls.modes if mode.dp_valid]
#: Block sizes of the long-reduction checks (the reviewer's 9.4M and 16.8M entries).
LONG_BLOCKS = (9_400_000, 16_777_216)
#: Fan-in and fan-out of the wide layer.
WIDE = 4096
#: Examples of the wide layer's batch (a block of several rows, as a trial forms it).
WIDE_BATCH = 8


@pytest.mark.parametrize("branch_name", BRANCHES)
@pytest.mark.parametrize(("method", "mode"), SOUND)
def test_cancelling_terms_release_no_more_than_the_bound(method: str, mode: str,
                                                         branch_name: str) -> None:
    excess = worst_cancelling_excess(crafted_method(METHODS[method], mode),
                                     branch_name=branch_name)
    assert excess <= 1 + REL_TOL, f"realised / bound = {excess!r}"


@pytest.mark.parametrize("branch_name", BRANCHES)
@pytest.mark.parametrize(("method", "mode"), SOUND)
def test_neighbouring_crafted_batches_differ_by_at_most_the_bound(method: str, mode: str,
                                                                  branch_name: str) -> None:
    """D of 1, 100 and 1,000 identical crafted examples against D plus one example with inputs
    x1e8 or x1e-20: no example's norm, scaling or fate depends on the others, so the released
    sums differ by that example's contribution alone."""
    for copies in COPIES:
        step = crafted_method(METHODS[method], mode, clip=neighbour_clip(copies))
        for scale in OUTLIER_SCALES:
            excess, same = neighbouring_excess(step, copies=copies, scale=scale,
                                               branch_name=branch_name)
            assert same, f"D's norms changed when x ({scale:g}) joined {copies} copies"
            assert excess <= 1 + REL_TOL, \
                f"||clip(D') - clip(D)|| / bound = {excess!r} ({copies} copies, x {scale:g})"


@pytest.mark.parametrize("size", LONG_BLOCKS)
def test_long_blocks_are_normed_within_1e6_of_float64(size: int) -> None:
    """One large entry per 1,024 and 2^-12.5 elsewhere: float32 partial sums lose the small
    squares beside the large one; the certified norm stays within [0, 1e-6] above float64,
    and so does a Gram-style sum of the same entries."""
    x = worst_layout(size)
    exact = float(x.double().square().sum())
    got = float(scaled_sq_norms(x)[0])
    assert 0 <= relative_to_float64(got, exact) <= 2 * REL_TOL  # on the square: 1e-6 on the norm
    total = float(x.double().sum())
    assert abs(relative_to_float64(float(row_sums(x)[0]), total)) <= REL_TOL
    naive = float(torch.linalg.vector_norm(x, dim=1).double().square()[0])
    assert relative_to_float64(naive, exact) < -REL_TOL  # the layout has teeth


@pytest.mark.parametrize("positions", [1, 4])
def test_a_4096_wide_layer_in_the_worst_layout_is_never_under_normed(positions: int) -> None:
    """A 4096x4096 Linear whose inputs and output gradients are in the worst layout: the
    engine's norm (ghost at one position, certified ghost at four) is never below float64's
    norm of the same example's gradient (its inputs and the output gradients the engine's own
    pass computed), and at one position within 1e-6 of it."""
    model = LayeredModel([("wide", torch.nn.Sequential(torch.nn.Linear(WIDE, WIDE))),
                          ("head", torch.nn.Sequential(torch.nn.Flatten(),
                                                       torch.nn.Linear(WIDE * positions, 2)))],
                         num_classes=2)
    with torch.no_grad():
        model.blocks["wide"][0].weight.copy_(torch.eye(WIDE))
        model.blocks["wide"][0].bias.zero_()
        model.blocks["head"][1].weight.copy_(
            worst_layout(2 * WIDE * positions).view(2, -1) * torch.tensor([[1.0], [-1.0]]))
    x = worst_layout(WIDE * positions).view(1, positions, WIDE).expand(WIDE_BATCH, -1, -1)
    y = torch.zeros(WIDE_BATCH, dtype=torch.long)
    seen: list[torch.Tensor] = []  # the output gradient the engine's pass itself computes

    def keep_output_gradient(module: torch.nn.Module, args: tuple[torch.Tensor]) -> None:
        if args[0].requires_grad:  # the pass's forward (its probes run without gradients)
            args[0].register_hook(lambda grad: seen.append(grad.detach().clone()) and None)

    model.blocks["head"][0].register_forward_pre_hook(keep_output_gradient)
    got = GradEngine(model, strategy="ghost").compute(x, y, live=[True, False]).norms[0, 0]
    a, b = x[0].double(), seen[-1][0].double()  # [positions, WIDE] each
    # the exact norm of that example's weight and bias gradient, in float64
    exact = math.sqrt(float((b.t() @ a).square().sum() + b.sum(0).square().sum()))
    rel = relative_to_float64(float(got), exact)
    assert rel >= 0, rel
    if positions == 1:
        assert rel <= REL_TOL, rel
