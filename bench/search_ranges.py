"""How much of each default search space learns: random points of every demo study, trained.

The demo's studies (every series at epsilon 3 on digits, the default config) are sampled
uniformly at random (Optuna's RandomSampler over the same distributions TPE searches, after each
study's enqueued paper preset), each point is trained with the real trial code (budget matched,
no Ray), and its validation accuracy is compared with USEFUL. Random points are the pessimistic
case: TPE concentrates on the part of the space that learns. Writes
bench/results/search_ranges.json; docs/search.md quotes it.

    .venv/bin/python -m bench.search_ranges [--points 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from bench.harness import write_results
from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.sweep.plans import study_plans
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.search_spaces import STEP
from dpsweep.trainables.training.loop import train_trial

#: Validation accuracy a digits trial must reach to count as useful (issue 14: >= 0.75).
USEFUL = 0.75


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=6, help="random points per study")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed")
    args = parser.parse_args()
    import optuna
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = Config()
    setup = check(cfg)
    data = setup.data_splits()
    rows: list[dict[str, Any]] = []
    for plan in study_plans(setup):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=args.seed),
                                    directions=["maximize"])
        points = [("preset", plan.space.first_point)]
        points += [("random", study.ask(plan.space.distributions).params)
                   for _ in range(args.points)]
        for kind, point in points:
            params = plan.space.decode(point)
            spec = plan_trial(setup, epsilon=plan.epsilon, method=plan.method,
                              params=params, data=data, trial_id="probe")
            started = time.perf_counter()
            result = train_trial(spec, data=data)
            row = {"series": plan.series, "kind": kind, "point": point,
                   "lr": params.get("lr"), "clip_norm": params.get("clip_norm"),
                   "step": point.get(STEP), "val_accuracy": result.val_accuracy,
                   "seconds": time.perf_counter() - started}
            rows.append(row)
            print(f"{plan.series:>20} {kind:>6} val {row['val_accuracy']:.3f} "
                  f"lr {row['lr'] or math.nan:.3g} C {row['clip_norm'] or math.nan:.3g} "
                  f"step {row['step'] or math.nan:.3g}", flush=True)
    by_series: dict[str, dict[str, Any]] = {}
    for row in rows:
        s = by_series.setdefault(row["series"], {"points": 0, "useful": 0, "failures": []})
        s["points"] += 1
        if row["val_accuracy"] >= USEFUL:
            s["useful"] += 1
        else:
            s["failures"].append({k: row[k] for k in ("kind", "point", "val_accuracy")})
    total = sum(s["points"] for s in by_series.values())
    useful = sum(s["useful"] for s in by_series.values())
    print(f"useful (val >= {USEFUL}): {useful}/{total} = {useful / total:.2f}")
    for name, s in by_series.items():
        print(f"  {name:>20}: {s['useful']}/{s['points']}")
    write_results("search_ranges", {"useful_threshold": USEFUL, "points_per_study": args.points,
                                    "seed": args.seed, "rows": rows, "by_series": by_series,
                                    "useful": useful, "total": total})


if __name__ == "__main__":
    main()
