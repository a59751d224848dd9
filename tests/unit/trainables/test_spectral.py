"""The tail-exponent estimator WW-DP-SGD steers by: accuracy, agreement with ``powerlaw``, rules."""

from __future__ import annotations

import functools
import math
import statistics
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dpsweep.trainables.data.splits import load_splits
from dpsweep.trainables.dp.spectral import (
    KS_MIN_EIGS,
    eigenvalues,
    fit_tail_exponent,
    layer_matrix,
    weight_tail_exponent,
)
from dpsweep.trainables.models.networks import digits_cnn

powerlaw = pytest.importorskip("powerlaw")

#: Our scan in powerlaw's configuration (every distinct value a candidate, tails down to 2).
MIRROR = {"min_tail": 2, "ks_min_eigs": 0}
#: Same data, same algorithm: only powerlaw's numerical MLE (used for alpha outside (1.5, 3])
#: could separate the two; measured differences are ~1e-15 relative.
MIRROR_RTOL = 1e-6


def _powerlaw_fit(data: np.ndarray) -> tuple[float, float]:
    """powerlaw's (alpha, xmin). From 2.0 on it bounds alpha to [0, 3] by default (the fit
    then pins at 3.0 for steeper tails), so the bound is lifted to alpha > 1."""
    major = int(str(getattr(powerlaw, "__version__", "1")).split(".")[0])
    extra = {"parameter_ranges": {"alpha": [1, None]}} if major >= 2 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = powerlaw.Fit(data, xmin=None, verbose=False, **extra)
    return float(fit.power_law.alpha), float(fit.xmin)


def _power_law_sample(alpha: float, n: int, seed: int) -> np.ndarray:
    """Inverse-CDF draws from p(x) ~ x^-alpha on [1, inf)."""
    u = np.random.default_rng(seed).random(n)
    return (1.0 - u) ** (-1.0 / (alpha - 1.0))


# ---- accuracy on known exponents ---------------------------------------------------------
@pytest.mark.parametrize("alpha", [2.5, 3.5, 5.0])
def test_recovers_synthetic_exponent(alpha: float) -> None:
    """n = 5000: the MLE's sd, (alpha - 1)/sqrt(n_tail), stays well inside 0.15 for alpha = 5
    (at n = 500 it is 0.18 for alpha = 5, so single fits cannot be held to 0.15 there)."""
    for seed in range(3):
        fit = fit_tail_exponent(_power_law_sample(alpha, 5000, seed))
        assert fit.method == "ks"
        assert abs(fit.zeta - alpha) < 0.15, (seed, fit)
        assert fit.lambda_min >= 1.0 and fit.n_tail >= 1000


@pytest.mark.parametrize("alpha", [2.5, 3.5, 5.0])
def test_unbiased_at_500_samples(alpha: float) -> None:
    """At n = 500 single fits are noisy, but their median over seeds is within 0.15."""
    zetas = [fit_tail_exponent(_power_law_sample(alpha, 500, 100 + s)).zeta for s in range(15)]
    assert abs(statistics.median(zetas) - alpha) < 0.15, zetas


def test_mle_formula_at_the_chosen_cutoff() -> None:
    x = _power_law_sample(3.0, 800, 7)
    fit = fit_tail_exponent(x)
    tail = x[x >= fit.lambda_min]
    assert fit.n_tail == tail.size
    assert fit.zeta == pytest.approx(1 + tail.size / np.sum(np.log(tail / fit.lambda_min)))


# ---- agreement with the powerlaw package -------------------------------------------------
@functools.cache
def _random_spectrum(kind: str) -> np.ndarray:
    return eigenvalues(_random_matrix(kind))


@functools.cache
def _powerlaw_on_random(kind: str) -> tuple[float, float]:
    return _powerlaw_fit(_random_spectrum(kind))


def _random_matrix(kind: str) -> np.ndarray:
    rng = np.random.default_rng(1)
    shape = (250, 500)
    if kind == "gaussian":
        return rng.standard_normal(shape)
    if kind == "student_t3":
        return rng.standard_t(3, shape)
    if kind == "student_t2":
        return rng.standard_t(2, shape)
    return rng.pareto(1.5, shape) * rng.choice([-1.0, 1.0], shape)


@pytest.mark.parametrize("kind", ["gaussian", "student_t3", "student_t2", "pareto1.5"])
def test_scan_matches_powerlaw_on_random_matrices(kind: str) -> None:
    eigs = _random_spectrum(kind)
    alpha, xmin = _powerlaw_on_random(kind)
    mirror = fit_tail_exponent(eigs, **MIRROR)
    assert mirror.lambda_min == xmin
    assert mirror.zeta == pytest.approx(alpha, rel=MIRROR_RTOL)


@pytest.mark.parametrize("kind", ["gaussian", "student_t3", "student_t2", "pareto1.5"])
def test_default_fit_agrees_with_powerlaw(kind: str) -> None:
    """Our default (tails >= 10 points) equals powerlaw wherever powerlaw's tail is that long,
    as on all of these; where powerlaw picks a shorter tail (e.g. a 300 x 600 Gaussian matrix:
    8 points, alpha ~ 25, a spectrum with no power-law tail) the two differ by design."""
    eigs = _random_spectrum(kind)
    alpha, xmin = _powerlaw_on_random(kind)
    assert np.sum(eigs >= xmin) >= 10
    fit = fit_tail_exponent(eigs)
    assert fit.method == "ks"
    assert fit.zeta == pytest.approx(alpha, rel=MIRROR_RTOL)


def _trained_digits_cnn() -> torch.nn.Module:
    """A digits CNN after 150 plain SGD steps: real trained weights, in about a second."""
    torch.manual_seed(0)
    data = load_splits(dataset="digits", seed=0)
    model = digits_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = torch.randint(0, data.train.x.shape[0], (64,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(data.train.x[idx]), data.train.y[idx]).backward()
        opt.step()
    return model


def test_scan_matches_powerlaw_on_trained_layers() -> None:
    model = _trained_digits_cnn()
    for name in ("conv2", "fc1"):
        weight = model.blocks[name][0 if name.startswith("conv") else 1].weight
        eigs = eigenvalues(layer_matrix(weight.detach().double().numpy()))
        assert eigs.size == 32 < KS_MIN_EIGS  # small: the default takes the top-k rule
        alpha, xmin = _powerlaw_fit(eigs)
        mirror = fit_tail_exponent(eigs, **MIRROR)
        assert mirror.lambda_min == xmin, name
        assert mirror.zeta == pytest.approx(alpha, rel=MIRROR_RTOL), name
        assert fit_tail_exponent(eigs).method == "top_k"


# ---- the small-matrix rule, reshaping, edge cases -----------------------------------------
def test_top_k_rule_on_a_small_matrix() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_t(3, (20, 64))  # 20 eigenvalues < KS_MIN_EIGS
    eigs = eigenvalues(w)
    fit = fit_tail_exponent(eigs)
    assert fit.method == "top_k"
    assert fit.n_tail == 10  # max(min_tail = 10, ceil(0.5 * 20))
    assert fit.lambda_min == eigs[-10]
    tail = eigs[-10:]
    assert fit.zeta == pytest.approx(1 + 10 / np.sum(np.log(tail / tail[0])))
    assert fit_tail_exponent(eigs, top_k_fraction=0.8).n_tail == 16
    assert fit_tail_exponent(eigenvalues(w[:6])).n_tail == 6  # fewer than min_tail: all
    # the threshold: 50 eigenvalues switch to the KS scan
    assert fit_tail_exponent(eigenvalues(rng.standard_t(3, (50, 100)))).method == "ks"


def test_conv_weights_reshaped_per_filter() -> None:
    conv = torch.nn.Conv2d(3, 8, kernel_size=(2, 5))
    w = conv.weight.detach().numpy()
    m = layer_matrix(w)
    assert m.shape == (8, 3 * 2 * 5)
    for f in range(8):  # row f = filter f, flattened over (C_in, kh, kw)
        np.testing.assert_array_equal(m[f], w[f].ravel())
    np.testing.assert_allclose(eigenvalues(m), np.sort(np.linalg.svd(m, compute_uv=False) ** 2))
    fit = weight_tail_exponent(w)
    assert fit == fit_tail_exponent(eigenvalues(m))
    dense = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(layer_matrix(dense), dense)
    with pytest.raises(ValueError):
        layer_matrix(np.ones(5))


def test_degenerate_spectra_fail_softly() -> None:
    for eigs in (np.array([]), np.ones(60), np.array([0.0, 0.0, 1.0]),
                 np.array([1.0, math.nan, 2.0])):
        fit = fit_tail_exponent(eigs)
        assert fit.method == "failed" and math.isnan(fit.zeta)
    # numerical zeros of a rank-deficient matrix are dropped, not fitted
    rng = np.random.default_rng(0)
    rank_20 = rng.standard_normal((60, 20)) @ rng.standard_normal((20, 100))
    eigs = eigenvalues(rank_20)
    fit = fit_tail_exponent(eigs)
    assert fit.method == "top_k" and fit.n_tail == 10  # 20 real eigenvalues, not 60
    assert fit == fit_tail_exponent(eigs[-20:])
    with pytest.raises(ValueError):
        fit_tail_exponent(eigs, min_tail=1)
