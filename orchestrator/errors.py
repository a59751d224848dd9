"""The one error type for bad user input (config, CLI arguments, data, checkpoints).

The CLI turns it into a single line on stderr and exit code 2; nothing is written before
validation passes, so raising it never leaves a half-written run behind.
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
