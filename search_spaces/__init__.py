"""Search spaces: for each method, which declared hyperparameters a sweep explores, and where.

A method declares its hyperparameters once (``trainables/methods/``: type, bounds, default,
log scale, presets, modes); a search space holds only the choices about *searching*: which of
them to explore, over which ranges, and how to parametrise them. Everything else is derived:
the Optuna distributions (type and log scale from the declaration), the first point of each
study (the method's ``paper`` preset, else its defaults), the decoding of a sampled point into
method parameters, and the checks on user overrides from the TOML (``[search.<method>]``).

SGD-family methods search the effective step ``lr_x_clip`` = lr * C together with C, not lr and
C independently: with clipping active the update's size is about lr * C, so independent lr and
C put most sampled points where the step is far too small or too large to learn (measured:
``docs/search.md``). lr is decoded as lr_x_clip / C.

Hyperparameters fixed by the config (``[method_params]``) and those the trial's mode does not
read are not searched.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpsweep.core.errors import UserInputError
from dpsweep.core.params import Param
from dpsweep.trainables.dp.step import DPStep
from dpsweep.trainables.methods import get_method

#: Name of the effective-step dimension (lr * C) of SGD-family spaces.
STEP = "lr_x_clip"
STEP_PARAM = Param(STEP, 0.5, "effective step lr * C", low=0.0, low_open=True, high=1e4, log=True)


@dataclass(frozen=True)
class Range:
    """A numeric interval to explore; ``log`` None takes the declaration's scale."""

    low: float
    high: float
    log: bool | None = None


@dataclass(frozen=True)
class Choices:
    """A finite set to explore (e.g. a grid whose budgets are calibrated before the sweep)."""

    values: tuple[Any, ...]


Dimension = Range | Choices


@dataclass(frozen=True)
class Space:
    """The searching choices of one method.

    ``method`` is the method's class (its registry entry) and every range is keyed by the name
    of a ``Param`` the method declares (``CLIP.name``, never a retyped string), so a space
    cannot name a method or a hyperparameter that does not exist: the names are checked here,
    when the space is made. ``per_model`` adds ranges that depend on the model (e.g. a layer
    count); ``step`` makes lr searched through the effective step lr * C (requires
    ``clip_norm`` in the ranges).
    """

    method: type[DPStep]
    ranges: Mapping[str, Dimension]
    step: Range | None = None
    per_model: Callable[[int], Mapping[str, Dimension]] | None = None

    def __post_init__(self) -> None:
        declared = self.method.declaration()
        unknown = [k for k in self.ranges if k not in declared]
        if unknown:
            raise RuntimeError(f"search space of {self.method.name!r} ranges over "
                               f"undeclared parameters {unknown}")

    @property
    def name(self) -> str:
        """The method's config name, under which the space is registered."""
        return self.method.name


SPACES: dict[str, Space] = {}

#: Ranges the SGD-family spaces share (measured: docs/search.md, bench/search_ranges.py): C over
#: the decade and a half around the 0.5-1 where DP-SGD's gradients are clipped (C alone did not
#: decide whether a point learned), and the effective step lr * C narrowed to where the demo's
#: 140-step digits runs learn (800 members, batch 128, epsilon 3: step 0.3 -> 0.72, 0.5 -> 0.79,
#: 1.0 -> 0.87, 1.5 -> 0.86, 2.0 -> 0.79-0.84, 3.0 -> 0.64-0.74 validation accuracy).
SGD_CLIP = Range(0.1, 5.0)
SGD_STEP = Range(0.7, 1.6)


def register(space: Space) -> Space:
    if space.name in SPACES:
        raise RuntimeError(f"search space of {space.name!r} registered twice")
    SPACES[space.name] = space
    return space


@dataclass(frozen=True)
class BuiltSpace:
    """A method's space for one sweep: Optuna distributions, first point, decoding."""

    method: str
    mode: str
    distributions: dict[str, Any]
    first_point: dict[str, Any]
    fixed: dict[str, Any] = field(default_factory=dict)
    step: bool = False

    def decode(self, sampled: Mapping[str, Any]) -> dict[str, Any]:
        """Method parameters of a sampled point (lr from the step, fixed values added)."""
        out = {**self.fixed, **{k: v for k, v in sampled.items() if k != STEP}}
        if self.step:
            out["lr"] = float(sampled[STEP]) / float(out["clip_norm"])
        out["mode"] = self.mode
        return out

    def contains(self, point: Mapping[str, Any]) -> bool:
        """Whether every searched key of an encoded point lies inside its distribution."""
        return all(k in point and d._contains(d.to_internal_repr(point[k]))
                   for k, d in self.distributions.items())


def _distribution(param: Param, dim: Dimension) -> Any:
    # optuna costs seconds to import and ``config --check`` imports this module
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if isinstance(dim, Choices):
        return CategoricalDistribution(tuple(dim.values))
    log = param.log if dim.log is None else dim.log
    if param.kind == "int":
        return IntDistribution(int(dim.low), int(dim.high), log=log)
    return FloatDistribution(float(dim.low), float(dim.high), log=log)


def _override(method: str, name: str, raw: Any, param: Param | None) -> Dimension:
    """A [search.<method>] entry as a dimension, checked against the declaration."""
    where = f"search.{method}.{name}"
    if not isinstance(raw, dict) or not (set(raw) <= {"low", "high", "log"}
                                         or set(raw) == {"choices"}):
        raise UserInputError(field=where, value=raw,
                             allowed="{low = .., high = .., log = true|false} or "
                                     "{choices = [..]}")
    declared = param if param is not None else STEP_PARAM

    def check(value: Any, part: str) -> Any:
        """The value checked against the declaration, refused as ``where.part``."""
        try:
            return declared.check(value, prefix="")
        except UserInputError as exc:
            raise UserInputError(field=f"{where}.{part}", value=value,
                                 allowed=exc.allowed) from None

    if "choices" in raw:
        values = raw["choices"]
        if not isinstance(values, list) or not values:
            raise UserInputError(field=f"{where}.choices", value=values,
                                 allowed="a non-empty list")
        checked = tuple(check(v, "choices") for v in values)
        # Optuna stores a categorical choice only as None, a bool, a number or a string
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in checked) or \
                len(set(checked)) != len(checked):
            raise UserInputError(field=f"{where}.choices", value=values,
                                 allowed="a non-empty list of distinct numbers, strings or "
                                         "booleans")
        return Choices(checked)
    if "low" not in raw or "high" not in raw:
        raise UserInputError(field=where, value=raw, allowed="both low and high")
    low, high = check(raw["low"], "low"), check(raw["high"], "high")
    if not (isinstance(low, (int, float)) and low < high):
        raise UserInputError(field=f"{where}.high", value=raw["high"],
                             allowed=f"a number > low = {raw['low']}")
    log = raw.get("log")
    if log is not None and not isinstance(log, bool):
        raise UserInputError(field=f"{where}.log", value=log, allowed="true or false")
    if log and low <= 0:
        raise UserInputError(field=f"{where}.low", value=low, allowed="> 0 on a log scale")
    return Range(low, high, log)


def check_overrides(search: Mapping[str, Any], *, methods: list[str],
                    fixed: Mapping[str, Mapping[str, tuple[str, Any]]] | None = None,
                    modes: Mapping[str, Sequence[str]] | None = None) -> None:
    """Validate ``[search.<method>]`` tables against the methods' spaces and declarations.

    ``fixed`` (per method, hyperparameter -> (config key, value)) and ``modes`` (the swept
    modes per method) refuse a range :func:`build_space` would drop without a word: one for a
    value the config fixes, or for a hyperparameter no swept mode reads.
    """
    for method, table in search.items():
        if method not in methods:
            raise UserInputError(field=f"search.{method}", value="[table]",
                                 allowed=f"a table named after a swept method: {methods}")
        if not isinstance(table, dict):
            raise UserInputError(field=f"search.{method}", value=table, allowed="a table")
        declared = get_method(method).declaration()
        space = SPACES[method]
        for name, raw in table.items():
            if name == STEP and space.step is None:
                raise UserInputError(field=f"search.{method}.{name}", value=raw,
                                     allowed=f"a searched hyperparameter of {method}")
            if name != STEP and name not in declared:
                raise UserInputError(field=f"search.{method}.{name}", value=raw,
                                     allowed=f"a hyperparameter declared by {method}: "
                                             f"{declared.names}")
            _override(method, name, raw, None if name == STEP else declared[name])
            _check_used(method, name, raw, param=None if name == STEP else declared[name],
                        fixed=(fixed or {}).get(method, {}),
                        modes=list((modes or {}).get(method, ())))


def _check_used(method: str, name: str, raw: Any, *, param: Param | None,
                fixed: Mapping[str, tuple[str, Any]], modes: list[str]) -> None:
    """A range the sweep would search: not one for a fixed value (the fixed value wins and the
    range would be ignored, whether or not the value lies inside it), not one for lr * C with lr
    fixed, not one for a hyperparameter only modes outside the sweep read."""
    where = f"search.{method}.{name}"
    target = "lr" if name == STEP else name
    if target in fixed:
        key, value = fixed[target]
        what = "the step lr * clip_norm is searched only while lr is free" if name == STEP \
            else "a fixed value is not searched"
        raise UserInputError(field=where, value=raw,
                             allowed=f"no range while {key} = {value!r} fixes {target} "
                                     f"({what}): remove the range or the fixed value")
    if param is not None and param.modes and modes and not set(modes) & set(param.modes):
        raise UserInputError(field=where, value=raw,
                             allowed=f"a range for a hyperparameter the swept modes read "
                                     f"({name} is read only in mode {' / '.join(param.modes)}; "
                                     f"{method} is swept in {', '.join(modes)})")


def build_space(method: str, *, mode: str, num_layers: int,
                fixed: Mapping[str, Any] | None = None,
                overrides: Mapping[str, Any] | None = None) -> BuiltSpace:
    """The method's space for a sweep: its ranges, the model's, the user's overrides, minus
    what the config fixes and what the mode does not read."""
    if method not in SPACES:
        raise UserInputError(field="sweep.methods", value=method,
                             allowed=f"methods with a search space: {sorted(SPACES)}")
    cls = get_method(method)
    declared = cls.declaration()
    space = SPACES[method]
    fixed = dict(fixed or {})
    fixed.pop("mode", None)
    dims: dict[str, Dimension] = dict(space.ranges)
    if space.per_model is not None:
        dims.update(space.per_model(num_layers))
    step = space.step
    for name, raw in (overrides or {}).items():
        dim = _override(method, name, raw, None if name == STEP else declared[name])
        if name == STEP:
            step = dim if isinstance(dim, Range) else step
        else:
            dims[name] = dim
    dims = {k: v for k, v in dims.items()
            if k not in fixed and (not declared[k].modes or mode in declared[k].modes)}
    # With C fixed the step is still searched (lr = step / C): a study searching nothing would
    # train one configuration n times.
    use_step = step is not None and "lr" not in fixed and ("clip_norm" in dims
                                                           or "clip_norm" in fixed)
    distributions = {k: _distribution(declared[k], d) for k, d in dims.items()}
    if use_step:
        distributions[STEP] = _distribution(declared["lr"], step)
    start = {**declared.defaults(), **cls.presets().get("paper", {}), **fixed}
    first = {k: start[k] for k in dims}
    if use_step:
        first[STEP] = float(start["lr"]) * float(start["clip_norm"])
    first = {k: _inside(v, distributions[k]) for k, v in first.items()}
    return BuiltSpace(method=method, mode=mode, distributions=distributions, first_point=first,
                      fixed=fixed, step=use_step)


def searched_params(method: str, *, num_layers: int = 4) -> frozenset[str]:
    """The declared parameters a sweep of ``method`` searches in at least one of its modes, as
    :func:`build_space` builds them: the ranges, the model-dependent ones and lr when the step
    lr * C stands for it (``Space.ranges`` alone misses the last two). ``num_layers`` only sizes
    the model-dependent ranges, not which parameters they cover."""
    out: set[str] = set()
    for mode in get_method(method).modes:
        built = build_space(method, mode=mode.name, num_layers=num_layers)
        out |= set(built.distributions) - {STEP}
        if built.step:
            out.add("lr")
    return frozenset(out)


def _inside(value: Any, dist: Any) -> Any:
    """The first point clamped into its range (a preset outside a user's narrowed range)."""
    if hasattr(dist, "choices"):
        return value if value in dist.choices else dist.choices[0]
    low, high = dist.low, dist.high
    clamped = min(max(value, low), high)
    return int(clamped) if isinstance(low, int) and not isinstance(low, bool) else (
        float(clamped) if math.isfinite(clamped) else low)


def _import_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
