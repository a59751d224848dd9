"""ww_dpsgd: C_0, the effective step, the controller gain kappa and the target exponent.

kappa on a log scale from 0.02 to 0.5 brackets the paper's 'small' 0.05 and 'large' 0.30
(Table 13); zeta_star over the health zone (2, 6) of Eq. 6-7.
"""

from __future__ import annotations

from dpsweep.search_spaces import SGD_CLIP, SGD_STEP, Range, Space, register
from dpsweep.trainables.dp.contract import CLIP
from dpsweep.trainables.methods.ww_dpsgd import KAPPA, WWDPSGD, ZETA_STAR

SPACE = register(Space(method=WWDPSGD,
                       ranges={CLIP.name: SGD_CLIP, KAPPA.name: Range(0.02, 0.5),
                               ZETA_STAR.name: Range(2.0, 6.0)},
                       step=SGD_STEP))
