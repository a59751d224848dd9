"""dp_psac — per-sample adaptive clipping with a non-monotonic weight.

Xia, Sun, Zhang et al., "Differentially Private Learning with Per-Sample Adaptive Clipping"
(AAAI 2023, arXiv 2212.00328): each example's gradient g_i becomes
C g_i / (||g_i|| + r / (||g_i|| + r)). Unlike automatic clipping's 1 / (||g|| + gamma), the
weight C / (x + r / (x + r)) is not monotone in x = ||g_i||: it rises for x < sqrt(r) - r and
falls after, so tiny gradients (which dominate late in training) are not amplified as much,
which the paper shows reduces the deviation between the expected update and the true gradient.

Privacy argument: ||C g_i / (||g_i|| + r / (||g_i|| + r))|| = C x / (x + r / (x + r)) < C for
every x >= 0 since r / (x + r) > 0, whatever the other examples are, so removing one example
moves the sum by less than C; noise N(0, sigma^2 C^2) per step makes each step the
Poisson-subsampled Gaussian mechanism with multiplier sigma, composed as in DP-SGD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from dpsweep.core.params import Param, ParamSet
from dpsweep.trainables.dp.contract import CLIP, LR, MOMENTUM
from dpsweep.trainables.dp.step import DPStep, example_norms
from dpsweep.trainables.methods import register

if TYPE_CHECKING:
    import torch


#: The weight's shape parameter (searched: search_spaces/dp_psac.py).
R = Param("r", 0.1, "the weight's shape parameter r (the paper's experiments use 0.1)",
          low=0.0, low_open=True, high=100.0, log=True, presets={"paper": 0.1})


@register
class DPPSAC(DPStep):
    name: ClassVar[str] = "dp_psac"
    summary: ClassVar[str] = ("per-sample adaptive clipping with the non-monotonic weight "
                              "C / (||g|| + r / (||g|| + r))")
    citation: ClassVar[str] = ("Xia, Sun, Zhang et al., Differentially Private Learning with "
                               "Per-Sample Adaptive Clipping, AAAI 2023, arXiv 2212.00328")
    argument: ClassVar[str] = (
        "each example's reweighted gradient has norm C x / (x + r / (x + r)) < C for x = "
        "||g_i|| whatever the other examples are; N(0, sigma^2 C^2) per step: the "
        "Poisson-subsampled Gaussian mechanism with multiplier sigma, composed as in DP-SGD.")
    params: ClassVar[ParamSet] = ParamSet.of(
        LR,
        CLIP.replace(doc="scale of the reweighted gradients and of the noise (only lr * C "
                         "matters: C multiplies both)", role="setting"),
        MOMENTUM,
        R,
    )

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """C / (||g_i|| + r / (||g_i|| + r)) for every layer of example i."""
        r = float(self.params["r"])
        total = example_norms(norms)
        factor = self.clip_norm / (total + r / (total + r))
        return factor.unsqueeze(1).expand(-1, self.num_layers)
