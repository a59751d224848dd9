"""What privacy accounting costs: the cold ``dpsweep budget`` command, calibrations, curves, checks.

Entries (each repeated, medians reported, wall and CPU seconds; CPU is what a shared machine's
load distorts least):

* ``cli_cold``: ``python -m orchestrator.cli budget --epsilon 3 --delta 1e-5 --sample-rate
  0.004267 --steps 2344`` in a fresh process (interpreter start, imports, forked PRV child);
  ``cli_cached_cold`` the same question answered from a verified cache hit in a fresh process
  (why the command does not read the cache); ``python_bare`` and ``import_numpy_scipy_special``
  put the first number in proportion.
* ``calibrate_constant`` / ``calibrate_20_phases``: ``calibrate(use_cache=False)`` in this
  process (the PRV child is a fresh interpreter here, since numpy's thread pool rules out fork),
  and ``prv_search_*`` the child's computation alone (RDP bracket, coarse aim, one fine
  composition).
* ``curve_constant_20`` / ``curve_20_phases``: the epsilon after each of 20 epochs.
* ``verify_constant`` / ``verify_20_phases``: the independent check of a cache hit (dp_accounting's
  PLD at two resolutions and the one-step bound), after ``import_dp_accounting``.
* with ``--with-prv-accountant``: the same fine composition and 20-point curve with the
  prv-accountant library (long double), as the previous implementation ran them.

Run from the repository root: ``.venv/bin/python -m bench.accountant_time [--rounds N]``.
Results: ``bench/results/accountant_time.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import load_average, write_results

REPO = Path(__file__).resolve().parents[1]
Q, STEPS, DELTA, EPSILON = 0.004267, 2344, 1e-5, 3.0
EPOCHS = 20
STEPS_PER_EPOCH = STEPS // EPOCHS
#: AdamILG-like decay of the relative multiplier per epoch (the 20-phase shape).
DECAY = 0.1
CLI_ARGS = ["budget", "--epsilon", str(EPSILON), "--delta", str(DELTA), "--sample-rate", str(Q),
            "--steps", str(STEPS)]
DEFAULT_ROUNDS = 5


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _fresh(args: list[str], *, env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of a fresh interpreter, children included."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, cwd=REPO, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return time.perf_counter() - t0, _children_cpu() - cpu0


def _in_process(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``, PRV children included."""
    cpu0, child0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - cpu0 + _children_cpu() - child0


def _record(results: dict[str, Any], name: str, runs: list[tuple[float, float]]) -> None:
    results[name] = {"wall_median_s": statistics.median(w for w, _ in runs),
                     "cpu_median_s": statistics.median(c for _, c in runs),
                     "wall_s": [w for w, _ in runs], "cpu_s": [c for _, c in runs]}
    print(f"{name:<30} wall {results[name]['wall_median_s']:7.3f} s   "
          f"cpu {results[name]['cpu_median_s']:7.3f} s   ({len(runs)} runs)", flush=True)


def _shape() -> Any:
    from dpsweep.core.schedule import Phase, Schedule

    return Schedule(tuple(Phase(noise_multiplier=1 / (1 + DECAY * e), steps=STEPS_PER_EPOCH)
                          for e in range(EPOCHS)))


def _cold_entries(results: dict[str, Any], rounds: int) -> None:
    _record(results, "python_bare", [_fresh(["-c", "pass"]) for _ in range(rounds)])
    _record(results, "import_numpy_scipy_special",
            [_fresh(["-c", "import numpy, scipy.special"]) for _ in range(rounds)])
    _record(results, "cli_cold", [_fresh(["-m", "dpsweep.orchestrator.cli", *CLI_ARGS])
                                  for _ in range(rounds)])
    with tempfile.TemporaryDirectory() as cache:
        env = {"DPSWEEP_CACHE_DIR": cache}
        fill = ("from dpsweep.orchestrator.accounting import calibrate; "
                f"calibrate(target_epsilon=3.0, delta={DELTA}, sample_rate={Q}, steps={STEPS})")
        _fresh(["-c", fill], env=env)
        _record(results, "cli_cached_cold", [_fresh(["-c", fill], env=env)
                                             for _ in range(rounds)])


def _warm_entries(results: dict[str, Any], rounds: int) -> None:
    from dpsweep.orchestrator.accounting import calibrate, epsilon_curve, verify_calibration
    from dpsweep.orchestrator.accounting.search import fine_eps_error, prv_calibrate

    shape = _shape()
    job = {"multipliers": [1.0], "steps": [STEPS], "sample_rate": Q, "delta": DELTA,
           "target": EPSILON, "eps_error": fine_eps_error(EPSILON)}
    job20 = {**job, "multipliers": [p.noise_multiplier for p in shape.phases],
             "steps": [p.steps for p in shape.phases]}
    prv_calibrate(**job)  # warm imports
    _record(results, "prv_search_constant",
            [_in_process(lambda: prv_calibrate(**job)) for _ in range(rounds)])
    _record(results, "prv_search_20_phases",
            [_in_process(lambda: prv_calibrate(**job20)) for _ in range(rounds)])
    cals: dict[str, Any] = {}

    def constant() -> None:
        cals["constant"] = calibrate(target_epsilon=EPSILON, delta=DELTA, sample_rate=Q,
                                     steps=STEPS, use_cache=False)

    def phases() -> None:
        cals["phases"] = calibrate(target_epsilon=EPSILON, delta=DELTA, sample_rate=Q,
                                   shape=shape, use_cache=False)

    _record(results, "calibrate_constant", [_in_process(constant) for _ in range(rounds)])
    _record(results, "calibrate_20_phases", [_in_process(phases) for _ in range(rounds)])
    at = [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    for name, cal in (("constant_20", cals["constant"]), ("20_phases", cals["phases"])):
        _record(results, f"curve_{name}",
                [_in_process(lambda c=cal: epsilon_curve(c, at_steps=at))
                 for _ in range(rounds)])
    _record(results, "import_dp_accounting",
            [_fresh(["-c", "import dp_accounting"]) for _ in range(rounds)])
    checks = {}
    for name, cal in (("constant", cals["constant"]), ("20_phases", cals["phases"])):
        checks[name] = verify_calibration(cal)
        _record(results, f"verify_{name}",
                [_in_process(lambda c=cal: verify_calibration(c)) for _ in range(rounds)])
    results["calibrations"] = {
        name: {"noise_multiplier": cal.noise_multiplier, "scale": cal.scale,
               "bounds": cal.bounds.to_dict(), "pld_epsilon": checks[name].pld_epsilon,
               "pld_error": checks[name].pld_error, "interval": checks[name].interval}
        for name, cal in (("constant", cals["constant"]), ("20_phases", cals["phases"]))}


def _prv_accountant_entries(results: dict[str, Any], rounds: int) -> None:
    import warnings

    import numpy as np
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    sigma = results["calibrations"]["constant"]["noise_multiplier"]
    at = [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]

    def fine(points: list[int]) -> None:
        prv = PoissonSubsampledGaussianMechanism(sampling_probability=Q, noise_multiplier=sigma)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            acc = PRVAccountant(prvs=[prv], max_self_compositions=[STEPS], eps_error=0.006,
                                delta_error=DELTA * 1e-3)
            for k in points:
                acc.compute_epsilon(delta=DELTA, num_self_compositions=[k])

    _record(results, "prv_accountant_fine_composition",
            [_in_process(lambda: fine([STEPS])) for _ in range(rounds)])
    _record(results, "prv_accountant_curve_20", [_in_process(lambda: fine(at))
                                                 for _ in range(max(1, rounds // 2))])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"repetitions per entry (default {DEFAULT_ROUNDS})")
    parser.add_argument("--with-prv-accountant", action="store_true",
                        help="also time the prv-accountant library (slow: long double)")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    load_start = load_average()
    _cold_entries(results, args.rounds)
    _warm_entries(results, args.rounds)
    if args.with_prv_accountant:
        _prv_accountant_entries(results, args.rounds)
    payload = {"entries": results, "load_average_start": load_start,
               "load_average_end": load_average(), "cpus": os.cpu_count(),
               "python": platform.python_version(), "machine": platform.machine(),
               "question": {"epsilon": EPSILON, "delta": DELTA, "sample_rate": Q,
                            "steps": STEPS, "epochs": EPOCHS}}
    print(f"load average {load_start:.2f} -> {payload['load_average_end']:.2f} on "
          f"{os.cpu_count()} CPUs; wrote {write_results('accountant_time', payload)}")


if __name__ == "__main__":
    main()
