"""What every accountant shares: the calibration window and the input checks.

A matched budget's type (``core.trial.Calibration``, ``EpsilonBounds``) lives in core, since
trials read it too; the checks live here, in one place: every public entry point checks its
input before any computation, so a bad value costs nothing and is refused naming its config field.
"""

from __future__ import annotations

from typing import Any

from dpsweep.core.checks import number
from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Phase, Schedule
from dpsweep.orchestrator.config.checks import MAX_EPSILON

WINDOW = 0.99
"""Calibrated upper epsilon lies in [WINDOW * target, target]: within 1% of the budget."""


# ---- input checks -------------------------------------------------------------------------
# ``field`` defaults to the config key; a caller that took the value from elsewhere (a CLI flag)
# passes the name the user typed.


def check_epsilon(value: Any, *, field: str = "privacy.epsilon") -> float:
    return number(value, field=field, low=0.0, low_open=True, high=MAX_EPSILON,
                  allowed=f"a number in (0, {MAX_EPSILON:g}]")


def check_delta(value: Any, *, field: str = "privacy.delta") -> float:
    return number(value, field=field, low=0.0, high=1.0, low_open=True, high_open=True,
                  allowed="a number in (0, 1)")


#: Smallest sample rate a calibration accepts: below it the noise that meets any target is so
#: small that the PRV grid's losses overflow float64 and dp_accounting's RDP drops its orders
#: (the fallback then cannot reach the target either). The loader's rate 1/ceil(N/B) stays
#: above it for a billion batches per epoch.
MIN_SAMPLE_RATE = 1e-9


def check_sample_rate(value: Any, *, field: str = "sample_rate", low: float = 0.0) -> float:
    """A rate in (0, 1], or in [low, 1] when a caller names the calibration's range."""
    if low > 0.0:
        return number(value, field=field, low=low, high=1.0,
                      allowed=f"a number in [{low:g}, 1] (the accountant's range)")
    return number(value, field=field, low=0.0, high=1.0, low_open=True,
                  allowed="a number in (0, 1]")


def check_positive(value: Any, *, field: str) -> float:
    return number(value, field=field, low=0.0, low_open=True)


def as_schedule(value: Any, *, field: str = "schedule") -> Schedule:
    """A Schedule, or a sequence of Phase made into one (core.schedule validates the phases)."""
    if isinstance(value, Schedule):
        return value
    allowed = "a Schedule or a non-empty sequence of Phase"
    if value is None or isinstance(value, (str, bytes)):
        raise UserInputError(field=field, value=value, allowed=allowed)
    try:
        phases = tuple(value)
    except TypeError:
        raise UserInputError(field=field, value=value, allowed=allowed) from None
    for i, p in enumerate(phases):
        if not isinstance(p, Phase):
            raise UserInputError(field=f"{field}[{i}]", value=p, allowed="a Phase")
    return Schedule(phases)


def check_timeout(value: Any, *, field: str = "timeout_s") -> float:
    """Seconds > 0; inf means no bound."""
    return number(value, field=field, low=0.0, low_open=True, allow_inf=True,
                  allowed="a number > 0 (seconds; inf for no bound)")
