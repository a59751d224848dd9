"""The Python API example (docs/api.md) runs as written, and every generated table of README.md and
docs/ is current."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator.docgen import stale

ROOT = Path(__file__).resolve().parents[2]
API_DOC = "docs/api.md"


def _python_block() -> str:
    """The first fenced Python block of docs/api.md."""
    return re.search(r"```python\n(.*?)```", (ROOT / API_DOC).read_text(), re.DOTALL).group(1)


def test_python_api_example_runs(tmp_path: Path, capsys) -> None:
    exec(compile(_python_block(), API_DOC, "exec"), {"OUT": tmp_path})
    out = capsys.readouterr().out
    assert "val_accuracy" in out and "epsilon" in out
    assert (tmp_path / "release" / "privacy_statement.json").is_file()


def test_generated_tables_are_current() -> None:
    assert stale() == [], "run `python -m orchestrator.docgen`"
