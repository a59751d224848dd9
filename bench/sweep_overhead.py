"""Ray Tune's overhead per trial, and the throughput of 2 concurrent 1-CPU trials vs 1.

Runs the real sweep driver (``orchestrator.sweep.driver.run_sweep``) on a DP-SGD-only sweep of
digits with the audit, the non-private baseline and the re-runs off, so a trial is pure training, at
``max_concurrent_trials`` 1 and 2, each in a fresh run directory, interleaved over ``--rounds``
(order shuffled each round, as ``bench.harness`` does, so a slow drift of a shared machine hits
both alike). Ratios are taken within one round and reported as medians over rounds.

Where the time goes, from the run's own records: each trial's ``result.json`` gives its in-trial
time (``seconds``: data and training inside the worker; ``train_seconds``: the epochs alone) and,
with the file's mtime, when the trial started and ended. The run directory records none of the
driver's own steps (``summary.json``'s ``wall_seconds`` starts after Ray is up and lumps the
budget precompute in with the trials), so those steps are timed by wrapping the driver's
functions with a clock, their behaviour unchanged: validation, Ray start, opening the studies,
budget precompute, the Tune experiment, the after-search phase with the report, Ray shutdown.

* Overhead per trial = (trials phase at concurrency 1 - summed in-trial time) / trials, the
  trials phase running from the first trial's start to the last one's end; at concurrency 1
  that is the idle time between one trial's end and the next one's start (Tune's scheduling,
  the searcher's ask and tell, the driver recording the result; its median is in the table),
  spread over the trials. Reported as a share of the median
  trial's in-trial time; target <= 10%. In-trial time includes what a trial does outside its
  epochs: reading the data and, in the first trial a worker process runs, that process's lazy
  imports (torch's optimizer pulls in ``torch._dynamo``, seconds on a busy machine); so the
  overhead is also given counted against training time alone, and the per-trial time outside
  the epochs is in the table.
* Throughput ratio = trials phase at concurrency 1 / at concurrency 2; target >= 1.7.
* The fixed costs outside the trials phase (Ray start, precompute, Tune's start-up and the
  first worker's imports, teardown, report) are reported separately: they are paid once per
  sweep, not per trial.

    .venv/bin/python -m bench.sweep_overhead [--rounds 3] [--trials 6] [--epochs 20] [--name N]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import load_average, write_results
from dpsweep.orchestrator.api import from_dict
from dpsweep.orchestrator.cluster import connection as cluster
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep import driver as sweep_mod

METHOD = "dpsgd"
DATASET = "digits"
CONCURRENCY = (1, 2)
#: Acceptance targets (the issue): Tune's overhead per trial and the 2-vs-1 throughput.
OVERHEAD_TARGET = 0.10
THROUGHPUT_TARGET = 1.7
SEED = 0
#: The warm-up sweep (not recorded): one short trial, to pay first imports and Ray's first
#: start in this process and the page cache before anything is timed.
WARMUP_TRIALS = 1
WARMUP_EPOCHS = 1
#: The driver's steps timed by wrapping them: (owner, attribute, phase name).
DRIVER_STEPS: tuple[tuple[Any, str, str], ...] = (
    (sweep_mod, "_validate_before_ray", "validate"),
    (cluster, "start_local", "ray_start"),
    (sweep_mod._Driver, "open_studies", "open_studies"),
    (sweep_mod, "precompute", "precompute"),
    (sweep_mod._Driver, "tune", "tune"),
    (sweep_mod._Driver, "finish", "after_search_and_report"),
    (cluster, "shutdown", "ray_shutdown"),
)


def sweep_config(*, trials: int, epochs: int, concurrent: int) -> Config:
    """The benchmark sweep, validated as a TOML file would be (``config.from_dict``)."""
    return from_dict({
        "data": {"dataset": DATASET},
        "training": {"epochs": epochs},
        "sweep": {"methods": [METHOD], "trials_per_method": trials,
                  "max_concurrent_trials": concurrent, "seeds": 0, "baseline": False},
        "audit": {"enabled": False},
    })


@contextmanager
def clocked(spans: dict[str, list[tuple[float, float]]]) -> Iterator[None]:
    """Record (start, end) wall-clock times of every call of the driver steps in ``spans``.

    Wall clock (``time.time``), not ``perf_counter``, so the spans line up with the trial
    records' file mtimes. The originals are restored afterwards.
    """
    saved = []
    for owner, attr, phase in DRIVER_STEPS:
        original = getattr(owner, attr)
        saved.append((owner, attr, original))

        def wrapper(*args: Any, _fn: Callable[..., Any] = original, _phase: str = phase,
                    **kwargs: Any) -> Any:
            began = time.time()
            try:
                return _fn(*args, **kwargs)
            finally:
                spans.setdefault(_phase, []).append((began, time.time()))

        setattr(owner, attr, functools.wraps(original)(wrapper))
    try:
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def trial_records(run: Path, *, expected: int) -> list[dict[str, Any]]:
    """Every trial's result.json with its start and end (wall clock); all must have finished."""
    failed = sorted(p.parent.name for p in run.glob("trials/*/error.json"))
    records = []
    for path in sorted(run.glob("trials/*/result.json")):
        record = json.loads(path.read_text())
        end = path.stat().st_mtime
        records.append({"trial_id": record["trial_id"], "seconds": float(record["seconds"]),
                        "train_seconds": float(record["train_seconds"]),
                        "start": end - float(record["seconds"]), "end": end})
    if failed or len(records) != expected:
        raise RuntimeError(f"{run}: {len(records)} of {expected} trials finished; "
                           f"failed: {failed or 'none'}")
    return records


def _span(spans: dict[str, list[tuple[float, float]]], phase: str) -> float:
    return sum(end - began for began, end in spans.get(phase, []))


def phases(spans: dict[str, list[tuple[float, float]]], records: list[dict[str, Any]], *,
           began: float, ended: float, concurrent: int) -> dict[str, float]:
    """One sweep split into the driver's steps and the trials phase (seconds)."""
    by_start = sorted(records, key=lambda r: r["start"])
    first, last = by_start[0]["start"], max(r["end"] for r in records)
    tune_began, tune_ended = spans["tune"][0]
    gaps = [b["start"] - a["end"] for a, b in itertools.pairwise(by_start)]
    out = {
        "wall_seconds": ended - began,
        **{f"{phase}_seconds": _span(spans, phase) for _, _, phase in DRIVER_STEPS},
        "tune_start_to_first_trial_seconds": first - tune_began,
        "trials_phase_seconds": last - first,
        "last_trial_to_tune_end_seconds": tune_ended - last,
        "in_trial_seconds_sum": sum(r["seconds"] for r in records),
        "train_seconds_sum": sum(r["train_seconds"] for r in records),
        "in_trial_seconds_median": statistics.median(r["seconds"] for r in records),
        "train_seconds_median": statistics.median(r["train_seconds"] for r in records),
        "outside_epochs_seconds_median": statistics.median(
            r["seconds"] - r["train_seconds"] for r in records),
        "outside_epochs_seconds_max": max(r["seconds"] - r["train_seconds"] for r in records),
        "trials": float(len(records)),
    }
    if concurrent == 1 and gaps:  # idle between one trial's end and the next one's start
        out["gap_seconds_median"] = statistics.median(gaps)  # (trials overlap otherwise)
    timed = sum(out[f"{phase}_seconds"] for _, _, phase in DRIVER_STEPS)
    out["other_seconds"] = out["wall_seconds"] - timed  # run directory, driver set-up, ...
    return out


def one_sweep(cfg: Config) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Run one sweep in a fresh run directory; its phases, and its trials (start and end in
    seconds after the ``run_sweep`` call)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        with clocked(spans):
            began = time.time()
            sweep_mod.run_sweep(check(cfg), run_dir=run, quiet=True)
            ended = time.time()
        records = trial_records(run, expected=cfg.sweep.trials_per_method)
    out = phases(spans, records, began=began, ended=ended,
                 concurrent=cfg.sweep.max_concurrent_trials)
    return out, [{**r, "start": r["start"] - began, "end": r["end"] - began} for r in records]


def derived(c1: dict[str, float], c2: dict[str, float]) -> dict[str, float]:
    """The round's headline numbers: overhead per trial (concurrency 1) and throughput."""
    trials = c1["trials"]
    overhead = (c1["trials_phase_seconds"] - c1["in_trial_seconds_sum"]) / trials
    overhead_vs_training = (c1["trials_phase_seconds"] - c1["train_seconds_sum"]) / trials
    fixed = c1["wall_seconds"] - c1["trials_phase_seconds"]
    return {
        "overhead_per_trial_seconds": overhead,
        "overhead_share": overhead / c1["in_trial_seconds_median"],
        "overhead_vs_training_per_trial_seconds": overhead_vs_training,
        "overhead_vs_training_share": overhead_vs_training / c1["train_seconds_median"],
        "fixed_seconds_per_sweep": fixed,
        "end_to_end_overhead_share": (c1["wall_seconds"] - c1["in_trial_seconds_sum"])
        / c1["in_trial_seconds_sum"],
        "throughput_ratio": c1["trials_phase_seconds"] / c2["trials_phase_seconds"],
        "end_to_end_throughput_ratio": c1["wall_seconds"] / c2["wall_seconds"],
    }


#: Table rows: (label, key in the phases).
TABLE = (
    ("wall (run_sweep call)", "wall_seconds"),
    ("  validation", "validate_seconds"),
    ("  Ray start", "ray_start_seconds"),
    ("  open studies", "open_studies_seconds"),
    ("  budget precompute", "precompute_seconds"),
    ("  Tune experiment", "tune_seconds"),
    ("    start -> 1st trial", "tune_start_to_first_trial_seconds"),
    ("    trials phase", "trials_phase_seconds"),
    ("    last trial -> end", "last_trial_to_tune_end_seconds"),
    ("  after search + report", "after_search_and_report_seconds"),
    ("  Ray shutdown", "ray_shutdown_seconds"),
    ("  other", "other_seconds"),
    ("sum of in-trial time", "in_trial_seconds_sum"),
    ("sum of training time", "train_seconds_sum"),
    ("median in-trial time", "in_trial_seconds_median"),
    ("median in-trial outside epochs", "outside_epochs_seconds_median"),
    ("max in-trial outside epochs", "outside_epochs_seconds_max"),
    ("median gap between trials", "gap_seconds_median"),
)


def format_table(medians: dict[int, dict[str, float]]) -> str:
    cols = sorted(medians)
    lines = [f"{'seconds (median over rounds)':<30}" + "".join(
        f"{f'concurrency {c}':>15}" for c in cols)]
    for label, key in TABLE:
        lines.append(f"{label:<30}" + "".join(
            f"{medians[c][key]:>15.2f}" if key in medians[c] else f"{'-':>15}" for c in cols))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (sweeps per "
                                                          "concurrency)")
    ap.add_argument("--trials", type=int, default=6, help="trials per sweep (>= 2)")
    ap.add_argument("--epochs", type=int, default=20,
                    help="epochs per trial (20 on digits: several seconds of training)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up sweeps")
    ap.add_argument("--name", default="sweep_overhead",
                    help="results file bench/results/NAME.json")
    args = ap.parse_args()
    if args.trials < max(CONCURRENCY) or args.rounds < 1:
        ap.error(f"need --trials >= {max(CONCURRENCY)} and --rounds >= 1")
    for _ in range(args.warmup):
        one_sweep(sweep_config(trials=WARMUP_TRIALS, epochs=WARMUP_EPOCHS, concurrent=1))
    configs = {c: sweep_config(trials=args.trials, epochs=args.epochs, concurrent=c)
               for c in CONCURRENCY}
    load = [load_average()]
    rounds: dict[int, list[dict[str, float]]] = {c: [] for c in CONCURRENCY}
    trials: dict[int, list[list[dict[str, Any]]]] = {c: [] for c in CONCURRENCY}
    order = list(CONCURRENCY)
    rng = random.Random(SEED)
    for index in range(args.rounds):
        rng.shuffle(order)
        for c in order:
            row, records = one_sweep(configs[c])
            rounds[c].append(row)
            trials[c].append(records)
            row = rounds[c][-1]
            print(f"round {index + 1}, concurrency {c}: wall {row['wall_seconds']:.1f} s, "
                  f"trials phase {row['trials_phase_seconds']:.1f} s, in-trial sum "
                  f"{row['in_trial_seconds_sum']:.1f} s", flush=True)
    load.append(load_average())
    per_round = [derived(a, b) for a, b in zip(rounds[1], rounds[2], strict=True)]
    headline = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    medians = {c: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
               for c, rows in rounds.items()}
    checks = {f"overhead <= {OVERHEAD_TARGET:.0%} of a trial":
              headline["overhead_share"] <= OVERHEAD_TARGET,
              f"throughput 2 vs 1 >= {THROUGHPUT_TARGET}":
              headline["throughput_ratio"] >= THROUGHPUT_TARGET}
    print(f"\n{METHOD} on {DATASET}, {args.trials} trials x {args.epochs} epochs, audit off; "
          f"{args.rounds} interleaved round(s); load average {load[0]:.1f} -> {load[1]:.1f}")
    print(format_table(medians))
    m1 = medians[1]
    print(f"\noverhead per trial (concurrency 1): {headline['overhead_per_trial_seconds']:.2f} s "
          f"= {headline['overhead_share']:.1%} of the median trial's in-trial time "
          f"({headline['overhead_vs_training_share']:.1%} counted against training alone, "
          f"which leaves out data loading inside the trial)")
    print(f"throughput 2 vs 1 concurrent trials: {headline['throughput_ratio']:.2f}x over the "
          f"trials phase, {headline['end_to_end_throughput_ratio']:.2f}x end to end")
    print(f"fixed costs per sweep (outside the trials phase): "
          f"{headline['fixed_seconds_per_sweep']:.1f} s: Ray start "
          f"{m1['ray_start_seconds']:.1f}, precompute {m1['precompute_seconds']:.1f}, Tune "
          f"start to first trial {m1['tune_start_to_first_trial_seconds']:.1f}, after search + "
          f"report {m1['after_search_and_report_seconds']:.1f}, Ray shutdown "
          f"{m1['ray_shutdown_seconds']:.1f}, the rest {m1['validate_seconds']:.1f} + "
          f"{m1['open_studies_seconds']:.1f} + {m1['last_trial_to_tune_end_seconds']:.1f} + "
          f"{m1['other_seconds']:.1f} (validation, studies, Tune teardown, other)")
    print("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in checks.items()))
    path = write_results(args.name, {
        "config": {"method": METHOD, "dataset": DATASET, "trials": args.trials,
                   "epochs": args.epochs, "rounds": args.rounds, "warmup": args.warmup,
                   "load_average_before_after": load},
        "rounds": {str(c): rows for c, rows in rounds.items()},
        "trials": {str(c): runs for c, runs in trials.items()},
        "per_round": per_round, "medians": {str(c): m for c, m in medians.items()},
        "headline": headline, "targets": checks})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
