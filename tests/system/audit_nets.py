"""Stock networks the audit tests add to ``tests/stock_nets.py``, as user factories that only
call constructors (shipped as a user's code folder by ``tests/system/test_audit_stock.py``):
a torchvision SqueezeNet, an EmbeddingBag text classifier, and the recipe of
``docs/user-models.md`` at full size, a ResNet-18 (GroupNorm) backbone loaded from one weights
file, frozen, under a new trainable head."""

import torch
import torchvision
from torch import nn

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
