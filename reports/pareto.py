"""Pareto fronts of validation accuracy (maximised) against peak MIA accuracy (minimised).

Selection reads **validation** accuracy only; test accuracy is reported beside it and never
read here, so neither a front, a hypervolume nor a pick can be tuned to the test set.

Who is on a front. Only finished, audited DP trials of the first run of a configuration:
failed trials, degenerate trials (validation accuracy below chance + ``DEGENERATE_MARGIN``), the
non-private baseline and re-runs with fresh noise (``repeat_of``) are kept off and listed by
:func:`exclusions` with the reason, so the report can show them.

Ties. Both coordinates are estimates with 95% intervals: validation accuracy a Wilson score
interval on the validation size, peak MIA accuracy the audit's interval (lower end: the peak
cell's interval, upper end: the simultaneous ``peak_mia_upper``). Trial ``b`` dominates ``a``
only when

* on **both** axes ``b``'s interval is at least as good as ``a``'s at each end
  (accuracy: ``b.lo >= a.lo`` and ``b.hi >= a.hi``; MIA: ``b.lo <= a.lo`` and ``b.hi <= a.hi``),
* and on **at least one** axis the intervals do not overlap, ``b`` being better
  (accuracy ``b.lo > a.hi`` or MIA ``b.hi < a.lo``).

So points whose intervals overlap on both axes never dominate each other: they are ties and
all stay on the front. The looser rule "better beyond the intervals on one axis, not worse
beyond them on the other" is not transitive: a chain of five trials with intervals of unequal
width can dominate each other in a cycle, leaving an empty front whose membership depends on
which comparison is made first. The rule above is a strict partial order (the end-wise order of
intervals is transitive, and disjointness carries along it), so every non-empty pool has a
front, and the front, computed from all pairs at once, is a property of the set of trials:
the same in any row order. With zero-width intervals it is ordinary Pareto dominance.

Hypervolume, on normalised axes: accuracy above chance ``(acc - 1/K) / (1 - 1/K)`` (K classes)
and attack advantage ``2 * mia - 1``, each clipped to [0, 1], against the reference point
(0, 1): no accuracy above chance, an attacker with advantage 1. It is the area of the union of
the boxes the pool's points dominate (point estimates), so it lies in [0, 1].
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from dpsweep.core.errors import UserInputError
from dpsweep.core.vocabulary import OK, PRUNED
from dpsweep.reports.store import DEGENERATE_MARGIN

ACC = "val_accuracy"
MIA = "peak_mia_accuracy"
MIA_UPPER = "peak_mia_upper"
#: Interval columns :func:`eligible` adds.
ACC_LO, ACC_HI = "val_accuracy_lo", "val_accuracy_hi"
MIA_LO, MIA_HI = "peak_mia_lo", "peak_mia_hi"
#: ``method`` of the non-private baseline row: never on a front or a pick.
NONPRIVATE = "nonprivate"
#: Two-sided 95% normal quantile.
Z95 = NormalDist().inv_cdf(0.975)
#: Reference point of the hypervolume: (accuracy above chance, attack advantage).
REFERENCE = (0.0, 1.0)
DEFAULT_NUM_CLASSES = 10
#: Rows compared at once by :func:`front_mask` (bounds its memory to a few MB per block; a
#: memory chunk, not the physical batch).
_MASK_BLOCK_ROWS = 512

#: Front kinds, in the order the report shows them for each target.
KIND_ALL = "all series"
KIND_VALID = "valid DP, release-safe"
KIND_STUDY = "study"

#: Exclusion reasons (the report's table and pick's messages use these words).
REASON_FAILED = "failed"
REASON_PRUNED = "pruned at epoch {rung} (weaker than the trials before it at that rung)"
REASON_BASELINE = "non-private baseline (not a DP trial)"
REASON_RERUN = "re-run with fresh noise of {of} (counted in its mean ± sd, not a new point)"
REASON_DEGENERATE = (f"degenerate: validation accuracy below chance + {DEGENERATE_MARGIN:g}")
REASON_UNAUDITED = "no peak MIA accuracy (audit not run or failed)"
REASON_UNSCORED = ("no peak MIA accuracy: the audit ran but could score no layer × attack "
                   "(each layer's reason is in the per-layer audit)")
REASON_NO_ACCURACY = "no validation accuracy"
#: A ``mia_layers`` cell's status when the audit scored it (``trainables.audit.exclusion.SCORED``,
#: which the report does not import); cells written before cells had a status are scored ones.
SCORED = "scored"


def natural_key(text: str) -> tuple[Any, ...]:
    """t2 before t10: trial ids sort the way a person reads them."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p)
                 for p in re.split(r"(\d+)", str(text)))


def sort_trials(frame: pd.DataFrame, *, by: Sequence[str] = (),
                ascending: Sequence[bool] = ()) -> pd.DataFrame:
    """Rows sorted by ``by`` then by readable trial id (stable for any input order)."""
    keys = frame["trial_id"].astype(str).map(natural_key)
    return frame.assign(_key=keys).sort_values(
        [*by, "_key"], ascending=[*ascending, True], kind="stable").drop(columns="_key")


# ---- intervals -------------------------------------------------------------------------------
def wilson_interval(accuracy: Sequence[float] | np.ndarray, *, n: int | None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """95% Wilson score interval of proportions measured on ``n`` examples (zero width when
    ``n`` is unknown, so the tie rule falls back to plain Pareto dominance)."""
    p = np.asarray(accuracy, dtype=float)
    if not n or n <= 0:
        return p.copy(), p.copy()
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * np.sqrt(np.clip(p * (1 - p), 0.0, None) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return np.clip(centre - half, 0.0, 1.0), np.clip(centre + half, 0.0, 1.0)


def parse_mia_layers(value: Any, *, trial_id: str) -> list[dict[str, Any]]:
    """The ``mia_layers`` JSON cell: a list of per (layer, attack) objects; null is empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return []
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(x, dict) for x in parsed):
        raise UserInputError(field="results.mia_layers", value=f"trial {trial_id}",
                             allowed="a JSON list of per (layer, attack) objects (the results "
                                     "file is corrupt)")
    return parsed


def _pair(value: Any) -> tuple[float, float]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        try:
            return float(value[0]), float(value[1])
        except (TypeError, ValueError):
            pass
    return math.nan, math.nan


def peak_cell(cells: list[dict[str, Any]], *, layer: str, attack: str) -> dict[str, Any] | None:
    """The (layer, attack) entry the row's peak names; else the most accurate entry."""
    for cell in cells:
        if str(cell.get("layer", "")) == layer and str(cell.get("attack", "")) == attack:
            return cell
    scored = [c for c in cells if isinstance(c.get("accuracy"), (int, float))]
    return max(scored, key=lambda c: float(c["accuracy"])) if scored else None


def mia_interval(*, peak: float, upper: float, cells: list[dict[str, Any]], layer: str,
                 attack: str) -> tuple[float, float]:
    """(lower, upper) of the peak MIA accuracy: the peak cell's lower end and the simultaneous
    upper bound (the cell's own upper end when that bound is missing; the point when neither
    exists)."""
    cell = peak_cell(cells, layer=layer, attack=attack)
    lo, hi = _pair(cell.get("accuracy_ci")) if cell else (math.nan, math.nan)
    hi = upper if math.isfinite(upper) else hi
    lo = lo if math.isfinite(lo) else peak
    hi = hi if math.isfinite(hi) else peak
    return min(lo, peak), max(hi, peak)


# ---- dominance -------------------------------------------------------------------------------
def front_mask(*, acc_lo: Sequence[float], acc_hi: Sequence[float], mia_lo: Sequence[float],
               mia_hi: Sequence[float]) -> np.ndarray:
    """Boolean mask of the trials no other trial dominates under the module's tie rule.

    All pairs are compared (in blocks), so the mask does not depend on the row order.
    """
    al, ah, ml, mh = (np.asarray(v, dtype=float) for v in (acc_lo, acc_hi, mia_lo, mia_hi))
    if not (al.shape == ah.shape == ml.shape == mh.shape) or al.ndim != 1:
        raise ValueError("interval bounds must be 1-D sequences of the same length")
    if not all(np.isfinite(v).all() for v in (al, ah, ml, mh)):
        raise ValueError("front points must be finite; filter with eligible() first")
    if (al > ah).any() or (ml > mh).any():
        raise ValueError("each interval needs lower <= upper")
    dominated = np.zeros(al.shape, dtype=bool)
    for start in range(0, len(al), _MASK_BLOCK_ROWS):
        # rows: the trials judged; columns: every other one
        i = slice(start, start + _MASK_BLOCK_ROWS)
        at_least = ((al[None, :] >= al[i, None]) & (ah[None, :] >= ah[i, None])
                    & (ml[None, :] <= ml[i, None]) & (mh[None, :] <= mh[i, None]))
        clear = (al[None, :] > ah[i, None]) | (mh[None, :] < ml[i, None])
        dominated[i] = (at_least & clear).any(axis=1)
    return ~dominated


# ---- hypervolume -----------------------------------------------------------------------------
def accuracy_above_chance(accuracy: Any, *, num_classes: int) -> np.ndarray:
    chance = 1.0 / num_classes
    return (np.asarray(accuracy, dtype=float) - chance) / (1.0 - chance)


def attack_advantage(mia: Any) -> np.ndarray:
    return 2.0 * np.asarray(mia, dtype=float) - 1.0


#: The whole normalised square: no set of points dominates more.
UNIT_AREA = 1.0


def hypervolume(*, accuracy: Sequence[float], mia: Sequence[float], num_classes: int) -> float:
    """Area dominated by the points on normalised axes, reference (0, 1) (module docstring).

    Each point (x, y) dominates [0, x] x [y, 1]; the union's area is the integral over x of
    (1 - lowest y among points with x' >= x). Dominated points may be passed: they add nothing.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    x = np.clip(accuracy_above_chance(accuracy, num_classes=num_classes), 0.0, 1.0)
    y = np.clip(attack_advantage(mia), 0.0, 1.0)
    ref_x, ref_y = REFERENCE
    keep = np.isfinite(x) & np.isfinite(y) & (x > ref_x) & (y < ref_y)
    x, y = x[keep], y[keep]
    if x.size == 0:
        return 0.0
    order = np.argsort(-x, kind="stable")
    x, y = x[order], y[order]
    lowest = np.minimum.accumulate(y)
    lower_edges = np.append(x[1:], ref_x)
    # a sum of float terms whose exact total is at most the unit square can round past it
    return float(min(np.sum((x - lower_edges) * (ref_y - lowest)), UNIT_AREA))


# ---- which trials --------------------------------------------------------------------------
def _column(frame: pd.DataFrame, name: str, default: Any) -> pd.Series:
    if name in frame.columns:
        return frame[name]
    return pd.Series([default] * len(frame), index=frame.index, dtype=object)


def _numeric(frame: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column; a column of another type is a corrupt store (one UserInputError)."""
    if name not in frame.columns:
        return pd.Series(math.nan, index=frame.index, dtype=float)
    column = frame[name]
    if column.isna().all():
        return column.astype(float)
    numeric = (pd.api.types.is_numeric_dtype(column)
               and not pd.api.types.is_bool_dtype(column)) or (
        column.dtype == object and all(isinstance(v, (int, float, np.number))
                                       and not isinstance(v, (bool, np.bool_))
                                       for v in column.dropna()))
    if not numeric:
        raise UserInputError(field=f"results.{name}", value=str(column.dtype),
                             allowed="a numeric column (the results file is corrupt)")
    return column.astype(float)


def _flag(frame: pd.DataFrame, name: str, default: bool) -> pd.Series:
    return _column(frame, name, default).fillna(default).astype(bool)


def _text(frame: pd.DataFrame, name: str) -> pd.Series:
    return _column(frame, name, "").fillna("").astype(str)


def exclusion_reasons(frame: pd.DataFrame) -> pd.Series:
    """Why each row is kept off the fronts ('' for rows that may enter one)."""
    acc, mia = _numeric(frame, ACC), _numeric(frame, MIA)
    status, method = _text(frame, "status"), _text(frame, "method")
    repeat, error = _text(frame, "repeat_of"), _text(frame, "error")
    audit_error = _text(frame, "audit_error")
    layers, ids = _column(frame, "mia_layers", None), _text(frame, "trial_id")
    degenerate = _flag(frame, "degenerate", False)
    reasons = []
    for i in range(len(frame)):
        if method.iat[i] == NONPRIVATE:
            reason = REASON_BASELINE
        elif status.iat[i] == PRUNED:
            rung = _numeric(frame, "pruned_at").iat[i] if "pruned_at" in frame else math.nan
            reason = REASON_PRUNED.format(rung=f"{rung:.0f}" if math.isfinite(rung) else "?")
        elif status.iat[i] != OK:
            reason = f"{REASON_FAILED}: {error.iat[i] or '(no reason recorded)'}"
        elif repeat.iat[i]:
            reason = REASON_RERUN.format(of=repeat.iat[i])
        elif not math.isfinite(acc.iat[i]):
            reason = REASON_NO_ACCURACY
        elif degenerate.iat[i]:
            reason = REASON_DEGENERATE
        elif not math.isfinite(mia.iat[i]) and not audit_error.iat[i] \
                and _audited_unscored(layers.iat[i], trial_id=str(ids.iat[i])):
            reason = REASON_UNSCORED
        elif not math.isfinite(mia.iat[i]):
            reason = REASON_UNAUDITED + (f": {audit_error.iat[i]}" if audit_error.iat[i] else "")
        else:
            reason = ""
        reasons.append(reason)
    return pd.Series(reasons, index=frame.index, dtype=object)


def _audited_unscored(cells: Any, *, trial_id: str) -> bool:
    """Whether an audit recorded cells and scored none of them (every layer excluded, e.g.
    frozen and shared with every reference)."""
    parsed = parse_mia_layers(cells, trial_id=trial_id)
    return bool(parsed) and all(c.get("status", SCORED) != SCORED for c in parsed)


def exclusions(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows kept off every front, with the reason, in trial order."""
    reasons = exclusion_reasons(frame)
    out = pd.DataFrame({"trial_id": _text(frame, "trial_id"), "series": _text(frame, "series"),
                        "study": _text(frame, "study"),
                        "target_epsilon": _numeric(frame, "target_epsilon"),
                        "reason": reasons})
    return sort_trials(out[reasons != ""]).reset_index(drop=True)


def eligible(frame: pd.DataFrame, *, validation_size: int | None) -> pd.DataFrame:
    """Rows that may enter a front, with their interval columns (ACC_LO .. MIA_HI) added."""
    reasons = exclusion_reasons(frame)
    out = frame[reasons == ""].copy()
    out[ACC] = _numeric(out, ACC)
    out[MIA] = _numeric(out, MIA)
    out["target_epsilon"] = _numeric(out, "target_epsilon")
    for name, default in (("dp_valid", False), ("release_safe", True),
                          ("audit_contradicts", False)):
        out[name] = _flag(out, name, default)
    for name in ("series", "study", "peak_layer", "peak_attack", "trial_id", "method"):
        out[name] = _text(out, name)
    out["series"] = out["series"].where(out["series"] != "", out["method"])
    out[ACC_LO], out[ACC_HI] = wilson_interval(out[ACC].to_numpy(), n=validation_size)
    upper = _numeric(out, MIA_UPPER)
    bounds = [mia_interval(peak=float(r[MIA]), upper=float(u),
                           cells=parse_mia_layers(r.get("mia_layers"), trial_id=r["trial_id"]),
                           layer=r["peak_layer"], attack=r["peak_attack"])
              for (_, r), u in zip(out.iterrows(), upper, strict=True)]
    out[MIA_LO] = [b[0] for b in bounds]
    out[MIA_HI] = [b[1] for b in bounds]
    return sort_trials(out)


# ---- fronts ----------------------------------------------------------------------------------
def front_of(pool: pd.DataFrame) -> pd.DataFrame:
    """The front rows of an eligible pool, ordered along the front (MIA up, accuracy up, then
    readable trial id) so that joining consecutive points draws the staircase."""
    if pool.empty:
        return pool.copy()
    mask = front_mask(acc_lo=pool[ACC_LO], acc_hi=pool[ACC_HI], mia_lo=pool[MIA_LO],
                      mia_hi=pool[MIA_HI])
    return sort_trials(pool[mask], by=[MIA, ACC], ascending=[True, True])


@dataclass(frozen=True)
class Front:
    """One front: what it ranges over, its trials (ordered along it) and its hypervolume."""

    name: str
    kind: str  # KIND_ALL, KIND_VALID or KIND_STUDY
    target_epsilon: float
    series: str  # the study's series; '' for fronts over several series
    pool_size: int
    trials: pd.DataFrame
    hypervolume: float

    @property
    def trial_ids(self) -> tuple[str, ...]:
        return tuple(self.trials["trial_id"].astype(str))


def front_name(*, kind: str, target_epsilon: float, series: str = "") -> str:
    where = f"eps {target_epsilon:g}"
    return f"{series} @ {where}" if kind == KIND_STUDY else f"{kind} @ {where}"


def fronts(frame: pd.DataFrame, *, validation_size: int | None,
           num_classes: int = DEFAULT_NUM_CLASSES) -> list[Front]:
    """Per target epsilon (ascending): the front over all series, over the valid-DP,
    release-safe trials, then one per study (series at that target, by series name)."""
    pool = eligible(frame, validation_size=validation_size)
    out: list[Front] = []
    for target in sorted(pool["target_epsilon"].dropna().unique()):
        at = pool[pool["target_epsilon"] == target]
        parts = [(KIND_ALL, "", at),
                 (KIND_VALID, "", at[at["dp_valid"] & at["release_safe"]])]
        parts += [(KIND_STUDY, s, at[at["series"] == s]) for s in sorted(at["series"].unique())]
        for kind, series, rows in parts:
            front = front_of(rows)
            out.append(Front(
                name=front_name(kind=kind, target_epsilon=float(target), series=series),
                kind=kind, target_epsilon=float(target), series=series, pool_size=len(rows),
                trials=front,
                hypervolume=hypervolume(accuracy=rows[ACC], mia=rows[MIA],
                                        num_classes=num_classes)))
    return out
