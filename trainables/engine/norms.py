"""Per-example norms that neither underflow nor overflow, for the engine and the DP step.

Squaring float32 entries flushes anything below ~1e-19 towards zero (subnormal or 0), so the
naive sum of squares of a block of tiny entries under-computes its norm (0.89x at entries of
2e-23, 0.30x at 1e-23); a rule that divides by the norm then overshoots its bound. Rows are
divided by their largest magnitude first and the scale is multiplied back in float64.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.lazy import lazy_module
from trainables.engine.host_reads import host_reads_allowed

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

__all__ = ["SAFE_RANGE", "row_scale", "row_sums", "scaled_sq_norms"]

#: Rows whose largest magnitude lies in this range are used as they are (no division pass):
#: their largest squares, and the largest products of two Gram entries (<= T^2 d p 2^80 for a
#: ghost norm), are normal float32 numbers, so what flushes to zero (each below 2^-126) is far
#: below the rounding of the sum, and nothing overflows.
SAFE_RANGE = (2.0 ** -20, 2.0 ** 20)


#: Elements per float32 partial sum in :func:`row_sums` and the norms: a float32 reduction over
#: a whole row loses precision with its length (a 2.4M-entry norm was 4e-5 low, a 9M one 3e-4,
#: enough to let a clipped example past C), one over 1024 entries keeps ~1e-9; the partial
#: results are added in float64.
PARTIAL = 1024


#: The shortest chunk worth a view of its own (see ``_chunks``).
MIN_CHUNK = 64


def _chunks(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, M] as [B, M / k, k] chunks and a tail: without a copy (no tail) where a power of
    two k in [``MIN_CHUNK``, ``PARTIAL``] divides M (a 3x3 convolution's 2,304 entries: k =
    256), else chunks of ``PARTIAL`` and the [B, M % PARTIAL] rest."""
    n = flat.shape[1]
    k = PARTIAL
    while k > MIN_CHUNK and n % k:
        k //= 2
    if n % k == 0 and flat.is_contiguous():
        return flat.view(flat.shape[0], n // k, k), None
    whole = n // PARTIAL * PARTIAL
    head = flat[:, :whole].reshape(flat.shape[0], -1, PARTIAL)
    return head, (flat[:, whole:] if whole < n else None)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """[B] float64 sums of each example's entries of x (any shape), accurately: float32
    partial sums over ``PARTIAL`` entries, added in float64."""
    flat = x.reshape(x.shape[0], -1)
    if flat.shape[1] <= PARTIAL:
        return flat.sum(dim=1).double()
    head, tail = _chunks(flat)
    total = head.sum(dim=2).double().sum(dim=1)
    return total if tail is None else total + tail.sum(dim=1).double()


def _sq_norms(flat: torch.Tensor) -> torch.Tensor:
    """[B] float64 squared norms of the rows of ``flat``, from per-chunk float32 norms."""
    if flat.shape[1] <= PARTIAL:  # one chunk: one kernel
        return torch.linalg.vector_norm(flat, dim=1).double().square()
    head, tail = _chunks(flat)
    total = torch.linalg.vector_norm(head, dim=2).double().square().sum(dim=1)
    if tail is not None:
        total = total + torch.linalg.vector_norm(tail, dim=1).double().square()
    return total


#: Entries below which the rows are normed without asking whether they need scaling (a host
#: read of a reduction costs more than the work on a small block): widened to float64 where
#: that is exact, else always scaled.
SMALL = 1 << 14
#: Dtypes whose squares are normal float64 numbers over their whole range.
_WIDENED = ("float32", "float16", "bfloat16")


def _in_range(scale: torch.Tensor) -> bool:
    """Whether every row may skip the division pass. Only asked where the host may read
    (:func:`trainables.engine.host_reads.host_reads_allowed`): on an accelerator the answer would
    cost a device synchronisation per module and step, more than the division it saves, so rows
    there are always scaled."""
    if not host_reads_allowed(scale.device):
        return False
    return bool(((scale >= SAFE_RANGE[0]) & (scale <= SAFE_RANGE[1])).all())


def scaled_sq_norms(g: torch.Tensor) -> torch.Tensor:
    """[B] squared L2 norms of the rows of g, in float64, without underflow or overflow.

    Squaring float32 entries flushes anything below ~1e-19 towards zero (subnormal or 0), so a
    block of tiny entries had its norm under-computed and a method that divides by the norm
    over-scaled it past its bound. Each row is divided by its largest magnitude first (exact up
    to rounding), normed in its own dtype, and the scale multiplied back in float64. A row with
    a non-finite entry gets an infinite norm (every clipping rule then gives it nothing).
    """
    flat = g.reshape(g.shape[0], -1)
    if flat.shape[1] == 0:
        return torch.zeros(flat.shape[0], dtype=torch.float64, device=flat.device)
    if flat.numel() <= SMALL and str(flat.dtype).removeprefix("torch.") in _WIDENED:
        # a float32 square never underflows or overflows in float64: no scaling to do
        sq = torch.linalg.vector_norm(flat.double(), dim=1).square()
        return torch.nan_to_num(sq, nan=math.inf, posinf=math.inf)
    scale = flat.abs().amax(dim=1)
    if flat.numel() > SMALL and _in_range(scale):
        return _sq_norms(flat)
    finite = torch.isfinite(scale)
    safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
    sq = _sq_norms(flat / safe.unsqueeze(1)) * safe.double().square()
    return torch.where(finite, sq, torch.full_like(sq, float("inf")))


def row_scale(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t with each example's row divided by its largest magnitude, that magnitude in float64),
    so products of per-example factors (Gram matrices) are formed at unit scale."""
    flat = t.reshape(t.shape[0], -1)
    scale = flat.abs().amax(dim=1) if flat.shape[1] else torch.zeros(
        flat.shape[0], dtype=t.dtype, device=t.device)
    if _in_range(scale):
        return t, torch.ones_like(scale, dtype=torch.float64)
    safe = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
    unit = t / safe.view(-1, *([1] * (t.dim() - 1)))
    return unit, torch.where(torch.isfinite(scale), safe.double(),
                             torch.full_like(safe, float("inf"), dtype=torch.float64))
