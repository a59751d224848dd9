"""Registry of DP methods: config name -> DPStep subclass.

Each method lives in its own module and registers itself on import; importing this package
imports every module in it, so ``METHODS`` is complete wherever it is read.
"""

from __future__ import annotations

from typing import TypeVar

from core.errors import UserInputError
from trainables.dp_step import DPStep

METHODS: dict[str, type[DPStep]] = {}

_T = TypeVar("_T", bound=type[DPStep])


def register(cls: _T) -> _T:
    """Class decorator: make a method available under ``cls.name``."""
    if cls.name in METHODS:
        raise RuntimeError(f"method {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def get_method(name: str) -> type[DPStep]:
    try:
        return METHODS[name]
    except KeyError:
        raise UserInputError(field="method", value=name,
                             allowed=f"one of {sorted(METHODS)}") from None


def _import_all() -> None:
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
