"""Budget matching: the noise schedule that spends exactly the sweep's (epsilon, delta).

Every trial of a sweep is held to one target, so the noise is calibrated here, once per distinct
question: the PRV search runs in a child bounded by ``timeout_s`` (``sandbox``) and its answer is
cached for the many trial processes that ask the same (``cache``). On timeout or failure the
looser but robust RDP accountant of dp_accounting calibrates instead and the result records why.

The epsilon a matched budget has spent after each epoch (``epsilon_curve``: a trial's ledger and
its report) costs one incremental composition on the calibration's own grid, less than
re-verifying a cached one would, so curves are only memoised in process, never cached on disk.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpsweep.core.checks import whole
from dpsweep.core.errors import UserInputError
from dpsweep.core.schedule import Phase, Schedule
from dpsweep.core.trial import Calibration, EpsilonBounds
from dpsweep.orchestrator.accounting.cache import cache_for, calibration_key, lookup, store
from dpsweep.orchestrator.accounting.certificate import (
    WINDOW,
    as_schedule,
    check_delta,
    check_epsilon,
    check_sample_rate,
    check_timeout,
)
from dpsweep.orchestrator.accounting.prv import (
    DEFAULT_PRV_EPS_ERROR,
    PrvGrid,
    load_numpy,
    prv_epsilon,
    rdp_integer_epsilon,
)
from dpsweep.orchestrator.accounting.sandbox import (
    CalibrationInterrupted,
    ChildOutcome,
    prv_in_child,
)
from dpsweep.orchestrator.accounting.search import (
    RDP_SCALE_RANGE,
    SearchError,
    fine_eps_error,
    rdp_calibrate,
    scaled_sigmas,
)
from dpsweep.orchestrator.config import DEFAULT_ACCOUNTANT_TIMEOUT_S
from dpsweep.orchestrator.config.checks import check_reachable

logger = logging.getLogger(__name__)

"""Time bound of one PRV calibration (``privacy.accountant_timeout_s``) before RDP takes over."""


def calibrate(*, target_epsilon: float, delta: float, sample_rate: float,
              steps: int | None = None, shape: Schedule | Sequence[Phase] | None = None,
              cache_dir: str | Path | None = None,
              timeout_s: float = DEFAULT_ACCOUNTANT_TIMEOUT_S,
              use_cache: bool = True) -> Calibration:
    """The noise schedule scale * shape whose PRV upper epsilon is at the centre of [0.99 T, T].

    Give exactly one of steps (constant sigma) or shape (relative multipliers per phase). The
    PRV calibrates in a child process bounded by timeout_s; on timeout or failure dp_accounting's
    RDP calibration is returned with fallback_reason set. Results are cached under cache_dir
    (default: default_cache_dir()) and every hit is verified (verify_calibration) before it is
    returned; a hit that fails is ignored (logged) and recomputed. use_cache=False neither reads nor
    writes the cache. A cached fallback caused by a timeout is retried when a longer timeout_s
    is given.
    """
    target = check_epsilon(target_epsilon)
    d = check_delta(delta)
    check_reachable(target, d)  # a pair no noise can reach is refused before any work
    q = check_sample_rate(sample_rate)
    shape_sched = _shape(steps, shape)
    timeout = check_timeout(timeout_s)

    eps_error = fine_eps_error(target)
    key = calibration_key(sample_rate=q, shape=shape_sched, delta=d, target_epsilon=target,
                          eps_error=eps_error)
    cache = cache_for(cache_dir) if use_cache else None
    if cache is not None:
        cal = lookup(cache, key, shape=shape_sched, timeout=timeout)
        if cal is not None:
            return cal

    t0 = time.perf_counter()
    multipliers = [p.noise_multiplier for p in shape_sched.phases]
    counts = [p.steps for p in shape_sched.phases]
    job = {"multipliers": multipliers, "steps": counts, "sample_rate": q, "delta": d,
           "target": target, "eps_error": eps_error}
    outcome = prv_in_child(job, timeout)
    sigmas, scale, bounds, fallback = _answer(outcome, job, asked=target_epsilon)
    cal = Calibration(
        target_epsilon=target, delta=d, sample_rate=q,
        schedule=Schedule(tuple(Phase(noise_multiplier=s, steps=n)
                                for s, n in zip(sigmas, counts, strict=True))),
        scale=scale, bounds=bounds, accountant=bounds.accountant, fallback_reason=fallback,
        eps_error=eps_error, seconds=time.perf_counter() - t0, cached=False)
    logger.info("calibrated noise %.6g (scale) for epsilon %g, delta %g, q %g, %d steps: "
                "upper %.6f via %s in %.2f s", scale, target, d, q, cal.steps, bounds.upper,
                bounds.accountant, cal.seconds)
    if cache is not None and not outcome.transient:
        store(cache, key, cal, prv_timeout_s=timeout if outcome.timed_out else None)
    return cal


def _shape(steps: Any, shape: Any) -> Schedule:
    """The relative multipliers to scale: constant for ``steps``, else ``shape``'s phases."""
    if (steps is None) == (shape is None):
        raise UserInputError(field="steps", value={"steps": steps, "shape": shape},
                             allowed="exactly one of steps (constant noise) or shape "
                                     "(a schedule of relative noise multipliers)")
    if steps is not None:
        n = whole(steps, field="steps", low=1)
        return Schedule.constant(noise_multiplier=1.0, steps=n)
    return as_schedule(shape, field="shape")


def _answer(outcome: ChildOutcome, job: dict[str, Any], *, asked: Any
            ) -> tuple[list[float], float, EpsilonBounds, str | None]:
    """(sigmas, scale, bounds, fallback reason): the PRV's answer when it passes the final
    check, else dp_accounting's RDP calibration, with the reason it was needed."""
    target = job["target"]
    result, reason = outcome.result, outcome.reason
    if outcome.interrupted:  # the user's interrupt: not a reason to fall back
        raise CalibrationInterrupted(reason)
    if result is None and outcome.unreachable:
        raise _unreachable(asked, reason)
    if result is not None and not WINDOW * target <= result["upper"] <= target:
        reason = (f"the PRV accountant's answer failed the final check (upper epsilon "
                  f"{result['upper']!r} outside [{WINDOW * target:.6g}, {target:g}]); RDP used")
        result = None
    if result is not None:
        logger.info("PRV calibration: %d coarse and %d fine compositions in %.2f s",
                    result["coarse_evals"], result["fine_evals"], result["seconds"])
        bounds = EpsilonBounds(lower=result["lower"], estimate=result["estimate"],
                               upper=result["upper"], accountant="prv")
        return result["sigmas"], result["scale"], bounds, None
    logger.warning("budget calibration fell back to RDP: %s", reason)
    # dp_accounting's RDP series report, through absl, each order they drop at tiny noise;
    # the bound stays valid and the fallback's reason is recorded
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        u, eps_rdp = rdp_calibrate(multipliers=job["multipliers"], steps=job["steps"],
                                   sample_rate=job["sample_rate"], delta=job["delta"],
                                   target=target)
    except SearchError as exc:
        raise _unreachable(asked, exc) from exc
    bounds = EpsilonBounds(lower=None, estimate=None, upper=eps_rdp, accountant="rdp")
    return scaled_sigmas(u, job["multipliers"]), math.exp(u), bounds, reason


def _unreachable(asked: Any, why: Any) -> UserInputError:
    return UserInputError(field="privacy.epsilon", value=asked,
                          allowed=f"a budget reachable with noise scales in "
                                  f"{list(RDP_SCALE_RANGE)} ({why})")


def certify(*, schedule: Schedule | Sequence[Phase], sample_rate: float, delta: float,
            target_epsilon: float | None = None) -> Calibration:
    """The accountant's certificate for a schedule fixed elsewhere (private tuning derives the
    per-trial noise from its end-to-end target): fine PRV bounds, no search."""
    started = time.perf_counter()
    sched = as_schedule(schedule)
    eps_error = DEFAULT_PRV_EPS_ERROR
    bounds = prv_epsilon(schedule=sched, sample_rate=sample_rate, delta=delta,
                         eps_error=eps_error)
    return Calibration(target_epsilon=bounds.upper if target_epsilon is None else target_epsilon,
                       delta=delta, sample_rate=sample_rate, schedule=sched, scale=sched.first,
                       bounds=bounds, accountant="prv", fallback_reason=None,
                       eps_error=eps_error, seconds=time.perf_counter() - started, cached=False)


# ---- epsilon per epoch ----------------------------------------------------------------------
#: Curves composed in this process, keyed by everything a curve depends on. A sweep's driver
#: asks for the same schedule's curve once per trial (``orchestrator.trial.plan.match_budget``); a
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
    ks = [whole(k, field="at_steps", low=1, high=total, allowed=f"integers in [1, {total}]")
          for k in at_steps]
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
