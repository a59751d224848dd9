"""Which studies a sweep runs: one per (series, target), with its search space and objectives,
and the budgets they can ask for, calibrated before any trial starts (``precompute``).

Shared by the driver (``orchestrator.sweep.driver``) and how it tunes
(``orchestrator.sweep.tuning``), neither of which the planning needs.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from dpsweep.core.vocabulary import ATTACK_OBJECTIVE, NOISY_OBJECTIVE, VALIDATION_OBJECTIVE
from dpsweep.orchestrator.accounting.sandbox import keep_interpreters
from dpsweep.orchestrator.audit.membership import reference_budgets
from dpsweep.orchestrator.door import CheckedSetup, require_checked
from dpsweep.orchestrator.sweep.progress import progress
from dpsweep.orchestrator.sweep.studies import StudyPlan, study_name
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.search_spaces import build_space
from dpsweep.trainables.dp.step import DPStep
from dpsweep.trainables.methods import get_method, series_name

if TYPE_CHECKING:
    from dpsweep.orchestrator.rundir import RunDir

__all__ = ["precompute", "precompute_order", "schedule_points", "study_plans"]


def study_plans(setup: CheckedSetup, *,
                counts: dict[str, int] | None = None) -> list[StudyPlan]:
    """Every (series, target) study with its space: fixed values from [method_params] are not
    searched, user ranges from [search.<method>] replace the defaults. ``counts`` (private
    tuning) gives each series its share of the secretly drawn number of trials."""
    cfg = require_checked(setup, where="study_plans").config
    layers = setup.num_layers
    two = cfg.audit.enabled and cfg.audit.in_trial
    if cfg.sweep.tuning == "private":
        objectives: tuple[str, ...] = (NOISY_OBJECTIVE,)
    else:
        objectives = ((VALIDATION_OBJECTIVE, ATTACK_OBJECTIVE) if two
                      else (VALIDATION_OBJECTIVE,))
    plans = []
    for eps in cfg.targets():
        for method, mode in setup.series():
            series = series_name(method, mode)
            space = build_space(method, mode=mode, num_layers=layers,
                                fixed=setup.given_params(method),
                                overrides=cfg.search.get(method))
            n_trials = (cfg.sweep.trials_per_method if counts is None
                        else counts.get(series, 0))
            plans.append(StudyPlan(name=study_name(series, eps), series=series, method=method,
                                   mode=mode, epsilon=eps, space=space, n_trials=n_trials,
                                   objectives=objectives))
    return plans


def schedule_points(plan: StudyPlan) -> list[dict[str, Any]]:
    """Points whose noise schedules differ: the first point and every categorical choice.
    (Only categorical dimensions may change a method's noise shape; see search_spaces.)"""
    points = [dict(plan.space.first_point)]
    for key, dist in plan.space.distributions.items():
        for value in getattr(dist, "choices", ()):
            if value != plan.space.first_point.get(key):
                points.append({**plan.space.first_point, key: value})
    return points


# ---- budgets, before any trial ----------------------------------------------------------
#: Threads that precompute budgets at once. Each PRV calibration runs in its own child process
#: and a method's preparation (LM-DP-SGD's risk estimate) in torch, so two lanes keep both cores
#: busy: the demo's cold precompute drops from 17-20 s to about 10 s on 2 cores.
PRECOMPUTE_LANES = 2


def precompute_order(plans: list[StudyPlan]) -> list[tuple[StudyPlan, dict[str, Any]]]:
    """The (study, point) pairs in the order the lanes take them from one shared queue.

    Methods with a once-per-sweep preparation go first (their first point carries it, the
    longest single item: LM-DP-SGD's risk estimate), then the methods with the most points; a
    method's points stay in order, so a budget the first caches serves the next. One queue,
    not a fixed lane per method: the demo's six DP-AdamILG points alone took one lane 12.2 s
    while the other idled from 8.7 s (balanced: about 10.5 s)."""
    by_method: dict[str, list[tuple[StudyPlan, dict[str, Any]]]] = {}
    for plan in plans:
        by_method.setdefault(plan.method, []).extend(
            (plan, point) for point in schedule_points(plan))

    def prepares(method: str) -> bool:
        return get_method(method).prepare.__func__ is not DPStep.prepare.__func__

    order = sorted(by_method, key=lambda m: (not prepares(m), -len(by_method[m]), m))
    return [item for method in order for item in by_method[method]]


def precompute(setup: CheckedSetup, *, run: RunDir, plans: list[StudyPlan], data: Any,
               quiet: bool, calibration: Any = None) -> None:
    """Budgets and once-per-sweep preparations for every schedule a study can produce, so
    trials only ever hit the cache (and the shadow pool's risk estimate runs once).

    ``PRECOMPUTE_LANES`` threads take (study, point) pairs from one queue in
    :func:`precompute_order`. Two lanes may compute one budget at once (DP-AdamILG's k = 0 is
    DP-SGD's schedule): the cache's writes are atomic and the two results identical.
    """
    cfg = setup.config
    order = precompute_order(plans)
    queue = iter(order)
    total = len(order)
    with progress(total=total, desc="budgets", quiet=quiet) as bar:
        lock = threading.Lock()
        stop = threading.Event()

        def work() -> None:
            while not stop.is_set():
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                plan, point = item
                spec = plan_trial(setup, epsilon=plan.epsilon, method=plan.method,
                                  params=plan.space.decode(point), cache_dir=run.cache_dir,
                                  data=data, calibration=calibration)
                if cfg.audit.enabled:
                    eps = plan.epsilon if calibration is None else calibration.bounds.upper
                    reference_budgets(cfg, method=plan.method, params=spec.method_params,
                                      epsilon=eps, data=data, cache_dir=run.cache_dir)
                with lock:
                    bar.update(1)

        pool = ThreadPoolExecutor(max_workers=PRECOMPUTE_LANES, thread_name_prefix="budgets")
        try:
            with keep_interpreters():
                for future in [pool.submit(work) for _ in range(PRECOMPUTE_LANES)]:
                    future.result()
        finally:
            stop.set()  # on an interrupt or an error, lanes stop after their current point
            pool.shutdown(wait=True, cancel_futures=True)
