"""Starting Ray for a sweep without anything but dpsweep's one line on the terminal.

* **A local Ray that times out** ("The current node timed out during startup": its raylet did
  not register with the GCS within Ray's fixed 30 s, which a loaded machine, or one still
  reaping a killed run's processes, can exceed) is started once more with a longer wait
  (:data:`RETRY_EXTRA_WAIT_S` on top of Ray's own), then refused with one line
  (:class:`RayStartFailed`, exit 2). ``run_sweep`` removes the run directory it had just made
  for a first ``run`` (:func:`discarded_if_ray_fails`): nothing half-made is left to ``resume``.
* **Ray's native (C++) warnings** while it probes or joins a cluster (``InvalidAuthToken`` for a
  missing or wrong token) are written on file descriptor 2 below Python; :func:`native_stderr`
  catches them in a file while that code runs and hands them to this module's log when the
  step fails (the failure's one line says why), or back to stderr when it succeeds.
* **Ray Tune's own warnings** that repeat what dpsweep records (:data:`QUIET_RAY_LOGGERS`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ray._private import services

from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.cluster import connection
from dpsweep.orchestrator.rundir import _undo_create

_log = logging.getLogger(__name__)

#: What Ray raises when a local node's raylet does not register in time (Ray 2.60,
#: ``ray/_private/node.py``, a fixed ``raylet_start_wait_time_s = 30``).
START_TIMEOUT_TEXT = "timed out during startup"
#: Ray's own wait for the raylet, which no setting changes.
RAY_START_WAIT_S = 30
#: How much longer the retry waits for the raylet (:func:`_patient_get_node`).
RETRY_EXTRA_WAIT_S = 60.0
#: A pause before the retry, for the first attempt's processes to go.
RETRY_PAUSE_S = 2.0
#: Ray's loggers whose warnings repeat what dpsweep records: Tune's result grid reading its own
#: per-trial JSON files at the end of ``fit`` ("Failed to fetch metrics", e.g. a file cut short
#: by a full disk): the results live in dpsweep's store, never in Tune's files.
QUIET_RAY_LOGGERS = ("ray.tune.analysis.experiment_analysis",)


class RayStartFailed(UserInputError):
    """A local Ray that did not come up, twice: one line, exit 2, nothing kept."""


def quiet_ray_loggers() -> None:
    """Ray's warnings that would precede dpsweep's one line go to the log only (errors stay)."""
    for name in QUIET_RAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def is_start_timeout(exc: BaseException) -> bool:
    return START_TIMEOUT_TEXT in str(exc)


def start_ray(*, address: str | None, quiet: bool, runtime_env: dict[str, Any] | None,
              pause_s: float = RETRY_PAUSE_S) -> Any:
    """Join the cluster at ``address`` (its native warnings caught, :func:`native_stderr`), or
    start a local Ray, once more with a longer wait when it times out; returns the
    ``ClusterInfo``."""
    quiet_ray_loggers()
    if address:
        with native_stderr():
            return connection.connect(address, quiet=quiet, runtime_env=runtime_env)
    try:
        return connection.start_local(num_cpus=None, num_gpus=None, quiet=quiet,
                                   runtime_env=runtime_env)
    except Exception as exc:
        if not is_start_timeout(exc):
            raise
        _log.warning("local Ray timed out during startup; starting it again with a longer wait")
    time.sleep(pause_s)
    try:
        with _patient_get_node(RETRY_EXTRA_WAIT_S):
            return connection.start_local(num_cpus=None, num_gpus=None, quiet=quiet,
                                       runtime_env=runtime_env)
    except Exception as exc:
        if not is_start_timeout(exc):
            raise
        _log.warning("local Ray timed out during startup again: %s", exc)
        wait = f"{RAY_START_WAIT_S} s, then {RAY_START_WAIT_S + RETRY_EXTRA_WAIT_S:.0f} s"
        raise RayStartFailed(
            field="local Ray", value="timed out during startup twice",
            allowed=f"a Ray node that starts within {wait} (this machine may be overloaded or "
                    "still stopping a previous run's Ray processes: try again when it is "
                    "less busy)") from None


@contextlib.contextmanager
def _patient_get_node(extra_s: float) -> Iterator[None]:
    """Ray's wait for its raylet made longer by ``extra_s``: its loop asks
    ``services.get_node`` until 30 s have passed; the first call here keeps asking (a
    ``RuntimeError`` while the node is not registered) for up to ``extra_s`` itself."""
    original: Callable[..., Any] = services.get_node
    deadline: list[float] = []

    def patient(*args: Any, **kwargs: Any) -> Any:
        if not deadline:
            deadline.append(time.monotonic() + extra_s)
        while True:
            try:
                return original(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() >= deadline[0]:
                    raise
                time.sleep(0.5)

    services.get_node = patient
    try:
        yield
    finally:
        services.get_node = original


@contextlib.contextmanager
def native_stderr() -> Iterator[None]:
    """File descriptor 2 into a temporary file while the block runs (Ray's C++ code writes its
    warnings there, below ``sys.stderr``); what was written goes to this module's log when the
    block raises, and back to stderr when it does not."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        capture = tempfile.TemporaryFile(mode="w+b")
    except (OSError, ValueError):  # no fd 2 to redirect (an embedding host): nothing to catch
        yield
        return
    failed = False
    try:
        os.dup2(capture.fileno(), 2)
        yield
    except BaseException:
        failed = True
        raise
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        capture.seek(0)
        text = capture.read().decode(errors="replace")
        capture.close()
        if text and failed:
            _log.info("Ray's native output: %s", text.strip())
        elif text:
            sys.stderr.write(text)


@contextlib.contextmanager
def discarded_if_ray_fails(path: Path) -> Iterator[None]:
    """Remove the run directory a first ``run`` makes in the block when its Ray does not start
    (:class:`RayStartFailed`): it holds only the config and the manifest, nothing to resume.
    The outermost folder the run creates goes, or only the contents of an empty ``path``."""
    top = Path(path)
    while not top.parent.exists():
        top = top.parent
    existed = Path(path).exists()
    try:
        yield
    except RayStartFailed:
        _undo_create(Path(path) if existed else top, keep=existed)
        raise
