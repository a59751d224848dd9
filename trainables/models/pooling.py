"""Max pooling whose gradient-free forward avoids PyTorch's slow CPU kernel for 2 x 2 windows.

PyTorch's CPU ``max_pool2d`` forward is several times slower than the elementwise maximum of
the window's four shifted (strided) slices for a 2 x 2 window: about 19 ms against 2 ms on
[256, 16, 14, 14] at stride 1, one thread (cnn28's first pooling), and 52 ms against 11 ms on
[256, 32, 28, 28] at stride 2. The audit runs many such forwards without a gradient (every
model's features, logits and probe inputs), so the built-in CNNs pool with :class:`MaxPool2d`.

The slices give the same values: the window's maximum, and NaN wherever any entry is NaN
(both propagate it; the NaN's payload may differ). Two zeros of opposite sign are equal and
either may come out, as ``torch.maximum``'s vectorised loop picks; the next layer's sums with
a bias cannot tell them apart (the built-in CNNs' logits agree bit for bit, tested). With a
gradient the slices are not used: their backward is much slower than the kernel's, and on ties
``torch.maximum`` splits the gradient between the equal entries where ``max_pool2d`` routes it
to one, which would change what DP-SGD clips.
"""

from __future__ import annotations

import torch
from torch import nn

#: The one window size the shifted-slice forward covers (four slices).
FAST_KERNEL = 2
#: The strides it covers: overlapping windows (cnn28) and the usual halving (cnn5).
FAST_STRIDES = (1, 2)


def _pair(value: int | tuple[int, ...]) -> tuple[int, ...]:
    return (value, value) if isinstance(value, int) else tuple(value)


def shifted_max_pool2d(x: torch.Tensor, *, stride: int) -> torch.Tensor:
    """``F.max_pool2d(x, 2, stride)`` as the maximum of four strided slices (no padding,
    floor mode: a last row or column the window does not reach is dropped, as there)."""
    height, width = x.shape[-2:]
    rows = (height - FAST_KERNEL) // stride + 1
    cols = (width - FAST_KERNEL) // stride + 1

    def window_entry(i: int, j: int) -> torch.Tensor:
        return x[..., i:i + stride * (rows - 1) + 1:stride, j:j + stride * (cols - 1) + 1:stride]

    return torch.maximum(torch.maximum(window_entry(0, 0), window_entry(0, 1)),
                         torch.maximum(window_entry(1, 0), window_entry(1, 1)))


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` that takes the shifted-slice forward when no gradient is recorded and
    its settings are a plain 2 x 2 window at stride 1 or 2 (module docstring: why)."""

    def fast_stride(self) -> int | None:
        """The stride the shifted-slice forward reproduces this pooling at, or None. Read on
        every call: the settings are plain attributes a caller may change."""
        kernel, strides = _pair(self.kernel_size), _pair(self.stride)
        plain = (kernel == (FAST_KERNEL, FAST_KERNEL) and _pair(self.padding) == (0, 0)
                 and _pair(self.dilation) == (1, 1) and not self.ceil_mode
                 and not self.return_indices)
        if plain and strides[0] == strides[1] and strides[0] in FAST_STRIDES:
            return strides[0]
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() or x.device.type != "cpu" or x.dim() not in (3, 4)
                or min(x.shape[-2:]) < FAST_KERNEL):
            return super().forward(x)
        stride = self.fast_stride()
        return super().forward(x) if stride is None else shifted_max_pool2d(x, stride=stride)
