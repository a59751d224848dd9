"""lm_dpsgd: lr, C and the risk emphasis r.

Paper (Table 2): r between 2 and 5 (5 on MNIST, 3 on CIFAR-10; App. E.4 sweeps 1-5); the
space runs r over [1, 6] as DESIGN.md asks (r >= 1). The first point is the paper's MNIST
row: r 5, C 1, with the config's lr (the paper's eta 0.08 is for its own batch size).
"""

from __future__ import annotations

from optuna.distributions import FloatDistribution

from search_spaces import SearchSpace, register
from search_spaces.common import CLIP, LR, inside


@register("lm_dpsgd")
def space(*, num_layers: int, lr: float, clip_norm: float) -> SearchSpace:
    del num_layers, clip_norm
    return SearchSpace(
        method="lm_dpsgd",
        distributions={"lr": LR, "clip_norm": CLIP,
                       "method_params.r": FloatDistribution(1.0, 6.0)},
        first_point={"lr": inside(lr, LR), "clip_norm": 1.0, "method_params.r": 5.0},
    )
