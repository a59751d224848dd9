"""Ray Tune's side of the sweep: every class and function Tune calls back into.

In the driver, :class:`SweepSearcher` feeds Tune the trials of every study (and the jobs from
outside the studies), :class:`InterruptStopper` stops the experiment when the sweep's stop flag
is set or the searcher met a full disk (``SweepSearcher.halt``; a trial reports one instead of
raising it), and :class:`SilentReporter` keeps Tune's tables quiet (the driver prints its own
lines).
In the workers, :func:`tune_trainable` runs one trial of a study, or a job from outside the
studies (the non-private baseline) in the same warm worker and a slot the trials would leave
idle.

This module subclasses Ray Tune's classes, so it imports Ray Tune: the driver imports it only
when it runs Tune. The trainable sits above both the trial (``orchestrator.trial.runner``) and
the after-search jobs (``orchestrator.sweep.jobs``), so neither imports the other's caller. A job
is named in the Tune config by its kind (``jobs.JobKind``), never by a display name.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState
from ray import tune
from ray.tune import ProgressReporter, Stopper
from ray.tune.logger import JsonLoggerCallback
from ray.tune.search import Searcher

from dpsweep.core.errors import DiskFull, describe, disk_full
from dpsweep.core.layout import OPTUNA_DB
from dpsweep.core.vocabulary import DISK_FULL_KEY, FAILED, INTERRUPTED, OK, PRUNED
from dpsweep.orchestrator.audit.membership import audit_in_trial
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.sweep import jobs
from dpsweep.orchestrator.sweep.studies import (
    AUDIT_ERROR_ATTR,
    ID_ATTR,
    INTERRUPTED_ATTR,
    Outcome,
    StudyPlan,
    Tally,
    audit_error,
    read_outcome,
    told_values,
)
from dpsweep.orchestrator.trial.runner import PHASE_KEY, STARTING, execute, use_data_pool

if TYPE_CHECKING:
    from dpsweep.orchestrator.sweep.signals import _StopFlag

#: Bytes per MiB (Ray counts a trial's memory in bytes; the config in MiB).
MIB = 2**20
#: The key of a Tune config that names a job (its kind's value) instead of a trial.
JOB_KEY = "job"
#: What a job reports to Tune when it fails (its reason: the searcher passes it to the driver).
JOB_ERROR = "job_error"
#: What a trial reports to Tune when a full disk stopped it (``DISK_FULL_KEY``: what could not
#: be written; this key: the reason): the searcher stops the sweep and the trial runs again on
#: resume.
DISK_FULL_REASON = "disk_full_reason"
#: The jobs a Tune experiment may run beside its trials, by kind.
TUNE_JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    jobs.JobKind.BASELINE.value: jobs.baseline_job}


def tune_trainable(config: dict[str, Any], data: dict[str, Any] | None = None) -> None:
    """The Ray Tune function trainable: :func:`execute` with per-epoch reports to Tune, or a job
    from outside the studies (``config[JOB_KEY]``) run in the same warm worker. ``data`` is the
    driver's ``orchestrator.trial.plan.data_pool`` (``tune.with_parameters``)."""
    use_data_pool(data)

    if JOB_KEY in config:
        try:  # its phases reach the driver as a trial's do
            TUNE_JOBS[config[JOB_KEY]](**config["kwargs"], report=tune.report)
        except Exception as exc:  # its reason reaches the driver; the sweep goes on
            tune.report({JOB_ERROR: describe(exc), "done": True})
            return
        tune.report({"done": True})
        return

    try:
        record = execute(config, report=tune.report, audit=audit_in_trial)
    except Exception as exc:
        full = disk_full(exc)
        if full is None:
            raise
        # reported, not raised: Tune would log the traceback, and the driver needs the reason
        tune.report({DISK_FULL_KEY: full.what, DISK_FULL_REASON: full.reason, "done": True})
        return
    tune.report({k: v for k, v in record.items() if isinstance(v, (int, float))
                 and not isinstance(v, bool)} | {"done": True})


class SweepSearcher(Searcher):
    """A Ray Tune searcher over a list of studies.

    ``jobs`` (name -> trial config with a ``"job"`` key) are work from outside the studies, the
    non-private baseline, started first in the same experiment so that they share Tune's warm
    workers and slots; ``on_job_done(name, last_result)`` hears each one end. They are not run
    as Ray tasks beside Tune: anything holding a CPU outside Tune while it starts trials makes
    it run them one at a time (measured with Ray 2.60: the 21 demo trials in one worker)."""

    def __init__(self, *, plans: list[StudyPlan], studies: dict[str, Any],
                 tallies: dict[str, Tally], make_config: Callable[..., dict[str, Any]],
                 on_outcome: Callable[..., None], trials_root: Path,
                 jobs: dict[str, dict[str, Any]] | None = None,
                 on_job_done: Callable[[str, dict | None], None] | None = None,
                 on_phase: Callable[[str, dict | None], None] | None = None,
                 ) -> None:
        """``on_phase(trial id, report)`` hears each running trial's phase reports
        (``runner.PHASE_KEY``) and ``None`` when it ends; a job's as
        ``on_phase(its name, report, kind=its kind)``."""
        super().__init__()
        self._plans = plans
        self._studies = studies
        self._tallies = tallies
        self._make_config = make_config
        self._on_outcome = on_outcome
        self._trials_root = trials_root
        self._jobs = dict(jobs or {})
        self._on_job_done = on_job_done
        self._on_phase = on_phase
        #: Tune's trial id -> a running job's name and kind.
        self._live_jobs: dict[str, tuple[str, str]] = {}
        self._live: dict[str, tuple[StudyPlan, Any, str]] = {}
        self._started: dict[str, int] = {p.name: 0 for p in plans}
        self._lock = threading.Lock()
        #: Set when a write failed on a full disk (a trial's, the driver's, Optuna's): no
        #: trial starts any more, the stopper ends the experiment, and the driver stops.
        self.halt: DiskFull | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Tune pickles its searcher into its own experiment state, which dpsweep never
        loads (state is rebuilt from the Optuna storage): an inert placeholder."""
        return {"dpsweep": "not restorable: the Optuna storage holds the state"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def job_kinds(self) -> list[str]:
        """The kinds of the jobs still to start (what the progress counts besides trials)."""
        return [config[JOB_KEY] for config in self._jobs.values()]

    def save(self, checkpoint_path: str) -> None:
        del checkpoint_path

    def restore(self, checkpoint_path: str) -> None:
        del checkpoint_path

    def _to_start(self, plan: StudyPlan) -> int:
        tally = self._tallies[plan.name]
        running = sum(1 for p, _, _ in self._live.values() if p.name == plan.name)
        return tally.remaining(plan.n_trials) - running

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        with self._lock:
            if self.halt is not None:
                return None
            try:
                return self._suggest(trial_id)
            except Exception as exc:
                self._halt_on(exc)
                return None

    def _halt_on(self, exc: BaseException) -> None:
        """Stop the sweep on a full disk (the state on disk stays consistent: whatever was not
        written is reconciled on resume); any other error is raised as before."""
        full = disk_full(exc, database=str(self._trials_root.parent / OPTUNA_DB))
        if full is None:
            raise exc
        self.halt = self.halt or full

    def _suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        if self._jobs:
            name, config = next(iter(self._jobs.items()))
            del self._jobs[name]
            self._live_jobs[trial_id] = (name, config[JOB_KEY])
            if self._on_phase is not None:
                self._on_phase(name, {PHASE_KEY: STARTING}, kind=config[JOB_KEY])
            return config
        for plan in self._plans:
            if self._to_start(plan) <= 0:
                continue
            study = self._studies[plan.name]
            ot = study.ask(plan.space.distributions)
            tid = ot.user_attrs.get(ID_ATTR)
            if tid is None:
                tally = self._tallies[plan.name]
                tid = plan.trial_id(tally.next_index)
                tally.next_index += 1
                ot.set_user_attr(ID_ATTR, tid)
            for key, value in (("series", plan.series), ("method", plan.method),
                               ("mode", plan.mode), ("epsilon", plan.epsilon)):
                ot.set_user_attr(key, value)
            try:
                config = self._make_config(plan, plan.space.decode(ot.params), tid)
            except Exception as exc:  # planning failed: the trial fails, not the run
                if disk_full(exc) is not None:
                    raise  # the disk, not the plan: the trial (RUNNING) is reconciled on resume
                self._finish(plan, ot, tid, Outcome(FAILED, {}, describe(exc)))
                continue
            self._live[trial_id] = (plan, ot, tid)
            if self._on_phase is not None:
                self._on_phase(tid, {PHASE_KEY: STARTING})
            return config
        return None if self._live or self._live_jobs else Searcher.FINISHED

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """A running trial's report: its phase goes to ``on_phase`` (shown, never stored)."""
        with self._lock:
            if self._on_phase is None or PHASE_KEY not in result:
                return
            entry = self._live.get(trial_id)
            if entry is not None:
                self._on_phase(entry[2], result)
            elif trial_id in self._live_jobs:
                name, kind = self._live_jobs[trial_id]
                self._on_phase(name, result, kind=kind)

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        with self._lock:
            try:
                self._complete(trial_id, result, error)
            except Exception as exc:
                self._halt_on(exc)

    def _complete(self, trial_id: str, result: dict | None, error: bool) -> None:
        if trial_id in self._live_jobs:
            name, kind = self._live_jobs.pop(trial_id)
            if self._on_phase is not None:
                self._on_phase(name, None, kind=kind)
            if self._on_job_done is not None:
                self._on_job_done(name, None if error else result)
            return
        entry = self._live.pop(trial_id, None)
        if entry is None:
            return
        plan, ot, tid = entry
        if self._on_phase is not None:
            self._on_phase(tid, None)
        outcome = read_outcome(self._trials_root / tid)
        if result and result.get(DISK_FULL_KEY) and outcome.status == INTERRUPTED \
                and not outcome.error:  # the disk took no error.json: the report says why
            full = DiskFull(str(result[DISK_FULL_KEY]), str(result.get(DISK_FULL_REASON, "")))
            outcome = Outcome(INTERRUPTED, {DISK_FULL_KEY: {"what": full.what,
                                                              "reason": full.reason}},
                              describe(full))
        self._finish(plan, ot, tid, outcome)

    def _finish(self, plan: StudyPlan, ot: Any, tid: str, outcome: Outcome) -> None:
        study = self._studies[plan.name]
        tally = self._tallies[plan.name]
        values = told_values(outcome, plan.objectives)
        if values is not None:
            if audit_error(outcome):
                ot.set_user_attr(AUDIT_ERROR_ATTR, audit_error(outcome))
            study.tell(ot, values)
            tally.done.add(tid)
        elif outcome.status == PRUNED:
            rung = int(outcome.metrics.get("pruned_at", 0))
            value = float(outcome.metrics.get("val_accuracy", math.nan))
            if len(plan.objectives) == 1 and math.isfinite(value):
                ot.report(value, rung)  # the sampler learns from where it stopped
            ot.set_user_attr("pruned_at", rung)
            study.tell(ot, state=TrialState.PRUNED)
            tally.pruned.add(tid)
        elif outcome.status == INTERRUPTED:
            # a dead worker, a stopped run or a full disk: re-run it under the same id
            full = outcome.metrics.get(DISK_FULL_KEY)
            if isinstance(full, dict):
                self.halt = self.halt or DiskFull(str(full.get("what")),
                                                  str(full.get("reason")))
            ot.set_user_attr(INTERRUPTED_ATTR, True)
            ot.set_user_attr("error", outcome.error or "interrupted (its worker stopped)")
            study.tell(ot, state=TrialState.FAIL)
            study.enqueue_trial(dict(ot.params),
                                user_attrs={ID_ATTR: tid, "rerun_of": ot.number})
            return
        else:
            ot.set_user_attr("error", outcome.error or "a metric was missing or "
                                                        "not finite")
            study.tell(ot, state=TrialState.FAIL)
            if outcome.status == OK:
                tally.done.add(tid)
            else:
                tally.failed.add(tid)
        self._on_outcome(plan, tid, outcome, ot)

    def interrupt(self, reason: str) -> list[str]:
        """Tell every live trial FAIL (interrupted) and enqueue its re-run."""
        with self._lock:
            stopped = []
            for plan, ot, tid in self._live.values():
                try:
                    outcome = read_outcome(self._trials_root / tid)
                    if outcome.status != INTERRUPTED:
                        self._finish(plan, ot, tid, outcome)
                        continue
                    study = self._studies[plan.name]
                    ot.set_user_attr(INTERRUPTED_ATTR, True)
                    ot.set_user_attr("error", reason)
                    study.tell(ot, state=TrialState.FAIL)
                    study.enqueue_trial(dict(ot.params),
                                        user_attrs={ID_ATTR: tid, "rerun_of": ot.number})
                except Exception as exc:  # a full disk: left RUNNING, reconciled on resume
                    self._halt_on(exc)
                stopped.append(tid)
            self._live.clear()
            self._live_jobs.clear()  # a job not finished on disk is run again on resume
            return stopped


class InterruptStopper(Stopper):
    """Stops the whole experiment once the sweep's stop flag is set (SIGINT / SIGTERM) or
    ``halted()`` holds (the searcher met a full disk)."""

    def __init__(self, flag: _StopFlag, halted: Callable[[], bool] | None = None) -> None:
        self._flag = flag
        self._halted = halted

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        return self._flag.event.is_set() or (self._halted is not None and self._halted())

    def __reduce__(self) -> tuple[Any, ...]:  # Tune pickles it; never restored
        return (tuple, ())


class SilentReporter(ProgressReporter):
    """A Tune progress reporter that reports nothing (the driver prints its own lines)."""

    def should_report(self, trials: list, done: bool = False) -> bool:
        return False

    def report(self, trials: list, done: bool, *sys_info: dict) -> None:
        del trials, done, sys_info


def _tune_trial_name(trial: Any) -> str:
    """Tune's own name and directory for a trial: its id (the default spells out the config)."""
    return str(trial.trial_id)


def make_tuner(searcher: SweepSearcher, flag: _StopFlag, *, cfg: Config, tune_dir: Path,
               data: Any, samples: int) -> tune.Tuner:
    """The sweep's Tune experiment: one attempt directory per run or resume, each trial's
    resources, the data pool shared through the object store (``data``), Tune's output
    silenced, and the stopper that polls ``flag`` and the searcher's halt."""
    attempt = 1 + sum(1 for _ in tune_dir.glob("attempt-*"))
    resources = {"cpu": cfg.resources.cpus_per_trial, "gpu": cfg.resources.gpus_per_trial}
    if cfg.resources.memory_per_trial_mb:
        resources["memory"] = cfg.resources.memory_per_trial_mb * MIB
    return tune.Tuner(
        tune.with_resources(tune.with_parameters(tune_trainable, data=data), resources),
        tune_config=tune.TuneConfig(
            search_alg=searcher, num_samples=samples,
            max_concurrent_trials=cfg.sweep.max_concurrent_trials, reuse_actors=True,
            trial_name_creator=_tune_trial_name, trial_dirname_creator=_tune_trial_name),
        run_config=tune.RunConfig(
            name=f"attempt-{attempt}", storage_path=str(tune_dir), verbose=0,
            progress_reporter=SilentReporter(), callbacks=[JsonLoggerCallback()],
            stop=InterruptStopper(flag, halted=lambda: searcher.halt is not None),
            failure_config=tune.FailureConfig(max_failures=0)))
