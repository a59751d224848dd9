"""What the driver of one sweep attempt holds, declared once for the three parts that share it
(``search.SweepSearch``, ``aftersearch.AfterSearchJobs``, ``records.SweepRecords``); the
driver (``driver._Driver``) sets every field in its constructor."""

from __future__ import annotations

from typing import Any

from orchestrator.config import Config
from orchestrator.rundir import RunDir
from orchestrator.sweep.signals import _StopFlag
from orchestrator.sweep.studies import StudyPlan
from orchestrator.trial.setup import ResolvedSetup


class SweepState:
    """The fields of one sweep attempt."""

    #: The sweep's config, resolved once where the sweep starts, and its plain values
    #: (``setup.config``).
    setup: ResolvedSetup
    cfg: Config
    run: RunDir
    quiet: bool
    #: Every attempt at this sweep, this one last (``summary.begin_attempt``).
    attempts: list[dict[str, Any]]
    #: ``resume --retry-failed``: failed trials and re-runs are trained again (adaptive sweeps;
    #: ``driver.check_retry`` refuses it under private tuning).
    retry_failed: bool
    #: Trials and after-search jobs this attempt started (0: nothing was left to run).
    ran: int
    plans: list[StudyPlan]
    #: The data splits every trial plans and audits with (``setup.data_splits()``).
    data: Any
    #: Trial id -> results row, read back from the results store on a resume.
    rows: dict[str, dict[str, Any]]
    #: The private-tuning plan and its certified per-trial calibration (None: adaptive).
    private: Any
    certified: Any
    #: The rung board's actor name (``sweep.pruner = 'asha'``), its handle, and the rungs.
    board: str | None
    board_handle: Any
    rungs: tuple[int, ...]
    #: Whether the baseline ran inside the search (then the after-search phase skips it).
    baseline_ran: bool
    flag: _StopFlag
    #: The progress shown: the bar, each study's best accuracy, when the attempt started, and
    #: whether a recorded trial advances the bar (not after the search, where the job does).
    bar: Any
    best: dict[str, float]
    start: float
    bar_counts_records: bool
