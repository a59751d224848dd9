"""The sweep: Ray Tune runs the trials, Optuna picks their hyperparameters, all at matched budgets.

``run_sweep`` validates everything before Ray starts (config, resources, ``--out``, data), then
creates the run directory (``orchestrator.rundir``: manifest, exclusive lock), calibrates every
budget the search can ask for (``plans.precompute``), and runs one Ray Tune experiment over all
studies (``studies``: one Optuna study per series and target epsilon; ``raytune``: the searcher
and the trainable). Objectives: with the audit inside the trial (default), validation accuracy
(max) and peak MIA accuracy (min); else validation accuracy alone, the audit afterwards. Test
accuracy is recorded, never used to choose. No ASHA or other early stopping: a stopped trial
would enter the front as if complete.

Signals (``signals``): SIGINT / SIGTERM stop running trials within seconds (told FAIL,
``interrupted``, and re-enqueued), flush state and exit 130 / 143 with a hint to resume.
``resume_sweep`` refuses damaged records, a lost Optuna storage and changed inputs before Ray or
user code runs (``resume_checks``), then rebuilds the state from the config, the storage and the
trial directories (``studies.reconcile``): no finished trial trained twice, none lost or RUNNING.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core import layout
from core.errors import UserInputError
from core.layout import RESULTS
from core.records import PrivacyRecord
from core.storage import json_bytes
from orchestrator import config as config_mod
from orchestrator.config import Config
from orchestrator.config.paths import check_address_form
from orchestrator.rundir import RunDir, check_creatable, private_file
from orchestrator.sweep import ray_start
from orchestrator.sweep.plans import precompute, study_plans
from orchestrator.sweep.resume_checks import check_storage
from orchestrator.sweep.signals import (
    Interrupted,
    _signals,
    _StopFlag,
    check_records,
    progress,
    raise_if_disk_full,
    stopped_by,
)
from orchestrator.sweep.studies import Outcome, StudyPlan, read_outcome, reconcile
from orchestrator.sweep.summary import (
    begin_attempt,
    end_attempt,
    end_if_begun,
    read_attempts,
    summary_bytes,
)
from orchestrator.sweep.tuning import (
    adaptive_summary,
    draw_counts,
    open_plan_study,
    private_tuning_plan,
    recorded_config_text,
    released_front,
)
from orchestrator.trial.plan import data_pool, plan_trial
from orchestrator.trial.pruning import ACTOR_PREFIX, PRUNED, rungs, start_board
from reports import store


@dataclasses.dataclass
class SweepSummary:
    run_dir: Path
    rows: int
    failed: int
    seconds: float
    report: Path | None
    pruned: int = 0


# ---- the driver -----------------------------------------------------------------------------
class _Driver:
    """Driver-side state of one sweep attempt (a run or a resume)."""

    def __init__(self, cfg: Config, run: RunDir, *, quiet: bool, attempts: list[dict[str, Any]],
                 retry_failed: bool = False) -> None:
        self.flag = _StopFlag()
        self.cfg = cfg
        self.run = run
        #: Every attempt at this sweep, this one last (``summary.begin_attempt``).
        self.attempts = attempts
        self.quiet = quiet
        #: ``resume --retry-failed``: failed re-runs are trained again (search trials are not)
        self.retry_failed = retry_failed
        self.private = None
        self.certified = None
        #: Whether the baseline ran inside the search (then the after-search phase skips it,
        #: whether it finished or failed with its reason).
        self.baseline_ran = False
        #: The rung board's actor name (``sweep.pruner = 'asha'``) and the rungs (epochs).
        self.board: str | None = None
        self.board_handle: Any = None  # keeps the actor alive while the sweep runs
        self.rungs = (rungs(epochs=cfg.training.epochs, min_epochs=cfg.sweep.pruner_min_epochs,
                            factor=cfg.sweep.pruner_factor)
                      if cfg.sweep.pruner == "asha" else ())
        counts = None
        if cfg.sweep.tuning == "private":
            self.private, counts = self._private_setup()
        self.plans = study_plans(cfg, counts=counts)
        self.data = cfg.data_splits()
        self.rows: dict[str, dict[str, Any]] = {
            r["trial_id"]: r for r in store.read_results(run.path, allow_empty=True)
            .to_dict("records")}
        self.start = time.time()
        self.best: dict[str, float] = {}
        self.bar: Any = None
        #: Whether a recorded trial advances the bar (not after the search, where the job that
        #: produced it advances it once).
        self.bar_counts_records = True

    def _private_setup(self) -> tuple[Any, dict[str, int]]:
        """The private-tuning plan, printed before any training, and the secret trial counts
        (drawn once; kept in the run directory for a resume, never in a release)."""
        from orchestrator.accounting.calibration import certify

        plan = private_tuning_plan(self.cfg)
        path = self.run.path / layout.PRIVATE_TUNING
        if path.is_file():
            counts = _read_json(self.run.verify(layout.PRIVATE_TUNING))["counts"]
        else:
            counts = draw_counts(self.cfg, plan)
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

    # ---- results --------------------------------------------------------------------------
    def _row(self, plan: StudyPlan, tid: str, outcome: Outcome) -> dict[str, Any]:
        trial_dir = self.run.trial_dir(tid)
        if outcome.status == PRUNED:
            return store.pruned_row(trial_id=tid, method=plan.method, record=outcome.metrics,
                                    spec=_read_json(trial_dir / layout.SPEC), series=plan.series,
                                    study=plan.name, preset=self._preset(tid))
        if outcome.status != "ok":  # the spec may never have been written: the reason stays
            spec_file = trial_dir / layout.SPEC
            spec = _read_json(spec_file) if spec_file.is_file() else None
            return store.failed_row(trial_id=tid, method=plan.method, series=plan.series,
                                    study=plan.name, error=outcome.error, spec=spec)

        spec = _read_json(trial_dir / layout.SPEC)
        history = _read_json(trial_dir / layout.HISTORY)
        privacy = trial_dir / layout.PRIVACY
        row = store.row_from_trial(
            run_dir=self.run.path, trial_dir=trial_dir,
            checkpoint_dir=trial_dir / layout.CHECKPOINT_DIR, spec=spec,
            privacy=PrivacyRecord.from_dict(_read_json(privacy), where=str(privacy)),
            history=history,
            train_seconds=float(outcome.metrics.get("train_seconds", math.nan)),
            num_classes=self.cfg.num_classes, series=plan.series,
            study=plan.name, preset=self._preset(tid))
        audit_file = trial_dir / layout.AUDIT
        if audit_file.is_file():
            from orchestrator.audit.membership import row_audit_columns

            row.update(row_audit_columns(_read_json(audit_file), row=row))
        row["audit_error"] = str(outcome.metrics.get("audit_error", "") or "")
        if outcome.metrics.get("noisy_val_score") is not None:
            row["noisy_val_score"] = float(outcome.metrics["noisy_val_score"])
        if "audit_seconds" in outcome.metrics:
            row["audit_seconds"] = float(outcome.metrics["audit_seconds"])
        return row

    def _preset(self, tid: str) -> str:
        """Adaptive studies start from the paper preset; private ones have no fixed point."""
        return "paper" if tid.endswith("-000") and self.private is None else ""

    def record(self, plan: StudyPlan, tid: str, outcome: Outcome, _ot: Any = None) -> None:
        """One finished or failed trial: its row, its files in the manifest, a progress line."""
        try:
            row = self._row(plan, tid, outcome)
        except Exception as exc:  # a record missing after a crash: the failure stays visible
            from core.errors import describe

            unread = f"records could not be read: {describe(exc)}"
            row = store.failed_row(trial_id=tid, method=plan.method, series=plan.series,
                                   study=plan.name,
                                   error=f"{outcome.error} ({unread})" if outcome.error
                                   else unread)
        self.rows[tid] = row
        self._write(tid)
        self._progress_line(plan, row)

    def _progress_line(self, plan: StudyPlan, row: dict[str, Any]) -> None:
        if self.quiet:
            return
        ok = row["status"] == "ok"
        if ok and not row.get("degenerate"):
            self.best[plan.name] = max(self.best.get(plan.name, -1.0), row["val_accuracy"])
        done = sum(r["status"] == "ok" for r in self.rows.values())
        pruned = sum(r["status"] == PRUNED for r in self.rows.values())
        failed = len(self.rows) - done - pruned
        if row["status"] == PRUNED:
            what = f"pruned at epoch {row['pruned_at']} (val acc {row['val_accuracy']:.3f})"
        else:
            what = (f"val acc {row['val_accuracy']:.3f}" + (
                f", peak MIA {row['peak_mia_accuracy']:.3f}"
                if isinstance(row.get("peak_mia_accuracy"), float)
                and math.isfinite(row["peak_mia_accuracy"]) else "")
                    if ok else f"FAILED: {row['error']}")
        line = (f"[{plan.name}] {row['trial_id']}: {what} | done {done}, "
                + (f"pruned {pruned}, " if pruned else "") + f"failed {failed}, "
                f"best {self.best.get(plan.name, float('nan')):.3f}, "
                f"elapsed {time.time() - self.start:.0f} s")
        if self.bar is not None:
            self.bar.write(line)
            if self.bar_counts_records:
                self.bar.update(1)
        else:
            print(line, flush=True)

    # ---- trials ---------------------------------------------------------------------------
    def trial_epsilon(self, plan: StudyPlan) -> float:
        """A trial's training epsilon, which its audit's references are matched to: the study's
        target, or under private tuning the certified per-trial figure (the target is then the
        end-to-end one)."""
        return plan.epsilon if self.certified is None else self.certified.bounds.upper

    def trial_config(self, plan: StudyPlan, params: dict[str, Any], tid: str) -> dict[str, Any]:
        spec = plan_trial(self.cfg.at_epsilon(plan.epsilon), method=plan.method,
                          params=params, trial_id=tid, cache_dir=self.run.cache_dir,
                          data=self.data, calibration=self.certified)
        audit = audit_settings(self.cfg)
        if audit["in_trial"]:
            from orchestrator.audit.membership import reference_budgets

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
        import uuid

        name = f"{ACTOR_PREFIX}{uuid.uuid4().hex[:12]}"
        board = start_board(name=name, factor=self.cfg.sweep.pruner_factor)
        seeds = []
        for plan in self.plans:
            tally = tallies[plan.name]
            for tid in sorted(tally.done | tally.pruned):
                history = self.run.trial_dir(tid) / layout.HISTORY
                if not history.is_file():
                    continue
                epochs = {int(m["epoch"]): float(m["val_accuracy"])
                          for m in _read_json(history)}
                last = max(epochs, default=0)
                for rung in self.rungs:
                    if rung in epochs:
                        seeds.append(board.seed.remote(plan.name, tid, rung, epochs[rung],
                                                       rung < last or tid in tally.done))
        import ray

        ray.get(seeds)
        self.board, self.board_handle = name, board

    def tune(self, studies: dict[str, Any], tallies: dict[str, Any], flag: _StopFlag) -> None:
        from ray import tune
        from ray.tune.logger import JsonLoggerCallback

        from orchestrator.sweep import raytune

        to_run = sum(t.remaining(p.n_trials) for p, t in
                     ((p, tallies[p.name]) for p in self.plans))
        if to_run == 0:
            return
        self.start_board(tallies)
        baseline = self.baseline_job()
        jobs = {} if baseline is None else {baseline.name: {
            raytune.JOB_KEY: baseline.kind.value, "kwargs": baseline.kwargs}}

        def job_done(name: str, result: dict | None) -> None:
            assert baseline is not None and name == baseline.name
            error = ("its worker stopped" if result is None
                     else str(result.get(raytune.JOB_ERROR, "")))
            raise_if_disk_full(error)  # not the job's failure: it runs again on resume
            self.baseline_ran = True
            if error or not self._recover(baseline):
                self._after(baseline, None, error or "it wrote no result.json")

        searcher = raytune.SweepSearcher(plans=self.plans, studies=studies, tallies=tallies,
                                         make_config=self.trial_config, on_outcome=self.record,
                                         trials_root=self.run.path / layout.TRIALS, jobs=jobs,
                                         on_job_done=job_done)
        attempt = 1 + sum(1 for _ in self.run.tune_dir.glob("attempt-*"))
        resources = {"cpu": self.cfg.resources.cpus_per_trial,
                     "gpu": self.cfg.resources.gpus_per_trial}
        if self.cfg.resources.memory_per_trial_mb:
            resources["memory"] = self.cfg.resources.memory_per_trial_mb * 2**20
        shared = data_pool(self.cfg)
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(raytune.tune_trainable, data=shared),
                                resources),
            tune_config=tune.TuneConfig(
                search_alg=searcher, num_samples=4 * to_run + len(jobs) + 16,
                max_concurrent_trials=self.cfg.sweep.max_concurrent_trials, reuse_actors=True,
                trial_name_creator=_tune_trial_name, trial_dirname_creator=_tune_trial_name),
            run_config=tune.RunConfig(
                name=f"attempt-{attempt}", storage_path=str(self.run.tune_dir), verbose=0,
                progress_reporter=raytune.SilentReporter(), callbacks=[JsonLoggerCallback()],
                stop=raytune.InterruptStopper(flag, halted=lambda: searcher.halt is not None),
                failure_config=tune.FailureConfig(max_failures=0)))
        with progress(total=to_run, desc="trials", quiet=self.quiet) as bar:
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
        import optuna

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
                on_finished=lambda tid, out, _t, plan=plan: self._reconciled(plan, tid, out))
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

    # ---- after the search ---------------------------------------------------------------
    def front_ids(self) -> dict[str, list[str]]:
        """Per study, the trials a release would be chosen among: the validation-accuracy
        leader and every trial tied with it within its 95% interval, or the leader alone with
        ``sweep.front = "best"`` (what the after-sweep audit and the re-runs spend on). Under
        private tuning, the released trial alone: the audit then runs after the selection and
        reads no noiseless metric to choose what it audits."""
        from reports.pareto import wilson_interval

        if self.cfg.sweep.tuning == "private":
            return released_front(list(self.rows.values()))

        n_val = self.cfg.split_sizes()["validation"]
        by_study: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows.values():
            if row["status"] == "ok" and not row.get("repeat_of") and not row.get("degenerate") \
                    and row["study"] in {p.name for p in self.plans}:
                by_study.setdefault(row["study"], []).append(row)
        out = {}
        for study, rows in by_study.items():
            best = max(rows, key=lambda r: r["val_accuracy"])
            if self.cfg.sweep.front == "best":
                out[study] = [best["trial_id"]]
                continue
            low = wilson_interval(best["val_accuracy"], n=n_val)[0]
            out[study] = sorted(r["trial_id"] for r in rows
                                if wilson_interval(r["val_accuracy"], n=n_val)[1] >= low)
        return out

    def _spec_of(self, tid: str) -> dict[str, Any]:
        return _read_json(self.run.verify(f"trials/{tid}/spec.json"))

    def post_sweep(self) -> None:
        """After-sweep audits, re-runs with fresh noise and the non-private baseline."""
        from orchestrator.audit.membership import reference_budgets
        from orchestrator.sweep import jobs as postsweep

        cfg, jobs = self.cfg, []
        plans = {p.name: p for p in self.plans}
        fronts = self.front_ids()
        settings = audit_settings(cfg)
        if cfg.audit.enabled and not cfg.audit.in_trial:
            todo = (sorted(t for ids in fronts.values() for t in ids) if cfg.audit.scope == "front"
                    else sorted(t for t, r in self.rows.items() if r["status"] == "ok"))
            for tid in todo:
                if isinstance(self.rows[tid].get("mia_layers"), str) and \
                        self.rows[tid]["mia_layers"] not in ("", "[]"):
                    continue
                if self._recover(postsweep.Job(postsweep.JobKind.AUDIT, tid,
                                               postsweep.audit_job, {})):
                    continue
                spec = self._spec_of(tid)
                plan = plans[self.rows[tid]["study"]]
                jobs.append(postsweep.Job(postsweep.JobKind.AUDIT, tid, postsweep.audit_job, {
                    "trial_dir": str(self.run.trial_dir(tid)), "spec": spec,
                    "settings": settings,
                    "budgets": reference_budgets(cfg, method=plan.method,
                                                 params=spec["method_params"],
                                                 epsilon=self.trial_epsilon(plan),
                                                 data=self.data,
                                                 cache_dir=self.run.cache_dir)}))
        for study, ids in fronts.items():
            for tid in ids:
                for k in range(1, cfg.sweep.seeds + 1):
                    rid = f"{tid}-r{k}"
                    if not postsweep.rerun_pending(self.rows.get(rid),
                                                   retry_failed=self.retry_failed) \
                            or self._recover(postsweep.Job(
                            postsweep.JobKind.RERUN, rid, postsweep.rerun_job, {})):
                        continue
                    spec = self._spec_of(tid)
                    config = self.trial_config(plans[study], spec["method_params"], rid)
                    config["spec"]["seed"] = int(spec["seed"]) + k
                    config["audit"]["in_trial"] = settings["in_trial"]
                    jobs.append(postsweep.Job(postsweep.JobKind.RERUN, rid, postsweep.rerun_job,
                                              {"config": config}))
        baseline = None if self.baseline_ran else self.baseline_job()
        if baseline is not None:
            jobs.append(baseline)
        if not jobs:
            return
        with progress(total=len(jobs), desc="after the search",
                       quiet=self.quiet) as bar:
            self.bar, self.bar_counts_records = bar, False

            def done(job: Any, result: dict[str, Any] | None, error: str) -> None:
                raise_if_disk_full(error)  # the sweep stops; the job runs again on resume
                self._after(job, result, error)
                bar.update(1)

            flag = self.flag
            flag.in_tune = True  # a signal inside ray.wait is deferred and polled, not raised

            def stop() -> None:
                if flag.event.is_set():
                    raise Interrupted(flag.signum or signal.SIGINT)

            try:
                postsweep.run_jobs(jobs, cpus=cfg.resources.cpus_per_trial, data=data_pool(cfg),
                                   gpus=cfg.resources.gpus_per_trial,
                                   concurrency=cfg.sweep.max_concurrent_trials, on_done=done,
                                   stop=stop)
            finally:
                flag.in_tune = False
                self.bar = None

    def baseline_job(self) -> Any:
        """The non-private baseline's job, or None: off, already recorded, or finished on disk
        (then recorded now). Its spec is a trial's (model, data, epochs, batch size, seed) built
        from the first study's first point, so it can start before any trial finishes."""
        from orchestrator.sweep import jobs as postsweep

        if not self.cfg.sweep.baseline or postsweep.BASELINE_ID in self.rows or self._recover(
                postsweep.Job(postsweep.JobKind.BASELINE, postsweep.BASELINE_ID,
                              postsweep.baseline_job, {})):
            return None
        plan = next((p for p in self.plans if p.n_trials), None)
        if plan is None:
            return None
        config = self.trial_config(plan, plan.space.decode(plan.space.first_point),
                                   postsweep.BASELINE_ID)
        return postsweep.Job(postsweep.JobKind.BASELINE, postsweep.BASELINE_ID,
                             postsweep.baseline_job, {
            "run_dir": str(self.run.path), "spec": config["spec"],
            "settings": audit_settings(self.cfg), "audit": self.cfg.audit.enabled,
            "lr": self.cfg.sweep.baseline_lr})

    def _recover(self, job: Any) -> bool:
        """Record an after-search job that finished on disk but not in the results (the driver
        stopped in between), instead of running it again; True when there was one."""
        from orchestrator.audit.membership import AUDIT_FILE
        from orchestrator.sweep import jobs as postsweep

        trial_dir = self.run.trial_dir(job.trial_id)
        if job.kind is postsweep.JobKind.AUDIT:
            path = trial_dir / AUDIT_FILE
            if not path.is_file():
                return False
            try:
                record = _read_json(path)
            except (OSError, ValueError):
                return False
        else:
            outcome = read_outcome(trial_dir)
            if outcome.status != "ok":
                return False
            record = outcome.metrics
        self._after(job, record, "")
        return True

    def _after(self, job: Any, result: dict[str, Any] | None, error: str) -> None:
        from orchestrator.audit.membership import AUDIT_FILE, row_audit_columns
        from orchestrator.sweep import jobs as postsweep

        tid = job.trial_id
        line = f"[{job.name}] " + ("FAILED: " + error if error else "done")
        if job.kind is postsweep.JobKind.AUDIT:
            row = self.rows[tid]
            if result is not None:
                row.update(row_audit_columns(result, row=row))
                row["audit_error"] = ""
            else:
                row.update(store.empty_audit())
                row["audit_error"] = error
            self._write(tid)
        elif job.kind is postsweep.JobKind.RERUN:
            base = tid.rsplit("-r", 1)[0]
            plan = next(p for p in self.plans if p.name == self.rows[base]["study"])
            outcome = Outcome("ok", result, "") if result is not None else Outcome(
                "failed", {}, error)
            self.record(plan, tid, outcome)
            self.rows[tid]["repeat_of"] = base
            self._write(tid)
        elif job.kind is postsweep.JobKind.BASELINE and result is not None:
            row = postsweep.baseline_row(result, num_classes=self.cfg.num_classes)
            audit_file = self.run.trial_dir(postsweep.BASELINE_ID) / AUDIT_FILE
            if audit_file.is_file():
                row.update(row_audit_columns(_read_json(audit_file), row=row))
            self.rows[postsweep.BASELINE_ID] = row
            self._write(postsweep.BASELINE_ID)
        if not self.quiet and self.bar is not None:
            self.bar.write(line)

    def _write(self, tid: str) -> None:
        """The results store with ``tid``'s row, and the trial's files, recorded as one step
        (``RunDir.commit``): after a crash or a full disk, a row never lacks its files."""
        self.run.commit(RESULTS, store.results_bytes(list(self.rows.values())),
                        also=self.run.trial_files(tid))

    def write_summary(self) -> None:
        """The attempt's end, then summary.json over every attempt."""
        tuning = (adaptive_summary(self.cfg, self.plans, list(self.rows.values()))
                  if self.private is None else {"mode": "private", **self.private.to_dict()})
        end_attempt(self.run, self.attempts, ended="finished")
        self.run.commit(layout.SUMMARY, summary_bytes(attempts=self.attempts, cfg=self.cfg,
                                                      tuning=tuning))

    def finish(self) -> SweepSummary:
        self.post_sweep()
        self.write_summary()
        frame = store.read_results(self.run.path, allow_empty=True)
        report = None
        if len(frame):
            from reports.html import build_report
            from trainables.methods import prepared_params

            report = build_report(self.run.path, prepared=prepared_params())
        status = frame["status"] if len(frame) else None
        pruned = int((status == PRUNED).sum()) if status is not None else 0
        summary = SweepSummary(run_dir=self.run.path, rows=len(frame),
                               failed=int((status == "failed").sum()) if status is not None
                               else 0, seconds=time.time() - self.start, report=report,
                               pruned=pruned)
        if not self.quiet:
            print(f"sweep finished: {summary.rows} trials ({summary.failed} failed"
                  + (f", {pruned} pruned" if pruned else "")
                  + f") in {summary.seconds:.0f} s", flush=True)
        if report is not None:
            print(f"report: {report}", flush=True)
        return summary


def audit_settings(cfg: Config) -> dict[str, Any]:
    settings = {f.name: getattr(cfg.audit, f.name) for f in dataclasses.fields(cfg.audit)}
    settings["in_trial"] = cfg.audit.enabled and cfg.audit.in_trial
    return settings


def _tune_trial_name(trial: Any) -> str:
    """Tune's own name and directory for a trial: its id (the default spells out the config)."""
    return str(trial.trial_id)


def _read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def _validate_before_ray(cfg: Config, *, out: Path | None, address: str | None) -> None:
    """Everything that can be checked without Ray: resources, --out, data, search spaces, the
    cluster's address (probed) or a temp dir for a local Ray."""
    from orchestrator.cluster import check_address, check_resources, code_runtime_env
    from orchestrator.raytemp import check_temp_dir

    if out is not None:
        check_creatable(out)
    if cfg.model.code_dir:  # where the user's code must be for the workers to import it
        code_runtime_env(cfg.model.code_dir, skip=[])
    check_resources(cpus_per_trial=cfg.resources.cpus_per_trial,
                    gpus_per_trial=cfg.resources.gpus_per_trial,
                    memory_per_trial_mb=cfg.resources.memory_per_trial_mb or None,
                    max_concurrent=cfg.sweep.max_concurrent_trials, info=None)
    data = cfg.data_splits()
    if cfg.audit.enabled:
        from orchestrator.audit.membership import AuditSettings, check_settings

        check_settings(data, AuditSettings.from_config(cfg.audit))
    study_plans(cfg)
    if cfg.sweep.tuning == "private":  # a target the plan cannot reach: refused before Ray
        private_tuning_plan(cfg)
    if address:
        with ray_start.native_stderr():  # Ray's C++ warnings (a wrong token): to the log
            check_address(address)
    else:
        check_temp_dir()


#: Ray Tune's own tables, banners and per-checkpoint chatter would drown the progress lines;
#: the results live in the run directory, not in Tune's output. Tune's automatic result
#: loggers are off: its CSV and TensorBoard files per trial are read by nothing, and writing
#: them took the driver's CPU from the trials it shares two cores with. The JSON one is kept
#: (``tune`` passes it): Tune's own result grid reads it at the end of ``fit`` and warns about
#: every trial without it.
TUNE_QUIET_ENV = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_STRICT_METRIC_CHECKING": "1",
                  "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "0",
                  "RAY_TRAIN_V2_ENABLED": "0", "TUNE_DISABLE_SIGINT_HANDLER": "1",
                  "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",
                  # a dead worker's traceback: the trial's failure is recorded with its reason
                  "TUNE_PRINT_ALL_TRIAL_ERRORS": "0"}


#: Ray's loggers of Tune's experiment-state copies (Ray 2.60).
TUNE_STATE_LOGGERS = ("ray.tune.execution.experiment_state", "ray.train._internal.syncer")


def _quiet_libraries() -> None:
    import warnings

    import optuna

    for key, value in TUNE_QUIET_ENV.items():
        os.environ.setdefault(key, value)
    import logging

    # dp_accounting's RDP series report orders they drop at tiny noise; the bound stays valid
    logging.getLogger("absl").setLevel(logging.ERROR)
    # Tune copying its own experiment state into tune/ (never read back: the state is rebuilt
    # from Optuna and the records) says nothing about the sweep when it fails; on a full disk
    # its tracebacks buried the one line that does (orchestrator.sweep.signals).
    for name in TUNE_STATE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _drive(cfg: Config, run: RunDir, *, address: str | None, quiet: bool,
           attempts: list[dict[str, Any]], command: str,
           retry_failed: bool = False) -> SweepSummary:
    from orchestrator import cluster

    _quiet_libraries()
    flag = _StopFlag()
    with _signals(flag):
        try:
            env = (cluster.code_runtime_env(cfg.model.code_dir, skip=[run.path])
                   if cfg.model.code_dir else None)
            info = ray_start.start_ray(address=address, quiet=quiet, runtime_env=env)
            flag.install()
            if address:
                cluster.check_resources(cpus_per_trial=cfg.resources.cpus_per_trial,
                                        gpus_per_trial=cfg.resources.gpus_per_trial,
                                        memory_per_trial_mb=(
                                            cfg.resources.memory_per_trial_mb or None),
                                        max_concurrent=cfg.sweep.max_concurrent_trials,
                                        info=info)
            cluster.check_storage(run.path)
            begin_attempt(run, attempts, command=command)  # every check passed: it starts
            driver = _Driver(cfg, run, quiet=quiet, attempts=attempts,
                             retry_failed=retry_failed)
            driver.flag = flag
            studies, tallies = driver.open_studies()
            precompute(cfg, run=run, plans=[p for p in driver.plans if p.n_trials],
                       data=driver.data, quiet=quiet, calibration=driver.certified)
            driver.tune(studies, tallies, flag)
            return driver.finish()
        finally:
            cluster.shutdown()


def run_sweep(cfg: Config, *, run_dir: Path, address: str | None = None,
              quiet: bool = False) -> SweepSummary:
    """A new sweep into a new (or empty) RUN_DIR."""
    address = _address(address)
    _validate_before_ray(cfg, out=Path(run_dir), address=address)
    with ray_start.discarded_if_ray_fails(Path(run_dir)):  # no half-made run left behind
        run = RunDir.create(Path(run_dir), config_text=recorded_config_text(cfg),
                            inputs=cfg.input_fingerprints())
        return _drive_and_release(run, lambda: cfg, address=address, quiet=quiet, command="run")


def resume_sweep(run_dir: Path, *, address: str | None = None, quiet: bool = False,
                 retry_failed: bool = False) -> SweepSummary:
    """Continue an interrupted sweep from its verified state (config + Optuna + records);
    ``retry_failed`` trains failed re-runs again (a failed search trial stays failed: its
    point was chosen and its record is the sampler's)."""
    address = _address(address)
    run = RunDir.open(Path(run_dir), write=True)

    def verified_config() -> Config:
        if run.manifest.get("kind") != "sweep":
            raise UserInputError(field="RUN_DIR", value=str(run_dir),
                                 allowed=f"the run directory of a sweep (this one is a "
                                         f"{run.manifest.get('kind')!r} run: nothing to resume)")
        check_records(run)  # Optuna's storage and the code and data hashes included
        cfg = config_mod.load(run.verify(layout.CONFIG))
        run.check_inputs(cfg.input_fingerprints())
        _validate_before_ray(cfg, out=None, address=address)
        check_storage(run)  # optuna.db agrees with the trial records: nothing trained twice
        if not quiet:
            print(f"resuming {run.path}", flush=True)
        return cfg

    return _drive_and_release(run, verified_config, address=address, quiet=quiet,
                              retry_failed=retry_failed,
                              command="resume --retry-failed" if retry_failed else "resume")


def _address(address: str | None) -> str | None:
    """``--address`` (refused when given empty), else RAY_ADDRESS, else None (a local Ray)."""
    check_address_form(address)
    return address or os.environ.get("RAY_ADDRESS") or None


def _drive_and_release(run: RunDir, config: Callable[[], Config], *, address: str | None,
                       quiet: bool, command: str, retry_failed: bool = False) -> SweepSummary:
    """Drive the sweep in a locked run directory; the lock is released however it ends, and
    an interrupt or a full disk names the directory to resume. The attempt is recorded once
    everything is validated, with how it ended where the process lives to say so."""
    attempts: list[dict[str, Any]] = []
    before = 0
    try:
        cfg = config()
        attempts.extend(read_attempts(run))  # checked before Ray; this one is begun in _drive
        before = len(attempts)
        return _drive(cfg, run, address=address, quiet=quiet, attempts=attempts,
                      command=command, retry_failed=retry_failed)
    except Interrupted as exc:
        exc.run_dir = run.path
        end_if_begun(run, attempts, before=before, ended="interrupted")
        raise
    except Exception as exc:
        end_if_begun(run, attempts, before=before, ended="failed")
        full = stopped_by(exc, run.path)
        if full is None or full is exc:
            raise
        raise full from exc
    finally:
        run.release()


if __name__ == "__main__":  # pragma: no cover
    raise UserInputError(field="module", value="orchestrator.sweep.driver",
                         allowed="the dpsweep command")
