"""Generated documentation: the method tables of README.md and docs/methods.md.

The tables come from the methods' declarations (``trainables/methods/``), the search spaces as
sweeps build them (``search_spaces.searched_params``) and the results schema
(``reports/store.py``), so they cannot drift from the code: ``python -m orchestrator.docgen``
rewrites the marked blocks, and a test fails when a committed file differs from what this module
generates.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from core.modes import INVALID_TAG

ROOT = Path(__file__).resolve().parent.parent
#: (file, block name) pairs this module owns.
BLOCKS = (("README.md", "methods"), ("docs/methods.md", "methods"),
          ("docs/methods.md", "hyperparameters"), ("docs/results.md", "columns"))


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def methods_table() -> str:
    from trainables.methods import METHODS

    lines = ["| method | what it does | modes (epsilon claim) | source |", "|---|---|---|---|"]
    for name, cls in sorted(METHODS.items()):
        modes = ", ".join(f"`{m.name}` ({'valid' if m.dp_valid else INVALID_TAG})"
                          for m in cls.modes)
        lines.append(f"| `{name}` | {_escape(cls.summary)} | {modes} | "
                     f"{_escape(cls.citation or 'baseline')} |")
    return "\n".join(lines)


def hyperparameter_tables() -> str:
    from search_spaces import SPACES, searched_params
    from trainables.methods import METHODS

    out = []
    for name, cls in sorted(METHODS.items()):
        searched = searched_params(name) if name in SPACES else frozenset()
        out += [f"### `{name}`", "", _escape(cls.argument), "",
                "| parameter | default | allowed | scale | modes | presets | searched | meaning |",
                "|---|---|---|---|---|---|---|---|"]
        for row in cls.declaration().table():
            out.append(" | ".join([
                f"| `{row['name']}`", f"`{row['default']}`", _escape(row["allowed"]),
                row["log"] or "linear", row["modes"], _escape(row["presets"]) or "-",
                "yes" if row["name"] in searched else "",
                _escape(row["doc"]) + " |"]))
        out.append("")
    return "\n".join(out).rstrip()


def columns_table() -> str:
    from reports.store import COLUMNS

    lines = ["| column | type | covered by epsilon | meaning |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {c.dtype} | {'yes' if c.covered else '**no**'} | "
              f"{_escape(c.meaning)} |" for name, c in COLUMNS.items()]
    return "\n".join(lines)


GENERATORS = {"methods": methods_table, "hyperparameters": hyperparameter_tables,
              "columns": columns_table}


def _pattern(block: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{block} -->\n)(?:.*?\n)?(<!-- /generated:{block} -->)",
                      re.DOTALL)


def render(text: str, block: str) -> str:
    """``text`` with the marked ``block`` replaced by freshly generated content."""
    pattern = _pattern(block)
    if not pattern.search(text):
        raise ValueError(f"no <!-- generated:{block} --> block")
    return pattern.sub(lambda m: m.group(1) + GENERATORS[block]() + "\n" + m.group(2), text)


def stale(root: Path = ROOT) -> list[str]:
    """Files whose generated blocks differ from what the code generates now."""
    out = []
    for rel, block in BLOCKS:
        text = (root / rel).read_text()
        if render(text, block) != text:
            out.append(f"{rel} [{block}]")
    return out


def main() -> int:
    for rel, block in BLOCKS:
        path = ROOT / rel
        path.write_text(render(path.read_text(), block))
    print("regenerated: " + ", ".join(f"{rel} [{b}]" for rel, b in BLOCKS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
