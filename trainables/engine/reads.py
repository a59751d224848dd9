"""Parameters read outside the forward of the module whose unit covers them.

A per-module rule (a Linear's, a module's own ``torch.func`` fallback) sees a parameter only
through its module's calls. torchvision's Swin v1 window attention (``ShiftedWindowAttention``)
owns ``qkv`` and ``proj`` Linear children but never calls them: its forward hands
``self.qkv.weight`` to ``F.linear`` on windows whose rows fold the batch with the windows
([B * windows, tokens, C]), and indexes its ``relative_position_bias_table`` by a buffer. The
Linear rules would never fire: those parameters would get no per-example gradient at all,
left out of every norm and never trained, with nothing to say so.

So before its first pass the engine runs the model once on one example (gradients on, as in a
step, so no inference-only fast path reads weights where a step would not) and records every
operation that reads a parameter while the module of the unit covering it is not running.
Each such parameter's *reader* is the innermost running module that contains the parameter's
owner (the window attention above). Every unit inside a reader is replaced by one exact
``torch.func`` fallback over the reader, for all of its trainable parameters
(:class:`trainables.engine.func.OwnerFallback`: each example's gradient of one call of the
reader, exact whatever the reader does inside, indexed gathers and folded batches included).
A reader that holds every trainable parameter (a read in the network's own forward) leaves
nothing for the engine: :class:`NotPerExample`, and the validator takes the exact path over
the whole model. Parameters of a container's own ``ParamUses`` unit are caught wherever they
are read (:mod:`trainables.engine.params`), so they are not followed here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.func import NotPerExample, OwnerFallback, leaves
from dpsweep.trainables.engine.params import ParamUses
from dpsweep.trainables.engine.passes import Unit, replaying, rng_state

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpsweep.trainables.models.trainable import TrainableLayers
else:
    torch = lazy_module("torch")


def _inside(name: str, module: str) -> bool:
    """Whether ``name`` (a module or parameter path) is ``module`` or lies under it."""
    return module == "" or name == module or name.startswith(module + ".")


def covered(unit: Unit, *, layer_of: dict[str, int]) -> list[str]:
    """The trainable parameters (full names) whose gradients ``unit`` forms from its module's
    calls: a fallback's own, or every one under a rule's module (a Linear, an attention or a
    recurrent module: their parameters are read by their own forward)."""
    if isinstance(unit, OwnerFallback):
        return list(unit.names)
    if isinstance(unit, ParamUses):
        return []
    return [n for n in layer_of if _inside(n, unit.qualname) and n != unit.qualname]


def find_readers(units: Sequence[Unit], *, model: nn.Module,
                 modules: dict[str, nn.Module], layer_of: dict[str, int],
                 x: torch.Tensor) -> dict[str, str]:
    """{parameter: its reader} for every parameter read outside its unit's module, from one
    forward of ``x[:1]`` (the global generators left as they were)."""
    owner: dict[int, tuple[str, str]] = {}  # id(parameter) -> (its name, its unit's module)
    params = {n: p for q, m in modules.items() for n, p in _own(q, m)}
    for unit in units:
        for name in covered(unit, layer_of=layer_of):
            if name in params:
                owner[id(params[name])] = (name, unit.qualname)
    if not owner or x.shape[0] == 0:
        return {}
    running: list[str] = []
    readers: dict[str, str] = {}

    def push(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            del module, args
            running.append(name)
        return hook

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        del module, args, output
        running.pop()

    class Reads(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if not any(isinstance(v, torch.Tensor) for v in leaves(out)[0]):
                return out  # a shape, a dtype: no value of the parameter flows on
            for t in leaves((args, kwargs or {}))[0]:
                hit = owner.get(id(t)) if isinstance(t, torch.Tensor) else None
                if hit is None or hit[1] in running:
                    continue
                name, unit = hit
                reader = next(q for q in reversed(running) if _inside(unit, q))
                readers.setdefault(name, reader)
            return out

    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(push(name), prepend=True))
        handles.append(module.register_forward_hook(pop, always_call=True))
    try:
        with replaying(rng_state(x), x), torch.enable_grad(), Reads():
            model(x[:1])
    finally:
        for h in handles:
            h.remove()
    return readers


def _own(qualname: str, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{qualname}.{n}" if qualname else n, p)
            for n, p in module.named_parameters(recurse=False)]


def absorb(units: Sequence[Unit], readers: dict[str, str], *,
           modules: dict[str, nn.Module], layer_of: dict[str, int]) -> list[Unit]:
    """``units`` with every unit inside a reader replaced by one exact fallback over the
    outermost reader (in the first replaced unit's place); :class:`NotPerExample` where a
    reader holds every trainable parameter."""
    hosts = set(readers.values())
    outer = sorted(h for h in hosts if not any(o != h and _inside(h, o) for o in hosts))
    for host in outer:
        if all(_inside(n, host) for n in layer_of):
            read = sorted(n for n, r in readers.items() if r == host)
            where = f"module {host!r}" if host else "the model"
            raise NotPerExample(f"parameter {read[0]!r} is read outside its own module by the "
                                f"forward of {where}, which holds every trainable parameter: "
                                "no module of the engine's can take it")
    out: list[Unit] = []
    placed: set[str] = set()
    for unit in units:
        host = next((h for h in outer if _inside(unit.qualname, h)), None)
        if host is None:
            out.append(unit)
            continue
        if host not in placed:
            prefix = f"{host}." if host else ""
            local = [n[len(prefix):] for n in layer_of if _inside(n, host)]
            out.append(OwnerFallback(modules[host], qualname=host, params=local,
                                     layer_of=layer_of))
            placed.add(host)
    return out


def reroute(units: Sequence[Unit], *, model: TrainableLayers, x: torch.Tensor,
            layer_of: dict[str, int]) -> list[Unit]:
    """``units`` with every parameter read outside its unit's module handed, with everything
    under its reader, to the reader's exact fallback (unchanged where there is none)."""
    modules = dict(model.named_modules())
    readers = find_readers(units, model=model.model, modules=modules, layer_of=layer_of, x=x)
    if not readers:
        return list(units)
    return absorb(units, readers, modules=modules, layer_of=layer_of)
