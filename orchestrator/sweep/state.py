"""What the parts of one sweep attempt share: the facts none of them changes
(:class:`SweepContext`) and what the attempt shows while it runs (:class:`SweepProgress`).

The driver (``driver._Driver``) builds both once and hands them to its parts (``search``,
``aftersearch``, ``records``) in their constructors; each part keeps its own changing state
(the rows, the rung board, whether the baseline ran) to itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

from dpsweep.core.trial import Calibration
from dpsweep.orchestrator.accounting.tuning.private import PrivateTuningPlan
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.sweep.progress import TRIAL, LiveTrials, progress
from dpsweep.orchestrator.sweep.studies import StudyPlan
from dpsweep.orchestrator.trial.setup import ResolvedSetup


class Bar(Protocol):
    """What ``progress.progress`` yields (a tqdm bar, plain lines, or nothing)."""

    def update(self, n: int = 1) -> object: ...

    def write(self, text: str) -> None: ...

    def show(self, *, line: str | None, summary: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class PrivateTuning:
    """Private tuning's plan (Papernot & Steinke) and the per-trial calibration it certifies."""

    plan: PrivateTuningPlan
    certified: Calibration


@dataclasses.dataclass(frozen=True)
class SweepContext:
    """One attempt's fixed facts: the config resolved once where the sweep starts, the locked
    run directory, the studies and, under private tuning, its plan."""

    setup: ResolvedSetup
    run: RunDir
    plans: tuple[StudyPlan, ...]
    #: None: adaptive tuning.
    private: PrivateTuning | None = None

    @property
    def cfg(self) -> Config:
        return self.setup.config

    @property
    def certified(self) -> Calibration | None:
        """The certified per-trial calibration under private tuning, else None."""
        return None if self.private is None else self.private.certified

    def plan_named(self, name: str) -> StudyPlan:
        return {p.name: p for p in self.plans}[name]


class SweepProgress:
    """The progress bar on screen (the search's, then the after-search jobs') and when the
    attempt started: a recorded trial's line goes above whichever bar is up; both bars show
    what each running trial or job is doing and the ETA (``progress.LiveTrials``), the jobs'
    ETA from the search's measured trials too (a re-run trains like one)."""

    def __init__(self, *, quiet: bool, started: float | None = None) -> None:
        self.quiet = quiet
        self.started = time.time() if started is None else started
        self._bar: Bar | None = None
        #: Whether a recorded trial advances the bar (the search's; a job advances its own).
        self._counts_records = True
        self._live: LiveTrials | None = None
        #: The finished trials' and jobs' durations by kind, over every bar of the attempt.
        self._durations: dict[str, list[float]] = {}

    @contextmanager
    def bar(self, *, total: int, desc: str, counts_records: bool,
            jobs: Mapping[str, int] | None = None,
            like: Mapping[str, str] | None = None) -> Iterator[Bar]:
        """A bar (``progress.progress``) that the lines of this block are written above; with
        ``jobs`` (kind -> how many) it shows their phases (``showing``)."""
        with progress(total=total, desc=desc, quiet=self.quiet,
                      live=counts_records or bool(jobs)) as bar, \
                self.showing(bar, counts_records=counts_records, total=total if
                             counts_records else 0, jobs=jobs, like=like):
            yield bar

    def phase(self, unit: str, report: dict | None, *, kind: str = TRIAL) -> None:
        """A running trial's or job's phase report (None: it ended), shown on the bar."""
        if self._live is None or self._bar is None:
            return
        line = self._live.update(unit, report, kind=kind)
        self._bar.show(line=line, summary=self._live.summary())

    @contextmanager
    def showing(self, bar: Bar, *, counts_records: bool, total: int = 0,
                jobs: Mapping[str, int] | None = None,
                like: Mapping[str, str] | None = None) -> Iterator[None]:
        """Lines go above ``bar`` inside the block, printed plainly after it; the search's bar
        (``counts_records``, of ``total`` trials) and a bar of ``jobs`` also show the running
        ones' phases (``like``: ``progress.LiveTrials``'s)."""
        self._bar, self._counts_records = bar, counts_records
        self._live = LiveTrials(total=total, jobs=jobs, like=like, durations=self._durations) \
            if counts_records or jobs else None
        try:
            yield
        finally:
            self._bar, self._counts_records, self._live = None, True, None

    def record_line(self, line: str) -> None:
        """A recorded trial's line: above the bar (which it advances in the search), else
        printed."""
        if self._bar is None:
            print(line, flush=True)
            return
        self._bar.write(line)
        if self._counts_records:
            self._bar.update(1)
            if self._live is not None:
                self._live.count_done()

    def job_line(self, line: str) -> None:
        """An after-search job's line, shown above a bar only (a job recovered from disk
        before any bar is up says nothing)."""
        if not self.quiet and self._bar is not None:
            self._bar.write(line)
