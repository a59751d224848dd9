"""Reference models kept between audits, so an identical reference is trained once.

A reference model is decided by its recipe (method, hyperparameters, matched budget, epochs,
batch size, network, seed, and the digest of the target's frozen parameters it starts from, if
any: :meth:`CacheableTrainer.describe`) and its data; the audited target plays no other part.
Re-runs of a configuration, the after-search audit of a trial already audited, and the
non-private baseline and null models of the tests therefore share references, and retraining
them (each costs about one target training) is waste.

Each entry is two files under ``<cache dir>/audit_references/``, named by the hash of the full
key: the key and the weights' SHA-256 (JSON, ``core.storage.JsonCache``, which treats a file
whose stored key differs as a miss), and the weights (safetensors: plain tensors, nothing that
runs code on load; never a pickle). A hit is used only after the stored key equals the
question, the weights hash to the recorded SHA-256 and load strictly into a freshly built
network of the recipe's shape; anything else is a miss that retrains and overwrites (logged).
The hash guards against torn or corrupted files, not against someone who can write the cache
directory (they could rewrite both files); it lives in the run directory, which such a person
could edit anyway.

The key holds the dpsweep and torch versions, so a code change retrains. Under a DP recipe
a reference is a random draw (fresh noise); a reused one is the same draw for every audit that
asks, which keeps each audit valid (a reference never depends on the target) and makes the
audits of identical recipes share their references' randomness.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dpsweep.core import __version__
from dpsweep.core.hints import read_hint_bytes
from dpsweep.core.lazy import lazy_module
from dpsweep.core.storage import JsonCache, atomic_write_bytes

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.data.splits import DataSplits, Split
    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

logger = logging.getLogger(__name__)

#: Sub-directory of the cache directory that holds reference models.
NAMESPACE = "audit_references"
#: The largest reference weights file read back (a ViT-B/16 in float32 is about 350 MB).
MAX_WEIGHTS_BYTES = 1 << 31
#: Bumped when the entry format or what the key means changes.
SCHEMA = 1


class CacheableTrainer(Protocol):
    """A reference trainer that can say what decides its model (besides the data) and build
    an untrained one of the same shape: what ``trainables.audit.cache`` needs to reuse it."""

    def __call__(self, data: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
        ...

    def describe(self, data: DataSplits, seed: int, index: int) -> dict[str, Any]:
        ...

    def blank(self, data: DataSplits) -> LayeredModel:
        ...


def tensor_hash(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and values."""
    array = tensor.detach().cpu().contiguous().numpy()
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


def _split_hash(split: Split) -> str:
    return hashlib.sha256((tensor_hash(split.x) + tensor_hash(split.y)).encode()).hexdigest()


def data_fingerprint(data: DataSplits) -> dict[str, Any]:
    """What a reference's training reads: its training set and the public data (methods with
    public modes draw from ``shadow``), by content."""
    return {"dataset": data.name, "input_shape": list(data.input_shape),
            "num_classes": int(data.num_classes), "train": _split_hash(data.train),
            "public": _split_hash(data.shadow)}


def reference_key(trainer: CacheableTrainer, data: DataSplits, *, seed: int,
                  index: int) -> dict[str, Any]:
    """The full question a cache entry answers."""
    return {"schema": SCHEMA, "dpsweep": __version__, "torch": torch.__version__,
            "recipe": trainer.describe(data, seed, index), "data": data_fingerprint(data)}


class CachingTrainer:
    """``trainer`` with its models kept under ``directory`` (module docstring).

    ``hits`` holds the indices of references loaded from the cache in this audit, ``rejected``
    why an entry that existed was not used.
    """

    def __init__(self, trainer: CacheableTrainer, directory: str | Path) -> None:
        self.trainer = trainer
        self.cache = JsonCache(directory, NAMESPACE)
        self.hits: set[int] = set()
        self.rejected: dict[int, str] = {}

    def weights_path(self, key: dict[str, Any]) -> Path:
        """Named by the key's hash, never by anything read from the cache."""
        return self.cache.path(key).with_suffix(".safetensors")

    def __call__(self, data: DataSplits, seed: int, index: int) -> tuple[LayeredModel, float]:
        key = reference_key(self.trainer, data, seed=seed, index=index)
        loaded = self._load(key, data, index)
        if loaded is not None:
            self.hits.add(index)
            return loaded
        model, seconds = self.trainer(data, seed, index)
        self._store(key, model, seconds)
        return model, seconds

    def _load(self, key: dict[str, Any], data: DataSplits,
              index: int) -> tuple[LayeredModel, float] | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        path = self.weights_path(key)
        try:
            if not isinstance(entry, dict):
                raise ValueError("the entry is not a record of weights")
            # a bounded regular file only: a FIFO or device in its place is not waited on
            blob = read_hint_bytes(path, max_bytes=MAX_WEIGHTS_BYTES)
            if blob is None:
                raise ValueError("no readable regular weights file")
            if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
                raise ValueError("the weights' SHA-256 differs from the entry's")
            model = self.trainer.blank(data)
            model.load_state_dict(load_safetensors(blob), strict=True)
            seconds = float(entry["train_seconds"])
        except (OSError, KeyError, TypeError, ValueError, RuntimeError,
                SafetensorError) as exc:
            self.rejected[index] = f"{path.name}: {exc}"
            logger.warning("audit reference cache entry %s not used (%s); retraining", path,
                           exc)
            return None
        return model.eval(), seconds

    def _store(self, key: dict[str, Any], model: LayeredModel, seconds: float) -> None:
        """Weights first, then the entry naming their hash: a reader that finds the entry finds
        its weights (a concurrent writer's mismatch fails verification, never loads)."""
        state = {k: v.detach().to("cpu").contiguous().clone()
                 for k, v in model.state_dict().items()}
        try:
            blob = save_safetensors(state)
            atomic_write_bytes(self.weights_path(key), blob)
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:  # unwritable,
            # or tensors sharing memory (safetensors refuses them)
            logger.warning("audit reference not cached (%s)", exc)
            return
        self.cache.put(key, {"sha256": hashlib.sha256(blob).hexdigest(),
                             "train_seconds": float(seconds), "bytes": len(blob),
                             "stored": time.time()})


def caching(trainer: Any, directory: str | Path | None) -> Any:
    """``trainer`` behind the cache when there is a directory and the trainer can describe
    itself (``describe`` and ``blank``); otherwise ``trainer`` unchanged."""
    if directory is None or not (hasattr(trainer, "describe") and hasattr(trainer, "blank")):
        return trainer
    return CachingTrainer(trainer, directory)
