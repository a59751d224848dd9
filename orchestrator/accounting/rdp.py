"""RDP of the Poisson-subsampled Gaussian at integer orders, vectorised with numpy.

Microseconds per schedule: the calibration search's cheap bracket and the PRV grid's domain
(any valid RDP bound is a valid domain). numpy is imported on first use, not with the module:
its thread pool would stop a sandbox from forking.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

DOMAIN_RDP_MAX_ORDER = 128
"""Integer RDP orders 2..128 bound the domain (any valid RDP bound is a valid domain)."""


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
