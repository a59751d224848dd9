"""Where each tensor's batch dimension is, and exact per-example gradients by ``torch.func``.

Two pieces of :mod:`trainables.engine.grad_engine` that do not depend on a module's type:

* **Batch dimensions by probing.** A stock model does not always keep the batch first inside:
  ``nn.TransformerEncoderLayer(batch_first=False)`` runs its Linear layers on [T, B, E], an
  RNN's hidden state is [layers, B, H]. The engine runs the model once on 2 and once on 3
  copies of one example and, for every tensor entering or leaving a module it hooks, takes as
  batch dimension the one dimension that is 2 in the first run, 3 in the second, with every
  other dimension equal. A tensor with no such dimension is a constant of the call (an
  attention mask); an output without one, or a tensor whose batch is folded into another
  dimension, has no per-example form and is reported by module path (:class:`NotPerExample`).
* **The exact fallback** (:class:`OwnerFallback`) for parameters no per-module rule covers: a
  module of a type the engine has no algebra for (``nn.MultiheadAttention``, a user's module),
  or a parameter owned directly by a parent (a ViT's ``class_token``, a learned positional
  embedding on the root). Per call, the module's inputs (every tensor of ``args`` and
  ``kwargs``) and output gradients (every tensor of its output, a tuple included) are kept; the
  per-example gradient of its own parameters is then ``vmap`` over examples of the vjp of that
  one call on a batch of one, children held fixed (exact: examples do not interact), summed
  over calls. This is the per-module form of Opacus's functorch fallback, extended to any
  number of inputs and outputs and to modules called more than once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpsweep.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")

#: Batch sizes of the two probe forwards (distinct, and unlikely to equal a model dimension;
#: a dimension that equals them by chance is still told apart by its growing 2 -> 3).
PROBE_SIZES = (2, 3)


class NotPerExample(ValueError):
    """A module's inputs or outputs have no batch dimension the engine can follow."""


def leaves(tree: Any) -> tuple[list[Any], Any]:
    """The flattened leaves of a (possibly nested) tuple / list / dict and its structure."""
    return torch.utils._pytree.tree_flatten(tree)


def rebuild(values: Sequence[Any], spec: Any) -> Any:
    return torch.utils._pytree.tree_unflatten(list(values), spec)


def shapes(tree: Any) -> list[tuple[int, ...] | None]:
    """Each leaf's shape (None for a leaf that is not a tensor)."""
    flat, _ = leaves(tree)
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in flat]


def batch_dims(small: Sequence[tuple[int, ...] | None], large: Sequence[tuple[int, ...] | None],
               *, where: str) -> tuple[int | None, ...]:
    """Per leaf, the dimension that grew from ``PROBE_SIZES[0]`` to ``PROBE_SIZES[1]`` (None:
    the leaf does not depend on the batch size)."""
    if len(small) != len(large):
        raise NotPerExample(f"{where} changes its structure with the batch size")
    out: list[int | None] = []
    for a, b in zip(small, large, strict=True):
        if a is None or b is None or a == b:
            out.append(None)
            continue
        grew = [d for d, (x, y) in enumerate(zip(a, b, strict=False))
                if (x, y) != (y, y) and x != y]
        if len(a) != len(b) or len(grew) != 1 or (a[grew[0]], b[grew[0]]) != PROBE_SIZES:
            raise NotPerExample(f"{where} has shape {a} for {PROBE_SIZES[0]} examples and {b} "
                                f"for {PROBE_SIZES[1]}: its batch is folded into another "
                                "dimension")
        out.append(grew[0])
    return tuple(out)


@dataclass(frozen=True)
class CallDims:
    """Batch dimension of every input leaf (args then kwargs) and output leaf of one call."""

    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]


def probe_calls(model: nn.Module, x: torch.Tensor, modules: dict[int, nn.Module],
                names: dict[int, str]) -> dict[int, list[CallDims]]:
    """Per hooked module (by id), the batch dimensions of each of its calls in one forward."""
    runs: list[dict[int, list[tuple[list[Any], list[Any]]]]] = []
    for size in PROBE_SIZES:
        seen: dict[int, list[tuple[list[Any], list[Any]]]] = {k: [] for k in modules}

        def hook(key: int, seen: dict[int, list[Any]] = seen) -> Callable[..., None]:
            def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       output: Any) -> None:
                del module
                seen[key].append((shapes((args, kwargs)), shapes(output)))
            return record

        handles = [m.register_forward_hook(hook(k), with_kwargs=True) for k, m in modules.items()]
        try:
            with torch.no_grad():
                model(x[:1].expand(size, *x.shape[1:]).contiguous())
        finally:
            for h in handles:
                h.remove()
        runs.append(seen)
    out: dict[int, list[CallDims]] = {}
    for key in modules:
        small, large = runs[0][key], runs[1][key]
        where = names[key]
        if len(small) != len(large):
            raise NotPerExample(f"{where} runs {len(small)} times for {PROBE_SIZES[0]} examples "
                                f"and {len(large)} for {PROBE_SIZES[1]}")
        calls = []
        for (ins, outs), (ins2, outs2) in zip(small, large, strict=True):
            in_dims = batch_dims(ins, ins2, where=f"an input of {where}")
            out_dims = batch_dims(outs, outs2, where=f"the output of {where}")
            calls.append(CallDims(inputs=in_dims, outputs=out_dims))
        out[key] = calls
    return out


def vmap_examples(fn: Callable[..., Any], *, in_dims: tuple[int | None, ...],
                  chunk: int | None) -> Callable[..., Any]:
    """``vmap(fn)`` drawing each example's own randomness (its own dropout mask) where the
    model allows it. An operation that fills an unbatched tensor in place at random
    (torchvision's stochastic depth draws its per-row mask into ``torch.empty``) has no
    per-example draw under ``vmap``; such a model takes one draw shared by the chunk's
    examples instead. Either way the draws do not depend on the data, so each example's
    gradient stays its own; and the same generator state makes the same choice and the same
    draws, so a recomputed chunk forms the very gradients that were clipped."""
    def run(*args: Any) -> Any:
        try:
            return torch.func.vmap(fn, in_dims=in_dims, chunk_size=chunk,
                                   randomness="different")(*args)
        except RuntimeError as exc:
            if "randomness" not in str(exc):
                raise
        return torch.func.vmap(fn, in_dims=in_dims, chunk_size=chunk, randomness="same")(*args)
    return run


class OwnParams:
    """A module's parameters handled together, by name (full names for the records)."""

    kind = "torch.func"
    per_channel = False

    def __init__(self, module: nn.Module, *, qualname: str, params: Sequence[str],
                 layer_of: dict[str, int]) -> None:
        self.module = module
        self.qualname = qualname
        self.local = list(params)
        self.names = [f"{qualname}.{n}" if qualname else n for n in self.local]
        self.layer_of = {f: layer_of[f] for f in self.names}
        self.layers = sorted(set(self.layer_of.values()))


class OwnerFallback(OwnParams):
    """Exact per-example gradients of one module's parameters by ``torch.func`` (see the module
    docstring). ``params`` are the local names it differentiates (its own, or every one under
    it for a module whose children's forwards never run, like ``nn.MultiheadAttention``'s
    ``out_proj``); ``layer_of`` maps their full names to layers."""

    def _params(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        own = dict(self.module.named_parameters())
        return {n: own[n].detach() for n in (self.local if names is None else names)}

    def _loss(self, call: Call, *, one: bool = True
              ) -> tuple[Callable[..., torch.Tensor], list[torch.Tensor], tuple[int | None, ...]]:
        """This call's summed output-gradient product, and its vmap arguments and dimensions
        (batched inputs, then the used output gradients); ``one``: on a batch of one example
        (under vmap), else on the whole chunk as kept."""
        inputs, spec, dims, grads = call
        batched = [i for i, d in enumerate(dims.inputs) if d is not None and one]
        used = [k for k, g in enumerate(grads) if g is not None]
        for k in used:
            if dims.outputs[k] is None:
                raise NotPerExample(f"the output of {self.qualname or 'the model'} has a "
                                    "tensor without a batch dimension that the loss reads")
        module = self.module

        def loss(params: dict[str, torch.Tensor], *values: torch.Tensor) -> torch.Tensor:
            flat = list(inputs)
            for i, v in zip(batched, values[:len(batched)], strict=True):
                flat[i] = v.unsqueeze(dims.inputs[i])
            args, kwargs = rebuild(flat, spec)
            out, _ = leaves(torch.func.functional_call(module, params, tuple(args), kwargs))
            terms = [(out[k] * (b.unsqueeze(dims.outputs[k]) if one else b)).sum()
                     for k, b in zip(used, values[len(batched):], strict=True)]
            return torch.stack(terms).sum()

        args = [inputs[i] for i in batched] + [grads[k] for k in used]
        return loss, args, (None, *[dims.inputs[i] for i in batched],
                            *[dims.outputs[k] for k in used])

    def per_example(self, calls: Sequence[Call], *, chunk: int) -> dict[str, torch.Tensor]:
        """{full name: [B, *shape]} summed over this module's calls in the chunk."""
        total: dict[str, torch.Tensor] = {}
        for call in calls:
            if not any(g is not None for g in call[3]):
                continue
            fn, args, in_dims = self._loss(call)
            # a dropout inside draws each example's own mask where it can (vmap_examples), so
            # no example's gradient depends on another's
            got = vmap_examples(torch.func.grad(fn), in_dims=in_dims,
                                chunk=chunk)(self._params(), *args)
            for n, f in zip(self.local, self.names, strict=True):
                total[f] = total[f] + got[n] if f in total else got[n]
        return total


#: One call of a fallback module: flattened inputs, their structure, batch dims, and the
#: gradient of each output leaf (None: not a tensor, or nothing downstream read it).
Call = tuple[list[Any], Any, CallDims, list["torch.Tensor | None"]]
