"""Generated documentation: the method tables of README.md and docs/methods.md, the stock
models' speed table of docs/stock-models.md.

The tables come from the methods' declarations (``trainables/methods/``), the search spaces as
sweeps build them (``search_spaces.searched_params``), the results schema
(``reports/store.py``) and the committed benchmark results (``bench/results/step_time_stock.json``,
written by ``python -m bench.step_time --stock``), so they cannot drift from the code or the
measurements: ``python -m orchestrator.docgen`` rewrites the marked blocks, and a test fails when
a committed file differs from what this module generates.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.modes import INVALID_TAG

ROOT = Path(__file__).resolve().parent.parent
#: (file, block name) pairs this module owns.
BLOCKS = (("README.md", "methods"), ("docs/methods.md", "methods"),
          ("docs/methods.md", "hyperparameters"), ("docs/results.md", "columns"),
          ("docs/stock-models.md", "stock_speed"))
#: The stock models' speed table: its page and the results it is generated from.
STOCK_DOC = "docs/stock-models.md"
STOCK_RESULTS = "bench/results/step_time_stock.json"


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


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _stock_row(name: str, row: Mapping[str, Any], notes: list[str]) -> str:
    """One model's table row; refusals, failures and Opacus's n/a go to ``notes``."""
    def note(text: str) -> str:
        notes.append(text)
        return f"[{len(notes)}]"

    time, ours, theirs = row["time"], row["ours"], row["opacus"]
    cells = [f"`{name}`", _escape(row["input"]), f"{row['trainable_params']:,}",
             _ms(time["non-private"]["median_s"])]
    for entry, info, who in (("dpsweep DP-SGD", ours, "dpsweep"),
                             ("opacus hooks", theirs, "Opacus")):
        if entry in time:
            t = time[entry]
            cells.append(f"{_ms(t['median_s'])} ({t['ratio_per_round_median']:.2f}x)")
        else:
            cells.append(f"{info['status']} " + note(f"`{name}`, {who} {info['status']}: "
                                                     f"{_escape(info['reason'])}"))
    setup = [f"fix: {', '.join(theirs['fixed'])}"] if theirs.get("fixed") else []
    if theirs.get("functorch"):
        setup.append(f"torch.func on {', '.join(theirs['functorch'])}")
    ours_fix = [f"fix: {', '.join(ours['fixed'])}"] if ours.get("fixed") else []
    cells.append(_escape("; ".join([ours.get("path") or "-", *ours_fix])))
    cells.append(_escape("; ".join(setup)) or "as built")
    vs = row["ours_vs_opacus"]
    if vs is None:
        cells += ["-", "-"]
    else:
        cells += [f"**{vs['median']:.2f}** ({vs['q1']:.2f}-{vs['q3']:.2f})",
                  "yes" if row["within_target"] else "**no**"]
    return "| " + " | ".join(cells) + " |"


def stock_speed_markdown(payload: Mapping[str, Any]) -> str:
    """The stock models' table from a ``bench.step_time --stock`` results payload."""
    models = payload["models"]
    loads = [x for row in models.values() for x in row.get("load_average_before_after", [])]
    load = f"; 1-minute load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    lines = [f"{payload['date']}, commit `{payload['commit']}`; torch {payload['torch']}, "
             f"torchvision {payload['torchvision']}, Opacus {payload['opacus']}; "
             f"{payload['machine']}, {payload['threads']} torch threads{load}; "
             f"{payload['rounds']} interleaved rounds per model; whole run "
             f"{_duration(payload['wall_s'])} (`{STOCK_RESULTS}`).", "",
             "| model | input | trainable parameters | non-private ms | dpsweep DP-SGD ms "
             "(x non-private) | Opacus hooks ms (x non-private) | dpsweep per-example path "
             "| Opacus setup | dpsweep / Opacus hooks (IQR) | "
             f"<= {payload['target']}x |", "|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    lines += [_stock_row(name, models[name], notes) for name in payload.get("order", models)]
    if notes:
        lines.append("")
        lines += [f"- [{i}] {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)


def stock_speed_table() -> str:
    path = ROOT / STOCK_RESULTS
    if not path.is_file():
        return f"Not measured yet: `{STOCK_RESULTS}` is missing."
    return stock_speed_markdown(json.loads(path.read_text()))


GENERATORS = {"methods": methods_table, "hyperparameters": hyperparameter_tables,
              "columns": columns_table, "stock_speed": stock_speed_table}


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
