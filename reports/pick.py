"""Which trial to deploy: pure selection over a results frame (``dpsweep pick`` writes files
through ``orchestrator.pickfile``).

The pool is the trials a front may hold (``reports.pareto.eligible``: finished, audited, not
degenerate, not the non-private baseline, not a re-run), restricted to valid DP and
release-safe trials unless ``allow_invalid_dp`` / ``allow_replayable`` admit the others, and to
one series if asked. The pool spans every target epsilon (each trial's target is reported with
it): the constraints are on measured attack success, which is what a deployment cares about.
Pick takes the front of that pool (so an inadmissible trial never knocks an admissible one off
it; the tie rule is ``reports.pareto``'s), keeps the front trials meeting the constraints, and
returns the one with the highest **validation** accuracy. Test accuracy is never read here.

Constraints: ``max_peak_mia`` bounds ``peak_mia_upper``, the simultaneous upper confidence bound
of the peak attack accuracy (a trial without it cannot be shown to meet the bound and does not
qualify); ``min_val_acc`` bounds the validation accuracy. Restricting to the front loses
nothing: a trial dominating a qualifying one has an upper MIA bound and an accuracy interval at
least as good at both ends, so it qualifies too.

Ties: qualifying trials whose validation-accuracy intervals overlap the chosen one's cannot be
ranked on the criterion pick selects by, so they are returned as ties. Pick still returns one
trial, the highest validation accuracy as a point estimate (then the lower MIA upper bound, then
the readable trial id): that is the stated objective, and the order is the same in any row
order. Preferring a tied trial with a lower attack bound is a privacy choice the user makes
explicitly, with ``max_peak_mia``, seeing the ties listed.

A private-tuning run is chosen by :func:`choose_private` instead: the best noisy validation
score, the one selection its end-to-end epsilon covers; nothing noiseless is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dpsweep.core.errors import UserInputError
from dpsweep.core.modes import INVALID_TAG
from dpsweep.core.vocabulary import OK
from dpsweep.reports.pareto import (
    ACC,
    ACC_HI,
    ACC_LO,
    KIND_VALID,
    MIA,
    MIA_UPPER,
    NONPRIVATE,
    eligible,
    exclusion_reasons,
    front_of,
    natural_key,
    sort_trials,
)

#: Front trials named when nothing qualifies.
CLOSEST = 3
#: The attack bound the report recommends at and the README's example uses. ``max_peak_mia``
#: bounds the *upper* end of the peak's simultaneous interval: at the demo's audit size (300
#: non-members) that end lies at 0.59-0.66 even for peaks inside the chance band, so a bound
#: below it refuses every trial whatever it leaks.
SUGGESTED_MAX_PEAK_MIA = 0.7
REPLAYABLE_TAG = "replayable: not releasable"
TIE_RULE = ("trials whose validation-accuracy intervals overlap the chosen one's are ties; the "
            "highest validation accuracy (point estimate) is returned, then the lower peak MIA "
            "upper bound, then the trial id")

#: The noisy selection score of a private-tuning trial
#: (``orchestrator.accounting.private_tuning.noisy_score``).
NOISY = "noisy_val_score"
PRIVATE_RULE = ("the highest noisy validation score among the search's dp_valid, release-safe "
                "trials (private tuning: the one selection its end-to-end epsilon covers)")


@dataclass(frozen=True)
class Choice:
    """The chosen trial (its results row with interval columns), its ties and what it was
    chosen from."""

    trial: dict[str, Any]
    ties: tuple[dict[str, Any], ...]
    qualifying: tuple[str, ...]  # front trials meeting every constraint, best first
    front: tuple[str, ...]  # the front pick chose from
    constraints: dict[str, Any]

    @property
    def trial_id(self) -> str:
        return str(self.trial["trial_id"])


def check_constraint(flag: str, value: float | None) -> None:
    """A constraint is an accuracy in [0, 1] (or absent)."""
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)
                                  and 0.0 <= value <= 1.0):
        raise UserInputError(field=flag, value=value, allowed="a number in [0, 1]")


def _upper(frame: pd.DataFrame) -> pd.Series:
    if MIA_UPPER not in frame.columns:
        return pd.Series(math.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[MIA_UPPER], errors="coerce").astype(float)


def meets(frame: pd.DataFrame, *, max_peak_mia: float | None,
          min_val_acc: float | None) -> pd.Series:
    """Rows meeting both constraints (a missing upper bound fails ``max_peak_mia``)."""
    ok = pd.Series(True, index=frame.index)
    if max_peak_mia is not None:
        ok &= (_upper(frame) <= max_peak_mia).fillna(False)
    if min_val_acc is not None:
        ok &= frame[ACC] >= min_val_acc
    return ok


def ranked(frame: pd.DataFrame) -> pd.DataFrame:
    """Highest validation accuracy first; then lower MIA upper bound; then readable id."""
    return sort_trials(frame.assign(_upper=_upper(frame).fillna(math.inf)),
                       by=[ACC, "_upper"], ascending=[False, True]).drop(columns="_upper")


def describe(row: pd.Series | dict[str, Any]) -> str:
    """One trial in a sentence (messages and tie lists)."""
    upper = _upper(pd.DataFrame([dict(row)])).iloc[0]
    flags = [] if bool(row["dp_valid"]) else [INVALID_TAG]
    if not bool(row.get("release_safe", True)):
        flags.append(REPLAYABLE_TAG)
    return (f"{row['trial_id']} ({row['series']}, eps {float(row['target_epsilon']):g}) "
            f"val acc {float(row[ACC]):.4f} [{float(row[ACC_LO]):.4f}, {float(row[ACC_HI]):.4f}]"
            f", peak MIA {float(row[MIA]):.4f} (upper {upper:.4f})"
            + (f", {', '.join(flags)}" if flags else ""))


def _admissible(pool: pd.DataFrame, *, allow_invalid_dp: bool,
                allow_replayable: bool) -> pd.Series:
    ok = pd.Series(True, index=pool.index)
    if not allow_invalid_dp:
        ok &= pool["dp_valid"]
    if not allow_replayable:
        ok &= pool["release_safe"]
    return ok


def _closest(front: pd.DataFrame, *, max_peak_mia: float | None,
             min_val_acc: float | None) -> list[str]:
    """The front trials nearest to meeting the constraints (sum of the shortfalls)."""
    if front.empty:
        return []
    short = pd.Series(0.0, index=front.index)
    if max_peak_mia is not None:
        short += (_upper(front) - max_peak_mia).clip(lower=0.0).fillna(1.0)
    if min_val_acc is not None:
        short += (min_val_acc - front[ACC]).clip(lower=0.0)
    order = ranked(front.assign(_short=short)).sort_values("_short", kind="stable")
    return [describe(r) for _, r in order.head(CLOSEST).iterrows()]


def _nothing_qualifies(*, pool: pd.DataFrame, front: pd.DataFrame, admissible: pd.Series,
                       max_peak_mia: float | None, min_val_acc: float | None,
                       allow_invalid_dp: bool, allow_replayable: bool,
                       scope: str) -> UserInputError:
    """One error naming the constraints that excluded the front trials and the closest ones."""
    parts, binding = [], []
    if max_peak_mia is not None:
        over = int((~meets(front, max_peak_mia=max_peak_mia, min_val_acc=None)).sum())
        if over:
            binding.append(("--max-peak-mia", max_peak_mia))
            parts.append(f"{over} have a peak MIA upper bound above {max_peak_mia:g} (or none)")
    if min_val_acc is not None:
        under = int((front[ACC] < min_val_acc).sum())
        if under:
            binding.append(("--min-val-acc", min_val_acc))
            parts.append(f"{under} have validation accuracy below {min_val_acc:g}")
    text = f"of the {len(front)} admissible front trials ({scope}), " + " and ".join(parts)
    others = pool[~admissible]
    if len(others):
        would = front_of(pool)
        would = would[~admissible.reindex(would.index).fillna(False).astype(bool)
                      & meets(would, max_peak_mia=max_peak_mia, min_val_acc=min_val_acc)]
        flags = [f for f, allowed in (("--allow-invalid-dp", allow_invalid_dp),
                                      ("--allow-replayable", allow_replayable)) if not allowed]
        text += (f"; {len(others)} other audited trials were excluded as "
                 f"{INVALID_TAG} or {REPLAYABLE_TAG} ({' / '.join(flags)} admits them"
                 + (f"; {len(would)} of them would qualify)" if len(would)
                    else "; none of them would qualify either)"))
    closest = _closest(front, max_peak_mia=max_peak_mia, min_val_acc=min_val_acc)
    if closest:
        text += "; closest: " + "; ".join(closest)
    field = "/".join(name for name, _ in binding)
    value = binding[0][1] if len(binding) == 1 else tuple(v for _, v in binding)
    return UserInputError(field=field, value=value,
                          allowed=f"a constraint that some trial meets: {text}")


def _no_pool(frame: pd.DataFrame, *, scope: str, run_dir: object) -> UserInputError:
    reasons = exclusion_reasons(frame)
    counts: dict[str, int] = {}
    for reason in reasons[reasons != ""]:
        key = reason.split(":")[0].split(" (")[0].split(" of ")[0]
        counts[key] = counts.get(key, 0) + 1
    why = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no trials"
    return UserInputError(field="RUN_DIR", value=_shown(run_dir),
                          allowed=f"at least one finished, audited, non-degenerate DP trial in "
                                  f"{scope} (run the audit first if none is audited: `dpsweep "
                                  f"reaudit RUN_DIR` audits finished trials without training "
                                  f"them; here: {why})")


def _shown(run_dir: object) -> str:
    """RUN_DIR's value as the line shows it: the path the caller was given (an in-sweep
    choice has none, and says so)."""
    return "(the run directory)" if run_dir is None else str(run_dir)


def _no_admissible(pool: pd.DataFrame, *, allow_invalid_dp: bool, allow_replayable: bool,
                   scope: str) -> UserInputError:
    invalid = int((~pool["dp_valid"]).sum())
    replayable = int((~pool["release_safe"]).sum())
    flags = []
    if not allow_invalid_dp and invalid:
        flags.append(("--allow-invalid-dp", f"{invalid} are {INVALID_TAG}"))
    if not allow_replayable and replayable:
        flags.append(("--allow-replayable", f"{replayable} are {REPLAYABLE_TAG}"))
    return UserInputError(
        field="/".join(f for f, _ in flags), value=False,
        allowed=f"a flag admitting them: all {len(pool)} audited trials ({scope}) are "
                f"excluded: {'; '.join(t for _, t in flags)}")


def choose(frame: pd.DataFrame, *, validation_size: int | None,
           max_peak_mia: float | None = None, min_val_acc: float | None = None,
           series: str | None = None, allow_invalid_dp: bool = False,
           allow_replayable: bool = False, run_dir: str | Path | None = None) -> Choice:
    """The deployable trial under the constraints (module docstring), or one UserInputError
    naming the constraint that excluded the trials and the closest ones (``run_dir``: the
    value a refusal naming RUN_DIR shows)."""
    check_constraint("--max-peak-mia", max_peak_mia)
    check_constraint("--min-val-acc", min_val_acc)
    if series is not None:
        known = sorted({str(s) for s in frame["series"].dropna()} - {""}, key=natural_key)
        if series not in known:
            raise UserInputError(field="--series", value=series,
                                 allowed=f"a series of this run: {known}")
        frame = frame[frame["series"] == series]
    scope = f"series {series}" if series else "all series"
    pool = eligible(frame, validation_size=validation_size)
    if pool.empty:
        raise _no_pool(frame, scope=scope, run_dir=run_dir)
    admissible = _admissible(pool, allow_invalid_dp=allow_invalid_dp,
                             allow_replayable=allow_replayable)
    if not admissible.any():
        raise _no_admissible(pool, allow_invalid_dp=allow_invalid_dp,
                             allow_replayable=allow_replayable, scope=scope)
    front = front_of(pool[admissible])
    qualifying = ranked(front[meets(front, max_peak_mia=max_peak_mia,
                                    min_val_acc=min_val_acc)])
    if qualifying.empty:
        raise _nothing_qualifies(pool=pool, front=front, admissible=admissible,
                                 max_peak_mia=max_peak_mia, min_val_acc=min_val_acc,
                                 allow_invalid_dp=allow_invalid_dp,
                                 allow_replayable=allow_replayable, scope=scope)
    best = qualifying.iloc[0]
    rest = qualifying.iloc[1:]
    tied = rest[(rest[ACC_HI] >= best[ACC_LO]) & (rest[ACC_LO] <= best[ACC_HI])]
    constraints = {"max_peak_mia": max_peak_mia, "min_val_acc": min_val_acc, "series": series,
                   "allow_invalid_dp": allow_invalid_dp, "allow_replayable": allow_replayable}
    return Choice(trial=best.to_dict(), ties=tuple(r.to_dict() for _, r in tied.iterrows()),
                  qualifying=tuple(qualifying["trial_id"].astype(str)),
                  front=tuple(front["trial_id"].astype(str)), constraints=constraints)


def choose_private(frame: pd.DataFrame, *, allow_invalid_dp: bool = False,
                   allow_replayable: bool = False, run_dir: str | Path | None = None) -> Choice:
    """Private tuning's release: the search trial with the highest noisy validation score.

    That argmax is what Papernot & Steinke's bound covers, so nothing noiseless is read: not
    validation accuracy, not ``degenerate`` (a noiseless threshold), not the audit. Leaving out
    trials that are not dp_valid or release-safe is covered too: both follow from the trial's
    series and the config, never from data, so it is the same as reading their scores as minus
    infinity. Re-runs and the non-private baseline are not search trials. Ties (probability
    zero under Gaussian noise) go to the readable trial id.
    """
    if frame.empty or NOISY not in frame.columns:
        raise _nothing_released(run_dir)
    score = pd.to_numeric(frame[NOISY], errors="coerce").astype(float)
    status = frame.get("status", pd.Series("", index=frame.index)).fillna("").astype(str)
    repeat = frame.get("repeat_of", pd.Series("", index=frame.index)).fillna("").astype(str)
    method = frame.get("method", pd.Series("", index=frame.index)).fillna("").astype(str)
    searched = (status == OK) & score.map(math.isfinite) & (repeat == "") & (
        method != NONPRIVATE)
    if not searched.any():
        raise _nothing_released(run_dir)
    pool = frame[searched].assign(**{NOISY: score[searched]})
    for column in ("dp_valid", "release_safe"):
        pool[column] = pool[column].fillna(False).astype(bool)
    admissible = pool[_admissible(pool, allow_invalid_dp=allow_invalid_dp,
                                  allow_replayable=allow_replayable)]
    if admissible.empty:
        flags = [f for f, allowed in (("--allow-invalid-dp", allow_invalid_dp),
                                      ("--allow-replayable", allow_replayable)) if not allowed]
        raise UserInputError(field="/".join(flags), value=False,
                             allowed=f"a flag admitting them: no finished trial of this "
                                     f"private-tuning run is {KIND_VALID}")
    best = sort_trials(admissible, by=[NOISY], ascending=[False]).iloc[0].to_dict()
    return Choice(trial=best, ties=(), qualifying=(str(best["trial_id"]),), front=(),
                  constraints={"rule": PRIVATE_RULE, "allow_invalid_dp": allow_invalid_dp,
                               "allow_replayable": allow_replayable})


def _nothing_released(run_dir: object) -> UserInputError:
    return UserInputError(field="RUN_DIR", value=_shown(run_dir),
                          allowed="a private-tuning run with at least one finished trial (K = 0 "
                                  "trials were drawn, or every trial failed: nothing is "
                                  "released)")
