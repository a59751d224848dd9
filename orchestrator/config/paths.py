"""The form of a path the user typed (``--out``, ``RUN_DIR``, ``CONFIG``), checked before use.

The kernel refuses a name component over NAME_MAX bytes or a path over PATH_MAX with
ENAMETOOLONG, which ``pathlib``'s ``exists()`` and ``mkdir()`` raise as a bare ``OSError`` from
deep inside a command; an empty ``--out`` would silently mean the default directory (or the
working directory); a line break in a directory name breaks every line-based log and tool that
prints it. Checked where a path enters (the command line, the Python API), each is one
:class:`UserInputError` naming the flag, before anything is read or written.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from pathlib import Path
from typing import Any

from dpsweep.core.errors import UserInputError

#: Linux's limits: bytes in one name component, and in a whole path with its terminating NUL.
NAME_MAX = 255
PATH_MAX = 4096
#: Characters of a long path an error message shows.
SHOWN_CHARS = 60


def shown(text: str) -> str:
    """A path as an error message shows it: whole when short, else its head, its tail (where
    the name typed usually is) and its length."""
    if len(text) <= SHOWN_CHARS:
        return text
    half = SHOWN_CHARS // 2
    return f"{text[:half]}...{text[-half:]} ({len(text)} characters)"


def check_path_form(value: Any, *, field: str, creates: bool = True) -> Path:
    """``value`` as a Path when its form is usable, else one error naming ``field``: not
    empty, every component <= NAME_MAX bytes, < PATH_MAX bytes once absolute, no NUL, and for
    a path dpsweep ``creates`` no line break. Whether it exists or may be written is for the
    command to check."""
    if not isinstance(value, (str, os.PathLike)):
        raise UserInputError(field=field, value=value, allowed="a path")
    text = os.fspath(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text:
        raise UserInputError(field=field, value=text,
                             allowed="a non-empty path (an empty one would silently mean the "
                                     "default or the working directory; leave the flag out "
                                     "for the default)")
    if "\0" in text or (creates and any(c in text for c in "\n\r")):
        raise UserInputError(field=field, value=shown(text),
                             allowed="a path without line breaks or NUL characters (a line "
                                     "break in a directory name breaks every log and tool "
                                     "that prints it)")
    encoded = os.fsencode(text)
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > NAME_MAX:
        raise UserInputError(field=field, value=shown(text),
                             allowed=f"a path whose every component is at most {NAME_MAX} "
                                     f"bytes (the file system's limit; one here has {longest})")
    absolute = len(os.fsencode(os.path.abspath(text)))
    if absolute >= PATH_MAX:
        raise UserInputError(field=field, value=shown(text),
                             allowed=f"a path shorter than {PATH_MAX} bytes once absolute "
                                     f"(the system's limit; this one has {absolute})")
    return Path(text)


#: What a user's code folder ships to workers without: data, environments, caches and runs
#: (Ray's ``excludes`` patterns, ``orchestrator.cluster.connection``); the folder's Python files
#: are what workers import.
CODE_EXCLUDES = (".git", ".venv", "venv", "__pycache__", "*.npz", "*.npy", "*.parquet", "*.csv",
                 "*.pt", "*.safetensors", "*.gz", "*.zip", "*.tar", "*.png", "*.jpg", "*.jpeg")


def check_arg_files(args: dict[str, Any], *, code_dir: str) -> None:
    """Refuse a ``[model] args`` value naming, relative to the code folder, a file the workers'
    copy of that folder leaves out (a weights file beside the factory): the factory would find
    it here and fail on every worker. An absolute path is every worker's to read."""
    for key, value in args.items():
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str) or not item or Path(item).expanduser().is_absolute():
                continue
            found = Path(code_dir) / item
            if found.is_file() and any(fnmatch.fnmatch(found.name, p) for p in CODE_EXCLUDES):
                raise UserInputError(
                    field=f"model.args.{key}", value=item,
                    allowed=f"an absolute path every worker can read ({found}; on a cluster, "
                            f"shared storage): workers import from a copy of model.code_dir "
                            f"that leaves out data and weight files ({', '.join(CODE_EXCLUDES)})")


def resolve_paths(cfg: Any, base: Path) -> Any:
    """A built config (``orchestrator.config.Config``, typed loosely: that module imports this
    one) with absolute data paths and code folder, so a run directory's config means the same
    files wherever it is resumed from; the code folder defaults to ``base`` when a factory is
    set. Every path's form is checked first, and the code folder must exist: one line naming
    ``model.code_dir`` here, before anything is written, Ray started or user code imported."""
    def absolute(value: str) -> str:
        return str((base / Path(value).expanduser()).resolve()) if value else value

    d, m = cfg.data, cfg.model
    for key, value in (("data.path", d.path), ("data.public_path", d.public_path),
                       ("data.data_dir", d.data_dir), ("model.code_dir", m.code_dir)):
        if value:  # a name the system cannot take is refused here, not as an OSError later
            check_path_form(value, field=key, creates=False)
    if m.code_dir and not (m.factory or d.factory):  # shipped to every worker, used by none
        raise UserInputError(field="model.code_dir", value=m.code_dir,
                             allowed="'' unless model.factory or data.factory is set (the "
                                     "folder their modules are imported from)")
    code_dir = m.code_dir or (str(base.resolve()) if m.factory or d.factory else "")
    code_dir = absolute(code_dir)
    if code_dir:
        check_code_dir(code_dir)
        check_arg_files(dict(m.args), code_dir=code_dir)
    return dataclasses.replace(
        cfg, data=dataclasses.replace(d, path=absolute(d.path),
                                      public_path=absolute(d.public_path)),
        model=dataclasses.replace(m, code_dir=code_dir))


def check_code_dir(code_dir: str) -> None:
    """One line naming ``model.code_dir`` unless it is an existing, readable folder: a missing
    one would otherwise reach Ray's upload (a traceback, after the run directory was written)."""
    folder = Path(code_dir)
    try:
        missing = "does not exist" if not folder.exists() else (
            "is not a folder" if not folder.is_dir() else "")
        if not missing and not os.access(folder, os.R_OK | os.X_OK):
            missing = "cannot be read"
    except OSError as exc:
        missing = f"cannot be read ({exc.strerror})"
    if missing:
        raise UserInputError(field="model.code_dir", value=code_dir,
                             allowed=f"an existing folder to import the factories from (this "
                                     f"one {missing}; a relative path is the config file's "
                                     f"folder's)")


#: The flag a Ray cluster's address is given as.
ADDRESS_FLAG = "--address"
#: Where Ray (and dpsweep) read a cluster address when --address is left out.
RAY_ADDRESS_ENV = "RAY_ADDRESS"


def check_address_form(value: str | None, *, field: str = ADDRESS_FLAG) -> None:
    """Refuse an address given but empty (or blank): it would silently mean a local Ray, or
    RAY_ADDRESS's cluster, instead of the cluster the user meant to name. None (the flag left
    out) is the default and passes; whether a given address answers is ``orchestrator.cluster``'s
    check."""
    if value is not None and not str(value).strip():
        raise UserInputError(field=field, value=value,
                             allowed="host:port of a running Ray cluster's GCS, 'auto' or "
                                     "ray://host:port (an empty address would silently run on "
                                     "a local Ray; leave the flag out for that)")


def address_of(address: str | None, *, field: str = ADDRESS_FLAG) -> str | None:
    """``--address`` (refused when given empty), else RAY_ADDRESS, else None (a local Ray)."""
    check_address_form(address, field=field)
    return address or os.environ.get(RAY_ADDRESS_ENV) or None
