"""A failed audit is a failure (issue 41): a sweep's exit code when trials or audits fail, and
``dpsweep reaudit``, on the real CLI with a fault injected into a tiny user model.

* **audits fail**: DP-SGD on digits, 2 trials, the audit inside each trial, every audit raising:
  the sweep exits 3, its summary line counts the failed audits, one line on stderr names the
  first reason and the command that audits them again, and the report has no front but names
  each failed audit at a glance;
* **trials fail**: the same sweep with every trial's training raising: exit 3 and, with
  ``--quiet``, that one line alone on stderr;
* **reaudit** of a copy of the first run, in this process and without the fault: every row gets
  its peak MIA accuracy, the report's fronts list trials they did not list before and its failed
  trials none; a second ``reaudit`` has nothing to do and writes nothing; ``--trial`` on an audit
  that stands is refused;
* **a tampered checkpoint** (one byte flipped in a copy): ``reaudit`` refuses in one line naming
  the file, exit 2, nothing written, Ray never started.

The fault: the model's ``forward`` raises while ``DPSWEEP_TEST_FAULT`` names a stage of
``trainables`` (``audit``, ``training``) that is on its call stack. The sweeps run as processes
with that variable set, so their local Ray's workers see it; the re-audit runs in this process,
whose environment lacks it. Both sweeps run at once (about 40 s on two cores), the re-audit
about 30 s.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from filelock import FileLock

from dpsweep.core import layout
from dpsweep.core.exits import EXIT_FAILURES, EXIT_OK, EXIT_USAGE
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.cluster import connection as cluster
from dpsweep.reports.store import read_results
from tests.system.conftest import Lane

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent / "dpsweep"
TIMEOUT = 600
FAULT_ENV = "DPSWEEP_TEST_FAULT"
MODULE = f'''\
import math
import os
import sys

from torch import nn


def _called_from(part):
    frame = sys._getframe(2)
    while frame is not None:
        if part in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Net(nn.Module):
    def __init__(self, features, num_classes):
        super().__init__()
        self.hidden = nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.Tanh())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        stage = os.environ.get("{FAULT_ENV}", "")
        if stage and _called_from(os.sep + os.path.join("trainables", stage) + os.sep):
            raise RuntimeError(f"injected {{stage}} fault")
        return self.head(self.hidden(x))


def build(input_shape, num_classes):
    return Net(math.prod(input_shape), num_classes)
'''
CONFIG = """\
[model]
factory = "faulty:build"
[training]
epochs = 4
batch_size = 50
[method_params]
lr = 1.0
clip_norm = 1.0
[sweep]
methods = ["dpsgd"]
trials_per_method = 2
max_concurrent_trials = 2
baseline = false
seeds = 0
[audit]
enabled = true
in_trial = true
reference_models = 4
"""
IDS = ["dpsgd_eps3-000", "dpsgd_eps3-001"]
AUDIT_FAULT = "RuntimeError: injected audit fault"


@dataclass
class Sweep:
    run: Path
    rc: int
    stdout: str
    stderr: str


def lane_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict[str, Sweep]]:
    """The two sweeps as a job for ``conftest.py``'s lane (their outcome depends on no
    timing), their folder taken now."""
    return functools.partial(_sweeps, tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def sweeps(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Sweep]:
    return lane.result(__name__, lambda: lane_job(tmp_path_factory))


def _sweeps(tmp: Path) -> dict[str, Sweep]:
    """One sweep whose audits all fail and one whose trials all fail, run at once."""
    (tmp / "faulty.py").write_text(MODULE)
    (tmp / "sweep.toml").write_text(CONFIG)
    procs = {}
    for stage, quiet in (("audit", []), ("training", ["--quiet"])):
        procs[stage] = subprocess.Popen(
            [str(BIN), "run", str(tmp / "sweep.toml"), "--out", str(tmp / stage), *quiet],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", FAULT_ENV: stage})
    out = {}
    for stage, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, stderr = proc.communicate()
        out[stage] = Sweep(tmp / stage, proc.returncode, stdout, stderr)
    return out


def _last_line(sweep: Sweep) -> str:
    assert "Traceback" not in sweep.stderr, sweep.stderr[-3000:]
    return sweep.stderr.strip().splitlines()[-1]


def _report(run: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(run / layout.REPORT / name)


def test_a_sweep_whose_audits_fail_exits_3_and_says_so_in_one_line(
        sweeps: dict[str, Sweep]) -> None:
    sweep = sweeps["audit"]
    assert sweep.rc == EXIT_FAILURES, sweep.stderr[-3000:]
    assert "sweep finished: 2 trials (0 failed, 2 audits failed) in " in sweep.stdout
    assert _last_line(sweep) == (
        f"dpsweep: 2 audits failed ({IDS[0]}: {AUDIT_FAULT}; 1 more); the report lists every "
        f"reason; `dpsweep reaudit {sweep.run.resolve()}` audits them again without training")
    frame = read_results(sweep.run)
    assert sorted(frame["trial_id"]) == IDS and (frame["status"] == "ok").all()
    assert (frame["audit_error"] == AUDIT_FAULT).all()
    assert frame["peak_mia_accuracy"].isna().all()
    assert _report(sweep.run, "fronts.csv").empty
    page = (sweep.run / layout.REPORT / "report.html").read_text()
    assert f"<b>2 audits failed</b> (<b>{IDS[0]}</b>: {AUDIT_FAULT}; <b>{IDS[1]}</b>: " \
           f"{AUDIT_FAULT})" in page


def test_a_sweep_whose_every_trial_fails_exits_3_with_one_line(
        sweeps: dict[str, Sweep]) -> None:
    sweep = sweeps["training"]
    assert sweep.rc == EXIT_FAILURES, sweep.stderr[-3000:]
    assert sweep.stderr.strip().splitlines() == [
        "dpsweep: 2 of 2 trials failed; the report lists every reason"]
    assert (read_results(sweep.run)["status"] == "failed").all()


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the lock's bookkeeping left out)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (layout.LOCK, layout.LOCK_INFO)}


def _reaudit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["reaudit", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_reaudit_fills_the_failed_audits_and_the_fronts_follow(
        sweeps: dict[str, Sweep], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    run = _copy(sweeps["audit"].run, tmp_path)
    rc, out, err = _reaudit(capsys, str(run), "--quiet")
    assert rc == EXIT_OK, err[-3000:]
    assert out.strip().splitlines() == [f"report: {run / layout.REPORT / 'report.html'}"]
    frame = read_results(run).set_index("trial_id")
    assert (frame["audit_error"] == "").all()
    assert frame["peak_mia_accuracy"].between(0.0, 1.0).all()
    assert (frame["peak_mia_upper"] >= frame["peak_mia_accuracy"]).all()
    for tid in IDS:  # each audit pools the other trial's references, as a sweep's
        record = json.loads((run / "trials" / tid / layout.AUDIT).read_text())
        assert record["pooled"]["trials"] == [tid, *(t for t in IDS if t != tid)]
        assert record["n_references"] == 8 and len(record["references"]) == 4
    fronts = _report(run, "fronts.csv")
    assert set(fronts["trial_id"]) and set(fronts["trial_id"]) <= set(IDS)
    assert _report(run, "failed_trials.csv").empty
    page = (run / layout.REPORT / "report.html").read_text()
    assert "audits failed" not in page and "No front" not in page

    # a second re-audit: nothing left to audit, nothing written
    before = _snapshot(run)
    rc, out, err = _reaudit(capsys, str(run))
    assert rc == EXIT_OK and err == "", err
    assert out.startswith(f"nothing to re-audit in {run}")
    assert _snapshot(run) == before

    # an audit that stands is never drawn again
    rc, _, err = _reaudit(capsys, str(run), "--trial", IDS[0])
    assert rc == EXIT_USAGE and err.count("\n") == 1, err
    assert err.startswith(f"dpsweep: error: --trial = '{IDS[0]}' is not allowed: expected a "
                          "trial whose audit failed or is missing (this one's audit stands")
    assert _snapshot(run) == before


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command starts or joins Ray."""

    def started(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster, "start_local", started)
    monkeypatch.setattr(cluster, "connect", started)


@pytest.mark.usefixtures("no_ray")
def test_reaudit_refuses_a_tampered_checkpoint_in_one_line_and_writes_nothing(
        sweeps: dict[str, Sweep], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(sweeps["audit"].run, tmp_path)
    rel = f"trials/{IDS[1]}/{layout.CHECKPOINT_DIR}/{layout.CHECKPOINT_FILE}"
    data = bytearray((run / rel).read_bytes())
    data[len(data) // 2] ^= 0x01
    (run / rel).write_bytes(bytes(data))
    before = _snapshot(run)
    rc, out, err = _reaudit(capsys, str(run))
    assert rc == EXIT_USAGE and out == "", out
    assert err.splitlines() == [
        f"dpsweep: error: RUN_DIR = '{rel}' is not allowed: expected the file dpsweep wrote "
        "(its SHA-256 differs from manifest.json: modified or replaced; restore it from a copy "
        "of the run directory, or start a new run)"]
    assert _snapshot(run) == before


@pytest.fixture(autouse=True)
def _no_leftover_lock(tmp_path: Path) -> Iterator[None]:
    """Every command released the copy's lock (another could take it at once)."""
    yield
    lock = tmp_path / "run" / layout.LOCK
    if lock.is_file():
        held = FileLock(str(lock))
        held.acquire(timeout=0)
        held.release()
