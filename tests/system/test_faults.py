"""Fault injection on the real CLI: signals, ``kill -9``, moved and copied run directories, locks.

One uninterrupted reference sweep (``conftest.py``'s, shared with ``test_run_integrity.py``)
runs beside a *chain* of interrupted attempts on a second run directory (the stages share it, so
the module stays near five minutes on two cores):

a. ``run``; Ctrl-C (SIGINT to the process group, as a terminal sends it) while budgets are
   precomputed;
b. ``resume``; SIGTERM to the driver while trials run (a second ``resume`` meanwhile: refused);
c. ``resume``; ``kill -9`` of the driver after two more trials finished;
d. ``mv`` of the run directory; ``resume`` at the new place; ``kill -9`` while budgets are
   precomputed (after the crash of c was reconciled);
e. ``resume``; Ctrl-C twice, 0.3 s apart, in the after-search phase (the re-runs of each
   study's leader; the non-private baseline runs in the last round of trials or after them);
f. ``cp -r``; ``resume`` of the copy to the end; the original stays byte-identical.

After every stage: the exit code, the one-line resume hint, no Optuna trial RUNNING, no
finished trial trained again (its ``result.json`` untouched), none lost; at the end the set of
trial ids equals the reference sweep's. The helpers are shared with ``bench/faults.py``.

The chain mostly waits on its commands, so ``conftest.py``'s lane runs the sweeps of
``test_faults_disk.py`` and ``test_pruner.py`` meanwhile (when they are in the session).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from bench.cli_harness import (
    KILL_GRACE,
    STAGE_TIMEOUT,
    Proc,
    complete_ids,
    finish,
    lock_pid,
    optuna_trials,
    reap,
    result_ids,
    result_mtimes,
    running,
    start,
    tree_hash,
    wait_for,
)

if TYPE_CHECKING:  # conftest.py imports this module's helpers
    from tests.system.conftest import Lane, ReferenceSweep


CONFIG = """\
[training]
epochs = 3
[sweep]
methods = ["dpsgd", "auto_s"]
trials_per_method = 4
max_concurrent_trials = 2
baseline = true
seeds = 1
front = "best"
[audit]
enabled = false
"""
SEARCH_IDS = frozenset(f"{s}_eps3-{i:03d}" for s in ("dpsgd", "auto_s") for i in range(4))
ALL_IDS = SEARCH_IDS | {"nonprivate"}
#: After the search, each study's leader is re-run once: "<leader>-r1" (which trial leads
#: depends on the fresh noise, so only their number is known).
RERUNS = 2


def without_reruns(ids: list[str]) -> list[str]:
    """The ids of a run with the re-runs checked (one per study) and taken out."""
    reruns = [t for t in ids if t.endswith("-r1")]
    assert len(reruns) == RERUNS, ids
    assert {t.split("_eps")[0] for t in reruns} == {"dpsgd", "auto_s"}, reruns
    return sorted(t for t in ids if t not in reruns)
#: Longest wait for one command (a stage takes 20-60 s on two busy cores).
#: Stage e's fault: Ctrl-C, then Ctrl-C again DOUBLE_SIGINT_GAP seconds later.
DOUBLE_SIGINT = "SIGINT twice"
DOUBLE_SIGINT_GAP = 0.3
HINT = re.compile(r"^dpsweep: interrupted by (SIGINT|SIGTERM); .*`dpsweep resume (.+)`$")
def hint_lines(stderr: str) -> list[re.Match]:
    return [m for m in map(HINT.match, stderr.splitlines()) if m]


# ---- stages ----------------------------------------------------------------------------------
@dataclass
class Stage:
    """One command of the chain and what it left behind."""

    name: str
    run: Path
    fault: str  # SIGINT (Ctrl-C to the group), DOUBLE_SIGINT, SIGTERM or SIGKILL, "" = none
    rc: int | None = None
    triggered: bool = False  # the moment of the fault was observed while the command ran
    seconds: float = 0.0
    fault_at: float = 0.0  # seconds after start
    stdout: str = ""
    stderr: str = ""
    before: dict[str, int] = field(default_factory=dict)  # result.json mtimes at the start
    at_fault: dict[str, int] = field(default_factory=dict)  # ... just before the fault
    after: dict[str, int] = field(default_factory=dict)  # ... after the command ended
    ids: list[str] = field(default_factory=list)  # results store rows after the command
    trials: list[dict[str, Any]] = field(default_factory=list)  # Optuna, after the command
    leftover: dict[int, str] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def redone(self) -> list[str]:
        """Trials finished before this stage whose result.json changed or vanished."""
        return sorted(t for t, m in self.before.items() if self.after.get(t) != m)


def run_stage(name: str, args: list[str], *, run: Path, fault: str,
              ready: Callable[[Proc], bool] | None, logs: Path,
              prelude: Callable[[Stage, Proc], None] | None = None,
              env: dict[str, str] | None = None) -> Stage:
    """Run one dpsweep command (``env`` as for :func:`start`); when ``ready(proc)`` holds, inject
    ``fault``; record the state."""
    stage = Stage(name=name, run=run, fault=fault, before=result_mtimes(run))
    began = time.monotonic()
    proc = start(args, log=logs / name, env=env)
    try:
        if prelude is not None:
            prelude(stage, proc)
        if ready is not None:
            stage.triggered = wait_for(proc, lambda: ready(proc), timeout=STAGE_TIMEOUT)
            stage.at_fault = result_mtimes(run)
            stage.fault_at = time.monotonic() - began
            if stage.triggered and proc.popen.poll() is None:
                if fault in ("SIGINT", DOUBLE_SIGINT):
                    os.killpg(proc.pid, signal.SIGINT)
                    if fault == DOUBLE_SIGINT:  # a second Ctrl-C while the stop is under way
                        time.sleep(DOUBLE_SIGINT_GAP)
                        if proc.popen.poll() is None:
                            os.killpg(proc.pid, signal.SIGINT)
                else:
                    os.kill(proc.pid, getattr(signal, fault))
        stage.rc = finish(proc, timeout=STAGE_TIMEOUT)
    finally:
        stage.leftover = reap(proc, grace=KILL_GRACE if fault == "SIGKILL" else 10.0)
    stage.seconds = time.monotonic() - began
    stage.stdout, stage.stderr = proc.stdout(), proc.stderr()
    if run.is_dir():
        stage.after = result_mtimes(run)
        stage.ids = result_ids(run)
        stage.trials = optuna_trials(run)
    return stage


def budgets_started(proc: Proc) -> bool:
    return "budgets:" in proc.stderr()


def after_search_started(proc: Proc) -> bool:
    return "after the search" in proc.stderr()


def results_at_least(run: Path, n: int) -> Callable[[Proc], bool]:
    return lambda _proc: len(result_mtimes(run)) >= n


def summary_line(stage: Stage) -> str:
    return (f"{stage.name}: {stage.fault or 'none'} at {stage.fault_at:.0f} s "
            f"(observed: {stage.triggered}), rc {stage.rc}, {stage.seconds:.0f} s; finished "
            f"before {len(stage.before)}, at the fault {len(stage.at_fault)}, after "
            f"{len(stage.after)}; RUNNING {len(running(stage.trials))}")


# ---- fixtures ------------------------------------------------------------------------------------
@dataclass
class Sweeps:
    config: Path
    ref: Path
    ref_rc: int | None
    ref_trials: list[dict[str, Any]]
    ref_seconds: float
    ref_stderr: str
    second_run: tuple[int | None, str, int]  # (rc, stderr, pid of the lock holder)
    stages: dict[str, Stage]
    moved_hash: tuple[str, str]  # the moved original's tree hash before and after the copy ran
    copy_after_cp: dict[str, int]  # result.json mtimes in the copy right after cp -r
    lost_old_path: bool  # the original path reappeared after the move

    def stage(self, name: str) -> Stage:
        assert name in self.stages, f"stage {name} did not run"
        return self.stages[name]


def _chain(tmp: Path, config: Path,
           stages: dict[str, Stage]) -> tuple[tuple[str, str], dict[str, int], bool]:
    logs = tmp / "logs"
    run = tmp / "chain"
    stages["a"] = run_stage("a", ["run", str(config), "--out", str(run)], run=run,
                            fault="SIGINT", ready=budgets_started, logs=logs)

    def second_resume(stage: Stage, proc: Proc) -> None:
        held = wait_for(proc, lambda: lock_pid(run) == proc.pid, timeout=STAGE_TIMEOUT)
        other = start(["resume", str(run)], log=logs / "b-second")
        rc = finish(other, timeout=120)
        reap(other, grace=5)
        stage.notes["second"] = (held, rc, other.stderr(), proc.pid)

    stages["b"] = run_stage("b", ["resume", str(run)], run=run, fault="SIGTERM",
                            ready=results_at_least(run, 1), logs=logs, prelude=second_resume)
    done = len(result_mtimes(run))
    stages["c"] = run_stage("c", ["resume", str(run)], run=run, fault="SIGKILL",
                            ready=results_at_least(run, min(done + 2, len(SEARCH_IDS) - 1)),
                            logs=logs)
    moved = tmp / "moved"
    os.replace(run, moved)
    stages["d"] = run_stage("d", ["resume", str(moved)], run=moved, fault="SIGKILL",
                            ready=budgets_started, logs=logs)
    stages["e"] = run_stage("e", ["resume", str(moved)], run=moved, fault=DOUBLE_SIGINT,
                            ready=after_search_started, logs=logs)
    copy = tmp / "copy"
    subprocess.run(["cp", "-r", str(moved), str(copy)], check=True)
    copy_mtimes = result_mtimes(copy)
    before = tree_hash(moved)
    stages["f"] = run_stage("f", ["resume", str(copy)], run=copy, fault="", ready=None,
                            logs=logs)
    return (before, tree_hash(moved)), copy_mtimes, run.exists()


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory, reference_sweep: ReferenceSweep,
           lane: Lane, request: pytest.FixtureRequest) -> Iterator[Sweeps]:
    """The chain, run while the reference sweep (started by ``conftest.py``, the second ``run``
    into it already refused) runs beside it, and the lane runs the sweeps that wait behind the
    chain (``conftest.BEHIND_THE_FAULT_CHAIN``: the chain mostly waits on its commands)."""
    from tests.system.conftest import start_behind_the_fault_chain

    start_behind_the_fault_chain(request, lane, tmp_path_factory)
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "logs").mkdir()
    config = reference_sweep.config
    stages: dict[str, Stage] = {}
    hashes, copy_mtimes, old = ("", ""), {}, False
    try:
        hashes, copy_mtimes, old = _chain(tmp, config, stages)
    finally:
        ref = reference_sweep.wait()
    for stage in stages.values():
        print(summary_line(stage))
    yield Sweeps(config=config, ref=ref.run, ref_rc=ref.rc, ref_trials=optuna_trials(ref.run),
                 ref_seconds=ref.seconds, ref_stderr=ref.stderr, second_run=ref.second_run,
                 stages=stages, moved_hash=hashes, copy_after_cp=copy_mtimes, lost_old_path=old)


# ---- checks -------------------------------------------------------------------------------
def assert_stopped(stage: Stage, *, exit_code: int) -> None:
    """A graceful stop: exit code, one hint naming the run directory, nothing RUNNING, no
    process left behind, no finished trial touched."""
    assert stage.triggered, f"{stage.name}: the moment of the fault never came:\n{stage.stderr}"
    assert stage.rc == exit_code, (stage.rc, stage.stderr[-3000:])
    hints = hint_lines(stage.stderr)
    assert len(hints) == 1, stage.stderr[-3000:]
    assert hints[0].group(1) == signal.Signals(
        signal.SIGTERM if exit_code == 143 else signal.SIGINT).name
    assert Path(hints[0].group(2)) == stage.run.resolve()
    assert running(stage.trials) == []
    assert stage.leftover == {}
    assert stage.redone() == []


def test_reference_sweep_finishes_every_trial_once(sweeps: Sweeps) -> None:
    assert sweeps.ref_rc == 0
    ids = result_ids(sweeps.ref)
    assert without_reruns(ids) == sorted(ALL_IDS)
    assert complete_ids(sweeps.ref_trials) == sorted(SEARCH_IDS)
    assert {t["state"] for t in sweeps.ref_trials} == {"COMPLETE"}
    # a sweep with nothing going wrong prints the driver's lines only: no warning or error from
    # Ray's loggers (Tune's result grid warned about every trial once its result files were
    # all switched off)
    ray_lines = re.findall(r"^.*\t(?:WARNING|ERROR) \S+\.py:\d+ -- .*$", sweeps.ref_stderr,
                           re.M)
    assert ray_lines == [], ray_lines


def test_second_run_into_a_directory_being_written_is_refused(sweeps: Sweeps) -> None:
    rc, stderr, holder = sweeps.second_run
    assert rc == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("dpsweep: error:")]
    assert len(lines) == 1, stderr
    assert f"pid {holder}" in lines[0], lines[0]
    assert "Traceback" not in stderr


def test_locked_directory_refuses_run_and_resume_and_writes_nothing(
        sweeps: Sweeps, tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom orchestrator.rundir import RunDir\n"
         "run = RunDir.open(sys.argv[1], write=True)\nprint('held', flush=True)\ntime.sleep(600)",
         str(sweeps.ref)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree_hash(sweeps.ref)
        # both commands at once (each is refused on its own: the holder keeps the lock)
        procs = [(args, start(args, log=tmp_path / args[0]))
                 for args in (["run", str(sweeps.config), "--out", str(sweeps.ref)],
                              ["resume", str(sweeps.ref)])]
        for args, proc in procs:
            rc = finish(proc, timeout=120)
            reap(proc, grace=5)
            assert rc == 2, (args, proc.stderr())
            assert f"pid {holder.pid}" in proc.stderr(), (args, proc.stderr())
        assert tree_hash(sweeps.ref) == before
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_ctrl_c_while_budgets_are_precomputed(sweeps: Sweeps) -> None:
    a = sweeps.stage("a")
    assert_stopped(a, exit_code=130)
    assert "trials:" not in a.stderr  # it stopped before Tune started
    assert a.after == {} and a.ids == []
    # the studies exist, each with its first point waiting
    assert sorted(t["id"] for t in a.trials if t["state"] == "WAITING") == \
        ["auto_s_eps3-000", "dpsgd_eps3-000"]


def test_sigterm_while_trials_run_reenqueues_the_running_ones(sweeps: Sweeps) -> None:
    b = sweeps.stage("b")
    assert_stopped(b, exit_code=143)
    assert len(b.at_fault) >= 1
    interrupted = [t for t in b.trials if t["state"] == "FAIL" and t["attrs"].get("interrupted")]
    stopped = re.search(r"stopped \d+ running trial\(s\): (.+)", b.stderr)
    named = set(stopped.group(1).split(", ")) if stopped else set()
    assert {t["id"] for t in interrupted} == named
    for t in interrupted:  # each has a waiting copy with the same id and hyperparameters
        copies = [w for w in b.trials if w["state"] == "WAITING" and w["id"] == t["id"]]
        assert len(copies) == 1, t
        assert copies[0]["fixed_params"] == t["params"]
        assert t["attrs"]["error"] == "interrupted by SIGTERM"
        assert t["id"] not in b.after


def test_second_resume_is_refused_while_one_runs(sweeps: Sweeps) -> None:
    held, rc, stderr, holder = sweeps.stage("b").notes["second"]
    assert held, "the first resume never took the lock"
    assert rc == 2, stderr
    assert f"held by pid {holder}" in stderr
    assert stderr.count("dpsweep: error:") == 1 and "Traceback" not in stderr


def test_kill_9_while_trials_run_loses_nothing_and_redoes_nothing(sweeps: Sweeps) -> None:
    c, d, e = sweeps.stage("c"), sweeps.stage("d"), sweeps.stage("e")
    assert c.triggered and c.rc == -signal.SIGKILL
    assert len(c.at_fault) >= len(c.before) + 2
    assert c.leftover == {}, "Ray workers kept running after the driver was killed"
    assert c.redone() == []
    # d reconciled c's crash before it was killed itself: nothing RUNNING, nothing redone
    assert running(d.trials) == []
    for stage in (d, e):
        assert all(stage.after.get(t) == m for t, m in c.at_fault.items()), stage.name
    # every trial c had finished is in the results store exactly once
    assert set(c.at_fault) <= set(e.ids) and len(e.ids) == len(set(e.ids))


def test_moved_run_directory_resumes_and_survives_kill_9_during_precompute(
        sweeps: Sweeps) -> None:
    d, e = sweeps.stage("d"), sweeps.stage("e")
    assert not sweeps.lost_old_path, "a resume wrote to the directory's old location"
    assert d.triggered and d.rc == -signal.SIGKILL
    assert "trials:" not in d.stderr
    assert d.leftover == {} and d.redone() == [] and running(d.trials) == []
    # e, at the new place, finished every search trial and then was stopped
    assert set(e.after) >= SEARCH_IDS
    assert sorted(complete_ids(e.trials)) == sorted(SEARCH_IDS)
    manifest = json.loads((e.run / "manifest.json").read_text())
    assert all(not Path(rel).is_absolute() for rel in manifest["files"])
    assert any(rel.startswith("trials/") for rel in manifest["files"])


def test_ctrl_c_twice_in_the_after_search_phase(sweeps: Sweeps) -> None:
    """Two Ctrl-Cs 0.3 s apart (an impatient user): the second is ignored while the first stop
    is under way; one line, exit 130, no traceback, and stage f's resume of a copy completes."""
    e = sweeps.stage("e")
    assert_stopped(e, exit_code=130)
    assert "Traceback" not in e.stderr and "SystemError" not in e.stderr, e.stderr[-3000:]
    assert "sweep finished" not in e.stdout
    assert not [t for t in e.ids if t.endswith("-r1")], "a re-run finished after the Ctrl-C"


def test_resumed_copy_finishes_with_the_reference_ids_and_leaves_the_original_untouched(
        sweeps: Sweeps) -> None:
    f = sweeps.stage("f")
    assert f.rc == 0, f.stderr[-3000:]
    before, after = sweeps.moved_hash
    assert before == after, "resuming the copy changed the original"
    assert without_reruns(f.ids) == without_reruns(result_ids(sweeps.ref)) == sorted(ALL_IDS)
    assert running(f.trials) == []
    assert complete_ids(f.trials) == complete_ids(sweeps.ref_trials) == sorted(SEARCH_IDS)
    # nothing finished before the copy was trained again in it
    assert {t: f.after.get(t) for t in sweeps.copy_after_cp} == sweeps.copy_after_cp
    # every FAIL is an interruption whose id finished later under the same id (or a trial
    # the searcher asked for but never started: no id)
    for t in f.trials:
        if t["state"] == "FAIL":
            assert t["attrs"].get("interrupted") is True or t["id"] is None, t
    assert f"report: {f.run.resolve()}" in f.stdout
    assert (f.run / "report" / "report.html").is_file()
    # every attempt is on record with how it ended; the two killed ones have no end and their
    # time is not in the total (the refused second run and second resume are not attempts)
    attempts = json.loads((f.run / "attempts.json").read_text())
    assert [(a["command"], a["ended"]) for a in attempts] == [
        ("run", "interrupted"), ("resume", "interrupted"), ("resume", "running"),
        ("resume", "running"), ("resume", "interrupted"), ("resume", "finished")]
    summary = json.loads((f.run / "summary.json").read_text())
    assert (summary["attempts"], summary["attempts_without_end"]) == (6, 2)
    assert summary["wall_seconds"] == pytest.approx(sum(
        a["finished"] - a["started"] for a in attempts if a["finished"] is not None), rel=1e-9)
    reference = json.loads((sweeps.ref / "summary.json").read_text())
    assert (reference["attempts"], reference["attempts_without_end"]) == (1, 0)
