"""The house's floors: imports run only downward, and no code block is written twice.

orchestrator -> search_spaces -> trainables -> reports -> core: a module may import its own
package and the packages below it, never above (function-level imports included, since an
import inside a function is still an arrow). ``core`` imports none of them.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOORS = ("orchestrator", "search_spaces", "trainables", "reports", "core")
#: Lines a repeated block must span to count (the review tool's threshold).
BLOCK = 6


def _modules() -> list[Path]:
    return sorted(p for pkg in FLOORS for p in (ROOT / pkg).rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        names = [n.removeprefix("dpsweep.") for n in names]
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in FLOORS}
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_upward(path: Path) -> None:
    own = path.relative_to(ROOT).parts[0]
    rank = FLOORS.index(own)
    upward = sorted(p for p in _imported_packages(path) if FLOORS.index(p) < rank)
    assert not upward, f"{path.relative_to(ROOT)} imports {upward}, above {own}"


def _normalised_lines(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#") or re.fullmatch(r"[\)\]\}:,]+", text):
            continue
        out.append((i, text))
    return out


def test_no_six_line_block_is_repeated_outside_tests() -> None:
    seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path in _modules() + sorted((ROOT / "bench").glob("*.py")):
        lines = _normalised_lines(path)
        for k in range(len(lines) - BLOCK + 1):
            window = tuple(text for _, text in lines[k:k + BLOCK])
            if all(t.startswith(("from ", "import ", '"""', "@")) or len(t) < 12
                   or t == "if TYPE_CHECKING:" for t in window):
                continue  # import lists and decorators are not logic
            seen[window].append(f"{path.relative_to(ROOT)}:{lines[k][0]}")
    repeated = {w: places for w, places in seen.items()
                if len({p.split(':')[0] for p in places}) > 1 or len(places) > 1}
    assert not repeated, "\n".join(f"{places}: {w[0]} ..." for w, places in
                                   list(repeated.items())[:5])


def test_every_run_directory_file_name_is_written_once() -> None:
    """A run's and a trial's file names live in core/layout.py and nowhere else outside tests:
    a reader and a writer cannot disagree on a name."""
    from dpsweep.core import layout

    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)
             and "." in v}
    assert {"privacy.json", "results.parquet", "state.pt"} <= names
    where: dict[str, set[str]] = defaultdict(set)
    for path in _modules() + sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                where[node.value].add(str(path.relative_to(ROOT)))
    # the export's loader travels alone (torch only), so it states the name it reads itself;
    # that copy is held equal to layout's here
    from dpsweep.orchestrator.release import loader

    assert loader.MODEL_FILE == layout.EXPORT_MODEL
    where[layout.EXPORT_MODEL].discard("orchestrator/release/loader.py")
    assert {n: sorted(p) for n, p in where.items() if p != {"core/layout.py"}} == {}
    assert set(where) == names
