"""``[model] fix = true``: every BatchNorm becomes a GroupNorm (and InstanceNorm running
statistics go) in the user's network, wherever it is built, and the privacy record says so;
without it the refusal lists every BatchNorm in one line, naming the factory as the value."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator import api
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.fix import fix_model, group_count
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.models.validator import sample_batch, wrap_checked

MODULE = """\
from collections import OrderedDict

from torch import nn


def build(input_shape, num_classes, width=8):
    return nn.Sequential(OrderedDict(
        conv=nn.Conv2d(input_shape[0], width, 3, padding=1),
        bn=nn.BatchNorm2d(width),
        act=nn.ReLU(),
        flat=nn.Flatten(),
        head=nn.Linear(width * input_shape[1] * input_shape[2], num_classes)))
"""
#: What the privacy record says of MODULE's network under fix.
FIXED = {"module": "bn", "was": "BatchNorm2d(8)", "now": "GroupNorm(8 groups, 8 channels)",
         "kind": "GroupNorm", "kwargs": {"num_groups": 8, "num_channels": 8, "eps": 1e-5,
                                         "affine": True}}


def _randomise_affine(net: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
            m.weight.data = torch.rand(m.weight.shape, generator=gen) + 0.5
            m.bias.data = torch.randn(m.bias.shape, generator=gen)


def _norms(net: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in net.named_modules()
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm))}


def test_resnet18_loses_every_batchnorm_and_keeps_its_shapes_and_affine() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10)
    _randomise_affine(net)
    net.layer2[0].bn1.weight.requires_grad_(False)  # a frozen BN stays frozen
    before = {n: (m.num_features, m.weight.detach().clone(), m.bias.detach().clone())
              for n, m in _norms(net).items()}
    x = torch.randn(2, 3, 32, 32)
    fixed, done = fix_model(net)
    assert fixed is net and len(done) == len(before) == 20
    assert [r.module for r in done] == list(before)  # named_modules order
    assert done[0].to_dict() == {"module": "bn1", "was": "BatchNorm2d(64)",
                                 "now": "GroupNorm(32 groups, 64 channels)", "kind": "GroupNorm",
                                 "kwargs": {"num_groups": 32, "num_channels": 64, "eps": 1e-5,
                                            "affine": True}}
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert not any("running" in name for name, _ in net.named_buffers())
    for name, gn in _norms(net).items():
        channels, weight, bias = before[name]
        assert isinstance(gn, nn.GroupNorm) and gn.num_channels == channels
        assert channels % gn.num_groups == 0 and gn.num_groups == min(32, channels)
        torch.testing.assert_close(gn.weight.detach(), weight)
        torch.testing.assert_close(gn.bias.detach(), bias)
        assert gn.weight.requires_grad == (name != "layer2.0.bn1") and gn.bias.requires_grad
    assert tuple(net(x).shape) == (2, 10)


def test_a_batchnorm1d_mlp_gets_one_group_and_a_non_constant_output() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(),
                        nn.Linear(16, 24), nn.BatchNorm1d(24, affine=False), nn.Linear(24, 3))
    _randomise_affine(net)
    x = torch.randn(5, 12)
    fixed, done = fix_model(net.double())
    assert [r.now for r in done] == ["GroupNorm(1 groups, 16 channels)",
                                     "GroupNorm(1 groups, 24 channels)"]
    assert fixed[1].weight.dtype == torch.float64 and fixed[4].weight is None
    out = fixed(x.double())
    assert tuple(out.shape) == (5, 3)
    # groups of one feature would normalise every feature of [batch, C] to zero
    assert fixed[1](fixed[0](x.double())).std() > 0.5
    assert group_count(nn.BatchNorm2d(48)) == 16 and group_count(nn.BatchNorm3d(6)) == 2
    assert group_count(nn.SyncBatchNorm(40)) == 8


def test_shared_and_root_norms_and_instance_norm_statistics() -> None:
    shared = nn.BatchNorm2d(4)
    net = nn.Sequential(OrderedDict(a=nn.Conv2d(1, 4, 1), b=shared, c=nn.Conv2d(4, 4, 1),
                                    d=shared, e=nn.InstanceNorm2d(4, affine=True,
                                                                   track_running_stats=True)))
    net, done = fix_model(net)
    assert [r.module for r in done] == ["b", "d", "e"] and net.b is net.d  # still shared
    assert done[2].was == "InstanceNorm2d(4, track_running_stats=True)"
    assert done[2].kind == "InstanceNorm2d" and not done[2].kwargs["track_running_stats"]
    assert isinstance(net.e, nn.InstanceNorm2d) and not net.e.track_running_stats
    assert net.e.running_mean is None and net.e.affine
    root, done = fix_model(nn.BatchNorm1d(3))
    assert isinstance(root, nn.GroupNorm) and [r.module for r in done] == [""]
    untouched = nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2))
    assert fix_model(untouched) == (untouched, [])


def test_without_fix_the_refusal_lists_every_batchnorm_and_shows_the_factory(
        tmp_path: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    (tmp_path / "resnets.py").write_text(
        "import torchvision\n\ndef build(input_shape, num_classes):\n"
        "    return torchvision.models.resnet18(num_classes=num_classes)\n")
    source = ModelSource(factory="resnets:build", code_dir=str(tmp_path))
    with pytest.raises(UserInputError) as err:
        build_network(source, input_shape=(3, 32, 32), num_classes=10, dataset="")
    text = str(err.value)
    assert err.value.field == "model.factory" and err.value.value == "resnets:build"
    assert text.startswith("model.factory = 'resnets:build' is not allowed") and "\n" not in text
    assert "20 BatchNorm modules ('bn1', 'layer1.0.bn1', 'layer1.0.bn2' and 17 more)" in text
    assert "set [model] fix = true to replace every BatchNorm with GroupNorm" in text
    # without a reference (a direct caller), the value is the network's class
    with pytest.raises(UserInputError) as err:
        wrap_checked(torchvision.models.resnet18(), layers=(), num_classes=1000,
                     sample=sample_batch(input_shape=(3, 32, 32), tokens=False))
    assert err.value.value == "ResNet"


def test_a_fixed_source_builds_the_same_network_every_time(tmp_path: Path) -> None:
    (tmp_path / "bn_net.py").write_text(MODULE)
    source = ModelSource(factory="bn_net:build", code_dir=str(tmp_path), fix=True)
    assert source.to_dict()["fix"] is True
    assert ModelSource.from_dict(source.to_dict()) == source
    assert "fix" not in ModelSource(factory="bn_net:build").to_dict()  # old records unchanged
    first = build_network(source, input_shape=(1, 8, 8), num_classes=10, dataset="")
    again = build_network(ModelSource.from_dict(source.to_dict()), input_shape=(1, 8, 8),
                          num_classes=10, dataset="")
    assert first.model_fixes == [FIXED]
    assert first.layer_names == ["conv", "bn", "head"]
    shapes = {k: tuple(v.shape) for k, v in first.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in again.state_dict().items()}
    assert not any("running" in k for k in shapes)
    again.load_state_dict(first.state_dict())  # an export's weights load into the rebuild
    with pytest.raises(UserInputError, match=r"model\.fix = 'yes'"):
        ModelSource(factory="bn_net:build", fix="yes")  # type: ignore[arg-type]


CONFIG = """\
[data]
dataset = "digits"
[model]
factory = "bn_net:build"
{fix}
[training]
epochs = 1
batch_size = 64
"""


def test_the_config_key_is_a_boolean(tmp_path: Path) -> None:
    (tmp_path / "bn_net.py").write_text(MODULE)
    path = tmp_path / "sweep.toml"
    path.write_text(CONFIG.format(fix='fix = "yes"'))
    with pytest.raises(UserInputError) as err:
        api.load_config(path)
    assert err.value.field == "model.fix" and "\n" not in str(err.value)
    path.write_text(CONFIG.format(fix="fix = true"))
    cfg = api.load_config(path)
    assert cfg.model.fix is True and check(cfg).model_source.fix is True
    path.write_text(CONFIG.format(fix="fix = false"))  # the default: refused, naming the fix
    with pytest.raises(UserInputError, match=r"set \[model\] fix = true"):
        api.load_config(path)


def test_config_check_and_one_epoch_train_with_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bn_net.py").write_text(MODULE)
    path = tmp_path / "sweep.toml"
    path.write_text(CONFIG.format(fix=""))
    assert main(["config", "--check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.factory = 'bn_net:build'" in err
    assert "1 BatchNorm module ('bn')" in err and "[model] fix = true" in err

    path.write_text(CONFIG.format(fix="fix = true"))
    assert main(["config", "--check", str(path)]) == 0
    out = tmp_path / "run"
    assert main(["train", str(path), "--out", str(out)]) == 0
    privacy = json.loads((out / "trials/trial-000/privacy.json").read_text())
    assert privacy["method_record"]["model_fixes"] == [FIXED]
    spec = json.loads((out / "trials/trial-000/spec.json").read_text())
    assert spec["user_model"]["fix"] is True
    from dpsweep.orchestrator.trial.plan import config_from_spec

    assert config_from_spec(spec).model.fix is True  # what pick writes to retrain it
    release = tmp_path / "release"
    assert main(["export", str(out), "--trial", "trial-000", "--out", str(release)]) == 0
    from dpsweep.orchestrator.release.model_card import fresh_model

    info = json.loads((release / "model.json").read_text())
    assert info["model_source"]["fix"] is True
    state = torch.load(release / "weights.pt", weights_only=True)
    fresh_model(info).net.load_state_dict(state)  # the rebuild is fixed the same way
