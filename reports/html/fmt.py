"""HTML helpers every section shares: numbers with their intervals, escaped tables, the flag
badges (DP validity, contradicted, replayable) and the "not covered by epsilon" label, so each
reads the same wherever it appears.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dpsweep.core.modes import INVALID_TAG
from dpsweep.reports.html.records import as_float
from dpsweep.reports.store import not_covered

CONTRADICTED_TAG = "claim contradicted by audit"
REPLAYABLE_TAG = "replayable: not releasable"
NOT_COVERED_TAG = "not covered by epsilon"
TEST_NOTE = "reported, not used to choose"
#: Most trial ids listed in one table cell before "… (n in all)".
MAX_IDS = 12
NOT_COVERED = frozenset(not_covered())


def num_text(value: Any, digits: int = 4) -> str:
    """A number with ``digits`` decimals; "—" for NaN or a non-number."""
    x = as_float(value)
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def sci_text(value: Any) -> str:
    """A number in three significant digits (p-values, deltas); "—" for NaN."""
    x = as_float(value)
    return "—" if math.isnan(x) else f"{x:.3g}"


def int_text(value: Any) -> str:
    """A count as an integer; "—" for NaN."""
    x = as_float(value)
    return "—" if math.isnan(x) else str(int(x))


def ci_text(point: Any, lo: Any, hi: Any, digits: int = 3) -> str:
    """A point estimate with its interval in a ``ci`` span; the point alone when the
    interval is degenerate."""
    if math.isnan(as_float(point)):
        return "—"
    if as_float(lo) == as_float(point) == as_float(hi):
        return num_text(point, digits)
    return (f"{num_text(point, digits)} <span class=\"ci\">[{num_text(lo, digits)}, "
            f"{num_text(hi, digits)}]</span>")


def schedule_text(*, sigma: float, schedule: Sequence[dict[str, Any]]) -> str:
    """sigma for a constant schedule; sigma_0 and the phases (sigma x steps) for a decay."""
    if len(schedule) <= 1:
        return num_text(sigma)
    phases = [f"{as_float(p.get('noise_multiplier')):.3f}×{int_text(p.get('steps'))}"
              for p in schedule[:4]]
    more = f", … ({len(schedule)} phases)" if len(schedule) > 4 else ""
    return f"σ0 {num_text(sigma)}; " + ", ".join(phases) + more


def esc(value: Any) -> str:
    """Any value as HTML-escaped text: every cell and caption goes through it."""
    return html.escape(str(value))


def th(label: str, column: str | None = None) -> str:
    """A table header; columns the epsilon does not cover carry the label."""
    text = esc(label)
    if column is not None and column in NOT_COVERED:
        text += f'<br><span class="nc">{NOT_COVERED_TAG}</span>'
    return text


def table_html(headers: Sequence[str], rows: Iterable[Sequence[str]], *,
               row_classes: Sequence[str] | None = None, cls: str = "") -> str:
    """An HTML table; headers (from :func:`th`) and cells are pre-escaped HTML."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        rc = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{rc}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    klass = f' class="{cls}"' if cls else ""
    return (f'<div class="scroll"><table{klass}><thead><tr>{head}</tr></thead><tbody>\n'
            + "\n".join(body) + "\n</tbody></table></div>")


def badge(text: str, kind: str = "invalid") -> str:
    """A flag as a coloured span (``kind`` is its CSS class)."""
    return f'<span class="{kind}">{esc(text)}</span>'


def flags_html(row: pd.Series | dict[str, Any]) -> str:
    """DP validity as the report shows it everywhere: valid / epsilon claim invalid, plus
    claim contradicted by audit and replayable: not releasable where they apply."""
    parts = ["valid" if bool(row["dp_valid"]) else badge(INVALID_TAG)]
    if bool(row.get("audit_contradicts", False)):
        parts.append(badge(CONTRADICTED_TAG))
    if not bool(row.get("release_safe", True)):
        parts.append(badge(REPLAYABLE_TAG, "replay"))
    return " ".join(parts)


def flags_text(row: pd.Series | dict[str, Any]) -> str:
    """:func:`flags_html` as plain text (CSVs)."""
    parts = ["valid" if bool(row["dp_valid"]) else INVALID_TAG]
    if bool(row.get("audit_contradicts", False)):
        parts.append(CONTRADICTED_TAG)
    if not bool(row.get("release_safe", True)):
        parts.append(REPLAYABLE_TAG)
    return "; ".join(parts)


def figure_html(path: Path, alt: str, *, covered: bool = False, wide: bool = False) -> str:
    """A PNG embedded as a data URI with its caption and CSV name; labelled "not covered
    by epsilon" unless ``covered``. A ``wide`` figure keeps its own size and scrolls, so its
    printed numbers are never scaled below their size (a heat map's cells)."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    label = "" if covered else f' <span class="nc">{NOT_COVERED_TAG}</span>'
    cls = ' class="wide scroll"' if wide else ""
    return (f'<figure{cls}><img src="data:image/png;base64,{data}" alt="{esc(alt)}">'
            f"<figcaption>{esc(alt)} (<code>{esc(path.name)}</code>, data in "
            f"<code>{esc(path.stem)}.csv</code>){label}</figcaption></figure>")


def count_text(n: int, noun: str) -> str:
    """"1 trial", "3 trials": ``noun`` in the plural unless ``n`` is 1."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def note_html(text: str) -> str:
    """A short explanatory paragraph; ``text`` is pre-escaped HTML."""
    return f'<p class="note">{text}</p>'


def ids_text(ids: Sequence[str]) -> str:
    """Trial ids for one cell, cut at ``MAX_IDS`` with the total."""
    shown = ", ".join(ids[:MAX_IDS])
    return esc(shown + (f", … ({len(ids)} in all)" if len(ids) > MAX_IDS else ""))


def eps_tag(eps: float) -> str:
    """The file-name form of a target: front_eps3.png, front_eps0.5.png."""
    return f"eps{eps:g}"


def hyperparameters_text(row: pd.Series, params: dict[str, Any], *,
                         prepared: Collection[str] = ()) -> str:
    """The trial's method hyperparameters (mode, lr, clip_norm, ...), the ``prepared`` ones
    (filled from public data, not chosen) left out."""
    values = {k: v for k, v in params.items()
              if k not in prepared and isinstance(v, (int, float, str, bool))}
    if not values:
        values = {c[3:]: row[c] for c in row.index if c.startswith("hp_")
                  and not (isinstance(row[c], float) and math.isnan(row[c]))}
    parts = []
    for key in sorted(values):
        value = values[key]
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        parts.append(f"{key}={text}")
    return esc(", ".join(parts) or "—")


def facts_table(rows: Sequence[tuple[str, str]]) -> str:
    """A two-column label/value table (the run header); values are pre-escaped HTML."""
    return ('<table class="facts"><tbody>\n'
            + "\n".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
            + "\n</tbody></table>")
