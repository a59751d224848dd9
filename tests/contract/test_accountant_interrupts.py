"""An interrupt during budget calibration is an interrupt, never an accountant fallback.

A Ctrl-C reaches the whole process group: the PRV children ignore it (the parent decides), a
parent leaving ``keep_interpreters`` by an exception (the sweep's ``Interrupted``) stops the
children still computing, and the thread that asked gets an interrupted outcome, which
``calibrate`` raises as ``CalibrationInterrupted`` instead of calibrating with RDP.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from dpsweep.orchestrator.accounting import sandbox
from dpsweep.orchestrator.accounting.calibration import _answer

#: A job that answers in well under a second.
QUICK = {"multipliers": [1.0], "steps": [10], "sample_rate": 0.01, "delta": 1e-5,
         "target": 3.0, "eps_error": 0.006}
#: A job that computes for about 2 s on 2 cores (a fine PRV grid of ~7 million points).
SLOW = {"multipliers": [1.0], "steps": [200_000], "sample_rate": 0.01, "delta": 1e-5,
        "target": 0.5, "eps_error": 0.0015}


def test_a_child_interpreter_ignores_sigint() -> None:
    child = sandbox._Interpreter()
    try:
        first, reusable = child.ask(QUICK, 60)
        assert first.result is not None and reusable
        os.kill(child.proc.pid, signal.SIGINT)  # what Ctrl-C sends the process group
        again, reusable = child.ask(QUICK, 60)
        assert again.result is not None and reusable
    finally:
        child.close(kill=True)


def test_leaving_keep_interpreters_by_an_interrupt_stops_running_jobs() -> None:
    outcomes: list[sandbox.ChildOutcome] = []
    lane = threading.Thread(target=lambda: outcomes.append(sandbox._prv_in_subprocess(SLOW, 600)))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), sandbox.keep_interpreters():
        lane.start()
        while not sandbox._BUSY and time.monotonic() - started < 30:
            time.sleep(0.05)
        assert sandbox._BUSY, "the job never started"
        time.sleep(0.8)  # the interpreter starts (~0.5 s), then computes
        raise KeyboardInterrupt  # as the sweep's Interrupted leaves precompute
    lane.join(30)
    assert not lane.is_alive() and time.monotonic() - started < 30
    (outcome,) = outcomes
    assert outcome.interrupted and outcome.result is None
    assert "RDP" not in (outcome.reason or "")


def test_an_interrupted_outcome_is_raised_not_calibrated_with_rdp(
        caplog: pytest.LogCaptureFixture) -> None:
    outcome = sandbox._died("code -2", interrupted=True)
    with pytest.raises(sandbox.CalibrationInterrupted):
        _answer(outcome, dict(QUICK), asked=3.0)
    assert "fell back" not in caplog.text


def test_a_child_that_died_otherwise_still_falls_back() -> None:
    outcome = sandbox._died("code -9")
    assert not outcome.interrupted and "RDP used" in (outcome.reason or "")
