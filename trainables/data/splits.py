"""Datasets and the four disjoint, seeded splits every trial and audit works from.

A membership audit is only sound when the members (``train``) and non-members (``holdout``)
come from the same distribution and never overlap, and when the attacker's ``shadow`` pool
and the accuracy ``test`` set are disjoint from both. Model selection reads only the private
``validation`` split, so the reported test accuracy of a picked model is not selection-biased.
Every split therefore carries the indices of its examples in the dataset's pooled example list
(official train set first, then the official test set), so the separation can be checked
rather than trusted.

Normalisation uses constants fixed in this file, never statistics of the loaded data: a
mean or standard deviation computed over the private examples would itself be an
unaccounted release of them. The ``file`` dataset (:mod:`trainables.data.files`: any .npz,
table, image folder or factory) takes its constants from the user, else from the public pool,
else from the shadow split, which is public by the design.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpsweep.core.datasets import DATASET_NAMES, FILE_DATASET, INPUT_SHAPES, NUM_CLASSES
from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.core.vocabulary import SPLIT_NAMES
from dpsweep.trainables.data.files import (
    FileSource,
    pixel_scale,
    public_stats,
    stat_signature,
    user_stats,
)
from dpsweep.trainables.data.pools import (
    DEBIAN_FASHION_MNIST_DIR,
    RawPool,
    digits_pool,
    download_root,
    fashion_mnist_dir,
    file_signature,
    idx_pool,
    torchvision_pool,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

@dataclass(frozen=True)
class Normalization:
    """Fixed per-dataset constants: ``x / max_value`` maps pixels to [0, 1], then per channel
    ``(x - mean) / std``."""

    max_value: float
    mean: tuple[float, ...]
    std: tuple[float, ...]


NORMALIZATION: dict[str, Normalization] = {
    # Round numbers written down once, close to the public UCI digits' overall pixel
    # statistics after /16 (about 0.305 and 0.376); a pixel of 0 maps to -0.3/0.37 and
    # a pixel of 16 to 0.7/0.37. They are never recomputed from a split.
    "digits": Normalization(max_value=16.0, mean=(0.3,), std=(0.37,)),
    # The customary published constants for the other three datasets.
    "fashion-mnist": Normalization(max_value=255.0, mean=(0.2860,), std=(0.3530,)),
    "mnist": Normalization(max_value=255.0, mean=(0.1307,), std=(0.3081,)),
    "cifar10": Normalization(
        max_value=255.0, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)
    ),
}

_SIZE_FIELDS: dict[str, str] = {
    "train": "data.train_size",
    "validation": "data.validation_size",
    "holdout": "data.holdout_size",
    "test": "data.test_size",
    "shadow": "data.shadow_size",
}


@dataclass(frozen=True)
class SplitSizes:
    """How many examples each split gets; every split needs at least one example, because an
    empty holdout or shadow pool silently turns the membership audit into a no-op."""

    train: int
    validation: int
    holdout: int
    test: int
    shadow: int

    def __post_init__(self) -> None:
        for name, field in _SIZE_FIELDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise UserInputError(field=field, value=value, allowed="an integer >= 1")


DEFAULT_SIZES: dict[str, SplitSizes] = {
    # No official test set: all five are slices of the 1,797 examples (sums to 1,797).
    "digits": SplitSizes(train=500, validation=200, holdout=300, test=297, shadow=500),
    # train/validation/holdout/shadow from the official 60k train set, test = official 10k.
    "fashion-mnist": SplitSizes(train=30_000, validation=5_000, holdout=10_000, test=10_000,
                                shadow=15_000),
    "mnist": SplitSizes(train=30_000, validation=5_000, holdout=10_000, test=10_000,
                        shadow=15_000),
    # train/validation/holdout/shadow from the official 50k train set, test = official 10k.
    "cifar10": SplitSizes(train=25_000, validation=5_000, holdout=5_000, test=10_000,
                          shadow=15_000),
}


@dataclass(frozen=True, eq=False)
class Split:
    """One split: normalised float32 inputs ``[N, C, H, W]`` (``file`` data: ``[N, *shape]``,
    int64 for token ids), int64 labels, and the pool indices they came from (for provenance
    and the no-overlap check)."""

    x: torch.Tensor
    y: torch.Tensor
    indices: np.ndarray

    def __post_init__(self) -> None:
        if not (len(self.x) == len(self.y) == len(self.indices)):
            raise ValueError(
                f"split parts disagree in length: x {len(self.x)}, y {len(self.y)}, "
                f"indices {len(self.indices)}"
            )

    def __len__(self) -> int:
        return len(self.indices)


@dataclass(frozen=True, eq=False)
class DataSplits:
    """The five disjoint splits of one dataset for one seed, plus what a model needs to know
    about them. ``source`` records where the raw data was read from; ``input_shape`` is one
    example's shape (``(C, H, W)`` for images, ``(D,)`` for tables, ``(T,)`` for tokens) and
    ``normalization`` the constants the inputs were normalised with (None: token ids), which
    a model needs again at inference."""

    name: str
    train: Split
    validation: Split
    holdout: Split
    test: Split
    shadow: Split
    num_classes: int
    input_shape: tuple[int, ...]
    source: str
    seed: int
    normalization: Normalization | None = None


@dataclass(frozen=True, eq=False)
class FilePool(RawPool):
    """A ``file`` dataset's rows: the private rows, then ``n_public`` public-pool rows (the
    shadow split's source when given), so split indices address both. ``assignment`` is the
    user's split per private row (codes into ``SPLIT_NAMES``) or None; ``n_train`` is every
    row (no official test set)."""

    n_public: int = 0
    assignment: np.ndarray | None = None
    num_classes: int = 0
    tokens: bool = False

    @property
    def n_private(self) -> int:
        return len(self.y) - self.n_public


@dataclass(frozen=True)
class Available:
    """How many examples a dataset offers: ``pool`` feeds train, holdout and shadow (and test
    too when ``test`` is None, i.e. the dataset has no official test set).

    For ``file`` data ``pool`` counts the private rows; ``public`` the public pool's rows (it
    then feeds the shadow split instead of ``pool``); ``assigned`` the split sizes a user's
    split assignment fixes (configured sizes must equal them or be left at their defaults).
    """

    pool: int
    test: int | None
    public: int | None = None
    assigned: SplitSizes | None = None


def load_splits(
    *,
    dataset: str,
    seed: int = 0,
    sizes: SplitSizes | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    source: FileSource | None = None,
) -> DataSplits:
    """Load ``dataset`` and cut the five disjoint splits for ``seed``.

    With an official test set, ``test`` is the first ``sizes.test`` examples of a seeded
    permutation of it, and train/validation/holdout/shadow are consecutive slices of a seeded
    permutation of the official train set. Without one (digits), all five are consecutive
    slices of a single permutation. ``data_dir`` is ignored for digits (bundled with
    scikit-learn), so one configured data directory can serve every dataset. ``"file"``
    reads ``source`` instead (see :func:`_file_split_indices`); named datasets ignore it.
    """
    _check_dataset(dataset)
    _check_seed(seed)
    if dataset == FILE_DATASET:
        return _file_splits(source=_need_source(source), seed=seed, sizes=sizes)
    sizes = DEFAULT_SIZES[dataset] if sizes is None else sizes
    pool = load_pool(dataset=dataset, data_dir=data_dir)
    index_sets = _split_indices(dataset=dataset, pool=pool, sizes=sizes, seed=seed)
    splits = {
        name: Split(
            x=normalise(pool.x[indices], dataset=dataset),
            y=torch.from_numpy(pool.y[indices].astype(np.int64)),
            indices=indices,
        )
        for name, indices in index_sets.items()
    }
    return DataSplits(
        name=dataset,
        train=splits["train"],
        validation=splits["validation"],
        holdout=splits["holdout"],
        test=splits["test"],
        shadow=splits["shadow"],
        num_classes=NUM_CLASSES[dataset],
        input_shape=INPUT_SHAPES[dataset],
        source=pool.source,
        seed=seed,
        normalization=NORMALIZATION[dataset],
    )


def available_size(dataset: str, data_dir: str | os.PathLike[str] | None = None, *,
                   source: FileSource | None = None) -> Available:
    """How many examples ``dataset`` offers, so callers can validate sizes up front."""
    _check_dataset(dataset)
    if dataset == FILE_DATASET:
        pool = _file_pool_of(source)
        return Available(pool=pool.n_private, test=None, public=pool.n_public or None,
                         assigned=_assigned_sizes(pool))
    pool = load_pool(dataset=dataset, data_dir=data_dir)
    return Available(pool=pool.n_train, test=pool.n_test if pool.n_test else None)


def check_available(*, dataset: str, data_dir: str | os.PathLike[str] | None = None,
                    source: FileSource | None = None) -> str:
    """Where the dataset's files are, without downloading anything; UserInputError if nowhere.

    ``dpsweep config --check`` calls this so a config is not declared runnable on a machine
    without its data (torchvision would only try to download it when the first trial starts).
    ``file`` data is read and checked in full here, so bad rows fail the check, not a trial.
    """
    _check_dataset(dataset)
    if dataset == FILE_DATASET:
        return _file_pool_of(source).source
    if dataset == "digits":
        return "bundled with scikit-learn"
    if dataset == "fashion-mnist":
        idx_dir = fashion_mnist_dir(data_dir)
        if idx_dir is not None:
            return str(idx_dir)
    root = Path(data_dir).expanduser() if data_dir is not None else download_root()
    folder = {"fashion-mnist": "FashionMNIST", "mnist": "MNIST",
              "cifar10": "cifar-10-batches-py"}[dataset]
    if (root / folder).is_dir():
        return str(root / folder)
    raise UserInputError(
        field="data.data_dir", value=str(data_dir or root),
        allowed=f"a directory holding {dataset} ({folder}/ under it"
                + (f", or Debian's {DEBIAN_FASHION_MNIST_DIR}: `make data`"
                   if dataset == "fashion-mnist" else "")
                + "); it is not on this machine and would have to be downloaded")


#: Pools handed to this process by whoever read them (a sweep's driver, through Ray's object
#: store: read once per sweep, mapped once per node), by (dataset, data directory), or for
#: ``file`` data by (``"file"``, the source's identity: its fields as sorted JSON).
_SHARED: dict[tuple[str, str | None], RawPool] = {}


def _pool_key(dataset: str, data_dir: str | os.PathLike[str] | None,
              source: FileSource | None = None) -> tuple[str, str | None]:
    if dataset == FILE_DATASET:
        return dataset, _need_source(source).identity()
    return dataset, None if data_dir is None or dataset == "digits" else str(data_dir)


def share_pool(pool: RawPool, *, dataset: str,
               data_dir: str | os.PathLike[str] | None = None,
               source: FileSource | None = None) -> None:
    """Serve ``dataset`` from ``pool`` in this process instead of reading it again (a worker
    then needs neither scikit-learn nor the files). The pool must be one :func:`load_pool`
    returned for the same arguments in another process of this run."""
    _check_dataset(dataset)
    expected = FilePool if dataset == FILE_DATASET else RawPool
    if not isinstance(pool, expected):
        raise TypeError(f"expected a {expected.__name__}, got {type(pool).__name__}")
    _SHARED[_pool_key(dataset, data_dir, source)] = pool


def load_pool(*, dataset: str, data_dir: str | os.PathLike[str] | None = None,
              source: FileSource | None = None) -> RawPool:
    """The raw pooled examples of ``dataset``, from the in-process cache when already read
    (a :class:`FilePool` for ``"file"``: read from ``source`` and checked)."""
    _check_dataset(dataset)
    shared = _SHARED.get(_pool_key(dataset, data_dir, source))
    if shared is not None:
        return shared
    if dataset == FILE_DATASET:
        assert source is not None  # _pool_key refused None
        return _file_pool(source, stat_signature(source))
    if dataset == "digits":
        return digits_pool()
    if dataset == "fashion-mnist":
        idx_dir = fashion_mnist_dir(data_dir)
        if idx_dir is not None:
            return idx_pool(idx_dir, file_signature(idx_dir))
    root = Path(data_dir).expanduser() if data_dir is not None else download_root()
    return torchvision_pool(dataset, str(root.resolve()))


def normalise(x_raw: np.ndarray, *, dataset: str,
              normalization: Normalization | None = None) -> torch.Tensor:
    """Raw inputs to float32 with the dataset's fixed constants, per index of axis 1 (the
    channel of ``[N, C, H, W]`` pixels, the feature of ``[N, D]`` rows). ``file`` data has no
    fixed constants: pass its ``DataSplits.normalization``."""
    _check_dataset(dataset)
    norm = normalization or NORMALIZATION.get(dataset)
    if norm is None:
        raise ValueError(f"{dataset!r} data has no fixed constants: pass the normalization "
                         f"its DataSplits carry")
    x = x_raw.astype(np.float32) / np.float32(norm.max_value)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = np.asarray(norm.mean, dtype=np.float32).reshape(shape)
    std = np.asarray(norm.std, dtype=np.float32).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray((x - mean) / std))


# --- validation -------------------------------------------------------------------------


def _check_dataset(dataset: object) -> None:
    if dataset not in DATASET_NAMES and dataset != FILE_DATASET:
        raise UserInputError(
            field="data.dataset",
            value=dataset,
            allowed="one of " + ", ".join(repr(name) for name in (*DATASET_NAMES, FILE_DATASET)),
        )


def _need_source(source: FileSource | None) -> FileSource:
    if not isinstance(source, FileSource):
        raise UserInputError(field="data.path", value=None if source is None else source,
                             allowed=f"a data file, folder or factory for dataset "
                                     f"{FILE_DATASET!r}")
    return source


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise UserInputError(field="data.seed", value=seed, allowed="an integer >= 0")


def _split_indices(
    *, dataset: str, pool: RawPool, sizes: SplitSizes, seed: int
) -> dict[str, np.ndarray]:
    """Pool indices of each split; checks the sizes fit what the pool offers."""
    rng = np.random.default_rng(seed)
    has_test = pool.n_test > 0
    from_pool = (
        ("train", "validation", "holdout", "shadow") if has_test
        else ("train", "validation", "holdout", "shadow", "test")
    )
    wanted = sum(getattr(sizes, name) for name in from_pool)
    if wanted > pool.n_train:
        part = "official train set" if has_test else "dataset"
        raise UserInputError(
            field="data.sizes",
            value={name: getattr(sizes, name) for name in from_pool},
            allowed=(
                f"{' + '.join(from_pool)} <= {pool.n_train}, the number of examples in the "
                f"{dataset} {part} (asked for {wanted})"
            ),
        )
    if has_test and sizes.test > pool.n_test:
        raise UserInputError(
            field="data.test_size",
            value=sizes.test,
            allowed=(
                f"at most {pool.n_test}, the number of examples in the {dataset} official test set"
            ),
        )
    order = rng.permutation(pool.n_train)
    result: dict[str, np.ndarray] = {}
    start = 0
    for name in from_pool:
        stop = start + getattr(sizes, name)
        result[name] = order[start:stop].astype(np.int64)
        start = stop
    if has_test:
        result["test"] = (pool.n_train + rng.permutation(pool.n_test)[: sizes.test]).astype(
            np.int64
        )
    return result


# --- file data --------------------------------------------------------------------------


def default_file_sizes(n: int, *, has_public: bool, public_n: int) -> SplitSizes:
    """Sizes for ``n`` private rows: 40/10/15/15/20 % for train/validation/holdout/test/shadow
    (train takes the rounding), or with a public pool 50/12.5/18.75/18.75 % and the whole
    public pool as shadow (the shadow share then goes to the private splits, pro rata)."""
    shares = {"validation": 0.10, "holdout": 0.15, "test": 0.15}
    if not has_public:
        shares["shadow"] = 0.20
    scale = 1.0 if not has_public else 1.0 / 0.8
    counts = {name: max(1, int(n * share * scale)) for name, share in shares.items()}
    train = n - sum(counts.values())
    if train < 1 or (has_public and public_n < 1):
        raise UserInputError(
            field="data.path", value=n,
            allowed=f"enough rows to split: at least {4 if has_public else 5} private rows"
                    + (" and one public row" if has_public else "")
                    + (f" (the public pool has {public_n})" if has_public else ""))
    return SplitSizes(train=train, shadow=public_n if has_public else counts["shadow"],
                      validation=counts["validation"], holdout=counts["holdout"],
                      test=counts["test"])


def _file_pool_of(source: FileSource | None) -> FilePool:
    pool = load_pool(dataset=FILE_DATASET, source=_need_source(source))
    if not isinstance(pool, FilePool):
        raise TypeError(f"a 'file' pool must be a FilePool, got {type(pool).__name__}")
    return pool


@functools.lru_cache(maxsize=4)
def _file_pool(source: FileSource, signature: tuple[tuple[str, int, int], ...]) -> FilePool:
    """Read and check ``source`` once per process (``signature``: its files' stat)."""
    del signature  # part of the cache key only
    # pandas and Pillow cost seconds: read only when file data is read
    from dpsweep.trainables.data.readers import read_source

    data = read_source(source)
    parts_x = [data.x] if data.public_x is None else [data.x, data.public_x]
    parts_y = [data.y] if data.public_y is None else [data.y, data.public_y]
    x = np.ascontiguousarray(np.concatenate(parts_x))
    y = np.ascontiguousarray(np.concatenate(parts_y))
    for array in (x, y, data.split):
        if array is not None:
            array.setflags(write=False)
    return FilePool(x=x, y=y, n_train=len(y), source=data.source,
                    n_public=0 if data.public_x is None else len(data.public_x),
                    assignment=data.split, num_classes=data.num_classes,
                    tokens=source.inputs == "tokens")


def _assigned_sizes(pool: FilePool) -> SplitSizes | None:
    """The sizes a user's split assignment fixes (shadow: the public pool when given)."""
    if pool.assignment is None:
        return None
    counts = np.bincount(pool.assignment, minlength=len(SPLIT_NAMES))
    sizes = {name: int(counts[code]) for code, name in enumerate(SPLIT_NAMES)}
    if pool.n_public:
        sizes["shadow"] = pool.n_public
    return SplitSizes(**sizes)


def _file_split_indices(pool: FilePool, sizes: SplitSizes | None,
                        seed: int) -> dict[str, np.ndarray]:
    """Pool indices per split. A user's assignment is used as given, in file order (``sizes``
    must then be None or equal its counts); otherwise consecutive slices of one seeded
    permutation of the private rows. A public pool is the shadow split (a seeded sample of
    ``sizes.shadow`` of it when smaller), indexed after the private rows."""
    n_private, public = pool.n_private, np.arange(pool.n_private, len(pool.y), dtype=np.int64)
    assigned = _assigned_sizes(pool)
    if pool.assignment is not None and assigned is not None:
        if sizes is not None and sizes != assigned:
            raise UserInputError(field="data.sizes", value=asdict(sizes),
                                 allowed=f"the split assignment's counts {asdict(assigned)} "
                                         f"(or the sizes left at their defaults)")
        given = {name: np.flatnonzero(pool.assignment == code).astype(np.int64)
                 for code, name in enumerate(SPLIT_NAMES)}
        if pool.n_public:
            given["shadow"] = public
        return given
    if sizes is None:
        sizes = default_file_sizes(n_private, has_public=pool.n_public > 0,
                                   public_n=pool.n_public)
    from_private = SPLIT_NAMES[:4] if pool.n_public else SPLIT_NAMES
    wanted = sum(getattr(sizes, name) for name in from_private)
    if wanted > n_private:
        raise UserInputError(
            field="data.sizes", value={name: getattr(sizes, name) for name in from_private},
            allowed=f"{' + '.join(from_private)} <= {n_private}, the number of private rows "
                    f"(asked for {wanted})")
    if pool.n_public and sizes.shadow > pool.n_public:
        raise UserInputError(field="data.shadow_size", value=sizes.shadow,
                             allowed=f"at most {pool.n_public}, the rows of the public pool")
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_private)
    result: dict[str, np.ndarray] = {}
    start = 0
    for name in from_private:
        result[name] = order[start:start + getattr(sizes, name)].astype(np.int64)
        start += getattr(sizes, name)
    if pool.n_public:
        result["shadow"] = public[rng.permutation(pool.n_public)[:sizes.shadow]]
    return result


def _file_normalization(source: FileSource, pool: FilePool,
                        shadow: np.ndarray) -> Normalization | None:
    """Constants by the rule in :mod:`trainables.data.files`: the user's, else the whole public
    pool's, else the shadow split's (public by the design); None for token ids."""
    if pool.tokens:
        return None
    scale = pixel_scale(pool.x)
    if source.mean:
        mean, std = user_stats(source, pool.x.shape[1])
    elif pool.n_public:
        mean, std = public_stats(pool.x[pool.n_private:], scale)
    else:
        mean, std = public_stats(pool.x[shadow], scale)
    return Normalization(max_value=scale, mean=mean, std=std)


def _file_splits(*, source: FileSource, seed: int, sizes: SplitSizes | None) -> DataSplits:
    pool = _file_pool_of(source)
    index_sets = _file_split_indices(pool, sizes, seed)
    norm = _file_normalization(source, pool, index_sets["shadow"])
    splits: dict[str, Split] = {}
    for name, indices in index_sets.items():
        rows = pool.x[indices]
        x = (torch.from_numpy(rows.astype(np.int64)) if norm is None
             else normalise(rows, dataset=FILE_DATASET, normalization=norm))
        splits[name] = Split(x=x, y=torch.from_numpy(pool.y[indices].astype(np.int64)),
                             indices=indices)
    return DataSplits(
        name=FILE_DATASET, train=splits["train"], validation=splits["validation"],
        holdout=splits["holdout"], test=splits["test"], shadow=splits["shadow"],
        num_classes=pool.num_classes, input_shape=tuple(int(d) for d in pool.x.shape[1:]),
        source=pool.source, seed=seed, normalization=norm)
