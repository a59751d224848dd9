"""Independent cross-checks: dp_accounting's accountants, which share no code with the PRV grid.

A cached calibration is trained with only once they agree with it (``verify_calibration``): the
exact one-step privacy loss (a closed-form lower bound) and dp_accounting's pessimistic PLD
(connect-the-dots, Doroshenko et al., arXiv 2207.04380) at two resolutions, whose gap is its
stated error. dp_accounting's RDP, looser but robust, is also the calibration's fallback.
dp_accounting is imported on first use: its import alone would cost most of ``dpsweep budget``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dpsweep.core.errors import CacheIntegrityError, UserInputError
from dpsweep.core.events import (
    EVENT_TYPES,
    Composed,
    Event,
    Gaussian,
    PoissonSubsampledGaussian,
    RepeatAndSelect,
)
from dpsweep.core.schedule import Phase, Schedule
from dpsweep.core.trial import Calibration, EpsilonBounds
from dpsweep.orchestrator.accounting.certificate import (
    as_schedule,
    check_delta,
    check_positive,
    check_sample_rate,
)
from dpsweep.orchestrator.accounting.prv import MAX_PRV_LOSS

_SQRT2 = math.sqrt(2.0)

# Independent verification of cached answers (dp_accounting's PLD, pessimistic).
VERIFY_INTERVAL_PER_EPSILON = 1e-3
VERIFY_INTERVAL_RANGE = (1e-4, 5e-2)
"""PLD value discretisation = 0.1% of the target (clamped): its stated error, the gap to the
PLD at twice the interval, is then about 1% of the target (measured in bench/accountant_time)."""
VERIFY_MAX_REL_ERROR = 0.02
VERIFY_MAX_REFINEMENTS = 2
VERIFY_REFINE_SAFETY = 0.8
"""Long schedules make the PLD's stated error grow (about steps x interval^2): while it exceeds
2% of the target the interval shrinks (at most twice), so the check keeps its teeth."""
VERIFY_REL_SLACK = 1e-9
"""Floating-point slack of the comparisons, relative to the target."""
DEFAULT_PLD_INTERVAL = 1e-3
"""epsilon_of_events' PLD value discretisation when none is given."""


@dataclass(frozen=True)
class IndependentCheck:
    """What the independent accountants say about a calibration's schedule.

    ``pld_epsilon`` is dp_accounting's pessimistic PLD epsilon (an upper bound) at value
    discretisation ``interval``; ``pld_error`` its stated error (the gap to the PLD at twice the
    interval); ``one_step_epsilon`` the exact epsilon of the least noisy single step (a lower
    bound on the whole schedule's).
    """

    pld_epsilon: float
    pld_error: float
    interval: float
    one_step_epsilon: float
    seconds: float


def schedule_events(schedule: Schedule | Sequence[Phase], *, sample_rate: float
                    ) -> list[PoissonSubsampledGaussian]:
    """DP-SGD's accounting events: one self-composed Poisson-subsampled Gaussian per run of
    equal multipliers (what a trial's ledger records)."""
    sched = as_schedule(schedule).merged()
    q = check_sample_rate(sample_rate)
    return [PoissonSubsampledGaussian(sampling_probability=q, noise_multiplier=p.noise_multiplier,
                                      count=p.steps) for p in sched.phases]


def _to_dp_event(event: Event) -> Any:
    from dp_accounting import dp_event

    if isinstance(event, PoissonSubsampledGaussian):
        inner = dp_event.PoissonSampledDpEvent(event.sampling_probability,
                                               dp_event.GaussianDpEvent(event.noise_multiplier))
        return dp_event.SelfComposedDpEvent(inner, event.count)
    if isinstance(event, Gaussian):
        return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(event.noise_multiplier),
                                            event.count)
    if isinstance(event, Composed):
        return dp_event.ComposedDpEvent([_to_dp_event(e) for e in event.events])
    if isinstance(event, RepeatAndSelect):
        shape = math.inf if event.shape is None else event.shape
        return dp_event.RepeatAndSelectDpEvent(_to_dp_event(event.event), event.mean, shape)
    raise UserInputError(field="events", value=repr(event)[:200], allowed="accounting events")


def _has_repeat_and_select(event: Event) -> bool:
    if isinstance(event, RepeatAndSelect):
        return True
    if isinstance(event, Composed):
        return any(_has_repeat_and_select(e) for e in event.events)
    return False


def epsilon_of_events(events: Event | Sequence[Event], *, delta: float,
                      accountant: Literal["pld", "rdp"] = "pld",
                      value_discretization_interval: float | None = None) -> float:
    """Epsilon at ``delta`` of the composed events by dp_accounting: an accountant that shares
    no code with the PRV grid above, for checking it.

    "pld" is dp_accounting's PLDAccountant (pessimistic connect-the-dots discretisation, both
    add and remove neighbours; an upper bound) at ``value_discretization_interval`` (default
    1e-3); "rdp" its RdpAccountant, the only one that supports RepeatAndSelect.
    """
    d = check_delta(delta)
    if isinstance(events, EVENT_TYPES):
        items: list[Event] = [events]  # type: ignore[list-item]
    elif isinstance(events, Sequence) and not isinstance(events, (str, bytes)) and events:
        items = list(events)
    else:
        raise UserInputError(field="events", value=repr(events)[:200],
                             allowed="an accounting event or a non-empty sequence of them")
    for e in items:
        if not isinstance(e, EVENT_TYPES):
            raise UserInputError(field="events", value=repr(e)[:200],
                                 allowed="core.events accounting events")
    if accountant not in ("pld", "rdp"):
        raise UserInputError(field="accountant", value=accountant, allowed="'pld' or 'rdp'")
    event = items[0] if len(items) == 1 else Composed(tuple(items))
    if accountant == "pld":
        if _has_repeat_and_select(event):
            raise UserInputError(field="accountant", value=accountant,
                                 allowed="'rdp' for repeat-and-select events (dp_accounting's "
                                         "PLD accountant does not support them)")
        interval = (DEFAULT_PLD_INTERVAL if value_discretization_interval is None else
                    check_positive(value_discretization_interval,
                                   field="value_discretization_interval"))
        from dp_accounting.pld import pld_privacy_accountant

        acc: Any = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    else:
        from dp_accounting.rdp import rdp_privacy_accountant

        acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(_to_dp_event(event))
    return float(acc.get_epsilon(d))


def rdp_epsilon(*, schedule: Schedule | Sequence[Phase], sample_rate: float,
                delta: float) -> EpsilonBounds:
    """dp_accounting's RDP upper bound of a schedule (phases' RDP curves add)."""
    sched = as_schedule(schedule)
    q = check_sample_rate(sample_rate)
    d = check_delta(delta)
    up = dp_rdp_upper(sigmas=[p.noise_multiplier for p in sched.phases],
                      steps=[p.steps for p in sched.phases], sample_rate=q, delta=d)
    return EpsilonBounds(lower=None, estimate=None, upper=up, accountant="rdp")


def dp_rdp_upper(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
                 delta: float) -> float:
    events = [PoissonSubsampledGaussian(sampling_probability=sample_rate, noise_multiplier=s,
                                        count=n) for s, n in zip(sigmas, steps, strict=True)]
    return epsilon_of_events(events, delta=delta, accountant="rdp")


def _one_step_epsilon(*, sample_rate: float, sigma: float, delta: float) -> float:
    """Exact epsilon of one Poisson-subsampled Gaussian step (remove neighbour), closed form:
    delta(eps) = q Phi_c((c - 1) / s) + (1 - q - e^eps) Phi_c(c / s), c = s^2 z(eps) + 1/2.
    Any schedule containing the step is at least this private-lossy (post-processing)."""
    q, s = sample_rate, sigma

    def hockey_stick(eps: float) -> float:
        z = math.log((math.expm1(eps) + q) / q)
        c = s * s * z + 0.5
        tail_p = 0.5 * math.erfc((c - 1.0) / (s * _SQRT2))
        tail_q = 0.5 * math.erfc(c / (s * _SQRT2))
        return q * tail_p + (1.0 - q) * tail_q - math.exp(eps) * tail_q

    if hockey_stick(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while hockey_stick(hi) > delta:
        lo, hi = hi, 2.0 * hi
        if hi > MAX_PRV_LOSS:
            return lo
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if hockey_stick(mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo


def verify_calibration(calibration: Calibration, *, source: str = "calibration"
                       ) -> IndependentCheck:
    """Check a calibration's claim with accountants independent of the PRV grid.

    Raises CacheIntegrityError naming ``source`` (e.g. the cache file) when (1) the exact
    one-step epsilon of its least noisy phase exceeds the claimed upper bound (then the schedule
    cannot be that private), or (2) dp_accounting's pessimistic PLD epsilon exceeds the claimed
    upper bound by more than the PLD's stated error, or (3) that PLD epsilon (an upper bound) is
    below the PRV's claimed lower bound. Passing means: the schedule's epsilon is <= the claimed
    upper bound (<= the target) up to the PLD's stated error, and consistent with the PRV's lower
    bound.
    """
    t0 = time.perf_counter()
    cal = calibration
    target = cal.target_epsilon
    slack = VERIFY_REL_SLACK * max(1.0, target)
    claim = cal.bounds.upper

    def fail(why: str) -> CacheIntegrityError:
        return CacheIntegrityError(field="budget cache", value=source,
                                   allowed=f"a calibration an independent accountant confirms, "
                                           f"but {why}; delete the file to recompute")

    weakest = min(p.noise_multiplier for p in cal.schedule.phases)
    one_step = _one_step_epsilon(sample_rate=cal.sample_rate, sigma=weakest, delta=cal.delta)
    if one_step > claim + slack:
        raise fail(f"one step at noise {weakest:.6g} alone has epsilon {one_step:.6g} > the "
                   f"claimed upper bound {claim:.6g}")
    interval = min(max(VERIFY_INTERVAL_PER_EPSILON * target, VERIFY_INTERVAL_RANGE[0]),
                   VERIFY_INTERVAL_RANGE[1])
    events = schedule_events(cal.schedule, sample_rate=cal.sample_rate)
    for refinement in range(VERIFY_MAX_REFINEMENTS + 1):
        coarse = epsilon_of_events(events, delta=cal.delta,
                                   value_discretization_interval=2 * interval)
        fine = epsilon_of_events(events, delta=cal.delta, value_discretization_interval=interval)
        error = max(coarse - fine, 0.0) if math.isfinite(coarse - fine) else math.inf
        wanted = VERIFY_MAX_REL_ERROR * target
        if (not math.isfinite(error) or error <= wanted or interval <= VERIFY_INTERVAL_RANGE[0]
                or refinement == VERIFY_MAX_REFINEMENTS):
            break
        # The pessimistic PLD's excess shrinks about like interval^2 (measured; bench).
        interval = max(VERIFY_INTERVAL_RANGE[0],
                       interval * VERIFY_REFINE_SAFETY * math.sqrt(wanted / error))
    if not (math.isfinite(fine) and math.isfinite(error)):
        # inf - inf would make the error NaN and every comparison below false: a pass
        raise fail(f"dp_accounting's PLD cannot bound epsilon at delta {cal.delta:g} (it "
                   f"gives {fine!r}: float64 rounding over {cal.steps} steps outweighs delta)")
    if fine > claim + error + slack:
        raise fail(f"dp_accounting's PLD gives epsilon {fine:.6g} > the claimed upper bound "
                   f"{claim:.6g} + its error {error:.3g}")
    lower = cal.bounds.lower
    if lower is not None and fine < lower - slack:
        raise fail(f"dp_accounting's PLD upper bound {fine:.6g} is below the claimed PRV lower "
                   f"bound {lower:.6g}")
    return IndependentCheck(pld_epsilon=fine, pld_error=error, interval=interval,
                            one_step_epsilon=one_step, seconds=time.perf_counter() - t0)
