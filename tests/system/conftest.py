"""What several system test modules share: one uninterrupted reference sweep per session, and a
background lane for sweeps that never depend on when their commands run.

The reference is ``test_faults.py``'s sweep (its CONFIG, on the real CLI), started under a
TMPDIR of 100 characters. ``test_faults.py`` compares its chain of interrupted attempts with it
and refuses a second ``run`` into it while it runs; ``test_run_integrity.py`` checks that it ran
under that TMPDIR and resumes a damaged copy of it. One sweep serves both (a second sweep, only
for the TMPDIR, cost about 18 s of every run of the suite); it starts when the first module asks
for it and runs in the background until a test waits for it (``test_faults.py`` runs its chain
meanwhile).

The lane: ``test_faults.py``'s chain spends most of its two minutes waiting for its commands (to
start Ray, to reach the moment of a fault, to stop), one command at a time. While it runs, the
lane runs the sweeps of ``test_faults_disk.py`` (a full disk, filled at exact writes) and
``test_pruner.py`` (a seeded sweep killed after four records), one after the other, if those
modules are in the session: their outcome depends on no timing, only on their own commands.
Each module still asks the lane for its result (``Lane.result``), which runs the job first when
nothing started it (the module run alone, or ``test_faults.py`` not in the session).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.cli_harness import STAGE_TIMEOUT, Proc, finish, lock_pid, reap, start, wait_for
from tests.system.test_faults import CONFIG

#: Under a TMPDIR of about 40 characters or more every run failed (Ray's plasma store socket
#: below it exceeded the 107 bytes of a Unix socket path); the reference runs under 100.
TMPDIR_LENGTH = 100


@dataclass
class ReferenceSweep:
    """The reference ``dpsweep run``, started; :meth:`wait` ends it (once) and fills in rc."""

    config: Path
    run: Path
    tmpdir: Path  # the TMPDIR it runs under
    proc: Proc
    began: float
    second_run: tuple[int | None, str, int]  # (rc, stderr, pid of the lock holder)
    rc: int | None = None
    seconds: float = 0.0
    done: bool = False

    def wait(self) -> ReferenceSweep:
        if not self.done:
            try:
                self.rc = finish(self.proc, timeout=STAGE_TIMEOUT)
                self.seconds = time.monotonic() - self.began
            finally:
                reap(self.proc, grace=10)
                self.done = True
        return self

    @property
    def stderr(self) -> str:
        return self.proc.stderr()


@pytest.fixture(scope="session")
def reference_sweep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceSweep]:
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "logs").mkdir()
    config = tmp / "sweep.toml"
    config.write_text(CONFIG)
    long = tmp / "t"
    long = Path(str(long) + "x" * (TMPDIR_LENGTH - len(str(long))))
    long.mkdir()
    assert len(str(long)) == TMPDIR_LENGTH
    run = tmp / "reference"
    began = time.monotonic()
    proc = start(["run", str(config), "--out", str(run)], log=tmp / "logs" / "reference",
                 env={"TMPDIR": str(long)})
    reference = None
    try:
        # a second `run` into the same directory while the first holds it
        wait_for(proc, lambda: lock_pid(run) == proc.pid, timeout=STAGE_TIMEOUT)
        other = start(["run", str(config), "--out", str(run)], log=tmp / "logs" / "second-run")
        second = (finish(other, timeout=120), other.stderr(), proc.pid)
        reap(other, grace=5)
        reference = ReferenceSweep(config=config, run=run, tmpdir=long, proc=proc,
                                   began=began, second_run=second)
        yield reference
    finally:
        if reference is not None:
            reference.wait()
        else:
            reap(proc, grace=0)


#: Modules whose sweeps run in the lane while ``test_faults.py``'s chain runs (when they are in
#: the session), in this order; each has ``lane_job(tmp_path_factory)``, the job to run.
BEHIND_THE_FAULT_CHAIN = ("tests.system.test_faults_disk", "tests.system.test_pruner",
                          "tests.system.test_reaudit", "tests.system.test_retry_failed",
                          "tests.system.test_wheel")

#: Modules that must run in one process (the reference sweep's users and the lane's): under
#: ``make test``'s two workers they are one group (``tests/conftest.py``).
ONE_PROCESS = ("tests.system.test_faults", "tests.system.test_run_integrity",
               *BEHIND_THE_FAULT_CHAIN)


class Lane:
    """Jobs run one after another in one background thread, each at most once, by name."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[tuple[str, Callable[[], Any]]] = []
        self._submitted: set[str] = set()
        self._done: dict[str, tuple[bool, Any]] = {}
        self._thread: threading.Thread | None = None

    def submit(self, name: str, make: Callable[[], Callable[[], Any]]) -> None:
        """Queue the job ``make()`` returns (``make`` runs here, in the caller's thread: it
        makes the job's folders), unless a job of that name was queued before."""
        with self._cond:
            if name in self._submitted:
                return
            self._submitted.add(name)
            self._queue.append((name, make()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="system-test-lane",
                                                daemon=True)
                self._thread.start()

    def result(self, name: str, make: Callable[[], Callable[[], Any]]) -> Any:
        """The job's return value once it ended (queued now if it never was); what it raised
        (a failed assertion, a skip) is raised here."""
        self.submit(name, make)
        with self._cond:
            self._cond.wait_for(lambda: name in self._done)
            ok, value = self._done[name]
        if not ok:
            raise value
        return value

    def join(self) -> None:
        """Wait until every queued job ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._thread is None)

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    self._cond.notify_all()
                    return
                name, job = self._queue.pop(0)
            try:
                outcome: tuple[bool, Any] = (True, job())
            except BaseException as exc:  # a skip or a failure: result() raises it
                outcome = (False, exc)
            with self._cond:
                self._done[name] = outcome
                self._cond.notify_all()


@pytest.fixture(scope="session")
def lane() -> Iterator[Lane]:
    lane = Lane()
    yield lane
    lane.join()  # a job whose module stopped early still ends (and cleans up) before the exit


def start_behind_the_fault_chain(request: pytest.FixtureRequest, lane: Lane,
                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Queue the sweeps of :data:`BEHIND_THE_FAULT_CHAIN`'s modules that are in the session."""
    chosen = {item.module.__name__ for item in request.session.items
              if getattr(item, "module", None) is not None}
    for name in BEHIND_THE_FAULT_CHAIN:
        if name in chosen:
            module = importlib.import_module(name)
            lane.submit(name, lambda module=module: module.lane_job(tmp_path_factory))
