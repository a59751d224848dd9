"""A user's model, checked before anything runs, and told how to fix what DP training cannot use.

In the spirit of Opacus's ``ModuleValidator``: each problem is one line naming the module, the
reason and the fix, raised as :class:`UserInputError` (exit 2) while the config is validated,
before a run directory or Ray exists. What is checked, and why it matters for the privacy claim:

* **Nothing mixes examples.** BatchNorm normalises each example with the batch's statistics, so
  one example's gradient depends on the others and per-example clipping no longer bounds one
  person's influence; its running statistics are also an unnoised release. Instance norms with
  running statistics keep the latter. Any buffer a forward pass changes is refused for the same
  reason, and an example's output must not change when another example joins its batch.
* **Every parameter in exactly one layer, owned by one module** (tied weights are refused: a
  shared tensor's per-example gradient would count one of its uses only), and every parameter
  trainable: the per-layer methods
  clip, noise and freeze by layer, and the accountant covers what is noised. A frozen
  parameter (``requires_grad=False``) would be silently trained by the DP step or silently left
  out of a layer's clipping bound; a constant belongs in a buffer.
* **Every layer runs in the forward** and returns a tensor (the audit attacks that output).
* **Per-example gradients exist**: the engine has exact per-layer algebra for Linear, Conv1d,
  Conv2d, Embedding, LayerNorm and GroupNorm; a layer with any other parameterised module is
  differentiated per example by ``torch.func`` (block by block when the layer's module takes one
  tensor and runs once, otherwise over the whole model). One step on a two-example batch is run
  here, so a model neither path handles is refused now, not in a worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from core.errors import UserInputError
from trainables.engine import BLOCK_EXACT_PATH, ENGINE_PATH, WHOLE_EXACT_PATH, GradEngine
from trainables.models import WrappedModel

#: Modules that normalise with batch statistics, and what to use instead.
_BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
_INSTANCE_NORMS: tuple[type[nn.Module], ...] = (nn.modules.instancenorm._InstanceNorm,)
#: Rows compared in the batch-independence check (an example's output with and without others).
_MIX_TOL = 1e-4


@dataclass(frozen=True)
class _Trace:
    order: list[str]  # qualified names of parameter-owning or named modules, first call order
    calls: dict[str, int]
    single_tensor: dict[str, bool]  # called with exactly one positional tensor and no kwargs


def _bad(field: str, module: str, reason: str, fix: str) -> UserInputError:
    return UserInputError(field=field, value=module, allowed=f"{fix} ({reason})")


def _trace(net: nn.Module, sample: torch.Tensor, names: Sequence[str]) -> _Trace:
    modules = dict(net.named_modules())
    order: list[str] = []
    calls = dict.fromkeys(names, 0)
    single: dict[str, bool] = dict.fromkeys(names, True)

    def pre(name: str):
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict) -> None:
            del module
            if name not in order:
                order.append(name)
            calls[name] += 1
            one = len(args) == 1 and isinstance(args[0], torch.Tensor) and not kwargs
            single[name] = single[name] and one
        return hook

    handles = [modules[n].register_forward_pre_hook(pre(n), with_kwargs=True) for n in names]
    try:
        with torch.no_grad():
            net(sample)
    finally:
        for h in handles:
            h.remove()
    return _Trace(order=order, calls=calls, single_tensor=single)


def _owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _check_modules(net: nn.Module, field: str) -> None:
    for name, module in net.named_modules():
        kind = type(module).__name__
        if isinstance(module, _BATCH_NORMS):
            raise _bad(field, name, f"{kind} mixes the examples of a batch, so per-example "
                       "clipping does not bound one example",
                       f"replace {kind} {name!r} with GroupNorm (or LayerNorm)")
        if isinstance(module, _INSTANCE_NORMS) and module.track_running_stats:
            raise _bad(field, name, "its running statistics are an unnoised release of the "
                       "training examples", f"build {kind} {name!r} with "
                       "track_running_stats=False")
        if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse
                                                 or module.scale_grad_by_freq):
            raise _bad(field, name, "max_norm rewrites the weight inside forward, "
                       "scale_grad_by_freq scales every example by the batch's token counts and "
                       "sparse gradients have no per-example form",
                       f"build Embedding {name!r} without max_norm or scale_grad_by_freq and "
                       "with sparse=False")
    owners: dict[int, str] = {}
    for pname, param in net.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            raise _bad(field, pname, f"it is the same tensor as {owners[id(param)]!r}: a "
                       "weight shared by two modules gets its per-example gradient from one of "
                       "them only", f"untie {pname!r} from {owners[id(param)]!r}")
        owners[id(param)] = pname
    for pname, param in net.named_parameters():
        if not param.requires_grad:
            raise _bad(field, pname, "DP training trains and noises every parameter of a layer",
                       f"make {pname!r} trainable, or register it as a buffer if it is a "
                       "constant")


def _default_layers(net: nn.Module, sample: torch.Tensor, field: str) -> dict[str, str]:
    """Each top-level child that owns parameters is a layer, in the order forward calls them."""
    children = [n for n, m in net.named_children() if _owns_parameters(m)]
    stray = [n for n, _ in net.named_parameters(recurse=False)]
    if stray:
        raise _bad(field, stray[0], "a parameter of the top module is in no layer",
                   f"move {stray[0]!r} into a submodule, or list the layers in [model] layers")
    if not children:
        raise _bad(field, type(net).__name__, "it has no parameters",
                   "return a model with trainable submodules")
    trace = _trace(net, sample, children)
    unused = [n for n in children if trace.calls[n] == 0]
    if unused:
        raise _bad(field, unused[0], "forward never calls it",
                   f"remove {unused[0]!r} or call it in forward")
    return {name: name for name in trace.order}


def _given_layers(net: nn.Module, layers: Sequence[str], sample: torch.Tensor,
                  field: str) -> dict[str, str]:
    modules = dict(net.named_modules())
    for path in layers:
        if path not in modules or path == "":
            raise UserInputError(field="model.layers", value=path,
                                 allowed=f"a module name of the model: "
                                         f"{[n for n, _ in net.named_children()]} (dotted "
                                         "paths reach deeper)")
    if len(set(layers)) != len(layers):
        raise UserInputError(field="model.layers", value=list(layers),
                             allowed="each module once")
    for pname, _ in net.named_parameters():
        owners = [p for p in layers if pname.startswith(p + ".")]
        if not owners:
            raise _bad(field, pname, "a parameter outside every layer is trained but belongs "
                       "to no clipping group", f"add its module to [model] layers = "
                       f"{list(layers)}")
        if len(owners) > 1:
            raise UserInputError(field="model.layers", value=owners,
                                 allowed=f"layers that do not nest: {pname!r} is in each")
    trace = _trace(net, sample, list(layers))
    unused = [p for p in layers if trace.calls[p] == 0]
    if unused:
        raise UserInputError(field="model.layers", value=unused[0],
                             allowed="modules the forward calls (this one never runs)")
    return {path: path for path in trace.order}


def _check_outputs(model: WrappedModel, sample: torch.Tensor, num_classes: int,
                   field: str) -> None:
    with torch.no_grad():
        model.eval()
        try:
            out, irs = model.forward_with_irs(sample)
        except TypeError as exc:
            raise _bad(field, type(model.net).__name__, str(exc),
                       "make each layer return a tensor") from None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(sample), num_classes):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise _bad(field, type(model.net).__name__, f"forward returned {shape}",
                       f"return logits of shape [batch, {num_classes}]")
        for name, ir in irs.items():
            if ir.shape[0] != len(sample):
                raise _bad(field, name, f"its output has {ir.shape[0]} rows for a batch of "
                           f"{len(sample)}", "keep the batch as the first dimension")
        if sample.is_floating_point():
            alone = model(sample[:1])
            if not torch.allclose(alone[0], out[0], rtol=_MIX_TOL, atol=_MIX_TOL):
                raise _bad(field, type(model.net).__name__, "an example's output changes when "
                           "another example joins its batch", "remove whatever mixes "
                           "examples across the batch dimension")
        model.train()


def _check_buffers(net: nn.Module, sample: torch.Tensor, field: str) -> None:
    before = {n: b.detach().clone() for n, b in net.named_buffers()}
    net.train()
    with torch.no_grad():
        net(sample)
    for name, buf in net.named_buffers():
        if name in before and not torch.equal(before[name], buf):
            raise _bad(field, name, "a buffer the forward pass updates carries statistics of "
                       "training examples outside the noised gradient",
                       f"stop updating {name!r} in forward (or make it a parameter)")


def per_example_path(model: WrappedModel, trace_single: dict[str, bool]) -> str:
    """Which per-example path the engine takes for this model (see the module docstring)."""
    from trainables.module_grads import handler_types

    types = handler_types()
    fallback = [name for name, block in model.blocks.items()
                if not all(type(m) in types for m in block.modules()
                           if next(m.parameters(recurse=False), None) is not None)]
    if not fallback:
        return ENGINE_PATH
    if all(trace_single.get(model.layer_paths()[n].removeprefix("net."), False)
           for n in fallback):
        return BLOCK_EXACT_PATH
    return WHOLE_EXACT_PATH


def wrap_checked(net: object, *, layers: Sequence[str], sample: torch.Tensor,
                 num_classes: int, field: str = "model.factory") -> WrappedModel:
    """``net`` checked (see the module docstring) and wrapped; the first problem is raised."""
    if not isinstance(net, nn.Module):
        raise UserInputError(field=field, value=type(net).__name__,
                             allowed="a factory that returns a torch.nn.Module")
    _check_modules(net, field)
    paths = (_given_layers(net, layers, sample, field) if layers
             else _default_layers(net, sample, field))
    trace = _trace(net, sample, list(paths.values()))
    model = WrappedModel(net, layers=paths, num_classes=num_classes)
    model.per_example_path = per_example_path(model, trace.single_tensor)
    _check_buffers(net, sample, field)
    _check_outputs(model, sample, num_classes, field)
    _check_one_step(model, sample, num_classes, field)
    return model


def _check_one_step(model: WrappedModel, sample: torch.Tensor, num_classes: int,
                    field: str) -> None:
    strategy = "vmap" if model.per_example_path == WHOLE_EXACT_PATH else "auto"
    y = torch.arange(len(sample)) % num_classes
    try:
        view = GradEngine(model, strategy=strategy).compute(
            sample, y, live=[True] * len(model.layer_names))
        view.weighted_sum(torch.ones_like(view.norms, dtype=torch.float32))
    except UserInputError:
        raise
    except Exception as exc:
        raise _bad(field, type(model.net).__name__, f"per-example gradients failed: "
                   f"{type(exc).__name__}: {exc}", "use modules torch.func can differentiate "
                   "per example (no in-place parameter updates, no .item() in forward)") \
            from None
    if not torch.isfinite(view.norms).all():
        raise _bad(field, type(model.net).__name__, "per-example gradient norms are not finite "
                   "at initialisation", "check the model's initialisation")


def sample_batch(*, input_shape: Sequence[int], tokens: bool, rows: int = 2) -> torch.Tensor:
    """A small deterministic batch shaped like the data (zeros for token ids)."""
    shape = (rows, *input_shape)
    if tokens:
        return torch.zeros(shape, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen)
