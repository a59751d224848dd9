"""Stock torch / torchvision networks at test sizes, as user factories that only call
constructors (and freeze, for ``resnet_head``). ``tests/system/test_stock_models.py`` ships
this file as a user's code folder; ``tests/contract/test_conformance_stock.py`` imports it."""

import torch
import torchvision
from torch import nn


def _gn(channels):
    return nn.GroupNorm(min(32, channels), channels)


def resnet_gn(input_shape, num_classes):
    return torchvision.models.resnet18(norm_layer=_gn, num_classes=num_classes)


def resnet_head(input_shape, num_classes):
    net = torchvision.models.resnet18(norm_layer=_gn, num_classes=num_classes)
    for name, param in net.named_parameters():
        param.requires_grad_(name.startswith("fc."))
    return net


def resnet_bn(input_shape, num_classes):
    return torchvision.models.resnet18(num_classes=num_classes)


def vit(input_shape, num_classes):
    return torchvision.models.VisionTransformer(
        image_size=input_shape[1], patch_size=8, num_layers=1, num_heads=2, hidden_dim=16,
        mlp_dim=32, num_classes=num_classes)


class Recurrent(nn.Module):
    def __init__(self, num_classes, cell, bidirectional):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = cell(16, 12, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(24 if bidirectional else 12, num_classes)

    def forward(self, x):
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


def lstm(input_shape, num_classes):
    return Recurrent(num_classes, nn.LSTM, False)


def bigru(input_shape, num_classes):
    return Recurrent(num_classes, nn.GRU, True)


class Encoder(nn.Module):
    def __init__(self, length, num_classes):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.position = nn.Parameter(torch.zeros(1, length, 16))
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x) + self.position).mean(1))


def encoder(input_shape, num_classes):
    return Encoder(input_shape[0], num_classes)


def pretrained(input_shape, num_classes, weights=""):
    """The common DP recipe: a backbone whose weights come from a file (``[model.args]
    weights``), frozen, and a new trainable head. An empty path builds it untrained (what an
    export's loader passes: the exported weights replace every parameter)."""
    backbone = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.GroupNorm(2, 8),
                             nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    if weights:
        backbone.load_state_dict(torch.load(weights, weights_only=True))
    backbone.requires_grad_(False)
    return nn.Sequential(backbone, nn.Linear(32, num_classes))
