"""Registry of DP methods: config name -> DPStep subclass.

Each method lives in its own module and registers itself on import; importing this package
imports every module in it, so ``METHODS`` is complete wherever it is read. A method is added
by one module here and one search-space entry (``search_spaces/``); nothing else changes.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator
from typing import TypeVar

from dpsweep.core.errors import UserInputError
from dpsweep.reports.series import LoggedSeries
from dpsweep.trainables.dp.step import DPStep

METHODS: dict[str, type[DPStep]] = {}

_T = TypeVar("_T", bound=type[DPStep])


def register(cls: _T) -> _T:
    """Class decorator: make a method available under ``cls.name``."""
    if cls.name in METHODS:
        raise RuntimeError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


@contextlib.contextmanager
def registered(cls: type[DPStep]) -> Iterator[type[DPStep]]:
    """Register ``cls`` for the duration of a block (test-only methods)."""
    register(cls)
    try:
        yield cls
    finally:
        METHODS.pop(cls.name, None)


def get_method(name: str) -> type[DPStep]:
    try:
        return METHODS[name]
    except KeyError:
        raise UserInputError(field="method", value=name,
                             allowed=f"one of {sorted(METHODS)}") from None


def parse_series(text: str, *, field: str = "sweep.methods") -> tuple[str, str]:
    """``"method"`` or ``"method:mode"`` -> (method, mode); the mode defaults to the method's
    first (default) mode. A series is what fronts and reports show as one line."""
    if not isinstance(text, str) or text.count(":") > 1:
        raise UserInputError(field=field, value=text, allowed="'method' or 'method:mode'")
    name, _, mode = text.partition(":")
    if name not in METHODS:
        raise UserInputError(field=field, value=text,
                             allowed=f"a registered method, optionally ':mode': {sorted(METHODS)}")
    cls = METHODS[name]
    modes = [m.name for m in cls.modes]
    if not mode:
        return name, modes[0]
    if mode not in modes:
        raise UserInputError(field=field, value=text,
                             allowed=f"a mode of {name}: {', '.join(modes)}")
    return name, mode


def series_name(method: str, mode: str) -> str:
    """How results and reports name a (method, mode): the method alone for its default mode."""
    return method if mode == METHODS[method].modes[0].name else f"{method}:{mode}"


def prepared_params() -> dict[str, tuple[str, ...]]:
    """Per method, its prepared parameters (``ParamSet.prepared``), for the report: it sits
    below trainables, so its caller reads the declarations for it."""
    return {name: cls.declaration().prepared() for name, cls in sorted(METHODS.items())}


def report_series() -> dict[str, LoggedSeries]:
    """Per method that logs per-step series, how the report shows them
    (``MethodContract.report_series``): the report sits below trainables, so its caller reads
    the declarations for it."""
    return {name: cls.report_series for name, cls in sorted(METHODS.items())
            if cls.report_series is not None}


def _import_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
