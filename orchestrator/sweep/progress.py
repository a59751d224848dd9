"""What a sweep shows while it runs: progress bars with an ETA (tqdm, on stderr) for the budget
precompute, the trials and the after-search jobs; ``--quiet`` turns them off."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm


class _NullBar:
    """What ``progress`` yields with --quiet: a bar that shows nothing."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix_str(self, text: str) -> None:
        del text

    def write(self, text: str) -> None:
        del text


@contextmanager
def progress(*, total: int, desc: str, quiet: bool) -> Iterator[Any]:
    """A progress bar with ETA on stderr (tqdm), or nothing with --quiet."""
    if quiet or total == 0:
        yield _NullBar()
        return
    bar = tqdm(total=total, desc=desc, unit="trial" if desc == "trials" else "it",
               dynamic_ncols=True, file=sys.stderr)
    try:
        yield bar
    finally:
        bar.close()
