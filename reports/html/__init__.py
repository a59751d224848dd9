"""``dpsweep report RUN_DIR``: one self-contained HTML page plus every figure as PNG and its data
as CSV.

The page is built from the run directory's files only (results store, config.toml,
summary.json, each trial's history.json and audit.json), so it can be rebuilt at any time
without training. Images are embedded as data URIs and the CSS is inline: the HTML file alone
can be mailed to a reviewer. Everything is sorted and the PNGs carry no metadata, so a rebuild
from the same run gives byte-identical PNGs and CSVs, and the same HTML except the one line
holding the timestamp (``class="stamp"``).

What it says is what the numbers mean: fronts are of **validation** accuracy (what selection
reads) against peak MIA accuracy, with 95% intervals on both axes and ties kept
(``reports.pareto``); test accuracy is shown beside it, labelled as reported only; every value
computed on private data without noise carries "not covered by epsilon"
(``reports.store.not_covered``); every place that shows DP validity also shows "claim
contradicted by audit" and "replayable: not releasable" where they apply.

The modules, in the order the data flows: ``records`` reads and validates the run directory,
``fmt`` holds the HTML helpers and the flag texts every section shares, ``overview``,
``fronts``, ``attacks``, ``training`` and ``validity`` each build some sections with their
CSVs and figures, and ``page`` assembles the page. A name these modules share is public in the
module that defines it; what code outside ``reports.html`` may use is exported here.
"""

from __future__ import annotations

from dpsweep.reports.html.overview import tuning_statement
from dpsweep.reports.html.page import HTML_FILE, STAMP_CLASS, build_report
from dpsweep.reports.html.records import RunData, load_run

__all__ = [
           "HTML_FILE",
           "STAMP_CLASS",
           "RunData",
           "build_report",
           "load_run",
           "tuning_statement",
]
