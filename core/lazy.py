"""Deferred imports of heavy libraries, so light commands never pay for them.

``dpsweep config --check`` must read every method's declared hyperparameters, and the method
modules are where those declarations live (next to the code that uses them); importing torch
there would cost seconds for a command that never touches a tensor. Modules that need torch only
inside functions bind it with :func:`lazy_module`: the name is a module object whose first
attribute access runs the real import (``importlib.util.LazyLoader``).
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_module(name: str) -> ModuleType:
    """``name`` as a module that is imported on first attribute access."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    if parent:  # as the import system does: `import a.b` then `a.b.f` must find it
        setattr(importlib.import_module(parent), child, module)
    return module
