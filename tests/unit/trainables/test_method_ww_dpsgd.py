"""WW-DP-SGD: the spectral-feedback controller (its equations, timing and clamps), noise that
follows C_t, and the trajectories a trial records. The generic checks (the release bound over a
lifecycle that includes probes, accounting, round trip) are in
tests/contract/test_conformance.py."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dpsweep.core.errors import UserInputError
from dpsweep.core.trial import TrialSpec
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.dp.spectral import TailFit
from dpsweep.trainables.methods import ww_dpsgd
from dpsweep.trainables.methods.ww_dpsgd import WWDPSGD
from dpsweep.trainables.training.loop import train_trial
from tests.conftest import tiny_config
from tests.contract.conformance import build_step

SIGMA = 1.3
LR = 0.1  # build_step's learning rate
EXPECTED_BATCH = 50.0  # build_step's expected batch size
#: The trial tests' controller: K = 3 gives three probes in each 10-step epoch of tiny_config.
TRIAL_PARAMS = {"lr": 1.0, "clip_norm": 1.0, "K": 3, "kappa": 0.2, "beta": 0.9}


def _build(*, clip_norm: float = 1.0, **params: Any) -> WWDPSGD:
    """A WW step on digits_cnn (seeded init, reproducible noise) with the given params."""
    step = build_step("ww_dpsgd", clip_norm=clip_norm, sigma=SIGMA, params=params)
    assert isinstance(step, WWDPSGD)
    return step


def _spec(**training: Any) -> TrialSpec:
    return plan_trial(check(tiny_config(reproducible=True, **training)), method="ww_dpsgd",
                      params=dict(TRIAL_PARAMS))


def _script(monkeypatch: pytest.MonkeyPatch, zetas: list[float]) -> Iterator[float]:
    """Make every probe's fit return the next scripted zeta."""
    it = iter(zetas)

    def fake(weight: Any, **_: Any) -> TailFit:
        del weight
        return TailFit(zeta=next(it), lambda_min=1.0, ks_distance=0.0, n_tail=10,
                       method="ks")

    monkeypatch.setattr(ww_dpsgd, "weight_tail_exponent", fake)
    return it


# ---- the controller equations ---------------------------------------------------------------
def test_controller_follows_the_equations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted zetas, kappa = 0.5, beta = 0.5, zeta* = 4, r = 2, clamp [0.5, 2]."""
    k = 5
    step = _build(K=k, kappa=0.5, beta=0.5, zeta_star=4.0, radius=2.0, clamp="absolute",
                  c_min=0.5, c_max=2.0)
    e = math.exp
    # (zeta, zeta^, C after the probe, clamp flag), worked by hand:
    # zeta^ = 0.5 zeta^ + 0.5 zeta (zeta^_1 = zeta_1); phi = sat((zeta^ - 4) / 2);
    # u = log C + 0.5 phi; C = clip(exp(u), 0.5, 2)
    reference = [
        (8.0, 8.0, e(0.5), 0.0),  # phi = sat(2) = 1
        (8.0, 8.0, 2.0, 1.0),  # exp(1) > 2: clamped
        (2.0, 5.0, 2.0, 1.0),  # phi = 0.5: log 2 + 0.25, clamped again
        (1.0, 3.0, 2 * e(-0.25), 0.0),  # phi = -0.5 from u = log 2 (no wind-up)
        (1.0, 2.0, 2 * e(-0.75), 0.0),  # phi = -1
        (1.0, 1.5, 2 * e(-1.25), 0.0),  # phi = sat(-1.25) = -1
        (1.0, 1.25, 0.5, -1.0),  # 2 exp(-1.75) < 0.5: clamped
        (math.nan, 1.25, 0.5, 0.0),  # failed fit: C and zeta^ held
        (9.0, 5.125, 0.5 * e(0.28125), 0.0),  # phi = 1.125 / 2
    ]
    _script(monkeypatch, [z for z, *_ in reference])
    for t in range(1, k * len(reference) + 1):
        step.begin_step(t)
        if t % k:
            continue
        p = t // k - 1
        _, zeta_hat, c, clamp = reference[p]
        assert step.zeta_hat == pytest.approx(zeta_hat, rel=1e-12), p
        assert step.clip_norm == pytest.approx(c, rel=1e-12), p
        assert math.log(step.clip_norm) == pytest.approx(math.log(c), abs=1e-12), p
        assert step.trajectories()["clamp"][-1] == clamp, p
    traj = step.trajectories()
    assert traj["step"] == [k * (p + 1) for p in range(len(reference))]
    assert traj["clip_norm"] == pytest.approx([r[2] for r in reference], rel=1e-12)
    assert traj["zeta_hat"] == pytest.approx([r[1] for r in reference], rel=1e-12)
    assert traj["zeta"][:7] == [r[0] for r in reference][:7]
    assert math.isnan(traj["zeta"][7]) and math.isnan(traj["zeta:fc1"][7])
    record = step.extra_record()
    assert record["clamp_hits"] == {"min": 1, "max": 2}
    assert record["clip_norm_bounds"] == [0.5, 2.0]


def test_paper_initialisation_and_relative_clamp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ema_init="target": zeta^_0 = zeta* (Alg. 1 line 6); relative clamp = factors of C_0."""
    step = _build(clip_norm=0.4, K=2, kappa=1.0, beta=0.9, ema_init="target",
                  c_min=0.5, c_max=2.0)
    assert step.zeta_hat == 4.0
    assert step.epoch_metrics() == {"clip_norm": 0.4, "zeta_hat": 4.0}
    _script(monkeypatch, [14.0, 14.0, 14.0])
    step.begin_step(2)
    assert step.zeta_hat == pytest.approx(0.9 * 4 + 0.1 * 14)  # 5.0: e = 1, phi = 0.5
    assert step.clip_norm == pytest.approx(0.4 * math.exp(0.5))
    step.begin_step(4)  # zeta^ = 5.9, phi = 0.95: 0.4 e^1.45 > 0.8 = 2 C_0
    assert step.clip_norm == pytest.approx(0.8)
    assert step.extra_record()["clip_norm_bounds"] == pytest.approx([0.2, 0.8])


def test_several_probe_layers_take_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _build(K=1, kappa=0.1, probe_layers=["conv1", "conv2", "fc1"])
    _script(monkeypatch, [2.0, 7.0, 3.0, math.nan, 7.0, 3.0])
    step.begin_step(1)
    assert step.zeta_hat == 3.0  # first probe initialises the EMA with median(2, 7, 3)
    step.begin_step(2)
    traj = step.trajectories()
    assert traj["zeta"] == [3.0, 5.0]  # the failed conv1 fit is left out: median(7, 3)
    assert traj["zeta:conv2"] == [7.0, 7.0] and math.isnan(traj["zeta:conv1"][1])

# ---- timing and noise ------------------------------------------------------------------------
def test_clip_norm_moves_only_at_multiples_of_k_and_noise_follows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    k = 4
    step = _build(K=k, kappa=0.3)
    seen: list[tuple[int, float, list[float], float]] = []
    noise = step.noise

    def spy(summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.append((step.step_count, step.clip_norm, step.noise_std(),
                     step.whitened_noise_multiplier()))
        return noise(summed)

    monkeypatch.setattr(step, "noise", spy)
    gen = torch.Generator().manual_seed(3)
    for _ in range(14):
        b = int(torch.randint(0, 12, (1,), generator=gen))
        step.step(torch.randn(b, 1, 8, 8, generator=gen),
                  torch.randint(0, 10, (b,), generator=gen))
    changes = [t for (t, c, *_), (_, prev, *_) in zip(seen[1:], seen, strict=False)
               if c != prev]
    assert changes == [4, 8, 12]  # the weights move, so every probe moves C
    for t, c, stds, multiplier in seen:
        assert stds == [SIGMA * c] * 4, t
        assert multiplier == pytest.approx(SIGMA, rel=1e-12)
        assert step.sensitivity() > 0
    assert step.trajectories()["step"] == [4, 8, 12]
    assert [e["noise_multiplier"] for e in step.ledger.events] == pytest.approx([SIGMA])


def test_released_noise_has_std_sigma_c_t(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty Poisson batch releases pure noise: its draw is sigma * C_t * z."""
    step = _build(K=5, kappa=0.7)
    _script(monkeypatch, [8.0])
    step.step_count = 5  # the next step probes first: C_t = C_0 e^0.7
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    replay = Randomness(kind="reproducible", device=torch.device("cpu"), seed=0)  # build_step's
    step.step(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    c_t = math.exp(0.7)
    assert step.clip_norm == pytest.approx(c_t)
    for n, p in step.model.named_parameters():
        z = replay.normal(p.shape, dtype=p.dtype)
        expected = before[n] - LR * (SIGMA * c_t * z) / EXPECTED_BATCH
        assert torch.allclose(p.detach(), expected, atol=1e-6), n


# ---- parameters ----------------------------------------------------------------------------
def test_defaults_and_probe_layers() -> None:
    assert _build().probe_names == ["fc1"]  # first dense layer
    assert _build(probe_layers="all").probe_names == ["conv1", "conv2", "fc1", "fc2"]
    assert _build(probe_layers="conv2").probe_names == ["conv2"]
    step = _build()
    assert step.c0 == 1.0 and step.period == 50 and step.zeta_hat is None
    assert math.isnan(step.epoch_metrics()["zeta_hat"])


def test_paper_preset_validates() -> None:
    p = WWDPSGD.validate_params(WWDPSGD.presets()["paper"])
    assert (p["clip_norm"], p["zeta_star"], p["radius"], p["beta"], p["K"]) == (
        1.0, 4.0, 2.0, 0.98, 50)
    assert (p["clamp"], p["c_min"], p["c_max"], p["ema_init"]) == (
        "absolute", 1.0, 3.0, "target")
    assert WWDPSGD.validate_params(dict(p)) == p  # idempotent


@pytest.mark.parametrize(("params", "field"), [
    ({"kappa": 0}, "method_params.kappa"),
    ({"kappa": math.inf}, "method_params.kappa"),
    ({"zeta_star": 1.0}, "method_params.zeta_star"),
    ({"radius": -1}, "method_params.radius"),
    ({"beta": 1.0}, "method_params.beta"),
    ({"beta": True}, "method_params.beta"),
    ({"K": 0}, "method_params.K"),
    ({"K": 2.5}, "method_params.K"),
    ({"clamp": "soft"}, "method_params.clamp"),
    ({"c_min": 0}, "method_params.c_min"),
    ({"c_min": 2.0, "c_max": 1.0}, "method_params.c_max"),
    ({"c_min": 1.5, "c_max": 3.0}, "method_params.c_min"),  # relative: must contain C_0
    ({"ema_init": "zero"}, "method_params.ema_init"),
    ({"probe_layers": []}, "method_params.probe_layers"),
    ({"probe_layers": ["fc1", "fc1"]}, "method_params.probe_layers"),
    ({"probe_layers": "fc9"}, "method_params.probe_layers"),  # checked against the model
    ({"probe": "fc1"}, "method_params.probe"),
])
def test_bad_params(params: dict[str, Any], field: str) -> None:
    with pytest.raises(UserInputError) as exc:
        _build(**params)
    assert exc.value.field == field


def test_absolute_clamp_may_start_outside_and_pulls_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As in the paper's C_0 sweep (Table 11): C_0 = 0.25 with clamp [1, 3]."""
    step = _build(clip_norm=0.25, K=1, clamp="absolute", c_min=1.0, c_max=3.0)
    _script(monkeypatch, [4.0])
    step.begin_step(1)
    assert step.clip_norm == 1.0 and step.trajectories()["clamp"] == [-1.0]


def test_checkpointed_controller_state_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _build(K=2, kappa=0.5)
    _script(monkeypatch, [9.0, 7.0])
    step.begin_step(2)
    step.begin_step(4)
    fresh = _build(K=2, kappa=0.5)
    fresh.load_extra_state(step.extra_state())
    assert (fresh.clip_norm, fresh.zeta_hat) == (step.clip_norm, step.zeta_hat)
    assert fresh.trajectories() == step.trajectories()
    other = _build(K=2, kappa=0.5, probe_layers="all")
    with pytest.raises(ValueError, match="probe layers"):
        other.load_extra_state(step.extra_state())


# ---- trials: logging, records, resume (through plan_trial and the training loop) -----------
def test_trial_logs_the_trajectories(tmp_path: Path) -> None:
    result = train_trial(_spec(), checkpoint_root=tmp_path)
    traj = result.privacy_record.trajectories
    assert traj["step"] == [3, 6, 9, 12, 15, 18]
    assert set(traj) == {"step", "clip_norm", "zeta_hat", "zeta", "clamp", "zeta:fc1"}
    assert all(len(v) == 6 for v in traj.values())
    assert all(math.isfinite(z) and z > 1 for z in traj["zeta"])
    # epoch metrics carry C_t and zeta^ as they stood at the end of the epoch (after step 9
    # and 19, i.e. after the probes at 9 and 18)
    assert [m["clip_norm"] for m in result.history] == [traj["clip_norm"][2],
                                                        traj["clip_norm"][5]]
    assert [m["zeta_hat"] for m in result.history] == [traj["zeta_hat"][2],
                                                       traj["zeta_hat"][5]]
    assert result.privacy_record.clip_norm == 1.0  # C_0
    record = result.privacy_record.method_record
    assert record["probe_layers"] == ["fc1"] and record["probes"] == 6
    assert json.loads((tmp_path / "privacy.json").read_text())["trajectories"] == traj


def test_resume_continues_the_same_trajectory(tmp_path: Path) -> None:
    spec = _spec(epochs=3)
    straight = train_trial(spec, checkpoint_root=tmp_path / "a")
    resumed = train_trial(spec, checkpoint_root=tmp_path / "b",
                          resume_from=tmp_path / "a" / "epoch_001")
    assert resumed.privacy_record.trajectories == straight.privacy_record.trajectories
    assert resumed.history == [{**m, "epoch_seconds": n["epoch_seconds"]}
                               for m, n in zip(straight.history, resumed.history, strict=True)]


def test_spec_round_trip_keeps_params() -> None:
    """Validated params are plain data: a trial spec carrying them survives JSON."""
    spec = _spec()
    params = json.loads(json.dumps(dataclasses.asdict(spec)))["method_params"]
    assert params == spec.method_params
    assert params["probe_layers"] == "first_dense" and params["K"] == 3
