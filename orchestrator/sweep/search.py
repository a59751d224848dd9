"""The search: the Optuna studies opened (or reconciled after a crash), the trial configs Ray Tune
runs, the rung board of the pruner, and the Tune experiment itself.

``SweepSearch`` is the part of the driver (``orchestrator.sweep.driver._Driver``) that runs the
trials: one Ray Tune experiment over every study (``raytune.SweepSearcher`` asks the studies for
points; ``raytune.tune_trainable`` trains one). A stop (a signal polled through
``raytune.InterruptStopper``, or a full disk the searcher met) ends the experiment, tells the
running trials they were interrupted, and is raised once Tune has returned. The non-private
baseline may run inside the experiment as a job, so that it starts before any trial finishes.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import uuid
from typing import TYPE_CHECKING, Any

import optuna
import ray

from core import layout
from core.storage import json_bytes
from orchestrator.accounting.calibration import certify
from orchestrator.audit.membership import reference_budgets
from orchestrator.config import Config
from orchestrator.rundir import private_file
from orchestrator.sweep.jobs import Job
from orchestrator.sweep.progress import progress
from orchestrator.sweep.records import read_json
from orchestrator.sweep.resume_checks import raise_if_disk_full
from orchestrator.sweep.signals import Interrupted, _StopFlag
from orchestrator.sweep.state import SweepState
from orchestrator.sweep.studies import Outcome, StudyPlan, reconcile
from orchestrator.sweep.tuning import draw_counts, open_plan_study, private_tuning_plan
from orchestrator.trial.plan import data_pool, plan_trial
from orchestrator.trial.pruning import ACTOR_PREFIX, start_board

if TYPE_CHECKING:
    from orchestrator.sweep.raytune import SweepSearcher

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


class SweepSearch(SweepState):
    """The studies, the trial configs, the rung board and the Tune experiment of one sweep."""

    def _private_setup(self) -> tuple[Any, dict[str, int]]:
        """The private-tuning plan, printed before any training, and the secret trial counts
        (drawn once; kept in the run directory for a resume, never in a release)."""
        plan = private_tuning_plan(self.setup)
        path = self.run.path / layout.PRIVATE_TUNING
        if path.is_file():
            counts = read_json(self.run.verify(layout.PRIVATE_TUNING))["counts"]
        else:
            counts = draw_counts(self.setup, plan)
            self.run.commit(layout.PRIVATE_TUNING, json_bytes(
                {"counts": counts, "note": "the secret number of trials per series: never "
                                           "exported"}))
        self.certified = certify(schedule=plan.schedule, sample_rate=plan.sample_rate,
                                 delta=plan.delta)
        if not self.quiet:
            print(f"private tuning: end-to-end epsilon {plan.end_to_end_epsilon:.4f} "
                  f"(target {plan.target_epsilon:g}, delta {plan.delta:g}, "
                  f"{plan.end_to_end_accountant}); per trial: sigma "
                  f"{plan.schedule.first:.4f}, epsilon {self.certified.bounds.upper:.4f} "
                  f"(training) / {plan.per_trial_epsilon:.4f} (with the noisy score); "
                  f"expected trials {plan.expected_trials:g} ({plan.distribution})", flush=True)
        return plan, counts

    def trial_epsilon(self, plan: StudyPlan) -> float:
        """A trial's training epsilon, which its audit's references are matched to: the study's
        target, or under private tuning the certified per-trial figure (the target is then the
        end-to-end one)."""
        return plan.epsilon if self.certified is None else self.certified.bounds.upper

    def trial_config(self, plan: StudyPlan, params: dict[str, Any], tid: str) -> dict[str, Any]:
        spec = plan_trial(self.setup, epsilon=plan.epsilon, method=plan.method,
                          params=params, trial_id=tid, cache_dir=self.run.cache_dir,
                          data=self.data, calibration=self.certified)
        audit = audit_settings(self.cfg)
        if audit["in_trial"]:
            audit["budgets"] = reference_budgets(
                self.cfg, method=plan.method, params=spec.method_params,
                epsilon=self.trial_epsilon(plan), data=self.data, cache_dir=self.run.cache_dir)
        config = {"run_dir": str(self.run.path), "trial_id": tid, "study": plan.name,
                  "series": plan.series, "spec": spec.to_dict(), "audit": audit}
        if self.private is not None:
            config["tuning"] = {"score_noise": self.private.score_noise_multiplier}
        if self.board is not None:
            config["pruning"] = {"actor": self.board, "study": plan.name,
                                 "rungs": list(self.rungs)}
        return config

    def start_board(self, tallies: dict[str, Any]) -> None:
        """With ``sweep.pruner = 'asha'``: the sweep's rung board, seeded with the decisions
        finished and pruned trials took before a restart (from their records)."""
        if self.cfg.sweep.pruner != "asha":
            return
        name = f"{ACTOR_PREFIX}{uuid.uuid4().hex[:BOARD_ID_HEX]}"
        board = start_board(name=name, factor=self.cfg.sweep.pruner_factor)
        seeds = []
        for plan in self.plans:
            tally = tallies[plan.name]
            for tid in sorted(tally.done | tally.pruned):
                history = self.run.trial_dir(tid) / layout.HISTORY
                if not history.is_file():
                    continue
                epochs = {int(m["epoch"]): float(m["val_accuracy"])
                          for m in read_json(history)}
                last = max(epochs, default=0)
                for rung in self.rungs:
                    if rung in epochs:
                        seeds.append(board.seed.remote(plan.name, tid, rung, epochs[rung],
                                                       rung < last or tid in tally.done))
        ray.get(seeds)
        self.board, self.board_handle = name, board

    def tune(self, studies: dict[str, Any], tallies: dict[str, Any], flag: _StopFlag) -> None:
        """Every trial still to run, in one Tune experiment (with the baseline as a job)."""
        # Deferred: Ray Tune reads its switches (``driver.TUNE_QUIET_ENV``, Ray Train's V2 flag
        # among them) when it is imported, which must follow ``driver._quiet_libraries``.
        from orchestrator.sweep import raytune

        to_run = sum(t.remaining(p.n_trials) for p, t in
                     ((p, tallies[p.name]) for p in self.plans))
        if to_run == 0:
            return
        self.ran += to_run
        self.start_board(tallies)
        baseline = self.baseline_job()
        jobs = {} if baseline is None else {baseline.name: {
            raytune.JOB_KEY: baseline.kind.value, "kwargs": baseline.kwargs}}

        def job_done(name: str, result: dict | None) -> None:
            assert baseline is not None and name == baseline.name
            self._baseline_done(baseline, error=(
                "its worker stopped" if result is None
                else str(result.get(raytune.JOB_ERROR, ""))))

        searcher = raytune.SweepSearcher(
            plans=self.plans, studies=studies, tallies=tallies, make_config=self.trial_config,
            on_outcome=self.record, trials_root=self.run.path / layout.TRIALS, jobs=jobs,
            on_job_done=job_done)
        tuner = raytune.make_tuner(
            searcher, flag, cfg=self.cfg, tune_dir=self.run.tune_dir, data=data_pool(self.setup),
            samples=SAMPLES_PER_TRIAL * to_run + len(jobs) + SPARE_SAMPLES)
        self._fit(tuner, searcher, flag, total=to_run)

    def _baseline_done(self, baseline: Job, *, error: str) -> None:
        """The baseline job that ran inside the search ended; a full disk stops the sweep
        instead (not the job's failure: it runs again on resume)."""
        raise_if_disk_full(error)
        self.baseline_ran = True
        if error or not self._recover(baseline):
            self._after(baseline, None, error or "it wrote no result.json")

    def _fit(self, tuner: Any, searcher: SweepSearcher, flag: _StopFlag, *,
             total: int) -> None:
        """Run the experiment under a progress bar; a signal or the searcher's halt (a full
        disk) stops the running trials and is raised once Tune has returned."""
        with progress(total=total, desc="trials", quiet=self.quiet) as bar:
            self.bar = bar
            flag.in_tune = True
            try:
                tuner.fit()
            except Exception:
                if searcher.halt is None:
                    raise  # (Tune's own error once the disk is full: the disk is the reason)
            finally:
                flag.in_tune = False
                self.bar, self.bar_counts_records = None, True
                reason = (f"interrupted by {signal.Signals(flag.signum).name}"
                          if flag.event.is_set() and flag.signum
                          else f"stopped: {searcher.halt}" if searcher.halt is not None
                          else "")
                if reason:
                    stopped = searcher.interrupt(reason)
                    if stopped and not self.quiet and searcher.halt is None:
                        print(f"stopped {len(stopped)} running trial(s): {', '.join(stopped)}",
                              file=sys.stderr)
        if flag.event.is_set():
            raise Interrupted(flag.signum or signal.SIGINT)
        if searcher.halt is not None:
            raise searcher.halt

    def open_studies(self) -> tuple[dict[str, Any], dict[str, Any]]:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        private_file(self.run.path / layout.OPTUNA_DB)  # SQLite would create it world-readable
        storage = optuna.storages.RDBStorage(self.run.optuna_url)
        studies, tallies = {}, {}
        parallel = self.cfg.sweep.max_concurrent_trials > 1
        for index, plan in enumerate(self.plans):
            study = open_plan_study(self.cfg, plan, index=index, storage=storage,
                                    parallel=parallel)
            tallies[plan.name] = reconcile(
                study, plan, storage=storage, trials_root=self.run.path / layout.TRIALS,
                on_finished=lambda tid, out, _t, plan=plan: self._reconciled(plan, tid, out),
                on_retry=(lambda tid, out: self.retire_failure(tid, out.error))
                if self.retry_failed else None)
            studies[plan.name] = study
        return studies, tallies

    def _reconciled(self, plan: StudyPlan, tid: str, outcome: Outcome) -> None:
        """A finished trial met by ``reconcile``: recorded, unless its row exists already; then
        only files a crash of an older dpsweep left out of the manifest are added."""
        if tid not in self.rows:
            self.record(plan, tid, outcome)
            return
        listed = self.run.manifest.get("files", {})
        unlisted = [rel for rel in self.run.trial_files(tid) if rel not in listed]
        if unlisted:
            self.run.record(unlisted)
