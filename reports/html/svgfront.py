"""The Pareto front as inline SVG: every point names itself on hover (a ``<title>``: trial,
method, hyperparameters, validation and test accuracy, peak MIA with its interval), and front
points carry labels placed so that no two overlap, nor cover a marker. No script and no
external file: the page works offline, and the same data give the same bytes.

Labels are placed greedily, most accurate point first, at the first free spot of a fixed ring
of candidates; a label with no free spot is left off (its point still names itself on hover).
Text widths are estimated from the character count with a margin wide enough for DejaVu
Sans, Helvetica and Arial, which the page's CSS names; the Chromium test measures them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dpsweep.reports.html.fmt import TEST_NOTE, esc, flags_text
from dpsweep.reports.pareto import ACC, ACC_HI, ACC_LO, MIA, MIA_HI, MIA_LO, MIA_UPPER
from dpsweep.reports.plots import Baseline

WIDTH, HEIGHT = 900, 500
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 14, 46
#: Label text size in px, and the width of one character as a fraction of it (a margin over
#: DejaVu Sans's widest digits, 0.636).
LABEL_PX = 12
CHAR_EM = 0.68
MARKER_R = 5
#: Where a label may go, relative to its point (dx, dy of the text's left baseline), nearest
#: first; each ring further out is the same directions scaled.
_DIRECTIONS = ((1, -1), (1, 1), (-1, -1), (-1, 1), (0, -1.4), (0, 1.6))
_RINGS = (8, 20, 34)
#: The class every point label carries (the Chromium test measures them).
LABEL_CLASS = "plabel"
_NICE_STEPS = (0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.2, 0.25, 0.5)
MAX_TICKS = 9


@dataclass(frozen=True)
class Box:
    x0: float
    y0: float
    x1: float
    y1: float

    def hits(self, other: Box) -> bool:
        return not (self.x1 <= other.x0 or other.x1 <= self.x0 or self.y1 <= other.y0
                    or other.y1 <= self.y0)


def _span(values: Sequence[float], *, pad: float) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = min(finite), max(finite)
    return max(0.0, lo - pad), min(1.0, hi + pad)


def _ticks(lo: float, hi: float) -> list[float]:
    step = next((s for s in _NICE_STEPS if (hi - lo) / s <= MAX_TICKS), _NICE_STEPS[-1])
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 6) for i in range(int((hi - first) / step + 1e-9) + 1)]


class _Axes:
    """Data to pixels, on the plot area."""

    def __init__(self, *, x: tuple[float, float], y: tuple[float, float]) -> None:
        self.x, self.y = x, y
        self.w, self.h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(self, value: float) -> float:
        return LEFT + (value - self.x[0]) / (self.x[1] - self.x[0]) * self.w

    def py(self, value: float) -> float:
        return TOP + (1 - (value - self.y[0]) / (self.y[1] - self.y[0])) * self.h

    @property
    def area(self) -> Box:
        return Box(LEFT, TOP, LEFT + self.w, TOP + self.h)


def _frame(ax: _Axes, *, half: float, eps: float, delta: float) -> list[str]:
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{ax.w}" height="{ax.h}" fill="#fff" '
             'stroke="#999"/>']
    if math.isfinite(half):
        x0, x1 = ax.px(max(ax.x[0], 0.5 - half)), ax.px(min(ax.x[1], 0.5 + half))
        parts.append(f'<rect x="{x0:.1f}" y="{TOP}" width="{x1 - x0:.1f}" height="{ax.h}" '
                     f'fill="#9e9e9e" fill-opacity="0.18"><title>chance band 0.5 ± {half:.3f}: '
                     "peaks here cannot be told from guessing at this audit's size</title>"
                     "</rect>")
    for t in _ticks(*ax.x):
        parts.append(f'<line x1="{ax.px(t):.1f}" x2="{ax.px(t):.1f}" y1="{TOP}" '
                     f'y2="{TOP + ax.h}" stroke="#eee"/><text x="{ax.px(t):.1f}" '
                     f'y="{TOP + ax.h + 16}" text-anchor="middle" font-size="12">{t:g}</text>')
    for t in _ticks(*ax.y):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + ax.w}" y1="{ax.py(t):.1f}" '
                     f'y2="{ax.py(t):.1f}" stroke="#eee"/><text x="{LEFT - 6}" '
                     f'y="{ax.py(t) + 4:.1f}" text-anchor="end" font-size="12">{t:g}</text>')
    parts.append(f'<text x="{LEFT + ax.w / 2}" y="{HEIGHT - 8}" text-anchor="middle" '
                 'font-size="13">peak MIA accuracy over layers × attacks, 95% interval '
                 f"(lower is better); ε = {eps:g}, δ = {delta:g}</text>")
    parts.append(f'<text transform="translate(15 {TOP + ax.h / 2}) rotate(-90)" '
                 'text-anchor="middle" font-size="13">validation accuracy, 95% Wilson interval'
                 "</text>")
    return parts


def _tooltip(row: pd.Series, *, hyper: str) -> str:
    flags = flags_text(row)
    return (f"{esc(row['trial_id'])}\n{esc(row['method'])} ({esc(row['series'])}), ε = "
            f"{float(row['target_epsilon']):g}\n{hyper}\nvalidation accuracy "
            f"{row[ACC]:.3f} [{row[ACC_LO]:.3f}, {row[ACC_HI]:.3f}]\ntest accuracy "
            f"{float(row['test_accuracy']):.3f} ({TEST_NOTE})\npeak MIA {row[MIA]:.3f} "
            f"[{row[MIA_LO]:.3f}, {row[MIA_HI]:.3f}], upper bound "
            f"{float(row.get(MIA_UPPER, math.nan)):.3f}" + (f"\n{esc(flags)}" if flags else ""))


def _point(ax: _Axes, row: pd.Series, *, colour: str, faded: bool, hyper: str) -> str:
    x, y = ax.px(row[MIA]), ax.py(row[ACC])
    op = ' opacity="0.35"' if faded else ""
    bars = (f'<line x1="{ax.px(row[MIA_LO]):.1f}" x2="{ax.px(row[MIA_HI]):.1f}" y1="{y:.1f}" '
            f'y2="{y:.1f}"/><line x1="{x:.1f}" x2="{x:.1f}" y1="{ax.py(row[ACC_LO]):.1f}" '
            f'y2="{ax.py(row[ACC_HI]):.1f}"/>')
    if not bool(row["dp_valid"]):
        r = MARKER_R
        marker = (f'<path d="M{x - r:.1f},{y - r:.1f}L{x + r:.1f},{y + r:.1f}M{x - r:.1f},'
                  f'{y + r:.1f}L{x + r:.1f},{y - r:.1f}" stroke-width="2.5"/>')
    else:
        fill = "#fff" if not bool(row["release_safe"]) else colour
        marker = (f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{MARKER_R}" fill="{fill}" '
                  'stroke-width="1.5"/>')
    return (f'<g class="pt" stroke="{colour}"{op}><title>{_tooltip(row, hyper=hyper)}</title>'
            f'<g stroke-opacity="0.5">{bars}</g>{marker}</g>')


def _place(ax: _Axes, text: str, *, x: float, y: float, taken: list[Box]) -> Box | None:
    """The first free spot for ``text`` near (x, y), or None."""
    width, ascent, descent = CHAR_EM * LABEL_PX * len(text) + 2, LABEL_PX, 0.3 * LABEL_PX
    for ring in _RINGS:
        for dx, dy in _DIRECTIONS:
            left = x + dx * ring if dx >= 0 else x + dx * ring - width
            if dx == 0:
                left = x - width / 2
            base = y + dy * ring + (ascent / 2 if dy > 0 else 0)
            box = Box(left, base - ascent, left + width, base + descent)
            inside = (box.x0 >= ax.area.x0 and box.x1 <= ax.area.x1 and box.y0 >= ax.area.y0
                      and box.y1 <= ax.area.y1)
            if inside and not any(box.hits(b) for b in taken):
                return box
    return None


def _labels(ax: _Axes, labelled: pd.DataFrame, *, points: pd.DataFrame) -> tuple[list[str], int]:
    """Non-overlapping labels for ``labelled`` (most accurate first), and how many were left
    off. Every marker of ``points`` is an obstacle."""
    taken = [Box(ax.px(m) - MARKER_R - 1, ax.py(a) - MARKER_R - 1, ax.px(m) + MARKER_R + 1,
                 ax.py(a) + MARKER_R + 1) for m, a in zip(points[MIA], points[ACC], strict=True)]
    parts, skipped = [], 0
    for _, row in labelled.sort_values(ACC, ascending=False, kind="stable").iterrows():
        text = str(row["trial_id"])
        x, y = ax.px(row[MIA]), ax.py(row[ACC])
        box = _place(ax, text, x=x, y=y, taken=taken)
        if box is None:
            skipped += 1
            continue
        taken.append(box)
        parts.append(f'<text class="{LABEL_CLASS}" x="{box.x0 + 1:.1f}" '
                     f'y="{box.y1 - 0.3 * LABEL_PX:.1f}" font-size="{LABEL_PX}">{esc(text)}'
                     "</text>")
    return parts, skipped


def _polyline(ax: _Axes, xs: np.ndarray, ys: np.ndarray, **style: str) -> str:
    pts = " ".join(f"{ax.px(a):.1f},{ax.py(b):.1f}" for a, b in zip(xs, ys, strict=True))
    attrs = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in style.items())
    return f'<polyline points="{pts}" fill="none" {attrs}/>'


def front_svg(points: pd.DataFrame, *, study_fronts: Mapping[str, set[str]],
              overall: pd.DataFrame, colours: Mapping[str, str], hyper: Mapping[str, str],
              half: float, baseline: Baseline | None, eps: float,
              delta: float) -> tuple[str, int]:
    """The figure at one target, and how many front labels were left off for want of room."""
    xs = [*points[MIA_LO], *points[MIA_HI], *([0.5 - half, 0.5 + half] if math.isfinite(half)
                                              else [])]
    ys = [*points[ACC_LO], *points[ACC_HI]]
    if baseline is not None:
        xs += [baseline.peak_mia]
        ys += [baseline.val_accuracy]
    ax = _Axes(x=_span(xs, pad=0.01), y=_span(ys, pad=0.02))
    parts = _frame(ax, half=half, eps=eps, delta=delta)
    if not overall.empty:
        stair = overall.sort_values([MIA, ACC], kind="stable")
        parts.append(_polyline(ax, stair[MIA].to_numpy(),
                               np.maximum.accumulate(stair[ACC].to_numpy()), stroke="#bbb",
                               stroke_width="9", stroke_opacity="0.6", stroke_linejoin="round"))
    for series, ids in sorted(study_fronts.items()):
        own = points[points["trial_id"].isin(ids)].sort_values(MIA, kind="stable")
        if len(own) > 1:
            parts.append(_polyline(ax, own[MIA].to_numpy(), own[ACC].to_numpy(),
                                   stroke=colours.get(series, "#333"), stroke_width="1.5"))
    if baseline is not None and math.isfinite(baseline.val_accuracy):
        y = ax.py(baseline.val_accuracy)
        parts.append(f'<g><title>non-private baseline: validation accuracy '
                     f"{baseline.val_accuracy:.3f}, peak MIA {baseline.peak_mia:.3f}</title>"
                     f'<line x1="{LEFT}" x2="{LEFT + ax.w}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#000" stroke-dasharray="6 4"/>'
                     + (f'<text x="{ax.px(baseline.peak_mia):.1f}" y="{y + 6:.1f}" '
                        'text-anchor="middle" font-size="18">★</text>'
                        if math.isfinite(baseline.peak_mia) else "") + "</g>")
    on_front = set().union(*study_fronts.values(), overall["trial_id"]) if study_fronts else \
        set(overall["trial_id"])
    for _, row in points.iterrows():
        parts.append(_point(ax, row, colour=colours.get(row["series"], "#333"),
                            faded=row["trial_id"] not in on_front,
                            hyper=hyper.get(row["trial_id"], "")))
    labels, skipped = _labels(ax, points[points["trial_id"].isin(on_front)], points=points)
    parts += labels
    return (f'<svg class="front" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" font-family="DejaVu Sans, Helvetica, Arial, '
            f'sans-serif">' + "".join(parts) + "</svg>"), skipped


def legend_html(colours: Mapping[str, str]) -> str:
    """The series' colours and the markers' meaning, as HTML under the figure."""
    swatches = "".join(f'<span class="sw"><i style="background:{c}"></i>{esc(s)}</span>'
                       for s, c in sorted(colours.items()))
    return f'<p class="legend">{swatches}</p>'
