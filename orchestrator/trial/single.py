"""``dpsweep train``: one trial, no sweep, in a run directory like a sweep's.

The output is a run directory of kind ``trial`` (manifest, lock, ``trials/<id>/`` records, a
one-row results store), so ``report``, ``export`` and ``audit`` work on it exactly as on a sweep.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpsweep.core.layout import CHECKPOINT_DIR, RESULTS
from dpsweep.orchestrator.door import CheckedSetup, require_checked
from dpsweep.orchestrator.rundir import RunDir, check_creatable
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.reports import store
from dpsweep.trainables.training.loop import TrialResult, resolve_device, train_trial

TRIAL_ID = "trial-000"


def train_single(setup: CheckedSetup, *, out: Path,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> TrialResult:
    """Plan the budget, train, and record one trial into a new run directory ``out``."""
    # budget.epsilons = [1] trains at 1, not 3; the setup, checked once for the command, is
    # read by the plan, the record and the row
    cfg = require_checked(setup, where="train_single").config.one_target(command="dpsweep train")
    check_creatable(Path(out))
    data = setup.data_splits()  # validates data_dir and files before anything is written
    # planned before the run directory exists (budgets in the user's cache): a setting that
    # cannot work leaves nothing behind
    spec = plan_trial(setup, trial_id=TRIAL_ID, data=data, epsilon=cfg.privacy.epsilon)
    resolve_device(cfg.resources.device)  # a device this machine lacks: refused here, too
    run = RunDir.create(Path(out), config_text=cfg.to_toml(), kind="trial",
                        inputs=setup.input_fingerprints())
    try:
        trial_dir = run.trial_dir(TRIAL_ID)
        result = train_trial(spec, data=data, checkpoint_root=trial_dir,
                             rolling_checkpoint=CHECKPOINT_DIR, plan_cache=run.cache_dir,
                             report=(lambda m, _c: progress(m)) if progress else None)
        row = store.row_from_trial(
            run_dir=run.path, trial_dir=trial_dir, checkpoint_dir=trial_dir / CHECKPOINT_DIR,
            spec=spec.to_dict(), privacy=result.privacy_record, history=result.history,
            train_seconds=sum(m["epoch_seconds"] for m in result.history),
            num_classes=setup.num_classes, study="single",
            preset=cfg.training.preset)
        store.write_results(run.path, [row])
        run.record_trial(TRIAL_ID)
        run.record([RESULTS])
        return result
    finally:
        run.release()
