"""How a sweep chooses hyperparameters, and what its epsilons then cover.

Two modes (``sweep.tuning``). **Adaptive**: each study's seeded sampler (TPE by default) starts
from the paper preset and adapts to noiseless metrics; ``adaptive_summary`` states, per target,
what the per-trial epsilon and the composition over every trained model cover given the
objectives the sampler saw (``orchestrator.accounting.tuning.adaptive.adaptive_statement``).
**Private** (Papernot & Steinke 2022): random search from OS entropy with no fixed point, a
secret number of trials drawn from the stated law, a noisy validation score, and release of the
best noisy score only (``released_front``, ``reports.pick.choose_private``); the config admits
nothing adaptive (``orchestrator.config``). The run directory still holds the trial count and
every trial's noiseless scores: it stays with whoever ran the sweep (docs/search.md).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import pandas as pd
import tomli_w

from dpsweep.core.errors import UserInputError
from dpsweep.core.poisson import poisson_plan
from dpsweep.core.schedule import Schedule
from dpsweep.core.vocabulary import OK
from dpsweep.orchestrator.accounting.tuning.adaptive import adaptive_statement
from dpsweep.orchestrator.accounting.tuning.private import draw_trial_count, plan_private_tuning
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import CheckedSetup
from dpsweep.orchestrator.sweep.plans import schedule_points, study_plans
from dpsweep.orchestrator.sweep.studies import (
    StudyPlan,
    make_sampler,
    open_study,
    secret_random_sampler,
)
from dpsweep.reports.pick import choose_private
from dpsweep.trainables.methods import get_method, series_name

#: ``[sweep]`` keys private tuning never reads (its points come from OS entropy, by random
#: search): the run directory's config.toml leaves them out rather than record a value unused.
PRIVATE_UNUSED = ("seed", "sampler")
#: config.toml's first line in a private-tuning run directory, saying what was left out.
PRIVATE_NOTE = ("# sweep.tuning = 'private': sweep.seed and sweep.sampler are not recorded: "
                "private tuning draws its points from OS entropy (random search) and uses "
                "neither\n")


def recorded_config_text(cfg: Config) -> str:
    """The config as a run directory records it (config.toml): every key the run uses; with
    private tuning, without PRIVATE_UNUSED (loading it back gives their defaults, also unused)."""
    if cfg.sweep.tuning != "private":
        return cfg.to_toml()

    raw = cfg.to_dict()
    raw["sweep"] = {k: v for k, v in raw["sweep"].items() if k not in PRIVATE_UNUSED}
    return PRIVATE_NOTE + tomli_w.dumps(raw)


#: Plans already computed in this process, by config text: the sweep validates the plan before
#: it creates anything, then uses it (the bisection takes seconds; the plan is a pure function
#: of the config).
_PLANS: dict[str, Any] = {}


def private_tuning_plan(setup: CheckedSetup) -> Any:
    """Papernot & Steinke's random search: one noise schedule for every trial (the end-to-end
    bound needs one base mechanism), the per-trial noise derived from the end-to-end target."""
    key = setup.config.to_toml()
    if key not in _PLANS:
        _PLANS[key] = _private_tuning_plan(setup)
    return _PLANS[key]


def _private_tuning_plan(setup: CheckedSetup) -> Any:
    cfg = setup.config
    sizes = setup.split_sizes
    q, steps_per_epoch = poisson_plan(dataset_size=sizes["train"],
                                      batch_size=cfg.training.batch_size)
    shapes = {}
    for plan in study_plans(setup):
        for point in schedule_points(plan):
            params = get_method(plan.method).validate_params(plan.space.decode(point))
            shapes[(plan.series, str(point))] = get_method(plan.method).noise_shape(
                epochs=cfg.training.epochs, steps_per_epoch=steps_per_epoch, params=params)
    distinct = {tuple(s.merged().phases) for s in shapes.values()}
    if len(distinct) != 1:
        raise UserInputError(field="sweep.tuning", value="private",
                             allowed="series whose trials all share one noise schedule (fix "
                                     "dp_adamilg's decay k in [method_params.dp_adamilg], or "
                                     "sweep it adaptively)")
    shape = next(iter(shapes.values()))
    dist = cfg.sweep.trial_count_distribution
    # dp_accounting's RDP series report orders they drop at tiny noise; the bound stays valid
    logging.getLogger("absl").setLevel(logging.ERROR)
    return plan_private_tuning(
        # the one target (config refuses several): budget.epsilons = [1] is 1 end to end
        target_epsilon=cfg.targets()[0], delta=cfg.privacy.delta, sample_rate=q,
        shape=shape, mean_trials=cfg.sweep.expected_trials, distribution=dist,
        shape_eta=cfg.sweep.trial_count_shape if dist != "poisson" else None,
        score_noise_multiplier=cfg.sweep.score_noise)


def draw_counts(setup: CheckedSetup, plan: Any) -> dict[str, int]:
    """K ~ the plan's law (secret entropy), each trial's series uniformly at random."""
    series = [series_name(m, mode) for m, mode in setup.series()]
    counts = dict.fromkeys(series, 0)
    for _ in range(draw_trial_count(plan=plan)):
        counts[secrets.choice(series)] += 1
    return counts


def open_plan_study(cfg: Config, plan: StudyPlan, *, index: int, storage: Any,
                    parallel: bool) -> Any:
    """The study with its sampler: adaptive tuning's seeded ``sweep.sampler`` and preset first
    point, or private tuning's random search from OS entropy with no fixed point (Papernot &
    Steinke's bound needs i.i.d. draws from a distribution fixed before the run)."""
    if cfg.sweep.tuning == "private":
        return open_study(plan, storage=storage, sampler=secret_random_sampler(),
                          first_point=False)
    return open_study(plan, storage=storage, sampler=make_sampler(
        cfg.sweep.sampler, seed=cfg.sweep.seed + index, parallel=parallel))


def released_front(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Private tuning's one released trial by study ({} when none finished: K = 0, or every
    trial failed): what an after-sweep audit may look at, chosen by the noisy score alone."""
    try:
        choice = choose_private(pd.DataFrame(rows))
    except UserInputError:
        return {}
    return {str(choice.trial["study"]): [choice.trial_id]}


def _dp_valid(plan: StudyPlan) -> bool:
    return next(m.dp_valid for m in get_method(plan.method).modes if m.name == plan.mode)


def adaptive_summary(cfg: Config, plans: list[StudyPlan], rows: list[dict[str, Any]], *,
                     retried: Mapping[str, int] | None = None) -> dict[str, Any]:
    """summary.json's tuning entry of an adaptive sweep: per target, the statement for the
    objectives its sampler saw, counting every model trained on the training set by a DP-valid
    series (finished and failed search trials, re-runs, and each failed attempt ``resume
    --retry-failed`` trained again: ``retried``, id -> attempts, from attempts.json); one
    DP-SGD mechanism throughout is composed exactly (a retried attempt ran its trial's own
    spec, or less of it), anything else (a failed trial's unknown schedule) as black boxes. A
    series with an invalid claim is not DP: no composition counts or covers it (each study's
    sampler sees only its own trials, so it does not reach the valid ones)."""
    retried = retried or {}
    by_target: dict[str, dict[str, Any]] = {}
    for eps in dict.fromkeys(p.epsilon for p in plans):
        at = [p for p in plans if p.epsilon == eps]
        names = {p.name for p in at if _dp_valid(p)}
        mine = [r for r in rows if r.get("study") in names]
        ok = [r for r in mine if r["status"] == OK]
        if not ok:
            continue
        search = [r for r in mine if not r.get("repeat_of")]
        repeats = [r for r in mine if r.get("repeat_of")]
        earlier_search = sum(retried.get(str(r["trial_id"]), 0) for r in search)
        earlier_repeats = sum(retried.get(str(r["trial_id"]), 0) for r in repeats)
        schedules = {r["noise_schedule"] for r in ok}
        rates = {r["sample_rate"] for r in ok}
        exact = len(schedules) == len(rates) == 1 and len(ok) == len(mine)
        stmt = adaptive_statement(
            n_trials=len(search) + earlier_search, reruns=len(repeats) + earlier_repeats,
            per_trial_epsilon=eps, delta=cfg.privacy.delta, objectives=at[0].objectives,
            sample_rate=rates.pop() if exact else None,
            schedule=Schedule.from_list(json.loads(schedules.pop())) if exact else None)
        entry = {"mode": "adaptive", **stmt.to_dict()}
        if earlier := earlier_search + earlier_repeats:
            entry["statement"] += (f" The count includes {earlier} failed attempt(s) of trials "
                                   f"trained again (resume --retry-failed): each trained on "
                                   f"the training set too.")
        invalid = [p.series for p in at if not _dp_valid(p)]
        if invalid:
            entry["statement"] += (f" Series whose epsilon claim is invalid ("
                                   f"{', '.join(invalid)}) are not counted: nothing covers "
                                   f"their models, or a choice that reads their metrics.")
        by_target[f"{eps:g}"] = entry
    bounds = [v for v in by_target.values() if v["composed_epsilon"] is not None]
    if len(by_target) > 1 and len(bounds) == len(by_target):
        across = (f" Choosing across the {len(by_target)} targets (pick ranges over every "
                  f"target) is covered for the training set by the sum of their bounds, "
                  f"({sum(v['composed_epsilon'] for v in bounds):.4g}, "
                  f"{sum(v['composed_delta'] for v in bounds):.3g})-DP (basic composition).")
        for v in by_target.values():
            v["statement"] += across
    return {"mode": "adaptive",
            "statement": " ".join(v["statement"] for v in by_target.values()),
            "n_trials": sum(int(v["n_trials"]) + int(v["reruns"]) for v in by_target.values()),
            "end_to_end_epsilon": None, "by_target": by_target}
