"""Our DP-SGD step at one commit against another, in the same interleaved run.

A change to the engine must not slow the CPU step. Timing each commit in its own run compares
two states of a shared machine, so each commit gets a long-lived worker process (its own
checkout, its own ``bench.step_time.make_step``) and the rounds alternate between the workers in
shuffled order (``bench.harness.interleaved``): the per-round ratio cancels the load common to
one round. The base commit is checked out with ``git worktree`` into a temporary folder.

    .venv/bin/python -m bench.versus --base HEAD~1 [--models cnn28 resnet20_gn] [--rounds 15]

Writes ``bench/results/versus.json`` (``--name``): per model, each side's median step and IQR,
and the median and IQR of the per-round ratio head / base.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.harness import interleaved, load_average, summarize, write_results
from bench.step_time import CONFIGS, ENGINE

ROOT = Path(__file__).resolve().parent.parent
#: The worker: builds one entry's step in its checkout, then times ``n`` steps per request.
WORKER = """
import sys, time, torch
from bench.step_time import CONFIGS, make_step
model, entry = sys.argv[1], sys.argv[2]
torch.set_num_threads(CONFIGS[model].threads)
step = make_step(model=model, entry=entry)
step()
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    for _ in range(int(line)):
        step()
    print(time.perf_counter() - start, flush=True)
"""


class Worker:
    """One checkout's step in a subprocess; ``__call__`` times one step there."""

    def __init__(self, checkout: Path, *, model: str, entry: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, model, entry], cwd=checkout, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"})
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the worker in {checkout} did not start")
        self.seconds: list[float] = []

    def __call__(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("1\n")
        self.proc.stdin.flush()
        self.seconds.append(float(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """``rev`` in a temporary git worktree."""
    with tempfile.TemporaryDirectory(prefix="versus-") as tmp:
        path = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                           check=False, capture_output=True)


def compare(base: Path, *, model: str, rounds: int, entry: str = ENGINE) -> dict[str, Any]:
    """Both commits' step of ``model`` in interleaved rounds; times as the workers saw them."""
    workers = {"base": Worker(base, model=model, entry=entry),
               "head": Worker(ROOT, model=model, entry=entry)}
    try:
        calls: dict[str, Callable[[], object]] = dict(workers)
        interleaved(calls, rounds=rounds, warmup=1)
        times = {k: w.seconds[1:] for k, w in workers.items()}  # the warm-up call dropped
    finally:
        for w in workers.values():
            w.close()
    return summarize(times, baseline="base")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="the commit to compare with")
    ap.add_argument("--models", nargs="+", choices=list(CONFIGS),
                    default=["cnn28", "resnet20_gn"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--name", default="versus")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True, check=False).stdout.strip()
    result: dict[str, Any] = {"base": args.base, "head": head, "rounds": args.rounds,
                              "models": {}}
    with checkout(args.base) as base:
        for model in args.models:
            load = load_average()
            summary = compare(base, model=model, rounds=args.rounds)
            summary["load_average_before_after"] = [load, load_average()]
            result["models"][model] = summary
            h = summary["head"]
            print(f"{model}: head/base per-round ratio {h['ratio_per_round_median']:.3f} "
                  f"(IQR {h['ratio_per_round_q1']:.3f}-{h['ratio_per_round_q3']:.3f}); "
                  f"base {summary['base']['median_s'] * 1e3:.1f} ms, "
                  f"head {h['median_s'] * 1e3:.1f} ms")
    print(write_results(args.name, result))


if __name__ == "__main__":
    main()
