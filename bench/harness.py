"""A small benchmark harness: interleaved timing rounds, ratios, peak memory, one JSON file.

Timing: every entry runs once per round, in an order shuffled each round, so slow drifts of a
shared machine (other jobs, frequency, caches) hit all entries alike; each entry reports the
median and the interquartile range of its round times, and ratios to a named baseline both as
a ratio of medians, as the median (and IQR) of the per-round ratios, which cancel the noise
common to one round, and as the ratio of minimums (the least-disturbed run of each entry).

Peak memory: each configuration runs in a fresh subprocess (so no earlier high-water mark or
allocator cache masks it). After warm-up steps the kernel's peak-RSS counter is reset
(``/proc/self/clear_refs`` = 5); the reported ``peak_delta_bytes`` is the peak (``VmHWM``) over
the measured steps minus the resident size once the model, data and optimizer were built, so
state a method keeps between steps (Opacus keeps every per-sample gradient until the next
``zero_grad``) counts, and transient one-time warm-up peaks do not.
``peak_over_step_start_bytes`` subtracts the resident size right before the measured steps
instead. We read RSS rather than ``tracemalloc`` because torch's
CPU tensors are allocated in C++ and never pass through Python's allocator, so tracemalloc would
not see them. glibc's mmap threshold is pinned (64 KiB) in the child so freed tensors leave the
resident set instead of sitting in malloc's free lists, which would hide the next step's peak.
Without ``clear_refs`` (not Linux) the fallback is ``getrusage`` maxrss minus the resident size
before the first step, which then includes one-time warm-up allocations.

Run a memory child by hand: ``python -m bench.harness memory '{"factory": "mod:fn", ...}'``.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dpsweep.core.storage import atomic_write_json

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: Bytes per kibibyte (``/proc`` and Linux ``ru_maxrss`` report KiB).
KIB = 1024
#: glibc: allocations at least this large are mmapped, and unmapped when freed.
MMAP_THRESHOLD_BYTES = 64 * KIB
#: Quartile cut points for the interquartile range.
QUARTILES = 4
CLEAR_REFS_RESET_PEAK = "5"
DEFAULT_MEMORY_TIMEOUT_S = 600


# ---- timing -----------------------------------------------------------------------------------
def interleaved(entries: Mapping[str, Callable[[], object]], *, rounds: int, warmup: int = 1,
                seed: int = 0) -> dict[str, list[float]]:
    """Seconds per call of each entry over ``rounds`` rounds in shuffled order."""
    for fn in entries.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in entries}
    order = list(entries.items())
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=QUARTILES, method="inclusive")
    return q[0], q[2]


def summarize(times: Mapping[str, list[float]], *, baseline: str) -> dict[str, dict[str, float]]:
    """Median, IQR, min and max per entry (seconds) and ratios to ``baseline``."""
    base = times[baseline]
    base_median = statistics.median(base)
    out: dict[str, dict[str, float]] = {}
    for name, ts in times.items():
        q1, q3 = _quartiles(ts)
        per_round = [t / b for t, b in zip(ts, base, strict=True)]
        r1, r3 = _quartiles(per_round)
        out[name] = {"median_s": statistics.median(ts), "q1_s": q1, "q3_s": q3,
                     "min_s": min(ts), "max_s": max(ts), "rounds": len(ts),
                     "ratio": statistics.median(ts) / base_median,
                     "ratio_of_min": min(ts) / min(base),
                     "ratio_per_round_median": statistics.median(per_round),
                     "ratio_per_round_q1": r1, "ratio_per_round_q3": r3}
    return out


def load_average() -> float:
    """1-minute load average (other jobs on a shared machine distort the timings)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def wait_for_quiet(*, max_load: float, timeout_s: float, poll_s: float = 10.0) -> float:
    """Wait until the 1-minute load average drops below ``max_load`` (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while (load := load_average()) >= max_load and time.monotonic() < deadline:
        time.sleep(poll_s)
    return load


# ---- peak memory ------------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write(CLEAR_REFS_RESET_PEAK)
    except OSError:
        return False
    return True


def _measure_in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the step named by ``spec`` and measure its peak resident-memory increase."""
    import torch

    torch.set_num_threads(int(spec.get("threads", 1)))
    module, _, fn = spec["factory"].partition(":")
    step = getattr(importlib.import_module(module), fn)(**spec.get("kwargs", {}))
    gc.collect()
    setup_kib = _status_kib("VmRSS") or 0
    for _ in range(int(spec.get("warmup", 1))):
        step()
    gc.collect()
    reset = _reset_peak()
    start_kib = _status_kib("VmRSS") or setup_kib
    for _ in range(int(spec.get("steps", 2))):
        step()
    if reset and (peak_kib := _status_kib("VmHWM")) is not None:
        method = "VmHWM after clear_refs"
    else:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss (includes warm-up)"
    return {"peak_delta_bytes": max(0, peak_kib - setup_kib) * KIB,
            "peak_over_step_start_bytes": max(0, peak_kib - start_kib) * KIB,
            "setup_rss_bytes": setup_kib * KIB, "method": method}


def peak_memory(*, factory: str, kwargs: Mapping[str, Any] | None = None, threads: int = 1,
                warmup: int = 1, steps: int = 2,
                timeout_s: float = DEFAULT_MEMORY_TIMEOUT_S) -> dict[str, Any]:
    """Peak memory of ``factory(**kwargs)()`` (a step) in a fresh subprocess; see module doc.

    ``factory`` is ``"module:function"`` returning a zero-argument step callable.
    """
    spec = {"factory": factory, "kwargs": dict(kwargs or {}), "threads": threads,
            "warmup": warmup, "steps": steps}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES),
               MALLOC_TRIM_THRESHOLD_=str(MMAP_THRESHOLD_BYTES))
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "bench.harness", "memory", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=root,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory child for {factory} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- output -----------------------------------------------------------------------------------
def write_results(name: str, payload: Mapping[str, Any]) -> Path:
    """``bench/results/<name>.json`` (written atomically; the directory is created)."""
    return atomic_write_json(RESULTS_DIR / f"{name}.json", dict(payload))


def format_table(summary: Mapping[str, Mapping[str, float]],
                 memory: Mapping[str, float] | None = None) -> str:
    """One line per entry: median ms, IQR, time ratio (per-round median and IQR), memory ratio."""
    lines = [f"{'entry':<24} {'median ms':>10} {'IQR ms':>15} {'x time':>7} "
             f"{'(round IQR)':>13} {'x min':>6} {'x memory':>9}"]
    for name, s in summary.items():
        mem = "" if memory is None or name not in memory else f"{memory[name]:>9.2f}"
        lines.append(
            f"{name:<24} {s['median_s'] * 1e3:>10.1f} "
            f"{s['q1_s'] * 1e3:>7.1f}-{s['q3_s'] * 1e3:<7.1f} {s['ratio_per_round_median']:>7.2f} "
            f"{s['ratio_per_round_q1']:>6.2f}-{s['ratio_per_round_q3']:<6.2f} "
            f"{s['ratio_of_min']:>6.2f} {mem}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "memory":
        raise SystemExit("usage: python -m bench.harness memory '<json spec>'")
    print(json.dumps(_measure_in_child(json.loads(argv[1]))))


if __name__ == "__main__":
    main(sys.argv[1:])
