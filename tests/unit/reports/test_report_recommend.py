"""The report's recommendation (issue 43) is ``reports.pick``'s choice at the stated threshold,
for the whole run and per series; when nothing qualifies it says the smallest threshold that
admits a trial. Built from the synthetic run (``bench/synthetic_run.py``), without figures."""

from __future__ import annotations

import html
from pathlib import Path

from bench.synthetic_run import make_run
from dpsweep.reports.html import load_run
from dpsweep.reports.html.recommend import recommend_section
from dpsweep.reports.pareto import MIA_UPPER
from dpsweep.reports.pick import SUGGESTED_MAX_PEAK_MIA, choose


def test_the_recommendation_is_picks_choice_for_the_run_and_each_series(
        tmp_path: Path) -> None:
    data = load_run(make_run(tmp_path))
    text = html.unescape(recommend_section(data))
    whole = choose(data.frame, validation_size=data.info.validation_size,
                   max_peak_mia=SUGGESTED_MAX_PEAK_MIA)
    assert f'Release <b id="recommended">{whole.trial_id}</b>' in text, text
    assert f"--max-peak-mia {SUGGESTED_MAX_PEAK_MIA:g} --export RELEASE_DIR" in text
    rows = text.split("Per series")[1]
    for series in ("dpsgd", "dpsgd_lf", "ww_dpsgd"):
        chosen = choose(data.frame, validation_size=data.info.validation_size,
                        max_peak_mia=SUGGESTED_MAX_PEAK_MIA, series=series).trial_id
        assert f"<td>{series}</td><td><b>{chosen}</b>" in rows, (series, chosen)


def test_with_nothing_under_the_bound_it_says_what_to_relax(tmp_path: Path) -> None:
    def leaky(rows: list[dict]) -> None:
        for row in rows:
            if row.get(MIA_UPPER) is not None:
                row[MIA_UPPER] = max(float(row[MIA_UPPER]), SUGGESTED_MAX_PEAK_MIA + 0.05)

    data = load_run(make_run(tmp_path, rows_hook=leaky))
    text = html.unescape(recommend_section(data))
    assert "No trial qualifies" in text and 'id="recommended"' not in text, text
    lowest = SUGGESTED_MAX_PEAK_MIA + 0.05
    assert f"<code>--max-peak-mia {lowest:.2f}</code> admits a trial" in text, text
