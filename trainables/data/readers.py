"""Reading a user's data source into checked arrays: the readers of each kind of source
(``.npz``, tables, image folders, a factory) and the row checks every one of them ends in.

What a source is and how it is configured is :mod:`trainables.data.files`; this module is
where pandas and Pillow are needed, so it is imported only when file data is actually read
(``trainables.data.splits``), never by a command that only validates a config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from dpsweep.core.errors import UserInputError
from dpsweep.core.vocabulary import SPLIT_NAMES
from dpsweep.trainables.data.files import (
    MAX_CLASSES,
    FileSource,
    class_dirs,
    image_files,
    path_kind,
    short_reason,
)
from dpsweep.trainables.models.usercode import call_user, resolve

#: Image modes read as uint8 channels, and how many channels each gives.
IMAGE_MODES: dict[str, int] = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}
#: The arrays a factory may return.
_FACTORY_KEYS: tuple[str, ...] = ("x", "y", "public_x", "public_y", "split")


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
    kind = path_kind(origin.field, origin.value)
    if kind == "images":
        return _read_images(path, origin, classes=private.classes if private else ())
    if kind == "table":
        return _read_table(path, origin, source, private=private)
    return _read_npz(path, origin, public=private is not None)


def _read_npz(path: Path, origin: _Origin, *, public: bool) -> _Raw:
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as exc:  # any unreadable file is bad input
        raise origin.error(f"a readable .npz file ({short_reason(exc)})") from None
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
            raise origin.error(
                f"numeric arrays stored without pickle ({short_reason(exc)})") from None
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
    try:
        if path.suffix.lower() == ".csv":
            return pd.read_csv(path)
        return pd.read_parquet(path)
    except Exception as exc:  # any unreadable table is bad input
        raise origin.error(f"a readable {path.suffix} table ({short_reason(exc)})") from None


def _numeric_column(column: Any, feature: str | None = None) -> np.ndarray:
    """A column as a numpy array (nullable integers with gaps as float NaN); a feature column
    of text is refused here, naming it, because the default takes every other column."""
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


def _read_images(root: Path, origin: _Origin, *, classes: tuple[str, ...]) -> _Raw:
    """Class-per-folder images as uint8 [N, C, H, W]; the public folder's class names map to
    the private folder's ids, so both agree on what label 3 means."""
    files = image_files(root, origin.field)
    names = classes or tuple(d.name for d in class_dirs(root, origin.field))
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
                                 allowed=f"a readable image ({short_reason(exc)})") from None
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
        raise origin.error(f"a map-style Dataset with a length ({short_reason(exc)})") from None
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for i in range(count):
        try:
            item = dataset[i]
        except Exception as exc:  # the user's code
            raise origin.error(f"a Dataset whose items can be read; item {i} raised "
                               f"{short_reason(exc)}") from None
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
        raise origin.error(f"{name} as one numeric array ({short_reason(exc)})") from None
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
