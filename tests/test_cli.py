"""The command line: the budget command's numbers, bad input -> one line and exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main

BIN = Path(sys.executable).parent / "dpsweep"


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "orchestrator.cli"]
    return subprocess.run([*exe, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ}, timeout=300)


def test_budget_acceptance_numbers() -> None:
    r = _run("budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.004267",
             "--steps", "2344")
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines())
    sigma = float(lines["sigma (noise multiplier)"])
    upper = float(lines["epsilon upper"].split()[0])
    assert 0.690 <= sigma <= 0.705
    assert 2.97 <= upper <= 3.0
    assert lines["accountant"].strip().startswith("prv")
    lower = float(lines["epsilon lower"])
    estimate = float(lines["epsilon estimate"])
    assert lower <= estimate <= upper


def test_budget_from_batch_size_and_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["budget", "--epsilon", "2", "--delta", "1e-5", "--batch-size", "256",
                 "--dataset-size", "60000", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "steps:                    470" in out  # 2 * ceil(60000/256)
    assert "sample rate q:            0.00425532" in out  # 1/235


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--epsilon", "-1", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"],
         "--epsilon = -1.0"),
        (["--epsilon", "3", "--delta", "1.5", "--sample-rate", "0.01", "--steps", "10"],
         "--delta = 1.5"),
        (["--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0", "--steps", "10"],
         "--sample-rate = 0.0"),
        (["--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01"], "--steps/--epochs"),
        (["--epsilon", "3", "--delta", "1e-5", "--steps", "10"], "--batch-size/--dataset-size"),
        (["--epsilon", "3", "--delta", "0.1", "--batch-size", "10", "--dataset-size", "100",
          "--steps", "10"], "--delta = 0.1"),
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


def test_bad_input_exit_code_and_nothing_written(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[training]\nlearning_rate = 0.1\n")
    out = tmp_path / "out"
    r = _run("train", str(cfg), "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "dpsweep: error: training.learning_rate = 0.1 is not allowed: expected one of the keys "
        "['batch_size', 'clip_norm', 'epochs', 'lr', 'max_physical_batch', 'method', "
        "'momentum', 'preset', 'seed'] (unknown key)"]
    assert not out.exists()
    cfg.write_text("[data]\ndataset = 'imagenet'\n")
    r = _run("train", str(cfg), "--out", str(out))
    assert r.returncode == 2 and "data.dataset = 'imagenet'" in r.stderr
    assert not out.exists()


def test_data_dir_without_files_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[data]\ndataset = 'fashion-mnist'\ndata_dir = '{empty}'\n"
                   "[training]\nepochs = 1\n")
    out = tmp_path / "out"
    r = _run("train", str(cfg), "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert "data.data_dir" in r.stderr and str(empty) in r.stderr
    assert not out.exists()


def test_train_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    cfg = tmp_path / "c.toml"
    cfg.write_text("")
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"


def test_train_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[training]\nepochs = 2\nbatch_size = 60\n")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "test accuracy" in text and "dp_valid True" in text
    for name in ["config.toml", "budget.json", "checkpoints/privacy.json",
                 "checkpoints/history.json", "checkpoints/epoch_002/state.pt"]:
        assert (out / name).is_file(), name


def test_config_command_prints_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    assert "[privacy]" in capsys.readouterr().out


def test_console_script_installed() -> None:
    assert BIN.exists() or shutil.which("dpsweep"), "pip install -e . provides `dpsweep`"
