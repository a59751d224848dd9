"""Atomic writes and the one on-disk JSON cache.

Every file dpsweep writes goes through :func:`atomic_write`: a uniquely named temporary file in
the target's directory, flushed and fsynced, then ``os.replace``-d over the target, so a reader
(another trial, a resumed sweep, a crash) sees the old file or the new one, never half of one,
and two writers never share a temporary name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from dpsweep.core.errors import disk_full
from dpsweep.core.hints import ignored, read_json_hint

#: Prefix of temporary files (``.tmp-<name>-<random>``); the run directory ignores them.
TMP_PREFIX = ".tmp-"


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` atomically: ``write(fh)`` fills a temporary file that replaces it.

    A full file system raises :class:`core.errors.DiskFull` naming ``path`` (whatever layer
    reported it: a serialiser writing into ``fh`` often drops the file name), and the old file
    stays as it was."""
    target = Path(path)
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f"{TMP_PREFIX}{target.name}-")
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        full = disk_full(exc, what=str(target)) if isinstance(exc, Exception) else None
        if full is not None and full is not exc:
            raise full from exc
        raise
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(value: Any, *, allow_nan: bool = True) -> bytes:
    """The bytes ``atomic_write_json`` writes (for ``RunDir.commit``, which writes bytes)."""
    return (json.dumps(value, indent=1, sort_keys=True, allow_nan=allow_nan) + "\n"
            ).encode("utf-8")


def atomic_write_json(path: str | os.PathLike[str], value: Any, *, indent: int | None = 1
                      ) -> Path:
    return atomic_write_text(path, json.dumps(value, indent=indent, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def canonical_hash(value: Any) -> str:
    """SHA-256 of the canonical JSON of ``value`` (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class JsonCache:
    """Answers keyed by a JSON-able key, one file per key under ``directory/namespace``.

    An entry stores its full key; a file whose key differs (hash collision, a foreign or
    edited file) or that does not parse is a miss, never an answer. The cache stores answers,
    it does not vouch for them: callers that derive privacy claims from an entry re-verify it
    (see ``orchestrator.accounting.cache``).
    """

    def __init__(self, directory: str | os.PathLike[str], namespace: str) -> None:
        self.directory = Path(directory).expanduser() / namespace

    def path(self, key: Any) -> Path:
        return self.directory / f"{canonical_hash(key)[:40]}.json"

    def get(self, key: Any) -> Any | None:
        """The stored value for ``key`` (untrusted: callers validate it), or None: no entry,
        or one that is not a bounded regular JSON file for this key (:mod:`core.hints`)."""
        path = self.path(key)
        entry = read_json_hint(path)
        if entry is None:
            return None
        if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key)):
            ignored(path, "an entry for another key")
            return None
        return entry.get("value")

    def put(self, key: Any, value: Any) -> Path | None:
        """Store ``value``; an unwritable cache is not an error (the answer is still used)."""
        try:
            return atomic_write_json(self.path(key), {"key": key, "value": value})
        except OSError:
            return None
