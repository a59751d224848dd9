"""DP-AdamILG: the whitened-multiplier identity (= sigma_t for any thresholds), the threshold
normalisation and where thresholds come from in each mode, the paper's faithful clipping, and
the epoch-wise decaying schedule. The generic checks (release bound over a lifecycle per mode,
accounting, round trip) are in tests/contract/test_conformance.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.core.modes import Source
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.methods.dp_adamilg import (
    _THRESHOLDS_FROM,
    MIN_SHARE,
    THRESHOLD_STAT,
    DPAdamILG,
    _BatchThresholds,
    _PublicThresholds,
    _ReleasedThresholds,
    paper_floor,
)
from dpsweep.trainables.training.loop import train_trial
from tests.conftest import tiny_config
from tests.contract.conformance import NUM_LAYERS, adversarial_view, build_step, make_method

K = 0.5  # a visible decay within 2-3 epoch trials


def _step(*, clip_norm: float = 1.0, sigma: float = 1.3, **params: Any) -> DPAdamILG:
    step = build_step("dp_adamilg", clip_norm=clip_norm, sigma=sigma,
                      params={"lr": 0.01, **params})
    assert isinstance(step, DPAdamILG)
    return step


SOUND = ["public", "lagged"]


# ---- the sound modes: per-example per-layer clipping at C_j ----------------------------------
@pytest.mark.parametrize("mode", SOUND)
def test_whitened_multiplier_is_sigma_t_for_random_importances(mode: str) -> None:
    step = _step(mode=mode, clip_norm=2.5, sigma=1.3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(50):
        imp = (torch.rand(NUM_LAYERS, generator=gen, dtype=torch.float64)
               * 10.0 ** torch.randint(-8, 8, (NUM_LAYERS,), generator=gen)).tolist()
        step.set_bounds(imp)
        bounds, stds = step.layer_bounds(), step.noise_std()
        assert bounds is not None
        assert math.sqrt(sum(c * c for c in bounds)) == pytest.approx(2.5, rel=1e-12)
        direct = sum((c / s) ** 2 for c, s in zip(bounds, stds, strict=True)) ** -0.5
        assert direct == pytest.approx(1.3, rel=1e-9)
        assert step.whitened_noise_multiplier() == pytest.approx(1.3, rel=1e-9)
        assert stds == pytest.approx([1.3 * c * math.sqrt(NUM_LAYERS) for c in bounds])


@pytest.mark.parametrize("mode", SOUND)
def test_adversarial_norms_respect_nonuniform_bounds(mode: str) -> None:
    step = _step(mode=mode, clip_norm=0.7)
    step.set_bounds([1e-3, 5.0, 0.0, 40.0])
    bounds = torch.tensor(step.layer_bounds(), dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    norms = 10.0 ** (torch.rand(64, NUM_LAYERS, generator=gen, dtype=torch.float64) * 24 - 12)
    norms[::7] = 0.0
    contribution = step.clip_coefficients(norms) * norms
    assert (contribution <= bounds * (1 + 1e-9)).all()
    assert (contribution.pow(2).sum(dim=1).sqrt() <= 0.7 * (1 + 1e-9)).all()
    # the clip phase on real per-example blocks: each example's summed block is within C_j
    view = adversarial_view(step, norms[:6])
    for k in range(6):
        one = adversarial_view(step, norms[k:k + 1])
        clipped = step.clip(one)
        per_layer = [0.0] * NUM_LAYERS
        for n, g in clipped.items():
            per_layer[step.layer_of[n]] += float(g.double().pow(2).sum())
        assert all(math.sqrt(v) <= c * (1 + 1e-6) for v, c in zip(per_layer, bounds.tolist(),
                                                                   strict=True)), k
    assert set(step.clip(view)) == {n for n, _ in step.model.named_parameters()}


@pytest.mark.parametrize("importance", [
    [0.0, 0.0, 0.0, 0.0], [math.nan, 1.0, math.inf, 0.0], [1e300, 1e-300, 2e300, 0.0],
    [-1.0, 2.0, 2.0, 2.0],
])
def test_degenerate_importances_keep_every_layer_alive(importance: list[float]) -> None:
    step = _step(clip_norm=1.0)
    step.set_bounds(importance)
    bounds = step.layer_bounds()
    assert bounds is not None and all(math.isfinite(c) for c in bounds)
    assert min(bounds) >= 0.99 * MIN_SHARE / math.sqrt(NUM_LAYERS)
    assert math.sqrt(sum(c * c for c in bounds)) == pytest.approx(1.0, rel=1e-12)


def test_alpha_cancels_in_the_sound_modes_and_is_refused_there() -> None:
    imp = [0.3, 2.0, 0.01, 7.0]
    a, b = _step(), _step()
    a.alpha, b.alpha = 0.1, 50.0
    a.set_bounds(imp)
    b.set_bounds(imp)
    assert a.layer_bounds() == pytest.approx(b.layer_bounds(), rel=1e-12)
    assert "cancels" in a.extra_record()["alpha_role"]
    # so the declaration lets only the faithful mode set it
    with pytest.raises(UserInputError) as err:
        DPAdamILG.validate_params({"mode": "public", "alpha": 50.0})
    assert err.value.field == "method_params.alpha" and "faithful" in err.value.allowed
    assert DPAdamILG.validate_params({"mode": "faithful", "alpha": 50.0})["alpha"] == 50.0


def test_each_mode_takes_thresholds_from_its_declared_source() -> None:
    assert {m.name: m.sources[THRESHOLD_STAT] for m in DPAdamILG.modes} == {
        "public": Source.PUBLIC, "lagged": Source.RELEASED, "faithful": Source.PRIVATE}
    assert _THRESHOLDS_FROM == {Source.PUBLIC: _PublicThresholds,
                                Source.RELEASED: _ReleasedThresholds,
                                Source.PRIVATE: _BatchThresholds}
    for mode in ("public", "lagged", "faithful"):
        step = _step(mode=mode)
        assert type(step.thresholds) is _THRESHOLDS_FROM[step.mode.sources[THRESHOLD_STAT]]
        assert step.optimizer.kind == "adam"


def test_public_thresholds_follow_public_gradients_not_the_private_batch() -> None:
    step = _step(mode="public")
    step.begin_step(0)
    public = step.layer_bounds()
    assert public != pytest.approx([1.0 / math.sqrt(NUM_LAYERS)] * NUM_LAYERS)
    # recomputed by hand: one ordinary backward on the same public draw
    twin = _step(mode="public")
    x, y = twin.public_batch(int(twin.params["public_batch_size"]))
    loss = torch.nn.functional.cross_entropy(twin.model(x), y)
    grads = torch.autograd.grad(loss, list(twin.model.parameters()))
    sq = [0.0] * NUM_LAYERS
    for (name, _), g in zip(twin.model.named_parameters(), grads, strict=True):
        sq[twin.layer_of[name]] += float(g.double().pow(2).sum())
    h = [math.sqrt(s / n) for s, n in zip(sq, twin.model.layer_sizes(), strict=True)]
    norm = math.sqrt(sum(v * v for v in h))
    assert public == pytest.approx([v / norm for v in h], rel=1e-5)
    # a private step does not move them: they are set before any private data is read
    step.step(torch.randn(7, 1, 8, 8) * 100, torch.arange(7))
    assert step.layer_bounds() == public


def test_refresh_every_amortises_the_public_pass() -> None:
    step = _step(mode="public", refresh_every=3)
    seen = []
    for t in range(7):
        step.begin_step(t)
        seen.append(step.refreshed_at)
    assert seen == [0, 0, 0, 3, 3, 3, 6]


def test_lagged_thresholds_come_from_the_released_noisy_gradient() -> None:
    step = _step(mode="lagged", clip_norm=2.0)
    assert step.layer_bounds() == pytest.approx([1.0] * NUM_LAYERS)  # uniform 2 / sqrt(4)
    step.begin_step(0)
    assert step.layer_bounds() == pytest.approx([1.0] * NUM_LAYERS)  # no public pass
    rms = [0.5, 3.0, 0.0, 1.0]
    noisy = {n: torch.full_like(p, rms[step.layer_of[n]])
             for n, p in step.model.named_parameters()}
    step.end_step(noisy)
    expected = [max(r / math.sqrt(sum(x * x for x in rms)), MIN_SHARE / 2) for r in rms]
    norm = math.sqrt(sum(x * x for x in expected))
    assert step.layer_bounds() == pytest.approx([2.0 * x / norm for x in expected])


# ---- the faithful mode (the paper's Algorithm 1; epsilon claim invalid) ----------------------
def test_faithful_one_example_moves_the_others() -> None:
    """The paper clips the batch sum, not examples: replacing example 0 changes the
    thresholds applied to everyone, and moves the clipped sum by far more than C."""
    step = _step(mode="faithful", clip_norm=0.7)
    assert step.dp_valid is False
    base = [[1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 0.5, 0.2], [0.3, 0.3, 3.0, 0.3],
            [1.0, 1.0, 1.0, 1.0]]
    a = adversarial_view(step, torch.tensor(base, dtype=torch.float64))
    b = adversarial_view(step, torch.tensor([[1e6, 1e-6, 1e-6, 1e6], *base[1:]],
                                            dtype=torch.float64))
    step.begin_step(0)
    sum_a = step.clip(a)
    s_a, std_a = list(step.faithful_s), step.noise_std()
    step.begin_step(0)
    sum_b = step.clip(b)
    s_b, std_b = list(step.faithful_s), step.noise_std()
    assert s_a != pytest.approx(s_b), "thresholds should depend on example 0"
    assert std_a != pytest.approx(std_b), "noise scale should depend on example 0"
    diff = math.sqrt(sum(float((sum_a[n] - sum_b[n]).pow(2).sum()) for n in sum_a))
    assert diff > 1e3 * 0.7  # no per-example bound: the shift grows with example 0
    assert step.sensitivity() == math.inf and step.layer_bounds() is None


def test_faithful_clip_and_noise_follow_the_paper() -> None:
    step = _step(mode="faithful", alpha=1.2, sigma=2.0)
    view = adversarial_view(step, torch.tensor([[1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 0.5, 0.2]],
                                               dtype=torch.float64))
    step.begin_step(0)
    clipped = step.clip(view)
    sizes = step.model.layer_sizes()
    sq = [0.0] * NUM_LAYERS
    for n, g in view.grads.items():
        sq[step.layer_of[n]] += float(g.sum(dim=0).pow(2).sum())
    s = [1.2 * math.sqrt(q) / math.sqrt(n) for q, n in zip(sq, sizes, strict=True)]
    for n, g in view.grads.items():
        j = step.layer_of[n]
        assert torch.allclose(clipped[n], g.sum(dim=0).clamp(-s[j], s[j]))
    assert step.noise_std() == pytest.approx(
        [sj * math.sqrt(n) * 2.0 for sj, n in zip(s, sizes, strict=True)])
    assert step.whitened_noise_multiplier() == 2.0  # the paper's claim, recorded invalid
    assert step.extra_record()["thresholds"] == pytest.approx(s)


# ---- the schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "floor", "expected"), [
    (0.5, 0.0, [1.0, 1 / 1.5, 0.5, 1 / 2.5]),
    (1.0, 0.4, [1.0, 0.5, 0.4, 0.4]),
    (0.0, 0.2, [1.0, 1.0, 1.0, 1.0]),
])
def test_noise_shape_is_the_epoch_decay(k: float, floor: float, expected: list[float]) -> None:
    shape = DPAdamILG.noise_shape(epochs=4, steps_per_epoch=5,
                                  params={"k": k, "sigma_floor": floor})
    per_epoch = [p.noise_multiplier for p in shape.phases for _ in range(p.steps // 5)]
    assert per_epoch == pytest.approx(expected)
    assert shape.steps == 20
    # one phase per distinct sigma_t: the floor's plateau is one mechanism
    assert len(shape.phases) == len(set(expected))


def test_steps_follow_the_decaying_schedule() -> None:
    """Noise std and the ledger's multiplier follow sigma_t epoch by epoch."""
    shape = DPAdamILG.noise_shape(epochs=3, steps_per_epoch=4, params={"k": K})
    schedule = shape.scaled(2.0)
    step = make_method(DPAdamILG, params=DPAdamILG.validate_params(
        {"mode": "lagged", "k": K, "lr": 0.01}), schedule=schedule)
    seen = []
    for _ in range(12):
        seen.append(step.whitened_noise_multiplier())
        step.step(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    sigmas = [2.0, 2.0 / (1 + K), 2.0 / (1 + 2 * K)]
    assert seen == pytest.approx([s for s in sigmas for _ in range(4)], rel=1e-9)
    assert [(e["noise_multiplier"], e["count"]) for e in step.ledger.events] == [
        (pytest.approx(s, rel=1e-9), 4) for s in sigmas]
    assert step.epoch_metrics()["sigma_t"] == pytest.approx(sigmas[-1])
    assert step.extra_record()["sigma_floor_absolute"] == pytest.approx(
        step.params["sigma_floor"] * 2.0)


def test_paper_presets() -> None:
    assert paper_floor(sigma_0=10.0) == pytest.approx(math.sqrt(2 * math.log(1.25e5)) / 10)
    presets = DPAdamILG.presets()
    assert (presets["paper"]["alpha"], presets["paper"]["k"]) == (1.2, 0.05)
    assert presets["paper_cifar10"]["k"] == 0.001
    assert presets["paper_cifar10"]["sigma_floor"] == pytest.approx(paper_floor(sigma_0=6.0))
    for preset in presets.values():  # alpha is read by the faithful mode only
        DPAdamILG.validate_params({**preset, "mode": "faithful"})
    assert DPAdamILG.optimizer_name == "adam"


@pytest.mark.parametrize(("params", "field"), [
    ({"mode": "private"}, "method_params.mode"),
    ({"mode": "faithful", "alpha": 0.0}, "method_params.alpha"),
    ({"mode": "faithful", "alpha": math.nan}, "method_params.alpha"),
    ({"k": -0.1}, "method_params.k"),
    ({"k": True}, "method_params.k"),
    ({"sigma_floor": 1.5}, "method_params.sigma_floor"),
    ({"public_batch_size": 0}, "method_params.public_batch_size"),
    ({"refresh_every": 1.5}, "method_params.refresh_every"),
    ({"mode": "lagged", "refresh_every": 2}, "method_params.refresh_every"),
    ({"sigma_0": 3.0}, "method_params.sigma_0"),
    ({"momentum": 0.9}, "method_params.momentum"),  # Adam: no SGD momentum declared
])
def test_bad_params(params: dict[str, Any], field: str) -> None:
    with pytest.raises(UserInputError) as exc:
        DPAdamILG.validate_params(params)
    assert exc.value.field == field


def test_checkpoint_state_is_plain_data() -> None:
    step = _step(mode="lagged")
    step.set_bounds([1.0, 2.0, 3.0, 4.0])
    state = step.extra_state()
    fresh = _step(mode="lagged")
    fresh.load_extra_state(state)
    assert fresh.layer_bounds() == step.layer_bounds()
    assert all(isinstance(v, (list, int, type(None))) for v in state.values())


def test_trial_ledger_decays_by_epoch_and_meets_the_budget(tmp_path: Path) -> None:
    """Through plan_trial: the budget matching scales the decay shape to the target."""
    spec = plan_trial(check(tiny_config(epochs=3)), method="dp_adamilg",
                      params={"lr": 0.01, "clip_norm": 1.0, "mode": "public", "k": K})
    result = train_trial(spec, checkpoint_root=tmp_path)
    p = result.privacy_record
    assert p.epsilon_upper <= p.target_epsilon
    events = p.ledger["events"]
    assert [e["count"] for e in events] == [10, 10, 10]
    sigma_0 = events[0]["noise_multiplier"]
    assert [e["noise_multiplier"] / sigma_0 for e in events] == pytest.approx(
        [1.0, 1 / (1 + K), 1 / (1 + 2 * K)], rel=1e-9)
    assert [ph["noise_multiplier"] for ph in p.noise_schedule.to_list()] == pytest.approx(
        [e["noise_multiplier"] for e in events], rel=1e-9)
    assert [m["sigma_t"] for m in result.history] == pytest.approx(
        [e["noise_multiplier"] for e in events])
    record = p.method_record
    assert p.mode == "public" and record["k"] == K
    assert record["sigma_floor_absolute"] == pytest.approx(record["sigma_floor"] * sigma_0)
