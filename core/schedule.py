"""The one noise-schedule type: phases of consecutive steps at one noise multiplier.

A schedule is what the accountant certifies (absolute multipliers) and what a method asks to be
scaled (a *shape*: relative multipliers the budget matching multiplies by one factor). Trials,
the budget cache, checkpoints and results all store it as a list of
``{"noise_multiplier": float, "steps": int}``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dpsweep.core.errors import UserInputError


@dataclass(frozen=True)
class Phase:
    """``steps`` consecutive steps at noise multiplier ``noise_multiplier``."""

    noise_multiplier: float
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "steps": self.steps}


@dataclass(frozen=True)
class Schedule:
    """An ordered, validated sequence of phases (equal neighbours kept apart only if given so)."""

    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise UserInputError(field="schedule", value=[], allowed="at least one phase")
        for i, p in enumerate(self.phases):
            m = p.noise_multiplier
            ok_m = (not isinstance(m, bool) and isinstance(m, (int, float))
                    and math.isfinite(m) and m > 0)
            try:
                ok_s = not isinstance(p.steps, bool) and operator.index(p.steps) >= 1
            except TypeError:
                ok_s = False
            if not (ok_m and ok_s):
                raise UserInputError(field=f"schedule[{i}]", value=p,
                                     allowed="a phase with noise_multiplier finite > 0 and "
                                             "steps an integer >= 1")

    @classmethod
    def of(cls, phases: Iterable[Phase]) -> Schedule:
        return cls(tuple(phases))

    @classmethod
    def constant(cls, *, noise_multiplier: float, steps: int) -> Schedule:
        return cls((Phase(noise_multiplier=noise_multiplier, steps=steps),))

    @classmethod
    def from_list(cls, items: Sequence[dict[str, Any]]) -> Schedule:
        """Inverse of :meth:`to_list`; malformed input is a UserInputError."""
        try:
            phases = tuple(Phase(noise_multiplier=float(d["noise_multiplier"]),
                                 steps=operator.index(d["steps"])) for d in items)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserInputError(field="schedule", value=repr(items)[:200],
                                 allowed=f"a list of {{noise_multiplier, steps}} ({exc})"
                                 ) from None
        return cls(phases)

    def to_list(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.phases]

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.phases)

    @property
    def first(self) -> float:
        """The first multiplier: sigma of a constant schedule, sigma_0 of a decay."""
        return self.phases[0].noise_multiplier

    def sigma_at(self, step: int) -> float:
        """Multiplier granted to step ``step`` (0-based); beyond the end is an error."""
        for phase in self.phases:
            if step < phase.steps:
                return phase.noise_multiplier
            step -= phase.steps
        raise IndexError("step beyond the schedule: the accountant did not cover it")

    def scaled(self, factor: float) -> Schedule:
        return Schedule(tuple(Phase(noise_multiplier=p.noise_multiplier * factor,
                                    steps=p.steps) for p in self.phases))

    def prefix(self, steps: int) -> Schedule:
        """The first ``steps`` steps (>= 1) of the schedule."""
        out, left = [], steps
        for p in self.phases:
            if left <= 0:
                break
            out.append(Phase(noise_multiplier=p.noise_multiplier, steps=min(p.steps, left)))
            left -= p.steps
        return Schedule(tuple(out))

    def merged(self) -> Schedule:
        """Equal neighbouring multipliers joined: one mechanism per distinct run."""
        out: list[Phase] = []
        for p in self.phases:
            if out and out[-1].noise_multiplier == p.noise_multiplier:
                out[-1] = Phase(noise_multiplier=p.noise_multiplier,
                                steps=out[-1].steps + p.steps)
            else:
                out.append(p)
        return Schedule(tuple(out))
