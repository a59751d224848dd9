"""dp_psac: the learning rate and the weight's shape parameter r.

C only scales both the reweighted gradients and the noise, so it is fixed (1) and the step is
searched through lr alone, over the SGD-family step range; r on a log scale around the paper's
0.1.
"""

from __future__ import annotations

from dpsweep.search_spaces import SGD_STEP, Range, Space, register
from dpsweep.trainables.dp.contract import LR
from dpsweep.trainables.methods.dp_psac import DPPSAC, R

SPACE = register(Space(method=DPPSAC, ranges={LR.name: SGD_STEP, R.name: Range(0.01, 1.0)}))
