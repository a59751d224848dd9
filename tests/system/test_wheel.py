"""The wheel a user installs: ``dpsweep`` is its only top-level name, and installed into a fresh
environment (one that sees the dependencies but not this checkout) it imports and runs a
one-trial sweep on Ray."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from dpsweep import PACKAGES
from dpsweep.core.vocabulary import OK
from tests.system.conftest import Lane

REPO = Path(__file__).resolve().parents[2]
#: What a wheel is built from (copied, so that the build writes nothing into the checkout).
SOURCES = ("dpsweep", *PACKAGES, "setup.py", "pyproject.toml", "README.md")
SWEEP = """\
[training]
epochs = 1
batch_size = 50

[sweep]
methods = ["dpsgd"]
trials_per_method = 1

baseline = false

[audit]
enabled = false
"""
BUILD_TIMEOUT_S = 300
SWEEP_TIMEOUT_S = 600


def _run(args: list[str], *, cwd: Path, timeout: float = BUILD_TIMEOUT_S
         ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def lane_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None]:
    """The build, install and sweep as a job for ``conftest.py``'s lane (its outcome depends
    on no timing), its folder taken now."""
    return functools.partial(_build_install_and_sweep, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_dpsweep_alone_and_runs_a_sweep(
        lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> None:
    lane.result(__name__, lambda: lane_job(tmp_path_factory))


def _build_install_and_sweep(tmp_path: Path) -> None:
    source = tmp_path / "source"
    for name in SOURCES:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, source / name)  # type: ignore[operator]
    _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
          "--no-build-isolation", "--quiet", "-w", str(tmp_path / "dist")], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("dpsweep-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dpsweep"}
    assert not [n for n in names if "docgen" in n or n.startswith(("dpsweep/bench", "tests"))]
    assert {f"dpsweep/{p}/__init__.py" for p in PACKAGES} <= set(names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp_path).stdout.strip()
    # the dependencies (this environment's site-packages), not the checkout or its editable
    # install: a path line in a .pth adds the folder, whose own .pth files do not run
    Path(site, "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
          str(wheel)], cwd=tmp_path)
    probe = ("import sys, dpsweep; dpsweep.run; dpsweep.budget; "
             "print(dpsweep.__path__[0]); "
             f"print(sorted(set(sys.modules) & set({list(PACKAGES)!r})))")
    lines = _run([str(python), "-c", probe], cwd=tmp_path).stdout.splitlines()
    assert Path(lines[0]).parent == Path(site) and lines[1] == "[]"

    (tmp_path / "sweep.toml").write_text(SWEEP)
    _run([str(venv / "bin" / "dpsweep"), "run", "sweep.toml", "--out", "out", "--quiet"],
         cwd=tmp_path, timeout=SWEEP_TIMEOUT_S)
    frame = pd.read_parquet(tmp_path / "out" / "results.parquet")
    assert len(frame) == 1 and frame["status"].tolist() == [OK]
