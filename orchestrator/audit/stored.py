"""An audit's signals file (``audit_signals.npz``): what its scores are computed from, kept so
that a sweep can score the audit again with more references and without the model.

It holds the target's and its own references' signals on the candidates (and on the population,
for offline plans), the block of references the trial trained, the candidates' pool indices,
the target's layers and frozen layers, and the cells read from the target model itself (the
shadow classifier's, scored or excluded with the reason). It is written once, by the audit, and
never rewritten: ``audit.json`` and ``audit_scores.npz`` are derived from it and may be
(``orchestrator.audit.pooling``).

Reading it trusts nothing: numpy without pickles, a known format tag, every array's dtype and
shape checked against the plan the reader recomputes from the run's data and configuration (the
candidates, the references' membership masks), and the block against the one the trial id
gives. A file that fails any check is refused with one line naming it and what is wrong.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.core.storage import atomic_write_bytes
from dpsweep.trainables.audit.exclusion import Exclusion
from dpsweep.trainables.audit.references import AuditSignals, ReferencePlan

#: The ``format`` entry of the signals file.
SIGNALS_FORMAT = "dpsweep-audit-signals-1"
#: A scored cell: stored scores [N] and the record's metadata of it.
Cell = tuple[np.ndarray, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class ModelCells:
    """What scoring needs of the target model besides the signals: its layers, which of them
    are frozen, and the cells read from the model itself (the shadow classifier's, per layer:
    scored, or excluded with the reason)."""

    layers: tuple[str, ...]
    frozen: frozenset[str]
    shadow: dict[tuple[str, str], Cell]
    shadow_excluded: tuple[Exclusion, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class StoredAudit:
    """A signals file read and verified: the trial's own signals (with the recomputed plan)
    and its model's cells."""

    signals: AuditSignals
    model: ModelCells


class SignalsFileError(ValueError):
    """A signals file that is not what the audit wrote for this plan."""


def _stack(table: dict[str, np.ndarray], names: list[str], shape: tuple[int, ...]) -> np.ndarray:
    if not names:
        return np.zeros((0, *shape))
    return np.stack([np.asarray(table[n], dtype=np.float64) for n in names])


def signals_bytes(*, signals: AuditSignals, model: ModelCells) -> bytes:
    """The signals file's content (compressed npz, no pickles)."""
    plan = signals.plan
    names = list(signals.target)
    n, m, k = len(plan.candidates), len(plan.population), plan.n_references
    keys = list(model.shadow)
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, format=np.array(SIGNALS_FORMAT), kind=np.array(plan.kind),
        block=np.array(plan.block, dtype=np.int64),
        pool_index=np.asarray(plan.candidates.indices, dtype=np.int64),
        names=np.array(names, dtype=str),
        target=_stack(signals.target, names, (n,)),
        references=_stack(signals.references, names, (k, n)),
        population_target=_stack(signals.population_target, names, (m,)),
        population_references=_stack(signals.population_references, names, (k, m)),
        layers=np.array(model.layers, dtype=str),
        frozen=np.array(sorted(model.frozen), dtype=str),
        shadow_layer=np.array([c[0] for c in keys], dtype=str),
        shadow_attack=np.array([c[1] for c in keys], dtype=str),
        shadow_scores=(np.stack([model.shadow[c][0] for c in keys]) if keys
                       else np.zeros((0, n))).astype(np.float64),
        shadow_meta=np.array(json.dumps([model.shadow[c][1] for c in keys])),
        shadow_excluded=np.array(json.dumps([e.to_dict() for e in model.shadow_excluded])))
    return buffer.getvalue()


def write_signals(path: Path, *, signals: AuditSignals, model: ModelCells) -> None:
    atomic_write_bytes(Path(path), signals_bytes(signals=signals, model=model))


def _array(z: Any, key: str, *, kind: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if key not in z.files:
        raise SignalsFileError(f"no '{key}' array")
    a = z[key]
    if a.dtype.kind not in kind:
        raise SignalsFileError(f"'{key}' has dtype {a.dtype}, expected kind {kind!r}")
    if shape is not None and a.shape != shape:
        raise SignalsFileError(f"'{key}' has shape {a.shape}, expected {shape}")
    return a


def _text(z: Any, key: str) -> str:
    return str(_array(z, key, kind="U", shape=()))


def read_signals(path: Path, *, plan: ReferencePlan) -> StoredAudit:
    """The signals file at ``path``, verified against ``plan`` (the plan its trial's audit
    used, recomputed); :class:`SignalsFileError` names what does not match."""
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            return _read(z, plan)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        if isinstance(exc, SignalsFileError):
            raise
        raise SignalsFileError(f"not a readable npz ({type(exc).__name__}: {exc})") from None


def _read(z: Any, plan: ReferencePlan) -> StoredAudit:
    if _text(z, "format") != SIGNALS_FORMAT:
        raise SignalsFileError(f"format is not {SIGNALS_FORMAT!r}")
    if _text(z, "kind") != plan.kind:
        raise SignalsFileError(f"kind {_text(z, 'kind')!r} is not the plan's {plan.kind!r}")
    if int(_array(z, "block", kind="i", shape=())) != plan.block:
        raise SignalsFileError("block is not the one its trial id gives")
    n, m, k = len(plan.candidates), len(plan.population), plan.n_references
    if not np.array_equal(_array(z, "pool_index", kind="i", shape=(n,)),
                          np.asarray(plan.candidates.indices)):
        raise SignalsFileError("its candidates are not the plan's")
    names = [str(x) for x in _array(z, "names", kind="U")]
    s = len(names)
    if len(set(names)) != s:
        raise SignalsFileError("signal names repeat")
    arrays = {key: _array(z, key, kind="f", shape=shape) for key, shape in (
        ("target", (s, n)), ("references", (s, k, n)), ("population_target", (s, m)),
        ("population_references", (s, k, m)))}
    layers = tuple(str(x) for x in _array(z, "layers", kind="U"))
    frozen = frozenset(str(x) for x in _array(z, "frozen", kind="U"))
    shadow_layer = _array(z, "shadow_layer", kind="U")
    c = len(shadow_layer)
    shadow_attack = _array(z, "shadow_attack", kind="U", shape=(c,))
    shadow_scores = _array(z, "shadow_scores", kind="f", shape=(c, n))
    metas = json.loads(_text(z, "shadow_meta"))
    excluded = json.loads(_text(z, "shadow_excluded"))
    if not (isinstance(metas, list) and len(metas) == c and all(isinstance(x, dict)
                                                                 for x in metas)):
        raise SignalsFileError("shadow_meta is not one mapping per shadow cell")
    if not frozen <= set(layers) or not set(map(str, shadow_layer)) <= set(layers):
        raise SignalsFileError("frozen or shadow layers are not among its layers")
    try:
        dropped = tuple(Exclusion(**e) for e in excluded)
    except TypeError:
        raise SignalsFileError("shadow_excluded is not a list of exclusions") from None
    table = {key: {name: a[i] for i, name in enumerate(names)} for key, a in arrays.items()}
    signals = AuditSignals(plan=plan, target=table["target"],
                           population_target=table["population_target"],
                           references=table["references"],
                           population_references=table["population_references"],
                           records=(), target_signal_seconds=0.0)
    shadow = {(str(layer), str(attack)): (np.asarray(shadow_scores[i], dtype=np.float64),
                                          dict(metas[i]))
              for i, (layer, attack) in enumerate(zip(shadow_layer, shadow_attack, strict=True))}
    return StoredAudit(signals=signals, model=ModelCells(
        layers=layers, frozen=frozen, shadow=shadow, shadow_excluded=dropped))
