"""dpsweep: hyperparameter and privacy-audit sweeps for differentially private training.

The public API (docs/api.md) is this package's names: ``Config``, ``load_config``,
``from_dict``, ``run``, ``resume``, ``reaudit``, ``results``, ``report``, ``pick``, ``export``,
``budget`` and ``UserInputError``; each is ``dpsweep.orchestrator.api``'s, imported the first
time it is read, so ``import dpsweep`` (and a worker or an export importing one of its modules)
loads nothing else: this file imports only the standard library.

Layout: the repository keeps dpsweep's packages (``core``, ``orchestrator``, ``trainables``,
``search_spaces``, ``reports``) at its top level, beside this folder; the wheel installs them
under ``dpsweep/``. In a checkout the folder above this one is added to the package's path, so
``dpsweep.core`` is ``./core`` there, and nothing of dpsweep is importable by a bare top-level
name in either layout.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

#: The packages under ``dpsweep``, in the order the data flows through them.
PACKAGES = ("core", "trainables", "search_spaces", "orchestrator", "reports")
#: The public names, all from ``dpsweep.orchestrator.api``.
__all__ = ["Config", "UserInputError", "budget", "export", "from_dict", "load_config", "pick",
           "reaudit", "report", "results", "resume", "run"]

#: What marks a checkout: the wheel's build script beside this folder, with the packages (in
#: an installed wheel, or an export's ``code/``, they sit inside this folder: nothing is added).
CHECKOUT_MARK = "setup.py"

_here = Path(__file__).resolve().parent
if (_here.parent / CHECKOUT_MARK).is_file() and (_here.parent / PACKAGES[0]).is_dir():
    __path__.append(str(_here.parent))  # type: ignore[name-defined]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # core's, the one place it is written
        return importlib.import_module("dpsweep.core").__version__
    if name in __all__:
        return getattr(importlib.import_module("dpsweep.orchestrator.api"), name)
    raise AttributeError(f"module 'dpsweep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "PACKAGES", "__version__"])
