"""Our DP-SGD step against Opacus's hooks on stock torch / torchvision models (issue 32).

The models are the factories of ``examples/stock_models/stock_models.py`` (ResNet-18 with
GroupNorm, the same with only ``fc`` trainable, a small VisionTransformer, Embedding + LSTM,
Embedding + bidirectional GRU, a TransformerEncoder with a root-level positional parameter,
ResNet-18 with BatchNorm swapped for GroupNorm), at small sizes. Per model, three entries on the
same input batch, timed in interleaved shuffled rounds by ``bench.harness`` (same threads):

* ``non-private``: the factory's network, SGD on its trainable parameters, cross-entropy;
* ``dpsweep DP-SGD``: the network as a config's ``[model] factory`` gets it
  (``trainables.models.assemble.build_network``: ``trainables.models.validator.wrap_checked``
  with the default layers), then the ``dpsgd`` method's ``DPStep`` built as
  ``bench.step_time`` builds its method entries
  (``method_on``: paper preset, reproducible noise). A model the validator refuses is recorded as
  ``refused`` with its one-line reason, one that fails to build a step or to step as ``failed``:
  neither is timed;
* ``opacus hooks``: the network as an Opacus user runs it: ``ModuleValidator.fix`` when
  ``ModuleValidator.is_valid`` says so (LSTM -> DPLSTM, GRU -> DPGRU, MultiheadAttention ->
  DPMultiheadAttention, BatchNorm -> GroupNorm), ``GradSampleModule`` (hooks; Opacus itself
  falls back to ``torch.func`` for a module without a grad sampler that owns parameters, which
  is recorded) and ``DPOptimizer``. A model Opacus cannot step is recorded as ``n/a`` with the
  reason.

Each entry reports the median and IQR of its step times and the median (IQR) of its per-round
ratios to the non-private step; ``dpsweep DP-SGD`` also the median (IQR) of its per-round ratios
to ``opacus hooks``, held to the target (<= 1.0: no slower). Results:
``bench/results/step_time_stock.json`` (a full run; a subset of ``--models`` writes
``step_time_stock_partial.json``), whose table ``bench.docgen`` puts in
``docs/stock-models.md`` (a full run regenerates it).

Run from the repository root: ``.venv/bin/python -m bench.stock_models [--models ...]
[--rounds N] [--batch B] [--threads T]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.harness import (
    interleaved,
    load_average,
    summarize,
    wait_for_quiet,
    write_results,
)
from bench.step_time import (
    CLIP_NORM,
    LR,
    NOISE_MULTIPLIER,
    NUM_CLASSES,
    PUBLIC_POOL,
    QUIET_TIMEOUT_S,
    REFERENCE_METHOD,
    SEED,
    default_series,
    method_on,
)
from dpsweep.core.errors import UserInputError
from dpsweep.trainables.dp.step import PublicData
from dpsweep.trainables.models.assemble import build_network
from dpsweep.trainables.models.source import ModelSource
from dpsweep.trainables.models.usercode import resolve
from dpsweep.trainables.models.validator import sample_batch

ROOT = Path(__file__).resolve().parent.parent
#: The factories' folder: dpsweep imports them from here as it imports a user's code_dir.
STOCK_DIR = ROOT / "examples" / "stock_models"
BASELINE = "non-private"
OURS = "dpsweep DP-SGD"
OPACUS = "opacus hooks"
#: dpsweep's step over Opacus's (median of per-round ratios) must be at most this.
TARGET = 1.0
DEFAULT_ROUNDS = 21
DEFAULT_THREADS = 2
#: Batch sizes: images (ResNet-18's per-example work dominates) and token sequences.
IMAGE_BATCH = 32
TOKEN_BATCH = 64
RESULTS = "step_time_stock"
PARTIAL_RESULTS = "step_time_stock_partial"
#: Longest reason kept (the results keep the first line of the message, up to this).
REASON_CHARS = 400
#: An error message (not a refusal) longer than this keeps its first sentence only.
SENTENCE_CHARS = 160


def load_stock() -> ModuleType:
    """``examples/stock_models/stock_models.py``, imported as dpsweep imports a user's factory
    (its folder first on ``sys.path``; Opacus's own top-level ``examples`` package would shadow
    ``examples.stock_models``)."""
    fn = resolve(field="model.factory", reference="stock_models:build_lstm", code_dir=STOCK_DIR)
    return sys.modules[fn.__module__]


def stock(name: str) -> Any:
    return load_stock().STOCK[name]


def default_batch(name: str) -> int:
    return TOKEN_BATCH if stock(name).tokens else IMAGE_BATCH


def describe_input(name: str, batch: int) -> str:
    s = stock(name)
    shape = ", ".join(str(d) for d in (batch, *s.input_shape))
    return f"token ids [{shape}] int64" if s.tokens else f"images [{shape}] float32"


def _data(name: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 4)
    return (stock(name).sample(batch, seed=SEED),
            torch.randint(0, NUM_CLASSES, (batch,), generator=g))


def _net(name: str, *, fixed: bool = True) -> nn.Module:
    """The factory's network (a ``fix`` model's BatchNorms replaced unless ``fixed=False``)."""
    torch.manual_seed(SEED)
    return stock(name).build(NUM_CLASSES, fixed=fixed)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def error_line(exc: BaseException) -> str:
    """The exception's first line (a refusal's one line as dpsweep prints it), and for any other
    exception its type, its first sentence and the deepest frame outside torch itself."""
    text = (str(exc).strip().splitlines() or [""])[0]
    if not isinstance(exc, UserInputError) and len(text) > SENTENCE_CHARS and ". " in text:
        text = text.split(". ", 1)[0] + "."  # torch's long explanations: the first sentence
    if len(text) > REASON_CHARS:
        text = text[:REASON_CHARS].rstrip() + "..."
    if isinstance(exc, UserInputError):
        return text
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename]
    where = (f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno}"
             + (f" `{frames[-1].line}`" if frames[-1].line else "") + ")") if frames else ""
    return f"{type(exc).__name__}: {text}{where}"


def plain_step(name: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    net = _net(name)
    opt = torch.optim.SGD(_trainable(net), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    return step


def ours_step(name: str, x: torch.Tensor,
              y: torch.Tensor) -> tuple[Callable[[], None] | None, dict[str, Any]]:
    """dpsweep's DP-SGD step on the model as a config's factory gets it, or why not."""
    s = stock(name)
    torch.manual_seed(SEED)
    try:
        source = ModelSource(factory=s.reference, code_dir=str(STOCK_DIR),
                             **({"fix": True} if s.fix else {}))
        model = build_network(source, input_shape=s.input_shape, num_classes=NUM_CLASSES,
                              dataset="file",
                              sample=sample_batch(input_shape=s.input_shape, tokens=s.tokens))
    except UserInputError as exc:
        return None, {"status": "refused", "reason": error_line(exc)}
    except Exception as exc:  # a crash while building is dpsweep's bug: recorded, not fatal
        return None, {"status": "failed", "reason": error_line(exc)}
    fixes = Counter(f"{r['was'].split('(')[0]} -> {r['kind']}"
                    for r in getattr(model, "model_fixes", None) or [])
    info: dict[str, Any] = {"path": getattr(model, "per_example_path", None),
                            "layers": list(model.layer_names),
                            "fixed": [f"{n} x {swap}" for swap, n in sorted(fixes.items())]}
    try:
        public = PublicData(x=s.sample(PUBLIC_POOL, seed=SEED + 2),
                            y=torch.randint(0, NUM_CLASSES, (PUBLIC_POOL,)),
                            generator=torch.Generator().manual_seed(SEED + 3))
        method = method_on(model, default_series(REFERENCE_METHOD), batch=len(x),
                           public=public)

        def step() -> None:
            method.step(x, y)

        step()  # a step that cannot run fails here, not in the middle of the rounds
    except Exception as exc:  # recorded per model; the bench goes on
        return None, {**info, "status": "failed", "reason": error_line(exc)}
    return step, {**info, "status": "ok"}


def _opacus_fix(net: nn.Module) -> tuple[nn.Module, list[str]]:
    """``ModuleValidator.fix`` where Opacus says the model needs it, and what it replaced."""
    from opacus.validators import ModuleValidator

    if ModuleValidator.is_valid(net):
        return net, []
    before = {n: type(m).__name__ for n, m in net.named_modules()}
    fixed = ModuleValidator.fix(net)
    swapped: list[str] = []  # replaced modules, not the submodules of a replacement
    swaps: Counter[str] = Counter()
    for n, m in fixed.named_modules():
        if (n in before and before[n] != type(m).__name__
                and not any(n.startswith(p + ".") for p in swapped)):
            swapped.append(n)
            swaps[f"{before[n]} -> {type(m).__name__}"] += 1
    return fixed, [f"{k} x {swap}" for swap, k in sorted(swaps.items())]


def opacus_step(name: str, x: torch.Tensor,
                y: torch.Tensor) -> tuple[Callable[[], None] | None, dict[str, Any]]:
    """Opacus's hooks (GradSampleModule + DPOptimizer) as its users run them, or why not."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    info: dict[str, Any] = {"fixed": [], "functorch": []}
    try:
        net, info["fixed"] = _opacus_fix(_net(name, fixed=False))
        gsm = GradSampleModule(net, batch_first=True, loss_reduction="mean")
        info["functorch"] = [n or "(root)" for n, m in net.named_modules()
                             if hasattr(m, "ft_compute_sample_grad")]
        opt = DPOptimizer(torch.optim.SGD(_trainable(gsm), lr=LR),
                          noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM,
                          expected_batch_size=len(x))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(gsm(x), y).backward()
            opt.step()

        step()
    except Exception as exc:  # Opacus cannot run this model: recorded, not fatal
        return None, {**info, "status": "n/a", "reason": error_line(exc)}
    return step, {**info, "status": "ok"}


def _versus(times: dict[str, list[float]]) -> dict[str, float] | None:
    """Our step over Opacus's: median (IQR) of the per-round ratios, ratio of medians."""
    if OURS not in times or OPACUS not in times:
        return None
    r = summarize({OURS: times[OURS], OPACUS: times[OPACUS]}, baseline=OPACUS)[OURS]
    return {"median": r["ratio_per_round_median"], "q1": r["ratio_per_round_q1"],
            "q3": r["ratio_per_round_q3"], "ratio_of_medians": r["ratio"],
            "ratio_of_min": r["ratio_of_min"]}


def bench_model(name: str, *, batch: int, rounds: int, threads: int,
                max_load: float | None = None) -> dict[str, Any]:
    """One stock model's row: the three entries in interleaved rounds (see the module doc)."""
    torch.set_num_threads(threads)
    x, y = _data(name, batch)
    started = time.perf_counter()
    steps = {BASELINE: plain_step(name, x, y)}
    ours, ours_info = ours_step(name, x, y)
    theirs, opacus_info = opacus_step(name, x, y)
    for entry, fn in ((OURS, ours), (OPACUS, theirs)):
        if fn is not None:
            steps[entry] = fn
    print(f"\n== {name}: {describe_input(name, batch)}, {threads} thread(s), {rounds} rounds")
    print(f"   dpsweep: {ours_info['status']} {ours_info.get('reason') or ours_info['path']}")
    print(f"   opacus: {opacus_info['status']} {opacus_info.get('reason') or ''}"
          f" fixed={opacus_info['fixed']} functorch={opacus_info['functorch']}")
    load = [wait_for_quiet(max_load=max_load, timeout_s=QUIET_TIMEOUT_S)
            if max_load else load_average()]
    times = interleaved(steps, rounds=rounds, warmup=1)
    load.append(load_average())
    summary = summarize(times, baseline=BASELINE)
    versus = _versus(times)
    for entry, s in summary.items():
        print(f"   {entry:<16} {s['median_s'] * 1e3:>9.1f} ms "
              f"(IQR {s['q1_s'] * 1e3:.1f}-{s['q3_s'] * 1e3:.1f}) "
              f"x non-private {s['ratio_per_round_median']:.2f}")
    if versus is not None:
        print(f"   dpsweep / opacus hooks: {versus['median']:.2f} "
              f"(IQR {versus['q1']:.2f}-{versus['q3']:.2f}), target <= {TARGET}")
    return {"input": describe_input(name, batch), "batch": batch, "threads": threads,
            "rounds": rounds, "reference": stock(name).reference,
            "trainable_params": sum(p.numel() for p in _trainable(_net(name))),
            "ours": ours_info, "opacus": opacus_info, "time": summary,
            "ours_vs_opacus": versus,
            "within_target": None if versus is None else versus["median"] <= TARGET,
            "load_average_before_after": load,
            "wall_s": time.perf_counter() - started}


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_info(*, rounds: int, threads: int) -> dict[str, Any]:
    """What a reader needs to judge the numbers: versions, commit, machine, settings."""
    import opacus
    import torchvision

    return {"bench": "bench.stock_models",
            "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
            "torch": torch.__version__, "torchvision": torchvision.__version__,
            "opacus": opacus.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": threads,
            "rounds": rounds, "target": TARGET, "entries": [BASELINE, OURS, OPACUS],
            "timed": "interleaved shuffled rounds, one warm-up call each; ratios are medians "
                     "(IQR) of per-round ratios"}


def _regenerate_docs() -> None:
    from bench.docgen import blocks as docgen

    path = docgen.ROOT / docgen.STOCK_DOC
    path.write_text(docgen.render(path.read_text(), "stock_speed"))
    print(f"regenerated {docgen.STOCK_DOC}")


def main(argv: list[str] | None = None) -> None:
    names = list(load_stock().STOCK)
    ap = argparse.ArgumentParser(prog="python -m bench.stock_models",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=names, default=names)
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                    help=f"interleaved timing rounds per model (default {DEFAULT_ROUNDS})")
    ap.add_argument("--batch", type=int, help=f"batch size of every model (default "
                                               f"{IMAGE_BATCH} images, {TOKEN_BATCH} tokens)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                    help=f"torch threads (default {DEFAULT_THREADS})")
    ap.add_argument("--max-load", type=float,
                    help="before timing each model, wait (up to 10 min) for the 1-minute load "
                         "average to drop below this (shared machines)")
    ap.add_argument("--name", help=f"results file bench/results/NAME.json (default {RESULTS} "
                                   f"for all models, else {PARTIAL_RESULTS})")
    args = ap.parse_args(argv)
    if args.rounds < 1 or (args.batch is not None and args.batch < 2) or args.threads < 1:
        ap.error("--rounds and --threads must be >= 1, --batch >= 2")
    warnings.filterwarnings("ignore", module=r"opacus(\.|$)")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    name = args.name or (RESULTS if args.models == names else PARTIAL_RESULTS)
    started = time.perf_counter()
    rows = {m: bench_model(m, batch=args.batch or default_batch(m), rounds=args.rounds,
                           threads=args.threads, max_load=args.max_load)
            for m in args.models}
    payload = {**run_info(rounds=args.rounds, threads=args.threads), "models": rows,
               "order": list(rows),  # the results file sorts its keys
               "wall_s": time.perf_counter() - started}
    path = write_results(name, payload)
    from bench.docgen.blocks import stock_speed_markdown

    print("\n" + stock_speed_markdown(payload))
    print(f"\nwrote {path} ({payload['wall_s']:.0f} s)")
    if name == RESULTS:
        _regenerate_docs()


if __name__ == "__main__":
    main()
