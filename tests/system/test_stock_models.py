"""Stock PyTorch and torchvision models train unmodified: each built by a factory that only
calls constructors, checked by ``dpsweep config --check`` and trained for one epoch by
``dpsweep train`` on an image folder or a token ``.npz``, with a valid epsilon at its target,
a finite loss, its trainable weights changed and its frozen ones untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpsweep.core import layout
from dpsweep.orchestrator import api
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.single import TRIAL_ID
from dpsweep.trainables.audit.exclusion import SHARED
from dpsweep.trainables.training.loop import _derived_seeds, load_checkpoint_state

pytestmark = pytest.mark.slow

#: The factories, shipped as the user's code (a file of constructors only).
FACTORIES = Path(__file__).resolve().parents[1] / "stock_nets.py"
#: The smallest splits the checks accept (validation: enough to tell a model from chance).
SIZES = "train_size = 60\nvalidation_size = 90\nholdout_size = 20\ntest_size = 30\n" \
        "shadow_size = 40\n"
#: (factory, data, extra [model] lines, the layers DP training must train)
CASES = {
    "resnet18_groupnorm": ("resnet_gn", "images", "", None),
    "resnet18_frozen_backbone": ("resnet_head", "images", "", ["fc"]),
    "vision_transformer": ("vit", "images", "", None),
    "embedding_lstm": ("lstm", "tokens", "", None),
    "embedding_bigru": ("bigru", "tokens", "", None),
    "transformer_encoder": ("encoder", "tokens", "", None),
    "resnet18_batchnorm_fixed": ("resnet_bn", "images", "fix = true\n", None),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stock")
    (root / "code").mkdir()
    (root / "code" / "stock.py").write_text(FACTORIES.read_text())
    rng = np.random.default_rng(0)
    for label, name in enumerate(["cat", "dog", "fox"]):
        folder = root / "images" / name
        folder.mkdir(parents=True)
        for i in range(80):
            pixels = rng.integers(0, 90, size=(16, 16, 3)) + 80 * label
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    y = rng.integers(0, 3, size=240)
    x = rng.integers(0, 50, size=(240, 12))
    x[:, 0] = y + 1  # the label is readable from the first token
    np.savez(root / "tokens.npz", x=x.astype(np.int64), y=y.astype(np.int64))
    return root


def _config(root: Path, name: str) -> Path:
    factory, data, extra, _ = CASES[name]
    source = (f'path = "{root / "images"}"\n' if data == "images"
              else f'path = "{root / "tokens.npz"}"\ninputs = "tokens"\n')
    text = (f'[data]\ndataset = "file"\n{source}{SIZES}'
            f'[model]\nfactory = "stock:{factory}"\ncode_dir = "{root / "code"}"\n{extra}'
            '[training]\nepochs = 1\nbatch_size = 20\nmethod = "dpsgd"\n'
            '[privacy]\nepsilon = 3.0\n')
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_a_stock_model_checks_and_trains_unmodified(workspace: Path, name: str) -> None:
    config = _config(workspace, name)
    assert main(["config", "--check", str(config)]) == 0
    out = workspace / f"run-{name}"
    assert main(["train", str(config), "--out", str(out)]) == 0
    privacy = json.loads(next(out.rglob(layout.PRIVACY)).read_text())
    assert privacy["dp_valid"] is True
    assert privacy["epsilon_upper"] <= 3.0 and privacy["epsilon_upper"] >= 0.99 * 3.0
    record = privacy["method_record"]
    trained = CASES[name][3]
    if trained is not None:
        assert record["trained_layers"] == trained
    assert 0 < record["trained_parameters"] <= record["model_parameters"]
    checkpoint = next(out.rglob(layout.CHECKPOINT_FILE)).parent
    state = load_checkpoint_state(checkpoint)
    assert np.isfinite(state["history"][-1]["train_loss_nonprivate"])
    initial = _initial_weights(workspace, name, state["spec"])
    frozen = [k for k, v in initial.items() if not v.requires_grad]
    moved = [k for k, v in initial.items()
             if v.requires_grad and not torch.equal(v.detach(), state["model"]["net." + k])]
    assert moved, "no trainable weight changed"
    assert all(torch.equal(initial[k].detach(), state["model"]["net." + k]) for k in frozen)
    if name == "resnet18_frozen_backbone":
        assert len(frozen) == sum(1 for k in initial if not k.startswith("fc."))
        _audit_lists_every_layer(config, checkpoint, state["spec"])


def _audit_lists_every_layer(config: Path, checkpoint: Path, spec: dict) -> None:
    """The membership audit of the frozen-backbone model reports every layer: the frozen
    backbone, which every reference starts from (``trainables.audit.prefix.FrozenStart``), as
    shared with the target, the trained head attacked (the gradient-norm attacks cover the
    trained layer only)."""

    from dpsweep.orchestrator.audit.membership import (
        AuditSettings,
        audit_trial_model,
        budgets_from_config,
        reference_budgets,
    )
    from dpsweep.trainables.training.loop import load_spec

    cfg = api.load_config(config)
    data = check(cfg).data_splits()
    trial = load_spec(spec)
    budgets = reference_budgets(cfg, method="dpsgd", params=trial.method_params, epsilon=3.0,
                                data=data, cache_dir=None)
    record = audit_trial_model(spec=trial, checkpoint=checkpoint, data=data,
                               settings=AuditSettings.from_config(cfg.audit),
                               budgets=budgets_from_config(budgets))
    attacked = {entry["layer"] for entry in record["attacks"]}
    shared = {entry["layer"] for entry in record["excluded"] if entry["status"] == SHARED}
    assert {"conv1", "bn1", "layer1", "layer2", "layer3", "layer4"} <= shared - attacked
    assert "fc" in attacked
    assert {e["layer"] for e in record["attacks"] if e["attack"].endswith(":grad_norm")} \
        == {"fc"}


def _initial_weights(root: Path, name: str, spec: dict) -> dict[str, torch.Tensor]:
    """The factory's weights before training: the trial seeds the build from its spec."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("stock_check", root / "code" /
                                                         "stock.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    seed_model, _ = _derived_seeds(spec["seed"])
    shape = (12,) if CASES[name][1] == "tokens" else (3, 16, 16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_model)
        net = getattr(module, CASES[name][0])(shape, 3)
    if name == "resnet18_batchnorm_fixed":
        from dpsweep.trainables.models.fix import fix_model

        net, _ = fix_model(net)
    return dict(net.named_parameters())


def test_a_pretrained_backbone_from_a_file_trains_only_its_head(workspace: Path) -> None:
    """``[model.args]`` names the backbone's weights file; the trial trains the head alone,
    leaves every backbone weight as the file has it, and its export loads without that file."""
    torch.manual_seed(1)
    saved = workspace / "backbone.pt"
    donor = __import__("tests.stock_nets", fromlist=["pretrained"]).pretrained((3, 16, 16), 3)
    torch.save(donor[0].state_dict(), saved)
    config = workspace / "pretrained.toml"
    config.write_text(_config(workspace, "resnet18_frozen_backbone").read_text().replace(
        'factory = "stock:resnet_head"', f'factory = "stock:pretrained"\nargs = {{weights = '
        f'"{saved}"}}'))
    out = workspace / "run-pretrained"
    assert main(["train", str(config), "--out", str(out)]) == 0
    state = load_checkpoint_state(next(out.rglob(layout.CHECKPOINT_FILE)).parent)
    backbone = torch.load(saved, weights_only=True)
    for name, value in backbone.items():
        assert torch.equal(state["model"][f"net.0.{name}"], value), name
    privacy = json.loads(next(out.rglob(layout.PRIVACY)).read_text())
    assert privacy["method_record"]["trained_layers"] == ["1"]
    assert privacy["method_record"]["trained_parameters"] == 32 * 3 + 3
    release = workspace / "pretrained-release"
    assert main(["export", str(out), "--trial", TRIAL_ID, "--out", str(release),
                 "--allow-degenerate"]) == 0
    saved.unlink()  # the stranger has the export, not the training machine's backbone file
    model_json = (release / layout.EXPORT_MODEL).read_text()
    assert str(workspace) not in model_json  # no path of the training machine
    assert json.loads(model_json)["build"]["paths_removed"] == ["weights"]
    probe = "x = torch.full((2, 3, 16, 16), 128, dtype=torch.uint8)"
    script = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import load; "
              f"m = load.load(sys.argv[1]); {probe}; "
              "print(m(x).argmax(1).tolist())")
    proc = subprocess.run([sys.executable, "-I", "-c", script, str(release)],
                          capture_output=True, text=True, timeout=120, cwd=workspace)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout.strip())) == 2
