"""What a sweep shows while it runs: progress bars (tqdm, on stderr) for the budget precompute,
the trials and the after-search jobs, each running trial's phase and an ETA measured from the
trials' own epochs and audit references (:class:`LiveTrials`); ``--quiet`` turns them off.

On a terminal the phases and the ETA ride on the trials' bar; anywhere else (a file, a pipe, a
CI log) there is no bar but plain lines: one per phase change of a trial (rate-limited), so a
log shows which trial trained which epoch and when an audit ran.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

from dpsweep.orchestrator.trial.runner import AUDIT, PHASE_KEY, SCORING, STARTING, TRAINING

#: Least seconds between two plain lines of one trial in the same phase (a new phase, from
#: training to the audit or to the scoring, is always shown).
PLAIN_INTERVAL_S = 5.0
#: The trials' bar on a terminal: our ETA is in the postfix (tqdm's own one only knows
#: finished trials, and says nothing until the first one finishes).
TRIALS_BAR_FORMAT = "{desc}: {n_fmt}/{total_fmt} [{elapsed}] {postfix}"
SECONDS_PER_MINUTE = 60
SECONDS_PER_HOUR = 3600


def duration(seconds: float | None) -> str:
    """``1h02m``, ``4m10s``, ``12s``; ``?`` when not known yet."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(round(seconds), 0)
    if s >= SECONDS_PER_HOUR:
        return f"{s // SECONDS_PER_HOUR}h{s % SECONDS_PER_HOUR // SECONDS_PER_MINUTE:02d}m"
    if s >= SECONDS_PER_MINUTE:
        return f"{s // SECONDS_PER_MINUTE}m{s % SECONDS_PER_MINUTE:02d}s"
    return f"{s}s"


@dataclasses.dataclass
class _Running:
    """What one running trial last said, and when (the driver's clock)."""

    started: float
    phase: str = STARTING
    at: float = 0.0
    epoch: int = 0
    epochs: int = 0
    val_accuracy: float | None = None
    reference: int = 0
    references: int = 0
    audit_started: float | None = None
    scoring_started: float | None = None
    shown: str = ""
    shown_at: float = -math.inf


class LiveTrials:
    """Each running trial's phase and the sweep's ETA from measured times: seconds per epoch
    of each running trial, per reference of each audit, and the finished trials' durations."""

    def __init__(self, *, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = 0
        self._clock = clock
        self._running: dict[str, _Running] = {}
        self._durations: list[float] = []
        self._audits: list[float] = []
        self._scorings: list[float] = []
        #: The most trials seen running at once: the sweep's real concurrency (Tune's limit,
        #: or fewer where the resources allow fewer).
        self._width = 1

    def update(self, trial_id: str, report: Mapping[str, Any] | None) -> str | None:
        """Take a trial's phase report (None: it ended); the line it makes, or None while the
        trial's last line is recent and in the same phase."""
        now = self._clock()
        if report is None:
            self._end(trial_id, now)
            return None
        trial = self._running.setdefault(trial_id, _Running(started=now, at=now))
        self._width = max(self._width, len(self._running))
        phase = str(report.get(PHASE_KEY, STARTING))
        if phase == AUDIT and trial.audit_started is None:
            trial.audit_started = now
        if phase == SCORING and trial.scoring_started is None:
            trial.scoring_started = now
        trial.phase, trial.at = phase, now
        trial.epoch = int(report.get("epoch", trial.epoch))
        trial.epochs = int(report.get("epochs", trial.epochs))
        trial.reference = int(report.get("reference", trial.reference))
        trial.references = int(report.get("references", trial.references))
        if report.get("val_accuracy") is not None:
            trial.val_accuracy = float(report["val_accuracy"])
        if phase == STARTING or (phase == trial.shown and now - trial.shown_at
                                 < PLAIN_INTERVAL_S):
            return None
        trial.shown, trial.shown_at = phase, now
        return f"trial {trial_id}: {self._describe(trial)} (ETA {duration(self.eta())})"

    def _end(self, trial_id: str, now: float) -> None:
        trial = self._running.pop(trial_id, None)
        if trial is None:
            return
        self._durations.append(now - trial.started)
        if trial.audit_started is not None:
            self._audits.append(now - trial.audit_started)
        if trial.scoring_started is not None:
            self._scorings.append(now - trial.scoring_started)

    @staticmethod
    def _describe(trial: _Running) -> str:
        if trial.phase == TRAINING:
            acc = "" if trial.val_accuracy is None else f", val accuracy {trial.val_accuracy:.3f}"
            return f"training epoch {trial.epoch}/{trial.epochs}{acc}"
        if trial.phase == AUDIT:
            return f"audit reference {trial.reference}/{trial.references}"
        if trial.phase == SCORING:
            return "audit scoring"
        return trial.phase

    def summary(self) -> str:
        """The bar's postfix: the ETA and each running trial's phase."""
        phases = "; ".join(f"{tid} {self._describe(t)}" for tid, t in self._running.items()
                           if t.phase != STARTING)
        return f"ETA {duration(self.eta())}" + (f" | {phases}" if phases else "")

    def eta(self) -> float | None:
        """Seconds until the last trial ends, from measured times; None before any is known."""
        now = self._clock()
        left = [self._left(t, now) for t in self._running.values()]
        pending = max(self.total - self.done - len(self._running), 0)
        whole = _mean(self._durations)
        if whole is None:
            whole = _mean([now - t.started + rest for t, rest in
                           zip(self._running.values(), left, strict=True) if rest is not None])
        if any(rest is None for rest in left) or (pending and whole is None):
            return None
        return (sum(r for r in left if r is not None) + pending * (whole or 0.0)) / self._width

    def _left(self, trial: _Running, now: float) -> float | None:
        """A running trial's seconds to go: its epochs at its own pace, then an audit as long
        as the finished ones' (or its references at their pace)."""
        audit = _mean(self._audits)
        if trial.phase == TRAINING and trial.epoch > 0:
            per_epoch = (trial.at - trial.started) / trial.epoch
            train = max(per_epoch * (trial.epochs - trial.epoch) - (now - trial.at), 0.0)
            return train + (audit or 0.0)
        if trial.phase == AUDIT and trial.audit_started is not None:
            spent = now - trial.audit_started
            if audit is not None:
                return max(audit - spent, 0.0)
            if trial.reference > 0:
                per_reference = (trial.at - trial.audit_started) / trial.reference
                return max(per_reference * (trial.references - trial.reference)
                           - (now - trial.at), 0.0)
            return None
        if trial.phase == SCORING and trial.scoring_started is not None:
            scoring = _mean(self._scorings)
            return max((scoring or 0.0) - (now - trial.scoring_started), 0.0)
        whole = _mean(self._durations)
        return None if whole is None else max(whole - (now - trial.started), 0.0)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class _NullBar:
    """What ``progress`` yields with --quiet: a bar that shows nothing."""

    def update(self, n: int = 1) -> None:
        del n

    def write(self, text: str) -> None:
        del text

    def show(self, *, line: str | None, summary: str) -> None:
        del line, summary


class _PlainBar:
    """What ``progress`` yields when stderr is no terminal: no bar, lines as they come (a
    trial's line on stdout, like tqdm's ``write``; phase lines on stderr, like the bar)."""

    def update(self, n: int = 1) -> None:
        del n

    def write(self, text: str) -> None:
        print(text, flush=True)

    def show(self, *, line: str | None, summary: str) -> None:
        """A phase change: its line (None while rate-limited)."""
        del summary
        if line is not None:
            print(line, file=sys.stderr, flush=True)


class _TerminalBar(tqdm):
    """tqdm's bar, with the running trials' phases and the ETA in its postfix."""

    def show(self, *, line: str | None, summary: str) -> None:
        del line
        self.set_postfix_str(summary)


@contextmanager
def progress(*, total: int, desc: str, quiet: bool) -> Iterator[Any]:
    """A progress bar on stderr (tqdm) when it is a terminal, plain lines when it is not,
    nothing with --quiet."""
    if quiet or total == 0:
        yield _NullBar()
        return
    if not sys.stderr.isatty():
        yield _PlainBar()
        return
    bar = _TerminalBar(total=total, desc=desc, unit="trial" if desc == "trials" else "it",
               dynamic_ncols=True, file=sys.stderr,
               bar_format=TRIALS_BAR_FORMAT if desc == "trials" else None)
    try:
        yield bar
    finally:
        bar.close()
