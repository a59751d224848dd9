"""What a sweep shows while it runs: progress bars (tqdm, on stderr) for the budget precompute,
the trials and the after-search jobs, each running trial's or job's phase and an ETA measured
from their own epochs and audit references (:class:`LiveTrials`); ``--quiet`` turns them off.

On a terminal the phases and the ETA ride on the bar (the trials', then the after-search
jobs'); anywhere else (a file, a pipe, a CI log) there is no bar but plain lines: one per phase
change of a trial or job (rate-limited), so a log shows which trial trained which epoch and
when an audit ran.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import Counter
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
#: The kind of a search's trial; an after-search job's kind is its ``jobs.JobKind`` value.
TRIAL = "trial"
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
    """What one running trial or job last said, and when (the driver's clock)."""

    started: float
    kind: str = TRIAL
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
    """Each running trial's (or after-search job's) phase and the ETA from measured times:
    seconds per epoch and per audit reference of each running one, and the finished ones'
    durations, kind by kind (a re-run's, an audit's and the baseline's differ from a trial's).

    ``total`` trials and ``jobs`` (kind -> how many) are still to run; a trial counts as done
    when it is recorded (``count_done``: a trial whose planning failed never runs), a job when
    it ends. ``like`` names the kind whose durations stand in for a kind not measured yet (a
    re-run trains like a trial); ``durations`` carries the finished ones' over from an earlier
    bar (the search's trials, for the re-runs after it)."""

    def __init__(self, *, total: int, jobs: Mapping[str, int] | None = None,
                 like: Mapping[str, str] | None = None,
                 durations: dict[str, list[float]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.totals = Counter({TRIAL: total, **(jobs or {})})
        self.done: Counter[str] = Counter()
        self._like = dict(like or {})
        self._clock = clock
        self._running: dict[str, _Running] = {}
        self._durations = {} if durations is None else durations
        #: The finished audits' and scorings' durations by kind (a trial audits only with
        #: ``audit.in_trial``, a re-run likewise, an audit job always).
        self._audits: dict[str, list[float]] = {}
        self._scorings: dict[str, list[float]] = {}
        #: Seconds per training epoch of every unit that reported one (the pace of a unit
        #: that trains without epoch reports: the non-private baseline).
        self._paces: dict[str, float] = {}
        #: The most units seen running at once: the real concurrency (Tune's limit or the
        #: jobs', or fewer where the resources allow fewer).
        self._width = 1

    def count_done(self, kind: str = TRIAL) -> None:
        """One more of ``kind`` finished (a recorded trial)."""
        self.done[kind] += 1

    def update(self, unit: str, report: Mapping[str, Any] | None, *,
               kind: str = TRIAL) -> str | None:
        """Take a trial's or job's phase report (None: it ended); the line it makes, or None
        while its last line is recent and in the same phase. A job's ``unit`` is its name."""
        now = self._clock()
        if report is None:
            self._end(unit, now)
            return None
        trial = self._running.setdefault(unit, _Running(started=now, at=now, kind=kind))
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
        if phase == TRAINING and trial.epoch > 0:
            self._paces[unit] = (now - trial.started) / trial.epoch
        if phase == STARTING or (phase == trial.shown and now - trial.shown_at
                                 < PLAIN_INTERVAL_S):
            return None
        trial.shown, trial.shown_at = phase, now
        return f"{_label(unit, trial.kind)}: {self._describe(trial)} (ETA {duration(self.eta())})"

    def _end(self, unit: str, now: float) -> None:
        trial = self._running.pop(unit, None)
        if trial is None:
            return
        if trial.kind != TRIAL:  # a trial is done when recorded
            self.done[trial.kind] += 1
        self._durations.setdefault(trial.kind, []).append(now - trial.started)
        if trial.audit_started is not None:
            self._audits.setdefault(trial.kind, []).append(now - trial.audit_started)
        if trial.scoring_started is not None:
            self._scorings.setdefault(trial.kind, []).append(now - trial.scoring_started)

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
        """The bar's postfix: the ETA and each running trial's or job's phase."""
        phases = "; ".join(f"{unit} {self._describe(t)}" for unit, t in self._running.items()
                           if t.phase != STARTING)
        return f"ETA {duration(self.eta())}" + (f" | {phases}" if phases else "")

    def eta(self) -> float | None:
        """Seconds until the last trial or job ends, from measured times; None before what is
        left is known."""
        now = self._clock()
        left = [self._left(t, now) for t in self._running.values()]
        if any(rest is None for rest in left):
            return None
        to_come = 0.0
        for kind, total in self.totals.items():
            running = sum(1 for t in self._running.values() if t.kind == kind)
            pending = max(total - self.done[kind] - running, 0)
            if not pending:
                continue
            whole = self._whole(kind, now)
            if whole is None:
                return None
            to_come += pending * whole
        return (sum(r for r in left if r is not None) + to_come) / self._width

    def _whole(self, kind: str, now: float) -> float | None:
        """How long one of ``kind`` takes: the finished ones' mean, else the running ones'
        projection, else (``like``) another kind's."""
        whole = _mean(self._durations.get(kind, []))
        if whole is None:
            whole = _mean([now - t.started + rest for t in self._running.values()
                           if t.kind == kind and (rest := self._left(t, now)) is not None])
        if whole is None and kind in self._like:
            return self._whole(self._like[kind], now)
        return whole

    def _of_kind(self, durations: dict[str, list[float]], kind: str) -> float | None:
        """The mean of ``kind``'s ``durations``, else of the kind it is ``like``."""
        mean = _mean(durations.get(kind, []))
        if mean is None and kind in self._like:
            return _mean(durations.get(self._like[kind], []))
        return mean

    def _left(self, trial: _Running, now: float) -> float | None:
        """A running unit's seconds to go: its epochs at its own pace (at the others' pace
        before its first epoch report: the baseline reports none), then an audit as long as
        the finished ones' (or its references at their pace)."""
        audit = self._of_kind(self._audits, trial.kind)
        if trial.phase == TRAINING and (trial.epoch > 0 or self._paces):
            per_epoch = ((trial.at - trial.started) / trial.epoch if trial.epoch > 0
                         else _mean(list(self._paces.values())) or 0.0)
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
            scoring = self._of_kind(self._scorings, trial.kind)
            return max((scoring or 0.0) - (now - trial.scoring_started), 0.0)
        whole = _mean(self._durations.get(trial.kind, []))
        return None if whole is None else max(whole - (now - trial.started), 0.0)


def _label(unit: str, kind: str) -> str:
    """How a line names what it is about: ``trial <id>``, or a job's name in brackets, as its
    ``[<job>] done`` line does."""
    return f"trial {unit}" if kind == TRIAL else f"[{unit}]"


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
    trial's line on stdout, like tqdm's ``write``; phase lines on stderr, like the bar), and
    one line on stderr where the bar's stage starts and one where it ends, under the bar's
    title (``budgets: 0/12``, ``budgets: 12/12 done``), so a log shows which stage ran."""

    def __init__(self, *, desc: str, total: int) -> None:
        self._desc, self._total, self._done = desc, total, 0
        print(f"{desc}: 0/{total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(f"{self._desc}: {self._done}/{self._total} done", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self._done += n

    def write(self, text: str) -> None:
        print(text, flush=True)

    def show(self, *, line: str | None, summary: str) -> None:
        """A phase change: its line (None while rate-limited)."""
        del summary
        if line is not None:
            print(line, file=sys.stderr, flush=True)


class _TerminalBar(tqdm):
    """tqdm's bar, with the running trials' or jobs' phases and the ETA in its postfix."""

    def show(self, *, line: str | None, summary: str) -> None:
        del line
        self.set_postfix_str(summary)


@contextmanager
def progress(*, total: int, desc: str, quiet: bool, live: bool = False) -> Iterator[Any]:
    """A progress bar on stderr (tqdm) when it is a terminal, plain lines when it is not,
    nothing with --quiet; ``live``: the bar shows phases and our ETA in its postfix (tqdm's
    own ETA, from finished items alone, is left out)."""
    if quiet or total == 0:
        yield _NullBar()
        return
    if not sys.stderr.isatty():
        plain = _PlainBar(desc=desc, total=total)
        try:
            yield plain
        finally:
            plain.close()
        return
    bar = _TerminalBar(total=total, desc=desc, unit="trial" if desc == "trials" else "it",
               dynamic_ncols=True, file=sys.stderr,
               bar_format=TRIALS_BAR_FORMAT if live else None)
    try:
        yield bar
    finally:
        bar.close()
