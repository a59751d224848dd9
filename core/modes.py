"""Modes as data: where each statistic a method computes comes from, and what that means.

Several methods adapt clipping or weighting from a statistic (layer importances, layer risk,
thresholds, a spectral probe). Whether the accountant's epsilon holds depends only on where
those statistics come from, so a mode is declared as a mapping statistic -> :class:`Source`,
and validity and its reason are *derived* from that declaration, never written by hand:

* ``PUBLIC``   — public data (the public shadow pool): no privacy cost;
* ``RELEASED`` — outputs the accountant already paid for (the noisy gradients, the weights):
  post-processing, no extra cost;
* ``FIXED``    — hyperparameters and schedules fixed before training;
* ``PRIVATE``  — private data without noise: one example can move every other example's
  contribution, so no sensitivity bound holds and the epsilon claim is invalid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class Source(str, Enum):
    PUBLIC = "public data"
    RELEASED = "released outputs (post-processing)"
    FIXED = "fixed before training"
    PRIVATE = "private data without noise"


#: The tag shown wherever a trial's epsilon claim does not hold.
INVALID_TAG = "epsilon claim invalid"


@dataclass(frozen=True)
class Mode:
    """One mode of a method: a name, the source of each statistic, and what it is for."""

    name: str
    sources: Mapping[str, Source] = field(default_factory=dict)
    doc: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", dict(self.sources))

    @property
    def dp_valid(self) -> bool:
        return all(s is not Source.PRIVATE for s in self.sources.values())

    @property
    def private_statistics(self) -> list[str]:
        return [k for k, s in self.sources.items() if s is Source.PRIVATE]

    def validity_reason(self, *, argument: str) -> str:
        """The sentence behind ``dp_valid``: the method's privacy argument, and for each
        statistic where it comes from; or why the claim fails."""
        origins = "; ".join(f"{k}: {s.value}" for k, s in self.sources.items())
        if not self.dp_valid:
            stats = ", ".join(self.private_statistics)
            return (f"{INVALID_TAG}: {stats} computed from private data without noise, so one "
                    f"example changes how every other example is clipped or weighted and no "
                    f"sensitivity bound holds; the reported epsilon is that of the noise "
                    f"multiplier alone ({origins})")
        return f"{argument}" + (f" Statistics: {origins}." if origins else "")
