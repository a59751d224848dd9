"""Power-law tail exponent of a weight matrix's eigenvalue spectrum (WeightWatcher's alpha).

WW-DP-SGD steers its clipping norm by this one number, so it lives apart from training: numpy
and scipy only, no torch, testable against the ``powerlaw`` package on fixed data.

The estimator follows Clauset, Shalizi & Newman (2009, SIAM Review 51(4), "Power-law
distributions in empirical data"), as their ``plfit`` and the ``powerlaw`` package implement it:

* for a candidate cutoff lambda_min, the continuous maximum-likelihood exponent of the tail
  {lambda_i >= lambda_min} (n points) is ``alpha = 1 + n / sum ln(lambda_i / lambda_min)``;
* lambda_min is the candidate (every distinct eigenvalue but the largest) whose fit has the
  smallest Kolmogorov-Smirnov distance ``max |S(x) - P(x)|`` between the tail's empirical CDF
  (S = k/n at the k-th smallest tail point, 0-based, as ``plfit`` and ``powerlaw`` take it) and
  the fitted ``P(x) = 1 - (x / lambda_min)^(1 - alpha)``.

Small matrices get a fixed top-k rule instead (see :func:`fit_tail_exponent`): with fewer than
:data:`KS_MIN_EIGS` eigenvalues the KS scan chooses among a handful of tails whose distances
differ by less than their own sampling noise (resolution 1/n_tail), so lambda_min, and with it
the exponent, jumps from probe to probe; a fixed rule keeps the controller's signal smooth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Below this many (positive) eigenvalues the KS scan is replaced by the top-k rule.
KS_MIN_EIGS = 50
#: Fewest tail points a fit may use (KS candidates leaving fewer are skipped).
MIN_TAIL = 10
#: Share of the spectrum the top-k rule fits (the top half), never fewer than ``min_tail``.
TOP_K_FRACTION = 0.5
#: Eigenvalues below this fraction of the largest are numerical zeros of a rank-deficient
#: matrix (float64 SVD noise is ~1e-32 relative), not part of the spectrum.
ZERO_RTOL = 1e-10


@dataclass(frozen=True)
class TailFit:
    """One tail fit: exponent, cutoff, goodness of fit, tail size and which rule chose it.

    ``method`` is ``"ks"`` (cutoff by minimal KS distance), ``"top_k"`` (small-matrix rule) or
    ``"failed"`` (fewer than two distinct positive eigenvalues, or non-finite input; then
    ``zeta`` is NaN and the controller holds its state).
    """

    zeta: float
    lambda_min: float
    ks_distance: float
    n_tail: int
    method: str


_FAILED = TailFit(zeta=math.nan, lambda_min=math.nan, ks_distance=math.nan, n_tail=0,
                  method="failed")


def layer_matrix(weight: np.ndarray) -> np.ndarray:
    """The weight as a 2-D matrix: dense as is, conv (C_out, C_in, kh, kw) as C_out x C_in*kh*kw.

    One row per output unit / filter, so a conv layer's spectrum is comparable with a dense
    layer's (the paper's reshaping, Section 8.2).
    """
    w = np.asarray(weight)
    if w.ndim < 2:
        raise ValueError(f"a layer weight has at least 2 dimensions, got shape {w.shape}")
    return w.reshape(w.shape[0], -1)


def eigenvalues(matrix: np.ndarray) -> np.ndarray:
    """Eigenvalues of W^T W (squared singular values of W), ascending, in float64."""
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {m.shape}")
    s = np.linalg.svd(m, compute_uv=False)
    return np.sort(s * s)


def _tail_alpha(log_x: np.ndarray, start: int) -> float:
    """Continuous MLE exponent of the sorted tail ``x[start:]`` with lambda_min = x[start]."""
    total = float(np.sum(log_x[start:]) - (log_x.size - start) * log_x[start])
    return math.inf if total <= 0 else 1.0 + (log_x.size - start) / total


def _ks_distance(x: np.ndarray, left: np.ndarray, start: int, alpha: float) -> float:
    """KS distance of the tail ``x[start:]`` to the power law (alpha, lambda_min = x[start]).

    ``left[j]`` counts the points below x[j] (ties share one CDF value, as in ``powerlaw``).
    """
    tail = x[start:]
    m = tail.size
    model = 1.0 - (tail / tail[0]) ** (1.0 - alpha)
    empirical = (left[start:] - start) / m
    return float(np.max(np.abs(model - empirical)))


def fit_tail_exponent(
    eigs: np.ndarray,
    *,
    min_tail: int = MIN_TAIL,
    ks_min_eigs: int = KS_MIN_EIGS,
    top_k_fraction: float = TOP_K_FRACTION,
) -> TailFit:
    """Fit p(lambda) ~ lambda^-zeta to the upper tail of a spectrum.

    Rule: drop numerical zeros (below ``ZERO_RTOL`` x the largest). With n >= ``ks_min_eigs``
    eigenvalues, scan every distinct eigenvalue as lambda_min, keeping tails of at least
    ``min_tail`` points, fit alpha by MLE and keep the fit of minimal KS distance (Clauset et
    al. 2009). With fewer, use the top-k rule: lambda_min = the k-th largest eigenvalue,
    k = max(min_tail, ceil(top_k_fraction * n)) capped at n, and the same MLE. ``min_tail=2``
    and ``ks_min_eigs=0`` reproduce ``powerlaw.Fit(data, xmin=None)``'s scan exactly.
    """
    if min_tail < 2:
        raise ValueError(f"min_tail must be >= 2 (a tail of one point has no exponent), "
                         f"got {min_tail}")
    if not 0 < top_k_fraction <= 1:
        raise ValueError(f"top_k_fraction must be in (0, 1], got {top_k_fraction}")
    x = np.asarray(eigs, dtype=np.float64).ravel()
    if x.size == 0 or not np.all(np.isfinite(x)):
        return _FAILED
    x = np.sort(x)
    if x[-1] <= 0:
        return _FAILED
    x = x[x > x[-1] * ZERO_RTOL]
    n = x.size
    if n < 2 or x[0] == x[-1]:
        return _FAILED
    log_x = np.log(x)
    left = np.searchsorted(x, x, side="left")

    if n >= ks_min_eigs:
        # first index of each distinct value; the largest is never a cutoff (tail of ties)
        starts = np.unique(left)[:-1]
        starts = starts[n - starts >= min_tail]
        best: TailFit | None = None
        for start in starts.tolist():
            alpha = _tail_alpha(log_x, start)
            if not math.isfinite(alpha):
                continue
            d = _ks_distance(x, left, start, alpha)
            if best is None or d < best.ks_distance:
                best = TailFit(zeta=alpha, lambda_min=float(x[start]), ks_distance=d,
                               n_tail=n - start, method="ks")
        if best is not None:
            return best
        # no candidate leaves min_tail points with spread: fall through to the fixed rule

    k = min(n, max(min_tail, math.ceil(top_k_fraction * n)))
    start = int(left[n - k])  # include every tie of the k-th largest value
    alpha = _tail_alpha(log_x, start)
    if not math.isfinite(alpha):
        return _FAILED
    return TailFit(zeta=alpha, lambda_min=float(x[start]),
                   ks_distance=_ks_distance(x, left, start, alpha), n_tail=n - start,
                   method="top_k")


def weight_tail_exponent(
    weight: np.ndarray,
    *,
    min_tail: int = MIN_TAIL,
    ks_min_eigs: int = KS_MIN_EIGS,
    top_k_fraction: float = TOP_K_FRACTION,
) -> TailFit:
    """:func:`fit_tail_exponent` of a layer weight's spectrum (conv kernels reshaped)."""
    return fit_tail_exponent(eigenvalues(layer_matrix(weight)), min_tail=min_tail,
                             ks_min_eigs=ks_min_eigs, top_k_fraction=top_k_fraction)
