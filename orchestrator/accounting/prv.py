"""The PRV accountant of Gopi, Lee & Wutschitz, "Numerical Composition of Differential Privacy"
(arXiv 2106.02848): tight numerical composition with certified error bars.

``PrvGrid`` is prv-accountant 0.2.0's algorithm (its domain from an RDP bound, Remark 5.6; its
mesh, Theorem 5.5; its mean-preserving cell-centred discretisation; Fourier self-composition;
its epsilon bounds) computed in float64 with numpy's FFT on a 5-smooth grid length, instead of in
long double on whatever length the domain gives. That is ~10x faster and agrees with
prv-accountant to ~1e-8 in epsilon (``tests/unit/orchestrator/test_budget.py`` checks it against
the library), and
it needs only numpy and ``scipy.special``: importing prv-accountant pulls in ``scipy.signal`` and
``scipy.stats``, which alone cost more than the whole ``dpsweep budget`` command may take.

The grid's domain comes from an RDP bound of the Poisson-subsampled Gaussian at integer orders,
vectorised with numpy (``rdp_integer_orders``): microseconds per schedule, it is also the
calibration search's cheap bracket (any valid RDP bound is a valid domain). numpy is imported on
first use, not with the module: its thread pool would stop a sandbox from forking.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpsweep.core.schedule import Phase, Schedule
from dpsweep.core.trial import EpsilonBounds
from dpsweep.orchestrator.accounting.certificate import (
    as_schedule,
    check_delta,
    check_positive,
    check_sample_rate,
)
from dpsweep.orchestrator.config.checks import RDP_MAX_ORDER

if TYPE_CHECKING:
    import numpy as np

DEFAULT_PRV_EPS_ERROR = 0.01
"""prv_epsilon's eps_error when none is given (calibrate derives its own from the target)."""

DELTA_ERROR_FACTOR = 1e-3
"""PRV's delta_error = delta * DELTA_ERROR_FACTOR, as prv-accountant recommends."""

PRV_DOMAIN_MARGIN = 3.0
"""prv-accountant adds 3 to the RDP-derived domain half-width L."""

MAX_PRV_GRID_POINTS = 1 << 23
"""Larger grids (tiny noise, very long schedules) are refused: RDP answers instead."""

MAX_PRV_LOSS = 600.0
"""Privacy losses beyond this overflow exp() in float64: such grids are refused (and
``verify`` searches the exact one-step epsilon no further)."""

# The truncated mean of one step's privacy loss (trapezoid rule over the output o).
MEAN_RANGE_SIGMAS = 40.0
MEAN_POINTS_PER_SIGMA = 50.0
MEAN_STRIP_FRACTION = 6.0
"""Step h = min(sigma / 50, pi sigma^2 / 6): the integrand is analytic in a strip of half-width
pi sigma^2 (where 1 - q + q exp((2o - 1) / (2 sigma^2)) vanishes), so the trapezoid error is
below exp(-2 pi * 6), and the Gaussian tails beyond 40 sigma are below exp(-800)."""

_SQRT2 = math.sqrt(2.0)


# ---- integer-order RDP: the grid's domain and the search's bracket ------------------------
DOMAIN_RDP_MAX_ORDER = RDP_MAX_ORDER
"""Integer RDP orders 2..128 bound the domain (any valid RDP bound is a valid domain); config
validation derives the smallest certifiable epsilon from the same orders."""


def load_numpy() -> Any:
    """numpy, imported on first use (see the module docstring)."""
    import numpy

    return numpy


@functools.lru_cache(maxsize=8)
def _rdp_binomial_terms(sample_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """The sigma-free part of log A_alpha's terms, log C(a, i) + i log q + (a - i) log(1 - q)
    (-inf where i > a), and i^2 - i, for orders a = 2..DOMAIN_RDP_MAX_ORDER."""
    np = load_numpy()
    top = DOMAIN_RDP_MAX_ORDER
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, top + 1)))])
    a = np.arange(2, top + 1)[:, None]
    i = np.arange(top + 1)[None, :]
    valid = i <= a
    rest = np.where(valid, a - i, 0)
    base = (log_fact[a] - log_fact[i] - log_fact[rest] + i * math.log(sample_rate)
            + rest * math.log1p(-sample_rate))
    return np.where(valid, base, -np.inf), (i * i - i).astype(np.float64)


def rdp_integer_orders(sample_rate: float, sigmas: Sequence[float]) -> np.ndarray:
    """RDP at orders 2..DOMAIN_RDP_MAX_ORDER, one row per sigma: exact at integer orders
    (Mironov, Talwar & Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism",
    arXiv 1908.10530, Sec. 3.3)."""
    np = load_numpy()
    orders = np.arange(2, DOMAIN_RDP_MAX_ORDER + 1, dtype=np.float64)
    inv = 1.0 / (2.0 * np.asarray(sigmas, dtype=np.float64) ** 2)
    if sample_rate >= 1.0:
        return inv[:, None] * orders[None, :]
    base, quad = _rdp_binomial_terms(sample_rate)
    terms = base[None, :, :] + inv[:, None, None] * quad[None, :, :]
    peak = terms.max(axis=2, keepdims=True)
    log_a = peak[..., 0] + np.log(np.exp(terms - peak).sum(axis=2))
    return log_a / (orders - 1.0)[None, :]


def rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta) from RDP (Canonne, Kamath & Steinke, arXiv 2004.00010, Prop. 12; the
    conversion prv-accountant and Opacus use)."""
    np = load_numpy()
    orders = np.arange(2, DOMAIN_RDP_MAX_ORDER + 1, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        eps = rdp - np.log(delta * orders) / (orders - 1.0) + np.log1p(-1.0 / orders)
    return float(np.nanmin(eps))


def rdp_integer_epsilon(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
                        delta: float) -> float:
    groups = grouped(sigmas, steps)
    rdp = rdp_integer_orders(sample_rate, [s for s, _ in groups])
    counts = load_numpy().asarray([n for _, n in groups], dtype=float)
    return rdp_to_epsilon(counts @ rdp, delta)


def grouped(sigmas: Sequence[float], steps: Sequence[int]) -> list[tuple[float, int]]:
    """(sigma, total steps) per distinct sigma: RDP and the PRV's spectra add per mechanism."""
    out: dict[float, int] = {}
    for s, n in zip(sigmas, steps, strict=True):
        out[s] = out.get(s, 0) + n
    return list(out.items())


# ---- the PRV grid ------------------------------------------------------------------------
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
    np = load_numpy()
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
    np = load_numpy()
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


class PrvGrid:
    """One discretisation grid for a schedule's mechanisms (Gopi et al., arXiv 2106.02848).

    The domain [-L, L] comes from an RDP bound on the composition at delta_error / 4 and on each
    step at delta_error / (8 N) (Remark 5.6), the mesh from eps_error (Theorem 5.5); the grid is
    then extended on the right to a 5-smooth length for a fast FFT (more domain never hurts).
    Prefix compositions reuse the grid, so an epsilon curve costs one inverse FFT per point.
    """

    def __init__(self, *, sample_rate: float, phases: Sequence[tuple[float, int]], delta: float,
                 eps_error: float) -> None:
        np = load_numpy()
        self.q = sample_rate
        self.delta = delta
        self.eps_error = eps_error
        self.delta_error = delta * DELTA_ERROR_FACTOR
        self.phases = [(float(s), int(n)) for s, n in phases]
        total = sum(n for _, n in self.phases)
        groups = grouped([s for s, _ in self.phases], [n for _, n in self.phases])
        rdp = rdp_integer_orders(sample_rate, [s for s, _ in groups])
        bound = rdp_to_epsilon(np.asarray([n for _, n in groups], dtype=float) @ rdp,
                               self.delta_error / 4)
        for row in rdp:
            bound = max(bound, rdp_to_epsilon(row, self.delta_error / 8 / total))
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
        np = load_numpy()
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
        np = load_numpy()
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
        np = load_numpy()
        f = np.fft.irfft(spectrum, self.n)
        return np.roll(f, (-(count - 1) * self.offset) % self.n)

    def _bounds(self, f: np.ndarray, shift: float) -> tuple[float, float, float]:
        """prv-accountant's (lower, estimate, upper) from the composed pmf.

        delta(eps) needs only sums over t >= eps, so the tail sums are formed over the losses
        above 0 first (half the work); only a negative epsilon needs the whole grid.
        """
        np = load_numpy()
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
        for sigma, n in grouped([s for s, _ in self.phases], [n for _, n in self.phases]):
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


def prv_bounds(*, sigmas: Sequence[float], steps: Sequence[int], sample_rate: float,
               delta: float, eps_error: float) -> tuple[float, float, float]:
    """PRV (lower, estimate, upper); raises on anything that is not a usable certificate."""
    np = load_numpy()
    with np.errstate(all="ignore"):
        grid = PrvGrid(sample_rate=sample_rate, phases=list(zip(sigmas, steps, strict=True)),
                       delta=delta, eps_error=eps_error)
        return grid.bounds()


def prv_epsilon(*, schedule: Schedule | Sequence[Phase], sample_rate: float, delta: float,
                eps_error: float | None = None) -> EpsilonBounds:
    """PRV epsilon bounds of a schedule (heterogeneous composition, one mechanism per phase).

    Runs in-process without a time bound; eps_error defaults to 0.01 and delta_error is
    delta * 1e-3, as in calibrate.
    """
    sched = as_schedule(schedule)
    q = check_sample_rate(sample_rate)
    d = check_delta(delta)
    err = (DEFAULT_PRV_EPS_ERROR if eps_error is None
           else check_positive(eps_error, field="eps_error"))
    lo, est, up = prv_bounds(sigmas=[p.noise_multiplier for p in sched.phases],
                             steps=[p.steps for p in sched.phases], sample_rate=q, delta=d,
                             eps_error=err)
    return EpsilonBounds(lower=lo, estimate=est, upper=up, accountant="prv")
