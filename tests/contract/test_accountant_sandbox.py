"""The PRV accountant's child process (``orchestrator.accounting.sandbox``): a calibration that
outlives its time bound falls back to RDP (and is retried with more time), child interpreters
are reused inside ``keep_interpreters`` and killed past their bound, a child exits with its
parent, fork only without threads, and the ``budget`` command's numbers from a fresh
interpreter that imports none of the accountants' heavy stack.

These start processes, so they are contract tests; the calibrations' numbers are unit tests
(``tests/unit/orchestrator/test_budget.py``, where the child's job runs in-process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dpsweep.orchestrator.accounting import cache as budget_cache
from dpsweep.orchestrator.accounting import sandbox
from dpsweep.orchestrator.accounting.calibration import calibrate, epsilon_curve
from dpsweep.orchestrator.accounting.verify import rdp_epsilon

REPO = Path(__file__).resolve().parents[2]
Q, T, DELTA = 0.004267, 2344, 1e-5
# A cheap question (a fraction of a second of PRV) for tests that need fresh calibrations.
CHEAP: dict[str, Any] = {"target_epsilon": 2.0, "delta": DELTA, "sample_rate": 0.02, "steps": 250}


def _python(code: str, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter on this checkout (what a CLI user or a child sees)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          timeout=timeout)


def test_acceptance_command_is_light_and_rounds_safely() -> None:
    """The CLI's numbers, and what it imports: no torch (``torch._C``: a lazy stub named torch
    loads nothing), opacus, prv_accountant, dp_accounting."""
    code = ("import sys\nfrom orchestrator.cli import main\n"
            "rc = main(['budget', '--epsilon', '3', '--delta', '1e-5', '--sample-rate', "
            "'0.004267', '--steps', '2344'])\n"
            "heavy = [m for m in ('torch._C', 'opacus', 'prv_accountant', 'dp_accounting', "
            "'scipy.stats') if m in sys.modules]\n"
            "print('heavy:', heavy)\nraise SystemExit(rc)\n")
    r = _python(code, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines())
    assert lines["heavy"].strip() == "[]"
    assert lines["sigma (noise multiplier)"].strip() == "0.6952"  # 0.695173 rounded up
    # the printed text (one rounding of one computation), not floats from two code paths
    assert lines["epsilon upper"].split()[0] == "2.9851"  # 2.985023 rounded up
    assert lines["epsilon lower"].strip() == "2.9724"  # 2.972479 rounded down
    assert lines["accountant"].strip() == "prv"


def test_timeout_falls_back_to_rdp(tmp_path: Path) -> None:
    cal = calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, timeout_s=0.01,
                    cache_dir=tmp_path)
    assert cal.accountant == "rdp" and cal.bounds.accountant == "rdp"
    assert cal.fallback_reason is not None
    assert "did not finish within 0.01 s" in cal.fallback_reason
    assert cal.bounds.lower is None and cal.bounds.estimate is None
    assert 2.97 <= cal.bounds.upper <= 3.0
    assert rdp_epsilon(schedule=cal.schedule, sample_rate=Q, delta=DELTA).upper == cal.bounds.upper
    assert cal.noise_multiplier > 0.705  # RDP is looser, so it asks for more noise
    curve = epsilon_curve(cal, at_steps=[1000, T])
    assert [b.accountant for b in curve] == ["rdp", "rdp"]
    assert curve[0].upper < curve[1].upper == cal.bounds.upper
    # The same question with the same time bound is answered from the (verified) cache.
    budget_cache._VERIFIED.clear()
    assert calibrate(target_epsilon=3, delta=DELTA, sample_rate=Q, steps=T, timeout_s=0.01,
                     cache_dir=tmp_path).cached


def test_cached_timeout_is_retried_with_more_time(tmp_path: Path) -> None:
    assert calibrate(**CHEAP, timeout_s=0.01, cache_dir=tmp_path).accountant == "rdp"
    retried = calibrate(**CHEAP, cache_dir=tmp_path)
    assert retried.accountant == "prv" and not retried.cached
    assert calibrate(**CHEAP, timeout_s=0.01, cache_dir=tmp_path).accountant == "prv"


def test_child_interpreters_are_reused_and_one_past_its_bound_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With threads (the sweep's budget lanes, here numpy's BLAS pool), each PRV job goes to a
    fresh interpreter. Inside ``keep_interpreters`` (the sweep's precompute) it is kept for the
    next job (its start costs more than a job); one that outlives its time bound is killed,
    never reused; on leaving, none is left. Outside, none is kept."""
    monkeypatch.setattr(sandbox, "_start_method", lambda: "subprocess")
    calibrate(**{**CHEAP, "target_epsilon": 1.8}, cache_dir=tmp_path / "z")
    assert sandbox._IDLE == []
    with sandbox.keep_interpreters():
        first = calibrate(**CHEAP, cache_dir=tmp_path / "a")
        assert first.accountant == "prv"
        assert len(sandbox._IDLE) == 1
        kept = sandbox._IDLE[0].proc
        second = calibrate(**{**CHEAP, "target_epsilon": 2.5}, cache_dir=tmp_path / "a")
        assert second.accountant == "prv" and not second.cached
        assert [c.proc for c in sandbox._IDLE] == [kept] and kept.poll() is None
        slow = calibrate(**{**CHEAP, "target_epsilon": 1.5}, timeout_s=0.01,
                         cache_dir=tmp_path / "b")
        assert slow.accountant == "rdp" and "did not finish within" in (slow.fallback_reason
                                                                        or "")
        assert kept.poll() is not None  # the one that took the job past its bound is gone
        assert sandbox._IDLE == []
        after = calibrate(**{**CHEAP, "target_epsilon": 1.5}, cache_dir=tmp_path / "c")
        assert after.accountant == "prv"
        last = sandbox._IDLE[0].proc
        assert last is not kept
    assert sandbox._IDLE == [] and last.poll() is not None


def test_a_child_interpreter_exits_with_its_parent() -> None:
    code = ("import json; from dpsweep.orchestrator.accounting import sandbox; "
            "keep = sandbox.keep_interpreters(); keep.__enter__(); "
            "r = sandbox._prv_in_subprocess({'multipliers': [1.0], 'steps': [250], "
            "'sample_rate': 0.02, 'delta': 1e-5, 'target': 2.0, 'eps_error': 0.06}, 60); "
            "print(json.dumps([r.result is not None, sandbox._IDLE[0].proc.pid]))")
    r = _python(code, timeout=120)
    answered, pid = json.loads(r.stdout.strip().splitlines()[-1])
    assert answered, r.stderr[-2000:]

    def alive() -> bool:  # a zombie waiting to be reaped has exited
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()


def test_start_method() -> None:
    import numpy  # noqa: F401  (its BLAS pool is a second thread)

    assert sandbox._start_method() == "subprocess"
    code = "from dpsweep.orchestrator.accounting import sandbox; print(sandbox._start_method())"
    r = _python(code, timeout=60)
    assert r.stdout.strip() == "fork", r.stderr
