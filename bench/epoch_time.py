"""Full-size epochs against the step: per-epoch time vs (steps x measured step time).

The full-size study's trial (``configs/fmnist_full_a.toml``: 50,000 Fashion-MNIST members, cnn28,
batch 2048 = 25 Poisson steps per epoch, momentum 0.9, ``max_physical_batch`` and threads as
the study runs them) is planned and trained by the real trial code (``plan_trial``,
``train_trial`` with the sweep's rolling checkpoint). Between epochs, in the report callback
(outside the timed epoch), the same round measures:

- ``step``: the measured step time, the median of ``--steps`` calls of a second ``DPStep`` of
  the same method and parameters on a copy of the model, on a fixed batch of exactly the
  expected size (2048 member examples), as ``bench.step_time`` times a step;
- ``evaluate``: the evaluation the epoch ran (same calls, same model): the validation split
  every epoch, the test split after the last one only.

Inside the epoch, the trial's own ``method.step`` calls are timed (``train_trial``'s
``instrument`` hook). Per epoch: ``epoch`` = wall time from the end of one report to the end of
the next (sampling, gathering the batch, the steps, evaluation, the rolling checkpoint, the
report); ``ratio`` = epoch / (steps per epoch x step), the number the issue bounds by 1.15;
the rest is split into the steps' own excess over the measured step (Poisson batch sizes vary
around the expected one), evaluation, and everything else (sampling, indexing, checkpoint).
The first epoch is warm-up and is left out. The calibration is for ``--epochs`` epochs (fewer
steps than the study's 1,000, so a smaller sigma): the cost of a step does not depend on sigma.
Results: ``bench/results/epoch_time.json``.

Run from the repository root (needs ``make data``):
``.venv/bin/python -m bench.epoch_time [--epochs 6] [--threads 1]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import load_average, wait_for_quiet, write_results
from dpsweep.core.layout import CHECKPOINT_DIR
from dpsweep.core.poisson import poisson_plan
from dpsweep.orchestrator.api import from_dict
from dpsweep.orchestrator.config import read_toml
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.plan import plan_trial
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.dp.step import DPStep, PublicData
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.training.loop import build_trial_model, evaluate, train_trial

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "fmnist_full_a.toml"
#: The trial the issue quotes (0.867 test accuracy at epsilon 2.985): step lr * C = 0.4.
METHOD = "dpsgd"
PARAMS = {"lr": 4.0, "clip_norm": 0.1, "momentum": 0.9}
EPSILON = 3.0
#: Isolated steps per round, and the schedule length of the isolated method (never reached).
ISOLATED_STEPS = 8
SCHEDULE_STEPS = 10_000_000
QUIET_TIMEOUT_S = 600
#: The issue's bound on epoch / (steps x step time).
TARGET = 1.15


def full_size_config(*, epochs: int, threads: int) -> Any:
    raw = read_toml(CONFIG)
    raw["training"] = {**raw["training"], "method": METHOD, "epochs": epochs}
    raw["privacy"] = {**raw.get("privacy", {}), "epsilon": EPSILON}
    raw["resources"] = {**raw.get("resources", {}), "cpus_per_trial": threads}
    raw["method_params"] = {METHOD: dict(PARAMS)}
    for key in ("sweep", "budget", "search", "audit"):
        raw.pop(key, None)
    return from_dict(raw, base_dir=CONFIG.parent)


def isolated_method(method: DPStep, spec: Any, data: Any) -> DPStep:
    """A second DPStep of the trial's method and parameters on a copy of its model (a fresh
    build with its weights: a deep copy would carry the trial engine's hooks along)."""
    cls = get_method(spec.method)
    model = build_trial_model(spec, data)
    model.load_state_dict(method.model.state_dict())
    schedule = cls.noise_shape(epochs=1, steps_per_epoch=SCHEDULE_STEPS,
                               params=spec.method_params)
    return cls(model=model, params=spec.method_params,
               noise_schedule=schedule, sample_rate=spec.calibration.sample_rate,
               expected_batch_size=float(spec.batch_size), steps_per_epoch=SCHEDULE_STEPS,
               randomness=Randomness(kind="reproducible", device=torch.device("cpu"), seed=1),
               public=PublicData(x=data.shadow.x, y=data.shadow.y,
                                 generator=torch.Generator().manual_seed(2)),
               max_physical_batch=spec.max_physical_batch)


class Probe:
    """Times the trial's own steps (``instrument``) and measures between epochs (``report``)."""

    def __init__(self, *, spec: Any, data: Any, steps: int) -> None:
        self.spec, self.data, self.steps = spec, data, steps
        self.in_steps, self.n_steps = 0.0, 0
        self.mark = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self.method: DPStep | None = None
        g = torch.Generator().manual_seed(3)
        idx = torch.randperm(len(data.train), generator=g)[:spec.batch_size]
        self.batch = (data.train.x[idx], data.train.y[idx])

    def instrument(self, method: DPStep) -> None:
        self.method = method
        inner = method.step

        def timed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = inner(x, y)
            self.in_steps += time.perf_counter() - t0
            self.n_steps += 1
            return out

        method.step = timed  # type: ignore[method-assign]

    def report(self, metrics: dict[str, Any], _ckpt: Path | None) -> None:
        epoch_s = time.perf_counter() - self.mark
        assert self.method is not None
        model = self.method.model
        t0 = time.perf_counter()
        evaluate(model, self.data.validation.x, self.data.validation.y)
        if "test_accuracy" in metrics:  # the last epoch evaluates the test split too
            evaluate(model, self.data.test.x, self.data.test.y)
        eval_s = time.perf_counter() - t0
        other = isolated_method(self.method, self.spec, self.data)
        other.step(*self.batch)  # warm-up
        times = []
        for _ in range(self.steps):
            t0 = time.perf_counter()
            other.step(*self.batch)
            times.append(time.perf_counter() - t0)
        model.eval()
        self.rows.append({"epoch": metrics["epoch"], "epoch_s": epoch_s,
                          "steps_s": self.in_steps, "steps": self.n_steps,
                          "evaluate_s": eval_s, "step_s": statistics.median(times),
                          "epoch_seconds_recorded": metrics["epoch_seconds"],
                          "val_accuracy": metrics["val_accuracy"]})
        self.in_steps, self.n_steps = 0.0, 0
        self.mark = time.perf_counter()


def summarise(rows: list[dict[str, Any]], *, steps_per_epoch: int) -> dict[str, Any]:
    timed = rows[1:]  # the first epoch warms caches and allocators
    ratio = [r["epoch_s"] / (steps_per_epoch * r["step_s"]) for r in timed]
    expected = [steps_per_epoch * r["step_s"] for r in timed]

    def share(key: str) -> float:
        return statistics.median(r[key] / r["epoch_s"] for r in timed)

    excess = statistics.median((r["steps_s"] - e) / r["epoch_s"]
                               for r, e in zip(timed, expected, strict=True))
    rest = statistics.median((r["epoch_s"] - r["steps_s"] - r["evaluate_s"]) / r["epoch_s"]
                             for r in timed)
    q = statistics.quantiles(ratio, n=4) if len(ratio) > 1 else [ratio[0]] * 3
    return {"ratio_median": statistics.median(ratio), "ratio_iqr": [q[0], q[2]],
            "ratios": ratio, "target": TARGET, "met": statistics.median(ratio) <= TARGET,
            "epoch_s_median": statistics.median(r["epoch_s"] for r in timed),
            "step_s_median": statistics.median(r["step_s"] for r in timed),
            "share_steps": share("steps_s"), "share_step_excess": excess,
            "share_evaluate": share("evaluate_s"), "share_rest": rest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=6, help="epochs (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (cpus_per_trial)")
    ap.add_argument("--steps", type=int, default=ISOLATED_STEPS,
                    help="isolated steps per round")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="wait until the 1-minute load average is below this")
    args = ap.parse_args()
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the first is warm-up)")
    cfg = full_size_config(epochs=args.epochs, threads=args.threads)
    setup = check(cfg)
    data = setup.data_splits()
    spec = plan_trial(setup, data=data)
    load = wait_for_quiet(max_load=args.max_load, timeout_s=QUIET_TIMEOUT_S)
    probe = Probe(spec=spec, data=data, steps=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        probe.mark = time.perf_counter()
        train_trial(spec, data=data, checkpoint_root=Path(tmp), rolling_checkpoint=CHECKPOINT_DIR,
                    report=probe.report, instrument=probe.instrument)
    _, steps_per_epoch = poisson_plan(dataset_size=len(data.train), batch_size=spec.batch_size)
    summary = summarise(probe.rows, steps_per_epoch=steps_per_epoch)
    payload = {"config": str(CONFIG.name), "method": METHOD, "params": PARAMS,
               "members": len(data.train), "batch_size": spec.batch_size,
               "steps_per_epoch": steps_per_epoch, "threads": args.threads,
               "max_physical_batch": spec.max_physical_batch, "load_before": load,
               "load_after": load_average(), "rows": probe.rows, "summary": summary}
    path = write_results("epoch_time", payload)
    print(f"epoch {summary['epoch_s_median']:.2f} s = {summary['ratio_median']:.3f} x "
          f"({steps_per_epoch} steps x {summary['step_s_median']:.3f} s), IQR "
          f"{summary['ratio_iqr'][0]:.3f}-{summary['ratio_iqr'][1]:.3f} (target <= {TARGET}); "
          f"shares: steps {summary['share_steps']:.3f} (of which over the measured step "
          f"{summary['share_step_excess']:+.3f}), evaluation {summary['share_evaluate']:.3f}, "
          f"rest {summary['share_rest']:.3f}\n-> {path}")


if __name__ == "__main__":
    main()
