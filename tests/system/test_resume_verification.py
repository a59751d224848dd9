"""Reliability, round four (issue 35): the Optuna storage is a record like the others, and
``resume`` verifies the user's code and data before it imports anything the config names.

* a finished trial is never trained twice, whatever file goes missing: ``optuna.db`` deleted,
  truncated, emptied, foreign or older than the trial records, and each neighbouring record
  (results store, attempts, summary, a trial's ``result.json``) deleted or truncated, is refused
  by ``resume`` with exit 2 and one line, nothing written, no lock held, Ray never started;
  states a ``kill -9`` leaves (a finished trial still RUNNING in the storage, a run stopped
  before the storage was first written) are still accepted;
* a run directory whose ``config.toml`` was edited to name another factory (the manifest's
  hash of the config redone) is refused on ``manifest.json.inputs.model_code`` before that
  factory's module is imported: the marker file it would write never appears.

One small sweep (one study, two one-epoch trials) is run once for the module; every case
damages its own copy.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from dpsweep.core import layout
from dpsweep.orchestrator import api
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.sweep.resume_checks import (
    check_records,
    check_storage,
    finished_in_storage,
)
from dpsweep.orchestrator.sweep.studies import ID_ATTR
from dpsweep.trainables.models.usercode import tree_sha256

PREFIX = "dpsweep: error: "
STORAGE_LINE = f"{PREFIX}RUN_DIR = '{layout.OPTUNA_DB}' is not allowed: expected the run's " \
               "Optuna storage ("
TRIALS = ("dpsgd_eps3-000", "dpsgd_eps3-001")
SWEEP = {"training": {"epochs": 1, "batch_size": 50},
         "method_params": {"lr": 1.0, "clip_norm": 1.0},
         "sweep": {"methods": ["dpsgd"], "trials_per_method": 2, "max_concurrent_trials": 1,
                   "baseline": False, "seeds": 0},
         "audit": {"enabled": False}}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A finished sweep's run directory (its two trials done), written by ``run_sweep``."""
    from dpsweep.orchestrator.sweep.driver import run_sweep

    out = tmp_path_factory.mktemp("finished") / "run"
    summary = run_sweep(check(api.from_dict(SWEEP)), run_dir=out, quiet=True)
    assert summary.rows == 2 and summary.failed == 0
    assert sorted(p.name for p in (out / layout.TRIALS).iterdir()) == list(TRIALS)
    yield out


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command starts or joins Ray (nothing could be trained without)."""
    from dpsweep.orchestrator.cluster import connection as cluster

    def started(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster, "start_local", started)
    monkeypatch.setattr(cluster, "connect", started)


def _copy(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run", symlinks=True))


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the lock's bookkeeping left out)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (layout.LOCK, layout.LOCK_INFO)}


def _refused_resume(run: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """``dpsweep resume RUN``: exit 2, one line, nothing written, the lock free again."""
    before = _snapshot(run)
    assert main(["resume", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert _snapshot(run) == before
    lock = FileLock(str(run / layout.LOCK))
    lock.acquire(timeout=0)  # not held by anyone
    lock.release()
    return err[0]


def _sql(db: Path, statement: str, *args: Any) -> None:
    with sqlite3.connect(db) as con:
        con.execute(statement, args)
    con.close()


# ---- 1. the Optuna storage ------------------------------------------------------------------
def _delete(db: Path) -> None:
    db.unlink()


def _truncate(db: Path) -> None:
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])


def _empty(db: Path) -> None:
    db.write_bytes(b"")


def _garbage(db: Path) -> None:
    db.write_bytes(b"not a database at all" * 300)


def _foreign(db: Path) -> None:
    db.unlink()
    _sql(db, "CREATE TABLE notes (x TEXT)")


def _older(db: Path) -> None:  # a copy from before the second trial was asked
    _sql(db, "DELETE FROM trial_user_attributes WHERE key = ? AND value_json = ?",
         ID_ATTR, f'"{TRIALS[1]}"')


def _waiting(db: Path) -> None:  # the finished trial is held only as a copy waiting to run
    _sql(db, "UPDATE trials SET state = 'WAITING' WHERE trial_id IN (SELECT trial_id FROM "
             "trial_user_attributes WHERE key = ? AND value_json = ?)", ID_ATTR,
         f'"{TRIALS[1]}"')


@pytest.mark.parametrize(("damage", "says"), [
    (_delete, "it is missing"), (_truncate, "damaged or truncated"), (_empty, "it is empty"),
    (_garbage, "unreadable"), (_foreign, "not an Optuna storage"),
    (_older, f"it does not hold trial {TRIALS[1]}"), (_waiting, "waiting to run")])
def test_a_lost_or_damaged_optuna_storage_is_refused_and_nothing_is_trained_again(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None,
        damage: Any, says: str) -> None:
    run = _copy(finished, tmp_path)
    damage(run / layout.OPTUNA_DB)
    line = _refused_resume(run, capsys)
    assert line.startswith(STORAGE_LINE), line
    assert says in line, line
    assert "restore it from a copy" in line


# ---- 1. its neighbours ----------------------------------------------------------------------
@pytest.mark.parametrize(("rel", "how"), [
    (layout.RESULTS, "delete"), (layout.RESULTS, "truncate"), (layout.ATTEMPTS, "delete"),
    (layout.ATTEMPTS, "truncate"), (layout.SUMMARY, "delete"),
    (f"{layout.TRIALS}/{TRIALS[0]}/{layout.RESULT}", "delete"),
    (f"{layout.TRIALS}/{TRIALS[0]}/{layout.RESULT}", "truncate"),
    (f"{layout.TRIALS}/{TRIALS[0]}", "delete")])
def test_every_neighbouring_record_lost_or_truncated_is_refused_in_one_line(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None,
        rel: str, how: str) -> None:
    run = _copy(finished, tmp_path)
    target = run / rel
    if how == "delete":
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    line = _refused_resume(run, capsys)
    assert line.startswith(f"{PREFIX}RUN_DIR = '{rel}'"), line


def test_a_finished_trial_still_running_in_the_storage_is_accepted(
        finished: Path, tmp_path: Path) -> None:
    """``kill -9`` of the driver after a trial wrote its result: reconcile completes it, so
    the check lets it through (and counts it as not yet finished in the storage)."""
    run = _copy(finished, tmp_path)
    _sql(run / layout.OPTUNA_DB, "UPDATE trials SET state = 'RUNNING' WHERE trial_id IN "
         "(SELECT trial_id FROM trial_user_attributes WHERE key = ? AND value_json = ?)",
         ID_ATTR, f'"{TRIALS[1]}"')
    journal = run / f"{layout.OPTUNA_DB}-journal"
    assert not journal.exists()
    before = _snapshot(run)
    with RunDir.open(run, write=True) as opened:
        check_records(opened)
        check_storage(opened)
        assert finished_in_storage(opened) == {TRIALS[0]}
    assert _snapshot(run) == before and not journal.exists()


def test_a_run_stopped_before_its_storage_was_written_is_accepted(tmp_path: Path) -> None:
    with RunDir.create(tmp_path / "run", config_text="[training]\nepochs = 1\n") as run:
        check_storage(run)
        (run.path / layout.OPTUNA_DB).write_bytes(b"")  # created private, then killed
        check_storage(run)
        assert finished_in_storage(run) == set()


# ---- 2. inputs before code ------------------------------------------------------------------
FACTORY = '''\
from torch import nn


def make(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
'''
EVIL = '''\
from pathlib import Path

Path({marker!r}).write_text("imported")


def make(input_shape, num_classes):
    raise SystemExit(0)
'''


@pytest.mark.parametrize("where", ["another folder", "the same folder"])
def test_a_config_edited_to_name_other_code_is_refused_before_that_code_is_imported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ray: None, where: str) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "netdef.py").write_text(FACTORY)
    config = ("[training]\nepochs = 1\n[model]\nfactory = \"{factory}\"\n"
              "code_dir = \"{code_dir}\"\n")
    with RunDir.create(tmp_path / "run", config_text=config.format(
            factory="netdef:make", code_dir=code), inputs={"model_code": tree_sha256(code)}):
        pass
    marker = tmp_path / "marker"
    evil_dir = tmp_path / "evil" if where == "another folder" else code
    evil_dir.mkdir(exist_ok=True)
    (evil_dir / "evil_factory.py").write_text(EVIL.format(marker=str(marker)))
    with RunDir.open(tmp_path / "run", write=True) as run:  # the attacker redoes the hash
        (run.path / layout.CONFIG).write_text(config.format(factory="evil_factory:make",
                                                            code_dir=evil_dir))
        run.record([layout.CONFIG])
    line = _refused_resume(tmp_path / "run", capsys)
    assert line.startswith(f"{PREFIX}{layout.MANIFEST}.inputs.model_code = "), line
    assert not marker.exists()
    assert "evil_factory" not in __import__("sys").modules
