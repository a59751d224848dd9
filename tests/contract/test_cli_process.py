"""The installed ``dpsweep`` script as a user runs it, in a process of its own: the budget
command's numbers, a bad config's one line, ``--version``, and the budget's flags at the edges
of the accountant's range (no absl chatter on stderr). In-process commands are
tests/unit/orchestrator/test_cli.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BIN = Path(sys.executable).parent / "dpsweep"


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "dpsweep.orchestrator.cli"]
    # PYTHONPATH: the code of this tree, whatever an (editable) install last mapped
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([*exe, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


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


def test_unknown_key_is_one_line_naming_field_value_and_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[training]\nlearning_rate = 0.1\n")
    out = tmp_path / "out"
    r = _run("train", str(cfg), "--out", str(out))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "dpsweep: error: training.learning_rate = 0.1 is not allowed: expected one of the keys "
        "['batch_size', 'epochs', 'max_physical_batch', 'method', 'preset', 'reproducible', "
        "'secure_mode', 'seed'] (unknown key)"]
    assert r.stdout == "" and not out.exists()


def test_console_script_installed() -> None:
    assert BIN.exists() or shutil.which("dpsweep"), "pip install -e . provides `dpsweep`"
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("dpsweep ")


def test_budget_with_a_tiny_sample_rate_names_the_flag_and_prints_nothing_else() -> None:
    r = _run("budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "1e-300",
             "--steps", "100")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "dpsweep: error: --sample-rate = 1e-300 is not allowed: expected a number in "
        "[1e-09, 1] (the accountant's range)"]


def test_budget_at_the_smallest_sample_rate_answers_without_absl_chatter() -> None:
    r = _run("budget", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "1e-9",
             "--steps", "100000", "--json")
    assert r.returncode == 0, r.stderr
    assert "absl" not in r.stderr and "rdp_privacy_accountant" not in r.stderr, r.stderr
    cal = json.loads(r.stdout)
    assert 0.99 * 3.0 <= cal["bounds"]["upper"] <= 3.0
