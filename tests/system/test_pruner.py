"""The pruner end to end: a digits sweep of 9 DP-SGD trials x 8 epochs stopped at rungs.

The sampler is seeded, the noise reproducible (``training.reproducible``: the trials' points
and curves are the same on every run, so the count below is a known answer, not luck) and the
search range wide, so most points learn little by the first rung. The sweep is killed with
``kill -9`` once several trials have records, then resumed: no pruned and no finished trial is
trained again, and the pruned rows carry their rung, their epochs and the epsilon they spent;
the leader's re-run (``sweep.seeds = 1``) is never pruned.

The two commands are a job of ``conftest.py``'s lane: they run while ``test_faults.py``'s chain
does when both modules are in the session (neither the count above nor any assertion depends on
when a command runs: the kill comes after four records, whenever that is).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.cli_harness import optuna_trials, running
from dpsweep.reports.store import read_results
from tests.system.conftest import Lane
from tests.system.test_faults import Stage, results_at_least, run_stage

pytestmark = pytest.mark.slow

CONFIG = """\
[training]
epochs = 8
batch_size = 50
reproducible = true
[sweep]
methods = ["dpsgd"]
trials_per_method = 9
max_concurrent_trials = 1
sampler = "random"
seed = 3
baseline = false
seeds = 1
front = "best"
pruner = "asha"
pruner_min_epochs = 2
pruner_factor = 3
[audit]
enabled = false
[search.dpsgd]
lr_x_clip = {low = 0.003, high = 1.0, log = true}
"""
TRIALS = 9
FIRST_RUNG = 2


@dataclass
class Swept:
    run: Path
    killed: Stage
    before: dict[str, Any]  # the records of the trials the killed run finished
    resumed: Stage


def sweep(tmp: Path, env: dict[str, str]) -> Swept:
    """The sweep, killed once four trials have records, then resumed to its end; the commands
    run with ``env`` (this process's environment when the job was made)."""
    (tmp / "sweep.toml").write_text(CONFIG)
    run = tmp / "run"
    killed = run_stage("kill", ["run", str(tmp / "sweep.toml"), "--out", str(run),
                                "--quiet"], run=run, fault="SIGKILL",
                       ready=results_at_least(run, 4), logs=tmp, env=env)
    assert killed.triggered and killed.rc != 0, killed.stderr[-2000:]
    before = {t: json.loads((run / "trials" / t / "result.json").read_text())
              for t in killed.after}
    resumed = run_stage("resume", ["resume", str(run), "--quiet"], run=run, fault="",
                        ready=None, logs=tmp, env=env)
    return Swept(run=run, killed=killed, before=before, resumed=resumed)


def lane_job(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Swept]:
    """The sweep as a job for ``conftest.py``'s lane, its folder and environment taken now."""
    return functools.partial(sweep, tmp_path_factory.mktemp("pruner"), dict(os.environ))


@pytest.fixture(scope="module")
def swept(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> Swept:
    return lane.result(__name__, lambda: lane_job(tmp_path_factory))


def test_pruned_trials_are_recorded_kept_off_and_never_rerun(
        swept: Swept, capsys: pytest.CaptureFixture[str]) -> None:
    run, resumed = swept.run, swept.resumed
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert resumed.redone() == []  # no pruned and no finished trial trained again
    for tid, record in swept.before.items():
        assert json.loads((run / "trials" / tid / "result.json").read_text()) == record

    frame = read_results(run).set_index("trial_id")
    # the leader's re-run is one more seed: never pruned, it runs to its last epoch
    reruns = frame[frame["repeat_of"] != ""]
    assert len(reruns) == 1 and reruns["status"].tolist() == ["ok"], reruns[["status", "error"]]
    assert reruns["epochs"].tolist() == [8]
    frame = frame[frame["repeat_of"] == ""]
    assert len(frame) == TRIALS and running(resumed.trials) == []
    pruned = frame[frame["status"] == "pruned"]
    assert (pruned["pruned_at"] == FIRST_RUNG).sum() >= 4, frame[["status", "pruned_at"]]
    assert (pruned["epochs"] == pruned["pruned_at"]).all()
    assert (pruned["epsilon_spent"] < pruned["target_epsilon"]).all()
    assert (frame.loc[frame["status"] == "ok", "epsilon_spent"]
            <= frame.loc[frame["status"] == "ok", "target_epsilon"]).all()
    states = {t["id"]: t["state"] for t in optuna_trials(run) if t["state"] != "FAIL"}
    assert {states[t] for t in pruned.index} == {"PRUNED"}

    import pandas as pd

    excluded = pd.read_csv(run / "report" / "excluded.csv").set_index("trial_id")
    for tid, rung in pruned["pruned_at"].items():
        assert excluded.loc[tid, "reason"].startswith(f"pruned at epoch {rung}")
    from dpsweep.orchestrator.cli import main

    # pick needs audited trials (the audit is off here); its refusal names the pruned ones as
    # kept off, for the same reason the fronts give
    assert main(["pick", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"pruned at epoch {FIRST_RUNG}" in err, err

