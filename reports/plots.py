"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Every function takes plain data, writes one PNG and returns its path. PNGs carry no software
or date metadata, so the same data gives byte-identical files and a rebuilt report is
identical to the first one. Every title names the epsilon it is about, and every figure of
values computed on private data without noise carries the "not covered by epsilon" footnote.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from dpsweep.reports.series import Panel

DPI = 100
INVALID_LABEL = "epsilon claim invalid"
CONTRADICTED_LABEL = "claim contradicted by audit"
REPLAYABLE_LABEL = "replayable: not releasable"
#: Footnote of every figure whose values were computed on private data without noise.
NOT_COVERED_NOTE = ("not covered by epsilon: computed on private data without noise "
                    "(stays in the run directory, never exported)")
NOT_COVERED_COLOUR = "#b00020"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")
#: A heat map cell's number, in points: 11.8 px at ``DPI`` (the page shows the figure unscaled).
CELL_PT = 8.5
#: Most trials in one heat map (further ones are in its CSV).
MAX_HEAT_ROWS = 16


def series_colours(series: Sequence[str]) -> dict[str, str]:
    """One fixed colour per series, by sorted name, so every figure agrees."""
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(sorted(set(series)))}


def eps_text(epsilons: Sequence[float]) -> str:
    """'ε = 3' or 'ε ∈ {1, 3, 8}' for titles."""
    values = sorted({float(e) for e in epsilons if math.isfinite(e)})
    if not values:
        return "ε: none"
    if len(values) == 1:
        return f"ε = {values[0]:g}"
    return "ε ∈ {" + ", ".join(f"{e:g}" for e in values) + "}"


def _footnote(fig: Figure) -> None:
    fig.text(0.01, 0.008, NOT_COVERED_NOTE, fontsize=7.5, color=NOT_COVERED_COLOUR,
             ha="left", va="bottom")


def _save(fig: Figure, path: Path, *, not_covered: bool,
          margins: tuple[float, float, float, float] = (0.08, 0.97, 0.14, 0.9),
          wspace: float = 0.28) -> Path:
    """Fixed margins (left, right, bottom, top): tight_layout costs seconds per figure on a
    busy machine and the layouts here are known in advance."""
    left, right, bottom, top = margins
    fig.subplots_adjust(left=left, right=right, bottom=bottom, top=top, wspace=wspace)
    if not_covered:
        _footnote(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


# ---- the front -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Baseline:
    """The non-private baseline: validation accuracy, test accuracy and peak MIA (NaN if not
    audited)."""

    val_accuracy: float
    test_accuracy: float
    peak_mia: float


# ---- per-layer x attack heat map ---------------------------------------------------------------
@dataclass(frozen=True)
class HeatRow:
    """One trial's attack accuracies per (layer, attack), with significance after the audit's
    multiple-testing correction, and its peak cell."""

    label: str
    cells: dict[tuple[str, str], tuple[float, bool]]
    peak: tuple[str, str]


def mia_heatmap(rows: Sequence[HeatRow], *, columns: Sequence[tuple[str, str]], title: str,
                path: Path) -> Path:
    """Rows = trials, columns = (layer, attack) grouped by layer from input to output; one
    diverging scale centred on 0.5 (chance): red = the attack beats guessing, blue = below.
    Cells not significant after correction are faded with grey values; significant ones are
    bold with a star; the black box is the trial's peak."""
    rows = list(rows)[:MAX_HEAT_ROWS]
    data = np.array([[row.cells.get(c, (math.nan, False))[0] for c in columns] for row in rows],
                    dtype=float)
    width = max(7.5, 0.8 * len(columns) + 3.6)
    height = max(3.0, 0.4 * len(rows) + 2.3)
    fig = Figure(figsize=(width, height))
    ax = fig.add_subplot()
    finite = data[np.isfinite(data)]
    spread = max(float(np.max(np.abs(finite - 0.5))) if finite.size else 0.05, 0.02)
    norm = TwoSlopeNorm(vmin=0.5 - spread, vcenter=0.5, vmax=0.5 + spread)
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="#e6e6e6")
    image = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto")
    significant = np.array([[row.cells.get(c, (math.nan, False))[1] for c in columns]
                            for row in rows], dtype=bool)
    veil = np.zeros((*data.shape, 4))
    veil[..., :3] = 1.0
    veil[..., 3] = np.where(np.isfinite(data) & ~significant, 0.55, 0.0)
    ax.imshow(veil, aspect="auto", interpolation="nearest")  # fades the n.s. cells
    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            value = data[i, j]
            if not math.isfinite(value):
                continue
            sig = bool(significant[i, j])
            strong = sig and abs(value - 0.5) > 0.6 * spread
            ax.text(j, i, f"{value:.3f}*" if sig else f"{value:.3f}", ha="center", va="center",
                    fontsize=CELL_PT, fontweight="bold" if sig else "normal",
                    color="white" if strong else ("black" if sig else "#606060"))
            if column == row.peak:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black",
                                       linewidth=2.0))
    layers = [c[0] for c in columns]
    for j in range(1, len(columns)):
        if layers[j] != layers[j - 1]:
            ax.axvline(j - 0.5, color="black", linewidth=1.2)
    ax.set_xticks(range(len(columns)), labels=[f"{layer} · {attack}" for layer, attack in
                                               columns], rotation=40, ha="right", fontsize=7.5)
    ax.set_yticks(range(len(rows)), labels=[row.label for row in rows], fontsize=8)
    ax.set_title(title + "\nfaded, grey = not significant after correction; * = significant",
                 fontsize=9.5)
    bar = fig.colorbar(image, ax=ax, fraction=0.03, pad=0.015)
    bar.set_label("attack accuracy (0.5 = chance)", fontsize=8)
    label_room = 0.11 + 0.006 * max(len(row.label) for row in rows)
    return _save(fig, path, not_covered=True,
                 margins=(min(0.3, label_room), 0.9, min(0.45, 1.3 / height), 0.9))


# ---- curves ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curve:
    """One trial's per-epoch validation accuracy."""

    label: str
    series: str
    epochs: tuple[float, ...]
    values: tuple[float, ...]


def validation_curves(curves: Sequence[Curve], *, title: str, baseline: float,
                      path: Path) -> Path:
    """Validation accuracy per epoch of the front trials, one colour per series."""
    colours = series_colours([c.series for c in curves])
    fig = Figure(figsize=(10.5, 4.8))
    ax = fig.add_subplot()
    styles = ("-", "--", ":", "-.")
    seen: dict[str, int] = {}
    for curve in curves:
        k = seen.get(curve.series, 0)
        seen[curve.series] = k + 1
        ax.plot(curve.epochs, curve.values, color=colours[curve.series],
                linestyle=styles[k % len(styles)], marker=".", linewidth=1.3,
                label=curve.label if len(curves) <= 14 else None)
    if math.isfinite(baseline):
        ax.axhline(baseline, color="black", linestyle="--", linewidth=1,
                   label=f"non-private baseline ({baseline:.3f})")
    ax.set(xlabel="epoch", ylabel="validation accuracy", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False)
    return _save(fig, path, not_covered=True, margins=(0.07, 0.74, 0.15, 0.9))


@dataclass(frozen=True)
class UtilitySeries:
    """One series across targets: mean and sd over its best configuration and re-runs."""

    series: str
    epsilons: tuple[float, ...]
    val_mean: tuple[float, ...]
    val_sd: tuple[float, ...]
    test_mean: tuple[float, ...]
    test_sd: tuple[float, ...]
    mia_mean: tuple[float, ...]
    mia_sd: tuple[float, ...]


def privacy_utility(series: Sequence[UtilitySeries], *, baseline: Baseline | None,
                    path: Path) -> Path:
    """Validation accuracy, test accuracy and peak MIA accuracy against target epsilon (log
    axis), mean +- sd per series, the non-private baseline as a dashed line."""
    colours = series_colours([s.series for s in series])
    fig = Figure(figsize=(14.0, 4.6))
    axes = [fig.add_subplot(1, 3, k + 1) for k in range(3)]
    targets = sorted({e for s in series for e in s.epsilons})
    panels = (("val", "validation accuracy", "val_accuracy"),
              ("test", "test accuracy (reported, not used to choose)", "test_accuracy"),
              ("mia", "peak MIA accuracy", "peak_mia"))
    for ax, (key, label, base_key) in zip(axes, panels, strict=True):
        for s in series:
            mean = np.array(getattr(s, f"{key}_mean"), dtype=float)
            sd = np.array(getattr(s, f"{key}_sd"), dtype=float)
            ax.errorbar(s.epsilons, mean, yerr=np.nan_to_num(sd), color=colours[s.series],
                        marker="o", markersize=4, capsize=3, linewidth=1.3, label=s.series)
        value = getattr(baseline, base_key) if baseline is not None else math.nan
        if math.isfinite(value):
            ax.axhline(value, color="black", linestyle="--", linewidth=1,
                       label="non-private baseline")
        if key == "mia":
            ax.axhline(0.5, color="grey", linestyle=":", linewidth=1, label="chance")
        ax.set_xscale("log")
        ax.set_xticks(targets, labels=[f"{t:g}" for t in targets])
        ax.minorticks_off()
        ax.set(xlabel="target ε", ylabel=label, title=f"{label.split(' (')[0]} vs "
               f"{eps_text(targets)}")
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.86, 0.5), fontsize=7.5,
               frameon=False)
    return _save(fig, path, not_covered=True, margins=(0.05, 0.85, 0.16, 0.88), wspace=0.32)


# ---- ROC and logged series --------------------------------------------------------------------
@dataclass(frozen=True)
class RocCurve:
    """A trial's ROC at its peak (layer, attack), as the report's SVG draws it."""

    label: str
    fpr: tuple[float, ...]
    tpr: tuple[float, ...]


@dataclass(frozen=True)
class SeriesTrace:
    """One trial's logged series (``reports.series.LoggedSeries``) as the figure draws them:
    per logged key its points (steps, values), and per panel the zone (centre, radius) its
    parameters give, or None."""

    label: str
    points: dict[str, tuple[tuple[float, ...], tuple[float, ...]]]
    zones: tuple[tuple[float, float] | None, ...]


#: Width of one panel of a logged-series figure, in inches.
PANEL_WIDTH = 5.5
#: Most trials whose lines are named in a legend.
MAX_LEGEND = 10


def logged_series(traces: Sequence[SeriesTrace], panels: Sequence[Panel], *, title: str,
                  path: Path, covered: bool) -> Path:
    """One panel per declared :class:`~reports.series.Panel`, one colour per trial: ``held``
    lines step at each entry, ``faint`` ones are dotted, a zone is a band centre ± radius.
    ``covered``: the values are released quantities (post-processing)."""
    fig = Figure(figsize=(PANEL_WIDTH * len(panels), 4.5))
    axes = [fig.add_subplot(1, len(panels), k + 1) for k in range(len(panels))]
    zones: list[set[tuple[float, float]]] = [set() for _ in panels]
    named = len(traces) <= MAX_LEGEND
    for i, trace in enumerate(traces):
        colour = PALETTE[i % len(PALETTE)]
        label = trace.label if named else None
        for k, (ax, panel) in enumerate(zip(axes, panels, strict=True)):
            for line in panel.lines:
                steps, values = trace.points.get(line.key, ((), ()))
                if not values:
                    continue
                if line.style == "held":
                    ax.plot(steps, values, color=colour, marker=".", linewidth=1.2,
                            drawstyle="steps-post", label=label)
                elif line.style == "faint":
                    ax.plot(steps, values, color=colour, linewidth=0.8, linestyle=":",
                            alpha=0.6)
                else:
                    ax.plot(steps, values, color=colour, linewidth=1.4, label=label)
            zone = trace.zones[k]
            if zone is not None and math.isfinite(zone[0]):
                zones[k].add(zone)
    for k, (ax, panel) in enumerate(zip(axes, panels, strict=True)):
        for centre, radius in sorted(zones[k]):
            ax.axhline(centre, color="grey", linestyle="--", linewidth=0.8)
            if math.isfinite(radius):
                ax.axhspan(centre - radius, centre + radius, color="green", alpha=0.06)
        ax.set(xlabel="step", ylabel=panel.ylabel,
               title=f"{title}: {panel.title}" if k == 0 else panel.title)
        ax.grid(True, alpha=0.3)
    if named:
        axes[0].legend(fontsize=7)
    return _save(fig, path, not_covered=not covered, margins=(0.07, 0.98, 0.12, 0.9))
