"""The PRV search in a child process, killed at its time bound.

Forked when this process has a single OS thread (nothing to deadlock on, nothing to re-import),
else a fresh interpreter started with subprocess (multiprocessing's "spawn" would re-run the
caller's main script), kept for the next job inside ``keep_interpreters`` (its start costs more
than a job) until one outlives its bound. Every outcome comes back as a message, so a timeout or
a crash is a reason to fall back to RDP, never a hang.

An interrupt is never such a reason: children ignore SIGINT (a Ctrl-C reaches the whole process
group; the parent decides), a parent leaving :func:`keep_interpreters` by an exception (the sweep's
``Interrupted``) kills the children still computing, and a child stopped either way raises
:class:`CalibrationInterrupted` in the thread that asked, instead of an RDP fallback.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dpsweep.orchestrator.accounting.search import UnreachableError, prv_calibrate


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    """The child's answer as a message: every outcome, errors included, goes back."""
    try:
        return {"ok": True, "result": prv_calibrate(**job)}
    except UnreachableError as exc:
        return {"ok": False, "unreachable": True, "error": str(exc)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


class CalibrationInterrupted(KeyboardInterrupt):
    """A calibration's child was stopped by an interrupt: the caller stops too, quietly."""


def _fork_worker(conn: Any, job: dict[str, Any]) -> None:
    """Entry point of a forked child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send(_run_job(job))
    finally:
        conn.close()


_RESULT_PREFIX = "dpsweep-prv-result "
_CHILD_CODE = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
               "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
               "from dpsweep.orchestrator.accounting.sandbox import _child_loop; _child_loop()")


def _child_loop() -> None:
    """Entry point of a fresh interpreter: one job per stdin line, one answer per stdout line,
    until stdin closes (the parent exited or let it go)."""
    for line in sys.stdin:
        message = _run_job(json.loads(line))
        sys.stdout.write(_RESULT_PREFIX + json.dumps(message) + "\n")
        sys.stdout.flush()


@dataclass(frozen=True)
class ChildOutcome:
    result: dict[str, Any] | None
    reason: str | None = None
    timed_out: bool = False
    #: the child failed to start or died: says nothing about this question, so not cached
    transient: bool = False
    unreachable: bool = False
    #: the child was stopped by an interrupt (killed by the parent leaving, or by SIGINT)
    interrupted: bool = False


def _start_method() -> str:
    """"fork" when this process has exactly one OS thread, else a fresh interpreter.

    Forking is cheap (nothing to re-import) and safe when no other thread can hold a lock the
    child needs; with threads (Ray, torch, OpenBLAS pools) only a fresh interpreter is safe.
    That interpreter is started with subprocess rather than multiprocessing's "spawn", which
    would re-run the caller's main script (a script without a __main__ guard would recurse, a
    Ray worker would re-import Ray). Linux shows every thread in /proc/self/task; elsewhere
    fork is not trusted.
    """
    if not sys.platform.startswith("linux"):
        return "subprocess"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "subprocess"
    return "fork" if threads == 1 else "subprocess"


def _outcome(msg: dict[str, Any]) -> ChildOutcome:
    if not msg.get("ok"):
        return ChildOutcome(None, f"the PRV accountant failed ({msg.get('error')}); RDP used",
                            unreachable=bool(msg.get("unreachable")))
    return ChildOutcome(msg["result"])


def prv_in_child(job: dict[str, Any], timeout_s: float) -> ChildOutcome:
    """Run the PRV calibration in a child process, killed at the time bound."""
    if _start_method() == "fork":
        return _prv_in_fork(job, timeout_s)
    return _prv_in_subprocess(job, timeout_s)


def _prv_in_fork(job: dict[str, Any], timeout_s: float) -> ChildOutcome:
    ctx = multiprocessing.get_context("fork")
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fork_worker, args=(send_end, job), name="dpsweep-prv",
                       daemon=True)
    try:
        proc.start()
    except Exception as exc:
        recv_end.close()
        return ChildOutcome(None, f"the PRV accountant could not be started in a child process "
                                  f"({type(exc).__name__}: {exc}); RDP used", transient=True)
    finally:
        send_end.close()  # so a child that dies without answering reads as EOF here
    try:
        if not recv_end.poll(None if math.isinf(timeout_s) else timeout_s):
            return _timed_out(timeout_s)
        try:
            msg = recv_end.recv()
        except EOFError:
            proc.join(5)
            return _died(f"code {proc.exitcode}",
                         interrupted=proc.exitcode == -signal.SIGINT)
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        recv_end.close()
    return _outcome(msg)


class _Interpreter:
    """A fresh interpreter that answers PRV jobs for as long as it lives.

    Started once and reused: its start and imports cost about 0.5 s here, a job 0.01-0.3 s, and
    a sweep's precompute asks two dozen. One job at a time; one that outlives its time bound or
    dies takes the interpreter with it (killed, never reused), so the bound holds as with a
    child per job."""

    def __init__(self) -> None:
        self.stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, json.dumps(sys.path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        except BaseException:
            self.stderr.close()
            raise
        self.pending = b""
        #: set by :meth:`cancel` (another thread): the job's end is an interrupt, not a failure
        self.cancelled = False

    def cancel(self) -> None:
        """Stop the job now: the asking thread reads EOF and reports an interrupt."""
        self.cancelled = True
        try:
            self.proc.kill()
        except OSError:
            pass

    def ask(self, job: dict[str, Any], timeout_s: float) -> tuple[ChildOutcome, bool]:
        """The outcome, and whether this interpreter may answer another job."""
        deadline = math.inf if math.isinf(timeout_s) else time.monotonic() + timeout_s
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return self._died(), False
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(_RESULT_PREFIX):
                    return _outcome(json.loads(text[len(_RESULT_PREFIX):])), True
            wait = None if math.isinf(deadline) else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return _timed_out(timeout_s), False
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                continue  # the deadline is checked above
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return self._died(), False
            self.pending += chunk

    def _died(self) -> ChildOutcome:
        try:
            code = self.proc.wait(5)
        except Exception:
            code = None
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        interrupted = self.cancelled or code == -signal.SIGINT or bool(
            lines and lines[-1].strip() == "KeyboardInterrupt")
        return _died(f"code {code}: {lines[-1]}" if lines else f"code {code}",
                     interrupted=interrupted)

    def close(self, *, kill: bool) -> None:
        """Let it go: stdin closed (it exits on EOF), or killed (a job still running)."""
        try:
            if kill:
                self.proc.kill()
            elif self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self.stderr.close()


#: Interpreters waiting for a job (at most one per thread that asked at once), this process's,
#: kept only inside :func:`keep_interpreters` (depth in ``_KEEP``).
_IDLE: list[_Interpreter] = []
_IDLE_LOCK = threading.Lock()
_IDLE_OWNER = os.getpid()
_KEEP = 0
#: Interpreters running a job now (any thread's), so an interrupt can stop them.
_BUSY: set[_Interpreter] = set()


def _close_idle() -> None:
    with _IDLE_LOCK:
        idle = list(_IDLE) if os.getpid() == _IDLE_OWNER else []
        _IDLE.clear()
    for child in idle:
        child.close(kill=False)


atexit.register(_close_idle)


@contextlib.contextmanager
def keep_interpreters() -> Iterator[None]:
    """Keep PRV child interpreters for the next job while inside (a sweep's budget precompute:
    two dozen jobs); outside, each job's interpreter exits after its answer, so none outlives
    the work that asked for it."""
    global _KEEP
    with _IDLE_LOCK:
        _KEEP += 1
    try:
        yield
    except BaseException:
        _cancel_busy()  # an interrupt or an error: jobs still running serve nobody
        raise
    finally:
        with _IDLE_LOCK:
            _KEEP -= 1
            last = _KEEP == 0
        if last:
            _close_idle()


def _cancel_busy() -> None:
    """Kill every interpreter of this process that is running a job; the threads that asked
    get an interrupted outcome."""
    with _IDLE_LOCK:
        busy = list(_BUSY) if os.getpid() == _IDLE_OWNER else []
    for child in busy:
        child.cancel()


def _prv_in_subprocess(job: dict[str, Any], timeout_s: float) -> ChildOutcome:
    with _IDLE_LOCK:
        child = _IDLE.pop() if _IDLE and os.getpid() == _IDLE_OWNER else None
    if child is None:
        try:
            child = _Interpreter()
        except OSError as exc:
            return ChildOutcome(None, f"the PRV accountant could not be started in a child "
                                      f"process ({type(exc).__name__}: {exc}); RDP used",
                                transient=True)
    with _IDLE_LOCK:
        _BUSY.add(child)
    try:
        outcome, reusable = child.ask(job, timeout_s)
    except BaseException:
        child.close(kill=True)
        raise
    finally:
        with _IDLE_LOCK:
            _BUSY.discard(child)
    if not reusable:
        child.close(kill=True)
        return outcome
    with _IDLE_LOCK:
        keep = _KEEP > 0 and os.getpid() == _IDLE_OWNER and not child.cancelled
        if keep:
            _IDLE.append(child)
    if not keep:
        child.close(kill=False)
    return outcome


def _timed_out(timeout_s: float) -> ChildOutcome:
    return ChildOutcome(None, f"the PRV accountant did not finish within {timeout_s:g} s; RDP "
                              "used", timed_out=True)


def _died(detail: str, *, interrupted: bool = False) -> ChildOutcome:
    if interrupted:
        return ChildOutcome(None, "the PRV accountant was stopped by an interrupt",
                            transient=True, interrupted=True)
    return ChildOutcome(None, f"the PRV accountant's process exited ({detail}) without an "
                              "answer; RDP used", transient=True)
