"""Privacy-budget matching: the noise schedule that spends exactly the sweep's (epsilon, delta).

Every trial of a sweep is held to one target, so the noise multiplier is calibrated here, once per
distinct question, with the PRV accountant of Gopi, Lee & Wutschitz, "Numerical Composition of
Differential Privacy" (arXiv 2106.02848): tight numerical composition with certified error bars.

**The PRV accountant.** ``_PrvGrid`` is prv-accountant 0.2.0's algorithm (its domain from an RDP
bound, Remark 5.6; its mesh, Theorem 5.5; its mean-preserving cell-centred discretisation; Fourier
self-composition; its epsilon bounds) computed in float64 with numpy's FFT on a 5-smooth grid
length, instead of in long double on whatever length the domain gives. That is ~10x faster and
agrees with prv-accountant to ~1e-8 in epsilon (``tests/test_budget.py`` checks it against the
library), and it needs only numpy and ``scipy.special``: importing prv-accountant pulls in
``scipy.signal`` and ``scipy.stats``, which alone cost more than the whole ``dpsweep budget``
command may take.

**Calibration at the cost of one fine composition.** The search multiplies a shape (relative
multipliers per phase) by one factor ``scale``; upper epsilon is monotone in it and nearly a
straight line in log-log space. An integer-order RDP bound (vectorised, microseconds) gives a
bracket; the PRV at a coarse ``eps_error`` (10-15x fewer grid points) then predicts the fine upper
bound (coarse upper - coarse error + fine error) and a secant search puts the prediction at the
centre of the window [0.99 T, T]; one fine composition confirms it. The answer is therefore the
scale whose fine upper bound is at the window's centre, independent of the search path.

**Time bound and fallback.** The PRV runs in a child process killed at ``timeout_s``: forked when
this process has a single OS thread (nothing to deadlock on, nothing to re-import), else a fresh
interpreter started with subprocess (multiprocessing's "spawn" would re-run the caller's main
script), kept for the next job inside ``keep_interpreters`` (its start costs more than a job)
until one outlives its bound.
On timeout or failure the looser but robust RDP accountant of dp_accounting calibrates instead
and the result records why.

**Cache, verified.** Answers are cached on disk (``core.storage.JsonCache``) for the many trial
processes that ask the same question, and every hit is re-checked before use by accountants that
share no code with the PRV above: the exact one-step privacy loss (a closed-form lower bound) and
dp_accounting's pessimistic PLD (connect-the-dots, Doroshenko et al., arXiv 2207.04380) at two
resolutions, whose gap is its stated error. A contradiction raises ``CacheIntegrityError`` naming
the file: a tampered or corrupted entry is never trained with.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import logging
import math
import multiprocessing
import operator
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from core.errors import CacheIntegrityError, UserInputError
from core.events import (
    EVENT_TYPES,
    Composed,
    Event,
    Gaussian,
    PoissonSubsampledGaussian,
    RepeatAndSelect,
)
from core.params import is_real
from core.schedule import Phase, Schedule
from core.storage import JsonCache, canonical_hash
from orchestrator.config import MAX_EPSILON

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DEFAULT_ACCOUNTANT_TIMEOUT_S",
    "WINDOW",
    "Calibration",
    "EpsilonBounds",
    "IndependentCheck",
    "calibrate",
    "default_cache_dir",
    "epsilon_curve",
    "epsilon_of_events",
    "prv_epsilon",
    "rdp_epsilon",
    "schedule_events",
    "verify_calibration",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
"""Bump when the cache's meaning changes, so stale answers are never served."""

CACHE_NAMESPACE = "calibration"
"""Sub-directory of the cache directory that holds calibrations."""

WINDOW = 0.99
"""Calibrated upper epsilon lies in [WINDOW * target, target]: within 1% of the budget."""

DEFAULT_ACCOUNTANT_TIMEOUT_S = 120.0
"""Time bound of one PRV calibration (``privacy.accountant_timeout_s``) before RDP takes over."""

DEFAULT_PRV_EPS_ERROR = 0.01
"""prv_epsilon's eps_error when none is given (calibrate derives its own from the target)."""

FINE_EPS_ERROR_CAP = 0.01
FINE_EPS_ERROR_PER_EPSILON = 0.002
"""The certified epsilon's error: min(cap, 0.2% of the target), a fifth of the window."""

COARSE_EPS_ERROR_CAP = 0.1
COARSE_EPS_ERROR_PER_EPSILON = 0.03
"""The search's PRV error: min(cap, 3% of the target); its estimate is nearly as good as the
fine one, at 10-15x fewer grid points."""

DELTA_ERROR_FACTOR = 1e-3
"""PRV's delta_error = delta * DELTA_ERROR_FACTOR, as prv-accountant recommends."""

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

# The PRV grid (prv-accountant's constants, and our float64 limits).
PRV_DOMAIN_MARGIN = 3.0
"""prv-accountant adds 3 to the RDP-derived domain half-width L."""
DOMAIN_RDP_MAX_ORDER = 128
"""Integer RDP orders 2..128 bound the domain (any valid RDP bound is a valid domain)."""
MAX_PRV_GRID_POINTS = 1 << 23
"""Larger grids (tiny noise, very long schedules) are refused: RDP answers instead."""
MAX_PRV_LOSS = 600.0
"""Privacy losses beyond this overflow exp() in float64: such grids are refused."""

# The truncated mean of one step's privacy loss (trapezoid rule over the output o).
MEAN_RANGE_SIGMAS = 40.0
MEAN_POINTS_PER_SIGMA = 50.0
MEAN_STRIP_FRACTION = 6.0
"""Step h = min(sigma / 50, pi sigma^2 / 6): the integrand is analytic in a strip of half-width
pi sigma^2 (where 1 - q + q exp((2o - 1) / (2 sigma^2)) vanishes), so the trapezoid error is
below exp(-2 pi * 6), and the Gaussian tails beyond 40 sigma are below exp(-800)."""

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

_ENV_CACHE_DIR = "DPSWEEP_CACHE_DIR"
_SQRT2 = math.sqrt(2.0)


# --------------------------------------------------------------------------------------------
# Data types


@dataclass(frozen=True)
class EpsilonBounds:
    """Epsilon of a schedule; RDP gives only an upper bound, so lower/estimate are None there."""

    lower: float | None
    estimate: float | None
    upper: float
    accountant: str

    def to_dict(self) -> dict[str, Any]:
        return {"lower": self.lower, "estimate": self.estimate, "upper": self.upper,
                "accountant": self.accountant}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpsilonBounds:
        def opt(v: Any) -> float | None:
            return None if v is None else float(v)

        accountant = str(d["accountant"])
        if accountant not in ("prv", "rdp"):
            raise ValueError(f"unknown accountant {accountant!r}")
        return cls(lower=opt(d["lower"]), estimate=opt(d["estimate"]), upper=float(d["upper"]),
                   accountant=accountant)


@dataclass(frozen=True)
class Calibration:
    """A matched budget: the schedule to train with and the accountant's certificate for it."""

    target_epsilon: float
    delta: float
    sample_rate: float
    schedule: Schedule
    scale: float
    bounds: EpsilonBounds
    accountant: str
    fallback_reason: str | None
    eps_error: float
    seconds: float
    cached: bool

    @property
    def noise_multiplier(self) -> float:
        """The first phase's multiplier: sigma for a constant schedule, sigma_0 for a decay."""
        return self.schedule.first

    @property
    def steps(self) -> int:
        return self.schedule.steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; trials receive this, and the cache stores it."""
        return {
            "schema": SCHEMA_VERSION,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "schedule": self.schedule.to_list(),
            "scale": self.scale,
            "bounds": self.bounds.to_dict(),
            "accountant": self.accountant,
            "fallback_reason": self.fallback_reason,
            "eps_error": self.eps_error,
            "seconds": self.seconds,
            "cached": self.cached,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of to_dict; a malformed dict raises UserInputError(field="calibration")."""
        try:
            schedule = Schedule.from_list(d["schedule"])
            accountant = str(d["accountant"])
            if accountant not in ("prv", "rdp"):
                raise ValueError("accountant must be 'prv' or 'rdp'")
            reason = d["fallback_reason"]
            return cls(
                target_epsilon=float(d["target_epsilon"]),
                delta=float(d["delta"]),
                sample_rate=float(d["sample_rate"]),
                schedule=schedule,
                scale=float(d["scale"]),
                bounds=EpsilonBounds.from_dict(d["bounds"]),
                accountant=accountant,
                fallback_reason=None if reason is None else str(reason),
                eps_error=float(d["eps_error"]),
                seconds=float(d["seconds"]),
                cached=bool(d.get("cached", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError, UserInputError) as exc:
            raise UserInputError(field="calibration", value=f"{type(exc).__name__}: {exc}",
                                 allowed="a dict produced by Calibration.to_dict()") from exc


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


# --------------------------------------------------------------------------------------------
# Validation (always before any computation)


def _real(value: Any, *, field: str, allowed: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float when it is a finite real number (not a bool) satisfying ``ok``."""
    if not (is_real(value) and ok(float(value))):
        raise UserInputError(field=field, value=value, allowed=allowed)
    return float(value)


def _check_epsilon(value: Any) -> float:
    return _real(value, field="privacy.epsilon", allowed=f"a number in (0, {MAX_EPSILON:g}]",
                 ok=lambda x: 0 < x <= MAX_EPSILON)


def _check_delta(value: Any) -> float:
    return _real(value, field="privacy.delta", allowed="a number in (0, 1)",
                 ok=lambda x: 0 < x < 1)


def _check_sample_rate(value: Any) -> float:
    return _real(value, field="sample_rate", allowed="a number in (0, 1]",
                 ok=lambda x: 0 < x <= 1)


def _check_eps_error(value: Any, *, field: str = "eps_error") -> float:
    return _real(value, field=field, allowed="a finite number > 0", ok=lambda x: x > 0)


def _whole(value: Any, *, field: str, low: int, allowed: str) -> int:
    """``value`` as an int (anything with __index__, not a bool) that is >= low."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < low:
        raise UserInputError(field=field, value=value, allowed=allowed)
    return n


def _as_schedule(value: Any, *, field: str = "schedule") -> Schedule:
    """A Schedule, or a sequence of Phase made into one (core.schedule validates the phases)."""
    if isinstance(value, Schedule):
        return value
    allowed = "a Schedule or a non-empty sequence of Phase"
    if value is None or isinstance(value, (str, bytes)):
        raise UserInputError(field=field, value=value, allowed=allowed)
    try:
        phases = tuple(value)
    except TypeError:
        raise UserInputError(field=field, value=value, allowed=allowed) from None
    for i, p in enumerate(phases):
        if not isinstance(p, Phase):
            raise UserInputError(field=f"{field}[{i}]", value=p, allowed="a Phase")
    return Schedule(phases)


def _check_timeout(value: Any) -> float:
    """Seconds > 0; inf means no bound."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not (number and value > 0):  # NaN fails the comparison
        raise UserInputError(field="timeout_s", value=value,
                             allowed="a number > 0 (seconds; inf for no bound)")
    return float(value)


def _fine_eps_error(target: float) -> float:
    return min(FINE_EPS_ERROR_CAP, FINE_EPS_ERROR_PER_EPSILON * target)


def _coarse_eps_error(target: float, eps_error: float) -> float:
    return max(eps_error, min(COARSE_EPS_ERROR_CAP, COARSE_EPS_ERROR_PER_EPSILON * target))


# --------------------------------------------------------------------------------------------
# RDP of the Poisson-subsampled Gaussian at integer orders (numpy; the search's cheap bound and
# the PRV grid's domain)


def _numpy() -> Any:
    import numpy

    return numpy


@functools.lru_cache(maxsize=8)
def _rdp_binomial_terms(sample_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """The sigma-free part of log A_alpha's terms, log C(a, i) + i log q + (a - i) log(1 - q)
    (-inf where i > a), and i^2 - i, for orders a = 2..DOMAIN_RDP_MAX_ORDER."""
    np = _numpy()
    top = DOMAIN_RDP_MAX_ORDER
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, top + 1)))])
    a = np.arange(2, top + 1)[:, None]
    i = np.arange(top + 1)[None, :]
    valid = i <= a
    rest = np.where(valid, a - i, 0)
    base = (log_fact[a] - log_fact[i] - log_fact[rest] + i * math.log(sample_rate)
            + rest * math.log1p(-sample_rate))
    return np.where(valid, base, -np.inf), (i * i - i).astype(np.float64)


def _rdp_integer_orders(sample_rate: float, sigmas: Sequence[float]) -> np.ndarray:
    """RDP at orders 2..DOMAIN_RDP_MAX_ORDER, one row per sigma: exact at integer orders
    (Mironov, Talwar & Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism",
    arXiv 1908.10530, Sec. 3.3)."""
    np = _numpy()
    orders = np.arange(2, DOMAIN_RDP_MAX_ORDER + 1, dtype=np.float64)
    inv = 1.0 / (2.0 * np.asarray(sigmas, dtype=np.float64) ** 2)
    if sample_rate >= 1.0:
        return inv[:, None] * orders[None, :]
    base, quad = _rdp_binomial_terms(sample_rate)
    terms = base[None, :, :] + inv[:, None, None] * quad[None, :, :]
    peak = terms.max(axis=2, keepdims=True)
    log_a = peak[..., 0] + np.log(np.exp(terms - peak).sum(axis=2))
    return log_a / (orders - 1.0)[None, :]


def _rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta) from RDP (Canonne, Kamath & Steinke, arXiv 2004.00010, Prop. 12; the
    conversion prv-accountant and Opacus use)."""
    np = _numpy()
    orders = np.arange(2, DOMAIN_RDP_MAX_ORDER + 1, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        eps = rdp - np.log(delta * orders) / (orders - 1.0) + np.log1p(-1.0 / orders)
    return float(np.nanmin(eps))


def _rdp_integer_epsilon(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
                         delta: float) -> float:
    groups = _grouped(sigmas, steps)
    rdp = _rdp_integer_orders(sample_rate, [s for s, _ in groups])
    counts = _numpy().asarray([n for _, n in groups], dtype=float)
    return _rdp_to_epsilon(counts @ rdp, delta)


def _grouped(sigmas: Sequence[float], steps: Sequence[int]) -> list[tuple[float, int]]:
    """(sigma, total steps) per distinct sigma: RDP and the PRV's spectra add per mechanism."""
    out: dict[float, int] = {}
    for s, n in zip(sigmas, steps, strict=True):
        out[s] = out.get(s, 0) + n
    return list(out.items())


# --------------------------------------------------------------------------------------------
# The PRV accountant (prv-accountant's algorithm in float64)


def _fast_len(n: int) -> int:
    """Smallest 2^a 3^b 5^c >= n: FFT lengths numpy's pocketfft handles fastest."""
    best = 1 << max(0, (n - 1).bit_length())
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            p = p35
            while p < n:
                p *= 2
            best = min(best, p)
            p35 *= 3
        p5 *= 5
    return best


def _loss_z(sample_rate: float, t: Any) -> Any:
    """z = log((e^t - 1 + q) / q), computed as log((1-q)/q) + log(expm1(t - log(1-q))) so that
    losses just above the support's lower end log(1 - q) keep their precision."""
    np = _numpy()
    if sample_rate >= 1.0:
        return np.asarray(t, dtype=np.float64)
    lq = math.log1p(-sample_rate)
    return math.log((1.0 - sample_rate) / sample_rate) + np.log(np.expm1(t - lq))


def _cdf_sf(sample_rate: float, sigma: float, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CDF and survival function of one step's privacy loss L = log(P/Q)(o), o ~ P, for
    P = (1-q) N(0, s^2) + q N(1, s^2), Q = N(0, s^2) (prv-accountant's PoissonSubsampledGaussian),
    at losses t > log(1 - q) given as z = _loss_z(q, t); each accurate in its own small tail.

    L <= t iff o <= s^2 z + 1/2, so the CDF is a mixture of two normal CDFs there.
    """
    from scipy.special import erfc

    q = sample_rate
    a = (2.0 * sigma * sigma * z - 1.0) / (2.0 * _SQRT2 * sigma)
    b = (2.0 * sigma * sigma * z + 1.0) / (2.0 * _SQRT2 * sigma)
    sf = 0.5 * q * erfc(a) + 0.5 * (1.0 - q) * erfc(b)
    low = sf > 0.5  # where the CDF is the small one, compute it directly
    cdf = 1.0 - sf
    cdf[low] = 0.5 * q * erfc(-a[low]) + 0.5 * (1.0 - q) * erfc(-b[low])
    return cdf, sf


def _truncated_mean(sample_rate: float, sigma: float, t_max: float) -> float:
    """E[L | L <= t_max] of one step's privacy loss, by the trapezoid rule over the output o
    (spectrally accurate here: see MEAN_STRIP_FRACTION). prv-accountant integrates the CDF with
    scipy.integrate.quad instead; the two agree to ~1e-12."""
    np = _numpy()
    q = sample_rate
    h = min(sigma / MEAN_POINTS_PER_SIGMA, math.pi * sigma * sigma / MEAN_STRIP_FRACTION)
    lo = -MEAN_RANGE_SIGMAS * sigma
    z_max = float(_loss_z(q, np.float64(t_max)))
    hi = min(1.0 + MEAN_RANGE_SIGMAS * sigma, sigma * sigma * z_max + 0.5)
    n = max(3, math.ceil((hi - lo) / h) + 1)
    o = np.linspace(lo, hi, n)
    weights = np.full(n, (hi - lo) / (n - 1))
    weights[0] = weights[-1] = 0.5 * weights[0]
    x = (2.0 * o - 1.0) / (2.0 * sigma * sigma)
    log_keep = math.log1p(-q) if q < 1.0 else -math.inf
    loss = np.logaddexp(log_keep, math.log(q) + x)
    density = ((1.0 - q) * np.exp(-0.5 * (o / sigma) ** 2)
               + q * np.exp(-0.5 * ((o - 1.0) / sigma) ** 2))
    wd = weights * density
    return float((wd * loss).sum() / wd.sum())


class _PrvGrid:
    """One discretisation grid for a schedule's mechanisms (Gopi et al., arXiv 2106.02848).

    The domain [-L, L] comes from an RDP bound on the composition at delta_error / 4 and on each
    step at delta_error / (8 N) (Remark 5.6), the mesh from eps_error (Theorem 5.5); the grid is
    then extended on the right to a 5-smooth length for a fast FFT (more domain never hurts).
    Prefix compositions reuse the grid, so an epsilon curve costs one inverse FFT per point.
    """

    def __init__(self, *, sample_rate: float, phases: Sequence[tuple[float, int]], delta: float,
                 eps_error: float) -> None:
        np = _numpy()
        self.q = sample_rate
        self.delta = delta
        self.eps_error = eps_error
        self.delta_error = delta * DELTA_ERROR_FACTOR
        self.phases = [(float(s), int(n)) for s, n in phases]
        total = sum(n for _, n in self.phases)
        groups = _grouped([s for s, _ in self.phases], [n for _, n in self.phases])
        rdp = _rdp_integer_orders(sample_rate, [s for s, _ in groups])
        bound = _rdp_to_epsilon(np.asarray([n for _, n in groups], dtype=float) @ rdp,
                                self.delta_error / 4)
        for row in rdp:
            bound = max(bound, _rdp_to_epsilon(row, self.delta_error / 8 / total))
        bound = max(bound, eps_error) + PRV_DOMAIN_MARGIN
        if not math.isfinite(bound) or bound > MAX_PRV_LOSS:
            raise ArithmeticError(f"PRV domain half-width {bound:.4g} exceeds {MAX_PRV_LOSS:g} "
                                  "(noise too small for float64)")
        mesh = eps_error / math.sqrt(total / 2 * math.log(12 / self.delta_error))
        t_min = math.floor(-bound / mesh) * mesh
        t_max = math.ceil(bound / mesh) * mesh
        size = round((t_max - t_min) / mesh) + 1
        if size % 2:
            size += 1
            t_max += mesh
        self.dt = (t_max - t_min) / (size - 1)
        self.n = _fast_len(size)
        if self.n > MAX_PRV_GRID_POINTS:
            raise ArithmeticError(f"PRV grid of {self.n} points exceeds {MAX_PRV_GRID_POINTS} "
                                  "(noise too small or schedule too long)")
        if sys.float_info.epsilon * self.n > delta - self.delta_error:
            raise ValueError("Floating point errors will dominate for such small values of "
                             "delta. Increase delta or reduce domain size.")
        self.offset = round(-t_min / self.dt)  # index of t = 0
        self.ts = t_min + self.dt * np.arange(self.n)

    @functools.cached_property
    def _support(self) -> tuple[int, int, np.ndarray]:
        """The sigma-free part of every step's discretisation: the first cell that can carry
        mass (its right edge above the loss's lower end log(1 - q)), the number of leading
        cell edges at or below log(1 - q) (CDF 0 there), and z at the edges above it."""
        np = _numpy()
        ts, dt = self.ts, self.dt
        lowest = math.log1p(-self.q) if self.q < 1.0 else -math.inf
        first = max(int(np.searchsorted(ts, lowest - dt / 2, side="right")) - 1, 0)
        edges = np.empty(self.n + 1 - first)
        edges[:-1] = ts[first:] - dt / 2
        edges[-1] = ts[-1] + dt / 2
        np.clip(edges, ts[0], ts[-1], out=edges)
        inner = int(np.searchsorted(edges, lowest, side="right"))
        return first, inner, _loss_z(self.q, edges[inner:])

    def _discretise(self, sigma: float) -> tuple[np.ndarray, float]:
        """Spectrum of one step's truncated, cell-centred, mean-preserving pmf and its shift.

        Only cells above the loss's lower end log(1 - q) carry mass; each cell's mass is a
        difference of CDFs below the median and of survival functions above it, so both tails
        keep their relative precision.
        """
        np = _numpy()
        ts, dt = self.ts, self.dt
        first, inner, z = self._support
        cdf = np.zeros(len(z) + inner)
        sf = np.ones(len(z) + inner)
        cdf[inner:], sf[inner:] = _cdf_sf(self.q, sigma, z)
        remaining = 1.0 - sf[-1] - cdf[0]
        median = int(np.searchsorted(cdf, 0.5, side="left"))  # cdf is non-decreasing
        pmf = np.zeros(self.n)
        tail = pmf[first:]
        tail[:median] = cdf[1:median + 1] - cdf[:median]
        tail[median:] = sf[median:-1] - sf[median + 1:]
        tail /= remaining
        shift = (_truncated_mean(self.q, sigma, float(ts[-1]))
                 - float(np.dot(ts[first:], tail)))
        if not abs(shift) < dt / 2:
            raise ArithmeticError("discrete mean differs from the continuous mean significantly "
                                  f"(shift {shift:.3g}, mesh {dt:.3g})")
        return np.fft.rfft(pmf), shift

    def _compose(self, spectrum: np.ndarray, count: int) -> np.ndarray:
        """The pmf of ``count`` composed steps on the grid (coordinates ts + their shifts).

        The circular convolution of ``count`` pmfs indexed from t_min = -offset * dt sums
        indices, so the result is rolled by -(count - 1) * offset to index from t_min again
        (prv-accountant's Fourier composer, for any grid length).
        """
        np = _numpy()
        f = np.fft.irfft(spectrum, self.n)
        return np.roll(f, (-(count - 1) * self.offset) % self.n)

    def _bounds(self, f: np.ndarray, shift: float) -> tuple[float, float, float]:
        """prv-accountant's (lower, estimate, upper) from the composed pmf.

        delta(eps) needs only sums over t >= eps, so the tail sums are formed over the losses
        above 0 first (half the work); only a negative epsilon needs the whole grid.
        """
        np = _numpy()
        targets = (self.delta + self.delta_error, self.delta, self.delta - self.delta_error)
        for start in (max(0, self.offset - 1), 0):
            tail = f[start:]
            exp_t = np.exp(self.ts[start:] + shift)
            d1 = np.cumsum(tail[::-1])[::-1]
            d2 = np.cumsum((tail / exp_t)[::-1])[::-1]
            neg_delta = exp_t * d2 - d1
            idx = [int(np.searchsorted(neg_delta, -dt, side="left")) for dt in targets]
            if min(idx) > 0 or start == 0:
                break
        if not all(0 < i < len(neg_delta) for i in idx):
            raise ArithmeticError("epsilon lies outside the PRV domain")
        lo, est, up = (math.log((d1[i] - dt) / d2[i]) for i, dt in zip(idx, targets,
                                                                       strict=True))
        return _checked_triple(lo - self.eps_error, est, up + self.eps_error)

    def bounds(self) -> tuple[float, float, float]:
        """(lower, estimate, upper) of the whole schedule."""
        spectrum: Any = 1.0
        shift, count = 0.0, 0
        for sigma, n in _grouped([s for s, _ in self.phases], [n for _, n in self.phases]):
            spec, s = self._discretise(sigma)
            spectrum = spectrum * _power(spec, n)
            shift += n * s
            count += n
        return self._bounds(self._compose(spectrum, count), shift)

    def prefix_bounds(self, ks: Sequence[int]) -> dict[int, tuple[float, float, float]]:
        """Bounds after each of the first k steps (ks ascending), composed incrementally."""
        out: dict[int, tuple[float, float, float]] = {}
        spectrum: Any = 1.0
        shift, done = 0.0, 0
        pending = list(ks)
        start = 0
        for sigma, n in self.phases:
            end = start + n
            if not pending:
                break
            spec, s = self._discretise(sigma)
            powers: dict[int, np.ndarray] = {}  # epochs repeat one step count
            while pending and pending[0] <= end:
                k = pending.pop(0)
                step = k - done
                if step not in powers:
                    powers[step] = _power(spec, step)
                spectrum = spectrum * powers[step]
                shift += step * s
                done = k
                out[k] = self._bounds(self._compose(spectrum, done), shift)
            if done < end:
                spectrum = spectrum * _power(spec, end - done)
                shift += (end - done) * s
                done = end
            start = end
        return out


def _power(x: np.ndarray, n: int) -> np.ndarray:
    """x ** n by binary exponentiation: ~2 log2(n) complex products instead of a complex
    log and exp per element (numpy's general complex power), 10x faster, same accuracy."""
    if n < 1:
        raise ValueError(f"power {n} of a spectrum: compositions count from 1")
    result = None
    base = x
    while True:
        if n & 1:
            result = base.copy() if result is None else result * base
        n >>= 1
        if not n:
            return result
        base = base * base


def _checked_triple(lower: Any, estimate: Any, upper: Any) -> tuple[float, float, float]:
    lo, est, up = float(lower), float(estimate), float(upper)
    if not all(math.isfinite(v) for v in (lo, est, up)) or not lo <= est <= up:
        raise ArithmeticError(f"the PRV accountant returned unusable epsilon bounds "
                              f"({lo!r}, {est!r}, {up!r})")
    return lo, est, up


def _prv_bounds(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
                delta: float, eps_error: float) -> tuple[float, float, float]:
    """PRV (lower, estimate, upper); raises on anything that is not a usable certificate."""
    np = _numpy()
    with np.errstate(all="ignore"):
        grid = _PrvGrid(sample_rate=sample_rate, phases=list(zip(sigmas, steps, strict=True)),
                        delta=delta, eps_error=eps_error)
        return grid.bounds()


def prv_epsilon(*, schedule: Schedule | Sequence[Phase], sample_rate: float, delta: float,
                eps_error: float | None = None) -> EpsilonBounds:
    """PRV epsilon bounds of a schedule (heterogeneous composition, one mechanism per phase).

    Runs in-process without a time bound; eps_error defaults to 0.01 and delta_error is
    delta * 1e-3, as in calibrate.
    """
    sched = _as_schedule(schedule)
    q = _check_sample_rate(sample_rate)
    d = _check_delta(delta)
    err = DEFAULT_PRV_EPS_ERROR if eps_error is None else _check_eps_error(eps_error)
    lo, est, up = _prv_bounds(sigmas=[p.noise_multiplier for p in sched.phases],
                              steps=[p.steps for p in sched.phases], sample_rate=q, delta=d,
                              eps_error=err)
    return EpsilonBounds(lower=lo, estimate=est, upper=up, accountant="prv")


# --------------------------------------------------------------------------------------------
# dp_accounting: events, RDP (the fallback) and PLD (the independent check)


def schedule_events(schedule: Schedule | Sequence[Phase], *, sample_rate: float
                    ) -> list[PoissonSubsampledGaussian]:
    """DP-SGD's accounting events: one self-composed Poisson-subsampled Gaussian per run of
    equal multipliers (what a trial's ledger records)."""
    sched = _as_schedule(schedule).merged()
    q = _check_sample_rate(sample_rate)
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
    d = _check_delta(delta)
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
                    _check_eps_error(value_discretization_interval,
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
    sched = _as_schedule(schedule)
    q = _check_sample_rate(sample_rate)
    d = _check_delta(delta)
    up = _dp_rdp_upper(sigmas=[p.noise_multiplier for p in sched.phases],
                       steps=[p.steps for p in sched.phases], sample_rate=q, delta=d)
    return EpsilonBounds(lower=None, estimate=None, upper=up, accountant="rdp")


def _dp_rdp_upper(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
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
        error = max(coarse - fine, 0.0)
        wanted = VERIFY_MAX_REL_ERROR * target
        if (error <= wanted or interval <= VERIFY_INTERVAL_RANGE[0]
                or refinement == VERIFY_MAX_REFINEMENTS):
            break
        # The pessimistic PLD's excess shrinks about like interval^2 (measured; bench).
        interval = max(VERIFY_INTERVAL_RANGE[0],
                       interval * VERIFY_REFINE_SAFETY * math.sqrt(wanted / error))
    if fine > claim + error + slack:
        raise fail(f"dp_accounting's PLD gives epsilon {fine:.6g} > the claimed upper bound "
                   f"{claim:.6g} + its error {error:.3g}")
    lower = cal.bounds.lower
    if lower is not None and fine < lower - slack:
        raise fail(f"dp_accounting's PLD upper bound {fine:.6g} is below the claimed PRV lower "
                   f"bound {lower:.6g}")
    return IndependentCheck(pld_epsilon=fine, pld_error=error, interval=interval,
                            one_step_epsilon=one_step, seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# Search


class _SearchError(RuntimeError):
    """The window could not be reached within the allowed range or evaluation count."""


class _UnreachableError(RuntimeError):
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
                raise _SearchError("epsilon is not decreasing in the noise scale")
            if ub - ua < 1e-12:
                raise _SearchError(f"no scale gives epsilon in [{lo:.6g}, {hi:.6g}]; "
                                   "the accountant's error exceeds the window")
            u_next = ub - fb * (ub - ua) / (fb - fa) if math.isfinite(fa - fb) else math.nan
            if not ua < u_next < ub:
                u_next = 0.5 * (ua + ub)
        else:
            step = f / slope if math.isfinite(f) else math.copysign(max_step, f)
            u_next = u + min(max(step, -max_step), max_step)
            u_next = min(max(u_next, u_min), u_max)
            if u_next == u:
                raise _SearchError(f"epsilon {eps:.6g} at the edge of the search range "
                                   f"(scale {math.exp(u):.6g}); target window "
                                   f"[{lo:.6g}, {hi:.6g}] is out of reach")
        u = u_next
    raise _SearchError(f"no scale with epsilon in [{lo:.6g}, {hi:.6g}] after "
                       f"{max_evals} evaluations")


def _sigmas(u: float, multipliers: Sequence[float]) -> list[float]:
    scale = math.exp(u)
    return [scale * m for m in multipliers]


def _rdp_anchor(*, multipliers: Sequence[float], steps: Sequence[int], sample_rate: float,
                delta: float, target: float) -> tuple[float, float, float]:
    """Integer-order RDP scale in the 1% window: the PRV search's bracket and the fallback's
    starting point. Returns (log scale, RDP epsilon there, local log-log slope)."""

    def evaluate(u: float) -> float:
        return _rdp_integer_epsilon(sigmas=_sigmas(u, multipliers), steps=steps,
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


def _prv_calibrate(*, multipliers: list[float], steps: list[int], sample_rate: float,
                   delta: float, target: float, eps_error: float) -> dict[str, Any]:
    """PRV calibration: coarse PRV evaluations aim, one fine composition certifies.

    The coarse accountant predicts the fine upper bound as coarse upper - coarse error + fine
    error (the PRV estimate hardly depends on the mesh); the secant search puts that prediction
    at the window's log-centre within COARSE_AIM_RTOL. If the fine bound nonetheless misses the
    window, the prediction is corrected by the observed offset and aimed again; a plain fine
    search is the last resort.
    """
    np = _numpy()
    t0 = time.perf_counter()
    try:
        u_rdp, _, slope = _rdp_anchor(multipliers=multipliers, steps=steps,
                                      sample_rate=sample_rate, delta=delta, target=target)
    except _SearchError as exc:
        raise _UnreachableError(str(exc)) from exc
    u_min = u_rdp - math.log(PRV_SCALE_BELOW_RDP)
    u_max = u_rdp + math.log(PRV_SCALE_ABOVE_RDP)
    centre = math.sqrt(WINDOW) * target
    eps_coarse = _coarse_eps_error(target, eps_error)
    fine_bounds: dict[float, tuple[float, float, float]] = {}
    counts = {"coarse": 0, "fine": 0}

    def coarse(u: float) -> float:
        counts["coarse"] += 1
        _, _, up = _prv_bounds(sigmas=_sigmas(u, multipliers), steps=steps,
                               sample_rate=sample_rate, delta=delta, eps_error=eps_coarse)
        return up - eps_coarse + eps_error

    def fine(u: float) -> float:
        counts["fine"] += 1
        fine_bounds[u] = _prv_bounds(sigmas=_sigmas(u, multipliers), steps=steps,
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
            except _SearchError:
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
    return {"sigmas": _sigmas(found, multipliers), "scale": math.exp(found), "lower": lower,
            "estimate": estimate, "upper": upper, "coarse_evals": counts["coarse"],
            "fine_evals": counts["fine"], "seconds": time.perf_counter() - t0}


def _rdp_calibrate(*, multipliers: Sequence[float], steps: Sequence[int], sample_rate: float,
                   delta: float, target: float) -> tuple[float, float]:
    """The fallback: dp_accounting's RDP upper bound in the window, starting from the integer-
    order RDP answer (never tighter than dp_accounting's, so only a step or two away)."""
    u0, _, slope = _rdp_anchor(multipliers=multipliers, steps=steps, sample_rate=sample_rate,
                               delta=delta, target=target)

    def evaluate(u: float) -> float:
        return _dp_rdp_upper(sigmas=_sigmas(u, multipliers), steps=steps,
                             sample_rate=sample_rate, delta=delta)

    u, eps, _, _ = _search(evaluate, u0=u0, slope=slope, lo=WINDOW * target, hi=target,
                           u_min=math.log(RDP_SCALE_RANGE[0]), u_max=math.log(RDP_SCALE_RANGE[1]),
                           max_step=math.log(1.5), max_evals=MAX_RDP_EVALS)
    return u, eps


# --------------------------------------------------------------------------------------------
# The child process


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    """The child's answer as a message: every outcome, errors included, goes back."""
    try:
        return {"ok": True, "result": _prv_calibrate(**job)}
    except _UnreachableError as exc:
        return {"ok": False, "unreachable": True, "error": str(exc)}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _fork_worker(conn: Any, job: dict[str, Any]) -> None:
    """Entry point of a forked child."""
    try:
        conn.send(_run_job(job))
    finally:
        conn.close()


_RESULT_PREFIX = "dpsweep-prv-result "
_CHILD_CODE = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
               "from orchestrator.budget import _child_loop; _child_loop()")


def _child_loop() -> None:
    """Entry point of a fresh interpreter: one job per stdin line, one answer per stdout line,
    until stdin closes (the parent exited or let it go)."""
    for line in sys.stdin:
        message = _run_job(json.loads(line))
        sys.stdout.write(_RESULT_PREFIX + json.dumps(message) + "\n")
        sys.stdout.flush()


@dataclass(frozen=True)
class _ChildOutcome:
    result: dict[str, Any] | None
    reason: str | None = None
    timed_out: bool = False
    #: the child failed to start or died: says nothing about this question, so not cached
    transient: bool = False
    unreachable: bool = False


def _start_method() -> str:
    """"fork" when this process has exactly one OS thread, else a fresh interpreter.

    Forking is cheap (nothing to re-import) and safe when no other thread can hold a lock the
    child needs; with threads (Ray, torch, OpenBLAS pools) only a fresh interpreter is safe.
    That interpreter is started with subprocess rather than multiprocessing's "spawn", which
    would re-run the caller's main script (a script without a __main__ guard would recurse, a
    Ray worker would re-import Ray). Linux shows every thread in /proc/self/task; elsewhere
    fork is not trusted.
    """
    if not sys.platform.startswith("linux"):
        return "subprocess"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return "subprocess"
    return "fork" if threads == 1 else "subprocess"


def _outcome(msg: dict[str, Any]) -> _ChildOutcome:
    if not msg.get("ok"):
        return _ChildOutcome(None, f"the PRV accountant failed ({msg.get('error')}); RDP used",
                             unreachable=bool(msg.get("unreachable")))
    return _ChildOutcome(msg["result"])


def _prv_in_child(job: dict[str, Any], timeout_s: float) -> _ChildOutcome:
    """Run the PRV calibration in a child process, killed at the time bound."""
    if _start_method() == "fork":
        return _prv_in_fork(job, timeout_s)
    return _prv_in_subprocess(job, timeout_s)


def _prv_in_fork(job: dict[str, Any], timeout_s: float) -> _ChildOutcome:
    ctx = multiprocessing.get_context("fork")
    recv_end, send_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fork_worker, args=(send_end, job), name="dpsweep-prv",
                       daemon=True)
    try:
        proc.start()
    except Exception as exc:
        recv_end.close()
        return _ChildOutcome(None, f"the PRV accountant could not be started in a child process "
                                   f"({type(exc).__name__}: {exc}); RDP used", transient=True)
    finally:
        send_end.close()  # so a child that dies without answering reads as EOF here
    try:
        if not recv_end.poll(None if math.isinf(timeout_s) else timeout_s):
            return _timed_out(timeout_s)
        try:
            msg = recv_end.recv()
        except EOFError:
            proc.join(5)
            return _died(f"code {proc.exitcode}")
        proc.join(5)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        recv_end.close()
    return _outcome(msg)


class _Interpreter:
    """A fresh interpreter that answers PRV jobs for as long as it lives.

    Started once and reused: its start and imports cost about 0.5 s here, a job 0.01-0.3 s, and
    a sweep's precompute asks two dozen. One job at a time; one that outlives its time bound or
    dies takes the interpreter with it (killed, never reused), so the bound holds as with a
    child per job."""

    def __init__(self) -> None:
        import subprocess
        import tempfile

        self.stderr = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, json.dumps(sys.path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
        except BaseException:
            self.stderr.close()
            raise
        self.pending = b""

    def ask(self, job: dict[str, Any], timeout_s: float) -> tuple[_ChildOutcome, bool]:
        """The outcome, and whether this interpreter may answer another job."""
        import select

        deadline = math.inf if math.isinf(timeout_s) else time.monotonic() + timeout_s
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return self._died(), False
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(_RESULT_PREFIX):
                    return _outcome(json.loads(text[len(_RESULT_PREFIX):])), True
            wait = None if math.isinf(deadline) else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return _timed_out(timeout_s), False
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                continue  # the deadline is checked above
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return self._died(), False
            self.pending += chunk

    def _died(self) -> _ChildOutcome:
        try:
            code = self.proc.wait(5)
        except Exception:
            code = None
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return _died(f"code {code}: {lines[-1]}" if lines else f"code {code}")

    def close(self, *, kill: bool) -> None:
        """Let it go: stdin closed (it exits on EOF), or killed (a job still running)."""
        try:
            if kill:
                self.proc.kill()
            elif self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            self.stderr.close()


#: Interpreters waiting for a job (at most one per thread that asked at once), this process's,
#: kept only inside :func:`keep_interpreters` (depth in ``_KEEP``).
_IDLE: list[_Interpreter] = []
_IDLE_LOCK = threading.Lock()
_IDLE_OWNER = os.getpid()
_KEEP = 0


def _close_idle() -> None:
    with _IDLE_LOCK:
        idle = list(_IDLE) if os.getpid() == _IDLE_OWNER else []
        _IDLE.clear()
    for child in idle:
        child.close(kill=False)


atexit.register(_close_idle)


@contextlib.contextmanager
def keep_interpreters() -> Iterator[None]:
    """Keep PRV child interpreters for the next job while inside (a sweep's budget precompute:
    two dozen jobs); outside, each job's interpreter exits after its answer, so none outlives
    the work that asked for it."""
    global _KEEP
    with _IDLE_LOCK:
        _KEEP += 1
    try:
        yield
    finally:
        with _IDLE_LOCK:
            _KEEP -= 1
            last = _KEEP == 0
        if last:
            _close_idle()


def _prv_in_subprocess(job: dict[str, Any], timeout_s: float) -> _ChildOutcome:
    with _IDLE_LOCK:
        child = _IDLE.pop() if _IDLE and os.getpid() == _IDLE_OWNER else None
    if child is None:
        try:
            child = _Interpreter()
        except OSError as exc:
            return _ChildOutcome(None, f"the PRV accountant could not be started in a child "
                                       f"process ({type(exc).__name__}: {exc}); RDP used",
                                 transient=True)
    try:
        outcome, reusable = child.ask(job, timeout_s)
    except BaseException:
        child.close(kill=True)
        raise
    if not reusable:
        child.close(kill=True)
        return outcome
    with _IDLE_LOCK:
        keep = _KEEP > 0 and os.getpid() == _IDLE_OWNER
        if keep:
            _IDLE.append(child)
    if not keep:
        child.close(kill=False)
    return outcome


def _timed_out(timeout_s: float) -> _ChildOutcome:
    return _ChildOutcome(None, f"the PRV accountant did not finish within {timeout_s:g} s; RDP "
                               "used", timed_out=True)


def _died(detail: str) -> _ChildOutcome:
    return _ChildOutcome(None, f"the PRV accountant's process exited ({detail}) without an "
                               "answer; RDP used", transient=True)


# --------------------------------------------------------------------------------------------
# Cache


def default_cache_dir() -> Path:
    """$DPSWEEP_CACHE_DIR, else ~/.cache/dpsweep/budget: shared by all trials of a machine."""
    env = os.environ.get(_ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dpsweep" / "budget"


_VERIFIED: set[str] = set()
"""Canonical hashes of (key, entry) pairs verified in this process: identical bytes get the same
verdict, so they are not re-verified."""


def _cache_for(cache_dir: str | Path | None) -> JsonCache:
    return JsonCache(default_cache_dir() if cache_dir is None else Path(cache_dir),
                     CACHE_NAMESPACE)


def _cached_calibration(value: Any, *, key: dict[str, Any], shape: Schedule, path: Path,
                        timeout: float) -> Calibration | None:
    """The verified cached answer, None if more time may now give a PRV answer; a cached
    answer that fails any check raises CacheIntegrityError naming the file."""
    def bad(why: str) -> CacheIntegrityError:
        return CacheIntegrityError(field="budget cache", value=str(path),
                                   allowed=f"a consistent calibration entry, but {why}; delete "
                                           "the file to recompute")

    try:
        cal = Calibration.from_dict(value["calibration"])
        failed_timeout = value.get("prv_timeout_s")
        failed_timeout = None if failed_timeout is None else float(failed_timeout)
    except (UserInputError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad(f"it does not parse ({exc})") from None
    if failed_timeout is not None and timeout > failed_timeout:
        return None
    expected = {"target_epsilon": float(key["target_epsilon"]), "delta": float(key["delta"]),
                "sample_rate": float(key["sample_rate"]), "eps_error": float(key["eps_error"])}
    for name, want in expected.items():
        if getattr(cal, name) != want:
            raise bad(f"its {name} {getattr(cal, name)!r} differs from the question's {want!r}")
    phases, wanted = cal.schedule.phases, shape.phases
    if len(phases) != len(wanted) or any(
            p.steps != w.steps or not math.isclose(p.noise_multiplier, cal.scale
                                                   * w.noise_multiplier, rel_tol=1e-12)
            for p, w in zip(phases, wanted, strict=False)):
        raise bad("its schedule is not scale x the requested shape")
    b = cal.bounds
    ordered = (b.lower is None) == (b.estimate is None) and (
        b.lower is None or (b.lower <= b.estimate <= b.upper))  # type: ignore[operator]
    if b.accountant != cal.accountant or not ordered or (cal.accountant == "prv"
                                                          and b.lower is None):
        raise bad("its bounds are malformed")
    if not WINDOW * cal.target_epsilon <= b.upper <= cal.target_epsilon:
        raise bad(f"its upper bound {b.upper!r} is outside [{WINDOW} T, T]")
    digest = canonical_hash({"key": key, "value": value})
    if digest not in _VERIFIED:
        check = verify_calibration(cal, source=str(path))
        logger.info("cached calibration verified: PLD %.6f (error %.3g) vs upper %.6f in %.2f s",
                    check.pld_epsilon, check.pld_error, b.upper, check.seconds)
        _VERIFIED.add(digest)
    return dataclasses.replace(cal, cached=True)


# --------------------------------------------------------------------------------------------
# Public entry points


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
    returned; a hit that fails raises CacheIntegrityError. use_cache=False neither reads nor
    writes the cache. A cached fallback caused by a timeout is retried when a longer timeout_s
    is given.
    """
    target = _check_epsilon(target_epsilon)
    d = _check_delta(delta)
    q = _check_sample_rate(sample_rate)
    if (steps is None) == (shape is None):
        raise UserInputError(field="steps", value={"steps": steps, "shape": shape},
                             allowed="exactly one of steps (constant noise) or shape "
                                     "(a schedule of relative noise multipliers)")
    if steps is not None:
        n = _whole(steps, field="steps", low=1, allowed="an integer >= 1")
        shape_sched = Schedule.constant(noise_multiplier=1.0, steps=n)
    else:
        shape_sched = _as_schedule(shape, field="shape")
    timeout = _check_timeout(timeout_s)

    eps_error = _fine_eps_error(target)
    key = {
        "schema": SCHEMA_VERSION,
        "kind": "calibration",
        "sample_rate": repr(q),
        "shape": [[repr(p.noise_multiplier), p.steps] for p in shape_sched.phases],
        "delta": repr(d),
        "target_epsilon": repr(target),
        "eps_error": repr(eps_error),
    }
    cache = _cache_for(cache_dir) if use_cache else None
    if cache is not None:
        value = cache.get(key)
        if value is not None:
            cal = _cached_calibration(value, key=key, shape=shape_sched, path=cache.path(key),
                                      timeout=timeout)
            if cal is not None:
                return cal

    t0 = time.perf_counter()
    multipliers = [p.noise_multiplier for p in shape_sched.phases]
    counts = [p.steps for p in shape_sched.phases]
    job = {"multipliers": multipliers, "steps": counts, "sample_rate": q, "delta": d,
           "target": target, "eps_error": eps_error}
    outcome = _prv_in_child(job, timeout)
    result, reason = outcome.result, outcome.reason
    if result is None and outcome.unreachable:
        raise UserInputError(field="privacy.epsilon", value=target_epsilon,
                             allowed=f"a budget reachable with noise scales in "
                                     f"{list(RDP_SCALE_RANGE)} ({reason})")
    if result is not None and not WINDOW * target <= result["upper"] <= target:
        reason = (f"the PRV accountant's answer failed the final check (upper epsilon "
                  f"{result['upper']!r} outside [{WINDOW * target:.6g}, {target:g}]); RDP used")
        result = None
    if result is not None:
        logger.info("PRV calibration: %d coarse and %d fine compositions in %.2f s",
                    result["coarse_evals"], result["fine_evals"], result["seconds"])
        sigmas, scale = result["sigmas"], result["scale"]
        bounds = EpsilonBounds(lower=result["lower"], estimate=result["estimate"],
                               upper=result["upper"], accountant="prv")
        accountant, fallback = "prv", None
    else:
        logger.warning("budget calibration fell back to RDP: %s", reason)
        try:
            u, eps_rdp = _rdp_calibrate(multipliers=multipliers, steps=counts, sample_rate=q,
                                        delta=d, target=target)
        except _SearchError as exc:
            raise UserInputError(field="privacy.epsilon", value=target_epsilon,
                                 allowed=f"a budget reachable with noise scales in "
                                         f"{list(RDP_SCALE_RANGE)} ({exc})") from exc
        sigmas, scale = _sigmas(u, multipliers), math.exp(u)
        bounds = EpsilonBounds(lower=None, estimate=None, upper=eps_rdp, accountant="rdp")
        accountant, fallback = "rdp", reason
    cal = Calibration(
        target_epsilon=target, delta=d, sample_rate=q,
        schedule=Schedule(tuple(Phase(noise_multiplier=s, steps=n)
                                for s, n in zip(sigmas, counts, strict=True))),
        scale=scale, bounds=bounds, accountant=accountant, fallback_reason=fallback,
        eps_error=eps_error, seconds=time.perf_counter() - t0, cached=False)
    logger.info("calibrated noise %.6g (scale) for epsilon %g, delta %g, q %g, %d steps: "
                "upper %.6f via %s in %.2f s", scale, target, d, q, cal.steps, bounds.upper,
                accountant, cal.seconds)
    if cache is not None and not outcome.transient:
        value = {"calibration": cal.to_dict(),
                 "prv_timeout_s": timeout if outcome.timed_out else None}
        if cache.put(key, value) is None:
            logger.warning("could not write the budget cache under %s", cache.directory)
        else:
            _VERIFIED.add(canonical_hash({"key": key, "value": value}))
    return cal


def epsilon_curve(calibration: Calibration, *, at_steps: Sequence[int],
                  cache_dir: str | Path | None = None,
                  use_cache: bool | None = None) -> list[EpsilonBounds]:
    """Epsilon spent after k steps of the calibrated schedule, for each k in at_steps.

    One incremental composition: the calibration's own PRV grid (same eps_error), its spectrum
    multiplied up step range by step range, one inverse FFT per point. Prefixes are post-
    processings of the whole run, so every point is capped at the calibration's upper bound, and
    the point at the full step count is the calibration's certificate itself. RDP calibrations
    get integer-order RDP points (capped the same way).

    ``cache_dir`` and ``use_cache`` are deprecated and ignored: a curve costs less to recompute
    than a cached one would cost to re-verify.
    """
    if cache_dir is not None or use_cache is not None:
        warnings.warn("epsilon_curve(cache_dir=..., use_cache=...) is deprecated and ignored: "
                      "curves are recomputed", DeprecationWarning, stacklevel=2)
    if not isinstance(calibration, Calibration):
        raise UserInputError(field="calibration", value=type(calibration).__name__,
                             allowed="a Calibration returned by calibrate()")
    total = calibration.steps
    if isinstance(at_steps, (str, bytes)):
        raise UserInputError(field="at_steps", value=at_steps,
                             allowed=f"a sequence of integers in [1, {total}]")
    ks = [_whole(k, field="at_steps", low=1, allowed=f"integers in [1, {total}]")
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


#: Curves composed in this process, keyed by everything a curve depends on. A sweep's driver
#: asks for the same schedule's curve once per trial (``orchestrator.trial.match_budget``); a
#: curve is a pure function of its key, so the second ask is a lookup, not a composition.
CURVE_MEMO_SIZE = 64
_CURVES: dict[tuple[Any, ...], dict[int, EpsilonBounds]] = {}


def _capped(lower: float | None, estimate: float | None, upper: float, *, cap: float,
            accountant: str) -> EpsilonBounds:
    up = min(upper, cap)
    est = None if estimate is None else min(estimate, up)
    low = None if lower is None else min(lower, up if est is None else est)
    return EpsilonBounds(lower=low, estimate=est, upper=up, accountant=accountant)


def _prv_curve(cal: Calibration, ks: Sequence[int]) -> dict[int, EpsilonBounds]:
    np = _numpy()
    with np.errstate(all="ignore"):
        grid = _PrvGrid(sample_rate=cal.sample_rate,
                        phases=[(p.noise_multiplier, p.steps) for p in cal.schedule.phases],
                        delta=cal.delta, eps_error=cal.eps_error)
        raw = grid.prefix_bounds([k for k in ks if k < cal.steps])
    return {k: _capped(*b, cap=cal.bounds.upper, accountant="prv") for k, b in raw.items()}


def _rdp_curve(cal: Calibration, ks: Sequence[int]) -> dict[int, EpsilonBounds]:
    np = _numpy()
    sigmas = [p.noise_multiplier for p in cal.schedule.phases]
    out: dict[int, EpsilonBounds] = {}
    with np.errstate(all="ignore"):
        for k in ks:
            counts = [p.steps for p in cal.schedule.prefix(k).phases]
            up = _rdp_integer_epsilon(sigmas=sigmas[:len(counts)], steps=counts,
                                      sample_rate=cal.sample_rate, delta=cal.delta)
            out[k] = _capped(None, None, up, cap=cal.bounds.upper, accountant="rdp")
    return out


def certify(*, schedule: Schedule | Sequence[Phase], sample_rate: float, delta: float,
            target_epsilon: float | None = None) -> Calibration:
    """The accountant's certificate for a schedule fixed elsewhere (private tuning derives the
    per-trial noise from its end-to-end target): fine PRV bounds, no search."""
    started = time.perf_counter()
    sched = _as_schedule(schedule)
    eps_error = DEFAULT_PRV_EPS_ERROR
    bounds = prv_epsilon(schedule=sched, sample_rate=sample_rate, delta=delta,
                         eps_error=eps_error)
    return Calibration(target_epsilon=bounds.upper if target_epsilon is None else target_epsilon,
                       delta=delta, sample_rate=sample_rate, schedule=sched, scale=sched.first,
                       bounds=bounds, accountant="prv", fallback_reason=None,
                       eps_error=eps_error, seconds=time.perf_counter() - started, cached=False)
