"""Ranges every SGD-family method shares: the learning rate and the clipping norm.

lr 0.01-8 covers DP-SGD practice (Opacus examples 0.1-1; Papernot et al. 2021 and DP-SGD-LF
use 2-4 at batch 2048); C 0.05-5 covers Papernot's 0.1 to the 1-3 of the WW and LF papers.
"""

from __future__ import annotations

from optuna.distributions import FloatDistribution

LR = FloatDistribution(0.01, 8.0, log=True)
CLIP = FloatDistribution(0.05, 5.0, log=True)
ADAM_LR = FloatDistribution(1e-4, 0.1, log=True)


def inside(value: float, dist: FloatDistribution) -> float:
    """Clamp a config default into the range so the first point is always valid."""
    return min(max(value, dist.low), dist.high)
