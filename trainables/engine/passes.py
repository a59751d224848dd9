"""One forward + backward of the engine over one chunk, and the units it is made of.

:mod:`trainables.engine.grad_engine` holds the views and the plan; this module holds what one pass
does: the unit of each module that owns a trainable parameter (:func:`build_units`), the hooks that
keep each unit's input and output gradient (:class:`Pass`), and what a chunk leaves for its weighted
sums (:class:`ChunkState`). """

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.attention import AttentionUnit, decomposable
from dpsweep.trainables.engine.embedding import (
    EmbeddingBagHandler,
    EmbeddingHandler,
    check_embedding,
)
from dpsweep.trainables.engine.func import (
    Call,
    CallDims,
    NotPerExample,
    OwnerFallback,
    leaves,
    rebuild,
)
from dpsweep.trainables.engine.host_reads import host_reads_allowed
from dpsweep.trainables.engine.modules import (
    Choice,
    Conv1dHandler,
    Conv2dHandler,
    Geometry,
    GroupNormHandler,
    Handler,
    LayerNormHandler,
    LinearHandler,
    combine,
    scale_rows,
)
from dpsweep.trainables.engine.norms import full_precision, scaled_sq_norms
from dpsweep.trainables.engine.params import ParamUses
from dpsweep.trainables.engine.rnn import RecurrentUnit, recurrent_types

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")


class PassEngine(Protocol):
    """What one pass reads of the engine that runs it (``GradEngine``): its layers, its
    physical batch, and its per-module plan."""

    num_layers: int
    max_physical_batch: int
    layer_of: dict[str, int]

    def call_dims(self, unit: Handler | OwnerFallback, call: int) -> CallDims:
        ...

    def choice(self, handler: Handler, geometry: Geometry) -> Choice:
        ...


#: An example whose certified norm lies more than this factor above its estimate is
#: materialised and kept where the host may read (``Pass._by_rule``): its rank-one terms
#: cancel, and its exact norm costs less than clipping it harder than it needs.
LOOSE = 1.01


# ---- one pass over one chunk ------------------------------------------------------------------
@dataclass
class ChunkState:
    """What a chunk leaves for the weighted sum: kept per-example grads, inputs and gradients."""

    kept: dict[str, torch.Tensor]
    pending: list[tuple[Handler, torch.Tensor, torch.Tensor]]
    #: (parameter, layer, example rows, their gradients): the kept rows of a weight otherwise
    #: summed natively (``Pass._by_rule``)
    rows: list[tuple[str, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def weighted_sum(self, coef: torch.Tensor,
                     layer_of: dict[str, int]) -> dict[str, torch.Tensor]:
        with full_precision(coef.device):
            return self._weighted_sum(coef, layer_of)

    def _weighted_sum(self, coef: torch.Tensor,
                      layer_of: dict[str, int]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for n, g in self.kept.items():
            accumulate(out, n, combine(coef[:, layer_of[n]], g))
        for n, layer, rows, g in self.rows:
            accumulate(out, n, combine(coef[rows, layer], g))
        for handler, a, b in self.pending:
            weight = handler.weight_sum(a, scale_rows(b, coef[:, handler.layer]))
            accumulate(out, str(handler.weight_name), weight)
        return out


def accumulate(into: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    into[name] = into[name] + value if name in into else value


class Pass:
    """Hooks and gradient sinks of one forward + backward over one chunk.

    ``coef`` None: norms mode (per-layer squared norms plus the chunk state); otherwise sums
    mode (each module adds sum_i coef_i g_i directly: no state, used for recomputed chunks).
    A module's output gradient is caught by a hook on the output tensor itself, registered
    before the caller sees it: the hook receives the gradient of the value the module
    returned, even when the caller then changes that tensor in place (``ReLU(inplace=True)``,
    ``out += identity``), and it costs no copy. An output that does not require grad yet
    (everything before the first hooked module is constant: the parameters are detached) is
    first added to a zero scalar leaf, the ``anchor`` the backward is run for.
    """

    def __init__(self, engine: PassEngine, n: int, *, live: Sequence[bool], dtype: torch.dtype,
                 device: torch.device, coef: torch.Tensor | None) -> None:
        self.engine = engine
        self.live = live
        self.coef = coef
        self.sq = torch.zeros(n, engine.num_layers, dtype=torch.float64, device=device)
        self.kept: dict[str, torch.Tensor] = {}
        self.pending: list[tuple[Handler, torch.Tensor, torch.Tensor]] = []
        self.rows: list[tuple[str, int, torch.Tensor, torch.Tensor]] = []
        #: planning: every once-called handler's (handler, a, b, geometry) of this pass
        self.capture: list[tuple[Handler, torch.Tensor, torch.Tensor, Geometry]] | None = None
        self.sums: dict[str, torch.Tensor] = {}
        self.calls: dict[int, int] = {}
        self.fallback_calls: list[tuple[OwnerFallback, Call, tuple[torch.Tensor, int]]] = []
        self.anchor = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
        self.uses: list[tuple[ParamUses, list[Any], list[tuple[torch.Tensor, int]]]] = []

    def _tapped(self, value: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
        if not value.requires_grad:
            value = value + self.anchor
        value.register_hook(lambda grad: sink(grad) and None)
        return value

    # -- forward hooks
    def hook(self, unit: Handler | OwnerFallback) -> Callable[..., Any]:
        def forward_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         output: Any) -> Any:
            del module
            call = self.calls.get(id(unit), 0)
            self.calls[id(unit)] = call + 1
            dims = self.engine.call_dims(unit, call)
            if isinstance(unit, OwnerFallback):
                flat_in, spec = leaves((args, kwargs))
                return self._hook_fallback(unit, flat_in, spec, dims, output)
            flat_in = list(args) if not kwargs else leaves((args, kwargs))[0]
            tensors = [i for i, v in enumerate(flat_in) if isinstance(v, torch.Tensor)]
            if len(tensors) != 1:
                raise NotPerExample(f"{unit.qualname} ({unit.kind}) is called with "
                                    f"{len(tensors)} tensors; its rule reads one input")
            first = tensors[0]
            a_in = flat_in[first]
            version = (a_in, a_in._version)
            a = unit.prepare(batch_first(a_in.detach(), dims.inputs[first], unit))
            d_out = dims.outputs[0]
            return self._tapped(output, lambda b: self.on_grad(
                unit, a, batch_first(b, d_out, unit), version))

        return forward_hook

    def _hook_fallback(self, unit: OwnerFallback, flat_in: list[Any], spec: Any,
                       dims: CallDims, output: Any) -> Any:
        kept = [v.detach() if isinstance(v, torch.Tensor) else v for v in flat_in]
        first = next((v for v in flat_in if isinstance(v, torch.Tensor)), None)
        flat_out, out_spec = leaves(output)
        grads: list[torch.Tensor | None] = [None] * len(flat_out)

        def sink(k: int) -> Callable[[torch.Tensor], None]:
            def put(grad: torch.Tensor) -> None:
                grads[k] = grad if grads[k] is None else grads[k] + grad
            return put

        tapped = [self._tapped(v, sink(k)) if isinstance(v, torch.Tensor)
                  and v.is_floating_point() else v for k, v in enumerate(flat_out)]
        version = (first, first._version) if first is not None else (self.anchor, 0)
        self.fallback_calls.append((unit, (kept, spec, dims, grads), version))
        return rebuild(tapped, out_spec)

    def on_use(self, unit: ParamUses, call: int, recipe: Callable[[Any], Any], local: str,
               read: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """A use of a container's own parameter (:mod:`trainables.engine.params`): kept with
        its output's batch dimension; the output gradient arrives by the hook."""
        if call >= len(unit.dims):
            raise NotPerExample(f"a parameter of {unit.qualname or 'the model'} is used more "
                                "often than in the probe forward")
        use: list[Any] = [recipe, local, unit.dims[call], None]
        self.uses.append((unit, use, [(t, t._version) for t in read]))

        def sink(grad: torch.Tensor) -> None:
            use[3] = grad if use[3] is None else use[3] + grad

        return self._tapped(out, sink)

    def part_tap(self, parts: list[tuple[Handler, Any, Any]], z: torch.Tensor
                      ) -> torch.Tensor:
        """A recurrent unit's projection ``z`` ([B, T, G]): its gradient goes to each part
        with that part's kept input (a tensor, or a function giving it once the forward is
        over) and transform (see :mod:`trainables.engine.rnn`)."""
        for part, _, _ in parts:
            self.calls[id(part)] = self.calls.get(id(part), 0) + 1

        def sink(b: torch.Tensor) -> None:
            for part, a, transform in parts:
                kept = a() if callable(a) else a
                self.on_grad(part, kept, b if transform is None else transform(b), None)

        return self._tapped(z, sink)

    # -- backward sinks
    def on_grad(self, handler: Handler, a: torch.Tensor, b: torch.Tensor,
                version: tuple[torch.Tensor, int] | None) -> None:
        if version is not None:
            check_version(version, handler.qualname)
        with full_precision(a.device):
            self._on_grad(handler, a, b)

    def _on_grad(self, handler: Handler, a: torch.Tensor, b: torch.Tensor) -> None:
        once = not handler.per_channel and self.calls[id(handler)] == 1
        if not once:  # per-example gradients, kept (ghost norms do not add over calls)
            for n, g in handler.per_example(a, b).items():
                if self.coef is None:
                    accumulate(self.kept, n, g)
                else:
                    accumulate(self.sums, n, combine(self.coef[:, handler.layer], g))
            return
        geometry = handler.geometry(a, b)
        choice = self.engine.choice(handler, geometry)
        if self.capture is not None:
            self.capture.append((handler, a, b, geometry))
        if handler.bias_name is not None:
            bias = handler.bias_per_example(b)
            if self.coef is None:
                self.kept[handler.bias_name] = bias
            else:
                accumulate(self.sums, handler.bias_name,
                           combine(self.coef[:, handler.layer], bias))
        if handler.weight_name is None:
            return
        if choice.keep:
            g = handler.weight_per_example(a, b, kernel=choice.kernel)
            if self.coef is None:
                self.kept[handler.weight_name] = g
            else:
                accumulate(self.sums, handler.weight_name,
                           combine(self.coef[:, handler.layer], g))
            return
        self._by_rule(handler, a, b, geometry=geometry, choice=choice)

    def _by_rule(self, handler: Handler, a: torch.Tensor, b: torch.Tensor, *,
                 geometry: Geometry, choice: Choice) -> None:
        """A weight normed without its per-example gradients (ghost, or materialised and
        dropped) and summed by the native kernel. Each example's norm is certified
        (:meth:`Handler.certified`): an upper bound of what the native sum releases for it,
        whatever its rank-one terms cancel. Where the host may read (the CPU), an example whose
        certificate lies more than ``LOOSE`` above its estimate is materialised and kept
        instead, so what is released for it is exactly what was normed; on an accelerator,
        finding it would stop the device once per module and step, so it keeps its certified
        norm (clipped a little harder than it needs). Each decision reads the example's own
        values only."""
        name = str(handler.weight_name)
        exact_rows = host_reads_allowed(a.device)
        if self.coef is not None and not exact_rows:
            accumulate(self.sums, name, handler.weight_sum(
                a, scale_rows(b, self.coef[:, handler.layer])))
            return
        ghost = choice.norm == "ghost"
        sq, terms = handler.weight_sq(a, b, geometry=geometry, ghost=ghost,
                                      kernel=choice.kernel)
        if terms is not None:
            certified = handler.certified(sq, terms, geometry=geometry, ghost=ghost,
                                          dtype=b.dtype)
            loose = certified > LOOSE ** 2 * sq
            sq = certified
            if exact_rows and bool(loose.any()):  # a free read on the CPU
                rows = loose.nonzero().flatten()
                g = handler.weight_per_example(a[rows], b[rows])
                if self.coef is None:
                    self.rows.append((name, handler.layer, rows, g))
                    sq = sq.index_put((rows,), scaled_sq_norms(g))
                else:
                    accumulate(self.sums, name, combine(self.coef[rows, handler.layer], g))
                b = b.index_put((rows,), b.new_zeros(()))
        if self.coef is not None:
            accumulate(self.sums, name, handler.weight_sum(
                a, scale_rows(b, self.coef[:, handler.layer])))
            return
        self.sq[:, handler.layer] += sq
        self.pending.append((handler, a, b))

    def finish(self) -> None:
        """After the backward: the fallbacks' calls, then the squared norms of what was kept."""
        by_unit: dict[int, tuple[OwnerFallback, list[Call]]] = {}
        for unit, call, version in self.fallback_calls:
            check_version(version, unit.qualname or "the model")
            by_unit.setdefault(id(unit), (unit, []))[1].append(call)
        self.fallback_calls = []
        layer_of = self.engine.layer_of
        for unit, use, versions in self.uses:
            for version in versions:
                check_version(version, f"a use of {unit.qualname or 'the model'}'s parameter")
            layer = layer_of[f"{unit.qualname}.{use[1]}" if unit.qualname else use[1]]
            if use[3] is None or not self.live[layer]:
                continue
            got = unit.per_example(tuple(use), coef=None if self.coef is None
                                   else self.coef[:, layer])
            for n, g in got.items():
                accumulate(self.kept if self.coef is None else self.sums, n, g)
        self.uses = []
        for unit, calls in by_unit.values():
            # per-example in both modes: a forward that draws randomness (dropout) redraws it
            # identically when a chunk is recomputed (``replaying``), so the sums are formed
            # from the very gradients whose norms were clipped
            got = unit.per_example(calls, chunk=self.engine.max_physical_batch)
            for n, g in got.items():
                if not self.live[layer_of[n]]:
                    continue
                if self.coef is None:
                    accumulate(self.kept, n, g)
                else:
                    accumulate(self.sums, n, combine(self.coef[:, layer_of[n]], g))
        if self.coef is None:
            for n, g in self.kept.items():
                self.sq[:, layer_of[n]] += scaled_sq_norms(g)


def rng_state(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global generators' states (CPU, and the device's) before a chunk's forward."""
    device = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
    return torch.random.get_rng_state(), device


@contextlib.contextmanager
def replaying(state: tuple[torch.Tensor, torch.Tensor | None], x: torch.Tensor
               ) -> Iterator[None]:
    """Recompute a chunk with the randomness its first forward drew (dropout masks), leaving
    the global generators as they were: a recomputed sum must be of the gradients whose norms
    the clip phase saw."""
    devices = [x.device] if state[1] is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.random.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], x.device)
        yield


def unpatch(units: Iterable[Unit]) -> None:
    for u in units:
        if isinstance(u, PATCHED) and "forward" in vars(u.module):
            del u.module.forward


def unit_layers(unit: Unit) -> list[int]:
    return list(unit.layers) if isinstance(unit, OwnerFallback | ParamUses) else [unit.layer]


def batch_first(t: torch.Tensor, dim: int | None, unit: Handler) -> torch.Tensor:
    """A hooked tensor with its batch dimension first (where the module's rule needs it)."""
    if dim == 0:
        return t
    if dim is None or not unit.batch_anywhere:
        where = "has no batch dimension" if dim is None else f"has its batch in dimension {dim}"
        raise NotPerExample(f"the input or output of {unit.qualname} ({unit.kind}) {where}")
    return t.movedim(dim, 0)


def check_version(version: tuple[torch.Tensor, int], where: str) -> None:
    """The engine keeps a module's input until the backward: changed in place after the module
    ran, it would no longer be the input the gradient belongs to."""
    tensor, seen = version
    if tensor._version != seen:
        raise NotPerExample(f"the input of {where} is changed in place after {where} ran "
                            "(its per-example gradient needs the value it was called with)")


# ---- units ------------------------------------------------------------------------------------
Unit = Handler | OwnerFallback | RecurrentUnit | AttentionUnit | ParamUses
#: Units whose module runs a re-stated forward during the pass (hooks on inner projections).
PATCHED = (RecurrentUnit, AttentionUnit)


#: Modules whose children's forwards never run (the parent reads the children's parameters
#: directly): one exact fallback covers all of their parameters.
def _atomic_types() -> tuple[type, ...]:
    return (torch.nn.MultiheadAttention,)


def handler_types() -> dict[type, type[Handler]]:
    """The modules the engine has algebra for, and their handlers."""
    nn_ = torch.nn
    return {nn_.Linear: LinearHandler, nn_.Conv1d: Conv1dHandler, nn_.Conv2d: Conv2dHandler,
            nn_.Embedding: EmbeddingHandler, nn_.EmbeddingBag: EmbeddingBagHandler,
            nn_.GroupNorm: GroupNormHandler, nn_.LayerNorm: LayerNormHandler}


def build_units(modules: Iterable[tuple[str, nn.Module]], layer_of: dict[str, int]
                ) -> list[Unit]:
    """One unit per module that owns a trainable parameter: the module's handler where the
    engine has its algebra, else the exact fallback for its own parameters (all of them under
    an atomic module such as ``nn.MultiheadAttention``); recurrent modules get their
    step-by-step unit (:mod:`trainables.engine.rnn`). Frozen parameters get no unit."""
    types = handler_types()
    units: list[Unit] = []
    claimed: list[str] = []
    for qual, module in modules:
        if any(qual.startswith(c + ".") for c in claimed):
            continue

        def full(local: str, q: str = qual) -> str:
            return f"{q}.{local}" if q else local

        if isinstance(module, _atomic_types()):
            mine = [n for n, _ in module.named_parameters() if full(n) in layer_of]
            layers = {layer_of[full(n)] for n in mine}
            if mine and decomposable(module) and len(layers) == 1:
                units.append(AttentionUnit(module, qualname=qual, layer=layers.pop(),
                                           trainable={full(n) for n in mine}))
            elif mine:
                units.append(OwnerFallback(module, qualname=qual, params=mine,
                                           layer_of=layer_of))
            claimed.append(qual)
            continue
        own = [n for n, _ in module.named_parameters(recurse=False) if full(n) in layer_of]
        if not own:
            continue
        if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag):
            check_embedding(module, qual)
        handler = types.get(type(module))
        if isinstance(module, torch.nn.EmbeddingBag) and module.mode == "max":
            handler = None  # a max has no linear rule: the exact fallback
        if isinstance(module, recurrent_types()):
            handler = RecurrentUnit  # type: ignore[assignment]
        if handler is None:  # a container's own parameters by their uses, else torch.func
            kind = ParamUses if next(module.children(), None) is not None else OwnerFallback
            units.append(kind(module, qualname=qual, params=own, layer_of=layer_of))
            continue
        layers = {layer_of[full(n)] for n in own}
        if len(layers) != 1:
            raise ValueError(f"the parameters of {qual} are in {len(layers)} layers, not one")
        units.append(handler(module, qualname=qual, layer=layers.pop(),
                             trainable={full(n) for n in own}))
    return units
