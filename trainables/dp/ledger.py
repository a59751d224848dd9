"""Privacy bookkeeping of a DP step: the ledger of accounting events a trial's steps spent,
and the whitened multiplier each step is entered with.

Every step appends one Poisson-subsampled Gaussian event (in ``core.events``' form) with the
step's *whitened* noise multiplier (noise std over sensitivity, taken per layer where the method
bounds each layer separately); the trial checks the ledger against the calibrated schedule the
accountant certified, so a method cannot silently spend more than it was granted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpsweep.core.errors import UserInputError
from dpsweep.core.events import PoissonSubsampledGaussian

#: A ledger event's keys: those of ``core.events``' Poisson-subsampled Gaussian.
_EVENT_KEYS = tuple(PoissonSubsampledGaussian(sampling_probability=1.0, noise_multiplier=1.0)
                    .to_dict())


def ledger_event(*, sample_rate: float, noise_multiplier: float, count: int = 1
                 ) -> dict[str, Any]:
    """``count`` steps at one multiplier in ``core.events``' form: a finite positive multiplier
    is built (and so checked) as a :class:`PoissonSubsampledGaussian`.

    A step may have a multiplier no accounting event takes, and the ledger must still count it
    so that :func:`trainables.training.loop.verify_ledger` compares every step with the certified
    schedule: inf (no live layer: the step released nothing, and passes) or 0 (no noise on a
    bounded sum: a broken method, which that check refuses; so is a negative or NaN one). Such
    a step gets the same keys, the event of a unit multiplier with its own written in.
    """
    m = float(noise_multiplier)
    if 0.0 < m < math.inf:
        return PoissonSubsampledGaussian(sampling_probability=sample_rate, noise_multiplier=m,
                                         count=count).to_dict()
    return {**PoissonSubsampledGaussian(sampling_probability=sample_rate, noise_multiplier=1.0,
                                        count=count).to_dict(), "noise_multiplier": m}


@dataclass
class Ledger:
    """Serialisable record of accounting events: runs of identical subsampled Gaussian steps,
    each ``PoissonSubsampledGaussian.to_dict()`` (see :func:`ledger_event`)."""

    sample_rate: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, noise_multiplier: float) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and math.isclose(last["noise_multiplier"], noise_multiplier,
                                             rel_tol=1e-9):
            last["count"] += 1
        else:
            self.events.append(ledger_event(sample_rate=self.sample_rate,
                                            noise_multiplier=noise_multiplier))

    @property
    def steps(self) -> int:
        return sum(e["count"] for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "events": [dict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ledger:
        """Inverse of :meth:`to_dict`; every event is rebuilt, so one in any other form (a
        checkpoint written before the ledger used ``core.events``) is refused by name."""
        events = []
        for e in d["events"]:
            if not isinstance(e, Mapping) or e.get("kind") != PoissonSubsampledGaussian.kind \
                    or set(e) != set(_EVENT_KEYS):
                raise UserInputError(field="checkpoint.ledger", value=repr(e)[:200],
                                     allowed=f"events with the keys {_EVENT_KEYS} "
                                             "(core.events.PoissonSubsampledGaussian)")
            events.append(ledger_event(sample_rate=e["sampling_probability"],
                                       noise_multiplier=e["noise_multiplier"], count=e["count"]))
        return cls(sample_rate=float(d["sample_rate"]), events=events)


def whitened_multiplier(*, stds: Sequence[float], layer_bounds: Sequence[float] | None,
                        live: Callable[[], Sequence[bool]],
                        sensitivity: Callable[[], float]) -> float:
    """Noise multiplier of a step as one Gaussian mechanism (what the accountant sees).

    With per-layer bounds C_l and stds s_l, whitening each block by s_l gives unit noise and
    sensitivity sqrt(sum (C_l/s_l)^2); with one global bound C, the adversary puts all of its
    norm in the least-noised live layer, so the multiplier is min s_l / C. ``live`` and
    ``sensitivity`` are the step's own methods, asked only in the global-bound case.
    """
    if layer_bounds is not None:
        total = 0.0
        for c, s in zip(layer_bounds, stds, strict=True):
            if c > 0:
                if s <= 0:
                    return 0.0
                total += (c / s) ** 2
        return math.inf if total == 0 else 1.0 / math.sqrt(total)
    on = [s for s, is_live in zip(stds, live(), strict=True) if is_live]
    return min(on) / sensitivity() if on else math.inf
