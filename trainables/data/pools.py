"""Where a named dataset's raw examples come from: the pool type every loader returns, the
download directory, and Fashion-MNIST's IDX files read directly (Debian's package, or any
directory holding them).

The module stays light (scikit-learn and torchvision are imported by the loaders that need
them): ``dpsweep config --check`` asks where a dataset's files are without reading or
downloading them, and a worker handed its pool (``share_pool``) needs neither library.
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpsweep.core.datasets import NUM_CLASSES
from dpsweep.core.errors import UserInputError

DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the IDX files."""

FASHION_MNIST_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
"""IDX file names (each may also be present gzipped, with a ``.gz`` suffix)."""


@dataclass(frozen=True, eq=False)
class RawPool:
    """A dataset's raw examples, official train set first, then the official test set.

    ``x`` is the unnormalised uint8 ``[N, C, H, W]`` array (read-only: it is shared through
    the in-process cache), ``y`` the int64 labels, ``n_train`` the size of the official
    train part. Datasets without an official test set have ``n_train == len(y)``.
    """

    x: np.ndarray
    y: np.ndarray
    n_train: int
    source: str

    @property
    def n_test(self) -> int:
        return len(self.y) - self.n_train


def download_root() -> Path:
    """Where torchvision downloads go: ``$DPSWEEP_DATA_DIR`` or ``~/.cache/dpsweep/data``."""
    configured = os.environ.get("DPSWEEP_DATA_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "dpsweep" / "data"


def _idx_file(directory: Path, name: str) -> Path | None:
    for candidate in (directory / f"{name}.gz", directory / name):
        if candidate.is_file():
            return candidate
    return None


def fashion_mnist_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """The directory to read Fashion-MNIST IDX files from, or None to use torchvision.

    A user-given directory must hold the files (directly, or in torchvision's
    ``FashionMNIST/raw`` layout); otherwise the Debian directory is used when complete.
    """
    if data_dir is not None:
        given = Path(data_dir).expanduser()
        for directory in (given, given / "FashionMNIST" / "raw"):
            if all(_idx_file(directory, name) for name in FASHION_MNIST_FILES):
                return directory.resolve()
        missing = [name for name in FASHION_MNIST_FILES if _idx_file(given, name) is None]
        raise UserInputError(
            field="data.data_dir",
            value=str(data_dir),
            allowed=(
                "a directory holding the Fashion-MNIST IDX files "
                + ", ".join(f"{name}[.gz]" for name in FASHION_MNIST_FILES)
                + f" (missing: {', '.join(missing)})"
            ),
        )
    if all(_idx_file(DEBIAN_FASHION_MNIST_DIR, name) for name in FASHION_MNIST_FILES):
        return DEBIAN_FASHION_MNIST_DIR.resolve()
    return None


def file_signature(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """Path, size and mtime of each IDX file, so the cache never serves a replaced file."""
    signature = []
    for name in FASHION_MNIST_FILES:
        path = _idx_file(directory, name)
        assert path is not None  # checked by _fashion_mnist_dir
        stat = path.stat()
        signature.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


@functools.lru_cache(maxsize=4)
def idx_pool(directory: Path, signature: tuple[tuple[str, int, int], ...]) -> RawPool:
    train_images, train_labels, test_images, test_labels = (
        Path(path) for path, _size, _mtime in signature
    )
    x_train = _read_idx_images(train_images)
    y_train = _read_idx_labels(train_labels, expected=len(x_train))
    x_test = _read_idx_images(test_images)
    y_test = _read_idx_labels(test_labels, expected=len(x_test))
    return frozen_pool(
        x=np.concatenate([x_train, x_test])[:, None, :, :],
        y=np.concatenate([y_train, y_test]).astype(np.int64),
        n_train=len(y_train),
        source=str(directory),
    )


def _corrupt(path: Path, reason: str) -> UserInputError:
    return UserInputError(
        field="data.data_dir",
        value=str(path),
        allowed=f"an intact IDX file ({reason}); replace the file or download it again",
    )


def _read_idx(path: Path, *, ndim: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file (gzipped or not), checking magic number and size.

    The IDX header is two zero bytes, a type code (0x08 = uint8), the number of
    dimensions, then each dimension as a big-endian uint32.
    """
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise _corrupt(path, f"damaged gzip stream: {exc}") from exc
    header = 4 + 4 * ndim
    expected_magic = bytes([0, 0, 0x08, ndim])
    if data[:4] != expected_magic:
        raise _corrupt(path, f"magic number {data[:4].hex()} instead of {expected_magic.hex()}")
    if len(data) < header:
        raise _corrupt(path, f"header truncated at {len(data)} bytes")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected_bytes = math.prod(dims)
    if len(data) - header != expected_bytes:
        raise _corrupt(
            path,
            f"{len(data) - header} data bytes where the header {dims} promises {expected_bytes}",
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _read_idx_images(path: Path) -> np.ndarray:
    images = _read_idx(path, ndim=3)
    if images.shape[1:] != (28, 28):
        raise _corrupt(path, f"images of shape {images.shape[1:]} instead of (28, 28)")
    return images


def _read_idx_labels(path: Path, *, expected: int) -> np.ndarray:
    labels = _read_idx(path, ndim=1)
    if len(labels) != expected:
        raise _corrupt(path, f"{len(labels)} labels for {expected} images")
    if len(labels) and labels.max() >= NUM_CLASSES["fashion-mnist"]:
        raise _corrupt(path, f"label {int(labels.max())} outside 0..9")
    return labels


def frozen_pool(*, x: np.ndarray, y: np.ndarray, n_train: int, source: str) -> RawPool:
    """Make the arrays read-only: the pool is shared by every caller through the cache."""
    x = np.ascontiguousarray(x)
    x.setflags(write=False)
    y = np.ascontiguousarray(y)
    y.setflags(write=False)
    return RawPool(x=x, y=y, n_train=n_train, source=source)


@functools.lru_cache(maxsize=1)
def digits_pool() -> RawPool:
    """The digits bundled with scikit-learn (imported here: it costs seconds)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = bunch.images.astype(np.uint8)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    return frozen_pool(x=x, y=y, n_train=len(y), source="sklearn")


@functools.lru_cache(maxsize=4)
def torchvision_pool(dataset: str, root: str) -> RawPool:
    """Download (if needed) and read a dataset through torchvision into a raw pool (imported
    here: it imports torch)."""
    import torchvision

    classes = {
        "fashion-mnist": torchvision.datasets.FashionMNIST,
        "mnist": torchvision.datasets.MNIST,
        "cifar10": torchvision.datasets.CIFAR10,
    }
    try:
        parts = [classes[dataset](root=root, train=train, download=True) for train in (True, False)]
    except (OSError, RuntimeError) as exc:
        raise UserInputError(
            field="data.data_dir",
            value=root,
            allowed=(
                f"a directory torchvision can read or download {dataset} into "
                f"(download failed: {exc})"
            ),
        ) from exc
    xs, ys = [], []
    for part in parts:
        x = np.asarray(part.data, dtype=np.uint8)
        # MNIST-style data is [N, H, W]; CIFAR-10 is [N, H, W, C].
        xs.append(x[:, None, :, :] if x.ndim == 3 else x.transpose(0, 3, 1, 2))
        ys.append(np.asarray(part.targets, dtype=np.int64))
    return frozen_pool(
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        n_train=len(ys[0]),
        source=f"torchvision:{root}",
    )
