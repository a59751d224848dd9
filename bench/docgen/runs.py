"""Generated tables of docs/benchmarks.md measured by whole runs: the CLI's cold start, the
demo's phases, Ray's overhead, a two-node cluster, kill -9 / resume and the chaos soak
(docs/operations.md).

Each table is built from one committed ``bench/results/<name>.json`` (written by
``bench.<name>``), so a figure on the page is always one a committed file holds; with several
rounds a table shows the median and the spread (min-max), never the best run.
``bench.docgen`` owns the blocks and checks them; this module only formats.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
ACCOUNTANT_TIME = "accountant_time"
DEMO_PHASES = "demo_phases"
SWEEP_OVERHEAD = "sweep_overhead"
TWO_NODE = "two_node"
FAULTS = "faults"
CHAOS = "chaos"
CHAOS_PRIVATE = "chaos_private"
#: The chaos soak's fault kinds, in the table's order (``bench.chaos.KINDS``).
CHAOS_KINDS = ("driver", "worker", "group")
#: What the budget command and a demo sweep must stay under (issue targets).
CLI_COLD_TARGET_S = 2.0
#: (entry, what it times) for the accounting table, in the page's order.
ACCOUNTANT_ROWS = (
    ("cli_cold", "`dpsweep budget --epsilon 3 --delta 1e-5 --sample-rate 0.004267 --steps "
                 "2344` in a fresh process"),
    ("cli_cached_cold", "the same question answered from a verified cache hit, fresh process"),
    ("python_bare", "a bare interpreter start"),
    ("import_numpy_scipy_special", "`import numpy, scipy.special`"),
    ("calibrate_constant", "`calibrate` (constant noise), in process"),
    ("calibrate_20_phases", "`calibrate` (20 noise phases), in process"),
    ("curve_constant_20", "epsilon after each of 20 epochs (constant noise)"),
    ("verify_constant", "the independent check of a cache hit (constant noise)"))
#: (label, key) of a demo run's phases, summed over its trials where it says so.
DEMO_ROWS = (("wall time, Ray start and report included", "wall_seconds"),
             ("the sweep (summary.json)", "sweep_seconds"),
             ("trials", "trials"),
             ("trials at validation accuracy >= 0.75", "useful_trials"),
             ("training, summed over trials", "train_seconds_sum"),
             ("reference models' training, summed", "reference_training_seconds_sum"),
             ("audit scoring, summed", "scoring_seconds_sum"))
COUNTS = frozenset({"trials", "useful_trials"})


def load_results(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def missing_results(name: str, module: str) -> str:
    return (f"Not measured: its results file (`{name}.json` in `bench/results/`) is not "
            f"committed; `.venv/bin/python -m bench.{module}` writes it.")


def _spread(values: Sequence[float], *, unit: str = " s", digits: int = 2) -> str:
    """Median, and min-max when there is more than one run."""
    median = f"{statistics.median(values):.{digits}f}{unit}"
    if len(values) < 2:
        return median
    return f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f}, {len(values)} runs)"


def accountant_table() -> str:
    """What privacy accounting costs, wall and CPU seconds (``bench.accountant_time``)."""
    run = load_results(ACCOUNTANT_TIME)
    if run is None:
        return missing_results(ACCOUNTANT_TIME, "accountant_time")
    entries = run["entries"]
    cal = entries["calibrations"]["constant"]
    lines = ["| what | wall: median (min-max) | CPU median |", "|---|---|---|"]
    for key, label in ACCOUNTANT_ROWS:
        e = entries[key]
        lines.append(f"| {label} | {_spread(e['wall_s'], digits=3)} | "
                     f"{e['cpu_median_s']:.3f} s |")
    cold = entries["cli_cold"]["wall_median_s"]
    return (f"{run['cpus']} CPUs, Python {run['python']}, load average "
            f"{run['load_average_start']:.1f} -> {run['load_average_end']:.1f} "
            f"(`bench/results/{ACCOUNTANT_TIME}.json`). The cold budget command: "
            f"{'met' if cold <= CLI_COLD_TARGET_S else '**not met**'} (<= "
            f"{CLI_COLD_TARGET_S:g} s); calibrated sigma {cal['noise_multiplier']:.4f}, upper "
            f"epsilon {cal['bounds']['upper']:.4f}.\n\n" + "\n".join(lines))


def demo_phases_table() -> str:
    """The demo's sweep with and without the in-trial audit (``bench.demo_phases``)."""
    run = load_results(DEMO_PHASES)
    if run is None:
        return missing_results(DEMO_PHASES, "demo_phases")
    variants = run["rounds"]
    lines = ["| | " + " | ".join(name.replace("_", " ") for name in variants) + " |",
             "|---|" + "---|" * len(variants)]
    for label, key in DEMO_ROWS:
        cells = []
        for rows in variants.values():
            values = [r[key] for r in rows]
            cells.append(_spread(values, unit="", digits=0) if key in COUNTS
                         else _spread(values, digits=1))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    rounds = len(next(iter(variants.values())))
    return (f"In-process `run_sweep` of the config `dpsweep demo` runs (`demo_config()`), "
            f"{rounds} round(s) per variant (`bench/results/{DEMO_PHASES}.json`)."
            "\n\n" + "\n".join(lines))


def sweep_overhead_table() -> str:
    """Ray's overhead per trial and 2 vs 1 concurrent trials (``bench.sweep_overhead``)."""
    run = load_results(SWEEP_OVERHEAD)
    if run is None:
        return missing_results(SWEEP_OVERHEAD, "sweep_overhead")
    c, per_round = run["config"], run["per_round"]

    def col(key: str, *, unit: str = " s", scale: float = 1.0, digits: int = 2) -> str:
        return _spread([r[key] * scale for r in per_round], unit=unit, digits=digits)

    targets = "; ".join(f"{k}: {'met' if ok else '**not met**'}"
                        for k, ok in run["targets"].items())
    lines = ["| overhead per trial (concurrency 1) | share of a trial | 2 vs 1 concurrent "
             "trials, trials phase | end to end | fixed cost per sweep | targets |",
             "|---|---|---|---|---|---|",
             f"| {col('overhead_per_trial_seconds')} | "
             f"{col('overhead_share', unit='%', scale=100, digits=1)} | "
             f"{col('throughput_ratio', unit='x')} | "
             f"{col('end_to_end_throughput_ratio', unit='x')} | "
             f"{col('fixed_seconds_per_sweep', digits=1)} | {targets} |"]
    load = c["load_average_before_after"]
    return (f"{c['method']} on {c['dataset']}, {c['trials']} trials x {c['epochs']} epochs, "
            f"audit off, {c['rounds']} interleaved round(s) of concurrency 1 and 2; load "
            f"average {load[0]:.1f} -> {load[1]:.1f} (`bench/results/{SWEEP_OVERHEAD}.json`)."
            "\n\n" + "\n".join(lines))


def cluster_and_faults_table() -> str:
    """A sweep on two Ray nodes (``bench.two_node``) and kill -9 / resume (``bench.faults``)."""
    lines = ["| what | measured | target |", "|---|---|---|"]
    nodes = load_results(TWO_NODE)
    if nodes is None:
        lines.append(f"| two-node Ray cluster | {missing_results(TWO_NODE, 'two_node')} | |")
    else:
        per_node = ", ".join(str(len(t)) for t in nodes["trials_by_node"].values())
        lines.append(
            f"| two-node Ray cluster (`bench/two_node.py`: head and second node as separate "
            f"processes, `dpsweep run --address`) | {nodes['nodes_used']} nodes ran trials "
            f"({per_node}); exit code {nodes['exit_code']}; sweep {nodes['sweep_wall_s']:.0f} s "
            f"| trials on both nodes: {'met' if nodes['nodes_used'] >= 2 else '**not met**'} |")
    faults = load_results(FAULTS)
    if faults is None:
        lines.append(f"| kill -9 and resume | {missing_results(FAULTS, 'faults')} | |")
    else:
        t = faults["totals"]
        lines.append(
            f"| kill -9 of the driver, then resume (`bench/faults.py`, {t['kills']} of "
            f"{t['kills_asked']} kills landed, {t['expected']} trials) | {len(t['redone'])} "
            f"redone, {len(t['lost'])} lost, {t['running_at_end']} RUNNING, "
            f"{t['leftover_processes']} processes left; {t['finished']} of {t['expected']} "
            f"finished in {t['seconds']:.0f} s | 0 / 0 / 0: "
            f"{'met' if faults['ok'] else '**not met**'} |")
    return "\n".join(lines)


def _chaos_cells(run: dict[str, Any]) -> list[str]:
    """One soak's column of the chaos table, in CHAOS_ROWS' order."""
    c = run["checks"]
    by_kind = " / ".join(str(run["faults_by_kind"].get(k, 0)) for k in CHAOS_KINDS)
    *before, last = run["exit_codes"]
    codes = ", ".join(f"{rc} x{n}" for rc, n in Counter(before).items())
    left = len(run["faults_not_injected"])
    private = run.get("private")
    if private is None:
        epsilon = "(adaptive tuning: no end-to-end bound)"
    else:
        before, after = (private[k]["end_to_end_epsilon"] for k in ("clean", "after"))
        same = private["equal"] and private["report_shows"] and private["printed_agree"]
        epsilon = (f"{before:.6f} / {after:.6f}; statement identical, report and stdout agree: "
                   f"{'yes' if same else '**no**'}; secret trial count unchanged: "
                   f"{'yes' if private['trial_count_unchanged'] else '**no**'}")
    load = run["load_average_before_after"]
    return [
        f"{by_kind} ({sum(run['faults_by_kind'].values())} of {len(run['schedule'])} planned"
        + ("; the sweep ended before the rest)" if left else ")"),
        f"{len(run['commands'])} commands, {run['resumes']} resumes; exit codes "
        + (f"{codes}, then {last}" if before else str(last)),
        f"{c['planned']} / {c['ok']} / {c['pruned']} / {c['failed']}",
        str(len(c["lost"])), str(len(run["trained_twice"])), str(len(c["running_left"])),
        "yes" if not c["store_mismatches"] and c["optuna_agrees"] else "**no**",
        f"exit {run['report_rc']}", epsilon,
        f"{run['wall_s']:.0f} s (load average {load[0]:.1f} -> {load[1]:.1f})",
        "met" if run["ok"] else "**not met**: " + "; ".join(run["problems"]),
    ]


#: The chaos table's rows, in the order of ``_chaos_cells``.
CHAOS_ROWS = ("faults injected (driver / worker / group kill -9)", "commands",
              "trials planned / finished / pruned / failed", "trials lost",
              "finished trials trained twice", "Optuna trials left RUNNING",
              "results store = trial records (and Optuna's states)", "`dpsweep report RUN_DIR`",
              "end-to-end epsilon: a clean run's plan / after the soak", "wall time",
              "nothing lost, trained twice or left RUNNING")


def chaos_table() -> str:
    """The chaos soak: kill -9 of the driver, a worker or the process group at seeded random
    moments, resumed to the end (``bench.chaos``), with ASHA and with private tuning."""
    soaks = {"ASHA pruning": load_results(CHAOS), "private tuning": load_results(CHAOS_PRIVATE)}
    missing = [missing_results(n, "chaos") for n, run in zip((CHAOS, CHAOS_PRIVATE), soaks.values(),
                                                       strict=True) if run is None]
    if len(missing) == len(soaks):
        return missing[0]
    columns = [_chaos_cells(run) if run is not None else ["not measured"] * len(CHAOS_ROWS)
               for run in soaks.values()]
    lines = ["| | " + " | ".join(f"{name} (`{file}.json`)" for name, file in
                                  zip(soaks, (CHAOS, CHAOS_PRIVATE), strict=True)) + " |",
             "|---|" + "---|" * len(soaks)]
    lines += [f"| {label} | " + " | ".join(col[i] for col in columns) + " |"
              for i, label in enumerate(CHAOS_ROWS)]
    seeds = sorted({run["seed"] for run in soaks.values() if run is not None})
    return (f"Seed {', '.join(map(str, seeds))}; every fault, command and check in "
            f"`bench/results/{CHAOS}.json` and `{CHAOS_PRIVATE}.json`."
            + "".join(f" {m}" for m in missing) + "\n\n" + "\n".join(lines))


GENERATORS = {"accounting_time": accountant_table, "demo_phases": demo_phases_table,
              "sweep_overhead": sweep_overhead_table,
              "cluster_and_faults": cluster_and_faults_table, "chaos": chaos_table}
