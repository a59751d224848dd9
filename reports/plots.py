"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot state).

Every function takes plain data, writes one PNG and returns its path. PNGs carry no software
or date metadata, so the same data gives byte-identical files and a rebuilt report is
identical to the first one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from reports.pareto import ACC, MIA, eligible, front_mask, front_of

DPI = 110
INVALID_LABEL = "epsilon claim invalid"
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def method_colours(methods: Sequence[str]) -> dict[str, str]:
    """One fixed colour per method, by sorted name, so every figure agrees."""
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(sorted(set(methods)))}


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    return path


def _staircase(front: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Front ordered by MIA up; 'steps-post' then draws the attainment boundary."""
    ordered = front.sort_values([MIA, ACC], kind="stable")
    return ordered[MIA].to_numpy(), ordered[ACC].to_numpy()


def front_plot(frame: pd.DataFrame, *, path: Path, num_classes: int) -> Path:
    """Peak MIA (x, lower is better) vs test accuracy (y, higher is better), one colour per
    method; each method's front joined and solid, its dominated trials faded; the front over
    all methods dashed; invalid-DP trials as crosses, labelled on the fronts."""
    ok = eligible(frame)
    colours = method_colours(ok["method"].astype(str).tolist())
    fig = Figure(figsize=(10.5, 6.0))
    ax = fig.add_subplot()
    for method, colour in colours.items():
        rows = ok[ok["method"] == method]
        on_front = front_mask(accuracy=rows[ACC].to_numpy(), mia=rows[MIA].to_numpy())
        valid = rows["dp_valid"].astype(bool).to_numpy()
        for front_flag, alpha in ((False, 0.25), (True, 1.0)):
            for valid_flag, marker, size in ((True, "o", 46), (False, "X", 90)):
                sel = rows[(on_front == front_flag) & (valid == valid_flag)]
                if sel.empty:
                    continue
                label = method if front_flag and valid_flag else None
                ax.scatter(sel[MIA], sel[ACC], c=colour, marker=marker, s=size, alpha=alpha,
                           edgecolors="black" if not valid_flag else "none", linewidths=0.6,
                           label=label, zorder=3)
        front = rows[on_front]
        xs, ys = _staircase(front)
        ax.plot(xs, ys, drawstyle="steps-post", color=colour, linewidth=1.6, zorder=2,
                label=None if valid[on_front].any() else method)
        invalid = rows[~rows["dp_valid"].astype(bool)]
        if len(invalid) > 10:  # too many labels to read: label those on the front only
            invalid = front[~front["dp_valid"].astype(bool)]
        for _, row in invalid.iterrows():
            ax.annotate(INVALID_LABEL, (row[MIA], row[ACC]), xytext=(6, -12),
                        textcoords="offset points", fontsize=7, color="#b00020")
    overall = front_of(ok)
    xs, ys = _staircase(overall)
    ax.plot(xs, ys, drawstyle="steps-post", color="black", alpha=0.22, linewidth=6,
            solid_capstyle="round", zorder=1, label="front, all methods")
    if len(overall) <= 15:
        for _, row in overall.iterrows():
            ax.annotate(str(row["trial_id"]), (row[MIA], row[ACC]), xytext=(5, 4),
                        textcoords="offset points", fontsize=7, color="#333333")
    ax.scatter([], [], marker="X", c="white", edgecolors="black", s=90, label=INVALID_LABEL)
    ax.scatter([], [], marker="o", c="grey", alpha=0.25, s=46, label="dominated (faded)")
    if not ok.empty:  # zoom on the trials; the reference lines show only when in view
        lo_x, hi_x, lo_y, hi_y = ok[MIA].min(), ok[MIA].max(), ok[ACC].min(), ok[ACC].max()
        pad_x, pad_y = 0.08 * max(hi_x - lo_x, 0.02), 0.08 * max(hi_y - lo_y, 0.02)
        ax.set_xlim(lo_x - pad_x, hi_x + 2 * pad_x)
        ax.set_ylim(lo_y - pad_y, hi_y + pad_y)
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    if y0 <= 1.0 / num_classes <= y1:
        ax.axhline(1.0 / num_classes, color="grey", linestyle=":", linewidth=1,
                   label="chance accuracy")
    if x0 <= 0.5 <= x1:
        ax.axvline(0.5, color="grey", linestyle="-.", linewidth=1, label="random-guess attack")
    ax.set_xlabel("peak-layer MIA accuracy (lower is better)")
    ax.set_ylabel("test accuracy (higher is better)")
    ax.set_title("Pareto front: test accuracy vs peak-layer MIA accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)


@dataclass(frozen=True)
class HeatRow:
    """One trial's per-layer attack accuracies (NaN where the layer was not attacked)."""

    label: str
    accuracies: dict[str, float]
    peak_layer: str


def mia_heatmap(rows: Sequence[HeatRow], *, layers: Sequence[str], path: Path) -> Path:
    """Rows = trials, columns = layers (input to output), cell = attack accuracy; the peak
    layer of each trial is outlined."""
    data = np.array([[row.accuracies.get(layer, math.nan) for layer in layers] for row in rows],
                    dtype=float)
    fig = Figure(figsize=(max(5.0, 1.1 * len(layers) + 3.0), max(2.5, 0.42 * len(rows) + 1.6)))
    ax = fig.add_subplot()
    masked = np.ma.masked_invalid(data)
    finite = data[np.isfinite(data)]
    vmin = min(0.5, float(finite.min())) if finite.size else 0.5
    vmax = max(vmin + 0.05, float(finite.max())) if finite.size else 1.0
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    image = ax.imshow(masked, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    for i, row in enumerate(rows):
        for j, layer in enumerate(layers):
            value = data[i, j]
            if math.isfinite(value):
                light = (value - vmin) / (vmax - vmin) < 0.6
                ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=8,
                        color="white" if light else "black")
            if layer == row.peak_layer:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red",
                                       linewidth=2))
    ax.set_xticks(range(len(layers)), labels=list(layers), rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), labels=[row.label for row in rows])
    ax.set_xlabel("layer (input -> output); red box = peak layer")
    ax.set_title("Per-layer MIA accuracy of the front's trials")
    fig.colorbar(image, ax=ax, label="attack accuracy")
    fig.tight_layout()
    return _save(fig, path)


@dataclass(frozen=True)
class RocCurve:
    """A trial's ROC on its peak layer."""

    label: str
    fpr: tuple[float, ...]
    tpr: tuple[float, ...]


def roc_plot(curves: Sequence[RocCurve], *, path: Path) -> Path:
    """Linear ROC beside log-log ROC: the low-FPR corner is where strong attacks show."""
    fig = Figure(figsize=(11.0, 4.8))
    lin, log = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colours = [_PALETTE[i % len(_PALETTE)] for i in range(len(curves))]
    for curve, colour in zip(curves, colours, strict=True):
        fpr, tpr = np.asarray(curve.fpr, dtype=float), np.asarray(curve.tpr, dtype=float)
        lin.plot(fpr, tpr, color=colour, linewidth=1.4, label=curve.label)
        pos = fpr > 0
        log.plot(fpr[pos], np.maximum(tpr[pos], 1e-4), color=colour, linewidth=1.4)
    grid = np.logspace(-4, 0, 50)
    lin.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="chance")
    log.plot(grid, grid, color="grey", linestyle=":", linewidth=1)
    lin.set(xlim=(0, 1), ylim=(0, 1), xlabel="false positive rate", ylabel="true positive rate",
            title="ROC of the peak layer")
    log.set(xscale="log", yscale="log", xlim=(1e-3, 1), ylim=(1e-3, 1),
            xlabel="false positive rate (log)", ylabel="true positive rate (log)",
            title="low-FPR region")
    for ax in (lin, log):
        ax.grid(True, alpha=0.3)
    lin.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


@dataclass(frozen=True)
class Trajectory:
    """A WW-DP-SGD trial's controller log: C_t and zeta^ per probe step."""

    label: str
    steps: tuple[float, ...]  # step of each zeta entry (the probe steps)
    clip_steps: tuple[float, ...]  # step of each C entry (C_0 at step 0, then the probes)
    clip_norm: tuple[float, ...]
    zeta_hat: tuple[float, ...]
    zeta: tuple[float, ...]
    zeta_star: float
    radius: float


def ww_trajectories(trajectories: Sequence[Trajectory], *, path: Path) -> Path:
    """C_t (left) and zeta^ with the raw zeta and the health zone zeta_star +- radius
    (right), one colour per trial."""
    fig = Figure(figsize=(11.0, 4.5))
    c_ax, z_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    zones: set[tuple[float, float]] = set()
    for i, traj in enumerate(trajectories):
        colour = _PALETTE[i % len(_PALETTE)]
        label = traj.label if len(trajectories) <= 10 else None
        if traj.clip_norm:
            c_ax.plot(traj.clip_steps[:len(traj.clip_norm)], traj.clip_norm, color=colour,
                      marker=".", linewidth=1.2, drawstyle="steps-post", label=label)
        if traj.zeta_hat:
            z_ax.plot(traj.steps[:len(traj.zeta_hat)], traj.zeta_hat, color=colour,
                      linewidth=1.4, label=label)
        if traj.zeta:
            z_ax.plot(traj.steps[:len(traj.zeta)], traj.zeta, color=colour, linewidth=0.8,
                      linestyle=":", alpha=0.6)
        if math.isfinite(traj.zeta_star):
            zones.add((traj.zeta_star, traj.radius))
    for centre, radius in sorted(zones):
        z_ax.axhline(centre, color="grey", linestyle="--", linewidth=0.8)
        if math.isfinite(radius):
            z_ax.axhspan(centre - radius, centre + radius, color="green", alpha=0.06)
    c_ax.set(xlabel="step", ylabel="clipping norm C_t", title="WW-DP-SGD clipping norm C_t")
    z_ax.set(xlabel="step", ylabel="tail exponent",
             title="zeta^ (solid), raw zeta (dotted), zone zeta* +- radius")
    for ax in (c_ax, z_ax):
        ax.grid(True, alpha=0.3)
    if len(trajectories) <= 10:
        c_ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)
