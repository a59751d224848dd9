"""A frozen prefix computed once per example and shared by the target and its references.

The first layers of a model (``LayeredModel`` layers, forward order) that neither train nor
follow a trainable layer (``trainables.audit.exclusion.frozen_layers``: a frozen backbone)
compute the same function in the target and in every model whose tensors there are
bit-identical to the target's (:meth:`Prefix.covers` compares every tensor of their state; it
never assumes): a backbone loaded from one weights file, or the target's frozen parameters, from
which every reference starts (:class:`FrozenStart`: they never train, so they hold nothing of
the target's data, and a reference built from its own seed would otherwise carry another random
backbone than the target it calibrates). The audit therefore computes the prefix's output once
per example and runs only the trainable suffix per model: in every model's signals, and in each
reference's training, whose examples pass through the prefix every epoch.

How the suffix runs alone (:meth:`SharedPrefix.feeding`): the model is called on its real input
as always; a forward pre-hook on the module that first receives it (a user's ``net``, a built-in
model's first block) finds every input row in a :class:`PrefixTable` by its bytes. When all are
there, the last prefix layer returns their stored outputs and the earlier prefix layers return
zeros of their shape, none of them running; with any row missing the whole model runs as usual.
A forward that reads an earlier prefix layer's output past the last one (a long skip) would see
the zeros: :func:`find_prefix` runs real examples with and without the table and shares nothing
unless the logits are bit-identical. Nothing is shared when a prefix layer's output is not one
tensor with the batch first, nor for a model the engine differentiates whole with ``torch.func``.

Precision and mode: the stored outputs are computed in eval mode in the model's own dtype
(float32: what the model computes in training and use), as the signals read them; where the
audit runs a float64 copy of a model (``trainables.audit.signals``) it casts them, and differs
from a float64 prefix by float32 rounding of its output only. A reference's training
examples are stored only when the prefix computes the same in train mode as in eval mode (no
dropout, no batch or running statistics: checked by module type and on real examples) and fit in
``MAX_TABLE_BYTES``; the reference then trains as without the table, to float rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsweep.core.lazy import lazy_module
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.trainables.audit.cache import tensor_hash
from dpsweep.trainables.audit.exclusion import frozen_layers
from dpsweep.trainables.data.splits import DataSplits
from dpsweep.trainables.engine.grad_engine import WHOLE_EXACT_PATH

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpsweep.trainables.models.networks import LayeredModel
else:
    torch = lazy_module("torch")

#: Largest table of stored prefix outputs (bytes); a larger one is not built (the prefix then
#: runs per model, as without sharing).
MAX_TABLE_BYTES = 512 * 2**20
#: Real examples :func:`find_prefix` checks the suffix on (the first audited candidates).
CHECK_ROWS = 8
#: Bytes of a row's key (a BLAKE2b digest of its values).
KEY_BYTES = 16

#: Whether the audit's savings are on (:func:`without_savings` turns them off).
_SAVINGS: ContextVar[bool] = ContextVar("audit_savings", default=True)


def savings_enabled() -> bool:
    """False inside :func:`without_savings`."""
    return _SAVINGS.get()


@contextlib.contextmanager
def without_savings() -> Iterator[None]:
    """The audit as it ran before its savings (the cost benchmark's baseline): every model
    computes its own prefix, references start from their own seeded parameters, gradient norms
    come from a float64 copy of each model, every reader of a model's layers runs its own
    forward, and probe and shadow-classifier fits use every BLAS thread."""
    token = _SAVINGS.set(False)
    try:
        yield
    finally:
        _SAVINGS.reset(token)


class _Stop(Exception):
    """Raised by the last prefix layer's hook: the rest of the forward is not needed."""


def row_keys(x: torch.Tensor) -> list[bytes]:
    """Each row's identity: a digest of its shape and values, floats as float32 where that is
    exact (so a float32 row and its float64 copy are one row) and float64 otherwise, integers
    as int64."""
    rows = x.detach().to("cpu")
    if rows.is_floating_point():
        narrow = rows.to(torch.float32)
        exact = rows.dtype == torch.float32 or torch.equal(narrow.to(rows.dtype), rows)
        rows = narrow if exact else rows.to(torch.float64)
    else:
        rows = rows.to(torch.int64)
    head = f"{rows.dtype}{tuple(rows.shape[1:])}".encode()
    flat = rows.reshape(rows.shape[0], -1).contiguous().numpy()
    return [hashlib.blake2b(head + row.tobytes(), digest_size=KEY_BYTES).digest()
            for row in flat]


def _float_dtype(model: nn.Module) -> torch.dtype:
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    return torch.get_default_dtype() if first is None else first.dtype


def _device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device


def _entry(model: LayeredModel) -> nn.Module:
    """The module that first receives the model's input: a user's ``net`` (its forward and
    ``forward_with_irs`` both call it), a built-in model's first block."""
    net = getattr(model, "net", None)
    return net if net is not None else model.blocks[model.layer_names[0]]


@dataclass(frozen=True, eq=False)
class Prefix:
    """The leading frozen layers of a target, their state, and their outputs' shapes."""

    layers: tuple[str, ...]
    #: Every state tensor of the prefix layers (the target's own, not copied).
    state: Mapping[str, torch.Tensor]
    #: Per layer: one example's output shape and the output's dtype.
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    #: It computes the same in train mode as in eval mode (its outputs may serve training).
    train_exact: bool = False
    #: The earlier layers' zeros are one value per example (every dimension 1): the forward
    #: between them then costs nothing (checked like the rest; else full-size zeros).
    compact: bool = False

    @property
    def last(self) -> str:
        return self.layers[-1]

    def row_bytes(self) -> int:
        shape, dtype = self.shapes[self.last]
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    def covers(self, model: LayeredModel) -> bool:
        """``model`` has the same prefix layers, frozen, with bit-identical tensors."""
        if tuple(model.layer_names[:len(self.layers)]) != self.layers \
                or not set(self.layers) <= frozen_layers(model):
            return False
        state = _prefix_state(model, self.layers)
        return state.keys() == self.state.keys() and all(
            v.shape == self.state[k].shape and v.dtype == self.state[k].dtype
            and torch.equal(v.to(self.state[k].device), self.state[k])
            for k, v in state.items())


def _prefix_state(model: LayeredModel, layers: Sequence[str]) -> dict[str, torch.Tensor]:
    paths = model.layer_paths()
    heads = tuple(paths[name] + "." for name in layers)
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
            if k.startswith(heads)}


#: ``keep(layer, output)``: sees every prefix layer's output once the prefix has run.
Keep = Callable[[str, "torch.Tensor"], None]


def _run_prefix(model: LayeredModel, layers: Sequence[str], x: torch.Tensor, *,
                keep: Keep | None = None
                ) -> tuple[torch.Tensor, dict[str, tuple[tuple[int, ...], torch.dtype]]] | None:
    """The last of ``layers``' output for ``x`` and every layer's output shape, the forward
    stopped there; None unless each layer ran once, in order, giving one batch-first tensor.
    ``keep`` sees the outputs once the forward stopped, as ``forward_with_irs`` returns them
    after its forward (a later in-place operation, the stem's ``ReLU(inplace=True)``, included).
    """
    calls: list[str] = []
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    seen: dict[str, torch.Tensor] = {}

    def look(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            del module, args
            calls.append(name)
            if not isinstance(output, torch.Tensor) or output.dim() == 0 \
                    or output.shape[0] != x.shape[0]:
                raise _Stop
            shapes[name] = (tuple(output.shape[1:]), output.dtype)
            seen[name] = output.detach()
            if name == layers[-1]:
                raise _Stop
        return hook

    handles = [model.blocks[name].register_forward_hook(look(name)) for name in layers]
    try:
        with torch.no_grad():
            model(x)
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if calls != list(layers) or len(seen) != len(layers):
        return None
    if keep is not None:
        for name in layers:
            keep(name, seen[name])
    return seen[layers[-1]], shapes


def prefix_outputs(model: LayeredModel, prefix: Prefix, x: torch.Tensor, *,
                   batch: int = PHYSICAL_BATCH, keep: Keep | None = None) -> torch.Tensor:
    """The last prefix layer's output for every row of ``x`` (eval mode, no gradient, the
    model's dtype), on the CPU; ``keep`` sees every prefix layer's output, chunk by chunk."""
    was_training = model.training
    model.eval()
    device = _device(model)
    parts = []
    try:
        for start in range(0, x.shape[0], batch):
            run = _run_prefix(model, prefix.layers, x[start:start + batch].to(device),
                              keep=keep)
            if run is None:
                raise RuntimeError(f"the prefix {list(prefix.layers)} stopped running as one")
            parts.append(run[0].to("cpu"))
    finally:
        model.train(was_training)
    return torch.cat(parts)


class PrefixTable:
    """Stored outputs of the last prefix layer, found by their input rows' keys."""

    def __init__(self, *, keys: Sequence[bytes], outputs: torch.Tensor) -> None:
        self.index = {key: i for i, key in enumerate(keys)}
        self.outputs = outputs

    @classmethod
    def compute(cls, model: LayeredModel, prefix: Prefix, x: torch.Tensor, *,
                batch: int = PHYSICAL_BATCH, keep: Keep | None = None) -> PrefixTable | None:
        """The table of ``x``, or None when it would exceed ``MAX_TABLE_BYTES``."""
        if x.shape[0] * prefix.row_bytes() > MAX_TABLE_BYTES:
            return None
        return cls(keys=row_keys(x),
                   outputs=prefix_outputs(model, prefix, x, batch=batch, keep=keep))

    def merged(self, other: PrefixTable) -> PrefixTable:
        keys = list(self.index) + list(other.index)
        ordered = torch.cat([self.outputs[list(self.index.values())],
                             other.outputs[list(other.index.values())]])
        return PrefixTable(keys=keys, outputs=ordered)

    def rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The stored outputs of every row of ``x``, or None when one is not stored."""
        found = [self.index.get(key) for key in row_keys(x)]
        if any(i is None for i in found):
            return None
        return self.outputs[torch.as_tensor(found, dtype=torch.long)]


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """A prefix and the stored outputs of the examples it is shared on; ``features``: each
    prefix layer's output reduced by the function :func:`share_prefix` was given, for the rows
    it was given, in order (None: none asked)."""

    prefix: Prefix
    table: PrefixTable
    features: Mapping[str, torch.Tensor] | None = None

    def with_outputs(self, x: torch.Tensor, outputs: torch.Tensor) -> SharedPrefix | None:
        """This table with ``x``'s rows and their known ``outputs`` added; None when it would
        exceed ``MAX_TABLE_BYTES``."""
        if (len(self.table.index) + x.shape[0]) * self.prefix.row_bytes() > MAX_TABLE_BYTES:
            return None
        more = PrefixTable(keys=row_keys(x), outputs=outputs)
        return dataclasses.replace(self, table=self.table.merged(more))

    @contextlib.contextmanager
    def feeding(self, model: LayeredModel) -> Iterator[None]:
        """While open, ``model`` (which this prefix covers) runs only its suffix on stored rows
        (module docstring)."""
        feed = _Feed(self, model)
        try:
            yield
        finally:
            feed.remove()


class _Feed:
    """The pre-hook and the prefix layers' forwards that :meth:`SharedPrefix.feeding` puts on
    one model, and what they read: the stored outputs of the current call's rows.

    The earlier layers' zeros are one buffer per layer, sized for the largest call and reused
    (a forward may write into it in place, as the stem's ``ReLU(inplace=True)`` does, which
    nothing reads): full-size zeros allocated per call took a third of a frozen ResNet-18's
    signals."""

    def __init__(self, shared: SharedPrefix, model: LayeredModel) -> None:
        self.shared = shared
        self.outputs: torch.Tensor | None = None
        self.scratch: dict[str, torch.Tensor] = {}
        self.dtype = _float_dtype(model)
        self.device = _device(model)
        self.handle = _entry(model).register_forward_pre_hook(self._lookup)
        #: each prefix module and the forward set on the instance before (None: its class's)
        self.modules: list[tuple[nn.Module, Any]] = []
        for name in shared.prefix.layers:
            module = model.blocks[name]
            self.modules.append((module, vars(module).get("forward")))
            module.forward = self._forward(name, module.forward)

    def _lookup(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        del module
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        found = None if x is None or x.dim() == 0 else self.shared.table.rows(x)
        if found is not None and found.is_floating_point():
            found = found.to(dtype=self.dtype)
        self.outputs = None if found is None else found.to(self.device)

    def _forward(self, name: str, own: Callable[..., Any]) -> Callable[..., Any]:
        shape, dtype = self.shared.prefix.shapes[name]
        if self.shared.prefix.compact:
            shape = (1,) * len(shape)
        last = name == self.shared.prefix.last

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.outputs is None:
                return own(*args, **kwargs)
            if last:
                return self.outputs
            rows = self.outputs.shape[0]
            buffer = self.scratch.get(name)
            if buffer is None or buffer.shape[0] < rows:
                buffer = self.scratch[name] = torch.zeros(
                    (rows, *shape), device=self.device,
                    dtype=self.dtype if dtype.is_floating_point else dtype)
            return buffer[:rows]

        return forward

    def remove(self) -> None:
        self.handle.remove()
        for module, before in self.modules:
            if before is None:
                del module.forward
            else:
                module.forward = before
        self.outputs = None
        self.scratch.clear()


def _mode_dependent(module: nn.Module) -> bool:
    """Whether the module's output depends on train / eval mode or on a random draw."""
    nn_ = torch.nn
    if isinstance(module, nn_.modules.batchnorm._BatchNorm):
        return True
    if isinstance(module, nn_.modules.dropout._DropoutNd):
        return float(module.p) > 0
    if isinstance(module, nn_.modules.instancenorm._InstanceNorm):
        return bool(module.track_running_stats)
    if isinstance(module, nn_.RNNBase | nn_.MultiheadAttention):
        return float(module.dropout) > 0
    return False


def _train_exact(model: LayeredModel, prefix: Prefix, sample: torch.Tensor,
                 eval_outputs: torch.Tensor) -> bool:
    """The prefix (on the CPU) has no mode-dependent module, gives ``eval_outputs`` in train
    mode too and draws nothing from the global generator there (skipping it in training must
    not shift a later draw); the generator's state is restored either way."""
    if _device(model).type != "cpu" or any(
            _mode_dependent(sub) for name in prefix.layers for sub in model.blocks[name].modules()):
        return False
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]):
            before = torch.get_rng_state()
            model.train()
            run = _run_prefix(model, prefix.layers, sample)
            drew = not torch.equal(before, torch.get_rng_state())
    finally:
        model.train(was_training)
    return run is not None and not drew and torch.equal(run[0], eval_outputs)


def _fed_alike(model: LayeredModel, prefix: Prefix, sample: torch.Tensor,
               outputs: torch.Tensor) -> bool:
    """The model fed ``outputs`` for ``sample`` gives bit-identical logits (an error counts as
    not alike: a forward the zeros do not suit)."""
    shared = SharedPrefix(prefix=prefix, table=PrefixTable(keys=row_keys(sample),
                                                           outputs=outputs.to("cpu")))
    with torch.no_grad():
        whole = model(sample)
        try:
            with shared.feeding(model):
                fed = model(sample)
        except Exception:  # any error of the user's forward on the zeros: not shareable
            return False
    return isinstance(whole, torch.Tensor) and isinstance(fed, torch.Tensor) \
        and torch.equal(whole, fed)


def find_prefix(model: LayeredModel, sample: torch.Tensor) -> Prefix | None:
    """The frozen prefix ``model`` can share, checked on ``sample`` (real inputs): its suffix
    fed the stored outputs gives bit-identical logits; None when there is none to share."""
    frozen = frozen_layers(model)
    names = model.layer_names
    k = next((i for i, name in enumerate(names) if name not in frozen), len(names))
    if k == 0 or k == len(names) or getattr(model, "per_example_path", "") == WHOLE_EXACT_PATH \
            or any(getattr(model, "ir_batch_dims", {}).get(n, 0) for n in names[:k]):
        return None
    layers = tuple(names[:k])
    was_training = model.training
    model.eval()
    try:
        sample = sample.to(_device(model))
        run = _run_prefix(model, layers, sample)
        if run is None:
            return None
        outputs, shapes = run
        base = Prefix(layers=layers, state=_prefix_state(model, layers), shapes=shapes)
        prefix = next((p for p in (dataclasses.replace(base, compact=True), base)
                       if _fed_alike(model, p, sample, outputs)), None)
        if prefix is None:
            return None
        return dataclasses.replace(
            prefix, train_exact=_train_exact(model, prefix, sample, outputs))
    finally:
        model.train(was_training)


#: ``features(output)``: what a caller keeps of a prefix layer's output (``SharedPrefix``).
Features = Callable[["torch.Tensor"], "torch.Tensor"]


def share_prefix(target: LayeredModel, x: torch.Tensor, *, batch: int = PHYSICAL_BATCH,
                 features: Features | None = None) -> SharedPrefix | None:
    """The target's shareable prefix with the stored outputs of ``x`` (checked on its first
    rows) and, with ``features``, each prefix layer's features of ``x``; None: no prefix,
    savings off, or a table over ``MAX_TABLE_BYTES``."""
    if not savings_enabled() or x.shape[0] == 0:
        return None
    prefix = find_prefix(target, x[:CHECK_ROWS])
    if prefix is None:
        return None
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in prefix.layers}
    table = PrefixTable.compute(
        target, prefix, x, batch=batch,
        keep=None if features is None else (lambda name, out: kept[name].append(features(out))))
    if table is None:
        return None
    return SharedPrefix(prefix=prefix, table=table, features=None if features is None else
                        {name: torch.cat(parts) for name, parts in kept.items()})


# --- what references start from --------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FrozenStart:
    """The target's frozen parameters, which every reference starts from, and the stored prefix
    outputs of the references' training examples (None: the prefix runs in training)."""

    parameters: Mapping[str, torch.Tensor]
    digest: str
    training: SharedPrefix | None = None

    @classmethod
    def of(cls, target: LayeredModel) -> FrozenStart | None:
        """None when the target trains every parameter, or with savings off."""
        frozen = {n: p.detach() for n, p in target.named_parameters() if not p.requires_grad}
        if not frozen or not savings_enabled():
            return None
        digest = hashlib.sha256()
        for name in sorted(frozen):
            digest.update(f"{name}={tensor_hash(frozen[name])};".encode())
        return cls(parameters=frozen, digest=digest.hexdigest())

    def apply(self, model: LayeredModel) -> None:
        """Set ``model``'s frozen parameters to the target's (it must freeze the same ones)."""
        own = dict(model.named_parameters())
        for name, value in self.parameters.items():
            param = own.get(name)
            if param is None or param.requires_grad or param.shape != value.shape:
                raise RuntimeError(f"a reference's parameter {name!r} is not frozen as the "
                                   "target's is: it was built from another recipe")
            with torch.no_grad():
                param.copy_(value)

    def prepare(self, model: LayeredModel, *, stack: contextlib.ExitStack) -> None:
        """Start ``model`` (a reference just built) from the target's frozen parameters; while
        ``stack`` is open it reads its training examples' stored prefix outputs (on the CPU)."""
        self.apply(model)
        if self.training is not None and _device(model).type == "cpu" \
                and self.training.prefix.covers(model):
            stack.enter_context(self.training.feeding(model))


@dataclass(frozen=True, eq=False)
class ReferenceData(DataSplits):
    """A reference's splits and what it starts from (:class:`FrozenStart`)."""

    start: FrozenStart | None = None


def with_start(data: DataSplits, start: FrozenStart | None) -> DataSplits:
    """``data`` carrying ``start`` (unchanged without one)."""
    if start is None:
        return data
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(DataSplits)}
    return ReferenceData(**fields, start=start)


def start_of(data: DataSplits) -> FrozenStart | None:
    return data.start if isinstance(data, ReferenceData) else None


def start_record(data: DataSplits) -> dict[str, str]:
    """What a reference's start adds to its cache key: the digest of the frozen parameters."""
    start = start_of(data)
    return {} if start is None else {"frozen_start": start.digest}


def training_start(start: FrozenStart | None, shared: SharedPrefix | None, *,
                   target: LayeredModel, source: torch.Tensor,
                   rows: Sequence[np.ndarray]) -> FrozenStart | None:
    """``start`` with the stored prefix outputs of the references' training examples (the
    union of ``rows`` of ``source``) when the prefix may serve training and they fit; ``start``
    unchanged otherwise."""
    if start is None or shared is None or not shared.prefix.train_exact or not rows:
        return start
    x = source[np.unique(np.concatenate(rows))]
    # Rows the audit already stored (the online plan's candidates are training rows of its
    # references) are not run through the prefix again.
    missing = [i for i, key in enumerate(row_keys(x)) if key not in shared.table.index]
    total = len(shared.table.index) + len(missing)
    if total * shared.prefix.row_bytes() > MAX_TABLE_BYTES:
        table = PrefixTable.compute(target, shared.prefix, x)
    elif missing:
        more = PrefixTable.compute(target, shared.prefix, x[missing])
        table = None if more is None else shared.table.merged(more)
    else:
        table = shared.table
    if table is None:
        return start
    return dataclasses.replace(start, training=SharedPrefix(prefix=shared.prefix, table=table))
