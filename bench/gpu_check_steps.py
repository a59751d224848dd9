"""Step-level measurements of ``bench.gpu_check``: the step-time table, every method against
DP-SGD, and the host-device synchronisations of one step (see ``bench/gpu_check.py``).

Models, batches and constants are ``bench.step_time``'s (cnn28, cnn5, resnet20_gn, wrn16_4,
random inputs, learning rate 0.1, C = 1, sigma = 1); every step here is built directly on the
measured device (nothing of the CPU benchmark is patched). Nothing is imported from ``tests/``.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from bench import step_time as st
from bench.harness import interleaved

BASELINE = "non-private"
#: The step table's original entry (kept so earlier results compare): the engine with the
#: benchmark's hand-written DP-SGD around it.
ENGINE = "engine DP-SGD"
#: The ``dpsgd`` method's own ``step`` (what a trial trains with), secret noise on the device.
METHOD = "method dpsgd"
OPACUS = "opacus hooks"
ENTRIES = (BASELINE, ENGINE, METHOD, OPACUS)
#: Per-round ratios reported for each row ("ours" is METHOD; ENGINE continues today's table).
RATIOS = ((METHOD, BASELINE), (METHOD, OPACUS), (ENGINE, BASELINE), (ENGINE, OPACUS))
#: Today's table (bench/results/cuda_check_h100.json): (model, batch).
ROWS = (("cnn28", 256), ("cnn28", 2048), ("cnn5", 256), ("resnet20_gn", 128),
        ("resnet20_gn", 512), ("wrn16_4", 64), ("wrn16_4", 256))
#: Where every method's step is compared with DP-SGD's.
METHOD_POINTS = (("cnn28", 2048), ("resnet20_gn", 512))
#: Acceptance bounds of issue 33 (recorded as checks, never enforced here).
METHOD_TARGET = 1.1
BIG_BATCH = 512
BIG_BATCH_MODELS = ("resnet20_gn", "wrn16_4")
BIG_BATCH_TARGET = 2.0
#: Steps of one timed method call at most (a public refresh period longer than this is cut).
MAX_CALL_STEPS = 4
#: Profiler runtime calls that make the host wait for the device.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")

Step = Callable[[], None]


def error_text(exc: BaseException, limit: int = 300) -> str:
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Free what the last measurement left on the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def config(model: str, batch: int) -> st.Config:
    return dataclasses.replace(st.CONFIGS[model], batch=batch)


def _batch(cfg: st.Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = st._data(cfg)
    return x.to(device), y.to(device)


def _net(cfg: st.Config, device: torch.device) -> torch.nn.Module:
    return st._model(cfg).to(device)


# ---- the entries ------------------------------------------------------------------------------
def nonprivate_step(cfg: st.Config, device: torch.device) -> Step:
    x, y = _batch(cfg, device)
    model = _net(cfg, device)
    opt = torch.optim.SGD(model.parameters(), lr=st.LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def engine_step(cfg: st.Config, device: torch.device) -> Step:
    """The step table's hand-written DP-SGD step: norms, flat clip, one weighted sum, noise, SGD."""
    from dpsweep.trainables.engine.grad_engine import GradEngine

    x, y = _batch(cfg, device)
    model = _net(cfg, device)
    engine = GradEngine(model, strategy="auto", max_physical_batch=cfg.batch)
    live = [True] * engine.num_layers
    opt = torch.optim.SGD(model.parameters(), lr=st.LR)
    params = dict(model.named_parameters())

    def step() -> None:
        view = engine.compute(x, y, live=live)
        total = view.norms.pow(2).sum(dim=1).sqrt()
        factor = (st.CLIP_NORM / (total + st.NORM_EPS)).clamp(max=1.0)
        summed = view.weighted_sum(factor.unsqueeze(1).expand(-1, engine.num_layers).float())
        std = st.NOISE_MULTIPLIER * st.CLIP_NORM
        for n, p in params.items():
            p.grad = (summed[n] + std * torch.randn_like(p)) / cfg.batch
        opt.step()

    return step


def opacus_step(cfg: st.Config, device: torch.device) -> Step:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    x, y = _batch(cfg, device)
    gsm = GradSampleModule(_net(cfg, device), batch_first=True, loss_reduction="mean")
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=st.LR),
                      noise_multiplier=st.NOISE_MULTIPLIER, max_grad_norm=st.CLIP_NORM,
                      expected_batch_size=cfg.batch)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y).backward()
        opt.step()

    return step


def build_method(cfg: st.Config, device: torch.device, series: str) -> Any:
    """A registered method (``name[:mode]``) on ``device`` as a trial builds it: the paper
    preset, a long constant schedule, secret noise drawn on the device, a public pool there."""
    from dpsweep.trainables.dp.randomness import Randomness
    from dpsweep.trainables.dp.step import PublicData
    from dpsweep.trainables.methods import get_method, parse_series

    name, mode = parse_series(series, field="method")
    model = _net(cfg, device)
    params = st.method_params(name, mode, num_layers=len(model.layer_names))
    cls = get_method(name)
    schedule = cls.noise_shape(epochs=1, steps_per_epoch=st.SCHEDULE_STEPS,
                               params=params).scaled(st.NOISE_MULTIPLIER)
    g = torch.Generator().manual_seed(st.SEED + 2)
    public = PublicData(
        x=torch.randn(st.PUBLIC_POOL, *cfg.shape, generator=g).to(device),
        y=torch.randint(0, st.NUM_CLASSES, (st.PUBLIC_POOL,), generator=g).to(device),
        generator=torch.Generator().manual_seed(st.SEED + 3))
    method = cls(model=model, params=params, noise_schedule=schedule,
                 sample_rate=st.SAMPLE_RATE, expected_batch_size=float(cfg.batch),
                 steps_per_epoch=st.SCHEDULE_STEPS,
                 randomness=Randomness(kind="secret", device=device, seed=None), public=public)
    if not method.dp_valid:
        raise ValueError(f"{series}: not DP-valid ({method.validity_reason})")
    return method


def method_step(cfg: st.Config, device: torch.device, series: str = "dpsgd",
                steps: int = 1) -> Step:
    method = build_method(cfg, device, series)
    x, y = _batch(cfg, device)

    def step() -> None:
        for _ in range(steps):
            method.step(x, y)

    return step


ENTRY_BUILDERS: dict[str, Callable[[st.Config, torch.device], Step]] = {
    BASELINE: nonprivate_step, ENGINE: engine_step, METHOD: method_step, OPACUS: opacus_step}


# ---- statistics -------------------------------------------------------------------------------
def per_round(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Median and IQR of the per-round ratios a / b."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    q = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1
         else [ratios[0]] * 3)
    return {"median": statistics.median(ratios), "iqr": [q[0], q[2]]}


def _synced(fn: Step, device: torch.device) -> Step:
    def call() -> None:
        fn()
        sync(device)
    return call


def build_entries(builders: dict[str, Callable[[], Step]],
                  device: torch.device) -> tuple[dict[str, Step], dict[str, str]]:
    """Entries that build and take one step (synchronised), and the others' errors."""
    built: dict[str, Step] = {}
    failed: dict[str, str] = {}
    for entry, make in builders.items():
        try:
            fn = _synced(make(), device)
            fn()
            built[entry] = fn
        except Exception as exc:  # e.g. Opacus missing, out of memory: recorded
            failed[entry] = error_text(exc)
    return built, failed


# ---- 1. the step-time table -------------------------------------------------------------------
def _row_checks(model: str, batch: int, ratios: dict[str, Any]) -> dict[str, bool]:
    checks: dict[str, bool] = {}
    if f"{METHOD} / {OPACUS}" in ratios:
        checks[f"{METHOD} <= {OPACUS}"] = ratios[f"{METHOD} / {OPACUS}"]["median"] <= 1.0
    if model in BIG_BATCH_MODELS and batch >= BIG_BATCH and f"{METHOD} / {BASELINE}" in ratios:
        checks[f"{METHOD} <= {BIG_BATCH_TARGET}x {BASELINE}"] = (
            ratios[f"{METHOD} / {BASELINE}"]["median"] <= BIG_BATCH_TARGET)
    return checks


def time_row(model: str, batch: int, device: torch.device, *, rounds: int,
             warmup: int) -> dict[str, Any]:
    """One row: every entry in interleaved rounds, in the earlier step table's layout plus
    ``ratios``."""
    cfg = config(model, batch)
    built, failed = build_entries(
        {e: (lambda b=b: b(cfg, device)) for e, b in ENTRY_BUILDERS.items()}, device)
    if BASELINE not in built:
        return {"entries": {}, "failed": failed, "error": "the non-private step failed"}
    times = interleaved(built, rounds=rounds, warmup=warmup)
    base = times[BASELINE]
    entries = {}
    for entry, ts in times.items():
        r = per_round(ts, base)
        entries[entry] = {"median_ms": 1e3 * statistics.median(ts),
                          "ratio_median": r["median"], "ratio_iqr": r["iqr"]}
    ratios = {f"{a} / {b}": per_round(times[a], times[b])
              for a, b in RATIOS if a in times and b in times}
    return {"entries": entries, "ratios": ratios, "failed": failed, "rounds": rounds,
            "checks": _row_checks(model, batch, ratios)}


def timing_table(device: torch.device, *, rows: Sequence[tuple[str, int]], rounds: int,
                 warmup: int, deadline: float) -> dict[str, Any]:
    """Section 1: each row of today's table, until the section's deadline."""
    out: dict[str, Any] = {}
    for model, batch in rows:
        key = f"{model}@{batch}"
        if time.monotonic() > deadline:
            out[key] = {"skipped": "the section's time budget ran out"}
            continue
        try:
            out[key] = time_row(model, batch, device, rounds=rounds, warmup=warmup)
        except Exception as exc:  # recorded; the next row still runs
            out[key] = {"error": error_text(exc)}
        finally:
            release(device)
        row = out[key]
        print(f"{key}: " + (", ".join(f"{e} {s['median_ms']:.2f} ms"
                                      for e, s in row.get("entries", {}).items())
                            or str(row)), flush=True)
    return out


# ---- 2. every method against DP-SGD -----------------------------------------------------------
def _method_entries(cfg: st.Config, device: torch.device
                    ) -> tuple[dict[str, Step], dict[str, int], dict[str, str]]:
    from dpsweep.trainables.methods import METHODS

    built: dict[str, Step] = {}
    calls: dict[str, int] = {}
    failed: dict[str, str] = {}
    for name in sorted(METHODS):
        try:
            series = st.default_series(name)
            method = build_method(cfg, device, series)
            n = max(1, min(method.public_refresh_every or 1, MAX_CALL_STEPS))
            x, y = _batch(cfg, device)

            def fn(method: Any = method, x: torch.Tensor = x, y: torch.Tensor = y,
                   n: int = n) -> None:
                for _ in range(n):
                    method.step(x, y)

            call = _synced(fn, device)
            call()
            built[series], calls[series] = call, n
        except Exception as exc:  # recorded per method
            failed[name] = error_text(exc)
    return built, calls, failed


def methods_at(model: str, batch: int, device: torch.device, *, rounds: int,
               warmup: int) -> dict[str, Any]:
    cfg = config(model, batch)
    ref = st.default_series("dpsgd")
    built, calls, failed = _method_entries(cfg, device)
    if ref not in built:
        return {"error": f"the reference {ref} did not step", "failed": failed}
    times = interleaved(built, rounds=rounds, warmup=warmup)
    times = {s: [t / calls[s] for t in ts] for s, ts in times.items()}
    methods = {}
    for series, ts in times.items():
        r = per_round(ts, times[ref])
        methods[series] = {"median_ms": 1e3 * statistics.median(ts), "ratio_median": r["median"],
                           "ratio_iqr": r["iqr"], "steps_per_call": calls[series],
                           f"<= {METHOD_TARGET}x": r["median"] <= METHOD_TARGET}
    return {"reference": ref, "target": METHOD_TARGET, "rounds": rounds, "methods": methods,
            "failed": failed}


def methods_section(device: torch.device, *, points: Sequence[tuple[str, int]], rounds: int,
                    warmup: int, deadline: float) -> dict[str, Any]:
    """Section 2: every method's first DP-valid mode vs DP-SGD, per point."""
    out: dict[str, Any] = {}
    for model, batch in points:
        key = f"{model}@{batch}"
        if time.monotonic() > deadline:
            out[key] = {"skipped": "the section's time budget ran out"}
            continue
        try:
            out[key] = methods_at(model, batch, device, rounds=rounds, warmup=warmup)
        except Exception as exc:
            out[key] = {"error": error_text(exc)}
        finally:
            release(device)
        print(f"methods {key}: " + ", ".join(
            f"{s} {m['ratio_median']:.2f}x" for s, m in out[key].get("methods", {}).items()),
              flush=True)
    return out


# ---- 3. host-device synchronisations ----------------------------------------------------------
def activities(device: torch.device) -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def sync_counts(prof: Any, device: torch.device) -> dict[str, int]:
    """Calls that make the host wait, from a finished profile: the synchronise calls (less
    the one ``torch.cuda.synchronize`` that closes a profiled region on CUDA), the
    device-to-host copies, and the host reads of a scalar (``aten::_local_scalar_dense``: on
    the CPU the only one of these a profile shows)."""
    raw = {e.key: int(e.count) for e in prof.key_averages()}
    counts = {name: raw.get(name, 0) for name in SYNC_CALLS}
    if device.type == "cuda":
        counts["cudaDeviceSynchronize"] = max(0, counts["cudaDeviceSynchronize"] - 1)
    counts["Memcpy DtoH"] = sum(n for k, n in raw.items() if "DtoH" in k)
    counts["aten::_local_scalar_dense"] = raw.get("aten::_local_scalar_dense", 0)
    return counts


def profile_syncs(fn: Step, device: torch.device, *, steps: int) -> dict[str, Any]:
    """:func:`sync_counts` over ``steps`` calls of ``fn`` (after 3 unprofiled ones), with no
    synchronisation inside the profiled region but the one that closes it."""
    from torch.profiler import profile

    for _ in range(3):
        fn()
    sync(device)
    with profile(activities=activities(device)) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    counts = sync_counts(prof, device)
    raw = {e.key: int(e.count) for e in prof.key_averages()
           if any(s in e.key for s in ("Synchronize", "Memcpy", "aten::item",
                                       "_local_scalar_dense"))}
    return {"steps": steps, "raw_counts": raw,
            "excluded": {"cudaDeviceSynchronize": 1 if device.type == "cuda" else 0},
            "per_step": {k: v / steps for k, v in counts.items()},
            "host_syncs_per_step": sum(counts[k] for k in SYNC_CALLS) / steps,
            "dtoh_copies_per_step": counts["Memcpy DtoH"] / steps}


def guard_check(device: torch.device, cfg: st.Config, *, steps: int) -> dict[str, Any]:
    """The dpsgd method's steps under ``trainables.engine.host_reads.forbid_host_reads``."""
    try:
        from dpsweep.trainables.engine.host_reads import forbid_host_reads
    except ImportError as exc:
        return {"error": error_text(exc)}
    fn = method_step(cfg, device)
    fn()
    sync(device)
    try:
        with forbid_host_reads():
            for _ in range(steps):
                fn()
        sync(device)
    except Exception as exc:  # the guard's HostRead, or anything the step raised under it
        return {"raised": True, "steps": steps, "message": error_text(exc, 1000)}
    return {"raised": False, "steps": steps}


def syncs_section(device: torch.device, *, point: tuple[str, int], steps: int
                  ) -> dict[str, Any]:
    """Section 3 (the step alone): profiler counts for the dpsgd method's step and the engine
    step at ``point``, and the host-read guard on the method's step."""
    cfg = config(*point)
    out: dict[str, Any] = {"point": f"{point[0]}@{point[1]}"}
    if device.type != "cuda":
        out["note"] = ("CPU dry run: no CUDA runtime calls; a rule may read values on the CPU "
                       "outside forbid_host_reads, so the counts say nothing of a GPU")
    for entry, make in ((METHOD, method_step), (ENGINE, engine_step)):
        try:
            out[entry] = profile_syncs(make(cfg, device), device, steps=steps)
        except Exception as exc:
            out[entry] = {"error": error_text(exc)}
        release(device)
    try:
        out["forbid_host_reads"] = guard_check(device, cfg, steps=steps)
    except Exception as exc:
        out["forbid_host_reads"] = {"error": error_text(exc)}
    release(device)
    return out
