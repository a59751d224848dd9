"""The report's at-a-glance line names every failed audit (issue 41): a trial whose audit failed
has no peak MIA accuracy, so it is on no front and no pick although its model was kept; the line
gives its id, the stored reason and the command that audits it again. Built from the synthetic
run (``bench/synthetic_run.py``: t12's audit failed), without figures."""

from __future__ import annotations

import html
from pathlib import Path

from bench.synthetic_run import make_run
from dpsweep.reports.html import load_run
from dpsweep.reports.html.overview import glance
from dpsweep.reports.html.validity import REAUDIT_COMMAND

#: The synthetic run's failed audit.
FAILED = "<b>t12</b>: RuntimeError: shadow model diverged (train loss nan)"


def test_the_glance_names_each_failed_audit_with_its_reason(tmp_path: Path) -> None:
    line = html.unescape(glance(load_run(make_run(tmp_path)), []))
    assert f"<b>1 audit failed</b> ({FAILED}): that trial is on no front until " \
           f"<code>{REAUDIT_COMMAND}</code> audits it again (no training)." in line, line


def test_the_glance_says_nothing_of_audits_when_none_failed(tmp_path: Path) -> None:
    def audited(rows: list[dict]) -> None:
        for row in rows:
            row["audit_error"] = ""

    line = glance(load_run(make_run(tmp_path, rows_hook=audited)), [])
    assert "audit failed" not in line and "reaudit" not in line, line
