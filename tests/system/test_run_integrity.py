"""A sweep under a 100-character TMPDIR, then a resume of it with a trial directory deleted
(issue 26, items 1 and 3), on the real CLI.

The sweep is the session's reference sweep (``conftest.py``: ``test_faults.py``'s uninterrupted
sweep, run under that TMPDIR), so that no second sweep is started for this module.

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
import time
from pathlib import Path

import pytest

from bench.cli_harness import BIN, complete_ids, optuna_trials, result_ids
from tests.system.conftest import TMPDIR_LENGTH, ReferenceSweep
from tests.system.test_faults import ALL_IDS, SEARCH_IDS, without_reruns

#: The trial whose directory the damaged copy loses.
GONE = "dpsgd_eps3-001"
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
def swept(reference_sweep: ReferenceSweep) -> tuple[Path, ReferenceSweep]:
    """The reference sweep's run directory, and the sweep once it ended."""
    return reference_sweep.run, reference_sweep.wait()


def test_a_sweep_runs_under_a_100_character_tmpdir(swept: tuple[Path, ReferenceSweep]) -> None:
    run, done = swept
    assert len(str(done.tmpdir)) == TMPDIR_LENGTH
    assert done.rc == 0, done.stderr[-3000:]
    assert "validate_socket_filename" not in done.stderr
    assert without_reruns(result_ids(run)) == sorted(ALL_IDS)
    assert complete_ids(optuna_trials(run)) == sorted(SEARCH_IDS)


def test_resume_with_a_trial_directory_deleted_is_refused_before_ray_and_changes_nothing(
        swept: tuple[Path, ReferenceSweep], tmp_path: Path) -> None:
    run, done = swept
    assert done.rc == 0, done.stderr[-3000:]
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged)
    shutil.rmtree(damaged / "trials" / GONE)
    before = _snapshot(damaged)
    began = time.monotonic()
    refused = _dpsweep(["resume", str(damaged), "--quiet"], timeout=REFUSAL_S * 2)
    assert time.monotonic() - began < REFUSAL_S
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert lines == [f"dpsweep: error: RUN_DIR = 'trials/{GONE}' is not allowed: expected the "
                     f"records of trial {GONE}, listed in manifest.json (the directory is "
                     "gone; restore it from a copy of the run directory, or start a new run)"]
    assert _snapshot(damaged) == before
    assert not list(damaged.glob("tune/attempt-2"))  # Tune never started
