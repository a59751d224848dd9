"""DP-SGD on Fashion-MNIST (and digits) at a matched budget: the foundation's accuracy figure.

Run: .venv/bin/python bench/fmnist_dpsgd.py [--epsilon 3] [--epochs 20] [--skip-digits]
Prints split sizes, the calibrated sigma and epsilon bounds, per-epoch test accuracy, final
accuracy and wall time. Needs Debian's dataset-fashion-mnist (`make data`) or a network.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from orchestrator.config import Config, DataConfig, PrivacyConfig, TrainingConfig
from orchestrator.trial import load_data, plan_trial
from trainables.training import train_trial


def run(cfg: Config, label: str) -> float:
    data = load_data(cfg)
    t0 = time.perf_counter()
    spec = plan_trial(cfg)
    t_budget = time.perf_counter() - t0
    cal = spec.calibration
    sizes = {k: len(getattr(data, k)) for k in ("train", "holdout", "test", "shadow")}
    print(f"\n== {label}: {cfg.data.dataset}, model {cfg.model.name}, splits {sizes}")
    print(f"   epsilon {cfg.privacy.epsilon} delta {cfg.privacy.delta}: sigma "
          f"{cal['schedule'][0]['noise_multiplier']:.4f}, q {cal['sample_rate']:.6f}, "
          f"steps {sum(p['steps'] for p in cal['schedule'])}, upper eps "
          f"{cal['bounds']['upper']:.4f} ({cal['accountant']}, {t_budget:.1f} s)")
    print(f"   lr {cfg.training.lr} C {cfg.training.clip_norm} batch {cfg.training.batch_size} "
          f"momentum {cfg.training.momentum} epochs {cfg.training.epochs}")

    def progress(m: dict, _c: object) -> None:
        print(f"   epoch {m['epoch']:>3}: loss {m['train_loss']:.4f} test acc "
              f"{m['test_accuracy']:.4f} eps {m['epsilon_spent']:.3f} "
              f"({m['epoch_seconds']:.1f} s)", flush=True)

    result = train_trial(spec, data=data, report=progress)
    print(f"   RESULT {label}: test accuracy {result.test_accuracy:.4f}, "
          f"epsilon upper {result.privacy['epsilon_upper']:.4f}, wall {result.seconds:.1f} s")
    return result.test_accuracy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=2.0)
    ap.add_argument("--clip-norm", type=float, default=0.5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-digits", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    fm = Config(
        data=DataConfig(dataset="fashion-mnist"),
        privacy=PrivacyConfig(epsilon=args.epsilon, delta=1e-5),
        training=TrainingConfig(epochs=args.epochs, lr=args.lr, clip_norm=args.clip_norm,
                                batch_size=args.batch_size, momentum=args.momentum,
                                seed=args.seed),
    )
    fm = dataclasses.replace(fm, resources=dataclasses.replace(fm.resources, cpus_per_trial=2))
    run(fm, "fashion-mnist")
    if not args.skip_digits:
        dg = Config(privacy=PrivacyConfig(epsilon=args.epsilon, delta=1e-5))
        dg = dataclasses.replace(dg, resources=dataclasses.replace(dg.resources,
                                                                   cpus_per_trial=2))
        run(dg, "digits (demo defaults)")


if __name__ == "__main__":
    main()
