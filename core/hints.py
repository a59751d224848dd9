"""Reading a cache file as a hint: bounded, non-blocking, never trusted, never fatal.

A cache (the engine's plans, the budget's calibrations, the audit's reference models, LM-DP-SGD's
layer risks) only saves work, so nothing found in one may fail, hang or change a trial. A file is
read here only if it is a regular file (opened without following a final symlink and without
blocking: a FIFO or a device in its place is seen, not waited on), no larger than the caller's
bound; JSON is parsed with a bounded nesting depth. Anything else is a miss: logged once per file
and reason, then rebuilt by the caller, which validates what it does get into typed values.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from typing import Any

logger = logging.getLogger(__name__)

#: The largest JSON cache entry read (plans and calibrations are a few KiB).
MAX_JSON_BYTES = 1 << 22
#: The deepest nesting of lists and objects a JSON cache entry may have.
MAX_JSON_DEPTH = 32
#: Bytes read per call while reading a hint.
_CHUNK = 1 << 20
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))
#: (path, reason) pairs already logged in this process.
_LOGGED: set[tuple[str, str]] = set()


def ignored(path: str | os.PathLike[str], reason: str) -> None:
    """Log once that the cache file ``path`` is ignored (and will be rebuilt) for ``reason``."""
    key = (str(path), reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning("cache file %s ignored and rebuilt: %s", path, reason)


def read_hint_bytes(path: str | os.PathLike[str], *, max_bytes: int) -> bytes | None:
    """The bytes of the regular file ``path`` (at most ``max_bytes``), or None: missing (a plain
    miss) or anything else (logged once): a symlink, FIFO, device or directory, unreadable,
    larger than the bound."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        ignored(path, f"cannot be opened as a regular file ({exc.strerror})")
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            ignored(path, "not a regular file")
            return None
        if info.st_size > max_bytes:
            ignored(path, f"{info.st_size} bytes, above the {max_bytes} a cache entry may have")
            return None
        parts, total = [], 0
        while chunk := os.read(fd, _CHUNK):
            parts.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                ignored(path, f"grew beyond the {max_bytes} bytes a cache entry may have")
                return None
        return b"".join(parts)
    except OSError as exc:
        ignored(path, f"unreadable ({exc.strerror})")
        return None
    finally:
        os.close(fd)


def _depth(value: Any) -> int:
    """Nesting depth of lists and dicts (iterative: no recursion on a crafted entry)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def read_json_hint(path: str | os.PathLike[str], *,
                   max_bytes: int = MAX_JSON_BYTES) -> Any | None:
    """The JSON value of the cache file ``path``, or None (missing, or ignored and logged: see
    :func:`read_hint_bytes`; not UTF-8, not JSON, nested deeper than ``MAX_JSON_DEPTH``)."""
    data = read_hint_bytes(path, max_bytes=max_bytes)
    if data is None:
        return None
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        ignored(path, f"not a JSON entry ({type(exc).__name__})")
        return None
    if _depth(value) > MAX_JSON_DEPTH:
        ignored(path, f"nested deeper than {MAX_JSON_DEPTH}")
        return None
    return value

