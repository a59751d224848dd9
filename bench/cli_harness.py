"""Driving the real CLI as a user would, for the system tests and the fault benchmark: a command
started in its own session (so everything it starts can be found in ``/proc``), waited on until a
chosen moment, stopped, and reaped; and what its run directory holds afterwards (result files,
Optuna's trials, a hash of the tree).

Both ``tests/system`` and ``bench/faults.py`` import it, so a fault measured in a benchmark is
injected exactly as the tests inject it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from dpsweep.core.layout import LOCK_INFO, OPTUNA_DB, RESULT, RESULTS, TRIALS
from dpsweep.orchestrator.sweep.studies import READ_ONLY_ATTR
from dpsweep.reports.store import read_results

#: The console script of the environment running the harness.
BIN = Path(sys.executable).parent / "dpsweep"


@dataclass(frozen=True)
class ProcInfo:
    name: str
    state: str
    parent: int
    session: int


def processes() -> dict[int, ProcInfo]:
    """pid -> its ``/proc/<pid>/stat`` fields; processes that exit while being read are skipped."""
    found: dict[int, ProcInfo] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        close = stat.rindex(")")  # the name may hold spaces and parentheses
        fields = stat[close + 2:].split()
        found[int(entry.name)] = ProcInfo(name=stat[stat.index("(") + 1:close], state=fields[0],
                                          parent=int(fields[1]), session=int(fields[3]))
    return found


STAGE_TIMEOUT = 300.0
#: Ray's node agents outlive a SIGKILLed driver by up to a minute before they notice; they hold
#: no trial. Every other process the command started must be gone within KILL_GRACE seconds.
AGENTS = ("ray::DashboardA", "ray::RuntimeEnv")
KILL_GRACE = 30.0


# ---- processes ---------------------------------------------------------------------------------
@dataclass
class Proc:
    """A dpsweep command started in its own session (so everything it starts can be found)."""

    popen: subprocess.Popen
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


def start(args: list[str], *, log: Path, env: dict[str, str] | None = None) -> Proc:
    """``env``: variables set for the command on top of this process's environment."""
    out, err = Path(f"{log}.out"), Path(f"{log}.err")
    with out.open("w") as fo, err.open("w") as fe:
        popen = subprocess.Popen([str(BIN), *args], stdout=fo, stderr=fe,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                 start_new_session=True, preexec_fn=as_from_a_terminal)
    return Proc(popen, out, err)


def as_from_a_terminal() -> None:
    """In the child before it runs: SIGINT and SIGTERM at their defaults, as a command started
    from a terminal has them (a shell starts a background job, such as a CI run, with SIGINT
    ignored, and a child inherits that: the Ctrl-C a test sends would be lost)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def wait_for(proc: Proc, ready: Callable[[], bool], *, timeout: float) -> bool:
    """Poll ``ready`` until it holds (True), or the command ended or time ran out (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return True
        if proc.popen.poll() is not None:
            return ready()
        time.sleep(0.05)
    return False


def session_pids(sid: int) -> dict[int, str]:
    """Live (non-zombie) processes of session ``sid``: pid -> command name."""
    return {pid: p.name for pid, p in processes().items() if p.session == sid and p.state != "Z"}


def reap(proc: Proc, *, grace: float) -> dict[int, str]:
    """Give what ``proc`` started ``grace`` seconds to exit by itself, then SIGKILL what is left
    (by pid: only processes of its own session). Returns the processes other than Ray's node
    agents that were still running after the grace period."""
    deadline = time.monotonic() + grace
    left = session_pids(proc.pid)
    while left and time.monotonic() < deadline \
            and not all(name in AGENTS for name in left.values()):
        time.sleep(0.5)
        left = session_pids(proc.pid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(10)
    return {pid: name for pid, name in left.items() if name not in AGENTS}


def finish(proc: Proc, *, timeout: float) -> int | None:
    """The exit code, or None (everything killed) if it did not end within ``timeout``."""
    try:
        return proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        reap(proc, grace=0)
        return None


# ---- run directory state -------------------------------------------------------------------
def result_mtimes(run: Path) -> dict[str, int]:
    """trial id -> mtime (ns) of its result.json: a trial trained again rewrites it."""
    return {p.parent.name: p.stat().st_mtime_ns for p in run.glob(f"{TRIALS}/*/{RESULT}")}


def result_ids(run: Path) -> list[str]:
    """Trial ids of the results store's rows (duplicates kept)."""
    if not (run / RESULTS).is_file():
        return []
    return list(read_results(run, allow_empty=True)["trial_id"])


def optuna_trials(run: Path) -> list[dict[str, Any]]:
    """Every Optuna trial of every series' study: state, dpsweep id, attributes, (fixed)
    parameters (a target's read-only summary study holds copies of them, not trials)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not (run / OPTUNA_DB).is_file():
        return []
    url = f"sqlite:///{run / OPTUNA_DB}"
    out = []
    for name in optuna.get_all_study_names(url):
        study = optuna.load_study(study_name=name, storage=url)
        if study.user_attrs.get(READ_ONLY_ATTR):
            continue
        for t in study.get_trials(deepcopy=False):
            out.append({"study": name, "number": t.number, "state": t.state.name,
                        "id": t.user_attrs.get("dpsweep_trial_id"), "attrs": dict(t.user_attrs),
                        "params": dict(t.params),
                        "fixed_params": dict(t.system_attrs.get("fixed_params") or {})})
    return out


def running(trials: list[dict[str, Any]]) -> list[tuple[str, int, str | None]]:
    return [(t["study"], t["number"], t["id"]) for t in trials if t["state"] == "RUNNING"]


def complete_ids(trials: list[dict[str, Any]]) -> list[str]:
    return sorted(t["id"] for t in trials if t["state"] == "COMPLETE")


def tree_hash(root: Path) -> str:
    """SHA-256 over every file's relative path and bytes (and every directory's name)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        if path.is_file() and not path.is_symlink():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def lock_pid(run: Path) -> int | None:
    try:
        return int(json.loads((run / LOCK_INFO).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None
