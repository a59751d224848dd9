"""Pareto fronts of test accuracy (maximised) against peak-layer MIA accuracy (minimised).

A trial is on a front when no other trial is at least as accurate and at most as attackable
and strictly better in one of the two. Exact duplicates therefore never dominate each other:
both stay on the front, so the result does not depend on row order. The hypervolume of a front
is the area it dominates inside the box bounded by the reference point (chance accuracy, MIA
accuracy 1.0); it is the one number per method the report compares.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

#: Name of the front over every method in :func:`fronts` and the report's tables.
ALL_METHODS = "all methods"
#: Name of the front over the trials whose epsilon claim holds.
ALL_VALID = "all methods, valid DP only"
#: Worst attack accuracy: the reference point's MIA coordinate.
REFERENCE_MIA = 1.0
DEFAULT_NUM_CLASSES = 10

ACC = "test_accuracy"
MIA = "peak_mia_accuracy"


def natural_key(text: str) -> tuple[Any, ...]:
    """t2 before t10: trial ids sort the way a person reads them."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def front_mask(*, accuracy: Sequence[float], mia: Sequence[float]) -> np.ndarray:
    """Boolean mask of the non-dominated points (accuracy up, MIA down); O(n log n).

    Points are swept in order of decreasing accuracy; a point survives when its MIA is below
    every MIA seen at strictly higher accuracy and it is the lowest MIA of its accuracy group.
    """
    acc = np.asarray(accuracy, dtype=float)
    att = np.asarray(mia, dtype=float)
    if acc.shape != att.shape or acc.ndim != 1:
        raise ValueError("accuracy and mia must be 1-D sequences of the same length")
    if not (np.isfinite(acc).all() and np.isfinite(att).all()):
        raise ValueError("front points must be finite; filter with eligible() first")
    mask = np.zeros(acc.shape, dtype=bool)
    order = np.lexsort((att, -acc))  # accuracy descending, then MIA ascending
    best_above = math.inf  # lowest MIA among strictly more accurate points
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and acc[order[j]] == acc[order[i]]:
            j += 1
        group = order[i:j]
        lowest = att[group[0]]
        if lowest < best_above:
            mask[group[att[group] == lowest]] = True
        best_above = min(best_above, lowest)
        i = j
    return mask


def hypervolume(*, accuracy: Sequence[float], mia: Sequence[float], chance_accuracy: float,
                reference_mia: float = REFERENCE_MIA) -> float:
    """Area dominated by the points inside the box [chance, 1] x [MIA, reference_mia].

    Each point (a, m) dominates the rectangle [chance, a] x [m, reference_mia]; the union's
    area is the integral over accuracy x of (reference_mia - lowest MIA among points with
    accuracy >= x). Points not better than the reference in both coordinates add nothing.
    Dominated points may be passed: they cannot change the union.
    """
    acc = np.asarray(accuracy, dtype=float)
    att = np.asarray(mia, dtype=float)
    keep = np.isfinite(acc) & np.isfinite(att) & (acc > chance_accuracy) & (att < reference_mia)
    acc, att = acc[keep], att[keep]
    if acc.size == 0:
        return 0.0
    order = np.argsort(-acc, kind="stable")
    acc, att = acc[order], att[order]
    lowest = np.minimum.accumulate(att)
    lower_edges = np.append(acc[1:], chance_accuracy)
    return float(np.sum((acc - lower_edges) * (reference_mia - lowest)))


def eligible(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished trials with both coordinates measured (the audit fills the MIA column)."""
    acc = pd.to_numeric(frame[ACC], errors="coerce")
    att = pd.to_numeric(frame[MIA], errors="coerce") if MIA in frame else acc * np.nan
    ok = (frame["status"] == "ok") & np.isfinite(acc) & np.isfinite(att)
    out = frame[ok].copy()
    out[ACC] = acc[ok].astype(float)
    out[MIA] = att[ok].astype(float)
    return out


def front_of(frame: pd.DataFrame) -> pd.DataFrame:
    """The front rows of an eligible frame, ordered along the front (MIA up, then accuracy up,
    then trial_id) so that joining consecutive points draws the attainment staircase."""
    if frame.empty:
        return frame.copy()
    mask = front_mask(accuracy=frame[ACC].to_numpy(), mia=frame[MIA].to_numpy())
    front = frame[mask]
    return front.assign(_key=front["trial_id"].astype(str).map(natural_key)).sort_values(
        [MIA, ACC, "_key"], kind="stable").drop(columns="_key")


@dataclass(frozen=True)
class FrontSummary:
    """One row of the hypervolume table."""

    front: str
    trials: int
    front_size: int
    hypervolume: float
    best_test_accuracy: float
    lowest_peak_mia: float
    front_trials: tuple[str, ...]


def fronts(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Front over all methods, over the valid-DP trials, and per method (sorted by name)."""
    ok = eligible(frame)
    out = {ALL_METHODS: front_of(ok),
           ALL_VALID: front_of(ok[ok["dp_valid"].astype(bool)])}
    for method in sorted(ok["method"].astype(str).unique()):
        out[method] = front_of(ok[ok["method"] == method])
    return out


def summarize(frame: pd.DataFrame, *, num_classes: int = DEFAULT_NUM_CLASSES
              ) -> list[FrontSummary]:
    """Hypervolume table: one row per front of :func:`fronts`, reference (1/num_classes, 1)."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    ok = eligible(frame)
    rows = []
    for name, front in fronts(frame).items():
        if name == ALL_METHODS:
            pool = ok
        elif name == ALL_VALID:
            pool = ok[ok["dp_valid"].astype(bool)]
        else:
            pool = ok[ok["method"] == name]
        rows.append(FrontSummary(
            front=name, trials=len(pool), front_size=len(front),
            hypervolume=hypervolume(accuracy=front[ACC], mia=front[MIA],
                                    chance_accuracy=1.0 / num_classes),
            best_test_accuracy=float(pool[ACC].max()) if len(pool) else math.nan,
            lowest_peak_mia=float(pool[MIA].min()) if len(pool) else math.nan,
            front_trials=tuple(front["trial_id"].astype(str))))
    return rows
