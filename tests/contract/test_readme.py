"""The README's Python API example runs as written, and its generated tables are current."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator.docgen import stale

ROOT = Path(__file__).resolve().parents[2]


def _python_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_python_api_example_runs(tmp_path: Path, capsys) -> None:
    exec(compile(_python_block(), "README.md", "exec"), {"OUT": tmp_path})
    out = capsys.readouterr().out
    assert "val_accuracy" in out and "epsilon" in out
    assert (tmp_path / "release" / "privacy_statement.json").is_file()


def test_generated_tables_are_current() -> None:
    assert stale() == [], "run `python -m orchestrator.docgen`"
