"""The sweep's Optuna studies: their plans, samplers, outcomes, and how a crash is reconciled.

How series share trials: **one Optuna study per series (method, or method:mode) at each target
epsilon, with equal trial budgets**. A fair comparison needs each series tuned with the same
effort, and each method has its own conditional hyperparameters; one study with a categorical
method choice lets TPE starve a method that starts badly and models conditional spaces poorly.
With adaptive tuning each study's first trial is the method's paper preset (or its defaults);
with private tuning there is no first point: every trial is an independent draw from the
declared space by :func:`secret_random_sampler` (Papernot & Steinke's random search).

One Ray Tune experiment runs the trials of every study (studies in order, a study's trials
concurrently), through ``orchestrator.sweep.raytune.SweepSearcher``, so Tune's actors are reused
across studies. The searcher owns the Optuna bookkeeping that Ray's stock ``OptunaSearch`` gets
wrong for this use (errored trials recorded COMPLETE with a stale value; RUNNING zombies with two
objectives): a trial is told COMPLETE only with every objective finite, FAIL otherwise, with its
reason. A trial that trained but whose audit failed is ``ok`` in the results store, so it is told
COMPLETE too (:func:`told_values`): its attack objective at the worst value an attack can reach,
its reason in the ``audit_error`` attribute; optuna-dashboard then shows every trial in the state
dpsweep gives it (``ok`` COMPLETE, ``pruned`` PRUNED, ``failed`` FAIL).

Trial ids are ``<study>-<index>`` in order of creation; a trial interrupted by a signal, a crash
or a dead worker is re-run under the same id and the same hyperparameters (its Optuna trial is
FAIL with ``interrupted`` and a WAITING copy carries the id), so an interrupted and resumed sweep
ends with the same set of trial ids as an uninterrupted one, none trained twice. Under private
tuning that copy is the only enqueued point: the interrupted trial's own draw, finishing the
same trial (its outcome did not choose it), never a point chosen from results.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sqlite3
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpsweep.core import layout
from dpsweep.core.errors import describe
from dpsweep.core.lazy import lazy_module
from dpsweep.core.vocabulary import (
    ATTACK_OBJECTIVE,
    DISK_FULL_KEY,
    FAILED,
    INTERRUPTED,
    NOISY_OBJECTIVE,
    OK,
    PRUNED,
    VALIDATION_OBJECTIVE,
)
from dpsweep.search_spaces import BuiltSpace

#: Optuna is imported on first use: ``orchestrator.trial.runner`` (every trial worker, and
#: ``dpsweep train``) reads this module's record names and never opens a study.
optuna = lazy_module("optuna")

#: Objectives and their directions; names carried by every study (optuna-dashboard shows them).
OBJECTIVES = {VALIDATION_OBJECTIVE: "maximize", ATTACK_OBJECTIVE: "minimize",
              NOISY_OBJECTIVE: "maximize"}
ID_ATTR = "dpsweep_trial_id"
INTERRUPTED_ATTR = "interrupted"
#: On a copy enqueued by ``resume --retry-failed``: the number of the failed Optuna trial it
#: trains again (the failed one stays, FAIL with its ``error``).
RETRY_ATTR = "retry_of"
#: Optuna trial states whose trial finished: its directory must hold ``result.json``.
FINISHED_STATES = ("COMPLETE", "PRUNED")
#: On a COMPLETE trial whose audit failed: why (the results row's ``audit_error``).
AUDIT_ERROR_ATTR = "audit_error"
#: The attack objective told for a trial whose audit failed: the highest accuracy an attack can
#: reach, so the sampler takes unmeasured leakage for the most leakage, never for little.
UNMEASURED_ATTACK = 1.0


#: The read-only summary study of each target (``front_name``: ``front@eps3``) and its trials'
#: one parameter, the series a copied trial came from.
FRONT_SERIES = FRONT_PARAM = "series"
FRONT_PREFIX = "front"
#: Keys a summary study's copy by the search trial it copies: not ``ID_ATTR``, which the resume
#: checks and :func:`finished_trial_ids` read as the search's own trials.
FRONT_ID_ATTR = "dpsweep_copy_of"
#: On a summary study: it is never sampled from (no trial is asked of it).
READ_ONLY_ATTR = "read_only"


def study_name(series: str, epsilon: float) -> str:
    return f"{series}@eps{epsilon:g}"


def slug(text: str) -> str:
    """A study name as one path component (``lm_dpsgd:faithful@eps3`` ->
    ``lm_dpsgd-faithful_eps3``)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "-", text.replace("@", "_"))


@dataclass(frozen=True)
class StudyPlan:
    """One study: its series at one target, its space, its trial budget and objectives."""

    name: str
    series: str
    method: str
    mode: str
    epsilon: float
    space: BuiltSpace
    n_trials: int
    objectives: tuple[str, ...]

    def trial_id(self, index: int) -> str:
        return f"{slug(self.name)}-{index:03d}"


def make_sampler(kind: str, *, seed: int, parallel: bool) -> Any:
    """The Optuna sampler named in ``sweep.sampler`` (seeded: the search, not the noise), for
    adaptive tuning only: private tuning uses :func:`secret_random_sampler`."""
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    # constant_liar: concurrent trials pretend the pending ones scored badly, so two trials
    # running at once are not sampled at the same point.
    return optuna.samplers.TPESampler(seed=seed, constant_liar=parallel, multivariate=True)


def secret_random_sampler() -> Any:
    """Private tuning's random search: every point an independent uniform draw (on each
    dimension's declared scale) that ignores the study's history, from a generator whose state
    comes from OS entropy and is written nowhere.

    Optuna's RandomSampler without a seed builds ``numpy.random.RandomState()``, which numpy
    seeds through a fresh ``SeedSequence`` (128 bits from the OS). A seed from ``sweep.seed``
    would let anyone holding the config replay the draws: a released ``clip_norm`` would then
    name the winning trial and bound the secret trial count from below.
    """
    return optuna.samplers.RandomSampler(seed=None)


def open_study(plan: StudyPlan, *, storage: str, sampler: Any, first_point: bool = True) -> Any:
    """Create or load the study, with metric names and attributes for optuna-dashboard.

    ``first_point`` enqueues the space's first point (the paper preset) once; private tuning
    passes False, since a fixed point is not a draw from the search distribution."""
    study = optuna.create_study(
        study_name=plan.name, storage=storage, load_if_exists=True, sampler=sampler,
        directions=[OBJECTIVES[o] for o in plan.objectives])
    with warnings.catch_warnings():  # experimental since Optuna 3.2, stable in use here
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(plan.objectives))
    for key, value in (("series", plan.series), ("method", plan.method), ("mode", plan.mode),
                       ("epsilon", plan.epsilon), ("trials_per_study", plan.n_trials)):
        study.set_user_attr(key, value)
    if first_point and not study.trials:
        study.enqueue_trial(dict(plan.space.first_point), user_attrs={ID_ATTR: plan.trial_id(0),
                                                                      "preset": "first point"})
    return study


@dataclass(frozen=True)
class Outcome:
    """What a trial left in its directory: finished (with metrics) or failed (with why)."""

    status: str  # one of core.vocabulary.STATUSES
    metrics: dict[str, Any]
    error: str

    def values(self, objectives: tuple[str, ...]) -> list[float] | None:
        vals = [self.metrics.get(o) for o in objectives]
        if self.status != OK or any(v is None or not math.isfinite(float(v)) for v in vals):
            return None
        return [float(v) for v in vals]


def audit_error(outcome: Outcome) -> str:
    """Why the audit of a trial that trained failed ("" when it did not)."""
    return str(outcome.metrics.get(AUDIT_ERROR_ATTR) or "") if outcome.status == OK else ""


def told_values(outcome: Outcome, objectives: tuple[str, ...]) -> list[float] | None:
    """The values a finished trial is told COMPLETE with, or None (told FAIL or PRUNED).

    A trial whose audit failed is ``ok`` in the results store: its missing attack objective
    becomes :data:`UNMEASURED_ATTACK`, so Optuna's state agrees with dpsweep's."""
    values = outcome.values(objectives)
    if values is not None or not audit_error(outcome):
        return values
    return Outcome(OK, {**outcome.metrics, ATTACK_OBJECTIVE: UNMEASURED_ATTACK},
                   outcome.error).values(objectives)


def read_outcome(trial_dir: Path) -> Outcome:
    """The trial's final record; a directory with neither record was interrupted."""
    for name, status in ((layout.RESULT, OK), (layout.ERROR, FAILED)):
        path = trial_dir / name
        if path.is_file():
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                return Outcome(FAILED, {}, f"unreadable {name}: {describe(exc)}")
            if status == OK and record.get("status") == PRUNED:
                status = PRUNED  # stopped at a rung: a final record, never re-run
            if status == FAILED and record.get(DISK_FULL_KEY):
                status = INTERRUPTED  # the disk, not the trial: it runs again
            return Outcome(status, record, str(record.get("error", "")))
    return Outcome(INTERRUPTED, {}, "")


def finished_trial_ids(db: Path) -> set[str]:
    """Ids of the trials the Optuna storage ``db`` counts as finished (COMPLETE or PRUNED).

    Read with SQLite itself, read-only, so that a resume can check them against the trial
    directories before anything (Optuna included) writes; an unreadable storage gives no ids
    here (``resume_checks.check_storage`` refuses it before a resume)."""
    if not db.is_file():
        return set()
    marks = ", ".join("?" for _ in FINISHED_STATES)
    query = ("SELECT a.value_json FROM trials t JOIN trial_user_attributes a "
             f"ON a.trial_id = t.trial_id WHERE a.key = ? AND t.state IN ({marks})")
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro",
                                                uri=True)) as con:
            rows = con.execute(query, (ID_ATTR, *FINISHED_STATES)).fetchall()
    except sqlite3.Error:
        return set()
    ids = set()
    for (value,) in rows:
        with contextlib.suppress(ValueError, TypeError):
            tid = json.loads(value)
            if isinstance(tid, str):
                ids.add(tid)
    return ids


@dataclass
class Tally:
    """Trials of one study: finished ids, and how many more to start."""

    done: set[str]
    failed: set[str]
    pending: int  # WAITING trials (re-runs and the first point) still to start
    next_index: int
    pruned: set[str] = field(default_factory=set)

    def remaining(self, n_trials: int) -> int:
        return max(0, n_trials - len(self.done) - len(self.failed) - len(self.pruned))


def _set_attr(storage: Any, study: Any, number: int, key: str, value: Any) -> None:
    """Set a user attribute on a trial known only by number (a FrozenTrial after a crash)."""
    study_id = storage.get_study_id_from_name(study.study_name)
    storage.set_trial_user_attr(storage.get_trial_id_from_study_id_trial_number(study_id, number),
                                key, value)


#: The reason recorded on an Optuna trial asked but never named (the driver died inside ask).
ORPHAN_REASON = "never started (the driver stopped between asking and naming the trial)"


def reconcile(study: Any, plan: StudyPlan, *, storage: Any, trials_root: Path,
              on_finished: Callable[[str, Outcome, Any], None],
              on_retry: Callable[[str, Outcome], None] | None = None) -> Tally:
    """Bring a study in line with the trial directories after a crash or an interrupt.

    A RUNNING trial whose directory holds a result is told COMPLETE (it finished; only the
    driver died; :func:`told_values`) — never trained again; one with an error record is told
    FAIL; one with neither was interrupted: it is told FAIL (``interrupted``) and re-enqueued
    under the same id. COMPLETE or FAIL trials are reported through ``on_finished`` so their
    result rows exist.

    With ``on_retry`` (``resume --retry-failed``) a trial that failed is trained again instead:
    ``on_retry(id, outcome)`` keeps its failure on record and clears its directory's, then the
    exact hyperparameters are enqueued once more under the same id (``RETRY_ATTR``). A finished
    or pruned trial never is.
    """
    done: set[str] = set()
    failed: set[str] = set()
    pruned: set[str] = set()
    waiting_ids: set[str] = set()
    indices = [-1]
    for t in study.get_trials(deepcopy=False):
        tid = t.user_attrs.get(ID_ATTR)
        if tid is None:
            continue
        indices.append(int(tid.rsplit("-", 1)[1]))
        if t.state == optuna.trial.TrialState.WAITING:
            waiting_ids.add(tid)
    for t in study.get_trials(deepcopy=False):
        tid = t.user_attrs.get(ID_ATTR)
        if tid is None and t.state == optuna.trial.TrialState.RUNNING:
            # The driver died between ``ask`` and naming the trial: it never started.
            _set_attr(storage, study, t.number, "error", ORPHAN_REASON)
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            continue
        if tid is None or t.state == optuna.trial.TrialState.WAITING:
            continue
        outcome = read_outcome(trials_root / tid)
        if t.state == optuna.trial.TrialState.RUNNING:
            values = told_values(outcome, plan.objectives)
            if values is not None:
                if audit_error(outcome):
                    _set_attr(storage, study, t.number, AUDIT_ERROR_ATTR, audit_error(outcome))
                study.tell(t.number, values)
            elif outcome.status == PRUNED:
                study.tell(t.number, state=optuna.trial.TrialState.PRUNED)
            else:
                reason = outcome.error or "interrupted (the sweep stopped while it ran)"
                _set_attr(storage, study, t.number, INTERRUPTED_ATTR,
                          outcome.status == INTERRUPTED)
                _set_attr(storage, study, t.number, "error", reason)
                study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                if outcome.status == INTERRUPTED and tid not in waiting_ids:
                    study.enqueue_trial(dict(t.params), user_attrs={ID_ATTR: tid,
                                                                    "rerun_of": t.number})
                    waiting_ids.add(tid)
        if outcome.status == OK:
            done.add(tid)
            on_finished(tid, outcome, t)
        elif outcome.status == PRUNED:
            pruned.add(tid)
            on_finished(tid, outcome, t)
        elif outcome.status == FAILED and not t.user_attrs.get(INTERRUPTED_ATTR):
            if on_retry is None:
                failed.add(tid)
                on_finished(tid, outcome, t)
            elif tid not in waiting_ids:
                # its error record goes: an older FAIL trial of the id then reads as interrupted,
                # already waiting, and enqueues nothing more
                on_retry(tid, outcome)
                study.enqueue_trial(dict(t.params), user_attrs={ID_ATTR: tid,
                                                                RETRY_ATTR: t.number})
                waiting_ids.add(tid)
        elif outcome.status == INTERRUPTED and t.state == optuna.trial.TrialState.FAIL \
                and tid not in waiting_ids and tid not in done:
            study.enqueue_trial(dict(t.params), user_attrs={ID_ATTR: tid, "rerun_of": t.number})
            waiting_ids.add(tid)
    waiting_ids -= done | failed | pruned
    return Tally(done=done, failed=failed, pending=len(waiting_ids),
                 next_index=max(indices) + 1, pruned=pruned)


def front_name(epsilon: float) -> str:
    """The summary study of one target, beside its series' studies (``front@eps3``)."""
    return study_name(FRONT_PREFIX, epsilon)


def is_search_trial(plan: StudyPlan, tid: str) -> bool:
    """Whether ``tid`` is one of ``plan``'s search trials (a re-run with fresh noise, ``<id>-r1``,
    is another seed of one, never a point of the search)."""
    return re.fullmatch(re.escape(slug(plan.name)) + r"-\d+", tid) is not None


class Fronts:
    """One read-only summary study per target (:func:`front_name`) holding a copy of every search
    trial told COMPLETE in its own series' study, so that optuna-dashboard's Pareto-front view
    shows every method together (each series' study shows only its own front).

    A copy is made with ``optuna.trial.create_trial`` and ``Study.add_trial``: the values the
    series' study was told (:func:`told_values`), the same objectives and directions, the series
    as its one categorical parameter and the row's hyperparameters as user attributes. Nothing
    is ever asked of a summary study, so no sampler reads it; copies are keyed by trial id
    (``FRONT_ID_ATTR``), so a resume that records a trial again adds no second copy. A target
    whose series' studies differ in objectives gets no summary study (no common front).
    """

    def __init__(self, *, storage: Any, plans: Sequence[StudyPlan]) -> None:
        """``storage``: the run's Optuna storage (its URL, or an open one), opened on the first
        copy."""
        self._storage = storage
        self._objectives: dict[float, tuple[str, ...] | None] = {}
        self._series: dict[float, list[str]] = {}
        for plan in plans:
            known = self._objectives.setdefault(plan.epsilon, plan.objectives)
            if known != plan.objectives:
                self._objectives[plan.epsilon] = None
            self._series.setdefault(plan.epsilon, [])
            if plan.series not in self._series[plan.epsilon]:
                self._series[plan.epsilon].append(plan.series)
        self._open: dict[float, tuple[Any, set[str]]] = {}

    def _study(self, epsilon: float, objectives: tuple[str, ...]) -> tuple[Any, set[str]]:
        """The target's summary study, created on first use, and the ids it holds copies of."""
        if epsilon not in self._open:
            study = optuna.create_study(
                study_name=front_name(epsilon), storage=self._storage, load_if_exists=True,
                directions=[OBJECTIVES[o] for o in objectives])
            with warnings.catch_warnings():  # experimental since Optuna 3.2, stable in use here
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(list(objectives))
            for key, value in ((READ_ONLY_ATTR, True), ("epsilon", epsilon),
                               ("series", sorted(self._series[epsilon]))):
                study.set_user_attr(key, value)
            held = {str(t.user_attrs.get(FRONT_ID_ATTR))
                    for t in study.get_trials(deepcopy=False)}
            self._open[epsilon] = (study, held)
        return self._open[epsilon]

    def add(self, plan: StudyPlan, tid: str, outcome: Outcome, *,
            attrs: Mapping[str, Any]) -> bool:
        """Copy ``tid`` into its target's summary study, once; False where it is not copied
        (not a search trial, not told COMPLETE, already held, no common front)."""
        objectives = self._objectives.get(plan.epsilon)
        values = told_values(outcome, plan.objectives)
        if objectives is None or values is None or not is_search_trial(plan, tid):
            return False
        study, held = self._study(plan.epsilon, objectives)
        if tid in held:
            return False
        choices = sorted(self._series[plan.epsilon])
        error = audit_error(outcome)
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.COMPLETE, values=values,
            params={FRONT_PARAM: plan.series},
            distributions={FRONT_PARAM: optuna.distributions.CategoricalDistribution(choices)},
            user_attrs={**attrs, FRONT_ID_ATTR: tid, "study": plan.name,
                        **({AUDIT_ERROR_ATTR: error} if error else {})}))
        held.add(tid)
        return True
