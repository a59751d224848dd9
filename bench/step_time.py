"""DP-SGD step time and peak memory as ratios to a non-private SGD step, per model.

Entries per model (same model, data, batch and thread count; timed in interleaved shuffled
rounds by ``bench.harness``): a non-private SGD step; our DP-SGD step on the book-keeping
engine (``trainables/engine/grad_engine.py``: per-layer norms, flat clipping coefficient min(1,
C/||g_i||), one weighted sum, Gaussian noise, SGD update); the same step on the ``torch.func`` vmap
path; Opacus's hooks (``GradSampleModule`` + ``DPOptimizer``) and Opacus's ghost clipping
(``grad_sample_mode="ghost"``: ``GradSampleModuleFastGradientClipping`` +
``DPOptimizerFastGradientClipping`` + ``DPLossFastGradientClipping``). Peak memory of each entry
comes from a fresh subprocess (see ``bench/harness.py``). Inputs are random tensors: step time does
not depend on pixel values. Results: ``bench/results/step_time.json``.

Registered DP methods vs DP-SGD (the acceptance's "every seed method <= 1.1x DP-SGD on the same
model"): every method of ``trainables.methods`` (``--methods``; default all) is built as
training builds it, a ``DPStep`` on the same model with its "paper" preset (values for modes it
does not run dropped, as the conformance suite does), in a DP-valid mode (its first one unless
``--methods name:mode`` says otherwise), a long constant-shape schedule (so no schedule-driven
change such as dpsgd_lf's late freeze happens while it is timed), reproducible noise and a
random public pool; entries ``method <name>``, timed in the same interleaved rounds as the other
entries. A timed call is one period of the method's public refresh (``public_refresh_every``,
derived from the batch for dp_adamilg and lm_dpsgd; 1 step for a method without one), so every
call holds exactly one refresh and the median is not a refresh-free step, or
``--method-steps`` steps for every method; times are reported per step. Each method's
ratios to the ``dpsgd`` method's step come from the same rounds (``methods_vs_dpsgd`` in the
results): the median of the per-round ratios (checked against the 1.1 target, as the engine's
time target is; it cancels the load common to one round) and their IQR, the ratio of medians,
the ratio of mean step times (amortises work rarer than one call, e.g. ww_dpsgd's probe every K
steps) and, with memory, the ratio of peak memory increases. Once-per-sweep prepared
parameters are given fixed stand-ins (``STANDINS``: lm_dpsgd's risk vector; its values do not
change the step's cost). A method that fails to build or step is reported, not fatal.

Stock torch / torchvision models (ResNet-18, ViT, LSTM, GRU, TransformerEncoder) are
``bench/stock_models.py``'s: it times our DP-SGD step through the user-model path against
Opacus's hooks and a non-private step, building the step as this module does.

Run from the repository root: ``.venv/bin/python -m bench.step_time [--quick] [--models ...]
[--methods ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import traceback
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
from dpsweep.core.errors import UserInputError
from dpsweep.trainables.dp.randomness import Randomness
from dpsweep.trainables.dp.step import DPStep, PublicData
from dpsweep.trainables.engine.grad_engine import GradEngine
from dpsweep.trainables.methods import METHODS, get_method, parse_series, series_name
from dpsweep.trainables.models.networks import LayeredModel, build_model

NUM_CLASSES = 10
LR = 0.1
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
NORM_EPS = 1e-6
#: Relative difference between two plans' median steps taken as noise on this machine.
PLAN_NOISE = 0.05
SEED = 0
QUIET_TIMEOUT_S = 600
BASELINE = "non-private"
#: Our step as a trial runs it: the plan measured on this machine before the first step.
ENGINE = "engine DP-SGD"
#: The same step on the cost model's plan (what the measured plan must never lose to).
COST_MODEL = "engine cost model"
ENTRIES = (BASELINE, ENGINE, COST_MODEL, "vmap DP-SGD", "opacus hooks", "opacus ghost")
OPACUS = ("opacus hooks", "opacus ghost")
#: The engine with one algorithm forced on every Linear / Conv2d (``--strategies``).
FORCED = ("engine ghost", "engine materialize")
#: Registered DP methods as entries: "method <series>" (``series_name``: "name[:mode]").
METHOD_PREFIX = "method "
#: The method every other method's step is compared with, and the acceptance's bound.
REFERENCE_METHOD = "dpsgd"
METHOD_TIME_TARGET = 1.1
#: The preset a method runs with (its declared defaults where it sets nothing).
METHOD_PRESET = "paper"
#: Steps of the calibrated schedule a benchmarked method gets (never reached).
SCHEDULE_STEPS = 10_000_000
#: Public (shadow) pool size for methods that draw public batches, and the expected batch's
#: sampling rate (accounting only; the Poisson batch itself is the fixed benchmark batch).
PUBLIC_POOL = 1024
SAMPLE_RATE = 0.01
#: Stand-ins for once-per-sweep prepared parameters (``DPStep.prepare``), by number of layers:
#: lm_dpsgd's stage 1 trains a shadow model and per-layer attacks; the per-step cost does not
#: depend on the risk values.
STANDINS: dict[str, Callable[[int], dict[str, Any]]] = {
    "lm_dpsgd": lambda layers: {"risk": [0.25] * layers},
}


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


def _ours(cfg: Config, strategy: str, *, measure: bool = False) -> Callable[[], None]:
    """DP-SGD as ``DPStep`` does it, on the engine: norms, clip coefficients, one sum, noise
    (``measure``: on the plan timed on this machine first, as a trial does)."""
    x, y = _data(cfg)
    model = _model(cfg)
    engine = GradEngine(model, strategy=strategy, max_physical_batch=cfg.batch)
    live = [True] * engine.num_layers
    if measure:
        engine.measure_plan(x, y, live=live)
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


def method_entry(series: str) -> str:
    return METHOD_PREFIX + series


def default_series(name: str) -> str:
    """The method in its first DP-valid mode (as ``series_name`` writes it)."""
    cls = get_method(name)
    for mode in cls.modes:
        if mode.dp_valid:
            return series_name(name, mode.name)
    raise ValueError(f"{name} has no DP-valid mode")


def method_params(name: str, mode: str, *, num_layers: int) -> dict[str, Any]:
    """The preset's values that ``mode`` reads, the stand-ins, the mode; validated."""
    cls = get_method(name)
    decl = cls.declaration()
    preset = cls.presets().get(METHOD_PRESET, {})
    values = {k: v for k, v in preset.items() if not decl[k].modes or mode in decl[k].modes}
    if name in STANDINS:
        values.update(STANDINS[name](num_layers))
    values["mode"] = mode
    return cls.validate_params(values)


def build_method(cfg: Config, series: str) -> DPStep:
    """A registered method on the config's model, as a trial builds it (see module doc)."""
    model = _model(cfg)
    g = torch.Generator().manual_seed(SEED + 2)
    public = PublicData(x=torch.randn(PUBLIC_POOL, *cfg.shape, generator=g),
                        y=torch.randint(0, NUM_CLASSES, (PUBLIC_POOL,), generator=g),
                        generator=torch.Generator().manual_seed(SEED + 3))
    return method_on(model, series, batch=cfg.batch, public=public)


def method_on(model: LayeredModel, series: str, *, batch: int, public: PublicData) -> DPStep:
    """A registered method (``METHOD[:MODE][@RANDOMNESS]``) on ``model``, as a trial builds it:
    its preset, a long constant-shape schedule, reproducible noise unless told otherwise."""
    series, _, kind = series.partition("@")
    name, mode = parse_series(series, field="--methods")
    cls = get_method(name)
    params = method_params(name, mode, num_layers=len(model.layer_names))
    schedule = cls.noise_shape(epochs=1, steps_per_epoch=SCHEDULE_STEPS,
                               params=params).scaled(NOISE_MULTIPLIER)
    method = cls(model=model, params=params, noise_schedule=schedule, sample_rate=SAMPLE_RATE,
                 expected_batch_size=float(batch), steps_per_epoch=SCHEDULE_STEPS,
                 randomness=Randomness(kind=kind or "reproducible", device=torch.device("cpu"),
                                       seed=SEED + 1 if kind in ("", "reproducible") else None),
                 public=public)
    if not method.dp_valid:
        raise ValueError(f"{series}: mode {mode!r} is not DP-valid ({method.validity_reason})")
    x, y = public.batch(batch)  # measured on public data, as a trial plans
    method.engine.measure_plan(x, y, live=method.trainable_layers())
    return method


def _method(cfg: Config, series: str, steps: int) -> Callable[[], None]:
    x, y = _data(cfg)
    method = build_method(cfg, series)

    def step() -> None:
        for _ in range(steps):
            method.step(x, y)

    return step


def make_step(*, model: str, entry: str, method_steps: int = 1) -> Callable[[], None]:
    """The step callable of one entry (module-level, so a memory subprocess can build it);
    a method entry's callable takes ``method_steps`` steps."""
    cfg = CONFIGS[model]
    if entry.startswith(METHOD_PREFIX):
        return _method(cfg, entry[len(METHOD_PREFIX):], method_steps)
    if entry == BASELINE:
        return _plain(cfg)
    if entry == ENGINE:
        return _ours(cfg, "auto", measure=True)
    if entry == COST_MODEL:
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


def _error(exc: BaseException) -> str:
    """One line for the table and the results, the traceback's last frame for context."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def refresh_period(cfg: Config, series: str) -> int:
    """Steps of one period of the method's public refresh on this config (1 without one)."""
    return build_method(cfg, series).public_refresh_every or 1


def _build_methods(cfg: Config, methods: list[str], *, steps: int | None,
                   failed: dict[str, str],
                   calls: dict[str, int]) -> dict[str, Callable[[], None]]:
    """Method entries that build and take one timed call (a failure is recorded, not fatal);
    ``calls`` receives each entry's steps per timed call (``steps``, or its refresh period)."""
    built: dict[str, Callable[[], None]] = {}
    for series in methods:
        try:
            n = steps or refresh_period(cfg, series)
            fn = make_step(model=cfg.model, entry=method_entry(series), method_steps=n)
            fn()  # a method that cannot step fails here, not in the middle of the rounds
        except Exception as exc:  # reported per method; the bench goes on
            failed[series] = _error(exc)
            print(f"   {method_entry(series)}: FAILED to build or step: {failed[series]}")
            continue
        built[method_entry(series)] = fn
        calls[method_entry(series)] = n
    return built


def compare_methods(times: dict[str, list[float]], methods: list[str],
                    peaks: dict[str, dict[str, Any]], *, steps: dict[str, int],
                    num_layers: int, failed: dict[str, str]) -> dict[str, Any]:
    """Each method's per-step time (and peak memory) as ratios to the reference method's."""
    ref_series = default_series(REFERENCE_METHOD)
    ref = method_entry(ref_series)
    out: dict[str, Any] = {
        "reference": ref, "target": METHOD_TIME_TARGET,
        "steps_per_timed_call": {e[len(METHOD_PREFIX):]: n for e, n in steps.items()},
        "preset": METHOD_PRESET,
        "checked_ratio": "ratio_per_round_median: median over rounds of the method's step "
                         "time / the reference's in the same round",
        "methods": {}, "failed": dict(failed)}
    timed = [s for s in methods if method_entry(s) in times]
    if ref not in times:
        out["error"] = f"the reference {ref} did not run: no ratios"
        return out
    vs = summarize({method_entry(s): times[method_entry(s)] for s in timed}, baseline=ref)
    ref_mean = statistics.fmean(times[ref])
    ref_peak = peaks.get(ref, {}).get("peak_delta_bytes")
    for series in timed:
        e = method_entry(series)
        name, mode = parse_series(series.partition("@")[0], field="--methods")
        v = vs[e]
        peak = peaks.get(e, {}).get("peak_delta_bytes")
        mem = None if peak is None or not ref_peak else peak / ref_peak
        out["methods"][series] = {
            "method": name, "mode": mode,
            "params": method_params(name, mode, num_layers=num_layers),
            "median_step_s": v["median_s"], "q1_step_s": v["q1_s"], "q3_step_s": v["q3_s"],
            "ratio": v["ratio"], "ratio_per_round_median": v["ratio_per_round_median"],
            "ratio_per_round_q1": v["ratio_per_round_q1"],
            "ratio_per_round_q3": v["ratio_per_round_q3"], "ratio_of_min": v["ratio_of_min"],
            "ratio_of_means": statistics.fmean(times[e]) / ref_mean,
            "memory_ratio": mem,
            # a randomness variant (METHOD@KIND) is the cost of a noise source, not a method:
            # reported, not held to the methods' target
            "meets_target": (None if "@" in series
                             else v["ratio_per_round_median"] <= METHOD_TIME_TARGET)}
    return out


def format_methods(cmp: dict[str, Any]) -> str:
    """Table of the methods' ratios to the reference method, with the target."""
    target = cmp["target"]
    lines = [f"registered methods vs {cmp['reference']} (steps per timed call: one public "
             f"refresh period, or 1; times per step; x dpsgd = median of per-round ratios, "
             f"target <= {target}; x medians = ratio of medians, x mean = ratio of means):",
             f"{'method':<22} {'mode':<9} {'steps':>5} {'median ms':>10} {'x dpsgd':>8} "
             f"{'(round IQR)':>13} {'x medians':>9} {'x mean':>7} {'x min':>6} "
             f"{'x memory':>9}  target"]
    for series, m in cmp["methods"].items():
        mem = "" if m["memory_ratio"] is None else f"{m['memory_ratio']:.2f}"
        lines.append(
            f"{series:<22} {m['mode']:<9} {cmp['steps_per_timed_call'].get(series, 1):>5} "
            f"{m['median_step_s'] * 1e3:>10.1f} "
            f"{m['ratio_per_round_median']:>8.2f} "
            f"{m['ratio_per_round_q1']:>6.2f}-{m['ratio_per_round_q3']:<6.2f} "
            f"{m['ratio']:>9.2f} {m['ratio_of_means']:>7.2f} "
            f"{m['ratio_of_min']:>6.2f} {mem:>9}  "
            + ("randomness cost (no target)" if m["meets_target"] is None else
               f"{'met' if m['meets_target'] else 'MISSED'} (<= {target})"))
    for series, err in cmp["failed"].items():
        lines.append(f"{series:<22} FAILED: {err}")
    if "error" in cmp:
        lines.append(cmp["error"])
    return "\n".join(lines)


def bench_model(cfg: Config, *, quick: bool, entries: list[str], memory: bool,
                rounds: int | None = None, max_load: float | None = None,
                methods: list[str] | None = None,
                method_steps: int | None = None) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    model = _model(cfg)
    engine = GradEngine(model, max_physical_batch=cfg.batch)
    engine.measure_plan(*_data(cfg), live=[True] * engine.num_layers)
    plan = engine.plan(_data(cfg)[0])
    print(f"\n== {cfg.model}: {cfg.shape}, batch {cfg.batch}, {cfg.threads} thread(s); "
          f"engine plan (measured here):")
    for p in plan:
        print("   " + p.describe())
    steps = {e: make_step(model=cfg.model, entry=e) for e in entries}
    methods = list(methods or [])
    failed: dict[str, str] = {}
    calls: dict[str, int] = {}
    method_steps_fns = _build_methods(cfg, methods, steps=method_steps, failed=failed,
                                      calls=calls)
    steps.update(method_steps_fns)
    rounds = rounds or (cfg.quick_rounds if quick else cfg.rounds)
    load = [wait_for_quiet(max_load=max_load, timeout_s=QUIET_TIMEOUT_S)
            if max_load else load_average()]
    times = interleaved(steps, rounds=rounds, warmup=1)
    # Per step: a method entry's timed call takes calls[e] steps.
    times = {e: [t / calls[e] for t in ts] if e in method_steps_fns else ts
             for e, ts in times.items()}
    summary = summarize(times, baseline=BASELINE)
    load.append(load_average())
    peaks: dict[str, dict[str, Any]] = {}
    mem_ratio: dict[str, float] = {}
    if memory:
        for e in list(steps):
            kwargs: dict[str, Any] = {"model": cfg.model, "entry": e}
            if e in method_steps_fns:
                kwargs["method_steps"] = calls[e]
            try:
                peaks[e] = peak_memory(factory="bench.step_time:make_step", kwargs=kwargs,
                                       threads=cfg.threads, warmup=1, steps=1)
            except RuntimeError as exc:
                if e not in method_steps_fns:
                    raise
                series = e[len(METHOD_PREFIX):]
                failed[f"{series} (memory)"] = _error(exc).splitlines()[-1]
        base = peaks[BASELINE]["peak_delta_bytes"]
        mem_ratio = {e: p["peak_delta_bytes"] / base if base else math.nan
                     for e, p in peaks.items()}
    print(f"{rounds} interleaved rounds; x time = median of per-round ratios to {BASELINE}, "
          f"x min = ratio of fastest runs; load average {load[0]:.1f} -> {load[1]:.1f}")
    print(format_table(summary, mem_ratio or None))
    result: dict[str, Any] = {
        "config": {"shape": list(cfg.shape), "batch": cfg.batch, "threads": cfg.threads,
                   "rounds": rounds, "load_average_before_after": load},
        "plan": [p.describe() for p in plan], "time": summary,
        "memory": {e: {**p, "ratio": mem_ratio[e]} for e, p in peaks.items()}}
    checks: dict[str, bool] = {}
    if ENGINE in summary:
        ours = summary[ENGINE]["ratio_per_round_median"]
        checks.update({f"faster than {o}": summary[ENGINE]["median_s"] < summary[o]["median_s"]
                       for o in OPACUS if o in summary})
        if cfg.time_target is not None:
            checks[f"time <= {cfg.time_target}x"] = ours <= cfg.time_target
        if COST_MODEL in summary:  # the measured plan never loses beyond the noise
            checks["measured plan <= cost model + noise"] = (
                summary[ENGINE]["median_s"]
                <= summary[COST_MODEL]["median_s"] * (1 + PLAN_NOISE))
        if cfg.memory_target is not None and mem_ratio:
            checks[f"memory <= {cfg.memory_target}x"] = mem_ratio[ENGINE] <= cfg.memory_target
    if methods:
        cmp = compare_methods(times, methods, peaks, steps=calls,
                              num_layers=len(model.layer_names), failed=failed)
        result["methods_vs_dpsgd"] = cmp
        print(format_methods(cmp))
        for series, m in cmp["methods"].items():
            if series != default_series(REFERENCE_METHOD) and m["meets_target"] is not None:
                checks[f"{series} <= {METHOD_TIME_TARGET}x dpsgd"] = m["meets_target"]
        for series in cmp["failed"]:
            checks[f"{series} steps"] = False
    if checks:
        print("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}"
                                      for k, v in checks.items()))
    result["targets"] = checks
    return result


#: Randomness sources timed against the reproducible reference by default (METHOD@KIND):
#: the secret default and secure_mode's os.urandom Gaussian (issue 10: its step-time cost).
RANDOMNESS_KINDS = ("secret", "secure")


def _method_series(ap: argparse.ArgumentParser, names: list[str] | None) -> list[str]:
    """``--methods`` as series, the reference first; each in a DP-valid mode."""
    out = [default_series(REFERENCE_METHOD)]
    for text in (names if names is not None else
                 sorted(METHODS) + [f"{REFERENCE_METHOD}@{k}" for k in RANDOMNESS_KINDS]):
        text, _, kind = text.partition("@")
        if kind and kind not in Randomness.KINDS:
            ap.error(f"--methods {text}@{kind}: randomness {kind!r} not in {Randomness.KINDS}")
        suffix = f"@{kind}" if kind else ""
        try:
            name, mode = parse_series(text, field="--methods")
        except UserInputError as exc:
            ap.error(str(exc))
        if ":" not in text:
            series = default_series(name)
        elif not get_method(name).mode_named(mode).dp_valid:
            ap.error(f"--methods {text}: mode {mode!r} is not DP-valid")
        else:
            series = series_name(name, mode)
        if series + suffix not in out:
            out.append(series + suffix)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few timing rounds")
    ap.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--strategies", action="store_true",
                    help="also time the engine with ghost / materialize forced everywhere")
    ap.add_argument("--entries", nargs="+", choices=list(ENTRIES) + list(FORCED),
                    help="time only these entries (the baseline is always included; methods "
                         "are chosen by --methods)")
    ap.add_argument("--methods", nargs="+", metavar="METHOD[:MODE]",
                    help=f"registered DP methods to time against {REFERENCE_METHOD} (default: "
                         f"all of {sorted(METHODS)}, each in its first DP-valid mode; "
                         f"{REFERENCE_METHOD} is always included)")
    ap.add_argument("--no-methods", action="store_true",
                    help=f"skip the registered methods (and the {METHOD_TIME_TARGET}x "
                         f"{REFERENCE_METHOD} check)")
    ap.add_argument("--method-steps", type=int,
                    help="consecutive steps per timed call of every method (default: each "
                         "method's public refresh period, so each call holds one refresh)")
    ap.add_argument("--rounds", type=int, help="override the rounds of every model")
    ap.add_argument("--threads", type=int,
                    help="override every model's thread count (1 thread is the least "
                         "sensitive to other jobs on a shared machine)")
    ap.add_argument("--max-load", type=float,
                    help="before timing each model, wait (up to 10 min) for the 1-minute load "
                         "average to drop below this (shared machines)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    ap.add_argument("--name", default="step_time", help="results file bench/results/NAME.json")
    args = ap.parse_args(argv)
    if args.method_steps is not None and args.method_steps < 1:
        ap.error("--method-steps must be >= 1")
    if args.no_methods and args.methods:
        ap.error("--methods and --no-methods exclude each other")
    methods = [] if args.no_methods else _method_series(ap, args.methods)
    entries = list(ENTRIES) + (list(FORCED) if args.strategies else [])
    if args.entries:
        entries = [BASELINE] + [e for e in args.entries if e != BASELINE]
    configs = {m: CONFIGS[m] if args.threads is None else
               dataclasses.replace(CONFIGS[m], threads=args.threads) for m in args.models}
    results = {m: bench_model(configs[m], quick=args.quick, entries=entries,
                              memory=not args.no_memory, rounds=args.rounds,
                              max_load=args.max_load, methods=methods,
                              method_steps=args.method_steps)
               for m in args.models}
    path = write_results(args.name, {
        "quick": args.quick, "torch": torch.__version__, "methods": methods,
        "method_steps": args.method_steps, "method_time_target": METHOD_TIME_TARGET,
        "models": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
