"""Every folder in ``examples/`` runs as the README says, at a small size: its data script, its
config checked, one short sweep; the BatchNorm example is refused with its fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import read_toml
from reports.store import read_results

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent
#: The examples' configs at a size CI can afford (the sweep and sizes sections replaced).
SMALL = {"training": {"epochs": 1, "batch_size": 64},
         "sweep": {"trials_per_method": 1, "max_concurrent_trials": 2, "baseline": False},
         "audit": {"enabled": False}}


def _shrink(config: Path, sizes: dict[str, int]) -> None:
    import tomli_w

    raw = read_toml(config)
    for section, values in SMALL.items():
        raw.setdefault(section, {}).update(values)
    raw["data"].update({f"{k}_size": v for k, v in sizes.items()})
    config.write_text(tomli_w.dumps(raw))


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the data scripts import dpsweep's loaders
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_example_is_listed_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    folders = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
    assert folders == ["batchnorm_refused", "fashion_cnn", "tabular_digits"]
    for name in folders:
        assert f"examples/{name}" in readme, name


@pytest.mark.parametrize(("name", "script_args", "sizes"), [
    ("tabular_digits", [], {"train": 800, "validation": 200, "holdout": 300, "test": 297,
                            "shadow": 200}),
    ("fashion_cnn", ["--limit", "2000"], {"train": 800, "validation": 300, "holdout": 300,
                                          "test": 300, "shadow": 300}),
])
def test_an_example_runs_end_to_end(name: str, script_args: list[str], sizes: dict[str, int],
                                    tmp_path: Path) -> None:
    if name == "fashion_cnn" and not Path("/usr/share/datasets/fashion-mnist").is_dir():
        pytest.skip("Fashion-MNIST is not on this machine (`make data`)")
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder)
    made = _run(sys.executable, "make_data.py", *script_args, cwd=folder)
    assert made.returncode == 0, made.stderr[-2000:]
    _shrink(folder / "sweep.toml", sizes)
    checked = _run(str(BIN / "dpsweep"), "config", "--check", "sweep.toml", cwd=folder)
    assert checked.returncode == 0, checked.stderr[-2000:]
    swept = _run(str(BIN / "dpsweep"), "run", str(folder / "sweep.toml"), "--out", "run",
                 "--quiet", cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr[-3000:]
    frame = read_results(tmp_path / "run")
    methods = read_toml(folder / "sweep.toml")["sweep"]["methods"]
    assert len(frame) == len(methods) and (frame["status"] == "ok").all(), frame["error"]


def test_the_batchnorm_example_is_refused_with_its_fix() -> None:
    proc = _run(str(BIN / "dpsweep"), "config", "--check",
                str(EXAMPLES / "batchnorm_refused" / "sweep.toml"), cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "replace BatchNorm2d '1' with GroupNorm" in lines[0]
