"""Step time of every method as a ratio to a non-private SGD step (28x28 CNN, batch 256).

One process, every contender warmed up, then timed in interleaved rounds in a shuffled order
(so machine noise and cache effects hit all of them alike); medians. Opacus's own DP-SGD
(hooks mode) is measured beside ours.

Run: .venv/bin/python bench/step_time.py [--rounds 40] [--threads 2] [--batch 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainables.dp_step import NoisePhase
from trainables.methods import METHODS, get_method
from trainables.models import cnn28

# Sound defaults; lm_dpsgd gets a fixed risk vector (stage 1 runs once per sweep, not per step).
CONTENDERS: dict[str, tuple[str, dict]] = {
    "dpsgd": ("dpsgd", {}),
    "lm_dpsgd (public)": ("lm_dpsgd", {"risk": [0.45, 0.42, 0.38, 0.33]}),
    "ww_dpsgd": ("ww_dpsgd", {}),
    "dp_adamilg (public)": ("dp_adamilg", {}),
    "dpsgd_lf (before t_f)": ("dpsgd_lf", {"t_f_fraction": 1.0}),
    "dpsgd_lf (after t_f)": ("dpsgd_lf", {"t_f_fraction": 0.0}),
}


def _data(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        from trainables.data import load_splits

        d = load_splits(dataset="fashion-mnist", seed=0)
        return d.train.x[:batch], d.train.y[:batch], d.shadow.x, d.shadow.y
    except Exception:  # no Fashion-MNIST here: timing does not depend on pixel values
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,)),
                torch.randn(4096, 1, 28, 28, generator=g), torch.randint(0, 10, (4096,)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, y, px, py = _data(args.batch)
    steps: dict[str, Callable[[], object]] = {}

    torch.manual_seed(0)
    plain = cnn28()
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step() -> None:
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        sgd.step()

    steps["non-private SGD"] = plain_step

    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    torch.manual_seed(0)
    gsm = GradSampleModule(cnn28(), batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=args.batch)

    def opacus_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        opt.step()

    steps["opacus DP-SGD (hooks)"] = opacus_step

    for label, (name, params) in CONTENDERS.items():
        if name not in METHODS:
            print(f"(skipping {label}: method not available)")
            continue
        torch.manual_seed(0)
        method = get_method(name)(
            model=cnn28(), lr=0.1, clip_norm=1.0,
            noise_schedule=[NoisePhase(noise_multiplier=1.0, steps=10**7)],
            sample_rate=args.batch / 30000, expected_batch_size=float(args.batch),
            noise_generator=torch.Generator().manual_seed(0), steps_per_epoch=118,
            public_data=(px, py), public_generator=torch.Generator().manual_seed(1), **params)
        steps[label] = (lambda m=method: m.step(x, y))

    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps.items())
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)  # no contender always runs right after the same neighbour
        for label, fn in order:
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    base = statistics.median(times["non-private SGD"])
    ours = statistics.median(times["dpsgd"]) if "dpsgd" in times else float("nan")
    print(f"\ncnn28, batch {args.batch}, {args.threads} threads, {args.rounds} interleaved "
          f"rounds, medians")
    print(f"{'step':<26} {'ms':>8} {'x non-private':>14} {'x our dpsgd':>12}")
    for label, ts in times.items():
        med = statistics.median(ts)
        print(f"{label:<26} {med * 1000:>8.2f} {med / base:>14.2f} {med / ours:>12.2f}")


if __name__ == "__main__":
    main()
