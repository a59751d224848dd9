"""Stock networks the audit tests add to ``tests/stock_nets.py``, as user factories that only
call constructors (shipped as a user's code folder by ``tests/system/test_audit_stock.py``):
a torchvision SqueezeNet, an EmbeddingBag text classifier, the recipe of
``docs/user-models.md`` at full size, a ResNet-18 (GroupNorm) backbone loaded from one weights
file, frozen, under a new trainable head, and one model of each torchvision family the zoo
needed engine or validator rules for (issue 45): GoogLeNet's auxiliary heads, a Swin v1 and a
MaxViT at toy widths."""

import torch
import torchvision
from torch import nn
from torchvision.models.googlenet import GoogLeNetOutputs
from torchvision.models.swin_transformer import SwinTransformer

#: The backbone's output width (ResNet-18's last stage) and the bag's vocabulary and width.
FEATURES = 512
VOCAB = 50
WIDTH = 16


def _gn(channels):
    return nn.GroupNorm(min(32, channels), channels)


def backbone():
    """The ResNet-18 (GroupNorm) trunk without its classifier."""
    net = torchvision.models.resnet18(norm_layer=_gn)
    net.fc = nn.Identity()
    return net


def resnet_backbone(input_shape, num_classes, weights=""):
    """A pretrained backbone from ``weights`` (``[model.args]``), frozen, and a trainable head;
    an empty path builds it untrained (what an export's loader passes)."""
    net = backbone()
    if weights:
        net.load_state_dict(torch.load(weights, weights_only=True))
    net.requires_grad_(False)
    return nn.Sequential(net, nn.Linear(FEATURES, num_classes))


def squeezenet(input_shape, num_classes):
    return torchvision.models.squeezenet1_1(num_classes=num_classes)


class Bag(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, WIDTH, mode="mean")
        self.head = nn.Linear(WIDTH, num_classes)

    def forward(self, x):
        return self.head(self.bag(x))


def bag(input_shape, num_classes):
    return Bag(num_classes)


class AuxHeads(nn.Module):
    """GoogLeNet's pattern at toy size: an auxiliary head called in training only, and
    torchvision's ``GoogLeNetOutputs`` named tuple there (the logits alone in evaluation);
    BatchNorm, as torchvision builds it (``fix = true``). torchvision's GoogLeNet itself
    passes the same audit (about a minute at 48 px on two cores)."""

    def __init__(self, num_classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(4))
        self.aux1 = nn.Sequential(nn.Flatten(), nn.Linear(8 * 16, num_classes))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 16, num_classes))

    def forward(self, x):
        h = self.stem(x)
        logits = self.head(h)
        if self.training:
            return GoogLeNetOutputs(logits, None, self.aux1(h))
        return logits


def aux_heads(input_shape, num_classes):
    return AuxHeads(num_classes)


def swin(input_shape, num_classes):
    """Swin v1's shifted-window attention (a bias table indexed by a buffer) at toy width."""
    return SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[1, 1], num_heads=[2, 2],
                           window_size=[2, 2], stochastic_depth_prob=0.0,
                           num_classes=num_classes)


def maxvit(input_shape, num_classes):
    """MaxViT's stages in a ``ModuleList`` its forward loops over, at toy width."""
    return torchvision.models.MaxVit(
        input_size=tuple(input_shape[1:]), stem_channels=8, partition_size=2,
        block_channels=[8, 16], block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.0,
        num_classes=num_classes)
