"""Host reads of device values: where a step may make them, and a guard that proves it does not.

On an accelerator every read of a tensor's value by Python (``.item()``, ``bool(t)``,
``float(t)``, ``.tolist()``, ``.cpu()``, a ``nonzero`` whose size the host must know) waits for
the device to finish everything queued before it: a step that reads once per module runs at
the speed of its launches. A DP step therefore makes none; counters stay on the device and
are read once per epoch, where the loop logs them.

On the CPU such a read costs nothing, and some rules use it to skip work
(``trainables.engine.norms``
asks whether rows need scaling). They ask :func:`host_reads_allowed` first, which says no on an
accelerator and inside :func:`forbid_host_reads`: the guard makes the CPU take the very branch
a GPU takes, and fails on any read, so a test on the CPU proves the GPU step free of them.

One kind of tensor lives on the host on every device: torch's Adam keeps its step counter on
the CPU beside CUDA parameters (``capturable=False``) and reads it every step, which waits for
nothing. :func:`host_resident` marks such a tensor, and the guard lets a read of it (and of it
alone) pass.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dpsweep.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

__all__ = ["HostRead", "forbid_host_reads", "host_reads_allowed", "host_resident", "to_device"]

#: aten operators whose result the host must read (a scalar's value, an output size).
_READING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive",
                "_unique2", "repeat_interleave")
#: Indexing by a boolean mask: the result's size is the mask's count, read by the host.
_INDEXING_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")
#: Tensor methods that copy values to the host without an aten operator on a CPU tensor.
_READING_METHODS = ("tolist", "numpy", "cpu", "item")

_forbidden = 0
#: id -> weak reference of each tensor marked by :func:`host_resident` (by identity: a set of
#: tensors would compare them by value, itself a read).
_resident: dict[int, weakref.ref[Any]] = {}


class HostRead(RuntimeError):
    """A value was read by the host inside a step that must not read any."""


def host_reads_allowed(device: torch.device) -> bool:
    """Whether a rule may read a tensor on ``device`` to skip work: on the CPU, outside the
    guard."""
    return device.type == "cpu" and not _forbidden


def host_resident(*tensors: torch.Tensor) -> None:
    """Mark CPU tensors that stay on the host whatever device the step runs on (an optimizer's
    step counter), so that the guard lets a read of them pass: on an accelerator too, reading
    them waits for nothing. Never for a value the device computed."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"only a tensor on the host can be host-resident, not {t.device}")
        key = id(t)
        _resident[key] = weakref.ref(t, lambda _ref, key=key: _resident.pop(key, None))


def _is_resident(t: Any) -> bool:
    ref = _resident.get(id(t))
    return ref is not None and ref() is t


def _boolean_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _mode_type() -> type:
    class _Guard(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            name = func._schema.name.split("::")[-1]
            resident = name == "_local_scalar_dense" and _is_resident(args[0])
            if (name in _READING_OPS and not resident) or (name in _INDEXING_OPS
                                                             and _boolean_index(args)):
                raise HostRead(f"the step read a device value on the host ({name})")
            return func(*args, **(kwargs or {}))

    return _Guard


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[None]:
    """Fail on any host read of a tensor's value inside the block (tests; see the module
    docstring), and make :func:`host_reads_allowed` say no on the CPU too."""
    global _forbidden
    saved = {m: getattr(torch.Tensor, m) for m in _READING_METHODS}

    def refuse(method: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if method == "item" and _is_resident(self):
                return saved[method](self, *args, **kwargs)
            raise HostRead(f"the step read a device value on the host (Tensor.{method})")
        return read

    _forbidden += 1
    try:
        for m in _READING_METHODS:
            setattr(torch.Tensor, m, refuse(m))
        with _mode_type()():
            yield
    finally:
        for m, f in saved.items():
            setattr(torch.Tensor, m, f)
        _forbidden -= 1


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``. To an accelerator through pinned memory with a
    non-blocking copy: an ordinary copy from pageable memory makes the host wait for the
    device's queue (torch synchronises the stream after it)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
