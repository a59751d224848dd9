"""``dpsweep resume --retry-failed`` trains a failed trial of an adaptive sweep again (issue 44):
its exact hyperparameters enqueued once more in its study under its id, its failure kept in the
attempt's record, its records out of the manifest; never a finished or pruned trial; refused under
private tuning, whose bound counts trials drawn before the run.

In-process, on a SQLite Optuna storage and trial records written the way the runner writes them;
the real CLI with a trial that fails and then finishes is ``tests/system/test_retry_failed.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.storage import atomic_write_json
from dpsweep.orchestrator import api
from dpsweep.orchestrator import config as config_mod
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.sweep.driver import _Driver, check_retry
from dpsweep.orchestrator.sweep.plans import study_plans
from dpsweep.orchestrator.sweep.studies import (
    ID_ATTR,
    RETRY_ATTR,
    Outcome,
    StudyPlan,
    make_sampler,
    open_study,
    reconcile,
)
from dpsweep.orchestrator.sweep.summary import RETRIED, begin_attempt, read_attempts, retried_trials
from dpsweep.orchestrator.sweep.tuning import adaptive_summary

optuna.logging.set_verbosity(optuna.logging.WARNING)
FAILURE = "RuntimeError: CUDA out of memory (the GPU was shared)"


def _config(**sweep: Any) -> config_mod.Config:
    return api.from_dict({"training": {"epochs": 2},
                                 "sweep": {"methods": ["dpsgd"], "trials_per_method": 4, **sweep},
                                 "audit": {"enabled": False}})


def _finished_study(root: Path) -> tuple[StudyPlan, Any, dict[str, Any]]:
    """A study whose sweep ended: 000 finished, 001 failed, 002 pruned, 003 finished."""
    plan = study_plans(check(_config()))[0]
    storage = optuna.storages.RDBStorage(f"sqlite:///{root / 'optuna.db'}")
    study = open_study(plan, storage=storage,
                       sampler=make_sampler("random", seed=0, parallel=False))
    trials = {}
    for i in range(4):
        ot = study.ask(plan.space.distributions)
        tid = plan.trial_id(i)
        ot.set_user_attr(ID_ATTR, tid)
        trials[tid] = ot
    ids = sorted(trials)
    atomic_write_json(root / ids[0] / layout.RESULT, {"status": "ok", "val_accuracy": 0.8})
    study.tell(trials[ids[0]], [0.8])
    atomic_write_json(root / ids[1] / layout.ERROR, {"status": "failed", "error": FAILURE})
    trials[ids[1]].set_user_attr("error", FAILURE)
    study.tell(trials[ids[1]], state=TrialState.FAIL)
    atomic_write_json(root / ids[2] / layout.RESULT, {"status": "pruned", "pruned_at": 1,
                                                      "val_accuracy": 0.3})
    study.tell(trials[ids[2]], state=TrialState.PRUNED)
    atomic_write_json(root / ids[3] / layout.RESULT, {"status": "ok", "val_accuracy": 0.7})
    study.tell(trials[ids[3]], [0.7])
    return plan, study, {"storage": storage, "ids": ids, "params": trials[ids[1]].params,
                         "number": trials[ids[1]].number}


def test_a_failed_trial_is_enqueued_again_with_its_own_hyperparameters_and_nothing_else(
        tmp_path: Path) -> None:
    plan, study, made = _finished_study(tmp_path)
    ids, storage = made["ids"], made["storage"]
    plain = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda *a: None)
    assert plain.failed == {ids[1]} and plain.remaining(plan.n_trials) == 0
    assert not study.get_trials(states=(TrialState.WAITING,))  # a plain resume retrains none

    retried: list[tuple[str, str]] = []

    def retire(tid: str, outcome: Outcome) -> None:  # what the driver does: the record goes
        retried.append((tid, outcome.error))
        (tmp_path / tid / layout.ERROR).unlink()

    tally = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda *a: None, on_retry=retire)
    assert retried == [(ids[1], FAILURE)]
    assert tally.done == {ids[0], ids[3]} and tally.pruned == {ids[2]} and not tally.failed
    assert tally.pending == 1 and tally.remaining(plan.n_trials) == 1
    (copy,) = study.get_trials(states=(TrialState.WAITING,))
    assert copy.user_attrs[ID_ATTR] == ids[1] and copy.user_attrs[RETRY_ATTR] == made["number"]
    assert copy.system_attrs["fixed_params"] == made["params"]
    failed = [t for t in study.get_trials() if t.state == TrialState.FAIL]
    assert [t.user_attrs["error"] for t in failed] == [FAILURE]  # the failure stays in Optuna

    # the driver stops before the retry runs, and the user retries again: one copy, not two
    again = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda *a: None, on_retry=retire)
    assert retried == [(ids[1], FAILURE)] and again.pending == 1
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1
    # the next trial asked is the copy, under the failed trial's id and with its point
    asked = study.ask(plan.space.distributions)
    assert asked.user_attrs[ID_ATTR] == ids[1] and asked.params == made["params"]


@pytest.fixture
def run(tmp_path: Path) -> Iterator[RunDir]:
    opened = RunDir.create(tmp_path / "run", config_text=_config().to_toml())
    yield opened
    opened.release()


def test_retiring_a_failure_keeps_its_reason_and_leaves_a_run_a_resume_accepts(
        run: RunDir) -> None:
    tid = "dpsgd_eps3-001"
    trial = run.trial_dir(tid)
    for name, value in ((layout.SPEC, {"trial_id": tid}), (layout.HISTORY, [{"epoch": 1}]),
                        (layout.ERROR, {"status": "failed", "error": FAILURE})):
        atomic_write_json(trial / name, value)
    run.record_trial(tid)
    attempts = read_attempts(run)
    begin_attempt(run, attempts, command="resume --retry-failed")
    driver = _Driver(check(_config()), run, quiet=True, attempts=attempts)
    driver.records.retire_failure(tid, FAILURE)

    assert not (trial / layout.ERROR).exists() and (trial / layout.SPEC).is_file()
    listed = run.manifest["files"]
    assert not [rel for rel in listed if rel.startswith(f"{layout.TRIALS}/{tid}/")]
    stored = read_attempts(run)
    assert stored[-1][RETRIED] == [{"trial_id": tid, "error": FAILURE}]
    assert retried_trials(stored) == {tid: 1}
    # the retry rewrites the trial's records; interrupted there, a resume finds nothing changed
    atomic_write_json(trial / layout.HISTORY, [{"epoch": 1}, {"epoch": 2}])
    run.check_resumable(referenced={}, finished=[])


def test_a_retry_record_is_checked_like_the_rest_of_the_attempt(run: RunDir) -> None:
    attempts = read_attempts(run)
    begin_attempt(run, attempts, command="resume --retry-failed")
    attempts[-1][RETRIED] = [{"trial_id": "t", "error": 3}]
    path = run.path / layout.ATTEMPTS
    path.write_text(json.dumps(attempts))
    run.record([layout.ATTEMPTS])
    with pytest.raises(UserInputError, match="retried a list of objects"):
        read_attempts(run)


def test_private_tuning_refuses_to_retry_in_one_line() -> None:
    check_retry(_config(), retry_failed=True)  # adaptive: allowed
    check_retry(_config(tuning="private"), retry_failed=False)  # a plain resume: allowed
    with pytest.raises(UserInputError) as info:
        check_retry(_config(tuning="private"), retry_failed=True)
    assert info.value.field == "--retry-failed" and "\n" not in str(info.value)
    assert "secret number of trials drawn before the run" in str(info.value)


def test_the_adaptive_statement_counts_each_failed_attempt_trained_again() -> None:
    """The earlier attempt trained on the training set as well: one more model."""
    cfg = _config()
    plans = study_plans(check(cfg))
    schedule = json.dumps([{"noise_multiplier": 1.1, "steps": 20}])
    rows = [{"trial_id": t, "study": plans[0].name, "status": "ok", "repeat_of": "",
             "noise_schedule": schedule, "sample_rate": 0.02} for t in ("a", "b")]
    before = adaptive_summary(cfg, plans, rows)["by_target"]["3"]
    after = adaptive_summary(cfg, plans, rows, retried={"b": 2})["by_target"]["3"]
    assert (before["n_trials"], after["n_trials"]) == (2, 4)
    assert after["composed_epsilon"] > before["composed_epsilon"]
    assert "includes 2 failed attempt(s) of trials trained again" in after["statement"]
