"""How a sweep is stopped by a signal.

SIGINT / SIGTERM set a stop flag (``_StopFlag``): while Ray Tune runs, its stopper polls the flag
(``orchestrator.sweep.raytune.InterruptStopper``) so running trials stop within seconds and are
re-enqueued; in every other phase the handler raises :class:`Interrupted` at once. Further
signals while that stop is under way (Ctrl-C pressed twice) are ignored: raised inside Ray's
shutdown they became tracebacks and exit 1 instead of the one line and 130. In the budget
phase that stops the PRV children still computing (``orchestrator.accounting.sandbox``: they
ignore the terminal's SIGINT themselves), so an interrupt is reported as one, never as an
accountant's fallback to RDP. The driver then flushes its state and the command exits 130 / 143
with a hint to resume. A full disk stops a sweep the same way
(``orchestrator.sweep.resume_checks``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpsweep.core.exits import EXIT_SIGINT, EXIT_SIGTERM


class Interrupted(BaseException):
    """The sweep was stopped by a signal; the run directory is consistent and resumable.

    A ``BaseException``, like ``KeyboardInterrupt``: the ``except Exception`` that keeps a
    failing trial's or job's reason must never turn a stop into a failure record."""

    def __init__(self, signum: int, run_dir: Path | None = None) -> None:
        self.signum = signum
        self.run_dir = run_dir
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}")

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.signum == signal.SIGTERM else EXIT_SIGINT


class _StopFlag:
    """Set by SIGINT/SIGTERM; Tune polls it through a Stopper, other phases raise at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.in_tune = False
        self.repeats = 0  # signals after the first, ignored (the stop is under way)

    def install(self) -> None:
        """(Re)install the handlers: ``ray.init`` replaces SIGTERM's with ``sys.exit(15)``."""
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, self.handler)

    def handler(self, signum: int, _frame: Any) -> None:
        if self.event.is_set():
            # A second signal while the first one stops the sweep: already under way. Raised
            # here it would land inside Ray (a SystemError from CoreWorker.wait, or a traceback
            # from ray.shutdown) and leave the records half-reconciled; the stop goes on.
            self.repeats += 1
            return
        self.signum = signum
        self.event.set()
        if not self.in_tune:
            raise Interrupted(signum)


@contextmanager
def _signals(flag: _StopFlag) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    flag.install()
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def ignore_further_signals() -> None:
    """SIGINT and SIGTERM ignored from here on: the stop has been reported, and Ray's exit
    handlers that still run must not turn a second Ctrl-C into a traceback."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
