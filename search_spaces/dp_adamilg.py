"""dp_adamilg: Adam's learning rate, C and the noise-decay rate k.

Adam normalises the update's scale, so lr and C are searched independently (no effective
step). k is searched on a grid so every schedule shape is known before the sweep starts and its
sigma_0 is calibrated once up front. alpha is not searched: it cancels in the sound modes (its
declaration says it is read only in ``faithful`` mode, so a faithful series searches it).
Paper (Table 1): k = 0.05 for MNIST/FMNIST, 0.001 for CIFAR; Adam lr 1e-3. The paper's runs
are thousands of steps; at the demo's 140 steps lr 1e-3 stays near chance and, with C = 1,
lr 1e-2 reaches 0.73, 2e-2 0.84, 3e-2 0.86 and 5e-2 0.84 (docs/search.md), so lr is searched
over [1.5e-2, 6e-2] (log) and the preset's 1e-3 is clamped to the range's low end as the first
point.
"""

from __future__ import annotations

from dpsweep.search_spaces import SGD_CLIP, Choices, Range, Space, register
from dpsweep.trainables.dp.contract import CLIP, LR
from dpsweep.trainables.methods.dp_adamilg import ALPHA, DPAdamILG, K

#: Decay rates whose schedules are calibrated before the sweep (the paper's two values inside).
K_GRID = (0.0, 0.001, 0.01, 0.05, 0.1, 0.2)

SPACE = register(Space(method=DPAdamILG,
                       ranges={LR.name: Range(1.5e-2, 6e-2), CLIP.name: SGD_CLIP,
                               K.name: Choices(K_GRID), ALPHA.name: Range(0.5, 3.0)}))
