"""Which layer x attack cells of a membership audit are not scored, and why.

A cell (one attack on one layer's signal or representation) is scored only when its scores
can depend on the target's membership and are finite numbers. The others are kept in the audit
record, each with its reason, and stay out of the peak and of the multiple-testing family:

* ``shared`` — the attack's input is bit-identical in the target and every reference model on
  every example it is read on: the per-example signal (:func:`identical_signals`, candidates and
  population) or the layer's raw output (``ShadowClassifier.identical_layers``). This is what a
  frozen backbone loaded from one weights file gives: its layers compute the same function in
  every model, whatever each trained on, so an attack on them sees nothing of the target's
  training set and is at chance by construction. Calibrated statistics are meaningless there
  (every per-candidate spread over references is zero: LiRA divides a difference of 0 by a
  floored standard deviation, RMIA's ratio is a function of the example alone).
* ``non_finite`` — some scores are NaN or infinite (a non-finite signal value, an overflow).
* ``unscorable`` — the attack refused its input (an error naming why, e.g. scikit-learn
  refusing non-finite features, too few finite reference values for a variance).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from dpsweep.trainables.models.networks import LayeredModel

SCORED = "scored"
SHARED = "shared"
NON_FINITE = "non_finite"
UNSCORABLE = "unscorable"
#: Per-layer status when some but not all of its cells are scored, or none for mixed reasons.
PARTLY_SCORED = "partly_scored"
EXCLUDED = "excluded"
#: The lead of a shared cell's reason: frozen (no trainable parameter in the layer or before
#: it) or merely identical (trainable, yet bit-identical in every model).
SHARED_FROZEN = "frozen and shared with every reference: chance by construction"
SHARED_IDENTICAL = "identical in the target and every reference: chance by construction"


@dataclass(frozen=True)
class Exclusion:
    """One layer x attack cell that is not scored, with its status and reason."""

    layer: str
    index: int
    attack: str
    signal: str
    status: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "index": self.index, "attack": self.attack,
                "signal": self.signal, "status": self.status, "reason": self.reason}


class SignalTable(Protocol):
    """What :func:`identical_signals` reads of an audit's signals
    (``trainables.audit.references.AuditSignals``)."""

    target: Mapping[str, np.ndarray]
    references: Mapping[str, np.ndarray]
    population_target: Mapping[str, np.ndarray]
    population_references: Mapping[str, np.ndarray]


def identical_signals(signals: SignalTable) -> set[str]:
    """Signals whose values are bit-identical (NaN where NaN) in the target and every reference,
    on the candidates and on the population: no attack on them can see membership."""
    same = set()
    for name, own in signals.target.items():
        refs, pop = signals.references[name], signals.population_references[name]
        own_pop = signals.population_target[name]
        if (np.array_equal(refs, np.broadcast_to(own, refs.shape), equal_nan=True)
                and np.array_equal(pop, np.broadcast_to(own_pop, pop.shape), equal_nan=True)):
            same.add(name)
    return same


def frozen_layers(model: LayeredModel) -> set[str]:
    """Layers that neither train nor follow a layer that does: no trainable parameter in them
    or in any earlier layer, and none outside the layers (a root parameter may act anywhere)."""
    owners = model.layer_of_parameter()
    names = model.layer_names
    trains = [False] * len(names)
    for pname, param in model.named_parameters():
        if pname not in owners:
            if param.requires_grad:
                return set()
            continue
        trains[owners[pname]] |= bool(param.requires_grad)
    out: set[str] = set()
    for name, trained in zip(names, trains, strict=True):
        if trained:
            break
        out.add(name)
    return out


def shared_reason(*, frozen: bool, what: str, n_references: int, n_examples: int) -> str:
    """Why a shared cell is chance by construction, with the evidence."""
    lead = SHARED_FROZEN if frozen else SHARED_IDENTICAL
    tail = ("; neither it nor any earlier layer has a trainable parameter" if frozen else "")
    return (f"{lead} ({what} is bit-identical in the target and all {n_references} references "
            f"on the {n_examples} examples compared, so it cannot depend on the target's "
            f"membership{tail})")


def _not_finite(values: np.ndarray) -> tuple[int, int]:
    v = np.asarray(values, dtype=np.float64)
    return int((~np.isfinite(v)).sum()), v.size


def non_finite_reason(scores: np.ndarray, *, what: str,
                      target: np.ndarray | None = None,
                      references: np.ndarray | None = None) -> str:
    """How many scores are not finite, and where the input already was not (``what`` names the
    signal or representation)."""
    s = np.asarray(scores, dtype=np.float64)
    n_nan, n_inf = int(np.isnan(s).sum()), int(np.isinf(s).sum())
    text = f"{n_nan + n_inf} of {s.size} scores are not finite ({n_nan} NaN, {n_inf} infinite)"
    if target is not None and references is not None:
        (bad_t, n_t), (bad_r, n_r) = _not_finite(target), _not_finite(references)
        text += (f"; {what} is not finite at {bad_t} of the target's {n_t} candidates and "
                 f"{bad_r} of the references' {n_r} values")
    return text


def layer_statuses(*, layers: Iterable[tuple[str, int]], scored: Iterable[tuple[str, str]],
                   excluded: Iterable[Exclusion], frozen: set[str]) -> list[dict[str, Any]]:
    """One entry per layer (the output row included): ``status`` ``scored`` (every cell),
    ``shared`` (every cell shared), ``partly_scored`` or ``excluded`` (no cell scored), the
    cell counts, whether it is frozen, and the reasons of its excluded cells."""
    n_scored: dict[str, int] = {}
    for layer, _ in scored:
        n_scored[layer] = n_scored.get(layer, 0) + 1
    dropped: dict[str, list[Exclusion]] = {}
    for e in excluded:
        dropped.setdefault(e.layer, []).append(e)
    out = []
    for layer, index in layers:
        cells = dropped.get(layer, [])
        count = n_scored.get(layer, 0)
        if not cells:
            status = SCORED
        elif count:
            status = PARTLY_SCORED
        elif all(e.status == SHARED for e in cells):
            status = SHARED
        else:
            status = EXCLUDED
        reasons = list(dict.fromkeys(e.reason for e in cells))
        out.append({"layer": layer, "index": index, "status": status, "frozen": layer in frozen,
                    "n_scored": count, "n_excluded": len(cells), "reasons": reasons})
    return out


def absent_peak_reason(statuses: Iterable[Mapping[str, Any]]) -> str:
    """Why an audit has no peak: every layer's status and first reason."""
    parts = [f"{s['layer']}: {s['status']}" + (f" ({s['reasons'][0]})" if s["reasons"] else "")
             for s in statuses]
    return "no layer x attack could be scored; " + "; ".join(parts)
