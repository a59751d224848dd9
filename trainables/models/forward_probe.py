"""A user's forward run on one example in training and in evaluation mode, before the checks
that need it: which modules each mode calls, and, when it fails, the module it failed in and
the smallest input it runs at.

Why both modes: torchvision's GoogLeNet and Inception-v3 call their auxiliary heads in training
only, so the modules a training step runs are not those the evaluation, the audit and the
checks run (``trainables.models.validator`` keeps such heads out of the layers and the training).
Why the module: a module that cannot take the input's size fails deep inside the user's code
(Inception-v3's auxiliary head pools a 4x4 map to 0x0 at 96 px; a GroupNorm with one channel
per group on a 1x1 map has one value to normalise for one example), where the user needs one
line naming the module and an input size that works. That size is searched (real tensors; on
the meta device, shapes only, above ``REAL_VALUES``) by trying larger sides (doublings and
common image sizes), then bisecting below the first that runs, the other sides scaled with the
smallest; the bisection assumes that an input which runs still runs when made somewhat larger,
as pooling and strided convolutions do.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

#: Largest spatial side tried when searching the smallest input a network runs at.
MAX_SIDE = 4096
#: Sides tried before doubling, in order with the doublings: torchvision's classifiers are made
#: for these, and some run at particular sizes only (MaxViT's window partitions must divide
#: each stage's map), which doubling alone may never meet.
COMMON_SIDES = (224, 256, 299, 384, 448, 512)
#: Input values up to which the search runs real tensors (faster than the meta device's
#: Python decompositions: GroupNorm's took 6 of 7 s searching GoogLeNet's smallest input);
#: above, meta tensors, whose memory is nothing whatever the size.
REAL_VALUES = 3 * 320 * 320
#: Characters of an exception's message kept in the one-line refusal.
MESSAGE_CHARS = 240


@dataclass(frozen=True)
class Failure:
    """Where a forward failed: the innermost module running (``""``: the network's own code),
    the shape of its first tensor input, the mode and the exception, as one line."""

    module: str
    kind: str
    module_input: tuple[int, ...] | None
    training: bool
    error: str


class FailedForward(Exception):
    """The network's forward raised; ``failure`` says where."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.module or 'the network'}: {failure.error}")
        self.failure = failure


@dataclass(frozen=True)
class Calls:
    """Module paths (``named_modules``) each mode called, and the training mode's output."""

    training: frozenset[str]
    evaluation: frozenset[str]
    training_output: object


def one_line(exc: BaseException) -> str:
    """``'RuntimeError: Given input size: ...'`` on one line, cut at ``MESSAGE_CHARS``."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."


@contextlib.contextmanager
def _watched(net: nn.Module, called: set[str], stack: list[tuple[str, nn.Module, object]]
             ) -> Iterator[None]:
    """Record every module the forward calls, and keep the stack of those still running (the
    last entry of a failed forward is the module it failed in)."""
    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            called.add(name)
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            stack.append((name, module, None if first is None else tuple(first.shape)))
        return hook

    def post(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        del module, args, output
        stack.pop()

    handles = []
    for name, module in net.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def own_random_streams(x: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Random draws (dropout) inside leave the caller's streams, CPU and ``x``'s GPU, as they
    were: a check must not change what training draws."""
    return torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else [])


def _run(net: nn.Module, x: torch.Tensor, *, training: bool,
         state: dict[str, torch.Tensor] | None = None) -> tuple[object, set[str]]:
    """``net(x)`` in the mode asked, without gradients and without drawing from the caller's
    random streams (dropout), with ``state`` in place of the parameters and buffers if given."""
    called: set[str] = set()
    stack: list[tuple[str, nn.Module, object]] = []
    net.train(training)
    with _watched(net, called, stack), torch.no_grad(), own_random_streams(x):
        try:
            out = net(x) if state is None else torch.func.functional_call(net, state, (x,))
        except Exception as exc:
            name, module, shape = stack[-1] if stack else ("", net, tuple(x.shape))
            failure = Failure(module=name, kind=type(module).__name__,
                              module_input=shape if isinstance(shape, tuple) else None,
                              training=training, error=one_line(exc))
            raise FailedForward(failure) from exc
    return out, called


def run_modes(net: nn.Module, x: torch.Tensor) -> Calls:
    """``net`` on ``x`` (one example) in training, then in evaluation mode; ``net`` is left in
    training mode. Raises :class:`FailedForward` naming where the first failure happened."""
    try:
        out, training = _run(net, x, training=True)
        _, evaluation = _run(net, x, training=False)
    finally:
        net.train()
    return Calls(training=frozenset(training), evaluation=frozenset(evaluation),
                 training_output=out)


def _scaled(spatial: tuple[int, ...], side: int) -> tuple[int, ...]:
    """``spatial`` with its smallest side made ``side``, the others in proportion."""
    smallest = min(spatial)
    return tuple(max(side, math.ceil(d * side / smallest)) if d != smallest else side
                 for d in spatial)


@dataclass(frozen=True)
class SizeSearch:
    """The smallest input shape (without the batch) found to run, if any, and the largest
    smallest-side tried (0: no search: ``x`` has no spatial dimensions, or the failure did not
    recur on a zero input of its size)."""

    smallest: tuple[int, ...] | None
    largest_side: int


def smallest_input(net: nn.Module, x: torch.Tensor, *, training_first: bool) -> SizeSearch:
    """The smallest input at which ``net`` runs in both modes on one example, among sizes
    above ``x``'s (``x``: one example it fails on, ``[1, C, *spatial]``)."""
    if x.dim() < 3 or not x.is_floating_point():
        return SizeSearch(smallest=None, largest_side=0)
    state = {name: torch.empty_like(t, device="meta")
             for name, t in [*net.named_parameters(), *net.named_buffers()]}
    modes = (True, False) if training_first else (False, True)

    def runs(side: int) -> bool:
        shape = (1, x.shape[1], *_scaled(tuple(x.shape[2:]), side))
        real = math.prod(shape) <= REAL_VALUES
        probe = (torch.zeros(shape, dtype=x.dtype, device=x.device) if real
                 else torch.empty(shape, dtype=x.dtype, device="meta"))
        try:
            for training in modes:
                _run(net, probe, training=training, state=None if real else state)
        except FailedForward:
            return False
        return True

    try:
        low = min(x.shape[2:])
        if runs(low):
            return SizeSearch(smallest=None, largest_side=0)
        tried = sorted({side for side in COMMON_SIDES if side > low}
                       | {min(low << k, MAX_SIDE) for k in range(1, MAX_SIDE.bit_length())})
        high = next((side for side in tried if runs(side)), None)
        if high is None:
            return SizeSearch(smallest=None, largest_side=tried[-1])
        low = max([low, *(side for side in tried if side < high)])
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if runs(middle) else (middle, high)
    finally:
        net.train()
    return SizeSearch(smallest=(x.shape[1], *_scaled(tuple(x.shape[2:]), high)),
                      largest_side=high)
