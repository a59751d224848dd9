"""References pooled over a study's trials: each trial's audit scored again with every
reference the study's audited trials trained.

Every audited trial trains ``audit.reference_models`` references (4 by default), each on a random
half of the audited candidates, drawn from the trial's own block (``trainables.audit.references
.reference_block``: a digest of its id), while the candidates depend on ``audit.seed`` alone.
So the references of a study's T audited trials are 4T independent online references for the
same candidates, each trained like its own trial. Online LiRA's weak point with few references
is the noise of each candidate's IN and OUT means (with 4 references, two models each); pooled,
a sweep of T trials estimates them from 2T models each at no extra training (Carlini et al.
2022, arXiv 2112.03570, Sec. VI: the attack improves with the number of references up to
about 64). The price: a reference trained with another trial's hyperparameters fits this
trial's distribution less well; ``bench/audit_strength.py`` measures the net on a study whose
trials differ in learning rate, epochs and batch size.

The pooled score is a function of the candidates and of models that never saw the target's
membership labels, so its TPR, FPR, intervals and p-values stay valid: only the attack's
strength depends on how alike the references are. Pooling is deterministic: the same trials
give the same record, whatever order they finished in; a resume or ``dpsweep reaudit`` that adds
trials pools again. Trials pool when they share the study, the plan kind, the candidates and
the signal names; the cells read from the model (the shadow classifier's) keep the trial's own
references. ``audit.share_references = "none"`` keeps every trial's own audit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsweep.core.storage import atomic_write_bytes
from dpsweep.orchestrator.audit.membership import audit_record
from dpsweep.orchestrator.audit.stored import StoredAudit
from dpsweep.trainables.audit.references import AuditSignals

#: The record's entry saying which trials' references an audit pools.
POOLED = "pooled"
#: The peak fields kept from the trial's own audit under ``pooled["own"]``.
OWN_FIELDS = ("n_references", "peak_mia_accuracy", "peak_mia_upper", "peak_layer",
              "peak_attack", "leak_detected", "leak_p_value", "scoring_seconds")


def compatible(a: AuditSignals, b: AuditSignals) -> bool:
    """Whether ``b``'s references can score ``a``'s target: same plan kind, candidates,
    population and signal names."""
    pa, pb = a.plan, b.plan
    return (pa.kind == pb.kind and list(a.target) == list(b.target)
            and np.array_equal(pa.candidates.indices, pb.candidates.indices)
            and np.array_equal(pa.population.indices, pb.population.indices))


def pool_signals(own: AuditSignals, others: Sequence[AuditSignals]) -> AuditSignals:
    """``own``'s target with its references followed by every one of ``others``'."""
    for other in others:
        if not compatible(own, other):
            raise ValueError("pooled signals must share the plan kind, candidates, population "
                             "and signal names")
    every = [own, *others]
    plan = dataclasses.replace(
        own.plan, train_rows=tuple(r for s in every for r in s.plan.train_rows),
        in_mask=np.concatenate([s.plan.in_mask for s in every]),
        population_in_mask=np.concatenate([s.plan.population_in_mask for s in every]))
    names = list(own.target)
    return dataclasses.replace(
        own, plan=plan,
        references={n: np.concatenate([s.references[n] for s in every]) for n in names},
        population_references={n: np.concatenate([s.population_references[n] for s in every])
                               for n in names},
        records=tuple(r for s in every for r in s.records))


def pool_groups(stored: Mapping[str, StoredAudit]) -> dict[str, list[str]]:
    """Per trial id, the trials whose references it pools: itself first, then every other
    compatible one in id order."""
    ids = sorted(stored)
    return {tid: [tid, *(o for o in ids if o != tid
                         and compatible(stored[tid].signals, stored[o].signals))]
            for tid in ids}


def own_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """The trial's own audit (its references alone) in a pooled record: kept from the record
    it replaces, or from that record's own summary when it was pooled already."""
    pooled = record.get(POOLED)
    if isinstance(pooled, Mapping) and isinstance(pooled.get("own"), Mapping):
        return dict(pooled["own"])
    return {k: record.get(k) for k in OWN_FIELDS}


def pooled_record(*, tid: str, group: Sequence[str], stored: Mapping[str, StoredAudit],
                  previous: Mapping[str, Any], alpha: float, scores_out: Path,
                  write: Callable[[Path, bytes], None] = atomic_write_bytes
                  ) -> dict[str, Any]:
    """Trial ``tid``'s audit record scored with the references of every trial in ``group``
    (``tid`` first); ``previous`` is its current record, whose references' list and training
    time stay (what this trial spent) and whose own peak is kept under ``pooled["own"]``."""
    own = stored[tid]
    signals = pool_signals(own.signals, [stored[o].signals for o in group[1:]])
    record = audit_record(signals=signals, model=own.model, alpha=alpha,
                          scores_out=scores_out, trials=len(group), write=write)
    record["references"] = previous.get("references", [])
    record["reference_train_seconds"] = previous.get("reference_train_seconds", 0.0)
    record[POOLED] = {"trials": list(group),
                      "own_references": own.signals.plan.n_references,
                      "own": own_summary(previous)}
    return record


def is_pooled_over(record: Mapping[str, Any], group: Sequence[str]) -> bool:
    """Whether ``record`` is already the audit pooled over exactly ``group``."""
    pooled = record.get(POOLED)
    return isinstance(pooled, Mapping) and list(pooled.get("trials", [])) == list(group)
