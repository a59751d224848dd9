"""Load a dpsweep export without dpsweep: ``model = load(EXPORT_DIR)``, then ``model(raw)``.

dpsweep copies this file unchanged into every export as ``load.py``. It needs Python and torch
(Pillow and numpy too, for :func:`read_images` only): not dpsweep, not the run directory, not
the folder the model was trained from. ``load`` does, in order:

1. reads ``model.json`` (what to build, the classes, the input normalisation);
2. checks the SHA-256 of every ``.py`` file under ``code/`` against ``model.json`` and refuses
   any file that is missing, changed or extra, before anything from ``code/`` is imported;
3. imports the builder from ``code/`` (the user's factory, or dpsweep's built-in models),
   calls it as training did: ``factory(input_shape=..., num_classes=..., **args)``, and
   replaces the modules training replaced (``[model] fix``: ``torch.nn`` classes only);
4. loads ``weights.pt`` with ``torch.load(weights_only=True)``, which reads tensors and runs no
   code;
5. returns the network wrapped in :class:`RawInput`, in eval mode: it applies the training
   normalisation itself, so raw inputs go in (image pixels as stored, 0..255) and logits come
   out. Nothing needs remembering about mean and std.

``model.classes[i]`` names label ``i``. The privacy statement next to this file says what the
release's epsilon covers.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
MODEL_FILE = "model.json"


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
    weights replace every parameter anyway)."""
    root = Path(export_dir).resolve()
    info = json.loads((root / MODEL_FILE).read_text(encoding="utf-8"))
    code = root / info["code"]["dir"]
    verify_code(code, info["code"]["files"])
    build = info["build"]
    factory = _import(build["factory"], code, provides=_top_names(info["code"]["files"]))
    network = factory(input_shape=tuple(info["input_shape"]),
                      num_classes=int(info["num_classes"]), **{**build["args"], **(args or {})})
    network = replace_modules(network, build.get("replace", []))
    state = torch.load(root / info["weights"]["torch"], map_location="cpu", weights_only=True)
    network.load_state_dict(state, strict=True)
    model = RawInput(network, normalization=info["input_normalization"],
                     input_shape=info["input_shape"], classes=info["classes"])
    return model.to(device).eval()


def classes(export_dir: str | Path = HERE) -> list[str]:
    """The class names in label order (``model.json``'s ``classes``)."""
    info = json.loads((Path(export_dir) / MODEL_FILE).read_text(encoding="utf-8"))
    return list(info["classes"])


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


def verify_code(code: Path, expected: dict[str, str]) -> None:
    """Every ``.py`` file under ``code`` is one ``model.json`` lists, with its SHA-256, and none
    is missing: only the code the weights were trained with is ever imported."""
    found = {p.relative_to(code).as_posix(): p for p in code.rglob("*.py")}
    if sorted(found) != sorted(expected):
        raise ImportError(f"{code} holds {sorted(found)}; model.json lists {sorted(expected)}: "
                          f"use the export as written")
    for name, path in found.items():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected[name]:
            raise ImportError(f"{path} changed since export (SHA-256 {digest}, model.json "
                              f"records {expected[name]}): use the export as written")


def _top_names(files: Iterable[str]) -> set[str]:
    """The top-level modules and packages the code folder provides."""
    return {name.split("/")[0].removesuffix(".py") for name in files}


def _import(reference: str, code: Path, *, provides: set[str]) -> Callable[..., nn.Module]:
    """``module:function`` imported from ``code`` (first on the import path). A module the
    folder provides that was imported earlier from elsewhere is refused, not shadowed: the
    network would be built from other code."""
    module_name, _, attr_path = reference.partition(":")
    for top in sorted(provides):
        if top in sys.modules and not _inside(sys.modules[top], code):
            raise ImportError(f"a module {top!r} is already imported from elsewhere in this "
                              f"process; this export's is under {code}: load it in a fresh "
                              f"process")
    if str(code) not in sys.path:
        sys.path.insert(0, str(code))
    obj: Any = importlib.import_module(module_name)
    if not _inside(obj, code):
        raise ImportError(f"{module_name} was imported from outside {code}")
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def _inside(module: Any, code: Path) -> bool:
    """Whether ``module`` (or, for a namespace package, every folder of it) is under ``code``."""
    file = getattr(module, "__file__", None)
    places = [file] if file else list(getattr(module, "__path__", []))
    return bool(places) and all(code in Path(p).resolve().parents for p in places)
