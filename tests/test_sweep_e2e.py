"""End to end: `dpsweep run` on digits (two methods, two trials each), then `resume` after an
interruption redoes no finished trial. Runs the real CLI in subprocesses with local Ray."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest

from orchestrator import results
from reports.pareto import eligible, front_of

BIN = Path(sys.executable).parent / "dpsweep"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

CONFIG = """
[training]
epochs = {epochs}
batch_size = 60
[sweep]
methods = {methods}
trials_per_method = {trials}
max_concurrent_trials = {concurrent}
[audit]
enabled = true
in_trial = true
"""


def _config(tmp: Path, *, methods: list[str], trials: int, epochs: int = 2,
            concurrent: int = 2) -> Path:
    path = tmp / "sweep.toml"
    path.write_text(CONFIG.format(epochs=epochs, methods=json.dumps(methods), trials=trials,
                                  concurrent=concurrent))
    return path


@pytest.mark.slow
def test_run_writes_rows_front_and_report(tmp_path: Path) -> None:
    cfg = _config(tmp_path, methods=["dpsgd", "dpsgd_lf"], trials=2)
    run = tmp_path / "run"
    proc = subprocess.run([str(BIN), "run", str(cfg), "--out", str(run), "--quiet"],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"report: {run}" in proc.stdout
    frame = results.read_results(run)
    assert len(frame) == 4
    assert sorted(frame["method"]) == ["dpsgd", "dpsgd", "dpsgd_lf", "dpsgd_lf"]
    assert (frame["status"] == "ok").all() and frame["dp_valid"].all()
    assert (frame["epsilon_upper"] <= frame["target_epsilon"]).all()
    assert (frame["epsilon_upper"] >= 0.99 * frame["target_epsilon"]).all()
    assert frame["peak_mia_accuracy"].between(0.0, 1.0).all()
    assert frame["accountant"].eq("prv").all()
    for _, row in frame.iterrows():
        layers = json.loads(row["mia_layers"])
        assert [entry["name"] for entry in layers] == ["conv1", "conv2", "fc1", "fc2"]
        assert row["peak_mia_accuracy"] == pytest.approx(max(e["accuracy"] for e in layers))
        assert (run / row["checkpoint"] / "state.pt").is_file()
    # the front is non-empty and non-dominated
    front = front_of(eligible(frame))
    assert 1 <= len(front) <= 4
    for _, a in front.iterrows():
        for _, b in frame.iterrows():
            assert not (b["test_accuracy"] > a["test_accuracy"]
                        and b["peak_mia_accuracy"] < a["peak_mia_accuracy"])
    # each method's study starts from its first point and has both objectives
    for method in ("dpsgd", "dpsgd_lf"):
        study = optuna.load_study(study_name=method, storage=f"sqlite:///{run / 'optuna.db'}")
        assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
        assert all(len(t.values) == 2 for t in study.trials)
    assert study.trials[0].params["method_params.t_f_fraction"] == 0.75
    report = run / "report"
    assert (report / "report.html").is_file()
    assert list(report.glob("*.png")) and list(report.glob("*.csv"))
    # the report rebuilds from stored results alone
    before = pd.read_csv(next(report.glob("*.csv")))
    again = subprocess.run([str(BIN), "report", str(run)], capture_output=True, text=True,
                           env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert before.equals(pd.read_csv(next(report.glob("*.csv"))))


@pytest.mark.slow
def test_resume_after_interruption_redoes_no_finished_trial(tmp_path: Path) -> None:
    cfg = _config(tmp_path, methods=["dpsgd"], trials=4, epochs=4, concurrent=1)
    run = tmp_path / "run"
    proc = subprocess.Popen([str(BIN), "run", str(cfg), "--out", str(run), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                            start_new_session=True)
    deadline = time.time() + 600
    store = run / results.RESULTS_FILE
    while time.time() < deadline:
        if store.is_file() and len(pd.read_parquet(store)) >= 2:
            break
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finished = pd.read_parquet(store)
    finished = finished[finished["status"] == "ok"]
    assert 2 <= len(finished) < 4, "interrupted before the end"
    stamps = {tid: (run / "trials" / tid / "history.json").stat().st_mtime_ns
              for tid in finished["trial_id"]}
    resumed = subprocess.run([str(BIN), "resume", str(run), "--quiet"], capture_output=True,
                             text=True, env=ENV, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    frame = results.read_results(run)
    ok = frame[frame["status"] == "ok"]
    assert len(ok) == 4 and ok["trial_id"].is_unique
    for tid, stamp in stamps.items():
        assert (run / "trials" / tid / "history.json").stat().st_mtime_ns == stamp, tid
        old = finished.set_index("trial_id").loc[tid]
        new = ok.set_index("trial_id").loc[tid]
        assert new["train_seconds"] == old["train_seconds"]
        assert math.isclose(new["test_accuracy"], old["test_accuracy"])
    study = optuna.load_study(study_name="dpsgd", storage=f"sqlite:///{run / 'optuna.db'}")
    states = [t.state for t in study.trials]
    assert optuna.trial.TrialState.RUNNING not in states
    assert states.count(optuna.trial.TrialState.COMPLETE) == 4
