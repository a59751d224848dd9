"""Load a dpsweep export without dpsweep: ``model = load(EXPORT_DIR)``, then ``model(raw)``.

dpsweep copies this file unchanged into every export as ``load.py``. It needs Python and torch
(Pillow and numpy too, for :func:`read_images` only): not dpsweep, not the run directory, not
the folder the model was trained from. ``load`` does, in order:

1. reads ``model.json`` (what to build, the classes, the input normalisation);
2. reads the weights with ``torch.load(weights_only=True)``, which reads tensors and runs no
   code;
3. checks ``code/``: it must hold exactly the ``.py`` files ``model.json`` lists, each with its
   SHA-256, and nothing else (no ``__pycache__``, no bytecode, no ``.so`` or ``.pth``, no
   other file or folder, no symbolic link), before anything from it is imported;
4. imports the builder from those verified bytes only: each module is compiled from the bytes
   that were hashed, never from a bytecode cache, and no bytecode is written into the export.
   Its import finder comes first on ``sys.meta_path`` for the export's top-level names only,
   so nothing of the same name elsewhere on the import path can stand in for them;
5. calls the builder as training did: ``factory(input_shape=..., num_classes=..., **args)``,
   replaces the modules training replaced (``[model] fix``: ``torch.nn`` classes only) and
   loads the weights;
6. returns the network wrapped in :class:`RawInput`, in eval mode: it applies the training
   normalisation itself, so raw inputs go in (image pixels as stored, 0..255) and logits come
   out. Nothing needs remembering about mean and std.

Whatever stops a load is an :class:`ExportError` with a one-line message naming the file;
``python load.py [EXPORT_DIR]`` prints that line alone (exit 1), or what it loaded (exit 0).
``model.classes[i]`` names label ``i``. The privacy statement next to this file says what the
release's epsilon covers.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import pickle
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
MODEL_FILE = "model.json"
#: model.json's fields that ``load`` reads.
MODEL_FIELDS = ("build", "code", "input_shape", "num_classes", "classes",
                "input_normalization", "weights")
SOURCE_SUFFIX = ".py"
PACKAGE_INIT = "__init__.py"
REFUSE = "refusing to import"
#: Exit statuses of ``python load.py``: the export cannot be loaded; wrong arguments.
EXIT_REFUSED = 1
EXIT_USAGE = 2
#: Class names ``python load.py`` prints.
SHOWN_CLASSES = 5


class ExportError(Exception):
    """The export cannot be loaded as written; the message is one line naming the file."""


class CodeRefused(ExportError, ImportError):
    """``code/`` is not exactly the hashed source of this export, or its module names are taken
    in this process: nothing from it is imported. (An ImportError too, for callers that catch
    import failures.)"""


class RawInput(nn.Module):
    """The trained network behind its input transform: what training applied to every input.

    Features and images: ``x / max_value``, then ``(x - mean) / std`` per index of axis 1 (the
    channel of ``[N, C, H, W]`` images), in float32. Token ids: cast to int64, never scaled.
    """

    def __init__(self, network: nn.Module, *, normalization: dict[str, Any] | None,
                 input_shape: Sequence[int], classes: Sequence[str]) -> None:
        super().__init__()
        self.network = network
        self.input_shape = tuple(int(d) for d in input_shape)
        self.classes = list(classes)
        self.tokens = normalization is None
        norm = normalization or {"max_value": 1.0, "mean": [0.0], "std": [1.0]}
        # Constants of the transform, not weights: kept out of state_dict, moved by .to().
        self.register_buffer("max_value", torch.tensor(float(norm["max_value"])),
                             persistent=False)
        self.register_buffer("mean", torch.tensor(norm["mean"], dtype=torch.float32),
                             persistent=False)
        self.register_buffer("std", torch.tensor(norm["std"], dtype=torch.float32),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != len(self.input_shape) + 1 or x.shape[1] != self.input_shape[0]:
            raise ValueError(f"raw inputs of shape [N, {', '.join(map(str, self.input_shape))}]"
                             f" (a batch, as training saw them); got {list(x.shape)}")
        if self.tokens:
            return self.network(x.to(torch.int64))
        x = x.to(torch.float32) / self.max_value
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return self.network((x - self.mean.reshape(shape)) / self.std.reshape(shape))


def load(export_dir: str | Path = HERE, *, device: str | torch.device = "cpu",
         args: dict[str, Any] | None = None) -> RawInput:
    """The exported model, ready for raw inputs, in eval mode on ``device``. ``args`` replace
    factory arguments the training machine had (a pretrained-weights path: the exported
    weights replace every parameter anyway). Raises :class:`ExportError` (one line) for an
    export that is incomplete or not as written."""
    root = Path(export_dir).resolve()
    info = read_model(root)
    weights = _relative(root, str(info["weights"]["torch"]), what="weights file")
    state = _read_weights(weights)
    code = _relative(root, str(info["code"]["dir"]), what="code folder")
    sources = verify_code(code, info["code"]["files"])
    build = info["build"]
    with hashed_imports(code, sources):
        factory = _import(build["factory"], code=code, shipped=bool(sources))
        network = factory(input_shape=tuple(info["input_shape"]),
                          num_classes=int(info["num_classes"]),
                          **{**build["args"], **(args or {})})
        network = replace_modules(network, build.get("replace", []))
    try:
        network.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ExportError(f"load: {weights} does not fit the network model.json "
                          f"builds ({' '.join(str(exc).split())[:300]})") from None
    model = RawInput(network, normalization=info["input_normalization"],
                     input_shape=info["input_shape"], classes=info["classes"])
    return model.to(device).eval()


def classes(export_dir: str | Path = HERE) -> list[str]:
    """The class names in label order (``model.json``'s ``classes``)."""
    return list(read_model(Path(export_dir).resolve())["classes"])


def read_images(paths: Iterable[str | Path], *, mode: str | None = None) -> torch.Tensor:
    """Image files as training read an image folder: uint8 ``[N, C, H, W]``, pixels as stored
    (mode L gives one channel, RGB three). ``mode`` converts each image first (e.g. "RGB" for
    a grey JPEG given to a colour model). Needs Pillow and numpy."""
    import numpy as np
    from PIL import Image

    arrays = []
    for path in paths:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert(mode) if mode else image)
        arrays.append(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1))
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)))


def replace_modules(network: nn.Module, replacements: Sequence[dict[str, Any]]) -> nn.Module:
    """What training replaced in the factory's network (``[model] fix``: a BatchNorm becomes a
    GroupNorm), rebuilt from ``torch.nn`` class names and arguments: only ``torch.nn`` modules,
    never code from the record."""
    for record in replacements:
        kind = getattr(nn, str(record["kind"]), None)
        if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
            raise ValueError(f"model.json replaces a module with {record['kind']!r}, which is "
                             f"not a torch.nn module")
        new = kind(**record["kwargs"])
        parent, _, name = str(record["module"]).rpartition(".")
        if not name:
            network = new
        else:
            setattr(network.get_submodule(parent) if parent else network, name, new)
    return network


# --------------------------------------------------------------------------------------------
# The export's files: model.json and the weights, one line each when they are not usable


def read_model(root: Path) -> dict[str, Any]:
    """``model.json`` of the export at ``root``, with the fields ``load`` reads."""
    path = root / MODEL_FILE
    try:
        info = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ExportError(f"load: {path} is missing: not a complete dpsweep export") from None
    except OSError as exc:
        raise ExportError(f"load: cannot read {path} ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ExportError(f"load: {path} is not valid JSON ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]})") from None
    if not isinstance(info, dict):
        raise ExportError(f"load: {path} holds a {type(info).__name__}, not an object")
    lacking = [name for name in MODEL_FIELDS if name not in info]
    if lacking:
        raise ExportError(f"load: {path} lacks {', '.join(lacking)}: not written by dpsweep "
                          f"export")
    return info


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state_dict, tensors only: ``weights_only=True`` runs no code from the file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ExportError(f"load: {path} is missing (model.json names it as the weights)"
                          ) from None
    except OSError as exc:
        raise ExportError(f"load: cannot read {path} ({exc.strerror or exc})") from None
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise ExportError(f"load: {path} is not a weights file torch can read safely "
                          f"({' '.join(str(exc).split())[:200]})") from None
    if not (isinstance(state, dict)
            and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ExportError(f"load: {path} holds no state_dict of tensors")
    return state


def _relative(root: Path, name: str, *, what: str) -> Path:
    """``root / name`` for a name model.json gives, which must stay inside the export."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        raise ExportError(f"load: {root / MODEL_FILE} names {name!r} as its {what}: not a "
                          f"path inside the export")
    return root.joinpath(*parts)


# --------------------------------------------------------------------------------------------
# code/: exactly the hashed source, imported from the bytes that were hashed


def verify_code(code: Path, expected: dict[str, str]) -> dict[str, bytes]:
    """The bytes of every ``.py`` file ``model.json`` lists (relative name -> bytes), each
    checked against its SHA-256, after checking that ``code`` holds nothing else: a bytecode
    cache, a compiled extension or a ``.pth`` file beside the source would run code no hash
    covers. Refused (:class:`CodeRefused`, one line) before anything is imported."""
    shown = code.name
    _check_listing(expected, shown=shown)
    if code.is_symlink() or not code.is_dir():
        raise CodeRefused(f"load: {shown}/ is not a folder of this export; {REFUSE}")
    unlisted = _unlisted(code, expected)
    if unlisted:
        first, why = unlisted[0]
        more = f" ({len(unlisted) - 1} more unlisted)" if len(unlisted) > 1 else ""
        raise CodeRefused(f"load: {shown}/{first} {why} of this export{more}; {REFUSE}")
    sources = {}
    for name, digest in expected.items():
        try:
            data = (code / name).read_bytes()
        except OSError as exc:
            raise CodeRefused(f"load: {shown}/{name} is missing or unreadable ("
                              f"{exc.strerror or exc}; model.json lists it); {REFUSE}") from None
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            raise CodeRefused(f"load: {shown}/{name} changed since export (SHA-256 {found}, "
                              f"model.json records {digest}); {REFUSE}")
        sources[name] = data
    return sources


def _check_listing(expected: Any, *, shown: str) -> None:
    """model.json's list names ``.py`` files by relative paths inside the code folder."""
    if not isinstance(expected, dict):
        raise CodeRefused(f"load: {MODEL_FILE}'s code.files is not a name -> SHA-256 map; "
                          f"{REFUSE}")
    for name in expected:
        parts = PurePosixPath(name).parts
        if (not name.endswith(SOURCE_SUFFIX) or PurePosixPath(name).is_absolute()
                or ".." in parts or "\\" in name or PurePosixPath(*parts).as_posix() != name):
            raise CodeRefused(f"load: {MODEL_FILE} lists {shown}/{name}, which is not a "
                              f"source file inside {shown}/; {REFUSE}")


def _unlisted(code: Path, expected: dict[str, str]) -> list[tuple[str, str]]:
    """(relative name, what is wrong) of every file under ``code`` that is not a listed
    regular file; if there is none, of every folder not on the way to one (an empty
    ``__pycache__``, say). A folder holding unlisted files is named by its files."""
    folders = {parent.as_posix() for name in expected for parent in PurePosixPath(name).parents}
    files, others = [], []
    for where, dirnames, filenames in os.walk(code, onerror=_unreadable, followlinks=False):
        base = Path(where)
        for name in sorted(dirnames + filenames):
            path = base / name
            rel = path.relative_to(code).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                files.append((rel, "is a symbolic link, not a hashed source file"))
            elif stat.S_ISDIR(mode):
                if rel not in folders:
                    others.append((rel, "is not a folder of the hashed source"))
            elif rel not in expected:
                files.append((rel, "is not a hashed source file"))
            elif not stat.S_ISREG(mode):
                files.append((rel, "is not a regular file"))
    return files or others


def _unreadable(exc: OSError) -> None:
    """os.walk's error: a folder that cannot be listed could hide anything."""
    raise CodeRefused(f"load: cannot list {exc.filename} ({exc.strerror or exc}); {REFUSE}")


def _module_table(sources: dict[str, bytes]) -> dict[str, tuple[str | None, bool]]:
    """Module name -> (its source file, whether it is a package) for each name the code can be
    imported by: ``a/b.py`` is ``a.b``, ``a/__init__.py`` the package ``a`` (it wins over
    ``a.py``, as in Python), a folder without one a namespace package (no source)."""
    table: dict[str, tuple[str | None, bool]] = {}
    for name in sorted(sources):
        parts = name.removesuffix(SOURCE_SUFFIX).split("/")
        package = parts[-1] == PACKAGE_INIT.removesuffix(SOURCE_SUFFIX)
        module = parts[:-1] if package else parts
        if not module or not all(part.isidentifier() for part in module):
            continue  # a file no import statement can name (a script like run-me.py)
        for depth in range(1, len(module)):
            table.setdefault(".".join(module[:depth]), (None, True))
        key = ".".join(module)
        if package or table.get(key, (None, True))[0] is None:
            table[key] = (name, package)
    return table


def _owner(module: Any) -> Path | None:
    """The code folder whose hashed source ``module`` was imported from; None if elsewhere."""
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    return getattr(loader, "hashed_code", None)


class _HashedSource(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the export's modules from the bytes :func:`verify_code` hashed, compiled with
    ``compile()``: no bytecode cache is read or written, and a file changed after the check is
    never read again. It answers for the export's top-level names only, and refuses a
    submodule the export does not hold rather than let another finder look for it elsewhere."""

    def __init__(self, *, code: Path, sources: dict[str, bytes]) -> None:
        self.hashed_code = code
        self.sources = sources
        self.modules = _module_table(sources)
        self.tops = {name.partition(".")[0] for name in self.modules}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.tops:
            return None
        if fullname not in self.modules:
            raise ModuleNotFoundError(f"load: no module {fullname!r} in this export's "
                                      f"{self.hashed_code.name}/", name=fullname)
        source, package = self.modules[fullname]
        origin = str(self.hashed_code.joinpath(*source.split("/"))) if source else None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=origin,
                                              loader_state=source, is_package=package)
        spec.has_location = source is not None
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is None or spec.loader_state is None:
            return  # a folder without __init__.py: a namespace package, nothing to run
        code = compile(self.sources[spec.loader_state], str(spec.origin), "exec",
                       dont_inherit=True)
        exec(code, module.__dict__)  # the hashed source, as an import would run it

    def get_source(self, fullname: str) -> str | None:
        """The hashed source (for tracebacks and ``inspect``)."""
        source, _ = self.modules[fullname]
        return None if source is None else importlib.util.decode_source(self.sources[source])


@contextmanager
def hashed_imports(code: Path, sources: dict[str, bytes]) -> Iterator[None]:
    """The export's modules come from ``sources`` while the network is built. A top-level
    name the export provides that this process already imported from elsewhere is refused,
    never mixed. Afterwards the finder stays first on ``sys.meta_path`` for the packages it
    imported only, so a submodule they import later (inside ``forward``) also comes from the
    hashed source, never from a same-named package elsewhere; other names are released."""
    if not sources:  # a factory from an installed package: imported as installed
        yield
        return
    finder = _HashedSource(code=code, sources=sources)
    for top in sorted(finder.tops):
        if top in sys.modules and _owner(sys.modules[top]) != code:
            raise CodeRefused(f"load: a module {top!r} is already imported from elsewhere in "
                              f"this process; this export's is under {code.name}/: load it in "
                              f"a fresh process")
    sys.meta_path[:] = [finder, *(f for f in sys.meta_path
                                  if getattr(f, "hashed_code", None) != code)]
    try:
        yield
    finally:
        finder.tops = {top for top in finder.tops if _owner(sys.modules.get(top)) == code}
        if not finder.tops:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]


def _import(reference: str, *, code: Path, shipped: bool) -> Callable[..., nn.Module]:
    """``module:function``; from the export's hashed source when it ships code."""
    module_name, _, attr_path = reference.partition(":")
    obj: Any = importlib.import_module(module_name)
    if shipped and _owner(obj) != code:
        raise CodeRefused(f"load: {module_name} was imported from outside this export's "
                          f"{code.name}/; {REFUSE}")
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------------------------
# python load.py [EXPORT_DIR]


def main(argv: Sequence[str] | None = None) -> int:
    """Load the export (this file's folder by default) and say what it takes and gives, or
    why it cannot be loaded, in one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1:
        print("usage: python load.py [EXPORT_DIR]", file=sys.stderr)
        return EXIT_USAGE
    where = Path(args[0]) if args else HERE
    try:
        model = load(where)
    except ExportError as exc:
        print(exc, file=sys.stderr)
        return EXIT_REFUSED
    names = ", ".join(model.classes[:SHOWN_CLASSES])
    more = ", ..." if len(model.classes) > SHOWN_CLASSES else ""
    print(f"load: {where}: raw inputs [N, {', '.join(map(str, model.input_shape))}] -> "
          f"logits over {len(model.classes)} classes ({names}{more})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
