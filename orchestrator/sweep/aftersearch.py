"""What happens after the search: the fronts a release is chosen among, the after-sweep audits,
the re-runs with fresh noise, the non-private baseline, and the recovery of such a job that
finished on disk but not in the results (the driver stopped in between).

``AfterSearchJobs`` is the part of the driver (``orchestrator.sweep.driver._Driver``) that plans
those jobs (``orchestrator.sweep.jobs``) and records what they return (through
``records.SweepRecords``). A job whose reason is a full disk stops the sweep (it runs again on
resume); a signal stops it as during the search: the driver's stop flag is passed to each run.
``dpsweep reaudit`` (``orchestrator.sweep.reaudit``) runs the same audit jobs, recorded the same
way, for trials whose audit failed or is missing (``audit_again``).
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Mapping
from typing import Any

from dpsweep.core import layout
from dpsweep.core.vocabulary import FAILED, OK
from dpsweep.orchestrator.audit.membership import row_audit_columns
from dpsweep.orchestrator.sweep import jobs as postsweep
from dpsweep.orchestrator.sweep.progress import TRIAL
from dpsweep.orchestrator.sweep.records import SweepRecords, read_json
from dpsweep.orchestrator.sweep.resume_checks import raise_if_disk_full
from dpsweep.orchestrator.sweep.search import TrialConfigs, audit_settings
from dpsweep.orchestrator.sweep.signals import Interrupted, _StopFlag
from dpsweep.orchestrator.sweep.state import SweepContext, SweepProgress
from dpsweep.orchestrator.sweep.studies import Outcome, StudyPlan, read_outcome
from dpsweep.orchestrator.sweep.tuning import released_front
from dpsweep.orchestrator.trial.plan import data_pool
from dpsweep.orchestrator.trial.setup import ResolvedSetup
from dpsweep.reports import store
from dpsweep.reports.pareto import wilson_interval

#: What separates a re-run's id from the trial it repeats (``<trial id>-r<k>``).
RERUN_SEPARATOR = "-r"
#: The progress bars' titles of the jobs after the search and of ``dpsweep reaudit``'s.
AFTER_SEARCH = "after the search"
REAUDIT = "re-audit"
#: What ``mia_layers`` holds in a row without an audit (``store.empty_audit``), or an old one.
NO_LAYERS = ("", "[]")


def has_audit(row: dict[str, Any]) -> bool:
    """Whether a results row holds an audit's columns (a failed or missing one holds none)."""
    return isinstance(row.get("mia_layers"), str) and row["mia_layers"] not in NO_LAYERS


def front_ids(rows: Mapping[str, dict[str, Any]], *, setup: ResolvedSetup,
              plans: tuple[StudyPlan, ...]) -> dict[str, list[str]]:
    """Per study, the trials a release would be chosen among: the validation-accuracy
    leader and every trial tied with it within its 95% interval, or the leader alone with
    ``sweep.front = "best"`` (what the after-sweep audit and the re-runs spend on). Under
    private tuning, the released trial alone: the audit then runs after the selection and
    reads no noiseless metric to choose what it audits."""
    cfg = setup.config
    if cfg.sweep.tuning == "private":
        return released_front(list(rows.values()))

    n_val = setup.split_sizes["validation"]
    names = {p.name for p in plans}
    by_study: dict[str, list[dict[str, Any]]] = {}
    for row in rows.values():
        if row["status"] == OK and not row.get("repeat_of") and not row.get("degenerate") \
                and row["study"] in names:
            by_study.setdefault(row["study"], []).append(row)
    out = {}
    for study, candidates in by_study.items():
        best = max(candidates, key=lambda r: r["val_accuracy"])
        if cfg.sweep.front == "best":
            out[study] = [best["trial_id"]]
            continue
        low = wilson_interval(best["val_accuracy"], n=n_val)[0]
        out[study] = sorted(r["trial_id"] for r in candidates
                            if wilson_interval(r["val_accuracy"], n=n_val)[1] >= low)
    return out


class AfterSearchJobs:
    """Fronts, after-sweep audits, re-runs and the baseline of one sweep, and their recovery."""

    def __init__(self, *, context: SweepContext, configs: TrialConfigs, records: SweepRecords,
                 progress: SweepProgress, retry_failed: bool) -> None:
        """``retry_failed``: ``resume --retry-failed`` (failed re-runs are trained again)."""
        self._context = context
        self._configs = configs
        self._records = records
        self._progress = progress
        self._retry_failed = retry_failed
        #: Whether the baseline ran inside the search (then ``post_sweep`` skips it).
        self._baseline_ran = False

    def front_ids(self) -> dict[str, list[str]]:
        """This sweep's fronts (:func:`front_ids`)."""
        return front_ids(self._records.rows, setup=self._context.setup,
                         plans=self._context.plans)

    def _spec_of(self, tid: str) -> dict[str, Any]:
        return read_json(self._context.run.verify(f"trials/{tid}/spec.json"))

    def post_sweep(self, flag: _StopFlag) -> int:
        """After-sweep audits, re-runs with fresh noise and the non-private baseline; how many
        jobs it started."""
        fronts = self.front_ids()
        jobs = self._audit_jobs(fronts) + self._rerun_jobs(fronts)
        baseline = None if self._baseline_ran else self.baseline_job()
        if baseline is not None:
            jobs.append(baseline)
        if jobs:
            self._run_jobs(jobs, flag)
        return len(jobs)

    def audit_scope(self, fronts: dict[str, list[str]] | None = None) -> list[str]:
        """The trials the sweep's membership audit covers: each study's front (``front_ids``,
        or ``fronts`` when given) when it runs after the search with ``audit.scope =
        "front"``, else every finished trial."""
        cfg = self._context.cfg
        if not cfg.audit.in_trial and cfg.audit.scope == "front":
            chosen = self.front_ids() if fronts is None else fronts
            return sorted(t for ids in chosen.values() for t in ids)
        return sorted(t for t, r in self._records.rows.items() if r["status"] == OK)

    def _audit_jobs(self, fronts: dict[str, list[str]]) -> list[postsweep.Job]:
        """The after-sweep audits (``audit.in_trial = false``) of the fronts or of every
        finished trial, less those audited or recovered already."""
        cfg = self._context.cfg
        if not (cfg.audit.enabled and not cfg.audit.in_trial):
            return []
        return self._jobs_to_audit(self.audit_scope(fronts))

    def audit_again(self, todo: list[str], flag: _StopFlag) -> None:
        """``dpsweep reaudit``: the audits of the finished trials ``todo`` run and recorded as
        after the search (one recorded on disk already is taken as it is)."""
        jobs = self._jobs_to_audit(todo)
        if jobs:
            self._run_jobs(jobs, flag, desc=REAUDIT)

    def _jobs_to_audit(self, todo: list[str]) -> list[postsweep.Job]:
        """Audit jobs of the trials ``todo``, less those audited or recovered already."""
        context, rows, jobs = self._context, self._records.rows, []
        settings = audit_settings(context.cfg)
        for tid in todo:
            if has_audit(rows[tid]) or self._recover(postsweep.Job(
                    postsweep.JobKind.AUDIT, tid, postsweep.audit_job, {})):
                continue
            spec = self._spec_of(tid)
            jobs.append(postsweep.Job(postsweep.JobKind.AUDIT, tid, postsweep.audit_job, {
                "trial_dir": str(context.run.trial_dir(tid)), "spec": spec,
                "settings": settings,
                "budgets": self._configs.audit_budgets(context.plan_named(rows[tid]["study"]),
                                                       spec["method_params"])}))
        return jobs

    def _rerun_jobs(self, fronts: dict[str, list[str]]) -> list[postsweep.Job]:
        """``sweep.seeds`` re-runs of every front trial with fresh noise, less those recorded
        (failed ones too, unless ``resume --retry-failed``) or recovered already."""
        cfg = self._context.cfg
        in_trial = audit_settings(cfg)["in_trial"]
        jobs = []
        for study, ids in fronts.items():
            for tid in ids:
                for k in range(1, cfg.sweep.seeds + 1):
                    rid = f"{tid}{RERUN_SEPARATOR}{k}"
                    row = self._records.rows.get(rid)
                    if not postsweep.rerun_pending(row, retry_failed=self._retry_failed) \
                            or self._recover(postsweep.Job(
                            postsweep.JobKind.RERUN, rid, postsweep.rerun_job, {})):
                        continue
                    if row is not None:  # failed: trained again, its failure kept on record
                        self._records.retire_failure(rid, str(row.get("error") or ""))
                    spec = self._spec_of(tid)
                    config = self._configs.config(self._context.plan_named(study),
                                                  spec["method_params"], rid)
                    config["spec"]["seed"] = int(spec["seed"]) + k
                    config["audit"]["in_trial"] = in_trial
                    jobs.append(postsweep.Job(postsweep.JobKind.RERUN, rid, postsweep.rerun_job,
                                              {"config": config}))
        return jobs

    def _run_jobs(self, jobs: list[postsweep.Job], flag: _StopFlag, *,
                  desc: str = AFTER_SEARCH) -> None:
        """The jobs on Ray under a progress bar showing each running one's phases (a re-run's
        ETA, before one has finished, a trial's); each result recorded as it comes."""
        context = self._context
        cfg = context.cfg
        with self._progress.bar(total=len(jobs), desc=desc, counts_records=False,
                                jobs=Counter(job.kind.value for job in jobs),
                                like={postsweep.JobKind.RERUN.value: TRIAL}) as bar:

            def phase(job: postsweep.Job, report: dict[str, Any] | None) -> None:
                self._progress.phase(job.name, report, kind=job.kind.value)

            def done(job: postsweep.Job, result: dict[str, Any] | None, error: str) -> None:
                raise_if_disk_full(error)  # the sweep stops; the job runs again on resume
                self._after(job, result, error)
                bar.update(1)

            flag.in_tune = True  # a signal inside ray.wait is deferred and polled, not raised

            def stop() -> None:
                if flag.event.is_set():
                    raise Interrupted(flag.signum or signal.SIGINT)

            try:
                postsweep.run_jobs(jobs, cpus=cfg.resources.cpus_per_trial,
                                   data=data_pool(context.setup),
                                   gpus=cfg.resources.gpus_per_trial,
                                   concurrency=cfg.sweep.max_concurrent_trials, on_done=done,
                                   stop=stop, on_phase=phase)
            finally:
                flag.in_tune = False

    def baseline_job(self) -> postsweep.Job | None:
        """The non-private baseline's job, or None: off, already recorded, or finished on disk
        (then recorded now). Its spec is a trial's (model, data, epochs, batch size, seed) built
        from the first study's first point, so it can start before any trial finishes."""
        cfg = self._context.cfg
        if not cfg.sweep.baseline or postsweep.BASELINE_ID in self._records.rows \
                or self._recover(postsweep.Job(postsweep.JobKind.BASELINE,
                                               postsweep.BASELINE_ID, postsweep.baseline_job,
                                               {})):
            return None
        plan = next((p for p in self._context.plans if p.n_trials), None)
        if plan is None:
            return None
        config = self._configs.config(plan, plan.space.decode(plan.space.first_point),
                                      postsweep.BASELINE_ID)
        return postsweep.Job(postsweep.JobKind.BASELINE, postsweep.BASELINE_ID,
                             postsweep.baseline_job, {
            "run_dir": str(self._context.run.path), "spec": config["spec"],
            "settings": audit_settings(cfg), "audit": cfg.audit.enabled,
            "lr": cfg.sweep.baseline_lr})

    def baseline_done(self, baseline: postsweep.Job, error: str) -> None:
        """The baseline job that ran inside the search ended; a full disk stops the sweep
        instead (not the job's failure: it runs again on resume)."""
        raise_if_disk_full(error)
        self._baseline_ran = True
        if error or not self._recover(baseline):
            self._after(baseline, None, error or "it wrote no result.json")

    def _recover(self, job: postsweep.Job) -> bool:
        """Record an after-search job that finished on disk but not in the results (the driver
        stopped in between), instead of running it again; True when there was one."""
        trial_dir = self._context.run.trial_dir(job.trial_id)
        if job.kind is postsweep.JobKind.AUDIT:
            path = trial_dir / layout.AUDIT
            if not path.is_file():
                return False
            try:
                record = read_json(path)
            except (OSError, ValueError):
                return False
        else:
            outcome = read_outcome(trial_dir)
            if outcome.status != OK:
                return False
            record = outcome.metrics
        self._after(job, record, "")
        return True

    def _after(self, job: postsweep.Job, result: dict[str, Any] | None, error: str) -> None:
        """A job's result (or its failure) in the results: an audit's columns on its trial's
        row, a re-run's own row, the baseline's row."""
        tid = job.trial_id
        line = f"[{job.name}] " + ("FAILED: " + error if error else "done")
        records, context = self._records, self._context
        if job.kind is postsweep.JobKind.AUDIT:
            columns = (row_audit_columns(result, row=records.rows[tid]) if result is not None
                       else store.empty_audit())
            records.amend(tid, {**columns, "audit_error": error if result is None else ""})
        elif job.kind is postsweep.JobKind.RERUN:
            base = tid.rsplit(RERUN_SEPARATOR, 1)[0]
            plan = context.plan_named(records.rows[base]["study"])
            outcome = Outcome(OK, result, "") if result is not None else Outcome(
                FAILED, {}, error)
            records.record(plan, tid, outcome)
            records.amend(tid, {"repeat_of": base})
        elif job.kind is postsweep.JobKind.BASELINE and result is not None:
            row = postsweep.baseline_row(result, num_classes=context.setup.num_classes)
            audit_file = context.run.trial_dir(postsweep.BASELINE_ID) / layout.AUDIT
            if audit_file.is_file():
                row.update(row_audit_columns(read_json(audit_file), row=row))
            records.add(postsweep.BASELINE_ID, row)
        self._progress.job_line(line)
