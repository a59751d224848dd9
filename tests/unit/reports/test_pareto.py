"""Fronts with ties, exclusions and normalised hypervolumes, checked against definitions."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsweep.core.errors import UserInputError
from dpsweep.reports.pareto import (
    ACC_HI,
    ACC_LO,
    KIND_ALL,
    KIND_STUDY,
    KIND_VALID,
    MIA_HI,
    MIA_LO,
    eligible,
    exclusions,
    front_mask,
    front_of,
    fronts,
    hypervolume,
    wilson_interval,
)

K = 10
# Values on a coarse lattice make ties and exact duplicates common.
lattice = st.integers(min_value=0, max_value=20).map(lambda k: k / 20)
widths = st.integers(min_value=0, max_value=4).map(lambda k: k / 40)
boxes = st.lists(st.tuples(lattice, widths, widths, lattice, widths, widths), max_size=20)


def _bounds(pts: list[tuple[float, ...]]) -> dict[str, np.ndarray]:
    return {"acc_lo": np.array([p[0] - p[1] for p in pts]),
            "acc_hi": np.array([p[0] + p[2] for p in pts]),
            "mia_lo": np.array([p[3] - p[4] for p in pts]),
            "mia_hi": np.array([p[3] + p[5] for p in pts])}


def dominates(b: int, a: int, x: dict[str, np.ndarray]) -> bool:
    """The module's rule, written pair by pair."""
    at_least = (x["acc_lo"][b] >= x["acc_lo"][a] and x["acc_hi"][b] >= x["acc_hi"][a]
                and x["mia_lo"][b] <= x["mia_lo"][a] and x["mia_hi"][b] <= x["mia_hi"][a])
    clear = x["acc_lo"][b] > x["acc_hi"][a] or x["mia_hi"][b] < x["mia_lo"][a]
    return at_least and clear


@settings(max_examples=100, deadline=None)
@given(boxes)
def test_front_is_the_undominated_set_in_any_order_and_never_empty(pts: list) -> None:
    x = _bounds(pts)
    mask = front_mask(**x)
    assert list(mask) == [not any(dominates(b, a, x) for b in range(len(pts)) if b != a)
                          for a in range(len(pts))]
    perm = np.random.default_rng(len(pts)).permutation(len(pts))
    again = front_mask(**{k: v[perm] for k, v in x.items()})
    assert list(again) == [mask[i] for i in perm]
    if pts:
        assert mask.any()  # a strict partial order: every finite pool has a front
    for a, b, c in itertools.permutations(range(min(len(pts), 6)), 3):  # transitive
        if dominates(a, b, x) and dominates(b, c, x):
            assert dominates(a, c, x)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(lattice, lattice), max_size=25))
def test_zero_width_intervals_give_plain_pareto_dominance(pts: list) -> None:
    acc = [p[0] for p in pts]
    mia = [p[1] for p in pts]
    mask = front_mask(acc_lo=acc, acc_hi=acc, mia_lo=mia, mia_hi=mia)
    brute = [not any(b[0] >= a[0] and b[1] <= a[1] and (b[0] > a[0] or b[1] < a[1])
                     for b in pts) for a in pts]
    assert list(mask) == brute


def test_overlapping_intervals_are_ties_and_the_loose_rule_would_leave_no_front() -> None:
    """Five trials that the looser rule ('better beyond the intervals on one axis, not worse
    beyond them on the other') dominates in a cycle: under it every one is dominated."""
    acc = [(0.70, 0.72), (0.70, 0.80), (0.79, 0.81), (0.76, 0.78), (0.73, 0.75)]
    mia = [(0.50, 0.52), (0.53, 0.55), (0.56, 0.58), (0.53, 0.60), (0.50, 0.56)]

    def loose(b: int, a: int) -> bool:
        clear = acc[b][0] > acc[a][1] or mia[b][1] < mia[a][0]
        worse = acc[b][1] < acc[a][0] or mia[b][0] > mia[a][1]
        return clear and not worse

    assert all(any(loose(b, a) for b in range(5) if b != a) for a in range(5))
    mask = front_mask(acc_lo=[a[0] for a in acc], acc_hi=[a[1] for a in acc],
                      mia_lo=[m[0] for m in mia], mia_hi=[m[1] for m in mia])
    assert mask.all()
    # two trials overlapping on both axes stay together, whatever their point estimates
    two = front_mask(acc_lo=[0.88, 0.87], acc_hi=[0.92, 0.91], mia_lo=[0.52, 0.53],
                     mia_hi=[0.56, 0.57])
    assert two.tolist() == [True, True]
    # the same two, separated beyond the intervals on accuracy: the better one dominates
    apart = front_mask(acc_lo=[0.88, 0.80], acc_hi=[0.92, 0.84], mia_lo=[0.52, 0.53],
                       mia_hi=[0.56, 0.57])
    assert apart.tolist() == [True, False]


def test_front_mask_rejects_bad_points() -> None:
    with pytest.raises(ValueError, match="finite"):
        front_mask(acc_lo=[0.9, math.nan], acc_hi=[0.9, 0.9], mia_lo=[0.5, 0.5],
                   mia_hi=[0.5, 0.5])
    with pytest.raises(ValueError, match="lower <= upper"):
        front_mask(acc_lo=[0.9], acc_hi=[0.8], mia_lo=[0.5], mia_hi=[0.5])


def test_wilson_interval_values() -> None:
    from statsmodels.stats.proportion import proportion_confint

    lo, hi = wilson_interval([0.9, 0.5], n=2000)
    for k, p in enumerate((0.9, 0.5)):  # an independent implementation
        assert (lo[k], hi[k]) == pytest.approx(
            proportion_confint(round(p * 2000), 2000, alpha=0.05, method="wilson"), abs=1e-9)
    # by hand: centre (0.9 + z^2/4000) / (1 + z^2/2000), half-width 0.013158
    assert lo[0] == pytest.approx(0.886076, abs=2e-6)
    assert hi[0] == pytest.approx(0.912391, abs=2e-6)
    assert hi[1] - 0.5 == pytest.approx(0.5 - lo[1])  # symmetric at 0.5
    lo, hi = wilson_interval([0.9], n=None)
    assert lo[0] == hi[0] == 0.9


def brute_area(pts: list[tuple[float, float]]) -> float:
    """Area of the union of [0, x] x [y, 1] on normalised axes, by coordinate compression."""
    rects = []
    for acc, mia in pts:
        x = min(max((acc - 1 / K) / (1 - 1 / K), 0.0), 1.0)
        y = min(max(2 * mia - 1, 0.0), 1.0)
        if x > 0 and y < 1:
            rects.append((x, y))
    xs = sorted({0.0, *(r[0] for r in rects)})
    ys = sorted({1.0, *(r[1] for r in rects)})
    area = 0.0
    for (x0, x1), (y0, y1) in itertools.product(itertools.pairwise(xs), itertools.pairwise(ys)):
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if any(cx <= x and cy >= y for x, y in rects):
            area += (x1 - x0) * (y1 - y0)
    return area


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=20))
def test_hypervolume_is_the_union_area_on_normalised_axes(pts: list) -> None:
    hv = hypervolume(accuracy=[p[0] for p in pts], mia=[p[1] for p in pts], num_classes=K)
    assert hv == pytest.approx(brute_area(pts), abs=1e-12)
    assert 0.0 <= hv <= 1.0


def test_hypervolume_known_values() -> None:
    assert hypervolume(accuracy=[], mia=[], num_classes=K) == 0.0
    # (0.91, 0.55): x = 0.9, advantage 0.1 -> 0.9 * 0.9
    assert hypervolume(accuracy=[0.91], mia=[0.55], num_classes=K) == pytest.approx(0.81)
    # staircase: (0.91, 0.6) and (0.55, 0.5): x 0.9 / 0.5, y 0.2 / 0.0
    assert hypervolume(accuracy=[0.91, 0.55], mia=[0.6, 0.5], num_classes=K) == \
        pytest.approx(0.5 * 1.0 + 0.4 * 0.8)
    # an attack below chance counts as advantage 0; chance accuracy or a perfect attack: 0
    assert hypervolume(accuracy=[1.0], mia=[0.3], num_classes=K) == pytest.approx(1.0)
    assert hypervolume(accuracy=[0.1, 0.9], mia=[0.5, 1.0], num_classes=K) == 0.0
    assert hypervolume(accuracy=[0.75], mia=[0.6], num_classes=2) == pytest.approx(0.5 * 0.8)
    with pytest.raises(ValueError):
        hypervolume(accuracy=[0.5], mia=[0.5], num_classes=1)


def _row(tid: str, series: str, eps: float, val: float, mia: float, **kw: object) -> dict:
    row = {"trial_id": tid, "series": series, "study": f"{series}@eps{eps:g}",
           "method": series.split(":")[0], "status": "ok", "error": "", "target_epsilon": eps,
           "val_accuracy": val, "test_accuracy": 0.5, "peak_mia_accuracy": mia,
           "peak_mia_upper": mia + 0.03, "peak_layer": "fc1", "peak_attack": "lira",
           "mia_layers": json.dumps([{"layer": "fc1", "attack": "lira", "accuracy": mia,
                                      "accuracy_ci": [mia - 0.02, mia + 0.02]}]),
           "dp_valid": True, "release_safe": True, "degenerate": False, "repeat_of": ""}
    row.update(kw)
    return row


def _frame() -> pd.DataFrame:
    return pd.DataFrame([
        _row("a1", "a", 3.0, 0.90, 0.60),
        _row("a2", "a", 3.0, 0.80, 0.52),
        _row("a3", "a", 3.0, 0.70, 0.58),  # dominated by a2 beyond both intervals
        _row("b1", "b:faithful", 3.0, 0.95, 0.50, dp_valid=False),
        _row("b2", "b", 3.0, 0.895, 0.602),  # a tie with a1 on both axes
        _row("b3", "b", 3.0, 0.99, 0.51, reproducible=True, release_safe=False),
        _row("b4", "b", 3.0, 0.12, 0.50, degenerate=True),
        _row("a4", "a", 3.0, 0.91, 0.59, repeat_of="a1"),
        _row("a5", "a", 3.0, math.nan, math.nan, status="failed", error="TrialDiverged: nan"),
        _row("a6", "a", 3.0, 0.97, math.nan),  # audit failed
        _row("n", "nonprivate", math.nan, 0.99, 0.7, method="nonprivate", dp_valid=False),
        _row("a10", "a", 1.0, 0.75, 0.51),
    ])


def test_exclusions_keep_degenerate_failed_baseline_and_reruns_off_visibly() -> None:
    frame = _frame()
    excluded = exclusions(frame).set_index("trial_id")["reason"]
    assert list(excluded.index) == ["a4", "a5", "a6", "b4", "n"]
    assert excluded["a4"].startswith("re-run with fresh noise of a1")
    assert excluded["a5"] == "failed: TrialDiverged: nan"
    assert excluded["a6"].startswith("no peak MIA accuracy")
    assert excluded["b4"].startswith("degenerate")
    assert excluded["n"].startswith("non-private baseline")
    assert list(eligible(frame, validation_size=1000)["trial_id"]) == \
        ["a1", "a2", "a3", "a10", "b1", "b2", "b3"]


def test_fronts_per_study_per_target_and_valid_release_safe() -> None:
    frame = _frame()
    result = {f.name: f for f in fronts(frame, validation_size=1000, num_classes=K)}
    assert list(result) == ["all series @ eps 1", "valid DP, release-safe @ eps 1", "a @ eps 1",
                            "all series @ eps 3", "valid DP, release-safe @ eps 3",
                            "a @ eps 3", "b @ eps 3", "b:faithful @ eps 3"]
    assert result["all series @ eps 3"].trial_ids == ("b1", "b3")
    assert result["all series @ eps 3"].kind == KIND_ALL
    valid = result["valid DP, release-safe @ eps 3"]
    assert valid.kind == KIND_VALID and valid.pool_size == 4
    # a1 and b2 overlap on both axes: both stay; plain dominance would drop b2
    assert valid.trial_ids == ("a2", "a1", "b2")
    plain = {f.name: f for f in fronts(frame, validation_size=None, num_classes=K)}
    assert plain["valid DP, release-safe @ eps 3"].trial_ids == ("a2", "a1")
    assert result["a @ eps 3"].kind == KIND_STUDY and result["a @ eps 3"].trial_ids == \
        ("a2", "a1")
    # hypervolume of the valid pool: (0.9, 0.6) and (0.8, 0.52) normalised
    x1, x2 = (0.9 - 0.1) / 0.9, (0.8 - 0.1) / 0.9
    assert valid.hypervolume == pytest.approx(x2 * (1 - 0.04) + (x1 - x2) * (1 - 0.2))
    rows = valid.trials.set_index("trial_id")
    assert rows.loc["a1", MIA_LO] == pytest.approx(0.58)
    assert rows.loc["a1", MIA_HI] == pytest.approx(0.63)
    assert rows.loc["a1", ACC_LO] < 0.9 < rows.loc["a1", ACC_HI]
    shuffled = frame.sample(frac=1.0, random_state=3)
    again = {f.name: f.trial_ids for f in fronts(shuffled, validation_size=1000, num_classes=K)}
    assert again == {name: f.trial_ids for name, f in result.items()}


def test_test_accuracy_is_never_read() -> None:
    """Fronts and hypervolumes do not move when test accuracy is poisoned or missing."""
    frame = _frame()
    base = [(f.name, f.trial_ids, f.hypervolume)
            for f in fronts(frame, validation_size=1000, num_classes=K)]
    poisoned = frame.assign(test_accuracy=np.linspace(1.0, 0.0, len(frame)))
    dropped = frame.drop(columns="test_accuracy")
    for variant in (poisoned, dropped):
        assert [(f.name, f.trial_ids, f.hypervolume)
                for f in fronts(variant, validation_size=1000, num_classes=K)] == base


def test_corrupt_columns_are_user_errors() -> None:
    frame = _frame()
    with pytest.raises(UserInputError, match=r"results\.val_accuracy"):
        eligible(frame.assign(val_accuracy=frame["val_accuracy"].astype(str)),
                 validation_size=1000)
    bad = frame.copy()
    bad.loc[0, "mia_layers"] = "{not json"
    with pytest.raises(UserInputError, match=r"results\.mia_layers.*a1"):
        fronts(bad, validation_size=1000)


def test_front_of_empty_pool_is_empty() -> None:
    assert front_of(eligible(_frame(), validation_size=1000).iloc[:0]).empty
