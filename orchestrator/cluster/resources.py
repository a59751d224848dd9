"""What this machine or a cluster's nodes offer a trial, and the refusal of a trial none can run.

Read without starting Ray or importing torch (affinity mask, cgroup quotas, the NVIDIA driver's
listing), so :func:`check_resources` answers before Ray starts; on a cluster it checks the alive
nodes ``orchestrator.cluster.connection`` described. A trial asking for more CPUs, GPUs or
memory than any single node has would wait forever in Ray's queue.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpsweep.core.checks import number, whole
from dpsweep.core.errors import UserInputError

#: The node address of a local Ray (kept on loopback by ``connection.start_local``).
LOOPBACK_V4 = "127.0.0.1"
ADDRESS_FIELD = "--address"
NVIDIA_SMI_TIMEOUT_S = 5.0
MIB = 1024 * 1024
_CUDA_NONE = frozenset({"", "-1", "NoDevFiles"})


@dataclass(frozen=True)
class NodeResources:
    """What one node offers a trial (a trial must fit on one node)."""

    node_id: str
    address: str
    cpus: float
    gpus: float
    memory_mb: float


@dataclass(frozen=True)
class ClusterInfo:
    """The Ray this process is attached to: its GCS address and its alive nodes."""

    address: str
    local: bool
    token_auth: bool
    nodes: tuple[NodeResources, ...]
    session_dir: str  # this machine's Ray session: logs, sockets, spilled objects


def machine_resources() -> NodeResources:
    """This machine as Ray would see it, read without starting Ray or importing torch."""
    return NodeResources(node_id="", address=LOOPBACK_V4, cpus=float(usable_cpus()),
                         gpus=float(_visible_gpus()), memory_mb=_memory_mb())


def check_resources(*, cpus_per_trial: float, gpus_per_trial: float,
                    memory_per_trial_mb: float | None, max_concurrent: int,
                    info: ClusterInfo | None) -> int:
    """Refuse a trial that no single node can ever run (Ray would queue it forever).

    Checked against this machine when ``info`` is None (before Ray starts), else against the
    alive nodes of ``info``. Returns how many trials can run at once: ``max_concurrent``, or
    fewer when the nodes hold fewer (not an error: the rest wait their turn).
    """
    nodes: Sequence[NodeResources] = info.nodes if info is not None else (machine_resources(),)
    where = ("this machine" if info is None else
             "one node of this cluster" if not info.local else "the local Ray")
    number(cpus_per_trial, field="resources.cpus_per_trial", low=0.0)
    number(gpus_per_trial, field="resources.gpus_per_trial", low=0.0)
    if memory_per_trial_mb is not None:
        number(memory_per_trial_mb, field="resources.memory_per_trial_mb", low=0.0)
    whole(max_concurrent, field="sweep.max_concurrent_trials", low=1)
    if gpus_per_trial > 1 and gpus_per_trial != int(gpus_per_trial):
        raise UserInputError(field="resources.gpus_per_trial", value=gpus_per_trial,
                             allowed="a fraction below 1 or a whole number (Ray's rule)")
    if not nodes:
        raise UserInputError(field=ADDRESS_FIELD, value=info.address if info else None,
                             allowed="a cluster with at least one alive node")
    most_cpus = max(n.cpus for n in nodes)
    if cpus_per_trial > most_cpus:
        raise UserInputError(field="resources.cpus_per_trial", value=cpus_per_trial,
                             allowed=f"at most {most_cpus:g}, the CPUs of {where}"
                                     f"{_listing(nodes, 'cpus')}")
    most_gpus = max(n.gpus for n in nodes)
    if gpus_per_trial > 0 and most_gpus == 0:
        raise UserInputError(field="resources.gpus_per_trial", value=gpus_per_trial,
                             allowed=f"0: {where} has no GPU{_gpu_hint(info)}")
    if gpus_per_trial > most_gpus:
        raise UserInputError(field="resources.gpus_per_trial", value=gpus_per_trial,
                             allowed=f"at most {most_gpus:g}, the GPUs of {where}"
                                     f"{_listing(nodes, 'gpus')}")
    memory = memory_per_trial_mb or 0.0
    most_memory = max(n.memory_mb for n in nodes)
    if memory > most_memory:
        raise UserInputError(field="resources.memory_per_trial_mb", value=memory_per_trial_mb,
                             allowed=f"at most {most_memory:.0f} MB, the memory of {where}")
    per_node = [_fits(n, cpus=cpus_per_trial, gpus=gpus_per_trial, memory_mb=memory)
                for n in nodes]
    if not any(per_node):
        wanted = {"cpus_per_trial": cpus_per_trial, "gpus_per_trial": gpus_per_trial}
        raise UserInputError(field="resources", value=wanted,
                             allowed="a trial that fits on one node: no node has "
                                     f"{cpus_per_trial:g} CPUs and {gpus_per_trial:g} GPUs "
                                     f"together{_listing(nodes, 'cpus', 'gpus')}")
    return max(1, min(max_concurrent, sum(per_node)))


def check_device(*, device: str, gpus_per_trial: float, info: ClusterInfo | None) -> None:
    """Refuse ``resources.device = 'cuda'`` where no GPU is (this machine when ``info`` is
    None, else the cluster's nodes), and without a GPU share per trial: Ray hides every GPU
    from a trial that asked for none."""
    if device != "cuda":
        return
    nodes: Sequence[NodeResources] = info.nodes if info is not None else (machine_resources(),)
    if not any(n.gpus > 0 for n in nodes):
        where = ("this machine" if info is None else
                 "this cluster" if not info.local else "the local Ray")
        raise UserInputError(field="resources.device", value=device,
                             allowed=f"'cpu' or 'auto': {where} has no GPU{_gpu_hint(info)}")
    if gpus_per_trial == 0:
        raise UserInputError(field="resources.gpus_per_trial", value=0.0,
                             allowed="> 0 when resources.device = 'cuda' (a GPU per trial, "
                                     "or a share of one such as 0.25: Ray hides every GPU "
                                     "from a trial that asks for none)")


def check_config_resources(resources: Any, *, max_concurrent: int,
                           info: ClusterInfo | None) -> int:
    """A config's ``[resources]`` (typed loosely: the config imports nothing from here)
    through :func:`check_device` and :func:`check_resources`; how many trials run at once."""
    check_device(device=resources.device, gpus_per_trial=resources.gpus_per_trial, info=info)
    return check_resources(cpus_per_trial=resources.cpus_per_trial,
                           gpus_per_trial=resources.gpus_per_trial,
                           memory_per_trial_mb=resources.memory_per_trial_mb or None,
                           max_concurrent=max_concurrent, info=info)


def _fits(node: NodeResources, *, cpus: float, gpus: float, memory_mb: float) -> int:
    """How many such trials this node holds at once."""
    counts = [math.floor(have / want + 1e-9) for have, want in
              ((node.cpus, cpus), (node.gpus, gpus), (node.memory_mb, memory_mb)) if want > 0]
    return min(counts) if counts else sys.maxsize  # asks for nothing: max_concurrent limits


def _listing(nodes: Sequence[NodeResources], *keys: str) -> str:
    if len(nodes) < 2:
        return ""
    parts = [", ".join(f"{getattr(n, k):g} {k}" for k in keys) + f" on {n.address}"
             for n in nodes]
    return " (nodes: " + "; ".join(parts) + ")"


def _gpu_hint(info: ClusterInfo | None) -> str:
    if info is not None:
        return ""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return f" visible (CUDA_VISIBLE_DEVICES={cvd!r})"
    return " (no NVIDIA driver found)"


def usable_cpus() -> int:
    """CPUs this process may run on: affinity mask and cgroup quota, whichever is smaller."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)


def _cgroup_cpu_quota() -> float | None:
    """CPU quota of this process's cgroup (v2 cpu.max or v1 cfs quota), None when unlimited."""
    v2 = Path("/sys/fs/cgroup/cpu.max")
    v1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else float(quota) / float(period)
        if v1[0].is_file() and v1[1].is_file():
            quota_us = float(v1[0].read_text())
            return None if quota_us <= 0 else quota_us / float(v1[1].read_text())
    except (OSError, ValueError):
        return None
    return None


def _visible_gpus() -> int:
    """NVIDIA GPUs this process may use, honouring CUDA_VISIBLE_DEVICES, without torch."""
    physical = _physical_gpus()
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return physical
    visible = 0
    for item in cvd.split(","):
        if item.strip() in _CUDA_NONE:  # CUDA stops at the first invalid entry
            break
        visible += 1
    return min(visible, physical)


def _physical_gpus() -> int:
    """GPUs the NVIDIA driver lists: /proc first (no process), else ``nvidia-smi -L``.

    Without either, a torch the program already imported is asked (never imported for this).
    """
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False,
                                 timeout=NVIDIA_SMI_TIMEOUT_S).stdout
        except (OSError, subprocess.TimeoutExpired):
            return 0
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    # torch._C: torch really imported (``torch`` alone may be a lazy stub that would import it)
    torch = sys.modules.get("torch") if "torch._C" in sys.modules else None
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.device_count())
    return 0


def _memory_mb() -> float:
    """Physical memory, or the cgroup limit when lower."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for limit in (Path("/sys/fs/cgroup/memory.max"),
                  Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, float(text))
        break
    return total / MIB
