"""dpsgd — the baseline: DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy",
arXiv 1607.00133) as Opacus implements it.

Privacy argument: each example's gradient is clipped to L2 norm <= C (flat clipping over all
layers), the clipped gradients are summed and N(0, sigma^2 C^2 I) is added once per Poisson
batch, so every step is the Poisson-subsampled Gaussian mechanism with multiplier sigma, which
the PRV accountant composes over the steps. Nothing is overridden: the base phases are DP-SGD.
"""

from __future__ import annotations

from typing import ClassVar

from dpsweep.trainables.dp.step import DPStep
from dpsweep.trainables.methods import register


@register
class DPSGD(DPStep):
    name: ClassVar[str] = "dpsgd"
    summary: ClassVar[str] = "DP-SGD: flat per-example clipping at C, noise N(0, sigma^2 C^2)"
    citation: ClassVar[str] = ("Abadi et al. 2016, Deep Learning with Differential Privacy, "
                               "arXiv 1607.00133")
