"""Which studies a sweep runs: one per (series, target), with its search space and objectives.

Shared by the driver (``orchestrator.sweep``) and how it tunes (``orchestrator.sweep_tuning``),
neither of which the planning needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from orchestrator.config import Config
from orchestrator.studies import (
    ATTACK_OBJECTIVE,
    NOISY_OBJECTIVE,
    VALIDATION_OBJECTIVE,
    StudyPlan,
    study_name,
)
from search_spaces import build_space

__all__ = ["at_epsilon", "epsilons", "schedule_points", "study_plans"]


def epsilons(cfg: Config) -> list[float]:
    return list(cfg.budget.epsilons) or [cfg.privacy.epsilon]


def _num_layers(cfg: Config) -> int:
    from orchestrator.trial import _model_factory

    return len(_model_factory(cfg).layer_names)


def study_plans(cfg: Config, *, counts: dict[str, int] | None = None) -> list[StudyPlan]:
    """Every (series, target) study with its space: fixed values from [method_params] are not
    searched, user ranges from [search.<method>] replace the defaults. ``counts`` (private
    tuning) gives each series its share of the secretly drawn number of trials."""
    from trainables.methods import series_name

    layers = _num_layers(cfg)
    two = cfg.audit.enabled and cfg.audit.in_trial
    if cfg.sweep.tuning == "private":
        objectives: tuple[str, ...] = (NOISY_OBJECTIVE,)
    else:
        objectives = ((VALIDATION_OBJECTIVE, ATTACK_OBJECTIVE) if two
                      else (VALIDATION_OBJECTIVE,))
    plans = []
    for eps in epsilons(cfg):
        for method, mode in cfg.series():
            series = series_name(method, mode)
            space = build_space(method, mode=mode, num_layers=layers,
                                fixed=cfg.given_params(method),
                                overrides=cfg.search.get(method))
            n_trials = (cfg.sweep.trials_per_method if counts is None
                        else counts.get(series, 0))
            plans.append(StudyPlan(name=study_name(series, eps), series=series, method=method,
                                   mode=mode, epsilon=eps, space=space, n_trials=n_trials,
                                   objectives=objectives))
    return plans


def at_epsilon(cfg: Config, eps: float) -> Config:
    return dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, epsilon=eps))


def schedule_points(plan: StudyPlan) -> list[dict[str, Any]]:
    """Points whose noise schedules differ: the first point and every categorical choice.
    (Only categorical dimensions may change a method's noise shape; see search_spaces.)"""
    points = [dict(plan.space.first_point)]
    for key, dist in plan.space.distributions.items():
        for value in getattr(dist, "choices", ()):
            if value != plan.space.first_point.get(key):
                points.append({**plan.space.first_point, key: value})
    return points
