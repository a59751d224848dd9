"""The command line: the budget command's numbers, the other commands end to end (train into a
run directory, config, version), bad input -> one line and exit 2, all in this process. The
installed script as a process is tests/contract/test_cli_process.py; the table of bad inputs over
every command tests/contract/test_bad_input.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dpsweep.orchestrator.cli import main


def test_budget_from_batch_size_and_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["budget", "--epsilon", "2", "--delta", "1e-5", "--batch-size", "256",
                 "--train-size", "60000", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "steps:                    470" in out  # 2 * ceil(60000/256)
    assert "sample rate q:            0.00425532" in out  # 1/235


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--epsilon", "-1", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"],
         "--epsilon (privacy.epsilon) = -1.0"),
        (["--epsilon", "3", "--delta", "1.5", "--sample-rate", "0.01", "--steps", "10"],
         "--delta (privacy.delta) = 1.5"),
        (["--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0", "--steps", "10"],
         "--sample-rate = 0.0"),
        (["--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01"], "--steps/--epochs"),
        (["--epsilon", "3", "--delta", "1e-5", "--steps", "10"], "--batch-size/--train-size"),
        (["--epsilon", "3", "--delta", "0.1", "--batch-size", "10", "--train-size", "100",
          "--steps", "10"], "--delta (privacy.delta) = 0.1"),
        (["--epsilon", "three", "--delta", "1e-5"], "invalid float value"),
    ],
)
def test_budget_bad_input(args: list[str], fragment: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) if "three" in args else _no_raise():
        rc = main(["budget", *args])
        assert rc == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_data_dir_without_files_is_refused(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[data]\ndataset = 'fashion-mnist'\ndata_dir = '{empty}'\n"
                   "[training]\nepochs = 1\n")
    out = tmp_path / "out"
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dpsweep: error: data.data_dir = '{empty}'")
    assert not out.exists() and list(empty.iterdir()) == []


def test_train_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"dpsweep: error: --out = '{out}'")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


def test_train_writes_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`dpsweep train` leaves a run directory like a sweep's: manifest, records, one row."""
    from dpsweep.orchestrator.rundir import RunDir
    from dpsweep.reports.store import read_results

    cfg = tmp_path / "c.toml"
    cfg.write_text("[training]\nepochs = 2\nbatch_size = 50\n[method_params]\nlr = 1.0\n")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "test accuracy" in text and "epsilon claim: valid" in text
    assert "REPLAYABLE" not in text  # secret randomness by default
    for name in ["config.toml", "manifest.json", "results.parquet",
                 "trials/trial-000/privacy.json", "trials/trial-000/history.json",
                 "trials/trial-000/spec.json", "trials/trial-000/checkpoint/state.pt"]:
        assert (out / name).is_file(), name
    run = RunDir.open(out, write=False)
    run.verify_all()  # every listed file is what dpsweep wrote
    assert {"config.toml", "results.parquet", "trials/trial-000/privacy.json",
            "trials/trial-000/checkpoint/state.pt"} <= set(run.manifest["files"])
    frame = read_results(out)
    assert list(frame["trial_id"]) == ["trial-000"] and frame.loc[0, "status"] == "ok"
    privacy = json.loads((out / "trials/trial-000/privacy.json").read_text())
    assert privacy["epsilon_upper"] <= privacy["target_epsilon"] == 3.0
    assert frame.loc[0, "epsilon_upper"] == privacy["epsilon_upper"]
    release = tmp_path / "release"
    assert main(["export", str(out), "--trial", "trial-000", "--out", str(release)]) == 0
    assert sorted(p.name for p in release.iterdir()) == sorted(
        ["weights.pt", "model.safetensors", "model.json", "load.py", "code",
         "privacy_statement.json", "privacy_statement.md"])


def test_train_holds_the_one_budget_target(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A part of a study sets budget.epsilons = [1]: `dpsweep train` of it trains at 1, not
    at privacy.epsilon's default 3 (which a sweep of the same file never reads)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[budget]\nepsilons = [1.0]\n[training]\nepochs = 1\nbatch_size = 50\n")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    assert "(target 1, delta 1e-05" in capsys.readouterr().out
    privacy = json.loads((out / "trials/trial-000/privacy.json").read_text())
    assert privacy["target_epsilon"] == 1.0
    assert 0.9 < privacy["epsilon_upper"] <= 1.0


def test_train_refuses_several_targets(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[budget]\nepsilons = [1.0, 3.0]\n[training]\nepochs = 1\n")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dpsweep: error: budget.epsilons = [1.0, 3.0] is not allowed: expected one "
                   "target for dpsweep train (it trains one model at one epsilon; `dpsweep "
                   "run` sweeps several)"]
    assert not out.exists()


def test_config_command_prints_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "[privacy]" in out and "[method_params]" in out
    assert "epsilon = 3.0" in out


def test_config_method_prints_the_declaration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--method", "ww_dpsgd"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ww_dpsgd: ") and "kappa" in out and "modes: standard (valid)" in out


def test_config_check_validates_and_finds_the_data(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[sweep]\nmethods = ['dpsgd', 'lm_dpsgd:lagged']\n")
    assert main(["config", "--check", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{cfg}: valid; digits data: bundled with scikit-learn")
    assert [p.name for p in tmp_path.iterdir()] == ["c.toml"]  # a check writes nothing


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from dpsweep.orchestrator import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"dpsweep {__version__}"


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpsweep: error: argument command")


# ---- issue 26: a full disk, an interrupt, the budget's flags: one line each ------------------
@pytest.mark.parametrize(("argv", "hint"), [
    (["run", "c.toml", "--out", "runs/full"], "`dpsweep resume runs/full`"),
    (["resume", "runs/full"], "`dpsweep resume runs/full`"),
    (["export", "runs/full", "--trial", "t", "--out", "rel"], "run the command again"),
])
def test_a_full_disk_is_one_line_with_what_to_do(argv: list[str], hint: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from dpsweep.orchestrator import cli
    from dpsweep.orchestrator.sweep import commands

    full = OSError(errno.ENOSPC, "No space left on device", "runs/full/optuna.db")
    try:
        raise RuntimeError("the store failed") from full
    except RuntimeError as wrapped:  # as a library wraps it
        error = wrapped
    command = {"run": "cmd_run", "resume": "cmd_resume", "export": "cmd_export"}[argv[0]]

    def fails(args: object, _module: object) -> int:
        if argv[0] == "run":
            commands.out_dir(args, stem="c")  # what cmd_run does first
        raise error

    monkeypatch.setattr(cli, command, fails)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text("")  # `run` validates its config before the command
    assert main(argv) == cli.EXIT_DISK_FULL == 74
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("dpsweep: error: could not write runs/full/optuna.db: the disk is "
                             "full; free some space")
    assert hint in err[0]


def test_sqlites_full_disk_is_recognised() -> None:
    from dpsweep.orchestrator.cli import disk_full

    wrapped = RuntimeError("(sqlite3.OperationalError) database or disk is full")
    assert disk_full(wrapped) is not None
    assert disk_full(RuntimeError("something else")) is None


def test_an_interrupted_calibration_says_interrupted_not_fallback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A PRV child stopped by Ctrl-C is the user's interrupt, never a reason to fall back."""
    import dpsweep.orchestrator.accounting.calibration as calibration
    from dpsweep.orchestrator.accounting.sandbox import ChildOutcome

    monkeypatch.setattr(calibration, "prv_in_child", lambda job, timeout: ChildOutcome(
        None, "the PRV accountant was stopped by an interrupt", transient=True,
        interrupted=True))
    rc = main(["budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01",
               "--steps", "100"])
    err = capsys.readouterr().err
    assert rc == 130 and err.strip() == "dpsweep: interrupted"
    assert "RDP" not in err


def test_budget_refuses_a_rate_too_small_to_sample_anyone(
        capsys: pytest.CaptureFixture[str]) -> None:
    """q x steps <= delta: epsilon is 0 without noise, there is no budget to match."""
    assert main(["budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "1e-8",
                 "--steps", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "dpsweep: error: --sample-rate = 1e-08 is not allowed: expected a number in (1e-07, 1]")


@pytest.mark.parametrize("out", ["", "a\nb", "x" * 300])
def test_out_of_a_bad_form_is_refused_before_anything(out: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text("")
    assert main(["run", "c.toml", "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpsweep: error: --out = ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_a_sweep_keeps_tunes_trial_tracebacks_off_the_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed worker's ActorDiedError is recorded as the trial's failure, not printed."""
    from dpsweep.orchestrator.sweep import commands
    from dpsweep.orchestrator.sweep.driver import SweepSummary

    monkeypatch.delenv(commands.TUNE_TRIAL_ERRORS_ENV, raising=False)
    done = SweepSummary(run_dir=Path("run"), rows=0, failed=0, seconds=0.0, report=None)
    assert commands.sweep(lambda: done) == 0
    assert os.environ[commands.TUNE_TRIAL_ERRORS_ENV] == "0"
