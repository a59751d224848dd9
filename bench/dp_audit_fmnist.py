"""The per-layer audit of DP-SGD at epsilon 1 and 3 on Fashion-MNIST, against the claim.

Takes the DP-SGD study leaders (best validation accuracy) at each epsilon of a Fashion-MNIST run
(``configs/fmnist.toml``), audits each exactly as the after-sweep audit does (online references
trained like the trial with their own matched budgets, every signal and attack, per-layer probes),
in parallel processes, and checks every measured ROC point against the claimed epsilon
(``orchestrator.audit.membership.claim_check``). Nothing is written into the run directory. Writes
bench/results/dp_audit_fmnist.json.

    .venv/bin/python -m bench.dp_audit_fmnist [RUN_DIR] [--series dpsgd] [--epsilons 1 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import write_results
from dpsweep.core import layout


def _audit(run_dir: str, trial_id: str) -> dict[str, Any]:
    import torch

    from dpsweep.orchestrator.api import load_config as load
    from dpsweep.orchestrator.audit.membership import (
        AuditSettings,
        audit_trial_model,
        budgets_from_config,
        claim_check,
        reference_budgets,
    )
    from dpsweep.orchestrator.sweep.search import audit_settings
    from dpsweep.trainables.training.loop import load_spec, load_trial_data

    torch.set_num_threads(1)
    run = Path(run_dir)
    cfg = load(run / layout.CONFIG)
    raw = json.loads((run / layout.TRIALS / trial_id / layout.SPEC).read_text())
    spec = load_spec(raw)
    privacy = json.loads((run / layout.TRIALS / trial_id / layout.PRIVACY).read_text())
    data = load_trial_data(spec)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:  # a copy: the run directory stays untouched
        shutil.copytree(run / layout.CACHE, cache, dirs_exist_ok=True)
        budgets = reference_budgets(cfg, method=spec.method, params=raw["method_params"],
                                    epsilon=float(privacy["target_epsilon"]), data=data,
                                    cache_dir=Path(cache))
    checkpoint = run / layout.TRIALS / trial_id / layout.CHECKPOINT_DIR
    record = audit_trial_model(spec=spec, checkpoint=checkpoint,
                               data=data, settings=AuditSettings.from_config(
                                   {**audit_settings(cfg), "layer_probes": True}),
                               budgets=budgets_from_config(budgets))
    check = claim_check(record, epsilon=float(privacy["epsilon_upper"]),
                        delta=float(privacy["delta"]))
    table = [{k: e[k] for k in ("layer", "attack", "accuracy", "accuracy_ci", "auc", "auc_ci",
                                "tpr_at_1pct_fpr", "tpr_at_1pct_fpr_ci", "tpr_at_0.1pct_fpr",
                                "p_value", "p_corrected", "significant")}
             for e in record["attacks"]]
    return {"trial": trial_id, "epsilon_upper": float(privacy["epsilon_upper"]),
            "delta": float(privacy["delta"]), "claim_check": check,
            "leak_detected": record["leak_detected"], "leak_p_value": record["leak_p_value"],
            "peak_layer": record["peak_layer"], "peak_attack": record["peak_attack"],
            "peak_mia_accuracy": record["peak_mia_accuracy"],
            "peak_mia_upper": record["peak_mia_upper"],
            "peak_half_width": record["peak_half_width"],
            "n_candidates": record["n_candidates"], "mode": record["mode"],
            "n_references": record["n_references"],
            "reference_train_seconds": record["reference_train_seconds"],
            "scoring_seconds": record["scoring_seconds"],
            "seconds": time.perf_counter() - started, "table": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, nargs="?", default=Path("runs/fmnist"))
    parser.add_argument("--series", default="dpsgd")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    args = parser.parse_args()
    import pandas as pd

    frame = pd.read_parquet(args.run_dir / layout.RESULTS)
    ok = frame[(frame["status"] == "ok") & (frame["series"] == args.series)
               & (frame["repeat_of"].fillna("") == "")]
    leaders = [str(ok[ok["target_epsilon"] == eps].sort_values("val_accuracy")
                   .iloc[-1]["trial_id"]) for eps in args.epsilons]
    with ProcessPoolExecutor(max_workers=len(leaders)) as pool:
        rows = list(pool.map(_audit, [str(args.run_dir)] * len(leaders), leaders))
    for row in rows:
        c = row["claim_check"]
        print(f"{row['trial']}: claim epsilon {row['epsilon_upper']:.3f}; ROC points "
              f"{c['mia_roc_points']}, simultaneous lower bound {c['mia_epsilon_lower']:.3f}, "
              f"pointwise violations {c['mia_pointwise_violations']}; leak "
              f"{row['leak_detected']} (p {row['leak_p_value']:.3g}); peak "
              f"{row['peak_mia_accuracy']:.4f} [upper {row['peak_mia_upper']:.4f}] at "
              f"{row['peak_layer']} ({row['peak_attack']}); {row['n_candidates']} candidates, "
              f"{row['n_references']} {row['mode']} references, {row['seconds']:.0f} s")
        for e in sorted(row["table"], key=lambda e: -e["auc"])[:6]:
            print(f"    {e['layer']:8s} {e['attack']:28s} acc {e['accuracy']:.4f} "
                  f"auc {e['auc']:.4f} tpr@1% {e['tpr_at_1pct_fpr']:.4f} "
                  f"p_corr {e['p_corrected']:.3g}")
    print(f"wrote {write_results('dp_audit_fmnist', {'run_dir': str(args.run_dir), 'rows': rows})}")


if __name__ == "__main__":
    main()
