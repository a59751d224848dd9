"""dp_adamilg: Adam lr, C and the noise-decay rate k.

k is searched on a grid so every schedule shape is known before the sweep starts and its
sigma_0 is calibrated once up front (a heterogeneous PRV calibration costs seconds to tens of
seconds). alpha is not searched: in the sound modes it cancels when the thresholds are
normalised to C (see the method's docstring), so trials spent on it would be wasted.
Paper (Table 1): k = 0.05 for MNIST/FMNIST, 0.001 for CIFAR; Adam lr 1e-3.
"""

from __future__ import annotations

from optuna.distributions import CategoricalDistribution

from search_spaces import SearchSpace, register
from search_spaces.common import ADAM_LR, CLIP, inside

K_GRID = (0.0, 0.001, 0.01, 0.05, 0.1, 0.2)


@register("dp_adamilg")
def space(*, num_layers: int, lr: float, clip_norm: float) -> SearchSpace:
    del num_layers, lr
    return SearchSpace(
        method="dp_adamilg",
        distributions={"lr": ADAM_LR, "clip_norm": CLIP,
                       "method_params.k": CategoricalDistribution(K_GRID)},
        first_point={"lr": 1e-3, "clip_norm": inside(clip_norm, CLIP),
                     "method_params.k": 0.05},
    )
