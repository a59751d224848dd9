"""Every value a trial stores is classed as covered by its epsilon or not (``reports.store.RECORD``
for privacy.json, ``COLUMNS`` for the results store), and nothing uncovered leaves in an export.

One real trial of every registered method and mode is trained for one epoch into a run directory
(``dpsweep train``'s code, no Ray); its privacy.json and its results row are walked key by key,
so a value stored without a declaration (as the engine's un-noised cancellation count was) fails
here with its path. Planted values show that the walk can fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dpsweep.core import layout
from dpsweep.core.records import PrivacyRecord
from dpsweep.orchestrator.door import check
from dpsweep.orchestrator.release.export import export_from_run
from dpsweep.orchestrator.release.statement import CLIPPING_RECORD_KEYS
from dpsweep.orchestrator.rundir import RunDir
from dpsweep.orchestrator.trial.single import TRIAL_ID, train_single
from dpsweep.reports import store
from dpsweep.trainables.methods import METHODS
from tests.conftest import leaves, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

#: A risk vector given by hand, so that only lm_dpsgd's public mode runs stage 1 (~1 s).
RISK = [0.3, 0.3, 0.4, 0.5]
#: series -> (method, method_params) of every trial walked: each registered method and mode.
SERIES: dict[str, tuple[str, dict[str, Any]]] = {
    "dpsgd": ("dpsgd", {}),
    "dpsgd_lf": ("dpsgd_lf", {}),
    "auto_s": ("auto_s", {}),
    "dp_psac": ("dp_psac", {}),
    "ww_dpsgd": ("ww_dpsgd", {"K": 2}),  # probes within one epoch: trajectories recorded
    "lm_dpsgd:public": ("lm_dpsgd", {"mode": "public"}),
    "lm_dpsgd:lagged": ("lm_dpsgd", {"mode": "lagged", "risk": RISK}),
    "lm_dpsgd:faithful": ("lm_dpsgd", {"mode": "faithful", "risk": RISK}),
    "dp_adamilg:public": ("dp_adamilg", {"mode": "public"}),
    "dp_adamilg:lagged": ("dp_adamilg", {"mode": "lagged"}),
    "dp_adamilg:faithful": ("dp_adamilg", {"mode": "faithful"}),
}
#: Columns the store adds per method hyperparameter (covered: configuration).
HP_PREFIX = "hp_"
#: A value no trial computes, so a search of the exported text cannot hit it by chance.
PLANTED = 918_273
#: Shortest printed number the export's text is searched for (shorter ones recur by chance).
MIN_SHOWN = 6
#: The trial's privacy record in its run directory.
PRIVACY_REL = f"{layout.TRIALS}/{TRIAL_ID}/{layout.PRIVACY}"
#: Statement fields that quote a canary audit given to it: listed there as not covered.
AUDIT_QUOTED = ("audit", "audit_contradicts")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A series' run directory, trained on first use (one epoch of 10 steps, secret noise:
    the engine's plan is measured and recorded)."""
    made: dict[str, Path] = {}

    def run(series: str) -> Path:
        if series not in made:
            method, params = SERIES[series]
            cfg = tiny_config(method=method, epochs=1)
            cfg = dataclasses.replace(cfg, method_params={**cfg.method_params, **params})
            out = tmp_path_factory.mktemp(series.replace(":", "-")) / "run"
            train_single(check(cfg), out=out)
            made[series] = out
        return made[series]
    return run


def _privacy(run: Path) -> dict[str, Any]:
    return json.loads((run / PRIVACY_REL).read_text())


def _row(run: Path) -> dict[str, Any]:
    return store.read_results(run).iloc[0].to_dict()


def _undeclared_columns(row: dict[str, Any]) -> list[str]:
    return [c for c in row if c not in store.COLUMNS and not c.startswith(HP_PREFIX)]


# --------------------------------------------------------------------------------------------
# The walk


def test_every_registered_method_and_mode_is_walked() -> None:
    """A new method or mode brings new record keys: it must be trained here too."""
    registered = {(name, mode.name) for name, cls in METHODS.items() for mode in cls.modes}
    walked = {(method, params.get("mode", "standard")) for method, params in SERIES.values()}
    assert walked == registered


@pytest.mark.parametrize("series", sorted(SERIES))
def test_every_value_of_a_real_record_and_row_is_declared(runs: Callable[[str], Path],
                                                          series: str) -> None:
    run = runs(series)
    record = _privacy(run)
    assert store.undeclared(record) == []
    # the store's walk sees every leaf the tests' own walker sees
    assert {".".join(p) for p in store.record_paths(record)} == {
        path[1:] for path, _ in leaves(record)}
    assert _undeclared_columns(_row(run)) == []


@pytest.mark.parametrize(("where", "path"), [
    ((), "private_count"),
    (("method_record",), "method_record.private_count"),
    (("method_record", "engine_plan", 0), "method_record.engine_plan.private_count"),
    (("ledger", "events", 0), "ledger.events.private_count"),
    (("trajectories",), "trajectories.private_count"),
])
def test_a_planted_private_count_is_caught_with_its_path(
        runs: Callable[[str], Path], where: tuple[str | int, ...], path: str) -> None:
    record = _privacy(runs("dpsgd"))
    target: Any = record
    for key in where:
        target = target[key]
    target["private_count"] = PLANTED
    assert store.undeclared(record) == [path]
    assert path in store.not_covered_in_record(record)


def test_a_planted_column_is_caught(runs: Callable[[str], Path]) -> None:
    row = {**_row(runs("dpsgd")), "private_count": PLANTED}
    assert _undeclared_columns(row) == ["private_count"]


def test_the_engine_cancellation_count_is_not_recorded(runs: Callable[[str], Path]) -> None:
    """It counted private examples without noise (the GPU memory check added 512 more)."""
    assert "cancellation_dropped" not in _privacy(runs("dpsgd"))["method_record"]


# --------------------------------------------------------------------------------------------
# The declaration


def test_every_record_field_and_exported_key_is_declared() -> None:
    for f in dataclasses.fields(PrivacyRecord):
        assert any(p.split(".")[0] == f.name for p in store.RECORD), f.name
    for key in CLIPPING_RECORD_KEYS:  # undeclared, the export would drop it silently
        assert store.record_entry(("method_record", key)) is not None, key
    assert all(stored.why for stored in store.RECORD.values())


def test_private_counts_and_faithful_statistics_are_not_covered() -> None:
    assert not store.RECORD["guard_capped"].covers(dp_valid=True)
    for key in ("final_weights", "thresholds"):
        stored = store.RECORD[f"method_record.{key}"]
        assert stored.covers(dp_valid=True) and not stored.covers(dp_valid=False), key
    assert store.RECORD["method_record.engine_plan.timings_ms.*"].covered


def test_the_trajectories_column_is_as_covered_as_the_record_it_copies() -> None:
    copied = [s for p, s in store.RECORD.items() if p.startswith("trajectories.")]
    assert copied and store.COLUMNS["trajectories"].covered == all(
        s.covered and not s.adaptive for s in copied)


@pytest.mark.parametrize(("series", "uncovered"), [
    ("dpsgd", {"guard_capped"}),
    ("lm_dpsgd:lagged", {"guard_capped"}),
    ("lm_dpsgd:faithful", {"guard_capped", "method_record.final_weights"}),
    ("dp_adamilg:faithful", {"guard_capped", "method_record.thresholds"}),
])
def test_what_a_real_record_holds_uncovered(runs: Callable[[str], Path], series: str,
                                            uncovered: set[str]) -> None:
    assert set(store.not_covered_in_record(_privacy(runs(series)))) == uncovered


# --------------------------------------------------------------------------------------------
# The export


def _planted_copy(run: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of ``run`` whose privacy.json has ``changes``, re-recorded in the manifest (the
    export verifies every file it reads)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    path = copy / PRIVACY_REL
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with RunDir.open(copy, write=True) as opened:
        opened.record([PRIVACY_REL])
    return copy


def _shown(value: Any) -> str | None:
    """How a number would read in the export's text, if it is distinctive enough to search."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    text = str(int(value)) if float(value).is_integer() else repr(float(value))
    return text if math.isfinite(value) and len(text) >= MIN_SHOWN else None


def _assert_nothing_uncovered_leaves(run: Path, out: Path) -> None:
    """No key of an uncovered record value or column names a statement field, and none of
    their distinctive values is in the statement's text."""
    statement = json.loads((out / layout.EXPORT_STATEMENT_JSON).read_text())
    text = (out / layout.EXPORT_STATEMENT_JSON).read_text() + (
        out / layout.EXPORT_STATEMENT_MD).read_text()
    fields = {path.rsplit(".", 1)[-1] for path, _ in leaves(statement)
              if path.split(".")[1] not in AUDIT_QUOTED}
    record, row = _privacy(run), _row(run)
    values = [(path, v) for path, v in leaves(record)
              if path[1:] in store.not_covered_in_record(record)]
    values += [(column, row[column]) for column in store.not_covered()]
    assert values
    for path, value in values:
        assert path.rsplit(".", 1)[-1] not in fields, path
        shown = _shown(value)
        assert shown is None or shown not in text, (path, shown)


def test_an_export_copies_no_uncovered_value(runs: Callable[[str], Path],
                                             tmp_path: Path) -> None:
    run = _planted_copy(runs("dpsgd"), tmp_path, guard_capped=PLANTED)
    out = tmp_path / "release"
    export_from_run(run, trial_id=TRIAL_ID, out=out, allow_degenerate=True)
    _assert_nothing_uncovered_leaves(run, out)
    assert str(PLANTED) not in (out / layout.EXPORT_STATEMENT_JSON).read_text()


@pytest.mark.parametrize(("series", "key", "exported"), [
    ("lm_dpsgd:faithful", "final_weights", False),
    ("dp_adamilg:faithful", "thresholds", False),
    ("lm_dpsgd:lagged", "final_weights", True),  # from released gradients: covered, stated
])
def test_a_faithful_statistic_stays_in_the_run(runs: Callable[[str], Path], tmp_path: Path,
                                               series: str, key: str, exported: bool) -> None:
    """A faithful mode's statistic comes from the private batch without noise: an export made
    with --allow-invalid-dp leaves it out of the statement's clipping."""
    run = runs(series)
    out = tmp_path / "release"
    result = export_from_run(run, trial_id=TRIAL_ID, out=out, allow_invalid_dp=True,
                             allow_degenerate=True)
    assert (key in result.statement.clipping) is exported
    if not exported:
        _assert_nothing_uncovered_leaves(run, out)
