"""``[model] fix = true``: what DP training cannot use, replaced in the user's network.

In the spirit of Opacus's ``ModuleValidator.fix``, and applied by
:func:`trainables.models.assemble.build_network`, the one place a network is made (the config
check, every trial, the audit's references, an export's rebuild), so every copy of a fixed
network has the same modules, shapes and ``state_dict`` keys:

* every BatchNorm (any ``_BatchNorm``: 1d, 2d, 3d, ``SyncBatchNorm``, subclasses) becomes a
  ``GroupNorm`` over the same channels, with the same ``eps`` and ``affine``. It normalises each
  example with its own statistics, so an example's gradient no longer depends on the rest of
  its batch, and there are no running statistics to release. Group count: ``gcd(32, C)`` (the
  Group Normalization paper's 32, as Opacus; the gcd always divides ``C``) for 2-D and 3-D
  inputs. A ``BatchNorm1d`` gets one group: its input is often ``[batch, C]``, where
  ``gcd(32, C)`` groups of one feature each would normalise every feature to zero; one group
  normalises an example over all its features, as LayerNorm does;
* every InstanceNorm with ``track_running_stats`` is rebuilt without running statistics (the
  per-example normalisation it does in training is kept).

The affine weight and bias are copied (BatchNorm's and GroupNorm's are both one scale and one
shift per channel), with their ``requires_grad``, dtype and device; the running statistics are
dropped. Each replacement is returned as a :class:`Replacement` (with the ``torch.nn`` class
and arguments that rebuild it), which the trial's privacy record lists
(``method_record.model_fixes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from dpsweep.core.errors import UserInputError

#: Groups of the GroupNorm that replaces a BatchNorm over 2-D or 3-D inputs (at most).
GROUPS = 32

_BATCH_NORM = nn.modules.batchnorm._BatchNorm
_INSTANCE_NORM = nn.modules.instancenorm._InstanceNorm
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@dataclass(frozen=True)
class Replacement:
    """One module replaced: where, what it was and what it is now, and how to build the new
    one (``getattr(torch.nn, kind)(**kwargs)``), so a loader without dpsweep can rebuild the
    trained network from the record alone."""

    module: str  # dotted path in the network ("" is the network itself)
    was: str  # e.g. "BatchNorm2d(64)"
    now: str  # e.g. "GroupNorm(32 groups, 64 channels)"
    kind: str  # a torch.nn class name: "GroupNorm", "InstanceNorm2d", ...
    kwargs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "was": self.was, "now": self.now, "kind": self.kind,
                "kwargs": dict(self.kwargs)}


def needs_fix(module: nn.Module) -> bool:
    """True for a module :func:`fix_model` replaces."""
    return isinstance(module, _BATCH_NORM) or (
        isinstance(module, _INSTANCE_NORM) and bool(module.track_running_stats))


def group_count(norm: nn.Module) -> int:
    """Groups of the GroupNorm replacing BatchNorm ``norm`` (see the module docstring)."""
    channels = int(norm.num_features)
    if isinstance(norm, nn.BatchNorm1d):
        return 1
    return math.gcd(GROUPS, channels)


def fix_model(net: nn.Module) -> tuple[nn.Module, list[Replacement]]:
    """``net`` with every module :func:`needs_fix` names replaced in place, and one
    replacement per module path in ``named_modules`` order; ``net`` itself is returned unless
    it is such a module. A module registered under several paths is replaced by one module,
    shared likewise."""
    made: dict[int, nn.Module] = {}
    done: list[Replacement] = []
    for name, module in list(net.named_modules(remove_duplicate=False)):
        if not needs_fix(module):
            continue
        kind, kwargs = _constructor(name, module)
        if id(module) not in made:
            made[id(module)] = _built(module, kind, kwargs)
        new = made[id(module)]
        done.append(Replacement(module=name, was=_describe(module), now=_describe(new),
                                kind=kind, kwargs=kwargs))
        if not name:
            return new, done
        parent_name, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent_name), child, new)
    return net, done


def _constructor(name: str, module: nn.Module) -> tuple[str, dict[str, Any]]:
    """The ``torch.nn`` class and keyword arguments of ``module``'s replacement."""
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise UserInputError(field="model.fix", value=True,
                             allowed=f"a network whose norms know their channels: "
                                     f"{type(module).__name__} {name!r} has none until its "
                                     "first forward (give it num_features)")
    channels = int(module.num_features)
    if isinstance(module, _BATCH_NORM):
        return "GroupNorm", {"num_groups": group_count(module), "num_channels": channels,
                             "eps": float(module.eps), "affine": bool(module.affine)}
    cls = next((c for c in type(module).__mro__ if c in _INSTANCE_NORMS), type(module))
    return cls.__name__, {"num_features": channels, "eps": float(module.eps),
                          "momentum": module.momentum, "affine": bool(module.affine),
                          "track_running_stats": False}


def _built(module: nn.Module, kind: str, kwargs: dict[str, Any]) -> nn.Module:
    cls = getattr(nn, kind, None) or type(module)
    new: nn.Module = cls(**kwargs)
    like = next(iter(module.parameters()), None)
    if like is None:
        like = next(iter(module.buffers()), None)
    if like is not None and like.is_floating_point():
        new.to(like.device, like.dtype)
    elif like is not None:
        new.to(like.device)
    if module.affine:
        new.weight.data.copy_(module.weight.detach())
        new.bias.data.copy_(module.bias.detach())
        new.weight.requires_grad_(module.weight.requires_grad)
        new.bias.requires_grad_(module.bias.requires_grad)
    return new.train(module.training)


def _describe(module: nn.Module) -> str:
    if isinstance(module, nn.GroupNorm):
        return f"GroupNorm({module.num_groups} groups, {module.num_channels} channels)"
    stats = (", track_running_stats=True" if isinstance(module, _INSTANCE_NORM)
             and module.track_running_stats else "")
    return f"{type(module).__name__}({module.num_features}{stats})"
