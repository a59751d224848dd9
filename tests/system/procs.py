"""What the system tests read from ``/proc``: every live process's name, parent and session,
to find what a sweep or a cluster left behind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcInfo:
    name: str
    state: str
    parent: int
    session: int


def processes() -> dict[int, ProcInfo]:
    """pid -> its ``/proc/<pid>/stat`` fields; processes that exit while being read are skipped."""
    found: dict[int, ProcInfo] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        close = stat.rindex(")")  # the name may hold spaces and parentheses
        fields = stat[close + 2:].split()
        found[int(entry.name)] = ProcInfo(name=stat[stat.index("(") + 1:close], state=fields[0],
                                          parent=int(fields[1]), session=int(fields[3]))
    return found
