"""DP-SGD, the baseline: the base phases are exactly Abadi et al.'s step.

The generic checks (sensitivity over a lifecycle, accounting, determinism, round trip) run for
every method in ``tests/contract/test_conformance.py``; this file checks DP-SGD's own arithmetic
against
a step computed by hand: flat per-example clipping at C, one N(0, sigma^2 C^2) draw per
coordinate, the sum divided by the *expected* batch size, one SGD update.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dpsweep.core.errors import PrivacyBoundViolation, UserInputError
from dpsweep.core.events import PoissonSubsampledGaussian, events_from_list
from dpsweep.trainables.dp.ledger import Ledger
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.methods.dpsgd import DPSGD
from dpsweep.trainables.training.loop import verify_ledger
from tests.contract.conformance import build_step, digits

SIGMA = 1.3
LR = 0.1
EXPECTED_BATCH = 50.0  # build_step: sample rate 0.1 of a 500-example train split


def _replayed_noise(step: DPSGD, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """The standard normal draws the step's noise phase makes (same seed, same order)."""
    replay = Randomness(kind="reproducible", device=torch.device("cpu"), seed=seed)
    return {n: replay.normal(p.shape, dtype=p.dtype) for n, p in step.model.named_parameters()}


def test_flat_clipping_matches_the_definition() -> None:
    step = build_step("dpsgd", clip_norm=1.0)
    norms = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.3, 0.4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    coef = step.clip_coefficients(norms)
    assert torch.allclose(coef[0], torch.full((4,), 0.2), atol=1e-6)  # ||g|| = 5: scaled to C
    assert torch.allclose(coef[1], torch.ones(4))  # ||g|| = 0.5 < C: untouched
    assert torch.isfinite(coef[2]).all()  # a zero gradient is not a division by zero


def test_noise_is_sigma_c_on_every_layer_and_the_multiplier_is_sigma() -> None:
    step = build_step("dpsgd", clip_norm=2.5, sigma=SIGMA)
    assert step.noise_std() == pytest.approx([SIGMA * 2.5] * 4)
    assert step.sensitivity() == 2.5
    assert step.whitened_noise_multiplier() == pytest.approx(SIGMA)
    assert step.dp_valid and step.validity_reason.startswith("each example's gradient")


def test_one_step_equals_the_hand_computed_dp_sgd_update() -> None:
    """Per-example gradients by a loop of ordinary backward passes, clipped at C, summed,
    plus sigma * C * z with the trial's own draws, over the expected batch size, times lr."""
    clip = 0.5
    step = build_step("dpsgd", clip_norm=clip, sigma=SIGMA, params={"lr": LR})
    data = digits()
    x, y = data.train.x[:7], data.train.y[:7]
    model = step.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for n, g in grads.items():
            total[n] += factor * g
    model.zero_grad()
    z = _replayed_noise(step)
    losses = step.step(x, y)
    assert losses.shape == (7,)
    for n, p in model.named_parameters():
        expected = before[n] - LR * (total[n] + SIGMA * clip * z[n]) / EXPECTED_BATCH
        assert torch.allclose(p.detach(), expected, atol=1e-6, rtol=1e-5), n
    assert step.ledger.events == [{"kind": "poisson_subsampled_gaussian",
                                   "sampling_probability": 0.1,
                                   "noise_multiplier": pytest.approx(SIGMA), "count": 1}]


def test_an_empty_poisson_batch_still_releases_noise() -> None:
    """Skipping an empty batch would make the output depend on its emptiness, which the
    accountant does not model: the update is pure noise, and the ledger counts the step."""
    step = build_step("dpsgd", clip_norm=1.0, sigma=SIGMA, params={"lr": LR})
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    z = _replayed_noise(step)
    step.step(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    for n, p in step.model.named_parameters():
        assert torch.allclose(p.detach(), before[n] - LR * SIGMA * z[n] / EXPECTED_BATCH,
                              atol=1e-7), n
    assert step.ledger.steps == 1 and step.step_count == 1


def test_the_ledger_speaks_core_events_and_counts_steps_no_event_takes() -> None:
    """Runs of equal steps are ``PoissonSubsampledGaussian.to_dict()``; a step with no live
    layer (multiplier inf: nothing released) or no noise (0: a broken method) has no such
    event but is counted in the same form, and the trial's check refuses the 0."""
    ledger = Ledger(sample_rate=0.1)
    for multiplier in (SIGMA, SIGMA, math.inf, SIGMA):
        ledger.add(multiplier)
    assert events_from_list(ledger.events[:1]) == [PoissonSubsampledGaussian(
        sampling_probability=0.1, noise_multiplier=SIGMA, count=2)]
    assert ledger.events[1] == {**ledger.events[0], "noise_multiplier": math.inf, "count": 1}
    assert ledger.steps == 4 and Ledger.from_dict(ledger.to_dict()) == ledger
    verify_ledger(SimpleNamespace(ledger=ledger, sigma_at=lambda step: SIGMA))
    for broken in (0.0, math.nan):
        ledger.add(broken)
        with pytest.raises(PrivacyBoundViolation):
            verify_ledger(SimpleNamespace(ledger=ledger, sigma_at=lambda step: SIGMA))
        ledger.events.pop()
    old = {"event": "poisson_subsampled_gaussian", "sampling_probability": 0.1,
           "noise_multiplier": SIGMA, "count": 1}  # the form before core.events
    with pytest.raises(UserInputError) as info:
        Ledger.from_dict({"sample_rate": 0.1, "events": [old]})
    assert info.value.field == "checkpoint.ledger"


def test_declaration_is_the_shared_sgd_one() -> None:
    decl = DPSGD.declaration()
    assert decl.names == ["mode", "lr", "clip_norm", "momentum"]
    assert DPSGD.validate_params({}) == {"mode": "standard", "lr": 0.5, "clip_norm": 1.0,
                                         "momentum": 0.0}
    assert DPSGD.presets() == {}
    assert [m.name for m in DPSGD.modes] == ["standard"]
