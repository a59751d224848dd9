"""The report's at-a-glance line points to the recommendation (issue 43) and names every failed
audit (issue 41): a trial whose audit failed has no peak MIA accuracy, so it is on no front and
no pick although its model was kept; the line gives its id, the stored reason and the command
that audits it again. Built from the synthetic
run (``bench/synthetic_run.py``: t12's audit failed), without figures."""

from __future__ import annotations

import html
from pathlib import Path

from bench.synthetic_run import make_run
from dpsweep.reports.html import load_run
from dpsweep.reports.html.fmt import ids_text
from dpsweep.reports.html.overview import glance
from dpsweep.reports.html.validity import REAUDIT_COMMAND
from dpsweep.reports.pareto import KIND_VALID, fronts
from dpsweep.reports.pick import SUGGESTED_MAX_PEAK_MIA, choose

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


def test_the_glance_points_to_the_recommendation_instead_of_listing_front_ids(
        tmp_path: Path) -> None:
    """Issue 43: the line says which trial to deploy (the one the recommendation names, and
    ``reports.pick`` chooses) and links to it; the fronts are counted, their ids not repeated."""
    data = load_run(make_run(tmp_path))
    front_list = fronts(data.frame, validation_size=data.info.validation_size,
                        num_classes=data.info.num_classes)
    line = glance(data, front_list)
    chosen = choose(data.frame, validation_size=data.info.validation_size,
                    max_peak_mia=SUGGESTED_MAX_PEAK_MIA).trial_id
    assert f'Deploy <a href="#recommend"><b>{chosen}</b></a>' in line, line
    valid = [f for f in front_list if f.kind == KIND_VALID and len(f.trial_ids) > 1]
    assert valid and all(ids_text(list(f.trial_ids)) not in line for f in valid), line
    assert all(f"ε = {f.target_epsilon:g}: {len(f.trials)} trials" in line for f in valid), line


def test_the_glance_says_so_when_nothing_qualifies(tmp_path: Path) -> None:
    def leaky(rows: list[dict]) -> None:
        for row in rows:
            if row.get("peak_mia_upper") is not None:
                row["peak_mia_upper"] = 0.99

    line = glance(load_run(make_run(tmp_path, rows_hook=leaky)), [])
    assert "No trial to deploy" in line and "Deploy <a" not in line, line
