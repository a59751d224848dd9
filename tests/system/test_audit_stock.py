"""The default membership audit completes with a finite peak MIA on stock torch / torchvision
models: ResNet-18 (GroupNorm) with a frozen backbone shared through one weights file (the
recipe ``docs/user-models.md`` recommends; issue 41), ResNet-18 (GroupNorm), ResNet-18 with
BatchNorm under ``[model] fix = true``, SqueezeNet, a ViT, an LSTM, a bidirectional GRU, a
TransformerEncoder, an EmbeddingBag classifier, and one model of each torchvision family the
zoo needed a rule for (issue 45): GoogLeNet's auxiliary heads (a toy net with its pattern),
Swin v1 and MaxViT.

Each trial runs as a sweep runs it, below Ray: the trial runner (``execute``) with the audit
hook (``audit_in_trial``) and the audit section and reference budgets the sweep gives it, at a
tiny size (a few dozen examples, one epoch, the default four offline references). The shared
backbone's layer is reported frozen and shared, outside the peak and the Holm family; every
layer that trains is scored."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dpsweep.core import layout
from dpsweep.orchestrator import api
from dpsweep.orchestrator.audit.membership import (
    audit_in_trial,
    reference_budgets,
    row_audit_columns,
)
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep.search import audit_settings
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.orchestrator.trial.runner import execute
from dpsweep.trainables.audit.exclusion import PARTLY_SCORED, SCORED, SHARED, SHARED_FROZEN
from tests.system import audit_nets

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: The user's code folder: the stock factories and the audit's additions.
CODE = {"stock.py": ROOT / "stock_nets.py", "extra.py": Path(audit_nets.__file__)}
#: Image sides: 16 x 16, and 24 x 24 for SqueezeNet (its smallest); token rows of 12; three
#: classes.
IMAGE_SIDES = {"images": 16, "images24": 24}
TOKENS = 12
CLASSES = 3
PER_CLASS = 64
#: Small splits the checks accept: 20 members and 20 non-members audited, offline references
#: trained on 20 of the 40 shadow examples; validation as small as three classes allow (86),
#: the layer probes' fitting set.
SIZES = ("train_size = 20\nvalidation_size = 90\nholdout_size = 20\ntest_size = 10\n"
         "shadow_size = 40\n")
#: name -> (factory, data, extra [model] lines)
CASES = {
    "resnet18_frozen_backbone_file": ("extra:resnet_backbone", "images", "weights"),
    "resnet18_groupnorm": ("stock:resnet_gn", "images", ""),
    "resnet18_batchnorm_fixed": ("stock:resnet_bn", "images", "fix = true\n"),
    "squeezenet": ("extra:squeezenet", "images24", ""),
    "vision_transformer": ("stock:vit", "images", ""),
    "embedding_lstm": ("stock:lstm", "tokens", ""),
    "embedding_bigru": ("stock:bigru", "tokens", ""),
    "transformer_encoder": ("stock:encoder", "tokens", ""),
    "embedding_bag": ("extra:bag", "tokens", ""),
    "aux_heads": ("extra:aux_heads", "images", "fix = true\n"),
    "swin_v1": ("extra:swin", "images", ""),
    "maxvit": ("extra:maxvit", "images", "fix = true\n"),
}
TRIAL_ID = "audit-000"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Code folder, image folder, token file, and the backbone's weights file (one seed)."""
    root = tmp_path_factory.mktemp("audit_stock")
    (root / "code").mkdir()
    for name, source in CODE.items():
        (root / "code" / name).write_text(source.read_text())
    rng = np.random.default_rng(0)
    for images, side in IMAGE_SIDES.items():
        for label, name in enumerate(["cat", "dog", "fox"]):
            folder = root / images / name
            folder.mkdir(parents=True)
            for i in range(PER_CLASS):
                pixels = rng.integers(0, 90, size=(side, side, 3)) + 80 * label
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    y = rng.integers(0, CLASSES, size=CLASSES * PER_CLASS)
    x = rng.integers(0, audit_nets.VOCAB, size=(len(y), TOKENS))
    x[:, 0] = y + 1  # the label is readable from the first token
    np.savez(root / "tokens.npz", x=x.astype(np.int64), y=y.astype(np.int64))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(audit_nets.backbone().state_dict(), root / "backbone.pt")
    return root


def _config(root: Path, name: str) -> Path:
    factory, data, extra = CASES[name]
    source = (f'path = "{root / data}"\n' if data in IMAGE_SIDES
              else f'path = "{root / "tokens.npz"}"\ninputs = "tokens"\n')
    if extra == "weights":  # an absolute path: the trial reads it wherever it runs
        extra = f'args = {{weights = "{root / "backbone.pt"}"}}\n'
    text = (f'[data]\ndataset = "file"\n{source}{SIZES}'
            f'[model]\nfactory = "{factory}"\ncode_dir = "{root / "code"}"\n{extra}'
            '[training]\nepochs = 1\nbatch_size = 10\nmethod = "dpsgd"\n'
            '[privacy]\nepsilon = 3.0\n[audit]\nenabled = true\n')
    path = root / f"{name}.toml"
    path.write_text(text)
    return path


def _audited_trial(root: Path, name: str) -> tuple[dict, dict]:
    """(audit.json, the trial's record) of one trial trained and audited by the trial runner
    with the sweep's audit hook, its budgets matched as the sweep matches them."""
    cfg = api.load_config(_config(root, name))
    setup = check(cfg)
    data = setup.data_splits()
    run = root / f"run-{name}"
    spec = plan_trial(setup, trial_id=TRIAL_ID, data=data)
    audit = audit_settings(cfg)
    audit["budgets"] = reference_budgets(cfg, method=spec.method, params=spec.method_params,
                                         epsilon=cfg.privacy.epsilon, data=data,
                                         cache_dir=None)
    record = execute({"run_dir": str(run), "trial_id": TRIAL_ID, "spec": spec.to_dict(),
                      "audit": audit}, audit=audit_in_trial)
    assert record["audit_error"] == "", record["audit_error"]
    return json.loads((run / layout.TRIALS / TRIAL_ID / layout.AUDIT).read_text()), record


@pytest.mark.parametrize("name", list(CASES))
def test_the_default_audit_gives_a_finite_peak_on_a_stock_model(workspace: Path,
                                                                  name: str) -> None:
    audit, record = _audited_trial(workspace, name)
    assert math.isfinite(record["peak_mia_accuracy"]) and math.isfinite(record["peak_mia_upper"])
    assert 0 <= audit["peak_mia_accuracy"] <= audit["peak_mia_upper"] <= 1
    assert audit["peak_absent_reason"] is None
    cells = [(e["layer"], e["attack"]) for e in audit["attacks"]]
    assert audit["combined"]["n_tests"] == len(cells) == audit["n_scored"]
    assert (audit["peak_layer"], audit["peak_attack"]) in cells
    assert all(math.isfinite(e["accuracy"]) and math.isfinite(e["auc"])
               for e in audit["attacks"])
    row = row_audit_columns(audit)
    assert math.isfinite(row["peak_mia_accuracy"]) and row["peak_layer"]
    statuses = {s["layer"]: s for s in audit["layers"]}
    shared = {e["layer"] for e in audit["excluded"] if e["status"] == SHARED}
    if name == "resnet18_frozen_backbone_file":
        backbone = statuses.pop("0")
        assert backbone["status"] == SHARED and backbone["frozen"]
        assert all(r.startswith(SHARED_FROZEN) for r in backbone["reasons"])
        assert shared == {"0"} and set(statuses) == {"1", "output"}
    else:  # every layer trains: nothing is shared
        assert shared == set()
    # every layer that trains is scored (a cell with a non-finite score may be excluded)
    assert all(s["status"] in (SCORED, PARTLY_SCORED) and s["n_scored"] > 0
               for s in statuses.values())
    assert {layer for layer, _ in cells} == set(statuses)
