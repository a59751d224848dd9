"""The conformance suite must fail on methods that break their bound late in life: one that
stops clipping a layer after warm-up, and one whose noise shrinks after a checkpoint resume.
Both pass a check of their initial state only, which is what the old suite looked at."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from tests.conformance import check_release, lifecycle, lifecycle_params, make_method
from trainables.methods import METHODS, registered
from trainables.methods.dpsgd import DPSGD

WARMUP = 5


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


@pytest.mark.parametrize("broken", [_ClipsUntilWarm, _NoiseLostOnResume])
def test_the_initial_state_alone_looks_fine(broken: type) -> None:
    with registered(broken):
        method = make_method(broken, params=lifecycle_params(broken, "standard"),
                             schedule=DPSGD.noise_shape(epochs=3, steps_per_epoch=10,
                                                        params={}).scaled(1.3))
        assert check_release(method).holds


@pytest.mark.parametrize("broken", [_ClipsUntilWarm, _NoiseLostOnResume])
def test_the_lifecycle_suite_catches_late_breakage(broken: type) -> None:
    with registered(broken):
        checks = lifecycle(broken, "standard")
    failing = [c for c in checks if not c.holds]
    assert failing, "the suite must fail on this method"
    first = failing[0].step
    if broken is _ClipsUntilWarm:
        assert first == WARMUP
    else:
        from tests.conformance import RESUME_AT

        assert first == RESUME_AT
    assert broken.name not in METHODS
