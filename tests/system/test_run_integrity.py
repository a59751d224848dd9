"""A sweep under a 100-character TMPDIR, then a resume of it with a trial directory deleted
(issue 26, items 1 and 3), on the real CLI.

Under a TMPDIR of about 40 characters or more every run failed: Ray's plasma store socket below
``$TMPDIR/dpsweep-ray-<uid>/ray/session_...`` exceeded the 107 bytes of a Unix socket path, after
the run directory was written. A deleted trial directory was silently trained again under a new
id while its row still said ok; the resume must now refuse with one line, before Ray starts,
and change nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.system.test_faults import complete_ids, optuna_trials, result_ids

BIN = Path(sys.executable).parent / "dpsweep"
CONFIG = """\
[training]
epochs = 1
[sweep]
methods = ["dpsgd"]
trials_per_method = 2
baseline = false
seeds = 0
[audit]
enabled = false
"""
IDS = ["dpsgd_eps3-000", "dpsgd_eps3-001"]
TMPDIR_LENGTH = 100
#: A refusal before Ray starts answers in seconds; a resume that started Ray took 9 s more.
REFUSAL_S = 60.0


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` by content, the lock's bookkeeping left out (a
    refused resume held the lock)."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))
            if p.name not in (".lock", ".lock.json")}


def _dpsweep(args: list[str], *, env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("integrity")
    long = tmp / "t"
    long = Path(str(long) + "x" * (TMPDIR_LENGTH - len(str(long))))
    long.mkdir()
    assert len(str(long)) == TMPDIR_LENGTH
    config = tmp / "sweep.toml"
    config.write_text(CONFIG)
    run = tmp / "run"
    done = _dpsweep(["run", str(config), "--out", str(run), "--quiet"],
                    env={"TMPDIR": str(long)})
    return run, done


def test_a_sweep_runs_under_a_100_character_tmpdir(swept: tuple[Path, Any]) -> None:
    run, done = swept
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validate_socket_filename" not in done.stderr
    assert sorted(result_ids(run)) == IDS
    assert complete_ids(optuna_trials(run)) == IDS


def test_resume_with_a_trial_directory_deleted_is_refused_before_ray_and_changes_nothing(
        swept: tuple[Path, Any], tmp_path: Path) -> None:
    run, done = swept
    assert done.returncode == 0, done.stderr[-3000:]
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged)
    shutil.rmtree(damaged / "trials" / IDS[1])
    before = _snapshot(damaged)
    began = time.monotonic()
    refused = _dpsweep(["resume", str(damaged), "--quiet"], timeout=REFUSAL_S * 2)
    assert time.monotonic() - began < REFUSAL_S
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert lines == [f"dpsweep: error: RUN_DIR = 'trials/{IDS[1]}' is not allowed: expected the "
                     f"records of trial {IDS[1]}, listed in manifest.json (the directory is "
                     "gone; restore it from a copy of the run directory, or start a new run)"]
    assert _snapshot(damaged) == before
    assert not list(damaged.glob("tune/attempt-2"))  # Tune never started
