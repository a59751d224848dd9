"""``dpsweep reaudit RUN_DIR``: the per-layer membership audit of a sweep's finished trials run
again from their stored checkpoints, without training them again.

A failed audit (a reference model that diverged, a worker lost, scores that could not be
computed) keeps the trained model, but leaves its trial off every front and out of ``pick``;
without this command the only way back was to train the whole sweep again. The command runs the
audit jobs the sweep runs after its search (``aftersearch.AfterSearchJobs.audit_again``: same
entry, ``orchestrator.audit.membership``, same references and budgets, same Ray resources), and
records each result the way the sweep does (the trial's row in the results store and its files
in the manifest, one atomic commit per trial), then rebuilds the report.

Which trials:

* by default, every finished trial the sweep's audit covers (``audit_scope``: every one with the
  audit in the trial or ``audit.scope = "all"``, each study's front otherwise) whose audit
  failed or is missing, also when the sweep ran with ``audit.enabled = false``;
* ``--trial ID`` (repeatable): those trials, each finished and without an audit;
* ``--all``: every finished trial without an audit, inside the scope or not.

An audit that stands is never run again: a second draw of its reference models could be kept
for looking better, which would make the reported risk a choice. The non-private baseline is
audited within its own job (``resume`` runs a failed one again). Optuna's record of the search
is left as the sampler saw it: a trial whose in-trial audit failed stays FAIL there; fronts,
``pick`` and the report read the results store.

Before anything runs, the run directory is verified as ``resume`` verifies it (every file the
manifest lists, checkpoints included, the results store, the Optuna storage, code and data
hashes): a refusal is one line, exit 2, nothing written. The command holds the run
directory's lock. Ctrl-C stops the audits within a second; each finished one is already
recorded, and running the command again does the rest (an audit written to disk but not yet
recorded is taken, not run again). Then every audited trial is scored again with its study's
references (``sweep.pooling``), as at the end of a sweep: the re-audited trials' references
join the pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.exits import outcome_code
from dpsweep.core.vocabulary import OK
from dpsweep.orchestrator.audit.membership import AuditSettings, check_settings
from dpsweep.orchestrator.config.paths import address_of
from dpsweep.orchestrator.door import CheckedSetup
from dpsweep.orchestrator.report import run_report
from dpsweep.orchestrator.rundir import RunDir, check_trial_id
from dpsweep.orchestrator.sweep.aftersearch import has_audit
from dpsweep.orchestrator.sweep.commands import sweep
from dpsweep.orchestrator.sweep.driver import (
    _Driver,
    ray_session,
    released,
    verified_setup,
)
from dpsweep.orchestrator.sweep.jobs import BASELINE_ID
from dpsweep.orchestrator.sweep.records import failed_audits
from dpsweep.orchestrator.sweep.signals import _StopFlag

#: The command's name, as its refusals and hints spell it.
COMMAND = "reaudit"
#: How many trial ids a refusal lists as examples.
SHOWN_IDS = 5


@dataclasses.dataclass
class ReauditSummary:
    """How a re-audit ended: what ``api.reaudit`` returns and the CLI's exit code is made of."""

    run_dir: Path
    #: The trials whose audit ran (or was recorded from disk), in order.
    audited: list[str]
    #: Those whose audit failed again: trial id -> the reason (``audit_error``).
    failed_audits: dict[str, str]
    seconds: float
    #: The rebuilt report (None when there was nothing to audit: nothing was written).
    report: Path | None

    @property
    def audits_failed(self) -> int:
        return len(self.failed_audits)

    @property
    def exit_code(self) -> int:
        """``core.exits.EXIT_FAILURES`` when an audit failed again, else 0."""
        return outcome_code(trials_failed=0, audits_failed=self.audits_failed)

    def failure_line(self) -> str:
        """What failed again, in one line."""
        tid, reason = min(self.failed_audits.items())
        more = self.audits_failed - 1
        return (f"{self.audits_failed} of {len(self.audited)} audits failed again ({tid}: "
                f"{reason}" + (f"; {more} more" if more else "") + "); the report lists every "
                "reason")


def _refuse(tid: str, why: str) -> UserInputError:
    return UserInputError(field="--trial", value=tid, allowed=why)


def _check_chosen(tid: str, rows: dict[str, dict[str, Any]]) -> None:
    """A trial named with ``--trial`` can be audited again: this run's, a DP trial, finished,
    and without an audit that stands."""
    check_trial_id(tid)
    if tid not in rows:
        shown = ", ".join(sorted(rows)[:SHOWN_IDS]) or "none"
        raise _refuse(tid, f"a trial of this run (its results hold {len(rows)}: {shown}"
                           + (", ..." if len(rows) > SHOWN_IDS else "") + ")")
    row = rows[tid]
    if tid == BASELINE_ID:
        raise _refuse(tid, "a DP trial (the non-private baseline is audited within its own job; "
                           "`dpsweep resume` runs a failed one again)")
    if row["status"] != OK:
        raise _refuse(tid, f"a finished trial (this one is {row['status']}: it has no final "
                           "model to audit)")
    if has_audit(row):
        raise _refuse(tid, f"a trial whose audit failed or is missing (this one's audit stands, "
                           f"peak MIA accuracy {float(row['peak_mia_accuracy']):.4f}: a second "
                           "draw of its references could be kept for looking better)")


def chosen_trials(driver: _Driver, *, trials: Sequence[str], every: bool) -> list[str]:
    """The trials to audit again (module docstring): ``trials`` when given, each checked;
    else those of the audit's scope (``every``: every finished trial) without an audit."""
    rows = driver.rows
    if trials:
        for tid in trials:
            _check_chosen(tid, rows)
        return sorted(set(trials))
    pool = sorted(rows) if every else driver.audit_scope()
    return [t for t in pool if t != BASELINE_ID and rows[t]["status"] == OK
            and not has_audit(rows[t])]


def reaudit_run(run_dir: Path, *, trials: Sequence[str] = (), every: bool = False,
                address: str | None = None, quiet: bool = False) -> ReauditSummary:
    """Audit again the finished trials of the sweep in ``run_dir`` whose audit failed or is
    missing (module docstring); ``trials`` names them, ``every`` takes every finished trial
    without an audit. Holds the run directory's lock; verifies it before anything runs."""
    if trials and every:
        raise UserInputError(field="--all", value=True,
                             allowed="either --trial or --all, not both")
    address = address_of(address)
    run = RunDir.open(Path(run_dir), write=True)
    with released(run):
        setup = verified_setup(run, run_dir=Path(run_dir), address=address, doing=COMMAND)
        if not setup.config.audit.enabled:  # the sweep never checked the audit's splits
            check_settings(setup.data_splits(), AuditSettings.from_config(setup.config.audit))
        return _reaudit(setup, run, trials=trials, every=every, address=address, quiet=quiet)


def _reaudit(setup: CheckedSetup, run: RunDir, *, trials: Sequence[str], every: bool,
             address: str | None, quiet: bool) -> ReauditSummary:
    """Choose the trials (nothing written when there are none), run their audits on Ray,
    rebuild the report."""
    started = time.time()
    flag = _StopFlag()
    driver = _Driver(setup, run, quiet=quiet, attempts=[], flag=flag)
    todo = chosen_trials(driver, trials=trials, every=every)
    if not todo:
        if not quiet:
            print(f"nothing to re-audit in {run.path}: every finished trial "
                  + ("has its audit" if every else "the audit covers has its audit (--all "
                                                   "also takes those outside it)"), flush=True)
        return ReauditSummary(run_dir=run.path, audited=[], failed_audits={},
                              seconds=time.time() - started, report=None)
    if not quiet:
        print(f"re-auditing {len(todo)} trial{'' if len(todo) == 1 else 's'} of {run.path}: "
              + ", ".join(todo), flush=True)
    with ray_session(setup, run, address=address, quiet=quiet, flag=flag):
        driver.audit_again(todo)
    driver.pool_audits()
    report = run_report(run.path)
    summary = ReauditSummary(
        run_dir=run.path, audited=todo, report=report, seconds=time.time() - started,
        failed_audits={t: e for t, e in failed_audits(driver.rows.values()).items()
                       if t in todo})
    if not quiet:
        print(f"reaudit finished: {len(todo)} audited ({summary.audits_failed} failed) in "
              f"{summary.seconds:.0f} s", flush=True)
        if (run.path / layout.PICK).is_file():
            print(f"{layout.PICK} was chosen before this re-audit: run `dpsweep pick "
                  f"{run.path}` again to choose from the new fronts", flush=True)
    print(f"report: {report}", flush=True)
    return summary


def again_hint(args: argparse.Namespace) -> str:
    """The command that continues an interrupted re-audit: the same one."""
    flags = "".join(f" --trial {t}" for t in args.trial or ()) + (" --all" if args.all else "")
    return f"dpsweep {COMMAND} {args.run_dir}{flags}"


def reaudit(args: argparse.Namespace) -> int:
    """``dpsweep reaudit`` as the command line runs it."""
    return sweep(lambda: reaudit_run(Path(args.run_dir), trials=args.trial or (),
                                     every=args.all, address=args.address, quiet=args.quiet),
                 again=lambda _run_dir: again_hint(args))
