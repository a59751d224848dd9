"""The search: the Optuna studies opened (or reconciled after a crash), the trial configs Ray Tune
runs, the rung board of the pruner, and the Tune experiment itself.

``SweepSearch`` is the part of the driver (``orchestrator.sweep.driver._Driver``) that runs the
trials: one Ray Tune experiment over every study (``raytune.SweepSearcher`` asks the studies for
points; ``raytune.tune_trainable`` trains one). A stop (a signal polled through
``raytune.InterruptStopper``, or a full disk the searcher met) ends the experiment, tells the
running trials they were interrupted, and is raised once Tune has returned. The non-private
baseline may run inside the experiment as a job, so that it starts before any trial finishes;
the search is handed that job and what to do when it ends, not the after-search phase.
``TrialConfigs`` makes the config one trial (or re-run, or the baseline) is given, and owns
the pruner's rung board whose name those configs carry.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optuna
import ray
from ray.actor import ActorHandle

from dpsweep.core import layout
from dpsweep.core.storage import json_bytes
from dpsweep.orchestrator.accounting.calibration import certify
from dpsweep.orchestrator.audit.membership import reference_budgets
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.rundir import RunDir, private_file
from dpsweep.orchestrator.sweep.jobs import Job
from dpsweep.orchestrator.sweep.progress import progress
from dpsweep.orchestrator.sweep.records import SweepRecords, read_json
from dpsweep.orchestrator.sweep.signals import Interrupted, _StopFlag
from dpsweep.orchestrator.sweep.state import PrivateTuning, SweepContext, SweepProgress
from dpsweep.orchestrator.sweep.studies import StudyPlan, Tally, reconcile
from dpsweep.orchestrator.sweep.tuning import draw_counts, open_plan_study, private_tuning_plan
from dpsweep.orchestrator.trial.plan import data_pool, plan_trial
from dpsweep.orchestrator.trial.pruning import ACTOR_PREFIX, start_board
from dpsweep.orchestrator.trial.setup import ResolvedSetup
from dpsweep.trainables.data.splits import DataSplits

if TYPE_CHECKING:
    from ray.tune import Tuner

    from dpsweep.orchestrator.sweep.raytune import SweepSearcher

#: Tune's own samples beyond the trials and jobs to run: room for trials told to stop and
#: re-enqueued, and for points the searcher skips.
SPARE_SAMPLES = 16
#: Samples per trial still to run (a re-enqueued trial is asked again).
SAMPLES_PER_TRIAL = 4
#: Hex digits of the rung board's actor name after its prefix.
BOARD_ID_HEX = 12


def audit_settings(cfg: Config) -> dict[str, Any]:
    """The audit section as plain data (it travels to Ray workers), with whether the audit
    runs inside each trial."""
    settings = {f.name: getattr(cfg.audit, f.name) for f in dataclasses.fields(cfg.audit)}
    settings["in_trial"] = cfg.audit.enabled and cfg.audit.in_trial
    return settings


def private_tuning(setup: ResolvedSetup, run: RunDir, *,
                   quiet: bool) -> tuple[PrivateTuning, dict[str, int]]:
    """The private-tuning plan, printed before any training, and the secret trial counts
    (drawn once; kept in the run directory for a resume, never in a release)."""
    plan = private_tuning_plan(setup)
    path = run.path / layout.PRIVATE_TUNING
    if path.is_file():
        counts = read_json(run.verify(layout.PRIVATE_TUNING))["counts"]
    else:
        counts = draw_counts(setup, plan)
        run.commit(layout.PRIVATE_TUNING, json_bytes(
            {"counts": counts, "note": "the secret number of trials per series: never "
                                       "exported"}))
    certified = certify(schedule=plan.schedule, sample_rate=plan.sample_rate, delta=plan.delta)
    if not quiet:
        print(f"private tuning: end-to-end epsilon {plan.end_to_end_epsilon:.4f} "
              f"(target {plan.target_epsilon:g}, delta {plan.delta:g}, "
              f"{plan.end_to_end_accountant}); per trial: sigma "
              f"{plan.schedule.first:.4f}, epsilon {certified.bounds.upper:.4f} "
              f"(training) / {plan.per_trial_epsilon:.4f} (with the noisy score); "
              f"expected trials {plan.expected_trials:g} ({plan.distribution})", flush=True)
    return PrivateTuning(plan=plan, certified=certified), counts


class TrialConfigs:
    """The config a trial, a re-run or the baseline is given, and the rung board
    (``sweep.pruner = 'asha'``) whose actor those configs name."""

    def __init__(self, *, context: SweepContext, data: DataSplits,
                 rungs: tuple[int, ...]) -> None:
        """``data``: the splits every trial plans and audits with (``setup.data_splits()``);
        ``rungs``: the pruner's epochs (``trial.pruning.rungs``; () without the pruner)."""
        self._context = context
        self._data = data
        self._rungs = rungs
        #: The board's actor name, and its handle, which keeps the actor alive while the
        #: sweep runs (None until ``start_board``).
        self._board: str | None = None
        self._board_handle: ActorHandle | None = None

    def trial_epsilon(self, plan: StudyPlan) -> float:
        """A trial's training epsilon, which its audit's references are matched to: the study's
        target, or under private tuning the certified per-trial figure (the target is then the
        end-to-end one)."""
        certified = self._context.certified
        return plan.epsilon if certified is None else certified.bounds.upper

    def audit_budgets(self, plan: StudyPlan, params: dict[str, Any]) -> dict[str, Any]:
        """The budgets of a trial's audit references (``audit.membership.reference_budgets``),
        from the run's budget cache."""
        context = self._context
        return reference_budgets(context.cfg, method=plan.method, params=params,
                                 epsilon=self.trial_epsilon(plan), data=self._data,
                                 cache_dir=context.run.cache_dir)

    def config(self, plan: StudyPlan, params: dict[str, Any], tid: str) -> dict[str, Any]:
        context = self._context
        run, private = context.run, context.private
        spec = plan_trial(context.setup, epsilon=plan.epsilon, method=plan.method,
                          params=params, trial_id=tid, cache_dir=run.cache_dir,
                          data=self._data, calibration=context.certified)
        audit = audit_settings(context.cfg)
        if audit["in_trial"]:
            audit["budgets"] = self.audit_budgets(plan, spec.method_params)
        config = {"run_dir": str(run.path), "trial_id": tid, "study": plan.name,
                  "series": plan.series, "spec": spec.to_dict(), "audit": audit}
        if private is not None:
            config["tuning"] = {"score_noise": private.plan.score_noise_multiplier}
        if self._board is not None:
            config["pruning"] = {"actor": self._board, "study": plan.name,
                                 "rungs": list(self._rungs)}
        return config

    def start_board(self, tallies: dict[str, Tally]) -> None:
        """With ``sweep.pruner = 'asha'``: the sweep's rung board, seeded with the decisions
        finished and pruned trials took before a restart (from their records)."""
        cfg, run = self._context.cfg, self._context.run
        if cfg.sweep.pruner != "asha":
            return
        name = f"{ACTOR_PREFIX}{uuid.uuid4().hex[:BOARD_ID_HEX]}"
        board = start_board(name=name, factor=cfg.sweep.pruner_factor)
        seeds = []
        for plan in self._context.plans:
            tally = tallies[plan.name]
            for tid in sorted(tally.done | tally.pruned):
                history = run.trial_dir(tid) / layout.HISTORY
                if not history.is_file():
                    continue
                epochs = {int(m["epoch"]): float(m["val_accuracy"])
                          for m in read_json(history)}
                last = max(epochs, default=0)
                for rung in self._rungs:
                    if rung in epochs:
                        seeds.append(board.seed.remote(plan.name, tid, rung, epochs[rung],
                                                       rung < last or tid in tally.done))
        ray.get(seeds)
        self._board, self._board_handle = name, board


class SweepSearch:
    """The studies and the Tune experiment of one sweep."""

    def __init__(self, *, context: SweepContext, configs: TrialConfigs, records: SweepRecords,
                 progress: SweepProgress, retry_failed: bool,
                 baseline: Callable[[], Job | None],
                 baseline_done: Callable[[Job, str], None]) -> None:
        """``retry_failed``: ``resume --retry-failed`` (failed trials are trained again);
        ``baseline``: the non-private baseline's job to run inside the search, if any;
        ``baseline_done(job, error)``: it ended (error "" when it finished)."""
        self._context = context
        self._configs = configs
        self._records = records
        self._progress = progress
        self._retry_failed = retry_failed
        self._baseline = baseline
        self._baseline_done = baseline_done

    def tune(self, studies: dict[str, optuna.Study], tallies: dict[str, Tally],
             flag: _StopFlag) -> int:
        """Every trial still to run, in one Tune experiment (with the baseline as a job);
        how many trials it set out to run."""
        # Deferred: Ray Tune reads its switches (``driver.TUNE_QUIET_ENV``, Ray Train's V2 flag
        # among them) when it is imported, which must follow ``driver._quiet_libraries``.
        from dpsweep.orchestrator.sweep import raytune

        context = self._context
        to_run = sum(tallies[p.name].remaining(p.n_trials) for p in context.plans)
        if to_run == 0:
            return 0
        self._configs.start_board(tallies)
        baseline = self._baseline()
        jobs = {} if baseline is None else {baseline.name: {
            raytune.JOB_KEY: baseline.kind.value, "kwargs": baseline.kwargs}}

        def job_done(name: str, result: dict | None) -> None:
            assert baseline is not None and name == baseline.name
            self._baseline_done(baseline, "its worker stopped" if result is None
                                else str(result.get(raytune.JOB_ERROR, "")))

        searcher = raytune.SweepSearcher(
            plans=list(context.plans), studies=studies, tallies=tallies,
            make_config=self._configs.config, on_outcome=self._records.record,
            trials_root=context.run.path / layout.TRIALS, jobs=jobs, on_job_done=job_done,
            on_phase=self._progress.phase)
        tuner = raytune.make_tuner(
            searcher, flag, cfg=context.cfg, tune_dir=context.run.tune_dir,
            data=data_pool(context.setup),
            samples=SAMPLES_PER_TRIAL * to_run + len(jobs) + SPARE_SAMPLES)
        self._fit(tuner, searcher, flag, total=to_run)
        return to_run

    def _fit(self, tuner: Tuner, searcher: SweepSearcher, flag: _StopFlag, *,
             total: int) -> None:
        """Run the experiment under a progress bar; a signal or the searcher's halt (a full
        disk) stops the running trials and is raised once Tune has returned."""
        with progress(total=total, desc="trials", quiet=self._progress.quiet,
                      live=True) as bar:
            try:
                with self._progress.showing(bar, counts_records=True, total=total,
                                            jobs=Counter(searcher.job_kinds())):
                    flag.in_tune = True
                    try:
                        tuner.fit()
                    except Exception:
                        if searcher.halt is None:
                            raise  # (Tune's own error on a full disk: the disk is the reason)
                    finally:
                        flag.in_tune = False
            finally:
                self._stop_running(searcher, flag)
        if flag.event.is_set():
            raise Interrupted(flag.signum or signal.SIGINT)
        if searcher.halt is not None:
            raise searcher.halt

    def _stop_running(self, searcher: SweepSearcher, flag: _StopFlag) -> None:
        """After a signal or a halt: the trials still running are told they were stopped."""
        reason = (f"interrupted by {signal.Signals(flag.signum).name}"
                  if flag.event.is_set() and flag.signum
                  else f"stopped: {searcher.halt}" if searcher.halt is not None
                  else "")
        if reason:
            stopped = searcher.interrupt(reason)
            if stopped and not self._progress.quiet and searcher.halt is None:
                print(f"stopped {len(stopped)} running trial(s): {', '.join(stopped)}",
                      file=sys.stderr)

    def open_studies(self) -> tuple[dict[str, optuna.Study], dict[str, Tally]]:
        """Each plan's Optuna study opened, and reconciled with the trial directories."""
        context, records = self._context, self._records
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        private_file(context.run.path / layout.OPTUNA_DB)  # SQLite would create it world-readable
        storage = optuna.storages.RDBStorage(context.run.optuna_url)
        studies, tallies = {}, {}
        parallel = context.cfg.sweep.max_concurrent_trials > 1
        for index, plan in enumerate(context.plans):
            study = open_plan_study(context.cfg, plan, index=index, storage=storage,
                                    parallel=parallel)
            tallies[plan.name] = reconcile(
                study, plan, storage=storage, trials_root=context.run.path / layout.TRIALS,
                on_finished=lambda tid, out, _t, plan=plan: records.reconciled(plan, tid, out),
                on_retry=(lambda tid, out: records.retire_failure(tid, out.error))
                if self._retry_failed else None)
            studies[plan.name] = study
        return studies, tallies
