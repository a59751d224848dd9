"""Accounting events: what a run released, as plain data an accountant can be asked about later.

The records mirror dp_accounting's ``DpEvent`` tree (``PoissonSampledDpEvent`` of a
``GaussianDpEvent``, ``GaussianDpEvent``, ``ComposedDpEvent``, ``RepeatAndSelectDpEvent``, each
with a self-composition count) so that a trial's ledger, a release's privacy statement and a
budget calibration can be checked by an independent accountant long after the run, without
pickles and without importing dp_accounting here (``core`` stays light; the conversion lives in
``orchestrator.accounting.verify``).

``RepeatAndSelect`` is the private hyperparameter-tuning wrapper of Papernot & Steinke,
"Hyperparameter Tuning with Renyi Differential Privacy" (arXiv 2110.03620): the inner event is
run a random number of times (mean ``mean``; Poisson when ``shape`` is None, else the truncated
negative binomial with that shape, 0 being the logarithmic and 1 the geometric law) and only the
best result is released.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dpsweep.core.checks import number, whole
from dpsweep.core.errors import UserInputError

#: Smallest mean number of repetitions dp_accounting's repeat-and-select analysis accepts.
MIN_REPETITION_MEAN = 1.0


@dataclass(frozen=True)
class PoissonSubsampledGaussian:
    """``count`` steps of the Gaussian mechanism on a Poisson sample of rate
    ``sampling_probability`` (noise multiplier = noise std / L2 sensitivity)."""

    sampling_probability: float
    noise_multiplier: float
    count: int = 1

    kind: ClassVar[str] = "poisson_subsampled_gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampling_probability", number(
            self.sampling_probability, field="event.sampling_probability",
            allowed="a number in (0, 1]", low=0.0, low_open=True, high=1.0))
        object.__setattr__(self, "noise_multiplier", number(
            self.noise_multiplier, field="event.noise_multiplier", low=0.0, low_open=True))
        object.__setattr__(self, "count", whole(self.count, field="event.count", low=1))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "sampling_probability": self.sampling_probability,
                "noise_multiplier": self.noise_multiplier, "count": self.count}


@dataclass(frozen=True)
class Gaussian:
    """``count`` releases of the Gaussian mechanism on the whole data set (no sampling)."""

    noise_multiplier: float
    count: int = 1

    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", number(
            self.noise_multiplier, field="event.noise_multiplier", low=0.0, low_open=True))
        object.__setattr__(self, "count", whole(self.count, field="event.count", low=1))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "noise_multiplier": self.noise_multiplier,
                "count": self.count}


@dataclass(frozen=True)
class Composed:
    """The events in sequence (adaptive composition)."""

    events: tuple[Event, ...]

    kind: ClassVar[str] = "composed"

    def __post_init__(self) -> None:
        events = tuple(self.events) if isinstance(self.events, (list, tuple)) else None
        if not events or not all(isinstance(e, EVENT_TYPES) for e in events):
            raise UserInputError(field="event.events", value=repr(self.events)[:200],
                                 allowed="a non-empty sequence of accounting events")
        object.__setattr__(self, "events", events)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "events": [e.to_dict() for e in self.events]}


@dataclass(frozen=True)
class RepeatAndSelect:
    """Run ``event`` a random number of times and release only the best run (arXiv 2110.03620).

    ``shape`` None is the Poisson law (dp_accounting's ``shape=inf``); a number >= 0 is the
    truncated negative binomial with that shape.
    """

    event: Event
    mean: float
    shape: float | None = None

    kind: ClassVar[str] = "repeat_and_select"

    def __post_init__(self) -> None:
        if not isinstance(self.event, EVENT_TYPES):
            raise UserInputError(field="event.event", value=repr(self.event)[:200],
                                 allowed="an accounting event")
        object.__setattr__(self, "mean", number(
            self.mean, field="event.mean", low=MIN_REPETITION_MEAN))
        if self.shape is not None:
            object.__setattr__(self, "shape", number(
                self.shape, field="event.shape",
                allowed="None (Poisson) or a finite number >= 0", low=0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "event": self.event.to_dict(), "mean": self.mean,
                "shape": self.shape}


Event = PoissonSubsampledGaussian | Gaussian | Composed | RepeatAndSelect
EVENT_TYPES: tuple[type, ...] = (PoissonSubsampledGaussian, Gaussian, Composed, RepeatAndSelect)


def event_from_dict(d: Mapping[str, Any]) -> Event:
    """Inverse of ``to_dict``; anything malformed is a UserInputError naming the field."""
    if not isinstance(d, Mapping):
        raise UserInputError(field="event", value=repr(d)[:200],
                             allowed="a mapping produced by an event's to_dict()")
    kind = d.get("kind")
    fields = {k: v for k, v in d.items() if k != "kind"}
    try:
        if kind == PoissonSubsampledGaussian.kind:
            return PoissonSubsampledGaussian(**fields)
        if kind == Gaussian.kind:
            return Gaussian(**fields)
        if kind == Composed.kind:
            items = fields.get("events")
            if set(fields) != {"events"} or not isinstance(items, Sequence):
                raise TypeError("a composed event has exactly one field, a list 'events'")
            return Composed(tuple(event_from_dict(e) for e in items))
        if kind == RepeatAndSelect.kind:
            inner = fields.pop("event", None)
            if inner is None:
                raise TypeError("a repeat-and-select event needs its inner 'event'")
            return RepeatAndSelect(event=event_from_dict(inner), **fields)
    except TypeError as exc:
        raise UserInputError(field="event", value=repr(dict(d))[:200],
                             allowed=f"the fields of a {kind!r} event ({exc})") from None
    raise UserInputError(field="event.kind", value=kind,
                         allowed=f"one of {[t.kind for t in EVENT_TYPES]}")


def events_to_list(events: Sequence[Event]) -> list[dict[str, Any]]:
    """JSON-safe list of events (a ledger)."""
    return [e.to_dict() for e in events]


def events_from_list(items: Sequence[Mapping[str, Any]]) -> list[Event]:
    """Inverse of :func:`events_to_list`."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence):
        raise UserInputError(field="events", value=repr(items)[:200],
                             allowed="a list of event mappings")
    return [event_from_dict(d) for d in items]
