"""What keeps a sweep's run directory whole when files vanish or the disk fills (issue 26).

* **Before a resume starts anything** (:func:`check_records`): every file the manifest lists is
  there and unchanged, the results store is readable, every file a results row points to exists,
  and every trial the Optuna storage counts as finished still has its result record. A deleted
  trial directory used to be trained again under a new id while its row still claimed the old
  one; now the resume is refused with one line naming what is missing.
* **A full disk** (``core.errors.DiskFull``, at any write: a trial's records, the results store,
  the manifest, the Optuna storage) stops the sweep as an interrupt does: running trials stop,
  the trial it hit is not recorded as failed but runs again on resume, whatever the driver could
  not write is reconciled then, and the sweep ends with :func:`stopped_by`'s ``DiskFull``, which
  names the run directory (the command prints one line and exits ``EXIT_DISK_FULL``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core import layout
from core.errors import DiskFull, disk_full, disk_full_in
from orchestrator.rundir import RESTORE, RunDir
from orchestrator.sweep.studies import finished_trial_ids


def check_records(run: RunDir) -> None:
    """Refuse to resume a run directory whose records are damaged, before anything writes or
    Ray starts: the results store unchanged and readable, then ``RunDir.check_resumable``
    with the files its rows point to and the trials Optuna counts as finished."""
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
    run.check_resumable(referenced=referenced,
                        finished=finished_trial_ids(run.path / layout.OPTUNA_DB))


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
