"""dpsgd: lr and C only; the first point is the config's own (DP-SGD has no paper preset)."""

from __future__ import annotations

from search_spaces import SearchSpace, register
from search_spaces.common import CLIP, LR, inside


@register("dpsgd")
def space(*, num_layers: int, lr: float, clip_norm: float) -> SearchSpace:
    del num_layers
    return SearchSpace(method="dpsgd", distributions={"lr": LR, "clip_norm": CLIP},
                       first_point={"lr": inside(lr, LR), "clip_norm": inside(clip_norm, CLIP)})
