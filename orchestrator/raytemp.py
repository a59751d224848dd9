"""A local Ray's temp dir: private to this user, and short enough for Ray's Unix sockets.

Ray puts its session (logs, Unix sockets, spilled objects) below the temp dir ``ray.init`` is
given. Two things go wrong with the default: anyone on the machine can read or replace what
lies under /tmp/ray, and under a long TMPDIR Ray's plasma store socket path exceeds what a Unix
socket allows, which Ray reports (``validate_socket_filename failed``) only after the run
directory exists. :func:`private_temp_dir` answers both; :func:`check_temp_dir` is the part
that can be checked before anything is written.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from dpsweep.core.errors import UserInputError

PRIVATE_TEMP_PREFIX = "dpsweep-ray-"
#: Ray's temp dir inside the private folder.
RAY_TEMP_SUBDIR = "ray"
#: Random characters ``tempfile.mkdtemp`` adds to its prefix.
MKDTEMP_RANDOM = 8
#: The longest Unix socket path a local Ray makes below its temp dir (Ray 2.60,
#: ``ray/_private/node.py``): ``/session_<%Y-%m-%d_%H-%M-%S_%f>_<pid>`` (the pid up to 7 digits,
#: Linux's largest pid_max being 4194304) then ``/sockets/plasma_store`` (the raylet's socket is
#: shorter), with room for Ray's ``.N`` suffix on a name already taken.
RAY_SOCKET_TAIL = (len("/session_2026-01-01_00-00-00_000000_") + 7 + len("/sockets/plasma_store")
                   + len(".99"))
#: A Unix socket path's bytes, the terminating NUL excluded (Ray's own limit: 107, macOS 103).
UNIX_SOCKET_MAX = (104 if sys.platform == "darwin" else 108) - 1
#: Short folders for Ray's private temp dir when TMPDIR's path is too long for its sockets.
SHORT_TEMP_BASES = ("/tmp", "/var/tmp")


def private_temp_dir() -> Path:
    """Ray's temp dir inside a directory only this user can enter.

    Ray makes every directory of its session mode 0777 and writes logs, Unix sockets and
    spilled objects (trial data) there; under /tmp/ray any local user could read the logs and
    spilled objects or replace the socket files. A 0700 parent closes all of that at once.
    It sits in TMPDIR, or in a short /tmp when TMPDIR's path would make Ray's sockets longer
    than a Unix socket path may be (:func:`check_temp_dir`).
    """
    base = check_temp_dir()
    root = base / f"{PRIVATE_TEMP_PREFIX}{os.getuid()}"
    with suppress(FileExistsError):
        root.mkdir(mode=0o700)
    info = os.lstat(root)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)):
        # Someone else's (or a loosened) directory under that name: never use it.
        root = Path(tempfile.mkdtemp(prefix=PRIVATE_TEMP_PREFIX, dir=base))
    return root / RAY_TEMP_SUBDIR


def check_temp_dir() -> Path:
    """Where a local Ray's private temp dir goes: TMPDIR's folder (``tempfile.gettempdir``)
    when Ray's longest socket path under it fits a Unix socket, else the first of
    ``SHORT_TEMP_BASES`` this user can write that fits; creates nothing.

    Ray checks its plasma store's socket path against the limit only after the run directory
    exists: a TMPDIR of about 40 characters broke every run, half-written. Refused (TMPDIR)
    when no folder fits."""
    usual = Path(tempfile.gettempdir())
    if _fits_ray_sockets(usual):
        return usual
    for base in map(Path, SHORT_TEMP_BASES):
        if base.is_dir() and os.access(base, os.W_OK | os.X_OK) and _fits_ray_sockets(base):
            return base
    longest = (UNIX_SOCKET_MAX - RAY_SOCKET_TAIL - len(_private_root_name())
               - len(f"//{RAY_TEMP_SUBDIR}"))
    raise UserInputError(field="TMPDIR", value=str(usual),
                         allowed=f"a folder whose path takes at most {longest} bytes (Ray's "
                                 f"Unix sockets below it must fit in {UNIX_SOCKET_MAX}), or a "
                                 f"writable {' or '.join(SHORT_TEMP_BASES)}")


def _private_root_name() -> str:
    """The longest name :func:`private_temp_dir` gives its folder (its own, or mkdtemp's)."""
    return PRIVATE_TEMP_PREFIX + "x" * max(len(str(os.getuid())), MKDTEMP_RANDOM)


def _fits_ray_sockets(base: Path) -> bool:
    temp = base / _private_root_name() / RAY_TEMP_SUBDIR
    return len(os.fsencode(temp)) + RAY_SOCKET_TAIL <= UNIX_SOCKET_MAX
