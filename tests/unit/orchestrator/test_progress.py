"""What a sweep shows while it runs (``orchestrator.sweep.progress``): each running trial's
phase, the ETA from measured epochs and references, plain lines off a terminal, and the trial
runner's audit lines turned into phase reports."""

from __future__ import annotations

from typing import Any

import pytest

from dpsweep.orchestrator.sweep import progress as progress_mod
from dpsweep.orchestrator.sweep.progress import LiveTrials, duration
from dpsweep.orchestrator.sweep.state import SweepProgress
from dpsweep.orchestrator.trial import runner
from dpsweep.orchestrator.trial.runner import AUDIT, PHASE_KEY, SCORING, STARTING, TRAINING


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _epoch(k: int, of: int = 10, acc: float = 0.5) -> dict[str, Any]:
    return {PHASE_KEY: TRAINING, "epoch": k, "epochs": of, "val_accuracy": acc}


def test_eta_comes_from_the_trials_own_epochs_then_the_finished_trials() -> None:
    clock = Clock()
    live = LiveTrials(total=4, clock=clock)
    for tid in ("a", "b"):
        assert live.update(tid, {PHASE_KEY: STARTING}) is None  # nothing measured: no line
    assert live.eta() is None
    clock.now = 10.0
    line = live.update("a", _epoch(1, acc=0.25))
    assert line == "trial a: training epoch 1/10, val accuracy 0.250 (ETA ?)"  # b unmeasured
    live.update("b", _epoch(1))
    # each at 10 s an epoch, 9 to go; 2 pending as long as the running ones (100 s), 2 wide
    assert live.eta() == pytest.approx((90 + 90 + 2 * 100) / 2)
    clock.now = 100.0
    live.update("a", None)  # a ended after 100 s: pending trials take as long
    live.count_done()
    assert live.eta() == pytest.approx((0 + 2 * 100) / 2)  # b's epochs are overdue: 0 left


def test_audit_time_is_the_references_pace_then_the_finished_audits() -> None:
    clock = Clock()
    live = LiveTrials(total=1, clock=clock)
    live.update("a", {PHASE_KEY: STARTING})
    clock.now = 5.0
    assert live.update("a", {PHASE_KEY: AUDIT, "reference": 0, "references": 8}) \
        == "trial a: audit reference 0/8 (ETA ?)"
    clock.now = 9.0
    live.update("a", {PHASE_KEY: AUDIT, "reference": 2, "references": 8})
    assert live.eta() == pytest.approx(6 * 2.0)
    assert "a audit reference 2/8" in live.summary()
    clock.now = 30.0
    assert live.update("a", {PHASE_KEY: SCORING}) == "trial a: audit scoring (ETA 0s)"


def test_plain_lines_are_rate_limited_within_a_phase_but_not_across() -> None:
    clock = Clock()
    live = LiveTrials(total=1, clock=clock)
    live.update("a", {PHASE_KEY: STARTING})
    clock.now = 1.0
    assert live.update("a", _epoch(1)) is not None
    clock.now = 2.0
    assert live.update("a", _epoch(2)) is None  # same phase within PLAIN_INTERVAL_S
    assert live.update("a", {PHASE_KEY: AUDIT, "reference": 0, "references": 4}) is not None
    clock.now = 2.0 + progress_mod.PLAIN_INTERVAL_S
    assert live.update("a", {PHASE_KEY: AUDIT, "reference": 3, "references": 4}) is not None


def test_durations_read_at_a_glance() -> None:
    assert [duration(s) for s in (None, 12.4, 250, 3725)] == ["?", "12s", "4m10s", "1h02m"]


def test_off_a_terminal_the_sweep_prints_phase_lines(capsys: pytest.CaptureFixture) -> None:
    shown = SweepProgress(quiet=False)
    with shown.bar(total=2, desc="trials", counts_records=True):
        shown.phase("t0", {PHASE_KEY: STARTING})
        shown.phase("t0", _epoch(1, of=3, acc=0.75))
        shown.record_line("t0 done")
    out, err = capsys.readouterr()
    assert out == "t0 done\n"
    lines = err.splitlines()
    assert lines[0] == "trials: 0/2"  # the stage's start and end, under the bar's title
    assert lines[1].startswith("trial t0: training epoch 1/3, val accuracy 0.750 (ETA ")
    assert lines[-1].startswith("trials: ") and lines[-1].endswith("/2 done")
    quiet = SweepProgress(quiet=True)
    with quiet.bar(total=2, desc="trials", counts_records=True):
        quiet.phase("t0", _epoch(1))
    assert capsys.readouterr() == ("", "")


def test_the_audit_lines_become_phase_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines ``orchestrator.audit.membership.audit_model`` says (its format, verbatim)."""
    reports: list[dict[str, Any]] = []
    say = runner.audit_phases(reports.append)
    monkeypatch.setattr(runner, "REPORT_INTERVAL_S", 0.0)
    for line in ("audit: offline plan, 3 references, 150 candidates",
                 "audit: reference 1/3 trained in 0.4 s, test accuracy 0.812",
                 "audit: reference 2/3 loaded from the cache, test accuracy 0.800",
                 "audit: reference 3/3 trained in 0.4 s, test accuracy 0.790",
                 "audit: 40 attacks scored, 2 excluded in 1.0 s (references 1.2 s)"):
        say(line)
    assert reports == [{PHASE_KEY: AUDIT, "reference": k, "references": 3} for k in (0, 1, 2)] \
        + [{PHASE_KEY: SCORING}]
    monkeypatch.setattr(runner, "REPORT_INTERVAL_S", 3600.0)
    reports.clear()
    say = runner.audit_phases(reports.append)
    for k in (1, 2, 3):
        say(f"audit: reference {k}/3 trained in 0.4 s, test accuracy 0.8")
    assert reports == [{PHASE_KEY: AUDIT, "reference": 1, "references": 3}, {PHASE_KEY: SCORING}]


def test_jobs_after_the_search_show_their_phases_and_count_in_the_eta() -> None:
    """An audit job and a re-run (whose duration, before one finished, is a trial's: the
    search's measured trials carry over) each have their lines, named as their jobs."""
    clock = Clock()
    history = {progress_mod.TRIAL: [100.0]}
    live = LiveTrials(total=0, jobs={"audit": 2, "re-run": 2}, like={"re-run": "trial"},
                      durations=history, clock=clock)
    live.update("audit t1", {PHASE_KEY: STARTING}, kind="audit")
    live.update("re-run t1-r1", {PHASE_KEY: STARTING}, kind="re-run")
    clock.now = 4.0
    line = live.update("audit t1", {PHASE_KEY: AUDIT, "reference": 0, "references": 4},
                       kind="audit")
    assert line == "[audit t1]: audit reference 0/4 (ETA ?)"
    clock.now = 6.0
    live.update("audit t1", {PHASE_KEY: AUDIT, "reference": 1, "references": 4}, kind="audit")
    assert live.update("re-run t1-r1", _epoch(1, of=5, acc=0.5), kind="re-run") \
        == "[re-run t1-r1]: training epoch 1/5, val accuracy 0.500 (ETA 36s)"
    # audit: 3 references at 2 s; re-run: 4 epochs at 6 s; pending: one audit and one re-run
    # each as long as its running one's projection (6 + 6 s, 6 + 24 s); 2 wide
    assert live.eta() == pytest.approx((6 + 24 + 12 + 30) / 2)
    assert "audit t1 audit reference 1/4" in live.summary()
    clock.now = 20.0
    live.update("audit t1", None, kind="audit")  # a job is done when it ends
    assert live.done["audit"] == 1 and history["audit"] == [20.0]
    assert live.eta() == pytest.approx((10 + 20 + 30) / 2)
    # before any re-run runs, one takes as long as the search's trials did
    fresh = LiveTrials(total=0, jobs={"re-run": 3}, like={"re-run": "trial"},
                       durations=history, clock=clock)
    assert fresh.eta() == pytest.approx(3 * 100.0)
    assert LiveTrials(total=0, jobs={"re-run": 3}, clock=clock).eta() is None


def test_the_baseline_trains_at_the_trials_pace_until_it_reports_its_end() -> None:
    """The non-private loop reports no epochs: epoch 0 of E is projected at the others'
    pace (an upper bound: a DP epoch costs more)."""
    clock = Clock()
    live = LiveTrials(total=1, jobs={"baseline": 1}, clock=clock)
    live.update("non-private baseline", {PHASE_KEY: TRAINING, "epoch": 0, "epochs": 4},
                kind="baseline")
    live.update("a", {PHASE_KEY: STARTING})
    assert live.eta() is None  # no pace known yet
    clock.now = 3.0
    live.update("a", _epoch(1, of=4))
    # a: 3 epochs at 3 s; the baseline: 4 epochs at 3 s less the 3 s spent; 2 wide
    assert live.eta() == pytest.approx((9 + 9) / 2)


def test_a_job_posts_its_phases_to_the_board_by_its_index() -> None:
    """``jobs._call``: the job's ``report`` posts to the board without waiting (no Ray: a
    stand-in board records the calls)."""
    from dpsweep.orchestrator.sweep import jobs

    posted: list[tuple[int, dict[str, Any]]] = []

    class Board:
        class post:  # the shape of a Ray actor method
            @staticmethod
            def remote(index: int, report: dict[str, Any]) -> None:
                posted.append((index, report))

    def job(*, x: int, report: Any) -> dict[str, Any]:
        report({PHASE_KEY: TRAINING, "epoch": x, "epochs": 2})
        return {"x": x}

    assert jobs._call(job, {"x": 1}, None, Board(), 7) == {"x": 1}
    assert posted == [(7, {PHASE_KEY: TRAINING, "epoch": 1, "epochs": 2})]
    assert jobs._call(lambda *, x: {"x": x}, {"x": 2}) == {"x": 2}  # no board: no report


def test_off_a_terminal_after_search_jobs_print_phase_lines(
        capsys: pytest.CaptureFixture) -> None:
    shown = SweepProgress(quiet=False)
    with shown.bar(total=1, desc="after the search", counts_records=False,
                   jobs={"audit": 1}):
        shown.phase("audit t0", {PHASE_KEY: STARTING}, kind="audit")
        shown.phase("audit t0", {PHASE_KEY: SCORING}, kind="audit")
        shown.phase("audit t0", None, kind="audit")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "after the search: 0/1"
    assert lines[1].startswith("[audit t0]: audit scoring (ETA ")
