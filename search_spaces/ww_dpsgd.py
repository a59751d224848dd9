"""ww_dpsgd: lr, C_0, controller gain kappa and target tail exponent zeta_star.

Paper defaults (see trainables/methods/ww_dpsgd.py): kappa 0.1 (between its "small" 0.05 and
"large" 0.30), zeta_star 4 (centre of the healthy zone 2-6), C_0 = 1.
"""

from __future__ import annotations

from optuna.distributions import FloatDistribution

from search_spaces import SearchSpace, register
from search_spaces.common import CLIP, LR, inside


@register("ww_dpsgd")
def space(*, num_layers: int, lr: float, clip_norm: float) -> SearchSpace:
    del num_layers, clip_norm
    return SearchSpace(
        method="ww_dpsgd",
        distributions={"lr": LR, "clip_norm": CLIP,
                       "method_params.kappa": FloatDistribution(0.01, 0.5, log=True),
                       "method_params.zeta_star": FloatDistribution(2.0, 6.0)},
        first_point={"lr": inside(lr, LR), "clip_norm": 1.0, "method_params.kappa": 0.1,
                     "method_params.zeta_star": 4.0},
    )
