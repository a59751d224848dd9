"""The report as a browser draws it (issue 43): headless Chromium loads the synthetic run's
report with a probe script appended, and the probe reports the point labels' boxes as laid out
and the recommended trial. No two labels may overlap, and the recommendation must be the trial
``reports.pick`` chooses at the stated bound.

Chromium is installed in CI (``make chromium``, called by ``.ci/run``); outside CI the test
skips when no chromium binary exists, in CI (``CI=true``) it fails.
"""

from __future__ import annotations

import html
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from bench.synthetic_run import make_run
from dpsweep.orchestrator.report import run_report
from dpsweep.reports.html import load_run
from dpsweep.reports.html.recommend import DECISION_CLASS
from dpsweep.reports.html.svgfront import LABEL_CLASS
from dpsweep.reports.pick import SUGGESTED_MAX_PEAK_MIA, choose

BINARIES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 120
#: Boxes may touch: anti-aliasing rounds edges by well under a pixel.
TOUCH_PX = 0.5
PROBE = f"""<script>
const labels = [...document.querySelectorAll("text.{LABEL_CLASS}")].map(e => {{
  const r = e.getBoundingClientRect();
  return [e.textContent, r.left, r.top, r.right, r.bottom];
}});
const chosen = document.getElementById("recommended");
const out = document.createElement("pre");
out.id = "probe";
out.textContent = JSON.stringify({{labels: labels, recommended: chosen && chosen.textContent,
  decisions: document.querySelectorAll(".{DECISION_CLASS}").length}});
document.body.appendChild(out);
</script>"""


def _chromium() -> str:
    found = next((path for name in BINARIES if (path := shutil.which(name))), None)
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("no chromium binary in CI: .ci/run installs it (make chromium)")
    pytest.skip("no chromium binary: `make chromium` (or apt-get install chromium) installs it")


def _probe(page: Path) -> dict:
    probed = page.with_name("probed.html")
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"),
                      encoding="utf-8")
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--no-first-run", f"--user-data-dir={profile}",
             "--window-size=1440,1000", "--dump-dom", probed.as_uri()],
            capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, flags=re.S)
    assert found, dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


def crowd(rows: list[dict]) -> None:
    """Every audited trial within a few thousandths of the others, as at epsilon 3 on the
    demo, where the labels used to cover each other."""
    audited = [r for r in rows if r.get("peak_mia_accuracy") is not None
               and r.get("val_accuracy") is not None]
    for i, row in enumerate(audited):
        row["val_accuracy"] = 0.80 + 0.004 * (i % 5)
        row["peak_mia_accuracy"] = 0.55 + 0.002 * (i % 7)
        row["peak_mia_upper"] = row["peak_mia_accuracy"] + 0.06


@pytest.mark.parametrize("hook", [None, crowd], ids=["synthetic", "crowded"])
def test_labels_never_overlap_and_the_recommendation_is_picks(tmp_path: Path,
                                                              hook: object) -> None:
    run = make_run(tmp_path, rows_hook=hook)
    probe = _probe(run_report(run))
    data = load_run(run)
    expected = choose(data.frame, validation_size=data.info.validation_size,
                      max_peak_mia=SUGGESTED_MAX_PEAK_MIA).trial_id
    assert probe["recommended"] == expected and probe["decisions"] == 1, probe
    labels = probe["labels"]
    assert len(labels) >= len(data.info.targets), labels  # a front at each target, labelled
    overlaps = [(a[0], b[0]) for a, b in itertools.combinations(labels, 2)
                if min(a[3], b[3]) - max(a[1], b[1]) > TOUCH_PX
                and min(a[4], b[4]) - max(a[2], b[2]) > TOUCH_PX]
    assert overlaps == [], overlaps
