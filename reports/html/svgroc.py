"""The ROC figure as inline SVG: with a dozen or more curves, colours and dashes alone do not
tell them apart, so each curve names itself on hover (a ``<title>``: trial, epsilon, series,
peak layer × attack, TPR at 1% and 0.1% FPR) and thickens under the pointer. A wide invisible
stroke under each line is what the pointer hits, so a 1.3 px line need not be found exactly.
No script and no external file: the page stays one offline file, and the same data give the
same bytes. The same SVG is written next to the page as ``roc.svg``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpsweep.reports.html.fmt import esc
from dpsweep.reports.plots import PALETTE, RocCurve

WIDTH, HEIGHT = 900, 520
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 30, 46
#: The axes' decades, 1e-3 .. 1 on both: the low-FPR corner, where strong attacks show, is
#: what matters.
LOG_LO, LOG_HI = -3.0, 0.0
#: A TPR of 0 is drawn at this floor (a log axis has no 0).
TPR_FLOOR = 1e-4
#: The FPRs the text names (the headline for strong attacks), drawn as grey verticals.
LOW_FPRS = (0.01, 0.001)
#: The class of each curve's group (the Chromium test counts their titles).
CURVE_CLASS = "curve"
#: Width of the invisible stroke the pointer hits, in px.
HIT_PX = 9


def _x(value: float) -> float:
    span = WIDTH - LEFT - RIGHT
    return LEFT + (math.log10(value) - LOG_LO) / (LOG_HI - LOG_LO) * span


def _y(value: float) -> float:
    span = HEIGHT - TOP - BOTTOM
    return TOP + (1 - (math.log10(value) - LOG_LO) / (LOG_HI - LOG_LO)) * span


def tpr_at(curve: RocCurve, fpr: float) -> float:
    """The curve's TPR at ``fpr`` (the highest TPR among its points at or below that FPR)."""
    x, y = np.asarray(curve.fpr, dtype=float), np.asarray(curve.tpr, dtype=float)
    below = y[x <= fpr + 1e-12]
    return float(below.max()) if below.size else math.nan


def _frame(title: str) -> list[str]:
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="#fff" stroke="#999"/>',
             f'<text x="{LEFT + w / 2}" y="{TOP - 10}" text-anchor="middle" font-size="13">'
             f"{esc(title)}</text>"]
    for k in range(int(LOG_LO), int(LOG_HI) + 1):
        v = 10.0 ** k
        parts.append(f'<line x1="{_x(v):.1f}" x2="{_x(v):.1f}" y1="{TOP}" y2="{TOP + h}" '
                     f'stroke="#eee"/><line x1="{LEFT}" x2="{LEFT + w}" y1="{_y(v):.1f}" '
                     f'y2="{_y(v):.1f}" stroke="#eee"/><text x="{_x(v):.1f}" '
                     f'y="{TOP + h + 16}" text-anchor="middle" font-size="12">{v:g}</text>'
                     f'<text x="{LEFT - 6}" y="{_y(v) + 4:.1f}" text-anchor="end" '
                     f'font-size="12">{v:g}</text>')
    for fpr in LOW_FPRS:
        parts.append(f'<line x1="{_x(fpr):.1f}" x2="{_x(fpr):.1f}" y1="{TOP}" y2="{TOP + h}" '
                     f'stroke="#bbb"><title>FPR {fpr:g}</title></line>')
    parts.append(f'<polyline points="{_x(10 ** LOG_LO):.1f},{_y(10 ** LOG_LO):.1f} '
                 f'{_x(1):.1f},{_y(1):.1f}" stroke="grey" stroke-dasharray="2 3" fill="none">'
                 "<title>chance: TPR = FPR</title></polyline>")
    parts.append(f'<text x="{LEFT + w / 2}" y="{HEIGHT - 8}" text-anchor="middle" '
                 'font-size="13">false positive rate (log)</text>'
                 f'<text transform="translate(15 {TOP + h / 2}) rotate(-90)" '
                 'text-anchor="middle" font-size="13">true positive rate (log)</text>')
    return parts


def style_of(index: int) -> tuple[str, str]:
    """The colour and dash pattern of the ``index``-th curve, in the figure and its legend alike."""
    colour = PALETTE[index % len(PALETTE)]
    dash = ("", "6 3")[(index // len(PALETTE)) % 2]
    return colour, dash


def _curve(curve: RocCurve, *, index: int) -> str:
    fpr, tpr = np.asarray(curve.fpr, dtype=float), np.asarray(curve.tpr, dtype=float)
    keep = (fpr >= 10 ** LOG_LO) & np.isfinite(tpr)
    points = " ".join(f"{_x(a):.1f},{_y(max(b, TPR_FLOOR, 10 ** LOG_LO)):.1f}"
                      for a, b in zip(fpr[keep], tpr[keep], strict=True))
    colour, dash = style_of(index)
    at = "; ".join(f"TPR at {f:g} FPR {tpr_at(curve, f):.3f}" for f in LOW_FPRS)
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<g class="{CURVE_CLASS}"><title>{esc(curve.label)}\n{at}</title>'
            f'<polyline points="{points}" fill="none" stroke="transparent" '
            f'stroke-width="{HIT_PX}" pointer-events="stroke"/>'
            f'<polyline class="line" points="{points}" fill="none" stroke="{colour}" '
            f'stroke-width="1.4"{dashed}/></g>')


def roc_svg(curves: Sequence[RocCurve], *, title: str) -> str:
    """Every curve on log-log axes, each naming itself on hover."""
    parts = _frame(title) + [_curve(c, index=i) for i, c in enumerate(curves)]
    return (f'<svg class="roc" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" font-family="DejaVu Sans, Helvetica, Arial, '
            'sans-serif">' + "".join(parts) + "</svg>")


def roc_legend(curves: Sequence[RocCurve]) -> str:
    """Each curve's colour and dash with its name, as HTML under the figure."""
    items = []
    for i, curve in enumerate(curves):
        colour, dash = style_of(i)
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        items.append(f'<span class="sw"><svg width="26" height="10" aria-hidden="true">'
                     f'<line x1="1" x2="25" y1="5" y2="5" stroke="{colour}" stroke-width="2"'
                     f"{dashed}/></svg> {esc(curve.label)}</span>")
    return f'<p class="legend roclegend">{"".join(items)}</p>'
