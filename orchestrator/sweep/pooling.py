"""The sweep's last audit step: each audited trial scored again with the references of every
audited trial of its study (``orchestrator.audit.pooling``), recorded as the audits are.

It runs in the driver after the search and the after-search jobs, and after ``dpsweep
reaudit``'s audits; no model is loaded and nothing trains (scoring only: well under a second per
trial at the defaults). Each trial's signals file is verified against the manifest and against
the plan recomputed from the run's data and configuration before it is read; a trial whose file
fails either keeps its own audit, and a line says why. A pooled record is written through the
run directory's commit (scores first, then ``audit.json``), then the trial's row is amended:
a crash in between leaves files the manifest vouches for, and the next resume pools again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.vocabulary import OK
from dpsweep.orchestrator.audit.membership import (
    AuditSettings,
    reference_plan,
    row_audit_columns,
)
from dpsweep.orchestrator.audit.pooling import is_pooled_over, pool_groups, pooled_record
from dpsweep.orchestrator.audit.stored import SignalsFileError, StoredAudit, read_signals
from dpsweep.orchestrator.sweep.aftersearch import has_audit
from dpsweep.orchestrator.sweep.records import SweepRecords, read_json
from dpsweep.orchestrator.sweep.state import SweepContext
from dpsweep.trainables.audit.references import reference_block
from dpsweep.trainables.data.splits import DataSplits

#: ``audit.share_references`` that pools over a study's trials.
SHARE_STUDY = "study"
#: The prefix of the lines this step prints.
TAG = "[audit pooling]"


def _stored(context: SweepContext, data: DataSplits, settings: AuditSettings,
            tid: str) -> StoredAudit:
    run = context.run
    path = run.verify(f"{layout.TRIALS}/{tid}/{layout.AUDIT_SIGNALS}")
    return read_signals(path, plan=reference_plan(data, settings, block=reference_block(tid)))


def pool_audits(*, context: SweepContext, records: SweepRecords, data: DataSplits,
                quiet: bool) -> int:
    """Pool every study's audited trials (module docstring); how many records changed."""
    cfg = context.cfg
    if not cfg.audit.enabled or cfg.audit.share_references != SHARE_STUDY:
        return 0
    settings = AuditSettings.from_config(cfg.audit)
    by_study: dict[str, list[str]] = {}
    for tid, row in records.rows.items():
        if row["status"] == OK and has_audit(row) and \
                (context.run.trial_dir(tid) / layout.AUDIT_SIGNALS).is_file():
            by_study.setdefault(str(row["study"]), []).append(tid)
    changed = 0
    for ids in by_study.values():
        if len(ids) < 2:
            continue
        stored: dict[str, StoredAudit] = {}
        for tid in sorted(ids):
            try:
                stored[tid] = _stored(context, data, settings, tid)
            except (UserInputError, SignalsFileError) as exc:
                _say(quiet, f"{TAG} {tid}: its own references only ({exc})")
        for tid, group in pool_groups(stored).items():
            if len(group) > 1 and _pool_one(context, records, tid=tid, group=group,
                                            stored=stored, alpha=settings.alpha):
                changed += 1
    if changed:
        _say(quiet, f"{TAG} {changed} audit(s) scored again with their study's references")
    return changed


def _pool_one(context: SweepContext, records: SweepRecords, *, tid: str, group: list[str],
              stored: Mapping[str, StoredAudit], alpha: float) -> bool:
    run = context.run
    trial_dir = run.trial_dir(tid)
    previous = read_json(run.verify(f"{layout.TRIALS}/{tid}/{layout.AUDIT}"))
    if is_pooled_over(previous, group):
        return False
    record = pooled_record(
        tid=tid, group=group, stored=stored, previous=previous, alpha=alpha,
        scores_out=trial_dir / layout.AUDIT_SCORES,
        write=lambda path, blob: run.commit(run.relative(path), blob))
    run.commit(run.relative(trial_dir / layout.AUDIT),
               (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    records.amend(tid, row_audit_columns(record, row=records.rows[tid]))
    return True


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(line, flush=True)

