"""Exit codes (issue 41): a sweep or re-audit in which a trial or an audit failed ends with one
line and ``EXIT_FAILURES``, never 0; the codes are written once (``core.exits``) and every
command reads them there; ``dpsweep reaudit`` chooses its trials as documented and refuses a
trial it must not audit again. No Ray: summaries, rows and a stand-in driver by hand (the real
sweeps and re-audits are ``tests/system/test_reaudit.py``'s).
"""

from __future__ import annotations

import argparse
import math
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dpsweep.core import errors, exits
from dpsweep.core.errors import UserInputError
from dpsweep.core.vocabulary import FAILED, OK, PRUNED
from dpsweep.orchestrator import cli
from dpsweep.orchestrator.sweep import commands, signals
from dpsweep.orchestrator.sweep.driver import SweepSummary
from dpsweep.orchestrator.sweep.reaudit import ReauditSummary, again_hint, chosen_trials
from dpsweep.orchestrator.sweep.records import failed_audits
from dpsweep.orchestrator.sweep.signals import Interrupted

REASON = "UserInputError: scores = 'non-finite values' is not allowed"


def _summary(*, failed: int = 0, audits: dict[str, str] | None = None,
             rows: int = 4) -> SweepSummary:
    return SweepSummary(run_dir=Path("runs/s"), rows=rows, failed=failed, seconds=1.0,
                        report=None, failed_audits=dict(audits or {}))


def test_the_codes_are_distinct_and_every_command_reads_them_from_one_place() -> None:
    codes = [exits.EXIT_OK, exits.EXIT_USAGE, exits.EXIT_FAILURES, exits.EXIT_DISK_FULL,
             exits.EXIT_SIGINT, exits.EXIT_SIGTERM]
    assert len(set(codes)) == len(codes) and 1 not in codes  # 1: Python's traceback
    assert cli.EXIT_USAGE is exits.EXIT_USAGE and cli.EXIT_DISK_FULL is exits.EXIT_DISK_FULL
    assert errors.EXIT_DISK_FULL is exits.EXIT_DISK_FULL
    assert (signals.EXIT_SIGINT, signals.EXIT_SIGTERM) == (exits.EXIT_SIGINT, exits.EXIT_SIGTERM)
    assert exits.outcome_code(trials_failed=0, audits_failed=0) == exits.EXIT_OK


@pytest.mark.parametrize(("failed", "audits", "line"), [
    (0, {"t-001": REASON, "t-000": REASON},
     f"dpsweep: 2 audits failed (t-000: {REASON}; 1 more); the report lists every reason; "
     "`dpsweep reaudit runs/s` audits them again without training"),
    (4, {}, "dpsweep: 4 of 4 trials failed; the report lists every reason"),  # every trial
    (1, {"t-002": REASON}, f"dpsweep: 1 of 4 trials failed, 1 audit failed (t-002: {REASON}); "
                           "the report lists every reason; `dpsweep reaudit runs/s` audits them "
                           "again without training"),
])
def test_a_sweep_with_a_failure_exits_3_with_one_line(
        capsys: pytest.CaptureFixture[str], failed: int, audits: dict[str, str],
        line: str) -> None:
    summary = _summary(failed=failed, audits=audits)
    assert commands.sweep(lambda: summary) == exits.EXIT_FAILURES == summary.exit_code
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_clean_sweep_exits_0_and_says_nothing_more(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.sweep(lambda: _summary()) == exits.EXIT_OK
    assert capsys.readouterr().err == ""


def test_the_summary_line_counts_failed_audits_beside_failed_trials() -> None:
    assert _summary().counts_text() == "4 trials (0 failed)"  # as before: no new words
    assert _summary(audits={f"t{i}": REASON for i in range(4)}).counts_text() == \
        "4 trials (0 failed, 4 audits failed)"
    one = _summary(failed=1, audits={"t1": REASON})
    one.pruned = 2
    assert one.counts_text() == "4 trials (1 failed, 1 audit failed, 2 pruned)"


def test_failed_audits_are_finished_trials_with_a_reason() -> None:
    rows = [{"trial_id": "a", "status": OK, "audit_error": REASON},
            {"trial_id": "b", "status": OK, "audit_error": ""},
            {"trial_id": "c", "status": FAILED, "audit_error": "", "error": "x"},
            {"trial_id": "d", "status": OK, "audit_error": math.nan}]
    assert failed_audits(rows) == {"a": REASON}


def test_a_reaudit_that_fails_again_exits_3_and_an_empty_one_0(
        capsys: pytest.CaptureFixture[str]) -> None:
    again = ReauditSummary(run_dir=Path("r"), audited=["a", "b"], failed_audits={"b": REASON},
                           seconds=1.0, report=None)
    assert commands.sweep(lambda: again) == exits.EXIT_FAILURES
    assert capsys.readouterr().err.splitlines() == [
        f"dpsweep: 1 of 2 audits failed again (b: {REASON}); the report lists every reason"]
    empty = ReauditSummary(run_dir=Path("r"), audited=[], failed_audits={}, seconds=0.0,
                           report=None)
    assert commands.sweep(lambda: empty) == exits.EXIT_OK


def test_an_interrupted_reaudit_names_the_same_command_to_continue(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = argparse.Namespace(run_dir="runs/s", trial=["t-001"], all=False)

    def stopped() -> Any:
        raise Interrupted(signal.SIGINT, tmp_path)

    assert commands.sweep(stopped, again=lambda _run: again_hint(args)) == exits.EXIT_SIGINT
    assert capsys.readouterr().err.splitlines() == [
        "dpsweep: interrupted by SIGINT; the run directory is consistent: continue with "
        "`dpsweep reaudit runs/s --trial t-001`"]


# ---- which trials a re-audit takes -------------------------------------------------------------
AUDITED = '[{"layer": "fc1"}]'


def _driver(scope: list[str]) -> Any:
    """A stand-in for the sweep driver: its rows and the audit's scope."""
    rows = {
        "s-000": {"status": OK, "mia_layers": AUDITED, "peak_mia_accuracy": 0.52},
        "s-001": {"status": OK, "mia_layers": "[]", "audit_error": REASON},
        "s-002": {"status": OK, "mia_layers": "[]", "audit_error": ""},  # never audited
        "s-003": {"status": FAILED, "mia_layers": "[]"},
        "s-004": {"status": PRUNED, "mia_layers": "[]"},
        "nonprivate": {"status": OK, "mia_layers": "[]"},
    }
    return SimpleNamespace(rows=rows, audit_scope=lambda: scope)


def test_by_default_the_scope_without_an_audit_and_all_takes_every_finished_trial() -> None:
    everything = ["nonprivate", "s-000", "s-001", "s-002"]
    assert chosen_trials(_driver(everything), trials=(), every=False) == ["s-001", "s-002"]
    front = ["s-000", "s-001"]  # audit.scope = "front", after the search
    assert chosen_trials(_driver(front), trials=(), every=False) == ["s-001"]
    assert chosen_trials(_driver(front), trials=(), every=True) == ["s-001", "s-002"]
    assert chosen_trials(_driver([]), trials=["s-002", "s-002"], every=False) == ["s-002"]


@pytest.mark.parametrize(("tid", "fragment"), [
    ("s-000", "audit stands, peak MIA accuracy 0.5200"),
    ("s-003", "a finished trial (this one is failed"),
    ("s-004", "a finished trial (this one is pruned"),
    ("nonprivate", "a DP trial (the non-private baseline"),
    ("s-009", "a trial of this run (its results hold 6: nonprivate, s-000, s-001, s-002, "
              "s-003, ...)"),
    ("../x", "letters, digits"),
])
def test_a_trial_that_cannot_be_audited_again_is_refused_naming_it(tid: str,
                                                                    fragment: str) -> None:
    with pytest.raises(UserInputError) as info:
        chosen_trials(_driver([]), trials=[tid], every=False)
    assert repr(tid) in str(info.value) and fragment in str(info.value), str(info.value)
