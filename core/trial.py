"""One trial's plan as every floor reads it: the matched budget and the spec a trial trains from.

The orchestrator plans (it matches the budget, ``orchestrator.accounting``), the trainables
train, and both read the same typed values from here. A plan crosses a process or a file only
as the plain data of ``to_dict`` (Ray's payload, ``spec.json``, a checkpoint, the budget cache)
and is rebuilt once by ``from_dict`` where it arrives; in between no one indexes a dict.

Nothing here imports torch or a method: checking a spec's hyperparameters against its method's
declaration is the training side's (``trainables.training.loop.load_spec``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final

from dpsweep.core.errors import UserInputError
from dpsweep.core.poisson import PHYSICAL_BATCH
from dpsweep.core.schedule import Schedule

#: The calibration's stored form (the budget cache keys on it); bump when the cache's meaning
#: changes, so stale answers are never served.
SCHEMA_VERSION: Final = 2

#: The accountants a calibration may name.
ACCOUNTANTS: Final = ("prv", "rdp")

#: The randomness kind of a replayable trial (``trainables.dp.randomness``): unsafe to release.
REPRODUCIBLE: Final = "reproducible"


@dataclass(frozen=True)
class EpsilonBounds:
    """Epsilon of a schedule; RDP gives only an upper bound, so lower/estimate are None there."""

    lower: float | None
    estimate: float | None
    upper: float
    accountant: str

    def to_dict(self) -> dict[str, Any]:
        return {"lower": self.lower, "estimate": self.estimate, "upper": self.upper,
                "accountant": self.accountant}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EpsilonBounds:
        def opt(v: Any) -> float | None:
            return None if v is None else float(v)

        accountant = str(d["accountant"])
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"unknown accountant {accountant!r}")
        return cls(lower=opt(d["lower"]), estimate=opt(d["estimate"]), upper=float(d["upper"]),
                   accountant=accountant)


@dataclass(frozen=True)
class Calibration:
    """A matched budget: the schedule to train with and the accountant's certificate for it."""

    target_epsilon: float
    delta: float
    sample_rate: float
    schedule: Schedule
    scale: float
    bounds: EpsilonBounds
    accountant: str
    fallback_reason: str | None
    eps_error: float
    seconds: float
    cached: bool

    @property
    def noise_multiplier(self) -> float:
        """The first phase's multiplier: sigma for a constant schedule, sigma_0 for a decay."""
        return self.schedule.first

    @property
    def steps(self) -> int:
        return self.schedule.steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form: what a spec carries and the cache stores."""
        return {
            "schema": SCHEMA_VERSION,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "schedule": self.schedule.to_list(),
            "scale": self.scale,
            "bounds": self.bounds.to_dict(),
            "accountant": self.accountant,
            "fallback_reason": self.fallback_reason,
            "eps_error": self.eps_error,
            "seconds": self.seconds,
            "cached": self.cached,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Calibration:
        """Inverse of to_dict; a malformed dict raises UserInputError(field="calibration")."""
        try:
            schedule = Schedule.from_list(d["schedule"])
            accountant = str(d["accountant"])
            if accountant not in ACCOUNTANTS:
                raise ValueError("accountant must be 'prv' or 'rdp'")
            reason = d["fallback_reason"]
            return cls(
                target_epsilon=float(d["target_epsilon"]),
                delta=float(d["delta"]),
                sample_rate=float(d["sample_rate"]),
                schedule=schedule,
                scale=float(d["scale"]),
                bounds=EpsilonBounds.from_dict(d["bounds"]),
                accountant=accountant,
                fallback_reason=None if reason is None else str(reason),
                eps_error=float(d["eps_error"]),
                seconds=float(d["seconds"]),
                cached=bool(d.get("cached", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError, UserInputError) as exc:
            raise UserInputError(field="calibration", value=f"{type(exc).__name__}: {exc}",
                                 allowed="a dict produced by Calibration.to_dict()") from exc


@dataclass(frozen=True)
class TrialSpec:
    """Everything one trial needs; plain values so Ray can ship it and a checkpoint can pin it.

    ``method_params`` are the method's hyperparameters (its declaration: mode, lr, clip_norm,
    ...), validated where the spec was planned or where it arrives as plain data. ``seed`` fixes
    initialisation and public-batch order only; the noise and the Poisson sampling come from
    ``randomness`` (fresh OS entropy unless reproducible). ``gpu_share`` is the fraction of one
    GPU the trial was given (``resources.gpus_per_trial``, at most 1): on CUDA it caps the
    trial's memory (``trainables.training.placement``). It is written only when below 1, so
    specs stored before it existed still compare equal."""

    method: str
    method_params: Mapping[str, Any]
    epochs: int
    batch_size: int
    calibration: Calibration
    epsilon_curve: list[float]  # accountant's upper epsilon after each epoch
    seed: int = 0
    randomness: str = "secret"
    dataset: str = "digits"
    data_dir: str | None = None
    split_seed: int = 0
    sizes: dict[str, int] | None = None
    model: str = "auto"
    activation: str = "tanh"
    #: A user's network (``ModelSource.to_dict()``) instead of the built-in ``model``.
    user_model: dict[str, Any] | None = None
    #: A user's data (``FileSource.to_dict()``) when ``dataset`` is "file".
    data_source: dict[str, Any] | None = None
    device: str = "auto"
    threads: int = 1
    max_physical_batch: int = PHYSICAL_BATCH
    trial_id: str = "trial"
    extra: dict[str, Any] = field(default_factory=dict)
    gpu_share: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.calibration, Calibration):
            raise TypeError(f"TrialSpec.calibration must be a Calibration, not "
                            f"{type(self.calibration).__name__} (from_dict rebuilds one)")
        share = self.gpu_share
        if isinstance(share, bool) or not isinstance(share, int | float) \
                or not 0.0 < share <= 1.0:
            raise UserInputError(field="resources.gpus_per_trial", value=share,
                                 allowed="a share in (0, 1] of one GPU")

    @property
    def lr(self) -> float:
        return float(self.method_params["lr"])

    @property
    def clip_norm(self) -> float:
        return float(self.method_params["clip_norm"])

    @property
    def mode(self) -> str:
        return str(self.method_params["mode"])

    @property
    def release_safe(self) -> bool:
        return self.randomness != REPRODUCIBLE

    def to_dict(self) -> dict[str, Any]:
        """Plain, mutable data (what Ray ships and ``spec.json`` holds); ``gpu_share`` only
        when below 1 (the class docstring)."""
        d: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "method_params":
                d[f.name] = dict(value)
            elif f.name == "calibration":
                d[f.name] = value.to_dict()
            else:
                d[f.name] = copy.deepcopy(value)
        if self.gpu_share == 1.0:
            del d["gpu_share"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrialSpec:
        """Inverse of :meth:`to_dict`: the calibration is rebuilt here, once."""
        values = dict(d)
        if "calibration" in values:
            values["calibration"] = Calibration.from_dict(values["calibration"])
        return cls(**values)
