"""What a DP method declares about the per-step series it logs (its ``trajectories()``, stored
in the results store's ``trajectories`` column), so that the report draws them and sums them up
for whatever methods a run holds, without knowing any method by name.

A method sets ``report_series`` (``trainables.dp.contract.MethodContract``) to a
:class:`LoggedSeries`; the caller of ``reports.html.build_report`` collects the declarations
(``trainables.methods.report_series``), since the methods sit above reports. The report gives
each declaring method of the run a section: one figure of :class:`Panel` s, one line per trial
and logged key, a table of :class:`SummaryColumn` s per trial, and the values as a CSV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: How a line is drawn: ``held`` keeps each value until the next entry (a setting changed at
#: probes), ``main`` a plain line, ``faint`` a dotted light one (a raw signal beside its
#: smoothed one, left out of the legend).
LineStyle = Literal["held", "main", "faint"]
#: What a summary column shows of one series per trial: the value before its first entry
#: (its line's ``start`` column), the last entry, the range, or how many entries are set
#: (nonzero, not NaN).
Stat = Literal["start", "last", "range", "hits"]


@dataclass(frozen=True)
class SeriesLine:
    """One logged key drawn on a panel."""

    #: The key in the method's ``trajectories()``.
    key: str
    style: LineStyle = "main"
    #: The results-store column holding the value before the first entry, drawn at step 0
    #: ("" when the series has none).
    start: str = ""


@dataclass(frozen=True)
class Zone:
    """A band the method steers towards, centre ± radius, read from two of its parameters."""

    centre: str
    radius: str


@dataclass(frozen=True)
class Panel:
    """One axes of the figure: its title, its y label, its lines and an optional zone."""

    title: str
    ylabel: str
    lines: tuple[SeriesLine, ...]
    zone: Zone | None = None


@dataclass(frozen=True)
class SummaryColumn:
    """A column of the section's table: ``stat`` of the logged key ``key``."""

    key: str
    label: str
    stat: Stat
    digits: int = 4


@dataclass(frozen=True)
class LoggedSeries:
    """A method's per-step series as the report shows them."""

    #: Who the method is on the page ("WW-DP-SGD"): the section is "<label> trajectories".
    label: str
    #: The stem of the figure and its CSV (``<name>.png``, ``<name>.csv``) and the section's id.
    name: str
    #: What the figure shows, for its caption.
    caption: str
    panels: tuple[Panel, ...]
    columns: tuple[SummaryColumn, ...] = ()
    #: Why epsilon covers the values (they are computed from released outputs: post-
    #: processing), said under the figure; "" when it does not cover them.
    covered_note: str = ""
    #: The logged key holding each entry's step (entries count 1, 2, ... without it).
    step_key: str = "step"
    #: The table's heading for how many entries a trial logged.
    count_label: str = "entries"

    @property
    def keys(self) -> tuple[str, ...]:
        """Every logged key drawn, in panel order (the CSV's columns after the step)."""
        return tuple(line.key for panel in self.panels for line in panel.lines)
