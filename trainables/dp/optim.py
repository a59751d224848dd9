"""The parameter update: torch's own functional SGD and Adam, without ``torch.optim.Optimizer``.

Why not the ``Optimizer`` classes: their ``step`` (and ``zero_grad``, ``state_dict``, the
constructor) import ``torch._dynamo`` on first use, 2-4 s on this 2-core machine in every fresh
process: each Ray worker's first trial, each after-search task, the driver's LM-DP-SGD risk
estimate. The functional forms (``torch.optim.sgd.sgd``, ``torch.optim.adam.adam``) are the very
arithmetic the classes call, with the same defaults (no foreach on CPU, foreach on CUDA), so the
updates are bit-identical (``tests/unit/trainables/test_optim.py`` checks against the classes) and
nothing of
the arithmetic is written here.

As with the classes, a parameter whose ``grad`` is None is skipped: its value and its state stay
untouched (frozen layers, layers without a released gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:  # on first use: the budget CLI imports this module (through the methods) and no torch
    torch = lazy_module("torch")

KINDS = ("sgd", "adam")
#: torch.optim.Adam's defaults, which every Adam in dpsweep uses.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
#: Per-parameter state entries, by kind (what ``state_dict`` holds and ``load_state_dict`` needs).
_STATE_KEYS = {"sgd": ("momentum_buffer",), "adam": ("step", "exp_avg", "exp_avg_sq")}


class Update:
    """SGD (with optional heavy-ball momentum) or Adam over named parameters."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], *, kind: str,
                 lr: float, momentum: float = 0.0) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "adam" and momentum:
            raise ValueError("Adam takes no momentum (its betas are fixed)")
        self.kind = kind
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.params = dict(named_parameters)
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def step(self) -> None:
        names = [n for n, p in self.params.items() if p.grad is not None]
        if not names:
            return
        params = [self.params[n] for n in names]
        grads = [p.grad for p in params]
        with torch.no_grad():  # not a decorator: that would import torch with this module
            if self.kind == "sgd":
                self._sgd(names, params, grads)
            else:
                self._adam(names, params, grads)

    def _sgd(self, names: list[str], params: list[torch.Tensor],
             grads: list[torch.Tensor]) -> None:
        buffers = [self.state.get(n, {}).get("momentum_buffer") for n in names]
        sgd, _ = _functional()
        sgd(params, grads, buffers, weight_decay=0.0, momentum=self.momentum, lr=self.lr,
            dampening=0.0, nesterov=False, maximize=False)
        if self.momentum:
            for n, buf in zip(names, buffers, strict=True):
                self.state[n] = {"momentum_buffer": buf}

    def _adam(self, names: list[str], params: list[torch.Tensor],
              grads: list[torch.Tensor]) -> None:
        for n, p in zip(names, params, strict=True):
            if n not in self.state:  # as torch.optim.Adam's first step creates it
                self.state[n] = {
                    "step": torch.tensor(0.0, dtype=_scalar_dtype()),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        st = [self.state[n] for n in names]
        _, adam = _functional()
        adam(params, grads, [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
             [s["step"] for s in st], has_complex=any(torch.is_complex(p) for p in params),
             amsgrad=False, beta1=ADAM_BETAS[0], beta2=ADAM_BETAS[1], lr=self.lr,
             weight_decay=0.0, eps=ADAM_EPS, maximize=False)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum,
                "state": {n: dict(s) for n, s in self.state.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint's update state, refused whole unless it fits these parameters
        (validated before anything is changed)."""
        def bad(why: str) -> UserInputError:
            return UserInputError(field="checkpoint.optimizer", value=why,
                                  allowed=f"the {self.kind} state of this model's parameters")

        if not isinstance(state, Mapping) or set(state) != {"kind", "lr", "momentum", "state"}:
            raise bad("expected the keys kind, lr, momentum and state")
        if (state["kind"], state["lr"], state["momentum"]) != (self.kind, self.lr,
                                                                 self.momentum):
            raise bad(f"it is {state['kind']} at lr {state['lr']} and momentum "
                      f"{state['momentum']}, this run {self.kind} at lr {self.lr} and "
                      f"momentum {self.momentum}")
        entries = state["state"]
        if not isinstance(entries, Mapping):
            raise bad("state is not a mapping")
        restored: dict[str, dict[str, torch.Tensor]] = {}
        for name, entry in entries.items():
            p = self.params.get(name)
            if p is None:
                raise bad(f"no parameter named {name!r}")
            keys = _STATE_KEYS[self.kind]
            if not isinstance(entry, Mapping) or tuple(sorted(entry)) != tuple(sorted(keys)):
                raise bad(f"{name!r} must hold {', '.join(keys)}")
            for key in keys:
                value = entry[key]
                shape = () if key == "step" else tuple(p.shape)
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape \
                        or not bool(torch.isfinite(value).all()):
                    raise bad(f"{name!r}.{key} must be a finite tensor of shape {shape}")
            restored[name] = {k: (v.clone() if k == "step" else v.to(p.device, p.dtype).clone())
                              for k, v in entry.items()}
        self.state = restored


def _scalar_dtype() -> torch.dtype:
    """Adam's step counter dtype, as torch.optim.Adam picks it (not fused, not capturable)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _functional() -> tuple[Callable[..., None], Callable[..., None]]:
    """torch's functional ``sgd`` and ``adam``. Imported on first use, not with this module:
    ``dpsweep budget`` imports it (through the methods) without torch, and ``torch.optim``
    removes its submodules' names, so the lazily bound ``torch`` cannot reach them."""
    from torch.optim import adam, sgd

    return sgd.sgd, adam.adam
