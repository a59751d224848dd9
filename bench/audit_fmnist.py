"""The membership audit on Fashion-MNIST: a leaky non-private cnn28 against DP-SGD at epsilon 1
and 3, per layer, and what the audit costs.

Run: .venv/bin/python bench/audit_fmnist.py [--dp-train 5000] [--epochs 20] [--shadows 2]
Prints, per model, each layer's attack accuracy with its 95% Wilson interval, AUC, TPR at 1% and
0.1% FPR, the loss-threshold baseline, then the audit's cost: shadow training against one target
training, attack fitting and evaluation as a share of one training. Needs Debian's
dataset-fashion-mnist (or a network); about 12 minutes on 2 shared CPU cores with the defaults.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from orchestrator.config import (
    Config,
    DataConfig,
    PrivacyConfig,
    ResourcesConfig,
    TrainingConfig,
)
from orchestrator.trial import load_data, plan_trial
from reports.audit import (
    NonPrivateRecipe,
    TrialAudit,
    audit_nonprivate,
    audit_trial,
)
from trainables.data import SplitSizes, load_splits
from trainables.training import train_trial


def print_audit(label: str, result: TrialAudit) -> None:
    attack = result.attack
    test_accuracy = result.target_test_accuracy or float("nan")
    print(f"\n== {label}: test accuracy {test_accuracy:.4f}; peak layer {attack.peak.name} "
          f"(index {attack.peak.index}); attack {attack.attack_kind} on {attack.features} "
          f"features, {attack.n_shadow_models} shadow(s)")
    print(f"   {'layer':6s} {'acc':>6s} {'95% CI':>15s} {'AUC':>6s} {'TPR@1%':>7s} "
          f"{'TPR@0.1%':>9s}  n")
    for m in (*attack.layers, attack.loss):
        star = "" if m.tpr_at_01pct_fpr_meaningful else "*"
        print(f"   {m.name:6s} {m.accuracy:6.3f} [{m.ci_low:.3f}, {m.ci_high:.3f}] "
              f"{m.auc:6.3f} {m.tpr_at_1pct_fpr:7.3f} {m.tpr_at_01pct_fpr:8.3f}{star:1s} "
              f"{m.n_members}+{m.n_nonmembers}")
    target = result.target_train_seconds or float("nan")
    shadows = result.shadow_train_seconds
    attack_s = attack.fit_seconds + attack.eval_seconds
    print(f"   cost: one target training {target:.1f} s; shadow training {shadows:.1f} s for "
          f"{len(result.shadows)} = {shadows / len(result.shadows) / target:.2f} x one training "
          f"each; attack fit {attack.fit_seconds:.1f} s + evaluation {attack.eval_seconds:.2f} s "
          f"= {100 * attack_s / target:.1f}% of one training; whole audit {result.seconds:.1f} s")
    print("   shadows: " + "; ".join(
        f"seed {s.seed}, {s.n_members}+{s.n_nonmembers}, test acc {s.test_accuracy:.3f}"
        + (f", sigma {s.noise_multiplier:.3f}, eps {s.epsilon_upper:.3f}"
           if s.noise_multiplier is not None else "")
        for s in result.shadows), flush=True)


def private(args: argparse.Namespace, epsilon: float) -> TrialAudit:
    """DP-SGD through the sweep's own path (plan_trial, train_trial) and the trial audit."""
    cfg = Config(
        data=DataConfig(dataset="fashion-mnist", train_size=args.dp_train,
                        holdout_size=args.dp_holdout, test_size=args.test,
                        shadow_size=args.shadow_pool),
        privacy=PrivacyConfig(epsilon=epsilon, delta=1e-5),
        training=TrainingConfig(epochs=args.epochs, lr=2.0, clip_norm=0.5, batch_size=256),
        resources=ResourcesConfig(cpus_per_trial=2),
    )
    data = load_data(cfg)
    spec = plan_trial(cfg, trial_id=f"dpsgd-eps{epsilon:g}", data=data)
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as tmp:
        root = Path(tmp)
        train_trial(spec, data=data, checkpoint_root=root)
        return audit_trial(root / f"epoch_{args.epochs:03d}", data=data,
                           shadow_models=args.shadows, seed=0, write_to=root)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaky-train", type=int, default=1000)
    ap.add_argument("--leaky-epochs", type=int, default=100)
    ap.add_argument("--dp-train", type=int, default=5000)
    ap.add_argument("--dp-holdout", type=int, default=5000)
    ap.add_argument("--shadow-pool", type=int, default=10000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--shadows", type=int, default=2)
    ap.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 3.0])
    args = ap.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    rows: list[tuple[str, TrialAudit]] = []

    sizes = SplitSizes(train=args.leaky_train, holdout=args.dp_holdout, test=args.test,
                       shadow=args.shadow_pool)
    data = load_splits(dataset="fashion-mnist", seed=0, sizes=sizes)
    recipe = NonPrivateRecipe(epochs=args.leaky_epochs, lr=1e-3, batch_size=64)
    result = audit_nonprivate(data, recipe=recipe, shadow_models=args.shadows, seed=0,
                              threads=2)
    label = f"non-private cnn28, {args.leaky_train} members, Adam {args.leaky_epochs} epochs"
    print_audit(label, result)
    rows.append(("non-private", result))

    for epsilon in args.epsilons:
        result = private(args, epsilon)
        label = (f"DP-SGD epsilon {epsilon:g}, {args.dp_train} members, "
                 f"{args.epochs} epochs")
        print_audit(label, result)
        rows.append((f"eps {epsilon:g}", result))

    names = [m.name for m in rows[0][1].attack.layers] + ["loss"]
    print("\n== attack accuracy per layer (95% interval half-width in the tables above)")
    print("   " + f"{'model':12s}" + "".join(f"{n:>8s}" for n in names))
    for label, result in rows:
        accs = [m.accuracy for m in (*result.attack.layers, result.attack.loss)]
        print("   " + f"{label:12s}" + "".join(f"{a:8.3f}" for a in accs))
    print(f"\ntotal wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
