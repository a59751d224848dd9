"""What certified norms cost in clipping: each example's clipping factor from the engine's
certified norm against the one from its exact norm, on real batches.

The engine clips on an upper bound of each example's norm (``trainables/engine/norms.py``), so
an example whose norm exceeds C is clipped a little harder than its exact norm asks. Per model
and batch (Fashion-MNIST's first training examples; ResNet-20-GN sees them padded to 32x32 and
repeated over three channels), on the CPU branch and the branch an accelerator takes (no host
reads, so no example is re-normed exactly), with the model at its seeded initialisation:

* per layer, the certified norm over the exact one (float64 model, ``torch.func``): median and
  maximum of the relative excess;
* the flat clipping factor min(1, C / ||g||) from certified over exact norms, mean and minimum,
  at C = the batch's median exact norm (half the examples clipped).

Run from the repository root: ``.venv/bin/python -m bench.overclip [--batch 256]``; writes
``bench/results/overclip.json``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from typing import Any

import torch

from bench.harness import write_results
from dpsweep.trainables.data.splits import load_splits
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.engine.host_reads import forbid_host_reads
from dpsweep.trainables.models.networks import build_model

RESULTS = "overclip"
MODELS = {"cnn28": (1, 28, 28), "resnet20_gn": (3, 32, 32)}
BRANCHES = ("cpu", "accelerator")
NUM_CLASSES = 10
SEED = 0
#: Examples per real batch (the step-time benchmark's cnn28 batch).
BATCH = 256


def real_batch(shape: tuple[int, int, int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` Fashion-MNIST training examples, as ``shape`` (padded to 32x32 and
    repeated over channels for a 3-channel model)."""
    train = load_splits(dataset="fashion-mnist", seed=SEED).train
    x, y = train.x[:n].float(), train.y[:n]
    if shape[1] != x.shape[2]:
        pad = (shape[1] - x.shape[2]) // 2
        x = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    return x.expand(-1, shape[0], -1, -1).contiguous(), y


def measure(model_name: str, *, batch: int) -> dict[str, Any]:
    shape = MODELS[model_name]
    torch.manual_seed(SEED)
    model = build_model(name=model_name, input_shape=shape, num_classes=NUM_CLASSES)
    x, y = real_batch(shape, batch)
    live = [True] * len(model.layer_names)
    exact = GradEngine(copy.deepcopy(model).double(), strategy="vmap").compute(
        x.double(), y, live=live).norms
    clip = float(exact.norm(dim=1).median())
    out: dict[str, Any] = {"batch": batch, "clip_norm": clip, "layers": model.layer_names}
    for branch in BRANCHES:
        engine = GradEngine(model)
        if branch == "accelerator":
            with forbid_host_reads():
                got = engine.compute(x, y, live=live).norms
        else:
            got = engine.compute(x, y, live=live).norms
        excess = (got / exact - 1).nan_to_num(0.0)
        factor = ((clip / got.norm(dim=1)).clamp(max=1.0)
                  / (clip / exact.norm(dim=1)).clamp(max=1.0))
        out[branch] = {
            "layer_excess_median": [float(v) for v in excess.median(dim=0).values],
            "layer_excess_max": [float(v) for v in excess.amax(dim=0)],
            "under_normed": int((excess < -1e-5).sum()),
            "factor_mean": float(factor.mean()),
            "factor_min": float(factor.min()),
            "clipped": int((exact.norm(dim=1) > clip).sum()),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    payload: dict[str, Any] = {"models": {}}
    for name in args.models:
        row = measure(name, batch=args.batch)
        payload["models"][name] = row
        for branch in BRANCHES:
            r = row[branch]
            print(f"{name:<12} {branch:<11} clip factor mean {r['factor_mean']:.6f} "
                  f"min {r['factor_min']:.6f}; layer excess median "
                  f"{statistics.median(r['layer_excess_median']):.2e} max "
                  f"{max(r['layer_excess_max']):.2e}; under-normed {r['under_normed']}")
    write_results(RESULTS, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
