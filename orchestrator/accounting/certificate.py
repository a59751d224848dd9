"""What a matched budget promises: the schedule to train with and the accountant's bounds for it.

Trials receive these as dicts and the cache stores them, so their form is versioned here, apart
from the accountants that compute them.

The accountants' input checks live here too, in one place: every public entry point checks its
input before any computation, so a bad value costs nothing and is refused naming its config field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.checks import number
from core.errors import UserInputError
from core.schedule import Phase, Schedule
from orchestrator.config import MAX_EPSILON

SCHEMA_VERSION = 2
"""Bump when the cache's meaning changes, so stale answers are never served."""

WINDOW = 0.99
"""Calibrated upper epsilon lies in [WINDOW * target, target]: within 1% of the budget."""


@dataclass(frozen=True)
class EpsilonBounds:
    """Epsilon of a schedule; RDP gives only an upper bound, so lower/estimate are None there."""

    lower: float | None
    estimate: float | None
    upper: float
    accountant: str

    def to_dict(self) -> dict[str, Any]:
        return {"lower": self.lower, "estimate": self.estimate, "upper": self.upper,
                "accountant": self.accountant}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpsilonBounds:
        def opt(v: Any) -> float | None:
            return None if v is None else float(v)

        accountant = str(d["accountant"])
        if accountant not in ("prv", "rdp"):
            raise ValueError(f"unknown accountant {accountant!r}")
        return cls(lower=opt(d["lower"]), estimate=opt(d["estimate"]), upper=float(d["upper"]),
                   accountant=accountant)


@dataclass(frozen=True)
class Calibration:
    """A matched budget: the schedule to train with and the accountant's certificate for it."""

    target_epsilon: float
    delta: float
    sample_rate: float
    schedule: Schedule
    scale: float
    bounds: EpsilonBounds
    accountant: str
    fallback_reason: str | None
    eps_error: float
    seconds: float
    cached: bool

    @property
    def noise_multiplier(self) -> float:
        """The first phase's multiplier: sigma for a constant schedule, sigma_0 for a decay."""
        return self.schedule.first

    @property
    def steps(self) -> int:
        return self.schedule.steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; trials receive this, and the cache stores it."""
        return {
            "schema": SCHEMA_VERSION,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "schedule": self.schedule.to_list(),
            "scale": self.scale,
            "bounds": self.bounds.to_dict(),
            "accountant": self.accountant,
            "fallback_reason": self.fallback_reason,
            "eps_error": self.eps_error,
            "seconds": self.seconds,
            "cached": self.cached,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of to_dict; a malformed dict raises UserInputError(field="calibration")."""
        try:
            schedule = Schedule.from_list(d["schedule"])
            accountant = str(d["accountant"])
            if accountant not in ("prv", "rdp"):
                raise ValueError("accountant must be 'prv' or 'rdp'")
            reason = d["fallback_reason"]
            return cls(
                target_epsilon=float(d["target_epsilon"]),
                delta=float(d["delta"]),
                sample_rate=float(d["sample_rate"]),
                schedule=schedule,
                scale=float(d["scale"]),
                bounds=EpsilonBounds.from_dict(d["bounds"]),
                accountant=accountant,
                fallback_reason=None if reason is None else str(reason),
                eps_error=float(d["eps_error"]),
                seconds=float(d["seconds"]),
                cached=bool(d.get("cached", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError, UserInputError) as exc:
            raise UserInputError(field="calibration", value=f"{type(exc).__name__}: {exc}",
                                 allowed="a dict produced by Calibration.to_dict()") from exc


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
