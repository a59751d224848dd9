"""Every generated table of README.md and docs/ is current. (The Python API example of
docs/api.md runs a sweep: tests/system/test_api_example.py.)"""

from __future__ import annotations

from bench.docgen.blocks import stale


def test_generated_tables_are_current() -> None:
    assert stale() == [], "run `python -m bench.docgen`"
