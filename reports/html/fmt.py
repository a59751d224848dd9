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

from core.modes import INVALID_TAG
from reports.html.records import _float
from reports.store import not_covered

CONTRADICTED_TAG = "claim contradicted by audit"
REPLAYABLE_TAG = "replayable: not releasable"
NOT_COVERED_TAG = "not covered by epsilon"
TEST_NOTE = "reported, not used to choose"
#: Most trial ids listed in one table cell before "… (n in all)".
MAX_IDS = 12
NOT_COVERED = frozenset(not_covered())


def _num(value: Any, digits: int = 4) -> str:
    x = _float(value)
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def _sci(value: Any) -> str:
    x = _float(value)
    return "—" if math.isnan(x) else f"{x:.3g}"


def _int(value: Any) -> str:
    x = _float(value)
    return "—" if math.isnan(x) else str(int(x))


def _ci(point: Any, lo: Any, hi: Any, digits: int = 3) -> str:
    if math.isnan(_float(point)):
        return "—"
    if _float(lo) == _float(point) == _float(hi):
        return _num(point, digits)
    return (f"{_num(point, digits)} <span class=\"ci\">[{_num(lo, digits)}, "
            f"{_num(hi, digits)}]</span>")


def schedule_text(*, sigma: float, schedule: Sequence[dict[str, Any]]) -> str:
    """sigma for a constant schedule; sigma_0 and the phases (sigma x steps) for a decay."""
    if len(schedule) <= 1:
        return _num(sigma)
    phases = [f"{_float(p.get('noise_multiplier')):.3f}×{_int(p.get('steps'))}"
              for p in schedule[:4]]
    more = f", … ({len(schedule)} phases)" if len(schedule) > 4 else ""
    return f"σ0 {_num(sigma)}; " + ", ".join(phases) + more


def _e(value: Any) -> str:
    return html.escape(str(value))


def _h(label: str, column: str | None = None) -> str:
    """A table header; columns the epsilon does not cover carry the label."""
    text = _e(label)
    if column is not None and column in NOT_COVERED:
        text += f'<br><span class="nc">{NOT_COVERED_TAG}</span>'
    return text


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *,
           row_classes: Sequence[str] | None = None, cls: str = "") -> str:
    """An HTML table; headers (from :func:`_h`) and cells are pre-escaped HTML."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        rc = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{rc}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    klass = f' class="{cls}"' if cls else ""
    return (f'<div class="scroll"><table{klass}><thead><tr>{head}</tr></thead><tbody>\n'
            + "\n".join(body) + "\n</tbody></table></div>")


def _badge(text: str, kind: str = "invalid") -> str:
    return f'<span class="{kind}">{_e(text)}</span>'


def flags_html(row: pd.Series | dict[str, Any]) -> str:
    """DP validity as the report shows it everywhere: valid / epsilon claim invalid, plus
    claim contradicted by audit and replayable: not releasable where they apply."""
    parts = ["valid" if bool(row["dp_valid"]) else _badge(INVALID_TAG)]
    if bool(row.get("audit_contradicts", False)):
        parts.append(_badge(CONTRADICTED_TAG))
    if not bool(row.get("release_safe", True)):
        parts.append(_badge(REPLAYABLE_TAG, "replay"))
    return " ".join(parts)


def flags_text(row: pd.Series | dict[str, Any]) -> str:
    """:func:`flags_html` as plain text (CSVs)."""
    parts = ["valid" if bool(row["dp_valid"]) else INVALID_TAG]
    if bool(row.get("audit_contradicts", False)):
        parts.append(CONTRADICTED_TAG)
    if not bool(row.get("release_safe", True)):
        parts.append(REPLAYABLE_TAG)
    return "; ".join(parts)


def _image(path: Path, alt: str, *, covered: bool = False) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    label = "" if covered else f' <span class="nc">{NOT_COVERED_TAG}</span>'
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_e(alt)}">'
            f"<figcaption>{_e(alt)} (<code>{_e(path.name)}</code>, data in "
            f"<code>{_e(path.stem)}.csv</code>){label}</figcaption></figure>")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _note(text: str) -> str:
    return f'<p class="note">{text}</p>'


def _ids(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:MAX_IDS])
    return _e(shown + (f", … ({len(ids)} in all)" if len(ids) > MAX_IDS else ""))


def _eps_tag(eps: float) -> str:
    """The file-name form of a target: front_eps3.png, front_eps0.5.png."""
    return f"eps{eps:g}"


def _hyperparameters(row: pd.Series, params: dict[str, Any], *,
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
    return _e(", ".join(parts) or "—")


def _section_table(rows: Sequence[tuple[str, str]]) -> str:
    return ('<table class="facts"><tbody>\n'
            + "\n".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
            + "\n</tbody></table>")
