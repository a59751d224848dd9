"""The pruner end to end: a digits sweep of 9 DP-SGD trials x 8 epochs stopped at rungs.

The sampler is seeded, the noise reproducible (``training.reproducible``: the trials' points
and curves are the same on every run, so the count below is a known answer, not luck) and the
search range wide, so most points learn little by the first rung. The sweep is killed with
``kill -9`` once several trials have records, then resumed: no pruned and no finished trial is
trained again, and the pruned rows carry their rung, their epochs and the epsilon they spent;
the leader's re-run (``sweep.seeds = 1``) is never pruned.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reports.store import read_results
from tests.system.test_faults import optuna_trials, results_at_least, run_stage, running

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


def test_pruned_trials_are_recorded_kept_off_and_never_rerun(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "sweep.toml").write_text(CONFIG)
    run = tmp_path / "run"
    killed = run_stage("kill", ["run", str(tmp_path / "sweep.toml"), "--out", str(run),
                                "--quiet"], run=run, fault="SIGKILL",
                       ready=results_at_least(run, 4), logs=tmp_path)
    assert killed.triggered and killed.rc != 0, killed.stderr[-2000:]
    before = {t: json.loads((run / "trials" / t / "result.json").read_text())
              for t in killed.after}
    resumed = run_stage("resume", ["resume", str(run), "--quiet"], run=run, fault="",
                        ready=None, logs=tmp_path)
    assert resumed.rc == 0, resumed.stderr[-3000:]
    assert resumed.redone() == []  # no pruned and no finished trial trained again
    for tid, record in before.items():
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
    from orchestrator.cli import main

    # pick needs audited trials (the audit is off here); its refusal names the pruned ones as
    # kept off, for the same reason the fronts give
    assert main(["pick", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"pruned at epoch {FIRST_RUNG}" in err, err

