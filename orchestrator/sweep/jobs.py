"""What runs after the search: audits of the fronts, re-runs with fresh noise, the baseline.

* **Audits** (``audit.in_trial = false``): the trials on each study's front (or all, with
  ``audit.scope = "all"``) are audited after the sweep, so a long search spends its time on
  training and only the candidates for release pay for reference models.
* **Re-runs** (``sweep.seeds = n``): every front trial is trained n more times with fresh
  noise and new initialisation seeds, so accuracy-vs-epsilon curves carry a spread.
* **The non-private baseline**: the same model and data trained without clipping or noise
  (Adam, the config's epochs and batch size), audited like the trials; a reference line on the
  report's curves, never on a front or a pick.

Each job is a Ray task with the trials' resources; at most ``sweep.max_concurrent_trials`` run
at once. A failing job is recorded with its reason and the others go on. A job reports its
phases as a trial does (``runner.PHASE_KEY``: training epochs, audit references, the scoring)
to ``report``: in a Ray task a post to a phase board (:class:`_PhaseBoard`, an actor holding no
CPU) that ``run_jobs`` empties while it waits, in Tune (the baseline) ``tune.report``.

The baseline needs nothing from the search, so when there is a search it runs inside it, as the
first entry of the Tune experiment (``raytune.SweepSearcher``'s ``jobs``), in a warm worker and
a slot the trials would otherwise leave idle at the end; a Ray task beside Tune would serialise
the trials.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from dpsweep.core import layout
from dpsweep.core.errors import describe
from dpsweep.core.layout import CHECKPOINT_DIR
from dpsweep.core.storage import atomic_write_json
from dpsweep.core.vocabulary import FAILED, OK
from dpsweep.orchestrator.audit.membership import (
    AuditSettings,
    audit_in_trial,
    audit_model,
    audit_trial_model,
    budgets_from_config,
    trial_audit_paths,
)
from dpsweep.orchestrator.trial import runner
from dpsweep.reports import store
from dpsweep.trainables.audit.references import (
    NonPrivateRecipe,
    nonprivate_trainer,
    train_nonprivate,
)
from dpsweep.trainables.training.loop import evaluate, load_spec, load_trial_data, spec_model_source

if TYPE_CHECKING:
    from dpsweep.trainables.models.networks import LayeredModel

BASELINE_ID = "nonprivate"
#: Where a job sends its phase reports (``runner.PHASE_KEY``).
Report = Callable[[dict[str, Any]], object]


class JobKind(enum.Enum):
    """What an after-search job does: the driver records a job's result by its kind."""

    AUDIT = "audit"
    RERUN = "re-run"
    BASELINE = "baseline"


@dataclasses.dataclass(frozen=True)
class Job:
    """One post-sweep task: its kind, the trial it is about, a function and its keyword
    arguments."""

    kind: JobKind
    trial_id: str
    fn: Callable[..., dict[str, Any]]
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        """For progress lines."""
        if self.kind is JobKind.BASELINE:
            return "non-private baseline"
        return f"{self.kind.value} {self.trial_id}"


#: Seconds between checks for a stop signal while after-search jobs run.
POLL_S = 0.5


def run_jobs(jobs: list[Job], *, cpus: int, gpus: float, concurrency: int,
             on_done: Callable[[Job, dict[str, Any] | None, str], None],
             stop: Callable[[], None] | None = None,
             data: dict[str, Any] | None = None,
             on_phase: Callable[[Job, dict[str, Any] | None], None] | None = None) -> None:
    """Run ``jobs`` as Ray tasks, ``concurrency`` at a time; ``on_done(job, result, error)``.
    ``data`` (``orchestrator.trial.plan.data_pool``) is put in Ray's object store once and served to
    every job's data splits. ``on_phase(job, report)`` hears each running job's phase reports
    (a ``STARTING`` one when it is started, None when it ended, before ``on_done``).

    ``stop`` is polled every ``POLL_S`` and raises to end the loop (a signal is never raised
    inside ``ray.wait``, whose C code turns it into a ``SystemError``); pending jobs are then
    cancelled and stay undone, so a resume runs them."""
    remote = ray.remote(num_cpus=cpus, num_gpus=gpus)(_call)
    shared = None if data is None else ray.put(data)
    board = None if on_phase is None else ray.remote(num_cpus=0)(_PhaseBoard).remote()
    pending: dict[Any, int] = {}
    queue = list(range(len(jobs)))
    try:
        while queue or pending:
            while queue and len(pending) < concurrency:
                index = queue.pop(0)
                pending[remote.remote(jobs[index].fn, jobs[index].kwargs, shared, board,
                                      index)] = index
                if on_phase is not None:
                    on_phase(jobs[index], {runner.PHASE_KEY: runner.STARTING})
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            if stop is not None:
                stop()
            if on_phase is not None and board is not None:
                running = set(pending.values())  # a report that arrives late is dropped
                for index, report in ray.get(board.drain.remote()):
                    if index in running:
                        on_phase(jobs[index], report)
            for ref in done:
                job = jobs[pending.pop(ref)]
                if on_phase is not None:
                    on_phase(job, None)
                try:
                    on_done(job, ray.get(ref), "")
                except Exception as exc:  # a failed job keeps its reason; the others go on
                    on_done(job, None, describe(getattr(exc, "cause", None) or exc))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


class _PhaseBoard:
    """Behind a Ray actor (no CPU): the running jobs' phase reports, posted without waiting
    and taken by the driver in arrival order."""

    def __init__(self) -> None:
        self._reports: list[tuple[int, dict[str, Any]]] = []

    def post(self, index: int, report: dict[str, Any]) -> None:
        self._reports.append((index, report))

    def drain(self) -> list[tuple[int, dict[str, Any]]]:
        reports, self._reports = self._reports, []
        return reports


def _call(fn: Callable[..., dict[str, Any]], kwargs: dict[str, Any],
          data: dict[str, Any] | None = None, board: Any = None,
          index: int = 0) -> dict[str, Any]:
    runner.use_data_pool(data)
    if board is None:
        return fn(**kwargs)
    return fn(**kwargs, report=lambda report: board.post.remote(index, report))


# ---- the jobs (run in Ray workers) ------------------------------------------------------
def audit_job(*, trial_dir: str, spec: dict[str, Any], settings: dict[str, Any],
              budgets: dict[str, Any], report: Report | None = None) -> dict[str, Any]:
    """Audit one finished trial from its checkpoint; writes its audit.json. ``report`` hears
    its references and the scoring."""
    trial_spec = load_spec(spec)
    data = load_trial_data(trial_spec)
    record = audit_trial_model(spec=trial_spec, checkpoint=Path(trial_dir) / CHECKPOINT_DIR,
                               data=data, settings=AuditSettings.from_config(settings),
                               budgets=budgets_from_config(budgets),
                               progress=None if report is None else runner.audit_phases(report),
                               **trial_audit_paths(Path(trial_dir)))
    atomic_write_json(Path(trial_dir) / layout.AUDIT, record)
    return record


def rerun_pending(row: dict[str, Any] | None, *, retry_failed: bool) -> bool:
    """Whether a re-run is to be trained: not recorded yet, or recorded as failed and the
    user asked for failed re-runs again (``dpsweep resume --retry-failed``)."""
    return row is None or (retry_failed and row.get("status") == FAILED)


def rerun_job(*, config: dict[str, Any], report: Report | None = None) -> dict[str, Any]:
    """Train a trial configuration again (fresh noise, its own seed), audited if in_trial;
    ``report`` hears its phases as a trial's are heard.

    Never pruned: a re-run is one more seed of a finished trial, so it runs to its last epoch
    (stopping the unlucky seeds at a rung would bias the mean over seeds upwards)."""
    return runner.execute({k: v for k, v in config.items() if k != "pruning"}, report=report,
                          audit=audit_in_trial)


def baseline_job(*, run_dir: str, spec: dict[str, Any], settings: dict[str, Any],
                 audit: bool, lr: float, report: Report | None = None) -> dict[str, Any]:
    """Train and audit the non-private baseline; writes trials/nonprivate/{result,audit}.json.
    ``report`` hears its training (each epoch k of E with its validation accuracy, as a
    trial's) and its audit."""
    started_at = time.time()
    trial_spec = load_spec(spec)
    data = load_trial_data(trial_spec)
    recipe = NonPrivateRecipe(epochs=trial_spec.epochs, lr=lr,
                              batch_size=trial_spec.batch_size,
                              model_source=spec_model_source(trial_spec).to_dict())

    def epoch_done(epoch: int, model: LayeredModel) -> None:
        assert report is not None
        acc, _ = evaluate(model, data.validation.x, data.validation.y)
        report({runner.PHASE_KEY: runner.TRAINING, "epoch": epoch, "epochs": recipe.epochs,
                "val_accuracy": acc})

    model, seconds = train_nonprivate(data=data, recipe=recipe, seed=trial_spec.seed,
                                      threads=trial_spec.threads,
                                      on_epoch=None if report is None else epoch_done)
    out = Path(run_dir) / layout.TRIALS / BASELINE_ID
    record: dict[str, Any] = {"status": OK, "trial_id": BASELINE_ID, "train_seconds": seconds,
                              "recipe": dataclasses.asdict(recipe)}
    for split in ("validation", "test"):
        acc, loss = evaluate(model, getattr(data, split).x, getattr(data, split).y)
        key = "val" if split == "validation" else "test"
        record[f"{key}_accuracy"], record[f"{key}_loss"] = acc, loss
    if audit:
        started = time.perf_counter()
        audited = audit_model(target=model, data=data, settings=AuditSettings.from_config(
            settings), trainer=nonprivate_trainer(recipe, threads=trial_spec.threads),
            progress=None if report is None else runner.audit_phases(report),
            **trial_audit_paths(out))
        atomic_write_json(out / layout.AUDIT, audited)
        record["audit_seconds"] = time.perf_counter() - started
    record.update(pid=os.getpid(), started_at=started_at, finished_at=time.time())
    atomic_write_json(out / layout.RESULT, record)
    return record


def baseline_row(record: dict[str, Any], *, num_classes: int) -> dict[str, Any]:
    """The baseline's results row: not a DP trial (no epsilon; never releasable)."""
    row = store.failed_row(trial_id=BASELINE_ID, method=BASELINE_ID, series=BASELINE_ID,
                           study="baseline", error="")
    row.update({"status": OK, "validity_reason": "non-private: no clipping, no noise",
                "randomness": "none", "release_safe": False,
                "val_accuracy": record["val_accuracy"], "val_loss": record["val_loss"],
                "test_accuracy": record["test_accuracy"], "test_loss": record["test_loss"],
                "degenerate": store.is_degenerate(record["val_accuracy"],
                                                  num_classes=num_classes),
                "train_seconds": record["train_seconds"], "epsilon_upper": math.inf,
                "audit_seconds": record.get("audit_seconds", math.nan)})
    return row
