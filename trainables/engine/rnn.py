"""Per-example gradients of ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` as Linear algebra.

Inside a recurrent layer every weight enters through a matrix product: the input projection
``x_t W_ih^T + b_ih`` for all steps at once, and the recurrent one ``h_{t-1} W_hh^T + b_hh``
step by step. So example i's gradient of W_ih is sum_t dz_it^T x_it, a Linear weight gradient
over T positions, with dz the gradient of the gate pre-activations; W_hh's is the same with
h_{t-1} for x_t (a GRU's candidate gate multiplies its recurrent term by the reset gate r, so
that part's output gradient is dz * r). The engine's Linear rules (ghost norm or materialised,
chosen by cost) then apply unchanged.

To reach dz, the engine runs the layer through :func:`RecurrentUnit.forward`, a step-by-step
re-statement of PyTorch's recurrence (same gates, same order, same initial state, inter-layer
dropout) whose input projections carry the engine's gradient hooks, instead of the fused
kernel; everywhere else (evaluation, the audit, an export) the module runs as it is. Opacus
replaces the module by its own ``DPLSTM`` to the same end; here the user's module stays.
Refused by name: a ``PackedSequence`` input and ``proj_size > 0`` (no rule yet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.func import NotPerExample
from dpsweep.trainables.engine.modules import LinearHandler

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")

#: Gates per recurrent cell type (rows of W_ih / W_hh are gates x hidden size).
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}

#: tap(part, a, z, transform): registers z's output-gradient hook for ``part`` with kept input
#: ``a`` ([B, T, d]); ``transform`` maps the gradient before the part's rule sees it.
Tap = Callable[..., "torch.Tensor"]


class LinearPart(LinearHandler):
    """One weight (and its bias) of a recurrent layer, handled as a Linear on [B, T, d]."""

    kind = "Linear"

    def __init__(self, module: nn.Module, *, qualname: str, layer: int, weight: str,
                 bias: str | None, trainable: set[str]) -> None:
        self.module = module
        self.qualname = qualname
        self.layer = layer
        self.weight_name = f"{qualname}.{weight}" if f"{qualname}.{weight}" in trainable \
            else None
        full_bias = f"{qualname}.{bias}" if bias else None
        self.bias_name = full_bias if full_bias in trainable else None


class RecurrentUnit:
    """The engine's unit for one recurrent module: its parts and its re-stated forward."""

    per_channel: ClassVar[bool] = False
    batch_anywhere: ClassVar[bool] = False

    def __init__(self, module: nn.Module, *, qualname: str, layer: int,
                 trainable: set[str]) -> None:
        if getattr(module, "proj_size", 0):
            raise NotPerExample(f"{qualname} (LSTM with proj_size > 0) has no per-example rule; "
                                "build it with proj_size=0")
        self.module = module
        self.qualname = qualname
        self.layer = layer
        self.kind = type(module).__name__
        self.gates = GATES[module.mode]
        self.parts: dict[tuple[int, int], tuple[LinearPart, LinearPart]] = {}
        for k in range(module.num_layers):
            for d in range(2 if module.bidirectional else 1):
                sfx = f"l{k}" + ("_reverse" if d else "")
                bias = module.bias
                self.parts[k, d] = tuple(  # type: ignore[assignment]
                    LinearPart(module, qualname=qualname, layer=layer, weight=f"weight_{w}_{sfx}",
                               bias=f"bias_{w}_{sfx}" if bias else None, trainable=trainable)
                    for w in ("ih", "hh"))

    def weights(self, k: int, d: int) -> tuple[torch.Tensor, ...]:
        m, sfx = self.module, f"l{k}" + ("_reverse" if d else "")
        w_ih, w_hh = getattr(m, f"weight_ih_{sfx}"), getattr(m, f"weight_hh_{sfx}")
        b_ih = getattr(m, f"bias_ih_{sfx}") if m.bias else None
        b_hh = getattr(m, f"bias_hh_{sfx}") if m.bias else None
        return w_ih.detach(), w_hh.detach(), b_ih, b_hh

    def forward(self, tap: Tap, input: Any, hx: Any = None) -> Any:
        """The module's forward, step by step, with the engine's hooks on the projections."""
        m = self.module
        if not isinstance(input, torch.Tensor):
            raise NotPerExample(f"{self.qualname} ({self.kind}) was given a "
                                f"{type(input).__name__}; pass a padded tensor")
        if input.dim() != 3:
            raise NotPerExample(f"{self.qualname} ({self.kind}) was given an unbatched input")
        x = input if m.batch_first else input.transpose(0, 1)  # [B, T, I]
        n, dirs, hidden = x.shape[0], 2 if m.bidirectional else 1, m.hidden_size
        lstm = self.kind == "LSTM"
        if hx is None:
            zeros = x.new_zeros(m.num_layers * dirs, n, hidden)
            h0, c0 = zeros, zeros if lstm else None
        else:
            h0, c0 = hx if lstm else (hx, None)
        finals_h, finals_c = [], []
        for k in range(m.num_layers):
            outs = []
            for d in range(dirs):
                i = k * dirs + d
                out, h, c = self._direction(tap, x, k, d, h0[i], None if c0 is None else c0[i])
                outs.append(out)
                finals_h.append(h)
                finals_c.append(c)
            x = torch.cat(outs, dim=2) if dirs > 1 else outs[0]
            if m.dropout and m.training and k < m.num_layers - 1:
                x = torch.nn.functional.dropout(x, p=m.dropout, training=True)
        output = x if m.batch_first else x.transpose(0, 1)
        h_n = torch.stack(finals_h)
        return (output, (h_n, torch.stack(finals_c))) if lstm else (output, h_n)

    def _direction(self, tap: Tap, x: torch.Tensor, k: int, d: int, h: torch.Tensor,
                   c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One layer and direction over all steps: ([B, T, H] outputs, last h, last c)."""
        w_ih, w_hh, b_ih, b_hh = self.weights(k, d)
        part_ih, part_hh = self.parts[k, d]
        steps = x.shape[1]
        order = range(steps - 1, -1, -1) if d else range(steps)
        prev: list[torch.Tensor | None] = [None] * steps
        resets: list[torch.Tensor | None] = [None] * steps
        mode = self.module.mode

        def recurrent_grad(b: torch.Tensor) -> torch.Tensor:
            if mode != "GRU":
                return b
            hidden = b.shape[-1] // 3
            r = torch.stack(resets, dim=1)  # type: ignore[arg-type]
            return torch.cat([b[..., :2 * hidden], b[..., 2 * hidden:] * r], dim=-1)

        xp = tap([(part_ih, x.detach(), None),
                  (part_hh, lambda: torch.stack(prev, dim=1), recurrent_grad)],
                 torch.nn.functional.linear(x, w_ih, _detached(b_ih)))
        outs: list[torch.Tensor | None] = [None] * steps
        for t in order:
            prev[t] = h.detach()
            hp = torch.nn.functional.linear(h, w_hh, _detached(b_hh))
            h, c, r = _cell(mode, xp[:, t], hp, h, c)
            resets[t] = r
            outs[t] = h
        return torch.stack(outs, dim=1), h, c  # type: ignore[arg-type]


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _cell(mode: str, xp: torch.Tensor, hp: torch.Tensor, h: torch.Tensor,
          c: torch.Tensor | None) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """One step of PyTorch's cell: (h', c', the GRU's reset gate for its W_hh gradient)."""
    if mode == "LSTM":
        i, f, g, o = (xp + hp).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c, None
    if mode == "GRU":
        xr, xz, xn = xp.chunk(3, dim=1)
        hr, hz, hn = hp.chunk(3, dim=1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        cand = torch.tanh(xn + r * hn)
        return (1 - z) * cand + z * h, None, r.detach()
    act = torch.tanh if mode == "RNN_TANH" else torch.relu
    return act(xp + hp), None, None


def recurrent_types() -> tuple[type, ...]:
    return (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN)
