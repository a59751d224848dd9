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

from core.errors import UserInputError
from trainables.models.usercode import call_user, check_reference, file_sha256, resolve, tree_sha256

SPLIT_NAMES: tuple[str, ...] = ("train", "validation", "holdout", "test", "shadow")
"""Split names a user's split assignment may use; a row's code is its index here."""

TABLE_SUFFIXES: tuple[str, ...] = (".csv", ".parquet", ".pq")
IMAGE_SUFFIXES: frozenset[str] = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
IMAGE_MODES: dict[str, int] = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}
"""Image modes read as uint8 channels, and how many channels each gives."""

INPUT_KINDS: tuple[str, ...] = ("features", "tokens")
MAX_CLASSES = 100_000
"""Most classes a dataset may have: a label of 2^40 would otherwise become an output layer
that cannot be allocated, blamed on the model instead of the labels."""
_FACTORY_KEYS: tuple[str, ...] = ("x", "y", "public_x", "public_y", "split")
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
        kind = _path_kind("data.path", self.path, check=check)
        if self.public_path:
            if _path_kind("data.public_path", self.public_path, check=check) != kind:
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
        return "factory" if self.factory else _path_kind("data.path", self.path,
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
    return tuple(d.name for d in _class_dirs(Path(source.path).expanduser(), "data.path"))


def stat_signature(source: FileSource) -> tuple[tuple[str, int, int], ...]:
    """Path, size and mtime of every file the source reads, so a cache never serves a
    replaced file (a factory's output is cached by the source alone)."""
    files: list[Path] = []
    for field, value in (("data.path", source.path), ("data.public_path", source.public_path)):
        if value:
            path = Path(value).expanduser()
            files += [f for _, f in _image_files(path, field)] if path.is_dir() else [path]
    signature = []
    for path in files:
        stat = path.stat()
        signature.append((str(path.resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FileData:
    """A source's checked rows: private ``x``/``y``, the optional public pool, the user's split
    per private row (codes into :data:`SPLIT_NAMES`) or None, and the class count."""

    x: np.ndarray
    y: np.ndarray
    public_x: np.ndarray | None
    public_y: np.ndarray | None
    split: np.ndarray | None
    num_classes: int
    source: str


@dataclass(frozen=True)
class _Origin:
    """Which config field to blame for a problem in some rows, and how to name a position."""

    field: str
    value: str
    columns: tuple[str, ...] = ()
    part: str = ""  # the labels' place inside the file (an .npz's array), for their messages

    def error(self, allowed: str) -> UserInputError:
        return UserInputError(field=self.field, value=self.value, allowed=allowed)

    def where(self, index: tuple[int, ...]) -> str:
        text = f"row {index[0]}"
        if self.columns and len(index) == 2:
            return f"{text}, column {self.columns[index[1]]!r}"
        return text + (f", position {tuple(int(i) for i in index[1:])}" if len(index) > 1 else "")


@dataclass(frozen=True, eq=False)
class _Raw:
    """Unchecked arrays as a reader found them, with the fields to blame for each part."""

    x: Any
    y: Any
    origin: _Origin
    labels: _Origin
    split: Any = None
    splits: _Origin | None = None
    classes: tuple[str, ...] = ()


def read_source(source: FileSource) -> FileData:
    """Read and check every row of ``source``: one UserInputError line for the first problem."""
    if source.factory:
        private, public = _read_factory(source)
    else:
        origin = _Origin("data.path", source.path)
        private = _read_path(source, origin, private=None)
        public = None
        if source.public_path:
            public = _read_path(source, _Origin("data.public_path", source.public_path),
                                private=private)
    x = _check_x(private.x, private.origin, source.inputs)
    y = _check_y(private.y, len(x), private.labels)
    public_x = public_y = None
    if public is not None:
        public_x = _check_x(public.x, public.origin, source.inputs)
        if public_x.shape[1:] != x.shape[1:]:
            raise public.origin.error(f"public examples of the private ones' shape "
                                      f"{x.shape[1:]}; they have {public_x.shape[1:]}")
        if (public_x.dtype == np.uint8) != (x.dtype == np.uint8):
            raise public.origin.error(f"the private rows' pixel type (both uint8 or neither: "
                                      f"{x.dtype} and {public_x.dtype})")
        public_y = _check_y(public.y, len(public_x), public.labels)
    split = None
    if private.split is not None:
        assert private.splits is not None
        split = _split_codes(private.split, private.splits, n=len(x),
                             has_public=public is not None)
    labelled = [(private.labels, y)]
    if public is not None and public_y is not None:
        labelled.append((public.labels, public_y))
    num_classes = _num_classes(source, labelled)
    return FileData(x=x, y=y, public_x=public_x, public_y=public_y, split=split,
                    num_classes=num_classes, source=source.describe())


def _read_path(source: FileSource, origin: _Origin, *, private: _Raw | None) -> _Raw:
    """The private file's rows, or (``private`` given) the public file's, read like them: the
    same class names and feature columns; a public split assignment is ignored."""
    path = Path(origin.value).expanduser()
    kind = _path_kind(origin.field, origin.value)
    if kind == "images":
        return _read_images(path, origin, classes=private.classes if private else ())
    if kind == "table":
        return _read_table(path, origin, source, private=private)
    return _read_npz(path, origin, public=private is not None)


def _read_npz(path: Path, origin: _Origin, *, public: bool) -> _Raw:
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as exc:  # any unreadable file is bad input
        raise origin.error(f"a readable .npz file ({_short(exc)})") from None
    if not hasattr(archive, "files"):
        raise origin.error("an .npz archive (this is a single .npy array)")
    with archive:
        names = list(archive.files)
        if "x" not in names or "y" not in names:
            raise origin.error(f"an .npz with arrays 'x' and 'y' (and optionally 'split'); "
                               f"it holds {names}")
        try:
            x, y = archive["x"], archive["y"]
            split = archive["split"] if "split" in names else None
        except Exception as exc:  # object arrays need pickle: refused
            raise origin.error(f"numeric arrays stored without pickle ({_short(exc)})") from None
    labels = _Origin(origin.field, origin.value, part="array 'y', ")
    return _Raw(x=x, y=y, origin=origin, labels=labels, split=None if public else split,
                splits=origin)


def _read_table(path: Path, origin: _Origin, source: FileSource, *,
                private: _Raw | None) -> _Raw:
    frame = _read_frame(path, origin)
    present = [str(c) for c in frame.columns]
    frame.columns = present
    shown = ", ".join(present[:100]) + (f", ... ({len(present)} in all)" if len(present) > 100
                                       else "")
    listing = f"a column of {path.name} (its columns: {shown})"
    if source.label_column not in present:
        raise UserInputError(field="data.label_column", value=source.label_column,
                             allowed=listing)
    split = None
    if source.split_column and private is None:
        if source.split_column not in present:
            raise UserInputError(field="data.split_column", value=source.split_column,
                                 allowed=listing)
        split = frame[source.split_column].astype(str).to_numpy()
    features = source.feature_columns or (private.origin.columns if private else tuple(
        c for c in present if c not in (source.label_column, source.split_column)))
    absent = [c for c in features if c not in present]
    if absent:
        raise UserInputError(field="data.feature_columns", value=absent[0] if len(absent) == 1
                             else absent, allowed=listing)
    if not features:
        raise UserInputError(field="data.feature_columns", value=[],
                             allowed=f"at least one feature column besides the label and split "
                                     f"columns in {path.name}")
    columns = [_numeric_column(frame[c], c) for c in features]
    return _Raw(x=np.column_stack(columns), y=_numeric_column(frame[source.label_column]),
                origin=_Origin(origin.field, origin.value, columns=tuple(features)),
                labels=_Origin("data.label_column", source.label_column), split=split,
                splits=_Origin("data.split_column", source.split_column))


def _read_frame(path: Path, origin: _Origin) -> Any:
    import pandas as pd

    try:
        if path.suffix.lower() == ".csv":
            return pd.read_csv(path)
        return pd.read_parquet(path)
    except Exception as exc:  # any unreadable table is bad input
        raise origin.error(f"a readable {path.suffix} table ({_short(exc)})") from None


def _numeric_column(column: Any, feature: str | None = None) -> np.ndarray:
    """A column as a numpy array (nullable integers with gaps as float NaN); a feature column
    of text is refused here, naming it, because the default takes every other column."""
    import pandas as pd

    if feature is not None and not pd.api.types.is_numeric_dtype(column.dtype):
        sample = column.iloc[0] if len(column) else None
        raise UserInputError(field="data.feature_columns", value=feature,
                             allowed=f"numeric feature columns; {feature!r} holds "
                                     f"{column.dtype} values such as {sample!r} (list the "
                                     f"features in data.feature_columns to leave it out)")
    values = column.to_numpy()
    if values.dtype == object and pd.api.types.is_numeric_dtype(column.dtype):
        values = column.to_numpy(dtype=np.float64, na_value=np.nan)
    return values


def _class_dirs(root: Path, field: str) -> list[Path]:
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not folders:
        raise UserInputError(field=field, value=str(root),
                             allowed="a folder with one sub-folder of images per class (it "
                                     "has no sub-folders)")
    return folders


def _image_files(root: Path, field: str) -> list[tuple[str, Path]]:
    """(class name, file) of every image, sorted; hidden files are skipped, anything else that
    is not an image is refused (silently dropping rows would change the data)."""
    found = []
    for folder in _class_dirs(root, field):
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


def _read_images(root: Path, origin: _Origin, *, classes: tuple[str, ...]) -> _Raw:
    """Class-per-folder images as uint8 [N, C, H, W]; the public folder's class names map to
    the private folder's ids, so both agree on what label 3 means."""
    from PIL import Image

    files = _image_files(root, origin.field)
    names = classes or tuple(d.name for d in _class_dirs(root, origin.field))
    seen = {name for name, _ in files}
    if not files:
        raise origin.error("a folder holding at least one image")
    if not classes and seen != set(names):
        raise origin.error(f"at least one image in every class folder (none in "
                           f"{sorted(set(names) - seen)})")
    if classes and not seen <= set(classes):
        raise origin.error(f"class folders named as in data.path {list(classes)} (unknown: "
                           f"{sorted(seen - set(classes))})")
    ids = {name: i for i, name in enumerate(names)}
    arrays, labels = [], []
    first: tuple[Path, str, tuple[int, int]] | None = None
    for name, path in files:
        try:
            with Image.open(path) as image:
                image.load()
                mode, size, pixels = image.mode, image.size, np.asarray(image)
        except Exception as exc:  # an unreadable image is bad input
            raise UserInputError(field=origin.field, value=str(path),
                                 allowed=f"a readable image ({_short(exc)})") from None
        if mode not in IMAGE_MODES:
            raise UserInputError(field=origin.field, value=str(path),
                                 allowed=f"an image in mode {', '.join(IMAGE_MODES)} (this one "
                                         f"is {mode}: convert it)")
        first = first or (path, mode, size)
        if (mode, size) != first[1:]:
            raise UserInputError(field=origin.field, value=str(path),
                                 allowed=f"every image in the mode and size of {first[0]} "
                                         f"({first[1]}, {first[2][0]}x{first[2][1]}); this one "
                                         f"is {mode}, {size[0]}x{size[1]}")
        arrays.append(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1))
        labels.append(ids[name])
    return _Raw(x=np.stack(arrays), y=np.asarray(labels, dtype=np.int64), origin=origin,
                labels=origin, classes=tuple(names))


def _read_factory(source: FileSource) -> tuple[_Raw, _Raw | None]:
    origin = _Origin("data.factory", source.factory)
    fn = resolve(field="data.factory", reference=source.factory,
                 code_dir=source.code_dir or None)
    result = call_user(field="data.factory", fn=fn, reference=source.factory)
    if isinstance(result, Mapping):
        return _factory_dict(result, origin)
    if isinstance(result, tuple | list) and len(result) == 2:
        return _Raw(x=_as_array(result[0], origin, "x"), y=_as_array(result[1], origin, "y"),
                    origin=origin, labels=origin), None
    if (hasattr(result, "__getitem__") and hasattr(result, "__len__")
            and not isinstance(result, str | bytes | np.ndarray | tuple | list)
            and not hasattr(result, "detach")):
        return _from_dataset(result, origin), None
    raise origin.error(f"a factory returning (x, y) arrays, a dict with keys "
                       f"{', '.join(_FACTORY_KEYS)} (x and y required), or a map-style Dataset "
                       f"of (x, y) items; it returned {type(result).__name__}")


def _factory_dict(result: Mapping[Any, Any], origin: _Origin) -> tuple[_Raw, _Raw | None]:
    unknown = [key for key in result if key not in _FACTORY_KEYS]
    missing = [key for key in ("x", "y") if key not in result]
    if unknown or missing:
        raise origin.error(f"a dict with keys {', '.join(_FACTORY_KEYS)} (x and y required); "
                           f"it has {sorted(map(str, result))}")
    if ("public_x" in result) != ("public_y" in result):
        raise origin.error("public_x and public_y together (or neither)")
    private = _Raw(x=_as_array(result["x"], origin, "x"), y=_as_array(result["y"], origin, "y"),
                   origin=origin, labels=origin, splits=origin,
                   split=None if result.get("split") is None
                   else np.asarray(result["split"]).astype(str))
    if "public_x" not in result:
        return private, None
    public = _Origin("data.factory", f"{origin.value} (public_x, public_y)")
    return private, _Raw(x=_as_array(result["public_x"], public, "public_x"),
                         y=_as_array(result["public_y"], public, "public_y"),
                         origin=public, labels=public)


def _from_dataset(dataset: Any, origin: _Origin) -> _Raw:
    """A map-style Dataset's items stacked into arrays (every item read once, in order)."""
    try:
        count = len(dataset)
    except Exception as exc:  # e.g. an IterableDataset
        raise origin.error(f"a map-style Dataset with a length ({_short(exc)})") from None
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for i in range(count):
        try:
            item = dataset[i]
        except Exception as exc:  # the user's code
            raise origin.error(f"a Dataset whose items can be read; item {i} raised "
                               f"{_short(exc)}") from None
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise origin.error(f"a Dataset of (x, y) items; item {i} is a "
                               f"{type(item).__name__}")
        x_i = _as_array(item[0], origin, f"item {i}'s x")
        y_i = _as_array(item[1], origin, f"item {i}'s y")
        if xs and x_i.shape != xs[0].shape:
            raise origin.error(f"items of one shape; item 0 has {xs[0].shape}, item {i} has "
                               f"{x_i.shape}")
        if y_i.size != 1:
            raise origin.error(f"one label per item; item {i}'s y has shape {y_i.shape}")
        xs.append(x_i)
        ys.append(y_i.reshape(()))
    if not xs:
        raise origin.error("a Dataset with at least one item")
    return _Raw(x=np.stack(xs), y=np.stack(ys), origin=origin, labels=origin)


def _as_array(value: Any, origin: _Origin, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged lists and the like
        raise origin.error(f"{name} as one numeric array ({_short(exc)})") from None
    if array.dtype == object:
        raise origin.error(f"{name} as one numeric array (it has dtype object: ragged rows or "
                           f"mixed values?)")
    return array


# --- checks -------------------------------------------------------------------------------


def _check_x(x: Any, origin: _Origin, inputs: str) -> np.ndarray:
    """Numeric, at least 2-D, finite; token ids integral and >= 0 (as int64)."""
    x = np.asarray(x)
    if x.dtype == bool:
        x = x.astype(np.int64 if inputs == "tokens" else np.float32)
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise origin.error(f"numeric inputs; they have dtype {x.dtype}")
    if x.ndim < 2:
        raise origin.error(f"inputs of shape [N, ...] with at least one feature axis; they have "
                           f"shape {x.shape}")
    if len(x) == 0:
        raise origin.error("at least one example")
    floating = np.issubdtype(x.dtype, np.floating)
    if floating and not np.isfinite(x).all():
        index = tuple(np.argwhere(~np.isfinite(x))[0])
        raise origin.error(f"finite inputs; {origin.where(index)} holds {x[index]}")
    if inputs != "tokens":
        return x
    if floating and not (x == np.floor(x)).all():
        index = tuple(np.argwhere(x != np.floor(x))[0])
        raise origin.error(f"integer token ids; {origin.where(index)} holds {x[index]}")
    if (x < 0).any():
        index = tuple(np.argwhere(x < 0)[0])
        raise origin.error(f"token ids >= 0; {origin.where(index)} holds {x[index]}")
    return x.astype(np.int64)


def _check_y(y: Any, n: int, origin: _Origin) -> np.ndarray:
    """One integral, non-negative label per example, as int64."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise origin.error(f"one label per example (shape [N]); the labels have shape {y.shape}")
    if len(y) != n:
        raise origin.error(f"as many labels as examples: the inputs have {n} rows, the labels "
                           f"{len(y)}")
    if y.dtype == bool or not (np.issubdtype(y.dtype, np.integer)
                               or np.issubdtype(y.dtype, np.floating)):
        raise origin.error(f"integer class labels; they have dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating):
        bad = ~np.isfinite(y) | (y != np.floor(np.where(np.isfinite(y), y, 0)))
        if bad.any():
            row = int(np.argmax(bad))
            raise origin.error(f"integer class labels; row {row} holds {y[row]}")
    if (y < 0).any():
        row = int(np.argmax(y < 0))
        raise origin.error(f"class labels >= 0; row {row} holds {y[row]}")
    if (y >= MAX_CLASSES).any():
        row = int(np.argmax(y >= MAX_CLASSES))
        raise origin.error(f"class labels below {MAX_CLASSES:,} (at most that many classes; "
                           f"num_classes is the largest label + 1): {origin.part}row {row} "
                           f"holds {y[row]}")
    return y.astype(np.int64)


def _split_codes(values: Any, origin: _Origin, *, n: int, has_public: bool) -> np.ndarray:
    """Per-row split codes from split names; every split gets a row (the public pool, when
    given, is the shadow split, so no private row may be assigned to shadow)."""
    names = np.asarray(values).astype(str).reshape(-1)
    if len(names) != n:
        raise origin.error(f"one split name per example ({n}); there are {len(names)}")
    present = [str(v) for v in np.unique(names)]
    unknown = [v for v in present if v not in SPLIT_NAMES]
    if unknown:
        row = int(np.argmax(names == unknown[0]))
        raise UserInputError(field=origin.field, value=unknown[0],
                             allowed=f"split names among {', '.join(SPLIT_NAMES)} (row {row} "
                                     f"holds {unknown[0]!r})")
    if has_public and "shadow" in present:
        raise origin.error("no 'shadow' rows when a public pool is given (the public pool is "
                           "the shadow split)")
    needed = SPLIT_NAMES[:4] if has_public else SPLIT_NAMES
    missing = [name for name in needed if name not in present]
    if missing:
        raise origin.error(f"at least one row in every split; none for {', '.join(missing)}")
    codes = np.zeros(n, dtype=np.int8)
    for code, name in enumerate(SPLIT_NAMES):
        codes[names == name] = code
    return codes


def _num_classes(source: FileSource, labelled: list[tuple[_Origin, np.ndarray]]) -> int:
    """``source.num_classes`` when given (every label below it), else the largest label + 1."""
    if source.num_classes:
        for part, (_, y) in zip(("private", "public"), labelled, strict=False):
            if (y >= source.num_classes).any():
                row = int(np.argmax(y >= source.num_classes))
                raise UserInputError(
                    field="data.num_classes", value=source.num_classes,
                    allowed=f"more classes than the labels use: {part} row {row} holds label "
                            f"{y[row]} (labels run 0..num_classes-1)")
        return source.num_classes
    top = max(int(y.max()) for _, y in labelled)
    if top < 1:
        raise labelled[0][0].error("labels of at least two classes (every label is 0)")
    return top + 1


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


def _path_kind(field: str, value: str, *, check: bool = True) -> str:
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
    for _, image in _image_files(path, field):
        digest.update(str(image.relative_to(path).as_posix()).encode() + b"\0")
        digest.update(file_sha256(image).encode() + b"\0")
    return digest.hexdigest()


def _short(exc: BaseException) -> str:
    """``Type: message`` on one line (library messages can span several)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]
