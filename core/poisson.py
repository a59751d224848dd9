"""The sampling facts every floor shares: the Poisson rate of a batch size, the largest delta
a training set allows, the physical batch.

The accountant is given exactly the rate the loader samples at, so both read it here.
"""

from __future__ import annotations

import math
from typing import Final

#: Examples per forward + backward when a Poisson batch is processed in pieces; the engine,
#: the DP step and the audit's signal passes default to it.
PHYSICAL_BATCH: Final = 512


def steps_per_epoch(*, dataset_size: int, batch_size: int) -> int:
    """Poisson steps in one epoch: ceil(N / B), as Opacus's ``DPDataLoader.from_data_loader``."""
    return math.ceil(dataset_size / batch_size)


def sample_rate(*, dataset_size: int, batch_size: int) -> float:
    """q = 1 / ceil(N / B): the rate the loader samples at and the accountant is given."""
    return 1.0 / steps_per_epoch(dataset_size=dataset_size, batch_size=batch_size)


def poisson_plan(*, dataset_size: int, batch_size: int) -> tuple[float, int]:
    """(sample rate, steps per epoch) for an expected batch size: what the planner calibrates
    for and the loop samples with."""
    return (sample_rate(dataset_size=dataset_size, batch_size=batch_size),
            steps_per_epoch(dataset_size=dataset_size, batch_size=batch_size))


def delta_bound(train_size: int) -> float:
    """delta must stay below 1 / N: a larger delta permits releasing a whole example."""
    return 1.0 / train_size
