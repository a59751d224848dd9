"""A user's model, checked before anything runs, and told how to fix what DP training cannot use.

In the spirit of Opacus's ``ModuleValidator``: each problem is one line naming the module, the
reason and the fix, raised as :class:`UserInputError` (exit 2) while the config is validated,
before a run directory or Ray exists. What is checked, and why it matters for the privacy claim:

* **Nothing mixes examples.** BatchNorm normalises each example with the batch's statistics, so
  one example's gradient depends on the others and per-example clipping no longer bounds one
  person's influence; its running statistics are also an unnoised release. Instance norms with
  running statistics keep the latter (one line lists every such module; ``[model] fix = true``
  replaces them all first, ``trainables.models.fix``). Any buffer a forward pass changes is
  refused for the same reason, and an example's output must not change when another example
  joins its batch. A difference float32 shows and a float64 copy does not is rounding that a
  module amplifies (a GroupNorm over a few values of a 1 x 1 map), not mixing: both this check
  and the per-example norm check confirm in float64 before refusing.
* **Every parameter in exactly one layer, owned by one module** (tied weights are refused: a
  shared tensor's per-example gradient would count one of its uses only), and every parameter
  trainable: the per-layer methods
  clip, noise and freeze by layer, and the accountant covers what is noised. A frozen
  parameter (``requires_grad=False``) would be silently trained by the DP step or silently left
  out of a layer's clipping bound; a constant belongs in a buffer. A forward that sets
  ``requires_grad`` (unfreezing a frozen layer, or freezing one) is refused by name: what a step
  trains would differ from what was checked and bounded here.
* **Every layer runs in the forward** and returns a tensor (the audit attacks that output).
* **Per-example gradients exist**: the engine has exact per-layer algebra for Linear, Conv1d,
  Conv2d, Embedding, LayerNorm and GroupNorm; a layer with any other parameterised module is
  differentiated per example by ``torch.func`` (block by block when the layer's module takes one
  tensor and runs once, otherwise over the whole model). One step on a two-example batch is run
  here, so a model neither path handles is refused now, not in a worker.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dpsweep.core.errors import UserInputError
from dpsweep.trainables.engine.diagnose import explain
from dpsweep.trainables.engine.func import NotPerExample, probe_calls
from dpsweep.trainables.engine.grad_engine import WHOLE_EXACT_PATH, GradEngine
from dpsweep.trainables.engine.passes import LOOSE
from dpsweep.trainables.models import forward_probe
from dpsweep.trainables.models.networks import WrappedModel, logits_of

#: Modules that normalise with batch statistics, and what to use instead.
_BATCH_NORMS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm,)
_INSTANCE_NORMS: tuple[type[nn.Module], ...] = (nn.modules.instancenorm._InstanceNorm,)
#: Relative difference allowed between the engine's norms and the autograd reference on the
#: validation sample (float32 rounding is ~1e-6; a module that mixes examples is off by O(1)).
_NORM_CHECK_TOL = 1e-3
#: Rows compared in the batch-independence check (an example's output with and without others).
_MIX_TOL = 1e-4


@dataclass(frozen=True)
class _Trace:
    order: list[str]  # qualified names of parameter-owning or named modules, first call order
    calls: dict[str, int]
    single_tensor: dict[str, bool]  # called with exactly one positional tensor and no kwargs


def _bad(field: str, value: object, where: str, reason: str, fix: str) -> UserInputError:
    """One line: ``field = value`` (the field's own value, e.g. the factory reference), the fix,
    and where in the network the problem is (``module 'layer1.0.bn1'``) with its cause."""
    return UserInputError(field=field, value=value, allowed=f"{fix} ({where}: {reason})")


def _network(net: nn.Module) -> str:
    return f"the network ({type(net).__name__})"


def _listed(names: Sequence[str], kind: str, shown: int = 3) -> str:
    """``'20 BatchNorm modules ('bn1', 'layer1.0.bn1', 'layer1.0.bn2' and 17 more)'``."""
    quoted = [repr(n) if n else "the network itself" for n in names[:shown]]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    plural = "s" if len(names) > 1 else ""
    return f"{len(names)} {kind} module{plural} ({', '.join(quoted)}{more})"


def _check_batch_statistics(net: nn.Module, field: str, value: object) -> None:
    """Every BatchNorm, then every InstanceNorm with running statistics, in one line each."""
    batch = [n for n, m in net.named_modules() if isinstance(m, _BATCH_NORMS)]
    if batch:
        raise _bad(field, value, _listed(batch, "BatchNorm"), "BatchNorm normalises each "
                   "example with its batch's statistics, so one example's gradient depends on "
                   "the others and per-example clipping does not bound it; its running "
                   "statistics are an unnoised release", "set [model] fix = true to replace "
                   "every BatchNorm with GroupNorm, or replace them yourself (GroupNorm or "
                   "LayerNorm)")
    tracked = [n for n, m in net.named_modules()
               if isinstance(m, _INSTANCE_NORMS) and m.track_running_stats]
    if tracked:
        raise _bad(field, value, _listed(tracked, "InstanceNorm"), "running statistics "
                   "(track_running_stats=True) are an unnoised release of the training "
                   "examples", "set [model] fix = true to drop them, or build them with "
                   "track_running_stats=False")


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


def _check_modules(net: nn.Module, field: str, value: object) -> None:
    _check_batch_statistics(net, field, value)
    for name, module in net.named_modules():
        lookup = isinstance(module, nn.Embedding | nn.EmbeddingBag)
        if lookup and (module.max_norm is not None or module.sparse
                       or module.scale_grad_by_freq):
            raise _bad(field, value, f"module {name!r}", "max_norm rewrites the weight "
                       "inside forward, scale_grad_by_freq scales every example by the batch's "
                       "token counts and sparse gradients have no per-example form",
                       f"build {type(module).__name__} {name!r} without max_norm or "
                       "scale_grad_by_freq and "
                       "with sparse=False")
    owners: dict[int, str] = {}
    for pname, param in net.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            raise _bad(field, value, f"parameter {pname!r}", f"it is the same tensor as "
                       f"{owners[id(param)]!r}: a weight shared by two modules gets its "
                       "per-example gradient from one of them only",
                       f"untie {pname!r} from {owners[id(param)]!r}")
        owners[id(param)] = pname
    if not any(param.requires_grad for param in net.parameters()):
        raise _bad(field, value, _network(net), "every parameter is frozen "
                   "(requires_grad=False): DP training would release nothing",
                   "leave at least one parameter trainable")


def _is_container(module: nn.Module) -> bool:
    """A module without a forward of its own (``ModuleList``, ``ModuleDict``): the forward
    calls its children, never it."""
    return type(module).forward is nn.Module.forward


def _default_layers(net: nn.Module, sample: torch.Tensor, field: str, value: object,
                    skip: Sequence[str] = ()) -> dict[str, str]:
    """Each top-level child that owns parameters is a layer, in the order forward calls them;
    a container the forward loops over (MaxViT's ``blocks``, a ``ModuleList``) gives its
    children instead, as deep as containers nest. ``skip``: modules left out (heads that run in
    training only, see :func:`_training_only_heads`)."""
    modules = dict(net.named_modules())
    children = [n for n, m in net.named_children() if _owns_parameters(m) and n not in skip]
    if not children:
        raise _bad(field, value, _network(net), "it has no parameters",
                   "return a model with trainable submodules")
    trace = _trace(net, sample, children)
    looped = [n for n in children if trace.calls[n] == 0 and _is_container(modules[n])]
    while looped:
        children = [n for n in children if n not in looped] + [
            f"{n}.{c}" for n in looped for c, m in modules[n].named_children()
            if _owns_parameters(m) and f"{n}.{c}" not in skip]
        trace = _trace(net, sample, children)
        looped = [n for n in children if trace.calls[n] == 0 and _is_container(modules[n])]
    unused = [n for n in children if trace.calls[n] == 0]
    if unused:
        raise _bad(field, value, f"module {unused[0]!r}", "forward never calls it",
                   f"remove {unused[0]!r} or call it in forward")
    return {name: name for name in trace.order}


def _given_layers(net: nn.Module, layers: Sequence[str], sample: torch.Tensor,
                  field: str, value: object, skip: Sequence[str] = ()) -> dict[str, str]:
    modules = dict(net.named_modules())
    for path in layers:
        if path not in modules or path == "":
            raise UserInputError(field="model.layers", value=list(layers),
                                 allowed=f"module names of the model ({path!r} is not one): "
                                         f"{[n for n, _ in net.named_children()]} (dotted "
                                         "paths reach deeper)")
        head = next((h for h in skip if path == h or path.startswith(h + ".")), None)
        if head is not None:
            raise UserInputError(field="model.layers", value=list(layers),
                                 allowed=f"modules the evaluation forward calls ({path!r} is "
                                         f"in {head!r}, which runs in training only and is "
                                         "not trained: leave it out)")
    if len(set(layers)) != len(layers):
        raise UserInputError(field="model.layers", value=list(layers),
                             allowed="each module once")
    for pname, _ in net.named_parameters():
        owners = [p for p in layers if pname.startswith(p + ".")]
        if len(owners) > 1:
            raise UserInputError(field="model.layers", value=list(layers),
                                 allowed=f"layers that do not nest: parameter {pname!r} is in "
                                         f"each of {owners}")
    trace = _trace(net, sample, list(layers))
    unused = [p for p in layers if trace.calls[p] == 0]
    if unused:
        raise UserInputError(field="model.layers", value=list(layers),
                             allowed=f"modules the forward calls (module {unused[0]!r} never "
                                     "runs)")
    return {path: path for path in trace.order}


def _check_outputs(model: WrappedModel, sample: torch.Tensor, num_classes: int,
                   field: str, value: object) -> None:
    with torch.no_grad():
        model.eval()
        try:
            out, irs = model.forward_with_irs(sample)
        except TypeError as exc:
            raise _bad(field, value, _network(model.net), str(exc),
                       "make each layer return a tensor") from None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(sample), num_classes):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise _bad(field, value, _network(model.net), f"forward returned {shape}",
                       f"return logits of shape [batch, {num_classes}]")
        for name, ir in irs.items():
            if ir.shape[0] != len(sample):
                raise _bad(field, value, f"layer {name!r}", f"its output has {ir.shape[0]} "
                           f"rows for a batch of {len(sample)}",
                           "keep the batch as the first dimension")
        if sample.is_floating_point() and not _alone_agrees(model, sample, out) \
                and not _alone_agrees_in_float64(model, sample):
            raise _bad(field, value, _network(model.net), "an example's output changes when "
                       "another example joins its batch", "remove whatever mixes "
                       "examples across the batch dimension")
        model.train()


def _alone_agrees(model: WrappedModel, sample: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the first example's output alone is its output in the batch ``out``."""
    return torch.allclose(model(sample[:1])[0], out[0], rtol=_MIX_TOL, atol=_MIX_TOL)


def _alone_agrees_in_float64(model: WrappedModel, sample: torch.Tensor) -> bool:
    """The same on a float64 copy (eval mode, no gradient): a float32 difference float64 does
    not repeat is rounding that a module amplifies (a GroupNorm over a few values of a 1 x 1
    map), not examples mixing (``_agrees_in_float64``)."""
    if next(model.parameters()).dtype == torch.float64:
        return False
    try:
        twin = copy.deepcopy(model).to(dtype=torch.float64).eval()
        x = sample.to(torch.float64)
        return _alone_agrees(twin, x, twin(x))
    except Exception:  # the float32 verdict stands
        return False


def _check_runs(net: nn.Module, sample: torch.Tensor, num_classes: int, field: str,
                value: object) -> forward_probe.Calls:
    """The forward on one example in training and in evaluation mode, before anything else
    runs it: a failure is one line naming the module (and, when the input is too small for
    it, the smallest input that runs), and training must return logits too (a named output's
    ``logits``, as GoogLeNet's)."""
    one = sample[:1]
    try:
        calls = forward_probe.run_modes(net, one)
    except forward_probe.FailedForward as failed:
        raise _failed_forward(net, one, failed.failure, field, value) from None
    out = logits_of(calls.training_output)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise _bad(field, value, _network(net), f"in training mode forward returned {shape}",
                   f"return logits of shape [batch, {num_classes}] in training too (or a named "
                   "output whose 'logits' field they are)")
    return calls


def _failed_forward(net: nn.Module, one: torch.Tensor, failure: forward_probe.Failure,
                    field: str, value: object) -> UserInputError:
    shape = tuple(one.shape[1:])
    where = (f"module {failure.module!r} ({failure.kind})" if failure.module
             else _network(net))
    got = f" got a {failure.module_input[1:]} input and" if failure.module_input else ""
    mode = "training" if failure.training else "evaluation"
    search = forward_probe.smallest_input(net, one, training_first=failure.training)
    if search.smallest is not None:
        fix = (f"a larger input: the smallest input_shape it runs at is {search.smallest} "
               "(resize the data, or use a model made for this size)")
    elif search.largest_side:
        fix = (f"a model built for input_shape {shape} (no larger input tried, sides up to "
               f"{search.largest_side}, runs either)")
    else:
        fix = f"a forward that runs on one example of input_shape {shape}"
    return _bad(field, value, where, f"on one example of input_shape {shape} in {mode} "
                f"mode it{got} raised {failure.error}", fix)


def _training_only_heads(net: nn.Module, sample: torch.Tensor, calls: forward_probe.Calls,
                         field: str, value: object) -> list[str]:
    """Modules with parameters that run in training only (GoogLeNet's and Inception-v3's
    auxiliary heads), frozen here: training uses the main logits, which do not depend on them
    (checked: one backward), so they would get no gradient, only noise, and a share of a
    per-layer budget; and being absent from the evaluation forward, they cannot be the layers
    the audit reads. A head the training logits do depend on is refused: what is trained would
    not be what is evaluated."""
    modules = dict(net.named_modules())
    only = sorted(n for n in calls.training - calls.evaluation if _owns_parameters(modules[n]))
    heads = [n for n in only if not any(n.startswith(h + ".") for h in only if h)]
    owned = [(h, p) for h in heads for p in modules[h].parameters() if p.requires_grad]
    if owned:
        net.train()
        with forward_probe.own_random_streams(sample):
            out = logits_of(net(sample[:1]))
        grads = (torch.autograd.grad(out.sum(), [p for _, p in owned], allow_unused=True)
                 if isinstance(out, torch.Tensor) and out.requires_grad else [None] * len(owned))
        used = [h for (h, _), g in zip(owned, grads, strict=True) if g is not None]
        if used:
            head = used[0]
            raise _bad(field, value, f"module {head!r}", "it runs in training only, yet the "
                       "training logits depend on it, so the model trained is not the one "
                       "evaluated and audited", f"call {head!r} in evaluation too, or keep it "
                       "out of the logits")
    for head in heads:
        modules[head].requires_grad_(False)
    return heads


def _check_requires_grad(net: nn.Module, sample: torch.Tensor, field: str, value: object,
                         before: dict[str, bool]) -> None:
    """Refuse a forward that sets a parameter's ``requires_grad`` (``before``: as built, before
    any forward): the layers, the frozen parameters and the clipping bounds are fixed from the
    model as built, so a parameter unfrozen in forward would be trained outside them (the norm
    check that would otherwise catch it can only say that something mixes examples)."""
    net.train()
    net(sample)  # with gradients on, as a training step runs it
    changed = [name for name, param in net.named_parameters()
               if before.get(name, param.requires_grad) != param.requires_grad]
    if changed:
        name, was = changed[0], before[changed[0]]
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise _bad(field, value, f"parameter {name!r}{more}", f"the forward changes its "
                   f"requires_grad ({was} -> {not was}), so what a step trains is not the model "
                   "checked here: a frozen parameter is left out of its layer's clipping bound",
                   "set requires_grad once, where the factory builds the model, not in forward")


def _check_buffers(net: nn.Module, sample: torch.Tensor, field: str, value: object) -> None:
    before = {n: b.detach().clone() for n, b in net.named_buffers()}
    net.train()
    with torch.no_grad():
        net(sample)
    for name, buf in net.named_buffers():
        if name in before and not torch.equal(before[name], buf):
            raise _bad(field, value, f"buffer {name!r}", "a buffer the forward pass updates "
                       "carries statistics of training examples outside the noised gradient",
                       f"stop updating {name!r} in forward (or make it a parameter)")


def wrap_checked(net: object, *, layers: Sequence[str], sample: torch.Tensor,
                 num_classes: int, field: str = "model.factory",
                 reference: str = "") -> WrappedModel:
    """``net`` checked (see the module docstring) and wrapped; the first problem is raised,
    as ``field = reference`` (the factory that built ``net``; without one, its class name)
    with the module and the cause in the explanation."""
    value = reference or type(net).__name__
    if not isinstance(net, nn.Module):
        raise UserInputError(field=field, value=value,
                             allowed=f"a factory that returns a torch.nn.Module (it returned "
                                     f"{type(net).__name__})")
    _check_modules(net, field, value)
    built = {name: param.requires_grad for name, param in net.named_parameters()}
    calls = _check_runs(net, sample, num_classes, field, value)
    _check_requires_grad(net, sample, field, value, built)
    heads = _training_only_heads(net, sample, calls, field, value)
    paths = (_given_layers(net, layers, sample, field, value, heads) if layers
             else _default_layers(net, sample, field, value, heads))
    model = WrappedModel(net, layers=paths, num_classes=num_classes)
    model.training_only = heads
    _check_buffers(net, sample, field, value)
    model.ir_batch_dims = _ir_batch_dims(model, sample, field, value)
    _check_outputs(model, sample, num_classes, field, value)
    model.per_example_path = _check_one_step(model, sample, num_classes, field, value)
    return model


def _ir_batch_dims(model: WrappedModel, sample: torch.Tensor, field: str,
                   value: object) -> dict[str, int]:
    """Where each layer's output keeps the batch (an ``nn.LSTM(batch_first=False)`` returns
    [T, B, H]): the audit reads every layer's output with the batch first."""
    modules = {i: model.blocks[name] for i, name in enumerate(model.layer_names)}
    names = {i: f"layer {name!r}" for i, name in enumerate(model.layer_names)}
    try:
        calls = probe_calls(model.net, sample, modules, names)
    except NotPerExample as exc:
        raise _bad(field, value, _network(model.net), str(exc),
                   "keep every layer's output per example") from None
    out: dict[str, int] = {}
    for i, name in enumerate(model.layer_names):
        dims = [d for d in calls[i][-1].outputs if d is not None] if calls[i] else []
        if not dims:
            raise _bad(field, value, f"layer {name!r}", "its output has no batch dimension",
                       "return a tensor with one row per example")
        out[name] = dims[0]
    return out


def _check_one_step(model: WrappedModel, sample: torch.Tensor, num_classes: int,
                    field: str, value: object) -> str:
    """Which per-example path the model takes (the engine's; the exact path over the whole
    model when the engine cannot follow a module's batch), after one step on ``sample`` whose
    per-example norms match a one-example-at-a-time autograd reference."""
    y = torch.arange(len(sample)) % num_classes
    model.eval()  # no dropout: the engine and the reference below must see one function
    try:
        return _one_step(model, sample, y, field, value)
    finally:
        model.train()


def _one_step(model: WrappedModel, sample: torch.Tensor, y: torch.Tensor, field: str,
              value: object) -> str:
    try:
        engine = GradEngine(model)
        view = engine.compute(sample, y, live=[True] * engine.num_layers)
        path = engine.path
    except NotPerExample as exc:
        try:
            model.per_example_path = WHOLE_EXACT_PATH
            engine = GradEngine(model)
            view = engine.compute(sample, y, live=[True] * engine.num_layers)
            path = WHOLE_EXACT_PATH
        except Exception as whole:
            raise _bad(field, value, _network(model.net), f"no per-example gradient: {exc}; "
                       f"over the whole model: {type(whole).__name__}: {whole}",
                       "keep each example's computation separate from the others'") from None
    except UserInputError:
        raise
    except Exception as exc:
        raise _bad(field, value, _network(model.net), f"per-example gradients failed: "
                   f"{type(exc).__name__}: {exc}", "a model whose per-example gradients the "
                   "engine or torch.func can form (docs/user-models.md, Per-example "
                   "gradients)") from None
    view.weighted_sum(torch.ones_like(view.norms, dtype=torch.float32))
    if not torch.isfinite(view.norms).all():
        raise _bad(field, value, _network(model.net), "per-example gradient norms are not finite "
                   "at initialisation", "check the model's initialisation")
    reference = _loop_norms(engine, sample, y)
    if not bool(_outside(view.norms, reference).any()) or _agrees_in_float64(model, sample, y):
        return path
    bad = int(((view.norms - reference).abs() / reference.clamp_min(1e-30)).amax(0).argmax())
    layer = f"layer {engine.layer_names[bad]!r}"
    found = explain(engine, view, sample, y, tol=_NORM_CHECK_TOL)
    differ = "its per-example gradient norms differ from one-example-at-a-time autograd"
    if found is None:  # every gradient agrees: the norms' own arithmetic is off
        raise _bad(field, value, layer, f"{differ}, though each parameter's per-example "
                   "gradient agrees with autograd's", "report the model (docs/user-models.md, "
                   "Per-example gradients)")
    name = model.parameter_label(found.parameter)
    if found.mixes:
        raise _bad(field, value, layer, f"{differ}: something in it mixes examples (parameter "
                   f"{name!r}: an example's gradient in the batch is not its gradient alone)",
                   "keep each example's computation separate")
    owner = name.rpartition(".")[0]
    where = f"module {owner!r}" if owner else "the network itself"
    raise _bad(field, value, f"parameter {name!r} of {where} ({found.kind})", "the engine's "
               f"per-example gradient of it is {found.error:.0%} off autograd's, "
               "though no example's gradient depends on another's: the engine does not "
               "follow how the forward uses it", "use the parameter only inside the forward "
               "of the module that owns it, or report the construct (docs/user-models.md, "
               "Per-example gradients)")


def _outside(norms: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[B, L] where the engine's norms leave the band around the reference: they are certified
    upper bounds, up to LOOSE above the exact ones."""
    low = norms < reference * (1 - _NORM_CHECK_TOL) - 1e-12
    high = norms > reference * (LOOSE + _NORM_CHECK_TOL) + 1e-12
    return low | high


def _agrees_in_float64(model: WrappedModel, sample: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the norm check passes on a float64 copy of ``model``. A float32 failure that
    float64 does not repeat is rounding, not a wrong per-example gradient (a GroupNorm over a
    few values of a 1 x 1 map divides float32 rounding by sqrt(eps) and passes it on as its
    whole output: ShuffleNetV2 failed float32 at some initialisations); refusing it would
    name a construct that is not there. The guard behind every step bounds what the engine's
    own norms and sums release either way."""
    if next(model.parameters()).dtype == torch.float64:
        return False
    try:
        twin = copy.deepcopy(model).to(dtype=torch.float64)
        x = sample.to(torch.float64) if sample.is_floating_point() else sample
        engine = GradEngine(twin)
        view = engine.compute(x, y, live=[True] * engine.num_layers)
        reference = _loop_norms(engine, x, y)
    except Exception:  # the float32 verdict stands
        return False
    return bool(torch.isfinite(view.norms).all()) and not bool(_outside(view.norms,
                                                                         reference).any())


def _loop_norms(engine: GradEngine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, L] per-layer gradient norms by autograd on one example at a time (the reference)."""
    params = dict(engine.model.named_parameters())
    rows = []
    for i in range(x.shape[0]):
        loss = torch.nn.functional.cross_entropy(engine.model(x[i:i + 1]), y[i:i + 1])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        sq = torch.zeros(engine.num_layers, dtype=torch.float64, device=x.device)
        for name, g in zip(params, grads, strict=True):
            if g is not None:
                sq[engine.layer_of[name]] += g.double().square().sum()
        rows.append(sq.sqrt())
    return torch.stack(rows)


def sample_batch(*, input_shape: Sequence[int], tokens: bool, rows: int = 2) -> torch.Tensor:
    """A small deterministic batch shaped like the data (zeros for token ids)."""
    shape = (rows, *input_shape)
    if tokens:
        return torch.zeros(shape, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen)
