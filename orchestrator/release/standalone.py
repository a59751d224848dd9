"""What a stranger needs to run an export without dpsweep: the network's source and a loader.

``model.json`` alone names a factory; a stranger has neither the training machine's code folder
nor dpsweep. So the export carries the code itself, under ``code/``:

* a user's factory: the ``.py`` files of ``model.code_dir``, exactly the files whose SHA-256 the
  run's manifest records (``trainables.models.usercode.code_files``). Only Python files leave: data,
  checkpoints and anything else in the folder stay behind, so private data kept beside the code
  is never released;
* a built-in model: dpsweep's own modules that build it (``trainables/models/networks.py`` and
  what it imports from dpsweep at module level, found by reading the imports, with their packages'
  ``__init__.py``), copied as they are: no second copy of the architectures to drift.

``load.py`` is ``orchestrator/release/loader.py`` copied unchanged: plain Python on torch that
checks that ``code/`` holds exactly the files ``model.json`` lists, each with its SHA-256, imports
the network's source from the bytes it hashed (never from a bytecode cache), rebuilds the
network, loads the weights (tensors only) and wraps it in the training input normalisation.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from dpsweep.core.layout import EXPORT_CODE
from dpsweep.trainables.models import usercode
from dpsweep.trainables.models.source import ModelSource

#: The built-in models' builder, as a factory reference (what ``load.py`` imports).
BUILTIN_FACTORY = "dpsweep.trainables.models.networks:build_model"
#: dpsweep's one top-level package: what a built-in model's closure ships.
TOP_PACKAGE = __name__.split(".")[0]
#: Where each kind of code in ``code/`` comes from (``model.json``'s ``code.origin``).
ORIGIN_USER = "model.code_dir"
ORIGIN_BUILTIN = "dpsweep"
ORIGIN_INSTALLED = "installed package"
#: The loader's source file, shipped as ``layout.EXPORT_LOADER``.
LOADER_SOURCE = Path(__file__).with_name("loader.py")


def build_record(source: ModelSource, *, architecture: str) -> dict[str, Any]:
    """The call ``load.py`` makes: ``factory(input_shape=..., num_classes=..., **args)``.

    An argument that names a file by an absolute path (a pretrained backbone's weights) is
    the training machine's: it is stored empty and listed under ``paths_removed``, so the
    export neither holds nor reads it (its weights replace every parameter anyway); a factory
    that needs the file to build gets it through ``load.load(args=...)``."""
    if source.is_user:
        args, removed = portable_args(dict(source.args))
        return {"factory": source.factory, "args": args, "paths_removed": removed}
    return {"factory": BUILTIN_FACTORY,
            "args": {"name": architecture, "activation": source.activation}}


def portable_args(args: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``args`` with every absolute path ("" in its place; in a list, each one), and the keys
    that held one."""
    def machine_path(value: Any) -> bool:
        return isinstance(value, str) and bool(value) and os.path.isabs(
            os.path.expanduser(value))

    out: dict[str, Any] = {}
    removed: list[str] = []
    for key, value in args.items():
        if isinstance(value, list):
            out[key] = ["" if machine_path(v) else v for v in value]
        else:
            out[key] = "" if machine_path(value) else value
        if out[key] != value:
            removed.append(key)
    return out, removed


def code_files(source: ModelSource) -> tuple[str, dict[str, bytes]]:
    """(origin, relative path under ``code/`` -> bytes) of the network's source; a user's in
    ``usercode.code_files``' order (the order its tree hash is taken in)."""
    if not source.is_user:
        return ORIGIN_BUILTIN, {name: path.read_bytes()
                                for name, path in _module_closure(BUILTIN_FACTORY).items()}
    if not source.code_dir:  # a factory from an installed package: importable as installed
        return ORIGIN_INSTALLED, {}
    root = Path(source.code_dir)
    return ORIGIN_USER, {p.relative_to(root).as_posix(): p.read_bytes()
                         for p in usercode.code_files(root)}


def code_record(origin: str, files: dict[str, bytes]) -> dict[str, Any]:
    """``model.json``'s ``code``: the folder, where it came from, each file's SHA-256 (what
    ``load.py`` checks) and one SHA-256 over them all in ``files``' order, computed as the run's
    manifest computes ``inputs.model_code``, so the two can be compared."""
    hashes = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    return {"dir": EXPORT_CODE, "origin": origin, "files": hashes,
            "sha256": usercode.combined_sha256(hashes.items())}


def _module_closure(reference: str) -> dict[str, Path]:
    """The files of ``reference``'s module and of every dpsweep module it imports at module
    level (and their packages), each under the path its module name gives
    (``dpsweep/trainables/models/networks.py``), in a checkout and an installed wheel alike."""
    todo, found = [reference.split(":")[0]], {}
    while todo:
        name = todo.pop()
        if name in found or not _first_party(name):
            continue  # the standard library or a third-party package: not shipped
        origin = _origin(name)
        if origin is None:
            continue
        found[name] = Path(origin)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        package = name if Path(origin).name == "__init__.py" else ".".join(parts[:-1])
        todo += _imported(Path(origin), package=package)
    return {"/".join(name.split(".")) + ("/__init__.py" if path.name == "__init__.py" else ".py"):
            path for name, path in found.items()}


def _first_party(name: str) -> bool:
    """Whether ``name`` is one of dpsweep's modules (the package this module belongs to)."""
    return name == TOP_PACKAGE or name.startswith(f"{TOP_PACKAGE}.")


def _origin(name: str) -> str | None:
    """The file a module is loaded from; None for a name that is no module (an attribute
    imported with ``from x import y``)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None or not spec.has_location else spec.origin


def _imported(path: Path, *, package: str) -> list[str]:
    """Module names a file imports when it is imported: module-level statements, ``if`` and
    ``try`` blocks included, ``if TYPE_CHECKING:`` and function bodies not (they do not run)."""
    names: list[str] = []
    stack = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module or ""
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            stack += [stmt for handler in node.handlers for stmt in handler.body]
    return names
