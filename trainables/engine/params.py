"""Per-example gradients of parameters a container module uses directly, op by op.

A ViT's ``class_token`` (``self.class_token.expand(n, -1, -1)`` in the root's forward), its
encoder's ``pos_embedding`` (``input + self.pos_embedding``) or a positional parameter added on
the root belong to a module whose forward runs a whole network: differentiating that module per
example by ``torch.func`` means a per-example pass over everything it wraps. The parameter
itself, though, enters a few cheap operations. While the owner's forward runs, a
``TorchFunctionMode`` catches every operation that takes one of its parameters as an argument,
runs it, and keeps it with a hook on its output. After the backward, example i's gradient of
that use is the operation's vjp with respect to the parameter at the output gradient restricted
to example i's slice (exact for any operation, since examples do not interact downstream),
computed for all examples at once by ``vmap`` over the slices; uses add up. Where the output's
batch dimension is comes from the engine's probe (2 and 3 copies of one example), per call in
forward order. An operation whose output has no batch dimension (the parameter transformed on
its own before meeting the batch) has no per-example form here: the probe reports it, and the
validator then takes the exact path over the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.func import PROBE_SIZES, NotPerExample, OwnParams, leaves, rebuild

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")

#: Elements of the per-example slices of one use's output gradient formed at once (memory).
SLICE_ELEMENTS = 1 << 24


class ParamUses(OwnParams):
    """The engine's unit for a container module's own parameters (see the module docstring)."""

    kind = "param uses"

    def __init__(self, module: nn.Module, *, qualname: str, params: Sequence[str],
                 layer_of: dict[str, int]) -> None:
        super().__init__(module, qualname=qualname, params=params, layer_of=layer_of)
        #: Per use in a forward, in order, the batch dimension of its output (probed).
        self.dims: list[int] = []

    def tensors(self) -> dict[int, tuple[ParamUses, str, str]]:
        """id(parameter) -> (this unit, local name, full name), for :func:`uses_mode`."""
        own = dict(self.module.named_parameters(recurse=False))
        return {id(own[n]): (self, n, f) for n, f in zip(self.local, self.names, strict=True)}

    def per_example(self, use: Use, *, coef: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
        """{full name: [B, *shape]} of one use (``coef``: its coefficient-weighted sum)."""
        vjp, vmap = torch.func.vjp, torch.func.vmap

        apply, local, dim, b = use
        param = dict(self.module.named_parameters(recurse=False))[local].detach()
        _, pull = vjp(apply, param)
        full = f"{self.qualname}.{local}" if self.qualname else local
        shape = [1] * b.dim()
        shape[dim] = -1
        if coef is not None:
            return {full: pull(b * coef.to(dtype=b.dtype, device=b.device).view(shape))[0]}
        n = b.shape[dim]
        step = max(1, SLICE_ELEMENTS // max(1, b.numel()))
        parts = []
        for start in range(0, n, step):
            rows = torch.arange(start, min(n, start + step), device=b.device)
            mask = torch.zeros(len(rows), n, dtype=b.dtype, device=b.device)
            mask[torch.arange(len(rows)), rows] = 1
            parts.append(vmap(pull)(b.unsqueeze(0) * mask.view(len(rows), *shape))[0])
        return {full: torch.cat(parts)}


#: One use: (the op as a function of the parameter, the parameter's local name, the batch
#: dimension of its output, the output gradient).
Use = tuple[Callable[["torch.Tensor"], "torch.Tensor"], str, int, "torch.Tensor"]
#: on_use(unit, call index, recipe, local name, tensors read, output) -> the output to return.
OnUse = Callable[..., "torch.Tensor"]


def uses_mode(units: Sequence[ParamUses], on_use: OnUse, *, model: nn.Module) -> Any:
    """A function mode that hands every use of the units' parameters to ``on_use``, as a
    function of the parameter. An op whose tensors are all the parameter, tensors derived
    from it, or the model's other parameters and buffers (``self.pos[:, :T]``,
    ``self.class_token.expand(n, -1, -1)``) derives a tensor that is followed to its uses;
    an op that also reads an activation is a use."""
    tracked: dict[int, tuple[ParamUses, str, Callable[[Any], Any], Any]] = {}
    for unit in units:
        for key, (_, local, _) in unit.tensors().items():
            tracked[key] = (unit, local, lambda p: p, None)
    constants = {id(t) for t in [*model.parameters(), *model.buffers()]}
    counts: dict[int, int] = {}

    class Uses(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not (isinstance(out, torch.Tensor) and out.is_floating_point()):
                return out
            flat, spec = leaves((args, kwargs))
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            hits = list(dict.fromkeys(id(t) for t in tensors if id(t) in tracked))
            if not hits:
                return out
            derived = all(id(t) in tracked or id(t) in constants for t in tensors)
            for key in hits:
                unit, local, chain, _ = tracked[key]
                recipe = _recipe(func, flat, spec, key, chain)
                if derived:  # kept alive while tracked, so its id is not reused
                    tracked[id(out)] = (unit, local, recipe, out)
                    continue
                call = counts.get(id(unit), 0)
                counts[id(unit)] = call + 1
                out = on_use(unit, call, recipe, local, tensors, out)
            return out

    return Uses()


def _recipe(func: Any, flat: list[Any], spec: Any, key: int,
            chain: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The op as a function of the parameter at the root of ``chain``."""
    def apply(p: Any) -> Any:
        v = chain(p)
        args, kwargs = rebuild([v if isinstance(t, torch.Tensor) and id(t) == key else t
                                for t in flat], spec)
        return func(*args, **kwargs)
    return apply


def probe_uses(units: Sequence[ParamUses], model: nn.Module, x: torch.Tensor) -> None:
    """Each unit's uses' output batch dimensions (``PROBE_SIZES``), in forward order."""
    if not units:
        return
    runs: list[dict[int, list[tuple[int, ...]]]] = []
    for size in PROBE_SIZES:
        shapes: dict[int, list[tuple[int, ...]]] = {id(u): [] for u in units}

        def record(unit: ParamUses, call: int, recipe: Any, local: str, read: Any,
                   out: torch.Tensor, shapes: dict[int, list[Any]] = shapes) -> torch.Tensor:
            del call, recipe, local, read
            shapes[id(unit)].append(tuple(out.shape))
            return out

        with uses_mode(units, record, model=model), torch.no_grad():
            model(x[:1].expand(size, *x.shape[1:]).contiguous())
        runs.append(shapes)
    for unit in units:
        small, large = runs[0][id(unit)], runs[1][id(unit)]
        where = f"a use of a parameter of {unit.qualname or 'the model'}"
        if len(small) != len(large):
            raise NotPerExample(f"{where} depends on the batch size")
        unit.dims = []
        for a, b in zip(small, large, strict=True):
            grew = [d for d in range(min(len(a), len(b))) if (a[d], b[d]) == PROBE_SIZES]
            if len(a) != len(b) or len(grew) != 1:
                raise NotPerExample(f"{where} has an output of shape {a} for {PROBE_SIZES[0]} "
                                    f"examples and {b} for {PROBE_SIZES[1]}: no batch "
                                    "dimension to split its gradient by")
            unit.dims.append(grew[0])
