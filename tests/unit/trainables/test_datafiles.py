"""Tests for trainables.data.files and the ``file`` dataset of trainables.data.splits:
scikit-learn's digits written as .npz, .csv, .parquet, a class-per-folder PNG directory and
factories; the splits, the normalisation rule (never statistics of private rows) and one error per
bad input."""

from __future__ import annotations

import itertools
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits

from dpsweep.core.datasets import FILE_DATASET
from dpsweep.core.errors import UserInputError
from dpsweep.trainables.data import splits as data
from dpsweep.trainables.data.files import FileSource, public_stats
from dpsweep.trainables.data.splits import (
    DataSplits,
    FilePool,
    SplitSizes,
    available_size,
    check_available,
    default_file_sizes,
    load_pool,
    load_splits,
    share_pool,
)

SPLIT_NAMES = ("train", "validation", "holdout", "test", "shadow")
COLUMNS = [f"p{i}" for i in range(64)]
DIGITS = load_digits()
X = DIGITS.data  # float64 [1797, 64], whole numbers 0..16
Y = DIGITS.target.astype(np.int64)
N = len(Y)


def _frame(x: np.ndarray = X, y: np.ndarray = Y, split: np.ndarray | None = None) -> pd.DataFrame:
    frame = pd.DataFrame(x, columns=COLUMNS[: x.shape[1]])
    frame["label"] = y
    if split is not None:
        frame["split"] = split
    return frame


def _split_column(n: int = N) -> np.ndarray:
    """A fixed assignment: row i goes to split i % 5."""
    return np.array(SPLIT_NAMES)[np.arange(n) % 5]


def _splits(**fields: object) -> DataSplits:
    sizes = fields.pop("sizes", None)
    seed = fields.pop("seed", 0)
    return load_splits(dataset=FILE_DATASET, seed=seed, sizes=sizes,  # type: ignore[arg-type]
                       source=FileSource(**fields))  # type: ignore[arg-type]


def _assert_disjoint(splits: DataSplits) -> None:
    for a, b in itertools.combinations(SPLIT_NAMES, 2):
        ia, ib = getattr(splits, a).indices, getattr(splits, b).indices
        assert len(np.unique(ia)) == len(ia)
        assert np.intersect1d(ia, ib).size == 0, f"{a} and {b} overlap"


def _sizes(splits: DataSplits) -> SplitSizes:
    return SplitSizes(**{name: len(getattr(splits, name)) for name in SPLIT_NAMES})


def _error(field: str, **fields: object) -> UserInputError:
    """The UserInputError a source or its splits raise, checked to name ``field``."""
    with pytest.raises(UserInputError) as info:
        _splits(**fields)
    assert info.value.field == field, str(info.value)
    assert field in str(info.value)
    return info.value


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("digits")
    paths = {
        "npz": root / "digits.npz",
        "csv": root / "digits.csv",
        "parquet": root / "digits.parquet",
        "split_parquet": root / "split.parquet",
        "split_npz": root / "split.npz",
        "private_csv": root / "private.csv",
        "public_csv": root / "public.csv",
    }
    np.savez(paths["npz"], x=X, y=Y)
    _frame().to_csv(paths["csv"], index=False)
    _frame().to_parquet(paths["parquet"])
    _frame(split=_split_column()).to_parquet(paths["split_parquet"])
    np.savez(paths["split_npz"], x=X, y=Y, split=_split_column())
    _frame(X[:1200], Y[:1200]).to_csv(paths["private_csv"], index=False)
    _frame(X[1200:], Y[1200:]).to_csv(paths["public_csv"], index=False)
    paths["images"] = _image_folder(root / "images", per_class=6)
    paths["public_images"] = _image_folder(root / "public_images", per_class=2, offset=100)
    return paths


def _image_folder(root: Path, *, per_class: int, offset: int = 0) -> Path:
    """Digits as 8x8 grayscale PNGs (pixels x 15, so 0..240), ``per_class`` in each folder."""
    for label in range(10):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True)
        rows = np.flatnonzero(Y == label)[offset: offset + per_class]
        for row in rows:
            pixels = (DIGITS.images[row] * 15).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / f"{row:04d}.png")
    (root / "README.txt").write_text("top-level files are not read")
    return root


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> str:
    """Write a factory module into ``tmp_path``; returns its ``module:make`` reference."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return f"{name}:make"


# --- formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["npz", "csv", "parquet"])
def test_each_format_gives_disjoint_default_sized_splits(files: dict[str, Path],
                                                         kind: str) -> None:
    splits = _splits(path=str(files[kind]), seed=4)
    assert splits.name == "file"
    assert splits.input_shape == (64,)
    assert splits.num_classes == 10
    assert str(files[kind]) in splits.source
    assert _sizes(splits) == default_file_sizes(N, has_public=False, public_n=0)
    _assert_disjoint(splits)
    everything = np.concatenate([getattr(splits, name).indices for name in SPLIT_NAMES])
    assert np.array_equal(np.sort(everything), np.arange(N))
    norm = splits.normalization
    assert norm is not None and norm.max_value == 1.0
    for name in SPLIT_NAMES:
        split = getattr(splits, name)
        assert split.x.dtype == torch.float32 and split.y.dtype == torch.int64
        np.testing.assert_array_equal(split.y.numpy(), Y[split.indices])
        expected = (X[split.indices] - np.asarray(norm.mean)) / np.asarray(norm.std)
        np.testing.assert_allclose(split.x.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_same_seed_same_splits_and_custom_sizes(files: dict[str, Path]) -> None:
    sizes = SplitSizes(train=300, validation=50, holdout=100, test=100, shadow=200)
    first = _splits(path=str(files["npz"]), seed=7, sizes=sizes)
    again = _splits(path=str(files["csv"]), seed=7, sizes=sizes)
    other = _splits(path=str(files["npz"]), seed=8, sizes=sizes)
    assert _sizes(first) == sizes
    _assert_disjoint(first)
    for name in SPLIT_NAMES:
        assert np.array_equal(getattr(first, name).indices, getattr(again, name).indices)
        assert not np.array_equal(getattr(first, name).indices, getattr(other, name).indices)


def test_default_file_sizes() -> None:
    assert default_file_sizes(1000, has_public=False, public_n=0) == SplitSizes(
        train=400, validation=100, holdout=150, test=150, shadow=200)
    assert default_file_sizes(800, has_public=True, public_n=77) == SplitSizes(
        train=400, validation=100, holdout=150, test=150, shadow=77)
    assert default_file_sizes(5, has_public=False, public_n=0) == SplitSizes(1, 1, 1, 1, 1)
    with pytest.raises(UserInputError):
        default_file_sizes(4, has_public=False, public_n=0)


def test_a_split_column_is_used_as_given(files: dict[str, Path]) -> None:
    assignment = _split_column()
    for path in (files["split_parquet"], files["split_npz"]):
        column = "split" if path.suffix == ".parquet" else ""
        splits = _splits(path=str(path), split_column=column)
        for name in SPLIT_NAMES:
            assert np.array_equal(getattr(splits, name).indices,
                                  np.flatnonzero(assignment == name))
        # The seed does not move a user's assignment; equal sizes are accepted.
        again = _splits(path=str(path), split_column=column, seed=9, sizes=_sizes(splits))
        assert np.array_equal(again.train.indices, splits.train.indices)
    source = FileSource(path=str(files["split_parquet"]), split_column="split")
    available = available_size(FILE_DATASET, source=source)
    assert available.pool == N and available.public is None
    assert available.assigned == _sizes(splits)
    error = _error("data.sizes", path=str(files["split_parquet"]), split_column="split",
                   sizes=SplitSizes(train=10, validation=10, holdout=10, test=10, shadow=10))
    assert "360" in error.allowed
    # Without split_column, the split column is taken as a (text) feature and refused.
    error = _error("data.feature_columns", path=str(files["split_parquet"]))
    assert "'split'" in str(error)


def test_a_public_file_is_the_shadow_split_and_sets_the_constants(files: dict[str, Path]) -> None:
    source = dict(path=str(files["private_csv"]), public_path=str(files["public_csv"]))
    splits = _splits(**source)
    n_public = N - 1200
    assert len(splits.shadow) == n_public
    assert np.array_equal(np.sort(splits.shadow.indices), np.arange(1200, N))
    _assert_disjoint(splits)
    for name in SPLIT_NAMES[:4]:
        assert getattr(splits, name).indices.max() < 1200
    assert _sizes(splits) == default_file_sizes(1200, has_public=True, public_n=n_public)
    assert splits.normalization is not None
    assert (splits.normalization.mean, splits.normalization.std) == public_stats(X[1200:], 1.0)
    assert "public:" in splits.source and str(files["public_csv"]) in splits.source
    np.testing.assert_array_equal(splits.shadow.y.numpy(), Y[splits.shadow.indices])
    smaller = _splits(**source, sizes=SplitSizes(train=100, validation=10, holdout=10, test=10,
                                                 shadow=50))
    assert len(smaller.shadow) == 50 and smaller.shadow.indices.min() >= 1200
    _error("data.shadow_size", **source,
           sizes=SplitSizes(train=1, validation=1, holdout=1, test=1, shadow=n_public + 1))
    available = available_size(FILE_DATASET, source=FileSource(**source))
    assert (available.pool, available.test, available.public) == (1200, None, n_public)


def test_a_public_table_is_read_with_the_private_feature_columns(files: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    """Extra columns in the public file (a split column, notes) are not features."""
    public = _frame(X[1200:], Y[1200:], split=_split_column(N - 1200))
    public["note"] = "scraped"
    public.to_parquet(tmp_path / "public.parquet")
    _frame(X[:1200], Y[:1200], split=_split_column(1200)).replace(
        {"split": {"shadow": "train"}}).to_parquet(tmp_path / "private.parquet")
    splits = _splits(path=str(tmp_path / "private.parquet"), split_column="split",
                     public_path=str(tmp_path / "public.parquet"))
    assert splits.input_shape == (64,) and len(splits.shadow) == N - 1200
    assert len(splits.train) == 480
    _frame(X[:1200], Y[:1200], split=_split_column(1200)).to_parquet(tmp_path / "bad.parquet")
    error = _error("data.split_column", path=str(tmp_path / "bad.parquet"),
                   split_column="split", public_path=str(tmp_path / "public.parquet"))
    assert "shadow" in error.allowed


def test_image_folder(files: dict[str, Path]) -> None:
    splits = _splits(path=str(files["images"]), seed=1)
    assert splits.input_shape == (1, 8, 8)
    assert splits.num_classes == 10
    assert _sizes(splits) == default_file_sizes(60, has_public=False, public_n=0)
    _assert_disjoint(splits)
    norm = splits.normalization
    assert norm is not None and norm.max_value == 255.0 and len(norm.mean) == 1
    pool = load_pool(dataset=FILE_DATASET, source=FileSource(path=str(files["images"])))
    assert pool.x.dtype == np.uint8 and pool.x.shape == (60, 1, 8, 8)
    # Rows are class by class: folder class_k holds label k.
    np.testing.assert_array_equal(pool.y, np.repeat(np.arange(10), 6))
    raw = pool.x[splits.train.indices].astype(np.float64) / 255.0
    np.testing.assert_allclose(splits.train.x.numpy(), (raw - norm.mean[0]) / norm.std[0],
                               rtol=1e-5, atol=1e-5)
    with_public = _splits(path=str(files["images"]), public_path=str(files["public_images"]))
    assert len(with_public.shadow) == 20 and with_public.shadow.indices.min() >= 60
    np.testing.assert_array_equal(np.sort(with_public.shadow.y.numpy()),
                                  np.repeat(np.arange(10), 2))


def test_user_constants_and_constant_features(files: dict[str, Path]) -> None:
    splits = _splits(path=str(files["npz"]), mean=(2.0,), std=(4.0,))
    assert splits.normalization is not None
    assert splits.normalization.mean == (2.0,) * 64
    np.testing.assert_allclose(splits.test.x.numpy(), (X[splits.test.indices] - 2) / 4,
                               rtol=1e-6)
    _error("data.mean", path=str(files["npz"]), mean=(0.0, 1.0), std=(1.0, 1.0))
    # Pixel 0 is 0 in every digit: centred (to 0) but not scaled (std taken as 1).
    plain = _splits(path=str(files["npz"]))
    assert plain.normalization is not None and plain.normalization.std[0] == 1.0
    assert bool((plain.train.x[:, 0] == 0).all())


def test_tokens_stay_int64_and_unnormalised(tmp_path: Path) -> None:
    tokens = (X.astype(np.int64) * 3) % 50
    np.savez(tmp_path / "tokens.npz", x=tokens, y=Y)
    splits = _splits(path=str(tmp_path / "tokens.npz"), inputs="tokens")
    assert splits.normalization is None
    assert splits.input_shape == (64,)
    for name in SPLIT_NAMES:
        split = getattr(splits, name)
        assert split.x.dtype == torch.int64
        np.testing.assert_array_equal(split.x.numpy(), tokens[split.indices])
    np.savez(tmp_path / "bad.npz", x=tokens - 1, y=Y)
    _error("data.path", path=str(tmp_path / "bad.npz"), inputs="tokens")
    _error("data.mean", path=str(tmp_path / "tokens.npz"), inputs="tokens", mean=(0.0,),
           std=(1.0,))


# --- the normalisation never reads private rows ---------------------------------------------


def test_constants_come_from_shadow_rows_only(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=X, y=Y)
    base = _splits(path=str(tmp_path / "a.npz"), seed=3)
    shadow = base.shadow.indices
    private = np.setdiff1d(np.arange(N), shadow)
    assert base.normalization is not None
    assert (base.normalization.mean, base.normalization.std) == public_stats(X[shadow], 1.0)

    changed = X.copy()
    changed[private] = changed[private] * 3 + 7
    np.savez(tmp_path / "b.npz", x=changed, y=Y)
    other = _splits(path=str(tmp_path / "b.npz"), seed=3)
    assert other.normalization == base.normalization
    assert torch.equal(other.shadow.x, base.shadow.x)
    assert not torch.equal(other.train.x, base.train.x)

    changed = X.copy()
    changed[shadow] = changed[shadow] * 3 + 7
    np.savez(tmp_path / "c.npz", x=changed, y=Y)
    assert _splits(path=str(tmp_path / "c.npz"), seed=3).normalization != base.normalization


def test_constants_come_from_the_public_file_only(files: dict[str, Path],
                                                  tmp_path: Path) -> None:
    public = str(files["public_csv"])
    base = _splits(path=str(files["private_csv"]), public_path=public)
    _frame(X[:1200] * 5 + 1, Y[:1200]).to_csv(tmp_path / "private.csv", index=False)
    other = _splits(path=str(tmp_path / "private.csv"), public_path=public)
    assert other.normalization == base.normalization
    _frame(X[1200:] * 5 + 1, Y[1200:]).to_csv(tmp_path / "public.csv", index=False)
    moved = _splits(path=str(files["private_csv"]), public_path=str(tmp_path / "public.csv"))
    assert moved.normalization != base.normalization


# --- factories --------------------------------------------------------------------------------


def test_factory_returning_arrays_and_a_dict(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _module(tmp_path, monkeypatch, "dpsweep_df_arrays", """
        from sklearn.datasets import load_digits

        def make():
            d = load_digits()
            return d.images[:, None], d.target
    """)
    splits = _splits(factory=ref, code_dir=str(tmp_path))
    assert splits.input_shape == (1, 8, 8) and splits.num_classes == 10
    assert splits.source.startswith(f"factory:{ref}")
    _assert_disjoint(splits)
    ref = _module(tmp_path, monkeypatch, "dpsweep_df_dict", """
        import numpy as np
        from sklearn.datasets import load_digits

        def make():
            d = load_digits()
            split = np.array(["train", "validation", "holdout", "test"])[np.arange(1200) % 4]
            return {"x": d.data[:1200], "y": d.target[:1200], "split": split,
                    "public_x": d.data[1200:], "public_y": d.target[1200:]}
    """)
    splits = _splits(factory=ref, code_dir=str(tmp_path))
    assert len(splits.train) == 300 and len(splits.shadow) == N - 1200
    assert np.array_equal(splits.validation.indices, np.arange(1, 1200, 4))
    assert splits.shadow.indices.min() == 1200
    assert splits.normalization is not None
    assert splits.normalization.mean == public_stats(X[1200:], 1.0)[0]


def test_factory_returning_a_torch_dataset(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _module(tmp_path, monkeypatch, "dpsweep_df_dataset", """
        import torch
        from sklearn.datasets import load_digits
        from torch.utils.data import Dataset

        class Digits(Dataset):
            def __init__(self):
                d = load_digits()
                self.x = torch.tensor(d.images[:400], dtype=torch.float32)
                self.y = torch.tensor(d.target[:400])

            def __len__(self):
                return len(self.y)

            def __getitem__(self, i):
                return self.x[i], self.y[i]

        def make():
            return Digits()
    """)
    splits = _splits(factory=ref, code_dir=str(tmp_path))
    assert splits.input_shape == (8, 8)
    assert _sizes(splits) == default_file_sizes(400, has_public=False, public_n=0)
    np.testing.assert_array_equal(splits.test.y.numpy(), Y[splits.test.indices])
    assert FileSource(factory=ref, code_dir=str(tmp_path)).fingerprint()["data.code_dir"]


# --- the source itself ----------------------------------------------------------------------


def test_round_trip_through_json(files: dict[str, Path]) -> None:
    source = FileSource(path=str(files["split_parquet"]), split_column="split",
                        feature_columns=("p1", "p2"), mean=(0.5, 1.0), std=(2.0, 3.0),
                        num_classes=12)
    again = FileSource.from_dict(json.loads(json.dumps(source.to_dict())))
    assert again == source and again.identity() == source.identity()
    with pytest.raises(UserInputError) as info:
        FileSource.from_dict({"path": str(files["npz"]), "labels": "y"})
    assert info.value.field == "data.labels"
    # A worker on a node without the files rebuilds the source as a key only.
    elsewhere = {**source.to_dict(), "path": "/elsewhere/split.parquet"}
    with pytest.raises(UserInputError) as info:
        FileSource.from_dict(elsewhere)
    assert info.value.field == "data.path"
    assert FileSource.from_dict(elsewhere, check_files=False).to_dict() == elsewhere
    assert FileSource(path=str(files["npz"])).kind == "npz"


def test_fingerprint_follows_the_bytes(files: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=X, y=Y)
    before = FileSource(path=str(path)).fingerprint()
    assert set(before) == {"data.path"} and len(before["data.path"]) == 64
    np.savez(path, x=X + 1, y=Y)
    assert FileSource(path=str(path)).fingerprint() != before
    source = FileSource(path=str(files["private_csv"]), public_path=str(files["public_csv"]))
    assert set(source.fingerprint()) == {"data.path", "data.public_path"}
    folder = _image_folder(tmp_path / "images", per_class=1)
    first = FileSource(path=str(folder)).fingerprint()
    image = next((folder / "class_3").iterdir())
    image.rename(image.with_name("renamed.png"))
    assert FileSource(path=str(folder)).fingerprint() != first


def test_shared_file_pool_is_served_by_identity(files: dict[str, Path]) -> None:
    source = FileSource(path=str(files["npz"]))
    pool = load_pool(dataset=FILE_DATASET, source=source)
    assert isinstance(pool, FilePool) and pool.n_private == N and pool.n_public == 0
    with pytest.raises(ValueError):
        pool.x[0, 0] = 1
    fake = FilePool(x=np.zeros((10, 3)), y=np.arange(10) % 2, n_train=10, source="shared",
                    num_classes=2)
    other = FileSource(path=str(files["csv"]), num_classes=10)
    try:
        share_pool(fake, dataset=FILE_DATASET, source=other)
        assert load_pool(dataset=FILE_DATASET, source=other) is fake
        assert load_pool(dataset=FILE_DATASET, source=source) is not fake
        with pytest.raises(TypeError, match="FilePool"):
            share_pool(data.RawPool(x=fake.x, y=fake.y, n_train=10, source="s"),
                       dataset=FILE_DATASET, source=other)
    finally:
        data._SHARED.pop((FILE_DATASET, other.identity()), None)
    assert check_available(dataset=FILE_DATASET, source=source).startswith("file:")


# --- bad input: one line naming the field -----------------------------------------------------


def test_file_dataset_needs_a_source() -> None:
    for call in (lambda: load_splits(dataset=FILE_DATASET), lambda: load_pool(dataset="file"),
                 lambda: available_size("file"), lambda: check_available(dataset="file")):
        with pytest.raises(UserInputError) as info:
            call()
        assert info.value.field == "data.path"


def _write(tmp_path: Path, name: str, **arrays: np.ndarray) -> str:
    path = tmp_path / name
    if path.suffix == ".npz":
        np.savez(path, **arrays)  # type: ignore[arg-type]
    else:
        _frame(arrays.get("x", X), arrays.get("y", Y), arrays.get("split")).to_csv(
            path, index=False)
    return str(path)


def test_bad_labels(files: dict[str, Path], tmp_path: Path) -> None:
    error = _error("data.num_classes", path=str(files["npz"]), num_classes=5)
    assert "row" in error.allowed and "label 5" in error.allowed
    negative = Y.copy()
    negative[3] = -1
    error = _error("data.label_column", path=_write(tmp_path, "neg.csv", y=negative))
    assert "row 3" in error.allowed
    fractional = Y.astype(np.float64)
    fractional[11] = 2.5
    error = _error("data.path", path=_write(tmp_path, "frac.npz", x=X, y=fractional))
    assert "row 11 holds 2.5" in error.allowed
    # Whole-number floats are fine labels.
    whole = _write(tmp_path, "whole.npz", x=X, y=Y.astype(np.float32))
    assert _splits(path=whole).num_classes == 10
    _error("data.path", path=_write(tmp_path, "short.npz", x=X, y=Y[:-1]))


def test_non_finite_features(tmp_path: Path) -> None:
    x = X.copy()
    x[5, 7] = np.nan
    error = _error("data.path", path=_write(tmp_path, "nan.csv", x=x))
    assert "row 5, column 'p7'" in error.allowed and "nan" in error.allowed
    x = X.copy()
    x[9, 2] = np.inf
    error = _error("data.path", path=_write(tmp_path, "inf.npz", x=x, y=Y))
    assert "row 9" in error.allowed and "inf" in error.allowed


def test_missing_columns_and_unknown_splits(files: dict[str, Path], tmp_path: Path) -> None:
    error = _error("data.label_column", path=str(files["csv"]), label_column="target")
    assert "'target'" in str(error) and "p63" in error.allowed and "label" in error.allowed
    error = _error("data.feature_columns", path=str(files["csv"]), feature_columns=("p0", "p99"))
    assert "p99" in str(error)
    _error("data.split_column", path=str(files["csv"]), split_column="fold")
    split = _split_column()
    split[42] = "training"
    error = _error("data.split_column", path=_write(tmp_path, "split.csv", split=split),
                   split_column="split")
    assert "'training'" in str(error) and "row 42" in error.allowed
    split = _split_column()
    split[split == "holdout"] = "train"
    error = _error("data.split_column", path=_write(tmp_path, "no_holdout.csv", split=split),
                   split_column="split")
    assert "holdout" in error.allowed


def test_mixed_images(tmp_path: Path) -> None:
    folder = _image_folder(tmp_path / "sizes", per_class=2)
    Image.new("L", (9, 8)).save(folder / "class_4" / "odd.png")
    error = _error("data.path", path=str(folder))
    assert "odd.png" in str(error) and "9x8" in error.allowed
    folder = _image_folder(tmp_path / "modes", per_class=2)
    Image.new("RGB", (8, 8)).save(folder / "class_4" / "odd.png")
    error = _error("data.path", path=str(folder))
    assert "RGB" in error.allowed
    (folder / "class_4" / "odd.png").unlink()
    (folder / "class_4" / "notes.txt").write_text("not an image")
    assert "notes.txt" in str(_error("data.path", path=str(folder)))


def test_bad_factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _module(tmp_path, monkeypatch, "dpsweep_df_raises", """
        def make():
            raise RuntimeError("no data today")
    """)
    error = _error("data.factory", factory=ref, code_dir=str(tmp_path))
    assert "no data today" in str(error)
    ref = _module(tmp_path, monkeypatch, "dpsweep_df_wrong", """
        def make():
            return "digits"
    """)
    error = _error("data.factory", factory=ref, code_dir=str(tmp_path))
    assert "returned str" in error.allowed
    ref = _module(tmp_path, monkeypatch, "dpsweep_df_keys", """
        def make():
            return {"x": [[1.0], [2.0]], "labels": [0, 1]}
    """)
    _error("data.factory", factory=ref, code_dir=str(tmp_path))
    _error("data.factory", factory="not a reference")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"path": "/nowhere/digits.npz"}, "data.path"),
        ({}, "data.path"),
        ({"path": "{npz}", "factory": "m:f"}, "data.path"),
        ({"path": "{txt}"}, "data.path"),
        ({"path": "{npz}", "public_path": "{csv}"}, "data.public_path"),
        ({"path": "{npz}", "public_path": "{npz}"}, "data.public_path"),
        ({"path": "{npz}", "split_column": "split"}, "data.split_column"),
        ({"path": "{csv}", "feature_columns": ("label",)}, "data.feature_columns"),
        ({"path": "{npz}", "mean": (0.0,), "std": (0.0,)}, "data.std"),
        ({"path": "{npz}", "mean": (0.0,), "std": (1.0, 1.0)}, "data.std"),
        ({"path": "{npz}", "num_classes": 1}, "data.num_classes"),
        ({"path": "{npz}", "inputs": "pixels"}, "data.inputs"),
        ({"path": "{images}", "inputs": "tokens"}, "data.inputs"),
        ({"factory": "m:f", "code_dir": "/nowhere"}, "data.code_dir"),
    ],
)
def test_bad_source_fields(files: dict[str, Path], tmp_path: Path, fields: dict[str, object],
                           field: str) -> None:
    (tmp_path / "digits.txt").write_text("1,2,3")
    where = {"npz": files["npz"], "csv": files["csv"], "images": files["images"],
             "txt": tmp_path / "digits.txt"}
    fields = {k: v.format(**where) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises(UserInputError) as info:
        FileSource(**fields)  # type: ignore[arg-type]
    assert info.value.field == field, str(info.value)


def test_sizes_larger_than_available(files: dict[str, Path]) -> None:
    error = _error("data.sizes", path=str(files["npz"]),
                   sizes=SplitSizes(train=1000, validation=200, holdout=300, test=300,
                                    shadow=1))
    assert f"<= {N}" in error.allowed and "asked for 1801" in error.allowed
