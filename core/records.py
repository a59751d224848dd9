"""The privacy record of one trial (``trials/<id>/privacy.json``) as one typed, validated type.

Training writes it; export, pick, release and the results table read it. Keeping the schema in
one frozen dataclass means a field is named, typed and range-checked once, and a bad file fails
with one line naming the field instead of a ``KeyError`` deep in a reader. The JSON on disk is
exactly :meth:`PrivacyRecord.to_dict` (same keys and values as before this type existed), so
existing run directories keep loading.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dpsweep.core.checks import number, number_range, whole
from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Schedule
from dpsweep.core.storage import atomic_write_json

#: The only mechanism dpsweep trains with (what the accountant certifies).
MECHANISM = "poisson_subsampled_gaussian"
#: Where noise and sampling come from (``trainables.dp.randomness.Randomness`` uses these).
RANDOMNESS_KINDS = ("secret", "reproducible", "secure")
#: Accountants a calibration may come from.
ACCOUNTANTS = ("prv", "rdp")
#: What computed an epsilon of each ``accountant`` kind; a privacy record names it in
#: ``versions["accountant"]`` (with ``dp_accounting``'s version for RDP). dpsweep's PRV grid is
#: prv-accountant's algorithm, not the package: the tests hold the two to 1e-8 in epsilon.
ACCOUNTANT_IMPLEMENTATIONS = {
    "prv": "dpsweep PrvGrid (orchestrator/accounting/prv.py): prv-accountant 0.2.0's algorithm "
           "in float64, tested against prv-accountant 0.2.0",
    "rdp": "dp_accounting's RDP accountant (the fallback)"}


def _is_number(value: Any) -> bool:
    """A plain JSON number: the record keeps values as given, so numpy scalars stay out."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _passes(check: Callable[[], Any]) -> bool:
    try:
        check()
    except UserInputError:
        return False
    return True


def _number(*, low: float, low_open: bool = True, high: float = math.inf,
            optional: bool = False) -> tuple[Callable[[Any], bool], str]:
    """core.checks.number in (low, high] or [low, high] as a rule; None allowed when
    ``optional``."""
    bounds = {"low": low, "low_open": low_open, "high": high}

    def ok(value: Any) -> bool:
        if value is None:
            return optional
        return _is_number(value) and _passes(lambda: number(value, field="", **bounds))
    return ok, number_range(**bounds) + (" or null" if optional else "")


def _whole(*, low: int) -> tuple[Callable[[Any], bool], str]:
    """core.checks.whole (>= low) as a rule, for a plain JSON integer."""
    return ((lambda v: isinstance(v, int) and _passes(lambda: whole(v, field="", low=low))),
            f"an integer >= {low}")


def _one_of(options: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v in options), f"one of {options}"


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


_TEXT = (lambda v: isinstance(v, str)), "a string"
_FLAG = (lambda v: isinstance(v, bool)), "true or false"
_OBJECT = _str_map, "a JSON object"
#: field -> (check, what is allowed): the record's schema, in the order of the file's keys.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "mechanism": _one_of((MECHANISM,)),
    "method": _TEXT,
    "mode": _TEXT,
    "dp_valid": _FLAG,
    "validity_reason": _TEXT,
    "randomness": _one_of(RANDOMNESS_KINDS),
    "release_safe": _FLAG,
    "sample_rate": _number(low=0.0, high=1.0),
    "steps": _whole(low=1),
    "noise_multiplier": _number(low=0.0),
    "noise_schedule": ((lambda v: isinstance(v, Schedule)),
                       "a list of {noise_multiplier, steps}"),
    "clip_norm": _number(low=0.0),
    "delta": _number(low=0.0, high=1.0),
    "target_epsilon": _number(low=0.0),
    # Any finite value: a PRV lower bound of a tiny epsilon may dip below 0 by its error;
    # whoever states a bound (export) decides which values it accepts.
    "epsilon_lower": _number(low=-math.inf, optional=True),
    "epsilon_estimate": _number(low=-math.inf, optional=True),
    "epsilon_upper": _number(low=0.0),
    "accountant": _one_of(ACCOUNTANTS),
    "accountant_fallback": ((lambda v: v is None or isinstance(v, str)), "a string or null"),
    "eps_error": _number(low=0.0, low_open=False, optional=True),
    "ledger": ((lambda v: _str_map(v) and _is_number(v.get("sample_rate"))
                and isinstance(v.get("events"), list)
                and all(isinstance(e, dict) for e in v["events"])),
               "a ledger {sample_rate, events: [...]}"),
    "guard_capped": _whole(low=0),
    "method_record": _OBJECT,
    "trajectories": ((lambda v: _str_map(v) and all(isinstance(s, list) for s in v.values())),
                     "a JSON object of lists"),
    "versions": ((lambda v: _str_map(v) and all(isinstance(s, str) for s in v.values())),
                 "a JSON object of strings"),
}


@dataclass(frozen=True)
class PrivacyRecord:
    """What a trial's epsilon claim rests on: mechanism, calibration, ledger and validity.

    Numbers keep the value they were given (an int stays an int) so the file round-trips
    byte for byte; every field is checked on construction, so an instance is always valid.
    """

    mechanism: str
    method: str
    mode: str
    dp_valid: bool
    validity_reason: str
    randomness: str
    release_safe: bool
    sample_rate: float
    steps: int
    noise_multiplier: float
    noise_schedule: Schedule
    clip_norm: float
    delta: float
    target_epsilon: float
    epsilon_lower: float | None
    epsilon_estimate: float | None
    epsilon_upper: float
    accountant: str
    accountant_fallback: str | None
    eps_error: float | None
    ledger: dict[str, Any]
    guard_capped: int
    method_record: dict[str, Any]
    trajectories: dict[str, list[Any]]
    versions: dict[str, str]

    def __post_init__(self) -> None:
        for f in fields(self):
            ok, allowed = _RULES[f.name]
            value = getattr(self, f.name)
            if not ok(value):
                shown = value if not isinstance(value, (dict, list)) else repr(value)[:200]
                raise UserInputError(field=f"privacy.{f.name}", value=shown, allowed=allowed)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``privacy.json`` (a deep copy: the record stays unchanged)."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        out["noise_schedule"] = self.noise_schedule.to_list()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> PrivacyRecord:
        """The record of a decoded ``privacy.json``; a missing, unknown or bad field is one
        UserInputError naming it (prefixed by ``where``, e.g. the file)."""
        prefix = f"{where}: " if where else ""
        if not isinstance(data, Mapping):
            raise UserInputError(field=f"{prefix}privacy", value=type(data).__name__,
                                 allowed="a JSON object (a dpsweep privacy record)")
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in data]
        unknown = sorted(str(k) for k in data if k not in _RULES)
        if missing or unknown:
            key = (missing or unknown)[0]
            raise UserInputError(field=f"{prefix}privacy.{key}",
                                 value=None if missing else data[key],
                                 allowed="present (a dpsweep record)" if missing
                                 else "no such field (a dpsweep privacy record)")
        values = {k: copy.deepcopy(data[k]) for k in names}
        try:
            schedule = data["noise_schedule"]
            if not isinstance(schedule, list):
                raise UserInputError(field="schedule", value=schedule, allowed="a list")
            values["noise_schedule"] = Schedule.from_list(schedule)
            return cls(**values)
        except UserInputError as exc:
            name = exc.field if exc.field.startswith("privacy.") else "privacy.noise_schedule"
            raise UserInputError(field=f"{prefix}{name}", value=exc.value,
                                 allowed=exc.allowed) from None

    @classmethod
    def load(cls, path: str | Path) -> PrivacyRecord:
        """Read and validate ``privacy.json``; any problem is one line naming the file and
        the field."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserInputError(field="privacy record", value=str(path),
                                 allowed=f"a readable JSON file ({type(exc).__name__})"
                                 ) from None
        return cls.from_dict(data, where=str(path))

    def save(self, path: str | Path) -> Path:
        """Write atomically, in the same form as every dpsweep JSON record."""
        return atomic_write_json(path, self.to_dict())
