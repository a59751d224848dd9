"""The calibration search, at the cost of one fine PRV composition.

The search multiplies a shape (relative multipliers per phase) by one factor ``scale``; upper
epsilon is monotone in it and nearly a straight line in log-log space. An integer-order RDP
bound (vectorised, microseconds) gives a bracket; the PRV at a coarse ``eps_error`` (10-15x fewer
grid points) then predicts the fine upper bound (coarse upper - coarse error + fine error) and a
secant search puts the prediction at the centre of the window [0.99 T, T]; one fine composition
confirms it. The answer is therefore the scale whose fine upper bound is at the window's centre,
independent of the search path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from dpsweep.orchestrator.accounting.certificate import WINDOW
from dpsweep.orchestrator.accounting.prv import load_numpy, prv_bounds, rdp_integer_epsilon
from dpsweep.orchestrator.accounting.verify import dp_rdp_upper

FINE_EPS_ERROR_CAP = 0.01
FINE_EPS_ERROR_PER_EPSILON = 0.002
"""The certified epsilon's error: min(cap, 0.2% of the target), a fifth of the window."""

COARSE_EPS_ERROR_CAP = 0.1
COARSE_EPS_ERROR_PER_EPSILON = 0.03
"""The search's PRV error: min(cap, 3% of the target); its estimate is nearly as good as the
fine one, at 10-15x fewer grid points."""

COARSE_AIM_RTOL = 1e-5
"""The coarse prediction of the fine upper bound is put within this relative distance of the
window's centre, so the answer does not depend on where the search started."""

MAX_FINE_AIMS = 3
"""Fine compositions spent re-aiming with a corrected prediction before a plain fine search."""

MAX_COARSE_EVALS = 16
MAX_FINE_EVALS = 12
MAX_RDP_EVALS = 80

PRV_SCALE_BELOW_RDP = 4.0
PRV_SCALE_ABOVE_RDP = 2.0
"""PRV searches scales in [rdp / 4, rdp * 2]: RDP is looser, so PRV's answer is a little below
RDP's, and small noise makes the PRV grid large; the bracket keeps the search away from it."""

RDP_SCALE_RANGE = (1e-4, 1e6)
"""Noise scales the RDP search may try; a target outside them is refused as unreachable."""

SLOPE_RANGE = (0.05, 50.0)
"""Plausible local slopes of -d log(epsilon) / d log(scale), to keep secant steps sane."""


def fine_eps_error(target: float) -> float:
    return min(FINE_EPS_ERROR_CAP, FINE_EPS_ERROR_PER_EPSILON * target)


def _coarse_eps_error(target: float, eps_error: float) -> float:
    return max(eps_error, min(COARSE_EPS_ERROR_CAP, COARSE_EPS_ERROR_PER_EPSILON * target))


class SearchError(RuntimeError):
    """The window could not be reached within the allowed range or evaluation count."""


class UnreachableError(RuntimeError):
    """Even RDP cannot place the budget within the allowed noise scales: bad input."""


def _search(evaluate: Callable[[float], float], *, u0: float, slope: float, lo: float,
            hi: float, u_min: float, u_max: float, max_step: float,
            max_evals: int) -> tuple[float, float, float, int]:
    """Find u = log(scale) with lo <= evaluate(u) <= hi, for evaluate decreasing in u.

    log(epsilon) is close to linear in log(scale), so the search aims at the window's
    log-centre with secant steps; once the target is bracketed it switches to regula falsi
    with the Illinois modification, which cannot stall on one side. Steps before bracketing
    are capped at max_step and u stays in [u_min, u_max], so a bad slope guess can never send
    the accountant to tiny noise. Returns (u, epsilon, local slope, evaluations).
    """
    v_star = 0.5 * (math.log(lo) + math.log(hi))
    above: tuple[float, float] | None = None  # (u, f > 0): epsilon too high, u too small
    below: tuple[float, float] | None = None  # (u, f < 0): epsilon too low, u too large
    last_side = 0
    prev: tuple[float, float] | None = None
    u = min(max(u0, u_min), u_max)
    for n in range(1, max_evals + 1):
        eps = evaluate(u)
        if lo <= eps <= hi:
            return u, eps, slope, n
        f = math.log(eps) - v_star if 0 < eps < math.inf else (math.inf if eps > 0 else -math.inf)
        if prev is not None and math.isfinite(f) and math.isfinite(prev[1]) and u != prev[0]:
            s = -(f - prev[1]) / (u - prev[0])
            if math.isfinite(s) and s > 0:
                slope = min(max(s, SLOPE_RANGE[0]), SLOPE_RANGE[1])
        prev = (u, f)
        if f > 0:
            if last_side == 1 and below is not None:
                below = (below[0], below[1] / 2)
            above, last_side = (u, f), 1
        else:
            if last_side == -1 and above is not None:
                above = (above[0], above[1] / 2)
            below, last_side = (u, f), -1
        if above is not None and below is not None:
            (ua, fa), (ub, fb) = above, below
            if ua >= ub:
                raise SearchError("epsilon is not decreasing in the noise scale")
            if ub - ua < 1e-12:
                raise SearchError(f"no scale gives epsilon in [{lo:.6g}, {hi:.6g}]; "
                                  "the accountant's error exceeds the window")
            u_next = ub - fb * (ub - ua) / (fb - fa) if math.isfinite(fa - fb) else math.nan
            if not ua < u_next < ub:
                u_next = 0.5 * (ua + ub)
        else:
            step = f / slope if math.isfinite(f) else math.copysign(max_step, f)
            u_next = u + min(max(step, -max_step), max_step)
            u_next = min(max(u_next, u_min), u_max)
            if u_next == u:
                raise SearchError(f"epsilon {eps:.6g} at the edge of the search range "
                                  f"(scale {math.exp(u):.6g}); target window "
                                  f"[{lo:.6g}, {hi:.6g}] is out of reach")
        u = u_next
    raise SearchError(f"no scale with epsilon in [{lo:.6g}, {hi:.6g}] after "
                      f"{max_evals} evaluations")


def scaled_sigmas(u: float, multipliers: Sequence[float]) -> list[float]:
    scale = math.exp(u)
    return [scale * m for m in multipliers]


def _rdp_anchor(*, multipliers: Sequence[float], steps: Sequence[int], sample_rate: float,
                delta: float, target: float) -> tuple[float, float, float]:
    """Integer-order RDP scale in the 1% window: the PRV search's bracket and the fallback's
    starting point. Returns (log scale, RDP epsilon there, local log-log slope)."""

    def evaluate(u: float) -> float:
        return rdp_integer_epsilon(sigmas=scaled_sigmas(u, multipliers), steps=steps,
                                   sample_rate=sample_rate, delta=delta)

    # Moments-accountant rule of thumb for the first guess; the search corrects it cheaply.
    total = sum(steps)
    guess = max(sample_rate * math.sqrt(2 * total * math.log(1 / delta)) / target, 1e-2)
    u, eps, _, _ = _search(evaluate, u0=math.log(guess), slope=1.0, lo=WINDOW * target,
                           hi=target, u_min=math.log(RDP_SCALE_RANGE[0]),
                           u_max=math.log(RDP_SCALE_RANGE[1]), max_step=math.log(4.0),
                           max_evals=MAX_RDP_EVALS)
    h = 0.02
    eps_h = evaluate(u + h)
    slope = (math.log(eps) - math.log(eps_h)) / h if 0 < eps_h < math.inf else math.nan
    return u, eps, (min(max(slope, SLOPE_RANGE[0]), SLOPE_RANGE[1])
                    if math.isfinite(slope) else 1.0)


def prv_calibrate(*, multipliers: list[float], steps: list[int], sample_rate: float,
                  delta: float, target: float, eps_error: float) -> dict[str, Any]:
    """PRV calibration: coarse PRV evaluations aim, one fine composition certifies.

    The coarse accountant predicts the fine upper bound as coarse upper - coarse error + fine
    error (the PRV estimate hardly depends on the mesh); the secant search puts that prediction
    at the window's log-centre within COARSE_AIM_RTOL. If the fine bound nonetheless misses the
    window, the prediction is corrected by the observed offset and aimed again; a plain fine
    search is the last resort.
    """
    np = load_numpy()
    t0 = time.perf_counter()
    try:
        u_rdp, _, slope = _rdp_anchor(multipliers=multipliers, steps=steps,
                                      sample_rate=sample_rate, delta=delta, target=target)
    except SearchError as exc:
        raise UnreachableError(str(exc)) from exc
    u_min = u_rdp - math.log(PRV_SCALE_BELOW_RDP)
    u_max = u_rdp + math.log(PRV_SCALE_ABOVE_RDP)
    centre = math.sqrt(WINDOW) * target
    eps_coarse = _coarse_eps_error(target, eps_error)
    fine_bounds: dict[float, tuple[float, float, float]] = {}
    counts = {"coarse": 0, "fine": 0}

    def coarse(u: float) -> float:
        counts["coarse"] += 1
        _, _, up = prv_bounds(sigmas=scaled_sigmas(u, multipliers), steps=steps,
                              sample_rate=sample_rate, delta=delta, eps_error=eps_coarse)
        return up - eps_coarse + eps_error

    def fine(u: float) -> float:
        counts["fine"] += 1
        fine_bounds[u] = prv_bounds(sigmas=scaled_sigmas(u, multipliers), steps=steps,
                                    sample_rate=sample_rate, delta=delta, eps_error=eps_error)
        return fine_bounds[u][2]

    with np.errstate(all="ignore"):
        u, aim, found = u_rdp, centre, None
        for _ in range(MAX_FINE_AIMS):
            try:
                u, predicted, slope, _ = _search(
                    coarse, u0=u, slope=slope, lo=aim * (1 - COARSE_AIM_RTOL),
                    hi=aim * (1 + COARSE_AIM_RTOL), u_min=u_min, u_max=u_max,
                    max_step=math.log(1.5), max_evals=MAX_COARSE_EVALS)
            except SearchError:
                break  # the coarse aim is only a head start; the fine search decides
            up = fine(u)
            if WINDOW * target <= up <= target:
                found = u
                break
            aim -= up - predicted
        if found is None:
            found, _, _, _ = _search(fine, u0=u, slope=slope, lo=WINDOW * target, hi=target,
                                     u_min=u_min, u_max=u_max, max_step=math.log(1.05),
                                     max_evals=MAX_FINE_EVALS)
    lower, estimate, upper = fine_bounds[found]
    return {"sigmas": scaled_sigmas(found, multipliers), "scale": math.exp(found), "lower": lower,
            "estimate": estimate, "upper": upper, "coarse_evals": counts["coarse"],
            "fine_evals": counts["fine"], "seconds": time.perf_counter() - t0}


def rdp_calibrate(*, multipliers: Sequence[float], steps: Sequence[int], sample_rate: float,
                  delta: float, target: float) -> tuple[float, float]:
    """The fallback: dp_accounting's RDP upper bound in the window, starting from the integer-
    order RDP answer (never tighter than dp_accounting's, so only a step or two away)."""
    u0, _, slope = _rdp_anchor(multipliers=multipliers, steps=steps, sample_rate=sample_rate,
                               delta=delta, target=target)

    def evaluate(u: float) -> float:
        return dp_rdp_upper(sigmas=scaled_sigmas(u, multipliers), steps=steps,
                            sample_rate=sample_rate, delta=delta)

    u, eps, _, _ = _search(evaluate, u0=u0, slope=slope, lo=WINDOW * target, hi=target,
                           u_min=math.log(RDP_SCALE_RANGE[0]), u_max=math.log(RDP_SCALE_RANGE[1]),
                           max_step=math.log(1.5), max_evals=MAX_RDP_EVALS)
    return u, eps
