"""DP-SGD step time and peak memory as ratios to a non-private SGD step, per model.

Entries per model (same model, data, batch and thread count; timed in interleaved shuffled
rounds by ``bench.harness``): a non-private SGD step; our DP-SGD step on the book-keeping
engine (``trainables/engine.py``: per-layer norms, flat clipping coefficient min(1, C/||g_i||),
one weighted sum, Gaussian noise, SGD update); the same step on the ``torch.func`` vmap path;
Opacus's hooks (``GradSampleModule`` + ``DPOptimizer``) and Opacus's ghost clipping
(``grad_sample_mode="ghost"``: ``GradSampleModuleFastGradientClipping`` +
``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping``). Peak memory of each
entry comes from a fresh subprocess (see ``bench/harness.py``). Inputs are random tensors: step
time does not depend on pixel values. Results: ``bench/results/step_time.json``.

Run from the repository root: ``.venv/bin/python -m bench.step_time [--quick] [--models ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import (
    format_table,
    interleaved,
    load_average,
    peak_memory,
    summarize,
    wait_for_quiet,
    write_results,
)
from trainables.engine import GradEngine
from trainables.models import build_model

NUM_CLASSES = 10
LR = 0.1
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
NORM_EPS = 1e-6
SEED = 0
QUIET_TIMEOUT_S = 600
BASELINE = "non-private"
ENGINE = "engine DP-SGD"
ENTRIES = (BASELINE, ENGINE, "vmap DP-SGD", "opacus hooks", "opacus ghost")
OPACUS = ("opacus hooks", "opacus ghost")
#: The engine with one algorithm forced on every Linear / Conv2d (``--strategies``).
FORCED = ("engine ghost", "engine materialize")


@dataclass(frozen=True)
class Config:
    """One model's benchmark: input shape, batch, threads, rounds (full / quick)."""

    model: str
    shape: tuple[int, int, int]
    batch: int
    threads: int
    rounds: int
    quick_rounds: int
    #: Upper bound on engine / non-private time (None: no target for this model).
    time_target: float | None
    #: Upper bound on engine / non-private peak memory (None: no target).
    memory_target: float | None = None


CONFIGS = {
    "cnn28": Config("cnn28", (1, 28, 28), 256, 1, 20, 5, 1.6),
    "cnn5": Config("cnn5", (3, 32, 32), 256, 2, 10, 3, None),
    "resnet20_gn": Config("resnet20_gn", (3, 32, 32), 128, 2, 6, 2, 2.0),
    "wrn16_4": Config("wrn16_4", (3, 32, 32), 64, 2, 4, 1, 2.0, 1.5),
}


def _data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(cfg.batch, *cfg.shape, generator=g),
            torch.randint(0, NUM_CLASSES, (cfg.batch,), generator=g))


def _model(cfg: Config) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model(name=cfg.model, input_shape=cfg.shape, num_classes=NUM_CLASSES,
                       activation="relu" if cfg.model in ("resnet20_gn", "wrn16_4") else "tanh")


def _ours(cfg: Config, strategy: str) -> Callable[[], None]:
    """DP-SGD as ``DPStep`` does it, on the engine: norms, clip coefficients, one sum, noise."""
    x, y = _data(cfg)
    model = _model(cfg)
    engine = GradEngine(model, strategy=strategy, max_physical_batch=cfg.batch)
    live = [True] * engine.num_layers
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    noise = torch.Generator().manual_seed(SEED + 1)
    params = dict(model.named_parameters())

    def step() -> None:
        view = engine.compute(x, y, live=live)
        total = view.norms.pow(2).sum(dim=1).sqrt()
        factor = (CLIP_NORM / (total + NORM_EPS)).clamp(max=1.0)
        summed = view.weighted_sum(factor.unsqueeze(1).expand(-1, engine.num_layers))
        std = NOISE_MULTIPLIER * CLIP_NORM
        for n, p in params.items():
            noisy = summed[n] + std * torch.randn(p.shape, generator=noise, dtype=p.dtype)
            p.grad = noisy / cfg.batch
        opt.step()

    return step


def _plain(cfg: Config) -> Callable[[], None]:
    x, y = _data(cfg)
    model = _model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _opacus_hooks(cfg: Config) -> Callable[[], None]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    x, y = _data(cfg)
    gsm = GradSampleModule(_model(cfg), batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=NOISE_MULTIPLIER,
                      max_grad_norm=CLIP_NORM, expected_batch_size=cfg.batch)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        opt.step()

    return step


def _opacus_ghost(cfg: Config) -> Callable[[], None]:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    x, y = _data(cfg)
    gsm = GradSampleModuleFastGradientClipping(_model(cfg), batch_first=True,
                                               loss_reduction="mean", max_grad_norm=CLIP_NORM,
                                               use_ghost_clipping=True)
    opt = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gsm.parameters(), lr=LR), noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=CLIP_NORM, expected_batch_size=cfg.batch, loss_reduction="mean")
    criterion = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(),
                                           loss_reduction="mean")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        criterion(gsm(x), y).backward()
        opt.step()

    return step


def make_step(*, model: str, entry: str) -> Callable[[], None]:
    """The step callable of one entry (module-level, so a memory subprocess can build it)."""
    cfg = CONFIGS[model]
    if entry == BASELINE:
        return _plain(cfg)
    if entry == ENGINE:
        return _ours(cfg, "auto")
    if entry.startswith("engine "):  # "engine ghost" / "engine materialize"
        return _ours(cfg, entry.split()[1])
    if entry == "vmap DP-SGD":
        return _ours(cfg, "vmap")
    if entry == "opacus hooks":
        return _opacus_hooks(cfg)
    if entry == "opacus ghost":
        return _opacus_ghost(cfg)
    raise ValueError(f"unknown entry {entry!r}")


def bench_model(cfg: Config, *, quick: bool, entries: list[str], memory: bool,
                rounds: int | None = None, max_load: float | None = None) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    plan = GradEngine(_model(cfg)).plan(_data(cfg)[0])
    print(f"\n== {cfg.model}: {cfg.shape}, batch {cfg.batch}, {cfg.threads} thread(s); "
          f"engine plan (auto):")
    for p in plan:
        print("   " + p.describe())
    steps = {e: make_step(model=cfg.model, entry=e) for e in entries}
    rounds = rounds or (cfg.quick_rounds if quick else cfg.rounds)
    load = [wait_for_quiet(max_load=max_load, timeout_s=QUIET_TIMEOUT_S)
            if max_load else load_average()]
    summary = summarize(interleaved(steps, rounds=rounds, warmup=1), baseline=BASELINE)
    load.append(load_average())
    peaks: dict[str, dict[str, Any]] = {}
    mem_ratio: dict[str, float] = {}
    if memory:
        for e in entries:
            peaks[e] = peak_memory(factory="bench.step_time:make_step",
                                   kwargs={"model": cfg.model, "entry": e},
                                   threads=cfg.threads, warmup=1, steps=1)
        base = peaks[BASELINE]["peak_delta_bytes"]
        mem_ratio = {e: p["peak_delta_bytes"] / base if base else math.nan
                     for e, p in peaks.items()}
    print(f"{rounds} interleaved rounds; x time = median of per-round ratios to {BASELINE}, "
          f"x min = ratio of fastest runs; load average {load[0]:.1f} -> {load[1]:.1f}")
    print(format_table(summary, mem_ratio or None))
    if ENGINE not in summary:
        return {"time": summary}
    ours = summary[ENGINE]["ratio_per_round_median"]
    checks = {f"faster than {o}": summary[ENGINE]["median_s"] < summary[o]["median_s"]
              for o in OPACUS if o in summary}
    if cfg.time_target is not None:
        checks[f"time <= {cfg.time_target}x"] = ours <= cfg.time_target
    if cfg.memory_target is not None and mem_ratio:
        checks[f"memory <= {cfg.memory_target}x"] = mem_ratio[ENGINE] <= cfg.memory_target
    print("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in checks.items()))
    return {"config": {"shape": list(cfg.shape), "batch": cfg.batch, "threads": cfg.threads,
                       "rounds": rounds, "load_average_before_after": load},
            "plan": [p.describe() for p in plan], "time": summary,
            "memory": {e: {**p, "ratio": mem_ratio[e]} for e, p in peaks.items()},
            "targets": checks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few timing rounds")
    ap.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--strategies", action="store_true",
                    help="also time the engine with ghost / materialize forced everywhere")
    ap.add_argument("--entries", nargs="+", choices=list(ENTRIES) + list(FORCED),
                    help="time only these entries (the baseline is always included)")
    ap.add_argument("--rounds", type=int, help="override the rounds of every model")
    ap.add_argument("--threads", type=int,
                    help="override every model's thread count (1 thread is the least "
                         "sensitive to other jobs on a shared machine)")
    ap.add_argument("--max-load", type=float,
                    help="before timing each model, wait (up to 10 min) for the 1-minute load "
                         "average to drop below this (shared machines)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    ap.add_argument("--name", default="step_time", help="results file bench/results/NAME.json")
    args = ap.parse_args()
    entries = list(ENTRIES) + (list(FORCED) if args.strategies else [])
    if args.entries:
        entries = [BASELINE] + [e for e in args.entries if e != BASELINE]
    configs = {m: CONFIGS[m] if args.threads is None else
               dataclasses.replace(CONFIGS[m], threads=args.threads) for m in args.models}
    results = {m: bench_model(configs[m], quick=args.quick, entries=entries,
                              memory=not args.no_memory, rounds=args.rounds,
                              max_load=args.max_load)
               for m in args.models}
    path = write_results(args.name, {"quick": args.quick, "torch": torch.__version__,
                                     "models": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
