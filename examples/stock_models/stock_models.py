"""Stock PyTorch models, at small sizes, as dpsweep user factories (issue 32).

Each ``build_<name>(input_shape, num_classes, **args)`` only calls constructors of
``torch.nn`` / ``torchvision`` (and, for two of them, marks parameters frozen or swaps a norm
module, as a user would), and returns an ``nn.Module`` giving logits ``[B, num_classes]``. They
follow dpsweep's factory signature (``docs/user-models.md``), so a config can name them::

    [model]
    factory = "stock_models:build_lstm"
    code_dir = "examples/stock_models"

and Python code imports them as dpsweep does, with this folder first on ``sys.path``:
``trainables.models.usercode.resolve(field=..., reference="stock_models:STOCK"...)`` needs a
callable, so ``bench.stock_models.load_stock()`` does it and returns this module (``import
stock_models`` after ``sys.path.insert(0, "examples/stock_models")`` works too). Not as
``examples.stock_models.stock_models``: Opacus installs a top-level ``examples`` package that
shadows the repository's folder. The module needs only ``torch`` and ``torchvision``:
``bench/stock_models.py`` (the speed table, ``docs/stock-models.md``) and the acceptance tests
import the same factories.

The models and their inputs (``STOCK`` maps each name to its factory and input):

============== ======================================================= =======================
name           model                                                   input
============== ======================================================= =======================
resnet18_gn    ``torchvision.models.resnet18(norm_layer=GroupNorm)``   images [B, 3, 32, 32]
               (``GroupNorm(min(32, c), c)``), ``num_classes`` outputs float32
resnet18_fc    the same, backbone frozen (``requires_grad=False``):    images [B, 3, 32, 32]
               only ``fc`` trains                                      float32
vit            ``torchvision.models.VisionTransformer`` (image 32,     images [B, 3, 32, 32]
               patch 8, 2 layers, 2 heads, hidden 64, MLP 128): a      float32
               root-owned ``class_token``, ``nn.MultiheadAttention``
lstm           ``nn.Embedding(1000, 64)`` + ``nn.LSTM(64, 64,          token ids [B, 32]
               batch_first=True)`` + ``nn.Linear`` on the last step    int64 in [0, 1000)
gru            ``nn.Embedding(1000, 64)`` + bidirectional ``nn.GRU``   token ids [B, 32]
               (hidden 64) + ``nn.Linear`` on the last step            int64 in [0, 1000)
transformer    ``nn.Embedding(1000, 64)`` + a root-level learned       token ids [B, 32]
               positional ``nn.Parameter`` + ``nn.TransformerEncoder`` int64 in [0, 1000)
               (2 layers, d_model 64, 4 heads, batch_first) + mean
               pooling + ``nn.Linear``
resnet18_fixed ``torchvision.models.resnet18()`` as built, with          images [B, 3, 32, 32]
               BatchNorm (``build_resnet18``), trained with every      float32
               ``BatchNorm2d`` replaced by ``GroupNorm(gcd(32, c),
               c)``: dpsweep's ``[model] fix = true``, Opacus's
               ``ModuleValidator.fix`` (``STOCK[...].fix``);
               ``build_resnet18_fixed`` returns the replaced network
============== ======================================================= =======================

The token models' sequence length is ``input_shape[0]`` (``(T,)``, as dpsweep's token data
gives it); the image models read ``(C, H, W)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torchvision
from torch import nn

#: Vocabulary, embedding and hidden sizes of the token models (``**args`` override them).
VOCAB = 1000
EMBED = 64
HIDDEN = 64
#: The inputs the models are benchmarked and tested at.
IMAGE_SHAPE = (3, 32, 32)
SEQ_LEN = 32
#: GroupNorm's group count cap (torchvision's and Opacus's choice).
MAX_GROUPS = 32


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(MAX_GROUPS, channels), channels)


def build_resnet18_gn(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """ResNet-18 built with GroupNorm in place of BatchNorm."""
    del input_shape  # adaptive pooling: any image size of at least 32 x 32
    return torchvision.models.resnet18(norm_layer=_group_norm, num_classes=num_classes)


def build_resnet18_fc(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """ResNet-18 (GroupNorm) with the backbone frozen: only ``fc`` is trained."""
    net = build_resnet18_gn(input_shape, num_classes)
    for p in net.parameters():
        p.requires_grad_(False)
    for p in net.fc.parameters():
        p.requires_grad_(True)
    return net


def build_vit(input_shape: Sequence[int], num_classes: int, patch_size: int = 8,
              num_layers: int = 2, num_heads: int = 2, hidden_dim: int = 64,
              mlp_dim: int = 128) -> nn.Module:
    """torchvision's VisionTransformer at a small size (square images of side ``H``)."""
    return torchvision.models.VisionTransformer(
        image_size=int(input_shape[1]), patch_size=patch_size, num_layers=num_layers,
        num_heads=num_heads, hidden_dim=hidden_dim, mlp_dim=mlp_dim, num_classes=num_classes)


class RecurrentClassifier(nn.Module):
    """Embedding, a recurrent module (LSTM or GRU, batch first), a linear head on the last
    time step's output."""

    def __init__(self, rnn: nn.LSTM | nn.GRU, *, vocab: int, embed: int,
                 num_classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embedding(tokens))
        return self.head(out[:, -1])


def build_lstm(input_shape: Sequence[int], num_classes: int, vocab: int = VOCAB,
               embed: int = EMBED, hidden: int = HIDDEN) -> nn.Module:
    """A text classifier: Embedding, one-layer LSTM, Linear."""
    del input_shape  # any sequence length
    return RecurrentClassifier(nn.LSTM(embed, hidden, batch_first=True), vocab=vocab,
                               embed=embed, num_classes=num_classes)


def build_gru(input_shape: Sequence[int], num_classes: int, vocab: int = VOCAB,
              embed: int = EMBED, hidden: int = HIDDEN) -> nn.Module:
    """A text classifier: Embedding, one-layer bidirectional GRU, Linear."""
    del input_shape
    return RecurrentClassifier(nn.GRU(embed, hidden, batch_first=True, bidirectional=True),
                               vocab=vocab, embed=embed, num_classes=num_classes)


class TransformerClassifier(nn.Module):
    """Embedding plus a learned positional parameter owned by the root module, a
    TransformerEncoder, mean pooling over positions, a linear head."""

    def __init__(self, *, seq_len: int, vocab: int, d_model: int, heads: int, layers: int,
                 num_classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(1, seq_len, d_model))
        block = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens) + self.position[:, :tokens.shape[1]]
        return self.head(self.encoder(h).mean(dim=1))


def build_transformer(input_shape: Sequence[int], num_classes: int, vocab: int = VOCAB,
                      d_model: int = EMBED, heads: int = 4, layers: int = 2) -> nn.Module:
    """A text classifier: Embedding + positional Parameter, 2-layer TransformerEncoder, Linear."""
    return TransformerClassifier(seq_len=int(input_shape[0]), vocab=vocab, d_model=d_model,
                                 heads=heads, layers=layers, num_classes=num_classes)


def build_resnet18(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Stock ResNet-18, BatchNorm and all: DP training needs it fixed first (``fix``)."""
    del input_shape
    return torchvision.models.resnet18(num_classes=num_classes)


def groupnorm_for_batchnorm(net: nn.Module) -> nn.Module:
    """``net`` with each BatchNorm2d swapped for GroupNorm(gcd(32, c), c) (same ``eps`` and
    ``affine``), as ``opacus.validators.ModuleValidator.fix`` and dpsweep's ``[model] fix``
    do; in place, returned."""
    for parent in list(net.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                c = child.num_features
                setattr(parent, name, nn.GroupNorm(math.gcd(MAX_GROUPS, c), c, eps=child.eps,
                                                   affine=child.affine))
    return net


def build_resnet18_fixed(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Stock ResNet-18 with its BatchNorms already replaced (``groupnorm_for_batchnorm``)."""
    return groupnorm_for_batchnorm(build_resnet18(input_shape, num_classes))


@dataclass(frozen=True)
class Stock:
    """A stock model: its factory, one example's shape, whether inputs are token ids, and
    whether it is trained fixed (BatchNorm -> GroupNorm: ``[model] fix = true`` in dpsweep,
    ``ModuleValidator.fix`` in Opacus, ``groupnorm_for_batchnorm`` without DP)."""

    factory: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    tokens: bool = False
    fix: bool = False

    def build(self, num_classes: int, *, fixed: bool = True) -> nn.Module:
        """The factory's network for this input (BatchNorms replaced when ``fix`` and
        ``fixed``)."""
        net = self.factory(input_shape=self.input_shape, num_classes=num_classes)
        return groupnorm_for_batchnorm(net) if self.fix and fixed else net

    @property
    def reference(self) -> str:
        """The factory as a config names it (``model.factory``, with ``code_dir`` this folder)."""
        return f"stock_models:{self.factory.__name__}"

    def sample(self, batch: int, *, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
        """A random input batch: standard-normal images or uniform token ids (int64)."""
        g = torch.Generator().manual_seed(seed)
        if self.tokens:
            return torch.randint(0, vocab, (batch, *self.input_shape), generator=g)
        return torch.randn(batch, *self.input_shape, generator=g)


STOCK: dict[str, Stock] = {
    "resnet18_gn": Stock(build_resnet18_gn, IMAGE_SHAPE),
    "resnet18_fc": Stock(build_resnet18_fc, IMAGE_SHAPE),
    "vit": Stock(build_vit, IMAGE_SHAPE),
    "lstm": Stock(build_lstm, (SEQ_LEN,), tokens=True),
    "gru": Stock(build_gru, (SEQ_LEN,), tokens=True),
    "transformer": Stock(build_transformer, (SEQ_LEN,), tokens=True),
    "resnet18_fixed": Stock(build_resnet18, IMAGE_SHAPE, fix=True),
}
