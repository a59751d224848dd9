"""Ray Tune's overhead per trial, and throughput with 1 vs 2 concurrent 1-CPU trials.

Runs the same small DP-SGD sweep on digits (audit off, so a trial is pure training) twice:
max_concurrent_trials = 1 and 2. Overhead per trial = (sweep wall time at concurrency 1 -
budget precompute - summed training time) / trials, reported as a share of a trial's time.

Run: .venv/bin/python bench/sweep_overhead.py [--trials 6] [--epochs 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from orchestrator import results
from orchestrator.config import AuditConfig, Config, SweepConfig, TrainingConfig
from orchestrator.sweep import run_sweep


def sweep(*, trials: int, epochs: int, concurrent: int) -> tuple[float, float]:
    cfg = Config(training=TrainingConfig(epochs=epochs),
                 sweep=SweepConfig(methods=["dpsgd"], trials_per_method=trials,
                                   max_concurrent_trials=concurrent),
                 audit=AuditConfig(enabled=False))
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        run_sweep(cfg, run_dir=run, quiet=True)
        wall = time.perf_counter() - t0
        frame = results.read_results(run)
        assert (frame["status"] == "ok").all()
        return wall, float(frame["train_seconds"].sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=20)
    args = ap.parse_args()
    import ray

    # warm the budget cache and Ray's first start so both runs pay the same fixed costs
    sweep(trials=1, epochs=args.epochs, concurrent=1)
    ray.shutdown()
    out = {}
    for concurrent in (1, 2):
        wall, train = sweep(trials=args.trials, epochs=args.epochs, concurrent=concurrent)
        ray.shutdown()
        out[concurrent] = (wall, train)
        print(f"concurrency {concurrent}: {args.trials} trials in {wall:.1f} s "
              f"({60 * args.trials / wall:.1f} trials/min), summed training {train:.1f} s",
              flush=True)
    wall1, train1 = out[1]
    per_trial = wall1 / args.trials
    overhead = (wall1 - train1) / args.trials
    print(f"\nper trial at concurrency 1: {per_trial:.2f} s wall, {train1 / args.trials:.2f} s "
          f"training; Ray + trial setup overhead {overhead:.2f} s = "
          f"{100 * overhead / per_trial:.0f}% of a trial (includes Ray start-up amortised)")
    print(f"throughput 2 vs 1 concurrent trials: {out[1][0] / out[2][0]:.2f}x")


if __name__ == "__main__":
    main()
