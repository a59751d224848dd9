"""The CUDA path on a GPU machine: correctness of the per-example engine, every method's step,
and step-time ratios, in one short run (a lent machine's device time is scarce).

1. **Norms.** Per-layer per-example norms and weighted sums of the engine (auto, ghost,
   materialize) against the exact ``torch.func`` path, in float32 with TF32 off (what training
   sets, ``trainables.training.full_float32``) and in float64: cnn28 and the every-module token
   model of the conformance suite (Embedding, LayerNorm, Conv1d, GroupNorm, Conv2d, Linear).
2. **Methods.** Every registered method (its first DP-valid mode, the paper preset) takes steps
   on cnn28 on the GPU; its parameters stay finite and move.
3. **Step time.** Non-private SGD, our DP-SGD step (engine), the vmap path and, when Opacus
   imports, its hooks and ghost clipping, per model at the CPU benchmark's batches and at a
   GPU-sized batch, timed with ``torch.cuda.synchronize`` in interleaved shuffled rounds
   (``bench.harness.interleaved``); ratios to the non-private step are medians of per-round
   ratios.

    python -m bench.cuda_check [--rounds 20] [--out DIR]

Writes ``cuda_check.json`` into ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import step_time as st
from bench.harness import interleaved
from tests.contract.conformance import every_module_model, token_task
from trainables.engine import GradEngine
from trainables.methods import METHODS
from trainables.training import full_float32

#: (model, batch) pairs timed: the CPU benchmark's batches, then a batch a GPU is sized for.
TIMED = (("cnn28", 256), ("cnn28", 2048), ("cnn5", 256), ("resnet20_gn", 128),
         ("resnet20_gn", 512), ("wrn16_4", 64), ("wrn16_4", 256))
STRATEGIES = ("auto", "ghost", "materialize")
METHOD_STEPS = 5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().clamp_min(1e-300)
    return float(((a - b).abs().max() / scale).item())


def _compare(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    layers = len(model.layer_names)
    live = [True] * layers
    dtype = next(model.parameters()).dtype
    coef = torch.rand(len(y), layers, dtype=dtype,
                      generator=torch.Generator().manual_seed(1)).to(x.device)
    ref = GradEngine(model, strategy="vmap").compute(x, y, live=live)
    ref_sum = ref.weighted_sum(coef)
    out: dict[str, float] = {}
    for strategy in STRATEGIES:
        view = GradEngine(model, strategy=strategy).compute(x, y, live=live)
        sums = view.weighted_sum(coef)
        out[f"{strategy} norms"] = _rel(view.norms, ref.norms)
        out[f"{strategy} sums"] = max(_rel(sums[k], ref_sum[k]) for k in ref_sum)
    return out


def norms_check(device: torch.device) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        cnn = st.build_model(name="cnn28", input_shape=(1, 28, 28), num_classes=10).to(
            device, dtype)
        x = torch.randn(64, 1, 28, 28, device=device, dtype=dtype)
        y = torch.randint(0, 10, (64,), device=device)
        results[f"cnn28 {str(dtype)[6:]}"] = _compare(cnn, x, y)
        tokens = every_module_model().to(device, dtype)
        tx, ty = token_task(64, seed=3)
        results[f"token {str(dtype)[6:]}"] = _compare(tokens, tx.to(device), ty.to(device))
    return results


def methods_check(device: torch.device) -> dict[str, Any]:
    from trainables.dp_step import PublicData
    from trainables.randomness import Randomness

    cfg = st.CONFIGS["cnn28"]
    x, y = (t.to(device) for t in st._data(cfg))
    out: dict[str, Any] = {}
    for name in sorted(METHODS):
        series = st.default_series(name)
        try:
            _, mode = st.parse_series(series, field="method")
            model = st._model(cfg).to(device)
            before = [p.detach().clone() for p in model.parameters()]
            params = st.method_params(name, mode, num_layers=len(model.layer_names))
            cls = METHODS[name]
            schedule = cls.noise_shape(epochs=1, steps_per_epoch=st.SCHEDULE_STEPS,
                                       params=params).scaled(st.NOISE_MULTIPLIER)
            g = torch.Generator().manual_seed(5)
            public = PublicData(x=torch.randn(st.PUBLIC_POOL, *cfg.shape, generator=g).to(device),
                                y=torch.randint(0, 10, (st.PUBLIC_POOL,), generator=g).to(device),
                                generator=torch.Generator().manual_seed(6))
            method = cls(model=model, params=params, noise_schedule=schedule,
                         sample_rate=st.SAMPLE_RATE, expected_batch_size=float(cfg.batch),
                         steps_per_epoch=st.SCHEDULE_STEPS,
                         randomness=Randomness(kind="secret", device=device, seed=None),
                         public=public)
            for _ in range(METHOD_STEPS):
                method.step(x, y)
            _sync(device)
            after = list(model.parameters())
            out[series] = {
                "finite": all(bool(torch.isfinite(p).all()) for p in after),
                "moved": all(not torch.equal(a, b) for a, b in zip(after, before, strict=True)),
                "guard_capped": int(method.guard_capped)}
        except Exception as exc:  # reported, the check goes on
            out[series] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _synced(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    def call() -> None:
        fn()
        _sync(device)
    return call


def _engine_step(cfg: st.Config, device: torch.device,
                 strategy: str = "auto") -> Callable[[], None]:
    """``bench.step_time``'s DP-SGD step (norms, flat clip, one sum, noise, SGD) on ``device``."""
    x, y = (t.to(device) for t in st._data(cfg))
    model = st._model(cfg).to(device)
    engine = GradEngine(model, strategy=strategy, max_physical_batch=cfg.batch)
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


def _on(device: torch.device) -> None:
    """Patch the CPU benchmark's builders so models and batches land on ``device``."""
    model, data = st._model, st._data
    st._model = lambda c: model(c).to(device)  # type: ignore[assignment]
    st._data = lambda c: tuple(t.to(device) for t in data(c))  # type: ignore[assignment]


def timing(device: torch.device, rounds: int,
           timed: tuple[tuple[str, int], ...] = TIMED) -> dict[str, Any]:
    import dataclasses

    _on(device)
    entries = [st.BASELINE, st.ENGINE, "vmap DP-SGD", *st.OPACUS]
    results: dict[str, Any] = {}
    for model, batch in timed:
        key = f"{model}@{batch}"
        st.CONFIGS[key] = dataclasses.replace(st.CONFIGS[model], batch=batch)
        built: dict[str, Callable[[], None]] = {}
        failed: dict[str, str] = {}
        for entry in entries:
            try:
                fn = (_engine_step(st.CONFIGS[key], device) if entry == st.ENGINE
                      else _engine_step(st.CONFIGS[key], device, "vmap")
                      if entry == "vmap DP-SGD" else st.make_step(model=key, entry=entry))
                fn()
                built[entry] = _synced(fn, device)
            except Exception as exc:  # e.g. Opacus missing, or out of memory: reported
                failed[entry] = f"{type(exc).__name__}: {str(exc)[:200]}"
        times = interleaved(built, rounds=rounds, warmup=3)
        base = times[st.BASELINE]
        summary = {}
        for entry, ts in times.items():
            ratios = [t / b for t, b in zip(ts, base, strict=True)]
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            summary[entry] = {"median_ms": 1e3 * statistics.median(ts),
                              "ratio_median": statistics.median(ratios),
                              "ratio_iqr": [q[0], q[2]]}
        results[key] = {"entries": summary, "failed": failed}
        print(f"{model} batch {batch}: " + ", ".join(
            f"{e} {s['median_ms']:.2f} ms ({s['ratio_median']:.2f}x)" for e, s in summary.items())
              + (f"; failed {failed}" if failed else ""), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--device", default="cuda", help="cpu for a dry run of the script")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device")
        full_float32()
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    report: dict[str, Any] = {"device": name,
                              "torch": torch.__version__, "python": platform.python_version()}
    report["norms"] = norms_check(device)
    print(json.dumps(report["norms"], indent=1), flush=True)
    report["methods"] = methods_check(device)
    print(json.dumps(report["methods"], indent=1), flush=True)
    report["timing"] = timing(device, args.rounds,
                              TIMED if device.type == "cuda" else TIMED[:1])
    report["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_check.json").write_text(json.dumps(report, indent=1, default=str))
    worst = max(v for r in report["norms"].values() for v in r.values())
    print(f"worst relative difference {worst:.2e}; {report['seconds']:.0f} s", flush=True)
    if not math.isfinite(worst):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
