"""What a membership audit costs against the trial's own training (issue 41, third item).

Per recipe a DP-SGD target (epsilon 3) is trained once, then three entries are timed in
interleaved, shuffled rounds (``bench.harness.interleaved``, one torch thread):

* ``train``: the target trained again as a trial trains it (``train_trial``: Poisson batches,
  validation after every epoch, the test split after the last; no checkpoint; the engine's
  plan read from the run's cache folder, as every trial after a sweep's first reads it);
* ``audit``: the audit a sweep runs on it (``orchestrator.audit.membership.audit_model`` with
  the default ``[audit]`` settings: 4 online references trained like the target, layer probes,
  no reference cache, so every reference is trained; the references take the target's engine
  plan from the run's cache folder);
* ``audit before``: the same audit inside ``trainables.audit.prefix.without_savings`` (every
  model computes its own frozen prefix, every reference times the engine's candidates
  itself, references start from their own seeded parameters,
  gradient norms come from a float64 copy of each model, the signals take a separate forward
  for the logits, the probes and the shadow classifier each run their own forward, and their
  fits use every BLAS thread): the audit before the savings, measured in the same run. DeLong's
  AUC interval and the built-in CNNs' no-gradient pooling are not among the savings it
  switches off: both columns include them. Token
  ids reaching the float64 signals as integers is a fix, not a saving, so it holds in both
  (the audit of a token model failed before it).

Reported per recipe: the median and interquartile range of the per-round ratios audit / train
for both audits (and the seconds). Recipes (``RECIPES``): ``cnn28`` on Fashion-MNIST (digits
when ``/usr/share/datasets/fashion-mnist`` is missing); ResNet-18 with GroupNorm from
``examples/stock_models`` with its backbone frozen (``resnet18_fc``: only ``fc`` trains; the
references share the target's backbone) and unfrozen (``resnet18_gn``), on 600 digits
upsampled to 32 x 32 and repeated to 3 channels; and ``lstm`` (Embedding + LSTM + Linear) on
the digits read as 64-token sequences of pixel intensities. Results:
``bench/results/audit_cost.json``, whose table ``bench.docgen`` puts in
``docs/audit.md``.

Run from the repository root: ``.venv/bin/python -m bench.audit_cost [--recipes ...]
[--rounds N]`` (a few minutes per round and recipe on 2 shared cores; the ResNet-18 rows'
``audit before`` are the longest).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.harness import interleaved, load_average, summarize, write_results
from dpsweep.core.trial import TrialSpec
from dpsweep.orchestrator.audit.membership import AuditSettings, audit_model
from dpsweep.orchestrator.config import AuditConfig
from dpsweep.orchestrator.trial.plan import match_budget
from dpsweep.trainables.audit.prefix import without_savings
from dpsweep.trainables.audit.references import Budget, dp_trainer
from dpsweep.trainables.data.pools import DEBIAN_FASHION_MNIST_DIR
from dpsweep.trainables.data.splits import DataSplits, Split, SplitSizes, load_pool, load_splits
from dpsweep.trainables.methods import get_method
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.training.loop import train_trial

ROOT = Path(__file__).resolve().parent.parent
STOCK_DIR = ROOT / "examples" / "stock_models"
RESULTS_NAME = "audit_cost"
TRAIN = "train"
AUDIT = "audit"
BEFORE = "audit before"
DEFAULT_ROUNDS = 3
METHOD = "dpsgd"
EPSILON = 3.0
DELTA = 1e-5
#: dpsgd's learning rate and clipping norm for every recipe.
PARAMS = {"lr": 1.0, "clip_norm": 1.0}
#: The sweep's default audit (``[audit]`` as the config's defaults declare it).
SETTINGS = AuditSettings.from_config(AuditConfig())
#: 600 digits to train on; the rest of the 1,797 split for the audit and its probes.
DIGITS_SIZES = SplitSizes(train=600, validation=150, holdout=300, test=147, shadow=600)
FMNIST_SIZES = SplitSizes(train=2000, validation=500, holdout=1000, test=1000, shadow=4000)
#: The small ResNet rows' input side (digits upsampled) and the digits' pixel levels (0..16).
IMAGE_SIDE = 32
RGB = 3
PIXEL_LEVELS = 17
SEED = 1


def _rgb(split: Split) -> Split:
    x = F.interpolate(split.x, size=IMAGE_SIDE, mode="bilinear", align_corners=False)
    return Split(x=x.repeat(1, RGB, 1, 1).contiguous(), y=split.y, indices=split.indices)


def _each_split(data: DataSplits, fn: Callable[[Split], Split], **changes: Any) -> DataSplits:
    return dataclasses.replace(data, **{name: fn(getattr(data, name)) for name in
                                        ("train", "validation", "holdout", "test", "shadow")},
                               **changes)


def digits_rgb() -> DataSplits:
    """600 digits to train on, upsampled to 32 x 32 and repeated to 3 channels."""
    return _each_split(load_splits(dataset="digits", seed=0, sizes=DIGITS_SIZES), _rgb,
                       input_shape=(RGB, IMAGE_SIDE, IMAGE_SIDE))


def digits_tokens() -> DataSplits:
    """The digits as sequences of 64 pixel intensities (token ids 0..16)."""
    pool = load_pool(dataset="digits")

    def tokens(split: Split) -> Split:
        x = np.asarray(pool.x[split.indices]).reshape(len(split.indices), -1)
        return Split(x=torch.from_numpy(x.astype(np.int64)), y=split.y, indices=split.indices)

    data = load_splits(dataset="digits", seed=0, sizes=DIGITS_SIZES)
    return _each_split(data, tokens, input_shape=(data.train.x[0].numel(),), normalization=None)


def fashion_or_digits() -> DataSplits:
    if DEBIAN_FASHION_MNIST_DIR.is_dir():
        return load_splits(dataset="fashion-mnist", seed=0, sizes=FMNIST_SIZES)
    return load_splits(dataset="digits", seed=0, sizes=DIGITS_SIZES)


@dataclass(frozen=True)
class Recipe:
    """A target: its data, network, epochs and batch size."""

    describe: str
    data: Callable[[], DataSplits]
    model: ModelSource
    epochs: int
    batch_size: int


def _stock(factory: str, **args: Any) -> ModelSource:
    return ModelSource(factory=f"stock_models:{factory}", code_dir=str(STOCK_DIR), args=args)


RECIPES = {
    "cnn28": Recipe("cnn28, 2,000 Fashion-MNIST members, 5 epochs at batch 256",
                    fashion_or_digits, ModelSource(name="cnn28"), 5, 256),
    "resnet18_fc": Recipe("ResNet-18 GN, backbone frozen (only fc trains), 600 digits "
                          "at 32x32 RGB, 2 epochs at batch 50", digits_rgb,
                          _stock("build_resnet18_fc"), 2, 50),
    "resnet18_gn": Recipe("ResNet-18 GN, every layer trains, 600 digits at 32x32 RGB, "
                          "2 epochs at batch 50", digits_rgb, _stock("build_resnet18_gn"), 2, 50),
    "lstm": Recipe("Embedding + LSTM + Linear, 600 digits as 64 tokens, 2 epochs at batch 50",
                   digits_tokens, _stock("build_lstm", vocab=PIXEL_LEVELS), 2, 50),
}


def _budget(size: int, *, recipe: Recipe) -> Budget:
    cal, curve = match_budget(method=METHOD, params=dict(_params()), dataset_size=size,
                              batch_size=min(recipe.batch_size, size), epochs=recipe.epochs,
                              epsilon=EPSILON, delta=DELTA, cache_dir=None, timeout_s=300.0)
    return Budget(calibration=cal, epsilon_curve=curve)


@functools.cache
def _params() -> dict[str, Any]:
    return dict(get_method(METHOD).validate_params(PARAMS))


def target_spec(recipe: Recipe, data: DataSplits) -> TrialSpec:
    budget = _budget(len(data.train), recipe=recipe)
    return TrialSpec(method=METHOD, method_params=_params(), epochs=recipe.epochs,
                     batch_size=recipe.batch_size, calibration=budget.calibration,
                     epsilon_curve=budget.epsilon_curve, seed=SEED,
                     user_model=recipe.model.to_dict(), device="cpu", threads=1)


def bench_recipe(name: str, *, rounds: int) -> dict[str, Any]:
    """Time one recipe's training and both audits; the ratios (module docstring)."""
    recipe = RECIPES[name]
    torch.set_num_threads(1)
    data = recipe.data()
    spec = target_spec(recipe, data)
    budgets = functools.cache(functools.partial(_budget, recipe=recipe))
    # the run's cache folder: the target's engine plan is kept there, as a sweep keeps it
    plans = Path(tempfile.mkdtemp(prefix="audit_cost_plans_"))
    target = train_trial(spec, data=data, plan_cache=plans).model.eval()
    records: dict[str, list[dict[str, Any]]] = {AUDIT: [], BEFORE: []}

    def audit(kind: str) -> None:
        trainer = dp_trainer(spec, budgets=budgets, plan_cache=None if kind == BEFORE else plans)
        with without_savings() if kind == BEFORE else contextlib.nullcontext():
            record = audit_model(target=target, data=data, settings=SETTINGS, trainer=trainer)
        records[kind].append({k: record[k] for k in ("reference_train_seconds",
                                                     "scoring_seconds", "n_scored")}
                             | {"excluded": len(record["excluded"])})

    entries = {TRAIN: lambda: train_trial(spec, data=data, plan_cache=plans),
               AUDIT: lambda: audit(AUDIT), BEFORE: lambda: audit(BEFORE)}
    load = [load_average()]
    times = interleaved(entries, rounds=rounds, warmup=0)
    load.append(load_average())
    summary = summarize(times, baseline=TRAIN)
    for kind in (AUDIT, BEFORE):
        s = summary[kind]
        print(f"{name:<12} {kind:<13} {s['median_s']:7.1f} s, audit / train "
              f"{s['ratio_per_round_median']:6.1f} (IQR {s['ratio_per_round_q1']:.1f}-"
              f"{s['ratio_per_round_q3']:.1f})")
    return {"describe": recipe.describe, "dataset": data.name, "n_train": len(data.train),
            "rounds": rounds, "load_average_before_after": load, "summary": summary,
            "times_s": times, "audits": records,
            "train_median_s": statistics.median(times[TRAIN])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    ap.add_argument("--name", default=RESULTS_NAME, help="results file bench/results/NAME.json")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    recipes = {r: bench_recipe(r, rounds=args.rounds) for r in args.recipes}
    path = write_results(args.name, {
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "threads": 1, "settings": dataclasses.asdict(SETTINGS),
        "method": METHOD, "epsilon": EPSILON,
        "ratio": "per-round audit seconds / train seconds: median and quartiles",
        "recipes": recipes})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
