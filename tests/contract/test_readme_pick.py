"""The README's ``pick`` line (issue 43, item 5) uses the thresholds the report recommends at
and, run as written through the installed ``dpsweep`` script, selects a trial. The run is the
synthetic one (``bench/synthetic_run.py``, peak MIA upper bounds 0.53-0.73, the demo's
0.59-0.66 among them); on a real sweep at the demo's sizes the line picks too
(``tests/system/test_progress_estimate.py``)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench.synthetic_run import make_run
from dpsweep.reports.pick import SUGGESTED_MAX_PEAK_MIA

README = Path(__file__).resolve().parents[2] / "README.md"
BIN = Path(sys.executable).parent / "dpsweep"
TIMEOUT_S = 120


def readme_pick_args() -> list[str]:
    """The README's ``dpsweep pick RUN_DIR`` line's bracketed options that carry a number."""
    line = next(ln for ln in README.read_text().splitlines()
                if ln.strip().startswith("dpsweep pick RUN_DIR"))
    return [w for opt in re.findall(r"\[(--[a-z-]+ [0-9.]+)\]", line) for w in shlex.split(opt)]


def test_the_readme_pick_line_uses_the_reports_bound() -> None:
    args = readme_pick_args()
    assert args[args.index("--max-peak-mia") + 1] == f"{SUGGESTED_MAX_PEAK_MIA:g}", args


def test_the_readme_pick_line_selects_a_trial(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    done = subprocess.run([str(BIN), "pick", str(run), *readme_pick_args()],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.startswith("picked trial "), done.stderr
