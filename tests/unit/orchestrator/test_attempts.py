"""A resumed sweep's wall time covers every attempt (``orchestrator.sweep.summary``).

The summary once held the last attempt's time alone: the full-size study's part A ran 74.7 min,
then a 15.8 min ``resume``, and its summary said 15.8 min. ``tests/system/test_faults.py``
checks the same record through the CLI over six attempts ended by SIGINT, SIGTERM, ``kill -9``
and a finish.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.sweep import summary as summary_mod
from dpsweep.orchestrator.sweep.summary import begin_attempt, end_attempt, read_attempts, wall_of


@pytest.fixture
def run(tmp_path: Path) -> Iterator[RunDir]:
    opened = RunDir.create(tmp_path / "run", config_text="[training]\nepochs = 1\n")
    yield opened
    opened.release()


class _Clock:
    """time.time() as the test sets it: wall times are exact sums, not measurements."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(summary_mod, "time", fake)
    return fake


def _reopened(run: RunDir) -> RunDir:
    run.release()
    return RunDir.open(run.path, write=True)


def test_every_attempt_counts_and_a_killed_one_is_named_not_guessed(
        run: RunDir, clock: _Clock) -> None:
    attempts = read_attempts(run)
    assert attempts == []
    begin_attempt(run, attempts, command="run")
    clock.now += 100.0
    end_attempt(run, attempts, ended="interrupted")
    run = _reopened(run)
    attempts = read_attempts(run)  # what a resume reads, verified against the manifest
    clock.now += 500.0  # the time between attempts is nobody's
    begin_attempt(run, attempts, command="resume")
    clock.now += 40.0  # then kill -9: no end recorded
    run = _reopened(run)
    attempts = read_attempts(run)
    assert [a["ended"] for a in attempts] == ["interrupted", "running"]
    clock.now += 10.0
    begin_attempt(run, attempts, command="resume --retry-failed")
    clock.now += 25.0
    end_attempt(run, attempts, ended="finished")
    assert wall_of(read_attempts(run)) == {"wall_seconds": 125.0, "attempts": 3,
                                           "attempts_without_end": 1}
    run.release()


def test_a_run_without_the_record_has_no_attempts_and_a_lost_first_write_is_none(
        run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpsweep.orchestrator.rundir as rundir
    def refused(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir, "atomic_write_bytes", refused)
    with pytest.raises(OSError):
        begin_attempt(run, [], command="run")
    monkeypatch.undo()
    assert run.manifest["files"][layout.ATTEMPTS].keys() == {"pending"}
    assert read_attempts(run) == []


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda a: "not a list", "a JSON list"),
    (lambda a: [{**a[0], "command": "rm -rf"}], "command in"),
    (lambda a: [{**a[0], "ended": "finished", "finished": None}], "an end time exactly"),
    (lambda a: [{**a[0], "finished": a[0]["started"] - 1.0}], "not before it"),
    (lambda a: [{**a[0], "started": True}], "started a time"),
    (lambda a: [{**a[0], "extra": 1}], "each an object"),
])
def test_a_damaged_record_is_refused_with_one_line(run: RunDir, edit: Any,
                                                   fragment: str) -> None:
    attempts: list[dict[str, Any]] = []
    begin_attempt(run, attempts, command="run")
    end_attempt(run, attempts, ended="finished")
    # written through the manifest (a hash that matches), so only the content check can refuse
    run.commit(layout.ATTEMPTS, json.dumps(edit(attempts)).encode())
    with pytest.raises(UserInputError) as exc:
        read_attempts(run)
    assert exc.value.field == "RUN_DIR" and exc.value.value == layout.ATTEMPTS
    assert fragment in exc.value.allowed


def test_an_edited_record_fails_its_hash(run: RunDir) -> None:
    attempts: list[dict[str, Any]] = []
    begin_attempt(run, attempts, command="run")
    path = run.path / layout.ATTEMPTS
    path.write_text(path.read_text().replace("running", "finished"))
    with pytest.raises(UserInputError, match="SHA-256 differs"):
        read_attempts(run)


def _attempt_then(error: BaseException) -> Any:
    """A stand-in for the driver's ``_drive``: the attempt begins (every check passed), then
    ``error`` ends it."""
    def drive(_cfg: object, run: RunDir, *, attempts: list[dict[str, Any]], command: str,
              **_: object) -> None:
        begin_attempt(run, attempts, command=command)
        raise error
    return drive


def test_how_an_attempt_ended_is_recorded_and_a_refused_one_writes_nothing(
        run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpsweep.orchestrator.sweep import driver
    from dpsweep.orchestrator.sweep.signals import Interrupted

    def refused() -> None:
        raise UserInputError(field="sweep.methods", value="nope", allowed="a method")

    with pytest.raises(UserInputError):  # bad input: refused before the attempt begins
        driver._drive_and_release(run, refused, address=None, quiet=True, command="run")
    assert not (run.path / layout.ATTEMPTS).exists()
    for error, command in [(Interrupted(signal.SIGTERM), "run"), (KeyError("x"), "resume")]:
        monkeypatch.setattr(driver, "_drive", _attempt_then(error))
        with pytest.raises(type(error)):
            driver._drive_and_release(RunDir.open(run.path, write=True), lambda: None,
                                      address=None, quiet=True, command=command)
    opened = RunDir.open(run.path, write=False)
    assert [(a["command"], a["ended"]) for a in read_attempts(opened)] == [
        ("run", "interrupted"), ("resume", "failed")]
