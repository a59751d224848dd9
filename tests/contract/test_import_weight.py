"""What a fresh interpreter imports on each light path: validating a config, refusing a bad one
(before torch, Ray, Optuna or scikit-learn load), a worker's splits cut from a shared pool
(scikit-learn never imported), and training (torch._dynamo never imported). Only a new process
shows what a path imports, so these are contract tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpsweep.trainables.data import splits as data

REPO = Path(__file__).resolve().parents[2]


def test_validating_a_config_imports_no_deep_learning_stack() -> None:
    code = ("import sys; from dpsweep.orchestrator import api; "
            "api.from_dict({'sweep': {'methods': []}, 'method_params': {'lr': 0.3}}); "
            "print(sorted(m for m in ('torch._C', 'optuna', 'ray', 'sklearn') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


#: What a sweep's module brings in (``orchestrator.sweep.commands``): seconds of imports that a
#: refused config must not wait for.
HEAVY = ("torch._C", "ray", "optuna", "sklearn")


@pytest.mark.parametrize(("command", "text", "says"), [
    ("run", None, "expected an existing TOML file"),
    ("run", "[training\nepochs = 2\n", "expected valid TOML"),
    ("run", "[training]\nepochs = 0\n", "training.epochs = 0 is not allowed"),
    ("train", "[training\n", "expected valid TOML"),
])
def test_a_missing_or_bad_config_is_refused_before_torch_ray_or_optuna_load(
        command: str, text: str | None, says: str, tmp_path: Path) -> None:
    """The refusal comes from the config, read and validated before the command's module is
    imported: no timing, only what the process had loaded when it refused."""
    config = tmp_path / "sweep.toml"
    if text is not None:
        config.write_text(text)
    out = tmp_path / "out"
    code = ("import sys\nfrom orchestrator.cli import main\n"
            f"rc = main([{command!r}, {str(config)!r}, '--out', {str(out)!r}])\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
            "raise SystemExit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stdout.strip() == "[]"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpsweep: error: ") and says in lines[0]
    assert not out.exists()


def test_training_never_imports_torch_dynamo() -> None:
    """Every method's DP steps, the non-private recipe and LM-DP-SGD's stage-1 training run in a
    fresh interpreter without importing torch._dynamo (torch.optim's classes import it on their
    first call: 2-4 s in every fresh Ray worker on this machine). On one intra-op thread, as a
    trial runs (``TrialSpec.threads``): with torch's default of one per core the interpreter
    took 79 s on a busy 2-core host against 11 s on one (9-10 s either way on an idle host),
    and the thread count has no bearing on what is imported."""
    code = """
import sys
import torch
torch.set_num_threads(1)
from tests.contract import conformance
from dpsweep.trainables.methods import METHODS
from dpsweep.trainables.audit.references import NonPrivateRecipe, train_nonprivate
for name, cls in sorted(METHODS.items()):
    for mode in cls.modes:  # preparation, steps, and a resume from the checkpointable state
        conformance.lifecycle(cls, mode.name, steps=6, resume_at=3)
        assert "torch._dynamo" not in sys.modules, (name, mode.name)
train_nonprivate(data=conformance.digits(), recipe=NonPrivateRecipe(
    epochs=1, lr=0.003, batch_size=64), seed=0, threads=1)
assert "torch._dynamo" not in sys.modules, "nonprivate"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_pool_shared_by_the_driver_serves_the_splits_without_reading_the_data() -> None:
    """A sweep's workers get the driver's pool through Ray's object store: their splits are cut
    from it (same seeds, same indices) and scikit-learn is never imported for them."""
    code = """
import sys
import numpy as np
from dpsweep.trainables.data import splits as data
n = 1797
pool = data.RawPool(x=(np.arange(n) % 251).astype(np.uint8).reshape(n, 1, 1, 1).repeat(64, 1)
                    .reshape(n, 1, 8, 8), y=(np.arange(n) % 10).astype(np.int64), n_train=n,
                    source="sklearn")
data.share_pool(pool, dataset="digits")
splits = data.load_splits(dataset="digits", seed=3)
assert "sklearn" not in sys.modules
for split in (splits.train, splits.validation, splits.test):
    assert bool((data.normalise(pool.x[split.indices], dataset="digits") == split.x).all())
    assert (split.y.numpy() == pool.y[split.indices]).all()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    with pytest.raises(TypeError, match="RawPool"):
        data.share_pool(torch.zeros(3), dataset="digits")  # type: ignore[arg-type]
