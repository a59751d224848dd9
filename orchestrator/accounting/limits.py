"""The accountants' input checks, in one place.

Every public entry point checks its input here before any computation: a bad value costs nothing
and is refused naming its config field.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from core.errors import UserInputError
from core.params import is_real
from core.schedule import Phase, Schedule
from orchestrator.config import MAX_EPSILON


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
