"""A trial that failed for a cause that is gone is trained again (issue 44), on the real CLI.

An adaptive sweep of two DP-SGD trials on digits whose tiny user model fails once: the first
forward inside training that claims the marker file (an atomic rename, so exactly one trial wins
it) raises. ``dpsweep run`` exits 3 with one trial failed; ``dpsweep resume --retry-failed``
trains that trial again, under its id and with its hyperparameters, in its Optuna study, while
the finished trial's records stay byte for byte; the attempt records the failure it replaced,
and the adaptive statement counts the failed attempt as a model. A last ``dpsweep resume`` has
nothing to run and says so. About a minute and a half on two cores.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from dpsweep.core import layout
from dpsweep.core.exits import EXIT_FAILURES, EXIT_OK
from dpsweep.orchestrator.sweep.studies import ID_ATTR, READ_ONLY_ATTR, RETRY_ATTR
from dpsweep.orchestrator.sweep.summary import RETRIED
from dpsweep.reports.store import read_results
from tests.system.conftest import Lane

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent / "dpsweep"
TIMEOUT = 600
MARKER = "fail_once"
FAULT = "RuntimeError: injected fault: the first training step fails"
MODULE = '''\
import math
import os
import sys

from torch import nn

MARKER = {marker!r}


def _in_training():
    frame = sys._getframe(1)
    while frame is not None:
        if os.sep + os.path.join("trainables", "training") + os.sep in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Net(nn.Module):
    def __init__(self, features, num_classes):
        super().__init__()
        self.hidden = nn.Sequential(nn.Flatten(), nn.Linear(features, 32), nn.Tanh())
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        if _in_training():
            try:
                os.rename(MARKER, MARKER + ".taken")  # one caller wins, once
            except FileNotFoundError:
                pass
            else:
                raise RuntimeError("injected fault: the first training step fails")
        return self.head(self.hidden(x))


def build(input_shape, num_classes):
    return Net(math.prod(input_shape), num_classes)
'''
CONFIG = """\
[model]
factory = "flaky:build"
[training]
epochs = 2
batch_size = 50
[method_params]
lr = 1.0
clip_norm = 1.0
[sweep]
methods = ["dpsgd"]
trials_per_method = 2
max_concurrent_trials = 2
baseline = false
[audit]
enabled = false
"""


def _dpsweep(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _records(run: Path, tid: str) -> dict[str, bytes]:
    """A trial's files, byte for byte."""
    root = run / layout.TRIALS / tid
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _trials(run: Path) -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{run / layout.OPTUNA_DB}"
    (summary,) = [s for s in optuna.get_all_study_summaries(storage)
                  if not s.user_attrs.get(READ_ONLY_ATTR)]  # not the target's summary copy
    return optuna.load_study(study_name=summary.study_name, storage=storage).trials


def lane_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None]:
    """The three commands and their checks as a job for ``conftest.py``'s lane (their outcome
    depends on no timing), its folder taken now."""
    return functools.partial(_run_retry_and_resume, tmp_path_factory.mktemp("retry"))


def test_a_failed_trial_is_trained_again_and_a_finished_one_is_not(
        lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> None:
    lane.result(__name__, lambda: lane_job(tmp_path_factory))


def _run_retry_and_resume(tmp_path: Path) -> None:
    marker = tmp_path / MARKER
    marker.write_text("")
    (tmp_path / "flaky.py").write_text(MODULE.format(marker=str(marker)))
    (tmp_path / "sweep.toml").write_text(CONFIG)
    run = tmp_path / "run"

    first = _dpsweep("run", str(tmp_path / "sweep.toml"), "--out", str(run))
    assert first.returncode == EXIT_FAILURES, first.stderr[-3000:]
    assert not marker.exists()  # the cause is gone: the fault fired once
    frame = read_results(run).set_index("trial_id")
    (failed,) = frame.index[frame["status"] == "failed"]
    (finished,) = frame.index[frame["status"] == "ok"]
    assert FAULT in frame.loc[failed, "error"]
    kept = _records(run, finished)
    failed_params = next(t.params for t in _trials(run) if t.user_attrs[ID_ATTR] == failed)

    retry = _dpsweep("resume", str(run), "--retry-failed")
    assert retry.returncode == EXIT_OK, retry.stderr[-3000:]
    assert f"retrying {failed}, which failed: " in retry.stdout
    assert "sweep finished: 2 trials (0 failed) in " in retry.stdout
    frame = read_results(run).set_index("trial_id")
    assert sorted(frame.index) == sorted([failed, finished])
    assert (frame["status"] == "ok").all() and (frame["error"] == "").all()
    assert _records(run, finished) == kept  # never trained again
    assert (run / layout.TRIALS / failed / layout.RESULT).is_file()
    assert not (run / layout.TRIALS / failed / layout.ERROR).exists()

    mine = [t for t in _trials(run) if t.user_attrs[ID_ATTR] == failed]
    assert [t.state.name for t in mine] == ["FAIL", "COMPLETE"]
    assert FAULT in mine[0].user_attrs["error"]  # the sampler's record of the failure stays
    assert mine[1].user_attrs[RETRY_ATTR] == mine[0].number
    assert mine[1].params == failed_params
    attempts = json.loads((run / layout.ATTEMPTS).read_text())
    assert [a["command"] for a in attempts] == ["run", "resume --retry-failed"]
    (record,) = attempts[-1][RETRIED]
    assert record["trial_id"] == failed and FAULT in record["error"]
    tuning = json.loads((run / layout.SUMMARY).read_text())["tuning"]["by_target"]["3"]
    assert tuning["n_trials"] == 3  # the failed attempt trained on the training set too
    assert "includes 1 failed attempt(s)" in tuning["statement"]

    again = _dpsweep("resume", str(run))
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    assert "sweep already finished, nothing was run: 2 trials (0 failed)" in again.stdout
    assert " in 0 s" not in again.stdout and "retrying" not in again.stdout
    assert _records(run, finished) == kept
