"""What ``secure`` randomness costs per DP step against the default ``secret`` randomness.

``secret`` draws noise and batches from torch's generators keyed by fresh OS entropy
(``trainables/dp/randomness.py``); ``secure`` draws them from ``os.urandom`` on the host with
the summed Box–Muller Gaussian. Per model (``bench.step_time.CONFIGS``: its batch, threads and
random inputs), two kinds of entry are timed in the same interleaved, shuffled rounds
(``bench.harness.interleaved``):

- ``step <kind>``: the dpsgd method's DP step as a trial builds it
  (``bench.step_time.make_step``, entry ``method dpsgd@<kind>``): per-example norms, clipping,
  the sum, the noise for every parameter, the update;
- ``sample <kind>``: one Poisson batch of the model's dataset size at the step's expected batch
  (``Randomness.poisson_indices``), which the loader draws once per step outside the DP step.

Reported per model: the median and IQR of the per-round ratio secure / secret for the step
(the headline), for the batch draw, and for the two together (one training step's randomness
and work), each with the medians in seconds. Results: ``bench/results/secure_cost.json``.

Run from the repository root: ``.venv/bin/python -m bench.secure_cost [--models ...]
[--rounds N]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bench.harness import interleaved, load_average, summarize, write_results
from bench.step_time import CONFIGS, REFERENCE_METHOD, default_series, make_step, method_entry
from dpsweep.trainables.dp.randomness import Randomness

#: The models of the figure: the digits CNN and ResNet-20 with GroupNorm.
MODELS = ("cnn28", "resnet20_gn")
#: Examples per dataset the batch is drawn from (MNIST / Fashion-MNIST; CIFAR-10).
POPULATION = {"cnn28": 60_000, "resnet20_gn": 50_000}
#: Interleaved rounds per model by default (a few: the machine is shared and small).
DEFAULT_ROUNDS = {"cnn28": 40, "resnet20_gn": 20}
REFERENCE = "secret"
CANDIDATE = "secure"
KINDS = (REFERENCE, CANDIDATE)
STEP = "step"
SAMPLE = "sample"
TOTAL = "step+sample"
RESULTS_NAME = "secure_cost"


def _entry(part: str, kind: str) -> str:
    return f"{part} {kind}"


def _sampler(*, kind: str, n: int, batch: int) -> Callable[[], None]:
    """One Poisson batch of ``range(n)`` at the rate that expects ``batch`` examples."""
    source = Randomness(kind=kind, device=torch.device("cpu"))
    rate = batch / n

    def draw() -> None:
        source.poisson_indices(n, rate=rate)

    return draw


def _ratio(times: Mapping[str, list[float]], part: str) -> dict[str, float]:
    """Median and IQR of the per-round ratio secure / secret of ``part`` (and its medians)."""
    pair = {k: times[_entry(part, k)] for k in KINDS}
    summary = summarize(pair, baseline=REFERENCE)[CANDIDATE]
    return {"ratio_median": summary["ratio_per_round_median"],
            "ratio_q1": summary["ratio_per_round_q1"],
            "ratio_q3": summary["ratio_per_round_q3"],
            "ratio_of_medians": summary["ratio"],
            f"{REFERENCE}_median_s": statistics.median(pair[REFERENCE]),
            f"{CANDIDATE}_median_s": summary["median_s"]}


def _with_total(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """``times`` plus per-round step + sample sums for each kind."""
    out = dict(times)
    for kind in KINDS:
        out[_entry(TOTAL, kind)] = [s + b for s, b in zip(
            times[_entry(STEP, kind)], times[_entry(SAMPLE, kind)], strict=True)]
    return out


def bench_model(model: str, *, rounds: int) -> dict[str, Any]:
    """Time one model's step and batch draw under both kinds; the ratios (module doc)."""
    cfg = CONFIGS[model]
    torch.set_num_threads(cfg.threads)
    series = default_series(REFERENCE_METHOD)
    entries: dict[str, Callable[[], object]] = {}
    for kind in KINDS:
        entries[_entry(STEP, kind)] = make_step(model=model,
                                                entry=method_entry(f"{series}@{kind}"))
        entries[_entry(SAMPLE, kind)] = _sampler(kind=kind, n=POPULATION[model],
                                                 batch=cfg.batch)
    load = [load_average()]
    times = _with_total(interleaved(entries, rounds=rounds, warmup=1))
    load.append(load_average())
    result = {part: _ratio(times, part) for part in (STEP, SAMPLE, TOTAL)}
    for part, r in result.items():
        print(f"{model:<12} {part:<12} secure/secret {r['ratio_median']:.3f} "
              f"(IQR {r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}); medians "
              f"{r['secret_median_s'] * 1e3:.1f} ms / {r['secure_median_s'] * 1e3:.1f} ms")
    return {"config": {"shape": list(cfg.shape), "batch": cfg.batch, "threads": cfg.threads,
                       "population": POPULATION[model], "rounds": rounds, "method": series,
                       "load_average_before_after": load},
            "ratios": result, "times_s": times}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rounds", type=int, help="override every model's interleaved rounds")
    ap.add_argument("--name", default=RESULTS_NAME, help="results file bench/results/NAME.json")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    models = {m: bench_model(m, rounds=args.rounds or DEFAULT_ROUNDS[m]) for m in args.models}
    path = write_results(args.name, {
        "torch": torch.__version__, "reference": REFERENCE, "candidate": CANDIDATE,
        "ratio": f"per-round {CANDIDATE} / {REFERENCE} time: median and quartiles",
        "models": models})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
