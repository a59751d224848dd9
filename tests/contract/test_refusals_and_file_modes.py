"""Reliability, round four (issue 35): what was silently adjusted or misplaced is refused in one
line, a run directory is its owner's alone on disk, and a private-tuning run records only the
keys it uses.

* ``audit.max_candidates`` above min(train_size, holdout_size), a release (``export --out``,
  ``pick --export``) inside the run directory and an empty ``--address`` are each refused with
  exit 2, one line naming the flag or key typed, nothing written, Ray never started;
* every folder of a run directory is 0700 and every file 0600 (``optuna.db``, ``.lock`` and
  ``.lock.json`` included), whatever the umask;
* a private-tuning run directory's ``config.toml`` leaves out ``sweep.seed`` and
  ``sweep.sampler`` (neither is used) and still loads back as the same run.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.toml import tomllib
from dpsweep.orchestrator import api
from dpsweep.orchestrator.cli import main
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.rundir import DIR_MODE, FILE_MODE, RunDir
from dpsweep.orchestrator.trial.single import train_single
from dpsweep.reports import store
from tests.conftest import tiny_config

TRIAL = "trial-000"  # orchestrator.trial.single.TRIAL_ID
PREFIX = "dpsweep: error: "
#: digits' default splits: train 500, holdout 300 (trainables.data.splits.DEFAULT_SIZES)
LARGEST_CANDIDATES = 300
TINY = "[training]\nepochs = 2\nbatch_size = 50\n[method_params]\nlr = 1.0\nclip_norm = 1.0\n"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release-safe single-trial run directory, written by ``dpsweep train``'s own code."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    train_single(check(tiny_config()), out=out)
    return out


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The common default umask, under which mkdir and SQLite make world-readable entries."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _copy(pristine: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(pristine, target, symlinks=True)
    return target


def _audited(pristine: Path, target: Path) -> Path:
    """A run copy whose trial carries audit results, so that ``pick`` can choose it."""
    run = _copy(pristine, target)
    frame = store.read_results(run)
    frame.loc[0, ["peak_mia_accuracy", "peak_mia_upper"]] = [0.55, 0.6]
    frame.loc[0, "val_accuracy"] = max(float(frame.loc[0, "val_accuracy"]), 0.9)
    frame.loc[0, "degenerate"] = False
    store.write_results(run, frame.to_dict("records"))
    with RunDir.open(run, write=True) as opened:
        opened.record([layout.RESULTS])
    return run


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the lock's bookkeeping left out)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (layout.LOCK, layout.LOCK_INFO)}


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *, names: str) -> str:
    """Run ``argv``; it must exit 2 with one line on stderr naming ``names``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"{PREFIX}{names} = "), err[0]
    return err[0]


def _no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command starts or joins Ray."""
    from dpsweep.orchestrator.cluster import connection as cluster

    def started(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster, "start_local", started)
    monkeypatch.setattr(cluster, "connect", started)


# ---- 4. refused: audit.max_candidates above what the splits allow -------------------------
@pytest.mark.parametrize("command", ["check", "run"])
def test_max_candidates_above_the_splits_is_refused_naming_the_key_and_the_largest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        command: str) -> None:
    _no_ray(monkeypatch)
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY + "[audit]\nmax_candidates = 100000\n")
    out = tmp_path / "out"
    argv = (["config", "--check", str(cfg)] if command == "check"
            else ["run", str(cfg), "--out", str(out)])
    line = _refused(capsys, argv, names="audit.max_candidates")
    assert "100000" in line and f"at most {LARGEST_CANDIDATES}" in line
    assert "train_size = 500" in line and "holdout_size = 300" in line
    assert not out.exists()


def test_max_candidates_up_to_the_splits_is_accepted() -> None:
    raw = {"training": {"epochs": 2, "batch_size": 50},
           "method_params": {"lr": 1.0, "clip_norm": 1.0}}
    for value in (0, 1, LARGEST_CANDIDATES):
        cfg = api.from_dict({**raw, "audit": {"max_candidates": value}})
        assert cfg.audit.max_candidates == value
    with pytest.raises(UserInputError, match=r"^audit\.max_candidates = 301 "):
        api.from_dict({**raw, "audit": {"max_candidates": LARGEST_CANDIDATES + 1}})


# ---- 4. refused: a release inside the run directory -------------------------------------
@pytest.mark.parametrize("where", ["inside", "itself", "nested", "dotdot", "symlink"])
def test_export_out_inside_the_run_directory_is_refused(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        where: str) -> None:
    run = _copy(pristine, tmp_path / "run")
    before = _snapshot(tmp_path)
    out = {"inside": run / "release", "itself": run, "nested": run / "trials" / "rel",
           "dotdot": tmp_path / "elsewhere" / ".." / "run" / "rel",
           "symlink": tmp_path / "link" / "rel"}[where]
    if where == "symlink":
        (tmp_path / "link").symlink_to(run / layout.TRIALS)
        before = _snapshot(tmp_path)
    line = _refused(capsys, ["export", str(run), "--trial", TRIAL, "--out", str(out)],
                    names="--out")
    assert "outside the run directory" in line
    assert _snapshot(tmp_path) == before


def test_export_out_beside_the_run_directory_is_still_accepted(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(pristine, tmp_path / "run")
    sibling = tmp_path / "run-release"  # shares the run's name as a prefix: not inside it
    assert main(["export", str(run), "--trial", TRIAL, "--out", str(sibling)]) == 0, \
        capsys.readouterr().err
    assert (sibling / "model.json").is_file()


@pytest.mark.parametrize("where", ["inside", "itself"])
def test_pick_export_inside_the_run_directory_is_refused_naming_export(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        where: str) -> None:
    run = _audited(pristine, tmp_path / "run")
    before = _snapshot(tmp_path)
    target = run / "release" if where == "inside" else run
    line = _refused(capsys, ["pick", str(run), "--export", str(target)], names="--export")
    assert "outside the run directory" in line
    assert _snapshot(tmp_path) == before
    assert not (run / "pick.toml").exists()


def test_pick_export_under_a_file_names_export_not_out(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _audited(pristine, tmp_path / "run")
    (tmp_path / "afile").write_text("x")
    before = _snapshot(tmp_path)
    line = _refused(capsys, ["pick", str(run), "--export", str(tmp_path / "afile" / "rel")],
                    names="--export")
    assert "--out" not in line
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["run", "train", "export"])
def test_nothing_new_is_written_inside_another_run_directory(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """A run, a trial or a release inside *another* run directory: refused naming --out."""
    _no_ray(monkeypatch)
    run = _copy(pristine, tmp_path / "run")
    other = _copy(pristine, tmp_path / "other")
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    before = _snapshot(tmp_path)
    out = other / "trials" / "nested"
    argv = {"run": ["run", str(cfg), "--out", str(out)],
            "train": ["train", str(cfg), "--out", str(out)],
            "export": ["export", str(run), "--trial", TRIAL, "--out", str(out)]}[command]
    line = _refused(capsys, argv, names="--out")
    assert f"outside the run directory {other.resolve()}" in line
    assert _snapshot(tmp_path) == before


def test_a_folder_with_another_programs_manifest_is_no_run_directory(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(pristine, tmp_path / "run")
    web = tmp_path / "web"
    web.mkdir()
    (web / layout.MANIFEST).write_text('{"name": "a web app", "format": "w3c"}')
    assert main(["export", str(run), "--trial", TRIAL, "--out", str(web / "rel")]) == 0, \
        capsys.readouterr().err


# ---- 4. refused: an empty --address ------------------------------------------------------
@pytest.mark.parametrize("address", ["", "  "])
@pytest.mark.parametrize("command", ["run", "resume"])
def test_an_empty_address_is_refused_before_ray(
        pristine: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, command: str, address: str) -> None:
    _no_ray(monkeypatch)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    run = _copy(pristine, tmp_path / "run")
    before = _snapshot(tmp_path)
    argv = (["run", str(cfg), "--out", str(tmp_path / "out"), "--address", address]
            if command == "run" else ["resume", str(run), "--address", address])
    line = _refused(capsys, argv, names="--address")
    assert "local Ray" in line
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists()


def test_the_api_refuses_an_empty_address_too(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:

    _no_ray(monkeypatch)
    cfg = api.from_dict({"training": {"epochs": 2, "batch_size": 50},
                                "method_params": {"lr": 1.0, "clip_norm": 1.0}})
    with pytest.raises(UserInputError, match=r"^address = ''"):
        api.run(cfg, out=tmp_path / "out", address="")
    with pytest.raises(UserInputError, match=r"^address = ''"):
        api.resume(tmp_path / "out", address="")
    assert not (tmp_path / "out").exists()


# ---- 5. least privilege on disk ----------------------------------------------------------
def _modes(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (itself included) whose mode is not DIR_MODE / FILE_MODE."""
    wrong = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        want = DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE
        if stat.S_IMODE(st.st_mode) != want:
            wrong[str(path.relative_to(root))] = oct(stat.S_IMODE(st.st_mode))
    return wrong


def test_dpsweep_train_writes_a_run_directory_only_its_owner_can_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], umask_022: None) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY)
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 0, capsys.readouterr().err
    names = {p.name for p in out.rglob("*")}
    assert {layout.LOCK, layout.CONFIG, layout.MANIFEST, layout.RESULTS} <= names
    assert any(p.is_dir() for p in out.rglob("*"))
    assert _modes(out) == {}


def test_a_sweep_run_directory_keeps_the_optuna_storage_and_lock_private(
        tmp_path: Path, umask_022: None) -> None:
    """The driver's own ``open_studies`` (Ray not needed) on a fresh run directory: optuna.db
    is 0600 from the moment it exists, and everything is 0700/0600 once the lock is released."""
    from dpsweep.orchestrator.sweep.driver import _Driver

    cfg = api.from_dict({"training": {"epochs": 2},
                                "sweep": {"methods": ["dpsgd"], "trials_per_method": 2},
                                "audit": {"enabled": False}})
    run = RunDir.create(tmp_path / "run", config_text=cfg.to_toml())
    try:
        assert stat.S_IMODE((run.path).stat().st_mode) == DIR_MODE
        assert stat.S_IMODE((run.path / layout.LOCK).stat().st_mode) == FILE_MODE
        driver = _Driver(check(cfg), run, quiet=True, attempts=[])
        studies, _ = driver.open_studies()
        assert studies
        assert stat.S_IMODE((run.path / layout.OPTUNA_DB).stat().st_mode) == FILE_MODE
        (run.path / layout.TRIALS / "t" / "sub").mkdir(parents=True)  # as Ray Tune would
        (run.path / layout.TRIALS / "t" / "sub" / "f").write_text("x")
    finally:
        run.release()
    assert (run.path / layout.OPTUNA_DB).is_file()
    assert _modes(run.path) == {}


def test_an_existing_empty_directory_given_as_the_run_directory_becomes_private(
        tmp_path: Path, umask_022: None) -> None:
    (tmp_path / "given").mkdir(mode=0o755)
    with RunDir.create(tmp_path / "given", config_text="") as run:
        assert stat.S_IMODE(run.path.stat().st_mode) == DIR_MODE
    assert _modes(tmp_path / "given") == {}


# ---- 7. record only what is used ---------------------------------------------------------
PRIVATE = {"training": {"epochs": 2, "batch_size": 50},
           "method_params": {"lr": 1.0, "clip_norm": 1.0},
           "sweep": {"methods": ["dpsgd"], "tuning": "private", "expected_trials": 2.0},
           "audit": {"in_trial": False}}


def test_a_private_tuning_run_records_neither_sweep_seed_nor_sampler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpsweep.orchestrator.sweep import driver

    cfg = api.from_dict(PRIVATE)
    monkeypatch.setattr(driver, "_validate_before_ray", lambda *_a, **_k: None)
    monkeypatch.setattr(driver, "_drive_and_release", lambda run, *_a, **_k: run.release())
    driver.run_sweep(check(cfg), run_dir=tmp_path / "run")
    text = (tmp_path / "run" / layout.CONFIG).read_text()
    recorded = tomllib.loads(text)
    assert "seed" not in recorded["sweep"] and "sampler" not in recorded["sweep"]
    assert recorded["sweep"]["tuning"] == "private"
    assert text.startswith("# sweep.tuning = 'private': sweep.seed and sweep.sampler are not")
    # loads back as the same run (resume reads it), the keys at their unused defaults
    again = api.load_config(tmp_path / "run" / layout.CONFIG)
    assert again.sweep.tuning == "private" and check(again).series() == check(cfg).series()
    assert again.privacy == cfg.privacy and again.training == cfg.training
    with RunDir.open(tmp_path / "run", write=False) as run:
        run.verify(layout.CONFIG)


def test_an_adaptive_run_still_records_its_sampler_and_seed() -> None:
    from dpsweep.orchestrator.sweep.tuning import recorded_config_text

    cfg = api.from_dict({**PRIVATE, "sweep": {"methods": ["dpsgd"], "seed": 7,
                                                     "sampler": "random"},
                                "audit": {}})
    recorded = tomllib.loads(recorded_config_text(cfg))
    assert recorded["sweep"]["seed"] == 7 and recorded["sweep"]["sampler"] == "random"


PRUNED_ID = "dpsgd_eps3-009"
PRUNED_AT = 2


def _with_a_pruned_trial(rows: list[dict[str, Any]]) -> None:
    rows.append(store.pruned_row(
        trial_id=PRUNED_ID, method="dpsgd", series="dpsgd", study="dpsgd@eps3",
        record={"pruned_at": PRUNED_AT, "epochs_run": PRUNED_AT, "val_accuracy": 0.2,
                "epsilon_spent": 1.1},
        spec={"seed": 9, "batch_size": 100, "calibration": {"target_epsilon": 3.0},
              "method_params": {"lr": 1.0, "clip_norm": 1.0}}))


@pytest.mark.parametrize("command", ["export", "audit"])
def test_a_pruned_trial_is_refused_as_pruned_not_as_failed_with_no_reason(
        tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.synthetic_run import make_run

    run = make_run(tmp_path, rows_hook=_with_a_pruned_trial)
    extra = ["--out", str(tmp_path / "release")] if command == "export" else []
    assert main([command, str(run), "--trial", PRUNED_ID, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"pruned at epoch {PRUNED_AT}" in err and "failed" not in err, err
    assert not (tmp_path / "release").exists()
