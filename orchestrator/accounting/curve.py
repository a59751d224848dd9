"""Epsilon spent after each epoch of a calibrated schedule: a trial's ledger and its report.

A curve costs one incremental composition on the calibration's own grid, less than re-verifying
a cached one would, so curves are only memoised in process, never cached on disk.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from core.errors import UserInputError
from orchestrator.accounting.certificate import Calibration, EpsilonBounds
from orchestrator.accounting.limits import check_whole
from orchestrator.accounting.prv import PrvGrid
from orchestrator.accounting.rdp import load_numpy, rdp_integer_epsilon

logger = logging.getLogger(__name__)


#: Curves composed in this process, keyed by everything a curve depends on. A sweep's driver
#: asks for the same schedule's curve once per trial (``orchestrator.trial.match_budget``); a
#: curve is a pure function of its key, so the second ask is a lookup, not a composition.
CURVE_MEMO_SIZE = 64
_CURVES: dict[tuple[Any, ...], dict[int, EpsilonBounds]] = {}


def epsilon_curve(calibration: Calibration, *, at_steps: Sequence[int]) -> list[EpsilonBounds]:
    """Epsilon spent after k steps of the calibrated schedule, for each k in at_steps.

    One incremental composition: the calibration's own PRV grid (same eps_error), its spectrum
    multiplied up step range by step range, one inverse FFT per point. Prefixes are post-
    processings of the whole run, so every point is capped at the calibration's upper bound, and
    the point at the full step count is the calibration's certificate itself. RDP calibrations
    get integer-order RDP points (capped the same way).
    """
    if not isinstance(calibration, Calibration):
        raise UserInputError(field="calibration", value=type(calibration).__name__,
                             allowed="a Calibration returned by calibrate()")
    total = calibration.steps
    if isinstance(at_steps, (str, bytes)):
        raise UserInputError(field="at_steps", value=at_steps,
                             allowed=f"a sequence of integers in [1, {total}]")
    ks = [check_whole(k, field="at_steps", low=1, allowed=f"integers in [1, {total}]")
          for k in at_steps]
    for k in ks:
        if k > total:
            raise UserInputError(field="at_steps", value=k, allowed=f"integers in [1, {total}]")
    if not ks:
        return []
    unique = sorted(set(ks))
    final = calibration.bounds
    memo_key = (calibration.accountant, calibration.sample_rate, calibration.delta,
                calibration.eps_error, final,
                tuple((p.noise_multiplier, p.steps) for p in calibration.schedule.phases),
                tuple(unique))
    points = _CURVES.get(memo_key)
    if points is None:
        points = {}
        if calibration.accountant == "prv":
            try:
                points = _prv_curve(calibration, unique)
            except Exception as exc:
                logger.warning("PRV epsilon curve failed (%s: %s); using RDP for the curve",
                               type(exc).__name__, exc)
        if not points:
            points = _rdp_curve(calibration, unique)
        points[total] = final
        if len(_CURVES) >= CURVE_MEMO_SIZE:
            _CURVES.clear()
        _CURVES[memo_key] = points
    return [points[k] for k in ks]


def _capped(lower: float | None, estimate: float | None, upper: float, *, cap: float,
            accountant: str) -> EpsilonBounds:
    up = min(upper, cap)
    est = None if estimate is None else min(estimate, up)
    low = None if lower is None else min(lower, up if est is None else est)
    return EpsilonBounds(lower=low, estimate=est, upper=up, accountant=accountant)


def _prv_curve(cal: Calibration, ks: Sequence[int]) -> dict[int, EpsilonBounds]:
    np = load_numpy()
    with np.errstate(all="ignore"):
        grid = PrvGrid(sample_rate=cal.sample_rate,
                       phases=[(p.noise_multiplier, p.steps) for p in cal.schedule.phases],
                       delta=cal.delta, eps_error=cal.eps_error)
        raw = grid.prefix_bounds([k for k in ks if k < cal.steps])
    return {k: _capped(*b, cap=cal.bounds.upper, accountant="prv") for k, b in raw.items()}


def _rdp_curve(cal: Calibration, ks: Sequence[int]) -> dict[int, EpsilonBounds]:
    np = load_numpy()
    sigmas = [p.noise_multiplier for p in cal.schedule.phases]
    out: dict[int, EpsilonBounds] = {}
    with np.errstate(all="ignore"):
        for k in ks:
            counts = [p.steps for p in cal.schedule.prefix(k).phases]
            up = rdp_integer_epsilon(sigmas=sigmas[:len(counts)], steps=counts,
                                     sample_rate=cal.sample_rate, delta=cal.delta)
            out[k] = _capped(None, None, up, cap=cal.bounds.upper, accountant="rdp")
    return out
