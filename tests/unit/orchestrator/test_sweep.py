"""The sweep's bookkeeping without a Ray cluster: study plans and names, Optuna studies,
``reconcile`` after crashes, the Tune searcher, signals, fronts and the after-search jobs.

Everything here runs in-process on a SQLite Optuna storage in ``tmp_path``; the searcher is
driven by hand the way Tune drives it (suggest, then on_trial_complete), with trial records
written the way ``orchestrator.trial.runner`` writes them. The real CLI under faults is in
``tests/system/test_faults.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import types
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from dpsweep.core.storage import atomic_write_json
from dpsweep.orchestrator import api
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep.aftersearch import AfterSearchJobs, front_ids
from dpsweep.orchestrator.sweep.driver import _Driver
from dpsweep.orchestrator.sweep.plans import precompute_order, schedule_points, study_plans
from dpsweep.orchestrator.sweep.raytune import SweepSearcher
from dpsweep.orchestrator.sweep.records import SweepRecords
from dpsweep.orchestrator.sweep.search import TrialConfigs
from dpsweep.orchestrator.sweep.signals import (
    EXIT_SIGINT,
    EXIT_SIGTERM,
    Interrupted,
    _signals,
    _StopFlag,
)
from dpsweep.orchestrator.sweep.state import PrivateTuning, SweepContext, SweepProgress
from dpsweep.orchestrator.sweep.studies import (
    ID_ATTR,
    INTERRUPTED_ATTR,
    Outcome,
    StudyPlan,
    Tally,
    make_sampler,
    open_study,
    read_outcome,
    reconcile,
    slug,
    study_name,
)
from dpsweep.orchestrator.sweep.tuning import open_plan_study

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _config(*, methods: list[str], trials: int = 2, eps: list[float] | None = None,
            audit: bool = False, **extra: Any) -> Config:
    """A validated config (as ``dpsweep run`` would load it)."""
    return api.from_dict({"training": {"epochs": 2},
                                 "budget": {"epsilons": list(eps or [])},
                                 "sweep": {"methods": methods, "trials_per_method": trials},
                                 "audit": {"enabled": audit}, **extra})


@pytest.fixture
def storage(tmp_path: Path) -> optuna.storages.RDBStorage:
    return optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")


def _studies(plans: list[StudyPlan], storage: Any, root: Path) -> tuple[dict, dict]:
    studies, tallies = {}, {}
    for i, plan in enumerate(plans):
        study = open_study(plan, storage=storage,
                           sampler=make_sampler("tpe", seed=i, parallel=True))
        studies[plan.name] = study
        tallies[plan.name] = reconcile(study, plan, storage=storage, trials_root=root,
                                       on_finished=lambda *a: None)
    return studies, tallies


def _result(root: Path, tid: str, **metrics: float) -> None:
    """What trial_runner.execute leaves for a finished trial."""
    atomic_write_json(root / tid / "result.json", {"status": "ok", "trial_id": tid,
                                                   "train_seconds": 1.0, **metrics})


def _error(root: Path, tid: str, message: str) -> None:
    atomic_write_json(root / tid / "error.json", {"status": "failed", "trial_id": tid,
                                                  "error": message, "type": "TrialDiverged"})


def _started(root: Path, tid: str) -> None:
    """A trial that began (spec written, no final record): what an interrupt leaves."""
    atomic_write_json(root / tid / "spec.json", {"trial_id": tid})


# ---- names and plans ------------------------------------------------------------------------
def test_study_names_and_trial_ids_are_one_path_component() -> None:
    assert study_name("lm_dpsgd:faithful", 3.0) == "lm_dpsgd:faithful@eps3"
    assert study_name("dpsgd", 0.5) == "dpsgd@eps0.5"
    assert slug("lm_dpsgd:faithful@eps3") == "lm_dpsgd-faithful_eps3"
    assert slug("dpsgd@eps0.5") == "dpsgd_eps0.5"
    plan = study_plans(check(_config(methods=["lm_dpsgd:faithful"])))[0]
    assert [plan.trial_id(i) for i in (0, 7, 123)] == [
        "lm_dpsgd-faithful_eps3-000", "lm_dpsgd-faithful_eps3-007", "lm_dpsgd-faithful_eps3-123"]


def test_one_study_per_series_and_target_with_equal_budgets() -> None:
    cfg = _config(methods=["dpsgd", "lm_dpsgd:faithful"], trials=5, eps=[4, 1], audit=True)
    plans = study_plans(check(cfg))
    assert cfg.targets() == [1.0, 4.0]  # sorted by the config
    assert [p.name for p in plans] == ["dpsgd@eps1", "lm_dpsgd:faithful@eps1", "dpsgd@eps4",
                                       "lm_dpsgd:faithful@eps4"]
    assert [(p.method, p.mode, p.epsilon) for p in plans] == [
        ("dpsgd", "standard", 1.0), ("lm_dpsgd", "faithful", 1.0), ("dpsgd", "standard", 4.0),
        ("lm_dpsgd", "faithful", 4.0)]
    assert {p.n_trials for p in plans} == {5}
    # the audit inside the trial makes the search two-objective; without it, accuracy alone
    assert {p.objectives for p in plans} == {("val_accuracy", "peak_mia_accuracy")}
    assert {p.objectives for p in study_plans(check(_config(methods=["dpsgd"])))} == {
        ("val_accuracy",)}
    assert _config(methods=["dpsgd"]).targets() == [3.0]  # [privacy] epsilon without a list


def test_a_fixed_clip_norm_is_not_searched_but_the_learning_rate_still_is() -> None:
    free = study_plans(check(_config(methods=["dpsgd"])))[0].space
    assert set(free.distributions) == {"clip_norm", "lr_x_clip"}
    decoded = free.decode({"clip_norm": 0.5, "lr_x_clip": 1.0})
    assert decoded["clip_norm"] == 0.5 and decoded["lr"] == pytest.approx(2.0)
    cfg = _config(methods=["dpsgd"], method_params={"dpsgd": {"clip_norm": 2.0}})
    space = study_plans(check(cfg))[0].space
    assert "clip_norm" not in space.distributions
    assert space.decode(space.first_point)["clip_norm"] == 2.0
    # with C fixed, a study that searches nothing would train one configuration n times
    assert space.distributions, "fixing clip_norm removed the learning rate from the search"


def test_open_study_names_metrics_and_enqueues_the_first_point_once(
        storage: Any, tmp_path: Path) -> None:
    plan = study_plans(check(_config(methods=["lm_dpsgd:faithful"], audit=True)))[0]
    for _ in range(2):  # reopening (a resume) changes nothing
        study = open_study(plan, storage=storage, sampler=make_sampler("tpe", seed=0,
                                                                      parallel=False))
    loaded = optuna.load_study(study_name=plan.name, storage=storage)
    assert loaded.metric_names == ["val_accuracy", "peak_mia_accuracy"]
    assert loaded.directions == [optuna.study.StudyDirection.MAXIMIZE,
                                 optuna.study.StudyDirection.MINIMIZE]
    assert loaded.user_attrs == {"series": "lm_dpsgd:faithful", "method": "lm_dpsgd",
                                 "mode": "faithful", "epsilon": 3.0, "trials_per_study": 2}
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1
    assert waiting[0].user_attrs[ID_ATTR] == "lm_dpsgd-faithful_eps3-000"
    assert waiting[0].system_attrs["fixed_params"] == plan.space.first_point


# ---- records ---------------------------------------------------------------------------------
def test_read_outcome_tells_finished_failed_and_interrupted_apart(tmp_path: Path) -> None:
    _result(tmp_path, "a", val_accuracy=0.9)
    _error(tmp_path, "b", "TrialDiverged: train loss became nan in epoch 3")
    _started(tmp_path, "c")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "result.json").write_text("{not json")
    a, b, c, d = (read_outcome(tmp_path / x) for x in "abcd")
    assert (a.status, a.metrics["val_accuracy"], a.values(("val_accuracy",))) == (
        "ok", 0.9, [0.9])
    assert (b.status, b.error) == ("failed", "TrialDiverged: train loss became nan in epoch 3")
    assert c.status == "interrupted" and c.values(("val_accuracy",)) is None
    assert d.status == "failed" and d.error.startswith("unreadable result.json")
    # a finished trial without a finite value for every objective gives Optuna no values
    assert a.values(("val_accuracy", "peak_mia_accuracy")) is None
    assert Outcome("ok", {"val_accuracy": math.nan}, "").values(("val_accuracy",)) is None


# ---- reconcile -------------------------------------------------------------------------------
def _crashed_study(storage: Any, root: Path) -> tuple[StudyPlan, Any, list[int]]:
    """A study whose driver asked for trials 000-003 and died: 000 finished (result.json),
    001 failed (error.json), 002 was running (spec only), 003 finished without its objective."""
    plan = study_plans(check(_config(methods=["dpsgd"], trials=6)))[0]
    study = open_study(plan, storage=storage, sampler=make_sampler("random", seed=0,
                                                                  parallel=False))
    numbers = []
    for i in range(4):
        ot = study.ask(plan.space.distributions)
        if i:
            ot.set_user_attr(ID_ATTR, plan.trial_id(i))
        assert ot.user_attrs[ID_ATTR] == plan.trial_id(i)
        numbers.append(ot.number)
    _result(root, plan.trial_id(0), val_accuracy=0.71)
    _error(root, plan.trial_id(1), "TrialDiverged: train loss became nan in epoch 2")
    _started(root, plan.trial_id(2))
    _result(root, plan.trial_id(3), val_accuracy=math.nan)
    return plan, study, numbers


def test_reconcile_after_a_crash_keeps_finished_trials_and_reruns_interrupted_ones(
        storage: Any, tmp_path: Path) -> None:
    plan, study, numbers = _crashed_study(storage, tmp_path)
    seen: list[tuple[str, str]] = []
    tally = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda tid, out, _t: seen.append((tid, out.status)))
    trials = {t.number: t for t in study.get_trials()}
    t0, t1, t2, t3 = (trials[n] for n in numbers)
    assert t0.state == TrialState.COMPLETE and t0.values == [0.71]  # never trained again
    assert t1.state == TrialState.FAIL
    assert t1.user_attrs["error"] == "TrialDiverged: train loss became nan in epoch 2"
    assert t1.user_attrs[INTERRUPTED_ATTR] is False
    assert t2.state == TrialState.FAIL and t2.user_attrs[INTERRUPTED_ATTR] is True
    assert t3.state == TrialState.FAIL  # finished, but NaN is no objective value
    waiting = [t for t in trials.values() if t.state == TrialState.WAITING]
    assert [(w.user_attrs[ID_ATTR], w.system_attrs["fixed_params"]) for w in waiting] == [
        (plan.trial_id(2), t2.params)]  # re-run under the same id and hyperparameters
    assert tally == Tally(done={plan.trial_id(0), plan.trial_id(3)}, failed={plan.trial_id(1)},
                          pending=1, next_index=4)
    assert sorted(seen) == [(plan.trial_id(0), "ok"), (plan.trial_id(1), "failed"),
                            (plan.trial_id(3), "ok")]
    assert tally.remaining(plan.n_trials) == 3  # 002 again, then 004 and 005
    # reconciling again (a second crash before anything ran) changes nothing
    again = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda *a: None)
    assert again == tally
    assert len(study.get_trials()) == len(trials)
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_reconcile_reruns_a_trial_interrupted_twice_once(storage: Any, tmp_path: Path) -> None:
    """A re-run that is interrupted again gets one new waiting copy, not one per attempt."""
    plan, study, _ = _crashed_study(storage, tmp_path)
    reconcile(study, plan, storage=storage, trials_root=tmp_path, on_finished=lambda *a: None)
    rerun = study.ask(plan.space.distributions)  # the next attempt takes the copy of 002 ...
    assert rerun.user_attrs[ID_ATTR] == plan.trial_id(2)
    tally = reconcile(study, plan, storage=storage, trials_root=tmp_path,  # ... and dies
                      on_finished=lambda *a: None)
    ids = [t.user_attrs.get(ID_ATTR) for t in study.get_trials(states=(TrialState.WAITING,))]
    assert ids == [plan.trial_id(2)] and tally.pending == 1
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_reconcile_leaves_nothing_running_when_the_driver_died_inside_ask(
        storage: Any, tmp_path: Path) -> None:
    """``kill -9`` between ``study.ask`` and the id attribute leaves a RUNNING trial without a
    dpsweep id (seen in test_faults); it never started, so it must not stay RUNNING."""
    plan, study, _ = _crashed_study(storage, tmp_path)
    orphan = study.ask(plan.space.distributions)
    assert ID_ATTR not in orphan.user_attrs
    tally = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda *a: None)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert tally.next_index == 4  # the orphan took no id


# ---- the searcher -----------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.configs: list[tuple[str, dict[str, Any], str]] = []
        self.outcomes: list[tuple[str, str, str]] = []
        self.fail_planning: set[str] = set()

    def make_config(self, plan: StudyPlan, params: dict[str, Any], tid: str) -> dict[str, Any]:
        if tid in self.fail_planning:
            raise ValueError(f"no budget for {tid}")
        self.configs.append((plan.name, params, tid))
        return {"trial_id": tid, "params": params}

    def on_outcome(self, plan: StudyPlan, tid: str, outcome: Outcome, _ot: Any) -> None:
        self.outcomes.append((tid, outcome.status, outcome.error))


def _searcher(storage: Any, root: Path, *, trials: int = 2) -> tuple[Any, Recorder, dict, list]:
    plans = study_plans(check(_config(methods=["dpsgd", "auto_s"], trials=trials)))
    studies, tallies = _studies(plans, storage, root)
    rec = Recorder()
    searcher = SweepSearcher(plans=plans, studies=studies, tallies=tallies,
                             make_config=rec.make_config, on_outcome=rec.on_outcome,
                             trials_root=root)
    return searcher, rec, studies, plans


def _states(study: Any) -> list[tuple[str | None, str]]:
    return [(t.user_attrs.get(ID_ATTR), t.state.name) for t in study.get_trials()]


def test_searcher_runs_studies_in_order_and_records_every_outcome(
        storage: Any, tmp_path: Path) -> None:
    searcher, rec, studies, plans = _searcher(storage, tmp_path)
    c1, c2, c3 = (searcher.suggest(f"tune{i}") for i in (1, 2, 3))
    # dpsgd's two trials first (000 is its first point), then auto_s once dpsgd is all started
    assert [c["trial_id"] for c in (c1, c2, c3)] == ["dpsgd_eps3-000", "dpsgd_eps3-001",
                                                      "auto_s_eps3-000"]
    assert c1["params"] == plans[0].space.decode(plans[0].space.first_point)
    assert c3["params"] == plans[1].space.decode(plans[1].space.first_point)
    _result(tmp_path, "dpsgd_eps3-000", val_accuracy=0.8)
    searcher.on_trial_complete("tune1")
    _error(tmp_path, "dpsgd_eps3-001", "TrialDiverged: loss nan")
    searcher.on_trial_complete("tune2", error=True)
    searcher.on_trial_complete("tune3", error=True)  # its worker died: no record at all
    assert _states(studies["dpsgd@eps3"]) == [("dpsgd_eps3-000", "COMPLETE"),
                                              ("dpsgd_eps3-001", "FAIL")]
    assert studies["dpsgd@eps3"].trials[0].values == [0.8]
    assert studies["dpsgd@eps3"].trials[1].user_attrs["error"] == "TrialDiverged: loss nan"
    auto_s = studies["auto_s@eps3"]
    assert _states(auto_s) == [("auto_s_eps3-000", "FAIL"), ("auto_s_eps3-000", "WAITING")]
    assert auto_s.trials[0].user_attrs[INTERRUPTED_ATTR] is True
    # the dead trial's outcome is not recorded (it will run again), the other two are
    assert rec.outcomes == [("dpsgd_eps3-000", "ok", ""),
                            ("dpsgd_eps3-001", "failed", "TrialDiverged: loss nan")]
    # dpsgd is spent (one done, one failed); auto_s re-runs 000 with the same point, then 001
    c4 = searcher.suggest("tune4")
    assert c4["trial_id"] == "auto_s_eps3-000" and c4["params"] == c3["params"]
    c5 = searcher.suggest("tune5")
    assert c5["trial_id"] == "auto_s_eps3-001"
    assert searcher.suggest("tune6") is None  # all started, two still running: wait
    for tune_id, tid in (("tune4", "auto_s_eps3-000"), ("tune5", "auto_s_eps3-001")):
        _result(tmp_path, tid, val_accuracy=0.5)
        searcher.on_trial_complete(tune_id)
    assert searcher.suggest("tune7") == "FINISHED"
    assert [s for _, s in _states(auto_s)] == ["FAIL", "COMPLETE", "COMPLETE"]


def test_searcher_passes_each_running_trials_phase_on_by_its_own_id(
        storage: Any, tmp_path: Path) -> None:
    searcher, *_ = _searcher(storage, tmp_path)
    heard: list[tuple[str, dict | None]] = []
    searcher._on_phase = lambda tid, report: heard.append((tid, report))
    searcher.suggest("tune1")
    searcher.on_trial_result("tune1", {"phase": "training", "epoch": 1})
    searcher.on_trial_result("tune1", {"epoch": 1})  # no phase: Tune's own bookkeeping
    searcher.on_trial_result("elsewhere", {"phase": "training"})  # not a live trial
    _result(tmp_path, "dpsgd_eps3-000", val_accuracy=0.8)
    searcher.on_trial_complete("tune1")
    assert heard == [("dpsgd_eps3-000", {"phase": "starting"}),
                     ("dpsgd_eps3-000", {"phase": "training", "epoch": 1}),
                     ("dpsgd_eps3-000", None)]


def test_searcher_interrupt_fails_and_reenqueues_live_trials(storage: Any,
                                                              tmp_path: Path) -> None:
    searcher, rec, studies, _ = _searcher(storage, tmp_path)
    first, second = searcher.suggest("t1"), searcher.suggest("t2")
    _result(tmp_path, second["trial_id"], val_accuracy=0.6)  # finished as the signal came
    _started(tmp_path, first["trial_id"])
    assert searcher.interrupt("interrupted by SIGINT") == ["dpsgd_eps3-000"]
    study = studies["dpsgd@eps3"]
    assert _states(study) == [("dpsgd_eps3-000", "FAIL"), ("dpsgd_eps3-001", "COMPLETE"),
                              ("dpsgd_eps3-000", "WAITING")]
    failed = study.trials[0]
    assert failed.user_attrs["error"] == "interrupted by SIGINT"
    assert study.trials[2].system_attrs["fixed_params"] == failed.params
    assert rec.outcomes == [("dpsgd_eps3-001", "ok", "")]
    assert searcher.interrupt("again") == []  # nothing live any more
    # Tune reports the stopped trials afterwards: ignored, no second FAIL
    searcher.on_trial_complete("t1", error=True)
    assert len(study.trials) == 3


def test_a_trial_whose_planning_fails_is_recorded_failed_and_the_search_goes_on(
        storage: Any, tmp_path: Path) -> None:
    searcher, rec, studies, _ = _searcher(storage, tmp_path)
    rec.fail_planning = {"dpsgd_eps3-000"}
    started = [searcher.suggest(f"t{i}")["trial_id"] for i in range(3)]
    # the failure counts against dpsgd's budget of two; its other trial still starts
    assert sorted(started) == ["auto_s_eps3-000", "auto_s_eps3-001", "dpsgd_eps3-001"]
    assert rec.outcomes == [("dpsgd_eps3-000", "failed", "ValueError: no budget for "
                                                          "dpsgd_eps3-000")]
    first = studies["dpsgd@eps3"].trials[0]
    assert first.state == TrialState.FAIL
    assert first.user_attrs["error"] == "ValueError: no budget for dpsgd_eps3-000"
    assert searcher.suggest("t3") is None  # three running, nothing left to start


def test_searcher_pickles_to_an_inert_placeholder(storage: Any, tmp_path: Path) -> None:
    from ray import cloudpickle

    searcher, *_ = _searcher(storage, tmp_path)
    clone = cloudpickle.loads(cloudpickle.dumps(searcher))  # what Tune does with it
    assert clone.__dict__ == {"dpsweep": "not restorable: the Optuna storage holds the state"}


# ---- the trial under Tune --------------------------------------------------------------------
def test_a_trial_reports_fast_epochs_to_tune_sparingly_and_slow_ones_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report blocks the trial until the driver has handled it; digits epochs take a tenth
    of a second, so reporting each cost more than training it. Epochs as long as the interval
    (Fashion-MNIST's) are each reported, so Tune can still stop a trial between them."""
    from dpsweep.orchestrator.trial import runner as trial_runner
    from dpsweep.orchestrator.trial.plan import plan_trial

    cfg = _config(methods=["dpsgd"], training={"epochs": 4})
    spec = plan_trial(check(cfg), method="dpsgd", trial_id="t0", cache_dir=tmp_path / "cache")
    epochs: dict[float, list[int]] = {}
    default = trial_runner.REPORT_INTERVAL_S
    for interval in (default, 0.0):
        monkeypatch.setattr(trial_runner, "REPORT_INTERVAL_S", interval)
        reports: list[dict[str, Any]] = []
        record = trial_runner.execute({"run_dir": str(tmp_path / f"run{interval}"),
                                       "trial_id": "t0", "spec": spec.to_dict()},
                                      report=reports.append)
        assert record["status"] == "ok"
        epochs[interval] = [r["epoch"] for r in reports]
        assert all(0.0 <= r["val_accuracy"] <= 1.0 and r["phase"] == "training"
                   and r["epochs"] == 4 for r in reports)
    assert epochs[0.0] == [1, 2, 3, 4]
    fast = epochs[default]
    assert len(fast) < 4 and fast[0] == 1 and set(fast) <= {1, 2, 3, 4}  # the first is shown


# ---- signals ---------------------------------------------------------------------------------
def test_stop_flag_raises_outside_tune_and_defers_inside() -> None:
    flag = _StopFlag()
    with pytest.raises(Interrupted) as exc:
        flag.handler(signal.SIGTERM, None)
    assert exc.value.exit_code == EXIT_SIGTERM == 143
    inside = _StopFlag()
    inside.in_tune = True
    inside.handler(signal.SIGINT, None)  # Tune's stopper sees the flag; no exception here
    assert inside.event.is_set() and inside.signum == signal.SIGINT
    inside.handler(signal.SIGINT, None)  # a second Ctrl-C: the stop is under way, never
    assert inside.repeats == 1           # raised inside Ray (tests/contract/..._exits.py)
    with pytest.raises(Interrupted) as exc:
        raise Interrupted(inside.signum or signal.SIGINT)
    assert exc.value.exit_code == EXIT_SIGINT == 130


def test_signals_are_handled_while_installed_and_restored_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    flag = _StopFlag()
    with pytest.raises(Interrupted), _signals(flag):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # give the handler a chance to run
        raise AssertionError("not interrupted")
    assert flag.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_cli_prints_one_resume_hint_and_exits_with_the_signal_code(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from dpsweep.orchestrator.sweep.commands import sweep as _sweep

    def stopped() -> None:
        raise Interrupted(signal.SIGTERM, tmp_path / "run")

    assert _sweep(stopped) == 143
    err = capsys.readouterr().err.splitlines()
    assert err == [f"dpsweep: interrupted by SIGTERM; the run directory is consistent: "
                   f"continue with `dpsweep resume {tmp_path / 'run'}`"]


def test_an_interrupt_while_a_row_is_recorded_is_not_turned_into_a_failed_trial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SweepRecords.record`` turns any error reading a trial's records into a failed row; a
    signal arriving meanwhile must stop the sweep instead of marking a finished trial failed
    (which a resume would then keep: its id is in the results)."""
    from dpsweep.orchestrator.rundir import RunDir
    from dpsweep.reports import store

    cfg = _config(methods=["dpsgd"])
    run = RunDir.create(tmp_path / "run", config_text=cfg.to_toml())
    driver = _Driver(check(cfg), run, quiet=True, attempts=[])

    def interrupted(*_a: Any) -> dict[str, Any]:
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(driver.records, "_row", interrupted)
    plan = study_plans(check(cfg))[0]
    try:
        with pytest.raises(Interrupted):
            driver.records.record(plan, "dpsgd_eps3-000",
                                  Outcome("ok", {"val_accuracy": 0.7}, ""))
        assert "dpsgd_eps3-000" not in driver.rows
        assert store.read_results(run.path, allow_empty=True).empty
    finally:
        run.release()


def test_an_interrupt_during_after_search_jobs_is_not_recorded_as_a_failed_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``postsweep.run_jobs`` records a failing job and goes on; an interrupt raised while a
    finished job is recorded must end the loop instead (Ray replaced by a stand-in)."""
    from dpsweep.orchestrator.sweep import jobs as postsweep

    fake = types.ModuleType("ray")

    class Ref:
        def __init__(self, value: Any) -> None:
            self.value = value

    def remote(**_kw: Any) -> Any:
        def wrap(fn: Any) -> Any:
            return types.SimpleNamespace(
                remote=lambda f, kw, data, *board: Ref(fn(f, kw, data, *board)))
        return wrap

    fake.remote = remote
    fake.wait = lambda refs, num_returns=1, **_kw: (refs[:num_returns], refs[num_returns:])
    fake.get = lambda ref: ref.value
    fake.cancel = lambda ref, **_kw: None
    fake.put = lambda value: value
    monkeypatch.setattr(postsweep, "ray", fake)
    calls: list[tuple[str, str]] = []

    def on_done(job: postsweep.Job, result: Any, error: str) -> None:
        calls.append((job.name, error))
        if job.trial_id == "first" and not error:
            raise Interrupted(signal.SIGINT)

    jobs = [postsweep.Job(postsweep.JobKind.AUDIT, tid, lambda: {"ok": True}, {})
            for tid in ("first", "second")]
    with pytest.raises(Interrupted):
        postsweep.run_jobs(jobs, cpus=1, gpus=0, concurrency=1, on_done=on_done)
    assert calls == [("audit first", "")]


# ---- after the search ---------------------------------------------------------------------------
def test_front_ids_are_the_leader_and_the_trials_tied_with_it() -> None:
    from dpsweep.reports.pareto import wilson_interval

    cfg = _config(methods=["dpsgd"])
    setup = check(cfg)
    n_val = setup.split_sizes["validation"]
    plans = study_plans(setup)

    def row(tid: str, acc: float, **extra: Any) -> dict[str, Any]:
        return {"trial_id": tid, "status": "ok", "study": "dpsgd@eps3", "val_accuracy": acc,
                "repeat_of": "", "degenerate": False, **extra}

    rows = [row("a", 0.80), row("b", 0.78), row("c", 0.65), row("d", 0.95, repeat_of="a"),
            row("e", 0.99, degenerate=True), row("f", 0.99, status="failed"),
            row("g", 0.99, study="elsewhere")]
    by_id = {r["trial_id"]: r for r in rows}
    low = wilson_interval(0.80, n=n_val)[0]
    assert wilson_interval(0.78, n=n_val)[1] >= low > wilson_interval(0.65, n=n_val)[1]
    assert front_ids(by_id, setup=setup, plans=tuple(plans)) == {"dpsgd@eps3": ["a", "b"]}
    # sweep.front = "best": the leader alone, whatever is tied with it.
    best = dataclasses.replace(cfg, sweep=dataclasses.replace(cfg.sweep, front="best"))
    assert front_ids(by_id, setup=check(best),
                     plans=tuple(plans)) == {"dpsgd@eps3": ["a"]}


def test_audit_settings_and_summary_inputs_follow_the_config() -> None:
    from dpsweep.orchestrator.sweep.search import audit_settings

    on = audit_settings(_config(methods=["dpsgd"], audit=True))
    off = audit_settings(_config(methods=["dpsgd"], audit=False))
    assert on["in_trial"] is True and off["in_trial"] is False
    assert json.loads(json.dumps(on)) == on  # travels to Ray workers as plain data


def test_the_after_sweep_audit_uses_the_run_cache_and_the_accountant_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The references' budgets of an after-sweep audit come from the run's own budget cache,
    under the config's accountant timeout (they were once computed with neither)."""
    from dpsweep.orchestrator.audit import membership as audit_mod
    from dpsweep.orchestrator.rundir import RunDir
    from dpsweep.orchestrator.sweep import jobs as postsweep
    from dpsweep.orchestrator.trial import plan as trial
    from dpsweep.reports import store

    cfg = _config(methods=["dpsgd"], audit=True,
                  **{"privacy": {"accountant_timeout_s": 77.0}})
    cfg = dataclasses.replace(cfg, audit=dataclasses.replace(cfg.audit, in_trial=False),
                              sweep=dataclasses.replace(cfg.sweep, seeds=0, baseline=False))
    run = RunDir.create(tmp_path / "run", config_text=cfg.to_toml())
    setup = check(cfg)
    try:
        plan = study_plans(setup)[0]
        tid = f"{plan.name.split('@')[0]}_eps3-000"
        (run.trial_dir(tid)).mkdir(parents=True)
        (run.trial_dir(tid) / "spec.json").write_text(json.dumps(
            {"method_params": {"lr": 0.5, "clip_norm": 1.0, "mode": "standard"}}))
        run.record_trial(tid)
        row = store.failed_row(trial_id=tid, method=plan.method, series=plan.series,
                               study=plan.name, error="")
        row.update(status="ok", val_accuracy=0.8, degenerate=False, repeat_of="",
                   mia_layers="")
        data = setup.data_splits()
        progress = SweepProgress(quiet=True)

        def after_search(context: SweepContext) -> AfterSearchJobs:
            records = SweepRecords(context=context, progress=progress, attempts=[],
                                   rows={tid: dict(row)})
            return AfterSearchJobs(
                context=context, records=records, progress=progress, retry_failed=False,
                configs=TrialConfigs(context=context, data=data, rungs=()))

        context = SweepContext(setup=setup, run=run, plans=(plan,))
        asked: list[dict[str, Any]] = []

        def match_budget(**kw: Any) -> tuple[Any, list[float]]:
            asked.append(kw)
            return types.SimpleNamespace(to_dict=lambda: {}), []

        monkeypatch.setattr(trial, "match_budget", match_budget)
        monkeypatch.setattr(audit_mod, "match_budget", match_budget)  # imported by name
        jobs: list[Any] = []
        monkeypatch.setattr(postsweep, "run_jobs", lambda j, **_kw: jobs.extend(j))
        assert after_search(context).post_sweep(_StopFlag()) == 1  # one job (run_jobs: a stand-in)
        assert [j.name for j in jobs] == [f"audit {tid}"]
        assert len(asked) == 1
        assert asked[0]["cache_dir"] == run.cache_dir
        assert asked[0]["timeout_s"] == 77.0
        size = audit_mod.reference_size(data, audit_mod.AuditSettings.from_config(cfg.audit))
        assert asked[0]["dataset_size"] == size
        assert asked[0]["epsilon"] == plan.epsilon
        # under private tuning the references match the certified per-trial epsilon, not the
        # end-to-end target the study is named after
        certified = types.SimpleNamespace(bounds=types.SimpleNamespace(upper=1.7))
        private = PrivateTuning(plan=types.SimpleNamespace(), certified=certified)
        asked.clear()
        after_search(dataclasses.replace(context, private=private)).post_sweep(_StopFlag())
        assert [a["epsilon"] for a in asked] == [1.7]
    finally:
        run.release()


def test_budget_lanes_take_the_preparing_method_first_then_the_most_points() -> None:
    """One queue for both lanes: LM-DP-SGD's point (it carries the risk estimate, the longest
    item) first, then DP-AdamILG's six schedules, each method's points in order."""
    plans = study_plans(check(_config(methods=["dpsgd", "dp_adamilg", "lm_dpsgd", "auto_s"])))
    order = precompute_order(plans)
    methods = [plan.method for plan, _ in order]
    assert methods[0] == "lm_dpsgd"
    counts = {p.method: len(schedule_points(p)) for p in plans}
    assert counts["dp_adamilg"] > 1 and counts["dpsgd"] == counts["auto_s"] == 1
    assert methods == ["lm_dpsgd"] * counts["lm_dpsgd"] + ["dp_adamilg"] * counts["dp_adamilg"] \
        + ["auto_s", "dpsgd"]
    adam = [point for plan, point in order if plan.method == "dp_adamilg"]
    plan = next(p for p in plans if p.method == "dp_adamilg")
    assert adam == schedule_points(plan)


# ---- private tuning: the theorem's random search -------------------------------------------------
def _private_config(**sweep: Any) -> Config:
    return api.from_dict({"training": {"epochs": 2},
                                 "sweep": {"methods": ["dpsgd"], "tuning": "private", **sweep},
                                 "audit": {"enabled": False}})


def _draws(cfg: Config, tmp: Path, n: int) -> tuple[Any, list[dict[str, Any]]]:
    """A fresh study opened as the driver opens it, and the points of its first n trials
    (``SweepSearcher.suggest`` asks exactly this), every global seed fixed first."""
    import random

    import numpy as np

    np.random.seed(0)
    random.seed(0)
    plan = study_plans(check(cfg), counts={"dpsgd": n})[0]
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp / 'optuna.db'}")
    study = open_plan_study(cfg, plan, index=0, storage=storage, parallel=True)
    before = study.get_trials(deepcopy=False)
    asked = [study.ask(plan.space.distributions) for _ in range(n)]
    assert all(t.state == TrialState.RUNNING for t in study.get_trials(deepcopy=False))
    return before, [dict(t.params) for t in asked]


def test_private_studies_draw_fresh_points_with_no_preset_or_enqueued_point(
        tmp_path: Path) -> None:
    """Two private runs of one config (same sweep.seed, same global seeds) draw different
    hyperparameters for every trial, and no study holds a preset or enqueued point; the
    adaptive control, seeded and preset-first, repeats itself (so the check can fail)."""
    cfg = _private_config(seed=7)
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        before, points = _draws(cfg, tmp_path / name, 6)
        assert before == []  # nothing enqueued: no preset, no fixed point
        runs.append(points)
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / name / 'optuna.db'}")
        for t in optuna.load_study(study_name="dpsgd@eps3", storage=storage).trials:
            assert "fixed_params" not in t.system_attrs and "preset" not in t.user_attrs
    assert all(a != b for a, b in zip(*runs, strict=True)), runs
    space = study_plans(check(cfg))[0].space
    assert all(p != dict(space.first_point) for p in runs[0] + runs[1])

    adaptive = dataclasses.replace(cfg, sweep=dataclasses.replace(cfg.sweep, tuning="adaptive",
                                                                  sampler="random"))
    control = []
    for name in ("c", "d"):
        (tmp_path / name).mkdir()
        before, points = _draws(adaptive, tmp_path / name, 3)
        assert [t.system_attrs["fixed_params"] for t in before] == [space.first_point]
        control.append(points)
    assert control[0] == control[1] and control[0][0] == space.first_point


def test_private_after_sweep_audit_looks_at_the_released_trial_only() -> None:
    """Under private tuning the after-search phase audits the best noisy score, chosen without
    reading noiseless accuracy or the degenerate flag."""
    cfg = _private_config()
    rows = [{"trial_id": tid, "status": "ok", "study": "dpsgd@eps3", "method": "dpsgd",
             "repeat_of": "", "dp_valid": True, "release_safe": True, "val_accuracy": acc,
             "noisy_val_score": noisy, "degenerate": acc < 0.2}
            for tid, acc, noisy in (("a", 0.95, 0.70), ("b", 0.15, 0.90), ("c", 0.80, 0.85))]
    setup = check(cfg)
    plans = tuple(study_plans(setup))
    assert front_ids({r["trial_id"]: r for r in rows}, setup=setup,
                     plans=plans) == {"dpsgd@eps3": ["b"]}
    assert front_ids({}, setup=setup, plans=plans) == {}  # K = 0: nothing to audit


def _summary_row(tid: str, study: str, *, status: str = "ok", repeat_of: str = "",
                 schedule: str = '[{"noise_multiplier": 1.1, "steps": 100}]') -> dict[str, Any]:
    return {"trial_id": tid, "study": study, "status": status, "repeat_of": repeat_of,
            "noise_schedule": schedule if status == "ok" else None,
            "sample_rate": 0.02 if status == "ok" else None}


def test_adaptive_summary_counts_every_model_and_states_what_the_sampler_saw() -> None:
    from dpsweep.orchestrator.accounting.tuning.adaptive import adaptive_statement
    from dpsweep.orchestrator.sweep.tuning import adaptive_summary

    cfg = _config(methods=["dpsgd", "lm_dpsgd:faithful"], eps=[1, 4])
    plans = study_plans(check(cfg))
    rows = [_summary_row("a", "dpsgd@eps1"), _summary_row("b", "dpsgd@eps1"),
            _summary_row("a-r1", "dpsgd@eps1", repeat_of="a"),
            _summary_row("f", "lm_dpsgd:faithful@eps1"),  # not DP: never counted
            _summary_row("c", "dpsgd@eps4"), _summary_row("d", "dpsgd@eps4", status="failed"),
            {"trial_id": "nonprivate", "study": "nonprivate", "status": "ok", "repeat_of": ""}]
    tuning = adaptive_summary(cfg, plans, rows)
    one, four = tuning["by_target"]["1"], tuning["by_target"]["4"]
    assert (one["n_trials"], one["reruns"], four["n_trials"], four["reruns"]) == (2, 1, 2, 0)
    assert one["objectives"] == ["val_accuracy"] and tuning["n_trials"] == 5
    # one DP-SGD mechanism throughout: exact; a failed trial's schedule is unknown: black box
    assert one["composed_delta"] == cfg.privacy.delta and "exact" in one["composition"]
    assert four["composed_delta"] == pytest.approx(3 * cfg.privacy.delta)
    assert four["composed_epsilon"] == pytest.approx(adaptive_statement(
        n_trials=2, per_trial_epsilon=4.0, delta=cfg.privacy.delta,
        objectives=("val_accuracy",)).composed_epsilon)
    total = one["composed_epsilon"] + four["composed_epsilon"]
    assert f"sum of their bounds, ({total:.4g}," in one["statement"]
    assert "invalid (lm_dpsgd:faithful) are not counted: nothing covers" in one["statement"]

    audited = _config(methods=["dpsgd"], audit=True)
    tuning = adaptive_summary(audited, study_plans(check(audited)),
                              [_summary_row("a", "dpsgd@eps3"), _summary_row("b", "dpsgd@eps3")])
    entry = tuning["by_target"]["3"]
    assert entry["objectives"] == ["val_accuracy", "peak_mia_accuracy"]
    assert entry["composed_epsilon"] is None and "no bound covers" in entry["statement"]
