"""What keeps a run directory whole when files vanish or the disk fills: what ``resume`` verifies
before it writes anything or imports any code a config names, and how a full disk stops a sweep.

* **Before a resume starts anything** (:func:`check_records`): every file the manifest lists is
  there and unchanged, the results store is readable, every file a results row points to exists,
  the Optuna storage is readable and agrees with the trial records (:func:`check_storage`), and
  every trial it counts as finished still has its result record. A deleted trial directory (or
  storage) would otherwise be trained again under a reused id; the resume is refused with one
  line naming what is missing.

* **The Optuna storage is a record like the others** (:func:`check_storage`, the last check
  before Ray starts, so that a damaged record, changed inputs or a bad address are named
  first; :func:`check_records` reads it earlier, :func:`finished_in_storage`). Not hashed
  (SQLite rewrites it on every trial), so it is checked for what it must be: a readable SQLite
  file that passes SQLite's own integrity check and holds Optuna's tables, and consistent with
  the trial records: every search trial whose directory exists is in it, every trial that
  finished on disk (``trials/<id>/result.json``) is held in a state ``reconcile`` completes
  (never only as a waiting copy), and every trial it counts as finished has its result record
  (``RunDir.check_resumable``). A storage that is missing (once any trial has started), empty,
  truncated, damaged or foreign is refused with one line naming ``optuna.db``; it is not
  rebuilt. Without it the next trial ids and the samplers' history are unknown: a fresh
  storage numbered trials from zero again and trained finished trials a second time. It is
  read from a private copy (a hot journal left by ``kill -9`` is rolled back there, not in the
  run directory), so the check writes nothing.
* **Inputs before code** (:func:`check_inputs_first`): the SHA-256 of the user's code folder
  and data files, recorded in the manifest when the run started, are compared with the files
  the run's ``config.toml`` names *before* the config is validated, since validating a config
  that names a factory imports and calls it. A config edited to name other code is refused
  without running it.
* **A full disk** (``core.errors.DiskFull``, at any write: a trial's records, the results store,
  the manifest, the Optuna storage) stops the sweep as an interrupt does: running trials stop,
  the trial it hit is not recorded as failed but runs again on resume
  (:func:`raise_if_disk_full`), whatever the driver could not write is reconciled then, and the
  sweep ends with :func:`stopped_by`'s ``DiskFull``, which names the run directory (the command
  prints one line and exits ``EXIT_DISK_FULL``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpsweep.core import layout
from dpsweep.core.errors import DiskFull, UserInputError, disk_full, disk_full_in
from dpsweep.core.layout import OPTUNA_DB, RESULT, TRIALS
from dpsweep.orchestrator import config as config_mod
from dpsweep.orchestrator.rundir import RESTORE, RunDir
from dpsweep.orchestrator.sweep.studies import FINISHED_STATES, ID_ATTR
from dpsweep.orchestrator.trial.setup import ResolvedSetup
from dpsweep.reports import store

#: Optuna's tables a resume reads (optuna.storages._rdb.models).
REQUIRED_TABLES = ("studies", "trials", "trial_user_attributes", "trial_values", "version_info")
#: A search trial's id (``StudyPlan.trial_id``: ``<study>-<index>``); re-runs (``<id>-r<k>``)
#: and the baseline (``nonprivate``) are after-search jobs Optuna never held.
_SEARCH_ID = re.compile(r"-\d+$")
#: SQLite's companions of a database file (a rollback journal, a write-ahead log).
_COMPANIONS = ("-journal", "-wal", "-shm")


def _refuse(what: str) -> UserInputError:
    return UserInputError(field="RUN_DIR", value=OPTUNA_DB,
                          allowed=f"the run's Optuna storage ({what}; {RESTORE})")


def search_trials(trials_root: Path) -> dict[str, bool]:
    """Search trials with a directory: id -> whether it finished (has ``result.json``)."""
    if not trials_root.is_dir():
        return {}
    return {d.name: (d / RESULT).is_file() for d in sorted(trials_root.iterdir())
            if d.is_dir() and _SEARCH_ID.search(d.name)}


def storage_states(run: RunDir) -> dict[str, set[str]] | None:
    """Each named trial's states in the run's Optuna storage, or None where it was never
    written (missing or empty); a damaged, truncated or foreign one is refused."""
    db = run.path / OPTUNA_DB
    if db.is_symlink() or (db.exists() and not db.is_file()):
        raise _refuse("a regular file")
    if not db.is_file() or db.stat().st_size == 0:
        return None
    return _trial_states(db)


def finished_in_storage(run: RunDir) -> set[str]:
    """The ids of the trials the storage counts as finished (COMPLETE or PRUNED)."""
    states = storage_states(run) or {}
    return {tid for tid, held in states.items() if held & set(FINISHED_STATES)}


def check_storage(run: RunDir) -> None:
    """Refuse a missing, damaged or inconsistent Optuna storage (see the module docstring).

    Called last before a resume starts Ray (``driver.resume_sweep``): the records, the inputs
    and the address are named first when they are what is wrong."""
    db = run.path / OPTUNA_DB
    on_disk = search_trials(run.path / TRIALS)
    states = storage_states(run)
    if states is None:
        if on_disk:  # trials were asked from it: without it they would be asked again
            state = "missing" if not db.exists() else "empty"
            raise _refuse(f"it is {state}, while {len(on_disk)} trial(s) have records under "
                          f"{TRIALS}/, e.g. {next(iter(on_disk))}")
        return  # the run stopped before the storage was first written
    for tid, done in on_disk.items():
        held = states.get(tid, set())
        if not held:
            raise _refuse(f"it does not hold trial {tid}, whose directory exists under "
                          f"{TRIALS}/: not this run's storage, or an older copy")
        if done and not held - {"WAITING"}:
            raise _refuse(f"it holds trial {tid} as waiting to run, but the trial finished "
                          f"({TRIALS}/{tid}/{RESULT})")


def _trial_states(db: Path) -> dict[str, set[str]]:
    """Each named trial's states in the storage (an id re-run after an interrupt has two)."""
    query = ("SELECT t.state, a.value_json FROM trials t JOIN trial_user_attributes a "
             "ON a.trial_id = t.trial_id WHERE a.key = ?")
    try:
        with _readable_copy(db) as con:
            check = con.execute("PRAGMA quick_check").fetchall()
            if [tuple(r) for r in check] != [("ok",)]:
                raise _refuse(f"damaged or truncated: SQLite's integrity check reports "
                              f"{'; '.join(str(r[0]) for r in check[:2])}")
            tables = {r[0] for r in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            missing = [t for t in REQUIRED_TABLES if t not in tables]
            if missing:
                raise _refuse(f"not an Optuna storage: no table {', '.join(missing)}")
            rows = con.execute(query, (ID_ATTR,)).fetchall()
    except sqlite3.Error as exc:
        raise _refuse(f"unreadable, damaged or truncated: {exc}") from None
    states: dict[str, set[str]] = {}
    for state, value in rows:
        with contextlib.suppress(ValueError, TypeError):
            tid = json.loads(value)
            if isinstance(tid, str):
                states.setdefault(tid, set()).add(str(state))
    return states


@contextlib.contextmanager
def _readable_copy(db: Path) -> Iterator[sqlite3.Connection]:
    """A connection to a private copy of ``db`` and its journal (SQLite rolls a hot journal
    back in the copy); read-only on ``db`` itself where no copy can be made."""
    with tempfile.TemporaryDirectory(prefix="dpsweep-storage-") as tmp:
        target = Path(tmp) / db.name
        try:
            for suffix in ("", *_COMPANIONS):
                source = db.with_name(db.name + suffix)
                if source.is_file():
                    shutil.copyfile(source, target.with_name(target.name + suffix))
            uri = f"{target.as_uri()}"
        except OSError:
            uri = f"{db.resolve().as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as con:
            yield con


def check_inputs_first(run: RunDir, config_path: Path) -> None:
    """Compare the manifest's input hashes with the files the config names, before the
    config is validated (validation imports and calls a factory it names)."""
    # parsing runs no code (the door's checks would); resolving hashes files, imports nothing
    run.check_inputs(ResolvedSetup(config=config_mod.parse_file(config_path))
                     .input_fingerprints())


# ---- records that vanish, a disk that fills ---------------------------------------------
def check_records(run: RunDir) -> None:
    """Refuse to resume a run directory whose records are damaged, before anything writes or
    Ray starts: the results store unchanged and readable, the Optuna storage readable
    (:func:`finished_in_storage`; its agreement with the trial records is
    :func:`check_storage`, last before Ray), then
    ``RunDir.check_resumable`` with the files the rows point to and the trials Optuna counts
    as finished; last the code and data hashes, before the config is validated
    (:func:`check_inputs_first`: validation imports the factories it names)."""
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
