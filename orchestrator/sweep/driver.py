"""The sweep: Ray Tune runs the trials, Optuna picks their hyperparameters, all at matched budgets.

``run_sweep`` validates everything before Ray starts (config, resources, ``--out``, data), then
creates the run directory (``orchestrator.rundir``: manifest, exclusive lock), calibrates every
budget the search can ask for (``plans.precompute``), and runs one Ray Tune experiment over all
studies (``search``; ``studies``: one Optuna study per series and target epsilon; ``raytune``:
the searcher and the trainable). Objectives: with the audit inside the trial (default),
validation accuracy (max) and peak MIA accuracy (min); else validation accuracy alone, the audit
afterwards (``aftersearch``). Test accuracy is recorded, never a basis for choosing. With
``sweep.pruner = "asha"`` weak trials stop at epoch rungs (``orchestrator.trial.pruning``): a
pruned trial is recorded as such and never enters a front, which holds finished trials only.

The driver of one attempt (``_Driver``) builds its parts once, each given what it needs in its
constructor: the fixed facts (``state.SweepContext``) and the progress shown
(``state.SweepProgress``), the records (``records.SweepRecords``: rows, trial records, progress
lines, the summary), the trial configs and the rung board (``search.TrialConfigs``), what runs
after the search (``aftersearch.AfterSearchJobs``) and the search (``search.SweepSearch``). The
stop flag is the driver's, passed to each phase that runs on Ray.

Signals (``signals``): SIGINT / SIGTERM stop running trials within seconds (told FAIL,
``interrupted``, and re-enqueued), flush state and exit 130 / 143 with a hint to resume.
``resume_sweep`` refuses damaged records, a lost Optuna storage and changed inputs before Ray or
user code runs (``resume_checks``), then rebuilds the state from the config, the storage and the
trial directories (``studies.reconcile``): no finished trial trained twice, none lost or RUNNING.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import optuna

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.exits import outcome_code
from dpsweep.core.vocabulary import FAILED, PRUNED
from dpsweep.orchestrator import config as config_mod
from dpsweep.orchestrator.audit.membership import AuditSettings, check_settings
from dpsweep.orchestrator.cluster import connection, storage
from dpsweep.orchestrator.cluster.resources import check_config_resources
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.config.paths import address_of
from dpsweep.orchestrator.door import CheckedSetup, check, require_checked
from dpsweep.orchestrator.raytemp import check_temp_dir
from dpsweep.orchestrator.report import run_report
from dpsweep.orchestrator.rundir import RunDir, check_creatable
from dpsweep.orchestrator.sweep import ray_start
from dpsweep.orchestrator.sweep.aftersearch import AfterSearchJobs
from dpsweep.orchestrator.sweep.plans import precompute, study_plans
from dpsweep.orchestrator.sweep.pooling import pool_audits
from dpsweep.orchestrator.sweep.records import SweepRecords, failed_audits
from dpsweep.orchestrator.sweep.resume_checks import check_records, check_storage, stopped_by
from dpsweep.orchestrator.sweep.search import SweepSearch, TrialConfigs, private_tuning
from dpsweep.orchestrator.sweep.signals import Interrupted, _signals, _StopFlag
from dpsweep.orchestrator.sweep.state import SweepContext, SweepProgress
from dpsweep.orchestrator.sweep.studies import Tally
from dpsweep.orchestrator.sweep.summary import begin_attempt, end_if_begun, read_attempts
from dpsweep.orchestrator.sweep.tuning import private_tuning_plan, recorded_config_text
from dpsweep.orchestrator.trial.pruning import rungs
from dpsweep.orchestrator.trial.setup import ResolvedSetup
from dpsweep.reports import store


@dataclasses.dataclass
class SweepSummary:
    """How a sweep ended: what ``api.run`` / ``api.resume`` return and the CLI's exit code
    (``exit_code``) is made from. The counts are over the whole run, earlier attempts included."""

    run_dir: Path
    #: Results rows (trials, re-runs and the baseline).
    rows: int
    #: Trials that failed in training.
    failed: int
    seconds: float
    report: Path | None
    pruned: int = 0
    #: Finished trials whose membership audit failed: trial id -> the reason (``audit_error``);
    #: ``dpsweep reaudit`` audits them again without training.
    failed_audits: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def audits_failed(self) -> int:
        return len(self.failed_audits)

    @property
    def exit_code(self) -> int:
        """``core.exits.EXIT_FAILURES`` when any trial or audit failed, else 0."""
        return outcome_code(trials_failed=self.failed, audits_failed=self.audits_failed)

    def counts_text(self) -> str:
        """``N trials (F failed, A audits failed, P pruned)``, the parts that are not 0 after
        the failures."""
        audits = self.audits_failed
        return (f"{self.rows} trials ({self.failed} failed"
                + (f", {audits} audit{'' if audits == 1 else 's'} failed" if audits else "")
                + (f", {self.pruned} pruned" if self.pruned else "") + ")")

    def failure_line(self) -> str:
        """What failed, in one line, with where the reasons are and what to do next."""
        parts = [f"{self.failed} of {self.rows} trials failed"] if self.failed else []
        if self.failed_audits:
            tid, reason = min(self.failed_audits.items())
            more = self.audits_failed - 1
            parts.append(f"{self.audits_failed} audit{'' if more == 0 else 's'} failed ({tid}: "
                         f"{reason}" + (f"; {more} more" if more else "") + ")")
        then = (f"; `dpsweep reaudit {self.run_dir}` audits them again without training"
                if self.failed_audits else "")
        return ", ".join(parts) + "; the report lists every reason" + then


class _Driver:
    """One sweep attempt (a run or a resume) or ``dpsweep reaudit``'s audits: its parts,
    built once, and its stop flag (``flag``), passed to each phase that runs on Ray."""

    def __init__(self, setup: ResolvedSetup, run: RunDir, *, quiet: bool,
                 attempts: list[dict[str, Any]], retry_failed: bool = False,
                 flag: _StopFlag | None = None) -> None:
        cfg = setup.config
        self.flag = _StopFlag() if flag is None else flag
        private, counts = (private_tuning(setup, run, quiet=quiet)
                           if cfg.sweep.tuning == "private" else (None, None))
        self.context = SweepContext(setup=setup, run=run, private=private,
                                    plans=tuple(study_plans(setup, counts=counts)))
        #: The data splits every trial plans and audits with.
        self.data = setup.data_splits()
        self.attempts = attempts
        #: Trials and after-search jobs this attempt started (0: nothing was left to run).
        self.ran = 0
        rows = {r["trial_id"]: r for r in store.read_results(run.path, allow_empty=True)
                .to_dict("records")}
        self.progress = SweepProgress(quiet=quiet)  # the attempt's clock starts here
        self.records = SweepRecords(context=self.context, progress=self.progress,
                                    attempts=attempts, rows=rows)
        self.configs = TrialConfigs(
            context=self.context, data=self.data,
            rungs=rungs(epochs=cfg.training.epochs, min_epochs=cfg.sweep.pruner_min_epochs,
                        factor=cfg.sweep.pruner_factor) if cfg.sweep.pruner == "asha" else ())
        self.after = AfterSearchJobs(context=self.context, configs=self.configs,
                                     records=self.records, progress=self.progress,
                                     retry_failed=retry_failed)
        self.search = SweepSearch(context=self.context, configs=self.configs,
                                  records=self.records, progress=self.progress,
                                  retry_failed=retry_failed, baseline=self.after.baseline_job,
                                  baseline_done=self.after.baseline_done)

    @property
    def rows(self) -> Mapping[str, dict[str, Any]]:
        """Trial id -> results row."""
        return self.records.rows

    def audit_scope(self) -> list[str]:
        """The trials the sweep's membership audit covers (``AfterSearchJobs.audit_scope``)."""
        return self.after.audit_scope()

    def audit_again(self, todo: list[str]) -> None:
        """``dpsweep reaudit``'s audits of ``todo``, under the stop flag."""
        self.after.audit_again(todo, self.flag)

    def pool_audits(self) -> int:
        """Every audited trial scored with its study's references (``sweep.pooling``)."""
        return pool_audits(context=self.context, records=self.records, data=self.data,
                           quiet=self.progress.quiet)

    def open_studies(self) -> tuple[dict[str, optuna.Study], dict[str, Tally]]:
        return self.search.open_studies()

    def tune(self, studies: dict[str, optuna.Study], tallies: dict[str, Tally]) -> None:
        self.ran += self.search.tune(studies, tallies, self.flag)

    def finish(self) -> SweepSummary:
        """The after-search jobs, the summary and the report; one line saying how it went."""
        self.ran += self.after.post_sweep(self.flag)
        self.pool_audits()
        self.records.write_summary()
        run = self.context.run
        frame = store.read_results(run.path, allow_empty=True)
        report = None
        if len(frame):
            report = run_report(run.path)
        status = frame["status"] if len(frame) else None
        summary = SweepSummary(
            run_dir=run.path, rows=len(frame),
            failed=int((status == FAILED).sum()) if status is not None else 0,
            pruned=int((status == PRUNED).sum()) if status is not None else 0,
            failed_audits=failed_audits(frame.to_dict("records")),
            seconds=time.time() - self.progress.started, report=report)
        if not self.progress.quiet:
            print(self._finished_line(summary), flush=True)
        if report is not None:
            print(f"report: {report}", flush=True)
        return summary

    def _finished_line(self, summary: SweepSummary) -> str:
        """How the attempt went; a resume that found nothing left to run says so, not how long
        it took to find out."""
        if self.ran == 0 and len(self.attempts) > 1:
            return f"sweep already finished, nothing was run: {summary.counts_text()}"
        return f"sweep finished: {summary.counts_text()} in {summary.seconds:.0f} s"


def check_retry(cfg: Config, *, retry_failed: bool) -> None:
    """``resume --retry-failed`` trains failed trials again only where no bound counts on how
    many trials ran: under private tuning the number of trained models would then depend on
    their outcomes (a failure can depend on the data), which Papernot & Steinke's bound, for a
    secret number of trials drawn before the run, does not cover. A failed trial is one of the
    K drawn there, and it is never selected."""
    if retry_failed and cfg.sweep.tuning == "private":
        raise UserInputError(
            field="--retry-failed", value=True,
            allowed="a plain `dpsweep resume` of a private-tuning sweep (sweep.tuning = "
                    "'private'): training a trial again because it failed makes the number "
                    "of trained models depend on their outcomes, which the end-to-end bound (a "
                    "secret number of trials drawn before the run) does not cover; a failed "
                    "trial stays one of those trials, never selected")


def _validate_before_ray(setup: ResolvedSetup, *, out: Path | None,
                         address: str | None) -> None:
    """Everything that can be checked without Ray: resources, --out, data, search spaces, the
    cluster's address (probed) or a temp dir for a local Ray."""
    cfg = setup.config
    if out is not None:
        check_creatable(out)
    if cfg.model.code_dir:  # where the user's code must be for the workers to import it
        connection.code_runtime_env(cfg.model.code_dir, skip=[])
    if not address:  # a cluster's resources are checked against its nodes once connected
        check_config_resources(cfg.resources, max_concurrent=cfg.sweep.max_concurrent_trials,
                               info=None)
    data = setup.data_splits()
    if cfg.audit.enabled:
        check_settings(data, AuditSettings.from_config(cfg.audit))
    study_plans(setup)
    if cfg.sweep.tuning == "private":  # a target the plan cannot reach: refused before Ray
        private_tuning_plan(setup)
    if address:
        with ray_start.native_stderr():  # Ray's C++ warnings (a wrong token): to the log
            connection.check_address(address)
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
#: Tune's closing complaint about trials that did not end TERMINATED (Ray 2.60): each failed
#: trial is recorded with its reason, and the sweep's one line says how many failed.
TUNE_INCOMPLETE_LOGGER = "ray.tune.tune"
TUNE_INCOMPLETE = "Trials did not complete"


def _not_tunes_incomplete_line(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(TUNE_INCOMPLETE)


def _quiet_libraries() -> None:
    """Tune's switches set before Tune is imported (``search.SweepSearch.tune``), and the
    libraries' chatter that repeats what the sweep records turned down."""
    for key, value in TUNE_QUIET_ENV.items():
        os.environ.setdefault(key, value)
    # dp_accounting's RDP series report orders they drop at tiny noise; the bound stays valid
    logging.getLogger("absl").setLevel(logging.ERROR)
    # Tune copying its own experiment state into tune/ (never read back: the state is rebuilt
    # from Optuna and the records) says nothing about the sweep when it fails; on a full disk
    # its tracebacks buried the one line that does (orchestrator.sweep.resume_checks).
    for name in TUNE_STATE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger(TUNE_INCOMPLETE_LOGGER).addFilter(_not_tunes_incomplete_line)  # once
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@contextlib.contextmanager
def ray_session(setup: ResolvedSetup, run: RunDir, *, address: str | None, quiet: bool,
                flag: _StopFlag) -> Iterator[None]:
    """Ray for one command on ``run`` (a sweep, or ``dpsweep reaudit``): local on loopback or
    the cluster at ``address`` (its resources and shared storage checked), with the user's code
    shipped, under the stop flag's signal handlers; shut down however the command ends."""
    cfg = setup.config
    _quiet_libraries()
    with _signals(flag):
        try:
            env = (connection.code_runtime_env(cfg.model.code_dir, skip=[run.path])
                   if cfg.model.code_dir else None)
            info = ray_start.start_ray(address=address, quiet=quiet, runtime_env=env)
            flag.install()
            if address:
                check_config_resources(cfg.resources,
                                       max_concurrent=cfg.sweep.max_concurrent_trials,
                                       info=info)
            storage.check_storage(run.path)
            yield
        finally:
            connection.shutdown()


def _drive(setup: ResolvedSetup, run: RunDir, *, address: str | None, quiet: bool,
           attempts: list[dict[str, Any]], command: str,
           retry_failed: bool = False) -> SweepSummary:
    flag = _StopFlag()
    with ray_session(setup, run, address=address, quiet=quiet, flag=flag):
        begin_attempt(run, attempts, command=command)  # every check passed: it starts
        driver = _Driver(setup, run, quiet=quiet, attempts=attempts, retry_failed=retry_failed,
                         flag=flag)
        studies, tallies = driver.open_studies()
        precompute(setup, run=run, plans=[p for p in driver.context.plans if p.n_trials],
                   data=driver.data, quiet=quiet, calibration=driver.context.certified)
        driver.tune(studies, tallies)
        return driver.finish()


def run_sweep(setup: CheckedSetup, *, run_dir: Path, address: str | None = None,
              quiet: bool = False) -> SweepSummary:
    """A new sweep into a new (or empty) RUN_DIR; ``setup`` is its config through the door
    (``orchestrator.door.check``), read by the whole sweep."""
    cfg = require_checked(setup, where="run_sweep").config
    address = address_of(address)
    _validate_before_ray(setup, out=Path(run_dir), address=address)
    with ray_start.discarded_if_ray_fails(Path(run_dir)):  # no half-made run left behind
        run = RunDir.create(Path(run_dir), config_text=recorded_config_text(cfg),
                            inputs=setup.input_fingerprints())
        return _drive_and_release(run, lambda: setup, address=address, quiet=quiet,
                                  command="run")


def resume_sweep(run_dir: Path, *, address: str | None = None, quiet: bool = False,
                 retry_failed: bool = False) -> SweepSummary:
    """Continue an interrupted sweep from its verified state (config + Optuna + records);
    ``retry_failed`` trains failed trials (with their exact hyperparameters, in their study,
    under their ids) and failed re-runs again, never a finished or pruned one; refused under
    private tuning (:func:`check_retry`)."""
    address = address_of(address)
    run = RunDir.open(Path(run_dir), write=True)

    def verified_config() -> ResolvedSetup:
        setup = verified_setup(run, run_dir=Path(run_dir), address=address, doing="resume")
        check_retry(setup.config, retry_failed=retry_failed)
        if not quiet:
            print(f"resuming {run.path}", flush=True)
        return setup

    return _drive_and_release(run, verified_config, address=address, quiet=quiet,
                              retry_failed=retry_failed,
                              command="resume --retry-failed" if retry_failed else "resume")


def verified_setup(run: RunDir, *, run_dir: Path, address: str | None,
                   doing: str) -> ResolvedSetup:
    """The sweep in ``run`` (locked) resolved after every check a resume makes before Ray or
    any code the config names runs: a sweep's directory, every file the manifest lists unchanged
    (checkpoints included), the results store, the Optuna storage, the code and data hashes, the
    config, resources, data and the address. ``doing`` names the command in the refusal of a
    run directory that is no sweep's."""
    if run.manifest.get("kind") != "sweep":
        raise UserInputError(field="RUN_DIR", value=str(run_dir),
                             allowed=f"the run directory of a sweep (this one is a "
                                     f"{run.manifest.get('kind')!r} run: nothing to {doing})")
    check_records(run)  # Optuna's storage and the code and data hashes included
    setup = check(config_mod.parse_file(run.verify(layout.CONFIG)), machine=not address)
    run.check_inputs(setup.input_fingerprints())
    _validate_before_ray(setup, out=None, address=address)
    check_storage(run)  # optuna.db agrees with the trial records: nothing trained twice
    return setup


@contextlib.contextmanager
def released(run: RunDir, *, ended: Callable[[str], None] | None = None) -> Iterator[None]:
    """A command's work in the locked ``run`` (a sweep attempt, ``dpsweep reaudit``): the lock
    is released however it ends, and an interrupt or a full disk carries the directory to
    continue in. ``ended("interrupted" | "failed")`` records how it ended first."""
    try:
        yield
    except Interrupted as exc:
        exc.run_dir = run.path
        if ended is not None:
            ended("interrupted")
        raise
    except Exception as exc:
        if ended is not None:
            ended("failed")
        full = stopped_by(exc, run.path)
        if full is None or full is exc:
            raise
        raise full from exc
    finally:
        run.release()


def _drive_and_release(run: RunDir, config: Callable[[], ResolvedSetup], *,
                       address: str | None,
                       quiet: bool, command: str, retry_failed: bool = False) -> SweepSummary:
    """Drive the sweep in a locked run directory (:func:`released`). The attempt is recorded
    once everything is validated, with how it ended where the process lives to say so."""
    attempts: list[dict[str, Any]] = []
    before = 0

    def ended(how: str) -> None:
        end_if_begun(run, attempts, before=before, ended=how)

    with released(run, ended=ended):
        setup = config()
        attempts.extend(read_attempts(run))  # checked before Ray; this one is begun in _drive
        before = len(attempts)
        return _drive(setup, run, address=address, quiet=quiet, attempts=attempts,
                      command=command, retry_failed=retry_failed)


if __name__ == "__main__":  # pragma: no cover
    raise UserInputError(field="module", value="dpsweep.orchestrator.sweep.driver",
                         allowed="the dpsweep command")
