"""Checks of a config across its fields and against what dpsweep's stages can do with it.

``orchestrator.config`` checks each field on its own; the checks here need several fields at
once or the limits of the stages downstream (what the accountant can certify, what the data can
serve, whether a validation split can tell a model from chance), so a config that ``dpsweep
config --check`` accepts is one ``run`` can carry out, and ``run`` refuses before it writes
anything. This module never imports ``orchestrator.config`` (that module imports this one): it
receives a built config.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from dpsweep.core.datasets import POOLS
from dpsweep.core.errors import UserInputError
from dpsweep.core.poisson import delta_bound, steps_per_epoch

#: A built ``orchestrator.config.Config``: typed loosely here, since that module imports this
#: one and the import graph keeps no cycle, not even a type-only one.
Config = Any
#: An ``orchestrator.trial.setup.ResolvedSetup`` (the config's sizes, classes and a user's
#: data), typed loosely for the same reason.
ResolvedSetup = Any

#: Largest epsilon any config may target: far beyond every meaningful claim, small enough that
#: the accountants' discretisations stay within memory.
MAX_EPSILON = 100.0

# ---- values: TOML's integers are 64-bit, and no key takes a date ---------------------------
#: TOML integers are 64-bit signed (the spec: a value outside must be an error); tomllib accepts
#: any size, and one beyond float range crashes every finite-number check downstream.
TOML_INT_RANGE = (-(2**63), 2**63 - 1)


def _shown(value: int) -> Any:
    """An integer as an error message shows it (a huge one cannot even be printed)."""
    return value if value.bit_length() <= 128 else f"<an integer of {value.bit_length()} bits>"


def check_plain(value: Any, *, where: str) -> None:
    """Refuse, anywhere in a parsed table and naming it, an integer outside TOML's 64-bit range
    or a TOML date or time (no key takes one, and the run's JSON records could not hold it)."""
    if isinstance(value, bool):
        return
    if isinstance(value, (datetime.date, datetime.time)):
        raise UserInputError(field=where, value=str(value),
                             allowed="a number, string, boolean, list or table (no dpsweep "
                                     "key takes a date or a time)")
    if isinstance(value, int):
        if not TOML_INT_RANGE[0] <= value <= TOML_INT_RANGE[1]:
            raise UserInputError(field=where, value=_shown(value),
                                 allowed="a 64-bit integer, in [-2^63, 2^63 - 1] (TOML "
                                         "integers are 64-bit; `dpsweep config` gives each "
                                         "key's range)")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_plain(item, where=f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_plain(item, where=where)


# ---- what the accountant can certify --------------------------------------------------------
#: Highest integer order of the accountant's RDP bound (``orchestrator.accounting.prv``: the PRV
#: grid's domain and the calibration's bracket, so every calibration passes through it).
RDP_MAX_ORDER = 128
#: Calibration targets at least this factor above the bound's floor, so the noise that reaches
#: the target lies inside the accountant's search range for any schedule a config can describe.
REACH_MARGIN = 1.02
#: Smallest delta per composed step. Float64 rounding in a composition grows with its steps;
#: below steps x this it outweighs delta: the PRV grid refuses (RDP answers instead) and
#: dp_accounting's PLD, which independently checks every cached budget, overstates epsilon
#: past even RDP's bound or returns infinity, so no budget could be verified. Measured: the
#: PLD fails at 4e-17 per step (1e-13 over 2,344 steps, 1e-11 over 10^6), holds from 1e-16.
DELTA_PER_STEP = 1e-15


def epsilon_floor(delta: float) -> float:
    """The smallest epsilon the accountant's RDP bound reaches at ``delta``, with infinite noise:
    min over orders a of (log(1/delta) - log a) / (a - 1) + log(1 - 1/a)."""
    return min((-math.log(delta) - math.log(a)) / (a - 1) + math.log1p(-1.0 / a)
               for a in range(2, RDP_MAX_ORDER + 1))


def _round_up(x: float) -> float:
    """``x`` rounded up to three significant digits, so a bound a message shows is accepted."""
    scale = 10.0 ** (math.floor(math.log10(x)) - 2)
    return float(f"{math.ceil(x / scale) * scale:.3g}")


def smallest_epsilon(delta: float) -> float:
    """The smallest target accepted at ``delta``: the floor with its margin, rounded up."""
    return _round_up(epsilon_floor(delta) * REACH_MARGIN)


def smallest_delta(steps: int) -> float:
    """The smallest delta accepted for a schedule of ``steps`` compositions, rounded up."""
    return _round_up(DELTA_PER_STEP * max(steps, 1))


def check_reachable(epsilon: float, delta: float, *, steps: int | None = None,
                    epsilon_field: str = "privacy.epsilon",
                    delta_field: str = "privacy.delta") -> None:
    """A (target, delta) pair the calibration can certify, or one error naming the field to
    change: delta when float64 cannot verify it over ``steps`` (when known), else epsilon."""
    if steps is not None and delta < smallest_delta(steps):
        raise UserInputError(field=delta_field, value=delta,
                             allowed=f"a number >= {smallest_delta(steps):.3g} for {steps} "
                                     "training steps: below it float64 rounding in the "
                                     "accountants' compositions outweighs delta (dp_accounting's "
                                     "PLD, which checks every cached budget, overstates epsilon)")
    low = smallest_epsilon(delta)
    if epsilon < low:
        raise UserInputError(field=epsilon_field, value=epsilon,
                             allowed=f"a number in [{low:.3g}, {MAX_EPSILON:g}] at "
                                     f"{delta_field} = {delta:g}: the accountant's RDP bound "
                                     f"(orders 2-{RDP_MAX_ORDER}) never certifies less at this "
                                     "delta, whatever the noise")


def check_budget(cfg: Config, setup: ResolvedSetup) -> None:
    """Every target the config trains at (``Config.targets``: ``privacy.epsilon`` is not read
    when ``budget.epsilons`` is set) is one the accountant can certify at its delta, over the
    trials' steps (epochs x ceil(train_size / batch_size), the loader's plan)."""
    delta = cfg.privacy.delta
    steps = cfg.training.epochs * steps_per_epoch(dataset_size=setup.split_sizes["train"],
                                                  batch_size=cfg.training.batch_size)
    if not cfg.budget.epsilons:
        check_reachable(cfg.privacy.epsilon, delta, steps=steps)
        return
    for eps in cfg.budget.epsilons:
        try:
            check_reachable(eps, delta, steps=steps)
        except UserInputError as exc:
            if exc.field != "privacy.epsilon":
                raise
            raise UserInputError(field="budget.epsilons", value=cfg.budget.epsilons,
                                 allowed=f"targets in [{smallest_epsilon(delta):.3g}, "
                                         f"{MAX_EPSILON:g}] at privacy.delta = {delta:g} "
                                         f"({eps:g} is below what the accountant's RDP bound "
                                         "certifies at this delta)") from None


# ---- the validation split -------------------------------------------------------------------
#: reports.store.DEGENERATE_MARGIN (not imported: it would bring pandas into config
#: validation): a trial is degenerate below chance + this accuracy.
DEGENERATE_MARGIN = 0.1
#: Two-sided 95% normal quantile.
Z95 = 1.959963984540054


def min_validation_size(num_classes: int) -> int:
    """Examples a validation split needs so that a chance-level model (accuracy 1/K) stays
    below the degenerate line 1/K + DEGENERATE_MARGIN at 95% confidence: the normal interval's
    half-width z sqrt(p (1 - p) / n) is at most the margin."""
    p = 1.0 / max(num_classes, 2)
    return math.ceil(Z95 * Z95 * p * (1.0 - p) / (DEGENERATE_MARGIN * DEGENERATE_MARGIN))


def check_validation_size(*, num_classes: int, sizes: dict[str, int]) -> None:
    """Refuse a validation split too small to tell a trial from chance: a trial that scores 1.0
    on one example would be neither degenerate nor distinguishable from a lucky guess."""
    n, k = sizes["validation"], num_classes
    need = min_validation_size(k)
    if n < need:
        raise UserInputError(field="data.validation_size", value=n,
                             allowed=f"at least {need} examples for {k} classes: with fewer, a "
                                     f"chance-level model (accuracy {1 / max(k, 2):.3g}) is "
                                     f"not told from the degenerate line chance + "
                                     f"{DEGENERATE_MARGIN:g} at 95% confidence, and a lucky "
                                     "few examples could put it on a front")


# ---- sizes ------------------------------------------------------------------------------------
def check_sizes(cfg: Config, setup: ResolvedSetup) -> None:
    """The splits fit the data, delta is below 1/train_size, a batch fits the members, and the
    validation split can tell a trial from chance."""
    sizes = dict(setup.split_sizes)
    if cfg.user_data:
        pool, official_test = setup.file_pool(sizes), 0
    else:
        pool, official_test = POOLS[cfg.data.dataset]
    private = ("train", "validation", "holdout", "shadow")
    if official_test:
        if sizes["test"] > official_test:
            raise UserInputError(field="data.test_size", value=sizes["test"],
                                 allowed=f"<= {official_test} (the official test set)")
        used = sum(sizes[k] for k in private)
        what = " + ".join(f"{k}_size" for k in private)
    else:
        used = sum(sizes.values())
        what = " + ".join(f"{k}_size" for k in (*private, "test"))
    if used > pool:
        raise UserInputError(field="data.sizes", value=f"{what} = {used}",
                             allowed=f"<= {pool} examples available in {cfg.data.dataset}")
    n = sizes["train"]
    if cfg.privacy.delta >= delta_bound(n):
        raise UserInputError(field="privacy.delta", value=cfg.privacy.delta,
                             allowed=f"< 1/train_size = {delta_bound(n):.3g} (a larger delta "
                                     "permits releasing whole examples)")
    if cfg.training.batch_size > n:
        raise UserInputError(field="training.batch_size", value=cfg.training.batch_size,
                             allowed=f"<= train_size = {n}")
    check_validation_size(num_classes=setup.num_classes, sizes=sizes)
    check_max_candidates(cfg, sizes)


def check_max_candidates(cfg: Config, sizes: dict[str, int]) -> None:
    """Refuse ``audit.max_candidates`` above min(train_size, holdout_size): the audit draws that
    many members and as many non-members, so a larger value would be cut without a word."""
    value, train, holdout = cfg.audit.max_candidates, sizes["train"], sizes["holdout"]
    largest = min(train, holdout)
    if value > largest:
        raise UserInputError(field="audit.max_candidates", value=value,
                             allowed=f"0 or at most {largest} = min(train_size = {train}, "
                                     f"holdout_size = {holdout}): the audit draws that many "
                                     "members and as many non-members, and the splits hold "
                                     "no more")


# ---- the sweep's series and its search ranges -----------------------------------------------
def check_series_texts(value: Any) -> list[str]:
    """``sweep.methods``: a list of 'method' or 'method:mode' strings; an empty mode after the
    colon is refused rather than read as the default mode."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError
    for text in value:
        name, colon, mode = text.partition(":")
        if colon and name and not mode:
            raise UserInputError(field="sweep.methods", value=text,
                                 allowed=f"'{name}' (its default mode) or '{name}:MODE' with "
                                         "a mode named after the colon")
    return list(value)
