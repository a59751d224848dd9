"""Per-module per-example gradient algebra for :mod:`trainables.engine.grad_engine`.

One handler per parameterised module type (Linear, Conv1d, Conv2d, GroupNorm, LayerNorm here;
Embedding and EmbeddingBag in :mod:`trainables.engine.embedding`) turns a module's kept input
``a`` and output gradient ``b`` into per-example squared norms (ghost or materialised, each
with its kernels: a :class:`Choice`) and coefficient-weighted sums; any other module falls back
to ``torch.func`` (:mod:`trainables.engine.func`). Which choice runs is measured per trial
(:mod:`trainables.engine.plan`); :func:`choose`, the cost model, decides where nothing was
measured and breaks near-ties. The costs are in the engine's docstring; this module holds the
algebra so the engine file holds the passes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.norms import (
    certified_ghost_sq,
    certified_released_sq,
    row_scale,
    row_sums,
    scaled_sq_norms,
)

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
    #: Embedding: the input is a token index (a one-hot row of width fan_in), so its Gram is
    #: T^2 comparisons and a^T b is a scatter of the T output-gradient rows (T p, not T p d).
    index_input: bool = False

    @property
    def shifted_gram(self) -> bool:
        """Whether the input Gram is cheaper from shifted channel Grams than from patches."""
        return 0 < self.padded_positions ** 2 < self.taps * self.positions ** 2

    def input_gram_cost(self) -> int:
        """Multiply-adds per example and group of the input Gram a_i a_i^T (T x T)."""
        t = self.positions
        if self.index_input:
            return t * t
        if self.shifted_gram:
            return self.fan_in // self.taps * self.padded_positions ** 2 + self.taps * t * t
        return self.fan_in * t * t


#: Kernels: "native" is each path's default (for a Conv2d ghost norm, the shifted or the
#: unfolded input Gram by ``Geometry.shifted_gram``; for its materialisation, the grouped
#: weight-gradient kernel); "unfold" forms a Conv2d's per-example gradients, or its input Gram,
#: from the unfolded patches with batched matrix products (no per-tap loop; fast on a GPU).
KERNELS = ("native", "unfold")


@dataclass(frozen=True)
class Choice:
    """How one module's weight is normed and summed: ``norm`` "ghost" or "materialize",
    ``keep`` the per-example gradients for the weighted sum, and the ``kernel`` used."""

    norm: str
    keep: bool
    kernel: str = "native"

    @property
    def label(self) -> str:
        keep = " kept" if self.keep else (" dropped" if self.norm == "materialize" else "")
        kernel = "" if self.kernel == "native" else f" ({self.kernel})"
        return f"{self.norm}{keep}{kernel}"

    def to_dict(self) -> dict[str, object]:
        return {"norm": self.norm, "keep": self.keep, "kernel": self.kernel}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Choice:
        """A choice read back from a plan cache: anything but a known choice is refused."""
        norm, keep, kernel = d.get("norm"), d.get("keep"), d.get("kernel")
        if norm not in ("ghost", "materialize") or not isinstance(keep, bool) \
                or kernel not in KERNELS or (keep and norm == "ghost"):
            raise ValueError(f"not a plan choice: {d!r}")
        return cls(norm=str(norm), keep=keep, kernel=str(kernel))


def estimate(geometry: Geometry, *, norm: str, keep: bool) -> float:
    """Multiply-adds per example of one norm and weighted sum (the engine's cost model)."""
    t, d, p, g = geometry.positions, geometry.fan_in, geometry.fan_out, geometry.groups
    if geometry.index_input:
        # a^T b is a scatter (T p); materialising fills and norms a dense V x p block per
        # example, so ghost wins unless T^2 (p + 1) exceeds about 2 V p
        scatter = g * t * p
        if norm == "ghost":
            return g * (geometry.input_gram_cost() + t * t * p) + scatter
        return 2 * g * p * d + scatter + (g * p * d if keep else scatter)
    wgrad = g * t * p * d
    if norm == "ghost":
        return g * (geometry.input_gram_cost() + t * t * p) + wgrad
    return MATERIALIZE_COST * wgrad + (g * p * d if keep else wgrad)


def choose(geometry: Geometry, *, strategy: str) -> tuple[str, bool]:
    """(norm algorithm, keep per-example gradients) for one module; see the module docstring."""
    keep = geometry.fan_in <= KEEP_RATIO * geometry.positions
    if strategy == "ghost":
        return "ghost", False
    if strategy == "materialize":
        return "materialize", keep
    ghost = estimate(geometry, norm="ghost", keep=False)
    materialize = estimate(geometry, norm="materialize", keep=keep)
    return ("ghost", False) if ghost < materialize else ("materialize", keep)


def _slices(n: int, per_example: int) -> Iterator[slice]:
    """Batch slices whose transient tensors stay within ``TRANSIENT_ELEMENTS``."""
    step = max(1, TRANSIENT_ELEMENTS // max(1, per_example))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def diagonal_bound(gram_a: torch.Tensor, gram_b: torch.Tensor) -> torch.Tensor:
    """[B] float64 (sum_t ||a_t|| ||b_t||)^2 (summed over groups) from [B, (g,) T, T] Grams."""
    terms = (gram_a.diagonal(dim1=-2, dim2=-1).clamp_min(0)
             * gram_b.diagonal(dim1=-2, dim2=-1).clamp_min(0)).sqrt().sum(-1)
    terms = terms.double().square()
    return terms.reshape(terms.shape[0], -1).sum(1)


def terms_bound(a3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """[B] float64 (sum_t ||a_t|| ||b_t||)^2 of [B, T, *] factors, at unit scale per example."""
    (ua, sa), (ub, sb) = row_scale(a3), row_scale(b3)
    terms = (torch.linalg.vector_norm(ua, dim=2) * torch.linalg.vector_norm(ub, dim=2)).sum(1)
    return terms.double().square() * (sa * sb).square()


def scale_rows(b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return b * c.to(dtype=b.dtype, device=b.device).view(-1, *([1] * (b.dim() - 1)))


class Handler:
    """Per-example gradient algebra of one module with parameters (one call = inputs a, b)."""

    per_channel: ClassVar[bool] = False
    kind: ClassVar[str] = ""
    #: Whether the rule holds with the batch in any dimension of the input and output (moved
    #: first before it runs): true for modules that act on the last dimension only.
    batch_anywhere: ClassVar[bool] = False

    def __init__(self, module: nn.Module, *, qualname: str, layer: int,
                 trainable: set[str] | None = None) -> None:
        self.module = module
        self.qualname = qualname
        self.layer = layer

        def name(local: str) -> str | None:
            full = f"{qualname}.{local}"
            if getattr(module, local, None) is None:
                return None
            return full if trainable is None or full in trainable else None

        #: None where the module has no such parameter or it is frozen (no gradient needed).
        self.weight_name = name("weight")
        self.bias_name = name("bias")

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

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor, *,
                           kernel: str = "native") -> torch.Tensor:
        raise NotImplementedError

    def bias_per_example(self, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def candidates(self, geometry: Geometry) -> list[Choice]:
        """Every way this module's weight can be normed and summed at ``geometry`` (what a
        measured plan times): ghost, and materialised kept (where ``KEEP_RATIO`` allows the
        memory) or dropped."""
        keep = geometry.fan_in <= KEEP_RATIO * geometry.positions
        out = [Choice("ghost", False), Choice("materialize", False)]
        return [*out, Choice("materialize", True)] if keep else out

    def timing_key(self) -> tuple[object, ...]:
        """What, besides the geometry, a candidate's time depends on: modules of one type with
        equal keys and geometries are timed once."""
        return (type(self).__name__,)

    def cost_choice(self, geometry: Geometry, *, strategy: str) -> Choice:
        """The cost model's choice (:func:`choose`)."""
        norm, keep = choose(geometry, strategy=strategy)
        return Choice(norm, keep)

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor, *, kernel: str = "native"
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B] squared norms, [B] ``cancellation_bound`` read off the Grams' diagonals, or
        None where nothing can cancel)."""
        raise NotImplementedError

    def gram_terms(self, geometry: Geometry) -> int:
        """Products summed into one entry of the input Gram (for a convolution's shifted Gram,
        a channel dot product and then the sum over taps)."""
        return geometry.fan_in + geometry.taps

    def release_terms(self, geometry: Geometry) -> int:
        """Products summed into one entry of the native weight-gradient kernel's sum for one
        example: one per position (the bound of a direct or matrix-product kernel, which the
        engine's CPU kernels and cuDNN's non-transform algorithms are)."""
        return geometry.positions

    def certified(self, sq: torch.Tensor, terms: torch.Tensor, *, geometry: Geometry,
                  ghost: bool, dtype: torch.dtype) -> torch.Tensor:
        """[B] upper bounds of the squared norms of what the native sum releases per example,
        from the ghost estimate or the materialised gradient's norm ``sq`` and
        ``terms`` = (sum_t ||a_t|| ||b_t||)^2 (:mod:`trainables.engine.norms`)."""
        if ghost:
            return certified_ghost_sq(sq, terms, input_terms=self.gram_terms(geometry),
                                      output_terms=geometry.fan_out,
                                      release_terms=self.release_terms(geometry), dtype=dtype)
        return certified_released_sq(sq, terms, materialised_terms=self.release_terms(geometry),
                                     release_terms=self.release_terms(geometry), dtype=dtype)

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        """sum_i a_i^T bc_i with the native kernel (bc: output gradients already scaled)."""
        raise NotImplementedError

    def transient(self, geometry: Geometry, *, ghost: bool, kernel: str = "native") -> int:
        """Elements per example of the temporaries of one norm computation."""
        del kernel
        t, d, p, g = geometry.positions, geometry.fan_in, geometry.fan_out, geometry.groups
        return g * (d * t + 2 * t * t) if ghost else g * p * d

    def weight_sq(self, a: torch.Tensor, b: torch.Tensor, *, geometry: Geometry,
                  ghost: bool, kernel: str = "native"
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B] squared norms of the weight's per-example gradients, [B] their
        ``cancellation_bound``), slice by slice."""
        parts, bounds = [], []
        for s in _slices(a.shape[0], self.transient(geometry, ghost=ghost, kernel=kernel)):
            if ghost:
                sq, bound = self.weight_ghost_sq(a[s], b[s], kernel=kernel)
            else:
                sq = scaled_sq_norms(self.weight_per_example(a[s], b[s], kernel=kernel))
                bound = self.cancellation_bound(a[s], b[s])
            parts.append(sq)
            bounds.append(bound)
        if len(parts) == 1:
            return parts[0], bounds[0]
        if any(b is None for b in bounds):
            return torch.cat(parts), None
        return torch.cat(parts), torch.cat(bounds)

    def cancellation_bound(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[B] float64 (sum_t ||a_t|| ||b_t||)^2, the size of the rank-one terms an example's
        weight gradient sums, on which every rounding of its norm and sum is bounded; zero
        where nothing can cancel."""
        return torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)


class LinearHandler(Handler):
    """``nn.Linear`` on [B, d] or [B, *, d]: positions are the middle dimensions."""

    kind = "Linear"
    batch_anywhere = True

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1, t.shape[-1])

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        return Geometry(positions=self._flat(b).shape[1], fan_in=a.shape[-1],
                        fan_out=b.shape[-1])

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor, *,
                           kernel: str = "native") -> torch.Tensor:
        del kernel
        a3, b3 = self._flat(a), self._flat(b)
        if a3.shape[1] == 1:
            return b3[:, 0, :, None] * a3[:, 0, None, :]
        return torch.bmm(b3.transpose(1, 2), a3)

    def bias_per_example(self, b: torch.Tensor) -> torch.Tensor:
        return self._flat(b).sum(1)

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor, *, kernel: str = "native"
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del kernel
        a3, b3 = self._flat(a), self._flat(b)
        if a3.shape[1] == 1:  # one term: its norm is exact, nothing can cancel
            return scaled_sq_norms(a3[:, 0]) * scaled_sq_norms(b3[:, 0]), None
        (ua, sa), (ub, sb) = row_scale(a3), row_scale(b3)
        gram_a, gram_b = torch.bmm(ua, ua.transpose(1, 2)), torch.bmm(ub, ub.transpose(1, 2))
        scale = (sa * sb).square()
        return row_sums(gram_a * gram_b) * scale, diagonal_bound(gram_a, gram_b) * scale

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        return bc.reshape(-1, bc.shape[-1]).t() @ a.reshape(-1, a.shape[-1])

    def cancellation_bound(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a3, b3 = self._flat(a), self._flat(b)
        if a3.shape[1] == 1:  # one term: its norm is exact
            return super().cancellation_bound(a, b)
        return terms_bound(a3, b3)


class Conv2dHandler(Handler):
    """``nn.Conv2d`` (any stride, padding, padding mode, dilation, groups; bias optional).

    The geometry is read once into 2-D tuples (``kernel_size``, ``stride``, ``dilation``,
    ``padding``, ``kernel_shape``) so :class:`Conv1dHandler` reuses every kernel as a Conv2d
    of height 1.
    """

    kind = "Conv2d"

    def __init__(self, module: nn.Module, *, qualname: str, layer: int,
                 trainable: set[str] | None = None) -> None:
        super().__init__(module, qualname=qualname, layer=layer, trainable=trainable)
        m = module
        # non-zero padding modes and string paddings: pad the kept input once, then pad 0
        self._explicit_pad = m.padding_mode != "zeros" or isinstance(m.padding, str)
        self.kernel_size = self._2d(m.kernel_size, 1)
        self.stride = self._2d(m.stride, 1)
        self.dilation = self._2d(m.dilation, 1)
        self.padding = (0, 0) if self._explicit_pad else self._2d(m.padding, 0)
        self.kernel_shape = (m.out_channels, m.in_channels // m.groups, *self.kernel_size)

    @staticmethod
    def _2d(value: tuple[int, ...], fill: int) -> tuple[int, int]:
        """A per-dimension setting as (height, width); a 1-D one gets height ``fill``."""
        h, w = (fill, *value) if len(value) == 1 else value
        return int(h), int(w)

    @staticmethod
    def _4d(b: torch.Tensor) -> torch.Tensor:
        """An output gradient as [n, C, H, W] (a Conv1d's [n, C, L] as height 1)."""
        return b if b.dim() == 4 else b.unsqueeze(2)

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        a = a.detach()
        if not self._explicit_pad:
            return a
        m = self.module
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        return torch.nn.functional.pad(a, m._reversed_padding_repeated_twice, mode=mode)

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        m = self.module
        kh, kw = self.kernel_size
        del b  # the output shape follows from the input's
        ph, pw = self.padding
        out = self._output_shape(a)
        return Geometry(positions=out[2] * out[3],
                        fan_in=m.in_channels // m.groups * kh * kw,
                        fan_out=m.out_channels // m.groups, groups=m.groups, taps=kh * kw,
                        padded_positions=(a.shape[2] + 2 * ph) * (a.shape[3] + 2 * pw))

    def timing_key(self) -> tuple[object, ...]:
        return (type(self).__name__, self.kernel_size, self.stride, self.dilation,
                self.padding, self._explicit_pad)

    def candidates(self, geometry: Geometry) -> list[Choice]:
        """The base candidates, each also with the other kernel (unfolded patches)."""
        base = super().candidates(geometry)
        return base + [Choice(c.norm, c.keep, "unfold") for c in base]

    def transient(self, geometry: Geometry, *, ghost: bool, kernel: str = "native") -> int:
        t, g = geometry.positions, geometry.groups
        if kernel == "unfold":  # the unfolded patches, and the Grams or the gradients
            extra = 2 * t * t if ghost else geometry.fan_out * geometry.fan_in
            return g * (geometry.fan_in * t + extra)
        if not ghost:
            return super().transient(geometry, ghost=ghost)
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
        n, g = a.shape[0], self.module.groups
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        if shifted is None:
            shifted = self.geometry(a, a).shifted_gram
        if not shifted:
            u = self._unfolded(a)
            return torch.matmul(u.transpose(2, 3), u)
        ph, pw = self.padding
        padded = torch.nn.functional.pad(a, (pw, pw, ph, ph)) if ph or pw else a
        hp, wp = padded.shape[2], padded.shape[3]
        flat = padded.reshape(n, g, -1, hp * wp)
        positions = torch.matmul(flat.transpose(2, 3), flat).view(n, g, hp, wp, hp, wp)
        out = self._output_shape(a)
        gram = positions.new_zeros(n, g, out[2], out[3], out[2], out[3])
        for i in range(kh):
            rows = slice(i * dh, i * dh + sh * (out[2] - 1) + 1, sh)
            for j in range(kw):
                cols = slice(j * dw, j * dw + sw * (out[3] - 1) + 1, sw)
                gram += positions[:, :, rows, cols, rows, cols]  # tap (i, j): a strided view
        return gram.view(n, g, out[2] * out[3], out[2] * out[3])

    def _output_shape(self, a: torch.Tensor) -> torch.Size:
        size = [(a.shape[2 + i] + 2 * self.padding[i]
                 - self.dilation[i] * (self.kernel_size[i] - 1) - 1) // self.stride[i] + 1
                for i in range(2)]
        return torch.Size([a.shape[0], self.module.out_channels, *size])

    def _weight_grad(self, a: torch.Tensor, b: torch.Tensor, groups: int,
                     shape: tuple[int, ...]) -> torch.Tensor:
        weight = b.new_empty(1).expand(shape)  # the kernel reads only the weight's shape
        return torch.ops.aten.convolution_backward(
            b, a, weight, None, list(self.stride), list(self.padding), list(self.dilation),
            False, [0, 0], groups, [False, True, False])[1]

    def _unfolded(self, a: torch.Tensor) -> torch.Tensor:
        """[n, g, d, T] patches of each example's input, per group."""
        u = torch.nn.functional.unfold(a, self.kernel_size, dilation=self.dilation,
                                       padding=self.padding, stride=self.stride)
        return u.view(a.shape[0], self.module.groups, -1, u.shape[-1])

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor, *,
                           kernel: str = "native") -> torch.Tensor:
        m = self.module
        n, b = a.shape[0], self._4d(b)
        if kernel == "unfold":  # [n, g, p, T] x [n, g, T, d]: one batched product
            u = self._unfolded(a)
            bf = b.reshape(n, m.groups, -1, u.shape[-1])
            return torch.matmul(bf, u.transpose(2, 3)).view(n, *m.weight.shape)
        a1 = a.reshape(1, n * a.shape[1], *a.shape[2:])
        b1 = b.reshape(1, n * b.shape[1], *b.shape[2:])
        shape = (n * m.out_channels, *self.kernel_shape[1:])
        return self._weight_grad(a1, b1, n * m.groups, shape).view(n, *m.weight.shape)

    def bias_per_example(self, b: torch.Tensor) -> torch.Tensor:
        return b.sum(tuple(range(2, b.dim())))

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor, *, kernel: str = "native"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        n, g = a.shape[0], self.module.groups
        (ua, sa), (ub, sb) = row_scale(a), row_scale(b)
        gram_a = self._input_gram(ua, shifted=False if kernel == "unfold" else None)
        bf = ub.reshape(n, g, -1, gram_a.shape[-1])  # [n, g, p, T]
        gram_b = torch.matmul(bf.transpose(2, 3), bf)
        scale = (sa * sb).square()
        return row_sums(gram_a * gram_b) * scale, diagonal_bound(gram_a, gram_b) * scale

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        m = self.module
        return self._weight_grad(a, self._4d(bc), m.groups, self.kernel_shape).view(
            m.weight.shape)

    def cancellation_bound(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per group, patch norms from a convolution of the squared input with a box kernel
        (no unfolding), then summed over groups."""
        n, g = a.shape[0], self.module.groups
        (ua, sa), (ub, sb) = row_scale(a), row_scale(self._4d(b))
        sq = ua.square().reshape(n, g, -1, *ua.shape[2:]).sum(2)
        box = sq.new_ones(g, 1, *self.kernel_size)
        patches = torch.nn.functional.conv2d(sq, box, stride=self.stride, padding=self.padding,
                                             dilation=self.dilation, groups=g)
        out = ub.square().reshape(n, g, -1, *ub.shape[2:]).sum(2)
        terms = (patches.clamp_min(0).sqrt() * out.sqrt()).reshape(n, g, -1).sum(2)
        return terms.double().square().sum(1) * (sa * sb).square()


class Conv1dHandler(Conv2dHandler):
    """``nn.Conv1d`` on [B, C, L] as a Conv2d of height 1 on [B, C, 1, L]: the same kernels,
    strides, dilations, groups and padding modes, with every 2-D setting's height 1 (padding 0),
    so the ghost and materialised paths and their costs are the 2-D ones, unchanged."""

    kind = "Conv1d"

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        return super().prepare(a).unsqueeze(2)  # padded over L first, as the module pads


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


class GroupNormHandler(NormHandler):
    kind = "GroupNorm"

    def normalized(self, a: torch.Tensor) -> torch.Tensor:
        m = self.module
        return torch.nn.functional.group_norm(a, m.num_groups, None, None, m.eps)

    def reduce_dims(self, a: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(2, a.dim()))


class LayerNormHandler(NormHandler):
    kind = "LayerNorm"
    batch_anywhere = True

    def normalized(self, a: torch.Tensor) -> torch.Tensor:
        m = self.module
        return torch.nn.functional.layer_norm(a, m.normalized_shape, None, None, m.eps)

    def reduce_dims(self, a: torch.Tensor) -> tuple[int, ...]:
        return tuple(range(1, a.dim() - len(self.module.normalized_shape)))
