"""How a sweep is stopped, and what it shows meanwhile.

SIGINT / SIGTERM set a stop flag (``_StopFlag``): while Ray Tune runs, its stopper polls the flag
(``orchestrator.sweep.raytune.InterruptStopper``) so running trials stop within seconds and are
re-enqueued; in every other phase the handler raises :class:`Interrupted` at once. Further
signals while that stop is under way (Ctrl-C pressed twice) are ignored: raised inside Ray's
shutdown they became tracebacks and exit 1 instead of the one line and 130. In the budget
phase that stops the PRV children still computing (``orchestrator.accounting.sandbox``: they
ignore the terminal's SIGINT themselves), so an interrupt is reported as one, never as an
accountant's fallback to RDP. The driver then flushes its state and the command exits 130 / 143
with a hint to resume. Progress bars (tqdm, on
stderr) report the budget precompute, the trials and the after-search jobs; ``--quiet`` turns them
off.

What keeps the run directory whole when files vanish or the disk fills:

* **Before a resume starts anything** (:func:`check_records`): every file the manifest lists is
  there and unchanged, the results store is readable, every file a results row points to exists,
  the Optuna storage is readable and agrees with the trial records
  (``orchestrator.sweep.resume_checks.check_storage``), and every trial it counts as finished
  still has its result record. A deleted trial directory (or storage) would otherwise be
  trained again under a reused id; the resume is refused with one line naming what is missing.
* **A full disk** (``core.errors.DiskFull``, at any write: a trial's records, the results store,
  the manifest, the Optuna storage) stops the sweep as an interrupt does: running trials stop,
  the trial it hit is not recorded as failed but runs again on resume, whatever the driver could
  not write is reconciled then, and the sweep ends with :func:`stopped_by`'s ``DiskFull``, which
  names the run directory (the command prints one line and exits ``EXIT_DISK_FULL``).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from core import layout
from core.errors import DiskFull, disk_full, disk_full_in
from orchestrator.rundir import RESTORE, RunDir
from orchestrator.sweep.resume_checks import check_inputs_first, finished_in_storage

#: Exit codes of a sweep stopped by a signal (128 + signal number, as shells report them).
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class Interrupted(BaseException):
    """The sweep was stopped by a signal; the run directory is consistent and resumable.

    A ``BaseException``, like ``KeyboardInterrupt``: the ``except Exception`` that keeps a
    failing trial's or job's reason must never turn a stop into a failure record."""

    def __init__(self, signum: int, run_dir: Path | None = None) -> None:
        self.signum = signum
        self.run_dir = run_dir
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}")

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT


class _StopFlag:
    """Set by SIGINT/SIGTERM; Tune polls it through a Stopper, other phases raise at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.in_tune = False
        self.repeats = 0  # signals after the first, ignored (the stop is under way)

    def install(self) -> None:
        """(Re)install the handlers: ``ray.init`` replaces SIGTERM's with ``sys.exit(15)``."""
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, self.handler)

    def handler(self, signum: int, _frame: Any) -> None:
        if self.event.is_set():
            # A second signal while the first one stops the sweep: already under way. Raised
            # here it would land inside Ray (a SystemError from CoreWorker.wait, or a traceback
            # from ray.shutdown) and leave the records half-reconciled; the stop goes on.
            self.repeats += 1
            return
        self.signum = signum
        self.event.set()
        if not self.in_tune:
            raise Interrupted(signum)


@contextmanager
def _signals(flag: _StopFlag) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    flag.install()
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _NullBar:
    """What ``progress`` yields with --quiet: a bar that shows nothing."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix_str(self, text: str) -> None:
        del text

    def write(self, text: str) -> None:
        del text


@contextmanager
def progress(*, total: int, desc: str, quiet: bool) -> Iterator[Any]:
    """A progress bar with ETA on stderr (tqdm), or nothing with --quiet."""
    if quiet or total == 0:
        yield _NullBar()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="trial" if desc == "trials" else "it",
               dynamic_ncols=True, file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()


# ---- records that vanish, a disk that fills ---------------------------------------------
def check_records(run: RunDir) -> None:
    """Refuse to resume a run directory whose records are damaged, before anything writes or
    Ray starts: the results store unchanged and readable, the Optuna storage readable
    (``resume_checks.finished_in_storage``; its agreement with the trial records is
    ``resume_checks.check_storage``, last before Ray), then
    ``RunDir.check_resumable`` with the files the rows point to and the trials Optuna counts
    as finished; last the code and data hashes, before the config is validated
    (``resume_checks.check_inputs_first``: validation imports the factories it names)."""
    from reports import store

    listed = run.manifest.get("files", {})
    entry = listed.get(layout.RESULTS)
    if entry is not None and ("sha256" in entry or (run.path / layout.RESULTS).exists()):
        run.verify(layout.RESULTS, hint=RESTORE)  # edited: named as such, not as unreadable
    referenced: dict[str, list[str]] = {}
    for row in store.read_results(run.path, allow_empty=True).to_dict("records"):
        rels = [row["privacy_record"]] if _text(row.get("privacy_record")) else []
        if _text(row.get("checkpoint")):
            rels.append(f"{row['checkpoint']}/{layout.CHECKPOINT_FILE}")
        referenced[str(row["trial_id"])] = rels
    run.check_resumable(referenced=referenced, finished=finished_in_storage(run))
    check_inputs_first(run, run.verify(layout.CONFIG))  # before any code the config names


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def raise_if_disk_full(error: str) -> None:
    """A job's or trial's reason that is a full disk is not its failure: the sweep stops."""
    full = disk_full_in(error) if error else None
    if full is not None:
        raise full


def stopped_by(exc: Exception, run_dir: Path) -> DiskFull | None:
    """The full disk that ended a sweep in ``run_dir``, as the ``DiskFull`` to raise (its
    ``run_dir`` says where to resume), or None when ``exc`` is something else."""
    full = disk_full(exc, database=str(run_dir / layout.OPTUNA_DB))
    if full is not None:
        full.run_dir = run_dir
    return full
