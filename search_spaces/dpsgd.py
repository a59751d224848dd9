"""dpsgd: the clipping norm C and the effective step lr * C (see the package docstring)."""

from __future__ import annotations

from dpsweep.search_spaces import SGD_CLIP, SGD_STEP, Space, register
from dpsweep.trainables.dp.contract import CLIP
from dpsweep.trainables.methods.dpsgd import DPSGD

SPACE = register(Space(method=DPSGD, ranges={CLIP.name: SGD_CLIP}, step=SGD_STEP))
