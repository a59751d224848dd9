"""The full-size study's reference trial on whatever device ``resources.device`` resolves to
(CUDA when present): wall time and test accuracy of ``dpsweep train``, repeated with fresh noise.

A lent GPU machine has PyTorch but no Ray or Optuna, so a whole sweep cannot run there; one
``train_single`` per repeat is the same trial a sweep's re-run trains (same plan, engine, data
splits and accountant), which is what the study's CPU wall times are made of.

``--method`` and ``--param`` train one method of a part's config at fixed hyperparameters
(for example another method's leader), to separate a method's effect from its tuning.

    python -m bench.cuda_fmnist [CONFIG] [--repeats 3] [--out DIR] [--name cuda_fmnist]
        [--method NAME --param lr=4.6 --param clip_norm=0.07 ...]

Writes ``NAME.json`` into ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dpsweep.orchestrator import api
from dpsweep.orchestrator import config as config_mod
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.trial.single import train_single
from dpsweep.trainables.training.loop import resolve_device

DEFAULT_CONFIG = Path("configs/fmnist_full_published.toml")
DEFAULT_REPEATS = 3


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _one(cfg: config_mod.Config, *, scratch: Path) -> dict[str, Any]:
    start = time.perf_counter()
    result = train_single(check(cfg), out=scratch)
    wall = time.perf_counter() - start
    p = result.privacy_record
    epochs = [float(m["epoch_seconds"]) for m in result.history]
    return {"wall_s": wall, "train_s": result.seconds,
            "epoch_s_median": statistics.median(epochs),
            "test_accuracy": result.test_accuracy, "val_accuracy": result.val_accuracy,
            "epsilon_upper": p.epsilon_upper, "noise_multiplier": p.noise_multiplier,
            "steps": p.steps, "dp_valid": p.dp_valid}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    acc = [r["test_accuracy"] for r in rows]
    wall = [r["wall_s"] for r in rows]
    return {"test_accuracy_mean": statistics.fmean(acc),
            "test_accuracy_sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "wall_s_median": statistics.median(wall), "wall_s_min": min(wall),
            "wall_s_max": max(wall), "wall_s_total": sum(wall)}


def _config(path: Path, *, method: str | None, params: list[str]) -> config_mod.Config:
    """The config at ``path``, or its one ``method`` at the fixed ``params`` (nothing searched)."""
    if method is None:
        if params:
            raise SystemExit("--param needs --method")
        return api.load_config(path)
    raw = config_mod.read_toml(path)
    fixed: dict[str, float | int] = {}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param {item!r}: allowed NAME=NUMBER")
        fixed[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    raw.setdefault("sweep", {})["methods"] = [method]
    raw.setdefault("method_params", {})[method] = fixed
    raw.pop("search", None)
    return api.from_dict(raw, base_dir=path.resolve().parent)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="cuda_fmnist")
    ap.add_argument("--method", default=None)
    ap.add_argument("--param", action="append", default=[], metavar="NAME=NUMBER")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: allowed >= 1")
    cfg = _config(args.config, method=args.method, params=args.param)
    device = resolve_device(cfg.resources.device)
    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            row = _one(cfg, scratch=Path(d) / "run")
        rows.append(row)
        print(f"repeat {i + 1}/{args.repeats}: test {row['test_accuracy']:.4f}, "
              f"wall {row['wall_s']:.1f} s (epoch median {row['epoch_s_median']:.2f} s), "
              f"epsilon <= {row['epsilon_upper']:.4f}", flush=True)
    out = {"config": str(args.config), "method": cfg.sweep.methods[0],
           "method_params": cfg.method_params, "device": _device_name(device),
           "torch": torch.__version__, "python": platform.python_version(),
           "repeats": rows, "summary": _summary(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    s = out["summary"]
    print(f"{out['device']}: test {s['test_accuracy_mean']:.4f} +- {s['test_accuracy_sd']:.4f}, "
          f"wall median {s['wall_s_median']:.1f} s; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
