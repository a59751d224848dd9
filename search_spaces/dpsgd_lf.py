"""dpsgd_lf: lr, C, the freeze time t_f (fraction of steps) and depth m_f in [1, L-1].

Paper (App. D): freeze the first 3 of 5 layers after epoch 4/19/40 of training at epsilon
1/2/3, i.e. late in training; the first point freezes the lower half at 3/4 of the steps.
"""

from __future__ import annotations

from optuna.distributions import FloatDistribution, IntDistribution

from search_spaces import SearchSpace, register
from search_spaces.common import CLIP, LR, inside


@register("dpsgd_lf")
def space(*, num_layers: int, lr: float, clip_norm: float) -> SearchSpace:
    m_f = IntDistribution(1, max(1, num_layers - 1))
    return SearchSpace(
        method="dpsgd_lf",
        distributions={"lr": LR, "clip_norm": CLIP,
                       "method_params.t_f_fraction": FloatDistribution(0.3, 0.95),
                       "method_params.m_f": m_f},
        first_point={"lr": inside(lr, LR), "clip_norm": 1.0,
                     "method_params.t_f_fraction": 0.75,
                     "method_params.m_f": max(1, num_layers // 2)},
    )
