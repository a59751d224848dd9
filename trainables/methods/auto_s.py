"""auto_s — automatic clipping, AUTO-S / NSGD: every per-example gradient is normalised.

Bu, Wang, Zha & Karypis, "Automatic Clipping: Differentially Private Deep Learning Made Easier
and Stronger" (arXiv 2206.07136), and the same rule as normalised SGD in Das et al., "Beyond
Uniform Lipschitz Condition in Differentially Private Optimization" (arXiv 2206.10713): each
example's gradient g_i becomes C g_i / (||g_i|| + gamma). There is no clipping threshold to
tune: gamma > 0 (the paper's default 0.01) keeps small gradients from being blown up, and C only
scales both the update and the noise, so lr * C is the one step size that matters.

Privacy argument: ||C g_i / (||g_i|| + gamma)|| = C ||g_i|| / (||g_i|| + gamma) < C for every
example whatever the others are, so removing one example moves the sum by less than C; noise
N(0, sigma^2 C^2) per step makes each step the Poisson-subsampled Gaussian mechanism with
multiplier sigma, composed as in DP-SGD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from dpsweep.core.params import Param, ParamSet
from dpsweep.trainables.dp.contract import CLIP, LR, MOMENTUM
from dpsweep.trainables.dp.step import DPStep, example_norms
from dpsweep.trainables.methods import register

if TYPE_CHECKING:
    import torch


#: The stability constant of the normalisation (searched: search_spaces/auto_s.py).
GAMMA = Param("gamma", 0.01, "stability constant gamma of g / (||g|| + gamma) (the paper's "
              "default 0.01)", low=0.0, low_open=True, high=100.0, log=True,
              presets={"paper": 0.01})


@register
class AutoS(DPStep):
    name: ClassVar[str] = "auto_s"
    summary: ClassVar[str] = ("automatic clipping (AUTO-S / NSGD): every per-example gradient "
                              "normalised to C g / (||g|| + gamma)")
    citation: ClassVar[str] = ("Bu, Wang, Zha & Karypis, Automatic Clipping: Differentially "
                               "Private Deep Learning Made Easier and Stronger, arXiv 2206.07136")
    argument: ClassVar[str] = (
        "each example's normalised gradient C g / (||g|| + gamma) has norm below C whatever the "
        "other examples are; N(0, sigma^2 C^2) per step: the Poisson-subsampled Gaussian "
        "mechanism with multiplier sigma, composed as in DP-SGD.")
    params: ClassVar[ParamSet] = ParamSet.of(
        LR,
        CLIP.replace(doc="scale of the normalised gradients and of the noise (only lr * C "
                         "matters: C multiplies both)", role="setting"),
        MOMENTUM,
        GAMMA,
    )

    def clip_coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        """C / (||g_i|| + gamma) for every layer of example i."""
        total = example_norms(norms)
        factor = self.clip_norm / (total + float(self.params["gamma"]))
        return factor.unsqueeze(1).expand(-1, self.num_layers)
