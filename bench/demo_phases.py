"""The demo's wall time and where it goes, with and without the reference-model audit.

Runs the embedded demo sweep (every method, 3 trials each, digits, epsilon 3) twice in fresh
run directories, once as shipped (in-trial audit with reference models) and once with the audit
off, and splits each into phases from the run's own records: Ray start and budget
precomputation (before the first trial starts), trials (training, and the audit's reference
training and scoring, summed over trials from result.json / audit.json), the after-search phase
and the report. Writes bench/results/demo_phases.json.

    .venv/bin/python -m bench.demo_phases [--rounds 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import write_results
from dpsweep.core import layout
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep.commands import demo_config
from dpsweep.orchestrator.sweep.driver import run_sweep


def _phases(run: Path, wall: float) -> dict[str, Any]:
    results = [json.loads(p.read_text()) for p in sorted(run.glob("trials/*/result.json"))]
    audits = [json.loads(p.read_text()) for p in sorted(run.glob("trials/*/audit.json"))]
    summary = json.loads((run / layout.SUMMARY).read_text())
    return {
        "wall_seconds": wall,
        "sweep_seconds": summary["wall_seconds"],
        "trials": len(results),
        "train_seconds_sum": sum(r.get("train_seconds", 0.0) for r in results),
        "trial_seconds_sum": sum(r.get("seconds", 0.0) for r in results),
        "reference_training_seconds_sum": sum(a["reference_train_seconds"] for a in audits),
        "scoring_seconds_sum": sum(a["scoring_seconds"] for a in audits),
        "useful_trials": sum(r.get("val_accuracy", 0.0) >= USEFUL for r in results
                             if r.get("trial_id") != "nonprivate"),
    }


#: Validation accuracy a demo trial must reach to count as useful (issue: >= 0.75 on digits).
USEFUL = 0.75


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant")
    args = parser.parse_args()
    base = demo_config()
    variants = {"with_audit": base,
                "without_audit": dataclasses.replace(
                    base, audit=dataclasses.replace(base.audit, enabled=False))}
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, cfg in variants.items():  # interleaved when rounds > 1
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(tmp) / "run"
                t0 = time.perf_counter()
                run_sweep(check(cfg), run_dir=run, quiet=True)
                out[name].append(_phases(run, time.perf_counter() - t0))
    table = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
             for name, rows in out.items()}
    for name, row in table.items():
        print(f"{name:>14}: wall {row['wall_seconds']:.0f} s, {row['trials']:.0f} trials, "
              f"useful {row['useful_trials']:.0f}, train {row['train_seconds_sum']:.0f} s, "
              f"reference training {row['reference_training_seconds_sum']:.0f} s, "
              f"scoring {row['scoring_seconds_sum']:.0f} s (sums over trials)")
    write_results("demo_phases", {"rounds": out, "medians": table})


if __name__ == "__main__":
    main()
