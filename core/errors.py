"""The errors every floor raises, and how they cross process boundaries.

``UserInputError`` is the one error type for bad input (config, CLI arguments, data, files in a
run directory): the CLI turns it into a single line on stderr and exit code 2. Nothing is
written before validation passes, so raising it never leaves a half-written run behind.

Errors raised inside Ray workers are pickled back to the driver; an exception whose
``__init__`` takes keyword-only arguments cannot be rebuilt by ``BaseException.__reduce__``
(Ray then reports a 60-line TypeError instead of the message), so every error here defines
``__reduce__``.
"""

from __future__ import annotations

from typing import Any


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
