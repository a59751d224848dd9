"""``dpsweep budget``: the calibrated noise for a privacy budget, without torch or opacus.

Imported by ``orchestrator.cli`` only when ``budget`` runs (the accountant's modules stay out of
``--help`` and the other commands).
"""

from __future__ import annotations

import argparse
import json
import logging
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_EVEN, Decimal
from typing import Any

from dpsweep.core import poisson
from dpsweep.core.checks import number, whole
from dpsweep.core.errors import UserInputError
from dpsweep.core.trial import Calibration
from dpsweep.orchestrator.accounting import calibration as calibration_module
from dpsweep.orchestrator.accounting.calibration import calibrate
from dpsweep.orchestrator.accounting.certificate import (
    MIN_SAMPLE_RATE,
    check_delta,
    check_epsilon,
    check_sample_rate,
)
from dpsweep.orchestrator.config import DEFAULT_ACCOUNTANT_TIMEOUT_S, MAX_ACCOUNTANT_TIMEOUT_S
from dpsweep.orchestrator.config.checks import check_reachable


def need(ok: bool, flag: str, value: Any, allowed: str) -> None:
    """For the flag combinations; numbers go through core.checks."""
    if not ok:
        raise UserInputError(field=flag, value=value, allowed=allowed)


def run(args: argparse.Namespace) -> int:
    """``dpsweep budget``: :func:`budget` on the flags, printed (``--json``: in full)."""
    cal, q, steps = budget(epsilon=args.epsilon, delta=args.delta, sample_rate=args.sample_rate,
                           batch_size=args.batch_size, train_size=args.train_size,
                           steps=args.steps, epochs=args.epochs,
                           accountant_timeout_s=args.accountant_timeout_s)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=2))
    else:
        _print_budget(cal, q=q, steps=steps, delta=cal.delta, eps=cal.target_epsilon)
    return 0


def budget(*, epsilon: float, delta: float, sample_rate: float | None = None,
           batch_size: int | None = None, train_size: int | None = None,
           steps: int | None = None, epochs: int | None = None,
           accountant_timeout_s: float | None = None) -> tuple[Calibration, float, int]:
    """The calibrated noise for a budget, light enough to answer in about a second: the
    calibration, the sample rate and the steps it is for.

    Neither torch nor opacus is imported: q = 1 / ceil(N / B) comes from ``core.poisson`` (the
    loader's exact rate), and the fresh PRV calibration (no cache: computing is cheaper than
    verifying a cached answer) runs in a forked child. sigma and the upper bound are printed
    rounded up, the lower bound down.
    """
    args = argparse.Namespace(epsilon=epsilon, delta=delta, sample_rate=sample_rate,
                              batch_size=batch_size, train_size=train_size, steps=steps,
                              epochs=epochs, accountant_timeout_s=accountant_timeout_s)
    eps = check_epsilon(args.epsilon, field="--epsilon (privacy.epsilon)")
    delta = check_delta(args.delta, field="--delta (privacy.delta)")
    timeout = number(
        DEFAULT_ACCOUNTANT_TIMEOUT_S if args.accountant_timeout_s is None
        else args.accountant_timeout_s,
        field="--accountant-timeout-s (privacy.accountant_timeout_s)",
        low=1.0, high=MAX_ACCOUNTANT_TIMEOUT_S,
        allowed=f"a number in [1, {MAX_ACCOUNTANT_TIMEOUT_S:g}]")
    if args.sample_rate is not None:
        need(args.batch_size is None and args.train_size is None, "--sample-rate",
             args.sample_rate, "either --sample-rate or --batch-size with --train-size, not both")
        q = check_sample_rate(args.sample_rate, field="--sample-rate", low=MIN_SAMPLE_RATE)
        steps_per_epoch = max(1, round(1.0 / q))
    else:
        need(args.batch_size is not None and args.train_size is not None,
             "--batch-size/--train-size", (args.batch_size, args.train_size),
             "both given (or --sample-rate instead)")
        train_size = whole(args.train_size, field="--train-size (data.train_size)", low=1)
        batch_size = whole(args.batch_size, field="--batch-size (training.batch_size)", low=1,
                           high=train_size,
                           allowed=f"an integer in [1, --train-size={train_size}]")
        steps_per_epoch = poisson.steps_per_epoch(dataset_size=train_size, batch_size=batch_size)
        q = poisson.sample_rate(dataset_size=train_size, batch_size=batch_size)
    need((args.steps is None) != (args.epochs is None), "--steps/--epochs",
         (args.steps, args.epochs), "exactly one of them")
    if args.steps is not None:
        steps = whole(args.steps, field="--steps", low=1)
    else:
        steps = whole(args.epochs, field="--epochs (training.epochs)", low=1) * steps_per_epoch
    if args.sample_rate is not None:  # (a loader's rate 1/ceil(N/B) > 1/N > delta always)
        need(q * steps > delta, "--sample-rate", args.sample_rate,
             f"a number in ({delta / steps:.3g}, 1] for --steps {steps} at --delta {delta:g}: "
             "an example sampled with probability at most delta in all the steps costs "
             "epsilon 0 without any noise, so there is nothing to calibrate")
    if args.train_size is not None:
        need(delta < poisson.delta_bound(args.train_size), "--delta (privacy.delta)", delta,
             f"< 1/--train-size = {poisson.delta_bound(args.train_size):.3g}")
        need(q >= MIN_SAMPLE_RATE, "--train-size (data.train_size)", args.train_size,
             f"at most {MIN_SAMPLE_RATE ** -1:g} batches per epoch (a sample rate "
             f"1/ceil(N/B) >= {MIN_SAMPLE_RATE:g}, the accountant's range)")
    check_reachable(eps, delta, steps=steps, epsilon_field="--epsilon (privacy.epsilon)",
                    delta_field="--delta (privacy.delta)")
    # dp_accounting's RDP (the fallback) reports each order it drops through absl; a fallback
    # itself is printed below with its reason, so the accountant's log line would repeat it
    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger(calibration_module.__name__).setLevel(logging.ERROR)
    cal = calibrate(target_epsilon=eps, delta=delta, sample_rate=q, steps=steps,
                    timeout_s=timeout, use_cache=False)
    return cal, q, steps


def _print_budget(cal: Any, *, q: float, steps: int, delta: float, eps: float) -> None:
    """``dpsweep budget``'s table: sigma and the upper bound rounded up, the lower down."""

    def fixed(value: float | None, rounding: str) -> str:
        """4 decimals of the exact binary value, rounded in the safe direction."""
        if value is None:
            return "n/a"
        return str(Decimal(value).quantize(Decimal("0.0001"), rounding=rounding))

    b = cal.bounds
    print(f"sigma (noise multiplier): {fixed(cal.noise_multiplier, ROUND_CEILING)}")
    print(f"sample rate q:            {q:.6g}")
    print(f"steps:                    {steps}")
    print(f"delta:                    {delta:g}")
    print(f"epsilon lower:            {fixed(b.lower, ROUND_FLOOR)}")
    print(f"epsilon estimate:         {fixed(b.estimate, ROUND_HALF_EVEN)}")
    print(f"epsilon upper:            {fixed(b.upper, ROUND_CEILING)}   (target {eps:g})")
    print(f"accountant:               {cal.accountant}"
          + (f"  (fallback: {cal.fallback_reason})" if cal.fallback_reason else ""))
