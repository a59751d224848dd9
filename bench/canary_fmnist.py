"""One-run canary audits of DP-SGD on Fashion-MNIST: empirical epsilon lower bounds vs claims.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (arXiv 2305.08846). For
each target epsilon (default 1 and 3) the DP-SGD configuration below is planned at that
budget, then trained twice more: once with m white-box gradient canaries (one coordinate in
every layer, scored from the released noisy gradients), once with m black-box canaries
(mislabelled holdout examples scored by -loss); ``trainables.audit.canaries`` explains both.
Each run gives guesses r, correct v and the 95% lower bound; the acceptance is that every
white-box bound is below its claim (a sound implementation cannot exceed it except with
probability 5%).

Reduced so that each epsilon (two trainings) took about 10 minutes on one shared CPU thread
(the white-box run's subtraction of the data's expected gradient roughly doubles its part):
cnn28, 10,000 training examples (batch 256: q = 1/40, 40 steps per epoch), 12 epochs (480
steps), validation 1,000, test 2,000, holdout 5,000 (the black-box pool), shadow 1,000; lr 2,
C 0.5, delta 1e-5. Writes bench/results/canary_fmnist.json and prints a table.

Run from the repository root: ``.venv/bin/python -m bench.canary_fmnist [--epochs 12]``.
Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` (/usr/share/datasets/fashion-mnist).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dpsweep.core.storage import atomic_write_json
from dpsweep.orchestrator.config import (
    Config,
    DataConfig,
    ModelConfig,
    PrivacyConfig,
    ResourcesConfig,
    TrainingConfig,
)
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial import plan as trial_mod
from dpsweep.trainables.audit.canary_runs import CanaryRun, black_box_run, white_box_run
from dpsweep.trainables.training.loop import load_trial_data

RESULTS = Path(__file__).resolve().parent / "results" / "canary_fmnist.json"
CONFIDENCE = 0.95
DELTA = 1e-5
SIZES = {"train_size": 10_000, "validation_size": 1_000, "holdout_size": 5_000,
         "test_size": 2_000, "shadow_size": 1_000}


def config(args: argparse.Namespace, epsilon: float) -> Config:
    data = DataConfig(dataset="fashion-mnist", **{**SIZES, "train_size": args.train_size})
    return Config(data=data, model=ModelConfig(name="cnn28"),
                  privacy=PrivacyConfig(epsilon=epsilon, delta=DELTA),
                  training=TrainingConfig(method="dpsgd", epochs=args.epochs,
                                          batch_size=args.batch_size, seed=args.seed),
                  resources=ResourcesConfig(cpus_per_trial=1, device="cpu"),
                  method_params={"lr": args.lr, "clip_norm": args.clip_norm})


def summarize(run: CanaryRun) -> dict[str, Any]:
    bound = run.bound(confidence=CONFIDENCE)
    best = bound.best
    return {"kind": run.kind, "m": run.m, "in_canaries": int(sum(run.is_member)),
            "r": best.r, "v": best.v, "k_plus": best.k_plus, "k_minus": best.k_minus,
            "eps_lower_bound": bound.epsilon_lower, "confidence": CONFIDENCE,
            "claimed_epsilon": run.claimed_epsilon, "below_claim":
            bound.epsilon_lower < run.claimed_epsilon, "joins": run.joins,
            "dropped_joins": run.dropped_joins, "steps": run.steps,
            "test_accuracy": run.test_accuracy, "seconds": run.seconds,
            "candidates": bound.to_dict()["candidates"]}


def progress(label: str) -> Any:
    def report(metrics: dict[str, Any], _ckpt: Any) -> None:
        print(f"   {label} epoch {metrics['epoch']:>3}: val acc {metrics['val_accuracy']:.4f} "
              f"({metrics['epoch_seconds']:.1f} s)", flush=True)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--train-size", type=int, default=SIZES["train_size"])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2.0)
    ap.add_argument("--clip-norm", type=float, default=0.5)
    ap.add_argument("--canaries", type=int, default=1000, help="white-box m")
    ap.add_argument("--black-box-canaries", type=int, default=1000, help="black-box m "
                    f"(at most the holdout split, {SIZES['holdout_size']})")
    ap.add_argument("--seed", type=int, default=0, help="audit seed (canary coordinates, pool)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for epsilon in args.epsilons:
        cfg = config(args, epsilon)
        t0 = time.perf_counter()
        spec = trial_mod.plan_trial(check(cfg))
        cal = spec.calibration
        print(f"== epsilon {epsilon:g}: sigma {cal.noise_multiplier:.4f}, "
              f"q {cal.sample_rate:.6f}, steps {cal.steps}, "
              f"claim {cal.bounds.upper:.4f} ({cal.accountant}, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        data = load_trial_data(spec)
        white = white_box_run(spec, m=args.canaries, seed=args.seed, data=data,
                              report=progress("white-box"))
        black = black_box_run(spec, m=args.black_box_canaries, seed=args.seed, data=data,
                              report=progress("black-box"))
        for run in (white, black):
            row = {"target_epsilon": epsilon, "sigma": cal.noise_multiplier,
                   "sample_rate": cal.sample_rate, "accountant": cal.accountant,
                   **summarize(run)}
            rows.append(row)
            print(f"   {run.kind}: m {row['m']}, r {row['r']}, v {row['v']}, bound "
                  f"{row['eps_lower_bound']:.4f} vs claim {row['claimed_epsilon']:.4f}, "
                  f"{row['seconds']:.0f} s", flush=True)
    setup = {"dataset": "fashion-mnist", "model": "cnn28", "method": "dpsgd",
             "sizes": {**SIZES, "train_size": args.train_size}, "epochs": args.epochs,
             "batch_size": args.batch_size, "lr": args.lr, "clip_norm": args.clip_norm,
             "delta": DELTA, "threads": 1, "paper": "Steinke, Nasr & Jagielski, Privacy "
             "Auditing with One (1) Training Run, arXiv 2305.08846"}
    white_ok = all(r["below_claim"] for r in rows if r["kind"] == "white-box")
    atomic_write_json(args.out, {"setup": setup, "rows": rows,
                                 "acceptance": {"white_box_bounds_below_claims": white_ok}})
    header = (f"{'eps':>5} {'kind':>9} {'m':>5} {'r':>5} {'v':>5} {'k+':>4} {'k-':>4} "
              f"{'bound':>7} {'claim':>7} {'acc':>6} {'min':>5}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['target_epsilon']:>5g} {r['kind']:>9} {r['m']:>5} {r['r']:>5} {r['v']:>5} "
              f"{r['k_plus']:>4} {r['k_minus']:>4} {r['eps_lower_bound']:>7.4f} "
              f"{r['claimed_epsilon']:>7.4f} {r['test_accuracy']:>6.4f} "
              f"{r['seconds'] / 60:>5.1f}")
    print(f"\nacceptance (every white-box bound below its claim): {white_ok}; wrote {args.out}")
    return 0 if white_ok else 1


if __name__ == "__main__":
    sys.exit(main())
