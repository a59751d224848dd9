"""Where a trial's data live, and whether the trial fits its share of a GPU (issue 33).

**Data.** A trial's splits go to the device once when they take at most ``DATA_SHARE`` of the
memory the trial may use there: each step's Poisson batch is then drawn as device indices and
gathered on the device, and nothing crosses the bus per step. Splits that would crowd the
device stay in host memory; each batch is then gathered on the host into pinned (page-locked)
memory and copied with ``non_blocking=True``, which does not make the host wait for the
device. Only the batches are pinned, not the splits: page-locking a data set too large for
the device would take as much host memory out of the operating system's hands for nothing,
since a gathered batch is a new buffer anyway. On the CPU the data are where the model is.

**Share.** Ray lets several trials share one GPU (``resources.gpus_per_trial`` < 1), but every
trial sees the whole device: nothing but the trial itself keeps it within its share. At the
start of a CUDA trial torch's allocator is capped at the share, and the trial measures what one
physical batch of its real step needs (the engine's norms and weighted sum on the first
``max_physical_batch`` training examples, with the data and model in place; nothing is
released, so it costs no privacy). A trial whose need, with ``HEADROOM`` for fragmentation and
the growth of a step's state, exceeds its share is refused in one line that says what to
change, instead of failing out of memory mid-training or starving its neighbours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch

    from dpsweep.trainables.data.splits import DataSplits
    from dpsweep.trainables.dp.step import DPStep
else:
    torch = lazy_module("torch")

__all__ = ["DATA_SHARE", "HEADROOM", "ON_DEVICE", "PINNED_HOST", "PLACED_SPLITS",
           "check_headroom", "claim_share", "data_bytes", "data_placement", "decide_placement",
           "ensure_headroom", "gather", "measure_peak", "place"]

#: Largest fraction of the trial's device memory its data may take there: the rest is left to
#: the model, the per-example gradients of a physical batch and the allocator's slack.
DATA_SHARE = 0.25
#: Factor over the measured peak of one physical batch that the trial's share must hold.
HEADROOM = 1.25
#: The splits a training run places (the holdout is the audit's, loaded by it).
PLACED_SPLITS = ("train", "validation", "test", "shadow")
#: The placements, as the privacy record's ``method_record["data_placement"]`` names them.
ON_DEVICE = "device"
PINNED_HOST = "pinned host"
_GIB = float(1 << 30)


def data_bytes(data: DataSplits) -> int:
    """Bytes of the splits a training run places (inputs and labels)."""
    return sum(getattr(data, name).x.nbytes + getattr(data, name).y.nbytes
               for name in PLACED_SPLITS)


def data_placement(*, data_bytes: int, free_bytes: int, total_bytes: int,
                   share: float) -> str:
    """``ON_DEVICE`` when ``data_bytes`` are at most ``DATA_SHARE`` of the memory this trial
    may use (its ``share`` of the device's ``total_bytes``, or what is free if less), else
    ``PINNED_HOST``. Pure: the numbers come from ``torch.cuda.mem_get_info``."""
    usable = min(float(free_bytes), share * float(total_bytes))
    return ON_DEVICE if data_bytes <= DATA_SHARE * usable else PINNED_HOST


def check_headroom(*, peak_bytes: int | None, share: float, total_bytes: int,
                   max_physical_batch: int) -> None:
    """Refuse a trial whose measured peak on one physical batch, times ``HEADROOM``, exceeds
    its share of the device (``peak_bytes`` None: the measurement itself ran out of memory).

    One line, as every bad setting is reported: the field (``resources.gpus_per_trial``) and
    its value, the need and the share in GiB, and the two settings that fix it."""
    allowed = share * float(total_bytes)
    if peak_bytes is not None and peak_bytes * HEADROOM <= allowed:
        return
    need = ("more than the share (one physical batch ran out of memory)" if peak_bytes is None
            else f"{peak_bytes * HEADROOM / _GIB:.2f} GiB ({peak_bytes / _GIB:.2f} GiB measured "
                 f"on one physical batch x {HEADROOM:g} headroom)")
    raise UserInputError(
        field="resources.gpus_per_trial", value=share,
        allowed=f"a GPU share that holds the trial: it needs {need}, its share is "
                f"{allowed / _GIB:.2f} GiB of the device's {total_bytes / _GIB:.2f} GiB; lower "
                f"training.max_physical_batch (now {max_physical_batch}) or raise "
                "resources.gpus_per_trial")


def claim_share(device: torch.device, *, share: float) -> tuple[int, int]:
    """Cap torch's allocator on the CUDA ``device`` at ``share`` of it; (free, total) bytes."""
    torch.cuda.set_per_process_memory_fraction(share, device)
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def measure_peak(method: DPStep, x: torch.Tensor, y: torch.Tensor,
                 *, device: torch.device) -> int | None:
    """Peak bytes allocated on the CUDA ``device`` while the method's engine computes the norms
    and one weighted sum of the batch (x, y) (the first physical batch); None when it ran out
    of memory. The global generators are forked, so training draws what it would have."""
    torch.cuda.reset_peak_memory_stats(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with torch.random.fork_rng(devices=[index]):
            view = method.engine.compute(x, y, live=method.trainable_layers())
            view.weighted_sum(torch.ones_like(view.norms))
            del view
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return int(torch.cuda.max_memory_allocated(device))


def place(t: torch.Tensor, *, placement: str, device: torch.device) -> torch.Tensor:
    """A split's tensor where ``placement`` keeps it: on ``device``, or in host memory."""
    return t.to(device) if placement == ON_DEVICE else t


def gather(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
           *, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch ``idx`` of (x, y) on ``device``. Indices live with the data (the sampler
    draws them there): indexed in place, or, for data in host memory and a model on an
    accelerator, gathered into pinned memory and copied without waiting for the device."""
    if x.device.type == device.type:
        return x[idx], y[idx]
    return _pinned_take(x, idx).to(device, non_blocking=True), \
        _pinned_take(y, idx).to(device, non_blocking=True)


def _pinned_take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` written straight into pinned memory (torch's pinned allocator keeps the
    buffer until the copy from it has finished)."""
    out = torch.empty((idx.shape[0], *t.shape[1:]), dtype=t.dtype, pin_memory=True)
    return torch.index_select(t, 0, idx, out=out)



def decide_placement(data: DataSplits, *, device: torch.device, share: float) -> str:
    """Where the trial's splits go: on CUDA (after capping torch's allocator at the trial's
    ``share``) by :func:`data_placement`; on any other device they are where the model is."""
    if device.type != "cuda":
        return ON_DEVICE
    free, total = claim_share(device, share=share)
    return data_placement(data_bytes=data_bytes(data), free_bytes=free, total_bytes=total,
                          share=share)


def ensure_headroom(method: DPStep, x: torch.Tensor, y: torch.Tensor, *,
                    device: torch.device, share: float) -> None:
    """On CUDA, refuse the trial unless its share holds one physical batch of its real step
    with ``HEADROOM`` (:func:`measure_peak`, :func:`check_headroom`); elsewhere nothing."""
    if device.type != "cuda":
        return
    k = min(method.max_physical_batch, int(y.shape[0]))
    first = torch.arange(k, device=x.device)
    xb, yb = gather(x, y, first, device=device)
    peak = measure_peak(method, xb, yb, device=device)
    total = int(torch.cuda.mem_get_info(device)[1])
    check_headroom(peak_bytes=peak, share=share, total_bytes=total,
                   max_physical_batch=method.max_physical_batch)
