"""auto_s: the learning rate and the stability constant gamma.

C only scales both the normalised gradients and the noise, so it is fixed (1) and the step is
searched through lr alone, over the SGD-family step range; gamma on a log scale around the
paper's 0.01.
"""

from __future__ import annotations

from dpsweep.search_spaces import SGD_STEP, Range, Space, register
from dpsweep.trainables.dp.contract import LR
from dpsweep.trainables.methods.auto_s import GAMMA, AutoS

SPACE = register(Space(method=AutoS, ranges={LR.name: SGD_STEP, GAMMA.name: Range(1e-3, 1.0)}))
