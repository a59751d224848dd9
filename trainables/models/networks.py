"""Models with named layers, numbered from the input, and access to each layer's output.

A *layer* is one block that owns parameters (a Conv or Linear, plus whatever activation and
pooling follow it; in the ResNets, the stem, each residual block with its skip path, and the
pooling + linear head). Layer-wise DP methods clip, weight, noise or freeze per layer, and the audit
attacks each layer's output (its intermediate representation, IR), so both need the same
parameter -> layer map; keeping each block in one named submodule makes that map a prefix rule.
No BatchNorm anywhere: it mixes examples in a batch and breaks per-example gradients (Opacus's
``ModuleValidator`` rejects it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.models.catalog import (
    CATALOG,
    CNN5,
    CNN28,
    DIGITS_CNN,
    MODEL_NAMES,
    RESNET20_GN,
    WRN16_4,
    ModelSpec,
    check_input_shape,
)
from dpsweep.trainables.models.pooling import MaxPool2d

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


class LayeredModel(nn.Module):
    """A network whose parameters are grouped into named layers, numbered from the input.

    Built-in models are feed-forward stacks of named blocks (``blocks[name]`` is one layer);
    :class:`WrappedModel` gives any ``nn.Module`` the same interface. Everything downstream
    (the DP methods, the engine, the audit) reads only ``layer_names``, ``blocks``,
    ``layer_of_parameter`` and ``forward_with_irs``.
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]], *, num_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(dict(blocks))
        self.num_classes = num_classes

    @property
    def layer_names(self) -> list[str]:
        """Layer names in order from the input."""
        return list(self.blocks.keys())

    def layer_paths(self) -> dict[str, str]:
        """Layer name -> the qualified name (in ``named_modules``) of the module it is."""
        return {name: f"blocks.{name}" for name in self.blocks}

    def layer_of_parameter(self) -> dict[str, int]:
        """Parameter name (as in ``named_parameters``) -> index of the layer that owns it."""
        prefixes = [(path + ".", i) for i, path in enumerate(self.layer_paths().values())]
        out: dict[str, int] = {}
        for pname, _ in self.named_parameters():
            owners = [i for prefix, i in prefixes if pname.startswith(prefix)]
            if len(owners) > 1:
                raise ValueError(f"parameter {pname!r} is in {len(owners)} layers, not one")
            if owners:  # else a parameter of a parent: a layer of its own for DP training
                out[pname] = owners[0]
        return out

    def parameter_label(self, pname: str) -> str:
        """A parameter's name as the user knows it (the layer name of a parameter that is a
        layer of its own, see :class:`TrainableLayers`)."""
        return pname

    def layer_sizes(self) -> list[int]:
        """Number of parameters per layer, in layer order."""
        sizes = [0] * len(self.layer_names)
        params = dict(self.named_parameters())
        for pname, layer in self.layer_of_parameter().items():
            sizes[layer] += params[pname].numel()
        return sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x

    def _wanted(self, layers: Sequence[str] | None) -> set[str]:
        wanted = set(self.layer_names if layers is None else layers)
        unknown = wanted - set(self.layer_names)
        if unknown:
            raise UserInputError(
                field="layers", value=sorted(unknown), allowed=f"names in {self.layer_names}"
            )
        return wanted

    def forward_with_irs(
        self, x: torch.Tensor, layers: Sequence[str] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Logits and the outputs of the requested layers (all layers by default)."""
        wanted = self._wanted(layers)
        irs: dict[str, torch.Tensor] = {}
        for name, block in self.blocks.items():
            x = block(x)
            if name in wanted:
                irs[name] = x
        return x, irs


class WrappedModel(LayeredModel):
    """A user's ``nn.Module`` (``net``) with layers named by module paths inside it.

    The user's own ``forward`` runs unchanged; each layer's output is captured by a forward
    hook (the last call's, for a module called more than once), so the audit sees the same
    representations whatever the forward does. ``layers`` maps layer name -> module path in
    ``net`` (``trainables.models.validator`` checks the map before this is built).
    """

    def __init__(self, net: nn.Module, *, layers: Mapping[str, str], num_classes: int) -> None:
        nn.Module.__init__(self)
        self.net = net
        self.num_classes = num_classes
        self._paths = dict(layers)
        modules = dict(net.named_modules())
        self._modules_of = {name: modules[path] for name, path in self._paths.items()}
        #: Where each layer's output keeps the batch, when not first (set by the validator).
        self.ir_batch_dims: dict[str, int] = {}
        #: Modules with parameters that run in training only, frozen and in no layer (GoogLeNet's
        #: auxiliary heads; set by the validator).
        self.training_only: list[str] = []

    @property
    def layer_names(self) -> list[str]:
        return list(self._paths)

    @property
    def blocks(self) -> dict[str, nn.Module]:  # type: ignore[override]
        """Layer name -> its module (read-only view; the modules live inside ``net``)."""
        return dict(self._modules_of)

    def layer_paths(self) -> dict[str, str]:
        return {name: f"net.{path}" for name, path in self._paths.items()}

    def parameter_label(self, pname: str) -> str:
        return pname.removeprefix("net.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.net(x))

    def forward_with_irs(
        self, x: torch.Tensor, layers: Sequence[str] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        wanted = self._wanted(layers)
        irs: dict[str, torch.Tensor] = {}

        def keep(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
                del module, inputs
                ir = first_tensor(output)
                dim = self.ir_batch_dims.get(name, 0)
                irs[name] = ir if dim == 0 else ir.movedim(dim, 0)
            return hook

        handles = [self._modules_of[n].register_forward_hook(keep(n)) for n in wanted]
        try:
            out = logits_of(self.net(x))
        finally:
            for h in handles:
                h.remove()
        return out, {n: irs[n] for n in self.layer_names if n in wanted}


def logits_of(output: object) -> object:
    """The logits of a network's output: the output itself, or the ``logits`` field of a
    named output (torchvision's GoogLeNet and Inception-v3 return ``GoogLeNetOutputs`` /
    ``InceptionOutputs`` in training, with their auxiliary heads' logits beside the main ones).
    Training, the audit and the checks all read the main logits, in either mode; anything else
    comes back as it is, for the validator to name."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


def first_tensor(output: object) -> torch.Tensor:
    """A module's output as one tensor: itself, or the first tensor of a tuple/list (an RNN's
    ``(output, state)``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    raise TypeError(f"a layer returned {type(output).__name__}, not a tensor")


def _conv_block(
    cin: int, cout: int, kernel: int, *, stride: int, padding: int, act: str, pool: nn.Module
) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding)
    return nn.Sequential(conv, ACTIVATIONS[act](), pool)


def _dense_block(fin: int, fout: int, *, act: str | None, flatten: bool = False) -> nn.Sequential:
    parts: list[nn.Module] = [nn.Flatten()] if flatten else []
    parts.append(nn.Linear(fin, fout))
    if act is not None:
        parts.append(ACTIVATIONS[act]())
    return nn.Sequential(*parts)


#: Builder of each catalog model, by name (filled by :func:`builds`).
BUILDERS: dict[str, Callable[..., LayeredModel]] = {}
#: Models whose builder also takes the input's side (``image_size``).
_SIZED: set[str] = set()

_B = TypeVar("_B", bound=Callable[..., LayeredModel])


def builds(spec: ModelSpec, *, sized: bool = False) -> Callable[[_B], _B]:
    """Decorator: register a builder for the catalog's ``spec``
    (``trainables.models.catalog`` says why the facts live there). The builder takes
    ``in_channels``, ``num_classes`` and ``act`` (and ``image_size`` when ``sized``)."""
    if CATALOG.get(spec.name) is not spec:
        raise RuntimeError(f"model {spec.name!r} is not declared in trainables.models.catalog")

    def register(fn: _B) -> _B:
        if spec.name in BUILDERS:
            raise RuntimeError(f"model {spec.name!r} registered twice")
        BUILDERS[spec.name] = fn
        if sized:
            _SIZED.add(spec.name)
        return fn

    return register


@builds(DIGITS_CNN)
def digits_cnn(*, in_channels: int = 1, num_classes: int = 10, act: str = "tanh") -> LayeredModel:
    """Small CNN for 8x8 digits: 2 conv + 2 dense, ~9k parameters."""
    return LayeredModel(
        [
            ("conv1", _conv_block(in_channels, 16, 3, stride=1, padding=1, act=act,
                                  pool=nn.AvgPool2d(2))),  # 16x4x4
            ("conv2", _conv_block(16, 32, 3, stride=1, padding=1, act=act,
                                  pool=nn.AvgPool2d(2))),  # 32x2x2
            ("fc1", _dense_block(128, 32, act=act, flatten=True)),
            ("fc2", _dense_block(32, num_classes, act=None)),
        ],
        num_classes=num_classes,
    )


@builds(CNN28)
def cnn28(*, in_channels: int = 1, num_classes: int = 10, act: str = "tanh") -> LayeredModel:
    """The 2 conv + 2 dense CNN of Papernot et al. (2021) for 28x28 inputs, ~26k parameters.

    Tanh by default: tempered sigmoids train better than ReLU under DP-SGD (same paper).
    """
    return LayeredModel(
        [
            ("conv1", _conv_block(in_channels, 16, 8, stride=2, padding=3, act=act,
                                  pool=MaxPool2d(2, 1))),  # 16x13x13
            ("conv2", _conv_block(16, 32, 4, stride=2, padding=0, act=act,
                                  pool=MaxPool2d(2, 1))),  # 32x4x4
            ("fc1", _dense_block(32 * 4 * 4, 32, act=act, flatten=True)),
            ("fc2", _dense_block(32, num_classes, act=None)),
        ],
        num_classes=num_classes,
    )


@builds(CNN5, sized=True)
def cnn5(
    *, in_channels: int = 1, num_classes: int = 10, act: str = "tanh", image_size: int = 28
) -> LayeredModel:
    """A 5-layer CNN (3 conv + 2 dense) for 28x28 or 32x32 inputs, as used by DP-SGD-LF."""
    side = image_size // 2 // 2 // 2
    return LayeredModel(
        [
            ("conv1", _conv_block(in_channels, 32, 3, stride=1, padding=1, act=act,
                                  pool=MaxPool2d(2))),
            ("conv2", _conv_block(32, 64, 3, stride=1, padding=1, act=act, pool=MaxPool2d(2))),
            ("conv3", _conv_block(64, 64, 3, stride=1, padding=1, act=act, pool=MaxPool2d(2))),
            ("fc1", _dense_block(64 * side * side, 128, act=act, flatten=True)),
            ("fc2", _dense_block(128, num_classes, act=None)),
        ],
        num_classes=num_classes,
    )


#: GroupNorm groups (16, as De et al. 2022, "Unlocking High-Accuracy Differentially Private
#: Image Classification through Scale", arXiv 2204.13650, use for WRN-16-4 under DP); layers
#: narrower than that normalise each channel on its own.
GN_GROUPS = 16


def _gn(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(GN_GROUPS, channels), channels)


def _conv3x3(cin: int, cout: int, *, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution without bias (a GroupNorm follows or precedes it)."""
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class _BasicBlockGN(nn.Module):
    """ResNet basic block with GroupNorm: act(GN(conv(act(GN(conv(x))))) + shortcut(x)).

    The shortcut is He et al.'s option A (CIFAR ResNets): identity, or on a change of shape a
    stride-2 subsample padded with zero channels, so it owns no parameters.
    """

    def __init__(self, cin: int, cout: int, *, stride: int, act: str) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride=stride)
        self.gn1 = _gn(cout)
        self.act1 = ACTIVATIONS[act]()
        self.conv2 = _conv3x3(cout, cout)
        self.gn2 = _gn(cout)
        self.act2 = ACTIVATIONS[act]()
        self.stride = stride
        self.extra = cout - cin

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1 and self.extra == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.extra // 2
        return nn.functional.pad(x, (0, 0, 0, 0, half, self.extra - half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return self.act2(out + self.shortcut(x))


class _WideBlockGN(nn.Module):
    """Pre-activation wide block with GroupNorm: conv(act(GN(conv(act(GN(x)))))) + shortcut.

    On a change of shape the shortcut is a 1x1 convolution of the pre-activated input, as in
    Zagoruyko & Komodakis's reference implementation.
    """

    def __init__(self, cin: int, cout: int, *, stride: int, act: str) -> None:
        super().__init__()
        self.gn1 = _gn(cin)
        self.act1 = ACTIVATIONS[act]()
        self.conv1 = _conv3x3(cin, cout, stride=stride)
        self.gn2 = _gn(cout)
        self.act2 = ACTIVATIONS[act]()
        self.conv2 = _conv3x3(cout, cout)
        self.shortcut = (nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
                         if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.act1(self.gn1(x))
        out = self.conv2(self.act2(self.gn2(self.conv1(pre))))
        return out + (x if self.shortcut is None else self.shortcut(pre))


def _head(channels: int, num_classes: int, *, norm_act: str | None = None) -> nn.Sequential:
    """Global average pooling + linear (after GN + activation for pre-activation nets)."""
    parts: list[nn.Module] = [] if norm_act is None else [_gn(channels), ACTIVATIONS[norm_act]()]
    parts += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*parts)


#: ResNet-20's stages: (width, stride of the first block); 3 blocks each.
RESNET20_STAGES = ((16, 1), (32, 2), (64, 2))
RESNET20_BLOCKS_PER_STAGE = 3
#: WRN-16-4: 16 = 6 N + 4 with N = 2 blocks per stage, widths 16 k with k = 4.
WRN16_4_STAGES = ((64, 1), (128, 2), (256, 2))
WRN16_4_BLOCKS_PER_STAGE = 2
STEM_WIDTH = 16


@builds(RESNET20_GN)
def resnet20_gn(*, in_channels: int = 3, num_classes: int = 10, act: str = "relu") -> LayeredModel:
    """CIFAR ResNet-20 (He et al. 2016, "Deep Residual Learning for Image Recognition",
    arXiv 1512.03385) with GroupNorm for BatchNorm; ~0.27M parameters; 28x28 or 32x32 inputs.

    Layers: ``stem`` (conv + GN + act), ``block1``..``block9`` (each with its skip path), ``head``
    (global pooling + linear).
    """
    stem = nn.Sequential(_conv3x3(in_channels, STEM_WIDTH), _gn(STEM_WIDTH), ACTIVATIONS[act]())
    blocks: list[tuple[str, nn.Module]] = [("stem", stem)]
    cin = STEM_WIDTH
    for width, stride in RESNET20_STAGES:
        for i in range(RESNET20_BLOCKS_PER_STAGE):
            blocks.append((f"block{len(blocks)}",
                           _BasicBlockGN(cin, width, stride=stride if i == 0 else 1, act=act)))
            cin = width
    blocks.append(("head", _head(cin, num_classes)))
    return LayeredModel(blocks, num_classes=num_classes)


@builds(WRN16_4)
def wrn16_4(*, in_channels: int = 3, num_classes: int = 10, act: str = "relu") -> LayeredModel:
    """Wide-ResNet-16-4 (Zagoruyko & Komodakis 2016, "Wide Residual Networks", arXiv
    1605.07146) with GroupNorm, as trained under DP by De et al. (arXiv 2204.13650); ~2.75M
    parameters; 28x28 or 32x32 inputs.

    Layers: ``stem`` (conv), ``block1``..``block6`` (pre-activation, each with its skip path),
    ``head`` (GN + act + global pooling + linear).
    """
    blocks: list[tuple[str, nn.Module]] = [("stem", _conv3x3(in_channels, STEM_WIDTH))]
    cin = STEM_WIDTH
    for width, stride in WRN16_4_STAGES:
        for i in range(WRN16_4_BLOCKS_PER_STAGE):
            blocks.append((f"block{len(blocks)}",
                           _WideBlockGN(cin, width, stride=stride if i == 0 else 1, act=act)))
            cin = width
    blocks.append(("head", _head(cin, num_classes, norm_act=act)))
    return LayeredModel(blocks, num_classes=num_classes)


def build_model(
    *, name: str, input_shape: tuple[int, int, int], num_classes: int, activation: str = "tanh"
) -> LayeredModel:
    """Instantiate a model by concrete name for the dataset's input shape (seed torch
    beforehand); "auto" is resolved first by :func:`trainables.models.catalog.model_for`."""
    if name not in BUILDERS:
        raise UserInputError(field="model.name", value=name, allowed=f"one of {MODEL_NAMES}")
    if activation not in ACTIVATIONS:
        raise UserInputError(
            field="model.activation", value=activation, allowed=f"one of {tuple(ACTIVATIONS)}"
        )
    shape = tuple(input_shape)
    check_input_shape(model=name, input_shape=shape)
    size = {"image_size": shape[1]} if name in _SIZED else {}
    return BUILDERS[name](in_channels=shape[0], num_classes=num_classes, act=activation, **size)
