"""lm_dpsgd: C, the effective step and the risk emphasis r.

Paper (Table 2): r between 2 and 5 (5 on MNIST, 3 on CIFAR-10; App. E.4 sweeps 1-5); the
range runs r over [1, 6] (r >= 1 keeps the risk ordering meaningful).
"""

from __future__ import annotations

from dpsweep.search_spaces import SGD_CLIP, SGD_STEP, Range, Space, register
from dpsweep.trainables.dp.contract import CLIP
from dpsweep.trainables.methods.lm_dpsgd import LMDPSGD, R

SPACE = register(Space(method=LMDPSGD, ranges={CLIP.name: SGD_CLIP, R.name: Range(1.0, 6.0)},
                       step=SGD_STEP))
