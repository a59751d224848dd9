"""The Python API example (docs/api.md) runs as written: a real sweep, its report and a release,
so a system test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API_DOC = "docs/api.md"


def _python_block() -> str:
    """The first fenced Python block of docs/api.md."""
    found = re.search(r"```python\n(.*?)```", (ROOT / API_DOC).read_text(), re.DOTALL)
    assert found is not None, f"{API_DOC} has no Python block"
    return found.group(1)


def test_python_api_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(_python_block(), API_DOC, "exec"), {"OUT": tmp_path})
    out = capsys.readouterr().out
    assert "val_accuracy" in out and "epsilon" in out
    assert (tmp_path / "release" / "privacy_statement.json").is_file()
