"""A run directory's HTML report as every command builds it: with what the methods declare
for it (their prepared parameters and the per-step series they log), so a sweep's end,
``dpsweep report`` and ``dpsweep reaudit`` draw the same page."""

from __future__ import annotations

from pathlib import Path

from dpsweep.reports.html import build_report
from dpsweep.trainables.methods import prepared_params, report_series


def run_report(run_dir: Path) -> Path:
    """Build (or rebuild) ``run_dir``'s report from its stored results; returns its path."""
    return build_report(Path(run_dir), prepared=prepared_params(), series=report_series())
