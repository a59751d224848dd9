"""Pareto fronts and hypervolumes, checked against brute force on random point sets."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.pareto import (
    ALL_METHODS,
    ALL_VALID,
    eligible,
    front_mask,
    front_of,
    fronts,
    hypervolume,
    summarize,
)

CHANCE = 0.1
# Values on a coarse lattice make ties and exact duplicates common.
lattice = st.integers(min_value=0, max_value=20).map(lambda k: k / 20)
points = st.lists(st.tuples(lattice, lattice), min_size=0, max_size=25)
free_points = st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=0, max_size=25)


def brute_front(pts: list[tuple[float, float]]) -> list[bool]:
    """O(n^2) definition: dominated = another point at least as good in both, better in one."""
    return [not any(b[0] >= a[0] and b[1] <= a[1] and (b[0] > a[0] or b[1] < a[1])
                    for b in pts) for a in pts]


def brute_union_area(pts: list[tuple[float, float]], *, chance: float, ref: float) -> float:
    """Exact area of the union of the rectangles [chance, a] x [m, ref] by coordinate
    compression: every elementary cell is either inside some rectangle or not."""
    rects = [(chance, a, m, ref) for a, m in pts if a > chance and m < ref]
    xs = sorted({chance, *(r[1] for r in rects)})
    ys = sorted({ref, *(r[2] for r in rects)})
    area = 0.0
    for (x0, x1), (y0, y1) in itertools.product(itertools.pairwise(xs), itertools.pairwise(ys)):
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if any(r[0] <= cx <= r[1] and r[2] <= cy <= r[3] for r in rects):
            area += (x1 - x0) * (y1 - y0)
    return area


def grid_count_area(pts: list[tuple[float, float]], *, chance: float, ref: float,
                    cells: int = 200) -> float:
    """Count cells of a fine grid whose centre is dominated (exact for lattice points whose
    coordinates are multiples of 1/cells)."""
    centres = (np.arange(cells) + 0.5) / cells
    acc_c, mia_c = np.meshgrid(centres, centres, indexing="ij")
    covered = np.zeros_like(acc_c, dtype=bool)
    for a, m in pts:
        if a > chance and m < ref:
            covered |= (acc_c >= chance) & (acc_c <= a) & (mia_c >= m) & (mia_c <= ref)
    return float(covered.sum()) / cells**2


@settings(max_examples=150, deadline=None)
@given(points)
def test_front_mask_matches_definition_and_ignores_order(pts: list[tuple[float, float]]) -> None:
    acc = [p[0] for p in pts]
    mia = [p[1] for p in pts]
    mask = front_mask(accuracy=acc, mia=mia)
    assert list(mask) == brute_front(pts)
    perm = np.random.default_rng(len(pts)).permutation(len(pts))
    again = front_mask(accuracy=[acc[i] for i in perm], mia=[mia[i] for i in perm])
    assert list(again) == [mask[i] for i in perm]
    if pts:
        assert mask.any()  # a non-empty set always has a front


@settings(max_examples=150, deadline=None)
@given(free_points)
def test_hypervolume_equals_exact_union_of_rectangles(pts: list[tuple[float, float]]) -> None:
    hv = hypervolume(accuracy=[p[0] for p in pts], mia=[p[1] for p in pts],
                     chance_accuracy=CHANCE)
    assert hv == pytest.approx(brute_union_area(pts, chance=CHANCE, ref=1.0), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(points)
def test_hypervolume_equals_grid_count(pts: list[tuple[float, float]]) -> None:
    hv = hypervolume(accuracy=[p[0] for p in pts], mia=[p[1] for p in pts],
                     chance_accuracy=CHANCE)
    assert hv == pytest.approx(grid_count_area(pts, chance=CHANCE, ref=1.0), abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(points, st.lists(st.tuples(st.floats(0, CHANCE), st.floats(0, 1)), max_size=5),
       st.lists(st.tuples(st.floats(0, 1), st.floats(1, 2)), max_size=5))
def test_front_alone_and_points_beyond_the_reference_add_nothing(
        pts: list[tuple[float, float]], below_chance: list[tuple[float, float]],
        beyond_mia: list[tuple[float, float]]) -> None:
    acc, mia = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    full = hypervolume(accuracy=acc, mia=mia, chance_accuracy=CHANCE)
    if pts:
        mask = front_mask(accuracy=acc, mia=mia)
        assert hypervolume(accuracy=acc[mask], mia=mia[mask],
                           chance_accuracy=CHANCE) == pytest.approx(full)
    extra = pts + below_chance + beyond_mia
    assert hypervolume(accuracy=[p[0] for p in extra], mia=[p[1] for p in extra],
                       chance_accuracy=CHANCE) == pytest.approx(full)
    assert 0.0 <= full <= (1 - CHANCE) * 1.0 + 1e-12


def test_hypervolume_known_values() -> None:
    assert hypervolume(accuracy=[], mia=[], chance_accuracy=CHANCE) == 0.0
    assert hypervolume(accuracy=[0.9], mia=[0.6], chance_accuracy=CHANCE) == pytest.approx(
        0.8 * 0.4)
    # two staircase points: 0.9/0.6 and 0.7/0.5 -> 0.2*0.4 + 0.6*0.5
    assert hypervolume(accuracy=[0.9, 0.7], mia=[0.6, 0.5],
                       chance_accuracy=CHANCE) == pytest.approx(0.08 + 0.30)
    assert hypervolume(accuracy=[0.05, 0.9], mia=[0.2, 1.0], chance_accuracy=CHANCE) == 0.0


def test_front_mask_rejects_non_finite_points() -> None:
    with pytest.raises(ValueError, match="finite"):
        front_mask(accuracy=[0.9, math.nan], mia=[0.5, 0.6])


def _frame() -> pd.DataFrame:
    rows = [
        ("t1", "a", "ok", True, 0.90, 0.60),
        ("t2", "a", "ok", True, 0.80, 0.55),
        ("t3", "a", "ok", True, 0.70, 0.58),  # dominated by t2
        ("t4", "b", "ok", False, 0.95, 0.50),  # invalid, dominates everything
        ("t5", "b", "ok", True, 0.80, 0.55),  # duplicate of t2
        ("t10", "b", "ok", True, 0.80, 0.55),  # and another, sorts after t5
        ("t6", "b", "failed", False, math.nan, math.nan),
        ("t7", "a", "ok", True, 0.99, math.nan),  # not audited
    ]
    return pd.DataFrame(rows, columns=["trial_id", "method", "status", "dp_valid",
                                       "test_accuracy", "peak_mia_accuracy"])


def test_fronts_per_method_overall_and_valid_only() -> None:
    frame = _frame()
    assert list(eligible(frame)["trial_id"]) == ["t1", "t2", "t3", "t4", "t5", "t10"]
    result = fronts(frame)
    assert list(result) == [ALL_METHODS, ALL_VALID, "a", "b"]
    assert list(result[ALL_METHODS]["trial_id"]) == ["t4"]
    # duplicates stay together on the front, ordered along it, ties by readable trial id
    assert list(result[ALL_VALID]["trial_id"]) == ["t2", "t5", "t10", "t1"]
    assert list(result["a"]["trial_id"]) == ["t2", "t1"]
    assert list(result["b"]["trial_id"]) == ["t4"]
    shuffled = frame.sample(frac=1.0, random_state=3)
    for name, front in fronts(shuffled).items():
        assert list(front["trial_id"]) == list(result[name]["trial_id"])


def test_summarize_reports_hypervolume_per_front() -> None:
    rows = {s.front: s for s in summarize(_frame(), num_classes=10)}
    assert rows[ALL_METHODS].hypervolume == pytest.approx(0.85 * 0.5)
    assert rows["a"].trials == 3 and rows["a"].front_size == 2
    assert rows["a"].hypervolume == pytest.approx(0.1 * 0.4 + 0.7 * 0.45)
    assert rows["a"].front_trials == ("t2", "t1")
    assert rows[ALL_VALID].best_test_accuracy == pytest.approx(0.9)
    assert rows[ALL_VALID].lowest_peak_mia == pytest.approx(0.55)
    with pytest.raises(ValueError):
        summarize(_frame(), num_classes=1)


def test_front_of_empty_frame_is_empty() -> None:
    assert front_of(eligible(_frame()).iloc[:0]).empty
