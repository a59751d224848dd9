"""The built-in datasets as plain data: names, class counts, input shapes and pool sizes.

One table that the data loader (``trainables.data.splits``), config validation
(``orchestrator.config``, which must not import torch) and the report (``reports``, which sits
below ``trainables``) all read, instead of copies kept equal by tests.
"""

from __future__ import annotations

DATASET_NAMES: tuple[str, ...] = ("digits", "fashion-mnist", "mnist", "cifar10")
INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "digits": (1, 8, 8),
    "fashion-mnist": (1, 28, 28),
    "mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
}
NUM_CLASSES: dict[str, int] = {name: 10 for name in DATASET_NAMES}
#: What each label means, in label order (an export's ``model.json`` names its classes, so
#: its predictions can be read without the dataset's documentation).
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "digits": tuple(str(i) for i in range(10)),
    "mnist": tuple(str(i) for i in range(10)),
    "fashion-mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                      "Sneaker", "Bag", "Ankle boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                "truck"),
}
#: Examples in each dataset's pool and in its official test split (0: none, the test split is
#: cut from the pool). ``tests/unit/orchestrator/test_config.py`` checks digits' against the
#: loaded data.
POOLS: dict[str, tuple[int, int]] = {
    "digits": (1797, 0),
    "fashion-mnist": (60000, 10000),
    "mnist": (60000, 10000),
    "cifar10": (50000, 10000),
}
#: The ``[data] dataset`` of a user's own data (a file or a factory: ``trainables.data.files``);
#: its shapes, classes and sizes come from the data itself.
FILE_DATASET = "file"
