"""dpsgd_lf: C, the effective step, the freeze time t_f (fraction of steps) and depth m_f.

Paper (App. D): freeze the first 3 of 5 layers late in training; t_f runs over [0.3, 0.95] of
the steps and m_f over every depth that leaves a layer trainable, [1, L-1], plus 0 (the
method's 'lower half' rule, the paper's default and the first point).
"""

from __future__ import annotations

from dpsweep.search_spaces import SGD_CLIP, SGD_STEP, Range, Space, register
from dpsweep.trainables.dp.contract import CLIP
from dpsweep.trainables.methods.dpsgd_lf import M_F, T_F_FRACTION, DPSGDLayerFreeze

SPACE = register(Space(method=DPSGDLayerFreeze,
                       ranges={CLIP.name: SGD_CLIP, T_F_FRACTION.name: Range(0.3, 0.95)},
                       step=SGD_STEP,
                       per_model=lambda layers: {M_F.name: Range(0, max(1, layers - 1))}))
