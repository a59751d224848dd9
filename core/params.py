"""Declared parameters: a value's type, bounds, default and meaning, written once, next to it.

Like scikit-learn's ``_param_validation``, a parameter is declared in one place and everything
else derives from the declaration: validation (one validator, one message format), defaults,
presets, the search space's encoding, ``dpsweep config`` and the README tables. Config sections
and every DP method's hyperparameters use the same :class:`Param`.

A bad value raises one :class:`~core.errors.UserInputError` whose text is always
``<prefix>.<name> = <value> is not allowed: expected <allowed>``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from dpsweep.core.errors import UserInputError

#: What a parameter is for: ``hyper`` is a hyperparameter a sweep may search; ``setting`` is a
#: fixed knob (e.g. a refresh period); ``prepared`` is filled by a method's once-per-sweep
#: preparation from public data (never searched, never shown as a hyperparameter).
ROLES = ("hyper", "setting", "prepared")
KINDS = ("float", "int", "str", "bool", "list", "table", "any")

_KIND_TEXT = {"float": "a number", "int": "an integer", "str": "a string", "bool": "true or false",
              "list": "a list", "table": "a table", "any": "a value"}


def _kind_of(default: Any) -> str:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "str"
    if isinstance(default, (list, tuple)):
        return "list"
    if isinstance(default, dict):
        return "table"
    return "any"


def is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float range
        return False


@dataclass(frozen=True)
class Param:
    """One declared parameter.

    ``rule`` normalises a value the generic checks cannot express (e.g. "a layer name or a list
    of them") and raises ``ValueError`` when it is not allowed; ``allowed_text`` then says what
    is. ``modes`` lists the modes that read the parameter (empty: all), so a value given for a
    mode that ignores it is refused instead of silently doing nothing.
    """

    name: str
    default: Any
    doc: str
    kind: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] = ()
    log: bool = False
    nullable: bool = False
    modes: tuple[str, ...] = ()
    presets: Mapping[str, Any] = field(default_factory=dict)
    role: str = "hyper"
    rule: Callable[[Any], Any] | None = None
    allowed_text: str = ""

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", _kind_of(self.default))
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} not in {KINDS}")
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: role {self.role!r} not in {ROLES}")
        object.__setattr__(self, "presets", dict(self.presets))

    def replace(self, **changes: Any) -> Param:
        """The same declaration with some fields changed (a method's own default or preset)."""
        return dataclasses.replace(self, **changes)

    # ---- validation ------------------------------------------------------------------------
    def allowed(self) -> str:
        """What is allowed, in words (the tail of every error message about this parameter)."""
        if self.allowed_text:
            text = self.allowed_text
        elif self.choices:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = _KIND_TEXT[self.kind]
            if self.kind in ("float", "int"):
                text = ("a finite number" if self.kind == "float" else text) + self._range_text()
        return f"{text} or none" if self.nullable and not self.allowed_text else text

    def _range_text(self) -> str:
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            left = "(" if self.low_open else "["
            right = ")" if self.high_open else "]"
            return f" in {left}{lo:g}, {hi:g}{right}"
        if lo is not None:
            return f" {'>' if self.low_open else '>='} {lo:g}"
        if hi is not None:
            return f" {'<' if self.high_open else '<='} {hi:g}"
        return ""

    def check(self, value: Any, *, prefix: str) -> Any:
        """The value, normalised (ints widen to floats, tuples to lists), or one UserInputError."""
        name = f"{prefix}.{self.name}" if prefix else self.name
        if value is None and self.nullable:
            return None
        try:
            out = self._normalise(value)
        except ValueError:
            raise UserInputError(field=name, value=value, allowed=self.allowed()) from None
        return out

    def _normalise(self, value: Any) -> Any:
        if self.rule is not None:
            return self.rule(value)
        kind = self.kind
        if kind == "float":
            if not is_real(value):
                raise ValueError
            value = float(value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError
        elif kind == "str":
            if not isinstance(value, str):
                raise ValueError
        elif kind == "list":
            if not isinstance(value, (list, tuple)):
                raise ValueError
            value = list(value)
        elif kind == "table" and not isinstance(value, dict):
            raise ValueError
        if self.choices and value not in self.choices:
            raise ValueError
        if kind in ("float", "int"):
            if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
                raise ValueError
            if self.high is not None and (value > self.high
                                          or (self.high_open and value == self.high)):
                raise ValueError
        return value

    # ---- documentation ---------------------------------------------------------------------
    def row(self) -> dict[str, str]:
        """One row of the documentation table (``dpsweep config --method``, README)."""
        return {"name": self.name, "default": _show(self.default), "allowed": self.allowed(),
                "log": "log" if self.log else "", "modes": ", ".join(self.modes) or "all",
                "presets": "; ".join(f"{k}: {_show(v)}" for k, v in self.presets.items()),
                "role": self.role, "doc": self.doc}


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return repr(value)
    return "none" if value is None else str(value)


@dataclass(frozen=True)
class Constraint:
    """A rule over several parameters (e.g. ``c_min < c_max``), reported on ``field``."""

    field: str
    ok: Callable[[Mapping[str, Any]], bool]
    allowed: str


class ValidatedParams(dict):
    """Values already checked against one owner's declaration (a method's ``ParamSet``).

    Read-only, so a layer handed one trusts it instead of checking again: validation happens
    once where values enter (the config, the searcher's draw, a spec read from disk or the
    wire) and nowhere after. A ``dict`` otherwise (JSON, TOML and ``dataclasses.asdict`` see
    plain data); a copy built by ``asdict`` has no owner, so it is checked again if used.
    """

    def __init__(self, values: Any = (), *, owner: str = "") -> None:
        super().__init__(values)
        self.owner = owner

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("validated parameters are read-only: validate a changed copy instead")

    __setitem__ = __delitem__ = _read_only  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _read_only  # type: ignore[assignment]
    __ior__ = _read_only  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_validated, (dict(self), self.owner))

    def __repr__(self) -> str:
        return f"ValidatedParams({dict(self)!r}, owner={self.owner!r})"


def _validated(values: dict[str, Any], owner: str) -> ValidatedParams:
    return ValidatedParams(values, owner=owner)


@dataclass(frozen=True)
class ParamSet:
    """An ordered set of declarations with one validator for all of them."""

    params: tuple[Param, ...]
    constraints: tuple[Constraint, ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in {names}")

    @classmethod
    def of(cls, *params: Param, constraints: Iterable[Constraint] = ()) -> ParamSet:
        return cls(tuple(params), tuple(constraints))

    def __iter__(self) -> Iterator[Param]:
        return iter(self.params)

    def __contains__(self, name: object) -> bool:
        return any(p.name == name for p in self.params)

    def __getitem__(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def preset_names(self) -> list[str]:
        seen: list[str] = []
        for p in self.params:
            seen += [k for k in p.presets if k not in seen]
        return seen

    def preset(self, name: str) -> dict[str, Any]:
        """The values a named preset sets (parameters it leaves out keep their defaults)."""
        return {p.name: p.presets[name] for p in self.params if name in p.presets}

    def validate(self, values: Mapping[str, Any], *, prefix: str,
                 mode_param: str | None = None) -> dict[str, Any]:
        """Defaults filled in, every value checked, unknown keys and mode-less values refused.

        With ``mode_param``, a non-default value for a parameter whose declaration lists modes
        that do not include the chosen mode is an error: it would have no effect. (Defaults pass,
        so a validated dictionary validates again.)
        """
        known = {p.name: p for p in self.params}
        for key in values:
            if key not in known:
                raise UserInputError(field=f"{prefix}.{key}" if prefix else key,
                                     value=values[key],
                                     allowed=f"a declared key: {', '.join(sorted(known))}")
        out = {p.name: p.check(values[p.name], prefix=prefix) if p.name in values else p.default
               for p in self.params}
        if mode_param is not None:
            mode = out[mode_param]
            for key in values:
                p = known[key]
                if p.modes and mode not in p.modes and out[key] != p.default:
                    raise UserInputError(
                        field=f"{prefix}.{key}", value=values[key],
                        allowed=f"unset: it is used only in mode {' / '.join(p.modes)}, and "
                                f"this {mode_param} is {mode!r}")
        for c in self.constraints:
            if not c.ok(out):
                raise UserInputError(field=f"{prefix}.{c.field}" if prefix else c.field,
                                     value=out[c.field], allowed=c.allowed)
        return out

    def prepared(self) -> tuple[str, ...]:
        """The parameters a method's preparation fills (``role="prepared"``): pick leaves them
        out of a rerun's config (the rerun recomputes them) and the report out of the
        hyperparameters it shows."""
        return tuple(p.name for p in self.params if p.role == "prepared")

    def table(self, *, roles: tuple[str, ...] = ("hyper", "setting")) -> list[dict[str, str]]:
        return [p.row() for p in self.params if p.role in roles]
