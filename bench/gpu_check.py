"""Issue 33's GPU measurements in one call on one H100 or H200 (at most 8 minutes), with only
what a lent device machine has (PyTorch, numpy, pandas, pyarrow, scipy, scikit-learn) plus small
pure-Python wheels carried from here; no Ray, no Optuna.

Sections (each guarded: one that fails records its error and the others still run; each has a
share of a global time budget, ``--budget``, and its seconds are recorded):

1. ``timing``: today's step table (cnn28 at 256 and 2048, cnn5 at 256, resnet20_gn at 128 and
   512, wrn16_4 at 64 and 256): a non-private SGD step, ``engine DP-SGD`` (the earlier step table's
   entry), ``method dpsgd`` (the dpsgd method's own ``step``, secret noise drawn on the device:
   "ours") and Opacus's hooks, in interleaved rounds (``bench.harness.interleaved``) with
   ``torch.cuda.synchronize``; ``median_ms`` per entry and per-round ratio medians, laid out as
   ``bench/results/cuda_check_h100.json``'s timing rows, plus ``ratios`` and ``checks``.
2. ``methods``: every method (first DP-valid mode, paper preset) against dpsgd at cnn28 2048
   and resnet20_gn 512: median of per-round ratios (target <= 1.1).
3. ``host_syncs``: ``torch.profiler`` (CUDA activity) over a few steps at cnn28 2048 of the
   dpsgd method and of the engine step alone (cudaStreamSynchronize / cudaDeviceSynchronize /
   cudaEventSynchronize calls and DtoH copies per step, less the one synchronize that closes
   the profiled region); ``trial_loop``: the real training loop's marginal count per epoch and
   per step (1- and 2-epoch trials, no evaluation); ``forbid_host_reads``: whether
   ``trainables.engine.host_reads.forbid_host_reads`` raised over a few method steps.
4. ``fmnist_trial``: configs/fmnist_full_published.toml's point (1,000 steps at batch 2048)
   planned by the accountant and trained by ``trainables.training.loop.train_trial``: ``train_s``
   (as bench/cuda_fmnist.py records it), test accuracy, epsilon.
5. ``shared_gpu``: the same trial shortened (``--share-steps``, default 200) as ``--share``
   (default 4) spawned processes at once, each with its own secret noise, against one alone:
   trials per minute, their ratio (target >= 2.5), and whether the final weights differ.

Plus ``device``, ``device_slug``, ``torch``, ``python``, ``git_commit`` (``git rev-parse
HEAD``, else ``$GPU_CHECK_COMMIT``, else "unknown": the device copy of the tree has no .git),
``source_digest`` (sha256 of the Python sources that ran) and ``sections`` (seconds, status).
The JSON ``gpu_check_<device_slug>.json`` is rewritten after every section, so a run cut short
still returns what it measured.

On the device machine, one call (prepare here first: ``make gpu-carry`` downloads the wheels
into bench/wheels/ and copies Fashion-MNIST's IDX files into bench/data/fashion-mnist/, both
git-ignored, about 31 MiB together)::

    run(command="GPU_CHECK_COMMIT=<git rev-parse HEAD here> bash bench/gpu_check.sh",
        carry=["bench/wheels", "bench/data"], timeout_s=540)

then copy ``gpu_check_<device>.json`` (and ``gpu_check.log``) from the reply's files into
bench/results/. Without the carried data the trial sections fail with a message saying so;
without the wheels Opacus's entries and the accountant fail (recorded). By hand::

    python -m bench.gpu_check [--out DIR] [--budget 450] [--rounds 20] [--sections ...]
    python -m bench.gpu_check --device cpu --smoke --out /tmp/x   # dry run, well under 1 min
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import gpu_check_steps as steps
from bench import gpu_check_trial as trial

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 450.0
SMOKE_BUDGET_S = 120.0
#: Seconds each section may take at most (the global budget caps them all), and the least it
#: needs to start; generous against today's H100 (about 35, 20, 15, 35 and 50 s).
CAPS = {"timing": 130.0, "methods": 80.0, "fmnist_trial": 100.0, "host_syncs": 45.0,
        "shared_gpu": 120.0}
MINIMUM = {"timing": 10.0, "methods": 10.0, "fmnist_trial": 30.0, "host_syncs": 10.0,
           "shared_gpu": 30.0}
SECTIONS = tuple(CAPS)
SOURCE_DIRS = ("bench", "core", "orchestrator", "trainables")


def device_slug(name: str) -> str:
    """A short name of a device: "NVIDIA H100 80GB HBM3" -> "h100"; "cpu" for the CPU."""
    if name == "cpu":
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")[:32] or "device"


def git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return os.environ.get("GPU_CHECK_COMMIT", "unknown")


def source_digest() -> str:
    """sha256 over the Python files that ran (path and bytes), for a tree with uncommitted
    changes or without .git."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("opacus", "prv-accountant", "dp-accounting", "tomli-w", "numpy", "scipy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        extra = {"memory_bytes": int(props.total_memory), "cuda": torch.version.cuda}
    else:
        name, extra = "cpu", {"threads": torch.get_num_threads()}
    return {"device": name, "device_slug": device_slug(name), **extra,
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "python": platform.python_version(),
            "packages": _versions(), "git_commit": git_commit(),
            "source_digest": source_digest()}


class Budget:
    """The global time budget (monotonic seconds)."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def deadline(self, cap: float) -> float:
        return min(time.monotonic() + cap, self.end)


def _status(result: dict[str, Any]) -> str:
    return "error" if "error" in result else "skipped" if "skipped" in result else "ok"


def run_section(report: dict[str, Any], name: str, fn: Callable[[float], dict[str, Any]], *,
                budget: Budget, device: torch.device, write: Callable[[], None]) -> None:
    """``report[name] = fn(deadline)``, or its error / the reason it was skipped; seconds."""
    start = time.monotonic()
    left = budget.left()
    print(f"== {name} ({left:.0f} s of the budget left)", flush=True)
    if left < MINIMUM[name]:
        result: dict[str, Any] = {
            "skipped": f"time budget: {left:.0f} s left, the section needs {MINIMUM[name]:.0f}"}
    else:
        try:
            result = fn(budget.deadline(CAPS[name]))
        except Exception as exc:  # recorded; the next section runs
            result = {"error": steps.error_text(exc, 2000),
                      "traceback": traceback.format_exc(limit=8)[-3000:]}
            print(f"{name} failed: {result['error']}", flush=True)
    steps.release(device)
    report[name] = result
    report["sections"][name] = {"seconds": time.monotonic() - start, "status": _status(result)}
    write()


def _plan_sections(args: argparse.Namespace, device: torch.device,
                   ctx: dict[str, Any]) -> dict[str, Callable[[float], dict[str, Any]]]:
    smoke, dev = args.smoke, str(device)
    rows = (("cnn28", 16),) if smoke else steps.ROWS
    points = (("cnn28", 16),) if smoke else steps.METHOD_POINTS
    sync_point = ("cnn28", 16) if smoke else ("cnn28", 2048)
    warmup = 1 if smoke else 3

    def syncs(_deadline: float) -> dict[str, Any]:
        out = steps.syncs_section(device, point=sync_point, steps=2 if smoke else 10)
        try:
            out["trial_loop"] = trial.loop_syncs(ctx, config_path=args.config, device=dev,
                                                 smoke=smoke)
        except Exception as exc:
            out["trial_loop"] = {"error": steps.error_text(exc, 1000)}
        return out

    return {
        "timing": lambda d: steps.timing_table(device, rows=rows, rounds=args.rounds,
                                               warmup=warmup, deadline=d),
        "methods": lambda d: steps.methods_section(device, points=points, rounds=args.rounds,
                                                   warmup=warmup, deadline=d),
        "fmnist_trial": lambda d: trial.full_trial(ctx, config_path=args.config, device=dev,
                                                   data_dir=args.data_dir, smoke=smoke),
        "host_syncs": syncs,
        "shared_gpu": lambda d: trial.shared_gpu(ctx, config_path=args.config, device=dev,
                                                 steps=args.share_steps,
                                                 processes=args.share, deadline=d,
                                                 smoke=smoke),
    }


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny rounds, batches and trials (digits); a dry run of every path")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--budget", type=float, help=f"seconds in all (default {DEFAULT_BUDGET_S:.0f}"
                                                 f"; smoke {SMOKE_BUDGET_S:.0f})")
    ap.add_argument("--rounds", type=int, help="interleaved timing rounds (default 20; smoke 2)")
    ap.add_argument("--config", type=Path, default=ROOT / trial.DEFAULT_CONFIG)
    ap.add_argument("--data-dir", type=Path, help="Fashion-MNIST IDX files (default: "
                    f"{trial.CARRIED_DATA}, else {trial.DEBIAN_DATA})")
    ap.add_argument("--share", type=int, help="trials sharing the device (default 4; smoke 2)")
    ap.add_argument("--share-steps", type=int, default=200,
                    help="steps of each sharing trial (whole epochs; smoke: 1 epoch)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = ap.parse_args(argv)
    args.budget = args.budget or (SMOKE_BUDGET_S if args.smoke else DEFAULT_BUDGET_S)
    args.rounds = args.rounds or (2 if args.smoke else 20)
    args.share = args.share or (2 if args.smoke else 4)
    if args.smoke:
        args.share_steps = 1
    if args.rounds < 1 or args.share < 1 or args.share_steps < 1:
        ap.error("--rounds, --share and --share-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: `--device cpu --smoke` is the dry run")
        from dpsweep.trainables.training.loop import full_float32

        full_float32()  # what training sets: no TF32
    budget = Budget(args.budget)
    report: dict[str, Any] = {"smoke": args.smoke,
                              "argv": list(sys.argv[1:] if argv is None else argv),
                              "budget_s": args.budget, **environment(device), "sections": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_check_{report['device_slug']}.json"

    def write() -> None:
        report["seconds_total"] = time.monotonic() - budget.start
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(path)

    write()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as cache:
        ctx: dict[str, Any] = {"cache_dir": Path(cache)}
        sections = _plan_sections(args, device, ctx)
        for name in SECTIONS:
            if name in args.sections:
                run_section(report, name, sections[name], budget=budget, device=device,
                            write=write)
    write()
    print(f"{report['device']}: " + ", ".join(
        f"{k} {v['status']} {v['seconds']:.0f} s" for k, v in report["sections"].items())
          + f"; {report['seconds_total']:.0f} s in all; {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
