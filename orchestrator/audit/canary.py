"""``dpsweep audit RUN_DIR --trial ID``: an empirical epsilon lower bound from one canary run.

The trial's exact configuration (its ``spec.json``, verified against the run's manifest) is
trained once more with m canaries, each IN with probability 1/2 (Steinke, Nasr & Jagielski,
"Privacy Auditing with One (1) Training Run", arXiv 2305.08846; canaries and scores in
``trainables.audit.canaries``, the bound in ``trainables.audit.stats.onerun``). The result goes to
``trials/<id>/canary_audit_<kind>.json`` and into the trial's results row
(``eps_lower_bound``, ``eps_lower_bound_kind``, ``canaries``, ``audit_contradicts``), so the
report and ``export`` show it. The row holds the latest audit of the trial; each kind's file
is kept.

A bound above the claimed epsilon (the row's ``epsilon_upper``) of a trial whose claim is
supposed to hold (``dp_valid``) contradicts the claim at 95% confidence: the method or its
accounting is broken. A bound below the claim proves nothing about its tightness: one run with
m canaries sees only part of the worst case.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.core.layout import CONFIG, RESULTS, TRIALS
from dpsweep.core.storage import atomic_write_json
from dpsweep.orchestrator.config import parse_file
from dpsweep.orchestrator.release.export import CANARY_CONFIDENCE, check_not_baseline
from dpsweep.orchestrator.release.selection import read_selection
from dpsweep.orchestrator.rundir import RunDir, check_trial_id
from dpsweep.reports import store
from dpsweep.trainables.audit.canaries import BLACK_BOX, CANARY_POOL, WHITE_BOX
from dpsweep.trainables.audit.canary_runs import CanaryRun, black_box_run, white_box_run
from dpsweep.trainables.training.loop import load_spec, load_trial_data

#: Canaries of a white-box audit unless ``--canaries`` says otherwise (the paper's m = 1000
#: already bounds epsilon within a few tenths of what perfect guessing allows).
DEFAULT_WHITE_BOX_CANARIES = 1000
#: Black-box canaries by default, capped by the pool they come from (the holdout split: 300
#: examples on digits, 10,000 on Fashion-MNIST by default).
DEFAULT_BLACK_BOX_CANARIES = 1000


@dataclass(frozen=True)
class CanaryAudit:
    """One canary audit of one trial: the bound, the guesses behind it, and the verdict."""

    trial_id: str
    kind: str  # "white-box" or "black-box"
    m: int
    r: int  # guesses made (k_plus IN + k_minus OUT)
    v: int  # correct guesses
    k_plus: int
    k_minus: int
    eps_lower_bound: float
    confidence: float
    delta: float
    epsilon_upper: float  # the trial's claim (its results row)
    dp_valid: bool
    contradicts: bool
    test_accuracy: float  # of the audited re-run (canaries included)
    seconds: float
    audit_file: str  # relative to the run directory

    def to_dict(self) -> dict[str, Any]:
        return {"trial_id": self.trial_id, "kind": self.kind, "m": self.m, "r": self.r,
                "v": self.v, "k_plus": self.k_plus, "k_minus": self.k_minus,
                "eps_lower_bound": self.eps_lower_bound, "confidence": self.confidence,
                "delta": self.delta, "epsilon_upper": self.epsilon_upper,
                "dp_valid": self.dp_valid, "contradicts": self.contradicts,
                "test_accuracy": self.test_accuracy, "seconds": self.seconds,
                "audit_file": self.audit_file}

    def summary(self) -> str:
        """What ``dpsweep audit`` prints."""
        if self.contradicts:
            verdict = (f"CONTRADICTS the claim epsilon <= {self.epsilon_upper:.4g}: the method "
                       "or its accounting is broken")
        elif not self.dp_valid:
            verdict = (f"the trial's mode makes no valid claim (accountant's figure "
                       f"{self.epsilon_upper:.4g})")
        else:
            verdict = (f"consistent with the claim epsilon <= {self.epsilon_upper:.4g} (a lower "
                       "bound, not a measure of tightness)")
        return "\n".join([
            f"canary audit ({self.kind}) of trial {self.trial_id}: m = {self.m} canaries",
            f"  epsilon >= {self.eps_lower_bound:.4f} at {self.confidence:.0%} confidence "
            f"(delta {self.delta:g}; {self.v} of {self.r} guesses correct: "
            f"{self.k_plus} IN, {self.k_minus} OUT)",
            f"  {verdict}",
            f"  audited re-run: test accuracy {self.test_accuracy:.4f}, {self.seconds:.1f} s; "
            f"details in {self.audit_file}",
        ])


def _check_canaries(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserInputError(field="--canaries", value=value, allowed="an integer >= 1")
    return value


def _row(run: RunDir, trial_id: str) -> tuple[list[dict[str, Any]], int]:
    """All rows of the verified results store and the index of the trial's (finished) row."""
    run.verify(RESULTS)
    rows = store.read_results(run.path).to_dict("records")
    for i, row in enumerate(rows):
        if row["trial_id"] == trial_id:
            check_not_baseline(row, trial_id,
                               why="which claims no epsilon for a canary bound to test (its "
                                   "membership audit in the report is its reference)")
            if why := store.unfinished(row):
                raise UserInputError(field="--trial", value=trial_id,
                                     allowed=f"a finished trial ({why})")
            return rows, i
    raise UserInputError(field="--trial", value=trial_id,
                         allowed=f"a trial of this run: {sorted(r['trial_id'] for r in rows)[:10]}")


def _progress(kind: str, m: int, epochs: int, quiet: bool) -> Any:
    if quiet:
        return None

    def report(metrics: dict[str, Any], _ckpt: Any) -> None:
        print(f"canary audit ({kind}, m = {m}): epoch {metrics['epoch']}/{epochs}, validation "
              f"accuracy {metrics['val_accuracy']:.4f}", file=sys.stderr, flush=True)

    return report


def audit_with_canaries(run_dir: Path, *, trial_id: str, canaries: int | None = None,
                        white_box: bool = False, quiet: bool = False) -> CanaryAudit:
    """Re-train trial ``trial_id`` of ``run_dir`` with canaries and record the epsilon bound.

    ``canaries`` is m (default ``DEFAULT_WHITE_BOX_CANARIES``; black-box: the smaller of
    ``DEFAULT_BLACK_BOX_CANARIES`` and the holdout split). Holds the run directory's lock
    throughout; every file read is verified against the manifest first.
    """
    check_trial_id(trial_id)
    m = _check_canaries(canaries)
    kind = WHITE_BOX if white_box else BLACK_BOX
    start = time.perf_counter()
    with RunDir.open(Path(run_dir), write=True) as run:
        rows, index = _row(run, trial_id)
        # the run's records of its selection, verified and consistent, as export reads them
        read_selection(run, frame=store.frame_of(rows), release=False)
        spec_rel = f"{TRIALS}/{trial_id}/spec.json"
        spec = load_spec(json.loads(run.verify(spec_rel).read_text()))
        seed = parse_file(run.verify(CONFIG)).audit.seed
        data = load_trial_data(spec)
        if m is None:
            m = (DEFAULT_WHITE_BOX_CANARIES if white_box else
                 min(DEFAULT_BLACK_BOX_CANARIES, len(getattr(data, CANARY_POOL))))
        run_canaries = white_box_run if white_box else black_box_run
        result = run_canaries(spec, m=m, seed=seed, data=data,
                              report=_progress(kind, m, spec.epochs, quiet))
        audit = _record(run, rows=rows, index=index, result=result,
                        seconds=time.perf_counter() - start)
    return audit


def _record(run: RunDir, *, rows: list[dict[str, Any]], index: int, result: CanaryRun,
            seconds: float) -> CanaryAudit:
    """Write the audit file, update the trial's row, record both in the manifest."""
    row = rows[index]
    trial_id = str(row["trial_id"])
    bound = result.bound(confidence=CANARY_CONFIDENCE)
    claim = float(row["epsilon_upper"])
    dp_valid = bool(row["dp_valid"])
    contradicts = dp_valid and math.isfinite(claim) and bound.epsilon_lower > claim
    mia_lower = float(row.get("mia_epsilon_lower") or math.nan)
    flagged = contradicts or (dp_valid and math.isfinite(mia_lower) and mia_lower > claim)
    rel = f"{TRIALS}/{trial_id}/{layout.CANARY_AUDIT.format(kind=result.kind)}"
    best = bound.best
    audit = CanaryAudit(
        trial_id=trial_id, kind=result.kind, m=result.m, r=best.r, v=best.v,
        k_plus=best.k_plus, k_minus=best.k_minus, eps_lower_bound=bound.epsilon_lower,
        confidence=CANARY_CONFIDENCE, delta=result.delta, epsilon_upper=claim,
        dp_valid=dp_valid, contradicts=contradicts, test_accuracy=result.test_accuracy,
        seconds=seconds, audit_file=rel)
    atomic_write_json(run.path / rel, {
        "audit": audit.to_dict(), "bound": bound.to_dict(), "run": result.to_dict(),
        "paper": "Steinke, Nasr & Jagielski, Privacy Auditing with One (1) Training Run, "
                 "arXiv 2305.08846"})
    row.update({"eps_lower_bound": bound.epsilon_lower, "eps_lower_bound_kind": result.kind,
                "canaries": result.m, "audit_contradicts": flagged})
    run.commit(RESULTS, store.results_bytes(rows), also=[rel])
    return audit
