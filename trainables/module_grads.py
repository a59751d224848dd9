"""Per-module per-example gradient algebra for :mod:`trainables.engine`.

One handler per parameterised module type (Linear, Conv2d, GroupNorm, LayerNorm) turns a
module's kept input ``a`` and output gradient ``b`` into per-example squared norms (ghost or
materialised, chosen by :func:`choose`) and coefficient-weighted sums; any other module makes
its block fall back to ``torch.func`` (:class:`BlockFallback`). The costs and the reasons for
each choice are in the engine's docstring; this module holds the algebra so the engine file
holds the passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from core.lazy import lazy_module
from trainables.norms import row_scale, scaled_sq_norms

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")

#: Per-example gradients are kept for the weighted sum while fan-in d <= KEEP_RATIO * T, i.e.
#: while they take at most twice the memory of the output gradient the other paths keep.
KEEP_RATIO = 2
#: Cost of materialising a_i^T b_i for every example, in native weight-gradient kernels.
MATERIALIZE_COST = 2.0
#: Elements of transient per-example tensors (unfolded inputs, dropped gradients) per slice:
#: bounds the working memory of one module's norm (16 MiB in float32).
TRANSIENT_ELEMENTS = 1 << 22


def combine(coef: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """sum_i coef[i] * grads[i], as one matrix-vector product."""
    flat = grads.reshape(grads.shape[0], -1)
    return (coef.to(device=flat.device, dtype=flat.dtype) @ flat).view(grads.shape[1:])


@dataclass(frozen=True)
class Geometry:
    """Per-example sizes of one weight gradient a^T b: T positions, fan-in d, fan-out p."""

    positions: int
    fan_in: int  # per group
    fan_out: int  # per group
    groups: int = 1
    #: Conv2d: kernel taps K (fan_in = channels per group * K) and padded input positions.
    taps: int = 1
    padded_positions: int = 0

    @property
    def shifted_gram(self) -> bool:
        """Whether the input Gram is cheaper from shifted channel Grams than from patches."""
        return 0 < self.padded_positions ** 2 < self.taps * self.positions ** 2

    def input_gram_cost(self) -> int:
        """Multiply-adds per example and group of the input Gram a_i a_i^T (T x T)."""
        t = self.positions
        if self.shifted_gram:
            return self.fan_in // self.taps * self.padded_positions ** 2 + self.taps * t * t
        return self.fan_in * t * t


def choose(geometry: Geometry, *, strategy: str) -> tuple[str, bool]:
    """(norm algorithm, keep per-example gradients) for one module; see the module docstring."""
    t, d, p, g = geometry.positions, geometry.fan_in, geometry.fan_out, geometry.groups
    keep = d <= KEEP_RATIO * t
    if strategy == "ghost":
        return "ghost", False
    if strategy == "materialize":
        return "materialize", keep
    wgrad = g * t * p * d
    ghost = g * (geometry.input_gram_cost() + t * t * p) + wgrad
    materialize = MATERIALIZE_COST * wgrad + (g * p * d if keep else wgrad)
    return ("ghost", False) if ghost < materialize else ("materialize", keep)


def _slices(n: int, per_example: int) -> Iterator[slice]:
    """Batch slices whose transient tensors stay within ``TRANSIENT_ELEMENTS``."""
    step = max(1, TRANSIENT_ELEMENTS // max(1, per_example))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def scale_rows(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return b * c.to(dtype=b.dtype, device=b.device).view(-1, *([1] * (b.dim() - 1)))


class Handler:
    """Per-example gradient algebra of one module with parameters (one call = inputs a, b)."""

    per_channel: ClassVar[bool] = False
    kind: ClassVar[str] = ""

    def __init__(self, module: nn.Module, *, qualname: str, layer: int) -> None:
        self.module = module
        self.qualname = qualname
        self.layer = layer
        self.weight_name = f"{qualname}.weight" if module.weight is not None else None
        bias = getattr(module, "bias", None)
        self.bias_name = f"{qualname}.bias" if bias is not None else None

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        """The input as the weight-gradient kernels need it (kept until the sums are formed)."""
        return a.detach()

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        raise NotImplementedError

    def per_example(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        if self.weight_name is not None:
            out[self.weight_name] = self.weight_per_example(a, b)
        if self.bias_name is not None:
            out[self.bias_name] = self.bias_per_example(b)
        return out

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def bias_per_example(self, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        """sum_i a_i^T bc_i with the native kernel (bc: output gradients already scaled)."""
        raise NotImplementedError

    def transient(self, geometry: Geometry, *, ghost: bool) -> int:
        """Elements per example of the temporaries of one norm computation."""
        t, d, p, g = geometry.positions, geometry.fan_in, geometry.fan_out, geometry.groups
        return g * (d * t + 2 * t * t) if ghost else g * p * d

    def weight_sq(self, a: torch.Tensor, b: torch.Tensor, *, geometry: Geometry,
                  ghost: bool) -> torch.Tensor:
        """[B] squared norms of the weight's per-example gradients, slice by slice."""
        parts = []
        for s in _slices(a.shape[0], self.transient(geometry, ghost=ghost)):
            if ghost:
                parts.append(self.weight_ghost_sq(a[s], b[s]))
            else:
                parts.append(scaled_sq_norms(self.weight_per_example(a[s], b[s])))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def weighted(self, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor) -> dict[str, torch.Tensor]:
        """sum_i c_i g_i(p) for this call's parameters, without per-example gradients."""
        out = {}
        if self.weight_name is not None:
            out[self.weight_name] = self.weight_sum(a, scale_rows(b, c))
        if self.bias_name is not None:
            out[self.bias_name] = combine(c, self.bias_per_example(b))
        return out


class LinearHandler(Handler):
    """``nn.Linear`` on [B, d] or [B, *, d]: positions are the middle dimensions."""

    kind = "Linear"

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1, t.shape[-1])

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        return Geometry(positions=self._flat(b).shape[1], fan_in=a.shape[-1],
                        fan_out=b.shape[-1])

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a3, b3 = self._flat(a), self._flat(b)
        if a3.shape[1] == 1:
            return b3[:, 0, :, None] * a3[:, 0, None, :]
        return torch.bmm(b3.transpose(1, 2), a3)

    def bias_per_example(self, b: torch.Tensor) -> torch.Tensor:
        return self._flat(b).sum(1)

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a3, b3 = self._flat(a), self._flat(b)
        if a3.shape[1] == 1:
            return scaled_sq_norms(a3[:, 0]) * scaled_sq_norms(b3[:, 0])
        (ua, sa), (ub, sb) = row_scale(a3), row_scale(b3)
        unit = (torch.bmm(ua, ua.transpose(1, 2)) * torch.bmm(ub, ub.transpose(1, 2))).sum((1, 2))
        return unit.double() * (sa * sb).square()

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        return bc.reshape(-1, bc.shape[-1]).t() @ a.reshape(-1, a.shape[-1])


class Conv2dHandler(Handler):
    """``nn.Conv2d`` (any stride, padding, padding mode, dilation, groups; bias optional)."""

    kind = "Conv2d"

    def __init__(self, module: nn.Module, *, qualname: str, layer: int) -> None:
        super().__init__(module, qualname=qualname, layer=layer)
        m = module
        # non-zero padding modes and string paddings: pad the kept input once, then pad 0
        self._explicit_pad = m.padding_mode != "zeros" or isinstance(m.padding, str)
        self.padding = (0, 0) if self._explicit_pad else tuple(m.padding)

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        a = a.detach()
        if not self._explicit_pad:
            return a
        m = self.module
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        return torch.nn.functional.pad(a, m._reversed_padding_repeated_twice, mode=mode)

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        m = self.module
        kh, kw = m.kernel_size
        del b  # the output shape follows from the input's
        ph, pw = self.padding
        out = self._output_shape(a)
        return Geometry(positions=out[2] * out[3],
                        fan_in=m.in_channels // m.groups * kh * kw,
                        fan_out=m.out_channels // m.groups, groups=m.groups, taps=kh * kw,
                        padded_positions=(a.shape[2] + 2 * ph) * (a.shape[3] + 2 * pw))

    def transient(self, geometry: Geometry, *, ghost: bool) -> int:
        if not ghost:
            return super().transient(geometry, ghost=ghost)
        t, g = geometry.positions, geometry.groups
        if geometry.shifted_gram:
            return g * (geometry.padded_positions ** 2 + (geometry.taps + 2) * t * t)
        return g * (geometry.fan_in * t + 2 * t * t)

    def _input_gram(self, a: torch.Tensor, *, shifted: bool | None = None) -> torch.Tensor:
        """[n, g, T, T] Gram of each example's input patches.

        Patch t is the input around output position t, so <patch_t, patch_s> is the sum over
        kernel taps k of <a[:, pos_t + k], a[:, pos_s + k]>: the Gram P of the padded input's
        positions (C (H W)^2 work) gathered at K shifted index sets, instead of unfolding the
        K-times larger patches (C K T^2 work); used when cheaper (stride-1 convolutions).
        """
        m = self.module
        n, g = a.shape[0], m.groups
        if shifted is None:
            shifted = self.geometry(a, a).shifted_gram
        if not shifted:
            u = torch.nn.functional.unfold(a, m.kernel_size, dilation=m.dilation,
                                           padding=self.padding, stride=m.stride)
            u = u.view(n, g, -1, u.shape[-1])  # [n, g, d, T]
            return torch.matmul(u.transpose(2, 3), u)
        ph, pw = self.padding
        padded = torch.nn.functional.pad(a, (pw, pw, ph, ph)) if ph or pw else a
        hp, wp = padded.shape[2], padded.shape[3]
        flat = padded.reshape(n, g, -1, hp * wp)
        positions = torch.matmul(flat.transpose(2, 3), flat).view(n, g, hp, wp, hp, wp)
        out = self._output_shape(a)
        gram = positions.new_zeros(n, g, out[2], out[3], out[2], out[3])
        for i in range(m.kernel_size[0]):
            rows = slice(i * m.dilation[0], i * m.dilation[0] + m.stride[0] * (out[2] - 1) + 1,
                         m.stride[0])
            for j in range(m.kernel_size[1]):
                cols = slice(j * m.dilation[1],
                             j * m.dilation[1] + m.stride[1] * (out[3] - 1) + 1, m.stride[1])
                gram += positions[:, :, rows, cols, rows, cols]  # tap (i, j): a strided view
        return gram.view(n, g, out[2] * out[3], out[2] * out[3])

    def _output_shape(self, a: torch.Tensor) -> torch.Size:
        m = self.module
        size = [(a.shape[2 + i] + 2 * self.padding[i] - m.dilation[i] * (m.kernel_size[i] - 1)
                 - 1) // m.stride[i] + 1 for i in range(2)]
        return torch.Size([a.shape[0], m.out_channels, *size])

    def _weight_grad(self, a: torch.Tensor, b: torch.Tensor, groups: int,
                     shape: tuple[int, ...]) -> torch.Tensor:
        m = self.module
        weight = b.new_empty(1).expand(shape)  # the kernel reads only the weight's shape
        return torch.ops.aten.convolution_backward(
            b, a, weight, None, list(m.stride), list(self.padding), list(m.dilation), False,
            [0, 0], groups, [False, True, False])[1]

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m = self.module
        n = a.shape[0]
        a1 = a.reshape(1, n * a.shape[1], *a.shape[2:])
        b1 = b.reshape(1, n * b.shape[1], *b.shape[2:])
        shape = (n * m.out_channels, *m.weight.shape[1:])
        return self._weight_grad(a1, b1, n * m.groups, shape).view(n, *m.weight.shape)

    def bias_per_example(self, b: torch.Tensor) -> torch.Tensor:
        return b.sum((2, 3))

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n, g = a.shape[0], self.module.groups
        (ua, sa), (ub, sb) = row_scale(a), row_scale(b)
        gram_a = self._input_gram(ua)
        bf = ub.reshape(n, g, -1, gram_a.shape[-1])  # [n, g, p, T]
        gram_b = torch.matmul(bf.transpose(2, 3), bf)
        return (gram_a * gram_b).sum((1, 2, 3)).double() * (sa * sb).square()

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        return self._weight_grad(a, bc, self.module.groups, tuple(self.module.weight.shape))


class NormHandler(Handler):
    """Affine normalisation: g_i(weight) = sum over positions of b_i * x_hat_i ([B, C]-sized)."""

    per_channel = True

    def normalized(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reduce_dims(self, a: torch.Tensor) -> tuple[int, ...]:
        raise NotImplementedError

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        per_example = a[0].numel()
        width = self.module.weight.numel() if self.weight_name else per_example
        return Geometry(positions=per_example // max(1, width), fan_in=1, fan_out=width)

    def per_example(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        dims = self.reduce_dims(a)
        out = {}
        if self.weight_name is not None:
            prod = b * self.normalized(a)
            out[self.weight_name] = prod.sum(dims) if dims else prod
        if self.bias_name is not None:
            out[self.bias_name] = b.sum(dims) if dims else b
        return out

    def weighted(self, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: combine(c, g) for n, g in self.per_example(a, b).items()}


class GroupNormHandler(NormHandler):
    kind = "GroupNorm"

    def normalized(self, a: torch.Tensor) -> torch.Tensor:
        m = self.module
        return torch.nn.functional.group_norm(a, m.num_groups, None, None, m.eps)

    def reduce_dims(self, a: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, a.dim()))


class LayerNormHandler(NormHandler):
    kind = "LayerNorm"

    def normalized(self, a: torch.Tensor) -> torch.Tensor:
        m = self.module
        return torch.nn.functional.layer_norm(a, m.normalized_shape, None, None, m.eps)

    def reduce_dims(self, a: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(1, a.dim() - len(self.module.normalized_shape)))


def handler_types() -> dict[type, type[Handler]]:
    nn_ = torch.nn
    return {nn_.Linear: LinearHandler, nn_.Conv2d: Conv2dHandler,
            nn_.GroupNorm: GroupNormHandler, nn_.LayerNorm: LayerNormHandler}


class BlockFallback:
    """A block with a module the engine has no algebra for: per-example grads by torch.func."""

    def __init__(self, block: nn.Module, *, qualname: str, layer: int) -> None:
        self.module = block
        self.layer = layer
        self.local = [n for n, _ in block.named_parameters()]
        self.names = [f"{qualname}.{n}" for n in self.local]

    def _params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def per_example(self, a: torch.Tensor, b: torch.Tensor, *,
                    chunk: int) -> dict[str, torch.Tensor]:
        from torch.func import functional_call, grad, vmap

        def inner(params: dict[str, torch.Tensor], ai: torch.Tensor,
                  bi: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.module, params, (ai.unsqueeze(0),))
            return (out * bi.unsqueeze(0)).sum()

        grads = vmap(grad(inner), in_dims=(None, 0, 0), chunk_size=chunk)(self._params(), a, b)
        return {f: grads[n] for n, f in zip(self.local, self.names, strict=True)}

    def weighted(self, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor) -> dict[str, torch.Tensor]:
        from torch.func import functional_call, vjp

        _, pull = vjp(lambda params: functional_call(self.module, params, (a,)), self._params())
        (grads,) = pull(scale_rows(b, c))
        return {f: grads[n] for n, f in zip(self.local, self.names, strict=True)}


@functools.cache
def tap_function() -> Any:
    """Identity on a module output whose backward hands the output gradient to a sink.

    Its second input, a scalar leaf, makes the output require grad even though every parameter
    is detached; the backward is run for that leaf only, so autograd computes input gradients
    along the network and nothing else.
    """

    class _Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, out: torch.Tensor, anchor: torch.Tensor,
                    sink: Callable[[torch.Tensor], None]) -> torch.Tensor:
            del anchor
            ctx.sink = sink
            return out.view_as(out)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            ctx.sink(grad)
            ctx.sink = None
            return grad, None, None

    return _Tap
