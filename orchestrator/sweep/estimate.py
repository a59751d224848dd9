"""``dpsweep run --estimate CONFIG``: what a sweep will cost, measured here before it starts.

A sweep's length is not guessable from its config (a digits sweep takes a minute, the README's
Fashion-MNIST one hours on a CPU), so the estimate times the real thing in small: for each
series it plans a trial as the sweep would (the accountant's budget, from its cache), builds the
real model on the real data and times a few real DP steps (``train_trial`` stopped after
``WARMUP_STEPS + TIMED_STEPS``), a reference model's steps likewise, and the audit without its
references' training (``audit_model`` on untrained references: the signals, the shadow
classifier and the scoring). It then multiplies out: trials x steps, references x steps, the
scoring, spread over the trials that run at once. Nothing is written into a run directory and
no model is kept; only the accountant's cache may grow.

It projects every trial to its last epoch and, with the audit in the trials or over all of
them, every trial audited: a pruner (``sweep.pruner``) can only shorten the sweep, and with the
audit on the fronts only (``audit.scope``) fewer trials are audited.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import torch

from dpsweep.orchestrator.accounting.cache import default_cache_dir
from dpsweep.orchestrator.audit.membership import (
    AuditSettings,
    audit_model,
    budgets_from_config,
    reference_budgets,
    reference_plan,
)
from dpsweep.orchestrator.cluster.resources import check_config_resources
from dpsweep.orchestrator.door import CheckedSetup, require_checked
from dpsweep.orchestrator.sweep.plans import study_plans
from dpsweep.orchestrator.sweep.progress import SECONDS_PER_MINUTE, duration
from dpsweep.orchestrator.sweep.studies import StudyPlan
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.audit.references import reference_data, reference_seed, reference_spec
from dpsweep.trainables.data.splits import DataSplits
from dpsweep.trainables.training.loop import (
    build_trial_model,
    evaluate,
    load_trial_data,
    train_trial,
)

#: Steps run before the timed ones (the first steps pay for lazy set-up and the allocator).
WARMUP_STEPS = 2
#: DP steps timed per model; their median is the step time.
TIMED_STEPS = 5
#: What a sweep spends outside its trials: the command's imports, Ray's start, each worker's
#: first import of torch, the budgets' precompute and the report. Measured: a 4-trial digits
#: sweep (2 at once, 2 cores) ran 47 s, 34 s of it outside its trials.
FIXED_SECONDS = 30.0
#: ``ru_maxrss`` is in KiB on Linux.
KIB = 1024
MIB = 2**20


class _Enough(Exception):
    """Raised from inside the training loop once the steps are timed: nothing more trains."""


@dataclasses.dataclass
class _StepTimer:
    """Wraps a trial's DP step (``train_trial``'s ``instrument``) to time it and stop."""

    device: torch.device
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_step: float | None = None
    times: list[float] = dataclasses.field(default_factory=list)

    def attach(self, method: Any) -> None:
        inner = method.step

        def timed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if len(self.times) >= WARMUP_STEPS + TIMED_STEPS:
                raise _Enough
            t0 = time.perf_counter()
            self.first_step = t0 if self.first_step is None else self.first_step
            out = inner(x, y)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times.append(time.perf_counter() - t0)
            return out

        method.step = timed

    def step_seconds(self) -> float:
        timed = sorted(self.times[WARMUP_STEPS:] or self.times)
        return timed[len(timed) // 2]

    def setup_seconds(self) -> float:
        return (self.first_step or time.perf_counter()) - self.started


def _time_steps(spec: Any, data: DataSplits) -> _StepTimer:
    """A few real DP steps of ``spec`` on ``data``: nothing is checkpointed or kept."""
    device = torch.device("cuda") if spec.device != "cpu" and torch.cuda.is_available() \
        else torch.device("cpu")
    timer = _StepTimer(device=device)
    try:
        train_trial(spec, data=data, instrument=timer.attach, evaluate_epochs=False)
    except _Enough:
        pass
    return timer


@dataclasses.dataclass(frozen=True)
class _Untrained:
    """A reference trainer that trains nothing (each reference its own initialisation): the
    audit's signals, shadow classifier and scoring timed without the references' training."""

    spec: Any

    def __call__(self, data: DataSplits, seed: int, index: int) -> tuple[Any, float]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            return build_trial_model(self.spec, data).eval(), 0.0


@dataclasses.dataclass(frozen=True)
class SeriesCost:
    """One series' measured costs, per trial."""

    series: str
    trials: int
    steps: int
    step_s: float
    setup_s: float
    eval_s: float
    epochs: int
    references: int = 0
    reference_steps: int = 0
    reference_step_s: float = 0.0
    scoring_s: float = 0.0

    def train_seconds(self) -> float:
        return self.setup_s + self.steps * self.step_s + self.epochs * self.eval_s

    def audit_seconds(self) -> float:
        return self.references * self.reference_steps * self.reference_step_s + self.scoring_s


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The projection ``dpsweep run --estimate`` prints."""

    series: tuple[SeriesCost, ...]
    width: int
    audited: bool
    peak_bytes: int
    peak_what: str
    device: str

    def trial_seconds(self) -> float:
        """Every trial's training and audit, one after another."""
        return sum(s.trials * (s.train_seconds() + (s.audit_seconds() if self.audited else 0))
                   for s in self.series)

    def wall_seconds(self) -> float:
        """The sweep's projected wall time at its concurrency, start-up and report included."""
        return FIXED_SECONDS + self.trial_seconds() / self.width

    def lines(self) -> list[str]:
        out = [f"estimate (measured on this machine's {self.device}; nothing trained is kept):"]
        for s in self.series:
            line = (f"  {s.series}: {s.trials} trial(s) x {s.steps} DP steps at "
                    f"{s.step_s * 1e3:.1f} ms = {_seconds(s.train_seconds())} a trial")
            if self.audited:
                line += (f"; audit {s.references} references x {s.reference_steps} steps at "
                         f"{s.reference_step_s * 1e3:.1f} ms + scoring "
                         f"{_seconds(s.scoring_s)} = {_seconds(s.audit_seconds())} a trial")
            out.append(line)
        trials = sum(s.trials for s in self.series)
        out.append(f"  {trials} trials, {sum(s.trials * s.steps for s in self.series)} DP "
                   "steps" + (f", {sum(s.trials * s.references for s in self.series)} audit "
                              "references" if self.audited else ""))
        out.append(f"  projected wall time: {_seconds(self.wall_seconds())} with "
                   f"{self.width} trial(s) at once (trials {_seconds(self.trial_seconds())} "
                   f"one after another; start-up and report about {_seconds(FIXED_SECONDS)}); "
                   "every trial to its last epoch: a pruner only shortens it")
        out.append(f"  peak memory per trial: {self.peak_bytes / MIB:.0f} MiB ({self.peak_what})")
        return out


def _seconds(value: float) -> str:
    """A short time to a tenth of a second, a long one as ``progress.duration``."""
    return f"{value:.1f}s" if value < SECONDS_PER_MINUTE else duration(value)


def _series_cost(setup: CheckedSetup, plan: StudyPlan, *, trials: int,
                 audited: bool) -> SeriesCost:
    """One series measured: a trial planned as the sweep plans its first point."""
    cfg = setup.config
    cache = default_cache_dir()
    params = plan.space.decode(plan.space.first_point)
    spec = plan_trial(setup, method=plan.method, params=params, epsilon=plan.epsilon,
                      trial_id="estimate", cache_dir=cache)
    data = load_trial_data(spec)
    timer = _time_steps(spec, data)
    target = build_trial_model(spec, data)
    started = time.perf_counter()
    evaluate(target, data.validation.x, data.validation.y)
    eval_s = time.perf_counter() - started
    cost = SeriesCost(series=plan.series, trials=trials, steps=spec.calibration.schedule.steps,
                      step_s=timer.step_seconds(), setup_s=timer.setup_seconds(),
                      eval_s=eval_s, epochs=spec.epochs)
    if not audited:
        return cost
    settings = AuditSettings.from_config(cfg.audit)
    refs = reference_plan(data, settings)
    budgets = budgets_from_config(reference_budgets(
        cfg, method=plan.method, params=spec.method_params, epsilon=plan.epsilon, data=data,
        cache_dir=cache))
    ref_data = reference_data(refs, data, index=0)
    ref_spec = reference_spec(spec, dataset_size=len(ref_data.train), budgets=budgets,
                              seed=reference_seed(audit_seed=settings.seed, index=0), index=0)
    ref_timer = _time_steps(ref_spec, ref_data)
    started = time.perf_counter()
    audit_model(target=target, data=data, settings=settings, trainer=_Untrained(spec),
                progress=lambda _line: None)
    return dataclasses.replace(cost, references=refs.n_references,
                               reference_steps=ref_spec.calibration.schedule.steps,
                               reference_step_s=ref_timer.step_seconds(),
                               scoring_s=time.perf_counter() - started)


def estimate(setup: CheckedSetup) -> Estimate:
    """Time each series of the sweep ``setup`` describes and project the whole."""
    cfg = require_checked(setup, where="estimate").config
    plans = study_plans(setup)
    audited = cfg.audit.enabled and (cfg.audit.in_trial or cfg.audit.scope == "all")
    on_gpu = cfg.resources.device != "cpu" and torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    series: dict[str, SeriesCost] = {}
    for plan in plans:  # one measurement per series: the targets share its shapes
        if plan.series in series:
            series[plan.series] = dataclasses.replace(
                series[plan.series], trials=series[plan.series].trials + plan.n_trials)
            continue
        series[plan.series] = _series_cost(setup, plan, trials=plan.n_trials, audited=audited)
    # how many trials this machine runs at once, as the sweep's own check counts them
    width = check_config_resources(cfg.resources, max_concurrent=cfg.sweep.max_concurrent_trials,
                                   info=None)
    if on_gpu:
        peak, what = torch.cuda.max_memory_allocated(), "GPU memory allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
        what = "the measuring process's peak RSS, torch included"
    return Estimate(series=tuple(series.values()), width=width, audited=audited,
                    peak_bytes=peak, peak_what=what, device="GPU" if on_gpu else "CPU")
