"""The conformance suite must fail on methods that break their bound, however slightly and
however late in life: one that stops clipping a layer after warm-up (its own rule overreaches,
even though the final guard caps the release), one whose noise shrinks after a checkpoint
resume, one whose noise phase adds 1% less than it declares, and one that releases 1e-4 more
than its bound by rescaling the clipped sum past the guard. Each passes a check of its initial
state only or of its declarations only, which is what a weaker suite would look at."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from dpsweep.trainables.engine.grad_engine import PerExampleView
from dpsweep.trainables.methods import METHODS, registered
from dpsweep.trainables.methods.dpsgd import DPSGD
from tests.contract.conformance import (
    NOISE_STEPS,
    RESUME_AT,
    check_noise,
    check_release,
    lifecycle,
    lifecycle_params,
    make_method,
)

WARMUP = 5
#: How far the deliberately broken methods miss: a 1% noise shortfall, a 1e-4 overreach.
NOISE_SHORTFALL = 0.99
OVERREACH = 1 + 1e-4


class _ClipsUntilWarm(DPSGD):
    """Test-only: leaves layer 0 unclipped once warm-up is over."""

    name: ClassVar[str] = "test_unclipped_after_warmup"

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        coef = super().clip_coefficients(norms).clone()
        if self.step_count >= WARMUP:
            coef[:, 0] = 1.0
        return coef


class _NoiseLostOnResume(DPSGD):
    """Test-only: after a resume its noise is a tenth of what the accountant was told."""

    name: ClassVar[str] = "test_quiet_after_resume"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.noise_factor = 1.0

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.noise_factor = 0.1

    def noise_std(self) -> list[float]:
        return [s * self.noise_factor for s in super().noise_std()]


class _NoiseOnePercentShort(DPSGD):
    """Test-only: declares the right std but its noise phase draws 1% less."""

    name: ClassVar[str] = "test_noise_one_percent_short"

    def noise(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stds = self.noise_std()
        return {n: s + NOISE_SHORTFALL * stds[self.layer_of[n]]
                * self.randomness.normal(s.shape, dtype=s.dtype) for n, s in summed.items()}


class _OverreachesPastTheGuard(DPSGD):
    """Test-only: clips through the guard, then scales the clipped sum by 1 + 1e-4."""

    name: ClassVar[str] = "test_overreach_1e-4"

    def clip(self, view: PerExampleView) -> dict[str, torch.Tensor]:
        return {n: OVERREACH * s for n, s in super().clip(view).items()}


def _first_failure(broken: type, dtype: torch.dtype = torch.float32) -> tuple[int, Any]:
    with registered(broken):
        run = lifecycle(broken, "standard", dtype=dtype)
    failing = [(c.step, c) for c in run.releases if not c.holds]
    failing += [(c.step, c) for c in run.noises if not c.holds]
    assert failing, f"the suite must fail on {broken.name}"
    return min(failing, key=lambda f: f[0])


@pytest.mark.parametrize("broken", [_ClipsUntilWarm, _NoiseLostOnResume])
def test_the_initial_state_alone_looks_fine(broken: type) -> None:
    with registered(broken):
        method = make_method(broken, params=lifecycle_params(broken, "standard"),
                             schedule=DPSGD.noise_shape(epochs=3, steps_per_epoch=10,
                                                        params={}).scaled(1.3))
        assert check_release(method).holds
        assert check_noise(method).holds


@pytest.mark.parametrize(("broken", "first"), [(_ClipsUntilWarm, WARMUP),
                                               (_NoiseLostOnResume, RESUME_AT)])
def test_the_lifecycle_suite_catches_late_breakage(broken: type, first: int) -> None:
    step, check = _first_failure(broken)
    assert step == first, check
    assert broken.name not in METHODS


def test_a_one_percent_noise_shortfall_is_caught_by_the_noise_measurement() -> None:
    step, check = _first_failure(_NoiseOnePercentShort)
    assert step == NOISE_STEPS[0]
    ratios = [m / s for m, s in zip(check.measured, check.declared, strict=True)]
    assert all(abs(r - NOISE_SHORTFALL) < 0.003 for r in ratios), ratios
    with registered(_NoiseOnePercentShort):  # the declaration alone is fine
        method = make_method(_NoiseOnePercentShort,
                             params=lifecycle_params(_NoiseOnePercentShort, "standard"),
                             schedule=DPSGD.noise_shape(epochs=3, steps_per_epoch=10,
                                                        params={}).scaled(1.3))
        assert check_release(method).holds


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_1e_4_overreach_past_the_guard_is_caught(dtype: torch.dtype) -> None:
    step, check = _first_failure(_OverreachesPastTheGuard, dtype)
    assert step == 0
    assert check.excess > 1 + 0.9e-4, check
    assert check.rule_excess <= 1, check  # its coefficients were fine: the release was not


def test_float32_norms_squared_without_scaling_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine before this suite: float32 squares summed unscaled, so a block of tiny entries
    had its norm under-computed and lm_dpsgd (which divides by it) released above its bound.
    With that engine restored by hand, the float32 lifecycle fails on the underflow pattern."""
    import dpsweep.trainables.dp.step
    import dpsweep.trainables.engine.grad_engine
    import dpsweep.trainables.engine.modules
    import dpsweep.trainables.engine.norms
    import dpsweep.trainables.engine.passes
    def unscaled(g: torch.Tensor) -> torch.Tensor:
        return g.reshape(g.shape[0], -1).pow(2).sum(1).double()

    monkeypatch.setattr(dpsweep.trainables.engine.norms, "scaled_sq_norms", unscaled)
    monkeypatch.setattr(dpsweep.trainables.engine.grad_engine, "scaled_sq_norms", unscaled)
    monkeypatch.setattr(dpsweep.trainables.engine.passes, "scaled_sq_norms", unscaled)
    monkeypatch.setattr(dpsweep.trainables.engine.modules, "scaled_sq_norms", unscaled)
    monkeypatch.setattr(dpsweep.trainables.dp.step, "scaled_sq_norms", unscaled)
    run = lifecycle(METHODS["lm_dpsgd"], "lagged", steps=4, resume_at=2)
    failing = [c for c in run.releases if not c.holds]
    assert failing and all(c.pattern == "squares_underflow" for c in failing)
    assert max(c.excess for c in failing) > 1 + 1e-4
