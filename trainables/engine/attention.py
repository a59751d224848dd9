"""Per-example gradients of ``nn.MultiheadAttention`` (self-attention) as Linear algebra.

Its parameters enter through two matrix products: the packed input projection
``x W_in^T + b_in`` (queries, keys and values at once when they are one tensor, as in every
``nn.TransformerEncoderLayer`` and torchvision ViT block) and the output projection. During the
engine's pass the module runs a re-statement of PyTorch's forward whose two projections carry
the engine's gradient hooks (``scaled_dot_product_attention`` in between, with the same masks,
dropout and causal flag), so both take the engine's Linear rules (ghost or materialised),
instead of a per-example ``torch.func`` pass whose attention kernel has no batching rule.
Everywhere else the module runs as it is. Cross-attention (different query, key and value),
separate projection weights, ``add_bias_kv`` and ``add_zero_attn`` keep the exact fallback
(:class:`trainables.engine.func.OwnerFallback`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.func import NotPerExample
from dpsweep.trainables.engine.rnn import LinearPart, Tap

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")


def decomposable(module: nn.Module) -> bool:
    """Whether :class:`AttentionUnit` covers this attention module's parameters."""
    return (module._qkv_same_embed_dim and module.bias_k is None and module.bias_v is None
            and not module.add_zero_attn)


class AttentionUnit:
    """The engine's unit for one self-attention module: its two projections and its forward."""

    per_channel: ClassVar[bool] = False
    batch_anywhere: ClassVar[bool] = False
    kind = "MultiheadAttention"

    def __init__(self, module: nn.Module, *, qualname: str, layer: int,
                 trainable: set[str]) -> None:
        self.module = module
        self.qualname = qualname
        self.layer = layer
        has_bias = module.in_proj_bias is not None
        self.parts = (
            LinearPart(module, qualname=qualname, layer=layer, weight="in_proj_weight",
                       bias="in_proj_bias" if has_bias else None, trainable=trainable),
            LinearPart(module, qualname=qualname, layer=layer, weight="out_proj.weight",
                       bias="out_proj.bias" if module.out_proj.bias is not None else None,
                       trainable=trainable))

    def forward(self, tap: Tap, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward`` with the engine's hooks on its projections."""
        m = self.module
        if not (query is key and key is value):
            raise NotPerExample(f"{self.qualname} (MultiheadAttention) is called with a "
                                "different query, key and value: cross-attention has no "
                                "per-example rule here")
        if query.dim() != 3:
            raise NotPerExample(f"{self.qualname} (MultiheadAttention) got an unbatched input")
        x = query if m.batch_first else query.transpose(0, 1)  # [B, L, E]
        n, length, width = x.shape
        heads, head = m.num_heads, width // m.num_heads
        bias = None if m.in_proj_bias is None else m.in_proj_bias.detach()
        qkv = tap([(self.parts[0], x.detach(), None)],
                  torch.nn.functional.linear(x, m.in_proj_weight.detach(), bias))
        q, k, v = (t.reshape(n, length, heads, head).transpose(1, 2) for t in qkv.chunk(3, -1))
        mask = _mask(attn_mask, key_padding_mask, n=n, heads=heads, length=length,
                     dtype=x.dtype)
        drop = m.dropout if m.training else 0.0
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(head)
            if mask is not None:
                scores = scores + mask
            elif is_causal:
                causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(causal, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            attended = torch.nn.functional.dropout(weights, p=drop, training=drop > 0) @ v
        else:
            weights = None
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=drop,
                is_causal=is_causal and mask is None)
        joined = attended.transpose(1, 2).reshape(n, length, width)
        out_bias = None if m.out_proj.bias is None else m.out_proj.bias.detach()
        out = tap([(self.parts[1], joined.detach(), None)],
                  torch.nn.functional.linear(joined, m.out_proj.weight.detach(), out_bias))
        out = out if m.batch_first else out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights


def _mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, *, n: int,
          heads: int, length: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive [B or 1, H or 1, L, L] mask PyTorch's attention builds from both masks
    (a boolean mask's True entries are excluded, as in ``nn.MultiheadAttention``)."""
    def additive(mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                mask, float("-inf"))
        return mask.to(dtype)

    total = None
    if attn_mask is not None:
        total = additive(attn_mask)
        total = (total.view(n, heads, length, -1) if total.dim() == 3
                 else total.view(1, 1, length, -1))
    if key_padding_mask is not None:
        pad = additive(key_padding_mask).view(n, 1, 1, -1)
        total = pad if total is None else total + pad
    return total


def attention_types() -> tuple[type, ...]:
    return (torch.nn.MultiheadAttention,)

