"""The report's audit parts (reports/html/attacks.py, records.py): the front trials' per-candidate
scores surfaced as mia_scores.parquet exactly as each trial's audit_scores.npz stores them, the
plan statement next to the leakage results, and a corrupt scores file refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from bench.synthetic_run import make_run
from dpsweep.core import layout
from dpsweep.core.errors import UserInputError
from dpsweep.orchestrator.audit.membership import write_scores
from dpsweep.reports.html import build_report
from dpsweep.reports.html.attacks import SCORES_FILE
from dpsweep.trainables.audit.plan_statement import plan_statement

#: Audited candidates per synthetic trial: 5 members then 5 non-members.
N = 10
PLAN = SimpleNamespace(candidates=SimpleNamespace(indices=np.arange(100, 100 + N)),
                       is_member=np.r_[np.ones(N // 2), np.zeros(N // 2)])
STATEMENT = plan_statement(kind="offline", n_references=4)


def _add_scores(run: Path) -> dict[str, np.ndarray]:
    """audit_scores.npz beside every audit.json (one row per recorded cell), and the plan
    statement in the record; returns each trial's score matrix."""
    written = {}
    for audit in sorted((run / layout.TRIALS).glob(f"*/{layout.AUDIT}")):
        record = json.loads(audit.read_text())
        keys = [(c["layer"], c["attack"]) for c in record["attacks"]]
        rng = np.random.default_rng(len(written))
        matrix = rng.normal(size=(len(keys), N)).astype(np.float32)
        record.update(write_scores(audit.parent / layout.AUDIT_SCORES, plan=PLAN, scored={
            k: (matrix[i], {}) for i, k in enumerate(keys)}))
        record["plan_statement"] = STATEMENT
        audit.write_text(json.dumps(record))
        written[audit.parent.name] = matrix
    return written


@pytest.fixture(scope="module")
def run_with_scores(tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, dict[str, np.ndarray]]:
    run = make_run(tmp_path_factory.mktemp("scores"))
    return run, _add_scores(run)


def test_front_trials_scores_are_in_the_report_as_stored(
        run_with_scores: tuple[Path, dict[str, np.ndarray]]) -> None:
    run, written = run_with_scores
    page = build_report(run)
    frame = pd.read_parquet(page.parent / SCORES_FILE)
    trials = set(frame["trial_id"])
    assert trials and trials <= set(written)
    for tid in trials:
        rows = frame[frame["trial_id"] == tid]
        assert rows["pool_index"].tolist() == list(range(100, 100 + N))
        assert rows["is_member"].tolist() == [1] * (N // 2) + [0] * (N // 2)
        record = json.loads((run / layout.TRIALS / tid / layout.AUDIT).read_text())
        for i, cell in enumerate(record["attacks"]):
            column = f"{cell['layer']}/{cell['attack']}"
            assert rows[column].dtype == np.float32
            np.testing.assert_array_equal(rows[column].to_numpy(), written[tid][i])
    text = page.read_text()
    assert "What this audit can see." in text and SCORES_FILE in text
    assert "4 offline references (this plan) reached 0.10 (0.07-0.15)" in text
    leakage = pd.read_csv(page.parent / "leakage.csv")
    assert (leakage.loc[leakage["audited"] > 0, "audit_plan"] == STATEMENT).all()


def test_a_corrupt_scores_file_is_one_user_error(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    _add_scores(run)
    for path in (run / layout.TRIALS).glob(f"*/{layout.AUDIT_SCORES}"):
        path.write_bytes(b"not an npz")
    with pytest.raises(UserInputError) as err:
        build_report(run)
    assert "audit scores" in str(err.value)
    assert not (run / layout.REPORT).exists()  # bad input writes nothing
