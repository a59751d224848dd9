"""Issue 43, items 1 and 2, end to end: a digits sweep run with stdout and stderr redirected to
a file shows each trial's epochs and audit phases, and ``dpsweep run --estimate`` projects its
wall time within 2x of the measured run (both timed back to back, under the same load)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.system.test_sweep_e2e import AUDITED

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent / "dpsweep"
TIMEOUT = 300
#: The acceptance's bound on estimate / measured, both ways.
WITHIN = 2.0
#: The end-to-end tests' audited sweep: two series, two trials each, audited in the trials.
CONFIG = AUDITED
TRIALS = ["dpsgd_eps3-000", "dpsgd_eps3-001", "lm_dpsgd-faithful_eps3-000",
          "lm_dpsgd-faithful_eps3-001"]
DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?")


def _seconds(text: str) -> float:
    match = DURATION.fullmatch(text)
    assert match is not None and text, text
    hours, minutes, seconds = (float(g or 0) for g in match.groups())
    return 3600 * hours + 60 * minutes + seconds


def test_a_redirected_sweep_shows_its_phases_and_the_estimate_holds(tmp_path: Path) -> None:
    config = tmp_path / "digits.toml"
    config.write_text(CONFIG)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    estimated = subprocess.run([str(BIN), "run", str(config), "--estimate"], env=env,
                               capture_output=True, text=True, timeout=TIMEOUT)
    assert estimated.returncode == 0, estimated.stderr
    assert not any(tmp_path.glob("runs*")) and not Path("runs", "digits").exists()
    projected = re.search(r"projected wall time: (\S+) with 2 trial\(s\) at once",
                          estimated.stdout)
    assert projected is not None, estimated.stdout
    assert "4 trials, 160 DP steps, 16 audit references" in estimated.stdout
    assert re.search(r"peak memory per trial: \d+ MiB", estimated.stdout)

    log = tmp_path / "sweep.log"
    started = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run([str(BIN), "run", str(config), "--out", str(tmp_path / "run")],
                            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT,
                            start_new_session=True).returncode
    measured = time.perf_counter() - started
    text = log.read_text()
    assert rc == 0, text
    for tid in TRIALS:  # each phase change of each trial has its line
        for phase in (r"training epoch 1/5, val accuracy 0\.\d{3}", r"audit reference 0/4",
                      r"audit scoring"):
            assert re.search(rf"^trial {tid}: {phase} \(ETA \S+\)$", text, re.M), (tid, text)
    ratio = _seconds(projected.group(1)) / measured
    assert 1 / WITHIN <= ratio <= WITHIN, (projected.group(0), measured)
