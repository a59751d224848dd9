"""Where a trial's network comes from: a built-in name, or a user's factory, as plain data.

The same record is written into every trial's spec, the run's manifest and an export, and
:func:`trainables.models.assemble.build_network` is the one place a network is made from it
(training, the audit's reference models, the budget's layer count, export): a built-in model is
a named factory of the same mechanism as a user's. The record stays torch-free (validating a
config never imports torch), so it knows nothing of how it is built.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.models import usercode
from dpsweep.trainables.models.catalog import model_for

#: ``[model] args`` values a TOML table can hold and a spec can carry as JSON.
_ARG_TYPES = (bool, int, float, str, list)


@dataclass(frozen=True)
class ModelSource:
    """``name``/``activation`` pick a built-in; ``factory`` (``"package.module:function"``,
    imported from ``code_dir``) replaces them with ``factory(input_shape=..., num_classes=...,
    **args)``; ``layers`` are module paths inside the returned module (empty: each top-level
    child that owns parameters); ``fix`` replaces its BatchNorms with GroupNorms and drops
    InstanceNorm running statistics first (``trainables.models.fix``)."""

    name: str = "auto"
    activation: str = "tanh"
    factory: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)
    layers: tuple[str, ...] = ()
    code_dir: str = ""
    fix: bool = False

    def __post_init__(self) -> None:
        if self.factory:
            usercode.check_reference(field="model.factory", value=self.factory)
        if not isinstance(self.args, Mapping):
            raise UserInputError(field="model.args", value=self.args,
                                 allowed="a table of keyword arguments for the factory")
        for key, value in self.args.items():
            if not isinstance(value, _ARG_TYPES):
                raise UserInputError(field=f"model.args.{key}", value=value,
                                     allowed="a number, string, boolean or list")
        if self.args and not self.factory:
            raise UserInputError(field="model.args", value=dict(self.args),
                                 allowed="unset: arguments go to [model] factory, which is unset")
        layers = tuple(self.layers)
        if any(not isinstance(p, str) or not p for p in layers):
            raise UserInputError(field="model.layers", value=list(layers),
                                 allowed="module names (non-empty strings)")
        if layers and not self.factory:
            raise UserInputError(field="model.layers", value=list(layers),
                                 allowed="unset for a built-in model (its layers are fixed)")
        if not isinstance(self.fix, bool):
            raise UserInputError(field="model.fix", value=self.fix, allowed="true or false")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "args", dict(self.args))

    @property
    def is_user(self) -> bool:
        return bool(self.factory)

    def describe(self, *, dataset: str) -> str:
        """The architecture's name as records show it (the factory reference for a user's)."""
        return self.factory if self.is_user else model_for(model=self.name, dataset=dataset)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; ``fix`` only when set, so records written without it read the same."""
        out = {"name": self.name, "activation": self.activation, "factory": self.factory,
               "args": dict(self.args), "layers": list(self.layers), "code_dir": self.code_dir}
        return {**out, "fix": True} if self.fix else out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelSource:
        known = {"name", "activation", "factory", "args", "layers", "code_dir", "fix"}
        extra = set(d) - known
        if extra:
            raise UserInputError(field="model", value=sorted(extra),
                                 allowed=f"keys among {sorted(known)}")
        return cls(**{**d, "layers": tuple(d.get("layers") or ())})

    def fingerprint(self) -> dict[str, str]:
        """SHA-256 of the user's code (every ``.py`` under ``code_dir``), for the manifest."""
        if not self.is_user or not self.code_dir or not Path(self.code_dir).is_dir():
            return {}
        return {"model_code": usercode.tree_sha256(self.code_dir)}


def source_of_callable(fn: Callable[..., Any], *, args: Mapping[str, Any] | None = None,
                       layers: Sequence[str] = ()) -> ModelSource:
    """The Python API's model: a factory function defined in an importable module file.

    Workers, ``resume`` and ``export`` import it by reference, so it must be found again under
    its module and name: a lambda, a nested function or one defined in ``__main__`` is refused
    with how to fix it.
    """
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or module in (None, "__main__") or "<" in qualname:
        raise UserInputError(field="model.factory", value=repr(fn),
                             allowed="a function defined at the top level of a module file "
                                     "(workers, resume and export import it by name)")
    reference = f"{module}:{qualname}"
    path = inspect.getsourcefile(sys.modules[module]) if module in sys.modules else None
    if path is None:
        raise UserInputError(field="model.factory", value=reference,
                             allowed="a function from a Python source file")
    root = Path(path).resolve().parent
    for _ in range(module.count(".")):
        root = root.parent
    installed = Path(sys.prefix).resolve()
    if root == installed or installed in root.parents:
        root = None  # an installed package: importable on every node of the environment
    source = ModelSource(factory=reference, args=dict(args or {}), layers=tuple(layers),
                         code_dir="" if root is None else str(root))
    found = usercode.resolve(field="model.factory", reference=reference, code_dir=root)
    if found is not fn:
        raise UserInputError(field="model.factory", value=reference,
                             allowed="a function importable under its own name")
    return source
