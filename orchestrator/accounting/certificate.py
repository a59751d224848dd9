"""What a matched budget promises: the schedule to train with and the accountant's bounds for it.

Trials receive these as dicts and the cache stores them, so their form is versioned here, apart
from the accountants that compute them.

The accountants' input checks live here too, in one place: every public entry point checks its
input before any computation, so a bad value costs nothing and is refused naming its config field.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.errors import UserInputError
from core.params import is_real
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
def _real(value: Any, *, field: str, allowed: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float when it is a finite real number (not a bool) satisfying ``ok``."""
    if not (is_real(value) and ok(float(value))):
        raise UserInputError(field=field, value=value, allowed=allowed)
    return float(value)


def check_epsilon(value: Any) -> float:
    return _real(value, field="privacy.epsilon", allowed=f"a number in (0, {MAX_EPSILON:g}]",
                 ok=lambda x: 0 < x <= MAX_EPSILON)


def check_delta(value: Any) -> float:
    return _real(value, field="privacy.delta", allowed="a number in (0, 1)",
                 ok=lambda x: 0 < x < 1)


def check_sample_rate(value: Any) -> float:
    return _real(value, field="sample_rate", allowed="a number in (0, 1]",
                 ok=lambda x: 0 < x <= 1)


def check_eps_error(value: Any, *, field: str = "eps_error") -> float:
    return _real(value, field=field, allowed="a finite number > 0", ok=lambda x: x > 0)


def check_whole(value: Any, *, field: str, low: int, allowed: str) -> int:
    """``value`` as an int (anything with __index__, not a bool) that is >= low."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < low:
        raise UserInputError(field=field, value=value, allowed=allowed)
    return n


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


def check_timeout(value: Any) -> float:
    """Seconds > 0; inf means no bound."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not (number and value > 0):  # NaN fails the comparison
        raise UserInputError(field="timeout_s", value=value,
                             allowed="a number > 0 (seconds; inf for no bound)")
    return float(value)


# Private tuning's checks take anything float() converts (a numpy scalar, a Decimal, a numeric
# string), as they always have; budget matching's above take int and float only.


def loose_finite(value: Any, *, field: str, allowed: str) -> float:
    if isinstance(value, bool):
        raise UserInputError(field=field, value=value, allowed=allowed)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UserInputError(field=field, value=value, allowed=allowed) from None
    if not math.isfinite(x):
        raise UserInputError(field=field, value=value, allowed=allowed)
    return x


def loose_positive(value: Any, *, field: str) -> float:
    allowed = "a finite number > 0"
    x = loose_finite(value, field=field, allowed=allowed)
    if x <= 0:
        raise UserInputError(field=field, value=value, allowed=allowed)
    return x


def loose_delta(value: Any) -> float:
    allowed = "a number in (0, 1)"
    x = loose_finite(value, field="privacy.delta", allowed=allowed)
    if not 0 < x < 1:
        raise UserInputError(field="privacy.delta", value=value, allowed=allowed)
    return x


def loose_sample_rate(value: Any) -> float:
    allowed = "a number in (0, 1]"
    x = loose_finite(value, field="sample_rate", allowed=allowed)
    if not 0 < x <= 1:
        raise UserInputError(field="sample_rate", value=value, allowed=allowed)
    return x
