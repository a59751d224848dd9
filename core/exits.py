"""Every exit code a dpsweep command ends with, written once (docs/operations.md#exit-codes).

A script or CI job that runs dpsweep reads these codes without parsing what it printed, so each
way of ending has its own number: nothing wrong, bad input (refused before anything was
written), work that ran but where some trial or audit failed (the run directory is whole and
holds each reason), a full disk, a signal.
"""

from __future__ import annotations

from typing import Final

#: Everything asked for was done, and nothing in it failed.
EXIT_OK: Final = 0
#: Bad input, refused with one line naming the field, the value and what is allowed; nothing
#: written (argparse's own code for a usage error).
EXIT_USAGE: Final = 2
#: The command ran to its end, but a trial or an audit failed (a sweep whose every trial failed
#: included): the results hold each reason, the report lists them. Not 1, which Python gives an
#: unexpected error with a traceback.
EXIT_FAILURES: Final = 3
#: A file system the command writes is full (sysexits.h's EX_IOERR); a sweep stays resumable.
EXIT_DISK_FULL: Final = 74
#: Stopped by a signal: 128 + the signal's number, as shells report it.
EXIT_SIGINT: Final = 130
EXIT_SIGTERM: Final = 143


def outcome_code(*, trials_failed: int, audits_failed: int) -> int:
    """A finished command's code: ``EXIT_FAILURES`` when any trial or audit failed, so that a
    sweep whose audits all failed (no front, nothing to pick) never reads as a success."""
    return EXIT_FAILURES if trials_failed > 0 or audits_failed > 0 else EXIT_OK
