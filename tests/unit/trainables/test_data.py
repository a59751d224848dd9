"""Tests for trainables.data.splits: five disjoint seeded splits (train, validation, holdout, test,
shadow), fixed normalisation, input errors, and the no-download availability check."""

from __future__ import annotations

import gzip
import itertools
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.data import splits as data
from dpsweep.trainables.data.pools import DEBIAN_FASHION_MNIST_DIR, FASHION_MNIST_FILES
from dpsweep.trainables.data.splits import (
    DATASET_NAMES,
    DEFAULT_SIZES,
    DataSplits,
    SplitSizes,
    available_size,
    check_available,
    load_pool,
    load_splits,
    normalise,
)

SPLIT_NAMES = ("train", "validation", "holdout", "test", "shadow")


def _indices(splits: DataSplits) -> dict[str, np.ndarray]:
    return {name: getattr(splits, name).indices for name in SPLIT_NAMES}


def _assert_disjoint(splits: DataSplits) -> None:
    for (a, ia), (b, ib) in itertools.combinations(_indices(splits).items(), 2):
        assert len(np.unique(ia)) == len(ia), f"{a} repeats an example"
        shared = np.intersect1d(ia, ib)
        assert shared.size == 0, f"{a} and {b} share pool indices {shared[:5]}"


def _assert_sizes(splits: DataSplits, sizes: SplitSizes) -> None:
    for name in SPLIT_NAMES:
        split = getattr(splits, name)
        assert len(split) == getattr(sizes, name)
        assert split.x.shape[0] == split.y.shape[0] == len(split.indices)


def _write_idx(path: Path, array: np.ndarray, *, compress: bool = True) -> None:
    payload = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += array.astype(np.uint8).tobytes()
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def _synthetic_fmnist(directory: Path, *, n_train: int = 50, n_test: int = 20) -> Path:
    """A tiny but valid Fashion-MNIST directory: pixel (0, 0) of image i holds i % 256."""
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = np.zeros((n, 28, 28), dtype=np.uint8)
        images[:, 0, 0] = np.arange(n) % 256
        images[:, 27, 27] = 255
        _write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(directory / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    return directory


@pytest.fixture(scope="module")
def debian_fmnist_dir() -> Path:
    if not all(
        (DEBIAN_FASHION_MNIST_DIR / f"{name}.gz").is_file()
        or (DEBIAN_FASHION_MNIST_DIR / name).is_file()
        for name in FASHION_MNIST_FILES
    ):
        message = (
            f"Fashion-MNIST IDX files not found under {DEBIAN_FASHION_MNIST_DIR}; "
            "run `make data` (installs Debian's dataset-fashion-mnist)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return DEBIAN_FASHION_MNIST_DIR


@pytest.fixture(scope="module")
def fmnist_splits(debian_fmnist_dir: Path) -> DataSplits:
    return load_splits(dataset="fashion-mnist", seed=3)


# --- digits -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_digits_splits_disjoint_and_sized(seed: int) -> None:
    splits = load_splits(dataset="digits", seed=seed)
    _assert_sizes(splits, DEFAULT_SIZES["digits"])
    _assert_disjoint(splits)
    everything = np.concatenate(list(_indices(splits).values()))
    # The defaults use the whole dataset, each example exactly once.
    assert np.array_equal(np.sort(everything), np.arange(1797))


def test_digits_default_sizes() -> None:
    assert DEFAULT_SIZES["digits"] == SplitSizes(train=500, validation=200, holdout=300,
                                                 test=297, shadow=500)


def test_digits_custom_sizes_leave_rest_unused() -> None:
    sizes = SplitSizes(train=100, validation=30, holdout=50, test=40, shadow=60)
    splits = load_splits(dataset="digits", seed=5, sizes=sizes)
    _assert_sizes(splits, sizes)
    _assert_disjoint(splits)


def test_digits_shapes_dtypes_and_metadata() -> None:
    splits = load_splits(dataset="digits", seed=0)
    assert splits.name == "digits"
    assert splits.num_classes == 10
    assert splits.input_shape == (1, 8, 8)
    assert splits.source == "sklearn"
    assert splits.seed == 0
    for name in SPLIT_NAMES:
        split = getattr(splits, name)
        assert split.x.dtype == torch.float32
        assert split.y.dtype == torch.int64
        assert tuple(split.x.shape[1:]) == (1, 8, 8)
        assert split.indices.dtype == np.int64
    labels = torch.cat([getattr(splits, name).y for name in SPLIT_NAMES])
    assert set(labels.tolist()) == set(range(10))


def test_digits_contents_match_indices_and_fixed_constants() -> None:
    """Compared against sklearn directly, with the documented constants written out."""
    bunch = load_digits()
    splits = load_splits(dataset="digits", seed=11)
    for name in SPLIT_NAMES:
        split = getattr(splits, name)
        rows = split.indices[:25]
        expected = (bunch.images[rows] / 16.0 - 0.3) / 0.37
        np.testing.assert_allclose(split.x[:25, 0].numpy(), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(split.y[:25].numpy(), bunch.target[rows])


def test_digits_known_pixel_values_map_as_documented() -> None:
    x = normalise(np.array([0, 8, 16], dtype=np.uint8).reshape(3, 1, 1, 1), dataset="digits")
    np.testing.assert_allclose(
        x.flatten().numpy(), [-0.3 / 0.37, 0.2 / 0.37, 0.7 / 0.37], rtol=1e-6
    )
    splits = load_splits(dataset="digits", seed=0)
    values = torch.unique(splits.train.x)
    # 17 raw grey levels 0..16 only; normalisation never depends on the data.
    assert len(values) <= 17
    assert values.min().item() == pytest.approx(-0.3 / 0.37, rel=1e-6)
    assert values.max().item() == pytest.approx(0.7 / 0.37, rel=1e-6)


def test_normalisation_constants_do_not_follow_the_data() -> None:
    """Normalising a subset gives the same values as normalising the whole pool."""
    pool = load_pool(dataset="digits")
    whole = normalise(pool.x, dataset="digits")
    part = normalise(pool.x[:10], dataset="digits")
    assert torch.equal(whole[:10], part)


def test_same_seed_same_splits_different_seed_different_splits() -> None:
    first = load_splits(dataset="digits", seed=4)
    again = load_splits(dataset="digits", seed=4)
    other = load_splits(dataset="digits", seed=5)
    for name in SPLIT_NAMES:
        a, b, c = (getattr(s, name) for s in (first, again, other))
        assert np.array_equal(a.indices, b.indices)
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
        assert not np.array_equal(a.indices, c.indices)
    assert not np.array_equal(np.sort(first.train.indices), np.sort(other.train.indices))


def test_available_size_digits() -> None:
    available = available_size("digits")
    assert available.pool == 1797
    assert available.test is None


def test_returned_splits_do_not_alias_the_cache() -> None:
    splits = load_splits(dataset="digits", seed=0)
    splits.train.x.zero_()
    assert not torch.equal(load_splits(dataset="digits", seed=0).train.x, splits.train.x)
    pool = load_pool(dataset="digits")
    with pytest.raises(ValueError):
        pool.x[0, 0, 0, 0] = 1


# --- Fashion-MNIST ----------------------------------------------------------------------


def test_fmnist_debian_shapes_classes_and_labels(
    fmnist_splits: DataSplits, debian_fmnist_dir: Path
) -> None:
    splits = fmnist_splits
    assert splits.source == str(debian_fmnist_dir.resolve())
    assert splits.num_classes == 10
    assert splits.input_shape == (1, 28, 28)
    _assert_sizes(splits, DEFAULT_SIZES["fashion-mnist"])
    _assert_disjoint(splits)
    for name in SPLIT_NAMES:
        split = getattr(splits, name)
        assert split.x.dtype == torch.float32 and split.y.dtype == torch.int64
        assert tuple(split.x.shape[1:]) == (1, 28, 28)
    # Official sets are balanced: 6,000 per class in train, 1,000 in test.
    pool = load_pool(dataset="fashion-mnist")
    assert pool.n_train == 60_000 and pool.n_test == 10_000
    assert np.bincount(pool.y[:60_000], minlength=10).tolist() == [6000] * 10
    assert np.bincount(pool.y[60_000:], minlength=10).tolist() == [1000] * 10
    assert DEFAULT_SIZES["fashion-mnist"] == SplitSizes(
        train=30_000, validation=5_000, holdout=10_000, test=10_000, shadow=15_000)
    # A random half of the train set: about 3,000 per class.
    counts = np.bincount(splits.train.y.numpy(), minlength=10)
    assert counts.min() > 2700 and counts.max() < 3300
    # The full official test set, each example once.
    assert np.bincount(splits.test.y.numpy(), minlength=10).tolist() == [1000] * 10


def test_fmnist_test_from_official_test_rest_from_official_train(
    fmnist_splits: DataSplits,
) -> None:
    for name in ("train", "validation", "holdout", "shadow"):
        assert getattr(fmnist_splits, name).indices.max() < 60_000
    assert fmnist_splits.test.indices.min() >= 60_000
    assert fmnist_splits.test.indices.max() < 70_000


def test_fmnist_contents_match_indices_and_constants(fmnist_splits: DataSplits) -> None:
    pool = load_pool(dataset="fashion-mnist")
    for name in SPLIT_NAMES:
        split = getattr(fmnist_splits, name)
        rows = split.indices[:8]
        expected = (pool.x[rows].astype(np.float64) / 255.0 - 0.2860) / 0.3530
        np.testing.assert_allclose(split.x[:8].numpy(), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(split.y[:8].numpy(), pool.y[rows])


def test_fmnist_parser_agrees_with_torchvision_reader(
    debian_fmnist_dir: Path, fmnist_splits: DataSplits, tmp_path: Path
) -> None:
    """Uncompressed copies in a user data_dir, cross-checked with torchvision's IDX reader."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    for name in FASHION_MNIST_FILES:
        packed = debian_fmnist_dir / f"{name}.gz"
        if packed.is_file():
            with gzip.open(packed, "rb") as src, open(tmp_path / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(debian_fmnist_dir / name, tmp_path / name)
    reference_x = read_image_file(str(tmp_path / "t10k-images-idx3-ubyte")).numpy()
    reference_y = read_label_file(str(tmp_path / "t10k-labels-idx1-ubyte")).numpy()
    pool = load_pool(dataset="fashion-mnist", data_dir=str(tmp_path))
    assert pool.source == str(tmp_path.resolve())
    np.testing.assert_array_equal(pool.x[60_000:, 0], reference_x)
    np.testing.assert_array_equal(pool.y[60_000:], reference_y)
    # Same files, same seed: the same splits as from the Debian directory.
    again = load_splits(dataset="fashion-mnist", seed=3, data_dir=str(tmp_path))
    for name in SPLIT_NAMES:
        assert np.array_equal(getattr(again, name).indices, getattr(fmnist_splits, name).indices)
    assert torch.equal(again.test.x, fmnist_splits.test.x)


def test_fmnist_deterministic_per_seed(fmnist_splits: DataSplits) -> None:
    sizes = SplitSizes(train=1000, validation=200, holdout=500, test=500, shadow=1000)
    a = load_splits(dataset="fashion-mnist", seed=3, sizes=sizes)
    b = load_splits(dataset="fashion-mnist", seed=3, sizes=sizes)
    c = load_splits(dataset="fashion-mnist", seed=4, sizes=sizes)
    for name in SPLIT_NAMES:
        assert np.array_equal(getattr(a, name).indices, getattr(b, name).indices)
        assert not np.array_equal(getattr(a, name).indices, getattr(c, name).indices)
    # Smaller sizes are prefixes of the same seeded permutation.
    assert np.array_equal(a.train.indices, fmnist_splits.train.indices[:1000])


def test_synthetic_fmnist_dir_and_size_limits(tmp_path: Path) -> None:
    directory = _synthetic_fmnist(tmp_path / "fm")
    sizes = SplitSizes(train=20, validation=5, holdout=10, test=20, shadow=15)
    splits = load_splits(dataset="fashion-mnist", seed=0, sizes=sizes, data_dir=directory)
    _assert_sizes(splits, sizes)
    _assert_disjoint(splits)
    assert available_size("fashion-mnist", str(directory)) == data.Available(pool=50, test=20)
    # Pixel (0, 0) encodes the position in the official file, pixel (27, 27) is 255.
    raw_00 = splits.train.x[:, 0, 0, 0].numpy() * 0.3530 + 0.2860
    np.testing.assert_allclose(raw_00 * 255.0, splits.train.indices, atol=1e-3)
    np.testing.assert_allclose(
        splits.test.x[:, 0, 0, 0].numpy() * 0.3530 + 0.2860,
        (splits.test.indices - 50) / 255.0,
        atol=1e-5,
    )
    assert splits.train.x[:, 0, 27, 27].numpy() == pytest.approx((1.0 - 0.2860) / 0.3530)
    np.testing.assert_array_equal(splits.train.y.numpy(), splits.train.indices % 10)

    with pytest.raises(UserInputError) as info:
        load_splits(
            dataset="fashion-mnist",
            sizes=SplitSizes(train=30, validation=5, holdout=10, test=5, shadow=6),
            data_dir=directory,
        )
    assert info.value.field == "data.sizes"
    assert "<= 50" in info.value.allowed and "asked for 51" in info.value.allowed
    with pytest.raises(UserInputError) as info:
        load_splits(
            dataset="fashion-mnist",
            sizes=SplitSizes(train=10, validation=5, holdout=10, test=21, shadow=10),
            data_dir=directory,
        )
    assert info.value.field == "data.test_size" and "20" in str(info.value)


def test_torchvision_layout_under_data_dir_is_accepted(tmp_path: Path) -> None:
    _synthetic_fmnist(tmp_path / "FashionMNIST" / "raw")
    pool = load_pool(dataset="fashion-mnist", data_dir=tmp_path)
    assert (pool.n_train, pool.n_test) == (50, 20)


# --- errors -----------------------------------------------------------------------------


def test_data_dir_missing_files(tmp_path: Path) -> None:
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")
    with pytest.raises(UserInputError) as info:
        load_splits(dataset="fashion-mnist", data_dir=str(tmp_path))
    message = str(info.value)
    assert info.value.field == "data.data_dir"
    assert "data.data_dir" in message and str(tmp_path) in message
    for name in FASHION_MNIST_FILES:
        assert name in message
    assert "missing: train-labels-idx1-ubyte, t10k-images" in message


def test_data_dir_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as info:
        load_pool(dataset="fashion-mnist", data_dir=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate_gzip", "gzip"),
        ("truncate_payload", "promises"),
        ("trailing_bytes", "promises"),
        ("bad_magic", "magic number"),
        ("label_count", "labels for"),
        ("empty", "magic number"),
    ],
)
def test_corrupt_idx_file(tmp_path: Path, damage: str, reason: str) -> None:
    directory = _synthetic_fmnist(tmp_path)
    images = directory / "train-images-idx3-ubyte.gz"
    labels = directory / "train-labels-idx1-ubyte.gz"
    if damage == "truncate_gzip":
        blob = images.read_bytes()
        images.write_bytes(blob[: len(blob) // 2])
        target = images
    elif damage == "truncate_payload":
        payload = gzip.decompress(images.read_bytes())
        images.unlink()
        target = directory / "train-images-idx3-ubyte"  # uncompressed this time
        target.write_bytes(payload[:-100])
    elif damage == "trailing_bytes":
        payload = gzip.decompress(labels.read_bytes())
        labels.write_bytes(gzip.compress(payload + b"\x00"))
        target = labels
    elif damage == "bad_magic":
        payload = bytearray(gzip.decompress(images.read_bytes()))
        payload[2:4] = b"\x0d\x03"  # float32 type code
        images.write_bytes(gzip.compress(bytes(payload)))
        target = images
    elif damage == "label_count":
        labels.unlink()
        _write_idx(directory / "train-labels-idx1-ubyte", np.zeros(49, dtype=np.uint8))
        target = labels
    else:
        images.write_bytes(gzip.compress(b""))
        target = images
    with pytest.raises(UserInputError) as info:
        load_pool(dataset="fashion-mnist", data_dir=directory)
    assert info.value.field == "data.data_dir"
    assert str(target) in str(info.value)
    assert reason in str(info.value)


def test_unknown_dataset_lists_known_names() -> None:
    with pytest.raises(UserInputError) as info:
        load_splits(dataset="imagenet")
    assert info.value.field == "data.dataset"
    message = str(info.value)
    assert "imagenet" in message
    for name in DATASET_NAMES:
        assert repr(name) in message
    assert set(DATASET_NAMES) == {"digits", "fashion-mnist", "mnist", "cifar10"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"train": 0}, "data.train_size"),
        ({"validation": 0}, "data.validation_size"),
        ({"test": 0}, "data.test_size"),
        ({"holdout": -3}, "data.holdout_size"),
        ({"shadow": 0}, "data.shadow_size"),
        ({"train": 1.5}, "data.train_size"),
        ({"train": True}, "data.train_size"),
        ({"validation": "5"}, "data.validation_size"),
    ],
)
def test_invalid_sizes(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(UserInputError) as info:
        SplitSizes(**{**dict.fromkeys(SPLIT_NAMES, 1), **kwargs})  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_digits_sizes_beyond_dataset() -> None:
    with pytest.raises(UserInputError) as info:
        load_splits(
            dataset="digits",
            sizes=SplitSizes(train=1000, validation=1, holdout=300, test=300, shadow=200),
        )
    assert info.value.field == "data.sizes"
    assert "<= 1797" in info.value.allowed and "asked for 1801" in info.value.allowed


@pytest.mark.parametrize("seed", [-1, 1.5, "0"])
def test_invalid_seed(seed: object) -> None:
    with pytest.raises(UserInputError) as info:
        load_splits(dataset="digits", seed=seed)  # type: ignore[arg-type]
    assert info.value.field == "data.seed"


# --- torchvision path (stubbed: no network here) ------------------------------------------


class _FakeCifar:
    def __init__(self, *, root: str, train: bool, download: bool) -> None:
        n = 40 if train else 12
        self.data = np.zeros((n, 32, 32, 3), dtype=np.uint8)
        self.data[:, 0, 0, :] = [255, 0, 128]  # channel-last, as torchvision stores it
        self.targets = [i % 10 for i in range(n)]


def test_cifar_through_torchvision_layout_and_constants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", _FakeCifar)
    sizes = SplitSizes(train=20, validation=5, holdout=10, test=12, shadow=5)
    splits = load_splits(dataset="cifar10", seed=2, sizes=sizes, data_dir=str(tmp_path))
    assert splits.source == f"torchvision:{tmp_path.resolve()}"
    assert splits.input_shape == (3, 32, 32)
    assert tuple(splits.train.x.shape) == (20, 3, 32, 32)
    _assert_disjoint(splits)
    pixel = splits.train.x[0, :, 0, 0].numpy()
    expected = (np.array([1.0, 0.0, 128 / 255]) - [0.4914, 0.4822, 0.4465]) / [
        0.2470,
        0.2435,
        0.2616,
    ]
    np.testing.assert_allclose(pixel, expected, rtol=1e-5)
    assert splits.test.indices.min() >= 40


def test_download_failure_is_a_user_input_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchvision

    def offline(*, root: str, train: bool, download: bool) -> None:
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    monkeypatch.setenv("DPSWEEP_DATA_DIR", str(tmp_path / "cache"))
    with pytest.raises(UserInputError) as info:
        load_splits(dataset="mnist")
    assert info.value.field == "data.data_dir"
    assert str(tmp_path / "cache") in str(info.value)
    assert "Error downloading" in str(info.value)


# --- availability without downloading ------------------------------------------------------


def test_check_available_finds_local_copies(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_available(dataset="digits") == "bundled with scikit-learn"
    directory = _synthetic_fmnist(tmp_path / "fm")
    assert check_available(dataset="fashion-mnist", data_dir=directory) == str(
        directory.resolve())
    (tmp_path / "tv" / "cifar-10-batches-py").mkdir(parents=True)
    assert check_available(dataset="cifar10", data_dir=tmp_path / "tv") == str(
        tmp_path / "tv" / "cifar-10-batches-py")
    monkeypatch.setenv("DPSWEEP_DATA_DIR", str(tmp_path / "dl"))
    (tmp_path / "dl" / "MNIST").mkdir(parents=True)
    assert check_available(dataset="mnist") == str(tmp_path / "dl" / "MNIST")


@pytest.mark.parametrize("dataset", ["mnist", "cifar10", "fashion-mnist"])
def test_check_available_refuses_what_would_be_downloaded(
        dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision

    def no_download(**_: object) -> None:
        raise AssertionError("check_available must not download")

    for name in ("MNIST", "FashionMNIST", "CIFAR10"):
        monkeypatch.setattr(torchvision.datasets, name, no_download)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserInputError) as info:
        check_available(dataset=dataset, data_dir=empty)
    assert info.value.field == "data.data_dir"
    assert str(empty) in str(info.value)
    with pytest.raises(UserInputError) as info:
        check_available(dataset="imagenet")
    assert info.value.field == "data.dataset"


