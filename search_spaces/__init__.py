"""One search space per method: Optuna distributions plus the paper-defaults point.

Keys are trial overrides as the trainable understands them: ``lr``, ``clip_norm`` and
``method_params.<name>``. Each space's ``first_point`` (the paper's defaults, or the config's
own lr / clip_norm where the paper gives none) is enqueued as the method's first trial, so
every study starts from a known-good configuration. Ranges are wide enough to contain every
paper's defaults (tested).

Spaces are built per sweep because some ranges depend on the model (DP-SGD-LF's m_f runs over
the layers) and on the config (the first point's lr / clip_norm).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import BaseDistribution

from core.errors import UserInputError


@dataclass(frozen=True)
class SearchSpace:
    method: str
    distributions: dict[str, BaseDistribution]
    first_point: dict[str, Any]
    #: Overrides every trial of the method gets (e.g. its default mode), not searched.
    fixed: dict[str, Any] = field(default_factory=dict)

    def contains(self, point: dict[str, Any]) -> bool:
        """Whether every searched key of ``point`` lies inside its distribution."""
        return all(k in point and d._contains(d.to_internal_repr(point[k]))
                   for k, d in self.distributions.items())


#: method -> builder(num_layers, lr, clip_norm) -> SearchSpace
BUILDERS: dict[str, Callable[..., SearchSpace]] = {}


def register(method: str) -> Callable[[Callable[..., SearchSpace]], Callable[..., SearchSpace]]:
    def deco(fn: Callable[..., SearchSpace]) -> Callable[..., SearchSpace]:
        BUILDERS[method] = fn
        return fn

    return deco


def build_space(method: str, *, num_layers: int, lr: float, clip_norm: float) -> SearchSpace:
    """The method's space for a model with ``num_layers`` layers and the config's lr / C."""
    if method not in BUILDERS:
        raise UserInputError(field="sweep.methods", value=method,
                             allowed=f"methods with a search space: {sorted(BUILDERS)}")
    return BUILDERS[method](num_layers=num_layers, lr=lr, clip_norm=clip_norm)


def _import_all() -> None:
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")


_import_all()
