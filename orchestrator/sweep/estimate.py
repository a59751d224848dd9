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
them, every trial audited: a pruner (``sweep.pruner``) can only shorten the sweep. The jobs
beside the trials are derived from the same measurements (same model, data and references): the
non-private baseline (``sweep.baseline``) as one more trial of the first series, trained and
audited (a non-private step costs no more than a DP one, so this bounds it), and after the
search, per study, a front of one trial (its leader: ties within the interval add more)
re-run ``sweep.seeds`` times and, with ``audit.in_trial = false`` and ``audit.scope = "front"``,
audited.
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
class Extras:
    """What runs beside the trials: the baseline and the jobs after the search."""

    #: ``sweep.baseline``: the non-private model, trained and audited (``audited``).
    baseline: bool = False
    #: ``sweep.seeds``: re-runs of each front trial.
    seeds: int = 0
    #: Whether re-runs audit themselves (``audit.in_trial``).
    reruns_audited: bool = False
    #: Whether the fronts are audited after the search (``audit.scope = "front"``).
    front_audits: bool = False
    #: Whether the baseline is audited (``audit.enabled``).
    baseline_audited: bool = False


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The projection ``dpsweep run --estimate`` prints."""

    series: tuple[SeriesCost, ...]
    width: int
    audited: bool
    peak_bytes: int
    peak_what: str
    device: str
    extras: Extras = Extras()
    #: Studies (each with its front) per series.
    studies: tuple[int, ...] = ()

    def trial_seconds(self) -> float:
        """Every trial's training and audit, one after another."""
        return sum(s.trials * (s.train_seconds() + (s.audit_seconds() if self.audited else 0))
                   for s in self.series)

    def baseline_seconds(self) -> float:
        """The non-private baseline: one more trial of the first series, audited if on."""
        if not (self.extras.baseline and self.series):
            return 0.0
        first = self.series[0]
        return first.train_seconds() + (first.audit_seconds()
                                        if self.extras.baseline_audited else 0.0)

    def after_jobs(self) -> list[float]:
        """Each job after the search: per study, ``seeds`` re-runs of its front's one trial
        and, when the fronts are audited after the search, its audit."""
        extras, out = self.extras, []
        for s, studies in zip(self.series, self.studies or (1,) * len(self.series),
                              strict=True):
            rerun = s.train_seconds() + (s.audit_seconds() if extras.reruns_audited else 0.0)
            out += [rerun] * (studies * extras.seeds)
            out += [s.audit_seconds()] * (studies if extras.front_audits else 0)
        return out

    def after_seconds(self) -> float:
        """The jobs after the search at the concurrency (never shorter than the longest)."""
        jobs = self.after_jobs()
        return max(sum(jobs) / self.width, max(jobs, default=0.0))

    def wall_seconds(self) -> float:
        """The sweep's projected wall time at its concurrency: the trials and the baseline
        (which runs among them), then the jobs after the search, start-up and report."""
        return (FIXED_SECONDS + (self.trial_seconds() + self.baseline_seconds()) / self.width
                + self.after_seconds())

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
        out += self._extra_lines()
        out.append(f"  projected wall time: {_seconds(self.wall_seconds())} with "
                   f"{self.width} trial(s) at once (trials {_seconds(self.trial_seconds())} "
                   f"one after another; start-up and report about {_seconds(FIXED_SECONDS)}); "
                   "every trial to its last epoch: a pruner only shortens it")
        out.append(f"  peak memory per trial: {self.peak_bytes / MIB:.0f} MiB ({self.peak_what})")
        return out


    def _extra_lines(self) -> list[str]:
        """What the projection includes beside the trials, or says it leaves out."""
        extras, out = self.extras, []
        if self.baseline_seconds():
            out.append("  non-private baseline (sweep.baseline): "
                       f"{_seconds(self.baseline_seconds())} (as a trial of the first series"
                       + (", audited" if extras.baseline_audited else "")
                       + "; a bound: it clips and noises nothing)")
        jobs = self.after_jobs()
        if jobs:
            studies = sum(self.studies or (1,) * len(self.series))
            what = ([f"{studies * extras.seeds} re-run(s) (sweep.seeds = {extras.seeds})"]
                    if extras.seeds else []) + ([f"{studies} front audit(s) (audit.scope = "
                                                 "front)"] if extras.front_audits else [])
            out.append(f"  after the search: {', '.join(what)} = "
                       f"{_seconds(self.after_seconds())}, a front of one trial per study "
                       "(ties add more)")
        else:
            out.append("  after the search: no jobs (sweep.seeds = 0, no audit after it)")
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
    extras = Extras(baseline=cfg.sweep.baseline and any(p.n_trials for p in plans),
                    seeds=cfg.sweep.seeds, reruns_audited=cfg.audit.enabled and cfg.audit.in_trial,
                    front_audits=cfg.audit.enabled and not audited,
                    baseline_audited=cfg.audit.enabled)
    on_gpu = cfg.resources.device != "cpu" and torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    series: dict[str, SeriesCost] = {}
    studies: dict[str, int] = {}
    for plan in plans:  # one measurement per series: the targets share its shapes
        studies[plan.series] = studies.get(plan.series, 0) + (1 if plan.n_trials else 0)
        if plan.series in series:
            series[plan.series] = dataclasses.replace(
                series[plan.series], trials=series[plan.series].trials + plan.n_trials)
            continue
        series[plan.series] = _series_cost(setup, plan, trials=plan.n_trials,
                                           audited=cfg.audit.enabled)
    # how many trials this machine runs at once, as the sweep's own check counts them
    width = check_config_resources(cfg.resources, max_concurrent=cfg.sweep.max_concurrent_trials,
                                   info=None)
    if on_gpu:
        peak, what = torch.cuda.max_memory_allocated(), "GPU memory allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
        what = "the measuring process's peak RSS, torch included"
    return Estimate(series=tuple(series.values()), width=width, audited=audited,
                    peak_bytes=peak, peak_what=what, device="GPU" if on_gpu else "CPU",
                    extras=extras, studies=tuple(studies[name] for name in series))
