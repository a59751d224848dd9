"""The number checks every layer shares, so one rule says what counts as a number.

Input is checked once where it enters (config, CLI flags, files, public accounting entry points)
and the checked value is what inner code trusts. A number is a real (int, float, numpy scalar),
never a bool (``True`` is 1 to Python, never what a user meant) and never a string: the callers
parse text themselves, so a quoted ``"0.5"`` in a config is a type error, not a silent cast.
A refusal is ``UserInputError`` naming the caller's field, with the allowed range spelled from
the bounds unless the caller words it.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from dpsweep.core.errors import UserInputError


def number_range(*, low: float = -math.inf, high: float = math.inf, low_open: bool = False,
                 high_open: bool = False) -> str:
    """What ``number`` with these bounds accepts, in the words every refusal uses."""
    lo, hi = math.isfinite(low), math.isfinite(high)
    if lo and hi:
        return (f"a finite number in {'(' if low_open else '['}{low:g}, "
                f"{high:g}{')' if high_open else ']'}")
    if lo:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if hi:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return "a finite number"


def number(value: Any, *, field: str, low: float = -math.inf, high: float = math.inf,
           low_open: bool = False, high_open: bool = False, allow_inf: bool = False,
           allowed: str | None = None) -> float:
    """``value`` as a float when it is a real number within the bounds, else UserInputError.

    NaN is always refused; +-inf only with ``allow_inf`` (and then still against the bounds),
    for the few fields where infinity means "no limit".
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    x = float(value) if ok else math.nan
    ok = ok and not math.isnan(x) and (allow_inf or math.isfinite(x))
    ok = ok and (x > low if low_open else x >= low) and (x < high if high_open else x <= high)
    if not ok:
        raise UserInputError(field=field, value=value, allowed=allowed or number_range(
            low=low, high=high, low_open=low_open, high_open=high_open))
    return x


def whole(value: Any, *, field: str, low: int, high: int | None = None,
          allowed: str | None = None) -> int:
    """``value`` as an int (anything with ``__index__``, not a bool) in [low, high]."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise UserInputError(field=field, value=value, allowed=allowed or text)
    return n

