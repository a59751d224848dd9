"""Any data as a dataset: a file, a folder of images or a user's factory, read and checked
before a trial starts, and normalised without looking at private rows.

Sources (:class:`FileSource`; exactly one of ``path`` and ``factory``):

* ``.npz``: arrays ``x`` [N, ...] and ``y`` [N], optionally ``split`` [N] (split names). It
  is read with ``allow_pickle=False``, so loading it runs no code.
* ``.csv`` / ``.parquet``: one row per example; a label column, feature columns (by default
  every other column except the split column) and optionally a split column.
* a folder with one sub-folder per class (sorted names are class ids 0, 1, ...) holding
  images of one size and one mode (L: one channel; LA, RGB, RGBA); rows are [C, H, W].
* ``factory = "package.module:function"``: the only source that runs code, imported through
  :mod:`trainables.models.usercode` from ``code_dir``. Called with no arguments, it returns
  ``(x, y)``, a dict with ``x``, ``y`` and optionally ``public_x``, ``public_y``, ``split``,
  or a map-style Dataset of ``(x, y)`` items.

``public_path`` (or the factory's ``public_x``/``public_y``) is a public pool: it becomes the
shadow split, which the audit's attacker and some methods read, and is public by assumption.

Normalisation rule. A statistic of private rows is itself a release of them that no
accountant sees, so the constants come from, in this order:

1. the user's ``mean``/``std``: one value per index of axis 1 (per channel of [N, C, H, W]
   images, per feature of [N, D] tables), or a single value for all;
2. else the whole public pool (``public_path``, or the factory's ``public_x``);
3. else the shadow split, after the seeded split (the shadow split is public by the design);

never train, validation, holdout or test rows. uint8 inputs are pixels: they are divided by
255 first (the statistics are of the scaled values). A feature or channel that is constant
over the public rows (zero std) is centred but left unscaled (std taken as 1) rather than
divided by zero. ``inputs="tokens"`` keeps integer ids as int64 and never normalises them.

This module is the source's description, its checks that need no reading, and the
normalisation; the readers of each kind of source and the row checks are
:mod:`trainables.data.readers` (pandas and Pillow are imported only there).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.models.usercode import check_reference, file_sha256, tree_sha256

TABLE_SUFFIXES: tuple[str, ...] = (".csv", ".parquet", ".pq")
IMAGE_SUFFIXES: frozenset[str] = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})

INPUT_KINDS: tuple[str, ...] = ("features", "tokens")
MAX_CLASSES = 100_000
"""Most classes a dataset may have: a label of 2^40 would otherwise become an output layer
that cannot be allocated, blamed on the model instead of the labels."""
_SOURCE_HINT = "a .npz, .csv or .parquet file, or a folder with one sub-folder of images per class"
#: False while :meth:`FileSource.from_dict` rebuilds a source with ``check_files=False``.
_CHECK_FILES: ContextVar[bool] = ContextVar("dpsweep_check_files", default=True)


@dataclass(frozen=True)
class FileSource:
    """Where a ``file`` dataset's rows come from and how to read them; checked on creation,
    so a bad config fails before anything is read or trained."""

    path: str = ""
    factory: str = ""
    code_dir: str = ""
    label_column: str = "label"
    feature_columns: tuple[str, ...] = ()
    split_column: str = ""
    public_path: str = ""
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    num_classes: int = 0
    inputs: str = "features"

    def __post_init__(self) -> None:
        for name in ("path", "factory", "code_dir", "label_column", "split_column",
                     "public_path", "inputs"):
            if not isinstance(getattr(self, name), str):
                raise UserInputError(field=f"data.{name}", value=getattr(self, name),
                                     allowed="a string")
        object.__setattr__(self, "feature_columns", _names(self.feature_columns))
        object.__setattr__(self, "mean", _floats("data.mean", self.mean))
        object.__setattr__(self, "std", _floats("data.std", self.std))
        self._check_origin()
        self._check_columns()
        self._check_numbers()

    def _check_origin(self) -> None:
        if bool(self.path) == bool(self.factory):
            raise UserInputError(
                field="data.path", value=self.path or None,
                allowed="exactly one of data.path (" + _SOURCE_HINT + ") and data.factory"
                        + (" (both are set)" if self.path else " (neither is set)"))
        check = _CHECK_FILES.get()
        if check and self.code_dir and not Path(self.code_dir).expanduser().is_dir():
            raise UserInputError(field="data.code_dir", value=self.code_dir,
                                 allowed="an existing folder to import data.factory from")
        if self.factory:
            check_reference(field="data.factory", value=self.factory)
            if self.public_path:
                raise UserInputError(
                    field="data.public_path", value=self.public_path,
                    allowed="no public_path with data.factory (return public_x and public_y "
                            "from the factory instead)")
            return
        kind = path_kind("data.path", self.path, check=check)
        if self.public_path:
            if path_kind("data.public_path", self.public_path, check=check) != kind:
                raise UserInputError(field="data.public_path", value=self.public_path,
                                     allowed=f"a public pool of the same kind as data.path "
                                             f"({kind})")
            if _resolved(self.public_path) == _resolved(self.path):
                raise UserInputError(field="data.public_path", value=self.public_path,
                                     allowed="a different file from data.path (the public "
                                             "pool must not hold the private rows)")

    def _check_columns(self) -> None:
        if not self.label_column:
            raise UserInputError(field="data.label_column", value=self.label_column,
                                 allowed="a column name")
        if self.split_column and self.split_column == self.label_column:
            raise UserInputError(field="data.split_column", value=self.split_column,
                                 allowed="a column other than data.label_column")
        for column in (self.label_column, self.split_column):
            if column and column in self.feature_columns:
                raise UserInputError(field="data.feature_columns",
                                     value=list(self.feature_columns),
                                     allowed=f"feature columns without the label or split "
                                             f"column {column!r}")
        if self.kind != "table":
            for name in ("feature_columns", "split_column"):
                if getattr(self, name):
                    raise UserInputError(
                        field=f"data.{name}", value=getattr(self, name),
                        allowed=f"nothing for this source ({self.kind}): columns apply to "
                                f".csv and .parquet tables only")

    def _check_numbers(self) -> None:
        if len(self.mean) != len(self.std):
            raise UserInputError(field="data.std", value=list(self.std),
                                 allowed=f"as many values as data.mean ({len(self.mean)})")
        if any(s <= 0 for s in self.std):
            raise UserInputError(field="data.std", value=list(self.std),
                                 allowed="standard deviations > 0")
        count = self.num_classes
        if (isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0
                or count == 1 or count > MAX_CLASSES):
            raise UserInputError(field="data.num_classes", value=count,
                                 allowed=f"0 (inferred as the largest label + 1) or an "
                                         f"integer in [2, {MAX_CLASSES:,}]")
        object.__setattr__(self, "num_classes", int(count))
        if self.inputs not in INPUT_KINDS:
            raise UserInputError(field="data.inputs", value=self.inputs,
                                 allowed="one of " + ", ".join(map(repr, INPUT_KINDS)))
        if self.inputs == "tokens":
            if self.mean:
                raise UserInputError(field="data.mean", value=list(self.mean),
                                     allowed="no constants with data.inputs = 'tokens' "
                                             "(token ids are never normalised)")
            if self.kind == "images":
                raise UserInputError(field="data.inputs", value=self.inputs,
                                     allowed="'features' for a folder of images")

    @property
    def kind(self) -> str:
        """``"npz"``, ``"table"``, ``"images"`` or ``"factory"``."""
        return "factory" if self.factory else path_kind("data.path", self.path,
                                                          check=_CHECK_FILES.get())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (tuples as lists); :meth:`from_dict` gives the source back."""
        return {f.name: list(v) if isinstance(v, tuple) else v
                for f in fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check_files: bool = True) -> FileSource:
        """The source a config's ``data`` table (or :meth:`to_dict`) describes; unknown keys
        are refused by name, so a typo is not silently ignored. ``check_files=False`` skips
        the checks that need the files (a worker on another node, served the driver's pool
        through :func:`trainables.data.splits.share_pool`, only needs the source as a key)."""
        if not isinstance(data, Mapping):
            raise UserInputError(field="data", value=data, allowed="a table of file source "
                                                                   "fields")
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                raise UserInputError(field=f"data.{key}", value=data[key],
                                     allowed="a file source field: " + ", ".join(known))
        token = _CHECK_FILES.set(bool(check_files))
        try:
            return cls(**dict(data))
        finally:
            _CHECK_FILES.reset(token)

    def identity(self) -> str:
        """The source as sorted JSON: the key its pool is shared and cached under."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self) -> str:
        """A readable one-line description for ``DataSplits.source`` and reports."""
        if self.factory:
            where = f" from {_resolved(self.code_dir)}" if self.code_dir else ""
            return f"factory:{self.factory}{where}"
        text = f"file:{_resolved(self.path)}"
        return text + (f" (public: {_resolved(self.public_path)})" if self.public_path else "")

    def fingerprint(self) -> dict[str, str]:
        """SHA-256 of every file read, by field (``data.path``, ``data.public_path``; an image
        folder hashes its relative names and contents; a factory its ``code_dir``'s Python
        files), for the run's manifest: ``resume`` refuses data that changed."""
        if self.factory:
            return {"data.code_dir": tree_sha256(self.code_dir)} if self.code_dir else {}
        result = {"data.path": _path_sha256("data.path", self.path)}
        if self.public_path:
            result["data.public_path"] = _path_sha256("data.public_path", self.public_path)
        return result


def class_names(source: FileSource) -> tuple[str, ...]:
    """An image folder's class names in label order (the sorted folder names that
    :func:`read_source` numbers 0, 1, ...); empty for a source whose labels are bare integers."""
    if source.factory or source.kind != "images":
        return ()
    return tuple(d.name for d in class_dirs(Path(source.path).expanduser(), "data.path"))


def stat_signature(source: FileSource) -> tuple[tuple[str, int, int], ...]:
    """Path, size and mtime of every file the source reads, so a cache never serves a
    replaced file (a factory's output is cached by the source alone)."""
    files: list[Path] = []
    for field, value in (("data.path", source.path), ("data.public_path", source.public_path)):
        if value:
            path = Path(value).expanduser()
            files += [f for _, f in image_files(path, field)] if path.is_dir() else [path]
    signature = []
    for path in files:
        stat = path.stat()
        signature.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


# --- normalisation ------------------------------------------------------------------------


def pixel_scale(x: np.ndarray) -> float:
    """255 for uint8 pixels, else 1: what the inputs are divided by before normalising."""
    return 255.0 if x.dtype == np.uint8 else 1.0


def public_stats(x: np.ndarray, scale: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and std per index of axis 1 of ``x / scale``. Call it on public rows only (see
    the module's rule); a constant channel gets std 1: centred, not scaled."""
    means, stds = [], []
    for channel in range(x.shape[1]):
        values = x[:, channel].astype(np.float64) / scale
        means.append(float(values.mean()))
        constant = bool(values.max() == values.min())
        stds.append(1.0 if constant else float(values.std()))
    return tuple(means), tuple(stds)


def user_stats(source: FileSource, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The source's constants, one per index of axis 1 (a single value applies to all)."""
    if len(source.mean) not in (1, channels):
        raise UserInputError(field="data.mean", value=list(source.mean),
                             allowed=f"1 or {channels} values (one per channel or feature, "
                                     f"axis 1 of the inputs)")
    repeat = channels if len(source.mean) == 1 else 1
    return tuple(source.mean) * repeat, tuple(source.std) * repeat


# --- helpers ------------------------------------------------------------------------------


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise UserInputError(field="data.feature_columns", value=value,
                             allowed="a list of column names")
    if not all(isinstance(v, str) and v for v in value) or len(set(value)) != len(value):
        raise UserInputError(field="data.feature_columns", value=list(value),
                             allowed="distinct, non-empty column names")
    return tuple(value)


def _floats(field: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise UserInputError(field=field, value=value, allowed="a list of numbers")
    if not all(isinstance(v, int | float | np.number) and not isinstance(v, bool)
               and np.isfinite(v) for v in value):
        raise UserInputError(field=field, value=list(value), allowed="finite numbers")
    return tuple(float(v) for v in value)


def path_kind(field: str, value: str, *, check: bool = True) -> str:
    """The kind of source at ``value``; with ``check=False`` (files elsewhere) by suffix, an
    unknown one taken as an image folder."""
    path = Path(value).expanduser()
    if check and not path.exists():
        raise UserInputError(field=field, value=value,
                             allowed=_SOURCE_HINT + " (nothing is at that path)")
    if path.is_dir():
        return "images"
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return "npz"
    if suffix in TABLE_SUFFIXES:
        return "table"
    if not check:
        return "images"
    raise UserInputError(field=field, value=value,
                         allowed=_SOURCE_HINT + f" (unknown suffix {suffix or '(none)'!r})")


def _resolved(value: str) -> str:
    return str(Path(value).expanduser().resolve())


def _path_sha256(field: str, value: str) -> str:
    path = Path(value).expanduser()
    if not path.is_dir():
        return file_sha256(path)
    digest = hashlib.sha256()
    for _, image in image_files(path, field):
        digest.update(str(image.relative_to(path).as_posix()).encode() + b"\0")
        digest.update(file_sha256(image).encode() + b"\0")
    return digest.hexdigest()


def short_reason(exc: BaseException) -> str:
    """``Type: message`` on one line (library messages can span several)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def class_dirs(root: Path, field: str) -> list[Path]:
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not folders:
        raise UserInputError(field=field, value=str(root),
                             allowed="a folder with one sub-folder of images per class (it "
                                     "has no sub-folders)")
    return folders


def image_files(root: Path, field: str) -> list[tuple[str, Path]]:
    """(class name, file) of every image, sorted; hidden files are skipped, anything else that
    is not an image is refused (silently dropping rows would change the data)."""
    found = []
    for folder in class_dirs(root, field):
        for path in sorted(folder.iterdir()):
            if path.name.startswith("."):
                continue
            if not path.is_file() or path.suffix.lower() not in IMAGE_SUFFIXES:
                suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
                raise UserInputError(field=field, value=str(path),
                                     allowed=f"only image files ({suffixes}) in class folder "
                                             f"{folder.name!r}")
            found.append((folder.name, path))
    return found
