"""Per-example gradient algebra of ``nn.Embedding`` and ``nn.EmbeddingBag``: the input is a
token index (a one-hot row of width V), so a^T b is a scatter of the output-gradient rows and
the ghost norm compares tokens instead of forming an input Gram (:mod:`trainables.engine.modules`
holds the shared handler and the dense modules)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpsweep.core.errors import UserInputError
from dpsweep.core.lazy import lazy_module
from dpsweep.trainables.engine.modules import Geometry, Handler, diagonal_bound, terms_bound
from dpsweep.trainables.engine.norms import row_scale, row_sums

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")


def check_embedding(module: nn.Module, qualname: str) -> None:
    """Refuse an Embedding whose gradient is not a per-example linear map of its output
    gradient, wherever it sits (handled, or in a block that falls back to ``torch.func``).

    Refused rather than left to the fallback, which would not make them sound:

    * ``max_norm``: forward renormalises the looked-up rows *in place*, so the weights change
      with the private batch's tokens outside the noised update (an unnoised release), and a
      chunked view's recomputed forward would see other weights.
    * ``scale_grad_by_freq``: backward divides each row by the token's count in the whole
      batch, so one example's gradient depends on the others and adding an example rescales
      everyone's contribution: clipping no longer bounds one example's influence.
    * ``sparse``: only the layout of autograd's ``.grad``; the engine's sums are dense and the
      noised gradient is dense in every row anyway, while ``torch.func`` (the fallback and the
      reference) cannot differentiate it. ``sparse=False`` computes the same values.
    """
    reasons = [why for flag, why in (
        (module.max_norm is not None, "max_norm rewrites the weight inside forward"),
        (module.scale_grad_by_freq, "scale_grad_by_freq makes each example's gradient depend "
                                    "on the batch's token counts"),
        (module.sparse, "sparse gradients have no per-example form in torch.func"))
        if flag]
    if reasons:
        raise UserInputError(field=f"model.{qualname}", value=type(module).__name__,
                             allowed=f"an Embedding with max_norm=None, "
                                     f"scale_grad_by_freq=False and sparse=False "
                                     f"({'; '.join(reasons)})")


class EmbeddingHandler(Handler):
    """``nn.Embedding`` on token ids [B] or [B, *] (T positions per example).

    Its weight gradient is a^T b with a the one-hot ids: example i's gradient adds output
    gradient row b_t into vocabulary row id_t. Ghost norm: ||g_i||^2 = sum over position pairs
    with the same token of <b_t, b_t'> (T^2 p, no V-sized tensor); materialised: a dense
    [V, p] scatter per example. Positions holding ``padding_idx`` get no gradient, as in
    PyTorch (their b rows are zeroed before either path).
    """

    kind = "Embedding"
    batch_anywhere = True

    def __init__(self, module: nn.Module, *, qualname: str, layer: int,
                 trainable: set[str] | None = None) -> None:
        check_embedding(module, qualname)
        super().__init__(module, qualname=qualname, layer=layer, trainable=trainable)

    def prepare(self, a: torch.Tensor) -> torch.Tensor:
        return a.detach().reshape(a.shape[0], -1).long()  # [B, T]

    def _rows(self, ids: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[B, T, p] output gradient, zero at padding positions."""
        b3 = b.reshape(ids.shape[0], ids.shape[1], b.shape[-1])
        pad = self.module.padding_idx
        return b3 if pad is None else b3.masked_fill((ids == pad).unsqueeze(-1), 0.0)

    def geometry(self, a: torch.Tensor, b: torch.Tensor) -> Geometry:
        del b
        m = self.module
        return Geometry(positions=a.shape[1], fan_in=m.num_embeddings, fan_out=m.embedding_dim,
                        index_input=True)

    def transient(self, geometry: Geometry, *, ghost: bool, kernel: str = "native") -> int:
        del kernel
        t, d, p = geometry.positions, geometry.fan_in, geometry.fan_out
        return 2 * t * t + t * p if ghost else d * p

    def weight_per_example(self, a: torch.Tensor, b: torch.Tensor, *,
                           kernel: str = "native") -> torch.Tensor:
        del kernel
        n, v = a.shape[0], self.module.num_embeddings
        b3 = self._rows(a, b)
        rows = (a + v * torch.arange(n, device=a.device).unsqueeze(1)).reshape(-1)
        out = b3.new_zeros(n * v, b3.shape[-1])
        return out.index_add_(0, rows, b3.reshape(-1, b3.shape[-1])).view(n, v, -1)

    def weight_ghost_sq(self, a: torch.Tensor, b: torch.Tensor, *, kernel: str = "native"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        del kernel
        ub, sb = row_scale(self._rows(a, b))
        same = (a.unsqueeze(2) == a.unsqueeze(1)).to(ub.dtype)  # [B, T, T]
        gram_b = torch.bmm(ub, ub.transpose(1, 2))
        scale = sb.square()
        return row_sums(gram_b * same) * scale, diagonal_bound(same, gram_b) * scale

    def gram_terms(self, geometry: Geometry) -> int:
        """The input Gram compares token ids: exact."""
        del geometry
        return 1

    def cancellation_bound(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = self._rows(a, b)
        return terms_bound(torch.ones_like(rows[..., :1]), rows)

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        m = self.module
        pad = -1 if m.padding_idx is None else m.padding_idx
        return torch.ops.aten.embedding_dense_backward(
            bc.reshape(-1, bc.shape[-1]), a.reshape(-1), m.num_embeddings, pad, False)


class EmbeddingBagHandler(EmbeddingHandler):
    """``nn.EmbeddingBag`` (``mode`` "sum" or "mean") on ids [B, T], one bag per example: the
    Embedding rules with output-gradient row b_t = b_bag (sum) or b_bag / (positions not
    holding ``padding_idx``) (mean), zero at padding. Offsets (1-D input) and per-sample
    weights are other inputs, so the engine's one-input hook refuses them by name (the exact
    path over the whole model takes such a model); mode "max" takes the exact fallback."""

    kind = "EmbeddingBag"
    batch_anywhere = False

    def _rows(self, ids: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        pad = self.module.padding_idx
        keep = torch.ones(ids.shape, dtype=b.dtype, device=b.device) if pad is None \
            else (ids != pad).to(b.dtype)
        if self.module.mode == "mean":
            keep = keep / keep.sum(dim=1, keepdim=True).clamp_min(1)
        return b.reshape(ids.shape[0], 1, -1) * keep.unsqueeze(-1)

    def weight_sum(self, a: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
        rows = self._rows(a, bc)
        return torch.ops.aten.embedding_dense_backward(
            rows.reshape(-1, rows.shape[-1]), a.reshape(-1), self.module.num_embeddings, -1,
            False)
