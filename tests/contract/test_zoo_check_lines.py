"""Issue 45: ``dpsweep config --check`` of a model that cannot run on the config's data is one
line on stderr with exit 2, never a traceback: an input smaller than the model's pools need
(AlexNet on 32 pixels, in small), and a forward that asks for more memory than any machine has
(a model too big for this one, without filling it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dpsweep.orchestrator import cli

MODELS = '''
import torch
from torch import nn


def pooled(input_shape, num_classes):
    """Two 4x4 pools: 16 pixels at least."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(4), nn.MaxPool2d(4),
                         nn.Flatten(), nn.Linear(4, num_classes))


class Huge(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.head = nn.Linear(192, num_classes)

    def forward(self, x):
        scratch = torch.empty(1 << 60, dtype=torch.uint8)  # more than any address space
        return self.head(x.flatten(1)) + scratch[:1].float()


def huge(input_shape, num_classes):
    return Huge(num_classes)
'''
#: The smallest split sizes the door accepts for 10 classes (validation tells chance apart).
SPLITS = {"train_size": 64, "validation_size": 40, "holdout_size": 16, "test_size": 16,
          "shadow_size": 24}
SIDE = 8


def _config(tmp_path: Path, factory: str) -> Path:
    rng = np.random.default_rng(0)
    n = sum(SPLITS.values())
    np.savez(tmp_path / "images.npz", x=rng.random((n, 3, SIDE, SIDE), dtype=np.float32),
             y=np.arange(n) % 10)
    (tmp_path / "zoo_lines_models.py").write_text(MODELS)
    sizes = "\n".join(f"{k} = {v}" for k, v in SPLITS.items())
    path = tmp_path / "check.toml"
    path.write_text(f'[data]\ndataset = "file"\npath = "images.npz"\n{sizes}\n\n'
                    f'[model]\nfactory = "zoo_lines_models:{factory}"\nfix = true\n\n'
                    '[training]\nbatch_size = 8\n\n[audit]\nenabled = false\n')
    return path


def _one_line(capsys: pytest.CaptureFixture[str], config: Path) -> str:
    assert cli.main(["config", "--check", str(config)]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "valid;" not in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_an_input_smaller_than_the_model_needs_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capsys, _config(tmp_path, "pooled"))
    assert line.startswith("dpsweep: error: model.factory = 'zoo_lines_models:pooled'")
    # the module that fails, the input it was given and the smallest one that runs
    assert "module '2' (MaxPool2d)" in line and f"(3, {SIDE}, {SIDE})" in line
    assert "(3, 16, 16)" in line


def test_a_forward_that_cannot_get_its_memory_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capsys, _config(tmp_path, "huge"))
    assert line.startswith("dpsweep: error: model.factory = 'zoo_lines_models:huge'")
    assert "can't allocate memory" in line and "Huge" in line
