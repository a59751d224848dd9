"""The run directory as one unit: its layout, a versioned manifest, an exclusive lock.

Everything a sweep writes lives under RUN_DIR, addressed by paths *relative* to it, so a run
directory can be moved (``mv``) or copied (``cp -r``) and resumed at its new place; resuming a
copy writes only into the copy. Nothing in it is executed or trusted unverified:

* ``manifest.json`` lists every file dpsweep wrote with its SHA-256 (trial records are added by
  the driver when the trial finishes); a read of a listed file checks the hash, so an edited or
  foreign file is an error naming it, never an input;
* state is rebuilt from ``config.toml`` + the Optuna storage + the results store; Ray Tune's own
  experiment files under ``tune/`` (pickles) are never loaded;
* checkpoints load with ``torch.load(weights_only=True)``; budget-cache hits are re-verified by an
  independent accountant (``orchestrator.accounting.verify``).

One process at a time writes a run directory: ``run`` and ``resume`` hold an exclusive lock
(``filelock``) for their whole life; a second writer is refused at once with the holder's pid.
Read-only commands (``report``, ``pick``, ``export``) verify instead of locking.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from core.errors import UserInputError
from core.layout import (
    CACHE,
    CHECKPOINT_DIR,
    CHECKPOINT_FILE,
    CONFIG,
    LOCK,
    LOCK_INFO,
    MANIFEST,
    OPTUNA_DB,
    REPORT,
    TRIAL_FILES,
    TRIALS,
    TUNE,
)
from core.storage import TMP_PREFIX, atomic_write_json, atomic_write_text, sha256_file

FORMAT = "dpsweep-run"
VERSION = 1
#: Files and folders that change outside the driver's control or are never read back: their
#: contents are not hashed (Optuna validates its own storage; Tune's files are never loaded).
UNHASHED = (OPTUNA_DB, LOCK, LOCK_INFO, TUNE, CACHE, REPORT)
_TRIAL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,199}$")


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
    return path


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
        (:meth:`check_inputs` compares them when the run is resumed)."""
        path = check_creatable(Path(path))
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path=path.resolve())
        run._acquire()
        run.manifest = {"format": FORMAT, "version": VERSION, "kind": kind,
                        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                        "files": {}, "inputs": dict(inputs or {})}
        atomic_write_text(run.path / CONFIG, config_text)
        run.record([CONFIG])
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
        lock = FileLock(str(self.path / LOCK))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = self._lock_holder()
            raise UserInputError(field="RUN_DIR", value=str(self.path),
                                 allowed=f"a run directory no other dpsweep process is writing "
                                         f"({holder})") from None
        self._lock = lock
        atomic_write_json(self.path / LOCK_INFO, {"pid": os.getpid(),
                                                  "host": os.uname().nodename})

    def _lock_holder(self) -> str:
        try:
            info = json.loads((self.path / LOCK_INFO).read_text())
            return f"held by pid {info['pid']} on {info['host']}"
        except (OSError, ValueError, KeyError):
            return "its lock is held"

    def release(self) -> None:
        if self._lock is not None:
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
        files = self.manifest.setdefault("files", {})
        for rel in rels:
            p = self.path / rel
            if not p.is_file():
                files.pop(rel, None)
                continue
            files[rel] = ({"sha256": sha256_file(p), "size": p.stat().st_size}
                          if self._hashed(rel) else {"sha256": None})
        self.manifest["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
        atomic_write_json(self.path / MANIFEST, self.manifest)

    def record_trial(self, trial_id: str) -> list[str]:
        """Record a finished trial's files (records and checkpoint)."""
        base = self.trial_dir(trial_id)
        rels = [self.relative(base / name) for name in TRIAL_FILES if (base / name).is_file()]
        ckpt = base / CHECKPOINT_DIR / CHECKPOINT_FILE
        if ckpt.is_file():
            rels.append(self.relative(ckpt))
        self.record(rels)
        return rels

    def verify(self, rel: str) -> Path:
        """The file's path if its content is what dpsweep wrote; else one clear error."""
        entry = self.manifest.get("files", {}).get(rel)
        path = self.path / rel
        if entry is None:
            raise UserInputError(field="RUN_DIR", value=rel,
                                 allowed=f"a file listed in {MANIFEST} (this one was not written "
                                         "by dpsweep for this run)")
        if not path.is_file():
            raise UserInputError(field="RUN_DIR", value=rel,
                                 allowed=f"an existing file (listed in {MANIFEST}, now missing)")
        if entry.get("sha256") is not None and sha256_file(path) != entry["sha256"]:
            raise UserInputError(field="RUN_DIR", value=rel,
                                 allowed=f"the file dpsweep wrote (its SHA-256 differs from "
                                         f"{MANIFEST}: modified or replaced)")
        return path

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
