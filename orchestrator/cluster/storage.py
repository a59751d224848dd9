"""Whether every alive Ray node reads and writes the run directory (shared storage on a cluster).

A probe task pinned to each node reads a marker the driver wrote and writes its own file; a node
that cannot start it is an error within ``STORAGE_PROBE_TIMEOUT_S``, not a wait.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import suppress
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dpsweep.core.errors import UserInputError

STORAGE_PROBE_TIMEOUT_S = 60.0


def check_storage(run_dir: Path) -> int:
    """Every alive Ray node must read and write RUN_DIR (shared storage on a cluster).

    Bounded by STORAGE_PROBE_TIMEOUT_S: a node that cannot start the probe (no worker, dead
    node) is an error, not a wait. Returns the number of nodes that passed.
    """
    marker = Path(run_dir) / ".storage-probe"
    token = f"{socket.gethostname()}-{os.getpid()}-{time.time()}"
    marker.write_text(token)

    # Defined here so cloudpickle ships it by value (the modules it uses by name, all from the
    # standard library): a node need not have dpsweep installed to answer the probe.
    def probe(path: str, expected: str) -> str:
        p = Path(path)
        seen = p.read_text() if p.is_file() else None
        if seen != expected:
            raise RuntimeError(f"cannot read {path} on {socket.gethostname()}")
        w = p.with_name(f".probe-{socket.gethostname()}-{os.getpid()}")
        w.write_text("ok")
        w.unlink()
        return socket.gethostname()

    remote = ray.remote(num_cpus=0)(probe)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n["NodeID"], soft=False)).remote(str(marker), token) for n in nodes]
    try:
        passed = len(ray.get(refs, timeout=STORAGE_PROBE_TIMEOUT_S))
    except Exception as exc:
        for ref in refs:
            with suppress(ray.exceptions.RayError, ValueError):  # best effort: it may be done
                ray.cancel(ref, force=True)
        reason = (f"no answer within {STORAGE_PROBE_TIMEOUT_S:g} s"
                  if isinstance(exc, ray.exceptions.GetTimeoutError) else str(exc))
        raise UserInputError(field="RUN_DIR", value=str(run_dir),
                             allowed="a directory every Ray node can read and write (shared "
                                     f"storage on a cluster): {reason}") from None
    finally:
        marker.unlink(missing_ok=True)
    return passed
