"""The run directory as one unit: its layout, a versioned manifest, an exclusive lock.

Everything a sweep writes lives under RUN_DIR, addressed by paths *relative* to it, so a run
directory can be moved (``mv``) or copied (``cp -r``) and resumed at its new place; resuming a
copy writes only into the copy. Nothing in it is executed or trusted unverified:

* ``manifest.json`` lists every file dpsweep wrote with its SHA-256 (trial records are added by
  the driver when the trial finishes); a read of a listed file checks the hash, so an edited or
  foreign file is an error naming it, never an input; files the driver rewrites go through
  :meth:`RunDir.commit`, so a crash or a full disk between the file and the manifest leaves
  both consistent; ``resume`` checks every listed file before it starts anything
  (:meth:`RunDir.check_resumable`);
* state is rebuilt from ``config.toml`` + the Optuna storage + the results store; Ray Tune's own
  experiment files under ``tune/`` (pickles) are never loaded;
* checkpoints load with ``torch.load(weights_only=True)``; budget-cache hits are re-verified by an
  independent accountant (``orchestrator.accounting.verify``).

One process at a time writes a run directory: ``run`` and ``resume`` hold an exclusive lock
(``filelock``) for their whole life; a second writer is refused at once with the holder's pid.
Read-only commands (``report``, ``pick``, ``export``) verify instead of locking.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from dpsweep.core.errors import DiskFull, UserInputError, disk_full
from dpsweep.core.layout import (
    CACHE,
    CHECKPOINT_DIR,
    CHECKPOINT_FILE,
    CONFIG,
    LOCK,
    LOCK_INFO,
    MANIFEST,
    OPTUNA_DB,
    REPORT,
    RESULT,
    RESULTS,
    TRIAL_FILES,
    TRIALS,
    TUNE,
)
from dpsweep.core.storage import (
    TMP_PREFIX,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
)

FORMAT = "dpsweep-run"
VERSION = 1
#: Files and folders that change outside the driver's control or are never read back: their
#: contents are not hashed (Optuna validates its own storage; Tune's files are never loaded).
UNHASHED = (OPTUNA_DB, LOCK, LOCK_INFO, TUNE, CACHE, REPORT)
#: Modes of everything in a run directory: its owner's alone. It holds every trial's noiseless
#: scores (the Optuna storage included), which stay with whoever ran the sweep (docs/search.md);
#: exports, written elsewhere, keep their own modes (``orchestrator.release.bundle``).
DIR_MODE = 0o700
FILE_MODE = 0o600
_TRIAL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,199}$")
#: What to do about a run directory whose records are damaged: no resume can repair them.
RESTORE = "restore it from a copy of the run directory, or start a new run"


def check_trial_id(trial_id: str) -> str:
    """A trial id is one path component: no separators, no leading dot."""
    if not isinstance(trial_id, str) or not _TRIAL_ID.match(trial_id) or ".." in trial_id:
        raise UserInputError(field="trial id", value=trial_id,
                             allowed="letters, digits and _.:@+- (one path component)")
    return trial_id


def check_creatable(path: Path, *, field_name: str = "--out") -> Path:
    """A new or empty directory at ``path`` can be created and written, or one clear error.

    Checked before Ray starts: a path under a regular file, a dangling symlink, an unwritable
    or virtual parent (/proc) are refused here, not after minutes of work.
    """
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise UserInputError(field=field_name, value=str(path),
                             allowed="a path that is not a dangling symbolic link")
    if path.exists():
        if not path.is_dir():
            raise UserInputError(field=field_name, value=str(path),
                                 allowed="a new or empty directory (this is a file)")
        holder = _live_holder(path)
        if holder is not None:
            raise UserInputError(field=field_name, value=str(path),
                                 allowed=f"a run directory no other dpsweep process is writing "
                                         f"({holder})")
        if any(path.iterdir()):
            raise UserInputError(field=field_name, value=str(path),
                                 allowed="a new or empty directory (use `dpsweep resume` to "
                                         "continue a sweep)")
        probe_dir = path
    else:
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise UserInputError(field=field_name, value=str(path),
                                 allowed=f"a path under a directory ({parent} is a file)")
        probe_dir = parent
    resolved = probe_dir.resolve()
    if resolved.parts[:2] in (("/", "proc"), ("/", "sys"), ("/", "dev")):
        raise UserInputError(field=field_name, value=str(path),
                             allowed="a directory on a real file system (not /proc, /sys, /dev)")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise UserInputError(field=field_name, value=str(path),
                             allowed=f"a location you can write ({probe_dir} is not writable)")
    enclosing = enclosing_run(resolved)
    if enclosing is not None:
        raise UserInputError(field=field_name, value=str(path),
                             allowed=f"a directory outside the run directory {enclosing} (a "
                                     "run directory is private and verified file by file: "
                                     "nothing new is written inside it)")
    return path


def enclosing_run(path: Path) -> Path | None:
    """The run directory ``path`` is in (itself or an ancestor), judged by its manifest's
    format (a ``manifest.json`` of another program does not count), or None."""
    for folder in (path, *path.parents):
        manifest = folder / MANIFEST
        try:
            if manifest.is_file() and json.loads(
                    manifest.read_text(encoding="utf-8")).get("format") == FORMAT:
                return folder
        except (OSError, ValueError, AttributeError):
            continue
    return None


def private_file(path: Path) -> Path:
    """``path`` readable and writable by its owner alone: created empty with FILE_MODE when
    missing (before SQLite or filelock would create it with the umask's mode), else set to it.
    A file that cannot be changed (a read-only run directory) is left for the command's own
    write to report."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    except FileExistsError:
        if not path.is_symlink():
            with contextlib.suppress(OSError):
                os.chmod(path, FILE_MODE)
        return path
    except OSError:  # not creatable here: the caller's own open reports why, as before
        return path
    try:
        os.fchmod(fd, FILE_MODE)  # O_CREAT's mode went through the umask
    finally:
        os.close(fd)
    return path


def protect_tree(root: Path) -> None:
    """Every folder under ``root`` (itself included) DIR_MODE, every file FILE_MODE: what Ray
    Tune, SQLite's journals and ``mkdir`` created with the umask's modes. Symbolic links are
    left alone (a mode cannot be set on a link, and its target is not the run's); an entry
    that vanished or cannot be changed is skipped."""
    with contextlib.suppress(OSError):
        os.chmod(root, DIR_MODE)
    for folder, dirs, files in os.walk(root):
        for name, mode in [*((d, DIR_MODE) for d in dirs), *((f, FILE_MODE) for f in files)]:
            entry = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.lstat(entry)
                if not os.path.islink(entry) and st.st_mode & 0o7777 != mode:
                    os.chmod(entry, mode)


def _live_holder(path: Path) -> str | None:
    """Who holds the run directory's lock, or None when nobody does (nothing is written)."""
    if not (path / LOCK).is_file():
        return None
    lock = FileLock(str(path / LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return RunDir(path=path)._lock_holder()
    lock.release()
    return None


def _undo_create(path: Path, *, keep: bool) -> None:
    """Remove what a failed :meth:`RunDir.create` wrote: ``path`` itself, or only its contents
    when it was an empty directory already (``keep``)."""
    if not keep:
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


@dataclass
class RunDir:
    """An open run directory (see the module docstring)."""

    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    _lock: FileLock | None = None

    # ---- opening ---------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, *, config_text: str, kind: str = "sweep",
               inputs: dict[str, str] | None = None) -> RunDir:
        """Make a new run directory, take its lock, write the config and the manifest.

        ``inputs`` are the SHA-256 of the user's code and data files the run reads
        (:meth:`check_inputs` compares them when the run is resumed). A full disk removes what
        was made and names ``--out``: a directory without its manifest could not be resumed."""
        path = check_creatable(Path(path))
        top = path  # the outermost folder this call creates (removed again on a full disk)
        while not top.parent.exists():
            top = top.parent
        existed = path.exists()
        run = cls(path=path.absolute())
        try:
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, DIR_MODE)  # mkdir's mode goes through the umask
            run.path = path.resolve()
            run._acquire()
            run.manifest = {"format": FORMAT, "version": VERSION, "kind": kind,
                            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                            "files": {}, "inputs": dict(inputs or {})}
            atomic_write_text(run.path / CONFIG, config_text)
            run.record([CONFIG])
        except OSError as exc:
            full = disk_full(exc)
            if full is None:
                raise
            run.release()
            _undo_create(path if existed else top, keep=existed)
            raise UserInputError(field="--out", value=str(path),
                                 allowed=f"a location with free space ({full}; nothing was "
                                         "kept)") from None
        return run

    @classmethod
    def open(cls, path: Path, *, write: bool) -> RunDir:
        """Open an existing run directory; ``write`` takes the exclusive lock."""
        path = Path(path)
        manifest_path = path / MANIFEST
        if not path.is_dir() or not manifest_path.is_file():
            raise UserInputError(field="RUN_DIR", value=str(path),
                                 allowed=f"a dpsweep run directory (with {MANIFEST})")
        run = cls(path=path.resolve())
        if write:
            run._acquire()
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            run.release()
            raise UserInputError(field=MANIFEST, value=str(manifest_path),
                                 allowed=f"a readable dpsweep manifest ({exc})") from None
        if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
                and isinstance(manifest.get("files"), dict)):
            run.release()
            raise UserInputError(field=MANIFEST, value=str(manifest_path),
                                 allowed=f"a manifest of format {FORMAT!r}")
        if manifest.get("version") != VERSION:
            run.release()
            raise UserInputError(field=f"{MANIFEST}.version", value=manifest.get("version"),
                                 allowed=f"{VERSION} (written by this dpsweep)")
        run.manifest = manifest
        run.verify(CONFIG)
        return run

    def _acquire(self) -> None:
        lock = FileLock(str(private_file(self.path / LOCK)), mode=FILE_MODE)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = self._lock_holder()
            raise UserInputError(field="RUN_DIR", value=str(self.path),
                                 allowed=f"a run directory no other dpsweep process is writing "
                                         f"({holder})") from None
        self._lock = lock
        try:
            atomic_write_json(self.path / LOCK_INFO, {"pid": os.getpid(),
                                                      "host": os.uname().nodename})
        except DiskFull:
            # Who holds the lock only words a refusal: a full disk must not block opening (the
            # first real write reports it), nor a stale record name a previous holder.
            (self.path / LOCK_INFO).unlink(missing_ok=True)

    def _lock_holder(self) -> str:
        try:
            info = json.loads((self.path / LOCK_INFO).read_text())
            return f"held by pid {info['pid']} on {info['host']}"
        except (OSError, ValueError, KeyError):
            return "its lock is held"

    def release(self) -> None:
        """Set the modes of everything this writer made (:func:`protect_tree`), then unlock."""
        if self._lock is not None:
            protect_tree(self.path)
            self._lock.release()
            self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- layout ----------------------------------------------------------------------------
    @property
    def optuna_url(self) -> str:
        """Computed from the current location every time (never stored)."""
        return f"sqlite:///{self.path / OPTUNA_DB}"

    @property
    def cache_dir(self) -> Path:
        return self.path / CACHE

    @property
    def tune_dir(self) -> Path:
        return self.path / TUNE

    def trial_dir(self, trial_id: str) -> Path:
        return self.path / TRIALS / check_trial_id(trial_id)

    def relative(self, path: Path) -> str:
        return os.path.relpath(Path(path).resolve(), self.path)

    # ---- the manifest ----------------------------------------------------------------------
    def _hashed(self, rel: str) -> bool:
        first = Path(rel).parts[0] if Path(rel).parts else rel
        return first not in UNHASHED and not Path(rel).name.startswith(TMP_PREFIX)

    def record(self, rels: Iterable[str]) -> None:
        """Add (or refresh) files in the manifest with their hashes; write it atomically."""
        self._require_lock()
        self._stage(rels)
        self._write_manifest()

    def _stage(self, rels: Iterable[str]) -> None:
        """Enter files in the manifest in memory (a missing one leaves it)."""
        files = self.manifest.setdefault("files", {})
        for rel in rels:
            p = self.path / rel
            if not p.is_file():
                files.pop(rel, None)
                continue
            files[rel] = ({"sha256": sha256_file(p), "size": p.stat().st_size}
                          if self._hashed(rel) else {"sha256": None})

    def _write_manifest(self) -> None:
        self.manifest["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
        atomic_write_json(self.path / MANIFEST, self.manifest)

    def commit(self, rel: str, data: bytes, *, also: Iterable[str] = ()) -> None:
        """Write ``rel`` (a file dpsweep rewrites: the results store, the summary) and record
        it, with the files in ``also``, so that a crash or a full disk at any moment leaves a
        file the manifest vouches for.

        The manifest first lists ``also`` and names the new content as *pending* beside the
        old one, then the file is replaced, then the pending hash becomes the recorded one:
        :meth:`verify` accepts either while both are listed. (Writing the file first and
        recording it second left, after a crash in between, a file whose hash no manifest
        held: a run that no resume would open.)"""
        self._require_lock()
        files = self.manifest.setdefault("files", {})
        digest = hashlib.sha256(data).hexdigest()
        self._stage(also)
        files[rel] = {**{k: v for k, v in (files.get(rel) or {}).items() if k != "pending"},
                      "pending": digest}
        self._write_manifest()
        atomic_write_bytes(self.path / rel, data)
        files[rel] = {"sha256": digest, "size": len(data)}
        self._write_manifest()

    def forget(self, rels: Iterable[str]) -> None:
        """Take files out of the manifest, which no read then accepts (:meth:`verify`) and no
        resume checks: the records of a failed trial that is trained again, which the retry
        writes anew (a resume after an interrupted retry would find them changed)."""
        self._require_lock()
        files = self.manifest.setdefault("files", {})
        for rel in rels:
            files.pop(rel, None)
        self._write_manifest()

    def trial_files(self, trial_id: str) -> list[str]:
        """A trial's record files and checkpoint that exist, relative to the run directory."""
        base = self.trial_dir(trial_id)
        rels = [self.relative(base / name) for name in TRIAL_FILES if (base / name).is_file()]
        ckpt = base / CHECKPOINT_DIR / CHECKPOINT_FILE
        if ckpt.is_file():
            rels.append(self.relative(ckpt))
        return rels

    def record_trial(self, trial_id: str) -> list[str]:
        """Record a finished trial's files (records and checkpoint)."""
        rels = self.trial_files(trial_id)
        self.record(rels)
        return rels

    def verify(self, rel: str, *, hint: str = "") -> Path:
        """The file's path if its content is what dpsweep wrote; else one clear error (ending
        with ``hint``, what to do about it)."""
        entry = self.manifest.get("files", {}).get(rel)
        path = self.path / rel
        then = f"; {hint}" if hint else ""
        if entry is None:
            raise UserInputError(field="RUN_DIR", value=rel,
                                 allowed=f"a file listed in {MANIFEST} (this one was not written "
                                         "by dpsweep for this run)")
        if not path.is_file():
            raise UserInputError(field="RUN_DIR", value=rel,
                                 allowed=f"an existing file (listed in {MANIFEST}, now "
                                         f"missing{then})")
        hashes = {entry.get("sha256"), entry.get("pending")} - {None}
        if hashes and sha256_file(path) not in hashes:
            raise UserInputError(field="RUN_DIR", value=rel,
                                 allowed=f"the file dpsweep wrote (its SHA-256 differs from "
                                         f"{MANIFEST}: modified or replaced{then})")
        return path

    def check_resumable(self, *, referenced: Mapping[str, Iterable[str]],
                        finished: Iterable[str]) -> None:
        """Refuse, before a resume starts anything, a run directory whose records are damaged.

        Every file the manifest lists must be there and unchanged; every file a results row
        points to (``referenced``: trial id -> paths) must be there; every trial the Optuna
        storage counts as finished (``finished``) must have its result record. A finished
        trial's directory that vanished was otherwise trained again under a new id while its
        row still claimed the old one."""
        files = self.manifest.get("files", {})
        for rel in sorted(files):
            parts = Path(rel).parts
            if len(parts) > 2 and parts[0] == TRIALS and not (self.path / TRIALS / parts[1]
                                                               ).is_dir():
                raise UserInputError(field="RUN_DIR", value=f"{TRIALS}/{parts[1]}",
                                     allowed=f"the records of trial {parts[1]}, listed in "
                                             f"{MANIFEST} (the directory is gone; {RESTORE})")
            if "sha256" in files[rel] or (self.path / rel).exists():
                self.verify(rel, hint=RESTORE)  # (a first write that never happened: skipped)
        for trial_id, rels in sorted(referenced.items()):
            for rel in rels:
                if not (self.path / rel).is_file():
                    raise UserInputError(field="RUN_DIR", value=rel,
                                         allowed=f"an existing file ({RESULTS}'s row of trial "
                                                 f"{trial_id} points to it; {RESTORE})")
        for trial_id in sorted(finished):
            rel = self.relative(self.trial_dir(trial_id) / RESULT)
            if not (self.path / rel).is_file():
                raise UserInputError(field="RUN_DIR", value=rel,
                                     allowed=f"the result record of trial {trial_id}, finished "
                                             f"according to {OPTUNA_DB} (it is missing; "
                                             f"{RESTORE})")

    def check_inputs(self, current: dict[str, str]) -> None:
        """Refuse to continue a run whose model code or data files changed since it started:
        its finished trials and the new ones would not describe one experiment."""
        recorded = self.manifest.get("inputs") or {}
        for name in sorted(set(recorded) | set(current)):
            if recorded.get(name) != current.get(name):
                raise UserInputError(
                    field=f"{MANIFEST}.inputs.{name}", value=current.get(name, "missing"),
                    allowed=f"the code and data the run started with (SHA-256 "
                            f"{recorded.get(name, 'none')}): restore them, or start a new run")

    def verify_all(self) -> None:
        for rel in sorted(self.manifest.get("files", {})):
            self.verify(rel)

    def _require_lock(self) -> None:
        if self._lock is None:
            raise RuntimeError("writing a run directory requires its lock (RunDir.open(write))")
