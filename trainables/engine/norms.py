"""Certified per-example norms: upper bounds whose floating-point error is bounded analytically.

A clipping rule divides by a norm, so a norm that comes out low releases more than the bound.
Every norm here is therefore an *upper bound* of the true norm of what is released:

* a plain norm (a materialised block) is summed in float32 partials of ``PARTIAL`` entries,
  added in float64, and inflated by ``gamma(PARTIAL + 2)``: the error of any summation order of
  nonnegative terms (Higham, "Accuracy and Stability of Numerical Algorithms", section 3.1),
  so no layout of entries (one large entry among many small ones, 16.8M entries) can bring
  it below the float64 norm, and it stays within about 1e-6 above it;
* rows are divided by a power of two near their largest magnitude (exact in floating point)
  only where that magnitude lies outside ``SAFE_RANGE`` (squares that would underflow or
  overflow); the decision is each row's own, so no example's norm depends on another's;
* a ghost norm (from Gram matrices, :func:`certified_ghost_sq`) carries the error bound of its
  Grams and its sum, and of the native kernel that releases the example's sum, both
  proportional to ``(sum_t ||a_t|| ||b_t||)^2``: rank-one terms that cancel cannot hide there.

:func:`full_precision` keeps an accelerator's reduced-precision matmul (TF32) out of the norms
and the sums whose errors these bounds assume.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.host_reads import host_reads_allowed

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

__all__ = ["PARTIAL", "SAFE_RANGE", "SUM_PARTIAL", "certified_ghost_sq",
           "certified_released_sq", "full_precision", "gamma", "plain_slack", "row_scale",
           "row_sums", "scaled_sq_norms", "unit_roundoff"]

#: Rows whose largest magnitude lies in this range are used unscaled: their squares, and the
#: products of two Gram entries (<= T^2 d p 2^80 for a ghost norm), are normal float32 numbers,
#: so nothing overflows and what flushes to zero is far below the certificate's slack.
SAFE_RANGE = (2.0 ** -20, 2.0 ** 20)
#: Squares per float32 partial sum of a norm: the certificate's relative slack on a squared
#: norm is ``gamma(PARTIAL + 2)`` (1.1e-6, with the products that follow under 1e-6 on the
#: norm); longer partials cost less (1024: 0.2x on 2 CPU cores) but loosen it in proportion.
PARTIAL = 16
#: Rows of at most this many entries are normed in float64 (a copy costs little there), so a
#: product of two such norms (a Linear layer at one position) stays within 1e-6 of float64.
WIDEN_ROW = 4096
#: Entries per float32 partial sum of a Gram product (:func:`row_sums`): its error joins a
#: ghost norm's certificate (gamma(SUM_PARTIAL) on the terms' magnitudes, below the Grams' own
#: gamma_d for any fan-in over 64).
SUM_PARTIAL = 64
#: Factor on every first-order error term of a ghost or released norm: it covers the
#: second-order terms and the rounding of the bound ``(sum_t ||a_t|| ||b_t||)^2`` itself (each
#: far below half the first-order term while the total stays under ``MAX_GAMMA``).
SAFETY = 2.0
#: A first-order relative error at or beyond this is no bound: the norm is taken as infinite.
MAX_GAMMA = 0.25
#: Relative rounding of the coefficient products c x g and of the float32 cast of c that
#: follow the norm (in units of the roundoff of the gradient's dtype).
PRODUCT_ROUNDINGS = 4


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff u of ``dtype`` (2^-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of any order of a sum of
    n terms (on the sum of their magnitudes); infinite where n u >= 1."""
    nu = n * u
    return nu / (1 - nu) if nu < 1 else math.inf


@contextlib.contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Full float32 matmuls and convolutions on an accelerator (no TF32, no reduced-precision
    reductions) for the norms' Grams and the released sums, whose certificates assume
    float32's roundoff; the user's settings are restored after. A no-op on the CPU."""
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.allow_tf32, cudnn.allow_tf32,
             matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved


def _chunks(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, M] as [B, M // k, k] (a view where it can be) and the [B, M % k] tail."""
    n = flat.shape[1]
    whole = n // k * k
    if whole == n and flat.is_contiguous():
        return flat.view(flat.shape[0], -1, k), None
    head = flat[:, :whole].reshape(flat.shape[0], -1, k)
    return head, (flat[:, whole:] if whole < n else None)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """[B] float64 sums of each example's entries of x (any shape): float32 partial sums over
    ``SUM_PARTIAL`` entries, added in float64 (error <= gamma(SUM_PARTIAL) x the sum of
    magnitudes)."""
    flat = x.reshape(x.shape[0], -1)
    if flat.shape[1] <= SUM_PARTIAL or flat.dtype == torch.float64:
        return flat.sum(dim=1, dtype=torch.float64)
    head, tail = _chunks(flat, SUM_PARTIAL)
    total = head.sum(dim=2).double().sum(dim=1)
    return total if tail is None else total + tail.sum(dim=1).double()


def _sq_norms(flat: torch.Tensor) -> torch.Tensor:
    """[B] float64 squared norms of the rows of ``flat``: in float64 for rows of at most
    ``WIDEN_ROW`` entries, else from float32 partial norms."""
    if flat.dtype == torch.float64 or flat.shape[1] <= WIDEN_ROW:
        return torch.linalg.vector_norm(flat.double(), dim=1).square()
    if flat.shape[1] <= PARTIAL:
        return torch.linalg.vector_norm(flat, dim=1).double().square()
    head, tail = _chunks(flat, PARTIAL)
    total = torch.linalg.vector_norm(head, dim=2).double().square().sum(dim=1)
    if tail is not None:
        total = total + torch.linalg.vector_norm(tail, dim=1).double().square()
    return total


def _pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """Each row's own scale: 1 inside ``SAFE_RANGE`` (and for zero or non-finite rows), else
    the power of two at or just below its largest magnitude, so the division is exact."""
    inside = (amax >= SAFE_RANGE[0]) & (amax <= SAFE_RANGE[1])
    usable = torch.isfinite(amax) & (amax > 0) & ~inside
    _, exponent = torch.frexp(torch.where(usable, amax, torch.ones_like(amax)))
    # 2^(e - 1) <= amax < 2^e: representable in the row's dtype at both ends of its range
    pow2 = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), (exponent - 1).double())
    return torch.where(usable, pow2, torch.ones_like(pow2))


def _any_outside(amax: torch.Tensor) -> bool:
    """Whether some row needs scaling; where the host may not read (an accelerator) the answer
    is taken as yes, and every row is divided by its own scale (1 where it needs none)."""
    if not host_reads_allowed(amax.device):
        return True
    return not bool(((amax >= SAFE_RANGE[0]) & (amax <= SAFE_RANGE[1])).all())


def row_scale(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t with each example's row divided by its own power-of-two scale, that scale in float64
    (infinite for a row with a non-finite entry)), so products of per-example factors (Gram
    matrices) are formed without overflow or underflow. Each row's scale is its own: dividing
    the rows that need no scaling by 1 is exact, so skipping the division when none does gives
    every row the same values."""
    flat = t.reshape(t.shape[0], -1)
    amax = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(
        flat.shape[0], dtype=t.dtype, device=t.device)
    finite = torch.isfinite(amax)
    if not _any_outside(amax):
        return t, torch.ones_like(amax, dtype=torch.float64)
    scale = _pow2_scales(amax)
    unit = t / scale.to(t.dtype).view(-1, *([1] * (t.dim() - 1)))
    return unit, torch.where(finite, scale, torch.full_like(scale, math.inf))


def plain_slack(n: int, dtype: torch.dtype) -> float:
    """Relative slack that makes :func:`_sq_norms` of n entries of ``dtype`` an upper bound:
    partial sums of ``PARTIAL`` squares (and the rounded root and square of each partial),
    the float64 sum of the partials, and the products that follow the norm."""
    u = unit_roundoff(dtype)
    partial = gamma(min(n, PARTIAL) + 2, u) if n > WIDEN_ROW and dtype != torch.float64 \
        else 0.0
    return (1 + partial) * (1 + gamma(n + 2, unit_roundoff(torch.float64))) \
        * (1 + PRODUCT_ROUNDINGS * u) ** 2 - 1


def scaled_sq_norms(g: torch.Tensor) -> torch.Tensor:
    """[B] certified squared L2 norms of the rows of g, in float64: never below the true
    squared norm of the row as stored, and within :func:`plain_slack` (~2e-6) above it.

    Rows are scaled by their own power of two where their squares would underflow or
    overflow (:func:`row_scale`); a row with a non-finite entry gets an infinite norm (every
    clipping rule then gives it nothing).
    """
    flat = g.reshape(g.shape[0], -1)
    if flat.shape[1] == 0:
        return torch.zeros(flat.shape[0], dtype=torch.float64, device=flat.device)
    unit, scale = row_scale(flat)
    sq = _sq_norms(unit) * scale.square() * (1 + plain_slack(flat.shape[1], flat.dtype))
    # an underflowed square is below the smallest normal number: one per entry, at most
    floor = flat.shape[1] * torch.finfo(flat.dtype).tiny * scale.square()
    sq = torch.where(sq > 0, sq + floor, sq)
    return torch.nan_to_num(torch.where(torch.isfinite(scale), sq, math.inf),
                            nan=math.inf, posinf=math.inf)


def _release_terms(terms: torch.Tensor, *, release_terms: int, dtype: torch.dtype,
                   extra: float = 0.0) -> tuple[torch.Tensor, float]:
    """(sqrt of the bound on the sum of the rank-one terms' magnitudes, the relative error of
    the native kernel that releases the example's sum of ``release_terms`` terms)."""
    g = gamma(release_terms, unit_roundoff(dtype)) + extra
    return terms.clamp_min(0).sqrt(), g


def certified_ghost_sq(sq: torch.Tensor, terms: torch.Tensor, *, input_terms: int,
                       output_terms: int, release_terms: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """[B] upper bound of the squared norm of an example's released weight gradient, from its
    ghost estimate ``sq`` = sum_ts <a_t, a_s> <b_t, b_s> formed from float32 Grams.

    Each Gram entry is a dot product over ``input_terms`` (``output_terms``) entries, wrong by
    at most gamma_n ||a_t|| ||a_s||; their products and the float32 partial sums of
    :func:`row_sums` add gamma_SUM_PARTIAL and a few roundings, all on at most ``terms`` =
    (sum_t ||a_t|| ||b_t||)^2; the native kernel that releases the sum of the example's
    ``release_terms`` rank-one terms is wrong by at most gamma_n sqrt(terms) in norm.
    """
    u = unit_roundoff(dtype)
    g_norm = gamma(input_terms, u) + gamma(output_terms, u) + gamma(SUM_PARTIAL, u) + 3 * u
    root, g_release = _release_terms(terms, release_terms=release_terms, dtype=dtype)
    return _certify(sq, terms, root, g_norm=g_norm, g_release=g_release, dtype=dtype)


def certified_released_sq(sq: torch.Tensor, terms: torch.Tensor, *, materialised_terms: int,
                          release_terms: int, dtype: torch.dtype) -> torch.Tensor:
    """[B] upper bound of the squared norm of an example's released weight gradient where the
    norm ``sq`` (certified, :func:`scaled_sq_norms`) is of its materialised gradient, summed in
    float32 over ``materialised_terms`` rank-one terms, and the release is the native kernel's
    sum of ``release_terms``: each differs from the exact gradient by at most gamma_n
    sqrt(terms) in norm."""
    u = unit_roundoff(dtype)
    root, g_release = _release_terms(terms, release_terms=release_terms, dtype=dtype,
                                     extra=gamma(materialised_terms, u))
    return _certify(sq, terms, root, g_norm=0.0, g_release=g_release, dtype=dtype)


def _certify(sq: torch.Tensor, terms: torch.Tensor, root: torch.Tensor, *, g_norm: float,
             g_release: float, dtype: torch.dtype) -> torch.Tensor:
    if SAFETY * max(g_norm, g_release) >= MAX_GAMMA:
        return torch.full_like(sq, math.inf)
    u = unit_roundoff(dtype)
    norm = (sq.clamp_min(0) + SAFETY * g_norm * terms.clamp_min(0)).sqrt()
    out = (norm + SAFETY * g_release * root).square() * (1 + PRODUCT_ROUNDINGS * u) ** 2
    return torch.nan_to_num(out, nan=math.inf, posinf=math.inf)
