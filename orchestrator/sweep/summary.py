"""What a sweep says of itself: every attempt at it (``attempts.json``) and ``summary.json``.

A sweep is often run in several attempts: ``dpsweep run``, stopped by a signal or a kill, then
one ``dpsweep resume`` or more. Each attempt is recorded when it starts, before Ray, and again
when it ends (``finished`` or ``interrupted``); one killed with ``kill -9`` keeps no end. The
summary's wall time is the sum over the attempts with a recorded end and says how many have
none, so a resumed run's time is neither the last attempt's alone nor a guess. An attempt of
``resume --retry-failed`` also lists the failed trials it trains again, each with the reason it
had failed (``RETRIED``): the retry replaces the trial's row and records, the failure stays here,
and the adaptive statement counts each such failed attempt as one more trained model.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from dpsweep.core import __version__, layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.storage import json_bytes
from dpsweep.orchestrator.rundir import RunDir

if TYPE_CHECKING:
    from dpsweep.orchestrator.trial.setup import ResolvedSetup

__all__ = ["ATTEMPT_COMMANDS", "ATTEMPT_ENDS", "RETRIED", "begin_attempt", "end_attempt",
           "end_if_begun", "read_attempts", "record_retry", "retried_trials", "summary_bytes",
           "wall_of"]

#: What started an attempt.
ATTEMPT_COMMANDS = ("run", "resume", "resume --retry-failed")
#: How an attempt ended; ``running`` stays on one that was killed (no end recorded).
ATTEMPT_ENDS = ("running", "finished", "interrupted", "failed")
#: What every attempt records; an attempt of ``resume --retry-failed`` may also hold RETRIED.
ATTEMPT_KEYS = frozenset({"command", "started", "finished", "ended"})
#: The failed trials an attempt trained again: a list of {"trial_id", "error"} (the reason the
#: trial had failed).
RETRIED = "retried"
RETRY_KEYS = frozenset({"trial_id", "error"})
#: Libraries whose versions the summary records.
VERSIONED = ("torch", "ray", "optuna", "dp-accounting", "numpy")


def _bad(why: str) -> UserInputError:
    return UserInputError(field="RUN_DIR", value=layout.ATTEMPTS,
                          allowed=f"a list of attempts as dpsweep writes them ({why})")


def _checked(entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict) or not ATTEMPT_KEYS <= set(entry) <= ATTEMPT_KEYS | {RETRIED}:
        raise _bad(f"each an object with command, started, finished and ended (and {RETRIED})")
    retried = entry.get(RETRIED, [])
    if not (isinstance(retried, list) and all(
            isinstance(r, dict) and set(r) == RETRY_KEYS
            and all(isinstance(v, str) for v in r.values()) for r in retried)):
        raise _bad(f"{RETRIED} a list of objects with a trial_id and an error")
    if entry["command"] not in ATTEMPT_COMMANDS or entry["ended"] not in ATTEMPT_ENDS:
        raise _bad(f"command in {list(ATTEMPT_COMMANDS)}, ended in {list(ATTEMPT_ENDS)}")
    started, finished = entry["started"], entry["finished"]
    if not _time(started) or not (finished is None or (_time(finished) and finished >= started)):
        raise _bad("started a time, finished none or a time not before it")
    if (finished is None) != (entry["ended"] == "running"):
        raise _bad("an end time exactly when the attempt ended")
    return dict(entry)


def _time(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def read_attempts(run: RunDir) -> list[dict[str, Any]]:
    """The recorded attempts, verified against the manifest and checked field by field
    (a run that predates the file has none)."""
    entry = run.manifest.get("files", {}).get(layout.ATTEMPTS)
    if entry is None or ("sha256" not in entry and not (run.path / layout.ATTEMPTS).exists()):
        return []  # none yet, or a first write that never happened (as RunDir.check_resumable)
    try:
        parsed = json.loads(run.verify(layout.ATTEMPTS).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"unreadable: {type(exc).__name__}") from None
    if not isinstance(parsed, list):
        raise _bad("a JSON list")
    return [_checked(entry) for entry in parsed]


def _commit(run: RunDir, attempts: list[dict[str, Any]]) -> None:
    run.commit(layout.ATTEMPTS, json_bytes(attempts))


def begin_attempt(run: RunDir, attempts: list[dict[str, Any]], *, command: str) -> None:
    """Record an attempt's start after ``attempts`` (read, and checked, already), in place."""
    if command not in ATTEMPT_COMMANDS:
        raise ValueError(f"command {command!r} not in {ATTEMPT_COMMANDS}")
    attempts.append({"command": command, "started": time.time(), "finished": None,
                     "ended": "running"})
    _commit(run, attempts)


def record_retry(run: RunDir, attempts: list[dict[str, Any]], *, trial_id: str,
                 error: str) -> None:
    """Record, in the current (last) attempt, that the failed trial ``trial_id`` is trained
    again, with the reason it had failed (its error record goes; this one stays)."""
    attempts[-1].setdefault(RETRIED, []).append({"trial_id": trial_id, "error": error})
    _commit(run, attempts)


def retried_trials(attempts: list[dict[str, Any]]) -> dict[str, int]:
    """Trial id -> how many of its failed attempts were trained again, over every attempt."""
    counts: dict[str, int] = {}
    for attempt in attempts:
        for retry in attempt.get(RETRIED, []):
            counts[retry["trial_id"]] = counts.get(retry["trial_id"], 0) + 1
    return counts


def end_attempt(run: RunDir, attempts: list[dict[str, Any]], *, ended: str) -> None:
    """Record how the current (last) attempt ended, in place."""
    if ended not in ATTEMPT_ENDS[1:]:
        raise ValueError(f"ended {ended!r} not in {ATTEMPT_ENDS[1:]}")
    attempts[-1].update(finished=time.time(), ended=ended)
    _commit(run, attempts)


def end_if_begun(run: RunDir, attempts: list[dict[str, Any]], *, before: int,
                 ended: str) -> None:
    """Record how this attempt ended if it began (``attempts`` grew past ``before``) and has
    no end yet. Best effort: a full disk or a vanished directory leaves it without an end,
    which the summary then counts as such."""
    if len(attempts) > before and attempts[-1]["ended"] == "running":
        with contextlib.suppress(OSError, UserInputError):
            end_attempt(run, attempts, ended=ended)


def wall_of(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's wall time: the attempts with a recorded end, and how many have none."""
    ended = [a for a in attempts if a["finished"] is not None]
    return {"wall_seconds": sum(a["finished"] - a["started"] for a in ended),
            "attempts": len(attempts), "attempts_without_end": len(attempts) - len(ended)}


def summary_bytes(*, attempts: list[dict[str, Any]], setup: ResolvedSetup,
                  tuning: dict[str, Any]) -> bytes:
    """summary.json for a sweep whose last attempt has just finished: what the report's header,
    the export's tuning statement and ``dpsweep pick`` read."""
    summary = {
        "started": attempts[0]["started"], "finished": attempts[-1]["finished"],
        **wall_of(attempts),
        "versions": {"dpsweep": __version__, "python": platform.python_version(),
                     **_library_versions()},
        "accountant": "prv (upper bound; RDP fallback recorded per trial)",
        "split_sizes": dict(setup.split_sizes),
        "model": setup.config.model.factory or setup.config.model.name,
        "num_classes": setup.num_classes, "tuning": tuning,
    }
    return json_bytes(summary)


def _library_versions() -> dict[str, str]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
