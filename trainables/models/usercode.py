"""A user's code, named in a config as ``"package.module:function"``: found, imported, hashed.

A factory reference is the only way a config runs code. It is looked up in one directory the
user chose (``model.code_dir``, by default the config file's folder) and in what is already
importable; nothing read from a run directory is ever imported. The SHA-256 of every ``.py``
file under that directory (and of each data file a run reads) goes into the run's manifest, so
``resume`` can refuse a run whose code or files changed under it, and an export names the
code its weights need.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import EXPORT_MODEL, EXPORT_STATEMENT_JSON

#: ``package.module:function`` (dotted module path, colon, dotted attribute path).
REFERENCE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
#: Hash chunk size (files may be large data tables).
_CHUNK = 1 << 20
#: Folders never hashed as code (caches and environments).
_SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".venv", "venv", "node_modules", ".mypy_cache",
                           ".pytest_cache", ".ruff_cache"})


def check_reference(*, field: str, value: object) -> str:
    """The reference itself, or one line naming ``field`` when it is not ``module:function``."""
    if not isinstance(value, str) or not REFERENCE.match(value):
        raise UserInputError(field=field, value=value,
                             allowed="'package.module:function' (a dotted module, a colon, "
                                     "a function or class name)")
    return value


def resolve(*, field: str, reference: str, code_dir: str | Path | None) -> Callable[..., Any]:
    """Import ``reference`` with ``code_dir`` first on the import path; one line if it fails.

    Any exception from the user's module at import is reported by type and message under
    ``field`` (the module is the user's, so its traceback is not ours to print).
    """
    check_reference(field=field, value=reference)
    module_name, attr_path = reference.split(":")
    code_dir = shipped_code_dir() or code_dir
    if code_dir is not None and Path(code_dir).is_dir():
        folder = Path(code_dir).resolve()
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        _forget_shadowed(module_name.split(".")[0], folder)
    try:
        obj: Any = importlib.import_module(module_name)
    except SystemExit as exc:
        raise UserInputError(field=field, value=reference,
                             allowed=f"a module that imports without exiting; importing "
                                     f"{module_name!r} exited ({_exit_call(exc)})") from None
    except Exception as exc:
        where = f" (looked in {code_dir} and the installed packages)" if code_dir else ""
        raise UserInputError(field=field, value=reference,
                             allowed=f"an importable module{where}; importing "
                                     f"{module_name!r} raised {type(exc).__name__}: {exc}") \
            from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UserInputError(field=field, value=reference,
                                 allowed=f"a name defined in {module_name}; it has no "
                                         f"{attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserInputError(field=field, value=reference,
                             allowed=f"a callable; {attr_path} is a {type(obj).__name__}")
    return obj


def shipped_code_dir() -> Path | None:
    """Inside a Ray worker whose runtime environment carries the user's code folder, that copy
    (the worker's working directory): the folder named in the config may not exist on this
    node, or may have changed since the driver uploaded it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE or not context.runtime_env.get("working_dir"):
        return None
    return Path.cwd()


def _forget_shadowed(top: str, folder: Path) -> None:
    """The code folder wins: a module of the same name imported earlier from elsewhere (another
    config's folder in this process) is dropped from the import cache, so the import below reads
    this folder's file."""
    here = folder / f"{top}.py" if (folder / f"{top}.py").is_file() else folder / top
    loaded = sys.modules.get(top)
    if not here.exists() or loaded is None:
        return
    origin = Path(getattr(loaded, "__file__", "") or "").resolve()
    if origin == here.resolve() or here.resolve() in origin.parents:
        return
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]


def call_user(*, field: str, fn: Callable[..., Any], reference: str = "",
              kwargs: Mapping[str, Any] | None = None) -> Any:
    """``fn(**kwargs)`` with any exception turned into one line naming ``field``, its value
    (``reference``, the ``module:function`` the field holds) and the cause. The arguments are
    a mapping, so a user's argument may have any name.

    ``sys.exit`` (``SystemExit``) from the user's code is refused the same way: left alone it
    would end dpsweep with the factory's exit code and nothing said. ``KeyboardInterrupt`` is
    an interrupt and passes through (the CLI's exit 130). ``os._exit`` cannot be caught."""
    kwargs = dict(kwargs or {})
    try:
        return fn(**kwargs)
    except UserInputError:
        raise
    except SystemExit as exc:  # a factory that exits: a refusal, never a silent success
        name = reference or getattr(fn, "__qualname__", repr(fn))
        raise UserInputError(field=field, value=name,
                             allowed=f"a factory that returns; calling it with "
                                     f"{sorted(kwargs)} exited ({_exit_call(exc)})") from None
    except Exception as exc:
        name = reference or getattr(fn, "__qualname__", repr(fn))
        raise UserInputError(field=field, value=name,
                             allowed=f"a factory that returns; calling it with "
                                     f"{sorted(kwargs)} raised {type(exc).__name__}: {exc}") \
            from None


def _exit_call(exc: SystemExit) -> str:
    """``sys.exit(code)`` as the user's code called it, for the one line."""
    return f"sys.exit({exc.code!r})"


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def code_files(code_dir: str | Path) -> list[Path]:
    """Every ``.py`` file under ``code_dir`` (caches and environments left out), sorted. A
    dpsweep export in the folder is left out too: its ``load.py`` and ``code/`` copy are not
    the user's code, and exporting next to the config must not change the run's code hash."""
    root = Path(code_dir)
    exports = {p.parent for p in root.rglob(EXPORT_STATEMENT_JSON)
               if (p.parent / EXPORT_MODEL).is_file()}
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in _SKIPPED_DIRS for part in p.relative_to(root).parts[:-1])
                  and exports.isdisjoint(p.parents))


def tree_sha256(code_dir: str | Path) -> str:
    """One SHA-256 over the relative names and contents of :func:`code_files`: it changes when
    any of the user's Python files is added, removed or edited."""
    root = Path(code_dir)
    return combined_sha256((str(p.relative_to(root)), file_sha256(p)) for p in code_files(root))


def combined_sha256(files: Iterable[tuple[str, str]]) -> str:
    """The tree hash of (relative name, SHA-256 of the file) pairs, in :func:`code_files`'
    order: an export recomputes it over the copies it ships, to compare with the manifest."""
    digest = hashlib.sha256()
    for name, file_digest in files:
        digest.update(name.encode() + b"\0")
        digest.update(file_digest.encode() + b"\0")
    return digest.hexdigest()


def callable_reference(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a Python callable (the API's factories), for records only."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"
