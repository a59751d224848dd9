"""The errors every floor raises, and how they cross process boundaries.

``UserInputError`` is the one error type for bad input (config, CLI arguments, data, files in a
run directory): the CLI turns it into a single line on stderr and exit code 2. Nothing is
written before validation passes, so raising it never leaves a half-written run behind.

``DiskFull`` is a write that failed on a full file system: never the fault of the work that was
writing, so a sweep stops on it (exit code ``EXIT_DISK_FULL``), resumable, instead of recording
a failure.

Errors raised inside Ray workers are pickled back to the driver; an exception whose
``__init__`` takes keyword-only arguments cannot be rebuilt by ``BaseException.__reduce__``
(Ray then reports a 60-line TypeError instead of the message), so every error here defines
``__reduce__``.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any

from dpsweep.core.exits import EXIT_DISK_FULL as EXIT_DISK_FULL  # re-exported: the code of DiskFull


class UserInputError(Exception):
    """Bad input, named by the field, the offending value and what is allowed."""

    def __init__(self, *, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field} = {value!r} is not allowed: expected {allowed}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_user_input_error,
                (type(self), self.field, _portable(self.value), self.allowed))


def _portable(value: Any) -> Any:
    """The value itself when it is plain data, else its repr (it may not pickle)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) and all(
            v is None or isinstance(v, (str, int, float, bool)) for v in value):
        return type(value)(value)
    return repr(value)


def _rebuild_user_input_error(cls: type[UserInputError], field: str, value: Any,
                              allowed: str) -> UserInputError:
    return cls(field=field, value=value, allowed=allowed)


class CacheIntegrityError(UserInputError):
    """A cached privacy answer that an independent check contradicts: never trained with."""


class TrialDiverged(RuntimeError):
    """Training produced a non-finite loss; the trial ends as failed with this reason."""


class PrivacyBoundViolation(RuntimeError):
    """A step released less noise than the accountant certified: the epsilon would be false."""


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, one line, for results rows and Optuna attributes."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: What a full file system looks like when the error that reports it lost its errno on the way
#: (SQLite through SQLAlchemy, a message pickled back from a Ray worker).
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "database or disk is full")
#: SQLite's text for it: the write that failed was the Optuna storage's.
_SQLITE_FULL = "database or disk is full"
#: ``str(DiskFull)``, wherever it ends up quoted (a worker's error, a job's reason).
_SAID = re.compile(r"the disk is full: could not write (.+?) \(([^()]*)\)")


class DiskFull(OSError):
    """A write failed because its file system is full (or over quota).

    Never a failure of the work that was writing: a sweep stops on it, keeps its run directory
    resumable, and runs the interrupted work again once there is space. An ``OSError`` (errno
    ENOSPC), so code that tolerates an unwritable optional file (the budget cache) still does.
    """

    def __init__(self, what: str, reason: str = os.strerror(errno.ENOSPC)) -> None:
        super().__init__(errno.ENOSPC, reason, what)
        self.what = what
        self.reason = reason
        #: Set by a sweep that stopped on it: the run directory to resume once there is space.
        self.run_dir: Any = None

    def __str__(self) -> str:
        return f"the disk is full: could not write {self.what} ({self.reason})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.reason))


def disk_full(exc: BaseException, *, what: str | None = None,
              database: str | None = None) -> DiskFull | None:
    """The :class:`DiskFull` behind ``exc`` (itself, or anywhere in its cause chain), or None.

    ``what`` names the file when the error does not; ``database``, the SQLite file a SQLite
    error is about (Optuna's storage)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, DiskFull):
            return cause
        if isinstance(cause, OSError) and cause.errno in _FULL_ERRNOS:
            return DiskFull(what or str(cause.filename or "a file"), os.strerror(cause.errno))
        found = disk_full_in(str(cause), what=what, database=database)
        if found is not None:
            return found
        cause = cause.__cause__ or cause.__context__
    return None


def disk_full_in(text: str, *, what: str | None = None,
                 database: str | None = None) -> DiskFull | None:
    """The :class:`DiskFull` an error's text reports (``describe`` of one pickled back from a
    worker, SQLite's message), or None."""
    said = _SAID.search(text)
    if said is not None:
        return DiskFull(said[1], said[2])
    marker = next((m for m in _FULL_TEXTS if m in text), None)
    if marker is None:
        return None
    if marker == _SQLITE_FULL:
        return DiskFull(f"the Optuna storage {database or ''}".strip(), marker)
    return DiskFull(what or "a file", marker)
