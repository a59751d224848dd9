"""dpsgd_lf — DP-SGD with layer freezing ("DP-SGD-LF: Improving Utility under Differentially
Private Learning via Layer Freezing", anonymous submission under double-blind review; no arXiv
id).

Plain DP-SGD until step t_f; from then on the first m_f layers (from the input) are frozen:
their gradients are not computed (equivalently zeroed before clipping), they receive no noise
and no update, so their weights stay bit-identical. The remaining layers share the whole
clipping budget C, which is the paper's point (less clipping bias and relative noise for them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from dpsweep.core.errors import UserInputError
from dpsweep.core.modes import Mode, Source
from dpsweep.core.params import Param, ParamSet
from dpsweep.trainables.dp.contract import CLIP, LR, MOMENTUM
from dpsweep.trainables.dp.step import DPStep
from dpsweep.trainables.methods import register

#: The freeze time (searched: search_spaces/dpsgd_lf.py).
T_F_FRACTION = Param("t_f_fraction", 0.75, "freeze time t_f as a fraction of the total steps (the "
                     "record stores the resolved step); the paper freezes late", low=0.0, high=1.0,
                     presets={"paper": 0.75})
#: The frozen layers (searched per model: search_spaces/dpsgd_lf.py).
M_F = Param("m_f", 0, "layers frozen from the input; 0 = the lower half, floor(L/2) (paper)",
            low=0, presets={"paper": 0})


@register
class DPSGDLayerFreeze(DPStep):
    name: ClassVar[str] = "dpsgd_lf"
    summary: ClassVar[str] = ("DP-SGD that freezes the first m_f layers from step t_f (no "
                              "gradient, noise or update)")
    citation: ClassVar[str] = ("DP-SGD-LF: Improving Utility under Differentially Private "
                               "Learning via Layer Freezing (anonymous, under review)")
    argument: ClassVar[str] = (
        "at every step each example's contribution is clipped to L2 norm <= C over the live "
        "layers and N(0, sigma^2 C^2) is added to every live coordinate; frozen coordinates are "
        "released as constants that do not depend on the data, so every step is DP-SGD's "
        "Poisson-subsampled Gaussian mechanism with multiplier sigma.")
    modes: ClassVar[tuple[Mode, ...]] = (
        Mode("standard", {"freeze time t_f and depth m_f": Source.FIXED}),)
    params: ClassVar[ParamSet] = ParamSet.of(
        # Paper (App. D, FashionMNIST 5-layer CNN): C = 1.0, eta = 4.0 at batch 2048, first 3
        # of 5 layers frozen after epoch 4 / 19 / 40 for epsilon 1 / 2 / 3; with other batch
        # sizes the epoch counts do not transfer, so the preset keeps C and the depth rule and
        # freezes at 3/4 of the steps.
        LR, CLIP.replace(presets={"paper": 1.0}), MOMENTUM,
        T_F_FRACTION,
        M_F,
    )
    fast_lifecycle: ClassVar[dict[str, Any]] = {"t_f_fraction": 0.5}
    #: One layer frozen from t_f on and one still training.
    min_trained_layers: ClassVar[int] = 2

    @classmethod
    def check_setting(cls, params: Mapping[str, Any], *, num_layers: int,
                      sizes: Mapping[str, int]) -> None:
        m_f = int(params["m_f"])
        if m_f > num_layers - 1:
            raise UserInputError(field="method_params.m_f", value=m_f,
                                 allowed=f"an integer in [0, {num_layers - 1}] for a "
                                         f"{num_layers}-layer model (0 = lower half)")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        layers = self.num_layers
        m_f = int(self.params["m_f"]) or layers // 2
        if not 1 <= m_f <= layers - 1:
            raise UserInputError(field="method_params.m_f", value=self.params["m_f"],
                                 allowed=f"an integer in [1, {layers - 1}] for a {layers}-layer "
                                         "model (0 = lower half)")
        self.m_f = m_f
        self.t_f = round(float(self.params["t_f_fraction"]) * self.total_steps)

    def trainable_layers(self) -> list[bool]:
        frozen = self.step_count >= self.t_f
        return [not (frozen and layer < self.m_f) for layer in range(self.num_layers)]

    def extra_record(self) -> dict[str, Any]:
        return {"t_f": self.t_f, "t_f_fraction": float(self.params["t_f_fraction"]),
                "m_f": self.m_f, "frozen_layers": self.model.layer_names[: self.m_f]}

    def epoch_metrics(self) -> dict[str, float]:
        return {**super().epoch_metrics(),
                "frozen_layers": float(sum(not x for x in self.trainable_layers()))}
