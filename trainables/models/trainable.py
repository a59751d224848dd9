"""What DP training sees of a model: its trainable parameters, grouped into layers.

Torch-free to import (``dpsweep config --check`` counts a network's trained layers without
loading the deep-learning stack until a network is built).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpsweep.trainables.models.networks import LayeredModel


class TrainableLayers:
    """What DP training sees of a ``LayeredModel``: its trainable parameters, in layers.

    A layer of the model without a trainable parameter (a frozen backbone block) is no layer
    here: nothing of it is clipped, noised, counted in a norm or given a share of a per-layer
    budget, and the optimiser never touches it; it stays a layer of the model, so the audit
    still attacks its output. A trainable parameter outside every layer of the model (owned by
    the root or by a parent module, e.g. a ViT's ``class_token`` or a learned positional
    embedding) is a layer of its own, named after the parameter, numbered before the module
    layers (such parameters enter at the input). Parameter names are the model's own.
    """

    def __init__(self, model: LayeredModel) -> None:
        self.model = model
        self.num_classes = model.num_classes
        paths = model.layer_paths()
        groups: dict[str, list[str]] = {}
        for pname, param in model.named_parameters():
            if not param.requires_grad:
                continue
            owners = [name for name, path in paths.items()
                      if pname == path or pname.startswith(path + ".")]
            if len(owners) > 1:
                raise ValueError(f"parameter {pname!r} is in {len(owners)} layers, not one")
            groups.setdefault(owners[0] if owners else _own_layer(pname, paths.values(), model),
                              []).append(pname)
        own = [k for k in groups if k not in paths]
        self.layer_names = own + [k for k in model.layer_names if k in groups]
        self._layer_of = {n: i for i, k in enumerate(self.layer_names) for n in groups[k]}
        self._paths = {k: paths[k] for k in self.layer_names if k in paths}
        self.blocks = {k: model.blocks[k] for k in self.layer_names if k in paths}
        self._named: list[tuple[str, nn.Parameter]] | None = None

    @property
    def per_example_path(self) -> str:
        return getattr(self.model, "per_example_path", "engine")

    def layer_of_parameter(self) -> dict[str, int]:
        return dict(self._layer_of)

    def layer_paths(self) -> dict[str, str]:
        return dict(self._paths)

    def layer_sizes(self) -> list[int]:
        sizes = [0] * len(self.layer_names)
        for pname, param in self.named_parameters():
            sizes[self._layer_of[pname]] += param.numel()
        return sizes

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        # listed once: a step asks many times, and walking a large model's modules cost a
        # frozen ResNet-18 1.8 ms a step (moving or loading a model keeps its Parameters)
        if self._named is None:
            self._named = [(n, p) for n, p in self.model.named_parameters()
                           if n in self._layer_of]
        return iter(self._named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named_parameters())

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        return self.model.named_modules()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def train(self, mode: bool = True) -> TrainableLayers:
        self.model.train(mode)
        return self

    def eval(self) -> TrainableLayers:
        return self.train(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def forward_with_irs(self, x: torch.Tensor, layers: Sequence[str] | None = None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.model.forward_with_irs(x, layers)

    def __getattr__(self, name: str) -> Any:
        """Everything else (``zero_grad``, ``to``, ``net``, ...) is the model's own."""
        if name == "model":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)


def _own_layer(pname: str, paths: Iterable[str], model: LayeredModel) -> str:
    """The layer of a trainable parameter outside every layer: its module's, when that module
    wraps no layer (a module the user's ``layers`` left out), else the parameter's own (a
    parameter of the root or of a parent of layers)."""
    owner = pname.rpartition(".")[0]
    if owner and not any(path.startswith(owner + ".") for path in paths):
        return model.parameter_label(owner)
    return model.parameter_label(pname)


def trainable_layers(model: LayeredModel | TrainableLayers) -> TrainableLayers:
    """The DP view of ``model`` (itself if it is one already)."""
    return model if isinstance(model, TrainableLayers) else TrainableLayers(model)
