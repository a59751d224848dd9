"""Assembling the report: every section and CSV built into a temporary directory, the page with
inline CSS and embedded figures, then an atomic swap into ``RUN_DIR/report``.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

import pandas as pd

from dpsweep.core import layout
from dpsweep.core.storage import atomic_write_text
from dpsweep.reports.html.attacks import (
    canary_frame,
    canary_section,
    heatmap_section,
    leakage_frame,
    leakage_section,
    mia_layers_frame,
    roc_section,
)
from dpsweep.reports.html.fmt import esc
from dpsweep.reports.html.fronts import (
    excluded_section,
    front_point_rows,
    front_section,
    hypervolume_frame,
    hypervolume_section,
    trials_frame,
)
from dpsweep.reports.html.overview import glance, header_section, tuning_statement
from dpsweep.reports.html.recommend import recommend_section
from dpsweep.reports.html.records import RunData, load_run, read_records
from dpsweep.reports.html.training import (
    curves_section,
    series_section,
    utility_frame,
    utility_section,
)
from dpsweep.reports.html.validity import (
    budget_frame,
    budget_section,
    coverage_frame,
    coverage_section,
    failed_frame,
    failed_section,
    pruned_frame,
    pruned_section,
    validity_frame,
    validity_section,
)
from dpsweep.reports.pareto import eligible, exclusions, fronts
from dpsweep.reports.series import LoggedSeries

HTML_FILE = "report.html"
#: The class of the one line a rebuild changes (the timestamp).
STAMP_CLASS = "stamp"


_CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;margin:20px auto;max-width:1320px;
color:#222;line-height:1.45;padding:0 18px}
h1{font-size:1.55em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;
margin-top:1.8em}h3{margin-bottom:.3em}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;margin:.6em 0;font-size:.84em}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600}table.facts th{white-space:nowrap;width:16em}
tbody tr:nth-child(even){background:#fafafa}
tr.bad{background:#fff0f0 !important}
.invalid{color:#fff;background:#b00020;border-radius:3px;padding:0 4px;font-size:.9em;
white-space:nowrap}
.replay{color:#5a3d00;background:#ffd27a;border-radius:3px;padding:0 4px;font-size:.9em;
white-space:nowrap}
.nc{color:#b00020;font-size:.78em;font-weight:normal;white-space:nowrap}
.ci{color:#666;font-size:.9em;white-space:nowrap}
.note{background:#fff8e1;border-left:4px solid #f0b400;padding:6px 10px}
.stamp{color:#777;font-size:.85em;margin-top:0}
.privacy{background:#eef4ff;border-left:4px solid #2a5db0;padding:4px 14px}
figure{margin:.6em 0}figure img{max-width:100%;border:1px solid #eee}
figure.wide img{max-width:none}
figcaption{color:#555;font-size:.85em}
nav{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #eee;
z-index:1;font-size:.9em}nav a{margin-right:11px;white-space:nowrap}
code{background:#f3f3f3;padding:0 3px}
details summary{cursor:pointer;color:#2a5db0}
.hp{display:inline-block;min-width:14em;max-width:22em;font-size:.86em;color:#333}
table.fronttable td:nth-child(4){white-space:nowrap}
ul.files{columns:4 14em;padding-left:1.2em}
.decision{background:#eefbea;border-left:4px solid #2e7d32;padding:4px 14px}
.decision .verdict{font-size:1.15em}
details.fold>summary{list-style:none}
details.fold>summary h2{display:inline-block;margin:.9em 0 .2em}
details.fold>summary::before{content:"▸ ";color:#2a5db0}
details.fold[open]>summary::before{content:"▾ "}
svg.front{max-width:100%;height:auto;border:1px solid #eee}svg.front .pt:hover{stroke-width:3}
svg.roc{max-width:100%;height:auto;border:1px solid #eee}
svg.roc .curve:hover .line{stroke-width:4}
.roclegend{columns:2 30em;font-size:.9em}
.roclegend .sw{display:block}
.legend .sw{margin-right:14px;white-space:nowrap;font-size:.9em}
.legend .sw i{display:inline-block;width:11px;height:11px;border-radius:6px;margin-right:4px}
"""


_SECTIONS = (("recommend", "Recommendation"), ("run", "Run"), ("tuning", "Privacy cost of tuning"),
             ("fronts", "Pareto fronts"), ("hypervolume", "Hypervolume"),
             ("excluded", "Kept off the fronts"), ("leakage", "Leakage per series"),
             ("heatmap", "Per-layer × attack MIA"), ("curves", "Validation curves"),
             ("utility", "Privacy-utility"), ("canary", "Epsilon lower bounds"),
             ("roc", "ROC"), ("budget", "Privacy budget"),
             ("validity", "DP validity and release safety"), ("pruned", "Pruned trials"),
             ("failed", "Failed trials"),
             ("coverage", "What epsilon covers"), ("files", "Files"))
#: The section the methods' own series follow (``reports.series``), one section per method.
_SERIES_AFTER = "roc"
#: The sections shown open: the decision and what it rests on; every later one is folded
#: (``<details>``), so the page opens on the choice rather than 16,000 px of evidence.
_OPEN = frozenset({"recommend", "run", "tuning", "fronts"})


def _section_names(declared: Mapping[str, LoggedSeries]) -> list[tuple[str, str]]:
    """Every section's id and title, in page order: the fixed ones, and after
    ``_SERIES_AFTER`` one per method of the run that declares logged series."""
    at = [key for key, _ in _SECTIONS].index(_SERIES_AFTER) + 1
    own = [(d.name, f"{d.label} trajectories") for _, d in sorted(declared.items())]
    return [*_SECTIONS[:at], *own, *_SECTIONS[at:]]


def _page(*, title: str, stamp: str, sections: dict[str, str],
          names: list[tuple[str, str]]) -> str:
    nav = " ".join(f'<a href="#{key}">{esc(name)}</a>' for key, name in names)
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
             f"<h1>{esc(title)}</h1>", f'<p class="{STAMP_CLASS}">{esc(stamp)}</p>',
             f"<nav>{nav}</nav>"]
    for key, name in names:
        cls = ' class="privacy"' if key == "tuning" else ""
        if key in _OPEN:
            parts.append(f'<section id="{key}"{cls}><h2>{esc(name)}</h2>\n{sections[key]}\n'
                         "</section>")
        else:
            parts.append(f'<details id="{key}" class="fold"><summary><h2>{esc(name)}</h2>'
                         f"</summary>\n{sections[key]}\n</details>")
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _write_csv(frame: pd.DataFrame, path: Path) -> Path:
    return atomic_write_text(path, frame.to_csv(index=False, lineterminator="\n"))


def build_report(run_dir: Path, *, num_classes: int | None = None,
                 prepared: Mapping[str, Collection[str]] | None = None,
                 series: Mapping[str, LoggedSeries] | None = None) -> Path:
    """Build ``run_dir/report/`` (HTML, PNGs, CSVs) from the run's files; return the HTML.

    Everything is read and validated first; the report is assembled in a temporary sibling
    directory and swapped in at the end, so bad input writes nothing and a failed build never
    leaves a half-written report or stale figures. ``num_classes`` overrides the dataset's;
    ``prepared`` (per method, its prepared parameters: ``trainables.methods.prepared_params``)
    keeps those out of the hyperparameter cells; ``series`` (per method, the per-step series it
    declares: ``trainables.methods.report_series``) gives each such method of the run its
    section.
    """
    data = load_run(Path(run_dir), num_classes=num_classes, prepared=prepared)
    run = data.run_dir
    final = run / layout.REPORT
    work = run / f".{layout.REPORT}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        _build_into(data, out=work, series=series or {})
        old = run / f".{layout.REPORT}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            os.replace(final, old)
        os.replace(work, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final / HTML_FILE


def _files_section(out: Path) -> str:
    """The list of what ``out`` holds (written last, so it names every figure and CSV)."""
    files = sorted([*(p.name for p in out.iterdir()), HTML_FILE])
    return ("<p>Written next to this page (the images above are embedded; each figure's data "
            "is the CSV of the same name):</p>" + '<ul class="files">'
            + "".join(f'<li><a href="{esc(f)}">{esc(f)}</a></li>' for f in files) + "</ul>")


def _build_into(data: RunData, *, out: Path, series: Mapping[str, LoggedSeries]) -> None:
    """Every figure and CSV into ``out``, then the page that embeds and lists them."""
    info = data.info
    pool = eligible(data.frame, validation_size=info.validation_size)
    front_list = fronts(data.frame, validation_size=info.validation_size,
                        num_classes=info.num_classes)
    excluded = exclusions(data.frame)
    records = read_records(data, trial_ids=(t for f in front_list for t in f.trial_ids))
    csvs: dict[str, pd.DataFrame] = {}
    sections = {
        "recommend": recommend_section(data),
        "run": header_section(data) + glance(data, front_list),
        "tuning": tuning_statement(summary=info.summary, trials=len(data.frame),
                                   config=info.config),
        "fronts": front_section(data, front_list=front_list, pool=pool, out=out, csvs=csvs),
        "hypervolume": hypervolume_section(front_list, num_classes=info.num_classes),
        "excluded": excluded_section(excluded),
    }
    leakage = leakage_frame(data)
    utility = utility_frame(data)
    canary = canary_frame(data)
    budget = budget_frame(data)
    validity = validity_frame(data)
    failed = failed_frame(data)
    pruned = pruned_frame(data)
    sections.update({
        "leakage": leakage_section(leakage),
        "heatmap": heatmap_section(data, front_list=front_list, out=out, csvs=csvs),
        "curves": curves_section(data, front_list=front_list, records=records, out=out,
                                 csvs=csvs),
        "utility": utility_section(data, utility, out=out, csvs=csvs),
        "canary": canary_section(canary),
        "roc": roc_section(data, front_list=front_list, records=records, out=out, csvs=csvs),
        "budget": budget_section(budget),
        "validity": validity_section(validity),
        "pruned": pruned_section(pruned, config=info.config),
        "failed": failed_section(failed),
        "coverage": coverage_section(),
    })
    csvs.update({
        "trials.csv": trials_frame(data, front_list, pool),
        "fronts.csv": front_point_rows(front_list),
        "hypervolume.csv": hypervolume_frame(front_list, num_classes=info.num_classes),
        "excluded.csv": excluded,
        "leakage.csv": leakage,
        "canary_bounds.csv": canary,
        "budget.csv": budget,
        "dp_validity.csv": validity,
        "failed_trials.csv": failed,
        "pruned_trials.csv": pruned,
        "mia_layers.csv": mia_layers_frame(data),
        "covered_by_epsilon.csv": coverage_frame(),
    })
    in_run = set(data.frame["method"])
    declared = {m: d for m, d in series.items() if m in in_run}
    sections.update({d.name: series_section(data, d, method=m, out=out, csvs=csvs)
                     for m, d in declared.items()})
    for name, frame in sorted(csvs.items()):
        _write_csv(frame, out / name)
    sections["files"] = _files_section(out)
    stamp = (f"Generated {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}"
             " from the run directory; rebuild with dpsweep report RUN_DIR.")
    title = f"dpsweep report: {data.run_dir.resolve().name}"
    atomic_write_text(out / HTML_FILE, _page(title=title, stamp=stamp, sections=sections,
                                             names=_section_names(declared)))
