"""No silent damage (issue 26): what a resume checks, how a full disk is told apart and stops a
sweep, and a local Ray's temp dir under a long TMPDIR.

Each check here is the unit behind an end-to-end one: ``tests/system/test_faults_disk.py``
fills a real small file system at three writes, ``tests/contract/test_bad_input.py`` refuses
damaged run directories and bad addresses through the CLI.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from dpsweep.core import layout
from dpsweep.core.errors import (
    EXIT_DISK_FULL,
    DiskFull,
    UserInputError,
    describe,
    disk_full,
    disk_full_in,
)
from dpsweep.core.storage import atomic_write, atomic_write_json
from dpsweep.core.vocabulary import DISK_FULL_KEY
from dpsweep.orchestrator import api, raytemp
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RESTORE, RunDir
from dpsweep.orchestrator.sweep.studies import (
    ID_ATTR,
    INTERRUPTED_ATTR,
    Outcome,
    finished_trial_ids,
    make_sampler,
    open_study,
    read_outcome,
    reconcile,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)
ENOSPC_TEXT = os.strerror(errno.ENOSPC)


def _full(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, ENOSPC_TEXT)


def _refused(path: Path, *_: object) -> Path:
    """A ``core.storage`` writer on a full disk."""
    raise DiskFull(str(path))


@pytest.fixture
def run(tmp_path: Path) -> Any:
    opened = RunDir.create(tmp_path / "run", config_text="[training]\nepochs = 1\n")
    yield opened
    opened.release()


def _trial(run: RunDir, tid: str, *, record: bool = True) -> list[str]:
    """A finished trial's records (recorded in the manifest unless not ``record``)."""
    for name in (layout.SPEC, layout.RESULT):
        atomic_write_json(run.trial_dir(tid) / name, {"trial_id": tid})
    return run.record_trial(tid) if record else run.trial_files(tid)


# ---- a full disk, told apart from every other error ----------------------------------------
def test_atomic_write_names_the_file_a_full_disk_refused_and_keeps_the_old_one(
        tmp_path: Path) -> None:
    target = tmp_path / "results.bin"
    target.write_bytes(b"old")
    with pytest.raises(DiskFull) as err:
        atomic_write(target, _full)
    assert err.value.what == str(target) and err.value.errno == errno.ENOSPC
    assert str(err.value) == f"the disk is full: could not write {target} ({ENOSPC_TEXT})"
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "results.bin"]  # no temporary file left behind


def test_disk_full_is_found_in_chains_and_texts_and_survives_pickling() -> None:
    try:
        try:
            _full()
        except OSError as exc:
            raise RuntimeError("writing the checkpoint failed") from exc
    except RuntimeError as wrapped:
        found = disk_full(wrapped, what="state.pt")
    assert found is not None and found.what == "state.pt" and found.reason == ENOSPC_TEXT
    sqlite = RuntimeError("(sqlite3.OperationalError) database or disk is full [SQL: UPDATE]")
    assert str(disk_full(sqlite, database="/r/optuna.db")) == (
        "the disk is full: could not write the Optuna storage /r/optuna.db (database or disk "
        "is full)")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/q/file")
    assert disk_full(quota).what == "/q/file"
    original = DiskFull("/r/results.parquet")
    back = disk_full_in(describe(original))  # a job's reason, pickled back as text
    assert (back.what, back.reason) == ("/r/results.parquet", original.reason)
    again = pickle.loads(pickle.dumps(original))
    assert type(again) is DiskFull and str(again) == str(original)
    for other in (OSError(errno.EACCES, "Permission denied"), ValueError("disk"),
                  RuntimeError("loss is nan")):
        assert disk_full(other) is None
    assert disk_full_in("TrialDiverged: loss nan") is None and disk_full_in("") is None


def test_a_full_disk_reads_as_an_interrupted_trial_with_its_reason(tmp_path: Path) -> None:
    full = DiskFull("/r/trials/t/result.json")
    atomic_write_json(tmp_path / "t" / layout.ERROR, {
        "status": "failed", "error": describe(full),
        DISK_FULL_KEY: {"what": full.what, "reason": full.reason}})
    outcome = read_outcome(tmp_path / "t")
    assert outcome.status == "interrupted" and outcome.error == describe(full)


def test_a_trial_stopped_by_a_full_disk_records_why_and_raises_disk_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpsweep.orchestrator.trial import runner

    config = {"trial_id": "t"}
    try:
        _full()
    except OSError as exc:
        with pytest.raises(DiskFull):
            runner._record_failure(tmp_path / "a", config, exc)
    record = json.loads((tmp_path / "a" / layout.ERROR).read_text())
    assert record[DISK_FULL_KEY]["reason"] == ENOSPC_TEXT
    assert record["error"].startswith("DiskFull: the disk is full")
    assert read_outcome(tmp_path / "a").status == "interrupted"
    # a failure the full disk takes no error.json for: no record at all (read as interrupted,
    # it runs again and records its reason then), and the sweep hears DiskFull
    monkeypatch.setattr(runner, "atomic_write_json", _refused)
    with pytest.raises(DiskFull):
        runner._record_failure(tmp_path / "b", config, ValueError("loss is nan"))
    assert not (tmp_path / "b").exists() and read_outcome(tmp_path / "b").status == "interrupted"
    monkeypatch.undo()
    runner._record_failure(tmp_path / "c", config, ValueError("loss is nan"))  # not raised here
    assert read_outcome(tmp_path / "c").status == "failed"
    # no room for the reason: the records a re-run writes again make room, the checkpoint stays
    trial = tmp_path / "d"
    for name in (*runner.PROVISIONAL, f"{layout.CHECKPOINT_DIR}/{layout.CHECKPOINT_FILE}"):
        atomic_write_json(trial / name, {})
    tries = []
    real = runner.atomic_write_json

    def full_once(path: Path, value: Any) -> Path:
        tries.append(path)
        return _refused(path) if len(tries) == 1 else real(path, value)

    monkeypatch.setattr(runner, "atomic_write_json", full_once)
    with pytest.raises(DiskFull):
        runner._record_failure(trial, config,
                               OSError(errno.ENOSPC, ENOSPC_TEXT, str(trial / layout.RESULT)))
    assert read_outcome(trial).error.startswith("DiskFull: the disk is full")
    assert sorted(p.name for p in trial.iterdir()) == [layout.CHECKPOINT_DIR, layout.ERROR]


# ---- the manifest: a rewritten file and its record move together ----------------------------
@pytest.mark.parametrize("refused", ["listing", "the file", "confirming"])
def test_commit_leaves_file_and_manifest_consistent_whichever_write_a_full_disk_refuses(
        run: RunDir, refused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpsweep.orchestrator.rundir as rundir
    trial = _trial(run, "t-000")
    run.commit(layout.RESULTS, b"old rows", also=trial)
    extra = _trial(run, "t-001", record=False)  # listed by the commit itself
    calls = {"json": 0}
    real_json, real_bytes = rundir.atomic_write_json, rundir.atomic_write_bytes

    def manifest(path: Path, value: Any) -> Path:
        calls["json"] += 1
        if (refused, calls["json"]) in (("listing", 1), ("confirming", 2)):
            raise DiskFull(str(path))
        return real_json(path, value)

    def data(path: Path, payload: bytes) -> Path:
        if refused == "the file":
            raise DiskFull(str(path))
        return real_bytes(path, payload)

    monkeypatch.setattr(rundir, "atomic_write_json", manifest)
    monkeypatch.setattr(rundir, "atomic_write_bytes", data)
    with pytest.raises(DiskFull):
        run.commit(layout.RESULTS, b"new rows", also=extra)
    monkeypatch.undo()
    reopened = RunDir.open(run.path, write=False)
    assert reopened.verify(layout.RESULTS).read_bytes() in (b"old rows", b"new rows")
    reopened.check_resumable(referenced={}, finished=["t-000"])  # nothing to refuse
    listed = set(reopened.manifest["files"])
    assert (set(extra) <= listed) == (refused != "listing")


def test_a_first_commit_the_disk_refused_is_not_a_missing_file(
        run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpsweep.orchestrator.rundir as rundir
    monkeypatch.setattr(rundir, "atomic_write_bytes", _refused)
    with pytest.raises(DiskFull):
        run.commit(layout.SUMMARY, b"{}")
    monkeypatch.undo()
    assert run.manifest["files"][layout.SUMMARY].keys() == {"pending"}
    run.check_resumable(referenced={}, finished=[])
    with pytest.raises(UserInputError, match="now missing"):
        run.verify(layout.SUMMARY)


def test_create_on_a_full_disk_leaves_nothing_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpsweep.orchestrator.rundir as rundir
    monkeypatch.setattr(rundir, "atomic_write_text", lambda *a: _full())
    for out, existed in ((tmp_path / "new" / "deeper", False), (tmp_path / "empty", True)):
        if existed:
            out.mkdir()
        with pytest.raises(UserInputError) as err:
            RunDir.create(out, config_text="")
        assert err.value.field == "--out" and "the disk is full" in str(err.value)
        assert "a location with free space" in str(err.value)
        assert out.is_dir() == existed and (not existed or list(out.iterdir()) == [])
    assert not (tmp_path / "new").exists()


def test_a_full_disk_does_not_block_opening_for_the_lock_record(
        run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpsweep.orchestrator.rundir as rundir
    run.release()
    monkeypatch.setattr(rundir, "atomic_write_json", _refused)
    with RunDir.open(run.path, write=True) as again:
        assert not (again.path / layout.LOCK_INFO).exists()  # no stale holder named


# ---- what a resume refuses -----------------------------------------------------------------
def _refusal(run: RunDir, **kwargs: Any) -> UserInputError:
    with pytest.raises(UserInputError) as err:
        run.check_resumable(**{"referenced": {}, "finished": [], **kwargs})
    assert RESTORE in str(err.value), str(err.value)
    return err.value


def test_a_resume_refuses_records_that_vanished_or_changed(run: RunDir) -> None:
    import shutil

    kept = _trial(run, "t-000")
    _trial(run, "t-001")
    run.check_resumable(referenced={"t-000": kept}, finished=["t-000", "t-001"])
    shutil.rmtree(run.trial_dir("t-001"))
    assert _refusal(run).value == f"{layout.TRIALS}/t-001"
    _trial(run, "t-001")
    (run.trial_dir("t-000") / layout.SPEC).unlink()
    err = _refusal(run)
    assert err.value == f"{layout.TRIALS}/t-000/{layout.SPEC}" and "now missing" in err.allowed
    _trial(run, "t-000")
    (run.trial_dir("t-000") / layout.RESULT).write_text("{}")
    assert "SHA-256 differs" in _refusal(run).allowed
    _trial(run, "t-000")
    err = _refusal(run, referenced={"t-000": [f"{layout.TRIALS}/t-000/{layout.PRIVACY}"]})
    assert "row of trial t-000 points to it" in err.allowed
    err = _refusal(run, finished=["t-000", "t-002"])
    assert err.value == f"{layout.TRIALS}/t-002/{layout.RESULT}"
    assert f"finished according to {layout.OPTUNA_DB}" in err.allowed


def test_finished_trial_ids_come_from_the_optuna_storage_read_only(tmp_path: Path) -> None:
    db = tmp_path / layout.OPTUNA_DB
    assert finished_trial_ids(db) == set()
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    for tid, state in (("a", TrialState.COMPLETE), ("b", TrialState.PRUNED),
                       ("c", TrialState.FAIL), ("d", None)):
        trial = study.ask()
        trial.set_user_attr(ID_ATTR, tid)
        if state is TrialState.COMPLETE:
            study.tell(trial, 0.5)
        elif state is not None:
            study.tell(trial, state=state)
    before = db.stat().st_mtime_ns
    assert finished_trial_ids(db) == {"a", "b"}
    assert db.stat().st_mtime_ns == before
    (tmp_path / "junk.db").write_bytes(b"not a database")
    assert finished_trial_ids(tmp_path / "junk.db") == set()


# ---- the searcher stops the sweep on a full disk ----------------------------------------------
def _searcher(tmp_path: Path, on_outcome: Any) -> tuple[Any, Any, Any]:
    from dpsweep.orchestrator.sweep.plans import study_plans
    from dpsweep.orchestrator.sweep.raytune import SweepSearcher

    tmp_path.mkdir(exist_ok=True)
    cfg = api.from_dict({"training": {"epochs": 1}, "audit": {"enabled": False},
                                "sweep": {"methods": ["dpsgd"], "trials_per_method": 2}})
    plan = study_plans(check(cfg))[0]
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / layout.OPTUNA_DB}")
    study = open_study(plan, storage=storage, sampler=make_sampler("tpe", seed=0, parallel=True))
    tally = reconcile(study, plan, storage=storage, trials_root=tmp_path,
                      on_finished=lambda *a: None)
    searcher = SweepSearcher(plans=[plan], studies={plan.name: study},
                             tallies={plan.name: tally},
                             make_config=lambda p, params, tid: {"trial_id": tid},
                             on_outcome=on_outcome, trials_root=tmp_path)
    return searcher, study, plan


def test_a_trial_that_reports_a_full_disk_runs_again_and_halts_the_search(
        tmp_path: Path) -> None:
    from dpsweep.orchestrator.sweep.raytune import DISK_FULL_REASON, InterruptStopper
    from dpsweep.orchestrator.sweep.signals import _StopFlag

    outcomes: list[str] = []
    searcher, study, _ = _searcher(tmp_path, lambda plan, tid, outcome, ot: outcomes.append(tid))
    first = searcher.suggest("tune-1")
    stopper = InterruptStopper(_StopFlag(), halted=lambda: searcher.halt is not None)
    assert not stopper.stop_all()
    searcher.on_trial_complete("tune-1", result={DISK_FULL_KEY: "/r/x/state.pt",
                                                 DISK_FULL_REASON: ENOSPC_TEXT})
    assert searcher.halt is not None and searcher.halt.what == "/r/x/state.pt"
    assert stopper.stop_all() and searcher.suggest("tune-2") is None
    failed, waiting = study.get_trials()
    assert (failed.state, waiting.state) == (TrialState.FAIL, TrialState.WAITING)
    assert failed.user_attrs[INTERRUPTED_ATTR] is True
    assert failed.user_attrs["error"] == describe(DiskFull("/r/x/state.pt"))
    assert waiting.user_attrs[ID_ATTR] == first["trial_id"] and outcomes == []


def test_a_driver_write_that_meets_a_full_disk_halts_instead_of_raising_into_tune(
        tmp_path: Path) -> None:
    def record(plan: Any, tid: str, outcome: Outcome, ot: Any) -> None:
        raise DiskFull("/r/results.parquet")

    searcher, study, _ = _searcher(tmp_path, record)
    first = searcher.suggest("tune-1")
    atomic_write_json(tmp_path / first["trial_id"] / layout.RESULT,
                      {"status": "ok", "val_accuracy": 0.5, "peak_mia_accuracy": 0.5})
    searcher.on_trial_complete("tune-1")
    assert str(searcher.halt).startswith("the disk is full: could not write /r/results")
    # told before the row was written: a resume finds it COMPLETE and records it then
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE]
    assert searcher.interrupt("stopped") == []

    def broken(plan: Any, tid: str, outcome: Outcome, ot: Any) -> None:
        raise KeyError("a bug, not the disk")

    searcher, _, _ = _searcher(tmp_path / "other", broken)
    second = searcher.suggest("tune-1")
    atomic_write_json(tmp_path / "other" / second["trial_id"] / layout.ERROR,
                      {"status": "failed", "error": "ValueError: x"})
    with pytest.raises(KeyError):
        searcher.on_trial_complete("tune-1")


def test_a_sweep_that_met_a_full_disk_ends_with_it_naming_where_to_resume(
        run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the command turns into one line and ``EXIT_DISK_FULL`` (``orchestrator.cli``):
    the write that failed (here Optuna's, known only by SQLite's text) and the run directory."""
    from dpsweep.orchestrator.sweep import driver

    def drive(*_: object, **__: object) -> None:
        try:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full")
        except RuntimeError as exc:
            raise ValueError("An exception is raised during the commit.") from exc

    monkeypatch.setattr(driver, "_drive", drive)
    with pytest.raises(DiskFull) as err:
        driver._drive_and_release(run, lambda: None, address=None, quiet=True, command="run")
    assert err.value.what == f"the Optuna storage {run.path / layout.OPTUNA_DB}"
    assert err.value.run_dir == run.path and EXIT_DISK_FULL == 74
    assert run._lock is None  # released
    monkeypatch.setattr(driver, "_drive", lambda *a, **k: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):  # anything else is left alone
        driver._drive_and_release(RunDir.open(run.path, write=True), lambda: None,
                                  address=None, quiet=True, command="resume")


# ---- a local Ray's temp dir under a long TMPDIR ----------------------------------------------
def test_ray_sockets_fit_under_any_tmpdir(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    long = tmp_path / ("t" * (100 - len(str(tmp_path)) - 1))
    long.mkdir()
    assert len(str(long)) == 100
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    base = raytemp.check_temp_dir()
    assert base != long and str(base) in raytemp.SHORT_TEMP_BASES
    temp = raytemp.private_temp_dir()
    parent = temp.parent
    assert parent.stat().st_uid == os.getuid() and parent.stat().st_mode & 0o077 == 0
    # Ray's longest socket there, with a 7-digit pid and a numbered duplicate
    socket = temp / "session_2026-11-26_01-35-00_123456_4194304" / "sockets" / "plasma_store.99"
    assert len(os.fsencode(socket)) <= raytemp.UNIX_SOCKET_MAX
    monkeypatch.setattr(tempfile, "tempdir", "/var/tmp")
    assert raytemp.check_temp_dir() == Path("/var/tmp")  # a TMPDIR that fits is kept


def test_a_tmpdir_too_long_with_no_short_fallback_is_refused_before_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("t" * 90)))
    monkeypatch.setattr(raytemp, "SHORT_TEMP_BASES", (str(tmp_path / "missing"),))
    with pytest.raises(UserInputError) as err:
        raytemp.check_temp_dir()
    assert err.value.field == "TMPDIR" and "bytes" in err.value.allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == []
