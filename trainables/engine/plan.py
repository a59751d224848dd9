"""The engine's plan by measurement: each module's fastest way, timed on the trial's device.

Which algorithm is fastest for one module (ghost norm, materialised and kept or dropped, each
with its kernels) depends on the device more than on multiply-add counts: on two AVX2 cores the
grouped convolution-weight kernel costs about two native weight gradients, on an H100 it runs as
im2col and costs four times Opacus's unfold + batched product. So a trial times every candidate
of every module once, before its first step, on a batch of *public* data (the shadow pool: the
plan is a function of shapes and speed, never of private examples), and keeps the fastest;
the cost model (:func:`trainables.engine.modules.choose`) decides only where nothing was timed
and breaks near-ties (within ``TIE``), so noise does not flip a plan between runs.

Timings are cached in the run's cache folder per device name, dtype, torch version and the
modules' shapes, so a re-run or a resumed trial reuses them. A cache file is only a hint: every
choice in it is checked against the known candidates, and the modules must match the model's;
anything else is measured again. Every candidate is exact, so a plan can change speed and the
last bits of rounding, never what is clipped or released.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpsweep.core.hints import ignored, read_json_hint
from dpsweep.core.lazy import lazy_module
from dpsweep.core.storage import atomic_write_json, json_bytes
from dpsweep.trainables.engine.modules import (
    Choice,
    Geometry,
    Handler,
    combine,
    estimate,
    scale_rows,
)
from dpsweep.trainables.engine.norms import scaled_sq_norms

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

#: Timed runs per candidate, after one untimed warm-up run (the fastest is kept: noise on a
#: shared machine only ever adds time).
REPEATS = 2
#: On the CPU, candidates are timed on this many examples of the batch: every candidate's work
#: grows linearly with the examples there, so the ranking holds and planning stays short. On
#: an accelerator the whole batch is used (small batches there are bound by launches).
CPU_ROWS = 32
#: The cost model's choice stays unless another candidate is faster by more than this fraction.
TIE = 0.10
#: A candidate whose warm-up is this many times slower than the best so far is not repeated.
HOPELESS = 3.0
#: Candidates whose multiply-adds exceed the cheapest's by this factor are not timed: no
#: device's kernels make up that much (the GPU's worst case measured about 4x).
PRUNE = 16.0
#: Where the planning time ran out: the module keeps the cost model's choice.
OVER_BUDGET = "cost model (planning time spent)"
#: Bumped when what a cached plan means changes (older files are measured again).
PLAN_VERSION = 1
PLAN_PREFIX = "engine_plan_"

Captured = tuple[Handler, "torch.Tensor", "torch.Tensor", Geometry]


@dataclass(frozen=True)
class ModuleTiming:
    """One module's plan: its choice, where it came from, and what each candidate took."""

    module: str
    kind: str
    geometry: Geometry
    choice: Choice
    source: str  # "measured", "cache" or "cost model"
    timings_ms: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "kind": self.kind, "geometry": asdict(self.geometry),
                "choice": self.choice.to_dict(), "label": self.choice.label,
                "source": self.source, "timings_ms": dict(self.timings_ms)}


def device_name(device: torch.device) -> str:
    """What the timings depend on: the accelerator's model, or the CPU and its threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{os.cpu_count()}cpu:{torch.get_num_threads()}t"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(handler: Handler, a: torch.Tensor, b: torch.Tensor, geometry: Geometry,
            choice: Choice) -> Callable[[], None]:
    """One norm and one weighted sum of the module's weight, the way ``choice`` forms them."""
    coef = torch.rand(a.shape[0], device=a.device, dtype=b.dtype)

    def run() -> None:
        if choice.keep:
            g = handler.weight_per_example(a, b, kernel=choice.kernel)
            scaled_sq_norms(g)
            combine(coef, g)
        else:
            handler.weight_sq(a, b, geometry=geometry, ghost=choice.norm == "ghost",
                              kernel=choice.kernel)
            handler.weight_sum(a, scale_rows(b, coef))
    return run


def _seconds(run: Callable[[], None], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start


def contenders(handler: Handler, geometry: Geometry, *, cost: Choice) -> list[Choice]:
    """The candidates worth timing, the cost model's first (so a slow one is seen as hopeless
    after one run): those whose multiply-adds are within ``PRUNE`` of the cheapest."""
    options = handler.candidates(geometry)
    work = {c: estimate(geometry, norm=c.norm, keep=c.keep) for c in options}
    least = min(work.values())
    kept = [c for c in options if work[c] <= PRUNE * least or c == cost]
    return sorted(kept, key=lambda c: (c != cost, work[c]))


def time_candidates(handler: Handler, a: torch.Tensor, b: torch.Tensor,
                    geometry: Geometry, *, cost: Choice,
                    deadline: float = math.inf) -> dict[Choice, float]:
    """Seconds of each contender (the fastest timed run; infinite where it ran out of memory;
    a hopeless one is timed once; none is started after ``deadline``, a ``perf_counter``
    time, once one has been timed)."""
    out: dict[Choice, float] = {}
    best = float("inf")
    if a.device.type == "cpu":
        a, b = a[:CPU_ROWS], b[:CPU_ROWS]
    with torch.no_grad():
        for choice in contenders(handler, geometry, cost=cost):
            if out and time.perf_counter() > deadline:
                break
            run = _runner(handler, a, b, geometry, choice)
            try:
                first = _seconds(run, a.device)  # warm-up: kernels chosen, memory allocated
                if first > HOPELESS * best:
                    out[choice] = first
                    continue
                out[choice] = min(_seconds(run, a.device) for _ in range(REPEATS))
            except torch.OutOfMemoryError:
                out[choice] = float("inf")
                if a.device.type == "cuda":
                    torch.cuda.empty_cache()
            best = min(best, out[choice])
    return out


def pick(timings: dict[Choice, float], *, cost: Choice) -> Choice:
    """The fastest candidate, unless the cost model's is within ``TIE`` of it."""
    fastest = min(timings, key=lambda c: timings[c])
    if cost in timings and timings[cost] <= (1 + TIE) * timings[fastest]:
        return cost
    return fastest


def plan_key(*, device: torch.device, dtype: torch.dtype, rows: int,
             captured: list[Captured]) -> str:
    """The cache key: device model, dtype, torch version, chunk size and every module's
    shape, in order."""
    modules = [[h.qualname, h.kind, asdict(g)] for h, _, _, g in captured]
    blob = json_bytes({"version": PLAN_VERSION, "device": device_name(device),
                       "dtype": str(dtype), "torch": torch.__version__, "rows": rows,
                       "modules": modules})
    return hashlib.sha256(blob).hexdigest()[:32]


def read_cached(path: Path, captured: list[Captured]) -> list[Choice] | None:
    """The cached choices for ``captured``, or None where the file is missing, not a bounded
    regular JSON file (:mod:`core.hints`), of another version, for other modules, or names
    anything but a candidate: the cache is a hint, ignored (logged once) and rebuilt."""
    data = read_json_hint(path)
    if data is None:
        return None
    entries = data.get("modules") if isinstance(data, dict) else None
    if not isinstance(entries, list) or data.get("version") != PLAN_VERSION \
            or len(entries) != len(captured):
        ignored(path, "not a plan of this version for these modules")
        return None
    out = []
    for entry, (handler, _, _, geometry) in zip(entries, captured, strict=True):
        choice = entry.get("choice") if isinstance(entry, dict) else None
        try:
            chosen = Choice.from_dict(choice) if isinstance(choice, dict) else None
        except ValueError:
            chosen = None
        if chosen is None or entry.get("module") != handler.qualname \
                or chosen not in handler.candidates(geometry):
            ignored(path, f"no candidate choice for {handler.qualname}")
            return None
        out.append(chosen)
    return out


def write_cached(path: Path, timings: list[ModuleTiming]) -> None:
    """Best effort: a plan that cannot be written is measured again next time."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_json(path, {"version": PLAN_VERSION,
                                 "modules": [t.to_dict() for t in timings]})
    except OSError:
        pass


def measure(captured: list[Captured], *, strategy: str, cache: Path | None, key: str,
            budget_s: float | None = None) -> list[ModuleTiming]:
    """Each captured module's plan: from the cache when it holds one, else timed (modules of
    one kind and shape once); once ``budget_s`` is spent, the rest keep the cost model's."""
    path = None if cache is None else cache / f"{PLAN_PREFIX}{key}.json"
    cached = None if path is None else read_cached(path, captured)
    timed: dict[tuple[object, ...], dict[Choice, float]] = {}
    deadline = time.perf_counter() + (math.inf if budget_s is None else budget_s)
    out = []
    for i, (handler, a, b, geometry) in enumerate(captured):
        cost = handler.cost_choice(geometry, strategy=strategy)
        group = (*handler.timing_key(), geometry)
        if handler.weight_name is None:
            out.append(ModuleTiming(handler.qualname, handler.kind, geometry, cost,
                                    "cost model", {}))
        elif cached is not None:
            out.append(ModuleTiming(handler.qualname, handler.kind, geometry, cached[i],
                                    "cache", {}))
        elif group not in timed and time.perf_counter() > deadline:
            out.append(ModuleTiming(handler.qualname, handler.kind, geometry, cost,
                                    OVER_BUDGET, {}))
        else:
            if group not in timed:
                timed[group] = time_candidates(handler, a, b, geometry, cost=cost,
                                               deadline=deadline)
            timings = timed[group]
            out.append(ModuleTiming(handler.qualname, handler.kind, geometry,
                                    pick(timings, cost=cost), "measured",
                                    {c.label: round(s * 1e3, 4) for c, s in timings.items()}))
    if path is not None and cached is None and out:
        write_cached(path, out)
    return out
