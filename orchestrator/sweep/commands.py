"""``dpsweep run`` / ``resume`` / ``demo`` as the command line runs them (``orchestrator.cli``
imports this module only when one of them runs: it brings Ray, Optuna and torch).

A sweep that ran to its end exits 0 only when no trial and no audit failed; otherwise one line
says what failed and the exit code is ``core.exits.EXIT_FAILURES`` (:func:`sweep`). An
interrupt ends with one line that names the run directory to resume, and the exit code of the
signal; a second Ctrl-C during Ray's own exit handlers is no error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dpsweep.orchestrator.config import Config
from dpsweep.orchestrator.door import CheckedSetup, check
from dpsweep.orchestrator.sweep.driver import resume_sweep, run_sweep
from dpsweep.orchestrator.sweep.estimate import estimate
from dpsweep.orchestrator.sweep.signals import Interrupted, ignore_further_signals
from dpsweep.trainables.methods import METHODS

#: Where a sweep goes without --out: runs/STEM-TIMESTAMP.
RUNS_ROOT = "runs"
DEMO_STEM = "demo"
#: Ray Tune prints every failed trial's traceback (a killed worker's ActorDiedError) on stderr;
#: dpsweep records each failure with its reason (results store, report, Optuna attributes).
TUNE_TRIAL_ERRORS_ENV = "TUNE_PRINT_ALL_TRIAL_ERRORS"
#: The demo's digits splits (all 1,797 images): more members than the dataset defaults
#: (800 vs 500) so that DP training at epsilon 3 clears 0.75 validation accuracy with a margin
#: (0.77 -> 0.86 for DP-SGD's preset step, docs/search.md), at the cost of a smaller test split
#: and shadow pool (offline references train on 150 of its 300 examples).
DEMO_SIZES = {"train_size": 800, "validation_size": 200, "holdout_size": 300, "test_size": 197,
              "shadow_size": 300}
#: Batch 128 keeps the demo at 140 steps (20 epochs of 7 Poisson batches) on 800 members.
DEMO_BATCH = 128
#: Two targets, so the report opens on privacy-utility curves as well as fronts; the pruner
#: (ASHA from epoch 1, factor 3) stops the weaker trials before their audit, which pays for
#: the second target.
DEMO_EPSILONS = (1.0, 3.0)
DEMO_FIRST_RUNG = 1
DEMO_TRIALS_PER_METHOD = 3


def demo_config() -> Config:
    """The embedded default sweep: every registered method, 3 trials each, on digits."""
    cfg = Config()
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, **DEMO_SIZES),
        training=dataclasses.replace(cfg.training, batch_size=DEMO_BATCH),
        budget=dataclasses.replace(cfg.budget, epsilons=list(DEMO_EPSILONS)),
        sweep=dataclasses.replace(cfg.sweep, trials_per_method=DEMO_TRIALS_PER_METHOD,
                                  pruner="asha", pruner_min_epochs=DEMO_FIRST_RUNG))


def out_dir(args: argparse.Namespace, *, stem: str) -> Path:
    """--out, or runs/STEM-TIMESTAMP when it is left out (an empty --out is refused in form);
    remembered on ``args`` for the disk-full message."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.sweep_dir = (Path(args.out) if args.out is not None
                      else Path(RUNS_ROOT) / f"{stem}-{stamp}")
    return args.sweep_dir


class Finished(Protocol):
    """How a command that ran to its end went (``driver.SweepSummary``,
    ``reaudit.ReauditSummary``)."""

    @property
    def exit_code(self) -> int: ...

    def failure_line(self) -> str: ...


def resume_hint(run_dir: Path | None) -> str:
    """The command that continues an interrupted sweep."""
    return f"dpsweep resume {run_dir}"


def sweep(action: Callable[[], Finished], *,
          again: Callable[[Path | None], str] = resume_hint) -> int:
    """Run a sweep (or ``reaudit``) and return its exit code: 0, or ``EXIT_FAILURES`` with one
    line on what failed. An interrupt is one line with the command that continues (``again``)
    and the signal's exit code."""
    os.environ.setdefault(TUNE_TRIAL_ERRORS_ENV, "0")
    try:
        finished = action()
    except Interrupted as exc:
        ignore_further_signals()  # Ray's exit handlers still run: a second Ctrl-C is no error
        sys.stderr.write(f"dpsweep: {exc}; the run directory is consistent: continue with "
                         f"`{again(exc.run_dir)}`\n")
        return exc.exit_code
    if finished.exit_code:
        sys.stderr.write(f"dpsweep: {finished.failure_line()}\n")
    return finished.exit_code


def demo(args: argparse.Namespace) -> int:
    cfg = demo_config()
    out = out_dir(args, stem=DEMO_STEM)
    print(f"dpsweep demo: sweep of all {len(METHODS)} DP methods on the bundled digits data "
          f"(offline), {DEMO_TRIALS_PER_METHOD} trials each at epsilon "
          f"{' and '.join(f'{e:g}' for e in cfg.budget.epsilons)} (weak trials pruned at "
          "epoch rungs), per-layer MIA audit, report", flush=True)
    setup = check(cfg)
    return sweep(lambda: run_sweep(setup, run_dir=out, quiet=args.quiet))


def run(args: argparse.Namespace, *, setup: CheckedSetup) -> int:
    """``dpsweep run CONFIG``; ``setup`` is CONFIG through the door, checked by the command
    line before this module (and Ray and Optuna with it) was imported. ``--estimate`` prints
    the sweep's measured cost (``estimate.estimate``) instead of running it."""
    if args.estimate:  # measured here; no run directory, nothing kept
        print("\n".join(estimate(setup).lines()), flush=True)
        return 0
    out = out_dir(args, stem=Path(args.config).stem)
    if setup.left_out_line() and not args.quiet:
        print(setup.left_out_line(), flush=True)
    return sweep(lambda: run_sweep(setup, run_dir=out, address=args.address, quiet=args.quiet))


def resume(args: argparse.Namespace) -> int:
    return sweep(lambda: resume_sweep(Path(args.run_dir), address=args.address,
                                      quiet=args.quiet, retry_failed=args.retry_failed))
