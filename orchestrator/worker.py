"""The Ray Tune function trainable: one trial of a study, or a job from outside the studies (the
non-private baseline) run in the same warm worker and a slot the trials would leave idle.

It sits above both the trial (``orchestrator.trial_runner``) and the after-search jobs
(``orchestrator.postsweep``), so neither imports the other's caller. A job is named in the Tune
config by its kind (``postsweep.JobKind``), never by a display name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import describe
from orchestrator import postsweep
from orchestrator.trial_runner import execute, use_data_pool

#: The key of a Tune config that names a job (its kind's value) instead of a trial.
JOB_KEY = "job"
#: What a job reports to Tune when it fails (its reason: the searcher passes it to the driver).
JOB_ERROR = "job_error"
#: The jobs a Tune experiment may run beside its trials, by kind.
TUNE_JOBS: dict[str, Callable[..., dict[str, Any]]] = {
    postsweep.JobKind.BASELINE.value: postsweep.baseline_job}


def tune_trainable(config: dict[str, Any], data: dict[str, Any] | None = None) -> None:
    """The Ray Tune function trainable: :func:`execute` with per-epoch reports to Tune, or a job
    from outside the studies (``config[JOB_KEY]``) run in the same warm worker. ``data`` is the
    driver's ``orchestrator.trial.data_pool`` (``tune.with_parameters``)."""
    from ray import tune

    from orchestrator.audit import audit_in_trial

    use_data_pool(data)

    if JOB_KEY in config:
        try:
            TUNE_JOBS[config[JOB_KEY]](**config["kwargs"])
        except Exception as exc:  # its reason reaches the driver; the sweep goes on
            tune.report({JOB_ERROR: describe(exc), "done": True})
            return
        tune.report({"done": True})
        return

    record = execute(config, report=tune.report, audit=audit_in_trial)
    tune.report({k: v for k, v in record.items() if isinstance(v, (int, float))
                 and not isinstance(v, bool)} | {"done": True})
