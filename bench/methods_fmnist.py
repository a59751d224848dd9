"""All five methods on Fashion-MNIST at matched epsilon (1 and 3), 3 seeds: accuracy mean ± sd.

Each method runs in its sound default mode (with the DP-SGD learning rate and clipping norm
tuned for this setting, lr 2 / C 0.5 at batch 256; Adam lr 1e-3 for DP-AdamILG) and from its
paper preset; the faithful modes of LM-DP-SGD and DP-AdamILG run too, labelled "epsilon claim
invalid". Also prints LM-DP-SGD's per-layer risk vector (stage 1 error rates).

Run: .venv/bin/python bench/methods_fmnist.py [--epochs 10] [--seeds 3] [--eps 1 3]
       [--methods dpsgd lm_dpsgd ...] (about 45 minutes for the defaults on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from orchestrator.config import Config, DataConfig, PrivacyConfig, ResourcesConfig, TrainingConfig
from orchestrator.trial import load_data, plan_trial
from trainables.training import train_trial

SGD = {"lr": 2.0, "clip_norm": 0.5}
#: (label, method, preset, method_params, training overrides)
RUNS: list[tuple[str, str, str, dict, dict]] = [
    ("dpsgd", "dpsgd", "", {}, SGD),
    ("lm_dpsgd public", "lm_dpsgd", "", {}, SGD),
    ("lm_dpsgd paper", "lm_dpsgd", "paper", {}, {}),
    ("lm_dpsgd faithful [invalid]", "lm_dpsgd", "", {"mode": "faithful"}, SGD),
    ("ww_dpsgd", "ww_dpsgd", "", {}, SGD),
    ("ww_dpsgd paper", "ww_dpsgd", "paper", {}, {}),
    ("dp_adamilg public", "dp_adamilg", "", {}, {"lr": 1e-3, "clip_norm": 0.5}),
    ("dp_adamilg paper", "dp_adamilg", "paper", {}, {}),
    ("dp_adamilg faithful [invalid]", "dp_adamilg", "paper", {"mode": "faithful"}, {}),
    ("dpsgd_lf", "dpsgd_lf", "", {}, SGD),
    ("dpsgd_lf paper", "dpsgd_lf", "paper", {}, SGD),
]


def config(*, method: str, preset: str, params: dict, training: dict, epsilon: float,
           epochs: int, seed: int) -> Config:
    base = TrainingConfig(method=method, preset=preset, epochs=epochs, batch_size=256,
                          seed=seed, **training)
    return Config(data=DataConfig(dataset="fashion-mnist"),
                  privacy=PrivacyConfig(epsilon=epsilon, delta=1e-5), training=base,
                  resources=ResourcesConfig(cpus_per_trial=2), method_params=params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0])
    ap.add_argument("--methods", nargs="*", help="only these methods")
    args = ap.parse_args()
    torch.set_num_threads(2)
    data = load_data(Config(data=DataConfig(dataset="fashion-mnist")))
    sizes = {k: len(getattr(data, k)) for k in ("train", "holdout", "test", "shadow")}
    print(f"Fashion-MNIST splits {sizes}; cnn28 (tanh); batch 256; {args.epochs} epochs; "
          f"delta 1e-5; seeds 0..{args.seeds - 1}", flush=True)
    table: dict[tuple[str, float], list[float]] = {}
    start = time.time()
    for epsilon in args.eps:
        for label, method, preset, params, training in RUNS:
            if args.methods and method not in args.methods:
                continue
            accs = []
            for seed in range(args.seeds):
                cfg = config(method=method, preset=preset, params=params, training=training,
                             epsilon=epsilon, epochs=args.epochs, seed=seed)
                spec = plan_trial(cfg, data=data)
                result = train_trial(spec, data=data)
                accs.append(result.test_accuracy)
                risk = spec.method_params.get("risk")
                if risk is not None and seed == 0:
                    print(f"   LM risk vector (error rate per layer, seed 0): "
                          f"{dict(zip(['conv1', 'conv2', 'fc1', 'fc2'], risk, strict=True))}")
                print(f"   eps {epsilon:g} {label:<30} seed {seed}: acc "
                      f"{result.test_accuracy:.4f} (upper eps "
                      f"{result.privacy['epsilon_upper']:.3f}, sigma_0 "
                      f"{spec.calibration['schedule'][0]['noise_multiplier']:.3f}, "
                      f"lr {spec.lr:g}, C {spec.clip_norm:g}, {result.seconds:.0f} s, "
                      f"elapsed {time.time() - start:.0f} s)", flush=True)
            table[(label, epsilon)] = accs
    print("\nTest accuracy, mean ± sd over seeds")
    print(f"{'method':<32}" + "".join(f"{'eps ' + format(e, 'g'):>18}" for e in args.eps))
    for label, *_ in RUNS:
        cells = [table.get((label, e)) for e in args.eps]
        if all(c is None for c in cells):
            continue
        print(f"{label:<32}" + "".join(
            f"{statistics.mean(c):>10.4f} ± {statistics.pstdev(c):.4f}" if c else f"{'-':>18}"
            for c in cells))
    print(f"\ntotal wall time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
